"""`daemon.upgrade` (control lane; roles node and site; retry-safe, self-terminating; 15 minutes;
Q-DLV-KIND-01 in docs/dispatch.md; DLV-PRIV-10).

Payload `DaemonUpgradeRequest{version, url, sha256, signature, rollback}`. No locks (it acts on no device).

- The running release is already the requested version (the command re-executed after the restart it
  caused: retry-safe, so the journal runs it again in the new process): confirm it to the helper and
  succeed with `DaemonUpgradeResult{previous_version, version}`. This is how the command completes.
- Else: RUNNING, download into the staging directory, and `daemon.swap` with the signed command itself
  as the release's freshness (the helper checks its kind, node, `not_after` and that its id was never
  used). Root swaps and restarts `bcd-node.service`; the handler then waits for that restart (the
  process ends), and fails `restart-timeout` if it is still running after `wait_s`.
- Root's refusal fails the command with root's reason (`downgrade`, `stale-generation`,
  `intent-replayed`, ...); a bad payload is `invalid-payload`.
"""

from __future__ import annotations

from typing import Final

import trio
from bcd_shared import wire
from bcd_shared.errors import StepError

from bcd_agent.dispatch.command import CommandEnvelope
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload, RunContext
from bcd_agent.dispatch.payload import decode_request
from bcd_agent.sections.daemon.model import ReleaseTarget, target_from_wire
from bcd_agent.sections.daemon.upgrade import Carrier, Upgrader

KIND: Final = "daemon.upgrade"
RESTART_WAIT_S: Final = 300.0


def _target(command: CommandEnvelope) -> ReleaseTarget:
    request = decode_request(command, wire.DaemonUpgradeRequest)
    try:
        target = target_from_wire(request)
    except StepError as exc:
        raise InvalidPayload(exc.message) from None
    if target is None:
        raise InvalidPayload("payload: names no release (version, url and sha256 are empty)")
    return target


class DaemonUpgradeHandler:
    def __init__(self, upgrader: Upgrader, wait_s: float = RESTART_WAIT_S) -> None:
        self.upgrader = upgrader
        self.wait_s = wait_s

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        _target(command)
        return frozenset()

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        target = _target(command)
        if target.version == self.upgrader.running_version:
            try:
                answer = await trio.to_thread.run_sync(self.upgrader.confirm_once)
            except StepError as exc:
                raise CommandFailed(exc.reason, exc.message) from None
            previous = str((answer or {}).get("previous_version", ""))
            return bytes(wire.DaemonUpgradeResult(previous_version=previous, version=target.version))
        carrier = Carrier("command", command.body_bytes, command.signature, command.signer_chain)
        await ctx.begin_effect()  # running{boot_id}: the next process re-executes it (retry-safe)
        try:
            await trio.to_thread.run_sync(self.upgrader.install, target, carrier)
        except StepError as exc:
            raise CommandFailed(exc.reason, exc.message) from None
        await trio.sleep(self.wait_s)  # root restarts bcd-node.service on the new release
        raise CommandFailed(
            "restart-timeout",
            f"release {target.version} was swapped in but bcd was not restarted within {self.wait_s:g} s",
        )
