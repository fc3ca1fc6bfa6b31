"""The gate to the simulated host: `--root DIR` with DIR other than `/` needs bcd-simhost.

The simulated host (fake nvidia-smi, systemctl, modprobe, ...) is the development distribution
bcd-simhost (devhost/, package bcd_simhost). Neither Debian package installs it, so the root helper's
trusted base carries no simulator; where it is absent a simulated root is refused with one line.
Imported by name at run time (importlib), never statically: shared/ does not depend on it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import cast

from bcd_shared.system import LocalSystem

SIMHOST = "bcd_simhost"


class SimHostMissing(Exception):
    """A simulated root was asked for where the bcd-simhost distribution is not installed."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(
            f"--root {root}: a simulated host needs the development distribution bcd-simhost "
            "(devhost/ in the repository; make venv installs it), which is not installed here;"
            " on a real host use --root /"
        )


def simhost_module(root: str | Path, name: str = "") -> ModuleType:
    """`bcd_simhost` (or `bcd_simhost.NAME`); SimHostMissing when the distribution is absent."""
    full = f"{SIMHOST}.{name}" if name else SIMHOST
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (exc.name == SIMHOST or exc.name.startswith(SIMHOST + ".")):
            raise SimHostMissing(root) from None
        raise


def sim_system(root: Path) -> LocalSystem:
    """The simulated host's System for ROOT (a LocalSystem with its fake tools); SimHostMissing if absent."""
    return cast(LocalSystem, simhost_module(root).sim_system(root))
