"""The telemetry section's pure parts and its exporter, without a node.

- otlp: bcd's hand-written encoder, decoded with the official opentelemetry-proto definitions;
- model: the section read strictly from the wire (DLV-SPEC-07), each refusal naming the field;
- headers: the secret's value parsed strictly;
- plan: desired section x the exporter's config x the headers' state -> steps (no mocks);
- exporter: bounded queue, drops counted, a failing endpoint never blocks;
- the broker's binding rule for the headers secret.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
from bcd_agent.converge.types import SectionState
from bcd_agent.counters import CounterSet
from bcd_agent.devplane.plane import DevPlane
from bcd_agent.sections.telemetry.exporter import Exporter, ExportFailed
from bcd_agent.sections.telemetry.headers import parse_headers
from bcd_agent.sections.telemetry.metrics import (
    Histogram,
    HistogramPoint,
    Metric,
    MetricKind,
    NodeMetrics,
    NumberPoint,
    counter_points,
    holds_per_gpu,
)
from bcd_agent.sections.telemetry.model import TelemetrySpec, from_wire
from bcd_agent.sections.telemetry.otlp import encode_request
from bcd_agent.sections.telemetry.plan import (
    Configure,
    ExportConfig,
    FetchHeaders,
    HeadersFailed,
    HeadersLoaded,
    HeadersPending,
    Observed,
    Stop,
    plan,
)
from bcd_shared import wire
from bcd_shared.errors import TerminalError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

# --- the encoder ----------------------------------------------------------------------------------


def _decode(data: bytes) -> ExportMetricsServiceRequest:
    message = ExportMetricsServiceRequest()
    message.ParseFromString(data)
    return message


def test_encoder_output_decodes_with_the_official_definitions_field_by_field() -> None:
    hist = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.7, 3.0):
        hist.record(v)
    metrics = [
        Metric("a.counter", "counts", "{x}", MetricKind.COUNTER, (NumberPoint((("k", "v"), ("n", -3)), 7),)),
        Metric("a.updown", "", "1", MetricKind.UPDOWN, (NumberPoint((("b", True), ("f", 0.25)), -2),)),
        Metric("a.double", "", "s", MetricKind.UPDOWN, (NumberPoint((), 1.5),)),
        Metric("a.hist", "h", "s", MetricKind.HISTOGRAM, (hist.point((("q", "é"),)),)),
    ]
    data = encode_request(
        (("service.name", "bcd"), ("zone", "fra-1")),
        "bcd",
        "0.1.0",
        metrics,
        start_ns=10**18,
        now_ns=2 * 10**18,
    )
    msg = _decode(data)
    (rm,) = msg.resource_metrics
    assert [(kv.key, kv.value.string_value) for kv in rm.resource.attributes] == [
        ("service.name", "bcd"),
        ("zone", "fra-1"),
    ]
    (sm,) = rm.scope_metrics
    assert (sm.scope.name, sm.scope.version) == ("bcd", "0.1.0")
    by = {m.name: m for m in sm.metrics}
    c = by["a.counter"]
    assert (c.description, c.unit, c.WhichOneof("data")) == ("counts", "{x}", "sum")
    assert (
        c.sum.is_monotonic
        and c.sum.aggregation_temporality == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    )
    (p,) = c.sum.data_points
    assert (p.as_int, p.start_time_unix_nano, p.time_unix_nano) == (7, 10**18, 2 * 10**18)
    assert [(a.key, a.value.WhichOneof("value")) for a in p.attributes] == [
        ("k", "string_value"),
        ("n", "int_value"),
    ]
    assert p.attributes[1].value.int_value == -3
    u = by["a.updown"]
    assert not u.sum.is_monotonic and u.sum.data_points[0].as_int == -2
    assert u.sum.data_points[0].attributes[0].value.bool_value is True
    assert u.sum.data_points[0].attributes[1].value.double_value == 0.25
    assert by["a.double"].sum.data_points[0].as_double == 1.5
    h = by["a.hist"].histogram
    assert h.aggregation_temporality == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    (hp,) = h.data_points
    assert list(hp.explicit_bounds) == [0.1, 1.0]
    assert list(hp.bucket_counts) == [1, 2, 1]
    assert (hp.count, hp.sum, hp.min, hp.max) == (4, pytest.approx(4.25), 0.05, 3.0)
    assert hp.attributes[0].value.string_value == "é"


def test_an_empty_histogram_encodes_no_min_or_max() -> None:
    point = Histogram((1.0,)).point()
    data = encode_request(
        (), "bcd", "", [Metric("h", "", "s", MetricKind.HISTOGRAM, (point,))], start_ns=1, now_ns=2
    )
    (hp,) = _decode(data).resource_metrics[0].scope_metrics[0].metrics[0].histogram.data_points
    assert hp.count == 0 and not hp.HasField("min") and not hp.HasField("max")


def test_counter_points_name_the_overflow_series_as_the_sdk_does() -> None:
    counters = CounterSet(max_series=2)
    for reason in ("a", "b", "c", "d"):
        counters.add(("op", reason))
    points = counter_points(counters, ("bcd.helper.op", "error.type"))
    assert [p.attributes for p in points].count((("otel.metric.overflow", True),)) == 1
    assert sum(int(p.value) for p in points) == 4 and len(points) == 3


def test_holds_per_gpu_counts_allocations_per_gpu_and_lists_free_ones() -> None:
    held = {"a1": ("GPU-1",), "a2": ("GPU-2/s0", "GPU-2/s1"), "a3": ("GPU-2/s2",)}
    assert holds_per_gpu(("GPU-1", "GPU-2", "GPU-3"), held) == {"GPU-1": 1, "GPU-2": 2, "GPU-3": 0}


# --- the section on the wire (DLV-SPEC-07) ----------------------------------------------------------


def test_DLV_SPEC_07_telemetry_holds_endpoint_interval_resource_attributes_and_headers_secret() -> None:
    """DLV-SPEC-07: the four fields of TelemetrySection, read into the converger's spec."""
    section = wire.TelemetrySection(
        otlp_endpoint="https://otel.example:4318",
        export_interval_ms=15_000,
        resource_attributes={"b": "2", "a": "1"},
        headers_secret_ref="secret://pool/otlp",
    )
    spec = from_wire(section)
    assert spec == TelemetrySpec(
        "https://otel.example:4318", 15_000, (("a", "1"), ("b", "2")), "secret://pool/otlp"
    )
    assert spec.metrics_url == "https://otel.example:4318/v1/metrics"
    assert from_wire(wire.TelemetrySection()) is None
    full_url = from_wire(wire.TelemetrySection(otlp_endpoint="https://o/v1/metrics/"))
    assert full_url is not None and full_url.metrics_url == "https://o/v1/metrics"
    default = from_wire(wire.TelemetrySection(otlp_endpoint="https://o"))
    assert default is not None and default.interval_ms == 60_000


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"otlp_endpoint": "http://otel.example:4318"}, "otlp_endpoint"),
        ({"otlp_endpoint": "ftp://o"}, "otlp_endpoint"),
        ({"otlp_endpoint": "https://user:pw@o"}, "otlp_endpoint"),
        ({"otlp_endpoint": "https://o?x=1"}, "otlp_endpoint"),
        ({"otlp_endpoint": "https:///path"}, "otlp_endpoint"),
        ({"otlp_endpoint": "https://o:99999"}, "otlp_endpoint"),
        ({"otlp_endpoint": "https://bücher.example"}, "otlp_endpoint"),
        ({"otlp_endpoint": "https://o/päth"}, "otlp_endpoint"),
        ({"otlp_endpoint": "https://o", "export_interval_ms": 999}, "export_interval_ms"),
        ({"otlp_endpoint": "https://o", "export_interval_ms": 3_600_001}, "export_interval_ms"),
        ({"otlp_endpoint": "https://o", "resource_attributes": {"": "x"}}, "resource_attributes"),
        ({"otlp_endpoint": "https://o", "resource_attributes": {"k": "a\nb"}}, "resource_attributes"),
        (
            {"otlp_endpoint": "https://o", "resource_attributes": {f"k{i}": "v" for i in range(65)}},
            "resource_attributes",
        ),
        ({"otlp_endpoint": "https://o", "headers_secret_ref": "vault://x"}, "headers_secret_ref"),
    ],
)
def test_a_bad_telemetry_section_is_terminal_and_names_its_field(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(TerminalError) as caught:
        from_wire(wire.TelemetrySection(**kwargs))  # type: ignore[arg-type]
    assert caught.value.reason == "InvalidTelemetry"
    assert caught.value.message.startswith(f"telemetry.{field}: ")


def test_each_telemetry_bound_is_accepted_at_its_edge() -> None:
    """docs/telemetry.md's bounds, each taken at exactly its limit (the refusals above are one past it):
    an interval of 1 s and of 1 h, 64 attributes, a 255-character key, a 4096-character value, a
    2048-character endpoint and a 512-character secret reference."""
    edge = wire.TelemetrySection(
        otlp_endpoint="https://o/" + "p" * (2048 - len("https://o/")),
        export_interval_ms=1_000,
        resource_attributes={**{f"k{i}": "v" for i in range(62)}, "k" * 255: "v", "big": "v" * 4096},
        headers_secret_ref="secret://" + "r" * (512 - len("secret://")),
    )
    spec = from_wire(edge)
    assert spec is not None and spec.interval_ms == 1_000 and len(spec.resource_attributes) == 64
    hour = from_wire(wire.TelemetrySection(otlp_endpoint="https://o", export_interval_ms=3_600_000))
    assert hour is not None and hour.interval_ms == 3_600_000
    for kwargs, field in (
        ({"otlp_endpoint": "https://o/" + "p" * (2049 - len("https://o/"))}, "otlp_endpoint"),
        ({"otlp_endpoint": "https://o", "resource_attributes": {"k" * 256: "v"}}, "resource_attributes"),
        ({"otlp_endpoint": "https://o", "resource_attributes": {"k": "v" * 4097}}, "resource_attributes"),
        ({"otlp_endpoint": "https://o", "headers_secret_ref": "secret://" + "r" * 504}, "headers_secret_ref"),
    ):
        with pytest.raises(TerminalError) as caught:
            from_wire(wire.TelemetrySection(**kwargs))  # type: ignore[arg-type]
        assert caught.value.message.startswith(f"telemetry.{field}: ")


def test_plain_http_is_allowed_to_a_loopback_collector_only() -> None:
    for url in ("http://127.0.0.1:4318", "http://[::1]:4318", "http://localhost:4318", "http://127.9.9.9"):
        assert from_wire(wire.TelemetrySection(otlp_endpoint=url)) is not None


# --- the headers secret -------------------------------------------------------------------------------


def test_headers_are_parsed_in_the_otel_exporter_headers_form() -> None:
    got = parse_headers(b" Authorization = Bearer%20abc%2C1 ,x-tenant=ml\n", "secret://r")
    assert got == (("Authorization", "Bearer abc,1"), ("x-tenant", "ml"))
    assert parse_headers(b"\n", "secret://r") == ()


@pytest.mark.parametrize(
    "value",
    [
        b"novalue",
        b"=v",
        b"bad name=v",
        b"a=",
        b"a=x%0d%0aHost: evil",
        b"a=\xff",
        b"a=%ff",
        b"a=caf%C3%A9",
        b"Host=x",
        b"content-length=1",
        b"a=1,A=2",
        b",".join(b"h%d=v" % i for i in range(33)),
        b"a=" + b"x" * 9000,
    ],
)
def test_bad_headers_are_refused_without_echoing_the_secret(value: bytes) -> None:
    with pytest.raises(TerminalError) as caught:
        parse_headers(value, "secret://r")
    assert caught.value.reason == "InvalidHeaders"
    assert "secret://r" in caught.value.message
    assert "evil" not in caught.value.message and "xxxx" not in caught.value.message


# --- the planner -----------------------------------------------------------------------------------------

SPEC = TelemetrySpec("https://o", 10_000, (("site", "fra"),), "secret://h")
BASE = (("service.name", "bcd"), ("site", "default"))
CONFIG = ExportConfig("https://o/v1/metrics", 10.0, (("service.name", "bcd"), ("site", "fra")), (("k", "v"),))


def test_plan_fetches_the_headers_first_and_waits_for_them() -> None:
    first = plan(SPEC, Observed(None, None), BASE)
    assert first.steps == (FetchHeaders("secret://h"),) and first.state is SectionState.PROGRESSING
    waiting = plan(SPEC, Observed(None, HeadersPending()), BASE)
    assert waiting.steps == () and waiting.state is SectionState.PROGRESSING
    again = plan(
        SPEC, Observed(None, HeadersFailed("SecretUnavailable", "broker down", terminal=False)), BASE
    )
    assert again.steps == (FetchHeaders("secret://h"),) and "broker down" in again.message


def test_plan_configures_with_the_section_attributes_over_bcds_own_then_has_nothing_to_do() -> None:
    loaded = HeadersLoaded((("k", "v"),))
    p = plan(SPEC, Observed(None, loaded), BASE)
    assert p.steps == (Configure(CONFIG),) and p.state is SectionState.CONVERGED
    # Apply to the "host" (the exporter's running config) and plan again: no steps.
    assert plan(SPEC, Observed(CONFIG, loaded), BASE).steps == ()
    moved = plan(
        TelemetrySpec("https://p", 10_000, (("site", "fra"),), "secret://h"), Observed(CONFIG, loaded), BASE
    )
    assert moved.steps == (
        Configure(ExportConfig("https://p/v1/metrics", 10.0, CONFIG.resource, CONFIG.headers)),
    )


def test_plan_stops_on_refused_headers_and_on_an_emptied_section() -> None:
    refused = plan(SPEC, Observed(CONFIG, HeadersFailed("SecretRefused", "no", terminal=True)), BASE)
    assert (
        refused.steps == (Stop(),)
        and refused.state is SectionState.FAILED
        and refused.reason == "SecretRefused"
    )
    assert plan(None, Observed(CONFIG, None)).steps == (Stop(),)
    assert plan(None, Observed(None, None)).steps == ()
    no_endpoint = TelemetrySpec("", 60_000, (("a", "b"),), "")
    assert plan(no_endpoint, Observed(None, None)).state is SectionState.CONVERGED


# --- the exporter -------------------------------------------------------------------------------------


async def test_a_failing_endpoint_keeps_the_queue_bounded_and_counts_the_drops() -> None:
    metrics = NodeMetrics()
    posts: list[str] = []

    async def refuse(url: str, body: bytes, headers: object, timeout_s: float) -> None:
        posts.append(url)
        await trio.sleep(timeout_s)  # a black hole: every attempt runs into the timeout
        raise ExportFailed("timeout", True)

    exporter = Exporter(metrics, post=refuse, max_queue=3, timeout_s=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(exporter.run)
        exporter.configure(ExportConfig("http://127.0.0.1:9/v1/metrics", 0.01, ()))
        for _ in range(100):
            await trio.sleep(0.01)
            assert exporter.queued <= 3
        assert metrics.exports_dropped.get(()) > 10
        assert metrics.exports.get(("timeout",)) >= 1
        # A new endpoint drops the old queue (counted) and is posted to at once.
        dropped = metrics.exports_dropped.get(())
        exporter.configure(ExportConfig("http://127.0.0.1:10/v1/metrics", 10.0, ()))
        assert metrics.exports_dropped.get(()) > dropped
        with trio.fail_after(5):
            while not posts or posts[-1] != "http://127.0.0.1:10/v1/metrics":  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def test_a_refused_export_is_dropped_and_a_retryable_one_is_sent_again() -> None:
    metrics = NodeMetrics()
    answers = [ExportFailed("400", False), ExportFailed("503", True, 0.0), None]
    bodies: list[bytes] = []

    async def post(url: str, body: bytes, headers: object, timeout_s: float) -> None:
        bodies.append(body)
        answer = answers.pop(0) if answers else None
        if answer is not None:
            raise answer

    exporter = Exporter(metrics, post=post)
    async with trio.open_nursery() as nursery:
        await nursery.start(exporter.run)
        exporter.configure(ExportConfig("http://127.0.0.1:9/v1/metrics", 1.0, ()))
        with trio.fail_after(10):
            while exporter.sent < 1:  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    # The 400 was dropped (a new snapshot followed); the 503's body was posted again as it was.
    assert bodies[1] != bodies[0] and bodies[2] == bodies[1]
    assert metrics.exports.get(("400",)) == 1 and metrics.exports.get(("503",)) == 1
    assert metrics.exports.get(("",)) == 1


def test_an_export_larger_than_the_queue_is_dropped_and_counted() -> None:
    metrics = NodeMetrics()
    exporter = Exporter(metrics, max_queue_bytes=10)
    exporter.enqueue(b"x" * 11)
    assert exporter.queued == 0 and metrics.exports_dropped.get(()) == 1
    exporter.enqueue(b"x" * 6)
    exporter.enqueue(b"y" * 6)
    assert exporter.queued == 1 and exporter.queued_bytes == 6 and metrics.exports_dropped.get(()) == 2


def test_the_pass_histogram_buckets_and_bounds() -> None:
    hist = Histogram((1.0, 2.0))
    for v in (1.0, 1.5, 2.0, 9.0):
        hist.record(v)
    point = hist.point()
    assert isinstance(point, HistogramPoint)
    assert point.bucket_counts == (1, 2, 1) and point.min == 1.0 and point.max == 9.0
    assert math.isclose(point.sum, 13.5)


# --- the broker's binding rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "workflow", "step", "expected"),
    [
        (
            {"telemetry": {"headersSecretRef": "secret://h"}},
            "telemetry",
            "headers_secret_ref",
            wire.SecretStatus.OK,
        ),
        (
            {"telemetry": {"headersSecretRef": "secret://other"}},
            "telemetry",
            "headers_secret_ref",
            wire.SecretStatus.REFUSED,
        ),
        (
            {"telemetry": {"headersSecretRef": "secret://h"}},
            "telemetry",
            "tokenRef",
            wire.SecretStatus.REFUSED,
        ),
        # Named elsewhere in the spec (an env line of a hold), not as the headers: not released for them.
        (
            {"devices": {"assignments": [{"allocationId": "a", "env": ["X=secret://h"]}]}},
            "telemetry",
            "headers_secret_ref",
            wire.SecretStatus.REFUSED,
        ),
    ],
)
def test_the_broker_releases_telemetry_headers_only_for_the_sections_reference(
    tmp_path: Path, spec: dict[str, object], workflow: str, step: str, expected: wire.SecretStatus
) -> None:
    from bcd_shared.pki import KeyPair

    plane = DevPlane(tmp_path / "dp", listen=None)
    joined = plane.join(
        wire.JoinRequest(
            token=plane.issue_token(), node_public_key=KeyPair.generate().public_key, hostname="h"
        )
    )
    node = wire.JoinResponseBody.parse(joined.body).node_id
    plane.put_secret("secret://h", b"k=v")
    plane.apply_spec(node, spec)
    answer = plane.secret(
        node, wire.SecretRequest(request_id="r", ref="secret://h", workflow_id=workflow, step_id=step)
    )
    assert answer.status == expected


async def test_a_bug_in_a_source_or_the_client_never_stops_the_exporter() -> None:
    metrics = NodeMetrics()

    class Broken:
        def event_stats(self) -> object:
            raise RuntimeError("journal closed")

    metrics.journal = Broken()
    calls: list[int] = []

    async def post(url: str, body: bytes, headers: object, timeout_s: float) -> None:
        calls.append(len(body))
        if len(calls) == 1:
            raise UnicodeEncodeError("ascii", "ä", 0, 1, "not ASCII")

    exporter = Exporter(metrics, post=post)
    async with trio.open_nursery() as nursery:
        await nursery.start(exporter.run)
        exporter.configure(ExportConfig("https://o/v1/metrics", 0.02, ()))
        with trio.fail_after(10):
            while exporter.sent < 1:  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert metrics.exports.get(("UnicodeEncodeError",)) == 1
    sent = _decode(encode_request((), "bcd", "", metrics.collect(), start_ns=1, now_ns=2))
    names = {m.name for m in sent.resource_metrics[0].scope_metrics[0].metrics}
    assert "bcd.journal.events.pending" not in names and "bcd.dispatcher.commands" in names


def test_bcd_plan_shows_the_telemetry_steps_and_refuses_a_bad_section() -> None:
    from bcd_agent.plan import plan_telemetry

    good = plan_telemetry(
        wire.TelemetrySection(
            otlp_endpoint="https://o:4318",
            export_interval_ms=15_000,
            resource_attributes={"site": "fra"},
            headers_secret_ref="secret://h",
        )
    )
    assert good.planner == "telemetry" and not good.failures
    assert good.steps == (
        "fetch the export headers secret://h (SecretRequest)",
        "export bcd's metrics to https://o:4318/v1/metrics every 15 s (resource attributes beside bcd's"
        " service.*: site)",
    )
    assert plan_telemetry(None).converged
    bad = plan_telemetry(wire.TelemetrySection(otlp_endpoint="http://10.0.0.1"))
    assert bad.failures and bad.failures[0].startswith("InvalidTelemetry: telemetry.otlp_endpoint")


async def test_https_verifies_the_endpoint_against_the_system_trust_store(tmp_path: Path) -> None:
    """A collector whose certificate chains to no trusted root is refused at the handshake (retried,
    never sent in the clear); the request never reaches it."""
    import ssl
    from functools import partial

    from bcd_agent.sections.telemetry.exporter import post_otlp
    from tlskit import make_tls

    _ca, cert, key = make_tls(tmp_path)  # a throwaway CA: in no trust store
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    received: list[bytes] = []

    async def serve(stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, server_ctx, server_side=True)
        try:
            received.append(await tls.receive_some(65536))
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(tls)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(ExportFailed) as caught:
            await post_otlp(f"https://127.0.0.1:{port}/v1/metrics", b"body", (("x-api-key", "s"),), 5.0)
        nursery.cancel_scope.cancel()
    assert caught.value.retryable and caught.value.error_type in (
        "SSLCertVerificationError",
        "BrokenResourceError",
    )
    assert received == []
