"""Attested results: node signatures over command results and allocation reports (DLV-SIG-17, DLV-SIG-18).

Command results (Q-DLV-SIG-02, decided): `CommandUpdate.attestation` is the serialized `CommandAttestation`
{command_id, state, result_sha256 = SHA-256(CommandUpdate.result), node_id, boot_id}, exactly as signed, and
`CommandUpdate.node_sig` is the node key's Ed25519 signature over `purpose_tag("command-result") ||
attestation`. The verifier never re-encodes: it verifies the bytes received, decodes them strictly and checks
each field against the update it came with (the result's hash is recomputed from the result bytes).

Reports: `AttestedReport{body, signature}`; body is the serialized AttestedReportBody, signed under
`attested-report`; the verifier checks the body names the expected node (DEV-EVT-01).
"""

from __future__ import annotations

import hashlib

from bcd_shared.pki._wire import decode
from bcd_shared.pki.errors import AttestationMismatch, MalformedAttestation
from bcd_shared.pki.signing import KeyPair, Purpose, verify_signature
from bcd_shared.wire import AttestedReport, AttestedReportBody, CommandAttestation, CommandState


def attest_command_result(
    node_key: KeyPair, command_id: str, state: CommandState, result: bytes, node_id: str, boot_id: str
) -> tuple[bytes, bytes]:
    """(attestation bytes, node_sig) for a terminal update of an attested kind."""
    attestation = bytes(
        CommandAttestation(
            command_id=command_id,
            state=state,
            result_sha256=hashlib.sha256(result).digest(),
            node_id=node_id,
            boot_id=boot_id,
        )
    )
    return attestation, node_key.sign(Purpose.COMMAND_RESULT, attestation)


def verify_command_result(
    attestation: bytes,
    node_sig: bytes,
    node_public_key: bytes,
    *,
    command_id: str,
    state: CommandState,
    result: bytes,
    node_id: str,
) -> CommandAttestation:
    """Verify an attested update: the signature, then that the attestation matches the update's fields."""
    verify_signature(node_public_key, Purpose.COMMAND_RESULT, attestation, node_sig)
    signed = decode(CommandAttestation, attestation, "command attestation", MalformedAttestation)
    expected: dict[str, object] = {
        "command_id": command_id,
        "state": state,
        "result_sha256": hashlib.sha256(result).digest(),
        "node_id": node_id,
    }
    for field, want in expected.items():
        got = getattr(signed, field)
        if got != want:
            if isinstance(got, bytes) and isinstance(want, bytes):
                got, want = got.hex(), want.hex()
            raise AttestationMismatch(f"{field}: attestation says {got!r}, the update says {want!r}")
    return signed


def sign_report(node_key: KeyPair, body: AttestedReportBody) -> AttestedReport:
    """An AttestedReport: the body encoded once and signed under `attested-report`."""
    data = bytes(body)
    return AttestedReport(body=data, signature=node_key.sign(Purpose.ATTESTED_REPORT, data))


def verify_report(body: bytes, signature: bytes, node_public_key: bytes, node_id: str) -> AttestedReportBody:
    """Verify an AttestedReport's exact body bytes and that it names `node_id`."""
    verify_signature(node_public_key, Purpose.ATTESTED_REPORT, body, signature)
    decoded = decode(AttestedReportBody, body, "attested report body", MalformedAttestation)
    if decoded.node_id != node_id:
        raise AttestationMismatch(f"node_id: report names {decoded.node_id!r}, expected {node_id!r}")
    return decoded
