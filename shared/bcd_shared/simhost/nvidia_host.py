# ruff: noqa: E501  (tool output and fixture lines are kept whole)
"""The host-settings half of the simulated `nvidia-smi`: power limits, ECC, MIG mode and instances.

The devices engineer owns the `nvidia-smi` fake (inventory output); its dispatcher should call
`handle(system, argv, stdin)` first and fall through when it returns None. `nvidia_smi` here is a
complete fallback used where no other fake is registered (the host tests and bench).

State: <root>/var/lib/bcd-sim/gpu-host.json, one entry per GPU (index, uuid, name, bus id, power
limit and range, ECC current/pending, MIG mode current/pending, GPU instances, compute mode, and two
knobs: `mig_needs_reset` (mode changes wait for a reset, as on Ampere) and `reset_fails`). The
nvidia driver must be loaded (/sys/module/nvidia) or nvidia-smi fails as the real one does.

Output formats follow ../shared/reference/nvidia-smi: CSV rows separated by ", ", `mig -lgip` and
`mig -lgi` tables, `-L` lines with MIG devices indented, "Successfully created GPU instance ID  N
on GPU  0 using profile MIG 1g.10gb (ID 19)", "No GPU instances found: Not Found".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem

from ._state import fail, load, ok, save

STATE = "gpu-host.json"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)

# H100 80GB: (name, profile id, compute slices, memory slices, allowed starts, memory GiB)
H100_PROFILES: tuple[tuple[str, int, int, int, tuple[int, ...], float], ...] = (
    ("1g.10gb", 19, 1, 1, (0, 1, 2, 3, 4, 5, 6), 9.75),
    ("1g.10gb+me", 20, 1, 1, (0, 1, 2, 3, 4, 5, 6), 9.75),
    ("1g.20gb", 15, 1, 2, (0, 2, 4, 6), 19.62),
    ("2g.20gb", 14, 2, 2, (0, 2, 4), 19.62),
    ("3g.40gb", 9, 3, 4, (0, 4), 39.50),
    ("4g.40gb", 5, 4, 4, (0,), 39.50),
    ("7g.80gb", 0, 7, 8, (0,), 79.25),
)


def default_gpus(count: int = 8) -> list[dict[str, Any]]:
    gpus = []
    for i in range(count):
        h = hashlib.sha256(f"bcd-sim-gpu-{i}".encode()).hexdigest()
        gpus.append(
            {
                "index": i,
                "uuid": f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}",
                "name": "NVIDIA H100 80GB HBM3",
                "bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
                "power": {"limit": 700.0, "min": 200.0, "max": 700.0},
                "ecc": {"current": "Enabled", "pending": "Enabled"},
                "mig": {"current": "Disabled", "pending": "Disabled"},
                "gis": [],
                "compute_mode": "Default",
                "mig_needs_reset": False,
                "reset_fails": False,
            }
        )
    return gpus


def _gpus(system: LocalSystem) -> list[dict[str, Any]]:
    gpus: list[dict[str, Any]] = load(system, STATE, [])
    return gpus


def _select(gpus: list[dict[str, Any]], args: list[str]) -> list[dict[str, Any]]:
    if "-i" in args:
        want = args[args.index("-i") + 1]
        return [g for g in gpus if str(g["index"]) == want or g["uuid"] == want or g["bus_id"] == want]
    return gpus


def _profile(name_or_id: str) -> tuple[str, int, int, int, tuple[int, ...], float] | None:
    for p in H100_PROFILES:
        if name_or_id in (p[0], str(p[1])):
            return p
    return None


def _place(gpu: dict[str, Any], prof: tuple[str, int, int, int, tuple[int, ...], float]) -> int | None:
    used: set[int] = set()
    compute = 0
    for gi in gpu["gis"]:
        used.update(range(gi["start"], gi["start"] + gi["size"]))
        compute += gi["slices"]
    if compute + prof[2] > 7:
        return None
    for start in reversed(prof[4]):  # the driver fills placements from the top
        span = set(range(start, start + prof[3]))
        if not span & used and max(span) < 8:
            return start
    return None


def _fits_empty(prof: tuple[str, int, int, int, tuple[int, ...], float]) -> int:
    g: dict[str, Any] = {"gis": []}
    n = 0
    while (start := _place(g, prof)) is not None:
        g["gis"].append({"start": start, "size": prof[3], "slices": prof[2]})
        n += 1
        if prof[0].endswith("+me"):
            break
    return n


def _query(gpus: list[dict[str, Any]], fields: list[str], nounits: bool, noheader: bool) -> str:
    def val(g: dict[str, Any], f: str) -> str:
        w = "" if nounits else " W"
        table = {
            "index": str(g["index"]),
            "uuid": g["uuid"],
            "name": g["name"],
            "pci.bus_id": g["bus_id"],
            "power.limit": f"{g['power']['limit']:.2f}{w}" if g["power"] else "[N/A]",
            "power.min_limit": f"{g['power']['min']:.2f}{w}" if g["power"] else "[N/A]",
            "power.max_limit": f"{g['power']['max']:.2f}{w}" if g["power"] else "[N/A]",
            "ecc.mode.current": g["ecc"]["current"] if g["ecc"] else "[N/A]",
            "ecc.mode.pending": g["ecc"]["pending"] if g["ecc"] else "[N/A]",
            "mig.mode.current": g["mig"]["current"] if g["mig"] else "[N/A]",
            "mig.mode.pending": g["mig"]["pending"] if g["mig"] else "[N/A]",
            "compute_mode": g["compute_mode"],
        }
        return str(table.get(f, "[N/A]"))

    lines = [] if noheader else [", ".join(fields)]
    lines += [", ".join(val(g, f) for f in fields) for g in gpus]
    return "\n".join(lines) + "\n"


def _lgip(gpus: list[dict[str, Any]]) -> str:
    bar = "+" + "-" * 77 + "+"
    out = [
        bar,
        "| GPU instance profiles:" + " " * 54 + "|",
        "| GPU   Name             ID    Instances   Memory     P2P    SM    DEC   ENC  |",
        "|                              Free/Total   GiB              CE    JPEG  OFA  |",
        "|" + "=" * 77 + "|",
    ]
    for g in gpus:
        for p in H100_PROFILES:
            total = _fits_empty(p)
            free = sum(1 for _ in range(total)) if not g["gis"] else 0
            row = f"|  {g['index']:>2}  MIG {p[0]:<13}{p[1]:>3}     {free}/{total}        {p[5]:<10} No     {16 * p[2]:<5}{p[2]:<6}0   |"
            out += [row, "|" + " " * 61 + f"{p[2]:<6}{p[2]:<6}0   |", bar]
    return "\n".join(out) + "\n"


def _lgi(gpus: list[dict[str, Any]]) -> str:
    rows = [(g, gi) for g in gpus for gi in g["gis"]]
    if not rows:
        return ""
    bar = "+" + "-" * 55 + "+"
    out = [
        bar,
        "| GPU instances:" + " " * 40 + "|",
        "| GPU   Name             Profile  Instance   Placement  |",
        "|                          ID       ID       Start:Size |",
        "|" + "=" * 55 + "|",
    ]
    for g, gi in rows:
        out += [
            f"|  {g['index']:>2}  MIG {gi['profile']:<13}{gi['profile_id']:>4}     {gi['id']:>4}          {gi['start']}:{gi['size']}     |",
            bar,
        ]
    return "\n".join(out) + "\n"


def _list(gpus: list[dict[str, Any]]) -> str:
    out = []
    for g in gpus:
        out.append(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        for n, gi in enumerate(g["gis"]):
            h = hashlib.sha256(f"{g['uuid']}/{gi['id']}".encode()).hexdigest()
            mig = f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
            out.append(f"  MIG {gi['profile']:<12}Device {n:>2}: (UUID: {mig})")
    return "\n".join(out) + "\n"


def handle(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult | None:
    """Answer the host-settings subcommands; None for anything else (inventory output)."""
    args = list(argv[1:])
    mine = (
        any(a.startswith("--query-gpu=") for a in args)
        or args[:1] == ["mig"]
        or any(a in ("-pl", "-e", "-mig", "--gpu-reset", "-L", "-c") for a in args)
    )
    if not mine:
        return None
    if not system.exists("/sys/module/nvidia"):
        return fail(argv, NO_DRIVER, 9)
    gpus = _gpus(system)
    sel = _select(gpus, args)
    if "-i" in args and not sel:
        return fail(argv, f"No devices were found matching {args[args.index('-i') + 1]}\n", 6)
    q = next((a for a in args if a.startswith("--query-gpu=")), None)
    if q is not None:
        fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "csv")
        return ok(argv, _query(sel, q.split("=", 1)[1].split(","), "nounits" in fmt, "noheader" in fmt))
    if "-L" in args:
        return ok(argv, _list(sel))
    if args[:1] == ["mig"]:
        return _mig(system, argv, gpus, sel, args[1:])
    out = []
    for g in sel:
        if "-pl" in args:
            w = float(args[args.index("-pl") + 1])
            p = g["power"]
            if not p["min"] <= w <= p["max"]:
                return fail(
                    argv,
                    f"Provided power limit {w:.2f} W is not a valid power limit which should be between "
                    f"{p['min']:.2f} W and {p['max']:.2f} W for GPU {g['bus_id']}\nTerminating early due to previous errors.\n",
                    2,
                )
            out.append(f"Power limit for GPU {g['bus_id']} was set to {w:.2f} W from {p['limit']:.2f} W.")
            p["limit"] = w
        if "-e" in args:
            on = args[args.index("-e") + 1] == "1"
            g["ecc"]["pending"] = "Enabled" if on else "Disabled"
            out.append(f"{'Enabled' if on else 'Disabled'} ECC support for GPU {g['bus_id']}.")
        if "-c" in args:
            g["compute_mode"] = {"0": "Default", "DEFAULT": "Default", "3": "Exclusive_Process"}.get(
                args[args.index("-c") + 1], "Exclusive_Process"
            )
            out.append(f"Set compute mode to {args[args.index('-c') + 1]} for GPU {g['bus_id']}.")
        if "-mig" in args:
            want = "Enabled" if args[args.index("-mig") + 1] == "1" else "Disabled"
            g["mig"]["pending"] = want
            if g.get("mig_needs_reset") and g["mig"]["current"] != want:
                verb = "enable" if want == "Enabled" else "disable"
                out.append(
                    f"Warning: MIG mode is in pending {verb} state for GPU {g['bus_id']}:In use by another client"
                )
            else:
                g["mig"]["current"] = want
                out.append(f"{want} MIG Mode for GPU {g['bus_id']}")
        if "--gpu-reset" in args:
            if g.get("reset_fails"):
                save(system, STATE, gpus)
                return fail(
                    argv,
                    f"The following GPUs could not be reset:\n  GPU {g['bus_id']}: In use by another client\n\n"
                    "1 device is currently being used by one or more other processes (e.g., Fabric Manager, CUDA "
                    "application, graphics application such as an X server, or a monitoring application such as "
                    "another instance of nvidia-smi). Please first kill all processes using this device and all "
                    "compute applications running in the system.\n",
                    255,
                )
            g["mig"]["current"] = g["mig"]["pending"]
            g["ecc"]["current"] = g["ecc"]["pending"]
            out.append(f"GPU {g['bus_id']} was successfully reset.")
    save(system, STATE, gpus)
    return ok(argv, "\n".join([*out, "All done."]) + "\n")


def _mig(
    system: LocalSystem,
    argv: Sequence[str],
    gpus: list[dict[str, Any]],
    sel: list[dict[str, Any]],
    args: list[str],
) -> CommandResult:
    if "-lgip" in args:
        on = [g for g in sel if g["mig"]["current"] == "Enabled"]
        return ok(argv, _lgip(on)) if on else fail(argv, "No MIG-enabled devices found.\n", 6)
    if "-lgi" in args:
        text = _lgi(sel)
        return ok(argv, text) if text else fail(argv, "No GPU instances found: Not Found\n", 6)
    out = []
    for g in sel:
        if g["mig"]["current"] != "Enabled":
            return fail(
                argv, f"Unable to manage GPU instances on GPU {g['index']:>2}: MIG mode is not enabled\n", 6
            )
        if "-dci" in args:
            cis = [gi for gi in g["gis"] if gi.get("ci")]
            if not cis:
                return fail(argv, "No compute instances found: Not Found\n", 6)
            for gi in cis:
                gi["ci"] = False
                out.append(
                    f"Successfully destroyed compute instance ID  0 from GPU {g['index']:>2} GPU instance ID {gi['id']:>2}"
                )
        elif "-dgi" in args:
            if not g["gis"]:
                return fail(argv, "No GPU instances found: Not Found\n", 6)
            if any(gi.get("ci") for gi in g["gis"]):
                return fail(
                    argv,
                    f"Unable to destroy GPU instance on GPU {g['index']:>2}: In use by another client\n",
                    6,
                )
            for gi in g["gis"]:
                out.append(f"Successfully destroyed GPU instance ID {gi['id']:>2} from GPU {g['index']:>2}")
            g["gis"] = []
        elif "-cgi" in args:
            for want in args[args.index("-cgi") + 1].split(","):
                prof = _profile(want)
                if prof is None:
                    save(system, STATE, gpus)
                    return fail(
                        argv,
                        f"Unable to create a GPU instance on GPU {g['index']:>2} using profile {want}: Not Found\n",
                        6,
                    )
                start = _place(g, prof)
                if start is None:
                    save(system, STATE, gpus)
                    return fail(
                        argv,
                        f"Unable to create a GPU instance on GPU {g['index']:>2} using profile {prof[1]}: Insufficient Resources\n",
                        6,
                    )
                gid = 1 + max([gi["id"] for gi in g["gis"]], default=0)
                g["gis"].append(
                    {
                        "id": gid,
                        "profile": prof[0],
                        "profile_id": prof[1],
                        "start": start,
                        "size": prof[3],
                        "slices": prof[2],
                        "ci": "-C" in args,
                    }
                )
                out.append(
                    f"Successfully created GPU instance ID {gid:>2} on GPU {g['index']:>2} using profile MIG {prof[0]} (ID {prof[1]:>2})"
                )
                if "-C" in args:
                    out.append(
                        f"Successfully created compute instance ID  0 on GPU {g['index']:>2} GPU instance ID {gid:>2} "
                        f"using profile MIG {prof[0]} (ID  0)"
                    )
        else:
            return fail(argv, f"nvidia-smi mig: unsupported on the simulated host: {' '.join(args)}\n")
    save(system, STATE, gpus)
    return ok(argv, "\n".join(out) + "\n")


def nvidia_smi(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    """A complete fake where no inventory fake is registered: the host subcommands only."""
    res = handle(system, argv, stdin)
    if res is None:
        return fail(argv, "nvidia-smi: only host-settings subcommands are simulated here\n", 2)
    return res
