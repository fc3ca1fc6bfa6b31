"""The `telemetry` converger (DLV-CONV-08): drives the OTLP export of bcd's own metrics.

`converge` is asynchronous and awaited in the runner's task; it never waits on the network. It reads the
section strictly (model.from_wire), plans against what the exporter runs (plan.plan) and applies:
`Configure`/`Stop` call the exporter (immediate, in memory), `FetchHeaders` starts a SecretRequest in the
section's own task (`run`) with workflow `telemetry`, step `headers_secret_ref`; when the answer comes, the
section asks the runner for a pass (`trigger("telemetry")`), which configures the exporter.

Only the headers of the reference the spec names are kept; the secret's value lives in memory only and
is never logged or reported.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from bcd_shared.errors import RetryableError, TerminalError

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import SectionOutcome
from bcd_agent.sections.telemetry.exporter import Exporter
from bcd_agent.sections.telemetry.headers import parse_headers
from bcd_agent.sections.telemetry.model import TelemetrySpec, from_wire
from bcd_agent.sections.telemetry.plan import (
    Configure,
    FetchHeaders,
    HeadersFailed,
    HeadersLoaded,
    HeadersPending,
    HeadersState,
    Observed,
    Plan,
    Stop,
    plan,
)

log = logging.getLogger("bcd.telemetry")

SECTION = "telemetry"
WORKFLOW_TELEMETRY = "telemetry"
STEP_HEADERS = "headers_secret_ref"
TRIGGER_HEADERS = "telemetry"

# fetch(ref) -> the secret's value; raises TerminalError (refused) or RetryableError (unavailable).
Fetch = Callable[[str], Awaitable[bytes]]


class TelemetrySection:
    name = SECTION

    def __init__(
        self,
        exporter: Exporter,
        fetch: Fetch | None,
        trigger: Callable[[str], None],
        base_resource: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.exporter = exporter
        self._fetch = fetch
        self._trigger = trigger
        self.base_resource = base_resource
        self._headers: dict[str, HeadersState] = {}
        self._nursery: trio.Nursery | None = None
        self._generation = 0
        exporter.on_auth_failure = self._headers_rejected

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Holds the nursery headers are fetched in; start it before the runner."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def is_empty(self, desired: object | None) -> bool:
        try:
            return from_wire(desired) is None
        except TerminalError:
            return False

    def observe(self, spec: TelemetrySpec | None) -> Observed:
        ref = spec.headers_secret_ref if spec is not None else ""
        return Observed(self.exporter.config, self._headers.get(ref) if ref else None)

    def plan(self, desired: object | None) -> Plan:
        spec = from_wire(desired)
        return plan(spec, self.observe(spec), self.base_resource)

    async def converge(
        self, desired: object | None, observation: Observation, ctx: PassContext
    ) -> SectionOutcome:
        try:
            spec = from_wire(desired)
        except TerminalError:
            # InvalidTelemetry -> FAILED. The previous generation's export stops too: bcd sends nothing
            # the current spec does not ask for.
            self.exporter.configure(None)
            raise
        wanted = spec.headers_secret_ref if spec is not None else ""
        new_generation = ctx.generation != self._generation
        self._generation = ctx.generation
        for ref, state in list(self._headers.items()):
            # Only the named reference's headers are kept; a refusal is terminal for its generation only
            # (a new spec asks again, the broker may release it now).
            stale = isinstance(state, HeadersFailed) and state.terminal and new_generation
            if ref != wanted or stale:
                del self._headers[ref]
        the_plan = plan(spec, self.observe(spec), self.base_resource)
        for step in the_plan.steps:
            if isinstance(step, Configure):
                self.exporter.configure(step.config)
            elif isinstance(step, Stop):
                self.exporter.configure(None)
            elif isinstance(step, FetchHeaders):
                self._start_fetch(step.ref)
        # The exporter is bcd's own state, not the host's: `changed` stays False (no follow-up pass).
        return SectionOutcome(SECTION, the_plan.state, the_plan.reason, the_plan.message)

    def _headers_rejected(self) -> None:
        """The endpoint answered 401/403: forget the loaded headers so the next pass fetches them again
        (the secret may have been rotated). A fetch already under way is left to finish."""
        for ref, state in list(self._headers.items()):
            if isinstance(state, HeadersLoaded):
                log.warning("telemetry: the endpoint refused the headers of %s; fetching them again", ref)
                del self._headers[ref]
                self._trigger(TRIGGER_HEADERS)

    def _start_fetch(self, ref: str) -> None:
        if self._fetch is None or self._nursery is None:
            raise RetryableError("SecretUnavailable", f"{ref}: this node cannot ask for secrets")
        self._headers[ref] = HeadersPending()
        self._nursery.start_soon(self._fetch_headers, ref)

    async def _fetch_headers(self, ref: str) -> None:
        assert self._fetch is not None
        state: HeadersState
        try:
            state = HeadersLoaded(parse_headers(await self._fetch(ref), ref))
        except TerminalError as exc:
            state = HeadersFailed(exc.reason, exc.message, terminal=True)
        except RetryableError as exc:
            state = HeadersFailed(exc.reason, exc.message, terminal=False)
        except Exception as exc:  # a bug must not stop the node: retried on the next pass
            log.warning("telemetry: fetching the export headers %s failed", ref, exc_info=True)
            state = HeadersFailed("InternalError", f"{type(exc).__name__}: {exc}", terminal=False)
        if isinstance(state, HeadersFailed):
            log.warning("telemetry: the export headers %s: %s", ref, state.message)
        if isinstance(self._headers.get(ref), HeadersPending):
            self._headers[ref] = state
            self._trigger(TRIGGER_HEADERS)
