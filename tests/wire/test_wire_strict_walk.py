"""The strict walk's per-class tables and lazily built paths (issue 16, item 8: the decoder's cost per
message) against the walk as it was before them, kept here verbatim as the reference: on valid messages,
single-byte corruptions and random bytes, both accept the same inputs and refuse the rest with the same
path and rule."""

from __future__ import annotations

from typing import Any

import bcd_shared.wire as wire
import betterproto2
from bcd_shared.wire import strict
from bcd_shared.wire.strict import (
    _FIXED32_TYPES,
    _FIXED64_TYPES,
    _INT32_LIKE,
    _MAX_FIELD_NUMBER,
    _VARINT_TYPES,
    _WIRE_FIXED32,
    _WIRE_FIXED64,
    _WIRE_LEN,
    _WIRE_VARINT,
    UnknownField,
    WireError,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wirehelpers import MESSAGE_CLASSES, populated

# ---- the reference: strict.py's walk before issue 16 --------------------------------------------------


def _varint(data: bytes, pos: int, path: str) -> tuple[int, int]:
    result = 0
    shift = 0
    start = pos
    while True:
        if pos >= len(data):
            raise WireError(path, "truncated varint")
        if pos - start >= 10:
            raise WireError(path, "varint longer than 10 bytes")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >= 1 << 64:
                raise WireError(path, "varint exceeds 64 bits")
            return result, pos
        shift += 7


def _sub(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _check_varint_value(proto_type: str, value: int, path: str) -> None:
    if proto_type == betterproto2.TYPE_BOOL and value > 1:
        raise WireError(path, f"bool encoded as {value}, expected 0 or 1")
    if proto_type == betterproto2.TYPE_UINT32 and value >= 1 << 32:
        raise WireError(path, "uint32 out of range")
    if proto_type in _INT32_LIKE and (1 << 31) <= value < (1 << 64) - (1 << 31):
        raise WireError(path, f"{proto_type} out of range")
    if proto_type == betterproto2.TYPE_SINT32 and value >= 1 << 32:
        raise WireError(path, "sint32 out of range")


def _check_packed(proto_type: str, payload: bytes, path: str) -> None:
    if proto_type in _FIXED64_TYPES or proto_type in _FIXED32_TYPES:
        size = 8 if proto_type in _FIXED64_TYPES else 4
        if len(payload) % size:
            raise WireError(path, f"packed run of {len(payload)} bytes is not a multiple of {size}")
        return
    pos = 0
    while pos < len(payload):
        value, pos = _varint(payload, pos, path)
        _check_varint_value(proto_type, value, path)


def _proto_meta(cls: type[betterproto2.Message]) -> betterproto2.ProtoClassMetadata:
    # betterproto2 types this class property for concrete subclasses only.
    meta: betterproto2.ProtoClassMetadata = cls._betterproto  # type: ignore[arg-type]
    return meta


def _field_class(cls: type[betterproto2.Message], name: str, meta: Any) -> type[betterproto2.Message]:
    if meta.unwrap is not None:
        unwrapped: type[betterproto2.Message] = meta.unwrap()
        return unwrapped
    field_cls: type[betterproto2.Message] = _proto_meta(cls).cls_by_field[name]
    return field_cls


def _ref_check(
    cls: type[betterproto2.Message],
    data: bytes,
    path: str,
    tolerate: frozenset[str],
    unknown: list[UnknownField],
) -> None:
    proto_meta = _proto_meta(cls)
    seen: set[int] = set()
    groups: dict[str, str] = {}
    counts: dict[str, int] = {}
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos, _sub(path, "<tag>"))
        number, wire_type = tag >> 3, tag & 7
        if number < 1 or number > _MAX_FIELD_NUMBER:
            raise WireError(path, f"invalid field number {number}")
        name = proto_meta.field_name_by_number.get(number)
        where = _sub(path, name) if name else _sub(path, f"#{number}")
        if wire_type == _WIRE_VARINT:
            value, pos = _varint(data, pos, where)
            payload = b""
        elif wire_type in (_WIRE_FIXED64, _WIRE_FIXED32):
            size = 8 if wire_type == _WIRE_FIXED64 else 4
            if pos + size > len(data):
                raise WireError(where, "truncated fixed-width value")
            value, payload, pos = 0, data[pos : pos + size], pos + size
        elif wire_type == _WIRE_LEN:
            length, pos = _varint(data, pos, where)
            if pos + length > len(data):
                raise WireError(where, f"length {length} runs past the end of the message")
            value, payload, pos = 0, data[pos : pos + length], pos + length
        else:
            raise WireError(where, f"wire type {wire_type} is not allowed (groups are not used)")

        if name is None:
            if path in tolerate:
                unknown.append(UnknownField(path=path, number=number, wire_type=wire_type))
                continue
            raise WireError(where, f"unknown field number {number}")

        meta = proto_meta.meta_by_field_name[name]
        proto_type = meta.proto_type
        repeated = bool(meta.repeated) or proto_type == betterproto2.TYPE_MAP
        if repeated:
            index = counts.get(name, 0)
            counts[name] = index + 1
            where = f"{where}[{index}]"
        else:
            if number in seen:
                raise WireError(where, "singular field appears more than once")
            seen.add(number)
            if meta.group:
                other = groups.get(meta.group)
                if other is not None:
                    raise WireError(where, f"oneof {meta.group} already set by {other}")
                groups[meta.group] = name

        if proto_type in _VARINT_TYPES:
            if wire_type == _WIRE_VARINT:
                _check_varint_value(proto_type, value, where)
            elif wire_type == _WIRE_LEN and meta.repeated:
                _check_packed(proto_type, payload, where)
            else:
                raise WireError(where, f"wire type {wire_type} does not carry a {proto_type}")
        elif proto_type in _FIXED64_TYPES or proto_type in _FIXED32_TYPES:
            expected = _WIRE_FIXED64 if proto_type in _FIXED64_TYPES else _WIRE_FIXED32
            if wire_type == _WIRE_LEN and meta.repeated:
                _check_packed(proto_type, payload, where)
            elif wire_type != expected:
                raise WireError(where, f"wire type {wire_type} does not carry a {proto_type}")
        elif wire_type != _WIRE_LEN:
            raise WireError(where, f"wire type {wire_type} does not carry a {proto_type}")
        elif proto_type == betterproto2.TYPE_STRING:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                raise WireError(where, "string is not valid UTF-8") from None
        elif proto_type in (betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP):
            _ref_check(_field_class(cls, name, meta), payload, where, tolerate, unknown)


# ---- the comparison -------------------------------------------------------------------------------------


def _outcome(walk: Any, cls: type, data: bytes, tolerate: frozenset[str]) -> tuple[str, list[UnknownField]]:
    unknown: list[UnknownField] = []
    try:
        walk(cls, data, "", tolerate, unknown)
    except WireError as exc:
        return f"refused {exc}", unknown
    return "accepted", unknown


def _same(cls: type, data: bytes, tolerate: frozenset[str] = frozenset()) -> None:
    assert _outcome(strict._check, cls, data, tolerate) == _outcome(_ref_check, cls, data, tolerate)


_CLASSES = (
    wire.NodeMessage,
    wire.GatewayMessage,
    wire.CommandBody,
    wire.DesiredStateBody,
    wire.CommandUpdate,
    wire.StatusReport,
    wire.Hello,
)
_SAMPLES = [(cls, bytes(populated(cls))) for cls in _CLASSES]


def test_valid_messages_walk_alike() -> None:
    for cls, data in _SAMPLES:
        _same(cls, data)
        _same(cls, data, strict.SPEC_PATHS)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(_SAMPLES))), st.integers(min_value=0), st.integers(0, 255), st.booleans())
def test_corrupted_messages_are_judged_alike(which: int, position: int, byte: int, cut: bool) -> None:
    cls, sample = _SAMPLES[which]
    data = bytearray(sample)
    position %= len(data)
    data[position] = byte
    if cut:
        data = data[: position + 1]
    _same(cls, bytes(data), strict.SPEC_PATHS if cls is wire.DesiredStateBody else frozenset())


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_CLASSES), st.binary(max_size=96))
def test_random_bytes_are_judged_alike(cls: type, data: bytes) -> None:
    _same(cls, data)


# ---- the builder against betterproto2's parser ---------------------------------------------------------


def _same_message(cls: type, data: bytes) -> None:
    """Bytes the walk accepts without unknown fields decode to the message `parse` makes."""
    unknown: list[UnknownField] = []
    try:
        strict._check(cls, data, "", frozenset(), unknown)
    except WireError:
        return
    built, parsed = strict._build(cls, data), cls.parse(data)
    assert built == parsed and bytes(built) == bytes(parsed) and repr(built) == repr(parsed)
    assert strict.decode(cls, data) == parsed


def test_valid_messages_build_as_parse_makes_them() -> None:
    """Every bcd.v1 message, with each member of its oneofs in turn (maps, packed scalars, every scalar
    type, nested messages)."""
    for cls in MESSAGE_CLASSES:
        for pick in range(4):
            _same_message(cls, bytes(populated(cls, oneof_pick=pick)))
    # Values at the edges of each scalar type, negative ints and unknown enum numbers included.
    update = wire.CommandUpdate(command_id="é", state=wire.CommandState(99), result=b"\0\xff")
    _same_message(wire.CommandUpdate, bytes(update))
    body = wire.CommandBody(seq=2**64 - 1, not_after=-5, min_generation=2**63 - 1, lane=wire.Lane(7))
    _same_message(wire.CommandBody, bytes(body))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(_SAMPLES))), st.integers(min_value=0), st.integers(0, 255))
def test_corrupted_messages_the_walk_accepts_build_as_parse_makes_them(
    which: int, position: int, byte: int
) -> None:
    cls, sample = _SAMPLES[which]
    data = bytearray(sample)
    data[position % len(data)] = byte
    _same_message(cls, bytes(data))
