"""Strict JSON decoding pieces shared by every parser of untrusted JSON (helper requests, the rebind
bundle, vm.json, unit settings, spec files): one rule, each caller's own error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def unique_keys(refuse: Callable[[str], Exception]) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A `json` object_pairs_hook that refuses an object naming a key twice (the standard library keeps
    the last silently): it raises `refuse(key)`."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise refuse(k)
            out[k] = v
        return out

    return hook
