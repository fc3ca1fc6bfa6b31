"""Strict decoding of the few wire messages pki reads (until bcd_shared.wire.strict covers them).

The bytes are parsed, never re-encoded; a truncated message, a wire-type error or any unknown field (at any
depth) is refused with the error class the caller names.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import betterproto2

from bcd_shared.pki.errors import PkiError

_M = TypeVar("_M", bound=betterproto2.Message)


def _unknown_field_path(message: betterproto2.Message, path: str) -> str | None:
    if getattr(message, "_unknown_fields", b""):
        return path or "(top level)"
    for field in dataclasses.fields(message):  # type: ignore[arg-type]
        value = getattr(message, field.name, None)
        items = (
            value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
        )
        for item in items:
            if isinstance(item, betterproto2.Message):
                found = _unknown_field_path(item, f"{path}.{field.name}" if path else field.name)
                if found is not None:
                    return found
    return None


def decode(cls: type[_M], data: bytes, what: str, error: type[PkiError]) -> _M:
    """Parse `data` as `cls`, refusing malformed input and unknown fields with `error`."""
    if not isinstance(data, bytes):
        raise error(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        message = cls.parse(data)
    except Exception as e:  # betterproto2 raises EOFError, ValueError, KeyError, ... on bad input
        raise error(f"{what}: does not decode as {cls.__name__} ({type(e).__name__}: {e})") from None
    unknown = _unknown_field_path(message, "")
    if unknown is not None:
        raise error(f"{what}: unknown field in {unknown}")
    return message
