"""Test fixtures shared by the whole suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# ../shared/ beside the checkout: read-only reference data (seeds, CDI schema, nvidia-smi output).
SHARED = REPO.parent / "shared"
REFERENCE = SHARED / "reference"
IN_CI = os.environ.get("CI") == "true"


@pytest.fixture
def sim_root(tmp_path: Path) -> Path:
    """A freshly seeded simulated host directory."""
    from bcd_shared.simhost.seed import seed

    root = tmp_path / "host"
    seed(root)
    return root


def require_tool(name: str) -> str:
    """The path of a real tool; skipped locally when missing, a failure under CI=true."""
    import shutil

    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is missing under CI: .ci/run must install it")
        pytest.skip(f"{name} not installed")
    return path
