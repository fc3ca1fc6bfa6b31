"""The `daemon` section on `bcd node` under `bcd helper` (DLV-CONV-07, DLV-CONV-15, DLV-PRIV-10).

Each pass (a synchronous Section, so it runs in a worker thread):
1. the running release confirms itself to the helper, once per process (upgrade.Upgrader.confirm_once);
2. NodeSpec.daemon becomes a `ReleaseTarget` (model.target_from_wire; a bad field is FAILED
   `InvalidRelease`), and `plan` compares it with the running version and the staged artifact;
3. nothing to do: CONVERGED (`Running`, or `NoTarget` for an empty section);
4. else the signed spec that carried the section (data_dir/host-intent.json, the session keeps the last
   full signed spec there for the helper) goes with the release to `daemon.swap`: the helper binds the
   release to that spec's generation. Root swaps and restarts `bcd-node.service`; the section says
   PROGRESSING `Restarting` until the new process, running the target, converges. A refusal only a
   new spec can change (a downgrade without a rollback intent, a stale spec, a bad signature, other
   bytes than signed) is FAILED with root's reason; anything else PROGRESSING (retried in 30 s).
Reads no observation part: its facts (the running version, the staged file) are its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from bcd_shared import wire

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import SectionOutcome, SectionState
from bcd_agent.sections.daemon.fetch import staged_sha256
from bcd_agent.sections.daemon.model import Observed, ReleaseTarget, Step, plan, target_from_wire
from bcd_agent.sections.daemon.upgrade import Carrier, Upgrader, no_carrier

log = logging.getLogger("bcd.daemon")

SECTION: Final = "daemon"


class DaemonSection:
    name = SECTION

    def __init__(self, upgrader: Upgrader, data_dir: str | Path) -> None:
        self.upgrader = upgrader
        self.data_dir = Path(data_dir)

    def is_empty(self, desired: object | None) -> bool:
        if desired is None:
            return True
        if not isinstance(desired, wire.DaemonSection):
            return False
        return not (desired.version or desired.url or desired.sha256 or desired.signature or desired.rollback)

    def observe(self, target: ReleaseTarget | None) -> Observed:
        staged = staged_sha256(self.upgrader.staging, target.artifact_name) if target is not None else None
        return Observed(self.upgrader.running_version, staged)

    def converge(self, desired: object | None, observation: Observation, ctx: PassContext) -> SectionOutcome:
        from bcd_agent.sections.host.intent import read_host_intent

        self.upgrader.confirm_once()
        if desired is not None and not isinstance(desired, wire.DaemonSection):
            raise TypeError(f"daemon payload {type(desired).__name__} is not a DaemonSection")
        target = target_from_wire(desired)
        steps = plan(target, self.observe(target))
        running = self.upgrader.running_version
        if not steps:
            if target is None:
                return SectionOutcome(SECTION, SectionState.CONVERGED, "NoTarget", f"running {running}")
            return SectionOutcome(SECTION, SectionState.CONVERGED, "Running", f"running {running}")
        assert target is not None and Step.SWAP in steps
        try:
            intent = read_host_intent(self.data_dir)
        except ValueError as exc:
            raise no_carrier(f"spec ({exc})") from None
        if intent is None or intent.generation != ctx.generation:
            raise no_carrier(f"spec at generation {ctx.generation}")
        carrier = Carrier("spec", intent.body, intent.signature, intent.signer_chain)
        answer = self.upgrader.install(target, carrier)
        return SectionOutcome(
            SECTION,
            SectionState.PROGRESSING,
            "Restarting",
            f"release {target.version} swapped in (was {running}); bcd-node restarts on it: "
            f"{answer.get('restart', '')}",
            changed=True,
        )
