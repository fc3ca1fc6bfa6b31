"""mig-layout: every MIG-capable GPU partitioned to one layout (HST-MIG-*).

Grammar: `all-disabled`; `all-<profile>` (as many as fit on an empty GPU, from `mig -lgip`);
`mixed:[<n>x]<profile>+...` (a count 1..8, 1..8 instances in all). A profile is `<n>g.<m>gb`, so
profiles with their own `+` (1g.10gb+me) cannot be expressed. A layout that does not parse, or a
profile the GPU does not have, is terminal. A GPU a live hold uses is left alone; the others are
repartitioned and the unit then fails retryably. A busy GPU that is already at the layout needs
nothing, so it does not fail the unit (holds on MIG instances the layout made keep it converged).

Decisions: Q-HST-MIG-01 instances are destroyed with `nvidia-smi mig -i <i> -dci` then `-dgi`
("Not Found" counts as done); "largest first" orders by compute slices, then memory; the reset
message is `mig-layout: MIG mode of GPU <i> waits for a GPU reset, which failed (reboot the node)`.
Q-HST-MIG-02 `all-disabled` destroys instances before turning MIG off; a busy GPU keeps its mode;
GPU instances are compared by profile names only (the compute-instance split is not checked).
The unit takes up to three rounds in one action: MIG mode first, then the instances once the
profiles can be listed.
"""

from __future__ import annotations

import re
from typing import Any

from attrs import frozen

from bcd_shared.errors import RetryableError
from bcd_shared.system import System

from ._base import ApplyContext, Fields, Issue, Plan, RebootRequired, Run, Step, refuse
from ._unit import ConfigUnit, UnitContext
from .nvsmi import MIG_QUERY, MigProfile, parse_lgi, parse_lgip, query

NAME = "mig-layout"
PROFILE_RE = r"[0-9]+g\.[0-9]+gb"


@frozen
class Layout:
    kind: str  # "disabled" | "all" | "mixed"
    profiles: tuple[tuple[str, int], ...] = ()  # (profile, count)


def parse_layout(text: str) -> Layout:
    if text == "all-disabled":
        return Layout("disabled")
    if text.startswith("all-"):
        prof = text[4:]
        if not re.fullmatch(PROFILE_RE, prof):
            raise refuse(f"layout: {prof!r} is not a MIG profile (<n>g.<m>gb)")
        return Layout("all", ((prof, 0),))
    if text.startswith("mixed:"):
        terms = text[6:].split("+")
        out: list[tuple[str, int]] = []
        for term in terms:
            m = re.fullmatch(rf"(?:([0-9]+)x)?({PROFILE_RE})", term)
            if not m:
                raise refuse(f"layout: {term!r} is not [<n>x]<n>g.<m>gb")
            n = int(m.group(1)) if m.group(1) else 1
            if not 1 <= n <= 8:
                raise refuse(f"layout: the count {n} of {m.group(2)} is outside 1 to 8")
            out.append((m.group(2), n))
        total = sum(n for _, n in out)
        if not 1 <= total <= 8:
            raise refuse(f"layout: {total} instances; a layout holds 1 to 8")
        return Layout("mixed", tuple(out))
    raise refuse(f"layout: {text!r} is not all-disabled, all-<profile> or mixed:<profiles>")


def size_key(profile: str) -> tuple[int, int]:
    m = re.fullmatch(r"([0-9]+)g\.([0-9]+)gb", profile)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def largest_first(profiles: list[str]) -> tuple[str, ...]:
    return tuple(sorted(profiles, key=lambda p: (-size_key(p)[0], -size_key(p)[1], p)))


def gpu_of(device_id: str) -> str:
    """`<uuid>/gi<n>/ci<m>` and `<uuid>/s<n>` belong to GPU `<uuid>`."""
    return device_id.split("/", 1)[0]


@frozen
class MigSettings:
    layout: str = ""
    parsed: Layout | None = None
    source: str | None = None


@frozen
class MigGpu:
    index: str
    uuid: str
    current: str
    pending: str
    profiles: tuple[MigProfile, ...]  # () while MIG is off
    instances: tuple[str, ...]


@frozen
class MigObserved:
    gpus: tuple[MigGpu, ...] | None
    busy: frozenset[str]
    why: tuple[tuple[str, str], ...] = ()  # UnitContext.busy_reasons: the helper's reasons, for the message


@frozen
class SetMigMode:
    index: str
    on: bool

    def describe(self) -> str:
        return f"turn MIG mode {'on' if self.on else 'off'} on GPU {self.index}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        res = system.run(["nvidia-smi", "-i", self.index, "-mig", "1" if self.on else "0"])
        if not res.ok:
            raise RetryableError(
                "MigMode", f"mig-layout: cannot set MIG mode on GPU {self.index}: {res.describe()}"
            )
        want = "Enabled" if self.on else "Disabled"
        rows = query(system, MIG_QUERY) or []
        current = next((r[2] for r in rows if r[0] == self.index), "")
        if current == want:
            return
        reset = system.run(["nvidia-smi", "--gpu-reset", "-i", self.index])
        rows = query(system, MIG_QUERY) or []
        current = next((r[2] for r in rows if r[0] == self.index), "")
        if not reset.ok or current != want:
            raise RebootRequired(
                f"mig-layout: MIG mode of GPU {self.index} waits for a GPU reset, "
                "which failed (reboot the node)"
            )


@frozen
class Repartition:
    index: str
    profiles: tuple[str, ...]

    def describe(self) -> str:
        return f"partition GPU {self.index} as {'+'.join(self.profiles) or 'nothing'}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        nf = ("Not Found", "not found")
        Run(
            ("nvidia-smi", "mig", "-i", self.index, "-dci"),
            ok_stderr=nf,
            message="destroying compute instances",
        ).apply(system, actx)
        Run(
            ("nvidia-smi", "mig", "-i", self.index, "-dgi"), ok_stderr=nf, message="destroying GPU instances"
        ).apply(system, actx)
        if self.profiles:
            Run(
                ("nvidia-smi", "mig", "-i", self.index, "-cgi", ",".join(self.profiles), "-C"),
                message=f"creating GPU instances on GPU {self.index}",
            ).apply(system, actx)


def _gpu_steps(layout: Layout, g: MigGpu) -> list[Step] | Issue:
    """What one GPU needs to reach the layout: steps (none when it is there), or a terminal issue."""
    if layout.kind == "disabled":
        out: list[Step] = []
        if g.instances:
            out.append(Repartition(g.index, ()))
        if g.current != "Disabled":
            out.append(SetMigMode(g.index, False))
        return out
    if g.current != "Enabled":
        return [SetMigMode(g.index, True)]
    known = {p.name: p for p in g.profiles}
    wanted: list[str] = []
    for prof, count in layout.profiles:
        if prof not in known:
            return Issue("terminal", f"mig-layout: GPU {g.index} has no MIG profile {prof}")
        wanted.extend([prof] * (known[prof].total if layout.kind == "all" else count))
    if tuple(sorted(wanted)) != g.instances:
        return [Repartition(g.index, largest_first(wanted))]
    return []


class MigLayout(ConfigUnit[MigSettings, MigObserved]):
    name = NAME

    def decode(self, obj: dict[str, Any]) -> MigSettings:
        f = Fields(obj)
        source = f.choice("from", ("pool", "profile"))
        layout = f.string("layout", max_len=256) or ""
        f.done()
        return MigSettings(layout, parse_layout(layout) if layout else None, source)

    def observe(self, system: System, settings: MigSettings | None, ctx: UnitContext) -> MigObserved:
        if settings is None or settings.parsed is None:
            return MigObserved((), frozenset())
        rows = query(system, MIG_QUERY)
        if rows is None:
            return MigObserved(None, frozenset())
        lgip: dict[int, tuple[MigProfile, ...]] = {}
        lgi: dict[int, tuple[str, ...]] = {}
        if any(r[2] == "Enabled" for r in rows):
            res = system.run(["nvidia-smi", "mig", "-lgip"])
            lgip = parse_lgip(res.stdout.decode(errors="replace")) if res.ok else {}
            res = system.run(["nvidia-smi", "mig", "-lgi"])
            lgi = parse_lgi(res.stdout.decode(errors="replace"))
        gpus = []
        for idx, uuid, cur, pend in rows:
            if cur not in ("Enabled", "Disabled"):
                continue  # HST-MIG-12: not MIG-capable
            i = int(idx)
            gpus.append(MigGpu(idx, uuid, cur, pend, lgip.get(i, ()), lgi.get(i, ())))
        return MigObserved(tuple(gpus), frozenset(gpu_of(d) for d in ctx.busy_gpus), ctx.busy_reasons)

    def plan(self, settings: MigSettings | None, observed: MigObserved) -> Plan:
        if settings is None or settings.parsed is None:
            return Plan()  # HST-RMV-05, HST-MIG-02
        if observed.gpus is None:
            return Plan(
                (),
                (Issue("retryable", "mig-layout: nvidia-smi does not answer yet (is the driver loaded?)"),),
            )
        layout = settings.parsed
        steps: list[Step] = []
        busy: list[str] = []
        for g in observed.gpus:
            wanted = _gpu_steps(layout, g)
            if g.uuid in observed.busy:
                if wanted != []:  # a busy GPU already at the layout is simply converged
                    busy.append(g.uuid)
                continue
            if isinstance(wanted, Issue):
                return Plan((), (wanted,))
            steps.extend(wanted)
        issues = []
        if busy:
            message = f"mig-layout: {', '.join(busy)} hold allocations; they are repartitioned once those end"
            why = [w for g, w in observed.why if g in busy]
            if why:  # the helper's own reasons (a VM's GPU holds no allocation)
                message += f" ({'; '.join(dict.fromkeys(why))})"
            issues.append(Issue("retryable", message))
        return Plan(tuple(steps), tuple(issues))


UNIT = MigLayout()
