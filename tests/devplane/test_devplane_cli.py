"""The development control plane's CLI and docs/devplane.md "By hand"."""

from __future__ import annotations

import re
from pathlib import Path


def test_join_tokens_never_begin_with_a_dash(tmp_path: Path) -> None:
    """`bcd join --token TOKEN`, as the docs write it, takes a token beginning with '-' for an option: one
    URL-safe base64 token in 64 did. The development control plane's tokens are hex."""
    from bcd_agent.devplane import DevPlane

    plane = DevPlane(tmp_path / "dp", listen=None)
    for _ in range(200):
        assert re.fullmatch(r"[0-9a-f]{48}", plane.issue_token())
