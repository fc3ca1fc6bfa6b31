# ruff: noqa: E501  (tool output lines are kept whole)
"""The host-settings subcommands of the simulated `nvidia-smi`, on the one GPU state (gpus.json).

Wired into nvidia_smi.py through its EXTENSIONS table; each handler is `(system, argv, state) ->
CommandResult` and saves with `gpus.save_state`. There is no GPU state of its own: the devices
inventory, the busy checks and these commands all see the same GPUs, MIG instances and processes.

Subcommands and where their output comes from (../shared/reference/nvidia-smi):
- `-i ID -pl W`: `Power limit for GPU <bus> was set to 450.00 W from 700.00 W.` then `All done.`;
  outside the GPU's range `Provided power limit ... should be between 200.00 W and 700.00 W for GPU
  <bus>` and `Terminating early due to previous errors.` (exit 2). Power values as in the CSV captures.
- `-i ID -e 0|1`: `Disabled ECC support for GPU <bus>.`, `All done.`, `Reboot required.` (the pending
  mode; it becomes current at the next reset).
- `-i ID -c MODE`: `Set compute mode to EXCLUSIVE_PROCESS for GPU <bus>.` (DEFAULT / 0,
  PROHIBITED / 2, EXCLUSIVE_PROCESS / 3); the CSV shows `Default`, `Prohibited`, `Exclusive_Process`.
- `-i ID -pm 0|1`: `Enabled persistence mode for GPU <bus>.` / `Persistence mode is already Enabled
  for GPU <bus>.`
- `-i ID -lgc MIN,MAX` / `-rgc`: `GPU clocks set to "(gpuClkMin MIN, gpuClkMax MAX)" for GPU <bus>` /
  `All done.`; `clocks.gpu_locked.min/max` show them. (No capture of these two in the reference set;
  the lines follow the driver's wording as reported in public issue threads.)
- `-i ID -mig 0|1`: `Enabled MIG Mode for GPU <bus>` (transcript a30 ... enable-pending-reboot, last
  lines); while processes run (`In use by another client`) or when the GPU needs a reset for a mode
  change (`mig_needs_reset`, as on Ampere: `Not Supported` with the `--gpu-reset` hint, from
  messages/mig-enable_pending-not-supported_seansiddens-mps-test.txt) the mode stays pending.
  Turning MIG off while GPU instances exist is refused (`In use by another client`); the simulator's
  own wording, the unit destroys the instances first.
- `mig -lgip`: the boxed table of the 580 driver (mig/a100-sxm4-40gb_580.126.09_... `-lgip`), H200
  profiles, `Free/Total` from the current placements; `No MIG-enabled devices found.` (exit 6).
- `mig -cgi P[,P...] [-C]`: `Successfully created GPU instance ID  N on GPU  0 using profile MIG
  <name> (ID  P)` and, with `-C`, `Successfully created compute instance ID  0 on GPU  0 GPU
  instance ID  N using profile MIG <name> (ID  C)` (IDs padded to 2, reference transcripts). Placement:
  the lowest allowed start whose memory slices are free (as the A30 and A100 transcripts show),
  except that a 3g instance takes the upper half first, so that the combinations NVIDIA supports
  (3g + 2g + 2g, 3g + 2g + 1g + 1g, created largest first) fit as they do on the GPU;
  GPU instance ids: the lowest free id from 1 (0 for a full-GPU instance). No room: `Unable to create
  a GPU instance on GPU  0 using profile P: Insufficient Resources` (exit 6).
- `mig -cci [PROFILE] -gi N`: a compute instance in GPU instance N (the full one by default, or
  `<n>c.<profile>`), as `-cci` in the ssup2 transcript.
- `mig -dci` / `mig -dgi` [-gi N]: `Successfully destroyed compute instance ID  0 from GPU  0 GPU
  instance ID  N` / `Successfully destroyed GPU instance ID  N from GPU  0`; nothing there: `No
  compute instances found: Not Found` / `No GPU instances found: Not Found` (exit 6); a compute
  instance with processes or a GPU instance with compute instances: `In use by another client`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem

from . import gpus as simgpus
from .nvidia_smi import opt, select

COMPUTE_MODES = {
    "0": "Default",
    "DEFAULT": "Default",
    "2": "Prohibited",
    "PROHIBITED": "Prohibited",
    "3": "Exclusive_Process",
    "EXCLUSIVE_PROCESS": "Exclusive_Process",
}
_SET_FLAGS = ("-pl", "-e", "-c", "-pm", "-mig", "-lgc", "-rgc")


def _res(argv: Sequence[str], rc: int, out: str = "", err: str = "") -> CommandResult:
    return CommandResult(tuple(argv), rc, out.encode(), err.encode())


def _lines(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _chosen(argv: Sequence[str], state: dict[str, Any]) -> list[dict[str, Any]] | CommandResult:
    ident = opt(list(argv[1:]), "-i") or opt(list(argv[1:]), "--id")
    gpus = select(state, ident)
    if gpus is None:
        return _res(
            argv, 6, f"No devices were found matching {ident}\n" if ident else "No devices were found\n"
        )
    return gpus


# --- settings ------------------------------------------------------------------------------------


def settings(system: LocalSystem, argv: Sequence[str], state: dict[str, Any]) -> CommandResult:
    """`-pl`, `-e`, `-c`, `-pm`, `-mig`, `-lgc`, `-rgc` on the GPUs `-i` names (all without it)."""
    args = list(argv[1:])
    gpus = _chosen(argv, state)
    if isinstance(gpus, CommandResult):
        return gpus
    out: list[str] = []
    for flag in [a for a in args if a in _SET_FLAGS]:
        value = opt(args, flag) if flag != "-rgc" else ""
        if value is None:
            return _res(argv, 2, err=f"Option {flag} requires a value.\n")
        for g in gpus:
            err = _set(g, flag, value, out)
            if err is not None:
                simgpus.save_state(system, state)
                return _res(argv, 2 if flag in ("-pl", "-c", "-lgc") else 6, _lines(out), err)
    simgpus.save_state(system, state)
    reboot = "-e" in args and any(g["ecc_pending"] != g["ecc_enabled"] for g in gpus)
    return _res(argv, 0, _lines([*out, "All done.", *(["Reboot required."] if reboot else [])]))


def _set(g: dict[str, Any], flag: str, value: str, out: list[str]) -> str | None:
    """Apply one setting to one GPU, appending its line; an error text stops the command."""
    bus = g["bus_id"]
    if flag == "-pl":
        try:
            watts = float(value)
        except ValueError:
            return f'Invalid power limit "{value}".\n'
        if not g["power_min"] <= watts <= g["power_max"]:
            return (
                f"Provided power limit {watts:.2f} W is not a valid power limit which should be between "
                f"{g['power_min']:.2f} W and {g['power_max']:.2f} W for GPU {bus}\n"
                "Terminating early due to previous errors.\n"
            )
        out.append(f"Power limit for GPU {bus} was set to {watts:.2f} W from {g['power_limit']:.2f} W.")
        g["power_limit"] = watts
    elif flag == "-e":
        if value not in ("0", "1"):
            return f'Invalid ECC mode "{value}".\n'
        on = value == "1"
        g["ecc_pending"] = on
        out.append(f"{'Enabled' if on else 'Disabled'} ECC support for GPU {bus}.")
    elif flag == "-c":
        mode = COMPUTE_MODES.get(value.upper())
        if mode is None:
            return f'Invalid compute mode "{value}".\n'
        g["compute_mode"] = mode
        out.append(f"Set compute mode to {mode.upper()} for GPU {bus}.")
    elif flag == "-pm":
        if value not in ("0", "1"):
            return f'Invalid persistence mode "{value}".\n'
        on = value == "1"
        word = "Enabled" if on else "Disabled"
        if g["persistence_mode"] == on:
            out.append(f"Persistence mode is already {word} for GPU {bus}.")
        else:
            g["persistence_mode"] = on
            out.append(f"{word} persistence mode for GPU {bus}.")
    elif flag == "-lgc":
        m = re.fullmatch(r"([0-9]+),([0-9]+)", value)
        if m is None or int(m.group(1)) > int(m.group(2)):
            return f'Invalid clock values "{value}".\n'
        g["locked_clocks"] = [int(m.group(1)), int(m.group(2))]
        out.append(f'GPU clocks set to "(gpuClkMin {m.group(1)}, gpuClkMax {m.group(2)})" for GPU {bus}')
    elif flag == "-rgc":
        g["locked_clocks"] = None
    elif flag == "-mig":
        return _set_mig(g, value, out)
    return None


def _set_mig(g: dict[str, Any], value: str, out: list[str]) -> str | None:
    if value not in ("0", "1"):
        return f'Invalid MIG mode "{value}".\n'
    on = value == "1"
    bus = g["bus_id"]
    verb = "enable" if on else "disable"
    if not on and g["migs"]:
        return f"Unable to disable MIG Mode for GPU {bus}: In use by another client\n"
    g["mig_pending"] = on
    if g["mig_enabled"] == on:
        out.append(f"{'Enabled' if on else 'Disabled'} MIG Mode for GPU {bus}")
    elif g["processes"]:
        out.append(f"Warning: MIG mode is in pending {verb} state for GPU {bus}:In use by another client")
        out.append(
            f"{bus} is currently being used by one or more other processes (e.g. CUDA application or a "
            "monitoring application such as another instance of nvidia-smi). Please first kill all "
            "processes using the device and retry the command or reboot the system to make MIG mode effective."
        )
    elif g.get("mig_needs_reset"):
        out.append(f"Warning: MIG mode is in pending {verb} state for GPU {bus}:Not Supported")
        out.append(f"Reboot the system or try nvidia-smi --gpu-reset to make MIG mode effective on GPU {bus}")
    else:
        g["mig_enabled"] = on
        g["migs"] = []
        out.append(f"{'Enabled' if on else 'Disabled'} MIG Mode for GPU {bus}")
    return None


# --- mig -----------------------------------------------------------------------------------------


def _mig_gpus(argv: Sequence[str], state: dict[str, Any]) -> list[dict[str, Any]] | CommandResult:
    gpus = _chosen(argv, state)
    if isinstance(gpus, CommandResult):
        return gpus
    on = [g for g in gpus if g["mig_enabled"]]
    if not on:
        return _res(argv, 6, "No MIG-enabled devices found.\n")
    return on


def _used(g: dict[str, Any]) -> tuple[set[int], int]:
    """Memory slices taken, compute slices taken."""
    mem: set[int] = set()
    compute = 0
    for m in simgpus.gpu_instances(g):
        start, size = (int(x) for x in m["placement"].split(":"))
        mem.update(range(start, start + size))
        compute += simgpus.PROFILES_BY_NAME[m["profile"]].compute
    return mem, compute


def _place(g: dict[str, Any], prof: simgpus.GiProfile) -> int | None:
    mem, compute = _used(g)
    if compute + prof.compute > simgpus.COMPUTE_SLICES:
        return None
    if prof.single and any(m["profile"] == prof.name for m in g["migs"]):
        return None
    for start in prof.starts:
        span = set(range(start, start + prof.memory))
        if not span & mem and max(span) < simgpus.MEMORY_SLICES:
            return start
    return None


def _fits(g: dict[str, Any], prof: simgpus.GiProfile) -> int:
    """How many more instances of `prof` fit on the GPU as it is."""
    trial = {"migs": [dict(m) for m in simgpus.gpu_instances(g)]}
    n = 0
    while (start := _place(trial, prof)) is not None:
        trial["migs"].append(simgpus.make_mig(0, prof.name, 100 + n, None, start))
        n += 1
    return n


def _profile(name_or_id: str) -> simgpus.GiProfile | None:
    for p in simgpus.H200_PROFILES:
        if name_or_id in (p.name, str(p.id)):
            return p
    return None


def mig_lgip(system: LocalSystem, argv: Sequence[str], state: dict[str, Any]) -> CommandResult:
    gpus = _mig_gpus(argv, state)
    if isinstance(gpus, CommandResult):
        return gpus
    rule = "+" + "-" * 79 + "+"
    out = [
        rule,
        "| GPU instance profiles:" + " " * 56 + "|",
        "| GPU   Name               ID    Instances   Memory     P2P    SM    DEC   ENC  |",
        "|                                Free/Total   GiB              CE    JPEG  OFA  |",
        "|" + "=" * 79 + "|",
    ]
    for g in gpus:
        empty: dict[str, Any] = {"migs": []}
        for p in simgpus.H200_PROFILES:
            total, free = _fits(empty, p), _fits(g, p)
            sm = 16 * p.compute if p.compute < 7 else 132
            dec = p.compute if p.compute < 7 else 7
            media = 1 if (p.single or p.compute == 7) else 0
            gib = f"{p.memory_mib / 1024:.2f}"
            row = f"|{g['index']:>4}  MIG {p.name:<16}{p.id:>2}     {f'{free}/{total}':<11}{gib:<11}No     {sm:<7}{dec:<6}0   |"
            sub = f"|{'':<63}{p.compute:<6}{media:<6}{media}   |"
            out += [row, sub, rule]
    return _res(argv, 0, _lines(out))


def _next_gi(g: dict[str, Any], prof: simgpus.GiProfile) -> int:
    taken = {m["gpu_instance"] for m in g["migs"]}
    if prof.memory == simgpus.MEMORY_SLICES and 0 not in taken:
        return 0
    return next(i for i in range(1, 64) if i not in taken)


def _serial(state: dict[str, Any]) -> int:
    state["mig_serial"] = int(state.get("mig_serial", 0)) + 1
    return int(state["mig_serial"])


def mig_cgi(system: LocalSystem, argv: Sequence[str], state: dict[str, Any]) -> CommandResult:
    args = list(argv[1:])
    gpus = _mig_gpus(argv, state)
    if isinstance(gpus, CommandResult):
        return gpus
    wanted = opt(args, "-cgi") or ""
    out: list[str] = []
    for g in gpus:
        for want in wanted.split(","):
            prof = _profile(want)
            if prof is None:
                simgpus.save_state(system, state)
                return _res(
                    argv,
                    6,
                    _lines(out),
                    f"Unable to create a GPU instance on GPU {g['index']:>2} using profile {want}: Not Found\n",
                )
            start = _place(g, prof)
            if start is None:
                simgpus.save_state(system, state)
                return _res(
                    argv,
                    6,
                    _lines(out),
                    f"Unable to create a GPU instance on GPU {g['index']:>2} using profile {prof.id}: Insufficient Resources\n",
                )
            gi = _next_gi(g, prof)
            ci = 0 if "-C" in args else None
            g["migs"].append(simgpus.make_mig(g["index"], prof.name, gi, ci, start, _serial(state)))
            out.append(
                f"Successfully created GPU instance ID {gi:>2} on GPU {g['index']:>2} using profile MIG {prof.name} (ID {prof.id:>2})"
            )
            if ci is not None:
                out.append(
                    f"Successfully created compute instance ID  0 on GPU {g['index']:>2} GPU instance ID {gi:>2} "
                    f"using profile MIG {prof.name} (ID {prof.ci_profile_id:>2})"
                )
    simgpus.save_state(system, state)
    return _res(argv, 0, _lines(out))


def mig_cci(system: LocalSystem, argv: Sequence[str], state: dict[str, Any]) -> CommandResult:
    args = list(argv[1:])
    gpus = _mig_gpus(argv, state)
    if isinstance(gpus, CommandResult):
        return gpus
    want = opt(args, "-cci")
    if want is not None and want.startswith("-"):
        want = None
    gi_ids = opt(args, "-gi")
    out: list[str] = []
    for g in gpus:
        for gi in simgpus.gpu_instances(g):
            if gi_ids is not None and str(gi["gpu_instance"]) not in gi_ids.split(","):
                continue
            prof = simgpus.PROFILES_BY_NAME[gi["profile"]]
            compute, name, ci_pid = prof.compute, prof.name, prof.ci_profile_id
            m = re.fullmatch(r"([0-9])c\.(.+)", want or "")
            if m and m.group(2) == prof.name:
                compute, name = int(m.group(1)), want or ""
                ci_pid = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}.get(compute, 0)
            elif want not in (None, prof.name, str(prof.ci_profile_id)):
                return _res(
                    argv,
                    6,
                    _lines(out),
                    f"Unable to create a compute instance on GPU {g['index']:>2} GPU instance ID {gi['gpu_instance']:>2} using profile {want}: Not Found\n",
                )
            siblings = [x for x in g["migs"] if x["gpu_instance"] == gi["gpu_instance"]]
            used = sum(
                simgpus.PROFILES_BY_NAME[x["profile"]].compute
                if x["ci_profile"] == x["profile"]
                else int(x["ci_profile"][0])
                for x in siblings
                if x["compute_instance"] is not None
            )
            if used + compute > prof.compute:
                return _res(
                    argv,
                    6,
                    _lines(out),
                    f"Unable to create a compute instance on GPU {g['index']:>2} GPU instance ID {gi['gpu_instance']:>2} using profile {ci_pid}: Insufficient Resources\n",
                )
            ci = next(i for i in range(8) if i not in {x["compute_instance"] for x in siblings})
            start = gi["placement"].split(":")[0]
            entry = simgpus.make_mig(
                g["index"], prof.name, gi["gpu_instance"], ci, int(start), _serial(state)
            )
            entry.update(ci_profile=name, ci_profile_id=ci_pid)
            g["migs"] = [x for x in g["migs"] if x is not gi or x["compute_instance"] is not None] + [entry]
            out.append(
                f"Successfully created compute instance ID {ci:>2} on GPU {g['index']:>2} GPU instance ID {gi['gpu_instance']:>2} using profile MIG {name} (ID {ci_pid:>2})"
            )
    simgpus.save_state(system, state)
    return _res(argv, 0, _lines(out))


def mig_dci(system: LocalSystem, argv: Sequence[str], state: dict[str, Any]) -> CommandResult:
    args = list(argv[1:])
    gpus = _mig_gpus(argv, state)
    if isinstance(gpus, CommandResult):
        return gpus
    gi_ids = opt(args, "-gi")
    out: list[str] = []
    errors: list[str] = []
    for g in gpus:
        kept: list[dict[str, Any]] = []
        for gi in simgpus.gpu_instances(g):
            n = gi["gpu_instance"]
            entries = [m for m in g["migs"] if m["gpu_instance"] == n]
            cis = sorted(
                (m for m in entries if m["compute_instance"] is not None), key=lambda m: m["compute_instance"]
            )
            if not cis or (gi_ids is not None and str(n) not in gi_ids.split(",")):
                kept += entries
                continue
            if any(p.get("gpu_instance") == n for p in g["processes"]):
                errors.append(
                    f"Unable to destroy compute instance(s) of GPU {g['index']:>2} GPU instance ID {n:>2}: In use by another client"
                )
                kept += entries
                continue
            for m in cis:
                out.append(
                    f"Successfully destroyed compute instance ID {m['compute_instance']:>2} from GPU {g['index']:>2} GPU instance ID {n:>2}"
                )
            kept.append(dict(cis[0], compute_instance=None, ci_profile_id=None, ci_profile=None, uuid=None))
        g["migs"] = kept
    simgpus.save_state(system, state)
    if errors:
        return _res(argv, 6, _lines(out), _lines(errors))
    if not out:
        return _res(argv, 6, "", "No compute instances found: Not Found\n")
    return _res(argv, 0, _lines(out))


def mig_dgi(system: LocalSystem, argv: Sequence[str], state: dict[str, Any]) -> CommandResult:
    args = list(argv[1:])
    gpus = _mig_gpus(argv, state)
    if isinstance(gpus, CommandResult):
        return gpus
    gi_ids = opt(args, "-gi")
    out: list[str] = []
    errors: list[str] = []
    for g in gpus:
        for gi in simgpus.gpu_instances(g):
            n = gi["gpu_instance"]
            if gi_ids is not None and str(n) not in gi_ids.split(","):
                continue
            if any(m["gpu_instance"] == n and m["compute_instance"] is not None for m in g["migs"]):
                errors.append(
                    f"Unable to destroy GPU instance ID {n:>2} from GPU {g['index']:>2}: In use by another client"
                )
                continue
            g["migs"] = [m for m in g["migs"] if m["gpu_instance"] != n]
            out.append(f"Successfully destroyed GPU instance ID {n:>2} from GPU {g['index']:>2}")
    simgpus.save_state(system, state)
    if errors:
        return _res(argv, 6, _lines(out), _lines(errors))
    if not out:
        return _res(argv, 6, "", "No GPU instances found: Not Found\n")
    return _res(argv, 0, _lines(out))
