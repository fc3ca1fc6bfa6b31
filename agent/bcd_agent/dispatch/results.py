"""Terminal updates from journal entries: the one conversion the dispatcher and the session's replay share.

A terminal result lives in the journal (`CommandEntry.result`); the session replays it until its id is
acknowledged (DLV-RES-08), and a duplicate delivery resends it (DLV-REC-05). Both build the update with
`update_from_entry`, so a replayed update is the one first sent:

- the state and the wire's `error_code` / `reason` come from the stored outcome and code;
- a `rebooted` SUCCEEDED (written by journal.recover/settle) carries `NodeRebootResult{previous_boot_id}`
  as its result (DLV-REC-17) when nothing else was stored;
- for attested kinds the serialized `CommandAttestation` and the node signature are made here, from the
  stored result bytes and the boot id stored with them. Both are deterministic (protobuf encoding of a
  message without maps, Ed25519), so a replay sends the same pair, and the pair always verifies.
"""

from __future__ import annotations

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


def update_from_entry(entry: CommandEntry, signer: ResultSigner | None, message: str = "") -> CommandUpdate:
    """The terminal CommandUpdate of a settled journal entry. Raises ValueError for an unsettled one."""
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
    attestation = node_sig = b""
    if entry.flags.attested and signer is not None:
        attestation, node_sig = signer.attest(entry.id, state, body, result.boot_id)
    return CommandUpdate(
        command_id=entry.id,
        state=state,
        boot_id=result.boot_id,
        error_code=error_code,
        reason=reason,
        message=message,
        result=body,
        attestation=attestation,
        node_sig=node_sig,
    )
