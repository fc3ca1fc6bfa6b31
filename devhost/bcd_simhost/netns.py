"""`nft` and `ip` on the simulated host: the real programs, but only inside a private network namespace.

The simulated host never runs the machine's programs, and nftables rules or links changed on the real
machine would outlive the test. A test that wants the instances' real nftables rules behind a simulated
host (a real helper process over a simulated root) starts that process under `unshare -n` with
BCD_SIM_NETNS=1, and these fakes run the real `nft` and `ip` there, where everything vanishes with the
namespace. Without the variable they answer as a host without the program (exit 127): the simulated
host has no nftables, and bcd on it loads no rules (docs/instances.md).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from bcd_shared.system import CommandResult, LocalSystem

ENV = "BCD_SIM_NETNS"


def _real(argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = tuple(argv)
    if os.environ.get(ENV) != "1":
        return CommandResult(
            args, 127, b"", f"{args[0]}: not on the simulated host (no network namespace)".encode()
        )
    proc = subprocess.run(args, input=stdin, capture_output=True, timeout=120, check=False)
    return CommandResult(args, proc.returncode, proc.stdout, proc.stderr)


def nft(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    return _real(["nft", *argv[1:]], stdin)


def ip(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    return _real(["ip", *argv[1:]], stdin)
