"""Fixtures for the helper's tests: a real helper process over a temporary simulated host."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helperproc import HelperProcess, base_config, make_root
from hostilekit import SignedHost
from intentkit import ControlPlane, Signer
from realkit import world  # noqa: F401 (a fixture: a real unprivileged node account)


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelperProcess]:
    root = make_root(tmp_path_factory.mktemp("helper"))
    proc = HelperProcess(root, base_config())
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def cp() -> ControlPlane:
    """A control plane's keys and command-signing hierarchies (intentkit), one for each test module."""
    return ControlPlane.build()


@pytest.fixture(scope="module")
def worker(cp: ControlPlane) -> Signer:
    """A command-signing leaf of `cp`."""
    return cp.command.leaf()


@pytest.fixture
def fresh_root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


@pytest.fixture
def signed_host() -> Iterator[SignedHost]:
    """A simulated host whose helper trusts command-signing roots (hostilekit.SignedHost), under /var/tmp:
    short enough for the VMM's socket paths. Its helpers are stopped and the tree removed at the end."""
    parent = Path(tempfile.mkdtemp(prefix="bcd-signed-", dir="/var/tmp"))
    helpers: list[HelperProcess] = []
    try:
        host = SignedHost(parent)
        helpers = host.helpers
        yield host
    finally:
        for h in helpers:
            h.stop()
        shutil.rmtree(parent, ignore_errors=True)
