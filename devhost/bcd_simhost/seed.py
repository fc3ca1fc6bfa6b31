"""Seed a simulated host directory: the base layout every area of bcd reads.

The base host: Debian 12, 2 NUMA nodes with 256 GiB each, 2 MiB and 1 GiB hugepage pools, a boot
id. Areas add their own state through SEEDERS (the GPUs, for instance, come from the devices
fixtures). Seeding is idempotent: files that exist are left alone, so a seeded directory keeps
what bcd and the fakes wrote into it.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable
from pathlib import Path

from bcd_shared.system import atomic_write

# Extra seeders by area: "module:function" under bcd_simhost, each `f(root: Path) -> None`.
SEEDERS: list[str] = [
    "gpus:seed_gpus",
    "hostseed:seed_host",
]

NUMA_NODES = 2
NODE_MEM_KB = 256 * 1024 * 1024  # 256 GiB per NUMA node
CPUS_PER_NODE = 32

OS_RELEASE = """PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"
NAME="Debian GNU/Linux"
VERSION_ID="12"
VERSION="12 (bookworm)"
VERSION_CODENAME=bookworm
ID=debian
HOME_URL="https://www.debian.org/"
"""


def _put(root: Path, path: str, text: str, mode: int = 0o644) -> None:
    target = root / path.lstrip("/")
    if not target.exists():
        atomic_write(target, text.encode(), mode)


def _meminfo(total_kb: int, hp_2m_total: int, hp_1g_total: int) -> str:
    hugetlb_kb = hp_2m_total * 2048 + hp_1g_total * 1024 * 1024
    free_kb = total_kb - hugetlb_kb - 8 * 1024 * 1024
    rows = [
        ("MemTotal", total_kb),
        ("MemFree", free_kb),
        ("MemAvailable", free_kb + 4 * 1024 * 1024),
        ("Buffers", 512 * 1024),
        ("Cached", 4 * 1024 * 1024),
        ("CommitLimit", (total_kb - hugetlb_kb) // 2),
        ("Committed_AS", 6 * 1024 * 1024),
        ("HugePages_Total", hp_2m_total),
        ("HugePages_Free", hp_2m_total),
        ("HugePages_Rsvd", 0),
        ("HugePages_Surp", 0),
    ]
    lines = []
    for key, value in rows:
        if key.startswith("HugePages"):
            lines.append(f"{key + ':':<16}{value:>8}")
        else:
            lines.append(f"{key + ':':<16}{value:>8} kB")
    lines.append(f"{'Hugepagesize:':<16}{2048:>8} kB")
    lines.append(f"{'Hugetlb:':<16}{hugetlb_kb:>8} kB")
    return "\n".join(lines) + "\n"


def seed_base(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    # run/log/journal: journald's volatile journal, which the XID watcher looks for (the simulated
    # kernel log itself is var/lib/bcd-sim/journal/kernel.jsonl, which the fake journalctl reads).
    for d in (
        "etc/cdi",
        "run/bcd/allocations",
        "var/lib",
        "dev",
        "tmp",
        "etc/systemd/system",
        "run/log/journal",
    ):
        (root / d).mkdir(parents=True, exist_ok=True)
    _put(root, "/etc/os-release", OS_RELEASE)
    _put(root, "/proc/sys/kernel/random/boot_id", f"{uuid.uuid4()}\n")
    _put(root, "/proc/cmdline", "BOOT_IMAGE=/boot/vmlinuz-6.1.0-27-amd64 root=/dev/sda1 ro quiet\n")
    hp_2m, hp_1g = 4096, 16  # per node: 8 GiB of 2 MiB pages and 16 GiB of 1 GiB pages
    total_kb = NODE_MEM_KB * NUMA_NODES
    _put(root, "/proc/meminfo", _meminfo(total_kb, hp_2m * NUMA_NODES, hp_1g * NUMA_NODES))
    cpus = NUMA_NODES * CPUS_PER_NODE
    _put(root, "/sys/devices/system/cpu/online", f"0-{cpus - 1}\n")
    _put(root, "/sys/devices/system/node/online", f"0-{NUMA_NODES - 1}\n")
    for node in range(NUMA_NODES):
        base = f"/sys/devices/system/node/node{node}"
        first = node * CPUS_PER_NODE
        _put(root, f"{base}/cpulist", f"{first}-{first + CPUS_PER_NODE - 1}\n")
        node_meminfo = "\n".join(
            f"Node {node} {k}:{v:>12} kB"
            for k, v in (("MemTotal", NODE_MEM_KB), ("MemFree", NODE_MEM_KB // 2))
        )
        _put(root, f"{base}/meminfo", node_meminfo + "\n")
        for size_kb, count in ((2048, hp_2m), (1048576, hp_1g)):
            pool = f"{base}/hugepages/hugepages-{size_kb}kB"
            _put(root, f"{pool}/nr_hugepages", f"{count}\n")
            _put(root, f"{pool}/free_hugepages", f"{count}\n")
            _put(root, f"{pool}/surplus_hugepages", "0\n")
    for size_kb, count in ((2048, hp_2m), (1048576, hp_1g)):
        pool = f"/sys/kernel/mm/hugepages/hugepages-{size_kb}kB"
        _put(root, f"{pool}/nr_hugepages", f"{count * NUMA_NODES}\n")
        _put(root, f"{pool}/free_hugepages", f"{count * NUMA_NODES}\n")
        _put(root, f"{pool}/resv_hugepages", "0\n")
        _put(root, f"{pool}/surplus_hugepages", "0\n")


def seed(root: Path) -> None:
    """Lay out the simulated host at `root` (idempotent)."""
    seed_base(Path(root))
    for spec in SEEDERS:
        module, _, func = spec.partition(":")
        fn: Callable[[Path], None] = getattr(importlib.import_module(f"bcd_simhost.{module}"), func)
        fn(Path(root))
