"""The simulated host's hold slices and reboots: the part of the fake `systemctl` the helper needs.

systemctl.py (the host units' fake) hands every call here first; `slice_call` answers the calls that
concern slices (`start`/`stop`/`set-property`/`is-active`/`show` of a `*.slice`, `list-units` of slices)
and `reboot`, and returns None for everything else. After systemctl(1) of systemd 252: a slice needs
no unit file (systemd synthesises slices), `set-property` on a unit that is not loaded exits 5, and
`list-units --plain --no-legend` prints `UNIT LOAD ACTIVE SUB DESCRIPTION` lines.

State a person can look at:
- `/var/lib/bcd-sim/slices.json`: per slice `active` and its runtime `properties`;
- `/var/lib/bcd-sim/systemd/log`: every state-changing call (argv after `systemctl`, joined by
  spaces), the same log the rest of the fake systemctl writes;
- a started slice `a-b-c.slice` gets its cgroup directory `/sys/fs/cgroup/a.slice/a-b.slice/a-b-c.slice/`
  with `cgroup.events` (`populated 0` / `frozen 0`), `cgroup.procs`, `hugetlb.{2MB,1GB}.max` (`max`)
  and the attribute files systemd's properties become, with the kernel's defaults: `cpuset.cpus`
  and `cpuset.mems` (empty: not restricted), `cpu.max` (`max 100000`), `memory.max` and
  `memory.high` (`max`); its ancestors get `cgroup.subtree_control`. A test marks a workload in it
  by writing `populated 1`;
- `set-property` writes those files as systemd does: `AllowedCPUs` -> cpuset.cpus,
  `AllowedMemoryNodes` -> cpuset.mems, `CPUQuota=N%` -> cpu.max `N*1000 100000` (the default
  100 ms period), `MemoryMax` / `MemoryHigh` -> memory.max / memory.high in bytes rounded down to
  the 4 KiB page as the kernel stores them; an empty value (`AllowedCPUs=`, `CPUQuota=`) or
  `infinity` resets to the default;
- stopping a slice removes its directory; systemd kills what was inside, so stopping a populated
  slice appends its name to `/var/lib/bcd-sim/killed-workloads` (bcd must only stop empty slices);
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
LOG = "/var/lib/bcd-sim/systemd/log"
KILLED = "/var/lib/bcd-sim/killed-workloads"
PAGE = 4096
# cgroup attribute files of a new slice, with the kernel's defaults.
DEFAULT_FILES = {
    "cpuset.cpus": "\n",
    "cpuset.mems": "\n",
    "cpu.max": "max 100000\n",
    "memory.max": "max\n",
    "memory.high": "max\n",
}
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


def log_call(system: LocalSystem, argv: Sequence[str]) -> None:
    old = system.read_bytes(LOG) or b""
    system.write_atomic(LOG, old + (" ".join(argv[1:]) + "\n").encode())


def _memory(value: str) -> str | None:
    """A MemoryMax/MemoryHigh value as memory.max shows it; None when systemd would refuse it."""
    if value in ("", "infinity"):
        return "max"
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    m = re.fullmatch(r"([0-9]+)([KMGT]?)", value)
    if m is None:
        return None
    return str(int(m.group(1)) * units.get(m.group(2), 1) // PAGE * PAGE)


def _kernel_cpulist(value: str) -> str:
    """A cpulist as the kernel prints it back: sorted, merged ranges (`3,0-2` -> `0-3`)."""
    spans = sorted((int(lo), int(hi or lo)) for lo, hi in re.findall(r"([0-9]+)(?:-([0-9]+))?", value))
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in merged)


def _attribute(key: str, value: str) -> tuple[str, str] | str | None:
    """(cgroup file, content) a property becomes; None when it has no file here; an error text."""
    if key in ("AllowedCPUs", "AllowedMemoryNodes"):
        if value and not re.fullmatch(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*", value):
            return f"Failed to parse {key}= value: {value}"
        return ("cpuset.cpus" if key == "AllowedCPUs" else "cpuset.mems", _kernel_cpulist(value))
    if key == "CPUQuota":
        if not value:
            return ("cpu.max", "max 100000")
        m = re.fullmatch(r"([0-9]+)%", value)
        if m is None or int(m.group(1)) == 0:
            return f"CPU quota '{value}' invalid."
        return ("cpu.max", f"{int(m.group(1)) * 1000} 100000")
    if key in ("MemoryMax", "MemoryHigh"):
        shown = _memory(value)
        if shown is None:
            return f"Failed to parse {key}= value: {value}"
        return ("memory.max" if key == "MemoryMax" else "memory.high", shown)
    return None


def _start(system: LocalSystem, state: dict[str, Any], unit: str) -> None:
    rec = state.setdefault(unit, {"active": False, "properties": {}})
    rec["active"] = True
    cg = slice_cgroup_path(unit)
    if not system.exists(f"{cg}/cgroup.events"):
        system.write_atomic(f"{cg}/cgroup.events", b"populated 0\nfrozen 0\n")
        system.write_atomic(f"{cg}/cgroup.procs", b"")
        for size in ("2MB", "1GB"):
            system.write_atomic(f"{cg}/hugetlb.{size}.max", b"max\n")
        for name, text in DEFAULT_FILES.items():
            system.write_atomic(f"{cg}/{name}", text.encode())
    parent = cg
    while parent != CGROUP_ROOT:
        parent = parent.rsplit("/", 1)[0]
        if not system.exists(f"{parent}/cgroup.subtree_control"):
            system.write_atomic(f"{parent}/cgroup.subtree_control", b"")


def _stop(system: LocalSystem, state: dict[str, Any], unit: str) -> None:
    if unit in state:
        state[unit] = {"active": False, "properties": {}}
    cg = slice_cgroup_path(unit)
    events = system.read_text(f"{cg}/cgroup.events") or ""
    if any(line.split() == ["populated", "1"] for line in events.splitlines()):
        old = system.read_bytes(KILLED) or b""
        system.write_atomic(KILLED, old + f"{unit}\n".encode())
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
        files: list[tuple[str, str]] = []
        for a in targets[1:]:
            key, sep, value = a.partition("=")
            if not sep or not key:
                return fail(argv, f"Failed to parse property assignment: {a}\n")
            attr = _attribute(key, value)
            if isinstance(attr, str):
                return fail(argv, attr + "\n")
            if attr is not None:
                files.append(attr)
            rec["properties"][key] = value
        cg = slice_cgroup_path(unit)
        for name, text in files:
            system.write_atomic(f"{cg}/{name}", (text + "\n").encode())
    elif verb == "is-active":
        active = bool(state.get(unit, {}).get("active"))
        return ok(argv, "active\n" if active else "inactive\n", 0 if active else 3)
    elif verb == "show":
        rec = state.get(unit, {"active": False, "properties": {}})
        values = dict(rec["properties"], ActiveState="active" if rec["active"] else "inactive")
        keys = sorted(values)
        if "-p" in rest and rest.index("-p") + 1 < len(rest):
            keys = rest[rest.index("-p") + 1].split(",")
        if "--value" in rest:
            return ok(argv, "".join(f"{values.get(k, '')}\n" for k in keys))
        return ok(argv, "".join(f"{k}={values.get(k, '')}\n" for k in keys))
    else:
        return None
    save(system, STATE, state)
    log_call(system, argv)
    return ok(argv)
