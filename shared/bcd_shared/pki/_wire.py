"""Strict decoding of the wire messages pki reads, through bcd_shared.wire.strict.

The bytes are checked against the schema and parsed, never re-encoded; malformed protobuf, a duplicate
singular field, a wrong wire type or any unknown field (at any depth) is refused with the PkiError class the
caller names, whose message carries the field path and the wire rule.
"""

from __future__ import annotations

from typing import TypeVar

import betterproto2

from bcd_shared.pki.errors import PkiError
from bcd_shared.wire import strict

_M = TypeVar("_M", bound=betterproto2.Message)


def decode(cls: type[_M], data: bytes, what: str, error: type[PkiError]) -> _M:
    """Decode `data` as `cls` strictly, refusing with `error`."""
    if not isinstance(data, bytes):
        raise error(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        return strict.decode(cls, data)
    except strict.WireError as e:
        raise error(f"{what}: {e}") from None
