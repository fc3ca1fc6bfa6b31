"""A fake `nvidia-smi` for the simulated host, printing nvidia-smi's real formats from gpus.json.

Formats follow the real captures in ../shared/reference/nvidia-smi (driver 580/590 era):
- `-L`: `GPU <i>: <name> (UUID: GPU-…)` and `  MIG <profile padded to 12>Device <n:2>: (UUID: MIG-…)`;
- `--query-gpu=F,… --format=csv[,noheader][,nounits]`: `", "` separated, header with units
  (`memory.total [MiB]`), values with units (`143771 MiB`), `[N/A]` when unavailable (remapped rows
  under MIG); an unknown field prints `Field "<f>" is not a valid field to query.` and exits 2;
- `--query-compute-apps=…`: one row per process, only the header when there is none;
- `-q -x`: the v13 DTD elements bcd reads, in the real order and nesting (tabs, `N/A`, `None` in
  `<mig_devices>` without MIG, `<remapped_rows>N/A</remapped_rows>` under MIG); not every element of
  a real log is printed;
- `--gpu-reset -i ID` / `-r -i ID`: `GPU <bus> was successfully reset.`, or the "could not be reset /
  In use by another client" block with exit 255 while processes run, or `Resetting GPU <bus> is not
  supported.` (exit 3); a reset clears volatile ECC counters, applies a pending row remap and makes
  the pending ECC and MIG modes current (MIG off drops the instances), and unlocks the clocks;
- `mig -lgi` / `mig -lci` [-i ID] [-gi N]: the boxed tables of driver 580, or
  `No GPU instances found: Not Found` / `No compute instances found: Not Found` (exit 6).
`-i` takes an index, a UUID or a bus id. Without the driver (`/sys/module/nvidia` absent, or
driver.json of the simulated host saying none is loaded) every command fails as the real one does
(exit 9); the driver and CUDA versions shown are those of the loaded driver.

The host subcommands (`-pl`, `-e`, `-c`, `-pm`, `-mig`, `-lgc`, `-rgc`, `mig -lgip/-cgi/-cci/-dci/
-dgi`) are in nvidia_host.py, wired in through EXTENSIONS below; they change the same gpus.json.

Extending: other areas add subcommands without editing this module's logic by adding a row to
EXTENSIONS: a key (`"-mig"` for `nvidia-smi -i 0 -mig 1`, `"mig -cgi"` for `nvidia-smi mig -cgi …`)
mapped to "module:function" under bcd_simhost, called as `f(system, argv, state) -> CommandResult`
(use gpus.save_state to persist changes). The key is the first recognised option of the command line.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem

from bcd_simhost import gpus as simgpus

# key -> "module:function" under bcd_simhost, see the module docstring. One literal table.
EXTENSIONS: dict[str, str] = {
    "-pl": "nvidia_host:settings",
    "-e": "nvidia_host:settings",
    "-c": "nvidia_host:settings",
    "-pm": "nvidia_host:settings",
    "-mig": "nvidia_host:settings",
    "-lgc": "nvidia_host:settings",
    "-rgc": "nvidia_host:settings",
    "mig -lgip": "nvidia_host:mig_lgip",
    "mig -cgi": "nvidia_host:mig_cgi",
    "mig -cci": "nvidia_host:mig_cci",
    "mig -dci": "nvidia_host:mig_dci",
    "mig -dgi": "nvidia_host:mig_dgi",
}

NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
DRIVER_STATE = "/var/lib/bcd-sim/driver.json"

Handler = Callable[[LocalSystem, Sequence[str], dict[str, Any]], CommandResult]

_IN_USE_TAIL = (
    "{n} device{s} {are} currently being used by one or more other processes (e.g., Fabric Manager, CUDA "
    "application, graphics application such as an X server, or a monitoring application such as another "
    "instance of nvidia-smi). Please first kill all processes using {these} device{s} and all compute "
    "applications running in the system."
)


def _res(argv: Sequence[str], rc: int, out: str = "", err: str = "") -> CommandResult:
    return CommandResult(tuple(argv), rc, out.encode(), err.encode())


def _opt(argv: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def loaded_driver(system: LocalSystem, state: dict[str, Any]) -> dict[str, Any] | None:
    """The loaded driver's version and CUDA version; None when no driver is loaded."""
    if not system.exists("/sys/module/nvidia"):
        return None
    raw = system.read_bytes(DRIVER_STATE)
    if raw is None:
        return {"version": state["driver_version"], "cuda": state["cuda_version"]}
    loaded = json.loads(raw).get("loaded")
    if not loaded:
        return None
    version = str(loaded["version"])
    return {"version": version, "cuda": simgpus.CUDA_BY_BRANCH.get(version[:3], state["cuda_version"])}


def select(state: dict[str, Any], ident: str | None) -> list[dict[str, Any]] | None:
    """The GPUs `-i` names (index, UUID or bus id, comma-separated); None when one matches nothing."""
    return _select(state, ident)


def opt(argv: Sequence[str], name: str) -> str | None:
    return _opt(argv, name)


def _select(state: dict[str, Any], ident: str | None) -> list[dict[str, Any]] | None:
    gpus: list[dict[str, Any]] = state["gpus"]
    if ident is None:
        return gpus
    chosen = []
    for part in ident.split(","):
        match = [
            g
            for g in gpus
            if part in (str(g["index"]), g["uuid"]) or part.upper() in (g["bus_id"], g["bus_id"][4:])
        ]
        if not match:
            return None
        chosen.extend(match)
    return chosen


def _stamp() -> str:
    return _dt.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


# --- -L ------------------------------------------------------------------------------------------


def _list(state: dict[str, Any], gpus: list[dict[str, Any]]) -> str:
    lines = []
    for g in gpus:
        lines.append(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        for n, m in enumerate(simgpus.mig_devices(g)):
            lines.append(f"  MIG {m['ci_profile'] or m['profile']:<12}Device {n:>2}: (UUID: {m['uuid']})")
    return "".join(line + "\n" for line in lines)


# --- CSV -----------------------------------------------------------------------------------------

NA = "[N/A]"


def _remap(g: dict[str, Any], key: str) -> str:
    if g["mig_enabled"]:
        return NA
    return "Yes" if g[key] else "No"


def _mode(on: bool) -> str:
    return "Enabled" if on else "Disabled"


def _mig_mode(g: dict[str, Any], key: str) -> str:
    """A GPU without MIG (`"mig_capable": false` in gpus.json) shows `[N/A]`, as nvidia-smi does."""
    return _mode(g[key]) if g.get("mig_capable", True) else NA


def _watts(value: float | None) -> str:
    return NA if value is None else f"{value:.2f}"


def _clock(g: dict[str, Any], i: int) -> str:
    locked = g.get("locked_clocks")
    return NA if not locked else str(locked[i])


# field -> (unit or "", value function)
GPU_FIELDS: dict[str, tuple[str, Callable[[dict[str, Any], dict[str, Any]], str]]] = {
    "timestamp": ("", lambda s, g: _stamp()),
    "driver_version": ("", lambda s, g: s["driver_version"]),
    "count": ("", lambda s, g: str(len(s["gpus"]))),
    "index": ("", lambda s, g: str(g["index"])),
    "name": ("", lambda s, g: g["name"]),
    "serial": ("", lambda s, g: g["serial"]),
    "uuid": ("", lambda s, g: g["uuid"]),
    "pci.bus_id": ("", lambda s, g: g["bus_id"]),
    "memory.total": ("MiB", lambda s, g: str(g["memory_mib"])),
    "mig.mode.current": ("", lambda s, g: _mig_mode(g, "mig_enabled")),
    "mig.mode.pending": ("", lambda s, g: _mig_mode(g, "mig_pending")),
    "ecc.mode.current": ("", lambda s, g: _mode(g["ecc_enabled"])),
    "ecc.mode.pending": ("", lambda s, g: _mode(g["ecc_pending"])),
    "persistence_mode": ("", lambda s, g: _mode(g["persistence_mode"])),
    "compute_mode": ("", lambda s, g: g["compute_mode"]),
    "power.management": ("", lambda s, g: "[Requested functionality has been deprecated]"),
    "power.limit": ("W", lambda s, g: _watts(g["power_limit"])),
    "enforced.power.limit": ("W", lambda s, g: _watts(g["power_limit"])),
    "power.default_limit": ("W", lambda s, g: _watts(g["power_default"])),
    "power.min_limit": ("W", lambda s, g: _watts(g["power_min"])),
    "power.max_limit": ("W", lambda s, g: _watts(g["power_max"])),
    "clocks.max.sm": ("MHz", lambda s, g: "1980"),
    "clocks.max.memory": ("MHz", lambda s, g: "3201"),
    "clocks.gpu_locked.min": ("MHz", lambda s, g: _clock(g, 0)),
    "clocks.gpu_locked.max": ("MHz", lambda s, g: _clock(g, 1)),
    "ecc.errors.uncorrected.volatile.total": ("", lambda s, g: str(g["ecc_uncorrected_volatile"])),
    "ecc.errors.uncorrected.aggregate.total": ("", lambda s, g: str(g["ecc_uncorrected_aggregate"])),
    "remapped_rows.pending": ("", lambda s, g: _remap(g, "remap_pending")),
    "remapped_rows.failure": ("", lambda s, g: _remap(g, "remap_failure")),
}
GPU_FIELDS["gpu_uuid"] = GPU_FIELDS["uuid"]
GPU_FIELDS["gpu_bus_id"] = GPU_FIELDS["pci.bus_id"]
GPU_FIELDS["gpu_name"] = GPU_FIELDS["name"]
GPU_FIELDS["gpu_serial"] = GPU_FIELDS["serial"]

APP_FIELDS: dict[str, tuple[str, Callable[[dict[str, Any], dict[str, Any]], str]]] = {
    "pid": ("", lambda g, p: str(p["pid"])),
    "process_name": ("", lambda g, p: p["name"]),
    "used_gpu_memory": ("MiB", lambda g, p: str(p["used_mib"])),
}


def _csv(argv: Sequence[str], cols: list[tuple[str, str]], rows: list[list[str]], fmt: str) -> CommandResult:
    """`cols` are (field, unit); values get their unit unless `nounits` (never `[N/A]`)."""
    opts = set(fmt.split(","))
    if "csv" not in opts:
        return _res(argv, 2, err=f'"{fmt}" is not a valid format.\n')
    units = "nounits" not in opts
    out = []
    if "noheader" not in opts:
        out.append(", ".join(f"{f} [{u}]" if u and units else f for f, u in cols))
    for row in rows:
        out.append(
            ", ".join(
                f"{v} {u}" if u and units and v != NA else v for (_, u), v in zip(cols, row, strict=True)
            )
        )
    return _res(argv, 0, "".join(line + "\n" for line in out))


def _query_gpu(
    argv: Sequence[str], state: dict[str, Any], gpus: list[dict[str, Any]], spec: str, fmt: str
) -> CommandResult:
    fields = spec.split(",")
    for f in fields:
        if f not in GPU_FIELDS:
            return _res(argv, 2, err=f'Field "{f}" is not a valid field to query.\n\n')
    cols = [(f, GPU_FIELDS[f][0]) for f in fields]
    rows = [[GPU_FIELDS[f][1](state, g) for f in fields] for g in gpus]
    return _csv(argv, cols, rows, fmt)


def _query_apps(
    argv: Sequence[str], state: dict[str, Any], gpus: list[dict[str, Any]], spec: str, fmt: str
) -> CommandResult:
    fields = spec.split(",")
    for f in fields:
        if f not in APP_FIELDS and f not in GPU_FIELDS:
            return _res(argv, 2, err=f'Field "{f}" is not a valid field to query.\n\n')
    cols = [(f, (APP_FIELDS.get(f) or GPU_FIELDS[f])[0]) for f in fields]
    stamp = _stamp()
    rows = []
    for g in gpus:
        for p in g["processes"]:
            row = []
            for f in fields:
                if f == "timestamp":
                    row.append(stamp)
                elif f in APP_FIELDS:
                    row.append(APP_FIELDS[f][1](g, p))
                else:
                    row.append(GPU_FIELDS[f][1](state, g))
            rows.append(row)
    return _csv(argv, cols, rows, fmt)


# --- -q -x ---------------------------------------------------------------------------------------


def _qx(state: dict[str, Any], gpus: list[dict[str, Any]]) -> str:
    stamp = _dt.datetime.now().strftime("%a %b %d %H:%M:%S %Y")
    o: list[str] = [
        '<?xml version="1.0" ?>',
        '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v13.dtd">',
        "<nvidia_smi_log>",
        f"\t<timestamp>{stamp}</timestamp>",
        f"\t<driver_version>{state['driver_version']}</driver_version>",
        f"\t<cuda_version>{state['cuda_version']}</cuda_version>",
        f"\t<attached_gpus>{len(state['gpus'])}</attached_gpus>",
    ]
    for g in gpus:
        bus = g["bus_id"]
        mig = "Enabled" if g["mig_enabled"] else "Disabled"
        pend = "Enabled" if g["mig_pending"] else "Disabled"
        o += [
            f'\t<gpu id="{bus}">',
            f"\t\t<product_name>{g['name']}</product_name>",
            "\t\t<product_brand>NVIDIA</product_brand>",
            "\t\t<product_architecture>Hopper</product_architecture>",
            f"\t\t<persistence_mode>{_mode(g['persistence_mode'])}</persistence_mode>",
            "\t\t<mig_mode>",
            f"\t\t\t<current_mig>{mig}</current_mig>",
            f"\t\t\t<pending_mig>{pend}</pending_mig>",
            "\t\t</mig_mode>",
        ]
        if simgpus.mig_devices(g):
            o.append("\t\t<mig_devices>")
            for n, m in enumerate(simgpus.mig_devices(g)):
                o += [
                    "\t\t\t<mig_device>",
                    f"\t\t\t\t<index>{n}</index>",
                    f"\t\t\t\t<gpu_instance_id>{m['gpu_instance']}</gpu_instance_id>",
                    f"\t\t\t\t<compute_instance_id>{m['compute_instance']}</compute_instance_id>",
                    "\t\t\t\t<ecc_error_count>",
                    "\t\t\t\t\t<volatile_count>",
                    "\t\t\t\t\t\t<sram_uncorrectable>0</sram_uncorrectable>",
                    "\t\t\t\t\t</volatile_count>",
                    "\t\t\t\t</ecc_error_count>",
                    "\t\t\t\t<fb_memory_usage>",
                    f"\t\t\t\t\t<total>{m['memory_mib']} MiB</total>",
                    "\t\t\t\t\t<reserved>0 MiB</reserved>",
                    "\t\t\t\t\t<used>12 MiB</used>",
                    f"\t\t\t\t\t<free>{m['memory_mib'] - 12} MiB</free>",
                    "\t\t\t\t</fb_memory_usage>",
                    "\t\t\t</mig_device>",
                ]
            o.append("\t\t</mig_devices>")
        else:
            o += ["\t\t<mig_devices>", "\t\t\tNone", "\t\t</mig_devices>"]
        domain, pbus, rest = bus.split(":")
        o += [
            f"\t\t<serial>{g['serial']}</serial>",
            f"\t\t<uuid>{g['uuid']}</uuid>",
            f"\t\t<minor_number>{g['minor']}</minor_number>",
            "\t\t<pci>",
            f"\t\t\t<pci_bus>{pbus}</pci_bus>",
            f"\t\t\t<pci_device>{rest.split('.')[0]}</pci_device>",
            f"\t\t\t<pci_domain>{domain[-4:]}</pci_domain>",
            "\t\t\t<pci_device_id>233510DE</pci_device_id>",
            f"\t\t\t<pci_bus_id>{bus}</pci_bus_id>",
            "\t\t</pci>",
            "\t\t<fb_memory_usage>",
            f"\t\t\t<total>{g['memory_mib']} MiB</total>",
            "\t\t\t<reserved>551 MiB</reserved>",
            "\t\t\t<used>0 MiB</used>",
            f"\t\t\t<free>{g['memory_mib'] - 551} MiB</free>",
            "\t\t</fb_memory_usage>",
            "\t\t<ecc_mode>",
            f"\t\t\t<current_ecc>{'Enabled' if g['ecc_enabled'] else 'Disabled'}</current_ecc>",
            f"\t\t\t<pending_ecc>{_mode(g['ecc_pending'])}</pending_ecc>",
            "\t\t</ecc_mode>",
            "\t\t<ecc_errors>",
            "\t\t\t<volatile>",
            "\t\t\t\t<sram_correctable>0</sram_correctable>",
            "\t\t\t\t<sram_uncorrectable_parity>0</sram_uncorrectable_parity>",
            "\t\t\t\t<sram_uncorrectable_secded>0</sram_uncorrectable_secded>",
            "\t\t\t\t<dram_correctable>0</dram_correctable>",
            f"\t\t\t\t<dram_uncorrectable>{g['ecc_uncorrected_volatile']}</dram_uncorrectable>",
            "\t\t\t</volatile>",
            "\t\t\t<aggregate>",
            "\t\t\t\t<sram_correctable>0</sram_correctable>",
            "\t\t\t\t<sram_uncorrectable_parity>0</sram_uncorrectable_parity>",
            "\t\t\t\t<sram_uncorrectable_secded>0</sram_uncorrectable_secded>",
            "\t\t\t\t<dram_correctable>0</dram_correctable>",
            f"\t\t\t\t<dram_uncorrectable>{g['ecc_uncorrected_aggregate']}</dram_uncorrectable>",
            "\t\t\t\t<sram_threshold_exceeded>No</sram_threshold_exceeded>",
            "\t\t\t</aggregate>",
            "\t\t</ecc_errors>",
        ]
        if g["mig_enabled"]:
            o.append("\t\t<remapped_rows>N/A</remapped_rows>")
        else:
            o += [
                "\t\t<remapped_rows>",
                "\t\t\t<remapped_row_corr>0</remapped_row_corr>",
                f"\t\t\t<remapped_row_unc>{int(g['remap_pending'] or g['remap_failure'])}</remapped_row_unc>",
                f"\t\t\t<remapped_row_pending>{'Yes' if g['remap_pending'] else 'No'}</remapped_row_pending>",
                f"\t\t\t<remapped_row_failure>{'Yes' if g['remap_failure'] else 'No'}</remapped_row_failure>",
                "\t\t</remapped_rows>",
            ]
        o.append("\t\t<processes>")
        for p in g["processes"]:
            o += [
                "\t\t\t<process_info>",
                f"\t\t\t\t<gpu_instance_id>{p.get('gpu_instance', 'N/A')}</gpu_instance_id>",
                f"\t\t\t\t<compute_instance_id>{p.get('compute_instance', 'N/A')}</compute_instance_id>",
                f"\t\t\t\t<pid>{p['pid']}</pid>",
                "\t\t\t\t<type>C</type>",
                f"\t\t\t\t<process_name>{p['name']}</process_name>",
                f"\t\t\t\t<used_memory>{p['used_mib']} MiB</used_memory>",
                "\t\t\t</process_info>",
            ]
        o += ["\t\t</processes>", "\t</gpu>", ""]
    o.append("</nvidia_smi_log>")
    return "\n".join(o) + "\n"


# --- reset ---------------------------------------------------------------------------------------


def _reset(
    system: LocalSystem, argv: Sequence[str], state: dict[str, Any], gpus: list[dict[str, Any]]
) -> CommandResult:
    for g in gpus:
        if not g["reset_supported"]:
            return _res(argv, 3, f"Resetting GPU {g['bus_id']} is not supported.\n")
    busy = [g for g in gpus if g["processes"]]
    if busy:
        n = len(busy)
        lines = ["The following GPUs could not be reset:"]
        lines += [f"  GPU {g['bus_id']}: In use by another client" for g in busy]
        tail = _IN_USE_TAIL.format(
            n=n, s="" if n == 1 else "s", are="is" if n == 1 else "are", these="this" if n == 1 else "these"
        )
        return _res(argv, 255, "\n".join(lines) + "\n\n" + tail + "\n")
    out = []
    for g in gpus:
        g["ecc_uncorrected_volatile"] = 0
        if g["remap_pending"]:
            g["remap_pending"] = False
        g["ecc_enabled"] = g["ecc_pending"]
        if g["mig_enabled"] != g["mig_pending"]:
            g["migs"] = []  # a mode change starts without instances
        g["mig_enabled"] = g["mig_pending"]
        g["locked_clocks"] = None
        g["reset_count"] += 1
        out.append(f"GPU {g['bus_id']} was successfully reset.")
    simgpus.save_state(system, state)
    return _res(argv, 0, "\n".join(out) + "\n")


# --- mig -lgi / -lci -----------------------------------------------------------------------------

_LGI_RULE = "+" + "-" * 57 + "+"
_LGI_HEAD = (
    _LGI_RULE,
    "| GPU instances:                                          |",
    "| GPU   Name               Profile  Instance   Placement  |",
    "|                            ID       ID       Start:Size |",
    "|" + "=" * 57 + "|",
)
_LCI_RULE = "+" + "-" * 68 + "+"
_LCI_HEAD = (
    _LCI_RULE,
    "| Compute instances:                                                 |",
    "| GPU     GPU       Name             Profile   Instance   Placement  |",
    "|       Instance                       ID        ID       Start:Size |",
    "|         ID                                                         |",
    "|" + "=" * 68 + "|",
)


def _lgi(argv: Sequence[str], gpus: list[dict[str, Any]]) -> CommandResult:
    rows = []
    seen: set[tuple[int, int]] = set()
    for g in gpus:
        if not g["mig_enabled"]:
            continue
        for m in simgpus.gpu_instances(g):
            if (g["index"], m["gpu_instance"]) in seen:
                continue
            seen.add((g["index"], m["gpu_instance"]))
            name = f"MIG {m['profile']}"
            rows.append(
                f"|{g['index']:>4}  {name:<20}{m['gi_profile_id']:>4}{m['gpu_instance']:>9}"
                f"{m['placement']:>13}     |"
            )
    if not rows:
        return _res(argv, 6, "No GPU instances found: Not Found\n")
    out = list(_LGI_HEAD)
    for r in rows:
        out += [r, _LGI_RULE]
    return _res(argv, 0, "\n".join(out) + "\n")


def _lci(argv: Sequence[str], gpus: list[dict[str, Any]], gi: str | None) -> CommandResult:
    rows = []
    for g in gpus:
        if not g["mig_enabled"]:
            continue
        for m in sorted(g["migs"], key=lambda m: (m["gpu_instance"], m["compute_instance"] or 0)):
            if m["compute_instance"] is None or (
                gi is not None and str(m["gpu_instance"]) not in gi.split(",")
            ):
                continue
            name = f"MIG {m['ci_profile'] or m['profile']}"
            size = m["placement"].split(":")[1]
            rows.append(
                f"|{g['index']:>4}{m['gpu_instance']:>7}       {name:<20}{m['ci_profile_id']:>2}"
                f"{m['compute_instance']:>10}{'0:' + size:>13}     |"
            )
    if not rows:
        return _res(argv, 6, "No compute instances found: Not Found\n")
    out = list(_LCI_HEAD)
    for r in rows:
        out += [r, _LCI_RULE]
    return _res(argv, 0, "\n".join(out) + "\n")


# --- entry point ---------------------------------------------------------------------------------


def _extension(key: str) -> Handler | None:
    spec = EXTENSIONS.get(key)
    if spec is None:
        return None
    module, _, func = spec.partition(":")
    fn: Handler = getattr(importlib.import_module(f"bcd_simhost.{module}"), func)
    return fn


def main(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    state = simgpus.load_state(system)
    driver = None if state is None else loaded_driver(system, state)
    if state is None or driver is None:
        return _res(argv, 9, NO_DRIVER)
    view = dict(state, driver_version=driver["version"], cuda_version=driver["cuda"])  # what is shown
    args = list(argv[1:])
    is_mig = bool(args) and args[0] == "mig"
    for a in args:
        key = f"mig {a}" if is_mig else a.split("=", 1)[0]
        ext = _extension(key)
        if ext is not None:
            return ext(system, argv, state)
    gpus = _select(state, _opt(args, "-i") or _opt(args, "--id"))
    if gpus is None:
        return _res(argv, 6, "No devices were found\n")
    if is_mig:
        if "-lgi" in args:
            return _lgi(argv, gpus)
        if "-lci" in args:
            return _lci(argv, gpus, _opt(args, "-gi"))
        return _res(argv, 2, f"Invalid combination of input arguments: {' '.join(args)}\n")
    if args == ["-L"] or args[:1] == ["-L"]:
        return _res(argv, 0, _list(view, gpus))
    fmt = _opt(args, "--format")
    if (q := _opt(args, "--query-gpu")) is not None:
        return _query_gpu(argv, view, gpus, q, fmt or "")
    if (q := _opt(args, "--query-compute-apps")) is not None:
        return _query_apps(argv, view, gpus, q, fmt or "")
    if "-q" in args and "-x" in args:
        return _res(argv, 0, _qx(view, gpus))
    if "--gpu-reset" in args or "-r" in args:
        if _opt(args, "-i") is None:
            return _res(argv, 2, "A GPU must be selected with -i to be reset.\n")
        return _reset(system, argv, state, gpus)
    return _res(argv, 2, f"Invalid combination of input arguments: {' '.join(args)}\n")
