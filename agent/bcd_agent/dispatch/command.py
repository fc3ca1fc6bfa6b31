"""The command as the dispatcher sees it: one frozen value, converted once from the wire.

`CommandEnvelope` keeps the exact `CommandBody` bytes that arrived (`body_bytes`): the signature is
verified over them, the journal stores them, and they are never re-encoded (house rule 3). The decoded
fields beside them are for reading only. `attempt` is informational and outside the signature
(DLV-CMD-01); `batch_approval` and `batch_proof` travel beside the body too (DLV-QRM-07).

Conversion from the generated protobuf classes lives in `dispatch.wire` (`envelope_from_wire`); this
module imports no wire code so the acceptance checks stay testable with plain values.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
from collections.abc import Iterable

from attrs import frozen

from bcd_agent.dispatch.kinds import Lane


class InvalidCommand(ValueError):
    """A delivered command that does not convert: names the field and the rule it broke.

    `command_id` is set when the id itself decoded, so the refusal can be reported against it.
    """

    def __init__(self, field: str, rule: str, command_id: str = "") -> None:
        super().__init__(f"command {command_id or '?'}: {field}: {rule}")
        self.field = field
        self.rule = rule
        self.command_id = command_id


@frozen
class Payload:
    """A packed `google.protobuf.Any`: type URL and the exact value bytes."""

    type_url: str = ""
    value: bytes = b""


@frozen
class ApproverSignature:
    key_id: str
    signature: bytes


@frozen
class BatchApproval:
    """`Command.batch_approval`: the exact BatchScope bytes the approvers signed, and their signatures."""

    scope: bytes
    signatures: tuple[ApproverSignature, ...]


@frozen
class BatchProof:
    """`Command.batch_proof`: the exact BatchLeaf bytes, its index, and the Merkle path to the root."""

    leaf: bytes
    leaf_index: int
    path: tuple[bytes, ...]


@frozen
class CommandEnvelope:
    """A delivered command: the signed body's bytes, its decoded fields, and what travels beside it."""

    id: str
    node_id: str
    seq: int
    kind: str
    payload: Payload
    lane: Lane | None  # None: the body named no lane (UNSUPPORTED)
    not_after: dt.datetime | None  # server time, aware UTC; None when the body has none (EXPIRED)
    min_generation: int
    retry_safe: bool
    idempotency_key: str
    self_terminating: bool
    attested: bool
    workflow_id: str
    step_id: str
    traceparent: str
    batch_id: str
    target_node_id: str
    # Beside the body:
    body_bytes: bytes
    signature: bytes = b""
    signer_chain: tuple[bytes, ...] = ()
    attempt: int = 0
    batch_approval: BatchApproval | None = None
    batch_proof: BatchProof | None = None

    @property
    def subject(self) -> str:
        """The node the command acts on: `target_node_id` when set, else `node_id` (the quorum's leaf
        subject, BatchLeaf.subject)."""
        return self.target_node_id or self.node_id


def envelope_sha256(body: bytes, signature: bytes, signer_chain: Iterable[bytes]) -> bytes:
    """SHA-256 over what a command's signature check judges (body, signature, chain; each length-prefixed,
    so no two envelopes share it): a refusal of an envelope that did not verify answers that envelope
    alone (journal `envelope_sha256`), so a forged body cannot take a signed command's id."""
    h = hashlib.sha256()
    for part in (body, signature, *signer_chain):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


class UpdateState(enum.Enum):
    """`CommandUpdate.state`: the progress and outcome a node reports (DLV-RES-01..05), and BUSY."""

    ACKED = "ACKED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    REJECTED = "REJECTED"
    CANCELLED = "CANCELLED"
    BUSY = "BUSY"  # not terminal, never journaled: redeliver later (DLV-ACK-14/15)

    @property
    def terminal(self) -> bool:
        return self in (
            UpdateState.SUCCEEDED,
            UpdateState.FAILED,
            UpdateState.REJECTED,
            UpdateState.CANCELLED,
        )


class RejectReason(enum.Enum):
    """Why the acceptance checks refused a command; all are terminal (DLV-ACK-16). BUSY is a state."""

    UNSUPPORTED = "UNSUPPORTED"
    STALE_GENERATION = "STALE_GENERATION"
    EXPIRED = "EXPIRED"
    BAD_SIGNATURE = "BAD_SIGNATURE"
    BATCH_UNAPPROVED = "BATCH_UNAPPROVED"
    UNBATCHED_LIMIT = "UNBATCHED_LIMIT"


# FAILED error codes the dispatcher itself produces (kinds add their own, e.g. gpu-busy).
ERR_INTERRUPTED = "interrupted"
ERR_INVALID_PAYLOAD = "invalid-payload"
ERR_INTERNAL = "internal"
# A handler asked for a secret: the command names no workflow step to bind it to (DLV-CMD-14), or this
# agent has no secret broker.
ERR_SECRET_UNBOUND = "secret-unbound"  # noqa: S105 (an error code)
ERR_SECRET_UNAVAILABLE = "secret-unavailable"  # noqa: S105 (an error code)
# The SUCCEEDED reason of a self-terminating command completed by the reboot it caused.
REASON_REBOOTED = "rebooted"


@frozen
class CommandUpdate:
    """One report about a command, as it goes to the session (and, when terminal, into the journal).

    Mirrors the wire's CommandUpdate: `error_code` for FAILED; `reason` for REJECTED (a RejectReason
    value), BUSY, CANCELLED (the Cancel's reason) and a SUCCEEDED `rebooted`; `result` the kind's
    serialized result message; `attestation` the serialized CommandAttestation that `node_sig` signs
    (attested kinds, terminal states). `boot_id` is the boot the update was produced in (DLV-RES-06).
    """

    command_id: str
    state: UpdateState
    boot_id: str
    error_code: str = ""
    reason: str = ""
    message: str = ""
    result: bytes = b""
    attestation: bytes = b""
    node_sig: bytes = b""

    @property
    def terminal(self) -> bool:
        return self.state.terminal
