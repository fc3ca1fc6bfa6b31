"""The `host` section: NodeSpec.host's config units, converged in the fixed order (host-config.md).

Rules (HST-STAT, HST-ORD, HST-COND, HST-RBT, HST-RMV):
- Units run in `bcd_shared.units.ORDER` whatever order the spec lists them in; each unit is one
  action that observes and plans again when it runs, against the host as the units before it left
  it (a module loaded by kernel-modules is seen by sysctl in the same pass).
- No unit holds back another: a failure while planning or applying is recorded and the pass goes
  on. The failures are reported together, each prefixed with its unit's name, joined by "; ".
  PROGRESSING while any failure is retryable (a reboot wait included), FAILED when all are terminal.
- A unit named twice fails the whole section (FAILED, nothing applied: bcd cannot tell which
  settings apply; Q-HST-STAT-01). An unknown unit is a terminal failure of that unit only.
- Conditions: FabricManagerDown, MPSDown, KubernetesTaintsDrift, KubernetesReleased from their units, and
  RebootRequired (reason: the waiting units in unit order, comma-separated; message: their errors
  joined by "; ", cut to 1024 bytes on a UTF-8 boundary). A condition whose fault ended is simply
  not raised (the runner clears it; Q-HST-COND-01). bcd never reboots.
- Units that clean up (sysctl, kernel-modules, cpu, iommu, gpu-sharing, k8s-join) plan their
  clean-up in every pass while absent from the spec: level-triggered, so a restart or a missed pass
  still cleans (Q-HST-RMV-01).
- `[host] units = false`: a section with units is UNSUPPORTED with reason HostManagedExternally
  (the runner does this too; the section never applies a unit then); an empty one is CONVERGED.
- `changed=True` when any unit applied a step, so the runner's next pass and the inventory refresh
  see what the units changed (HST-LVL-13).

Executors: `DirectExecutor` runs units in-process against a `System` (bcd node as root, the
simulated host); `HelperExecutor` sends one `host.unit` per unit that is not converged to the root
helper (bcd node unprivileged), which plans again as root and applies.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from attrs import evolve, field, frozen
from bcd_shared.errors import StepError
from bcd_shared.system import System
from bcd_shared.units import (
    ORDER,
    REBOOT_PHRASE,
    REGISTRY,
    ApplyContext,
    ConfigUnit,
    Issue,
    UnitCondition,
    UnitContext,
    UnitResult,
    acting_as_root,
    converge_unit,
    for_root,
    root_guard,
)
from bcd_shared.units._base import IssueKind

from bcd_agent.converge.types import Condition, SectionOutcome, SectionState

SECTION = "host"
MESSAGE_LIMIT = 1024


@frozen
class HostSection:
    """The domain form of NodeSpec.host: (unit name, settings as canonical JSON) in wire order."""

    units: tuple[tuple[str, str], ...] = field(factory=tuple)

    @classmethod
    def of(cls, units: Sequence[tuple[str, str]]) -> HostSection:
        return cls(tuple((str(n), str(s)) for n, s in units))


class UnitExecutor(Protocol):
    """Runs one unit (settings JSON, or None to clean) and reports its result; never raises StepError."""

    def converge(self, name: str, settings_json: str | None) -> UnitResult: ...


@frozen
class DirectExecutor:
    """In-process: `bcd node` as root, or the simulated host.

    Acting as root (effective uid 0, with no helper between), every write and removal of the units
    follows the root-only rule (HST-ROOT-*): the System is wrapped in `units.RootOnlySystem`, and
    the units' `ApplyContext.guard` is the rootpath check under the System's root when none was
    given. On the simulated host that root is the simulated directory, so its directories must be
    root's and writable by no one else, as `bcd sim` lays them out. Not as root (the simulated host
    under an ordinary user, tests), nothing changes."""

    system: System
    ctx: UnitContext = field(factory=UnitContext)
    actx: ApplyContext = field(factory=ApplyContext)

    def converge(self, name: str, settings_json: str | None) -> UnitResult:
        decoded = _decode(name, settings_json)
        if isinstance(decoded, UnitResult):
            return decoded
        unit, settings = decoded
        system, actx = self.system, self.actx
        if acting_as_root():
            system = for_root(system)
            if actx.guard is None:
                actx = evolve(actx, guard=root_guard(system.root))
        return converge_unit(unit, settings, system, self.ctx, actx)


@frozen
class HelperAnswer:
    """What the helper's `host.unit` answered: ok, or an error text (and whether it is terminal)."""

    ok: bool
    message: str = ""
    terminal: bool = False
    changed: bool = False
    conditions: tuple[UnitCondition, ...] = ()


HelperSend = Callable[[str, str | None, frozenset[str]], HelperAnswer]


@frozen
class HelperExecutor:
    """Unprivileged node beside bcd helper: plan read-only here, send only units not converged.

    The answer comes back as text; `reboot the node` in it marks a reboot wait (HST-RBT-07).
    """

    system: System  # the node's own (read-only) view of the host
    send: HelperSend
    ctx: UnitContext = field(factory=UnitContext)

    def converge(self, name: str, settings_json: str | None) -> UnitResult:
        decoded = _decode(name, settings_json)
        if isinstance(decoded, UnitResult):
            return decoded
        unit, settings = decoded
        try:
            plan = unit.plan(settings, unit.observe(self.system, settings, self.ctx))
        except (StepError, PermissionError):
            # Cannot read it as the node: let root plan it. PermissionError: root's records
            # (/var/lib/bcd-hostconfig, root:root 0700 as install.sh and the helper's unit make it).
            plan = None
        if plan is not None and plan.converged:
            return UnitResult(name, False, (), plan.conditions)
        answer = self.send(name, settings_json, self.ctx.busy_gpus)
        if answer.ok:
            return UnitResult(name, answer.changed, (), answer.conditions)
        kind: IssueKind = "terminal" if answer.terminal else "retryable"
        if not answer.terminal and REBOOT_PHRASE in answer.message:
            kind = "reboot"
        conditions = answer.conditions or (plan.conditions if plan is not None else ())
        return UnitResult(name, answer.changed, (Issue(kind, _prefixed(name, answer.message)),), conditions)


def _decode(name: str, settings_json: str | None) -> tuple[ConfigUnit[Any, Any], Any] | UnitResult:
    """The unit and its decoded settings (None: the unit is cleaned), or the terminal result when the
    settings do not decode."""
    unit = REGISTRY[name]
    try:
        return unit, (None if settings_json is None else unit.decode_settings(settings_json))
    except StepError as exc:
        return UnitResult(name, False, (Issue("terminal", _prefixed(name, exc.message)),))


def _prefixed(name: str, message: str) -> str:
    return message if message.startswith(f"{name}: ") else f"{name}: {message}"


def cut_utf8(text: str, limit: int = MESSAGE_LIMIT) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore")


def run_units(section: HostSection, executor: UnitExecutor) -> tuple[list[UnitResult], list[Issue]]:
    """Every unit in the fixed order (and the clean-up of absent ones); returns results and failures."""
    listed = dict(section.units)
    results: list[UnitResult] = []
    for name in ORDER:
        if name in listed:
            results.append(executor.converge(name, listed[name]))
        elif REGISTRY[name].cleans:
            results.append(executor.converge(name, None))
    failures = [i for r in results for i in r.issues]
    for name, _ in section.units:
        if name not in REGISTRY:
            failures.append(Issue("terminal", f"{name}: not a config unit this bcd knows"))
    return results, failures


def outcome(results: Sequence[UnitResult], failures: Sequence[Issue]) -> SectionOutcome:
    conditions = [Condition(c.type, c.reason, c.message, SECTION) for r in results for c in r.conditions]
    waiting = [(r.name, i.message) for r in results for i in r.issues if i.kind == "reboot"]
    if waiting:
        conditions.append(
            Condition(
                "RebootRequired",
                ",".join(dict.fromkeys(n for n, _ in waiting)),
                cut_utf8("; ".join(m for _, m in waiting)),
                SECTION,
            )
        )
    changed = any(r.changed for r in results)
    if not failures:
        return SectionOutcome(SECTION, SectionState.CONVERGED, conditions=tuple(conditions), changed=changed)
    state = SectionState.FAILED if all(i.kind == "terminal" for i in failures) else SectionState.PROGRESSING
    return SectionOutcome(
        SECTION,
        state,
        reason="UnitsFailed",
        message="; ".join(i.message for i in failures),
        conditions=tuple(conditions),
        changed=changed,
    )


def converge_host(section: HostSection, executor: UnitExecutor, *, host_units: bool = True) -> SectionOutcome:
    """One pass of the host section."""
    if not host_units:
        if section.units:
            return SectionOutcome(
                SECTION,
                SectionState.UNSUPPORTED,
                reason="HostManagedExternally",
                message="this host's configuration is managed outside bcd ([host] units = false)",
            )
        return SectionOutcome(SECTION, SectionState.CONVERGED)
    names = [n for n, _ in section.units]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return SectionOutcome(
            SECTION,
            SectionState.FAILED,
            reason="UnitNamedTwice",
            message="; ".join(
                f"{n}: named twice in the host section; bcd cannot tell which settings apply" for n in twice
            ),
        )
    results, failures = run_units(section, executor)
    return outcome(results, failures)


class HostConverger:
    """The runner's `Section` for `host` (sync: the runner runs it in a worker thread)."""

    name = SECTION

    def __init__(
        self,
        executor_for: Callable[[frozenset[str]], UnitExecutor],
        *,
        host_units: bool = True,
        busy_gpus: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        self._executor_for = executor_for
        self._host_units = host_units
        self._busy = busy_gpus

    def is_empty(self, desired: object | None) -> bool:
        return desired is None or (isinstance(desired, HostSection) and not desired.units)

    def converge(self, desired: object | None, observation: object, ctx: object) -> SectionOutcome:
        section = desired if isinstance(desired, HostSection) else HostSection()
        return converge_host(section, self._executor_for(self._busy()), host_units=self._host_units)


def section_from_json(text: str) -> HostSection:
    """A HostSection from `[{"name": ..., "settings": {...}}, ...]` (bcd sim spec files and tests).

    Settings objects are re-serialised canonically (sorted keys, no spaces), as the wire carries them.
    """
    doc: Any = json.loads(text)
    units = []
    for item in doc:
        settings = item["settings"]
        units.append(
            (
                item["name"],
                settings
                if isinstance(settings, str)
                else json.dumps(settings, sort_keys=True, separators=(",", ":")),
            )
        )
    return HostSection(tuple(units))
