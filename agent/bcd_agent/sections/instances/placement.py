"""Placement and host admission of instance starts: pure functions of the spec and host facts.

Placement (DLV-PLC-01..06; decisions in docs/instances.md, Q-DLV-PLC-01/02): `cpus` is a cpulist of
at least as many online CPUs as vCPUs; `mems` NUMA nodes this host has; a huge page size of 2 MiB or
1 GiB that this host has a pool of, with the memory a whole number of pages; never a balloon with huge
pages. The instance is pinned (`vcpupin`, one CPU per vCPU) when `cpus` has exactly as many CPUs as
vCPUs, and floats over the set (`cpuset`) otherwise. Checked before anything is created; a placement
the host cannot apply fails the instance.

Admission (DLV-ADM-01..16): a start of a domain that is not running is admitted against
`MemTotal - Hugetlb - 1 GiB`, less memory + overhead (memory/32 + 256 MiB) of every running or paused
managed domain on normal pages (only the overhead for one on huge pages), less the bound holds'
memory limits, less the starts admitted earlier in the same pass. An instance on huge pages also needs
its pages free on its NUMA nodes (or host-wide without `mems`) and no more than the host-wide free
count. A refusal is `ResourcesExhausted: ...`, never ERROR; the full configured memory is charged.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import define, field, frozen

from bcd_agent.inventory.host import HostMemory, parse_cpulist
from bcd_agent.sections.instances.model import HUGE_1G, HUGE_2M, InstanceSpec

MIB = 1024 * 1024


@frozen
class HostFacts:
    online_cpus: frozenset[int]
    numa_nodes: frozenset[int]
    hugepage_sizes: frozenset[int]  # bytes


@frozen
class CpuPlacement:
    cpus: tuple[int, ...]
    pinned: bool


def check_placement(inst: InstanceSpec, host: HostFacts) -> str | None:
    """The placement's failure message, or None when the host can apply it (pure)."""
    pl = inst.placement
    if pl is None:
        return None
    if pl.cpus:
        try:
            cpus = parse_cpulist(pl.cpus)
        except ValueError as exc:
            return f"placement.cpus: {exc}"
        if len(cpus) < inst.vcpus:
            return f"placement.cpus: {len(cpus)} CPUs for {inst.vcpus} vCPUs"
        missing = sorted(set(cpus) - host.online_cpus)
        if missing:
            return f"placement.cpus: CPUs {missing[:16]} are not online on this host"
    if pl.mems:
        try:
            mems = parse_cpulist(pl.mems)
        except ValueError as exc:
            return f"placement.mems: {exc}"
        missing = sorted(set(mems) - host.numa_nodes)
        if missing:
            return f"placement.mems: NUMA nodes {missing[:16]} do not exist on this host"
    size = pl.hugepage_size_bytes
    if size:
        if size not in (HUGE_2M, HUGE_1G):
            return f"placement.hugepage_size_bytes: {size} is neither 2 MiB nor 1 GiB"
        if inst.memory_bytes % size:
            return f"placement: memory {inst.memory_bytes} bytes is not whole {size // MIB} MiB pages"
        if size not in host.hugepage_sizes:
            return f"placement: this host has no {size // MIB} MiB huge page pool"
        if pl.balloon:
            return "placement: a balloon is never used with huge pages"
    return None


def cpu_placement(inst: InstanceSpec) -> CpuPlacement | None:
    """Q-DLV-PLC-01: pinned when `cpus` has exactly one CPU per vCPU, floating otherwise."""
    if inst.placement is None or not inst.placement.cpus:
        return None
    cpus = parse_cpulist(inst.placement.cpus)
    return CpuPlacement(cpus, pinned=len(cpus) == inst.vcpus)


def overhead_bytes(memory_bytes: int) -> int:
    """The VMM overhead charged per domain (DLV-ADM-05)."""
    return memory_bytes // 32 + 256 * MIB


def committed_bytes(memory_bytes: int, hugepages: int) -> int:
    """What a running or paused domain takes from normal memory (DLV-ADM-06/11)."""
    return overhead_bytes(memory_bytes) + (0 if hugepages else memory_bytes)


@frozen
class HeldPages:
    """Huge pages a bound hold may still take (its limit less what its slice has faulted in): the
    kernel still counts them free, but they were promised to the hold (DEV-ADM-17)."""

    size_bytes: int
    pages: int
    nodes: tuple[int, ...] = ()  # the hold's memory nodes; () for none (host-wide only)


@define
class Admission:
    """One pass's admission ledger: what is left after the domains, the holds and earlier starts."""

    host: HostMemory | None
    left_bytes: int = 0
    # size bytes -> NUMA node (None: host-wide) -> free pages
    pages_left: dict[int, dict[int | None, int]] = field(factory=dict)
    held_pages: tuple[HeldPages, ...] = ()

    @classmethod
    def open(
        cls,
        host: HostMemory | None,
        domains_committed: int,
        holds_bytes: int,
        held_pages: tuple[HeldPages, ...] = (),
    ) -> Admission:
        if host is None:
            return cls(None)
        pages: dict[int, dict[int | None, int]] = {}
        for size_kb, pool in host.pools.items():
            per: dict[int | None, int] = {n: c for n, c in pool.per_node_free.items()}
            per[None] = pool.free
            pages[size_kb * 1024] = per
        left = host.normal_available_bytes - domains_committed - holds_bytes
        return cls(host, left, pages, held_pages)

    def admit(self, inst: InstanceSpec) -> str | None:
        """None when the start fits (and is then charged), else the ResourcesExhausted message."""
        if self.host is None:
            return None
        need = committed_bytes(inst.memory_bytes, inst.hugepages)
        if need > self.left_bytes:
            return (
                f"ResourcesExhausted: {need // MIB} MiB of memory needed, "
                f"{max(0, self.left_bytes) // MIB} MiB left on this host"
            )
        size = inst.hugepages
        take: list[tuple[int | None, int]] = []
        if size:
            pages = inst.memory_bytes // size
            pool: Mapping[int | None, int] = self.pages_left.get(size, {})
            # The holds' promised pages, as the devices section counts them against a new hold: all of
            # them host-wide, and on the placement's nodes those of holds on any of those nodes.
            held = [h for h in self.held_pages if h.size_bytes == size]
            host_free = pool.get(None, 0) - sum(h.pages for h in held)
            nodes = parse_cpulist(inst.placement.mems) if inst.placement and inst.placement.mems else ()
            node_free = (
                sum(pool.get(n, 0) for n in nodes) - sum(h.pages for h in held if set(h.nodes) & set(nodes))
                if nodes
                else host_free
            )
            free = min(node_free, host_free)
            if pages > free:
                return (
                    f"ResourcesExhausted: {pages} hugepages of {size // 1024} KiB needed, {max(0, free)} free"
                )
            left = pages
            for n in nodes:
                got = min(left, pool.get(n, 0))
                take.append((n, got))
                left -= got
            take.append((None, pages))
        self.left_bytes -= need
        for node, count in take:
            self.pages_left[size][node] -= count
        return None
