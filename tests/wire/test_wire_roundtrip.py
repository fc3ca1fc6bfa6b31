"""Every bcd.v1 message encodes and decodes (strictly) back to an equal value, with every field set."""

from __future__ import annotations

import bcd_shared.wire as wire
import betterproto2
import pytest
from bcd_shared.wire import strict
from bcd_shared.wire.kinds import KIND_MESSAGES
from wirehelpers import MESSAGE_CLASSES, meta_of, populated


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda c: c.__name__)
def test_every_message_round_trips_field_complete(cls: type[betterproto2.Message]) -> None:
    groups = {m.group for m in meta_of(cls).meta_by_field_name.values() if m.group}
    widest = max(
        (sum(1 for m in meta_of(cls).meta_by_field_name.values() if m.group == g) for g in groups), default=1
    )
    for pick in range(widest):  # each member of every oneof at least once
        message = populated(cls, oneof_pick=pick)
        data = bytes(message)
        decoded = strict.decode(cls, data)
        assert decoded == message
        # Every field that was set survives: nothing was dropped into unknown fields.
        assert decoded._unknown_fields == b""
        assert bytes(decoded) == data


def test_empty_messages_round_trip() -> None:
    for cls in MESSAGE_CLASSES:
        assert strict.decode(cls, bytes(cls())) == cls()


def test_DLV_RCV_09_desired_state_envelope_keeps_body_bytes() -> None:
    """Covers DLV-RCV-09 (the body's fields); the body travels as exact bytes inside the envelope."""
    body = wire.DesiredStateBody(
        node_id="node-1",
        generation=42,
        spec_hash="sha256:abc",
        full=wire.NodeSpec(
            host=wire.HostSection(units=[wire.HostUnit(name="sysctl", settings='{"vm.swappiness":10}')]),
            devices=wire.DevicesSection(
                assignments=[
                    wire.DeviceAssignment(
                        allocation_id="alloc_01jz8k2v",
                        reservation_id="rsv_01jz8k1q",
                        binding=wire.Binding.HOLD,
                        devices=[wire.DeviceAtom(id="GPU-5f1c2a90-0000-4000-8000-000000000001")],
                        limits=wire.DeviceLimits(cpus="0-7", mems="0", cpu_millis=8000, memory_bytes=0),
                        env=["FOO=bar"],
                    )
                ]
            ),
        ),
    )
    body_bytes = bytes(body)
    # A signer's exact bytes, here with a field order betterproto2 itself would not produce: the envelope
    # carries them untouched, and decoding them never requires re-encoding.
    reordered = bytes(wire.DesiredStateBody(generation=42)) + bytes(wire.DesiredStateBody(node_id="node-1"))
    for signed in (body_bytes, reordered):
        envelope = wire.DesiredState(
            body=signed, signature=b"\x01" * 64, signer_chain=[b"leaf-der", b"int-der"]
        )
        got = strict.decode(wire.DesiredState, bytes(envelope))
        assert got.body == signed
        assert got.signer_chain == [b"leaf-der", b"int-der"]
    decoded = strict.decode(wire.DesiredStateBody, body_bytes)
    assert decoded.full is not None and decoded.patch is None
    limits = decoded.full.devices.assignments[0].limits
    # proto3 optional: an explicit 0 is a value, an unset field is None (limits with presence).
    assert limits.memory_bytes == 0 and limits.hugepages_1gi is None
    assert betterproto2.which_one_of(decoded, "spec")[0] == "full"


def test_DLV_CMD_06_payload_is_any_of_the_kind_request() -> None:
    """Covers DLV-CMD-01 and DLV-CMD-06: the body is bytes in the envelope, the payload an Any."""
    body = wire.CommandBody(
        id="01JZ8K2V0000000000000000AA",
        node_id="node-1",
        seq=7,
        kind="gpu.reset",
        payload=wire.ProtoAny.pack(wire.GpuResetRequest(gpu_uuids=["GPU-1", "GPU-2"])),
        lane=wire.Lane.CONTROL,
        not_after=1_764_000_000_000,
        attested=True,
    )
    command = wire.Command(body=bytes(body), signature=b"sig", attempt=3)
    got = strict.decode(wire.Command, bytes(command))
    got_body = strict.decode(wire.CommandBody, got.body)
    assert got_body.payload is not None
    assert got_body.payload.type_url == "type.googleapis.com/bcd.v1.GpuResetRequest"
    request = strict.unpack_any(got_body.payload, KIND_MESSAGES[got_body.kind].request)
    assert request == wire.GpuResetRequest(gpu_uuids=["GPU-1", "GPU-2"])


def test_session_oneofs_carry_each_message() -> None:
    up = [
        wire.NodeMessage(hello=wire.Hello(node_id="n", applied_generation=3, role=wire.Role.NODE)),
        wire.NodeMessage(
            spec_request=wire.SpecRequest(have_generation=3, reason=wire.SpecRequestReason.NO_SPEC)
        ),
        wire.NodeMessage(event_batch=wire.EventBatch(journal_id="j", events=[wire.Event(seq=1)])),
    ]
    for message in up:
        assert strict.decode(wire.NodeMessage, bytes(message)) == message
    down = wire.GatewayMessage(ack=wire.Ack(command_ids=["c1"], journal_id="j", event_seq=9))
    assert strict.decode(wire.GatewayMessage, bytes(down)) == down
    assert betterproto2.which_one_of(down, "msg")[0] == "ack"


def test_kind_messages_cover_the_seed_kinds() -> None:
    assert set(KIND_MESSAGES) >= {
        "inventory.refresh",
        "diag.nvml",
        "gpu.reset",
        "node.reboot",
        "logs.collect",
        "instance.snapshot",
        "diag.dcgm",
    }
    for kind in KIND_MESSAGES.values():
        assert strict.type_url(kind.request).startswith("type.googleapis.com/bcd.v1.")
