"""The wire edge: a Command converted once, strictly, keeping the exact body bytes (DLV-CMD-01..16)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from bcd_agent.dispatch.command import CommandUpdate, InvalidCommand, UpdateState
from bcd_agent.dispatch.kinds import Lane
from bcd_agent.dispatch.wire import envelope_from_wire, update_to_wire
from bcd_shared import wire
from bcd_shared.wire.strict import decode
from dhelpers import ulid


def body(**kw: object) -> wire.CommandBody:
    base: dict[str, object] = {
        "id": ulid(),
        "node_id": "node-a",
        "seq": 7,
        "kind": "gpu.reset",
        "payload": wire.ProtoAny(type_url="type.googleapis.com/bcd.v1.GpuResetRequest", value=b"\n\x05GPU-1"),
        "lane": wire.Lane.CONTROL,
        "not_after": 1_795_000_000_123,
        "min_generation": 3,
        "attested": True,
        "batch_id": "b1",
        "traceparent": "00-abc-def-01",
        "workflow_id": "wf1",
        "step_id": "s1",
        "idempotency_key": "wf:wf1:s1",
    }
    base.update(kw)
    return wire.CommandBody(**base)  # type: ignore[arg-type]


def test_DLV_CMD_01_exact_body_bytes_and_fields() -> None:
    b = body()
    raw = bytes(b)
    env = envelope_from_wire(wire.Command(body=raw, signature=b"s" * 64, signer_chain=[b"der"], attempt=4))
    assert env.body_bytes == raw
    assert (env.id, env.node_id, env.seq, env.kind, env.lane) == (
        b.id,
        "node-a",
        7,
        "gpu.reset",
        Lane.CONTROL,
    )
    assert env.not_after == dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
        milliseconds=1_795_000_000_123
    )
    assert env.not_after.microsecond == 123000
    assert (
        env.payload.value == b"\n\x05GPU-1" and env.signature == b"s" * 64 and env.signer_chain == (b"der",)
    )
    assert env.attempt == 4 and env.min_generation == 3 and env.attested and env.batch_id == "b1"
    assert env.subject == "node-a"
    assert envelope_from_wire(wire.Command(body=bytes(body(target_node_id="m-1")))).subject == "m-1"


def test_DLV_ACK_11_zero_not_after_is_absent_and_unknown_lane_is_none() -> None:
    env = envelope_from_wire(wire.Command(body=bytes(body(not_after=0, lane=wire.Lane.UNSPECIFIED))))
    assert env.not_after is None and env.lane is None


def test_unknown_field_in_body_is_refused_naming_the_field() -> None:
    b = body()
    raw = bytes(b) + b"\xa8\x06\x01"  # field 101, varint 1: not in CommandBody
    with pytest.raises(InvalidCommand) as exc:
        envelope_from_wire(wire.Command(body=raw))
    assert exc.value.command_id == b.id and "unknown field" in exc.value.rule


@pytest.mark.parametrize(("field", "value"), [("id", "not-a-ulid"), ("node_id", ""), ("kind", "")])
def test_DLV_CMD_03_required_fields(field: str, value: str) -> None:
    with pytest.raises(InvalidCommand, match=f"body.{field}"):
        envelope_from_wire(wire.Command(body=bytes(body(**{field: value}))))


def test_update_to_wire_round_trip() -> None:
    u = CommandUpdate("01ABC", UpdateState.BUSY, "boot-1", reason="BUSY", message="lane full")
    w = decode(wire.CommandUpdate, bytes(update_to_wire(u)))
    assert (w.command_id, w.state, w.reason, w.boot_id) == ("01ABC", wire.CommandState.BUSY, "BUSY", "boot-1")


async def test_DLV_CMD_invalid_body_refused_once_and_journaled(tmp_path: Path) -> None:
    """A body that fails the edge's rules is UNSUPPORTED against its id, and a duplicate gets the same."""
    import trio
    from dhelpers import Harness, Pki

    h = Harness(tmp_path / "data", Pki.build())
    good = body(node_id="node-a", kind="test.effect")
    bad = bytes(good) + b"\xa8\x06\x01"
    async with trio.open_nursery() as n:
        d = await n.start(h.dispatcher({}).run)
        d.deliver_wire(wire.Command(body=bad))
        d.deliver_wire(wire.Command(body=bad))
        d.deliver_wire(wire.Command(body=b"\xff\xff"))  # no id to answer: dropped
        n.cancel_scope.cancel()
    assert [(u.command_id, u.state, u.reason) for u in h.sink.updates] == [
        (good.id, UpdateState.REJECTED, "UNSUPPORTED")
    ] * 2
    assert "unknown field" in h.sink.updates[0].message
