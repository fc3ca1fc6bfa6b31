"""Host memory for admission: /proc/meminfo, huge page pools per size and per NUMA node.

`read_host_memory(system)` returns None when /proc/meminfo is missing, cannot be read (a read error
such as EIO or EACCES, not only a missing file) or lacks MemTotal, and when the huge page counts cannot
be read (the caller then binds without host-side admission and says so, as delivery.md's admission
rule says: "a host whose /proc/meminfo cannot be read starts without the check, with a warning").
Huge page counts come from `/sys/kernel/mm/hugepages/hugepages-<kB>kB/{free,resv}_hugepages` (host-wide) and
`/sys/devices/system/node/node<N>/hugepages/hugepages-<kB>kB/free_hugepages` (per node).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from attrs import frozen
from bcd_shared.system import System

log = logging.getLogger("bcd.devices")

KIB = 1024
MIB = 1024 * 1024
HUGEPAGE_SIZES_KB = (2048, 1048576)


class MeminfoParseError(ValueError):
    pass


def parse_meminfo(text: str) -> dict[str, int]:
    """`Key: value [kB]` lines as key -> value (kB for sized rows, a count for HugePages_*)."""
    out: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([A-Za-z0-9_()]+):\s+(\d+)(?: kB)?\s*", line)
        if m is None:
            raise MeminfoParseError(f"/proc/meminfo line {n}: {line!r}")
        out[m[1]] = int(m[2])
    return out


def parse_cpulist(text: str) -> tuple[int, ...]:
    """A kernel cpulist (`0-3,8,10-11`) as sorted ids; ValueError when malformed."""
    text = text.strip()
    if not text:
        return ()
    ids: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"{part!r} is not a cpulist element")
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        if hi < lo:
            raise ValueError(f"{part!r}: range runs backwards")
        ids.update(range(lo, hi + 1))
    return tuple(sorted(ids))


@frozen
class HugePool:
    size_kb: int
    free: int  # host-wide free_hugepages - resv_hugepages
    per_node_free: Mapping[int, int]


@frozen
class HostMemory:
    mem_total_kb: int
    hugetlb_kb: int
    pools: Mapping[int, HugePool]  # size_kb -> pool
    nodes: tuple[int, ...]

    @property
    def normal_available_bytes(self) -> int:
        """MemTotal less the whole huge page pool and 1 GiB of headroom (DEV-ADM-04)."""
        return (self.mem_total_kb - self.hugetlb_kb) * KIB - 1024 * MIB


def _int_file(system: System, path: str) -> int | None:
    text = system.read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def numa_nodes(system: System) -> tuple[int, ...]:
    text = system.read_text("/sys/devices/system/node/online")
    if text is None:
        return ()
    try:
        return parse_cpulist(text)
    except ValueError:
        return ()


def read_host_memory(system: System) -> HostMemory | None:
    try:
        return _read_host_memory(system)
    except OSError as exc:
        log.warning("devices: host memory cannot be read (%s): binding without host-side admission", exc)
        return None


def _read_host_memory(system: System) -> HostMemory | None:
    text = system.read_text("/proc/meminfo")
    if text is None:
        return None
    try:
        info = parse_meminfo(text)
    except MeminfoParseError:
        return None
    if "MemTotal" not in info:
        return None
    nodes = numa_nodes(system)
    pools: dict[int, HugePool] = {}
    for size in HUGEPAGE_SIZES_KB:
        base = f"/sys/kernel/mm/hugepages/hugepages-{size}kB"
        free = _int_file(system, f"{base}/free_hugepages")
        if free is None:
            continue
        resv = _int_file(system, f"{base}/resv_hugepages") or 0
        per_node = {}
        for node in nodes:
            n = _int_file(
                system, f"/sys/devices/system/node/node{node}/hugepages/hugepages-{size}kB/free_hugepages"
            )
            if n is not None:
                per_node[node] = n
        pools[size] = HugePool(size, max(0, free - resv), per_node)
    hugetlb = info.get("Hugetlb")
    if hugetlb is None:
        hugetlb = info.get("HugePages_Total", 0) * info.get("Hugepagesize", 0)
    return HostMemory(mem_total_kb=info["MemTotal"], hugetlb_kb=hugetlb, pools=pools, nodes=nodes)
