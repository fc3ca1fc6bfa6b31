"""The destructive-batch quorum (DLV-QRM-01): approvals over a batch scope, and a command's scope proof.

Layouts (docs/pki.md, "Quorum"):
- A batch is an ordered list of leaves; each leaf is a serialized `BatchLeaf{subject, kind, payload_sha256,
  command_id}`, hashed exactly as sent. The tree is RFC 9162's (Certificate Transparency v2):
  leaf hash = SHA-256(0x00 || leaf bytes), node hash = SHA-256(0x01 || left || right), split at the largest
  power of two below the leaf count. `merkle_root`, `inclusion_path` build it; `verify_inclusion` checks a
  proof (`BatchProof{leaf, leaf_index, path}`: siblings from the leaf up).
- The scope is a serialized `BatchScope{batch_id, merkle_root, leaf_count, description, not_after}`; each
  approver signs its exact bytes under purpose `batch-approval` (`BatchApproval{scope, signatures}`, each
  signature naming its approver by `key_id` from the trust bundle).
- `verify_batch_approval` counts a signature once per DISTINCT approver public key (two key ids listing the
  same key, or the same key signing twice, count once); unknown key ids and bad signatures count nothing.
  Fewer than `approvals_required` is QuorumNotMet, naming what was and was not counted.
- `verify_scope_proof` proves that this command's leaf (subject, kind, payload hash, command id) is in the
  approved tree. A proof for another (subject, kind) is ScopeMismatch.
Pure functions; `now` is a parameter.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from typing import Final

import attrs

from bcd_shared.pki._wire import decode
from bcd_shared.pki.bundle import Approver, TrustBundle
from bcd_shared.pki.errors import (
    BadScopeProof,
    MalformedQuorumInput,
    PkiError,
    QuorumNotMet,
    ScopeExpired,
    ScopeMismatch,
)
from bcd_shared.pki.signing import KeyPair, Purpose, verify_signature
from bcd_shared.wire import ApproverSignature, BatchApproval, BatchLeaf, BatchProof, BatchScope

HASH_LENGTH: Final = 32
MAX_LEAVES: Final = 1 << 20
MAX_PATH: Final = 20  # ceil(log2(MAX_LEAVES))


def leaf_hash(leaf: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly below n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def _root_of_hashes(hashes: Sequence[bytes]) -> bytes:
    if len(hashes) == 1:
        return hashes[0]
    k = _split(len(hashes))
    return node_hash(_root_of_hashes(hashes[:k]), _root_of_hashes(hashes[k:]))


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """The RFC 9162 Merkle tree hash over the leaves' exact bytes (at least one leaf)."""
    if not 1 <= len(leaves) <= MAX_LEAVES:
        raise MalformedQuorumInput(f"a batch has 1 to {MAX_LEAVES} leaves, got {len(leaves)}")
    return _root_of_hashes([leaf_hash(leaf) for leaf in leaves])


def _path(index: int, hashes: Sequence[bytes]) -> list[bytes]:
    if len(hashes) == 1:
        return []
    k = _split(len(hashes))
    if index < k:
        return [*_path(index, hashes[:k]), _root_of_hashes(hashes[k:])]
    return [*_path(index - k, hashes[k:]), _root_of_hashes(hashes[:k])]


def inclusion_path(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """The audit path of leaf `index`: sibling hashes from the leaf up to (excluding) the root."""
    if not 0 <= index < len(leaves):
        raise MalformedQuorumInput(f"leaf index {index} outside a batch of {len(leaves)}")
    return _path(index, [leaf_hash(leaf) for leaf in leaves])


def verify_inclusion(leaf: bytes, index: int, path: Sequence[bytes], leaf_count: int, root: bytes) -> None:
    """RFC 9162 section 2.1.3.2; raises BadScopeProof unless `leaf` sits at `index` of the tree `root`."""
    if not 0 <= index < leaf_count:
        raise BadScopeProof(f"leaf index {index} outside a batch of {leaf_count} leaves")
    if len(path) > MAX_PATH or any(len(p) != HASH_LENGTH for p in path):
        raise BadScopeProof(f"path must be at most {MAX_PATH} hashes of {HASH_LENGTH} bytes")
    fn, sn, r = index, leaf_count - 1, leaf_hash(leaf)
    for sibling in path:
        if sn == 0:
            raise BadScopeProof("path is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = node_hash(sibling, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, sibling)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise BadScopeProof("path is shorter than the tree is deep")
    if r != root:
        raise BadScopeProof("the proof does not lead to the approved Merkle root")


# --- approvals --------------------------------------------------------------------------------------


@attrs.frozen
class ApprovedScope:
    """A batch scope with enough distinct approver signatures."""

    batch_id: str
    merkle_root: bytes = attrs.field(repr=False)
    leaf_count: int
    not_after_ms: int
    approved_by: frozenset[str]  # key ids of the counted approvers (one per distinct public key)


def _now_ms(now: datetime.datetime) -> int:
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    return int(now.timestamp() * 1000)


def decode_scope(scope: bytes) -> BatchScope:
    decoded = decode(BatchScope, scope, "batch scope", MalformedQuorumInput)
    if not decoded.batch_id:
        raise MalformedQuorumInput("batch scope: batch_id is empty")
    if len(decoded.merkle_root) != HASH_LENGTH:
        raise MalformedQuorumInput(
            f"batch scope: merkle_root is {len(decoded.merkle_root)} bytes, expected 32"
        )
    if not 1 <= decoded.leaf_count <= MAX_LEAVES:
        raise MalformedQuorumInput(f"batch scope: leaf_count {decoded.leaf_count} outside 1..{MAX_LEAVES}")
    return decoded


def verify_batch_approval(
    scope: bytes,
    signatures: Sequence[tuple[str, bytes]],
    approvers: Sequence[Approver],
    required: int,
    now: datetime.datetime,
) -> ApprovedScope:
    """Check the approvers' signatures over the exact scope bytes; count each distinct public key once."""
    if required < 1:
        raise ValueError("a quorum needs at least one approval")
    decoded = decode_scope(scope)
    if decoded.not_after and _now_ms(now) > decoded.not_after:
        raise ScopeExpired(f"batch {decoded.batch_id!r}: the approval ended at {decoded.not_after} ms")
    by_id = {a.key_id: a for a in approvers}
    counted: dict[bytes, str] = {}  # public key -> the first key id counted for it
    not_counted: list[str] = []
    for key_id, signature in signatures:
        approver = by_id.get(key_id)
        if approver is None:
            not_counted.append(f"unknown key id {key_id!r}")
            continue
        if approver.public_key in counted:
            not_counted.append(f"{key_id!r} repeats the key of {counted[approver.public_key]!r}")
            continue
        try:
            verify_signature(approver.public_key, Purpose.BATCH_APPROVAL, scope, signature)
        except PkiError as e:
            not_counted.append(f"{key_id!r}: {e.rule}")
            continue
        counted[approver.public_key] = key_id
    if len(counted) < required:
        detail = f"; not counted: {', '.join(not_counted)}" if not_counted else ""
        raise QuorumNotMet(
            f"batch {decoded.batch_id!r}: {len(counted)} distinct approver key(s) signed, "
            f"{required} required{detail}"
        )
    return ApprovedScope(
        decoded.batch_id,
        decoded.merkle_root,
        decoded.leaf_count,
        decoded.not_after,
        frozenset(counted.values()),
    )


@attrs.frozen
class ProvenLeaf:
    """This command's leaf, proven inside an approved scope. `leaf_id` identifies it for run-once records."""

    batch_id: str
    leaf_index: int
    leaf_id: str  # hex leaf hash
    leaf: BatchLeaf = attrs.field(eq=False, repr=False)


def verify_scope_proof(
    approved: ApprovedScope,
    leaf: bytes,
    leaf_index: int,
    path: Sequence[bytes],
    *,
    command_id: str,
    subject: str,
    kind: str,
    payload_sha256: bytes,
) -> ProvenLeaf:
    """Prove the command's (subject, kind), payload hash and id are a leaf of the approved tree."""
    verify_inclusion(leaf, leaf_index, path, approved.leaf_count, approved.merkle_root)
    decoded = decode(BatchLeaf, leaf, "batch leaf", MalformedQuorumInput)
    if (decoded.subject, decoded.kind) != (subject, kind):
        raise ScopeMismatch(
            f"the proof is for (subject, kind) = ({decoded.subject!r}, {decoded.kind!r}), "
            f"the command is ({subject!r}, {kind!r})"
        )
    if decoded.payload_sha256 != payload_sha256:
        raise ScopeMismatch(f"the leaf binds another payload for {kind!r} on {subject!r}")
    if decoded.command_id != command_id:
        raise ScopeMismatch(f"the leaf admits command {decoded.command_id!r}, not {command_id!r}")
    return ProvenLeaf(approved.batch_id, leaf_index, leaf_hash(leaf).hex(), decoded)


def admit_batched_command(
    approval: BatchApproval,
    proof: BatchProof,
    bundle: TrustBundle,
    now: datetime.datetime,
    *,
    batch_id: str,
    command_id: str,
    subject: str,
    kind: str,
    payload: bytes,
) -> ProvenLeaf:
    """The whole quorum check for one destructive command with a batch_id (after its signature check).

    Any PkiError here means BATCH_UNAPPROVED. `payload` is the command payload Any's value bytes.
    """
    if not bundle.has_quorum:
        raise ValueError("the trust bundle has no approver keys; the quorum does not apply")
    approved = verify_batch_approval(
        approval.scope,
        [(s.key_id, s.signature) for s in approval.signatures],
        bundle.approvers,
        bundle.approvals_required,
        now,
    )
    if approved.batch_id != batch_id:
        raise ScopeMismatch(
            f"the approval is for batch {approved.batch_id!r}, the command is in {batch_id!r}"
        )
    return verify_scope_proof(
        approved,
        proof.leaf,
        proof.leaf_index,
        proof.path,
        command_id=command_id,
        subject=subject,
        kind=kind,
        payload_sha256=hashlib.sha256(payload).digest(),
    )


# --- the issuing side (development control plane, tests) --------------------------------------------


@attrs.frozen
class Batch:
    """A built batch: the scope bytes approvers sign and the leaf bytes proofs carry."""

    scope: bytes = attrs.field(repr=False)
    leaves: tuple[bytes, ...] = attrs.field(repr=False)

    def proof(self, index: int) -> BatchProof:
        return BatchProof(leaf=self.leaves[index], leaf_index=index, path=inclusion_path(self.leaves, index))


def build_batch(
    batch_id: str, leaves: Sequence[BatchLeaf], description: str = "", not_after_ms: int = 0
) -> Batch:
    encoded = tuple(bytes(leaf) for leaf in leaves)
    scope = BatchScope(
        batch_id=batch_id,
        merkle_root=merkle_root(encoded),
        leaf_count=len(encoded),
        description=description,
        not_after=not_after_ms,
    )
    return Batch(bytes(scope), encoded)


def approve(approver_key: KeyPair, key_id: str, scope: bytes) -> ApproverSignature:
    return ApproverSignature(key_id=key_id, signature=approver_key.sign(Purpose.BATCH_APPROVAL, scope))
