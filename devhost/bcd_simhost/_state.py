"""Small helpers the host-config fakes share: JSON state under <root>/var/lib/bcd-sim/, results."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem, atomic_write

SIM = "/var/lib/bcd-sim"


def load(system: LocalSystem, name: str, default: Any) -> Any:
    data = system.read_bytes(f"{SIM}/{name}")
    return default if data is None else json.loads(data)


def save(system: LocalSystem, name: str, value: Any) -> None:
    system.write_atomic(f"{SIM}/{name}", (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def put(system: LocalSystem, path: str, text: str, mode: int = 0o644) -> None:
    atomic_write(system.host_path(path), text.encode(), mode)


def installed(system: LocalSystem, binary: str) -> bool:
    return any(
        system.exists(f"{d}/{binary}") for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin")
    )


def ok(argv: Sequence[str], out: str = "", rc: int = 0, err: str = "") -> CommandResult:
    return CommandResult(tuple(argv), rc, out.encode(), err.encode())


def fail(argv: Sequence[str], err: str, rc: int = 1) -> CommandResult:
    return CommandResult(tuple(argv), rc, b"", err.encode())


def not_found(argv: Sequence[str]) -> CommandResult:
    return CommandResult(tuple(argv), 127, b"", f"{argv[0]}: command not found".encode())


def host_file(system: LocalSystem, real: str) -> Path:
    return Path(real)
