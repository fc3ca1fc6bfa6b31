"""The node's HelperClient reading answers (bcd_agent.helperclient._read_answer): a small answer in one read,
a split one gathered, and a broken stream (closed, oversized, more than one frame) refused as
`unreachable` with the connection dropped. The helper end is a socket pair driven by the test."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest
from bcd_agent.helperclient import MAX_FRAME, HelperClient
from bcd_shared.errors import HelperRefused


def frame(doc: object) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack(">I", len(body)) + body


def serve_once(
    reply: Callable[[socket.socket], None],
) -> tuple[HelperClient, socket.socket, threading.Thread]:
    a, b = socket.socketpair()
    client = HelperClient("unused")
    client._sock = a

    def run() -> None:
        (n,) = struct.unpack(">I", b.recv(4, socket.MSG_WAITALL))
        b.recv(n, socket.MSG_WAITALL)
        reply(b)

    t = threading.Thread(target=run)
    t.start()
    return client, b, t


def test_an_answer_in_one_piece_is_read() -> None:
    client, b, t = serve_once(lambda s: s.sendall(frame({"ok": True, "result": {"x": 1}})))
    with b:
        assert client.call("helper.ping") == {"x": 1}
        t.join()
    client.close()


def test_an_answer_split_byte_by_byte_is_gathered() -> None:
    data = frame({"ok": True, "result": {"text": "y" * 300}})

    def trickle(s: socket.socket) -> None:
        for i in range(len(data)):
            s.sendall(data[i : i + 1])

    client, b, t = serve_once(trickle)
    with b:
        assert client.call("helper.ping") == {"text": "y" * 300}
        t.join()
    client.close()


def test_an_answer_larger_than_one_read_is_read_whole() -> None:
    client, b, t = serve_once(lambda s: s.sendall(frame({"ok": True, "result": {"t": "z" * 200_000}})))
    with b:
        assert client.call("helper.ping") == {"t": "z" * 200_000}
        t.join()
    client.close()


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (lambda s: s.sendall(frame({"ok": True}) + frame({"ok": True})), "more than one answer"),
        (lambda s: s.sendall(struct.pack(">I", MAX_FRAME + 1)), "too large"),
        (lambda s: s.sendall(b"\0\0"), "closed the connection"),
        (lambda s: s.sendall(struct.pack(">I", 10) + b"{}"), "closed the connection"),
    ],
)
def test_a_broken_stream_is_unreachable_and_dropped(
    reply: Callable[[socket.socket], None], words: str
) -> None:
    def then_close(s: socket.socket) -> None:
        reply(s)
        s.shutdown(socket.SHUT_WR)

    client, b, t = serve_once(then_close)
    with b:
        with pytest.raises(HelperRefused) as info:
            client.call("helper.ping")
        t.join()
    assert info.value.reason == "unreachable" and words in str(info.value)
    assert client._sock is None  # dropped: the next call reconnects


# --- sending (the ratio work: one write(2) for a usual request) ---------------------------------------------


def test_a_request_larger_than_the_socket_buffer_is_sent_whole() -> None:
    """The first write takes what the socket buffer holds; the rest goes through sendall."""
    got: list[bytes] = []
    a, b = socket.socketpair()
    client = HelperClient("unused")
    client._sock = a

    def run() -> None:
        (n,) = struct.unpack(">I", b.recv(4, socket.MSG_WAITALL))
        got.append(b.recv(n, socket.MSG_WAITALL))
        b.sendall(frame({"ok": True, "result": {}}))

    t = threading.Thread(target=run)
    t.start()
    content = "c" * (2 * 1024 * 1024)
    with b:
        assert client.file_write("cdi", "a1", content) == {}
        t.join()
    client.close()
    assert json.loads(got[0]) == {
        "op": "file.write",
        "args": {"kind": "cdi", "id": "a1", "content": content, "encoding": "utf-8"},
    }


def test_a_request_the_helper_does_not_take_times_out_unreachable() -> None:
    a, b = socket.socketpair()
    client = HelperClient("unused")
    client._sock = a
    with b, pytest.raises(HelperRefused) as info:
        client.call("helper.ping", {"s": "c" * (3 * 1024 * 1024)}, timeout=0.05)
    assert info.value.reason == "unreachable"
    assert client._sock is None  # dropped


def test_a_request_to_a_full_socket_waits_for_room_and_goes_whole() -> None:
    """The first write finds no room (EAGAIN): the whole request goes by sendall once the helper reads."""
    a, b = socket.socketpair()
    b.settimeout(10)
    a.setblocking(False)
    junk = 0
    try:
        while True:
            junk += a.send(b"j" * 65536)
    except BlockingIOError:
        pass
    client = HelperClient("unused")
    client._sock = a
    got: list[bytes] = []

    def run() -> None:
        time.sleep(0.05)
        assert b.recv(junk, socket.MSG_WAITALL) == b"j" * junk
        (n,) = struct.unpack(">I", b.recv(4, socket.MSG_WAITALL))
        got.append(b.recv(n, socket.MSG_WAITALL))
        b.sendall(frame({"ok": True, "result": {"x": 3}}))

    t = threading.Thread(target=run)
    t.start()
    with b:
        assert client.call("helper.ping") == {"x": 3}
        t.join()
    client.close()
    assert json.loads(got[0]) == {"op": "helper.ping", "args": {}}


def test_DLV_CMD_15_a_request_carries_the_current_trace_as_version_00_and_none_outside_one() -> None:
    """DLV-CMD-15: inside a command's trace context the client's request carries `trace`, the context
    written as a version-00 traceparent (a later version's value re-written so); outside one, the request
    is exactly {"op", "args"}."""
    from bcd_shared import tracecontext

    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    a, b = socket.socketpair()
    client = HelperClient("unused")
    client._sock = a
    sent: list[dict[str, object]] = []

    def run() -> None:
        for _ in range(3):
            (n,) = struct.unpack(">I", b.recv(4, socket.MSG_WAITALL))
            sent.append(json.loads(b.recv(n, socket.MSG_WAITALL)))
            b.sendall(frame({"ok": True, "result": {}}))

    t = threading.Thread(target=run)
    t.start()
    with b:
        with tracecontext.current(f"00-{trace}-{parent}-01"):
            client.call("helper.ping")
        with tracecontext.current(f"cc-{trace}-{parent}-0a-later"):
            client.call("helper.ping")
        client.call("helper.ping")
        t.join()
    client.close()
    assert sent == [
        {"op": "helper.ping", "args": {}, "trace": f"00-{trace}-{parent}-01"},
        {"op": "helper.ping", "args": {}, "trace": f"00-{trace}-{parent}-0a"},
        {"op": "helper.ping", "args": {}},
    ]
