"""Fixtures for the helper's tests: a real helper process over a temporary simulated host.

Hypothesis profiles: `helper-dev` (default, small, for local runs) and `helper-ci` (at least
1000 examples per property), chosen by CI=true or BCD_HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helperproc import HelperProcess, base_config, make_root
from hypothesis import HealthCheck, settings

settings.register_profile(
    "helper-ci",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "helper-dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PROFILE = os.environ.get("BCD_HYPOTHESIS_PROFILE") or (
    "helper-ci" if os.environ.get("CI") == "true" else "helper-dev"
)
HELPER_SETTINGS = settings.get_profile(PROFILE)


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelperProcess]:
    root = make_root(tmp_path_factory.mktemp("helper"))
    proc = HelperProcess(root, base_config())
    yield proc
    proc.stop()


@pytest.fixture
def fresh_root(tmp_path: Path) -> Path:
    return make_root(tmp_path)
