"""The simulated host's GPUs: state in `<root>/var/lib/bcd-sim/gpus.json`, and its seeder.

`seed_gpus(root)` writes an HGX-like node: 8 NVIDIA H200 (143771 MiB, driver 590.48.01), GPUs 0-3
on NUMA node 0 and 4-7 on node 1, ECC on, no row remaps pending. GPU 7 has MIG enabled with four
instances (3g.71gb gi1, 2g.35gb gi2, 1g.18gb gi3 and gi4, each with compute instance 0). It also
writes what the kernel and the toolkit would show: `/sys/bus/pci/devices/<bus>/numa_node`,
`/dev/nvidia<N>` placeholders and NVIDIA's CDI spec `/etc/cdi/nvidia.json` in the JSON shape
`nvidia-ctk cdi generate --device-name-strategy=index --device-name-strategy=uuid` writes
(devices by index `0`, `7:0` and by UUID, an `all` device, common edits with
`NVIDIA_VISIBLE_DEVICES=void`; the values follow the 575-era spec quoted in docker/buildx#3295).

The fake `nvidia-smi` (nvidia_smi.py) reads and changes this state; other fakes (for instance the
host engineer's `mig` subcommands) use `load_state`/`save_state`. The state is plain JSON so that a
person can read and edit it; tests change it through `update_state`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bcd_shared.system import LocalSystem, atomic_write

STATE_PATH = "/var/lib/bcd-sim/gpus.json"
DRIVER_VERSION = "590.48.01"
CUDA_VERSION = "13.1"
H200_MEMORY_MIB = 143771
GPU_COUNT = 8

# H200 MIG profiles (name -> (GPU instance profile id, slices, memory MiB)), as `mig -lgip` lists them.
H200_GI_PROFILES: dict[str, tuple[int, int, int]] = {
    "1g.18gb": (19, 1, 16384),
    "1g.35gb": (15, 1, 32512),
    "2g.35gb": (14, 2, 32512),
    "3g.71gb": (9, 4, 69376),
    "4g.71gb": (5, 4, 69376),
    "7g.141gb": (0, 8, 140032),
}

State = dict[str, Any]


def gpu_uuid(index: int) -> str:
    return f"GPU-5f1c2a90-0000-4000-8000-{index + 1:012x}"


def mig_uuid(gpu_index: int, gi: int, ci: int) -> str:
    return f"MIG-7a3e0c55-{gpu_index:04x}-5{gi:03x}-8{ci:03x}-{gpu_index * 256 + gi * 16 + ci:012x}"


def bus_id(index: int) -> str:
    buses = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
    return f"00000000:{buses[index]:02X}:00.0"


def make_mig(gpu_index: int, profile: str, gi: int, ci: int = 0, placement_start: int = 0) -> dict[str, Any]:
    pid, size, mem = H200_GI_PROFILES[profile]
    return {
        "gpu_instance": gi,
        "compute_instance": ci,
        "profile": profile,
        "gi_profile_id": pid,
        "ci_profile_id": 0,
        "placement": f"{placement_start}:{size}",
        "memory_mib": mem,
        "uuid": mig_uuid(gpu_index, gi, ci),
    }


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
        for n, m in enumerate(g["migs"]):
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
