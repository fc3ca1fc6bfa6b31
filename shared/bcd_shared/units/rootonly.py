"""The root-only rule for a node acting on the host as root without `bcd helper` (HST-ROOT-01..08).

`bcd node` run as root converges the host and devices sections itself. Then, exactly as the helper
does, every file it writes or removes goes through `bcd_shared.rootpath`: each existing directory
from `/` (the System's root: `/` on a real host, the simulated host's directory under `bcd sim` and
in tests) down to the file must be root's and writable by no one else, the walk never follows a
symlink, and the write is atomic and durable relative to the verified directory.

- `RootOnlySystem(inner)`: a System whose `write_atomic` / `remove` are `write_root_only` /
  `remove_root_only`; reads and programs go to `inner` (programs, such as the simulated host's fake
  tools, act as themselves). A refusal is a retryable `RootOnly` step error naming the directory.
- `root_guard(root)`: the units' `ApplyContext.guard` (the check alone, for writes that programs
  make on the units' behalf and for the steps that test a path before writing).
- `acting_as_root()`: whether this process writes as root (effective uid 0).
- `for_root(system)`: `system` wrapped when acting as root, else `system` itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from bcd_shared.errors import RetryableError
from bcd_shared.rootpath import RootPathRefused, check_root_only, remove_root_only, write_root_only
from bcd_shared.system import DEFAULT_TOOL_TIMEOUT_S, CommandResult, System

from ._base import PathGuard

REASON = "RootOnly"


def acting_as_root() -> bool:
    return os.geteuid() == 0


def _refused(exc: RootPathRefused) -> RetryableError:
    return RetryableError(REASON, str(exc))


def root_guard(root: Path) -> PathGuard:
    """The root-only check as a units path guard (a retryable step error when refused)."""

    def guard(path: str) -> None:
        try:
            check_root_only(root, path)
        except RootPathRefused as exc:
            raise _refused(exc) from None

    return guard


class RootOnlySystem:
    """A System whose writes and removals follow the root-only rule (see the module docstring)."""

    root_only = True

    def __init__(self, inner: System) -> None:
        self.inner = inner

    @property
    def root(self) -> Path:
        return self.inner.root

    def host_path(self, path: str) -> Path:
        return self.inner.host_path(path)

    def read_bytes(self, path: str) -> bytes | None:
        return self.inner.read_bytes(path)

    def read_text(self, path: str) -> str | None:
        return self.inner.read_text(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def guard(self, path: str) -> None:
        root_guard(self.inner.root)(path)

    def write_atomic(self, path: str, data: bytes, mode: int = 0o644) -> None:
        try:
            write_root_only(self.inner.root, path, data, mode)
        except RootPathRefused as exc:
            raise _refused(exc) from None

    def remove(self, path: str) -> bool:
        try:
            return remove_root_only(self.inner.root, path)
        except RootPathRefused as exc:
            raise _refused(exc) from None

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TOOL_TIMEOUT_S,
        input: bytes | None = None,
    ) -> CommandResult:
        return self.inner.run(argv, timeout=timeout, input=input)

    def boot_id(self) -> str:
        return self.inner.boot_id()


def for_root(system: System) -> System:
    """`system` under the root-only rule when this process acts as root; unchanged otherwise."""
    if not acting_as_root() or isinstance(system, RootOnlySystem) or getattr(system, "root_only", False):
        return system
    return RootOnlySystem(system)
