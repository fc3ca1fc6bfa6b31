"""The helper's server in process: a `Connection` over a socket pair (framing, the budget, ancillary data,
the frame deadline), `answer` (every refusal, word for word, and what the audit log records), the
per-peer refusal rate, the audit-full rule, the op locks, the bounds on audit lines, and the servers'
sockets.

test_hostile_framing.py and the real-helper tests drive the same code in a `bcd helper serve` process;
these call it directly, so they are fast and mutation testing sees them (docs/mutation.md). A non-root
peer is stood in for by setting the connection's `peer` after SO_PEERCRED was read (a socket pair's
peer is this process, root)."""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import socket
import struct
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from attrs import frozen
from bcd_helper import server
from bcd_helper.audit import AuditLog, canonical
from bcd_helper.config import parse_config
from bcd_helper.ops.base import Failed, HelperContext, Peer, Refused
from bcd_helper.ops.table import LOCK_ORDER, OPS, OpSpec
from bcd_helper.protocol import MAX_FRAME, MAX_VALUES, ProtocolError, encode_frame, read_frame
from bcd_helper.server import (
    BUDGET,
    EOF,
    MAX_CONNECTIONS,
    MAX_SHOWN,
    MAX_TEXT,
    MAX_TEXT_BYTES,
    REFUSAL_BURST,
    VALUE_COST,
    Budget,
    Busy,
    Connection,
    Guards,
    _bounded,
    _cut,
    frame_cost,
)

DIR = "/var/log/bcd-helper"
NODE = 4242


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[HelperContext]:
    root = tmp_path / "host"
    root.mkdir(mode=0o755)
    config = parse_config(f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE}\n'.encode())
    from bcd_shared.system import LocalSystem

    audit = AuditLog(root, DIR, syslog=False)
    c = HelperContext(root=root, config=config, system=LocalSystem(root), audit=audit, lock_names=LOCK_ORDER)
    yield c
    audit.close()


@pytest.fixture
def guards(ctx: HelperContext) -> Iterator[Guards]:
    g = Guards(ctx)
    yield g
    g.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def audit_lines(ctx: HelperContext) -> list[dict[str, Any]]:
    path = ctx.root / DIR.lstrip("/") / "audit.log"
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def connection(ctx: HelperContext, guards: Guards, sock: socket.socket, uid: int = 0) -> Connection:
    conn = Connection(ctx, sock, guards)
    if uid:
        conn.peer = Peer(conn.peer.pid, uid, uid)
    return conn


@pytest.fixture
def conn(ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]) -> Connection:
    """Root's connection on the pair's second end (the first is the peer's)."""
    return connection(ctx, guards, pair[1])


@pytest.fixture
def node_conn(ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]) -> Connection:
    """The node's connection on the pair's second end."""
    return connection(ctx, guards, pair[1], uid=NODE)


def read_refused(conn: Connection) -> str:
    """Reading the next request raises ProtocolError: its text."""
    with pytest.raises(ProtocolError) as info:
        conn.read_request()
    return str(info.value)


@pytest.fixture
def srv(ctx: HelperContext, tmp_path: Path, guards: Guards) -> Iterator[server.HelperServer]:
    """The node's socket server over `guards`, not serving (each test hands it its connections), closed at
    the end."""
    s = server.HelperServer(ctx, str(tmp_path / "helper.sock"), guards)
    yield s
    s.server_close()


@pytest.fixture
def node_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection the servers take is the node's (what SO_PEERCRED would say)."""
    monkeypatch.setattr(server, "peer_credentials", lambda _s: Peer(1, NODE, NODE))


@pytest.fixture
def peer_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The credentials of every connection the servers take cannot be read: the peer is gone."""

    def gone(_s: socket.socket) -> Peer:
        raise OSError("gone")

    monkeypatch.setattr(server, "peer_credentials", gone)


@pytest.fixture
def budget_spent(guards: Guards, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other frames hold the whole budget, and a frame waits 0.05 s for its share."""
    monkeypatch.setattr(server, "FRAME_TIMEOUT_S", 0.05)
    guards.budget.used = BUDGET


def one_slot_taken(srv: server.HelperServer) -> None:
    """The server holds at most one connection of the node, and that slot is taken."""
    srv._slots = threading.BoundedSemaphore(1)
    assert srv._slots.acquire(blocking=False)


# --- the budget -------------------------------------------------------------------------------------------


def test_a_frame_costs_its_bytes_three_times_and_its_values() -> None:
    assert frame_cost(0) == 0
    assert frame_cost(10) == 30 + 10 * VALUE_COST
    assert frame_cost(MAX_VALUES + 5) == 3 * (MAX_VALUES + 5) + VALUE_COST * MAX_VALUES


def test_the_budget_is_shared_and_waits_for_a_release() -> None:
    b = Budget(100)
    assert b.acquire(60, time.monotonic() + 1) and b.used == 60
    assert b.acquire(40, time.monotonic() + 1) and b.used == 100
    assert not b.acquire(1, time.monotonic() + 0.05)  # full until the deadline
    assert b.used == 100
    releaser = threading.Timer(0.05, b.release, args=(60,))
    releaser.start()
    assert b.acquire(50, time.monotonic() + 5)  # woken by the release
    releaser.join()
    assert b.used == 90
    b.release(90)
    assert b.used == 0
    assert b.acquire(500, time.monotonic())  # more than the total takes the total, never waits forever
    assert b.used == 100
    b.release(500)
    assert b.used == 0
    assert not b.acquire(1, time.monotonic() - 1) or b.used == 1


def test_an_expired_deadline_gets_nothing_once_the_budget_is_full() -> None:
    b = Budget(10)
    assert b.acquire(10, time.monotonic() - 1)  # fits: no wait, whatever the deadline
    assert not b.acquire(1, time.monotonic() - 1)
    assert b.used == 10


# --- the refusal rate and the suppressed counts ----------------------------------------------------------


def test_root_is_never_rate_limited_and_a_peer_gets_a_burst(
    guards: Guards, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(server.time, "monotonic", lambda: clock[0])
    assert all(guards.allow_refusal(0) for _ in range(REFUSAL_BURST * 2))
    assert all(guards.allow_refusal(NODE) for _ in range(REFUSAL_BURST))
    assert not guards.allow_refusal(NODE)
    assert guards.allow_refusal(NODE + 1)  # another peer has its own bucket
    clock[0] += 0.05  # half a token at 10 a second
    assert not guards.allow_refusal(NODE)
    clock[0] += 0.06  # one token now (0.11 s at 10 a second: 1.1 tokens)
    assert guards.allow_refusal(NODE)
    assert not guards.allow_refusal(NODE)
    clock[0] += 3600  # refilled to the burst, never past it
    assert all(guards.allow_refusal(NODE) for _ in range(REFUSAL_BURST))
    assert not guards.allow_refusal(NODE)


def test_counted_refusals_are_audited_as_one_line_per_peer(ctx: HelperContext, guards: Guards) -> None:
    for _ in range(3):
        guards.count(NODE, "busy")
    guards.count(NODE, "audit-full")
    guards.count(77, "busy")
    guards.flush()
    lines = [e for e in audit_lines(ctx) if e["op"] == "(suppressed)"]
    assert [(e["peer_uid"], e["args"]) for e in lines] == [
        (77, {"count": 1, "reasons": {"busy": 1}}),
        (NODE, {"count": 4, "reasons": {"audit-full": 1, "busy": 3}}),
    ]
    e = lines[1]
    assert (e["peer_pid"], e["decision"], e["reason"], e["duration_ms"]) == (0, "refused", "rate-limit", 0.0)
    assert e["message"] == f"4 refusals of uid {NODE} answered without a line of their own"
    import hashlib

    assert e["args_sha256"] == hashlib.sha256(canonical(e["args"])).hexdigest()
    guards.flush()  # nothing pending: nothing written
    assert len([e for e in audit_lines(ctx) if e["op"] == "(suppressed)"]) == 2


def test_a_suppressed_line_names_at_most_32_reasons(ctx: HelperContext, guards: Guards) -> None:
    for i in range(40):
        guards.count(NODE, f"r{i:02d}")
    guards.close()
    (line,) = [e for e in audit_lines(ctx) if e["op"] == "(suppressed)"]
    assert line["args"]["count"] == 40
    assert sorted(line["args"]["reasons"]) == [f"r{i:02d}" for i in range(32)]


def test_the_flusher_writes_the_counts_on_its_own(
    ctx: HelperContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "FLUSH_S", 0.01)
    g = Guards(ctx)
    try:
        g.count(NODE, "busy")
        end = time.monotonic() + 10
        while time.monotonic() < end and not any(e["op"] == "(suppressed)" for e in audit_lines(ctx)):
            time.sleep(0.01)
        assert any(e["op"] == "(suppressed)" for e in audit_lines(ctx))
    finally:
        g.close()
    assert not g._thread.is_alive()


# --- reading frames ---------------------------------------------------------------------------------------


def test_frames_are_read_one_after_another_then_eof(
    pair: tuple[socket.socket, socket.socket], conn: Connection
) -> None:
    a = pair[0]
    a.sendall(encode_frame({"op": "x", "args": {}}) + encode_frame([1, 2]) + encode_frame(None))
    assert conn.read_request() == {"op": "x", "args": {}}
    assert conn.frame_deadline is None
    assert conn.read_request() == [1, 2]
    assert conn.read_request() is None  # a JSON null is a document, not the end
    a.shutdown(socket.SHUT_WR)
    assert conn.read_request() is EOF


def test_a_frame_split_in_small_pieces_is_gathered(
    pair: tuple[socket.socket, socket.socket], conn: Connection
) -> None:
    a = pair[0]
    frame = encode_frame({"op": "helper.ping", "args": {"k": "v" * 100}})

    def trickle() -> None:
        for i in range(0, len(frame), 3):
            a.sendall(frame[i : i + 3])
            time.sleep(0.001)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        assert conn.read_request() == {"op": "helper.ping", "args": {"k": "v" * 100}}
    finally:
        t.join()


def test_a_frame_larger_than_read_ahead_is_read_whole(
    pair: tuple[socket.socket, socket.socket], conn: Connection
) -> None:
    a = pair[0]
    doc = {"op": "x", "args": {"s": "y" * (server.READ_AHEAD * 3)}}
    t = threading.Thread(target=a.sendall, args=(encode_frame(doc) + encode_frame(7),))
    t.start()
    try:
        assert conn.read_request() == doc
        assert conn.read_request() == 7
    finally:
        t.join()


@pytest.mark.parametrize("sent", [b"\x00\x00", b"\x00\x00\x00\x10{}"])
def test_a_peer_closing_mid_frame_is_named(
    pair: tuple[socket.socket, socket.socket], sent: bytes, conn: Connection
) -> None:
    a = pair[0]
    a.sendall(sent)
    a.shutdown(socket.SHUT_WR)
    assert read_refused(conn) == "connection closed mid-frame"


def test_a_length_above_the_cap_is_refused(
    pair: tuple[socket.socket, socket.socket], conn: Connection
) -> None:
    a = pair[0]
    a.sendall(struct.pack(">I", MAX_FRAME + 1))
    assert read_refused(conn) == f"frame of {MAX_FRAME + 1} bytes exceeds {MAX_FRAME}"


def test_a_frame_at_the_cap_is_read(
    guards: Guards, pair: tuple[socket.socket, socket.socket], node_conn: Connection
) -> None:
    a = pair[0]
    frame = encode_frame("a" * (MAX_FRAME - 2))
    t = threading.Thread(target=a.sendall, args=(frame,))
    t.start()
    try:
        assert node_conn.read_request() == "a" * (MAX_FRAME - 2)
    finally:
        t.join()
    assert node_conn.reserved == frame_cost(MAX_FRAME) and guards.budget.used == frame_cost(MAX_FRAME)
    node_conn.release()
    assert node_conn.reserved == 0 and guards.budget.used == 0
    node_conn.release()
    assert guards.budget.used == 0


def test_only_a_non_root_peer_takes_from_the_budget(
    ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    root_conn = connection(ctx, guards, b)
    body = b'{"op":"x","args":{}}'
    a.sendall(struct.pack(">I", len(body)) + body)
    root_conn.read_request()
    assert root_conn.reserved == 0 and guards.budget.used == 0
    node_conn = connection(ctx, guards, b, uid=NODE)
    a.sendall(struct.pack(">I", len(body)) + body)
    node_conn.read_request()
    assert node_conn.reserved == frame_cost(len(body)) == guards.budget.used


def test_a_frame_that_cannot_get_its_budget_in_time_is_busy(
    pair: tuple[socket.socket, socket.socket],
    node_conn: Connection,
    budget_spent: None,
) -> None:
    a = pair[0]
    a.sendall(encode_frame({"op": "x", "args": {}}))
    with pytest.raises(Busy) as info:
        node_conn.read_request()
    assert str(info.value) == "the helper is busy with other large frames: try again later"
    assert node_conn.reserved == 0


def test_a_frame_not_complete_within_the_deadline_is_refused(
    ctx: HelperContext,
    guards: Guards,
    pair: tuple[socket.socket, socket.socket],
    monkeypatch: pytest.MonkeyPatch,
    conn: Connection,
) -> None:
    monkeypatch.setattr(server, "FRAME_TIMEOUT_S", 0.2)
    a, b = pair
    a.sendall(b"\x00\x00")
    assert read_refused(conn) == "frame not complete within 0 s"
    conn2 = connection(ctx, guards, b)
    a.sendall(b"\x00\x00\x00\x10{")
    assert read_refused(conn2) == "frame not complete within 0 s"


def test_a_deadline_already_past_is_refused_before_reading(conn: Connection) -> None:
    conn.buffer += b"\x00"
    conn.frame_deadline = time.monotonic() - 1
    assert read_refused(conn) == f"frame not complete within {server.FRAME_TIMEOUT_S:.0f} s"


def test_an_idle_connection_times_out_without_a_refusal(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch, conn: Connection
) -> None:
    monkeypatch.setattr(server, "IDLE_TIMEOUT_S", 0.05)
    b = pair[1]
    with pytest.raises(TimeoutError):
        conn.read_request()
    assert b.gettimeout() == 0.05


def test_a_passed_descriptor_is_closed_and_refused(
    pair: tuple[socket.socket, socket.socket], conn: Connection
) -> None:
    a = pair[0]
    r, w = os.pipe()
    try:
        a.sendmsg(
            [encode_frame({"op": "x", "args": {}})],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]).tobytes())],
        )
        before = set(os.listdir("/proc/self/fd"))
        assert (
            read_refused(conn) == "file descriptors or other ancillary data were sent: the helper takes none"
        )
        assert set(os.listdir("/proc/self/fd")) <= before  # the received copy was closed
    finally:
        os.close(r)
        os.close(w)


def test_an_answer_can_carry_a_descriptor(
    pair: tuple[socket.socket, socket.socket], conn: Connection
) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        conn.send({"ok": True, "result": {}}, r)
        assert b.gettimeout() == server.FRAME_TIMEOUT_S  # the descriptor's frame too, never unbounded
        data, ancdata, _flags, _addr = a.recvmsg(1 << 16, socket.CMSG_SPACE(4))
        assert data == encode_frame({"ok": True, "result": {}})
        ((level, kind, payload),) = ancdata
        assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
        got = array.array("i", payload)[0]
        os.write(w, b"z")
        assert os.read(got, 1) == b"z"
        os.close(got)
        conn.send([1])
        assert read_frame(a) == [1]
        assert b.gettimeout() == server.FRAME_TIMEOUT_S
    finally:
        os.close(r)
        os.close(w)


def test_an_answer_between_reads_goes_out_in_one_write_keeping_the_idle_timeout(
    ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]
) -> None:
    """The ratio work: after a read the socket is non-blocking under its idle timeout, and a usual answer is
    one write(2); neither the answer nor the next read sets the timeout again (each settimeout is a
    syscall)."""
    a, b = pair
    a.settimeout(10)
    conn = connection(ctx, guards, b)
    a.sendall(encode_frame({"op": "x", "args": {}}) * 2)
    assert conn.read_request() == {"op": "x", "args": {}}
    assert b.gettimeout() == server.IDLE_TIMEOUT_S
    conn.send({"ok": True, "result": {"n": 1}})
    assert read_frame(a) == {"ok": True, "result": {"n": 1}}
    assert b.gettimeout() == server.IDLE_TIMEOUT_S
    assert conn.read_request() == {"op": "x", "args": {}}


def test_an_answer_before_any_timeout_is_sent_under_the_frame_timeout(
    ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]
) -> None:
    """A connection's socket starts blocking (a refusal of its peer is sent before any read): never one
    unbounded write, the frame timeout first."""
    a, b = pair
    a.settimeout(10)
    conn = connection(ctx, guards, b)
    assert b.gettimeout() is None
    conn.send({"ok": False})
    assert read_frame(a) == {"ok": False}
    assert b.gettimeout() == server.FRAME_TIMEOUT_S


def fill(sock: socket.socket) -> int:
    """Write to `sock` until its buffer is full (nobody reads the other end); the bytes written."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    n = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            n += sock.send(b"j" * 65536)
    sock.settimeout(timeout)
    return n


def test_an_answer_to_a_full_socket_waits_for_room_and_goes_whole(
    ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]
) -> None:
    """The first write finds no room (EAGAIN): the whole answer goes through sendall once the peer reads."""
    a, b = pair
    a.settimeout(10)
    conn = connection(ctx, guards, b)
    a.sendall(encode_frame(1))
    assert conn.read_request() == 1
    junk = fill(b)
    got: list[Any] = []

    def drain() -> None:
        time.sleep(0.05)
        assert a.recv(junk, socket.MSG_WAITALL) == b"j" * junk
        got.append(read_frame(a))

    t = threading.Thread(target=drain)
    t.start()
    try:
        conn.send({"ok": True, "result": {"n": 2}})
    finally:
        t.join()
    assert got == [{"ok": True, "result": {"n": 2}}]


def test_an_answer_larger_than_the_socket_buffer_is_sent_whole(
    ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]
) -> None:
    """The first write takes what the socket buffer holds; the rest goes under the frame timeout."""
    a, b = pair
    conn = connection(ctx, guards, b)
    a.sendall(encode_frame(1))
    assert conn.read_request() == 1
    doc = {"ok": True, "result": {"s": "z" * (2 * 1024 * 1024)}}
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(read_frame(a)))
    t.start()
    try:
        conn.send(doc)
    finally:
        t.join()
    assert got == [doc]
    assert b.gettimeout() == server.FRAME_TIMEOUT_S


@pytest.mark.parametrize("first_read", [True, False])
def test_an_answer_not_taken_times_out_after_the_frame_timeout(
    ctx: HelperContext,
    guards: Guards,
    pair: tuple[socket.socket, socket.socket],
    monkeypatch: pytest.MonkeyPatch,
    first_read: bool,
) -> None:
    """A peer that reads nothing: the answer's rest waits FRAME_TIMEOUT_S, not the idle timeout."""
    monkeypatch.setattr(server, "FRAME_TIMEOUT_S", 0.05)
    a, b = pair
    conn = connection(ctx, guards, b)
    if first_read:
        a.sendall(encode_frame(1))
        assert conn.read_request() == 1
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.send({"ok": True, "result": {"s": "z" * (3 * 1024 * 1024)}})
    assert time.monotonic() - t0 < 5
    assert b.gettimeout() == 0.05


# --- answering ----------------------------------------------------------------------------------------------


@frozen
class Nothing:
    pass


@frozen
class Shown:
    kind: str = ""
    big: int = 0
    hidden: str = ""


def spec(handler: Any, **kw: Any) -> OpSpec:
    """A table row for a test op: the table names an op's module, request type and handler (imported
    on the first call), so the test's handler and type go in a module of their own."""
    mod = types.ModuleType(f"_server_unit_op_{len(sys.modules)}_{id(handler)}")
    mod.Request = kw.pop("request", Nothing)  # type: ignore[attr-defined]
    mod.handle = handler  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    fields: dict[str, Any] = {
        "module": mod.__name__,
        "request_name": "Request",
        "handler_name": "handle",
        "timeout_s": 5.0,
        "locks": (),
        "flags": frozenset(),
        "shown": (),
        "summary": "",
    }
    fields.update(kw)
    return OpSpec(**fields)


SHAPE = 'a request is exactly {"op": <string>, "args": <object>}, and optionally "trace": <traceparent>'


def last(ctx: HelperContext) -> dict[str, Any]:
    return audit_lines(ctx)[-1]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], SHAPE),
        ({"op": "helper.ping"}, SHAPE),
        ({"op": "helper.ping", "args": {}, "x": 1}, SHAPE),
        ({"op": "helper.ping", "trace": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "x": 1}, SHAPE),
        (["op", "args"], SHAPE),  # a list holding the two names is no request
        ({"op": 7, "args": {}}, "$.op: expected string"),
    ],
)
def test_a_request_outside_its_shape_is_refused(
    ctx: HelperContext, conn: Connection, doc: Any, message: str
) -> None:
    assert conn.answer(doc) == {"ok": False, "error": "refused", "reason": "bad-request", "message": message}
    e = last(ctx)
    assert (e["op"], e["decision"], e["reason"], e["message"]) == ("?", "refused", "bad-request", message)


def test_an_unknown_op_is_refused_naming_it_cut(ctx: HelperContext, conn: Connection) -> None:
    op = "x" * 150
    got = conn.answer({"op": op, "args": {}})
    assert got == {
        "ok": False,
        "error": "refused",
        "reason": "unknown-op",
        "message": f"unknown operation {'x' * 100!r}",
    }
    assert last(ctx)["op"] == "x" * 100


def test_bad_arguments_are_refused_naming_the_op_and_field(ctx: HelperContext, conn: Connection) -> None:
    got = conn.answer({"op": "helper.ping", "args": {"x": 1}})
    assert got == {
        "ok": False,
        "error": "refused",
        "reason": "bad-arguments",
        "message": "helper.ping: $.args: unknown field 'x'",
    }


def test_an_accepted_request_is_answered_and_audited(ctx: HelperContext, conn: Connection) -> None:
    got = conn.answer({"op": "helper.ping", "args": {}})
    assert got["ok"] is True and got["result"]["peer_uid"] == 0
    e = last(ctx)
    import hashlib

    assert (e["op"], e["decision"], e["reason"], e["message"], e["args"]) == (
        "helper.ping",
        "accepted",
        "",
        "",
        {},
    )
    assert e["args_sha256"] == hashlib.sha256(canonical({"op": "helper.ping", "args": {}})).hexdigest()
    assert (e["peer_pid"], e["peer_uid"]) == (os.getpid(), 0)
    assert 0 <= e["duration_ms"] < 60_000


def test_handler_outcomes_are_answered_and_audited(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(_call: Any, _req: Any) -> dict[str, Any]:
        raise Refused("nope", "r" * (MAX_TEXT + 10))

    def fail(_call: Any, _req: Any) -> dict[str, Any]:
        raise Failed("tool", "f" * (MAX_TEXT + 10))

    def boom(_call: Any, _req: Any) -> dict[str, Any]:
        raise RuntimeError("b" * (MAX_TEXT + 10))

    monkeypatch.setitem(OPS, "t.refuse", spec(refuse))
    monkeypatch.setitem(OPS, "t.fail", spec(fail))
    monkeypatch.setitem(OPS, "t.boom", spec(boom))
    assert conn.answer({"op": "t.refuse", "args": {}}) == {
        "ok": False,
        "error": "refused",
        "reason": "nope",
        "message": "r" * MAX_TEXT,
    }
    assert (last(ctx)["decision"], last(ctx)["reason"], last(ctx)["message"]) == (
        "refused",
        "nope",
        "r" * MAX_TEXT,
    )
    assert conn.answer({"op": "t.fail", "args": {}}) == {
        "ok": False,
        "error": "failed",
        "reason": "tool",
        "message": "f" * MAX_TEXT,
    }
    assert (last(ctx)["decision"], last(ctx)["reason"]) == ("failed", "tool")
    message = ("t.boom: RuntimeError: " + "b" * MAX_TEXT)[:MAX_TEXT]
    assert conn.answer({"op": "t.boom", "args": {}}) == {
        "ok": False,
        "error": "failed",
        "reason": "internal",
        "message": message,
    }
    assert (last(ctx)["decision"], last(ctx)["reason"], last(ctx)["message"]) == (
        "failed",
        "internal",
        message,
    )


def test_the_call_gets_the_peer_a_deadline_and_a_bounded_system(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def look(call: Any, req: Any) -> dict[str, Any]:
        seen.update(peer=call.peer, left=call.deadline.remaining(), seconds=call.deadline.seconds, req=req)
        seen["system"] = call.system
        return {"x": 1}

    monkeypatch.setitem(OPS, "t.look", spec(look, timeout_s=123.0))
    assert conn.answer({"op": "t.look", "args": {}}) == {"ok": True, "result": {"x": 1}}
    assert seen["peer"] == conn.peer and seen["seconds"] == 123.0 and 100 < seen["left"] <= 123.0
    assert seen["req"] == Nothing()
    from bcd_helper.ops.base import BoundedSystem

    assert isinstance(seen["system"], BoundedSystem) and seen["system"].inner is conn.ctx.system


def test_shown_arguments_are_recorded_bounded_the_rest_only_digested(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        OPS, "t.shown", spec(lambda _c, _r: {}, request=Shown, shown=("kind", "big", "absent"))
    )
    args = {"kind": "cdi", "big": 2**70, "hidden": "secret"}
    conn.answer({"op": "t.shown", "args": args})
    e = last(ctx)
    text = str(2**70).encode()
    import hashlib

    assert e["args"] == {
        "kind": "cdi",
        "big": {"bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()},
    }
    assert e["args_sha256"] == hashlib.sha256(canonical({"op": "t.shown", "args": args})).hexdigest()


def test_an_unprintable_integer_gets_a_zero_digest(ctx: HelperContext, conn: Connection) -> None:
    huge = 10**5000
    got = conn.answer({"op": "helper.ping", "args": {"n": huge}})
    assert got["reason"] == "bad-arguments"
    assert last(ctx)["args_sha256"] == "0" * 64


def test_refusals_past_the_burst_are_counted_not_audited(
    ctx: HelperContext,
    guards: Guards,
    monkeypatch: pytest.MonkeyPatch,
    node_conn: Connection,
) -> None:
    monkeypatch.setattr(server.time, "monotonic", lambda: 1000.0)  # no refill while the test runs
    for _ in range(REFUSAL_BURST + 5):
        assert node_conn.answer({"op": "no.such", "args": {}})["reason"] == "unknown-op"
    refused = [e for e in audit_lines(ctx) if e["reason"] == "unknown-op"]
    assert len(refused) == REFUSAL_BURST
    assert guards._pending == {NODE: {"unknown-op": 5}}
    # accepted lines are never limited
    assert node_conn.answer({"op": "helper.ping", "args": {}})["ok"] is True
    assert last(ctx)["decision"] == "accepted"


def test_a_full_audit_log_refuses_the_node_but_not_root_or_audit_head(
    ctx: HelperContext, guards: Guards, node_conn: Connection, conn: Connection
) -> None:
    ctx.audit._held = ctx.audit._keep * 4
    assert ctx.audit.full
    before = len(audit_lines(ctx))
    assert node_conn.answer({"op": "helper.ping", "args": {}}) == {
        "ok": False,
        "error": "refused",
        "reason": "audit-full",
        "message": "the audit log holds all the unexported files it may: read audit.head first",
    }
    assert len(audit_lines(ctx)) == before and guards._pending == {NODE: {"audit-full": 1}}
    assert node_conn.answer({"op": "audit.head", "args": {}})["ok"] is True
    assert conn.answer({"op": "helper.ping", "args": {}})["ok"] is True
    assert node_conn.answer({"op": 5, "args": {}})["reason"] == "bad-request"


# --- locks ----------------------------------------------------------------------------------------------


def test_an_ops_locks_are_held_in_order_while_it_runs_and_released(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[str] = []
    order: list[str] = []
    real = {n: ctx.locks[n] for n in ctx.locks}

    class Spy:
        def __init__(self, name: str) -> None:
            self.name = name

        def acquire(self, **kw: Any) -> bool:
            order.append(self.name)
            return real[self.name].acquire(**kw)

        def release(self) -> None:
            real[self.name].release()

    for name in ("system", "gpus", "units"):
        ctx.locks[name] = Spy(name)  # type: ignore[assignment]

    def look(_call: Any, _req: Any) -> dict[str, Any]:
        held.extend(n for n in ("system", "gpus", "units") if real[n].locked())
        return {}

    monkeypatch.setitem(OPS, "t.locks", spec(look, locks=("system", "units", "gpus")))
    assert conn.answer({"op": "t.locks", "args": {}})["ok"] is True
    assert order == ["units", "gpus", "system"]  # LOCK_ORDER, whatever the row lists
    assert sorted(held) == ["gpus", "system", "units"]
    assert not any(real[n].locked() for n in real)


def test_a_held_lock_refuses_busy_at_once_with_nowait_or_at_the_deadline(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        OPS,
        "t.nowait",
        spec(lambda _c, _r: {}, locks=("units", "system"), flags=frozenset({"nowait"}), timeout_s=30.0),
    )
    monkeypatch.setitem(OPS, "t.wait", spec(lambda _c, _r: {}, locks=("units", "system"), timeout_s=0.2))
    ctx.locks["system"].acquire()
    try:
        t0 = time.monotonic()
        assert conn.answer({"op": "t.nowait", "args": {}}) == {
            "ok": False,
            "error": "refused",
            "reason": "busy",
            "message": "another operation holds the helper's system lock",
        }
        assert time.monotonic() - t0 < 5
        assert not ctx.locks["units"].locked()  # the lock taken before is given back
        t0 = time.monotonic()
        assert conn.answer({"op": "t.wait", "args": {}})["reason"] == "busy"
        assert time.monotonic() - t0 >= 0.15
        assert not ctx.locks["units"].locked()
    finally:
        ctx.locks["system"].release()
    assert conn.answer({"op": "t.wait", "args": {}})["ok"] is True


def test_a_waiting_op_gets_the_lock_when_it_is_released(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(OPS, "t.wait", spec(lambda _c, _r: {}, locks=("gpus",), timeout_s=10.0))
    ctx.locks["gpus"].acquire()
    threading.Timer(0.05, ctx.locks["gpus"].release).start()
    assert conn.answer({"op": "t.wait", "args": {}})["ok"] is True


# --- the connection loop --------------------------------------------------------------------------------


def test_a_peer_that_may_not_use_the_socket_is_refused_and_closed(
    ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    conn = connection(ctx, guards, b, uid=1234)
    conn.serve()
    message = f"uid 1234 may not use this socket (only root and uid {NODE})"
    assert read_frame(a) == {"ok": False, "error": "refused", "reason": "peer", "message": message}
    e = last(ctx)
    assert (e["op"], e["decision"], e["reason"], e["message"], e["peer_uid"]) == (
        "(connect)",
        "refused",
        "peer",
        message,
        1234,
    )
    root_only = Connection(ctx, b, guards, (0,))
    root_only.peer = Peer(1, NODE, NODE)
    root_only.serve()
    assert read_frame(a)["message"] == f"uid {NODE} may not use this socket (only root)"


def test_the_loop_answers_each_request_until_the_end(
    guards: Guards, pair: tuple[socket.socket, socket.socket], node_conn: Connection
) -> None:
    a = pair[0]
    a.sendall(encode_frame({"op": "helper.ping", "args": {}}) + encode_frame({"op": "nope", "args": {}}))
    a.shutdown(socket.SHUT_WR)
    node_conn.serve()
    assert read_frame(a)["result"]["peer_uid"] == NODE
    assert read_frame(a)["reason"] == "unknown-op"
    assert node_conn.requests == 2 and guards.budget.used == 0


def test_the_loop_refuses_a_broken_frame_and_closes(
    ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket], node_conn: Connection
) -> None:
    a = pair[0]
    a.sendall(encode_frame({"op": "helper.ping", "args": {}}) + struct.pack(">I", 3) + b"{{{")
    node_conn.serve()
    assert read_frame(a)["ok"] is True
    answer = read_frame(a)
    assert (answer["ok"], answer["error"], answer["reason"]) == (False, "refused", "protocol")
    assert answer["message"].startswith("frame is not one JSON document: ")
    e = last(ctx)
    assert (e["op"], e["reason"], e["message"]) == ("(frame)", "protocol", answer["message"])
    assert node_conn.requests == 1 and guards.budget.used == 0


def test_args_sha256_is_the_digest_of_each_frame_body_exactly_as_received(
    ctx: HelperContext, pair: tuple[socket.socket, socket.socket], node_conn: Connection
) -> None:
    """Signed bytes are never re-encoded: a request's line pins the bytes that came (spaces, key order and
    escapes as sent), not a canonical re-encoding of what they decode to; a frame refused before its body
    was read (too large) has no bytes to pin, and its line never carries the last body's digest: it pins
    the canonical {"op", "args"} it records."""
    import hashlib

    a = pair[0]
    first = b'{ "args" : {}, "op" : "helper.ping" }'
    second = b'{"op":"helper.p\\u0069ng","args":{}}'
    for body in (first, second):
        a.sendall(struct.pack(">I", len(body)) + body)
    a.sendall(struct.pack(">I", MAX_FRAME + 1))
    node_conn.serve()
    assert [read_frame(a)["ok"] for _ in range(3)] == [True, True, False]
    lines = audit_lines(ctx)[-3:]
    assert [e["op"] for e in lines] == ["helper.ping", "helper.ping", "(frame)"]
    sent = [hashlib.sha256(b).hexdigest() for b in (first, second)]
    assert [e["args_sha256"] for e in lines[:2]] == sent
    assert lines[0]["args_sha256"] != hashlib.sha256(canonical(json.loads(first))).hexdigest()
    assert lines[2]["args_sha256"] == hashlib.sha256(canonical({"op": "(frame)", "args": None})).hexdigest()
    node_conn.body = first
    node_conn.release()  # as after each answer: the frame's bytes are let go with it, not kept while idle
    assert node_conn.body is None


def test_a_frame_refused_after_its_body_was_read_pins_those_bytes(
    ctx: HelperContext, pair: tuple[socket.socket, socket.socket], node_conn: Connection
) -> None:
    """A body that is not one JSON document is refused as a frame; its line pins the bytes received."""
    import hashlib

    a = pair[0]
    broken = b'{"op":'
    a.sendall(struct.pack(">I", len(broken)) + broken)
    node_conn.serve()
    assert read_frame(a)["reason"] == "protocol"
    e = last(ctx)
    assert (e["op"], e["args_sha256"]) == ("(frame)", hashlib.sha256(broken).hexdigest())


def test_a_line_without_a_frame_body_pins_the_canonical_request(
    ctx: HelperContext, pair: tuple[socket.socket, socket.socket], node_conn: Connection, budget_spent: None
) -> None:
    """A frame refused busy before its body was read pins the canonical {"op", "args"} it records, as for a
    refused connection."""
    import hashlib

    a = pair[0]
    a.sendall(encode_frame({"op": "helper.ping", "args": {}}))
    node_conn.serve()
    assert read_frame(a)["reason"] == "busy"
    e = last(ctx)
    assert (e["op"], e["args_sha256"]) == (
        "(frame)",
        hashlib.sha256(canonical({"op": "(frame)", "args": None})).hexdigest(),
    )


def test_the_loop_answers_busy_when_the_budget_is_spent(
    ctx: HelperContext,
    pair: tuple[socket.socket, socket.socket],
    node_conn: Connection,
    budget_spent: None,
) -> None:
    a = pair[0]
    a.sendall(encode_frame({"op": "helper.ping", "args": {}}))
    node_conn.serve()
    answer = read_frame(a)
    assert (answer["reason"], answer["message"]) == (
        "busy",
        "the helper is busy with other large frames: try again later",
    )
    assert last(ctx)["reason"] == "busy"


def test_a_peer_gone_is_not_a_refusal(
    ctx: HelperContext,
    guards: Guards,
    pair: tuple[socket.socket, socket.socket],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server, "IDLE_TIMEOUT_S", 0.05)
    _, b = pair
    before = len(audit_lines(ctx))
    connection(ctx, guards, b).serve()  # idle: times out
    assert len(audit_lines(ctx)) == before


def test_a_descriptor_in_a_result_is_sent_and_closed(
    ctx: HelperContext,
    guards: Guards,
    pair: tuple[socket.socket, socket.socket],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = pair
    r, w = os.pipe()
    handed: list[int] = []

    def console(_call: Any, _req: Any) -> dict[str, Any]:
        handed.append(os.dup(r))
        return {"_fd": handed[0], "pty": "x"}

    monkeypatch.setitem(OPS, "t.console", spec(console))
    a.sendall(encode_frame({"op": "t.console", "args": {}}))
    a.shutdown(socket.SHUT_WR)
    connection(ctx, guards, b).serve()
    with pytest.raises(OSError):
        os.fstat(handed[0])  # the helper's copy was closed once sent
    data, ancdata, _f, _a = a.recvmsg(1 << 16, socket.CMSG_SPACE(4))
    assert json.loads(data[4:]) == {"ok": True, "result": {"pty": "x"}}
    got = array.array("i", ancdata[0][2])[0]
    os.write(w, b"q")
    assert os.read(got, 1) == b"q"
    os.close(got)
    os.close(r)
    os.close(w)


# --- bounded audit lines ------------------------------------------------------------------------------


def test_bounded_shows_small_values_as_sent() -> None:
    import hashlib

    assert _bounded(None) is None and _bounded(True) is True and _bounded(False) is False
    assert _bounded(2**64 - 1) == 2**64 - 1 and _bounded(-(2**64) + 1) == -(2**64) + 1
    text = str(2**64).encode()
    assert _bounded(2**64) == {"bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()}
    short = "\u2028" * (MAX_SHOWN // 12)
    assert _bounded(short) is short
    at_cap = "a" * (MAX_SHOWN - 2)
    assert _bounded(at_cap) == at_cap
    over = "a" * (MAX_SHOWN - 1)
    data = canonical(over)
    assert _bounded(over) == {"bytes": MAX_SHOWN + 1, "sha256": hashlib.sha256(data).hexdigest()}
    fits = "\u2028" * ((MAX_SHOWN - 2) // 6)  # escaped: 6 bytes a character, 1022 in all
    assert _bounded(fits) == fits
    escaped = fits + "\u2028"  # 1028 bytes of JSON
    assert _bounded(escaped) == {"bytes": 1028, "sha256": hashlib.sha256(canonical(escaped)).hexdigest()}
    assert _bounded(["a", 1]) == ["a", 1]
    assert _bounded({"k": "v" * 2000})["bytes"] == len(canonical({"k": "v" * 2000}))


def test_bounded_digests_a_value_holding_an_unprintable_integer() -> None:
    import hashlib

    got = _bounded([10**5000])
    assert got == {"bytes": -1, "sha256": hashlib.sha256(b"<class 'list'> too large").hexdigest()}


def test_cut_keeps_the_text_within_characters_and_json_bytes() -> None:
    assert _cut("abc", 2) == "ab"
    assert _cut("a" * 5000, MAX_TEXT) == "a" * MAX_TEXT
    plain = "a" * (MAX_TEXT_BYTES - 2)
    assert _cut(plain, 10_000) == plain  # its JSON is exactly MAX_TEXT_BYTES
    assert _cut(plain + "a", 10_000) == (plain + "a")[: (MAX_TEXT_BYTES - 1) * 3 // 4]
    escaped = _cut("\u2028" * MAX_TEXT, MAX_TEXT)
    assert len(json.dumps(escaped)) <= MAX_TEXT_BYTES
    assert escaped == "\u2028" * 632  # 2000 -> 1500 -> 1125 -> 843 -> 632 characters: 3794 bytes


# --- the sockets ----------------------------------------------------------------------------------------


def test_the_servers_bind_their_sockets_with_their_modes(ctx: HelperContext, tmp_path: Path) -> None:
    node_path = str(tmp_path / "helper.sock")
    root_path = str(tmp_path / "root.sock")
    (tmp_path / "helper.sock").write_text("stale")  # an old socket file is replaced
    srv = server.HelperServer(ctx, node_path)
    rsrv = server.RootServer(ctx, root_path, srv.guards)
    # Serving before any check: `shutdown` below waits for serve_forever, so a failed check must not
    # leave it unstarted (the test would hang instead of failing).
    threads = [
        threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        for s in (srv, rsrv)
    ]
    for t in threads:
        t.start()
    try:
        st = os.stat(node_path)
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o660, 0, NODE)
        st = os.stat(root_path)
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o600, 0, 0)
        assert srv.uids is None and rsrv.uids == (0,)
        assert srv.request_queue_size == 128 and rsrv.request_queue_size == 64
        for path in (node_path, root_path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(10)
                c.connect(path)
                c.sendall(encode_frame({"op": "helper.ping", "args": {}}))
                assert read_frame(c)["result"]["peer_uid"] == 0
    finally:
        for s in (srv, rsrv):
            s.shutdown()
            s.server_close()
        srv.guards.close()


def test_a_connection_past_the_cap_is_refused_busy(
    guards: Guards, srv: server.HelperServer, node_peer: None
) -> None:
    one_slot_taken(srv)
    a, b = socket.socketpair()
    with a:
        srv.process_request(b, None)
        assert read_frame(a) == {
            "ok": False,
            "error": "refused",
            "reason": "busy",
            "message": f"more than {MAX_CONNECTIONS} connections at once: try again later",
        }
    assert guards._pending == {NODE: {"busy": 1}}
    srv._slots.release()
    a, b = socket.socketpair()
    with a:
        srv.process_request(b, None)  # a slot: served on its own thread, then the slot is given back
        a.sendall(encode_frame({"op": "helper.ping", "args": {}}))
        a.settimeout(10)
        assert read_frame(a)["result"]["peer_uid"] == NODE
        a.shutdown(socket.SHUT_WR)
        end = time.monotonic() + 10
        while time.monotonic() < end and not srv._slots.acquire(blocking=False):
            time.sleep(0.01)
    srv._slots.release()


def test_root_connections_take_no_slot(srv: server.HelperServer) -> None:
    one_slot_taken(srv)
    a, b = socket.socketpair()
    with a:
        srv.process_request(b, None)
        a.settimeout(10)
        a.sendall(encode_frame({"op": "helper.ping", "args": {}}))
        assert read_frame(a)["ok"] is True


def test_a_group_is_named_or_shown_by_number() -> None:
    assert server.node_group_name(0) == "root"
    assert server.node_group_name(2**31 - 7) == str(2**31 - 7)


# --- edges found by mutation testing ----------------------------------------------------------------------


def test_the_budget_waits_out_its_deadline_for_a_release() -> None:
    b = Budget(10)
    assert b.acquire(10, time.monotonic() + 5)
    releaser = threading.Timer(0.05, b.release, args=(10,))
    releaser.start()
    assert b.acquire(5, time.monotonic() + 0.5)  # less than a second left: still waits
    releaser.join()


def test_roots_socket_refuses_the_node_whatever_the_peer(
    ctx: HelperContext, tmp_path: Path, guards: Guards, monkeypatch: pytest.MonkeyPatch
) -> None:
    rsrv = server.RootServer(ctx, str(tmp_path / "root.sock"), guards)
    t = threading.Thread(target=rsrv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        monkeypatch.setattr(server, "peer_credentials", lambda _s: Peer(1, NODE, NODE))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10)
            c.connect(str(tmp_path / "root.sock"))
            assert read_frame(c) == {
                "ok": False,
                "error": "refused",
                "reason": "peer",
                "message": f"uid {NODE} may not use this socket (only root)",
            }
        monkeypatch.setattr(server, "peer_credentials", lambda _s: Peer(1, 0, 0))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10)
            c.connect(str(tmp_path / "root.sock"))
            c.sendall(encode_frame({"op": "no.such", "args": {}}))
            assert (
                read_frame(c)["reason"] == "unknown-op"
            )  # a refusal on root's socket is audited and answered
    finally:
        rsrv.shutdown()
        rsrv.server_close()


def test_a_server_without_guards_makes_its_own_over_the_context(ctx: HelperContext, tmp_path: Path) -> None:
    srv = server.HelperServer(ctx, str(tmp_path / "helper.sock"))
    try:
        srv.guards.count(NODE, "busy")
        srv.guards.flush()
        assert audit_lines(ctx)[-1]["op"] == "(suppressed)"
    finally:
        srv.server_close()
        srv.guards.close()


def test_the_server_holds_at_most_max_connections_of_the_node(
    ctx: HelperContext, tmp_path: Path, guards: Guards, monkeypatch: pytest.MonkeyPatch, node_peer: None
) -> None:
    monkeypatch.setattr(server, "MAX_CONNECTIONS", 1)  # before the server: its slots are made of it
    srv = server.HelperServer(ctx, str(tmp_path / "helper.sock"), guards)
    try:
        a, b = socket.socketpair()
        c, d = socket.socketpair()
        with a, c:
            srv.process_request(b, None)  # holds the one slot while its thread serves it
            srv.process_request(d, None)
            c.settimeout(10)
            assert read_frame(c)["reason"] == "busy"
            a.shutdown(socket.SHUT_WR)
    finally:
        srv.server_close()


def test_a_peer_whose_credentials_cannot_be_read_is_closed(srv: server.HelperServer, peer_gone: None) -> None:
    a, b = socket.socketpair()
    with a:
        srv.process_request(b, None)
        a.settimeout(10)
        assert a.recv(1) == b""  # closed, not served


def test_a_busy_refusal_to_a_peer_already_gone_is_quiet(
    guards: Guards, srv: server.HelperServer, node_peer: None
) -> None:
    one_slot_taken(srv)
    a, b = socket.socketpair()
    a.close()
    srv.process_request(b, None)  # the send fails (EPIPE): swallowed
    assert guards._pending == {NODE: {"busy": 1}}


def test_a_connections_thread_is_a_daemon_whatever_thread_accepts(srv: server.HelperServer) -> None:
    """The accept loop may run on a thread that is not a daemon: a connection's thread still must not hold
    the process's exit (a node that never closes its connection would keep a stopped helper alive)."""
    assert not threading.current_thread().daemon
    before = set(threading.enumerate())
    a, b = socket.socketpair()
    with a:
        srv.process_request(b, None)  # on this thread, not a daemon
        new = [t for t in threading.enumerate() if t not in before]
        assert [t.daemon for t in new] == [True]
        a.shutdown(socket.SHUT_WR)
        new[0].join(10)


def test_a_busy_refusal_never_blocks_the_accept_thread(
    guards: Guards, srv: server.HelperServer, node_peer: None
) -> None:
    """A peer past the cap that reads nothing (its socket's buffer full) gets no answer, and the accept
    thread goes on at once."""
    one_slot_taken(srv)
    a, b = socket.socketpair()
    with a:
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            while True:
                b.send(b"x" * 65536)
        b.setblocking(True)
        accept = threading.Thread(target=srv.process_request, args=(b, None), daemon=True)
        accept.start()
        accept.join(5)
        assert not accept.is_alive()
        assert b.fileno() == -1  # closed by the server
    assert guards._pending == {NODE: {"busy": 1}}


# --- edges found by the complete mutation run (docs/mutation.md) -------------------------------------------


class _Creds:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def getsockopt(self, level: int, name: int, size: int) -> bytes:
        assert (level, name, size) == (socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        return self.raw


def test_a_peers_uid_and_gid_are_read_unsigned() -> None:
    """struct ucred's uid_t and gid_t are unsigned: a uid past 2**31 (a user namespace's, say) is shown as
    itself in the audit line, never as a negative number."""
    raw = struct.pack("iII", 4321, 2**31 + 5, 2**32 - 2)
    assert server.peer_credentials(_Creds(raw)) == Peer(4321, 2**31 + 5, 2**32 - 2)  # type: ignore[arg-type]


def test_the_flusher_is_a_named_daemon_thread(guards: Guards) -> None:
    """It never holds the process's exit, and shows as `audit-flusher` in a thread dump."""
    assert (guards._thread.name, guards._thread.daemon, guards._thread.is_alive()) == (
        "audit-flusher",
        True,
        True,
    )


def test_closing_waits_a_bounded_time_for_a_stuck_flusher(
    ctx: HelperContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "FLUSH_S", 0.01)
    monkeypatch.setattr(server, "CLOSE_WAIT_S", 0.1)
    stuck, release = threading.Event(), threading.Event()
    real = ctx.audit.record

    def hang(**kw: Any) -> None:
        stuck.set()
        release.wait(30)
        real(**kw)

    monkeypatch.setattr(ctx.audit, "record", hang)
    g = Guards(ctx)
    g.count(NODE, "busy")
    assert stuck.wait(10)
    closer = threading.Thread(target=g.close, daemon=True)
    closer.start()
    closer.join(5)
    try:
        assert not closer.is_alive()  # back after CLOSE_WAIT_S, the flusher still stuck
    finally:
        release.set()
        g._thread.join(10)


def test_the_flusher_outlives_an_audit_write_error(
    ctx: HelperContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "FLUSH_S", 0.01)
    real = ctx.audit.record
    failures = [OSError("disk full")]

    def record(**kw: Any) -> None:
        if failures:
            raise failures.pop()
        real(**kw)

    monkeypatch.setattr(ctx.audit, "record", record)
    g = Guards(ctx)
    try:
        g.count(NODE, "busy")
        end = time.monotonic() + 10
        while time.monotonic() < end and failures:
            time.sleep(0.01)
        g.count(NODE, "peer")  # counted after the failed write: the flusher still writes it
        while time.monotonic() < end and not any(e["op"] == "(suppressed)" for e in audit_lines(ctx)):
            time.sleep(0.01)
        assert [e["args"] for e in audit_lines(ctx) if e["op"] == "(suppressed)"] == [
            {"count": 1, "reasons": {"peer": 1}}
        ]
        assert g._thread.is_alive()
    finally:
        g.close()


def test_ancillary_data_other_than_descriptors_is_refused_and_never_read_as_descriptors(
    ctx: HelperContext, guards: Guards, pair: tuple[socket.socket, socket.socket]
) -> None:
    """Credentials (SCM_CREDENTIALS, delivered once the socket has SO_PASSCRED) are refused like
    descriptors; their numbers (pid, uid, gid) are not taken for descriptors and closed."""
    a, b = pair
    b.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    conn = connection(ctx, guards, b)
    r, w = os.pipe()
    try:
        creds = struct.pack("3i", os.getpid(), r, w)  # root may send any uid and gid
        a.sendmsg(
            [encode_frame({"op": "x", "args": {}})], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)]
        )
        assert (
            read_refused(conn) == "file descriptors or other ancillary data were sent: the helper takes none"
        )
        os.fstat(r)
        os.fstat(w)  # still open
    finally:
        os.close(r)
        os.close(w)


def test_a_frame_deadline_reached_to_the_instant_is_refused(
    monkeypatch: pytest.MonkeyPatch, conn: Connection
) -> None:
    monkeypatch.setattr(server.time, "monotonic", lambda: 500.0)
    conn.buffer += b"\x00"
    conn.frame_deadline = 500.0
    assert read_refused(conn) == f"frame not complete within {server.FRAME_TIMEOUT_S:.0f} s"


def _later(sock: socket.socket, data: bytes, delay: float) -> threading.Thread:
    t = threading.Timer(delay, sock.sendall, args=(data,))
    t.start()
    return t


def test_a_frame_completed_with_under_a_second_left_is_read(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch, conn: Connection
) -> None:
    monkeypatch.setattr(server, "FRAME_TIMEOUT_S", 0.8)
    a = pair[0]
    frame = encode_frame({"op": "x", "args": {}})
    a.sendall(frame[:6])
    t = _later(a, frame[6:], 0.05)
    try:
        assert conn.read_request() == {"op": "x", "args": {}}
    finally:
        t.join()


def test_a_trickled_frame_gets_no_more_time_for_each_byte(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch, conn: Connection
) -> None:
    """The deadline runs from the frame's first byte: bytes arriving one by one, each well within it, do not
    move it."""
    monkeypatch.setattr(server, "FRAME_TIMEOUT_S", 0.5)
    a = pair[0]
    frame = encode_frame({"op": "x", "args": {}})

    def trickle() -> None:
        with contextlib.suppress(OSError):
            for i in range(4):
                a.sendall(frame[i : i + 1] if i < 3 else frame[3:])
                time.sleep(0.2)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        assert read_refused(conn) == "frame not complete within 0 s"
    finally:
        t.join()


def test_a_head_read_ahead_gets_the_frame_deadline(
    ctx: HelperContext,
    guards: Guards,
    pair: tuple[socket.socket, socket.socket],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes of the next frame read ahead with the last one start its deadline when it is read: a part of
    its length, or its whole length and part of its body."""
    monkeypatch.setattr(server, "FRAME_TIMEOUT_S", 0.3)
    monkeypatch.setattr(server, "IDLE_TIMEOUT_S", 1.0)
    first = encode_frame([1])
    nxt = encode_frame({"op": "x", "args": {}})
    for cut in (2, 6):
        a, b = socket.socketpair()
        with a, b:
            conn = connection(ctx, guards, b)
            a.sendall(first + nxt[:cut])
            assert conn.read_request() == [1]
            t = _later(a, nxt[cut:], 0.05)  # the rest well within the deadline
            try:
                assert conn.read_request() == {"op": "x", "args": {}}
            finally:
                t.join()
            a.sendall(first + nxt[:cut])  # the rest never comes: refused at the frame's deadline
            assert conn.read_request() == [1]
            assert read_refused(conn) == "frame not complete within 0 s"


def test_a_large_answer_with_a_descriptor_is_sent_whole(
    pair: tuple[socket.socket, socket.socket], conn: Connection
) -> None:
    """More than the socket takes at once: the rest follows the part sent with the descriptor."""
    a = pair[0]
    doc = {"ok": True, "result": {"log": "z" * (2 * 1024 * 1024)}}
    got: dict[str, Any] = {}

    def reader() -> None:
        a.settimeout(30)
        data, ancdata, _flags, _addr = a.recvmsg(1 << 16, socket.CMSG_SPACE(4))
        got["fds"] = [array.array("i", p)[0] for _l, _k, p in ancdata]
        rest = bytearray(data)
        n = struct.unpack(">I", rest[:4])[0] + 4
        while len(rest) < n:
            rest += a.recv(1 << 20)
        got["frame"] = bytes(rest)

    r, w = os.pipe()
    t = threading.Thread(target=reader)
    t.start()
    try:
        conn.send(doc, r)
        t.join(30)
        assert got["frame"] == encode_frame(doc)
        assert len(got["fds"]) == 1
        os.close(got["fds"][0])
    finally:
        os.close(r)
        os.close(w)


def test_roots_refusals_are_never_rate_limited(
    ctx: HelperContext, conn: Connection, guards: Guards, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.time, "monotonic", lambda: 1000.0)  # no refill while the test runs
    for _ in range(REFUSAL_BURST + 3):
        assert conn.answer({"op": "no.such", "args": {}})["reason"] == "unknown-op"
    assert len([e for e in audit_lines(ctx) if e["reason"] == "unknown-op"]) == REFUSAL_BURST + 3
    assert guards._pending == {}


def test_the_duration_is_recorded_in_milliseconds(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.time, "monotonic", lambda: 1000.0)
    conn.audit("helper.ping", {}, OPS["helper.ping"], "accepted", "", "", 999.75)
    assert last(ctx)["duration_ms"] == 250.0


def test_root_is_served_while_the_audit_log_is_full(
    ctx: HelperContext, conn: Connection, guards: Guards
) -> None:
    ctx.audit._held = ctx.audit._keep * 4
    assert ctx.audit.full
    assert conn.answer({"op": "helper.ping", "args": {}})["ok"] is True
    assert last(ctx)["decision"] == "accepted" and guards._pending == {}


def test_refused_and_failed_requests_show_their_arguments(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    def refuse(_call: Any, _req: Any) -> dict[str, Any]:
        raise Refused("nope", "no")

    def fail(_call: Any, _req: Any) -> dict[str, Any]:
        raise Failed("tool", "broke")

    def boom(_call: Any, _req: Any) -> dict[str, Any]:
        raise RuntimeError("bug")

    for name, handler, decision in [
        ("t.refuse", refuse, "refused"),
        ("t.fail", fail, "failed"),
        ("t.boom", boom, "failed"),
    ]:
        monkeypatch.setitem(OPS, name, spec(handler, request=Shown, shown=("kind",)))
        args = {"kind": "cdi", "hidden": "secret"}
        assert conn.answer({"op": name, "args": args})["ok"] is False
        e = last(ctx)
        assert (e["op"], e["decision"], e["args"]) == (name, decision, {"kind": "cdi"})
        assert e["args_sha256"] == hashlib.sha256(canonical({"op": name, "args": args})).hexdigest()


def test_an_unexpected_error_before_the_op_is_looked_up_names_the_op_cut(
    ctx: HelperContext, monkeypatch: pytest.MonkeyPatch, node_conn: Connection
) -> None:
    def broken(_self: Any) -> bool:
        raise OSError("audit directory gone")

    monkeypatch.setattr(AuditLog, "full", property(broken))
    op = "o" * 150
    message = f"{'o' * 100}: OSError: audit directory gone"
    assert node_conn.answer({"op": op, "args": {}}) == {
        "ok": False,
        "error": "failed",
        "reason": "internal",
        "message": message,
    }
    assert (last(ctx)["op"], last(ctx)["message"]) == ("o" * 100, message)


def test_serving_a_peer_already_gone_is_quiet(ctx: HelperContext, guards: Guards) -> None:
    """A refusal that cannot be sent (the peer closed its end) still is audited, and serve returns."""
    a, b = socket.socketpair()
    with b:
        a.close()
        stranger = connection(ctx, guards, b, uid=NODE + 1)
        stranger.serve()
        e = last(ctx)
        assert (e["op"], e["decision"], e["reason"]) == ("(connect)", "refused", "peer")
    a, b = socket.socketpair()
    with b:
        a.sendall(struct.pack(">I", MAX_FRAME + 1))
        a.close()
        connection(ctx, guards, b, uid=NODE).serve()
        e = last(ctx)
        assert (e["op"], e["decision"], e["reason"], e["message"]) == (
            "(frame)",
            "refused",
            "protocol",
            f"frame of {MAX_FRAME + 1} bytes exceeds {MAX_FRAME}",
        )


def test_a_handler_whose_peer_is_gone_prints_nothing(
    capsys: pytest.CaptureFixture[str], srv: server.HelperServer, peer_gone: None
) -> None:
    """socketserver prints a traceback for an exception a handler lets out: a peer gone is not one."""
    a, b = socket.socketpair()
    with a:
        srv.process_request_thread(b, "")
    assert capsys.readouterr().err == ""


def test_a_socket_is_never_more_open_than_0600_before_its_mode_is_set(
    ctx: HelperContext, tmp_path: Path, guards: Guards, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes: list[int] = []
    real = os.chown

    def chown(path: str, uid: int, gid: int) -> None:
        modes.append(os.stat(path).st_mode & 0o777)
        real(path, uid, gid)

    monkeypatch.setattr(server.os, "chown", chown)
    srv = server.HelperServer(ctx, str(tmp_path / "helper.sock"), guards)
    rsrv = server.RootServer(ctx, str(tmp_path / "root.sock"), guards)
    srv.server_close()
    rsrv.server_close()
    assert modes == [0o600, 0o600]


def test_a_connection_whose_thread_cannot_start_gives_back_its_slot(
    monkeypatch: pytest.MonkeyPatch, srv: server.HelperServer, node_peer: None
) -> None:
    srv._slots = threading.BoundedSemaphore(1)

    def no_thread(_self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    a, b = socket.socketpair()
    with a:
        with monkeypatch.context() as m:
            m.setattr(threading.Thread, "start", no_thread)
            with pytest.raises(RuntimeError, match="can't start new thread"):
                srv.process_request(b, None)
        assert b.fileno() == -1
        assert srv._slots.acquire(blocking=False)  # the slot was given back


# --- a request's trace (DLV-CMD-15) -----------------------------------------------------------------------

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACED = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACE_RULE = (
    "$.trace: expected a W3C traceparent of version 00, exactly 55 characters 00-<32 hex>-<16 hex>-<2 hex> "
    "in lower case, neither id all zeros"
)


def test_DLV_CMD_15_a_requests_trace_goes_on_its_line_whatever_its_outcome(
    ctx: HelperContext, node_conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DLV-CMD-15: the trace id and parent id a request carries are on its audit line, accepted, refused
    (by the decoding, an unknown op, the handler) or failed (the handler, an unexpected error); a request
    without `trace` gets a line without either field."""

    def refuse(_call: Any, _req: Any) -> dict[str, Any]:
        raise Refused("nope", "no")

    def fail(_call: Any, _req: Any) -> dict[str, Any]:
        raise Failed("tool", "broke")

    def boom(_call: Any, _req: Any) -> dict[str, Any]:
        raise RuntimeError("bug")

    monkeypatch.setitem(OPS, "t.refuse", spec(refuse))
    monkeypatch.setitem(OPS, "t.fail", spec(fail))
    monkeypatch.setitem(OPS, "t.boom", spec(boom))
    for op, args, outcome in [
        ("helper.ping", {}, ("accepted", "")),
        ("helper.ping", {"x": 1}, ("refused", "bad-arguments")),
        ("t.nothing", {}, ("refused", "unknown-op")),
        ("t.refuse", {}, ("refused", "nope")),
        ("t.fail", {}, ("failed", "tool")),
        ("t.boom", {}, ("failed", "internal")),
    ]:
        node_conn.answer({"op": op, "args": args, "trace": TRACED})
        e = last(ctx)
        assert (e["op"], e["decision"], e["reason"]) == (op, *outcome), e
        assert (e["trace_id"], e["parent_id"]) == (TRACE_ID, PARENT_ID), e
        node_conn.answer({"op": op, "args": args})
        e = last(ctx)
        assert (e["op"], e["decision"], e["reason"]) == (op, *outcome), e
        assert "trace_id" not in e and "parent_id" not in e, e


@pytest.mark.parametrize(
    "value",
    [
        TRACED.upper(),
        "01" + TRACED[2:],
        TRACED + "-x",
        TRACED[:-1],
        f"00-{'0' * 32}-{PARENT_ID}-01",
        f"00-{TRACE_ID}-{'0' * 16}-01",
        None,
        55,
        [TRACED],
    ],
)
def test_DLV_CMD_15_a_bad_trace_is_refused_word_for_word(
    ctx: HelperContext, node_conn: Connection, value: Any
) -> None:
    """DLV-CMD-15: `trace` is decoded strictly: anything but a valid version-00 traceparent is refused
    `bad-request`, the message naming the op, the field and the rule; the line has no trace fields."""
    got = node_conn.answer({"op": "helper.ping", "args": {}, "trace": value})
    message = f"helper.ping: {TRACE_RULE}"
    assert got == {"ok": False, "error": "refused", "reason": "bad-request", "message": message}
    e = last(ctx)
    assert (e["op"], e["decision"], e["reason"], e["message"]) == (
        "helper.ping",
        "refused",
        "bad-request",
        message,
    )
    assert "trace_id" not in e and "parent_id" not in e


def test_a_bad_traces_refusal_names_the_op_cut_to_100_characters(
    ctx: HelperContext, node_conn: Connection
) -> None:
    got = node_conn.answer({"op": "x" * 150, "args": {}, "trace": "bad"})
    assert got["message"] == f"{'x' * 100}: {TRACE_RULE}"


def test_a_valid_trace_of_any_flags_is_taken(ctx: HelperContext, node_conn: Connection) -> None:
    for flags in ("00", "ff", "0a"):
        assert node_conn.answer({"op": "helper.ping", "args": {}, "trace": TRACED[:-2] + flags})["ok"] is True
        assert last(ctx)["trace_id"] == TRACE_ID


class _Clock:
    """server.time stood in for by a clock that moves 50 us at each reading (no real time is measured)."""

    def __init__(self) -> None:
        self.now = 0
        self.reads = 0

    def monotonic_ns(self) -> int:
        self.reads += 1
        self.now += 50_000
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_after_an_answer_a_connection_polls_for_its_next_request_until_the_spin_ends(
    monkeypatch: pytest.MonkeyPatch, conn: Connection, pair: tuple[socket.socket, socket.socket]
) -> None:
    """The ratio work, round 11: with nothing sent, `_await_next` polls until NEXT_REQUEST_SPIN_NS is past
    (by the clock), then leaves the sleeping read to read_request; the spinner is free again after."""
    clock = _Clock()
    monkeypatch.setattr(server, "time", clock)
    polls: list[int] = []
    real_poll = select.poll

    class CountingPoll:
        def __init__(self) -> None:
            self.inner = real_poll()

        def register(self, fd: int, events: int) -> None:
            self.inner.register(fd, events)

        def poll(self, timeout: int) -> list[tuple[int, int]]:
            polls.append(timeout)
            return self.inner.poll(timeout)

    monkeypatch.setattr(server.select, "poll", CountingPoll)
    conn._await_next()
    spin = server.NEXT_REQUEST_SPIN_NS // 50_000
    assert polls == [0] * spin  # never a poll that sleeps; stops when the clock passes the end
    assert clock.reads == spin + 1
    assert conn.guards.spinner.acquire(blocking=False)
    conn.guards.spinner.release()
    polls.clear()
    pair[0].sendall(encode_frame({"op": "x", "args": {}}))
    conn._await_next()
    assert polls == [0]  # the request is there: the first poll sees it
    assert conn.read_request() == {"op": "x", "args": {}}


def test_one_connection_polls_at_a_time_and_none_with_bytes_already_read(
    monkeypatch: pytest.MonkeyPatch, conn: Connection, pair: tuple[socket.socket, socket.socket]
) -> None:
    """A flood of connections burns one thread's polling at most: while another connection holds the
    spinner, `_await_next` returns at once (no clock read, no poll); so does a connection holding read-ahead
    bytes of its next frame (they are its next request)."""
    clock = _Clock()
    monkeypatch.setattr(server, "time", clock)
    with conn.guards.spinner:
        conn._await_next()
    assert clock.reads == 0 and conn._poll is None
    conn.buffer += b"\0"
    conn._await_next()
    assert clock.reads == 0 and conn._poll is None


def test_the_serving_loop_polls_only_between_requests(
    monkeypatch: pytest.MonkeyPatch, conn: Connection, pair: tuple[socket.socket, socket.socket]
) -> None:
    """Not before the first request (a new connection has nothing to be quick for), then once after each."""
    calls: list[int] = []
    monkeypatch.setattr(Connection, "_await_next", lambda self: calls.append(self.requests))
    a = pair[0]
    a.sendall(encode_frame({"op": "helper.ping", "args": {}}) * 2)
    a.shutdown(socket.SHUT_WR)
    conn.serve()
    assert calls == [1, 2]
    assert [read_frame(a)["ok"] for _ in range(2)] == [True, True]
