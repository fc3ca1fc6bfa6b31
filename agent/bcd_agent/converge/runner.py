"""The converge runner: every section, in the seeds' order, from one observation, on every pass.

Rules (seeds/delivery.md "Convergence and status"; docs/converge.md):

- A pass reads ONE observation, then calls every section of SECTION_ORDER in order, empty ones
  included, and reports one SectionStatus per section (plus one per unknown NodeSpec field).
- A section without a converger is CONVERGED when empty and UNSUPPORTED otherwise, with the
  condition SectionUnsupported whose reason is the section's NodeSpec field number. With
  `[host] units = false` the host section has no converger: non-empty it is UNSUPPORTED with reason
  HostManagedExternally and no condition.
- TerminalError -> FAILED; RetryableError, HelperRefused, any other exception -> PROGRESSING.
- observed_generation advances to the spec's generation only when no section is PROGRESSING
  (CONVERGED, FAILED and UNSUPPORTED are settled); it never moves backwards.
- Passes run at start, on a new spec, every `retry_interval_s` (30 s) while a section is PROGRESSING,
  every `drift_interval_s` (10 min) after the last pass whatever happened, right after a pass in
  which a section changed the host (bounded), and on `trigger(reason)` (events of other parts).
- Status is published to a StatusCell, latest wins. Conditions keep the monotonic time they were
  first raised across passes; reports carry their age.

No module-level mutable state: everything lives in the ConvergeRunner, started with
`await nursery.start(runner.run)`. Time comes from `clock` (trio's clock by default, so MockClock
drives it in tests).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

import attrs
import trio
from bcd_shared.errors import RetryableError, TerminalError

from bcd_agent.converge.section import Observation, Observer, PassContext, Section
from bcd_agent.converge.status import StatusCell
from bcd_agent.converge.types import (
    CONDITION_SECTION_UNSUPPORTED,
    REASON_HOST_MANAGED_EXTERNALLY,
    SECTION_FIELD_NUMBERS,
    SECTION_ORDER,
    Condition,
    DesiredSpec,
    InstancesReport,
    NodeStatus,
    SectionOutcome,
    SectionState,
    SectionStatus,
)

log = logging.getLogger("bcd.converge")

RETRY_INTERVAL_S = 30.0
DRIFT_INTERVAL_S = 600.0
# A pass in which a section changed the host is followed at once by another (so the next section
# sees it); at most this many in a row, so a section that changes something on every pass cannot
# spin the runner.
MAX_FOLLOW_UP_PASSES = 3
# Bounds an asynchronous section's converge (a driver install builds kernel modules: 30 minutes).
SECTION_TIMEOUT_S = 40 * 60.0

REASON_INTERNAL_ERROR = "InternalError"
REASON_TIMEOUT = "Timeout"
REASON_OBSERVATION_FAILED = "ObservationFailed"

# Pass reasons (PassContext.reasons).
TRIGGER_START = "start"
TRIGGER_SPEC = "spec"
TRIGGER_RETRY = "retry"
TRIGGER_DRIFT = "drift"
TRIGGER_CHANGED = "changed"


def payload_is_empty(payload: object | None) -> bool:
    """Emptiness of a section that has no converger: None, or a sized payload of length 0."""
    if payload is None:
        return True
    try:
        return len(payload) == 0  # type: ignore[arg-type]
    except TypeError:
        return False


@attrs.define
class _Result:
    outcome: SectionOutcome
    # True when the section raised: its conditions of the previous pass are kept.
    keep_previous_conditions: bool = False


def _raised(name: str, state: SectionState, reason: str, message: str) -> _Result:
    """The outcome of a section that raised (or answered nonsense): its previous conditions are kept."""
    return _Result(
        SectionOutcome(section=name, state=state, reason=reason, message=message),
        keep_previous_conditions=True,
    )


class ConvergeRunner:
    """Converges a DesiredSpec with the given sections; publishes NodeStatus to `status`."""

    def __init__(
        self,
        sections: Sequence[Section],
        observe: Observer,
        *,
        host_units: bool = True,
        initial_spec: DesiredSpec | None = None,
        status: StatusCell | None = None,
        clock: Callable[[], float] = trio.current_time,
        retry_interval_s: float = RETRY_INTERVAL_S,
        drift_interval_s: float = DRIFT_INTERVAL_S,
        section_timeout_s: float = SECTION_TIMEOUT_S,
        sync_sections_in_thread: bool = True,
        on_pass: Callable[[float, NodeStatus], None] | None = None,
    ) -> None:
        by_name: dict[str, Section] = {}
        for section in sections:
            if section.name not in SECTION_ORDER:
                raise ValueError(f"section {section.name!r} is not one of {SECTION_ORDER}")
            if section.name in by_name:
                raise ValueError(f"two convergers for section {section.name!r}")
            by_name[section.name] = section
        self._sections: Mapping[str, Section] = by_name
        self._observe = observe
        self._host_units = host_units
        self._spec = initial_spec
        self.status = status if status is not None else StatusCell()
        self._clock = clock
        self._retry_interval_s = retry_interval_s
        self._drift_interval_s = drift_interval_s
        self._section_timeout_s = section_timeout_s
        self._sync_in_thread = sync_sections_in_thread
        # Told each pass's wall duration in seconds and its status (bcd's own metrics, docs/telemetry.md).
        self._on_pass = on_pass

        self._pending: set[str] = set()
        self._wake = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._pass_lock = trio.Lock()
        self._passes = 0
        self._version = 0
        self._audit_head: tuple[int, str] | None = None
        self._observed_generation = 0
        self._last_pass: float | None = None
        self._follow_ups = 0
        self._statuses: tuple[SectionStatus, ...] = ()
        self._conditions: dict[tuple[str, str], Condition] = {}
        self._section_conditions: dict[str, tuple[Condition, ...]] = {}
        self._instances: InstancesReport | None = None
        # Conditions of parts other than the sections (the XID watcher), by source: set_conditions.
        self._external: dict[str, tuple[Condition, ...]] = {}

    # --- inputs -------------------------------------------------------------------------------

    @property
    def spec(self) -> DesiredSpec | None:
        return self._spec

    @property
    def observed_generation(self) -> int:
        return self._observed_generation

    def set_spec(self, spec: DesiredSpec) -> bool:
        """Hold `spec` and run a pass for it. A generation not above the held one is ignored
        (False); the session filters those already, this is the runner's own guard."""
        held = self._spec
        if held is not None and spec.generation <= held.generation:
            if spec.generation < held.generation or spec.spec_hash != held.spec_hash:
                log.warning(
                    "converge: ignored spec generation %d (hash %s): holding generation %d",
                    spec.generation,
                    spec.spec_hash,
                    held.generation,
                )
            return False
        self._spec = spec
        self.trigger(TRIGGER_SPEC)
        return True

    def trigger(self, reason: str) -> None:
        """Ask for a pass (an event of another part: devices freed, a reaper, an operator).

        Safe to call from the runner's trio run or, once `run` started, from a worker thread."""
        if trio.lowlevel.in_trio_run() or self._token is None:
            self._trigger(reason)
        else:
            trio.from_thread.run_sync(self._trigger, reason, trio_token=self._token)

    def _trigger(self, reason: str) -> None:
        self._pending.add(reason)
        self._wake.set()

    # --- the service --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """The runner's loop; start it with `await nursery.start(runner.run)`."""
        self._token = trio.lowlevel.current_trio_token()
        if self._version == 0:
            self._publish()
        if self._spec is not None:
            self._pending.add(TRIGGER_START)
        task_status.started()
        while True:
            if not self._pending:
                deadline, timer_reason = self._next_deadline()
                with trio.move_on_at(deadline):
                    await self._wake.wait()
                if not self._pending:
                    self._pending.add(timer_reason)
            self._wake = trio.Event()
            reasons = frozenset(self._pending)
            self._pending.clear()
            if self._spec is None:
                continue
            await self.converge_once(reasons)

    def next_pass(self) -> tuple[float, str]:
        """When (the runner's clock) and why the next timed pass runs: `retry` while a section is
        PROGRESSING, else `drift`; infinity before a spec (`bcd status`)."""
        return self._next_deadline()

    def _next_deadline(self) -> tuple[float, str]:
        if self._spec is None or self._last_pass is None:
            return math.inf, TRIGGER_START
        drift = self._last_pass + self._drift_interval_s
        if any(s.state is SectionState.PROGRESSING for s in self._statuses):
            retry = self._last_pass + self._retry_interval_s
            if retry < drift:
                return retry, TRIGGER_RETRY
        return drift, TRIGGER_DRIFT

    # --- one pass -----------------------------------------------------------------------------

    async def converge_once(self, reasons: frozenset[str] = frozenset({"manual"})) -> NodeStatus:
        """Run one pass now (the loop's passes, `bcd bench converge`, tests) and publish its status."""
        async with self._pass_lock:
            spec = self._spec
            if spec is None:
                raise RuntimeError("converge_once: the runner holds no spec")
            self._passes += 1
            started = time.perf_counter()
            now = self._clock()
            ctx = PassContext(spec=spec, pass_number=self._passes, reasons=reasons, now_monotonic=now)
            observation = await self._take_observation()
            results = [await self._converge_section(name, spec, observation, ctx) for name in SECTION_ORDER]
            results.extend(self._unknown_field(number) for number in sorted(spec.unknown_fields))
            self._last_pass = self._clock()
            self._record(spec, results, now)
            self._plan_follow_up(reasons, results)
            status = self._publish()
            if self._on_pass is not None:
                try:
                    self._on_pass(time.perf_counter() - started, status)
                except Exception:
                    log.warning("converge: the pass observer failed", exc_info=True)
            return status

    async def _take_observation(self) -> Observation:
        try:
            return await self._observe()
        except Exception as e:
            # The observer's own failure (its readers' failures are per part): every section that
            # reads a part goes PROGRESSING with this error, and the next pass retries.
            log.warning("converge: the observation failed: %s: %s", type(e).__name__, e, exc_info=True)
            error = RetryableError(
                REASON_OBSERVATION_FAILED, f"observing the host failed: {type(e).__name__}: {e}"
            )
            return Observation(failure=error, taken_monotonic=self._clock())

    async def _converge_section(
        self, name: str, spec: DesiredSpec, observation: Observation, ctx: PassContext
    ) -> _Result:
        payload = spec.payload(name)
        section = self._sections.get(name)
        if name == "host" and not self._host_units:
            if self._is_empty(section, payload):
                return _Result(SectionOutcome(section=name, state=SectionState.CONVERGED))
            return _Result(
                SectionOutcome(
                    section=name,
                    state=SectionState.UNSUPPORTED,
                    reason=REASON_HOST_MANAGED_EXTERNALLY,
                    message="this host's configuration is managed outside bcd ([host] units = false)",
                )
            )
        if section is None:
            if self._is_empty(None, payload):
                return _Result(SectionOutcome(section=name, state=SectionState.CONVERGED))
            return _Result(self._unsupported(name, SECTION_FIELD_NUMBERS[name]))
        try:
            outcome = await self._call(section, payload, observation, ctx)
        except TerminalError as e:
            return _raised(name, SectionState.FAILED, e.reason, e.message)
        except RetryableError as e:
            return _raised(name, SectionState.PROGRESSING, e.reason, e.message)
        except _SectionTimeout:
            return _raised(
                name,
                SectionState.PROGRESSING,
                REASON_TIMEOUT,
                f"the {name} section did not finish within {self._section_timeout_s:g} s",
            )
        except Exception as e:
            log.warning("converge: section %s raised unexpectedly; retrying", name, exc_info=True)
            return _raised(name, SectionState.PROGRESSING, REASON_INTERNAL_ERROR, f"{type(e).__name__}: {e}")
        if not isinstance(outcome, SectionOutcome) or outcome.section != name:
            log.warning("converge: section %s returned %r, not its SectionOutcome", name, outcome)
            return _raised(
                name,
                SectionState.PROGRESSING,
                REASON_INTERNAL_ERROR,
                f"the {name} converger returned {type(outcome).__name__}, not its SectionOutcome",
            )
        return _Result(outcome)

    def _is_empty(self, section: Section | None, payload: object | None) -> bool:
        if section is None:
            return payload_is_empty(payload)
        return section.is_empty(payload)

    async def _call(
        self, section: Section, payload: object | None, observation: Observation, ctx: PassContext
    ) -> object:
        if inspect.iscoroutinefunction(section.converge):
            result: object = None
            with trio.move_on_after(self._section_timeout_s) as scope:
                result = await section.converge(payload, observation, ctx)
            if scope.cancelled_caught:
                raise _SectionTimeout
            return result
        if self._sync_in_thread:
            return await trio.to_thread.run_sync(section.converge, payload, observation, ctx)
        outcome = section.converge(payload, observation, ctx)
        if inspect.isawaitable(outcome):
            return await outcome
        return outcome

    def _unsupported(self, name: str, number: int) -> SectionOutcome:
        reason = str(number)
        what = f"the {name} section" if name in SECTION_FIELD_NUMBERS else f"NodeSpec field {number}"
        message = f"bcd has no converger for {what}"
        return SectionOutcome(
            section=name,
            state=SectionState.UNSUPPORTED,
            reason=reason,
            message=message,
            conditions=(
                Condition(type=CONDITION_SECTION_UNSUPPORTED, reason=reason, message=message, section=name),
            ),
        )

    def _unknown_field(self, number: int) -> _Result:
        # A NodeSpec field this bcd does not know: reported under its number (DLV-CONV-06).
        return _Result(self._unsupported(str(number), number))

    # --- bookkeeping --------------------------------------------------------------------------

    def _record(self, spec: DesiredSpec, results: list[_Result], now: float) -> None:
        statuses: list[SectionStatus] = []
        raised: list[Condition] = []
        for result in results:
            o = result.outcome
            statuses.append(
                SectionStatus(
                    section=o.section,
                    state=o.state,
                    generation=spec.generation,
                    reason=o.reason,
                    message=o.message,
                )
            )
            conditions = (
                self._section_conditions.get(o.section, ()) if result.keep_previous_conditions else ()
            )
            conditions = conditions + tuple(
                c if c.section else attrs.evolve(c, section=o.section) for c in o.conditions
            )
            self._section_conditions[o.section] = conditions
            raised.extend(conditions)
            if o.instances is not None:
                self._instances = o.instances
            elif result.keep_previous_conditions and o.section == "instances" and self._instances is not None:
                # The section raised: its last listing is kept but no longer known to be complete.
                self._instances = attrs.evolve(self._instances, complete=False)
            self._log_outcome(spec, o)
        merged: dict[tuple[str, str], Condition] = {}
        for c in raised:
            key = (c.type, c.section)
            if key in merged:
                continue
            previous = self._conditions.get(key)
            if previous is not None:
                since = previous.since_monotonic
            elif c.since_monotonic > 0:
                since = c.since_monotonic
            else:
                since = now
            merged[key] = attrs.evolve(c, since_monotonic=since)
        self._conditions = merged
        self._statuses = tuple(statuses)
        if all(s.state.settled for s in statuses) and spec.generation > self._observed_generation:
            self._observed_generation = spec.generation

    def _log_outcome(self, spec: DesiredSpec, o: SectionOutcome) -> None:
        if o.state is SectionState.FAILED:
            log.error(
                "converge: section %s FAILED at generation %d: %s: %s",
                o.section,
                spec.generation,
                o.reason,
                o.message,
            )
        elif o.state is SectionState.PROGRESSING:
            log.warning(
                "converge: section %s PROGRESSING at generation %d, retrying in %g s: %s: %s",
                o.section,
                spec.generation,
                self._retry_interval_s,
                o.reason,
                o.message,
            )

    def _plan_follow_up(self, reasons: frozenset[str], results: list[_Result]) -> None:
        changed = [r.outcome.section for r in results if r.outcome.changed]
        if not changed:
            self._follow_ups = 0
            return
        self._follow_ups = self._follow_ups + 1 if reasons == {TRIGGER_CHANGED} else 1
        if self._follow_ups <= MAX_FOLLOW_UP_PASSES:
            self._pending.add(TRIGGER_CHANGED)
            self._wake.set()
        else:
            log.warning(
                "converge: sections %s changed the host in %d passes in a row; waiting for the next trigger",
                ",".join(changed),
                self._follow_ups,
            )

    def set_audit_head(self, head: tuple[int, str]) -> None:
        """The helper's audit head as just read: published at once with the current status (a new
        version, no pass), so the next StatusReport carries it (docs/helper.md "Audit log")."""
        if head == self._audit_head:
            return
        self._audit_head = head
        if self._version:
            self._publish()

    def set_conditions(self, source: str, conditions: tuple[Condition, ...]) -> None:
        """The conditions a part other than the sections raises (the XID watcher, nodeparts.xid), all of
        them each time: they replace that source's previous ones and are published at once (a new
        version, no pass), so a cleared one leaves the next StatusReport and status.json."""
        if self._external.get(source, ()) == conditions:
            return
        if conditions:
            self._external[source] = conditions
        else:
            self._external.pop(source, None)
        if self._version:
            self._publish()

    def _publish(self) -> NodeStatus:
        self._version += 1
        spec = self._spec
        status = NodeStatus(
            version=self._version,
            applied_generation=spec.generation if spec is not None else 0,
            observed_generation=self._observed_generation,
            spec_hash=spec.spec_hash if spec is not None else "",
            sections=self._statuses,
            conditions=(*self._conditions.values(), *(c for cs in self._external.values() for c in cs)),
            passes=self._passes,
            last_pass_monotonic=self._last_pass if self._last_pass is not None else -math.inf,
            instances=self._instances,
            audit_head=self._audit_head,
        )
        self.status.publish(status)
        return status


class _SectionTimeout(Exception):
    pass


__all__ = [
    "DRIFT_INTERVAL_S",
    "RETRY_INTERVAL_S",
    "ConvergeRunner",
    "Observation",
    "Observer",
    "PassContext",
    "Section",
    "payload_is_empty",
]
