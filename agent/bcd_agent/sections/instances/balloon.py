"""Memory ballooning (seeds/delivery.md "Memory ballooning", DLV-BAL): the pure controller and its shell.

The controller (`plan_balloons`, pure: no I/O, no clock) turns the host's memory (`MemTotal`,
`MemAvailable`, PSI `some avg10`) and each ballooned guest's reading (its configured memory, what its
balloon holds now, what it uses) into the new balloon sizes, by the seed's table:

| Host state | Step |
| --- | --- |
| available < 10% of MemTotal, or a stall >= 10.00 | inflate to cover the shortfall below 10% (at least |
|   (`some avg10`)                                 | 2% of MemTotal while stalled), the guests with the |
|                                                  | most memory above their floor first, at most a     |
|                                                  | quarter of a guest's memory each                   |
| available > 20% and no stall                     | deflate every inflated balloon by at most a quarter |
|                                                  | of its guest's memory, within what is free above   |
|                                                  | 20% (the most inflated first)                      |
| in between | nothing |

A guest's floor is `balloon_floor_percent` of its memory, or its use plus 10% of its memory when that
is higher, capped at its memory; a guest without a usage reading counts as using all its memory, so
nothing is taken from it (DLV-BAL-10/11). A guest found below its floor (its use grew) is deflated up to
its floor on any tick, whatever the host's state: it never stays below it (docs/instances.md).

Sizes are the *balloon's* (what the host takes back), runtime-neutral: libvirt-kvm sets `memory -
balloon` with `virsh setmem --live` (KiB), cloud-hypervisor sends `vm.resize` `desired_balloon` as is.
Steps are whole MiB (a balloon is emptied exactly). Host admission never sees balloons: it charges each
VM its full configured memory (placement.committed_bytes, DLV-BAL-16).

The shell (`BalloonController.tick`, run by the node every 30 s in a worker thread, outside any pass):
reads the host, asks each runtime for its guests' readings (`balloon_readings()`: a guest defined
without a balloon device is absent, so it is never touched; DLV-BAL-14), keeps only the running
managed guests whose spec asks for a balloon and whose memory is not in huge pages (DLV-BAL-02/04),
plans, and sets each size through the runtime (`set_balloon`; `ErrNoBalloon` from the runtime skips
the guest). What each guest lends is kept for the telemetry section's OTLP metric
`bcd.instance.memory.balloon.reclaimed` (DLV-BAL-17).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from attrs import frozen
from bcd_shared.errors import StepError

from bcd_agent.sections.instances.model import Desired, InstancesSpec
from bcd_agent.sections.instances.runtimes.base import RUNNING, Domain, ErrNoBalloon

__all__ = ["BALLOON_METRIC", "BalloonController", "ErrNoBalloon", "plan_balloons"]

log = logging.getLogger("bcd.instances.balloon")

BALLOON_METRIC = "bcd.instance.memory.balloon.reclaimed"  # DLV-BAL-17, for the telemetry section
INTERVAL_S = 30.0  # the health interval (DLV-BAL-03)
MIB = 1 << 20
LOW_PERCENT = 10  # below: inflate
HIGH_PERCENT = 20  # above (and no stall): deflate
STALL_AVG10 = 10.0  # PSI `some avg10` at or above: stalled (Q-DLV-BAL-01)
STALL_MIN_PERCENT = 2  # while stalled, at least this much of MemTotal is reclaimed per pass


@frozen
class HostPressure:
    total_bytes: int  # MemTotal
    available_bytes: int  # MemAvailable
    stall_avg10: float | None = None  # PSI memory `some avg10`; None: the kernel has no PSI


@frozen
class BalloonReading:
    """What a runtime reads of one guest's balloon (DLV-BAL-12/13)."""

    balloon_bytes: int  # what the balloon holds now: configured memory less what the guest is left
    used_bytes: int | None = None  # the guest's use, when its driver reports it


@frozen
class Guest:
    name: str
    runtime: str
    memory_bytes: int  # configured
    balloon_bytes: int  # now
    used_bytes: int | None  # None: counts as all its memory


@frozen
class Resize:
    name: str
    runtime: str
    balloon_bytes: int  # the new size
    previous_bytes: int
    memory_bytes: int

    @property
    def guest_bytes(self) -> int:
        """What the guest is left (libvirt's `setmem` value)."""
        return self.memory_bytes - self.balloon_bytes


def floor_bytes(g: Guest, floor_percent: int) -> int:
    """The least memory the guest is left: floor_percent of its memory, or use + 10% when higher."""
    base = g.memory_bytes * floor_percent // 100
    used = g.memory_bytes if g.used_bytes is None else g.used_bytes + g.memory_bytes // 10
    return min(g.memory_bytes, max(base, used))


def plan_balloons(host: HostPressure, guests: Sequence[Guest], floor_percent: int) -> tuple[Resize, ...]:
    """The new balloon sizes (only those that change), by the table in the module docstring. Pure."""
    target = {g.name: g.balloon_bytes for g in guests}
    floors = {g.name: floor_bytes(g, floor_percent) for g in guests}
    for g in guests:  # never below the floor, whatever the host's state
        target[g.name] = min(target[g.name], g.memory_bytes - floors[g.name])
    stalled = host.stall_avg10 is not None and host.stall_avg10 >= STALL_AVG10
    low = host.total_bytes * LOW_PERCENT // 100
    high = host.total_bytes * HIGH_PERCENT // 100
    if host.available_bytes < low or stalled:
        need = max(0, low - host.available_bytes)
        if stalled:
            need = max(need, host.total_bytes * STALL_MIN_PERCENT // 100)
        need = -(-need // MIB) * MIB  # whole MiB, rounded up: the shortfall is covered

        def room(g: Guest) -> int:
            return max(0, g.memory_bytes - target[g.name] - floors[g.name])

        for g in sorted(guests, key=lambda g: (-room(g), g.name)):
            if need <= 0:
                break
            take = min(need, room(g), g.memory_bytes // 4) // MIB * MIB
            if take <= 0:
                continue
            target[g.name] += take
            need -= take
    elif host.available_bytes > high:
        free = host.available_bytes - high
        for g in sorted(guests, key=lambda g: (-target[g.name], g.name)):
            held = target[g.name]
            if held <= 0 or free <= 0:
                continue
            step = min(held, g.memory_bytes // 4, free)
            if step < held:
                step = step // MIB * MIB
            if step <= 0:
                continue
            target[g.name] = held - step
            free -= step
    return tuple(
        Resize(g.name, g.runtime, max(0, target[g.name]), g.balloon_bytes, g.memory_bytes)
        for g in guests
        if max(0, target[g.name]) != g.balloon_bytes
    )


def reclaimed(guests: Iterable[Guest]) -> dict[str, int]:
    """What each ballooned guest lends the host (DLV-BAL-17's value): its memory less what it is left."""
    return {g.name: g.balloon_bytes for g in guests}


# --- reading the host -----------------------------------------------------------------------------

_MEMINFO = re.compile(r"^(MemTotal|MemAvailable):\s+(\d+) kB$", re.M)
_PSI_SOME = re.compile(r"^some avg10=([0-9]+(?:\.[0-9]+)?)\b", re.M)


def parse_pressure(meminfo: str, psi: str | None) -> HostPressure | None:
    """/proc/meminfo and /proc/pressure/memory (None: no PSI) as HostPressure; None: unreadable."""
    found = {k: int(v) * 1024 for k, v in _MEMINFO.findall(meminfo)}
    if "MemTotal" not in found or "MemAvailable" not in found or found["MemTotal"] <= 0:
        return None
    stall = None
    if psi is not None:
        m = _PSI_SOME.search(psi)
        stall = float(m.group(1)) if m else None
    return HostPressure(found["MemTotal"], found["MemAvailable"], stall)


# --- the shell ------------------------------------------------------------------------------------


class Ballooning(Protocol):
    """What a runtime offers the controller (libvirt-kvm; cloud-hypervisor's adapter)."""

    def balloon_readings(self) -> Mapping[str, BalloonReading]: ...

    def set_balloon(self, name: str, balloon_bytes: int) -> None: ...


class BalloonController:
    """One tick: observe, plan (pure), set. `system` reads /proc; `runtimes` by name."""

    def __init__(self, system: Any, runtimes: Mapping[str, Any], floor_percent: int = 50) -> None:
        self.system = system
        self.runtimes = runtimes
        self.floor_percent = floor_percent
        self.lent: dict[str, int] = {}  # instance -> bytes its balloon holds (DLV-BAL-17's value)

    def read_host(self) -> HostPressure | None:
        meminfo = self.system.read_text("/proc/meminfo")
        if meminfo is None:
            return None
        return parse_pressure(meminfo, self.system.read_text("/proc/pressure/memory"))

    def guests(self, spec: InstancesSpec, domains: Iterable[Domain]) -> list[Guest]:
        """The running, managed guests whose spec asks for a balloon (never with huge pages) and whose
        runtime reads a balloon for them."""
        wanted = {
            i.id: i
            for i in spec.instances
            if i.desired is not Desired.DELETED
            and i.placement is not None
            and i.placement.balloon
            and not i.hugepages
        }
        readings: dict[str, Mapping[str, BalloonReading]] = {}
        out = []
        for d in domains:
            inst = wanted.get(d.name)
            if inst is None or not d.managed or d.state != RUNNING or d.hugepages:
                continue
            if d.runtime != inst.runtime:
                continue
            rt = self.runtimes.get(d.runtime)
            read: Callable[[], Mapping[str, BalloonReading]] | None = getattr(rt, "balloon_readings", None)
            if read is None:
                continue
            if d.runtime not in readings:
                try:
                    readings[d.runtime] = read()
                except StepError as exc:
                    log.warning("balloon: %s: %s", d.runtime, exc.message)
                    readings[d.runtime] = {}
            r = readings[d.runtime].get(d.name)
            if r is None:  # no balloon device (ErrNoBalloon): never touched
                continue
            memory = d.memory_bytes or inst.memory_bytes
            out.append(Guest(d.name, d.runtime, memory, min(max(0, r.balloon_bytes), memory), r.used_bytes))
        return out

    def tick(self, spec: InstancesSpec, domains: Iterable[Domain]) -> tuple[Resize, ...]:
        host = self.read_host()
        if host is None:
            return ()
        guests = self.guests(spec, domains)
        steps = plan_balloons(host, guests, self.floor_percent)
        done = {g.name: g.balloon_bytes for g in guests}
        applied = []
        for step in steps:
            try:
                self.runtimes[step.runtime].set_balloon(step.name, step.balloon_bytes)
            except ErrNoBalloon:
                done.pop(step.name, None)
                continue
            except StepError as exc:
                if exc.reason == "ErrNoBalloon":
                    done.pop(step.name, None)
                else:
                    log.warning("balloon: %s: %s", step.name, exc.message)
                continue
            done[step.name] = step.balloon_bytes
            applied.append(step)
        self.lent = done
        return tuple(applied)
