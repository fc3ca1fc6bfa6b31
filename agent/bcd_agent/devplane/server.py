"""The development control plane's grpclib servers (TCP with TLS, and a Unix socket), under trio-asyncio.

Each Session stream is handled by trio code (`trio_as_aio`): the first message must be Hello; the node's
TLS certificate (when the stream came over TCP) must chain to the node CA and name the Hello's node id,
checked with bcd's own chain checker. Messages are decoded strictly (session.transport.StrictCodec).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import struct
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpclib.const
import trio
import trio_asyncio
from bcd_shared import wire
from grpclib import GRPCError
from grpclib.server import Server

from bcd_agent.session.transport import StrictCodec, open_loop
from bcd_agent.wire import JOIN_PATH, SESSION_STREAM_PATH

if TYPE_CHECKING:
    from bcd_agent.devplane.plane import DevPlane

log = logging.getLogger("bcd.devplane")


def _peer_der(stream: Any) -> bytes | None:
    transport = getattr(stream.peer, "_transport", None)
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    return bytes(der) if der else b""


class _Handlers:
    def __init__(self, plane: DevPlane) -> None:
        self.plane = plane

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            SESSION_STREAM_PATH: grpclib.const.Handler(
                self._session, grpclib.const.Cardinality.STREAM_STREAM, wire.NodeMessage, wire.GatewayMessage
            ),
            JOIN_PATH: grpclib.const.Handler(
                self._join, grpclib.const.Cardinality.UNARY_UNARY, wire.JoinRequest, wire.JoinResponse
            ),
        }

    async def _join(self, stream: Any) -> None:
        request = await stream.recv_message()
        try:
            response = self.plane.join(request)
        except PermissionError as exc:
            raise GRPCError(grpclib.const.Status.PERMISSION_DENIED, str(exc)) from None
        await stream.send_message(response)

    async def _session(self, stream: Any) -> None:
        await trio_asyncio.trio_as_aio(self._session_trio)(stream)

    async def _session_trio(self, stream: Any) -> None:
        plane = self.plane
        first = await trio_asyncio.aio_as_trio(stream.recv_message)()
        if first is None or first.hello is None:
            return
        hello = first.hello
        peer = _peer_der(stream)
        why = "no client certificate" if peer == b"" else plane.node_certificate_ok(hello.node_id, peer)
        if why:
            log.warning("devplane: session refused: %s", why)
            raise GRPCError(grpclib.const.Status.PERMISSION_DENIED, why)
        send, receive = trio.open_memory_channel[wire.GatewayMessage](math.inf)
        try:
            session = plane.open_session(hello, send)
        except PermissionError as exc:
            raise GRPCError(grpclib.const.Status.PERMISSION_DENIED, str(exc)) from None
        log.info("devplane: session of %s, epoch %d", hello.node_id, session.epoch)
        try:
            async with trio.open_nursery() as nursery:

                async def sender() -> None:
                    async for message in receive:
                        batch = [message]
                        while len(batch) < SEND_BATCH:
                            try:
                                batch.append(receive.receive_nowait())
                            except trio.WouldBlock:
                                break
                        await trio_asyncio.aio_as_trio(_send_batch)(stream, _merge_acks(batch))

                nursery.start_soon(sender)
                while True:
                    messages = await trio_asyncio.aio_as_trio(_recv_batch)(stream)
                    if messages is None:
                        break
                    with plane.store.batch():  # one commit for the batch (nothing is sent before it)
                        for message in messages:
                            plane.on_message(session, message)
                nursery.cancel_scope.cancel()
        finally:
            plane.close_session(session)


# The sender writes what is queued together (one HTTP/2 write), at most this many messages.
SEND_BATCH = 64


def _merge_acks(batch: list[wire.GatewayMessage]) -> list[wire.GatewayMessage]:
    """Consecutive acks of command results become one Ack (its `command_ids` is a list for that); an
    event ack or any other message keeps its place, so the order the node sees is unchanged."""
    out: list[wire.GatewayMessage] = []
    for message in batch:
        ack = message.ack
        if ack is not None and not ack.journal_id and out:
            last = out[-1].ack
            if last is not None and not last.journal_id:
                last.command_ids = [*last.command_ids, *ack.command_ids]
                continue
        if ack is not None and not ack.journal_id:
            message = wire.GatewayMessage(ack=wire.Ack(command_ids=list(ack.command_ids)))
        out.append(message)
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _len_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def encode(message: wire.GatewayMessage) -> bytes:
    """The message's protobuf bytes. The two a busy plane sends most, a Command without batch approval
    and an Ack of command results, are encoded here field by field exactly as betterproto2 encodes them
    (tests/devplane/test_devplane_encode.py compares them), several times faster; any other message
    goes through betterproto2."""
    command, ack = message.command, message.ack
    if command is not None and command.batch_approval is None and command.batch_proof is None:
        if all(command.signer_chain):
            parts = [_len_field(1, command.body)] if command.body else []
            if command.signature:
                parts.append(_len_field(2, command.signature))
            parts.extend(_len_field(3, der) for der in command.signer_chain)
            if command.attempt:
                parts.append(_varint(4 << 3) + _varint(command.attempt))
            return _len_field(4, b"".join(parts))
    elif ack is not None and not ack.journal_id and not ack.event_seq and message.command is None:
        return _len_field(6, b"".join(_len_field(1, cid.encode()) for cid in ack.command_ids))
    return bytes(message)


async def _send_batch(stream: Any, messages: list[wire.GatewayMessage]) -> None:
    """gRPC messages are length-prefixed, so several share one write."""
    if len(messages) == 1:
        await stream.send_message(encode(messages[0]))  # the codec sends bytes as they are
        return
    if not stream._send_initial_metadata_done:
        await stream.send_initial_metadata()
    data = b"".join(struct.pack(">?I", False, len(m)) + m for m in (encode(x) for x in messages))
    await stream._stream.send_data(data)


async def _recv_batch(stream: Any, limit: int = 64) -> list[wire.NodeMessage] | None:
    """The next message and those already buffered behind it, in one crossing into asyncio."""
    first = await stream.recv_message()
    if first is None:
        return None
    out = [first]
    buffer = getattr(stream._stream, "buffer", None)
    while len(out) < limit and buffer is not None:
        queued = getattr(getattr(buffer, "_unacked", None), "_queue", ())
        if int(getattr(buffer, "_acked_size", 0)) + sum(int(i.data_size) for i in queued) < 5:
            break
        message = await stream.recv_message()
        if message is None:
            break
        out.append(message)
    return out


@contextlib.asynccontextmanager
async def serving(plane: DevPlane) -> AsyncIterator[tuple[str, int] | None]:
    """Start the TCP (TLS) and Unix servers; yield the bound TCP address."""
    from bcd_agent.devplane.plane import ssl_server_context

    async with open_loop():
        servers: list[Server] = []
        bound: tuple[str, int] | None = None

        async def start() -> None:
            nonlocal bound
            if plane.listen:
                host, _, port = plane.listen.rpartition(":")
                server = Server([_Handlers(plane)], codec=StrictCodec())
                await server.start(
                    host.strip("[]"),
                    int(port),
                    ssl=ssl_server_context(plane.keys, plane.directory),
                    reuse_address=True,
                )
                servers.append(server)
                sock = server._server.sockets[0]  # type: ignore[union-attr]
                name = sock.getsockname()
                bound = (str(name[0]), int(name[1]))
            if plane.unix_socket is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(plane.unix_socket)
                server = Server([_Handlers(plane)], codec=StrictCodec())
                await server.start(path=str(plane.unix_socket))
                os.chmod(plane.unix_socket, 0o600)
                servers.append(server)

        async def stop() -> None:
            for server in servers:
                server.close()
            for server in servers:
                with contextlib.suppress(Exception):
                    await server.wait_closed()

        await trio_asyncio.aio_as_trio(start)()
        try:
            yield bound
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await trio_asyncio.aio_as_trio(stop)()
