"""The session's transport: grpclib under trio-asyncio. The only agent module that imports asyncio/grpclib.

- `StrictCodec`: grpclib codec that encodes with betterproto2 and decodes every received message through
  `bcd_shared.wire.strict.decode` (unknown fields, duplicates, truncation refused: house rule 4).
- `Endpoint`: where the gateway is: a Unix socket (local, no TLS: the development control plane and
  `bcd sim`) or `host:port` with mutual TLS (the node key and certificate; the gateway's CA from
  `[control_plane] ca_file` or identity.json).
- `open_loop()`: enters a trio-asyncio loop unless the calling task already runs inside one (so `bcd sim`
  can host the node and the development control plane under one loop).
- `open_stream(endpoint, limits)`: an async context manager yielding a `StreamHandle` with trio-callable
  `send` and `recv` (None at the end of the stream). `recv` reads the 5-byte gRPC message prefix itself
  and refuses a message longer than `limits.max_message_bytes` (gRPC's usual 4 MiB) before reading any
  of its body, so HTTP/2 flow control holds the rest back at the peer; a body that stops arriving for
  `limits.frame_deadline_s` is refused too. Both raise `FrameRefused` (a protocol error: the session is
  replaced).
- `join_call(endpoint, request)`: the unary Join RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
from collections.abc import AsyncIterator
from typing import Any

import trio
import trio_asyncio
from attrs import frozen
from bcd_shared import wire
from bcd_shared.wire.strict import decode
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality
from grpclib.encoding.base import CodecBase

from bcd_agent.wire import JOIN_PATH, SESSION_STREAM_PATH

# gRPC's usual cap on a received message; `[control_plane] max_message_bytes` may set another.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# How long the rest of a message may take once its length prefix arrived.
FRAME_DEADLINE_S = 10.0
# How long closing a stream may take (the channel's connection is closed after it either way).
CLOSE_S = 2.0


class FrameRefused(Exception):
    """The gateway sent a message over the size cap, or one that stopped arriving: a protocol error."""


def describe_transport_error(exc: BaseException) -> str | None:
    """One line for grpclib's errors (the session's log names the cause), None for other exceptions."""
    from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

    if isinstance(exc, GRPCError):
        return f"the gateway closed the stream: {exc.status.name}: {exc.message or ''}".rstrip(": ")
    if isinstance(exc, StreamTerminatedError):
        return f"the gateway closed the stream: {exc}"
    if isinstance(exc, ProtocolError):
        return f"protocol error (HTTP/2): {exc}"
    return None


@frozen
class StreamLimits:
    max_message_bytes: int = MAX_MESSAGE_BYTES
    frame_deadline_s: float = FRAME_DEADLINE_S


class StrictCodec(CodecBase):
    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, bytes):
            return message  # serialized once by the session's outbox (session.outbox)
        if not isinstance(message, message_type):
            raise TypeError(f"{type(message).__name__} is not {message_type.__name__}")
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return decode(message_type, data)


@frozen
class Endpoint:
    """The gateway: `unix_path`, or `host`/`port` with TLS material (PEM text / file path)."""

    host: str | None = None
    port: int | None = None
    unix_path: str | None = None
    ca_pem: str | None = None  # the gateway's CA
    client_pem_path: str | None = None  # the node key + chain (mutual TLS); None: server-auth only (join)
    server_name: str | None = None

    @classmethod
    def parse(cls, address: str, **kw: Any) -> Endpoint:
        """`unix:/path`, `/path`, `host:port` or `[v6]:port`."""
        if address.startswith("unix:"):
            return cls(unix_path=address[5:], **kw)
        if address.startswith("/"):
            return cls(unix_path=address, **kw)
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"address {address!r}: expected host:port or unix:/path")
        return cls(host=host.strip("[]"), port=int(port), **kw)

    def describe(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.unix_path:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        if self.ca_pem:
            ctx.load_verify_locations(cadata=self.ca_pem)
        else:
            ctx.load_default_certs()
        if self.client_pem_path:
            ctx.load_cert_chain(self.client_pem_path)
        ctx.set_alpn_protocols(["h2"])
        return ctx


@contextlib.asynccontextmanager
async def open_loop() -> AsyncIterator[None]:
    """A trio-asyncio loop for this task, unless one is already current."""
    if trio_asyncio.current_loop.get() is not None:
        yield
        return
    async with trio_asyncio.open_loop():
        yield


def _channel(endpoint: Endpoint, codec: CodecBase | None = None) -> Channel:
    codec = codec or StrictCodec()
    if endpoint.unix_path:
        return Channel(path=endpoint.unix_path, codec=codec)
    config = Configuration(ssl_target_name_override=endpoint.server_name) if endpoint.server_name else None
    return Channel(endpoint.host, endpoint.port, ssl=endpoint.ssl_context(), codec=codec, config=config)


class StreamHandle:
    def __init__(self, stream: Any, limits: StreamLimits | None = None) -> None:
        self._stream = stream
        self._limits = limits or StreamLimits()
        self._pending: Exception | None = None  # an error met behind a batch's messages

    async def send(self, message: wire.NodeMessage | bytes) -> None:
        """One message, or one already serialized (the outbox's bytes)."""
        await trio_asyncio.aio_as_trio(self._send)(message)

    async def send_many(self, messages: list[bytes]) -> None:
        """Serialized messages in one HTTP/2 write: gRPC messages are length-prefixed, so several may
        share DATA frames, and the stream takes them with one call (one socket write when the window
        allows) instead of one per message."""
        await trio_asyncio.aio_as_trio(self._send_many)(messages)

    async def _send_many(self, messages: list[bytes]) -> None:
        from grpclib.exceptions import StreamTerminatedError

        data = b"".join(struct.pack(">?I", False, len(m)) + m for m in messages)
        try:
            with self._stream._wrapper:
                await self._stream._stream.send_data(data)
        except StreamTerminatedError as exc:
            raise self._status_error() or exc from None

    async def _send(self, message: wire.NodeMessage | bytes) -> None:
        from grpclib.exceptions import StreamTerminatedError

        try:
            await self._stream.send_message(message)
        except StreamTerminatedError as exc:
            raise self._status_error() or exc from None

    def _status_error(self) -> Exception | None:
        """The gateway's status (GRPCError) when its trailers arrived with one other than OK: grpclib
        reports the stream reset that follows them instead, which does not say why."""
        from grpclib.const import Status
        from grpclib.exceptions import GRPCError

        trailers = getattr(self._stream._stream, "trailers", None)
        if trailers is None:
            return None
        try:
            status, message, details = self._stream._process_grpc_status(dict(trailers))
        except Exception:
            return None
        return GRPCError(status, message, details) if status is not Status.OK else None

    async def recv(self) -> wire.GatewayMessage | None:
        message = await trio_asyncio.aio_as_trio(self._recv)()
        assert message is None or isinstance(message, wire.GatewayMessage)
        return message

    async def recv_batch(self, limit: int = 64) -> list[wire.GatewayMessage] | None:
        """The next message and the ones whose prefix already arrived behind it (at most `limit`), in one
        crossing into asyncio; None at the end of the stream."""
        batch: list[wire.GatewayMessage] | None = await trio_asyncio.aio_as_trio(self._recv_batch)(limit)
        return batch

    async def _recv_batch(self, limit: int) -> list[wire.GatewayMessage] | None:
        if self._pending is not None:
            error, self._pending = self._pending, None
            raise error
        first = await self._recv()
        if first is None:
            return None
        out = [first]
        while len(out) < limit and self._buffered(5):
            try:
                message = await self._recv()
            except Exception as exc:  # the messages before it are handled first; it is raised next time
                self._pending = exc
                break
            if message is None:
                break
            out.append(message)
        return out

    def _buffered(self, size: int) -> bool:
        """At least `size` bytes of the stream arrived and wait in grpclib's buffer (no read would wait)."""
        buffer = getattr(self._stream._stream, "buffer", None)
        if buffer is None:
            return False
        queued = getattr(getattr(buffer, "_unacked", None), "_queue", ())
        have = int(getattr(buffer, "_acked_size", 0)) + sum(int(item.data_size) for item in queued)
        return bool(have >= size)

    async def _recv(self) -> wire.GatewayMessage | None:
        from grpclib.exceptions import StreamTerminatedError

        try:
            return await self._recv_message()
        except StreamTerminatedError as exc:
            raise self._status_error() or exc from None

    async def _recv_message(self) -> wire.GatewayMessage | None:
        """grpclib's `recv_message`, with the size cap checked on the prefix and a deadline on the body.

        grpclib's own reader acknowledges (re-opens the HTTP/2 window for) every byte it moves into its
        buffer while it waits for a whole message, so a 100 MB message would be buffered whole; here
        nothing of a body is read before its length passed the cap."""
        stream = self._stream
        if not stream._recv_initial_metadata_done:
            await stream.recv_initial_metadata()
        with stream._wrapper:
            h2 = stream._stream
            prefix = await h2.recv_data(5)
            if not prefix:
                error = self._status_error()  # the end of the stream: a status other than OK says why
                if error is not None:
                    raise error
                return None
            if len(prefix) != 5:
                raise FrameRefused(f"a message prefix of {len(prefix)} bytes, expected 5")
            compressed, length = struct.unpack(">?I", prefix)
            if compressed:
                raise FrameRefused("a compressed message (bcd negotiates no compression)")
            cap = self._limits.max_message_bytes
            if length > cap:
                raise FrameRefused(
                    f"a message of {length} bytes exceeds the {cap}-byte cap"
                    " ([control_plane] max_message_bytes)"
                )
            try:
                if self._buffered(length):  # all there: no deadline (a timer and a task) needed
                    body = await h2.recv_data(length)
                else:
                    body = await asyncio.wait_for(h2.recv_data(length), self._limits.frame_deadline_s)
            except TimeoutError:
                raise FrameRefused(
                    f"a {length}-byte message stopped arriving: not complete after"
                    f" {self._limits.frame_deadline_s:g} s"
                ) from None
            message = stream._codec.decode(body, stream._recv_type)
            stream._messages_received += 1
            return message  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def open_stream(endpoint: Endpoint, limits: StreamLimits | None = None) -> AsyncIterator[StreamHandle]:
    """The session stream; must run inside `open_loop()`."""

    async def make() -> Channel:
        return _channel(endpoint)

    channel = await trio_asyncio.aio_as_trio(make)()
    try:
        stream = channel.request(
            SESSION_STREAM_PATH, Cardinality.STREAM_STREAM, wire.NodeMessage, wire.GatewayMessage
        )
        await trio_asyncio.aio_as_trio(stream.__aenter__)()
        try:
            await trio_asyncio.aio_as_trio(stream.send_request)()
            yield StreamHandle(stream, limits)
        finally:
            # Bounded: towards a peer that stopped reading, the RST_STREAM itself cannot be written.
            with trio.move_on_after(CLOSE_S, shield=True), contextlib.suppress(Exception):
                await trio_asyncio.aio_as_trio(stream.cancel)()
            with trio.move_on_after(CLOSE_S, shield=True), contextlib.suppress(Exception):
                await trio_asyncio.aio_as_trio(stream.__aexit__)(None, None, None)
    finally:
        channel.close()


class _RawReplyCodec(StrictCodec):
    """Decodes a reply to its exact bytes after checking them strictly (root's join record keeps them)."""

    def decode(self, data: bytes, message_type: Any) -> Any:
        decode(message_type, data)
        return bytes(data)


async def join_call(endpoint: Endpoint, request: wire.JoinRequest, rpc_timeout_s: float = 30.0) -> bytes:
    """The unary Join RPC; returns the serialized JoinResponse exactly as received (strictly checked).
    Raises grpclib's GRPCError on a refusal."""
    async with open_loop():

        async def call() -> bytes:
            channel = _channel(endpoint, _RawReplyCodec())
            try:
                async with channel.request(
                    JOIN_PATH,
                    Cardinality.UNARY_UNARY,
                    wire.JoinRequest,
                    wire.JoinResponse,
                    timeout=rpc_timeout_s,
                ) as stream:
                    await stream.send_message(request, end=True)
                    reply = await stream.recv_message()
                    if reply is None:
                        raise ConnectionError("the JoinService sent no response")
                    assert isinstance(reply, bytes)
                    return reply
            finally:
                channel.close()

        reply: bytes = await trio_asyncio.aio_as_trio(call)()
        return reply
