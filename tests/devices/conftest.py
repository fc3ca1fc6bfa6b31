"""Fixtures of the devices tests (the host model lives in devhost.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from devices.devhost import Host


@pytest.fixture
def host(sim_root: Path) -> Host:
    return Host(sim_root)


@pytest.fixture
def make_host(sim_root: Path) -> Callable[..., Host]:
    return lambda **kw: Host(sim_root, **kw)
