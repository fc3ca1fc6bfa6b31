"""The simulated host's hold slices and reboots: the part of the fake `systemctl` the helper needs.

systemctl.py (the host units' fake) hands every call here first; `slice_call` answers the calls that
concern slices (`start`/`stop`/`set-property`/`is-active`/`show` of a `*.slice`, `list-units` of slices)
and `reboot`, and returns None for everything else. After systemctl(1) of systemd 252: a slice needs
no unit file (systemd synthesises slices), `set-property` on a unit that is not loaded exits 5, and
`list-units --plain --no-legend` prints `UNIT LOAD ACTIVE SUB DESCRIPTION` lines.

State a person can look at:
- `/var/lib/bcd-sim/slices.json`: per slice `active` and its runtime `properties`;
- a started slice `a-b-c.slice` gets its cgroup directory `/sys/fs/cgroup/a.slice/a-b.slice/a-b-c.slice/`
  with `cgroup.events` (`populated 0` / `frozen 0`), `cgroup.procs` and `hugetlb.{2MB,1GB}.max`
  (`max`), and its ancestors get `cgroup.subtree_control`, as the kernel shows them. A test marks a
  workload in it by writing `populated 1`. Stopping removes the directory (systemd kills what was
  inside; bcd itself stops only empty slices);
- `systemctl reboot` writes `/var/lib/bcd-sim/reboot-requested`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem

CGROUP_ROOT = "/sys/fs/cgroup"
REBOOT_MARK = "/var/lib/bcd-sim/reboot-requested"
STATE = "/var/lib/bcd-sim/slices.json"
_SLICE_RE = re.compile(r"^[A-Za-z0-9:_.\\-]{1,255}\.slice$")


def load(system: LocalSystem, path: str, default: dict[str, Any]) -> dict[str, Any]:
    data = system.read_bytes(path)
    return default if data is None else dict(json.loads(data))


def save(system: LocalSystem, path: str, value: dict[str, Any]) -> None:
    system.write_atomic(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def ok(argv: Sequence[str], out: str = "", rc: int = 0) -> CommandResult:
    return CommandResult(tuple(argv), rc, out.encode(), b"")


def fail(argv: Sequence[str], err: str, rc: int = 1) -> CommandResult:
    return CommandResult(tuple(argv), rc, b"", err.encode())


def slice_cgroup_path(name: str) -> str:
    """The cgroup directory systemd gives slice `name` (`a-b-c.slice` nests under `a.slice/a-b.slice`)."""
    parts = name[: -len(".slice")].split("-")
    return CGROUP_ROOT + "/" + "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def _start(system: LocalSystem, state: dict[str, Any], unit: str) -> None:
    rec = state.setdefault(unit, {"active": False, "properties": {}})
    rec["active"] = True
    cg = slice_cgroup_path(unit)
    if not system.exists(f"{cg}/cgroup.events"):
        system.write_atomic(f"{cg}/cgroup.events", b"populated 0\nfrozen 0\n")
        system.write_atomic(f"{cg}/cgroup.procs", b"")
        for size in ("2MB", "1GB"):
            system.write_atomic(f"{cg}/hugetlb.{size}.max", b"max\n")
    parent = cg
    while parent != CGROUP_ROOT:
        parent = parent.rsplit("/", 1)[0]
        if not system.exists(f"{parent}/cgroup.subtree_control"):
            system.write_atomic(f"{parent}/cgroup.subtree_control", b"")


def _stop(system: LocalSystem, state: dict[str, Any], unit: str) -> None:
    if unit in state:
        state[unit] = {"active": False, "properties": {}}
    cg = slice_cgroup_path(unit)
    for name in system.listdir(cg):
        real = system.host_path(f"{cg}/{name}")
        if real.is_file():
            real.unlink()
    real_dir = system.host_path(cg)
    if real_dir.is_dir() and not any(real_dir.iterdir()):
        real_dir.rmdir()


def slice_call(system: LocalSystem, argv: Sequence[str]) -> CommandResult | None:
    """Answer a systemctl call about slices or a reboot; None when the call is not one."""
    args = [a for a in argv[1:] if a not in ("--quiet", "-q", "--no-block", "--runtime", "--no-pager")]
    if not args:
        return None
    verb, rest = args[0], args[1:]
    targets = [a for a in rest if not a.startswith("-")]
    if verb == "reboot":
        system.write_atomic(REBOOT_MARK, b"reboot requested\n")
        return ok(argv)
    if verb == "list-units" and any(t.endswith(".slice") for t in targets):
        state = load(system, STATE, {})
        rx = re.compile("^" + re.escape(targets[0]).replace(r"\*", ".*") + "$")
        lines = [
            f"{u} loaded active active {u}\n" for u, r in sorted(state.items()) if r["active"] and rx.match(u)
        ]
        return ok(argv, "".join(lines))
    if not targets or not targets[0].endswith(".slice"):
        return None
    state = load(system, STATE, {})
    unit = targets[0]
    if not _SLICE_RE.match(unit):
        return fail(argv, f"Invalid unit name {unit!r}\n")
    if verb in ("start", "restart"):
        for u in targets:
            _start(system, state, u)
    elif verb == "stop":
        for u in targets:
            _stop(system, state, u)
    elif verb == "set-property":
        rec = state.get(unit)
        if rec is None or not rec["active"]:
            return fail(argv, f"Failed to set unit properties on {unit}: Unit {unit} is not loaded.\n", 5)
        for a in targets[1:]:
            key, sep, value = a.partition("=")
            if not sep or not key:
                return fail(argv, f"Failed to parse property assignment: {a}\n")
            rec["properties"][key] = value
    elif verb == "is-active":
        active = bool(state.get(unit, {}).get("active"))
        return ok(argv, "active\n" if active else "inactive\n", 0 if active else 3)
    elif verb == "show":
        rec = state.get(unit, {"active": False, "properties": {}})
        values = dict(rec["properties"], ActiveState="active" if rec["active"] else "inactive")
        return ok(argv, "".join(f"{k}={v}\n" for k, v in sorted(values.items())))
    else:
        return None
    save(system, STATE, state)
    return ok(argv)
