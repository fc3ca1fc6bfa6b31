"""The root-only rule for a node acting on the host as root without `bcd helper` (HST-ROOT-01..08).

`bcd node` run as root converges the host and devices sections itself. Then, exactly as the helper
does, every file it writes or removes goes through `bcd_shared.rootpath`: each existing directory
from `/` (the System's root: `/` on a real host, the simulated host's directory under `bcd sim` and
in tests) down to the file must be root's and writable by no one else, the walk never follows a
symlink, and the write is atomic and durable relative to the verified directory.

- `RootOnlySystem(inner)` (defined in bcd_shared.rootsystem, shared with the helper): a System whose
  `write_atomic` / `remove` are `write_root_only` / `remove_root_only`; reads and programs go to
  `inner` (programs, such as the simulated host's fake tools, act as themselves). A refusal is a
  retryable `RootOnly` step error naming the directory.
- `root_guard(root)`: the units' `ApplyContext.guard` (the check alone, for writes that programs
  make on the units' behalf and for the steps that test a path before writing).
- `acting_as_root()`: whether this process writes as root (effective uid 0).
- `for_root(system)`: `system` wrapped when acting as root, else `system` itself.
"""

from __future__ import annotations

import os

from bcd_shared.rootsystem import REASON, RootOnlySystem, root_guard
from bcd_shared.system import System

__all__ = ["REASON", "RootOnlySystem", "acting_as_root", "for_root", "root_guard"]


def acting_as_root() -> bool:
    return os.geteuid() == 0


def for_root(system: System) -> System:
    """`system` under the root-only rule when this process acts as root; unchanged otherwise."""
    if not acting_as_root() or isinstance(system, RootOnlySystem) or getattr(system, "root_only", False):
        return system
    return RootOnlySystem(system)
