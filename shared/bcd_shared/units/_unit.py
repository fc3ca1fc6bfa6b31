"""The unit interface and the one-unit runner both `bcd node` (as root) and `bcd helper` use."""

from __future__ import annotations

import abc
from typing import Any, Generic, TypeVar

from attrs import field, frozen

from bcd_shared.errors import StepError
from bcd_shared.system import System

from ._base import REBOOT_PHRASE, ApplyContext, Issue, IssueKind, Plan, UnitCondition, load_object

S = TypeVar("S")
Obs = TypeVar("Obs")


@frozen
class ClusterPin:
    """One `[kubernetes] allowed_clusters` entry: an API server and its CA pin."""

    server: str  # normalised: https://host:port
    ca_sha256: str  # 64 lowercase hex digits


@frozen
class UnitContext:
    """What a unit needs beyond its settings and the host.

    busy_gpus: device ids live holds use (GPU UUIDs, `<uuid>/gi<n>/ci<m>`, `<uuid>/s<n>`).
    busy_reasons: (GPU UUID, why it is busy) as the helper read it (root's busy view), so that a unit
    leaving a GPU alone says why; the node passes none.
    allowed_clusters: root's `[kubernetes] allowed_clusters` (the helper passes its own).
    identity_labels: `bcd.dev/node-id`, `bcd.dev/site`, `bcd.dev/gpu.*` that k8s-join keeps.
    """

    busy_gpus: frozenset[str] = frozenset()
    busy_reasons: tuple[tuple[str, str], ...] = ()
    allowed_clusters: tuple[ClusterPin, ...] = ()
    identity_labels: tuple[tuple[str, str], ...] = ()


class ConfigUnit(abc.ABC, Generic[S, Obs]):
    """One config unit. Subclasses implement decode/observe/plan; the rest is shared."""

    name: str = ""
    # Units whose state is only bcd's own files clean up when they leave the spec (HST-RMV-*).
    cleans: bool = False
    # How many observe-plan-apply rounds one action may take (MIG mode before instances).
    max_rounds: int = 3

    def decode_settings(self, raw: str | bytes) -> S:
        """Strictly decode and validate canonical JSON settings (TerminalError on any fault)."""
        return self.decode(load_object(raw))

    @abc.abstractmethod
    def decode(self, obj: dict[str, Any]) -> S:
        """Settings from the decoded JSON object (unknown fields refused)."""

    def validate(self, settings: S, ctx: UnitContext) -> None:
        """Checks that need the node's context (root's allowlist); decoding did the rest."""

    @abc.abstractmethod
    def observe(self, system: System, settings: S | None, ctx: UnitContext) -> Obs:
        """What the host shows now, read through `system`."""

    @abc.abstractmethod
    def plan(self, settings: S | None, observed: Obs) -> Plan:
        """Pure. `settings` None plans the clean-up of a unit that left the spec."""

    def apply(self, system: System, plan: Plan, actx: ApplyContext) -> None:
        for step in plan.steps:
            step.apply(system, actx)


@frozen
class UnitResult:
    """One unit's outcome in a pass."""

    name: str
    changed: bool = False
    issues: tuple[Issue, ...] = ()
    conditions: tuple[UnitCondition, ...] = ()
    steps_done: tuple[str, ...] = field(factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.issues


def _prefixed(name: str, message: str) -> str:
    return message if message.startswith(f"{name}: ") else f"{name}: {message}"


def converge_unit(
    unit: ConfigUnit[Any, Any],
    settings: Any | None,
    system: System,
    ctx: UnitContext,
    actx: ApplyContext,
) -> UnitResult:
    """Observe, plan, apply what differs, and plan again; never raises StepError.

    `settings` are decoded settings, or None to clean a unit that left the spec. Terminal issues
    apply nothing (settings are never half applied).
    """
    done: list[str] = []
    changed = False
    plan = Plan()
    try:
        if settings is not None:
            unit.validate(settings, ctx)
        for _ in range(unit.max_rounds):
            plan = unit.plan(settings, unit.observe(system, settings, ctx))
            if plan.terminal or not plan.steps:
                break
            for step in plan.steps:
                step.apply(system, actx)
                done.append(step.describe())
                changed = True
            if plan.stop_after:
                plan = unit.plan(settings, unit.observe(system, settings, ctx))
                after = plan.issues or (
                    Issue("retryable", f"{unit.name}: installed packages; the next pass plans the rest"),
                )
                return UnitResult(unit.name, changed, _fix(unit.name, after), plan.conditions, tuple(done))
        else:
            plan = unit.plan(settings, unit.observe(system, settings, ctx))
    except StepError as exc:
        kind: IssueKind = "terminal" if exc.terminal else "retryable"
        if not exc.terminal and (exc.reason == "RebootRequired" or REBOOT_PHRASE in exc.message):
            kind = "reboot"
        conditions: tuple[UnitCondition, ...] = ()
        if changed:
            try:  # the conditions still follow the host as the failed step left it
                conditions = unit.plan(settings, unit.observe(system, settings, ctx)).conditions
            except StepError:
                conditions = plan.conditions
        else:
            conditions = plan.conditions
        issue = Issue(kind, _prefixed(unit.name, exc.message))
        return UnitResult(unit.name, changed, (issue,), conditions, tuple(done))
    issues = list(plan.issues)
    if plan.steps and not plan.terminal:
        issues.append(Issue("retryable", f"{unit.name}: not converged yet: {plan.steps[0].describe()}"))
    return UnitResult(unit.name, changed, _fix(unit.name, tuple(issues)), plan.conditions, tuple(done))


def _fix(name: str, issues: tuple[Issue, ...]) -> tuple[Issue, ...]:
    return tuple(Issue(i.kind, _prefixed(name, i.message)) for i in issues)
