"""`CounterSet`: monotonic counters keyed by a small attribute tuple, bounded in memory, thread-safe.

The parts that count things for bcd's own metrics (the dispatcher's outcomes per kind, the helper client's
calls and refusals, the telemetry exporter) keep one; the telemetry section reads them when it exports
(bcd_agent.sections.telemetry.metrics). At most `max_series` distinct keys are kept: a key beyond them
counts under OVERFLOW, as the OpenTelemetry SDK's cardinality limit does (`otel.metric.overflow`), so a
stream of odd reasons never grows memory.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

MAX_SERIES = 64
OVERFLOW: tuple[str, ...] = ("otel.metric.overflow",)


class CounterSet:
    def __init__(self, max_series: int = MAX_SERIES) -> None:
        self._max = max_series
        self._counts: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    def add(self, key: tuple[str, ...], n: int = 1) -> None:
        with self._lock:
            if key not in self._counts and len(self._counts) >= self._max:
                key = OVERFLOW
            self._counts[key] = self._counts.get(key, 0) + n

    def snapshot(self) -> Mapping[tuple[str, ...], int]:
        with self._lock:
            return dict(self._counts)

    def get(self, key: tuple[str, ...]) -> int:
        with self._lock:
            return self._counts.get(key, 0)
