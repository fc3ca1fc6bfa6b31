"""Fixtures shared by the whole suite (constants and helpers live in testsupport.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testsupport import IN_CI, REFERENCE, REPO, SHARED, require_tool

__all__ = ["IN_CI", "REFERENCE", "REPO", "SHARED", "require_tool", "sim_root"]


@pytest.fixture
def sim_root(tmp_path: Path) -> Path:
    """A freshly seeded simulated host directory."""
    from bcd_shared.simhost.seed import seed

    root = tmp_path / "host"
    seed(root)
    return root
