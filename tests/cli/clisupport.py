"""Helpers of the CLI tests: run `bcd` as a subprocess, seed a simulated host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bcd_simhost.seed import seed
from testsupport import REPO

EXAMPLES = REPO / "examples"


def bcd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={"PATH": "/usr/bin:/bin", "BCD_CONFIG": "/nonexistent/bcd-config.toml"},
    )


def bcd_json(*args: str) -> tuple[int, Any]:
    res = bcd(*args, "--json")
    assert res.stdout.strip(), res.stderr
    return res.returncode, json.loads(res.stdout)


def sim_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    seed(root)
    return root
