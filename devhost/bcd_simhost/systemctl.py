"""A fake `systemctl` for the simulated host: units, slices and their cgroups kept in files.

The machines bcd is developed on have no systemd as PID 1, so `systemctl` is simulated here, after
systemctl(1) of systemd 252 (Debian 12): verbs, exit statuses (0 ok, 3 `is-active` not active,
5 unit not found, 1 other failures) and output shapes (`is-active` prints one state word,
`show -p K --value` prints the value, `list-units --plain --no-legend` prints
`UNIT LOAD ACTIVE SUB DESCRIPTION` lines).

State lives where a person can look at it:
- `/var/lib/bcd-sim/systemd/units.json`: per unit `active`, `enabled` and runtime `properties`;
- `/var/lib/bcd-sim/systemd/log`: one line per state-changing call (argv joined by spaces);
- a started slice `bcd-alloc-X.slice` gets its cgroup directory
  `/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-X.slice/` with `cgroup.events`
  (`populated 0` / `frozen 0`) and `cgroup.procs`; a test marks a workload by writing
  `populated 1`. Stopping a slice removes the directory (systemd kills what was inside; bcd itself
  only stops empty slices);
- `systemctl reboot` writes `/var/lib/bcd-sim/reboot-requested`;
- starting a service runs its `ExecStartPre=` lines that call `nvidia-smi` (the simulated one) and
  stopping it its `ExecStopPost=` ones, so `bcd-mps.service` sets the GPUs' compute mode to
  EXCLUSIVE_PROCESS and back to DEFAULT; a service whose `ExecStart` is `nvidia-cuda-mps-control`
  makes its `CUDA_MPS_PIPE_DIRECTORY` while it runs (the devices section gives slot holds
  `CUDA_MPS_PIPE_DIRECTORY` when that directory exists). Other commands are not run.

A service unit must have a unit file under /etc/systemd/system or /lib/systemd/system (else exit 5,
"Unit X not found."); slices and scopes are accepted without one, as systemd synthesises them.
"""

from __future__ import annotations

import fcntl
import json
import re
from collections.abc import Sequence
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem

from .slices import slice_call

STATE = "/var/lib/bcd-sim/systemd/units.json"
LOG = "/var/lib/bcd-sim/systemd/log"
REBOOT_MARK = "/var/lib/bcd-sim/reboot-requested"
CGROUP_ROOT = "/sys/fs/cgroup"
UNIT_DIRS = ("/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system", "/run/systemd/system")

_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.\\@-]{1,255}\.(service|slice|scope|socket|timer|mount|target|path)$")


_CHANGE_VERBS = (
    "start",
    "stop",
    "restart",
    "reload",
    "enable",
    "disable",
    "try-restart",
    "reload-or-restart",
)


def _new() -> dict[str, Any]:
    return {"active": False, "enabled": False, "properties": {}}


def _load(system: LocalSystem) -> dict[str, dict[str, Any]]:
    text = system.read_text(STATE)
    if not text:
        return {}
    data: dict[str, dict[str, Any]] = json.loads(text)
    return data


def _save(system: LocalSystem, units: dict[str, dict[str, Any]]) -> None:
    system.write_atomic(STATE, (json.dumps(units, sort_keys=True, indent=1) + "\n").encode())


def _log(system: LocalSystem, argv: Sequence[str]) -> None:
    old = system.read_bytes(LOG) or b""
    system.write_atomic(LOG, old + (" ".join(argv[1:]) + "\n").encode())


def slice_cgroup_path(name: str) -> str:
    """The cgroup directory systemd gives slice `name` (`a-b-c.slice` nests under `a.slice/a-b.slice`)."""
    stem = name[: -len(".slice")]
    parts = stem.split("-")
    dirs = ["-".join(parts[: i + 1]) + ".slice" for i in range(len(parts))]
    return CGROUP_ROOT + "/" + "/".join(dirs)


def _has_file(system: LocalSystem, unit: str) -> bool:
    return any(system.exists(f"{d}/{unit}") for d in UNIT_DIRS)


def _ok(argv: Sequence[str], out: str = "") -> CommandResult:
    return CommandResult(tuple(argv), 0, out.encode(), b"")


def _fail(argv: Sequence[str], code: int, err: str) -> CommandResult:
    return CommandResult(tuple(argv), code, b"", (err + "\n").encode())


def _unit_lines(system: LocalSystem, unit: str, key: str) -> list[str]:
    """The values of `key=` lines of the unit's file (the first unit directory that has it)."""
    for d in UNIT_DIRS:
        text = system.read_text(f"{d}/{unit}")
        if text is not None:
            return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]
    return []


def _exec_simulated(system: LocalSystem, unit: str, key: str) -> None:
    """Run the unit's `key` commands that are simulated programs (nvidia-smi: the GPUs' compute mode
    for MPS); shell lines and daemons are not run. A failing `ExecStartPre` would fail the start on a
    real host; the fakes it reaches (nvidia-smi -c) do not fail on a seeded host."""
    for line in _unit_lines(system, unit, key):
        argv = line.lstrip("-@+!").split()
        if argv and argv[0].rsplit("/", 1)[-1] == "nvidia-smi":
            system.run(["nvidia-smi", *argv[1:]])


def _mps_pipe_dir(system: LocalSystem, unit: str) -> str | None:
    """The pipe directory of an MPS control daemon unit (`CUDA_MPS_PIPE_DIRECTORY`), else None."""
    if not any("nvidia-cuda-mps-control" in line for line in _unit_lines(system, unit, "ExecStart")):
        return None
    for env in _unit_lines(system, unit, "Environment"):
        name, _, value = env.partition("=")
        if name == "CUDA_MPS_PIPE_DIRECTORY" and value.startswith("/"):
            return value
    return "/tmp/nvidia-mps"  # noqa: S108 (the daemon's default, simulated)


def _start(system: LocalSystem, units: dict[str, dict[str, Any]], unit: str) -> None:
    rec = units.setdefault(unit, _new())
    if unit.endswith(".service") and not rec["active"]:
        _exec_simulated(system, unit, "ExecStartPre")
        pipe = _mps_pipe_dir(system, unit)
        if pipe is not None:  # the MPS control daemon makes its pipe directory
            system.host_path(pipe).mkdir(parents=True, exist_ok=True)
    rec["active"] = True
    if unit.endswith(".slice"):
        cg = slice_cgroup_path(unit)
        if not system.exists(f"{cg}/cgroup.events"):
            system.write_atomic(f"{cg}/cgroup.events", b"populated 0\nfrozen 0\n")
            system.write_atomic(f"{cg}/cgroup.procs", b"")


def _stop(system: LocalSystem, units: dict[str, dict[str, Any]], unit: str) -> None:
    rec = units.get(unit)
    if unit.endswith(".service") and rec is not None and rec["active"]:
        pipe = _mps_pipe_dir(system, unit)
        if pipe is not None:
            real = system.host_path(pipe)
            for child in real.iterdir() if real.is_dir() else ():
                child.unlink()
            if real.is_dir():
                real.rmdir()
        _exec_simulated(system, unit, "ExecStopPost")
    if rec is not None and rec.get("transient"):
        from .chtools import stop_vmm

        stop_vmm(system, unit)
    if rec is not None:
        rec["active"] = False
        rec["properties"] = {}
    if unit.endswith(".slice"):
        cg = slice_cgroup_path(unit)
        for name in system.listdir(cg):
            system.remove(f"{cg}/{name}")
        real = system.host_path(cg)
        if real.is_dir():
            real.rmdir()


LOCK = "/var/lib/bcd-sim/systemd.lock"


def systemctl(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    """One systemctl call. Calls that change state are serialised with an flock on
    /var/lib/bcd-sim/systemd.lock, as systemd serialises the jobs it is asked for: the devices
    section applies slices from a thread pool, and under `bcd sim` the node and the helper are two
    processes. Queries take no lock (state files are replaced atomically) and write nothing."""
    verbs = [a for a in argv[1:] if not a.startswith("-")]
    if not verbs or verbs[0] not in (*_CHANGE_VERBS, "set-property", "daemon-reload", "reboot"):
        return _systemctl(system, argv)
    lock = system.host_path(LOCK)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        f = open(lock, "a")  # noqa: SIM115 (closed below)
    except PermissionError:
        try:  # an unprivileged reader of a root-owned simulated host: flock works on a read-only fd
            f = open(lock)  # noqa: SIM115
        except OSError:
            return _systemctl(system, argv)
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            return _systemctl(system, argv)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _systemctl(system: LocalSystem, argv: Sequence[str]) -> CommandResult:
    handled = slice_call(system, argv)  # hold slices and reboot: slices.py
    if handled is not None:
        return handled
    args = [
        a for a in argv[1:] if a not in ("--no-block", "--quiet", "-q", "--no-pager", "--no-ask-password")
    ]
    runtime = "--runtime" in args
    args = [a for a in args if a != "--runtime"]
    if not args:
        return _fail(argv, 1, "systemctl: no verb given (simulated host)")
    verb, rest = args[0], args[1:]
    units = _load(system)

    if verb in ("daemon-reload", "reboot"):
        if verb == "reboot":
            system.write_atomic(REBOOT_MARK, b"reboot requested\n")
        _log(system, argv)
        return _ok(argv)

    if verb == "list-units":
        pattern = next((a for a in rest if not a.startswith("-")), "*")
        rx = re.compile("^" + re.escape(pattern).replace(r"\*", ".*") + "$")
        lines = [
            f"{u} loaded {'active' if r['active'] else 'inactive'} {'active' if r['active'] else 'dead'} {u}"
            for u, r in sorted(units.items())
            if rx.match(u) and (r["active"] or "--all" in rest)
        ]
        return _ok(argv, "".join(line + "\n" for line in lines))

    if verb == "show":
        names = [a for a in rest if not a.startswith("-") and a not in ("-p",)]
        props: list[str] = []
        if "-p" in rest:
            i = rest.index("-p")
            props = rest[i + 1].split(",") if i + 1 < len(rest) else []
            names = [n for n in names if n != rest[i + 1]]
        if not names:
            return _fail(argv, 1, "systemctl show: no unit named (simulated host)")
        shown = units.get(names[0], _new())
        values = dict(shown["properties"])
        values["ActiveState"] = "active" if shown["active"] else "inactive"
        values["UnitFileState"] = "enabled" if shown["enabled"] else "disabled"
        keys = props or sorted(values)
        if "--value" in rest:
            return _ok(argv, "".join(f"{values.get(k, '')}\n" for k in keys))
        return _ok(argv, "".join(f"{k}={values.get(k, '')}\n" for k in keys))

    targets = [a for a in rest if not a.startswith("-")]
    if verb in ("is-active", "is-enabled"):
        if not targets:
            return _fail(argv, 1, f"systemctl {verb}: no unit named")
        found = units.get(targets[0])
        if verb == "is-active":
            state = "active" if found and found["active"] else "inactive"
            return CommandResult(tuple(argv), 0 if state == "active" else 3, f"{state}\n".encode(), b"")
        state = "enabled" if found and found["enabled"] else "disabled"
        return CommandResult(tuple(argv), 0 if state == "enabled" else 1, f"{state}\n".encode(), b"")

    if verb == "set-property":
        if len(targets) < 2:
            return _fail(argv, 1, "systemctl set-property: needs a unit and at least one property")
        unit, assignments = targets[0], targets[1:]
        target = units.get(unit)
        if target is None or not target["active"]:
            return _fail(argv, 5, f"Failed to set unit properties on {unit}: Unit {unit} is not loaded.")
        for a in assignments:
            key, sep, value = a.partition("=")
            if not sep or not key:
                return _fail(argv, 1, f"Failed to parse property assignment: {a}")
            target["properties"][key] = value
        target["runtime"] = runtime or target.get("runtime", False)
        _save(system, units)
        _log(system, argv)
        return _ok(argv)

    if verb in _CHANGE_VERBS:
        now = "--now" in rest
        for unit in targets:
            if not _UNIT_RE.match(unit):
                return _fail(argv, 1, f"Invalid unit name {unit!r}")
            needs_file = unit.endswith((".service", ".socket", ".timer", ".mount", ".target", ".path"))
            if needs_file and verb not in ("stop", "disable") and not _has_file(system, unit):
                return _fail(argv, 5, f"Failed to {verb} {unit}: Unit {unit} not found.")
            if verb in ("start", "restart", "try-restart", "reload-or-restart"):
                if verb == "try-restart" and not units.get(unit, {}).get("active"):
                    continue
                if verb != "start" and units.get(unit, {}).get("active") and unit.endswith(".service"):
                    _stop(system, units, unit)  # a restart stops, then starts
                _start(system, units, unit)
            elif verb == "reload":
                if not units.get(unit, {}).get("active"):
                    return _fail(argv, 1, f"Failed to reload {unit}: Unit {unit} is not active.")
            elif verb == "stop":
                _stop(system, units, unit)
            elif verb == "enable":
                units.setdefault(unit, {"active": False, "enabled": False, "properties": {}})["enabled"] = (
                    True
                )
                if now:
                    _start(system, units, unit)
            elif verb == "disable":
                if unit in units:
                    units[unit]["enabled"] = False
                if now:
                    _stop(system, units, unit)
        _save(system, units)
        _log(system, argv)
        return _ok(argv)

    return _fail(argv, 1, f"Unknown command verb {verb} (simulated host)")
