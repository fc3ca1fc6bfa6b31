"""A fake host for the pure planner's tests: the files and records a plan's steps write, in memory.

`PlanHost.step(spec)` observes (the holds read back from their CDI documents, as `observe.read_holds`
does), plans, and applies every step as the section's applier would when nothing fails: the CDI
document goes through `cdi.encode_spec` and back, a started slice enforces what its spec asks
(`wanted_limits`), a stop leaves a populated slice running, the releases file, the marker and the
event ledger are rewritten, and the events are kept in order. No I/O, so a planner test can plan,
apply and plan again in microseconds (the simulated host's tests, tests/devices/test_devices_*.py
with the `host` fixture, do the same through the real applier and systemctl, at a second each).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from attrs import define, evolve, field
from bcd_agent.inventory.gpus import GpuInventory
from bcd_agent.sections.devices.events import BoundEvent, FailedEvent, ReleasedEvent
from bcd_agent.sections.devices.model import DevicesSpec
from bcd_agent.sections.devices.plan import (
    ApplySlice,
    Emit,
    ForgetEventKeys,
    Ledger,
    LiveHold,
    Observed,
    PendingRelease,
    Plan,
    RemoveEnv,
    RemoveMarker,
    RemoveSpec,
    SetAsideReleases,
    SliceState,
    Step,
    StopSlice,
    WriteEnv,
    WriteLedger,
    WriteReleases,
    WriteSpec,
    plan,
)
from bcd_agent.sections.devices.slices import wanted_limits
from bcd_shared import cdi

Event = BoundEvent | ReleasedEvent | FailedEvent


@define
class PlanHost:
    inventory: GpuInventory
    specs: dict[str, Mapping[str, Any]] = field(factory=dict)  # /etc/cdi/bcd-<id>.json, decoded
    unparseable: list[str] = field(factory=list)  # bcd-<id>.json files that do not parse
    # /run/bcd/allocations/<id>.env; None: one that does not parse
    envs: dict[str, tuple[str, ...] | None] = field(factory=dict)
    slices: dict[str, SliceState] = field(factory=dict)
    releases: tuple[PendingRelease, ...] = ()
    releases_unreadable: bool = False
    marker: bool = False
    ledger: Ledger = field(factory=Ledger)
    events: list[Event] = field(factory=list)
    keys: set[str] = field(factory=set)  # the journal's remembered event keys (Emit.key)
    stopped: list[str] = field(factory=list)  # slice names, in the order they were stopped
    # What the rest of the host says (the kube side, VFIO, host memory, ...): Observed's fields.
    facts: dict[str, Any] = field(factory=dict)

    def observed(self) -> Observed:
        holds = {
            alloc: LiveHold(cdi.parse_hold_doc(doc, alloc), doc, self.envs.get(alloc))
            for alloc, doc in self.specs.items()
        }
        return Observed(
            inventory=self.inventory,
            holds=holds,
            unparseable_specs=tuple(self.unparseable),
            slices=dict(self.slices),
            releases=self.releases,
            releases_unreadable=self.releases_unreadable,
            marker=self.marker,
            ledger=self.ledger,
            orphan_envs={
                alloc: lines
                for alloc, lines in self.envs.items()
                if alloc not in self.specs and alloc not in self.unparseable
            },
            event_keys=frozenset(self.keys),
            **self.facts,
        )

    def plan(self, spec: DevicesSpec) -> Plan:
        return plan(spec, self.observed())

    def step(self, spec: DevicesSpec) -> Plan:
        """One pass: observe, plan, apply. Returns the plan that was applied."""
        p = self.plan(spec)
        for action in p.actions:
            for s in action.steps:
                self.apply(s)
        return p

    def apply(self, s: Step) -> None:
        if isinstance(s, WriteSpec):
            self.specs[s.allocation_id] = json.loads(cdi.encode_spec(s.doc))
        elif isinstance(s, RemoveSpec):
            self.specs.pop(s.allocation_id, None)
            if s.allocation_id in self.unparseable:
                self.unparseable.remove(s.allocation_id)
        elif isinstance(s, WriteEnv):
            self.envs[s.allocation_id] = s.lines
        elif isinstance(s, RemoveEnv):
            self.envs.pop(s.allocation_id, None)
        elif isinstance(s, ApplySlice):
            old = self.slices.get(s.slice.name)
            state = old or SliceState(s.slice.name, False)
            self.slices[s.slice.name] = evolve(state, limits=wanted_limits(s.slice))
        elif isinstance(s, StopSlice):
            st = self.slices.get(s.name)
            if st is not None and not st.populated:  # the executor reads cgroup.events first
                del self.slices[s.name]
                self.stopped.append(s.name)
        elif isinstance(s, WriteReleases):
            self.releases = s.releases
            self.releases_unreadable = False
        elif isinstance(s, SetAsideReleases):
            self.releases, self.releases_unreadable, self.marker = (), False, True
        elif isinstance(s, RemoveMarker):
            self.marker = False
        elif isinstance(s, Emit):
            if s.key is None or s.key not in self.keys:
                self.events.append(s.event)
            if s.key is not None:
                self.keys.add(s.key)
        elif isinstance(s, WriteLedger):
            self.ledger = s.ledger
        elif isinstance(s, ForgetEventKeys):
            self.keys -= set(s.keys)

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]
