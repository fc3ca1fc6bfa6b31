"""Terminal updates from journal entries: the one conversion the dispatcher and the session's replay share.

A terminal result lives in the journal (`CommandEntry.result`); the session replays it until its id is
acknowledged (DLV-RES-08), and a duplicate delivery resends it (DLV-REC-05). Both build the update with
`update_from_entry`, so a replayed update is the one first sent:

- the state and the wire's `error_code` / `reason` come from the stored outcome and code;
- a `rebooted` SUCCEEDED (written by journal.recover/settle) carries `NodeRebootResult{previous_boot_id}`
  as its result (DLV-REC-17) when nothing else was stored;
- for attested kinds the serialized `CommandAttestation` and the node signature are made once, when the
  result is journaled: `result_attester(signer)` is the journal's attester (`Journal.set_attester`; the
  Dispatcher sets it), it signs exactly the update this module builds, and the journal stores the pair
  in the same transaction as the result. A replay sends the stored bytes as they are, never re-encoded
  (an upgraded encoder or a rotated node key cannot change what was first sent). A result journaled
  without an attester (one `recover` settled before the dispatcher set it, or a schema-1 row) is signed
  here on each send; both encodings are deterministic, so it is still the same pair every time.
"""

from __future__ import annotations

from collections.abc import Callable

from bcd_shared.wire import NodeRebootResult

from bcd_agent.dispatch.command import REASON_REBOOTED, CommandUpdate, UpdateState
from bcd_agent.dispatch.ports import ResultSigner
from bcd_agent.journal import CODE_REBOOTED, CommandEntry, Outcome

_STATE = {
    Outcome.SUCCEEDED: UpdateState.SUCCEEDED,
    Outcome.FAILED: UpdateState.FAILED,
    Outcome.REJECTED: UpdateState.REJECTED,
    Outcome.CANCELLED: UpdateState.CANCELLED,
}


def result_attester(signer: ResultSigner) -> Callable[[CommandEntry], tuple[bytes, bytes]]:
    """The journal's attester (`Journal.set_attester`): signs the terminal update `update_from_entry`
    builds for an entry (its state, result bytes and boot id) with the node key."""

    def attest(entry: CommandEntry) -> tuple[bytes, bytes]:
        state, body, _, _ = _wire_parts(entry)
        assert entry.result is not None
        return signer.attest(entry.id, state, body, entry.result.boot_id)

    return attest


def _wire_parts(entry: CommandEntry) -> tuple[UpdateState, bytes, str, str]:
    """(state, result bytes, error_code, reason) of a settled entry's terminal update."""
    result = entry.result
    if result is None or not entry.state.terminal:
        raise ValueError(f"command {entry.id}: not settled ({entry.state.value})")
    state = _STATE[result.outcome]
    body = result.body
    error_code = reason = ""
    if state is UpdateState.FAILED:
        error_code = result.code
    elif state is UpdateState.SUCCEEDED:
        if result.code == CODE_REBOOTED:
            reason = REASON_REBOOTED
            if not body and result.previous_boot_id:
                body = bytes(NodeRebootResult(previous_boot_id=result.previous_boot_id))
    else:
        reason = result.code
    return state, body, error_code, reason


def update_from_entry(entry: CommandEntry, signer: ResultSigner | None, message: str = "") -> CommandUpdate:
    """The terminal CommandUpdate of a settled journal entry. Raises ValueError for an unsettled one.
    An attested entry carries its stored attestation and node signature; without them it is signed with
    `signer` (when given)."""
    state, body, error_code, reason = _wire_parts(entry)
    result = entry.result
    assert result is not None
    attestation = node_sig = b""
    if entry.flags.attested:
        if result.attestation and result.node_sig:
            attestation, node_sig = result.attestation, result.node_sig
        elif signer is not None:
            attestation, node_sig = signer.attest(entry.id, state, body, result.boot_id)
    return CommandUpdate(
        command_id=entry.id,
        state=state,
        boot_id=result.boot_id,
        error_code=error_code,
        reason=reason,
        message=message or result.message,
        result=body,
        attestation=attestation,
        node_sig=node_sig,
    )
