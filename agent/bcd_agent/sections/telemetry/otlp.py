"""A hand-written encoder for OTLP's ExportMetricsServiceRequest (opentelemetry-proto, metrics v1).

Why by hand (docs/telemetry.md): the OpenTelemetry SDK with its OTLP/HTTP exporter costs the agent about
9 MB of resident memory (google.protobuf, requests, urllib3, the SDK), and the agent's idle target of
60 MB has about 4 MB of headroom. bcd exports a fixed schema (Sum and Histogram points with string
attributes), so the encoder is a few functions over protobuf's wire format; the tests decode its output
with the official `opentelemetry-proto` definitions.

Only what bcd sends is encoded: Resource attributes, one InstrumentationScope, Metric{name, description,
unit, sum | histogram}, NumberDataPoint (as_int or as_double) and HistogramDataPoint with explicit
bounds, string/int/bool/double attribute values. Field numbers are those of
opentelemetry/proto/metrics/v1/metrics.proto and common/v1/common.proto.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

from bcd_agent.sections.telemetry.metrics import (
    AttrValue,
    HistogramPoint,
    Metric,
    MetricKind,
    NumberPoint,
)

# AggregationTemporality: bcd reports every sum and histogram since the process started.
CUMULATIVE = 2

_WT_VARINT = 0
_WT_I64 = 1
_WT_LEN = 2
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")
_S64 = struct.Struct("<q")


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 in two's complement, ten bytes
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _len(field: int, payload: bytes) -> bytes:
    return _key(field, _WT_LEN) + _varint(len(payload)) + payload


def _str(field: int, value: str) -> bytes:
    return _len(field, value.encode("utf-8")) if value else b""


def _fixed64(field: int, value: int) -> bytes:
    return _key(field, _WT_I64) + _U64.pack(value)


def _double(field: int, value: float) -> bytes:
    return _key(field, _WT_I64) + _F64.pack(value)


def _any_value(value: AttrValue) -> bytes:
    # AnyValue: string_value 1, bool_value 2, int_value 3, double_value 4 (bool before int: bool is an int).
    if isinstance(value, str):
        return _len(1, value.encode("utf-8"))
    if isinstance(value, bool):
        return _key(2, _WT_VARINT) + _varint(int(value))
    if isinstance(value, int):
        return _key(3, _WT_VARINT) + _varint(value)
    return _double(4, float(value))


def key_values(field: int, attributes: Iterable[tuple[str, AttrValue]]) -> bytes:
    """Repeated KeyValue{key 1, value 2} under `field`."""
    return b"".join(_len(field, _str(1, k) + _len(2, _any_value(v))) for k, v in attributes)


def _number_point(p: NumberPoint, start_ns: int, now_ns: int) -> bytes:
    # NumberDataPoint: start_time_unix_nano 2, time_unix_nano 3, as_double 4, as_int 6 (sfixed64),
    # attributes 7.
    is_int = isinstance(p.value, int)
    value = _key(6, _WT_I64) + _S64.pack(p.value) if is_int else _double(4, p.value)
    return _fixed64(2, start_ns) + _fixed64(3, now_ns) + value + key_values(7, p.attributes)


def _histogram_point(p: HistogramPoint, start_ns: int, now_ns: int) -> bytes:
    # HistogramDataPoint: start 2, time 3, count 4, sum 5, bucket_counts 6 (packed fixed64),
    # explicit_bounds 7 (packed double), attributes 9, min 11, max 12.
    out = _fixed64(2, start_ns) + _fixed64(3, now_ns) + _fixed64(4, p.count) + _double(5, p.sum)
    out += _len(6, b"".join(_U64.pack(c) for c in p.bucket_counts))
    out += _len(7, b"".join(_F64.pack(b) for b in p.bounds))
    out += key_values(9, p.attributes)
    if p.count:
        out += _double(11, p.min) + _double(12, p.max)
    return out


def _metric(m: Metric, start_ns: int, now_ns: int) -> bytes:
    # Metric: name 1, description 2, unit 3, sum 7, histogram 9.
    head = _str(1, m.name) + _str(2, m.description) + _str(3, m.unit)
    if m.kind is MetricKind.HISTOGRAM:
        points = b"".join(
            _len(1, _histogram_point(p, start_ns, now_ns)) for p in m.points if isinstance(p, HistogramPoint)
        )
        # Histogram: data_points 1, aggregation_temporality 2.
        return head + _len(9, points + _key(2, _WT_VARINT) + _varint(CUMULATIVE))
    points = b"".join(
        _len(1, _number_point(p, start_ns, now_ns)) for p in m.points if isinstance(p, NumberPoint)
    )
    # Sum: data_points 1, aggregation_temporality 2, is_monotonic 3.
    body = points + _key(2, _WT_VARINT) + _varint(CUMULATIVE)
    if m.kind is MetricKind.COUNTER:
        body += _key(3, _WT_VARINT) + _varint(1)
    return head + _len(7, body)


def encode_request(
    resource: Sequence[tuple[str, AttrValue]],
    scope_name: str,
    scope_version: str,
    metrics: Sequence[Metric],
    *,
    start_ns: int,
    now_ns: int,
) -> bytes:
    """ExportMetricsServiceRequest{resource_metrics 1: ResourceMetrics{resource 1, scope_metrics 2}}."""
    scope = _str(1, scope_name) + _str(2, scope_version)
    scope_metrics = _len(1, scope) + b"".join(_len(2, _metric(m, start_ns, now_ns)) for m in metrics)
    resource_metrics = _len(1, key_values(1, resource)) + _len(2, scope_metrics)
    return _len(1, resource_metrics)
