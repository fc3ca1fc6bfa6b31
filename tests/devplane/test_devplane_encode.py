"""The development control plane's own encoding of the messages it sends most (a Command, an Ack of
results) is byte for byte betterproto2's, and every other message goes through betterproto2."""

from __future__ import annotations

import bcd_shared.wire as wire
import pytest
from bcd_agent.devplane.server import encode


@pytest.mark.parametrize(
    "message",
    [
        wire.GatewayMessage(
            command=wire.Command(
                body=b"\x08\x01body", signature=b"s" * 64, signer_chain=[b"c" * 300], attempt=1
            )
        ),
        wire.GatewayMessage(command=wire.Command(body=b"b" * 200, signer_chain=[b"a", b"b"], attempt=300)),
        wire.GatewayMessage(command=wire.Command()),
        wire.GatewayMessage(command=wire.Command(signer_chain=[b""])),  # an empty element: betterproto2's
        wire.GatewayMessage(command=wire.Command(body=b"b", batch_approval=wire.BatchApproval(scope=b"x"))),
        wire.GatewayMessage(ack=wire.Ack(command_ids=["01ABC", "é" * 40])),
        wire.GatewayMessage(ack=wire.Ack()),
        wire.GatewayMessage(ack=wire.Ack(journal_id="j", event_seq=7)),
        wire.GatewayMessage(ack=wire.Ack(command_ids=["a"], event_seq=2)),
        wire.GatewayMessage(cancel=wire.Cancel(command_id="c", reason="r")),
    ],
)
def test_encoded_exactly_as_betterproto_encodes(message: wire.GatewayMessage) -> None:
    assert encode(message) == bytes(message)
