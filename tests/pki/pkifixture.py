"""A small certificate hierarchy for the pki tests, built with the package's own issuance helpers."""

from __future__ import annotations

import datetime
import functools

import attrs
from bcd_shared.pki import KeyPair, Role, Roots, issue_intermediate, issue_leaf, issue_root

NOW = datetime.datetime(2026, 11, 20, 12, 0, tzinfo=datetime.UTC)
HOUR = datetime.timedelta(hours=1)
DAY = datetime.timedelta(days=1)


@attrs.frozen
class Signer:
    key: KeyPair
    chain: tuple[bytes, ...]  # leaf first, up to (not including) the root


@attrs.frozen
class Hierarchy:
    root_key: KeyPair
    root: bytes
    ca_key: KeyPair
    intermediate: bytes

    @classmethod
    def build(cls, name: str = "command-signing") -> Hierarchy:
        root_key, ca_key = KeyPair.generate(), KeyPair.generate()
        root = issue_root(root_key, f"{name} root", NOW - 365 * DAY, NOW + 3650 * DAY, path_length=1)
        inter = issue_intermediate(
            root, root_key, ca_key.public_key, f"{name} CA", NOW - 30 * DAY, NOW + 365 * DAY
        )
        return cls(root_key, root, ca_key, inter)

    @property
    def roots(self) -> Roots:
        return Roots.from_ders([self.root])

    def leaf(
        self,
        role: Role,
        name: str = "worker-1",
        not_before: datetime.datetime = NOW - HOUR,
        not_after: datetime.datetime = NOW + 4 * HOUR,
    ) -> Signer:
        key = KeyPair.generate()
        der = issue_leaf(self.intermediate, self.ca_key, key.public_key, role, name, not_before, not_after)
        return Signer(key, (der, self.intermediate))


# One hierarchy per test session. (No conftest.py here: a second module named `conftest` shadows
# tests/conftest.py for the suite's `from testsupport import REPO`.) Test modules wrap these in fixtures.
@functools.cache
def shared_hierarchy() -> Hierarchy:
    return Hierarchy.build()


@functools.cache
def shared_worker() -> Signer:
    return shared_hierarchy().leaf(Role.WORKER, "worker-1")


@functools.cache
def shared_node() -> Signer:
    return shared_hierarchy().leaf(Role.NODE, "node-1")
