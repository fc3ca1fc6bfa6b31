"""The destructive-batch quorum primitives: Merkle tree, approvals counted per distinct key, scope proofs.

Covers DLV-QRM-01 (enough signatures of distinct approver keys over a scope whose proof proves the
command's (subject, kind)), DLV-ACK-13 (any refusal here is BATCH_UNAPPROVED for the caller), DLV-SIG-11
(a leaf is bound to its payload).
"""

from __future__ import annotations

import datetime
import hashlib

import pytest
from bcd_shared.pki import (
    ApprovedScope,
    Approver,
    BadScopeProof,
    KeyPair,
    MalformedQuorumInput,
    Purpose,
    QuorumNotMet,
    ScopeExpired,
    ScopeMismatch,
    TrustBundle,
    WrongPurpose,
    admit_batched_command,
    approve,
    build_batch,
    inclusion_path,
    merkle_root,
    verify_batch_approval,
    verify_inclusion,
    verify_scope_proof,
    verify_signature,
)
from bcd_shared.pki.quorum import leaf_hash, node_hash
from bcd_shared.wire import ApproverSignature, BatchApproval, BatchLeaf
from hypothesis import given, settings
from hypothesis import strategies as st
from pkifixture import NOW

K1, K2, K3 = (KeyPair(bytes([i]) * 32) for i in (11, 12, 13))
APPROVERS = (
    Approver("alice", K1.public_key),
    Approver("bob", K2.public_key),
    Approver("carol", K3.public_key),
)
BUNDLE = TrustBundle(version=1, approvers=APPROVERS, approvals_required=2)
NOW_MS = int(NOW.timestamp() * 1000)


def _payload(i: int) -> bytes:
    return f"payload-{i}".encode()


def _leaf(i: int, subject: str = "node-1", kind: str = "gpu.reset") -> BatchLeaf:
    return BatchLeaf(
        subject=subject, kind=kind, payload_sha256=hashlib.sha256(_payload(i)).digest(), command_id=f"cmd-{i}"
    )


LEAVES = [_leaf(0), _leaf(1, kind="node.reboot"), _leaf(2, subject="node-2"), _leaf(3), _leaf(4)]
BATCH = build_batch("batch-7", LEAVES, description="reset GPUs in rack 7", not_after_ms=NOW_MS + 3_600_000)


# --- the tree -------------------------------------------------------------------------------------


def test_rfc9162_tree_shape_for_small_batches() -> None:
    a, b, c = b"a", b"b", b"c"
    assert merkle_root([a]) == leaf_hash(a)
    assert merkle_root([a, b]) == node_hash(leaf_hash(a), leaf_hash(b))
    assert merkle_root([a, b, c]) == node_hash(node_hash(leaf_hash(a), leaf_hash(b)), leaf_hash(c))
    assert inclusion_path([a, b, c], 2) == [node_hash(leaf_hash(a), leaf_hash(b))]
    with pytest.raises(MalformedQuorumInput):
        merkle_root([])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(max_size=8), min_size=1, max_size=40, unique=True), st.data())
def test_every_leaf_proves_only_at_its_own_index(leaves: list[bytes], data: st.DataObject) -> None:
    root = merkle_root(leaves)
    index = data.draw(st.integers(0, len(leaves) - 1))
    path = inclusion_path(leaves, index)
    verify_inclusion(leaves[index], index, path, len(leaves), root)
    with pytest.raises(BadScopeProof):
        verify_inclusion(leaves[index] + b"x", index, path, len(leaves), root)
    with pytest.raises(BadScopeProof):
        verify_inclusion(leaves[index], index, [*path, bytes(32)], len(leaves), root)
    other = data.draw(st.integers(0, len(leaves) - 1))
    if other != index:
        with pytest.raises(BadScopeProof):
            verify_inclusion(leaves[index], other, path, len(leaves), root)


# --- approvals ------------------------------------------------------------------------------------


def _sigs(*pairs: tuple[KeyPair, str]) -> list[tuple[str, bytes]]:
    return [(key_id, key.sign(Purpose.BATCH_APPROVAL, BATCH.scope)) for key, key_id in pairs]


def test_DLV_QRM_01_two_distinct_approvers_admit() -> None:
    approved = verify_batch_approval(BATCH.scope, _sigs((K1, "alice"), (K2, "bob")), APPROVERS, 2, NOW)
    assert approved.batch_id == "batch-7"
    assert approved.approved_by == {"alice", "bob"}
    assert approved.leaf_count == 5


def test_DLV_QRM_01_approver_counted_once_per_distinct_key() -> None:
    # The same key signing twice counts once.
    with pytest.raises(
        QuorumNotMet, match=r"1 distinct approver key\(s\) signed, 2 required.*repeats the key"
    ):
        verify_batch_approval(BATCH.scope, _sigs((K1, "alice"), (K1, "alice")), APPROVERS, 2, NOW)
    # Two key ids for one public key count once too.
    aliased = (*APPROVERS, Approver("alice-again", K1.public_key))
    with pytest.raises(QuorumNotMet, match="'alice-again' repeats the key of 'alice'"):
        verify_batch_approval(BATCH.scope, _sigs((K1, "alice"), (K1, "alice-again")), aliased, 2, NOW)


APPROVAL_REFUSALS = [
    ("one approval", lambda: _sigs((K1, "alice")), "1 distinct"),
    ("none", lambda: [], "0 distinct"),
    (
        "unknown key id",
        lambda: _sigs((K1, "alice"), (KeyPair.generate(), "mallory")),
        "unknown key id 'mallory'",
    ),
    ("key id of another approver", lambda: _sigs((K1, "alice"), (K3, "bob")), "'bob': bad-signature"),
    (
        "signature under another purpose",
        lambda: [*_sigs((K1, "alice")), ("bob", K2.sign(Purpose.COMMAND, BATCH.scope))],
        "'bob': wrong-purpose",
    ),
    (
        "truncated signature",
        lambda: [*_sigs((K1, "alice")), ("bob", _sigs((K2, "bob"))[0][1][:40])],
        "truncated",
    ),
]


@pytest.mark.parametrize(("case", "sigs", "text"), APPROVAL_REFUSALS, ids=[c[0] for c in APPROVAL_REFUSALS])
def test_DLV_QRM_01_approval_refusals(case: str, sigs: object, text: str) -> None:
    with pytest.raises(QuorumNotMet, match=text):
        verify_batch_approval(BATCH.scope, sigs(), APPROVERS, 2, NOW)  # type: ignore[operator]


def test_scope_expiry_and_shape() -> None:
    later = NOW + datetime.timedelta(hours=2)
    with pytest.raises(ScopeExpired, match="batch 'batch-7'"):
        verify_batch_approval(BATCH.scope, _sigs((K1, "alice"), (K2, "bob")), APPROVERS, 2, later)
    with pytest.raises(MalformedQuorumInput, match="unknown field"):
        verify_batch_approval(BATCH.scope + b"\x50\x01", [], APPROVERS, 2, NOW)
    with pytest.raises(WrongPurpose):
        # The approval is a real signature, but not of the scope under batch-approval.
        verify_signature(
            K1.public_key, Purpose.BATCH_APPROVAL, BATCH.scope, K1.sign(Purpose.COMMAND, BATCH.scope)
        )


# --- scope proofs ---------------------------------------------------------------------------------


def _approved() -> ApprovedScope:
    return verify_batch_approval(BATCH.scope, _sigs((K1, "alice"), (K2, "bob")), APPROVERS, 2, NOW)


def test_DLV_QRM_01_proof_admits_its_own_leaf() -> None:
    for index in range(len(LEAVES)):
        proof = BATCH.proof(index)
        leaf = LEAVES[index]
        proven = verify_scope_proof(
            _approved(),
            proof.leaf,
            proof.leaf_index,
            proof.path,
            command_id=leaf.command_id,
            subject=leaf.subject,
            kind=leaf.kind,
            payload_sha256=leaf.payload_sha256,
        )
        assert proven.leaf_index == index
        assert proven.leaf_id == hashlib.sha256(b"\x00" + proof.leaf).hexdigest()


PROOF_REFUSALS = [
    (
        "another kind",
        dict(kind="node.reboot"),
        ScopeMismatch,
        r"\('node-1', 'gpu.reset'\), the command is \('node-1', 'node.reboot'\)",
    ),
    ("another subject", dict(subject="node-2"), ScopeMismatch, "the command is \\('node-2', 'gpu.reset'\\)"),
    (
        "another payload",
        dict(payload_sha256=hashlib.sha256(b"other").digest()),
        ScopeMismatch,
        "another payload",
    ),
    ("another command id", dict(command_id="cmd-9"), ScopeMismatch, "admits command 'cmd-0', not 'cmd-9'"),
]


@pytest.mark.parametrize(
    ("case", "change", "error", "text"), PROOF_REFUSALS, ids=[c[0] for c in PROOF_REFUSALS]
)
def test_DLV_QRM_01_proof_for_another_subject_kind_is_refused(
    case: str, change: dict[str, object], error: type[Exception], text: str
) -> None:
    proof = BATCH.proof(0)
    fields: dict[str, object] = {
        "command_id": "cmd-0",
        "subject": "node-1",
        "kind": "gpu.reset",
        "payload_sha256": LEAVES[0].payload_sha256,
        **change,
    }
    with pytest.raises(error, match=text):
        verify_scope_proof(_approved(), proof.leaf, proof.leaf_index, proof.path, **fields)  # type: ignore[arg-type]


def test_tampered_proofs_are_refused() -> None:
    proof = BATCH.proof(1)
    kw = {
        "command_id": "cmd-1",
        "subject": "node-1",
        "kind": "node.reboot",
        "payload_sha256": LEAVES[1].payload_sha256,
    }
    approved = _approved()
    # A leaf of another batch (here: the same leaf claiming another index).
    with pytest.raises(BadScopeProof, match="does not lead"):
        verify_scope_proof(approved, proof.leaf, 0, proof.path, **kw)  # type: ignore[arg-type]
    with pytest.raises(BadScopeProof, match="outside a batch of 5"):
        verify_scope_proof(approved, proof.leaf, 5, proof.path, **kw)  # type: ignore[arg-type]
    bad_path = [bytes(32), *proof.path[1:]]
    with pytest.raises(BadScopeProof, match="does not lead"):
        verify_scope_proof(approved, proof.leaf, 1, bad_path, **kw)  # type: ignore[arg-type]
    with pytest.raises(BadScopeProof, match="shorter"):
        verify_scope_proof(approved, proof.leaf, 1, proof.path[:-1], **kw)  # type: ignore[arg-type]
    with pytest.raises(BadScopeProof, match="32 bytes"):
        verify_scope_proof(approved, proof.leaf, 1, [p[:31] for p in proof.path], **kw)  # type: ignore[arg-type]
    # A leaf a gateway made up for its own (subject, kind) is not in the approved tree.
    forged = bytes(_leaf(1, subject="node-1", kind="disk.wipe"))
    with pytest.raises(BadScopeProof):
        verify_scope_proof(approved, forged, 1, proof.path, **kw)  # type: ignore[arg-type]


def test_DLV_ACK_13_admit_batched_command_end_to_end() -> None:
    approval = BatchApproval(
        scope=BATCH.scope, signatures=[approve(K1, "alice", BATCH.scope), approve(K3, "carol", BATCH.scope)]
    )
    kw = {"command_id": "cmd-3", "subject": "node-1", "kind": "gpu.reset", "payload": _payload(3)}
    proven = admit_batched_command(approval, BATCH.proof(3), BUNDLE, NOW, batch_id="batch-7", **kw)  # type: ignore[arg-type]
    assert proven.batch_id == "batch-7" and proven.leaf.command_id == "cmd-3"
    with pytest.raises(ScopeMismatch, match="approval is for batch 'batch-7', the command is in 'batch-8'"):
        admit_batched_command(approval, BATCH.proof(3), BUNDLE, NOW, batch_id="batch-8", **kw)  # type: ignore[arg-type]
    with pytest.raises(ScopeMismatch, match="another payload"):
        admit_batched_command(
            approval, BATCH.proof(3), BUNDLE, NOW, batch_id="batch-7", **{**kw, "payload": b"x"}
        )  # type: ignore[arg-type]
    single = BatchApproval(scope=BATCH.scope, signatures=[approve(K1, "alice", BATCH.scope)] * 3)
    with pytest.raises(QuorumNotMet):
        admit_batched_command(single, BATCH.proof(3), BUNDLE, NOW, batch_id="batch-7", **kw)  # type: ignore[arg-type]
    stolen = BatchApproval(
        scope=BATCH.scope, signatures=[ApproverSignature(key_id="alice", signature=b"\x00" * 64)]
    )
    with pytest.raises(QuorumNotMet, match="'alice': bad-signature"):
        admit_batched_command(stolen, BATCH.proof(3), BUNDLE, NOW, batch_id="batch-7", **kw)  # type: ignore[arg-type]
