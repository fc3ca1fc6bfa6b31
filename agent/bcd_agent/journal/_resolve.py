"""The Resolve table and Recover's settlement, as pure functions of an entry, the incarnation and the boot.

| Journal entry                                        | Action       |
| ---------------------------------------------------- | ------------ |
| none                                                 | NONE         |
| a refusal on the gateway's word, another envelope    | NONE         |
| terminal (done, cancelled, rejected)                 | DONE         |
| accepted or running, written by this incarnation     | REATTACH     |
| running, self-terminating, from an earlier boot      | REBOOTED     |
| left by an earlier process, retry-safe               | REEXECUTE    |
| left by an earlier process, not retry-safe           | INTERRUPTED  |

The rows are tried in this order: a `node.reboot` (retry-safe and self-terminating) found running from
an earlier boot is REBOOTED, not re-executed. A refusal of an envelope whose signature did not verify
(`CommandEntry.envelope_sha256` set) answers only that envelope: another one under the id is judged afresh
(NONE, with the entry), since a forged body must not take a signed command's id.
"""

from __future__ import annotations

from bcd_agent.journal._types import (
    CODE_INTERRUPTED,
    CODE_REBOOTED,
    Action,
    CommandEntry,
    CommandResult,
    CommandState,
    Outcome,
)


def resolve_entry(
    entry: CommandEntry | None, incarnation: str, boot_id: str, envelope_sha256: bytes | None = None
) -> Action:
    """`envelope_sha256`: the delivered envelope's (None: the caller has none, e.g. a Cancel)."""
    if entry is None:
        return Action.NONE
    if entry.state.terminal:
        if not entry.binds and envelope_sha256 is not None and envelope_sha256 != entry.envelope_sha256:
            return Action.NONE
        return Action.DONE
    if entry.incarnation == incarnation:
        return Action.REATTACH
    if entry.state is CommandState.RUNNING and entry.flags.self_terminating and entry.boot_id != boot_id:
        return Action.REBOOTED
    if entry.flags.retry_safe:
        return Action.REEXECUTE
    return Action.INTERRUPTED


def settlement(entry: CommandEntry, action: Action, boot_id: str, now: float) -> CommandResult | None:
    """The result Recover journals for an entry whose outcome needs no server input (DLV-REC-10)."""
    if action is Action.REBOOTED:
        return CommandResult(
            outcome=Outcome.SUCCEEDED,
            code=CODE_REBOOTED,
            body=b"",
            boot_id=boot_id,
            finished_at=now,
            previous_boot_id=entry.boot_id,
        )
    if action is Action.INTERRUPTED:
        return CommandResult(
            outcome=Outcome.FAILED, code=CODE_INTERRUPTED, body=b"", boot_id=boot_id, finished_at=now
        )
    return None
