"""Fixtures for the helper's tests: a real helper process over a temporary simulated host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helperproc import HelperProcess, base_config, make_root
from realkit import world  # noqa: F401 (a fixture: a real unprivileged node account)


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelperProcess]:
    root = make_root(tmp_path_factory.mktemp("helper"))
    proc = HelperProcess(root, base_config())
    yield proc
    proc.stop()


@pytest.fixture
def fresh_root(tmp_path: Path) -> Path:
    return make_root(tmp_path)
