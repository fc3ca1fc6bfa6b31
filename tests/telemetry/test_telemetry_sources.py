"""The parts bcd's own metrics read: the journal's totals, the helper clients' calls and refusals, the
converge runner's pass observer, and the telemetry converger's headers flow (refused, unavailable)."""

from __future__ import annotations

import json
import socket
import struct
import threading
from pathlib import Path

import pytest
import trio
from bcd_agent.converge.runner import ConvergeRunner
from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import DesiredSpec, SectionState
from bcd_agent.helperclient import HelperCallStats, HelperClient
from bcd_agent.journal import EventClass, Journal, NewEvent
from bcd_agent.sections.telemetry.exporter import Exporter
from bcd_agent.sections.telemetry.metrics import NodeMetrics
from bcd_agent.sections.telemetry.section import TelemetrySection
from bcd_shared import wire
from bcd_shared.errors import HelperRefused, RetryableError, TerminalError


def test_the_journal_counts_acked_and_dropped_events_since_it_was_opened(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "data", boot_id="b", max_events=10) as j:
        assert j.event_totals() == (0, 0)
        j.append_events([NewEvent(EventClass.METRIC, "m", b"x")] * 8)
        out = j.append_events([NewEvent(EventClass.TRANSITION, "t", b"y")] * 5)
        assert out.dropped_metrics == 3
        j.ack_events(j.journal_id, out.first_seq + 1)
        acked, dropped = j.event_totals()
        assert dropped == 3
        assert acked == 10 - j.event_stats().count and acked > 0
        metrics = NodeMetrics()
        metrics.journal = j
        values = {m.name: m.points[0].value for m in metrics.collect() if m.name.startswith("bcd.journal.")}
    assert values == {
        "bcd.journal.events.pending": 10 - acked,
        "bcd.journal.events.acked": acked,
        "bcd.journal.events.dropped": 3,
    }


def _helper(path: Path, answers: list[dict[str, object]]) -> threading.Thread:
    """A fake helper socket answering one connection's requests with `answers`, in order."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        with conn, server:
            for answer in answers:
                (n,) = struct.unpack(">I", conn.recv(4))
                conn.recv(n)
                body = json.dumps(answer).encode()
                conn.sendall(struct.pack(">I", len(body)) + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_helper_clients_count_calls_per_op_and_refusals_per_reason(tmp_path: Path) -> None:
    stats = HelperCallStats()
    sock = tmp_path / "h.sock"
    thread = _helper(sock, [{"ok": True, "result": {}}, {"ok": False, "reason": "denied", "message": "no"}])
    client = HelperClient(str(sock), stats=stats)
    client.ping()
    with pytest.raises(HelperRefused):
        client.file_remove("cdi", "a")
    client.close()
    thread.join(5)
    with pytest.raises(HelperRefused):
        HelperClient(str(tmp_path / "absent.sock"), stats=stats).call("made.up")
    assert stats.calls.snapshot() == {("helper.ping",): 1, ("file.remove",): 1, ("other",): 1}
    assert stats.refusals.snapshot() == {("file.remove", "denied"): 1, ("other", "unreachable"): 1}


class _Section:
    name = "devices"

    def is_empty(self, desired: object | None) -> bool:
        return desired is None

    def converge(self, desired: object | None, observation: Observation, ctx: PassContext) -> object:
        from bcd_agent.converge.types import SectionOutcome

        return SectionOutcome("devices", SectionState.CONVERGED)


async def _observe() -> Observation:
    return Observation()


async def test_the_runner_reports_every_pass_to_its_observer() -> None:
    metrics = NodeMetrics()
    runner = ConvergeRunner(
        [_Section()], _observe, initial_spec=DesiredSpec(1, "h"), on_pass=metrics.record_pass
    )
    for _ in range(3):
        await runner.converge_once()
    point = metrics.pass_duration.point()
    assert point.count == 3 and sum(point.bucket_counts) == 3 and point.sum >= 0


SECTION = wire.TelemetrySection(
    otlp_endpoint="https://otel.example", export_interval_ms=5000, headers_secret_ref="secret://h"
)
CTX = PassContext(DesiredSpec(1, "h"), 1, frozenset(), 0.0)


async def _section_with(fetch_result: object) -> tuple[TelemetrySection, list[str], list[str]]:
    asked: list[str] = []
    triggered: list[str] = []

    async def fetch(ref: str) -> bytes:
        asked.append(ref)
        if isinstance(fetch_result, Exception):
            raise fetch_result
        assert isinstance(fetch_result, bytes)
        return fetch_result

    section = TelemetrySection(Exporter(NodeMetrics()), fetch, triggered.append)
    return section, asked, triggered


@pytest.mark.parametrize(
    ("answer", "state", "reason", "asks"),
    [
        (b"x-key=v", SectionState.CONVERGED, "", 1),
        (TerminalError("SecretRefused", "refused"), SectionState.FAILED, "SecretRefused", 1),
        (b"Host=evil", SectionState.FAILED, "InvalidHeaders", 1),
        (RetryableError("SecretUnavailable", "later"), SectionState.PROGRESSING, "HeadersPending", 2),
    ],
)
async def test_the_converger_fetches_the_headers_off_the_pass_and_acts_on_the_answer(
    answer: object, state: SectionState, reason: str, asks: int
) -> None:
    section, asked, triggered = await _section_with(answer)
    async with trio.open_nursery() as nursery:
        await nursery.start(section.run)
        first = await section.converge(SECTION, Observation(), CTX)
        assert (first.state, first.reason) == (SectionState.PROGRESSING, "HeadersPending")
        assert section.exporter.config is None
        with trio.fail_after(5):
            while not triggered:  # noqa: ASYNC110 - the answer triggers a pass
                await trio.sleep(0.01)
        second = await section.converge(SECTION, Observation(), CTX)
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert (second.state, second.reason) == (state, reason)
    assert len(asked) == asks
    config = section.exporter.config
    if state is SectionState.CONVERGED:
        assert config is not None and config.headers == (("x-key", "v"),)
        assert config.url == "https://otel.example/v1/metrics" and config.interval_s == 5.0
    else:
        assert config is None


async def test_an_invalid_section_stops_the_previous_export() -> None:
    section, _asked, _triggered = await _section_with(b"k=v")
    async with trio.open_nursery() as nursery:
        await nursery.start(section.run)
        plain = wire.TelemetrySection(otlp_endpoint="https://otel.example")
        assert (await section.converge(plain, Observation(), CTX)).state is SectionState.CONVERGED
        assert section.exporter.config is not None
        with pytest.raises(TerminalError, match=r"telemetry\.otlp_endpoint"):
            await section.converge(wire.TelemetrySection(otlp_endpoint="http://10.0.0.1"), Observation(), CTX)
        assert section.exporter.config is None
        assert (await section.converge(None, Observation(), CTX)).state is SectionState.CONVERGED
        nursery.cancel_scope.cancel()


async def test_a_401_from_the_endpoint_fetches_the_headers_again() -> None:
    """Rotated credentials: the endpoint refuses the headers, the section asks for the secret again and
    the exporter runs with its new value."""
    from bcd_agent.sections.telemetry.exporter import ExportFailed

    values = [b"authorization=old", b"authorization=new"]
    asked: list[str] = []
    triggered: list[str] = []
    seen: list[tuple[tuple[str, str], ...]] = []

    async def fetch(ref: str) -> bytes:
        asked.append(ref)
        return values[min(len(asked), len(values)) - 1]

    async def post(url: str, body: bytes, headers: tuple[tuple[str, str], ...], timeout_s: float) -> None:
        seen.append(tuple(headers))
        if ("authorization", "old") in headers:
            raise ExportFailed("401", False)

    section = TelemetrySection(Exporter(NodeMetrics(), post=post), fetch, triggered.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(section.run)
        await nursery.start(section.exporter.run)
        with trio.fail_after(10):
            while section.exporter.sent < 1:
                if triggered or not asked:
                    triggered.clear()
                    await section.converge(SECTION, Observation(), CTX)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert len(asked) == 2
    assert any(("authorization", "new") in h for h in seen)
    assert section.exporter.metrics.exports.get(("401",)) >= 1


async def test_a_refused_secret_stays_failed_for_its_generation_and_is_asked_again_for_a_new_one() -> None:
    section, asked, triggered = await _section_with(TerminalError("SecretRefused", "not now"))
    async with trio.open_nursery() as nursery:
        await nursery.start(section.run)
        await section.converge(SECTION, Observation(), CTX)
        with trio.fail_after(5):
            while not triggered:  # noqa: ASYNC110
                await trio.sleep(0.01)
        for _ in range(2):
            out = await section.converge(SECTION, Observation(), CTX)
            assert (out.state, out.reason) == (SectionState.FAILED, "SecretRefused")
        assert len(asked) == 1
        gen2 = PassContext(DesiredSpec(2, "h2"), 5, frozenset(), 0.0)
        out = await section.converge(SECTION, Observation(), gen2)
        await trio.sleep(0.05)  # the fetch runs in the section's own task
        assert out.state is SectionState.PROGRESSING and len(asked) == 2
        nursery.cancel_scope.cancel()
