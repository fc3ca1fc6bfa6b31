"""The generated grpclib stubs carry a bidirectional Session stream and a unary Join over a Unix socket.

Plain asyncio on purpose: this checks the generated code and grpclib, not the agent's trio bridge.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import bcd_shared.wire as wire
import betterproto2
from bcd_agent.wire import JoinBase, JoinStub, SessionBase, SessionStub
from bcd_shared.wire import strict
from grpclib.client import Channel
from grpclib.server import Server

SIGNED_BODY = bytes(
    wire.DesiredStateBody(node_id="node-1", generation=4, spec_hash="h4", full=wire.NodeSpec())
)


class FakeGateway(SessionBase):
    """Answers Hello with Welcome and a spec, and acknowledges events."""

    def __init__(self) -> None:
        self.received: list[str] = []

    async def stream(self, messages: AsyncIterator[wire.NodeMessage]) -> AsyncIterator[wire.GatewayMessage]:
        async for message in messages:
            name, value = betterproto2.which_one_of(message, "msg")
            self.received.append(name)
            if isinstance(value, wire.Hello):
                yield wire.GatewayMessage(
                    welcome=wire.Welcome(server_time=1_764_000_000_000, session_epoch=7)
                )
                yield wire.GatewayMessage(
                    desired_state=wire.DesiredState(body=SIGNED_BODY, signature=b"\x02" * 64)
                )
            elif isinstance(value, wire.EventBatch):
                last = value.events[-1].seq
                yield wire.GatewayMessage(ack=wire.Ack(journal_id=value.journal_id, event_seq=last))


class FakeJoin(JoinBase):
    async def join(self, message: wire.JoinRequest) -> wire.JoinResponse:
        body = wire.JoinResponseBody(node_id="node-1", certificate_chain=[b"leaf:" + message.node_public_key])
        return wire.JoinResponse(body=bytes(body), signature=b"s", signer_spki=b"spki")


async def _exchange(socket_path: str) -> tuple[list[wire.GatewayMessage], wire.JoinResponse, list[str]]:
    gateway = FakeGateway()
    server = Server([gateway, FakeJoin()])
    await server.start(path=socket_path)
    channel = Channel(path=socket_path)
    try:
        outbox: asyncio.Queue[wire.NodeMessage | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[wire.NodeMessage]:
            while (item := await outbox.get()) is not None:
                yield item

        await outbox.put(
            wire.NodeMessage(hello=wire.Hello(node_id="node-1", journal_id="j1", role=wire.Role.NODE))
        )
        got: list[wire.GatewayMessage] = []
        async for reply in SessionStub(channel).stream(requests(), timeout=10):
            got.append(reply)
            name, _ = betterproto2.which_one_of(reply, "msg")
            if name == "desired_state":
                events = [wire.Event(seq=1, event_class=wire.EventClass.RESULT, type="AllocationFailed")]
                await outbox.put(
                    wire.NodeMessage(event_batch=wire.EventBatch(journal_id="j1", events=events))
                )
            elif name == "ack":
                await outbox.put(None)  # ends the node's half; the gateway then ends its own
        joined = await JoinStub(channel).join(
            wire.JoinRequest(token="t", node_public_key=b"k" * 32), timeout=10
        )
        return got, joined, gateway.received
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


def test_session_bidi_stream_and_join_over_a_unix_socket() -> None:
    with tempfile.TemporaryDirectory(prefix="bcdw") as tmp:  # short: AF_UNIX paths are limited to 108 bytes
        socket_path = str(Path(tmp) / "gw.sock")
        got, joined, received = asyncio.run(asyncio.wait_for(_exchange(socket_path), 30))
    names = [betterproto2.which_one_of(m, "msg")[0] for m in got]
    assert names == ["welcome", "desired_state", "ack"]
    assert received == ["hello", "event_batch"]
    assert got[0].welcome is not None and got[0].welcome.session_epoch == 7
    assert got[1].desired_state is not None and got[1].desired_state.body == SIGNED_BODY
    assert got[2].ack == wire.Ack(journal_id="j1", event_seq=1)
    assert strict.decode(wire.JoinResponseBody, joined.body).certificate_chain == [b"leaf:" + b"k" * 32]
