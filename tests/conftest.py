"""Fixtures shared by the whole suite (constants and helpers live in testsupport.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testsupport import IN_CI, REFERENCE, REPO, SHARED, require_tool

__all__ = ["IN_CI", "REFERENCE", "REPO", "SHARED", "require_tool", "sim_root"]


@pytest.fixture
def sim_root(tmp_path: Path) -> Path:
    """A freshly seeded simulated host directory."""
    from bcd_simhost.seed import seed

    root = tmp_path / "host"
    seed(root)
    return root


# Real host paths that bcd writes in production. Tests work on simulated roots and temporary
# directories only: a test that leaves something here has touched the machine it runs on.
REAL_HOST_PATHS = ("/var/lib/bcd-hostconfig", "/var/lib/bcd", "/run/bcd", "/etc/bcd", "/usr/lib/bcd")


def _real_host_state() -> dict[str, bool]:
    state = {p: Path(p).exists() for p in REAL_HOST_PATHS}
    cdi = Path("/etc/cdi")
    state["/etc/cdi/bcd-*.json"] = cdi.is_dir() and any(cdi.glob("bcd-*.json"))
    return state


@pytest.fixture(scope="session", autouse=True)
def _never_touch_the_real_host() -> object:
    before = _real_host_state()
    yield
    created = [p for p, exists in _real_host_state().items() if exists and not before[p]]
    assert not created, f"the test session created real host paths: {created}"


@pytest.fixture(autouse=True)
def _every_cdi_spec_bcd_writes_is_valid(request: pytest.FixtureRequest) -> object:
    """After each test, every hold spec under its tmp_path (`…/etc/cdi/bcd-*.json`) must pass the official
    CDI schema and CDI's naming rules (DEV-CDI-01): whatever path wrote it, the agent, the helper or the
    simulator. Tests that plant a broken spec on purpose say so with `@pytest.mark.planted_cdi`."""
    if "tmp_path" not in request.fixturenames or request.node.get_closest_marker("planted_cdi"):
        yield
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")  # taken now: torn down after this fixture
    yield
    from devices.cdicheck import assert_cdi_valid

    for spec in tmp_path.rglob("bcd-*.json"):
        if spec.parent.name == "cdi" and spec.parent.parent.name == "etc" and spec.is_file():
            assert_cdi_valid(spec.read_bytes())
