"""Attested results (node_sig over CommandAttestation), attested reports, and root's join record.

Covers DLV-SIG-17 (node_sig over the command id, the state and the SHA-256 of the result), DLV-SIG-18 and
DEV-EVT-01 (node-signed AttestedReports naming the node), HST-SIGN-20/21 (the join record re-verified against
join_signing_key_pin; a record another key signed is refused).
"""

from __future__ import annotations

import hashlib

import pytest
from bcd_shared.pki import (
    AttestationMismatch,
    BadSignature,
    JoinKeyPin,
    KeyPair,
    MalformedAttestation,
    Purpose,
    Role,
    TrustBundle,
    UntrustedBundleSigner,
    UntrustedJoinSigner,
    WrongPurpose,
    attest_command_result,
    sign_join_response,
    sign_report,
    sign_trust_bundle,
    verify_chain,
    verify_command_result,
    verify_join_response,
    verify_report,
)
from bcd_shared.wire import (
    AllocationBound,
    AttestedReportBody,
    CommandAttestation,
    CommandState,
    JoinResponseBody,
)
from pkifixture import NOW, Hierarchy, Signer, shared_hierarchy, shared_node


@pytest.fixture(name="hierarchy")
def _hierarchy_fixture() -> Hierarchy:
    return shared_hierarchy()


@pytest.fixture(name="node_signer")
def _node_signer_fixture() -> Signer:
    return shared_node()


RESULT = b"\x0a\x28GPU-0f4c1e2a\x10\x01"
CMD = "01JCMD0000000000000000000A"


def _attested(node: Signer) -> tuple[bytes, bytes]:
    return attest_command_result(node.key, CMD, CommandState.SUCCEEDED, RESULT, "node-1", "boot-a")


def test_DLV_SIG_17_node_sig_covers_id_state_and_result_hash(
    hierarchy: Hierarchy, node_signer: Signer
) -> None:
    attestation, sig = _attested(node_signer)
    # The node key comes from its certificate, checked for the node role.
    signer = verify_chain(node_signer.chain, hierarchy.roots, Purpose.COMMAND_RESULT, NOW)
    assert signer.role is Role.NODE
    signed = verify_command_result(
        attestation,
        sig,
        signer.public_key,
        command_id=CMD,
        state=CommandState.SUCCEEDED,
        result=RESULT,
        node_id="node-1",
    )
    assert signed.result_sha256 == hashlib.sha256(RESULT).digest()
    assert signed.boot_id == "boot-a"


MISMATCHES = [
    ("another command", {"command_id": "01JCMD0000000000000000000B"}, "command_id"),
    ("another state", {"state": CommandState.FAILED}, "state"),
    ("another result", {"result": RESULT + b"\x00"}, "result_sha256"),
    ("another node", {"node_id": "node-2"}, "node_id"),
]


@pytest.mark.parametrize(("case", "change", "field"), MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_DLV_SIG_17_attestation_must_match_the_update(
    case: str, change: dict[str, object], field: str, node_signer: Signer
) -> None:
    attestation, sig = _attested(node_signer)
    kwargs: dict[str, object] = {
        "command_id": CMD,
        "state": CommandState.SUCCEEDED,
        "result": RESULT,
        "node_id": "node-1",
        **change,
    }
    with pytest.raises(AttestationMismatch, match=f"^attestation-mismatch: {field}:"):
        verify_command_result(attestation, sig, node_signer.key.public_key, **kwargs)  # type: ignore[arg-type]


def test_DLV_SIG_17_node_sig_refusals(node_signer: Signer) -> None:
    attestation, sig = _attested(node_signer)
    kw = {"command_id": CMD, "state": CommandState.SUCCEEDED, "result": RESULT, "node_id": "node-1"}
    with pytest.raises(BadSignature):
        verify_command_result(attestation[:-1] + b"b", sig, node_signer.key.public_key, **kw)  # type: ignore[arg-type]
    with pytest.raises(BadSignature):
        verify_command_result(attestation, sig, KeyPair.generate().public_key, **kw)  # type: ignore[arg-type]
    report_sig = node_signer.key.sign(Purpose.ATTESTED_REPORT, attestation)
    with pytest.raises(WrongPurpose, match="'attested-report', expected 'command-result'"):
        verify_command_result(attestation, report_sig, node_signer.key.public_key, **kw)  # type: ignore[arg-type]
    with_unknown = attestation + b"\x50\x01"  # field 10, varint
    with pytest.raises(MalformedAttestation, match="unknown field"):
        verify_command_result(
            with_unknown,
            node_signer.key.sign(Purpose.COMMAND_RESULT, with_unknown),
            node_signer.key.public_key,
            **kw,  # type: ignore[arg-type]
        )


def test_attestation_bytes_are_the_wire_message(node_signer: Signer) -> None:
    attestation, _ = _attested(node_signer)
    assert CommandAttestation.parse(attestation) == CommandAttestation(
        command_id=CMD,
        state=CommandState.SUCCEEDED,
        result_sha256=hashlib.sha256(RESULT).digest(),
        node_id="node-1",
        boot_id="boot-a",
    )


def test_DLV_SIG_18_DEV_EVT_01_attested_report(node_signer: Signer) -> None:
    body = AttestedReportBody(
        node_id="node-1",
        boot_id="boot-a",
        allocation_bound=AllocationBound(allocation_id="alloc_1", device_ids=["GPU-1"]),
    )
    report = sign_report(node_signer.key, body)
    decoded = verify_report(report.body, report.signature, node_signer.key.public_key, "node-1")
    assert decoded.allocation_bound is not None and decoded.allocation_bound.allocation_id == "alloc_1"
    with pytest.raises(AttestationMismatch, match="report names 'node-1', expected 'node-2'"):
        verify_report(report.body, report.signature, node_signer.key.public_key, "node-2")
    with pytest.raises(BadSignature):
        verify_report(report.body + b"\x00", report.signature, node_signer.key.public_key, "node-1")


# --- join records ---------------------------------------------------------------------------------

JOIN_KEY = KeyPair(bytes([9]) * 32)
PIN = JoinKeyPin.of_key(JOIN_KEY.public_key)


def _join_body(hierarchy: Hierarchy, node: Signer, bundle_key: KeyPair = JOIN_KEY) -> JoinResponseBody:
    return JoinResponseBody(
        node_id="node-1",
        certificate_chain=list(node.chain),
        trust_bundle=sign_trust_bundle(bundle_key, TrustBundle(version=4, command_roots=(hierarchy.root,))),
        issued_at=1_700_000_000_000,
    )


def test_HST_SIGN_20_join_record_names_the_node(hierarchy: Hierarchy, node_signer: Signer) -> None:
    record = sign_join_response(JOIN_KEY, _join_body(hierarchy, node_signer))
    joined = verify_join_response(record, PIN)
    assert joined.node_id == "node-1"
    assert joined.certificate_chain == node_signer.chain
    assert joined.trust_bundle is not None and joined.trust_bundle.version == 4
    assert joined.trust_bundle.bundle.has_command_roots


def test_HST_SIGN_21_join_record_of_another_key_is_refused(hierarchy: Hierarchy, node_signer: Signer) -> None:
    record = sign_join_response(KeyPair.generate(), _join_body(hierarchy, node_signer))
    with pytest.raises(UntrustedJoinSigner, match="not the pinned JoinService key"):
        verify_join_response(record, PIN)
    # A record signed by the pinned key that embeds a bundle from another key is refused too.
    record = sign_join_response(JOIN_KEY, _join_body(hierarchy, node_signer, bundle_key=KeyPair.generate()))
    with pytest.raises(UntrustedBundleSigner):
        verify_join_response(record, PIN)


def test_join_record_tampering_is_refused(hierarchy: Hierarchy, node_signer: Signer) -> None:
    record = sign_join_response(JOIN_KEY, _join_body(hierarchy, node_signer))
    index = record.index(b"node-1")
    tampered = record[:index] + b"node-2" + record[index + 6 :]
    with pytest.raises(BadSignature):
        verify_join_response(tampered, PIN)
