"""A `System` over the simulated host with the host-config fakes, for the host tests and bench.

`sim_system(root)` gives the shared TOOLS; when no `nvidia-smi` fake is registered there (the
devices fake is separate), the host-settings one from nvidia_host stands in, and when one is, the
host subcommands are still answered by nvidia_host first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bcd_shared.system import CommandResult, FakeTool, LocalSystem

from . import TOOLS, _LazyTool
from .nvidia_host import handle


def host_sim_system(root: Path) -> LocalSystem:
    tools: dict[str, FakeTool] = {name: _LazyTool(spec) for name, spec in TOOLS.items()}
    other = tools.get("nvidia-smi")

    def nvidia_smi(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
        res = handle(system, argv, stdin)
        if res is not None:
            return res
        if other is not None:
            return other(system, argv, stdin)
        return CommandResult(tuple(argv), 2, b"", b"nvidia-smi: not simulated here\n")

    tools["nvidia-smi"] = nvidia_smi
    return LocalSystem(root=Path(root), tools=tools)
