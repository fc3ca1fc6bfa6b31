"""The session against a hostile or broken gateway (issue 16, items 5, 6 and 7).

- oversized messages are refused from their length prefix, before their body is read, and a message whose
  body stops arriving is refused at the frame deadline: both a protocol error that replaces the session;
- every connection that ends is logged in one line naming its cause (a refused Welcome with both times,
  a TLS error, a protocol error, the gateway closing), never "ExceptionGroup: ...";
- refused and ignored specs, by the ten thousand, leave the node's memory where the first round left it.

The gateway is a real grpclib server (hostilegw) or the development control plane; the node's half is
`SessionCore` + `Session` over a real journal.
"""

from __future__ import annotations

import asyncio
import logging
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.clock import OffsetClock
from bcd_agent.dispatch.trust import BundleTrust
from bcd_agent.journal import Journal
from bcd_agent.session.backoff import Backoff
from bcd_agent.session.core import SessionCore
from bcd_agent.session.service import Session
from bcd_agent.session.transport import Endpoint, StreamLimits
from bcd_shared import wire
from hostilegw import HostileGateway, prefix, read_forever, send_raw, serving
from test_session_core import NODE, Pki, Recorder, connect

pytestmark = pytest.mark.slow

MiB = 1024 * 1024


def _core(tmp_path: Path, pki: Pki) -> SessionCore:
    rec = Recorder()
    return SessionCore(
        journal=Journal.open(tmp_path / "data", boot_id="boot-1"),
        dispatcher=rec,
        runner=rec,
        trust=BundleTrust(),
        clock=OffsetClock(),
        identity=pki.identity(),
        data_dir=tmp_path / "data",
        monotonic=trio.current_time,
        persist_identity=False,
    )


async def _until(what: str, check: Callable[[], Any], within: float) -> Any:
    with trio.fail_after(within):
        while not (got := check()):  # noqa: ASYNC110 - polls state other tasks change
            await trio.sleep(0.02)
    assert got, what
    return got


async def _run_session(session: Session, check: Callable[[], Any], within: float) -> Any:
    async with trio.open_nursery() as nursery:
        await nursery.start(session.run)
        got = await _until("the session's outcome", check, within)
        nursery.cancel_scope.cancel()
    return got


@pytest.fixture
def pki() -> Pki:
    return Pki()


# --- item 7: oversized and stalled messages ---------------------------------------------------------------


async def test_a_message_over_the_cap_is_refused_from_its_prefix_and_replaces_the_session(
    tmp_path: Path, pki: Pki
) -> None:
    """A 100 MB command announced in its prefix, of which 1 MiB is sent: refused at once (its body is never
    buffered: the gateway's writes stop at the HTTP/2 window), logged as a protocol error naming the cap,
    and the session is made again. Today's reader waits for all 100 MB."""
    sent = {"bytes": 0}

    async def oversized(stream: Any) -> None:
        await send_raw(stream, prefix(100 * MiB))
        chunk = b"\0" * (64 * 1024)
        with_timeout = 5.0
        for _ in range(16):
            try:
                await asyncio.wait_for(send_raw(stream, chunk), with_timeout)
            except (TimeoutError, Exception):
                return
            sent["bytes"] += len(chunk)
        await asyncio.sleep(30)

    sock = tmp_path / "gw.sock"
    gateway = HostileGateway(oversized)
    core = _core(tmp_path, pki)
    session = Session(core, Endpoint(unix_path=str(sock)), backoff=Backoff(initial_s=0.05, max_s=0.1))
    async with serving(gateway, sock):
        t0 = time.monotonic()
        await _run_session(session, lambda: gateway.sessions >= 2, within=10)
    assert time.monotonic() - t0 < 10
    why = session.failures[0]
    assert "protocol error" in why and f"{100 * MiB} bytes exceeds the {4 * MiB}-byte cap" in why, why
    # Refused from the prefix: at most the HTTP/2 windows' worth (4 MiB each) ever left the gateway.
    assert sent["bytes"] <= 8 * MiB


async def test_the_cap_is_configurable_and_a_message_under_it_passes(tmp_path: Path, pki: Pki) -> None:
    """`[control_plane] max_message_bytes` sets the cap: a heartbeat (a few bytes) passes a 64 KiB cap, a
    70 KiB message is refused under it."""
    sock = tmp_path / "gw.sock"
    big = wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=int(time.time() * 1000)))
    small_len = len(bytes(big))

    async def script(stream: Any) -> None:
        await stream.send_message(big)
        await send_raw(stream, prefix(70 * 1024) + b"\0" * 1024)
        await asyncio.sleep(30)

    gateway = HostileGateway(script)
    core = _core(tmp_path, pki)
    session = Session(
        core,
        Endpoint(unix_path=str(sock)),
        backoff=Backoff(initial_s=0.05, max_s=0.1),
        limits=StreamLimits(max_message_bytes=64 * 1024),
    )
    async with serving(gateway, sock):
        await _run_session(session, lambda: session.failures, within=10)
    assert small_len < 64 * 1024
    assert core.state.welcomes >= 1
    assert f"{70 * 1024} bytes exceeds the {64 * 1024}-byte cap" in session.failures[0]


async def test_a_message_that_stops_arriving_is_refused_at_the_frame_deadline(
    tmp_path: Path, pki: Pki
) -> None:
    """A prefix announcing 1 MiB (under the cap), then 16 bytes, then nothing: a protocol error at the
    frame deadline, and a new session. Today's reader waits for ever."""

    async def stalled(stream: Any) -> None:
        await send_raw(stream, prefix(MiB) + b"\0" * 16)
        await asyncio.sleep(60)

    sock = tmp_path / "gw.sock"
    gateway = HostileGateway(stalled)
    core = _core(tmp_path, pki)
    session = Session(
        core,
        Endpoint(unix_path=str(sock)),
        backoff=Backoff(initial_s=0.05, max_s=0.1),
        limits=StreamLimits(frame_deadline_s=0.5),
    )
    async with serving(gateway, sock):
        await _run_session(session, lambda: gateway.sessions >= 2, within=10)
    why = session.failures[0]
    assert "protocol error" in why and f"a {MiB}-byte message stopped arriving" in why, why


# --- item 6: one line naming the cause --------------------------------------------------------------------


async def test_a_refused_welcome_is_logged_in_one_line_with_both_times(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A Welcome 10 minutes before the node's server time mark: refused (DLV-JRN-13), and the log line says
    so with both times, not `ExceptionGroup: Exceptions from Trio nursery`."""
    now_ms = int(time.time() * 1000)

    async def idle(stream: Any) -> None:
        await read_forever(stream, [])

    sock = tmp_path / "gw.sock"
    gateway = HostileGateway(idle, welcome_ms=lambda: now_ms - 600_000)
    core = _core(tmp_path, pki)
    core.journal.observe_server_time(now_ms / 1000)
    session = Session(core, Endpoint(unix_path=str(sock)), backoff=Backoff(initial_s=0.05, max_s=0.1))
    caplog.set_level(logging.INFO, logger="bcd.session")
    async with serving(gateway, sock):
        await _run_session(session, lambda: session.failures, within=10)
    lines = [r.getMessage() for r in caplog.records if r.name == "bcd.session" and "ended" in r.getMessage()]
    assert lines, caplog.text
    line = lines[0]
    assert "\n" not in line and "ExceptionGroup" not in line, line
    assert "Welcome refused" in line, line
    assert f"{(now_ms - 600_000) / 1000:.3f}" in line and f"{now_ms / 1000:.3f}" in line, line


async def test_a_failed_attempt_says_when_the_next_is_and_where_to_look(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """No gateway on the socket: each line names the attempt and when the next one is, and the third says
    which command checks the address (before: the cause alone, the same line every few seconds)."""
    core = _core(tmp_path, pki)
    session = Session(
        core, Endpoint(unix_path=str(tmp_path / "none.sock")), backoff=Backoff(initial_s=0.01, max_s=0.02)
    )
    caplog.set_level(logging.INFO, logger="bcd.session")
    await _run_session(session, lambda: len(session.failures) >= 4, within=10)
    lines = [r.getMessage() for r in caplog.records if r.name == "bcd.session" and "ended" in r.getMessage()]
    assert len(lines) >= 3, caplog.text
    assert "connection failed" in lines[0] and "; attempt 1 failed, the next in 0.0 s" in lines[0], lines[0]
    assert "bcd doctor" not in lines[0] and "bcd doctor" not in lines[1]
    assert "; attempt 3 failed" in lines[2] and "`bcd doctor` checks the control plane" in lines[2], lines[2]


async def test_the_gateway_closing_the_stream_is_named(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway that ends the stream with a gRPC status: the line names the status and its message."""
    from grpclib import GRPCError
    from grpclib.const import Status

    async def closes(stream: Any) -> None:
        await asyncio.sleep(0.3)  # a live session, then the gateway ends it
        raise GRPCError(Status.UNAVAILABLE, "gateway draining")

    sock = tmp_path / "gw.sock"
    gateway = HostileGateway(closes)
    core = _core(tmp_path, pki)
    session = Session(core, Endpoint(unix_path=str(sock)), backoff=Backoff(initial_s=0.05, max_s=0.1))
    caplog.set_level(logging.INFO, logger="bcd.session")
    async with serving(gateway, sock):
        await _run_session(session, lambda: session.failures, within=10)
    assert "the gateway closed the stream: UNAVAILABLE: gateway draining" in session.failures[0], (
        session.failures
    )
    assert "ExceptionGroup" not in caplog.text


async def test_a_tls_failure_names_the_certificate_problem(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """The development control plane over TLS, the node trusting another CA: the line names the TLS
    certificate failure."""
    import datetime as dt

    from bcd_agent.devplane import keys as keysmod
    from bcd_agent.devplane.plane import DevPlane

    plane = DevPlane(tmp_path / "dp", listen="127.0.0.1:0", unix_socket=None)
    (tmp_path / "stranger").mkdir()
    stranger = keysmod.load_or_create(tmp_path / "stranger", dt.datetime.now(dt.UTC))
    core = _core(tmp_path, pki)
    caplog.set_level(logging.INFO, logger="bcd.session")
    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        assert plane.address is not None
        endpoint = Endpoint(host=plane.address[0], port=plane.address[1], ca_pem=stranger.ca_pem().decode())
        session = Session(core, endpoint, backoff=Backoff(initial_s=0.05, max_s=0.1))
        await _run_session(session, lambda: session.failures, within=10)
        nursery.cancel_scope.cancel()
    assert "TLS" in session.failures[0] and "certificate" in session.failures[0], session.failures
    assert "ExceptionGroup" not in caplog.text


# --- item 5: refused and ignored specs do not grow the node -----------------------------------------------


def test_refused_and_ignored_specs_keep_memory_flat(tmp_path: Path, pki: Pki) -> None:
    """Rounds of stale specs, unsigned specs once command roots are known, and specs for another node:
    after the first round, the node keeps less than 20 bytes per message (today it kept every reason)."""
    from test_session_core import make

    core, out, _rec, _mono = make(tmp_path, pki)
    connect(core, out, bundle=pki.bundle(version=1, roots=True))
    core.handle(wire.GatewayMessage(desired_state=pki.spec(5)))
    assert core.journal.applied_generation == 5
    stale = wire.GatewayMessage(desired_state=pki.spec(3))
    unsigned = [wire.GatewayMessage(desired_state=pki.spec(10 + i, sign=False)) for i in range(50)]
    other = wire.GatewayMessage(desired_state=pki.spec(9, node="node-2"))
    per_round = 3000

    def round_() -> None:
        for i in range(per_round // 3):
            core.handle(stale)
            core.handle(unsigned[i % len(unsigned)])
            core.handle(other)
        out.clear()

    logging.getLogger("bcd.session").setLevel(logging.CRITICAL)  # the log records are not what is measured
    try:
        tracemalloc.start()
        round_()
        first = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            round_()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        logging.getLogger("bcd.session").setLevel(logging.NOTSET)
    per_message = (after - first) / (3 * per_round)
    assert per_message < 20, f"{per_message:.1f} bytes kept per refused/ignored spec"
    assert core.state.refused_count + core.state.ignored_count == 4 * per_round
    assert core.journal.applied_generation == 5
    assert core.node_id == NODE
