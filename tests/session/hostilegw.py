"""A scriptable gateway for the session's fault tests: a real grpclib server on a Unix socket (under the
same trio-asyncio loop as the node's session), whose Session handler answers Hello with a valid Welcome
and then does what the test asks: send raw bytes on the stream (an oversized or truncated gRPC message),
stop reading, or end the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpclib.const
import trio
import trio_asyncio
from bcd_agent.session.transport import StrictCodec, open_loop
from bcd_agent.wire import SESSION_STREAM_PATH
from bcd_shared import wire
from grpclib.server import Server

# After the Welcome: an asyncio coroutine given the grpclib server stream.
Script = Callable[[Any], Awaitable[None]]


def prefix(length: int) -> bytes:
    """A gRPC message prefix (uncompressed) announcing `length` bytes."""
    return struct.pack(">?I", False, length)


class HostileGateway:
    def __init__(self, script: Script, *, welcome_ms: Callable[[], int] | None = None) -> None:
        self.script = script
        self.welcome_ms = welcome_ms or (lambda: int(time.time() * 1000))
        self.sessions = 0
        self.received: list[wire.NodeMessage] = []

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            SESSION_STREAM_PATH: grpclib.const.Handler(
                self._session, grpclib.const.Cardinality.STREAM_STREAM, wire.NodeMessage, wire.GatewayMessage
            )
        }

    async def _session(self, stream: Any) -> None:
        hello = await stream.recv_message()
        self.sessions += 1
        self.received.append(hello)
        welcome = wire.Welcome(server_time=self.welcome_ms(), session_epoch=self.sessions)
        await stream.send_message(wire.GatewayMessage(welcome=welcome))
        await self.script(stream)


async def send_raw(stream: Any, data: bytes) -> None:
    """Bytes straight onto the HTTP/2 stream, past grpclib's framing."""
    await stream._stream.send_data(data)


async def read_forever(stream: Any, into: list[wire.NodeMessage]) -> None:
    while True:
        message = await stream.recv_message()
        if message is None:
            return
        into.append(message)


@contextlib.asynccontextmanager
async def serving(gateway: HostileGateway, path: Path) -> AsyncIterator[None]:
    async with open_loop():
        server = Server([gateway], codec=StrictCodec())

        async def start() -> None:
            await server.start(path=str(path))

        async def stop() -> None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

        await trio_asyncio.aio_as_trio(start)()
        try:
            yield
        finally:
            with trio.CancelScope(shield=True):
                await trio_asyncio.aio_as_trio(stop)()
