"""bcd_shared.wire.strict refuses what a lenient protobuf parser would let through."""

from __future__ import annotations

import contextlib

import bcd_shared.wire as wire
import pytest
from bcd_shared.wire import strict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wirehelpers import populated


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(payload)) + payload


def _refused(cls: type, data: bytes) -> strict.WireError:
    with pytest.raises(strict.WireError) as info:
        strict.decode(cls, data)
    return info.value


def test_unknown_top_level_field_is_refused_and_named() -> None:
    data = bytes(wire.Hello(node_id="n")) + _tag(99, 0) + _varint(1)
    error = _refused(wire.Hello, data)
    assert error.path == "#99" and "unknown field number 99" in error.rule
    # A lenient parse keeps it as raw unknown bytes and would write it back when re-encoded.
    assert wire.Hello.parse(data)._unknown_fields != b""


def test_unknown_nested_field_is_refused_with_its_path() -> None:
    limits = bytes(wire.DeviceLimits(cpus="0-3")) + _tag(15, 0) + _varint(4)
    assignment = _len(1, b"alloc") + _len(5, limits)
    spec = _len(2, _len(1, assignment))
    body = _len(4, spec)
    error = _refused(wire.DesiredStateBody, body)
    assert error.path == "full.devices.assignments[0].limits.#15"


def test_unknown_section_number_is_reported_not_refused_when_tolerated() -> None:
    """A NodeSpec section number this build does not know reaches the runner (to report UNSUPPORTED)."""
    spec = bytes(wire.NodeSpec(host=wire.HostSection())) + _len(8, b"")
    body = bytes(wire.DesiredStateBody(node_id="n", generation=5)) + _len(4, spec)
    message, unknown = strict.decode_with_unknown(
        wire.DesiredStateBody, body, tolerate_unknown_in={"full", "patch"}
    )
    assert message.full is not None and message.generation == 5
    assert unknown == [strict.UnknownField(path="full", number=8, wire_type=2)]
    # Tolerance is per path: elsewhere an unknown field still refuses the whole body.
    bad = bytes(wire.DesiredStateBody(node_id="n")) + _len(4, _len(1, _len(1, b"") + _tag(9, 0) + b"\x01"))
    with pytest.raises(strict.WireError, match=r"full\.host\.#9"):
        strict.decode_with_unknown(wire.DesiredStateBody, bad, tolerate_unknown_in={"full", "patch"})


def test_decode_spec_body_lists_unknown_section_numbers() -> None:
    spec = _len(9, b"") + bytes(wire.NodeSpec(site=wire.SiteSection())) + _len(8, b"") + _len(8, b"")
    body = bytes(wire.DesiredStateBody(node_id="n", generation=6)) + _len(5, spec)  # as a patch
    decoded, unknown_sections = strict.decode_spec_body(body)
    assert decoded.patch is not None and decoded.patch.site is not None
    assert unknown_sections == (8, 9)


def test_duplicate_singular_field_is_refused() -> None:
    data = bytes(wire.SpecRequest(have_generation=1)) + bytes(wire.SpecRequest(have_generation=2))
    assert _refused(wire.SpecRequest, data).path == "have_generation"


def test_two_oneof_members_are_refused() -> None:
    data = bytes(wire.DesiredStateBody(full=wire.NodeSpec())) + bytes(
        wire.DesiredStateBody(patch=wire.NodeSpecPatch())
    )
    error = _refused(wire.DesiredStateBody, data)
    assert error.path == "patch" and "oneof spec already set by full" in error.rule


def test_repeated_fields_may_repeat() -> None:
    data = bytes(wire.Ack(command_ids=["a"])) + bytes(wire.Ack(command_ids=["b"]))
    assert strict.decode(wire.Ack, data).command_ids == ["a", "b"]


@pytest.mark.parametrize(
    ("cls", "data", "rule"),
    [
        (wire.Hello, _tag(1, 2) + _varint(10) + b"abc", "runs past the end"),  # truncated length
        (wire.SpecRequest, _tag(2, 0) + b"\x80", "truncated varint"),  # trailing half varint
        (wire.SpecRequest, bytes(wire.SpecRequest(have_generation=3)) + b"\x80", "truncated varint"),
        (wire.SpecRequest, _tag(2, 0) + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (wire.SpecRequest, _tag(2, 1) + b"\x00" * 3, "truncated fixed-width"),
        (wire.Hello, _tag(1, 3), "groups are not used"),
        (wire.SpecRequest, _len(1, b"\x01"), "does not carry a uint64"),  # wire type mismatch
        (wire.Hello, _tag(1, 0) + b"\x01", "does not carry a string"),
        (wire.Gauge, _tag(2, 5) + b"\x00" * 4, "does not carry a double"),
        (wire.Hello, _len(1, b"\xff\xfe"), "not valid UTF-8"),
        (wire.Hello, b"\x00", "invalid field number 0"),
        (wire.GpuHealth, _len(3, b"\x80"), "truncated varint"),  # packed repeated uint32
    ],
)
def test_malformed_or_mistyped_bytes_are_refused(cls: type, data: bytes, rule: str) -> None:
    assert rule in str(_refused(cls, data))


def test_packed_and_unpacked_repeated_scalars_are_both_accepted() -> None:
    packed = strict.decode(wire.GpuHealth, _len(3, _varint(79) + _varint(94)))
    unpacked = strict.decode(wire.GpuHealth, _tag(3, 0) + _varint(79) + _tag(3, 0) + _varint(94))
    assert packed.xids == unpacked.xids == [79, 94]


def test_scalar_ranges_are_checked() -> None:
    assert "bool" in _refused(wire.Welcome, _tag(4, 0) + _varint(2)).rule
    assert "uint32" in _refused(wire.Command, _tag(4, 0) + _varint(1 << 32)).rule
    # an enum is an int32: a 64-bit value out of int32 range is refused, a sign-extended negative is not
    assert "enum" in _refused(wire.SpecRequest, _tag(2, 0) + _varint(1 << 40)).rule
    negative = strict.decode(wire.SpecRequest, _tag(2, 0) + _varint((1 << 64) - 1))
    assert int(negative.reason) == -1


def test_unknown_enum_values_are_kept_for_the_domain_layer() -> None:
    """Open enums: an unknown binding reaches the devices converger (unsupported-binding)."""
    data = bytes(wire.DeviceAssignment(allocation_id="a")) + _tag(3, 0) + _varint(9)
    assignment = strict.decode(wire.DeviceAssignment, data)
    assert int(assignment.binding) == 9 and assignment.binding.name == ""


def test_unpack_any_checks_the_type_url() -> None:
    packed = wire.ProtoAny.pack(wire.NodeRebootRequest(reason="xid 79"))
    assert strict.unpack_any(packed, wire.NodeRebootRequest).reason == "xid 79"
    with pytest.raises(strict.WireError, match=r"is not 'type\.googleapis\.com/bcd\.v1\.GpuResetRequest'"):
        strict.unpack_any(packed, wire.GpuResetRequest)
    with pytest.raises(strict.WireError, match="missing"):
        strict.unpack_any(None, wire.GpuResetRequest)
    smuggled = wire.ProtoAny(type_url=packed.type_url, value=packed.value + _tag(50, 0) + b"\x01")
    with pytest.raises(strict.WireError, match="#50"):
        strict.unpack_any(smuggled, wire.NodeRebootRequest)


_SPEC_SAMPLE = bytes(populated(wire.DesiredStateBody))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=len(_SPEC_SAMPLE) - 1), st.integers(min_value=0, max_value=255))
def test_a_corrupted_body_is_refused_or_decodes_cleanly(position: int, byte: int) -> None:
    """Any single-byte corruption of a full body either decodes (strictly) or raises WireError, never
    another exception, and a body strict accepts has no unknown fields left in it."""
    data = bytearray(_SPEC_SAMPLE)
    data[position] = byte
    try:
        message = strict.decode(wire.DesiredStateBody, bytes(data))
    except strict.WireError:
        return
    assert message._unknown_fields == b""


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_escape_as_another_error(data: bytes) -> None:
    for cls in (wire.NodeMessage, wire.GatewayMessage, wire.CommandBody):
        with contextlib.suppress(strict.WireError):
            strict.decode(cls, data)


def _varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out += bytes([(n & 0x7F) | 0x80])
        n >>= 7
    return out + bytes([n])


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _in_access(access: bytes) -> bytes:
    """A DesiredStateBody (node_id, generation) whose full spec's access section is `access`'s bytes."""
    return b"\x0a\x01n\x10\x01" + _ld(4, _ld(4, access))


def _in_assignment(assignment: bytes) -> bytes:
    return b"\x0a\x01n\x10\x01" + _ld(4, _ld(2, _ld(1, assignment)))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            _in_access(_ld(1, b"a") + _ld(1, b"b")),
            "full.access.exec_ticket_jwks: singular field appears more than once",
        ),
        (_in_access(_ld(4, b"\x80")), "full.access.revoked_serials[0]: truncated varint"),
        (
            _in_access(_varint(1 << 3) + b"\x01"),
            "full.access.exec_ticket_jwks: wire type 0 does not carry a string",
        ),
        (
            _in_access(_varint(1 << 3 | 5) + b"\0\0\0\0"),
            "full.access.exec_ticket_jwks: wire type 5 does not carry a string",
        ),
        (
            _in_access(_varint(1 << 3 | 1) + b"\0"),
            "full.access.exec_ticket_jwks: truncated fixed-width value",
        ),
        (
            _in_access(_varint(1 << 3 | 2) + b"\x05a"),
            "full.access.exec_ticket_jwks: length 5 runs past the end of the message",
        ),
        (_in_access(b"\x80"), "full.access.<tag>: truncated varint"),
        (_in_access(_varint(1 << 3 | 2) + b"\x80"), "full.access.exec_ticket_jwks: truncated varint"),
        (
            _in_access(_varint(((1 << 29) - 1) << 3) + b"\0"),
            "full.access.#536870911: unknown field number 536870911",
        ),
        (
            _in_assignment(_varint(3 << 3) + _varint(1 << 31)),
            "full.devices.assignments[0].binding: enum out of range",
        ),
        (
            _in_assignment(_ld(3, b"\x01")),
            "full.devices.assignments[0].binding: wire type 2 does not carry a enum",
        ),
    ],
)
def test_a_nested_refusal_names_its_field_path_word_for_word(data: bytes, message: str) -> None:
    """Every rule of the strict walk names the whole path of the field it refuses, inside submessages too
    (docs/mutation.md, "Round 6b": the walk's messages below the top level had no test)."""
    with pytest.raises(strict.WireError) as info:
        strict.decode_spec_body(data)
    assert str(info.value) == message


def test_the_largest_in_range_values_and_a_fixed_width_field_path() -> None:
    """An enum of 2**31 - 1 is kept (open enums), 2**31 is refused; a double given a varint or a length is
    refused naming its path; bytes that are not bytes name what they are."""
    assert (
        strict.decode_spec_body(_in_assignment(_varint(3 << 3) + _varint((1 << 31) - 1)))[0].full is not None
    )
    gauge = _varint(2 << 3) + b"\x01"
    with pytest.raises(strict.WireError, match=r"^gauges\[0\]\.value: wire type 0 does not carry a double$"):
        strict.decode(wire.StatusReport, _ld(9, gauge))
    with pytest.raises(strict.WireError, match=r"^gauges\[0\]\.value: wire type 2 does not carry a double$"):
        strict.decode(wire.StatusReport, _ld(9, _ld(2, b"abcdefgh")))
    # A packed run's elements are range-checked as their type: GpuHealth.xids is uint32.
    xids = _ld(1, _ld(3, _varint(1) + _varint(1 << 32)))
    with pytest.raises(strict.WireError, match=r"^gpus\[0\]\.xids\[0\]: uint32 out of range$"):
        strict.decode(wire.DiagNvmlResult, xids)
    with pytest.raises(strict.WireError) as info:
        strict.decode(wire.AccessSection, "x")  # type: ignore[arg-type]
    assert str(info.value) == "<message>: expected bytes, got str"
