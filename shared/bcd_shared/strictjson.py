"""Strict JSON decoding pieces shared by every parser of untrusted JSON (helper requests, the rebind
bundle, vm.json, unit settings, spec files): one rule, each caller's own error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def unique_keys(refuse: Callable[[str], Exception]) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A `json` object_pairs_hook that refuses an object naming a key twice (the standard library keeps
    the last silently): it raises `refuse(key)`."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)  # in C; a key named twice leaves fewer entries than pairs
        if len(out) != len(pairs):  # then find the first key named twice, to name it
            seen: set[str] = set()
            for k, _v in pairs:
                if k in seen:
                    raise refuse(k)
                seen.add(k)
        return out

    return hook


def value_bound(data: bytes | bytearray) -> int:
    """An upper bound on the values of a JSON text, counted on its bytes before decoding: every value but
    the first is preceded by `,` or `:` or opens with `[`/`{` (those inside strings count too, so this is
    an upper bound). Decoded, 3 bytes of `{},` are ~70 bytes of objects: a caller bounds this first."""
    return data.count(b"[") + data.count(b"{") + data.count(b",") + data.count(b":")
