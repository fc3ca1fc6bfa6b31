"""The GPU inventory: what nvidia-smi and sysfs say about the node's GPUs, as frozen values.

`collect_gpus(system)` runs `nvidia-smi -L` (UUIDs, MIG UUIDs), `nvidia-smi --query-gpu=…
--format=csv,noheader` (bus ids, memory, MIG mode, ECC and row remapping) and `nvidia-smi -q -x`
(each MIG device's GPU and compute instance ids, ECC counters, row remapping) and reads each GPU's
NUMA node from `/sys/bus/pci/devices/<bus>/numa_node`. `build_inventory` is the pure join of those
outputs, so tests feed it real captures.

A MIG device is keyed by `(gpu instance, compute instance)`; its `MIG-…` UUID comes from `-L`, matched
through the MIG device index that both `-L` ("Device <n>") and `-q -x` (`<index>`) print. Health is
taken from `-q -x` when it answered, else from the CSV. Without nvidia-smi there are no GPUs and
`nvml` is False.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from attrs import asdict, frozen
from bcd_shared import nvsmi
from bcd_shared.system import System

NVIDIA_SMI = "nvidia-smi"
TOOL_TIMEOUT_S = 60.0


@frozen
class MigDevice:
    gpu_instance: int
    compute_instance: int
    uuid: str | None  # MIG-…, from -L; None when -L gave it none
    profile: str = ""
    index: int = -1

    @property
    def key(self) -> str:
        return f"gi{self.gpu_instance}/ci{self.compute_instance}"


@frozen
class GpuHealth:
    """What `gpu.reset` judges health by; None fields: the GPU (or the host's tools) did not say."""

    ecc_uncorrected_volatile: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None

    @property
    def healthy(self) -> bool:
        """No uncorrectable volatile ECC errors and no pending or failed row remap (DEV-BUSY-10)."""
        return not (
            (self.ecc_uncorrected_volatile or 0) > 0
            or self.remap_pending is True
            or self.remap_failure is True
        )


@frozen
class Gpu:
    index: int
    uuid: str
    name: str
    bus_id: str  # nvidia-smi's form, 00000000:53:00.0
    numa_node: int | None
    minor: int | None
    memory_mib: int | None
    mig_enabled: bool
    migs: tuple[MigDevice, ...]
    health: GpuHealth

    def mig(self, gpu_instance: int, compute_instance: int) -> MigDevice | None:
        for m in self.migs:
            if m.gpu_instance == gpu_instance and m.compute_instance == compute_instance:
                return m
        return None


@frozen
class GpuInventory:
    gpus: tuple[Gpu, ...]
    driver_version: str | None = None
    nvml: bool = False  # nvidia-smi answered
    errors: tuple[str, ...] = ()  # what could not be read (a tool failed, a parse error)

    def by_uuid(self) -> Mapping[str, Gpu]:
        return {g.uuid: g for g in self.gpus}

    def gpu(self, uuid: str) -> Gpu | None:
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        return None

    def to_json(self) -> dict[str, Any]:
        return asdict(self, recurse=True)

    def hash(self) -> str:
        """A stable digest of what the inventory says (heartbeats carry it; it changes with any fact)."""
        body = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(body).hexdigest()


def sysfs_pci_address(bus_id: str) -> str:
    """nvidia-smi's `00000000:53:00.0` as sysfs names it: `0000:53:00.0` (lower case)."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def build_inventory(
    listed: tuple[nvsmi.ListedGpu, ...],
    queried: tuple[nvsmi.QueriedGpu, ...],
    qx: nvsmi.QxLog | None,
    numa: Mapping[str, int | None],
    errors: tuple[str, ...] = (),
) -> GpuInventory:
    """Join the outputs (pure). `numa` maps bus id to NUMA node."""
    by_uuid_q = {q.uuid: q for q in queried}
    by_uuid_x = {x.uuid: x for x in qx.gpus} if qx else {}
    gpus: list[Gpu] = []
    for lg in listed:
        q = by_uuid_q.get(lg.uuid)
        x = by_uuid_x.get(lg.uuid)
        migs = [
            MigDevice(r.gpu_instance, r.compute_instance, r.uuid, r.profile, r.index)
            for r in nvsmi.join_migs(lg, x)
        ]
        bus = (q.bus_id if q else None) or (x.bus_id if x else "")
        if x is not None:
            health = GpuHealth(x.ecc_uncorrected_volatile, x.remap_pending, x.remap_failure)
        elif q is not None:
            health = GpuHealth(q.ecc_uncorrected_volatile, q.remap_pending, q.remap_failure)
        else:
            health = GpuHealth()
        gpus.append(
            Gpu(
                index=lg.index,
                uuid=lg.uuid,
                name=lg.name,
                bus_id=bus,
                numa_node=numa.get(bus),
                minor=x.minor if x else None,
                memory_mib=(q.memory_mib if q else None) or (x.memory_mib if x else None),
                mig_enabled=(q.mig_enabled if q else False) or (x.mig_enabled if x else False),
                migs=tuple(migs),
                health=health,
            )
        )
    driver = (qx.driver_version if qx else None) or next(
        (q.driver_version for q in queried if q.driver_version), None
    )
    return GpuInventory(gpus=tuple(gpus), driver_version=driver, nvml=True, errors=errors)


def read_numa_node(system: System, bus_id: str) -> int | None:
    text = system.read_text(f"/sys/bus/pci/devices/{sysfs_pci_address(bus_id)}/numa_node")
    if text is None:
        return None
    try:
        node = int(text.strip())
    except ValueError:
        return None
    return node if node >= 0 else None


def collect_gpus(system: System) -> GpuInventory:
    """Run nvidia-smi and read sysfs. A missing nvidia-smi is an inventory without GPUs."""
    listing = system.run([NVIDIA_SMI, "-L"], timeout=TOOL_TIMEOUT_S)
    if listing.returncode == 127:
        return GpuInventory(gpus=(), nvml=False)
    if not listing.ok:
        # "No devices were found" exits 6; either way there is nothing to hold.
        return GpuInventory(gpus=(), nvml=False, errors=(listing.describe(),))
    errors: list[str] = []
    try:
        listed = nvsmi.parse_list(listing.stdout.decode())
    except nvsmi.NvsmiParseError as exc:
        return GpuInventory(gpus=(), nvml=False, errors=(str(exc),))
    query = system.run(
        [NVIDIA_SMI, f"--query-gpu={','.join(nvsmi.QUERY_GPU_FIELDS)}", "--format=csv,noheader"],
        timeout=TOOL_TIMEOUT_S,
    )
    queried: tuple[nvsmi.QueriedGpu, ...] = ()
    if query.ok:
        try:
            queried = nvsmi.queried_gpus(nvsmi.parse_csv(query.stdout.decode(), nvsmi.QUERY_GPU_FIELDS))
        except nvsmi.NvsmiParseError as exc:
            errors.append(str(exc))
    else:
        errors.append(query.describe())
    qx_run = system.run([NVIDIA_SMI, "-q", "-x"], timeout=TOOL_TIMEOUT_S)
    qx: nvsmi.QxLog | None = None
    if qx_run.ok:
        try:
            qx = nvsmi.parse_qx(qx_run.stdout)
        except nvsmi.NvsmiParseError as exc:
            errors.append(str(exc))
    else:
        errors.append(qx_run.describe())
    buses = {q.bus_id for q in queried} | ({x.bus_id for x in qx.gpus} if qx else set())
    numa = {bus: read_numa_node(system, bus) for bus in buses}
    return build_inventory(listed, queried, qx, numa, tuple(errors))
