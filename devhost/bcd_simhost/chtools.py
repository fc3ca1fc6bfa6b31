"""Fakes for the cloud-hypervisor runtime's root-side programs on the simulated host.

- `systemd-run --unit=U --collect --slice=S --quiet --property=K=V … -- ARGV`: records the transient
  unit in the fake systemctl's units.json (active, its properties, `Slice`, `ExecStart`), so that
  `systemctl list-units`, `show -p User --value` and `stop` see it (systemctl.py). A unit already
  active is refused as systemd refuses it ("Unit U was already loaded or has a fragment file.").
  Each `BindPaths=` / `BindReadOnlyPaths=` value (`SRC:DEST` or one path) is resolved as systemd
  resolves the source, as root following every symlink, when the fake runs: the unit's `binds` lists
  `[key, src, dest, st_dev, st_ino]` (None, None where nothing is there), for the race tests
  (docs/helper.md, "Threat model, round 11").
  When the command is a `cloud-hypervisor --api-socket path=P`, the simulated VMM
  (bcd_simhost.chapi.FakeCHServer) serves P from the calling process (the helper's, under `bcd helper`)
  until `systemctl stop` of the unit or `vmm.shutdown`.
- `useradd`/`groupadd`/`userdel`/`groupdel` with the options bcd_shared.chunit gives them: edit the
  simulated root's /etc/passwd and /etc/group (exit 9 "already exists", 6 "does not exist").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem

from . import systemctl as sc


def _res(argv: Sequence[str], code: int = 0, err: str = "") -> CommandResult:
    return CommandResult(tuple(argv), code, b"", err.encode())


def systemd_run(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    if "--" not in args:
        return _res(argv, 1, "systemd-run: no command given (simulated host)\n")
    opts, command = args[: args.index("--")], args[args.index("--") + 1 :]
    unit = next((o.split("=", 1)[1] for o in opts if o.startswith("--unit=")), "")
    if not unit.endswith(".service") or not command:
        return _res(argv, 1, "systemd-run: needs --unit=NAME.service and a command (simulated host)\n")
    props: dict[str, str] = {}
    binds: list[list[Any]] = []
    for o in opts:
        key, _, value = o.removeprefix("--property=").partition("=")
        if o.startswith("--property=") and key in ("BindPaths", "BindReadOnlyPaths"):
            src, _, dest = value.partition(":")
            try:
                st = os.stat(system.host_path(src))  # follows links, as systemd does
                binds.append([key, src, dest or src, st.st_dev, st.st_ino])
            except OSError:
                binds.append([key, src, dest or src, None, None])
    for o in opts:
        if o.startswith("--property="):
            key, _, value = o[len("--property=") :].partition("=")
            props[key] = f"{props[key]} {value}" if key in props and key.startswith("Device") else value
        elif o.startswith("--slice="):
            props["Slice"] = o.split("=", 1)[1]
    props["ExecStart"] = " ".join(command)
    units = sc._load(system)
    if units.get(unit, {}).get("active"):
        return _res(
            argv,
            1,
            f"Failed to start transient service unit: Unit {unit} was already loaded"
            " or has a fragment file.\n",
        )
    units[unit] = {"active": True, "enabled": False, "properties": props, "transient": True, "binds": binds}
    sc._save(system, units)
    if command[0].endswith("/cloud-hypervisor") and "--api-socket" in command:
        spec = (
            command[command.index("--api-socket") + 1]
            if command.index("--api-socket") + 1 < len(command)
            else ""
        )
        if spec.startswith("path="):
            _start_vmm(system, unit, spec[len("path=") :])
    sc._log(system, argv)
    return _res(argv)


def _edit(system: LocalSystem, path: str, name: str, line: str | None) -> bool:
    text = system.read_text(path) or ""
    lines = [ln for ln in text.splitlines() if ln]
    present = any(ln.split(":", 1)[0] == name for ln in lines)
    if line is not None:
        if present:
            return False
        lines.append(line)
    else:
        if not present:
            return False
        lines = [ln for ln in lines if ln.split(":", 1)[0] != name]
    system.write_atomic(path, ("\n".join(lines) + "\n").encode(), 0o644)
    return True


def _opt(args: list[str], key: str) -> str:
    return args[args.index(key) + 1] if key in args and args.index(key) + 1 < len(args) else ""


def groupadd(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    name = args[-1]
    if not _edit(system, "/etc/group", name, f"{name}:x:{_opt(args, '--gid')}:"):
        return _res(argv, 9, f"groupadd: group '{name}' already exists\n")
    return _res(argv)


def useradd(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    name = args[-1]
    fields = [_opt(args, k) for k in ("--uid", "--gid", "--comment", "--home-dir", "--shell")]
    entry = ":".join([name, "x", *fields])
    if not _edit(system, "/etc/passwd", name, entry):
        return _res(argv, 9, f"useradd: user '{name}' already exists\n")
    return _res(argv)


def userdel(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    name = argv[-1]
    if not _edit(system, "/etc/passwd", name, None):
        return _res(argv, 6, f"userdel: user '{name}' does not exist\n")
    return _res(argv)


def groupdel(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    name = argv[-1]
    if not _edit(system, "/etc/group", name, None):
        return _res(argv, 6, f"groupdel: group '{name}' does not exist\n")
    return _res(argv)


# The simulated VMMs this process serves, by (simulated root, unit): a VMM is a process of its own on a
# real host; here it is a thread of whichever process ran systemd-run, so it is found again by key.
_VMMS: dict[tuple[str, str], Any] = {}


def _start_vmm(system: LocalSystem, unit: str, socket_path: str) -> None:
    from .chapi import FakeCHServer

    key = (str(system.root), unit)
    old = _VMMS.pop(key, None)
    if old is not None:
        old.close()
    real = system.host_path(socket_path)
    with contextlib.suppress(FileNotFoundError):
        real.unlink()
    _VMMS[key] = FakeCHServer(real, mode=0o770, root=system.root)  # the unit's UMask=0007


def stop_vmm(system: LocalSystem, unit: str) -> None:
    """`systemctl stop` of a transient VMM unit (systemctl.py): its simulated VMM goes."""
    srv = _VMMS.pop((str(system.root), unit), None)
    if srv is not None:
        srv.close()
