"""A System whose writes and removals follow the root-only rule (bcd_shared.rootpath; HST-ROOT-01..08).

One wrapper serves both places that act on the host as root: `bcd node` run as root
(bcd_shared.units.rootonly) and the helper, whose per-call System (bcd_helper.ops.base.BoundedSystem)
adds a deadline on programs to it.

- `RootOnlySystem(inner)`: `write_atomic` / `remove` are `write_root_only` / `remove_root_only`
  relative to `inner.root`; reads and programs go to `inner` (programs, such as the simulated host's
  fake tools, act as themselves). A refusal is a retryable `RootOnly` step error naming the directory.
- `root_guard(root)`: the check alone, as a path guard (`path -> None`, raising the same error), for
  writes that programs make on the units' behalf and for the steps that test a path before writing.

This module imports only the stdlib and bcd_shared's base modules, so the helper loads it without the
host units.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from bcd_shared.errors import RetryableError
from bcd_shared.rootpath import RootPathRefused, check_root_only, remove_root_only, write_root_only
from bcd_shared.system import DEFAULT_TOOL_TIMEOUT_S, CommandResult, System

REASON = "RootOnly"


def _refused(exc: RootPathRefused) -> RetryableError:
    return RetryableError(REASON, str(exc))


def root_guard(root: Path) -> Callable[[str], None]:
    """The root-only check as a path guard (a retryable step error when refused)."""

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
