"""Helpers for the journal tests: a settable clock, command builders, and a crash simulator."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bcd_agent.journal import CommandFlags, Journal, NewCommand

RETRY_SAFE = CommandFlags(retry_safe=True)
NOT_RETRY_SAFE = CommandFlags()
REBOOT = CommandFlags(retry_safe=True, self_terminating=True)  # node.reboot
KEXEC = CommandFlags(self_terminating=True)  # boot.kexec


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def cmd(cid: str, flags: CommandFlags = RETRY_SAFE, kind: str = "inventory.refresh") -> NewCommand:
    return NewCommand(
        id=cid, kind=kind, flags=flags, body=b"body:" + cid.encode(), signature=b"sig:" + cid.encode()
    )


def crash_copy(journal: Journal, target: Path) -> Path:
    """What a SIGKILL leaves on disk: the db and its WAL as the OS holds them right now (every commit has
    been written and fsynced). The copy goes to `target` (a new 0700 data_dir); then the live journal is
    dropped without a clean shutdown of the copy."""
    os.mkdir(target, 0o700)
    src = journal.path
    for suffix in ("", "-wal"):
        p = Path(str(src) + suffix)
        if p.exists():
            shutil.copyfile(p, target / (src.name + suffix))
    journal.close()
    return target
