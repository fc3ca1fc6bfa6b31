"""The simulated host's GPUs: ONE state in `<root>/var/lib/bcd-sim/gpus.json`, and its seeder.

Every area reads and changes the same GPUs: the devices inventory (`-L`, `--query-gpu`, `-q -x`),
the host units (power limit, ECC, persistence and compute mode, clocks, MIG mode and instances)
and the busy checks. There is no second GPU state anywhere on the simulated host.

`seed_gpus(root)` writes an HGX-like node: 8 NVIDIA H200 (143771 MiB, driver 590.48.01), GPUs 0-3
on NUMA node 0 and 4-7 on node 1, ECC on, no row remaps pending, persistence mode on, power limit
700 W in a 200-700 W range (the values of the reference capture
`csv/h200_mig_590.48.01_query-gpu_idle.csv`). GPU 7 has MIG enabled with four
instances (3g.71gb gi1, 2g.35gb gi2, 1g.18gb gi3 and gi4, each with compute instance 0). It also
writes what the kernel and the toolkit would show: `/sys/bus/pci/devices/<bus>/numa_node`,
`/dev/nvidia<N>` placeholders and NVIDIA's CDI spec `/etc/cdi/nvidia.json` in the JSON shape
`nvidia-ctk cdi generate --device-name-strategy=index --device-name-strategy=uuid` writes
(devices by index `0`, `7:0` and by UUID, an `all` device, common edits with
`NVIDIA_VISIBLE_DEVICES=void`; the values follow the 575-era spec quoted in docker/buildx#3295).

Per GPU: identity (index, uuid, name, serial, bus id, minor, NUMA node, memory), health (ECC
counters, row remaps, `reset_supported`), settings (`power_limit` / `power_default` / `power_min` /
`power_max`, `ecc_enabled` (current) / `ecc_pending`, `persistence_mode`, `compute_mode`,
`locked_clocks`), MIG (`mig_enabled` current / `mig_pending`, `mig_needs_reset`: a mode change waits
for a GPU reset, as on Ampere) and `migs`: one entry per compute instance, each carrying its GPU
instance (`gpu_instance`, `profile`, `gi_profile_id`, `placement` "start:size" in memory slices,
`memory_mib`) and its compute instance (`compute_instance`, `ci_profile_id`, `ci_profile`, `uuid`);
a GPU instance without a compute instance is one entry whose `compute_instance` is null (it shows in
`mig -lgi`, not in `-L`). `processes` are compute processes (`pid`, `name`, `used_mib`, optional
`gpu_instance` / `compute_instance`): a GPU with processes is "in use by another client".

The fake `nvidia-smi` (nvidia_smi.py, with the host subcommands of nvidia_host.py wired in through
its EXTENSIONS table) reads and changes this state; other fakes use `load_state`/`save_state`. The
state is plain JSON so that a person can read and edit it; tests change it through `update_state`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import frozen
from bcd_shared.system import LocalSystem, atomic_write

STATE_PATH = "/var/lib/bcd-sim/gpus.json"
DRIVER_VERSION = "590.48.01"
CUDA_VERSION = "13.1"
H200_MEMORY_MIB = 143771
GPU_COUNT = 8

POWER_MIN_W, POWER_MAX_W, POWER_DEFAULT_W = 200.0, 700.0, 700.0
MEMORY_SLICES = 8  # Hopper: 8 memory slices, 7 compute slices
COMPUTE_SLICES = 7


@frozen
class GiProfile:
    """A GPU instance profile as `mig -lgip` lists it (H100/H200 placement rules)."""

    name: str
    id: int
    compute: int  # compute slices
    memory: int  # memory slices (the placement size)
    starts: tuple[int, ...]  # allowed placement starts, in the order the driver tries them
    memory_mib: int
    single: bool = False  # +me profiles: one per GPU (the media engines)

    @property
    def ci_profile_id(self) -> int:
        """The compute instance profile id of a CI that fills the GPU instance (A100/H100 numbering)."""
        return {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[self.compute]


# H200 MIG profiles, in `mig -lgip` order. Placement rules as on H100 80GB (same slice layout);
# memory from the devices engineer's H200 numbers.
H200_PROFILES: tuple[GiProfile, ...] = (
    GiProfile("1g.18gb", 19, 1, 1, (0, 1, 2, 3, 4, 5, 6), 16384),
    GiProfile("1g.18gb+me", 20, 1, 1, (0, 1, 2, 3, 4, 5, 6), 16384, single=True),
    GiProfile("1g.35gb", 15, 1, 2, (0, 2, 4, 6), 32512),
    GiProfile("2g.35gb", 14, 2, 2, (0, 2, 4), 32512),
    GiProfile("3g.71gb", 9, 3, 4, (4, 0), 69376),  # upper half first: see nvidia_host.py
    GiProfile("4g.71gb", 5, 4, 4, (0,), 69376),
    GiProfile("7g.141gb", 0, 7, 8, (0,), 140032),
)
PROFILES_BY_NAME = {p.name: p for p in H200_PROFILES}
# name -> (GPU instance profile id, memory slices, memory MiB): the older table, kept for callers.
H200_GI_PROFILES: dict[str, tuple[int, int, int]] = {
    p.name: (p.id, p.memory, p.memory_mib) for p in H200_PROFILES
}
# CUDA version nvidia-smi shows per driver branch (reference captures: 580 -> 13.0, 590 -> 13.1).
CUDA_BY_BRANCH = {"535": "12.2", "550": "12.4", "570": "12.8", "580": "13.0", "590": "13.1"}

State = dict[str, Any]


def gpu_uuid(index: int) -> str:
    return f"GPU-5f1c2a90-0000-4000-8000-{index + 1:012x}"


def mig_uuid(gpu_index: int, gi: int, ci: int, serial: int = 0) -> str:
    """A MIG device's UUID; `serial` tells apart instances created again with the same ids."""
    tail = (serial << 16) + gpu_index * 256 + gi * 16 + ci
    return f"MIG-7a3e0c55-{gpu_index:04x}-5{gi:03x}-8{ci:03x}-{tail:012x}"


def bus_id(index: int) -> str:
    buses = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
    return f"00000000:{buses[index]:02X}:00.0"


def make_mig(
    gpu_index: int,
    profile: str,
    gi: int,
    ci: int | None = 0,
    placement_start: int = 0,
    serial: int = 0,
) -> dict[str, Any]:
    """One `migs` entry: GPU instance `gi` of `profile` with compute instance `ci` filling it
    (`ci=None`: a GPU instance without a compute instance)."""
    p = PROFILES_BY_NAME[profile]
    return {
        "gpu_instance": gi,
        "compute_instance": ci,
        "profile": profile,
        "gi_profile_id": p.id,
        "ci_profile_id": None if ci is None else p.ci_profile_id,
        "ci_profile": None if ci is None else profile,
        "placement": f"{placement_start}:{p.memory}",
        "memory_mib": p.memory_mib,
        "uuid": None if ci is None else mig_uuid(gpu_index, gi, ci, serial),
    }


def mig_devices(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU's MIG devices (compute instances) in the driver's order, as `-L` numbers them."""
    if not gpu["mig_enabled"]:
        return []
    cis = [m for m in gpu["migs"] if m["compute_instance"] is not None]
    return sorted(cis, key=lambda m: (m["gpu_instance"], m["compute_instance"]))


def gpu_instances(gpu: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per GPU instance (its first compute instance, or its bare entry), by GI id."""
    seen: dict[int, dict[str, Any]] = {}
    for m in sorted(gpu["migs"], key=lambda m: (m["gpu_instance"], m["compute_instance"] or 0)):
        seen.setdefault(m["gpu_instance"], m)
    return list(seen.values())


def default_gpu(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": gpu_uuid(index),
        "name": "NVIDIA H200",
        "serial": f"165102400{index:04d}",
        "bus_id": bus_id(index),
        "numa_node": 0 if index < GPU_COUNT // 2 else 1,
        "minor": index,
        "memory_mib": H200_MEMORY_MIB,
        "mig_enabled": False,
        "mig_pending": False,
        "migs": [],
        "ecc_enabled": True,
        "ecc_pending": True,
        "persistence_mode": True,
        "compute_mode": "Default",
        "power_limit": POWER_DEFAULT_W,
        "power_default": POWER_DEFAULT_W,
        "power_min": POWER_MIN_W,
        "power_max": POWER_MAX_W,
        "locked_clocks": None,  # [min, max] MHz after `-lgc`
        "mig_needs_reset": False,
        "ecc_uncorrected_volatile": 0,
        "ecc_uncorrected_aggregate": 0,
        "remap_pending": False,
        "remap_failure": False,
        "processes": [],  # {"pid", "name", "used_mib", optional "gpu_instance"/"compute_instance"}
        "reset_supported": True,
        "reset_count": 0,
    }


def default_state() -> State:
    gpus = [default_gpu(i) for i in range(GPU_COUNT)]
    last = gpus[-1]
    last["mig_enabled"] = last["mig_pending"] = True
    last["migs"] = [
        make_mig(7, "3g.71gb", 1, 0, 0),
        make_mig(7, "2g.35gb", 2, 0, 4),
        make_mig(7, "1g.18gb", 3, 0, 6),
        make_mig(7, "1g.18gb", 4, 0, 7),
    ]
    return {"driver_version": DRIVER_VERSION, "cuda_version": CUDA_VERSION, "gpus": gpus}


def _host(root: Path, path: str) -> Path:
    return Path(root) / path.lstrip("/")


def read_state_file(root: Path) -> State:
    data: State = json.loads(_host(root, STATE_PATH).read_text())
    return data


def write_state_file(root: Path, state: State) -> None:
    atomic_write(_host(root, STATE_PATH), (json.dumps(state, indent=2) + "\n").encode())


def load_state(system: LocalSystem) -> State | None:
    data = system.read_bytes(STATE_PATH)
    if data is None:
        return None
    state: State = json.loads(data)
    return state


def save_state(system: LocalSystem, state: State) -> None:
    system.write_atomic(STATE_PATH, (json.dumps(state, indent=2) + "\n").encode())


def update_state(root: Path, change: Callable[[State], None]) -> State:
    """Read the state, let `change` edit it in place, write it back (for tests and other fakes)."""
    state = read_state_file(root)
    change(state)
    write_state_file(root, state)
    write_host_files(root, state)
    return state


def sysfs_address(bus: str) -> str:
    domain, _, rest = bus.partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def vendor_spec(state: State) -> dict[str, Any]:
    """NVIDIA's CDI spec for these GPUs, as the toolkit generates it (see the module docstring)."""
    drv = state["driver_version"]
    devices: list[dict[str, Any]] = []
    for g in state["gpus"]:
        edits = {"deviceNodes": [{"path": f"/dev/nvidia{g['minor']}"}, {"path": "/dev/dri/card1"}]}
        devices.append({"name": str(g["index"]), "containerEdits": edits})
        devices.append({"name": g["uuid"], "containerEdits": edits})
        for n, m in enumerate(mig_devices(g)):
            cap = 2 + g["minor"] * 140 + m["gpu_instance"] * 9 + m["compute_instance"]
            medits = {
                "deviceNodes": [
                    {"path": f"/dev/nvidia{g['minor']}"},
                    {"path": f"/dev/nvidia-caps/nvidia-cap{cap - 1}"},
                    {"path": f"/dev/nvidia-caps/nvidia-cap{cap}"},
                ]
            }
            devices.append({"name": f"{g['index']}:{n}", "containerEdits": medits})
            devices.append({"name": m["uuid"], "containerEdits": medits})
    devices.append(
        {
            "name": "all",
            "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{g['minor']}"} for g in state["gpus"]]},
        }
    )
    libs = ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so")
    return {
        "cdiVersion": "0.7.0",
        "kind": "nvidia.com/gpu",
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_CTK_DEBUG=false", "NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [
                {"path": "/dev/nvidiactl"},
                {"path": "/dev/nvidia-uvm"},
                {"path": "/dev/nvidia-uvm-tools"},
            ],
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-cdi-hook",
                    "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"],
                    "env": ["NVIDIA_CTK_DEBUG=false"],
                }
            ],
            "mounts": [
                {
                    "hostPath": f"/usr/lib/x86_64-linux-gnu/{lib}.{drv}",
                    "containerPath": f"/usr/lib/x86_64-linux-gnu/{lib}.{drv}",
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
                }
                for lib in libs
            ],
            "additionalGids": [44],
        },
    }


def write_host_files(root: Path, state: State) -> None:
    """What the kernel and the toolkit show for these GPUs: sysfs NUMA nodes, /dev nodes, nvidia.json."""
    for g in state["gpus"]:
        atomic_write(
            _host(root, f"/sys/bus/pci/devices/{sysfs_address(g['bus_id'])}/numa_node"),
            f"{g['numa_node']}\n".encode(),
        )
        dev = _host(root, f"/dev/nvidia{g['minor']}")
        if not dev.exists():
            atomic_write(dev, b"")
    atomic_write(
        _host(root, "/etc/cdi/nvidia.json"), (json.dumps(vendor_spec(state), indent=2) + "\n").encode()
    )


def seed_gpus(root: Path) -> None:
    """The SEEDERS entry: write the GPU state and host files once (a seeded host keeps its state)."""
    if _host(root, STATE_PATH).exists():
        return
    state = default_state()
    write_state_file(root, state)
    write_host_files(root, state)
