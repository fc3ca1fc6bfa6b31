"""The session's send queue: serialized NodeMessages waiting for the stream, with their bytes counted.

One per connection. `put` serializes the message once (the codec sends those bytes as they are) and
refuses, with `OutboxFull`, a message that would take the queue over `max_bytes`: a gateway that stopped
reading does not make the node buffer without bound, it gets its session replaced, and everything that
must reach it is durable (results and events in the journal, replayed after the next Hello; the status
and heartbeats are rebuilt). A byte stays counted until the stream has taken it (`sent`), so `bytes`
includes the message in flight. The session reads journal events only while `room()` is above the
events' share (`SessionCore.pump_events`), so a backlog of events never fills the queue by itself.
"""

from __future__ import annotations

from collections import deque

import trio
from bcd_shared import wire

# Ceiling on the bytes queued for one connection (every message kind together).
MAX_OUTBOX_BYTES = 8 * 1024 * 1024
# Events are read from the journal only while at least this much room is left for other messages.
EVENT_RESERVE_BYTES = 6 * 1024 * 1024


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited field (wire type 2), omitted when empty as proto3 omits defaults."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data if data else b""


def encode(message: wire.NodeMessage) -> bytes:
    """The message's protobuf bytes. A NodeMessage holding only a CommandUpdate (three per command, the
    bulk of what a busy node sends) is encoded here, field by field in number order with defaults left
    out, exactly as betterproto encodes it (tests/session/test_outbox.py compares them) and ~40 times
    faster; any other message goes through betterproto."""
    u = message.command_update
    if u is None or any(
        getattr(message, name) is not None
        for name in ("hello", "heartbeat", "status", "event_batch", "spec_request", "secret_request")
    ):
        return bytes(message)
    state = int(u.state)
    body = b"".join(
        (
            _field(1, u.command_id.encode()),
            (_varint(2 << 3) + _varint(state)) if state else b"",
            _field(3, u.error_code.encode()),
            _field(4, u.reason.encode()),
            _field(5, u.message.encode()),
            _field(6, bytes(u.result)),
            _field(7, u.boot_id.encode()),
            _field(8, bytes(u.attestation)),
            _field(9, bytes(u.node_sig)),
        )
    )
    return _varint(4 << 3 | 2) + _varint(len(body)) + body


class OutboxFull(Exception):
    """The queue is at its ceiling: the gateway is not reading; the session is replaced."""


class Outbox:
    def __init__(self, max_bytes: int = MAX_OUTBOX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._items: deque[bytes] = deque()
        self.bytes = 0
        self.peak_bytes = 0
        self.messages = 0
        self._ready = trio.Event()

    def put(self, message: wire.NodeMessage) -> None:
        data = encode(message)
        if self.bytes + len(data) > self.max_bytes:
            raise OutboxFull(
                f"the gateway is not reading: {self.bytes} bytes ({len(self._items)} messages) are queued"
                f" and a {len(data)}-byte message would pass the {self.max_bytes}-byte ceiling"
            )
        self._items.append(data)
        self.bytes += len(data)
        self.messages += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._ready.set()

    def room(self) -> int:
        return self.max_bytes - self.bytes

    def __len__(self) -> int:
        return len(self._items)

    async def next(self) -> bytes:
        """The oldest queued message (it stays counted until `sent`)."""
        while not self._items:
            self._ready = trio.Event()
            await self._ready.wait()
        return self._items[0]

    def sent(self, count: int = 1) -> None:
        for _ in range(count):
            data = self._items.popleft()
            self.bytes -= len(data)

    async def batch(self, max_bytes: int) -> list[bytes]:
        """The oldest queued messages, up to `max_bytes` together (always at least one); they stay
        counted until `sent(len(batch))`."""
        await self.next()
        out: list[bytes] = []
        total = 0
        for data in self._items:
            if out and total + len(data) > max_bytes:
                break
            out.append(data)
            total += len(data)
        return out
