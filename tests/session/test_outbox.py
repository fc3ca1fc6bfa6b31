"""The outbox's own CommandUpdate encoder gives betterproto's bytes exactly, and the queue's accounting."""

from __future__ import annotations

import itertools

import pytest
import trio
from bcd_agent.session.outbox import Outbox, OutboxFull, encode
from bcd_shared import wire
from bcd_shared.wire.strict import decode

TEXTS = ("", "x", "ünïcödé ✓", "r" * 200)
BLOBS = (b"", b"\x00", bytes(range(256)) * 3)


@pytest.mark.parametrize("state", list(wire.CommandState))
def test_command_updates_encode_as_betterproto_does(state: wire.CommandState) -> None:
    for text, blob in itertools.product(TEXTS, BLOBS):
        update = wire.CommandUpdate(
            command_id="01J" + text[:20],
            state=state,
            error_code=text,
            reason=text[::-1],
            message=text * 2,
            result=blob,
            boot_id=text[:36],
            attestation=blob[::-1],
            node_sig=blob[:64],
        )
        message = wire.NodeMessage(command_update=update)
        data = encode(message)
        assert data == bytes(message)
        assert decode(wire.NodeMessage, data) == message


def test_other_messages_go_through_betterproto() -> None:
    message = wire.NodeMessage(heartbeat=wire.NodeHeartbeat(server_time_mark=5, applied_generation=2))
    assert encode(message) == bytes(message)
    assert encode(wire.NodeMessage(command_update=wire.CommandUpdate())) == bytes(
        wire.NodeMessage(command_update=wire.CommandUpdate())
    )


async def test_the_queue_counts_bytes_until_sent_and_refuses_past_its_ceiling() -> None:
    box = Outbox(max_bytes=100)
    first = wire.NodeMessage(command_update=wire.CommandUpdate(command_id="a" * 40))
    size = len(encode(first))
    box.put(first)
    box.put(first)
    assert box.bytes == 2 * size and box.room() == 100 - 2 * size
    with pytest.raises(OutboxFull):
        box.put(first)
    batch = await box.batch(max_bytes=10)  # at least one, even over the batch size
    assert len(batch) == 1 and box.bytes == 2 * size  # counted until sent
    box.sent(len(batch))
    assert box.bytes == size and box.peak_bytes == 2 * size
    with trio.move_on_after(0.05):
        rest = await box.batch(max_bytes=1000)
        assert len(rest) == 1
