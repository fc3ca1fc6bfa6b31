"""The wire edge of dispatch: `Command` in, `CommandUpdate` out. Converted once, here.

`envelope_from_wire` decodes `Command.body` strictly (bcd_shared.wire.strict: unknown fields, duplicate
singular fields, truncation and bad UTF-8 are refused, naming the field) and keeps the exact body bytes in
the envelope; nothing downstream re-encodes them. Field rules at this edge:

- `id`: a ULID (26 Crockford base-32 characters); `node_id` and `kind` non-empty;
- `not_after`: milliseconds since the epoch, 0 = absent (the command will be EXPIRED, DLV-ACK-11);
- `lane`: LANE_UNSPECIFIED or a number this build does not know becomes `None` (UNSUPPORTED later);
- `payload`: absent becomes an empty Payload (a kind's handler decides whether that is its request).

A body that fails these rules raises `InvalidCommand` carrying the id when one could be read, so the
session can report the refusal against it (`Dispatcher.refuse_invalid`; `Dispatcher.deliver_wire` does both).
"""

from __future__ import annotations

import datetime as dt
import re

from bcd_shared import wire
from bcd_shared.wire.strict import WireError, decode

from bcd_agent.dispatch.command import (
    ApproverSignature,
    BatchApproval,
    BatchProof,
    CommandEnvelope,
    CommandUpdate,
    InvalidCommand,
    Payload,
    UpdateState,
)
from bcd_agent.dispatch.kinds import Lane

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# A ULID is 128 bits: 26 Crockford base-32 digits, so the first is at most 7. fullmatch, since `$`
# would also match before a trailing newline.
_ULID = re.compile(r"[0-7][0-9A-HJKMNP-TV-Z]{25}")

_LANES = {wire.Lane.CONTROL: Lane.CONTROL, wire.Lane.PROVISION: Lane.PROVISION, wire.Lane.BULK: Lane.BULK}

UPDATE_STATE_TO_WIRE = {
    UpdateState.ACKED: wire.CommandState.ACKED,
    UpdateState.RUNNING: wire.CommandState.RUNNING,
    UpdateState.SUCCEEDED: wire.CommandState.SUCCEEDED,
    UpdateState.FAILED: wire.CommandState.FAILED,
    UpdateState.REJECTED: wire.CommandState.REJECTED,
    UpdateState.CANCELLED: wire.CommandState.CANCELLED,
    UpdateState.BUSY: wire.CommandState.BUSY,
}


def is_ulid(value: str) -> bool:
    return _ULID.fullmatch(value) is not None


def _lenient_id(body: bytes) -> str:
    """The id of a body that failed the strict decode, read leniently, only to report the refusal."""
    try:
        candidate = wire.CommandBody.parse(body).id
    except Exception:  # any parse failure: there is no id to report against
        return ""
    # A lenient parse of bad UTF-8 leaves the field None: nothing to report against then.
    return candidate if isinstance(candidate, str) and is_ulid(candidate) else ""


def _not_after(ms: int, command_id: str) -> dt.datetime | None:
    if ms == 0:
        return None
    try:
        return _EPOCH + dt.timedelta(milliseconds=ms)
    except OverflowError:
        raise InvalidCommand(
            "not_after", f"{ms} ms is outside the representable time range", command_id
        ) from None


def envelope_from_wire(command: wire.Command) -> CommandEnvelope:
    """The domain command of a delivered `Command` (see the module docstring)."""
    raw = bytes(command.body)
    try:
        body = decode(wire.CommandBody, raw)
    except WireError as exc:
        raise InvalidCommand(f"body.{exc.path}", exc.rule, _lenient_id(raw)) from None
    if not is_ulid(body.id):
        raise InvalidCommand("body.id", f"{body.id!r} is not a ULID")
    if not body.node_id:
        raise InvalidCommand("body.node_id", "must not be empty", body.id)
    if not body.kind:
        raise InvalidCommand("body.kind", "must not be empty", body.id)
    try:
        lane: Lane | None = _LANES.get(wire.Lane(body.lane))
    except ValueError:
        lane = None
    payload = Payload(body.payload.type_url, bytes(body.payload.value)) if body.payload else Payload()
    approval = None
    if command.batch_approval is not None:
        approval = BatchApproval(
            scope=bytes(command.batch_approval.scope),
            signatures=tuple(
                ApproverSignature(s.key_id, bytes(s.signature)) for s in command.batch_approval.signatures
            ),
        )
    proof = None
    if command.batch_proof is not None:
        proof = BatchProof(
            leaf=bytes(command.batch_proof.leaf),
            leaf_index=command.batch_proof.leaf_index,
            path=tuple(bytes(p) for p in command.batch_proof.path),
        )
    return CommandEnvelope(
        id=body.id,
        node_id=body.node_id,
        seq=body.seq,
        kind=body.kind,
        payload=payload,
        lane=lane,
        not_after=_not_after(body.not_after, body.id),
        min_generation=body.min_generation,
        retry_safe=body.retry_safe,
        idempotency_key=body.idempotency_key,
        self_terminating=body.self_terminating,
        attested=body.attested,
        workflow_id=body.workflow_id,
        step_id=body.step_id,
        traceparent=body.traceparent,
        batch_id=body.batch_id,
        target_node_id=body.target_node_id,
        body_bytes=raw,
        signature=bytes(command.signature),
        signer_chain=tuple(bytes(c) for c in command.signer_chain),
        attempt=command.attempt,
        batch_approval=approval,
        batch_proof=proof,
    )


def approval_to_wire(approval: BatchApproval) -> wire.BatchApproval:
    return wire.BatchApproval(
        scope=approval.scope,
        signatures=[
            wire.ApproverSignature(key_id=s.key_id, signature=s.signature) for s in approval.signatures
        ],
    )


def proof_to_wire(proof: BatchProof) -> wire.BatchProof:
    return wire.BatchProof(leaf=proof.leaf, leaf_index=proof.leaf_index, path=list(proof.path))


def update_to_wire(update: CommandUpdate) -> wire.CommandUpdate:
    return wire.CommandUpdate(
        command_id=update.command_id,
        state=UPDATE_STATE_TO_WIRE[update.state],
        error_code=update.error_code,
        reason=update.reason,
        message=update.message,
        result=update.result,
        boot_id=update.boot_id,
        attestation=update.attestation,
        node_sig=update.node_sig,
    )
