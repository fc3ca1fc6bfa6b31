"""The telemetry section's pure planner: `plan(desired, observed) -> Plan` (no I/O, no trio).

The exporter is the "host" this section converges: the config it runs (endpoint URL, interval, resource
attributes, headers) is what is observed; the desired config follows from the section and the headers
secret. Steps:

- `FetchHeaders(ref)`: ask the control plane for the headers secret (a SecretRequest). It runs off the
  pass (the section never waits on the network); the section is PROGRESSING until the answer, and a
  `Retry` state asks again on the next pass.
- `Configure(config)`: run the exporter with `config` (a new endpoint applies at once, no restart).
- `Stop()`: stop exporting (the section emptied, its endpoint cleared, or its headers refused).

Nothing exports without the headers the section names: a refused or malformed secret is FAILED (terminal:
a new spec is needed) and the exporter stops.
"""

from __future__ import annotations

from attrs import frozen

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.telemetry.model import TelemetrySpec

REASON_HEADERS_PENDING = "HeadersPending"


@frozen
class ExportConfig:
    url: str
    interval_s: float
    resource: tuple[tuple[str, str], ...]
    headers: tuple[tuple[str, str], ...] = ()


@frozen
class HeadersLoaded:
    headers: tuple[tuple[str, str], ...]


@frozen
class HeadersPending:
    pass


@frozen
class HeadersFailed:
    reason: str
    message: str
    terminal: bool  # refused or malformed: FAILED; unavailable: fetched again on the next pass


HeadersState = HeadersLoaded | HeadersPending | HeadersFailed


@frozen
class Observed:
    running: ExportConfig | None  # what the exporter runs now
    headers: HeadersState | None  # the state of the desired reference's headers (None: never asked)


@frozen
class FetchHeaders:
    ref: str


@frozen
class Configure:
    config: ExportConfig


@frozen
class Stop:
    pass


Step = FetchHeaders | Configure | Stop


@frozen
class Plan:
    steps: tuple[Step, ...]
    state: SectionState
    reason: str = ""
    message: str = ""


def desired_config(
    spec: TelemetrySpec, base_resource: tuple[tuple[str, str], ...], headers: tuple[tuple[str, str], ...]
) -> ExportConfig:
    """bcd's own resource attributes (service.*), overridden by the section's."""
    resource = dict(base_resource)
    resource.update(spec.resource_attributes)
    return ExportConfig(spec.metrics_url, spec.interval_ms / 1000, tuple(sorted(resource.items())), headers)


def plan(
    desired: TelemetrySpec | None, observed: Observed, base_resource: tuple[tuple[str, str], ...] = ()
) -> Plan:
    stop: tuple[Step, ...] = (Stop(),) if observed.running is not None else ()
    if desired is None or not desired.exports:
        return Plan(stop, SectionState.CONVERGED)
    headers: tuple[tuple[str, str], ...] = ()
    if desired.headers_secret_ref:
        state = observed.headers
        if state is None or (isinstance(state, HeadersFailed) and not state.terminal):
            why = f"fetching the export headers {desired.headers_secret_ref}"
            if isinstance(state, HeadersFailed):
                why += f" again ({state.message})"
            return Plan(
                (FetchHeaders(desired.headers_secret_ref),),
                SectionState.PROGRESSING,
                REASON_HEADERS_PENDING,
                why,
            )
        if isinstance(state, HeadersPending):
            why = f"waiting for the export headers {desired.headers_secret_ref}"
            return Plan((), SectionState.PROGRESSING, REASON_HEADERS_PENDING, why)
        if isinstance(state, HeadersFailed):
            return Plan(stop, SectionState.FAILED, state.reason, state.message)
        headers = state.headers
    config = desired_config(desired, base_resource, headers)
    if observed.running == config:
        return Plan((), SectionState.CONVERGED)
    return Plan((Configure(config),), SectionState.CONVERGED)
