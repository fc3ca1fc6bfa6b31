"""Fixtures of the pki tests: one command-signing hierarchy and a worker signer under it."""

from __future__ import annotations

import pytest
from bcd_shared.pki import Role
from pkifixture import Hierarchy, Signer


@pytest.fixture(scope="session")
def hierarchy() -> Hierarchy:
    return Hierarchy.build()


@pytest.fixture(scope="session")
def worker(hierarchy: Hierarchy) -> Signer:
    return hierarchy.leaf(Role.WORKER, "worker-1")


@pytest.fixture(scope="session")
def node_signer(hierarchy: Hierarchy) -> Signer:
    return hierarchy.leaf(Role.NODE, "node-1")
