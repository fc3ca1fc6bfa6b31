"""bcd's own metrics: the data model the OTLP encoder writes, and `NodeMetrics`, which reads the node's parts.

Names follow OpenTelemetry's semantic conventions (namespaced `bcd.`, units in UCUM with `{annotation}`
counts, durations in seconds, a `.status` metric valued 1 for the current state and 0 for the others as
`hw.status` does, `error.type` for failure reasons, `hw.id` for a device). Every value is cumulative since
the process started (`start_time_unix_nano` is that start). See docs/telemetry.md for the table.

| Metric | Instrument | Unit | Attributes |
| --- | --- | --- | --- |
| `bcd.journal.events.pending` | UpDownCounter | `{event}` | |
| `bcd.journal.events.acked` | Counter | `{event}` | |
| `bcd.journal.events.dropped` | Counter | `{event}` | |
| `bcd.dispatcher.queue.length` | UpDownCounter | `{command}` | `bcd.lane` |
| `bcd.dispatcher.commands` | Counter | `{command}` | `bcd.command.kind`, `bcd.command.outcome` |
| `bcd.converge.pass.duration` | Histogram | `s` | |
| `bcd.converge.section.status` | UpDownCounter | `1` | `bcd.section`, `bcd.section.state` |
| `bcd.gpu.holds` | UpDownCounter | `{hold}` | `hw.id` |
| `bcd.instance.memory.balloon.reclaimed` | UpDownCounter | `By` | `bcd.instance.id` |
| `bcd.helper.calls` | Counter | `{call}` | `bcd.helper.op` |
| `bcd.helper.refusals` | Counter | `{call}` | `bcd.helper.op`, `error.type` |
| `bcd.telemetry.exports` | Counter | `{export}` | `error.type` (failed exports only) |
| `bcd.telemetry.exports.dropped` | Counter | `{export}` | |

Each part is optional (a node without the devices section has no `bcd.gpu.holds` points but still the
metric). A part that raises while being read is logged and left out of that export only.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from attrs import field, frozen

from bcd_agent.converge.types import SECTION_ORDER, SectionState
from bcd_agent.counters import OVERFLOW, CounterSet

log = logging.getLogger("bcd.telemetry")

AttrValue = str | int | bool | float
Attrs = tuple[tuple[str, AttrValue], ...]

# Seconds; converge passes range from milliseconds (nothing to do) to half an hour (a driver build).
PASS_BOUNDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
)  # fmt: skip


class MetricKind(enum.Enum):
    COUNTER = "counter"  # monotonic cumulative Sum
    UPDOWN = "updown"  # non-monotonic cumulative Sum (a count of things now)
    HISTOGRAM = "histogram"  # cumulative Histogram with explicit bounds


@frozen
class NumberPoint:
    attributes: Attrs
    value: int | float


@frozen
class HistogramPoint:
    attributes: Attrs
    count: int
    sum: float
    bucket_counts: tuple[int, ...]
    bounds: tuple[float, ...]
    min: float
    max: float


@frozen
class Metric:
    name: str
    description: str
    unit: str
    kind: MetricKind
    points: tuple[NumberPoint | HistogramPoint, ...] = field(factory=tuple)


class Histogram:
    """Explicit-bucket histogram (thread-safe: the runner records from its task, the exporter reads)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf
        self._lock = threading.Lock()

    def record(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        with self._lock:
            self._counts[index] += 1
            self._sum += value
            self._min = min(self._min, value)
            self._max = max(self._max, value)

    def point(self, attributes: Attrs = ()) -> HistogramPoint:
        with self._lock:
            count = sum(self._counts)
            return HistogramPoint(
                attributes,
                count,
                self._sum,
                tuple(self._counts),
                self.bounds,
                self._min if count else 0.0,
                self._max if count else 0.0,
            )


def counter_points(counters: CounterSet, names: Sequence[str]) -> tuple[NumberPoint, ...]:
    """A CounterSet's series as points, its key's parts named by `names` (the overflow series as OTel's)."""
    points = []
    for key, value in sorted(counters.snapshot().items()):
        if key == OVERFLOW:
            attrs: Attrs = (("otel.metric.overflow", True),)
        else:
            attrs = tuple((n, v) for n, v in zip(names, key, strict=True) if v != "")
        points.append(NumberPoint(attrs, value))
    return tuple(points)


def holds_per_gpu(
    gpus: Iterable[str], device_ids_by_allocation: Mapping[str, Iterable[str]]
) -> dict[str, int]:
    """Allocations holding each GPU (any of its atoms: the whole GPU, a MIG instance, a slot); every
    GPU of the inventory is listed, 0 when free, so a release shows as a drop to 0."""
    from bcd_agent.sections.devices.atoms import atom_from_id

    out = dict.fromkeys(gpus, 0)
    for ids in device_ids_by_allocation.values():
        for gpu in {atom_from_id(d).gpu for d in ids}:
            out[gpu] = out.get(gpu, 0) + 1
    return out


class NodeMetrics:
    """What bcd exports about itself: reads the node's parts at each export (see the module docstring).

    The parts are set by the node once they exist; `record_pass` is the converge runner's `on_pass`."""

    def __init__(self) -> None:
        self.journal: Any = None  # bcd_agent.journal.Journal
        self.dispatcher: Any = None  # bcd_agent.dispatch.dispatcher.Dispatcher
        self.status: Any = None  # bcd_agent.converge.status.StatusCell
        self.holds: Callable[[], Mapping[str, int]] | None = None  # GPU UUID -> holds
        # instance -> bytes its balloon lends the host (the balloon controller's last tick, DLV-BAL-17)
        self.balloons: Callable[[], Mapping[str, int]] | None = None
        self.helper: Any = None  # bcd_agent.helperclient.HelperCallStats
        self.exports: CounterSet = CounterSet()  # (error.type or "",)
        self.exports_dropped: CounterSet = CounterSet()  # ()
        self.pass_duration = Histogram(PASS_BOUNDS)

    def record_pass(self, seconds: float, _status: object = None) -> None:
        self.pass_duration.record(seconds)

    def collect(self) -> list[Metric]:
        metrics: list[Metric] = []
        for part in (
            self._journal,
            self._dispatcher,
            self._converge,
            self._holds,
            self._balloons,
            self._helper,
            self._telemetry,
        ):
            try:
                metrics.extend(part())
            except Exception:
                log.warning(
                    "telemetry: reading %s failed; left out of this export", part.__name__, exc_info=True
                )
        return metrics

    def _journal(self) -> list[Metric]:
        pending = acked = dropped = 0
        if self.journal is not None:
            pending = self.journal.event_stats().count
            acked, dropped = self.journal.event_totals()
        return [
            Metric(
                "bcd.journal.events.pending",
                "Journal events not yet acknowledged by the control plane",
                "{event}",
                MetricKind.UPDOWN,
                (NumberPoint((), pending),),
            ),
            Metric(
                "bcd.journal.events.acked",
                "Journal events the control plane acknowledged",
                "{event}",
                MetricKind.COUNTER,
                (NumberPoint((), acked),),
            ),
            Metric(
                "bcd.journal.events.dropped",
                "Metric events the journal dropped to stay within its bounds",
                "{event}",
                MetricKind.COUNTER,
                (NumberPoint((), dropped),),
            ),
        ]

    def _dispatcher(self) -> list[Metric]:
        queue: tuple[NumberPoint, ...] = ()
        outcomes: tuple[NumberPoint, ...] = ()
        d = self.dispatcher
        if d is not None:
            queue = tuple(NumberPoint((("bcd.lane", lane.value),), d.queue_length(lane)) for lane in d.lanes)
            outcomes = counter_points(d.outcomes, ("bcd.command.kind", "bcd.command.outcome"))
        return [
            Metric(
                "bcd.dispatcher.queue.length",
                "Commands admitted on a lane and waiting for a worker",
                "{command}",
                MetricKind.UPDOWN,
                queue,
            ),
            Metric(
                "bcd.dispatcher.commands",
                "Commands settled by the dispatcher, by kind and outcome (busy answers included)",
                "{command}",
                MetricKind.COUNTER,
                outcomes,
            ),
        ]

    def _converge(self) -> list[Metric]:
        status = self.status.latest() if self.status is not None else None
        states: dict[str, SectionState] = {}
        if status is not None:
            states = {s.section: s.state for s in status.sections if s.section in SECTION_ORDER}
        points = tuple(
            NumberPoint(
                (("bcd.section", name), ("bcd.section.state", state.value)), int(states[name] is state)
            )
            for name in SECTION_ORDER
            if name in states
            for state in SectionState
        )
        return [
            Metric(
                "bcd.converge.pass.duration",
                "Duration of a converge pass over every section",
                "s",
                MetricKind.HISTOGRAM,
                (self.pass_duration.point(),),
            ),
            Metric(
                "bcd.converge.section.status",
                "A section's state after the last pass: 1 for the current state, 0 for the others",
                "1",
                MetricKind.UPDOWN,
                points,
            ),
        ]

    def _holds(self) -> list[Metric]:
        held = self.holds() if self.holds is not None else {}
        return [
            Metric(
                "bcd.gpu.holds",
                "Allocations holding a GPU (the whole GPU, a MIG instance or a slot of it)",
                "{hold}",
                MetricKind.UPDOWN,
                tuple(NumberPoint((("hw.id", gpu),), n) for gpu, n in sorted(held.items())),
            )
        ]

    def _balloons(self) -> list[Metric]:
        """Only the running guests whose spec asks for a balloon: the controller's view (DLV-BAL-17)."""
        from bcd_agent.sections.instances.balloon import BALLOON_METRIC

        lent = self.balloons() if self.balloons is not None else {}
        return [
            Metric(
                BALLOON_METRIC,
                "Memory a ballooned guest lends the host: its memory less what its balloon leaves it",
                "By",
                MetricKind.UPDOWN,
                tuple(NumberPoint((("bcd.instance.id", i),), n) for i, n in sorted(lent.items())),
            )
        ]

    def _helper(self) -> list[Metric]:
        calls: tuple[NumberPoint, ...] = ()
        refusals: tuple[NumberPoint, ...] = ()
        if self.helper is not None:
            calls = counter_points(self.helper.calls, ("bcd.helper.op",))
            refusals = counter_points(self.helper.refusals, ("bcd.helper.op", "error.type"))
        return [
            Metric(
                "bcd.helper.calls",
                "Calls to the root helper, by operation",
                "{call}",
                MetricKind.COUNTER,
                calls,
            ),
            Metric(
                "bcd.helper.refusals",
                "Helper calls refused or failed, by operation and reason",
                "{call}",
                MetricKind.COUNTER,
                refusals,
            ),
        ]

    def _telemetry(self) -> list[Metric]:
        return [
            Metric(
                "bcd.telemetry.exports",
                "OTLP exports attempted; failed ones carry error.type",
                "{export}",
                MetricKind.COUNTER,
                counter_points(self.exports, ("error.type",)),
            ),
            Metric(
                "bcd.telemetry.exports.dropped",
                "OTLP exports dropped unsent: the bounded queue was full, or the endpoint changed",
                "{export}",
                MetricKind.COUNTER,
                (NumberPoint((), self.exports_dropped.get(())),),
            ),
        ]


METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in NodeMetrics().collect())
