"""The session's transport: grpclib under trio-asyncio. The only agent module that imports asyncio/grpclib.

- `StrictCodec`: grpclib codec that encodes with betterproto2 and decodes every received message through
  `bcd_shared.wire.strict.decode` (unknown fields, duplicates, truncation refused: house rule 4).
- `Endpoint`: where the gateway is: a Unix socket (local, no TLS: the development control plane and
  `bcd sim`) or `host:port` with mutual TLS (the node key and certificate; the gateway's CA from
  `[control_plane] ca_file` or identity.json).
- `open_loop()`: enters a trio-asyncio loop unless the calling task already runs inside one (so `bcd sim`
  can host the node and the development control plane under one loop).
- `open_stream(endpoint)`: an async context manager yielding a `StreamHandle` with trio-callable `send`,
  `recv` (None at the end of the stream) and `close`.
- `join_call(endpoint, request)`: the unary Join RPC.
"""

from __future__ import annotations

import contextlib
import ssl
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


class StrictCodec(CodecBase):
    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
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
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    async def send(self, message: wire.NodeMessage) -> None:
        await trio_asyncio.aio_as_trio(self._stream.send_message)(message)

    async def recv(self) -> wire.GatewayMessage | None:
        message = await trio_asyncio.aio_as_trio(self._stream.recv_message)()
        assert message is None or isinstance(message, wire.GatewayMessage)
        return message


@contextlib.asynccontextmanager
async def open_stream(endpoint: Endpoint) -> AsyncIterator[StreamHandle]:
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
            yield StreamHandle(stream)
        finally:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await trio_asyncio.aio_as_trio(stream.cancel)()
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
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
