"""The development control plane's sender merges consecutive result acks and keeps every other message
in its place (issue 16, item 8: one Ack for a burst of results instead of one per result)."""

from __future__ import annotations

from bcd_agent.devplane.server import _merge_acks
from bcd_shared import wire


def _ack(*ids: str) -> wire.GatewayMessage:
    return wire.GatewayMessage(ack=wire.Ack(command_ids=list(ids)))


def test_consecutive_result_acks_merge_and_the_order_is_kept() -> None:
    hb = wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=1))
    events = wire.GatewayMessage(ack=wire.Ack(journal_id="j", event_seq=4))
    batch = [_ack("a"), _ack("b"), hb, _ack("c"), events, _ack("d"), _ack("e", "f")]
    merged = _merge_acks(batch)
    assert [m.ack.command_ids if m.ack is not None else None for m in merged] == [
        ["a", "b"],
        None,
        ["c"],
        [],
        ["d", "e", "f"],
    ]
    assert merged[1] is hb and merged[3].ack is not None and merged[3].ack.event_seq == 4
    assert batch[0].ack is not None and batch[0].ack.command_ids == ["a"]  # the queued messages untouched
