"""`bcd node` exporting its own metrics to a real OTLP/HTTP receiver on loopback (DLV-CONV-08).

The node runs beside the development control plane in one trio process, directly on a simulated host
(tests/session/test_node_wiring.py's World and `running`). The spec's telemetry section names the
receiver, an interval, resource attributes and a headers secret the control plane's broker holds. Every
request is decoded with the official OpenTelemetry protobuf definitions (the `opentelemetry-proto`
package), never with bcd's own encoder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from bcd_agent.devplane.otlp import OtlpReceiver, Received
from bcd_agent.sections.telemetry.metrics import METRIC_NAMES
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from session.test_node_wiring import World, running

HEADERS_REF = "secret://pool/otlp-headers"
ATTRS = {"deployment.environment": "test", "bcd.pool": "gpu-a"}


async def until(what: str, check: Callable[[], Any], within: float = 20) -> Any:
    with trio.move_on_after(within):
        while True:
            got = check()
            if got:
                return got
            await trio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def telemetry(endpoint: str, ref: str = HEADERS_REF) -> dict[str, Any]:
    return {
        "telemetry": {
            "otlpEndpoint": endpoint,
            "exportIntervalMs": "1000",
            "resourceAttributes": ATTRS,
            "headersSecretRef": ref,
        }
    }


def decode(request: Received) -> ExportMetricsServiceRequest:
    message = ExportMetricsServiceRequest()
    message.ParseFromString(request.body)
    return message


def resource_of(message: ExportMetricsServiceRequest) -> dict[str, Any]:
    (rm,) = message.resource_metrics
    return {kv.key: kv.value.string_value for kv in rm.resource.attributes}


def metrics_of(message: ExportMetricsServiceRequest) -> dict[str, Any]:
    (rm,) = message.resource_metrics
    (sm,) = rm.scope_metrics
    assert sm.scope.name == "bcd"
    return {m.name: m for m in sm.metrics}


async def test_DLV_CONV_08_every_metric_reaches_a_real_otlp_receiver_with_resource_and_secret_headers(
    tmp_path: Path,
) -> None:
    """DLV-CONV-08, DLV-SPEC-07: the telemetry converger drives bcd's OTLP export: the section's endpoint,
    interval and resource attributes, and the headers from its secret reference (a SecretRequest)."""
    world = World(tmp_path)
    receiver = OtlpReceiver()
    async with trio.open_nursery() as outer:
        await outer.start(receiver.run)
        async with running(world, world.config()) as node:
            world.plane.put_secret(HEADERS_REF, b"authorization=Bearer%20t0ken,x-tenant=ml\n")
            assert world.plane.apply_spec(world.node_id, telemetry(receiver.url)) == 1
            await until("an export", lambda: receiver.count >= 1)
            await until(
                "CONVERGED", lambda: world.section("telemetry").get("state") == "SECTION_STATE_CONVERGED"
            )
            # The headers came through a SecretRequest bound to the telemetry section.
            asked = [r for r in node.secrets.sent if r.ref == HEADERS_REF]
            assert asked and asked[0].workflow_id == "telemetry" and asked[0].step_id == "headers_secret_ref"
            # A later export carries a pass and the sections' states.
            await until("two exports", lambda: receiver.count >= 2)
            request = receiver.requests[-1]
            assert request.path == "/v1/metrics"
            assert request.headers["content-type"] == "application/x-protobuf"
            assert request.headers["authorization"] == "Bearer t0ken"
            assert request.headers["x-tenant"] == "ml"
            message = decode(request)
            resource = resource_of(message)
            for key, value in ATTRS.items():
                assert resource[key] == value
            assert resource["service.name"] == "bcd"
            assert resource["service.instance.id"] == world.node_id
            metrics = metrics_of(message)
            assert set(metrics) == set(METRIC_NAMES), set(METRIC_NAMES) ^ set(metrics)
            passes = metrics["bcd.converge.pass.duration"].histogram.data_points[0]
            assert passes.count >= 1 and sum(passes.bucket_counts) == passes.count
            states = {
                (dict((a.key, a.value.string_value) for a in p.attributes)["bcd.section"], p.as_int)
                for p in metrics["bcd.converge.section.status"].sum.data_points
                if dict((a.key, a.value.string_value) for a in p.attributes)["bcd.section.state"]
                == "CONVERGED"
            }
            assert ("telemetry", 1) in states
            lanes = {
                p.attributes[0].value.string_value: p.as_int
                for p in metrics["bcd.dispatcher.queue.length"].sum.data_points
            }
            assert set(lanes) == {"control", "provision", "bulk"}
            holds = metrics["bcd.gpu.holds"].sum.data_points
            assert holds and all(p.attributes[0].key == "hw.id" for p in holds)
            assert metrics["bcd.journal.events.pending"].sum.is_monotonic is False
            assert metrics["bcd.journal.events.acked"].sum.is_monotonic is True
            # Every export of the run carried the section's resource attributes.
            for r in receiver.requests:
                got = resource_of(decode(r))
                assert {k: got.get(k) for k in ATTRS} == ATTRS
        outer.cancel_scope.cancel()


async def test_DLV_CONV_08_an_endpoint_change_applies_without_restart_and_a_dead_one_never_blocks_a_pass(
    tmp_path: Path,
) -> None:
    """DLV-CONV-08: a new endpoint is exported to by the same process; an unreachable one leaves the
    passes running (observed_generation advances) and the export queue bounded, its drops counted."""
    world = World(tmp_path)
    first, second = OtlpReceiver(), OtlpReceiver()
    async with trio.open_nursery() as outer:
        await outer.start(first.run)
        await outer.start(second.run)
        async with running(world, world.config()) as node:
            world.plane.put_secret(HEADERS_REF, b"x-api-key=k1")
            world.plane.apply_spec(world.node_id, telemetry(first.url))
            await until("an export to the first endpoint", lambda: first.count >= 1)
            generation = world.plane.apply_spec(world.node_id, telemetry(second.url))
            await until("an export to the second endpoint", lambda: second.count >= 1)
            assert second.requests[-1].headers["x-api-key"] == "k1"
            await until(
                "observed",
                lambda: (world.plane.node(world.node_id) or {}).get("observed_generation") == generation,
            )
            sent_to_first = first.count
            # An endpoint nobody listens on (the first receiver's port, closed) and a short interval.
            dead = OtlpReceiver()
            async with trio.open_nursery() as n:
                await n.start(dead.run)
                dead_url = dead.url
                n.cancel_scope.cancel()
            generation = world.plane.apply_spec(world.node_id, telemetry(dead_url))
            await until(
                "observed with a dead endpoint",
                lambda: (world.plane.node(world.node_id) or {}).get("observed_generation") == generation,
            )
            assert world.section("telemetry")["state"] == "SECTION_STATE_CONVERGED"
            exporter = node.exporter
            # Several intervals: exports are built, fail, the oldest are dropped; never more than the bound.
            await until("drops", lambda: node.metrics.exports_dropped.get(()) >= 1, within=30)
            assert exporter.queued <= 4
            assert first.count == sent_to_first and second.count >= 1
            failed = {k: v for k, v in node.metrics.exports.snapshot().items() if k != ("",)}
            assert failed, node.metrics.exports.snapshot()
        outer.cancel_scope.cancel()
