"""Builds fully populated instances of any bcd.v1 message from its schema (for round-trip tests)."""

from __future__ import annotations

from typing import Any

import bcd_shared.wire as wire
import betterproto2

MESSAGE_CLASSES: list[type[betterproto2.Message]] = [
    obj
    for name in wire.__all__
    if isinstance(obj := getattr(wire, name), type) and issubclass(obj, betterproto2.Message)
]
ENUM_CLASSES: list[type[betterproto2.Enum]] = [
    obj
    for name in wire.__all__
    if isinstance(obj := getattr(wire, name), type) and issubclass(obj, betterproto2.Enum)
]

_SCALARS: dict[str, Any] = {
    betterproto2.TYPE_STRING: "sample-é",
    betterproto2.TYPE_BYTES: b"\x00\xffsig",
    betterproto2.TYPE_BOOL: True,
    betterproto2.TYPE_INT32: -7,
    betterproto2.TYPE_SINT32: -5,
    betterproto2.TYPE_INT64: -(2**40),
    betterproto2.TYPE_SINT64: -(2**41),
    betterproto2.TYPE_UINT32: 2**31 + 3,
    betterproto2.TYPE_UINT64: 2**63 + 11,
    betterproto2.TYPE_DOUBLE: 0.25,
    betterproto2.TYPE_FLOAT: 0.5,
    betterproto2.TYPE_FIXED32: 9,
    betterproto2.TYPE_FIXED64: 10,
    betterproto2.TYPE_SFIXED32: -9,
    betterproto2.TYPE_SFIXED64: -10,
}


def meta_of(cls: type[betterproto2.Message]) -> Any:
    return cls._betterproto  # type: ignore[arg-type]


def _value(cls: type[betterproto2.Message], name: str, meta: Any, depth: int, oneof_pick: int) -> Any:
    proto_type = meta.proto_type
    if proto_type == betterproto2.TYPE_ENUM:
        enum_cls = meta_of(cls).cls_by_field[name]
        members = [m for m in enum_cls if m.value != 0]
        return members[-1]
    if proto_type == betterproto2.TYPE_MESSAGE:
        if meta.unwrap is not None:
            raise AssertionError(f"{cls.__name__}.{name}: wrapped well-known types are not used in bcd.v1")
        return populated(meta_of(cls).cls_by_field[name], depth + 1, oneof_pick)
    return _SCALARS[proto_type]


def populated(cls: type[betterproto2.Message], depth: int = 0, oneof_pick: int = 0) -> Any:
    """An instance of cls with every field set to a non-default value (one member per oneof, chosen by
    oneof_pick modulo the group's size), nested messages populated down to depth 6."""
    if depth > 6:
        return cls()
    meta = meta_of(cls)
    kwargs: dict[str, Any] = {}
    groups: dict[str, list[str]] = {}
    for name in meta.sorted_field_names:
        field_meta = meta.meta_by_field_name[name]
        if field_meta.group:
            groups.setdefault(field_meta.group, []).append(name)
    chosen = {members[oneof_pick % len(members)] for members in groups.values()}
    for name in meta.sorted_field_names:
        field_meta = meta.meta_by_field_name[name]
        if field_meta.group and name not in chosen:
            continue
        if field_meta.proto_type == betterproto2.TYPE_MAP:
            entry = meta.cls_by_field[name]
            entry_meta = meta_of(entry)
            key = _value(entry, "key", entry_meta.meta_by_field_name["key"], depth, oneof_pick)
            value = _value(entry, "value", entry_meta.meta_by_field_name["value"], depth, oneof_pick)
            kwargs[name] = {key: value, f"{key}-2": value}
        elif field_meta.repeated:
            first = _value(cls, name, field_meta, depth, oneof_pick)
            kwargs[name] = [first, _value(cls, name, field_meta, depth, oneof_pick + 1)]
        else:
            kwargs[name] = _value(cls, name, field_meta, depth, oneof_pick)
    return cls(**kwargs)
