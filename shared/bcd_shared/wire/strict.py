"""Strict decoding of bcd.v1 messages at a trust boundary.

Protobuf parsers skip unknown fields and let a later occurrence of a singular field overwrite an earlier
one; betterproto2's ``Message.parse`` does both (it keeps unknown fields as raw bytes and writes them back
when the message is encoded again). bcd is strict at every boundary instead, so :func:`decode` first walks the
wire format against the message's schema and refuses, naming the field path and the rule:

- bytes that are not well-formed protobuf: a truncated tag, varint or length, a length past the end, a
  varint longer than 10 bytes, a field number 0 or above 2^29-1, the deprecated group wire types;
- a field number the schema does not know, anywhere in the tree ("unknown field"), except directly inside a
  message at a path listed in ``tolerate_unknown_in`` (then it is reported, not refused);
- a known field with the wrong wire type;
- a singular field that appears twice, or two members of one oneof;
- a string that is not UTF-8, a bool other than 0 or 1, an int32/uint32/enum varint out of its range, a
  packed run whose length is not a whole number of elements.

Only then is the data handed to ``Message.parse``. Trailing data cannot exist in protobuf as such: anything
after the last complete field is either another (checked) field or a truncation, which is refused.

Unknown *enum values* are not refused here: proto3 enums are open, betterproto2 keeps the number
(``Binding(9)`` reads ``UNKNOWN(9)``), and the domain layer must refuse it with its own rule (for example
``AllocationFailed{reason: unsupported-binding}`` for a binding bcd does not know).

Decoding never re-encodes: signed bytes are verified and stored as received (docs/protocol.md).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Collection
from typing import Any, TypeVar

import attrs
import betterproto2

from bcd_shared.wire._gen.bcd.v1 import DesiredStateBody
from bcd_shared.wire._gen.google.protobuf import Any as ProtoAny

M = TypeVar("M", bound=betterproto2.Message)

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LEN, _WIRE_FIXED32 = 0, 1, 2, 5
_MAX_FIELD_NUMBER = (1 << 29) - 1

_VARINT_TYPES = frozenset(
    {
        betterproto2.TYPE_INT32,
        betterproto2.TYPE_INT64,
        betterproto2.TYPE_UINT32,
        betterproto2.TYPE_UINT64,
        betterproto2.TYPE_SINT32,
        betterproto2.TYPE_SINT64,
        betterproto2.TYPE_BOOL,
        betterproto2.TYPE_ENUM,
    }
)
_FIXED64_TYPES = frozenset({betterproto2.TYPE_FIXED64, betterproto2.TYPE_SFIXED64, betterproto2.TYPE_DOUBLE})
_FIXED32_TYPES = frozenset({betterproto2.TYPE_FIXED32, betterproto2.TYPE_SFIXED32, betterproto2.TYPE_FLOAT})
_INT32_LIKE = frozenset({betterproto2.TYPE_INT32, betterproto2.TYPE_ENUM})


class WireError(ValueError):
    """Bytes refused at the boundary. ``path`` names the field (``full.devices.assignments[0].limits``)."""

    def __init__(self, path: str, rule: str) -> None:
        self.path = path or "<message>"
        self.rule = rule
        super().__init__(f"{self.path}: {rule}")


@attrs.frozen
class UnknownField:
    """A field number the schema does not know, found inside the message at ``path`` (tolerated there)."""

    path: str
    number: int
    wire_type: int


def decode(cls: type[M], data: bytes, *, tolerate_unknown_in: Collection[str] = ()) -> M:
    """Decode ``data`` as ``cls`` strictly (see the module docstring); raise WireError on any violation."""
    message, _ = decode_with_unknown(cls, data, tolerate_unknown_in=tolerate_unknown_in)
    return message


def decode_with_unknown(
    cls: type[M], data: bytes, *, tolerate_unknown_in: Collection[str] = (), max_fields: int | None = None
) -> tuple[M, list[UnknownField]]:
    """Like :func:`decode`, also returning the tolerated unknown fields.

    A DesiredStateBody is decoded with ``tolerate_unknown_in={"full", "patch"}``: a NodeSpec section number
    this build does not know is then listed here (and the section reported UNSUPPORTED, DLV-CONV-06) while
    an unknown field anywhere else still refuses the whole body.

    ``max_fields`` bounds what decoding builds: the fields of the whole tree (each element of a packed run
    counted), counted by the walk before anything is built, past which the bytes are refused. For bytes no
    signature vouches for (the helper's development-only unsigned access spec, round 6b): an empty
    submessage is two bytes on the wire and hundreds once decoded.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError("", f"expected bytes, got {type(data).__name__}")
    raw = bytes(data)
    unknown: list[UnknownField] = []
    _check(cls, raw, "", frozenset(tolerate_unknown_in), unknown, _Budget(max_fields))
    try:
        if unknown:
            return cls.parse(raw), unknown  # parse keeps the tolerated fields' bytes (`_unknown_fields`)
        return _build(cls, raw), unknown
    except Exception as exc:  # the walk above admits only what parse handles; keep the boundary typed anyway
        raise WireError("", f"undecodable: {exc}") from exc


# Where a DesiredStateBody holds its NodeSpec (oneof spec): unknown section numbers are tolerated there only.
SPEC_PATHS: frozenset[str] = frozenset({"full", "patch"})


def decode_spec_body(
    data: bytes, *, max_fields: int | None = None
) -> tuple[DesiredStateBody, tuple[int, ...]]:
    """A DesiredStateBody, strictly, and the NodeSpec section numbers in it this build does not know (sorted,
    each once): the converge runner reports those UNSUPPORTED with the number as reason (DLV-CONV-05/06).
    ``max_fields``: as for :func:`decode_with_unknown`."""
    body, unknown = decode_with_unknown(
        DesiredStateBody, data, tolerate_unknown_in=SPEC_PATHS, max_fields=max_fields
    )
    return body, tuple(sorted({u.number for u in unknown}))


def type_url(cls: type[betterproto2.Message]) -> str:
    """The Any type URL of a bcd.v1 message class (``type.googleapis.com/bcd.v1.GpuResetRequest``)."""
    from bcd_shared.wire._gen.message_pool import default_message_pool

    try:
        return str(default_message_pool.type_to_url[cls])
    except KeyError:
        raise WireError("", f"{cls.__name__} is not a registered message") from None


def unpack_any(value: ProtoAny | None, cls: type[M], *, path: str = "payload") -> M:
    """Strictly decode an Any's value as ``cls``, refusing another type URL or a missing Any."""
    if value is None:
        raise WireError(path, f"missing, expected {type_url(cls)}")
    expected = type_url(cls)
    if value.type_url != expected:
        raise WireError(path, f"type_url {value.type_url!r} is not {expected!r}")
    return decode(cls, value.value)


# ---- the wire walk ----------------------------------------------------------------------------------


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


def _varint_at(data: bytes, pos: int, path: str, name: str) -> tuple[int, int]:
    """`_varint` with the one-byte case inline and the error path (`path`.`name`) built only on error."""
    if pos < len(data):
        byte = data[pos]
        if byte < 0x80:
            return byte, pos + 1
    return _varint(data, pos, _sub(path, name))


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


_FIXED_FORMATS = {
    betterproto2.TYPE_DOUBLE: "<d",
    betterproto2.TYPE_FLOAT: "<f",
    betterproto2.TYPE_FIXED32: "<I",
    betterproto2.TYPE_FIXED64: "<Q",
    betterproto2.TYPE_SFIXED32: "<i",
    betterproto2.TYPE_SFIXED64: "<q",
}

# What the walk needs of one field, computed once per message class (`_rules`).
_K_VARINT, _K_FIXED, _K_STRING, _K_BYTES, _K_MESSAGE = range(5)


class _Rule:
    __slots__ = (
        "enum_cls",
        "fixed_fmt",
        "fixed_wire",
        "group",
        "is_map",
        "kind",
        "name",
        "packable",
        "proto_type",
        "repeated",
        "sub",
        "unwrap",
    )

    def __init__(self, cls: type[betterproto2.Message], name: str, meta: Any) -> None:
        proto_type = meta.proto_type
        self.name = name
        self.proto_type = proto_type
        self.repeated = bool(meta.repeated) or proto_type == betterproto2.TYPE_MAP
        self.packable = bool(meta.repeated)  # a packed run is accepted for a repeated scalar
        self.group = meta.group
        self.fixed_wire = -1
        self.fixed_fmt = ""
        self.sub: type[betterproto2.Message] | None = None
        self.enum_cls: Any = None
        self.is_map = proto_type == betterproto2.TYPE_MAP
        self.unwrap = meta.unwrap is not None
        if proto_type in _VARINT_TYPES:
            self.kind = _K_VARINT
            if proto_type == betterproto2.TYPE_ENUM:
                self.enum_cls = _proto_meta(cls).cls_by_field[name]
        elif proto_type in _FIXED64_TYPES or proto_type in _FIXED32_TYPES:
            self.kind = _K_FIXED
            self.fixed_wire = _WIRE_FIXED64 if proto_type in _FIXED64_TYPES else _WIRE_FIXED32
            self.fixed_fmt = _FIXED_FORMATS[proto_type]
        elif proto_type == betterproto2.TYPE_STRING:
            self.kind = _K_STRING
        elif proto_type in (betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP):
            self.kind = _K_MESSAGE
            self.sub = _field_class(cls, name, meta)
        else:
            self.kind = _K_BYTES


@functools.cache
def _rules(cls: type[betterproto2.Message]) -> dict[int, _Rule]:
    """The class's fields by number (the schema is fixed for the life of the process)."""
    proto_meta = _proto_meta(cls)
    return {
        number: _Rule(cls, name, proto_meta.meta_by_field_name[name])
        for number, name in proto_meta.field_name_by_number.items()
    }


class _Budget:
    """The fields a decode may still build (None: unbounded)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.left = limit

    def take(self, n: int, path: str) -> None:
        if self.left is None:
            return
        self.left -= n
        if self.left < 0:
            raise WireError(path, f"more than {self.limit} fields")


def _check(
    cls: type[betterproto2.Message],
    data: bytes,
    path: str,
    tolerate: frozenset[str],
    unknown: list[UnknownField],
    budget: _Budget | None = None,
) -> None:
    budget = budget if budget is not None else _Budget(None)
    rules = _rules(cls)
    seen: set[int] = set()
    groups: dict[str, str] = {}
    counts: dict[str, int] = {}
    pos = 0
    end = len(data)
    while pos < end:
        budget.take(1, path)
        tag, pos = _varint_at(data, pos, path, "<tag>")
        number, wire_type = tag >> 3, tag & 7
        if number < 1 or number > _MAX_FIELD_NUMBER:
            raise WireError(path, f"invalid field number {number}")
        rule = rules.get(number)
        name = rule.name if rule is not None else f"#{number}"
        if wire_type == _WIRE_VARINT:
            value, pos = _varint_at(data, pos, path, name)
            payload = b""
        elif wire_type == _WIRE_LEN:
            length, pos = _varint_at(data, pos, path, name)
            if pos + length > end:
                raise WireError(_sub(path, name), f"length {length} runs past the end of the message")
            value, payload, pos = 0, data[pos : pos + length], pos + length
        elif wire_type in (_WIRE_FIXED64, _WIRE_FIXED32):
            size = 8 if wire_type == _WIRE_FIXED64 else 4
            if pos + size > end:
                raise WireError(_sub(path, name), "truncated fixed-width value")
            value, payload, pos = 0, data[pos : pos + size], pos + size
        else:
            raise WireError(_sub(path, name), f"wire type {wire_type} is not allowed (groups are not used)")

        if rule is None:
            if path in tolerate:
                unknown.append(UnknownField(path=path, number=number, wire_type=wire_type))
                continue
            raise WireError(_sub(path, name), f"unknown field number {number}")

        index = -1
        if rule.repeated:
            index = counts.get(name, 0)
            counts[name] = index + 1
        else:
            if number in seen:
                raise WireError(_sub(path, name), "singular field appears more than once")
            seen.add(number)
            if rule.group:
                other = groups.get(rule.group)
                if other is not None:
                    raise WireError(_sub(path, name), f"oneof {rule.group} already set by {other}")
                groups[rule.group] = name

        kind = rule.kind
        if kind == _K_STRING and wire_type == _WIRE_LEN:
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                raise WireError(_where(path, name, index), "string is not valid UTF-8") from None
        elif kind == _K_BYTES and wire_type == _WIRE_LEN:
            pass
        elif kind == _K_MESSAGE and wire_type == _WIRE_LEN:
            assert rule.sub is not None
            _check(rule.sub, payload, _where(path, name, index), tolerate, unknown, budget)
        elif kind == _K_VARINT:
            if wire_type == _WIRE_VARINT:
                if value >= 1 << 31 or rule.proto_type == betterproto2.TYPE_BOOL:
                    _check_varint_value(rule.proto_type, value, _where(path, name, index))
            elif wire_type == _WIRE_LEN and rule.packable:
                budget.take(len(payload), path)  # at most one element a byte
                _check_packed(rule.proto_type, payload, _where(path, name, index))
            else:
                raise WireError(
                    _where(path, name, index), f"wire type {wire_type} does not carry a {rule.proto_type}"
                )
        elif kind == _K_FIXED:
            if wire_type == _WIRE_LEN and rule.packable:
                budget.take(len(payload) // 4, path)  # at most one element in four bytes
                _check_packed(rule.proto_type, payload, _where(path, name, index))
            elif wire_type != rule.fixed_wire:
                raise WireError(
                    _where(path, name, index), f"wire type {wire_type} does not carry a {rule.proto_type}"
                )
        else:  # a length-delimited kind with another wire type
            raise WireError(
                _where(path, name, index), f"wire type {wire_type} does not carry a {rule.proto_type}"
            )


def _where(path: str, name: str, index: int) -> str:
    where = _sub(path, name)
    return f"{where}[{index}]" if index >= 0 else where


# ---- building the message from bytes the walk accepted ----------------------------------------------


def _from_varint(rule: _Rule, value: int) -> Any:
    """A varint's value as betterproto2's parser makes it (Message._postprocess_single)."""
    proto_type = rule.proto_type
    if proto_type in _SIGNED_VARINT:
        bits = 32 if proto_type == betterproto2.TYPE_INT32 else 64
        value &= (1 << bits) - 1
        sign = 1 << (bits - 1)
        value = (value ^ sign) - sign
        return rule.enum_cls(value) if rule.enum_cls is not None else value
    if proto_type == betterproto2.TYPE_BOOL:
        return value > 0
    if proto_type == betterproto2.TYPE_UINT32:
        return value & 0xFFFFFFFF
    if proto_type == betterproto2.TYPE_UINT64:
        return value & 0xFFFFFFFFFFFFFFFF
    value &= 0xFFFFFFFF if proto_type == betterproto2.TYPE_SINT32 else 0xFFFFFFFFFFFFFFFF
    return (value >> 1) ^ (-(value & 1))  # sint32/sint64: undo the zig-zag


_SIGNED_VARINT = frozenset({betterproto2.TYPE_INT32, betterproto2.TYPE_INT64, betterproto2.TYPE_ENUM})


def _build(cls: type[M], data: bytes) -> M:
    """The message `cls.parse(data)` would make, for bytes `_check` accepted with no unknown field (so no
    check is repeated here): the same values, field by field, without betterproto2's generic reader.
    tests/wire/test_wire_strict_walk.py compares the two."""
    rules = _rules(cls)
    message = cls()
    pos = 0
    end = len(data)
    while pos < end:
        tag, pos = _varint(data, pos, "")
        rule = rules[tag >> 3]
        wire_type = tag & 7
        value: Any
        if wire_type == _WIRE_VARINT:
            raw, pos = _varint(data, pos, "")
            value = _from_varint(rule, raw)
        elif wire_type == _WIRE_LEN:
            length, pos = _varint(data, pos, "")
            payload, pos = data[pos : pos + length], pos + length
            kind = rule.kind
            if kind == _K_STRING:
                value = str(payload, "utf-8")
            elif kind == _K_BYTES:
                value = payload
            elif kind == _K_MESSAGE:
                assert rule.sub is not None
                value = _build(rule.sub, payload)
                if rule.is_map:
                    getattr(message, rule.name)[value.key] = value.value
                    continue
                if rule.unwrap:
                    value = value.to_wrapped()
            else:  # a packed run of scalars
                getattr(message, rule.name).extend(_unpack(rule, payload))
                continue
        else:
            size = 8 if wire_type == _WIRE_FIXED64 else 4
            value = struct.unpack(rule.fixed_fmt, data[pos : pos + size])[0]
            pos += size
        if rule.repeated:
            getattr(message, rule.name).append(value)
        else:
            setattr(message, rule.name, value)
    return message


def _unpack(rule: _Rule, payload: bytes) -> list[Any]:
    if rule.kind == _K_FIXED:
        size = 8 if rule.fixed_wire == _WIRE_FIXED64 else 4
        return [struct.unpack(rule.fixed_fmt, payload[i : i + size])[0] for i in range(0, len(payload), size)]
    out: list[Any] = []
    pos = 0
    while pos < len(payload):
        raw, pos = _varint(payload, pos, "")
        out.append(_from_varint(rule, raw))
    return out
