"""The cores of `inventory.refresh` and `diag.nvml`: collect, convert to the wire, hash.

`collect_inventory(system)` reads GPUs (gpus.collect_gpus), /proc/meminfo, huge page pools (host-wide
and per NUMA node), NUMA nodes (cpulist, MemTotal), the CPU count and the CPUs the kernel isolates
(/sys/devices/system/cpu/isolated), and returns the wire `Inventory`; `inventory_hash` is the digest
heartbeats carry (NodeHeartbeat.inventory_hashes["inventory"]): SHA-256 over the GPU inventory's
canonical JSON and the host facts, so it changes with any fact and not with the order tools print
them. `SystemInventoryCollector` is the `bcd_agent.kinds.inventory.InventoryCollector` the
dispatcher's handler takes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import trio
from bcd_shared import wire
from bcd_shared.system import System

from bcd_agent.inventory.gpus import GpuInventory, collect_gpus
from bcd_agent.inventory.host import HUGEPAGE_SIZES_KB, parse_cpulist, parse_meminfo


def _int(system: System, path: str) -> int:
    text = system.read_text(path)
    try:
        return int(text.strip()) if text else 0
    except ValueError:
        return 0


def gpus_to_wire(inv: GpuInventory) -> list[wire.GpuInfo]:
    return [
        wire.GpuInfo(
            uuid=g.uuid,
            index=g.index,
            name=g.name,
            pci_bus_id=g.bus_id,
            memory_bytes=(g.memory_mib or 0) * 1024 * 1024,
            numa_node=-1 if g.numa_node is None else g.numa_node,
            mig_enabled=g.mig_enabled,
            mig_devices=[
                wire.MigDeviceInfo(
                    uuid=m.uuid or "",
                    gpu_instance=m.gpu_instance,
                    compute_instance=m.compute_instance,
                    profile=m.profile,
                )
                for m in g.migs
            ],
            ecc_uncorrectable_volatile=g.health.ecc_uncorrected_volatile,
            row_remap_pending=g.health.remap_pending,
            row_remap_failed=g.health.remap_failure,
        )
        for g in inv.gpus
    ]


def collect_inventory(system: System, gpus: GpuInventory | None = None) -> wire.Inventory:
    inv = gpus if gpus is not None else collect_gpus(system)
    meminfo = parse_meminfo(system.read_text("/proc/meminfo") or "")
    nodes_text = system.read_text("/sys/devices/system/node/online") or ""
    nodes = parse_cpulist(nodes_text) if nodes_text.strip() else ()
    numa = []
    for n in nodes:
        base = f"/sys/devices/system/node/node{n}"
        node_mem = parse_meminfo(
            "\n".join(
                line.split(" ", 2)[2]
                for line in (system.read_text(f"{base}/meminfo") or "").splitlines()
                if line
            )
        )
        numa.append(
            wire.NumaNode(
                id=n,
                cpus=(system.read_text(f"{base}/cpulist") or "").strip(),
                memory_bytes=node_mem.get("MemTotal", 0) * 1024,
            )
        )
    pools = []
    for size in HUGEPAGE_SIZES_KB:
        base = f"/sys/kernel/mm/hugepages/hugepages-{size}kB"
        if not system.exists(base):
            continue
        pools.append(
            wire.HugepagePool(
                page_size_bytes=size * 1024,
                numa_node=-1,
                total=_int(system, f"{base}/nr_hugepages"),
                free=_int(system, f"{base}/free_hugepages"),
                reserved=_int(system, f"{base}/resv_hugepages"),
            )
        )
        for n in nodes:
            nb = f"/sys/devices/system/node/node{n}/hugepages/hugepages-{size}kB"
            pools.append(
                wire.HugepagePool(
                    page_size_bytes=size * 1024,
                    numa_node=n,
                    total=_int(system, f"{nb}/nr_hugepages"),
                    free=_int(system, f"{nb}/free_hugepages"),
                )
            )
    cpus_text = system.read_text("/sys/devices/system/cpu/online") or ""
    return wire.Inventory(
        gpus=gpus_to_wire(inv),
        numa_nodes=numa,
        mem_total_bytes=meminfo.get("MemTotal", 0) * 1024,
        hugepages=pools,
        cpu_count=len(parse_cpulist(cpus_text)) if cpus_text.strip() else 0,
        driver_version=inv.driver_version or "",
        isolated_cpus=(system.read_text("/sys/devices/system/cpu/isolated") or "").strip(),
    )


def inventory_hash(inventory: wire.Inventory) -> str:
    """A stable digest of the inventory's facts (the dict form, sorted keys, compact)."""
    body = json.dumps(inventory.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(body).hexdigest()


def refresh_result(system: System) -> wire.InventoryRefreshResult:
    inv = collect_inventory(system)
    return wire.InventoryRefreshResult(inventory=inv, inventory_hash=inventory_hash(inv))


class SystemInventoryCollector:
    """`InventoryCollector` over a System; `publish` gets each fresh result (status, heartbeat hash)."""

    def __init__(
        self, system: System, publish: Callable[[wire.InventoryRefreshResult], None] = lambda _r: None
    ):
        self.system = system
        self.publish = publish

    async def refresh(self) -> wire.InventoryRefreshResult:
        result = await trio.to_thread.run_sync(refresh_result, self.system)
        self.publish(result)
        return result


def diag_nvml(system: System) -> wire.DiagNvmlResult:
    """`diag.nvml`: each GPU's health from a fresh inventory (ECC and row remapping, DEV-BUSY-10)."""
    inv = collect_gpus(system)
    out = []
    for g in inv.gpus:
        h = g.health
        problems = []
        if (h.ecc_uncorrected_volatile or 0) > 0:
            problems.append(f"{h.ecc_uncorrected_volatile} uncorrectable volatile ECC errors")
        if h.remap_pending:
            problems.append("a row remap is pending")
        if h.remap_failure:
            problems.append("a row remap failed")
        out.append(
            wire.GpuHealth(
                uuid=g.uuid,
                healthy=h.healthy,
                ecc_uncorrectable_volatile=h.ecc_uncorrected_volatile,
                row_remap_pending=h.remap_pending,
                row_remap_failed=h.remap_failure,
                message="; ".join(problems),
            )
        )
    return wire.DiagNvmlResult(gpus=out)


def nvml_available(system: System) -> bool:
    """Whether nvidia-smi answered (the `nvml` Hello capability, DEV-CAP-02)."""
    return collect_gpus(system).nvml


def hello_capabilities(inventory: GpuInventory, privileged: bool) -> tuple[str, ...]:
    """Capabilities the devices side advertises (DEV-CAP-01/02, DEV-UNPRIV-02): on a GPU host,
    `cdi`, `devices.limits` and `binding.kubernetes` unless unprivileged; `nvml` when nvidia-smi answered."""
    caps: list[str] = []
    if inventory.gpus and privileged:
        caps += ["cdi", "devices.limits", "binding.kubernetes"]
    if inventory.nvml:
        caps.append("nvml")
    return tuple(caps)


def is_unprivileged(*, fakehw: bool, mode: str, helper_socket: str | None, euid: int | None = None) -> bool:
    """`Options.Unprivileged` (DEV-UNPRIV-01): not fakehw, mode node, euid not 0, no [helper] socket."""
    uid = os.geteuid() if euid is None else euid
    return not fakehw and mode == "node" and uid != 0 and not helper_socket
