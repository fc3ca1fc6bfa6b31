"""A hold slice's limits in one normal form: what the spec's limits make them, and what a running slice's
cgroup files say the kernel enforces (pure).

The node's devices planner compares the two to re-apply a kept hold's changed limits (Q-DEV-PASS-01), and
root compares them before it writes a sliced hold's files (docs/helper.md, round 6b row 1): one module, so
the two never disagree on what "the slice enforces the limits" means. The helper imports it without any
agent code.

Normal form: cpulists merged (`0-3,8`), memory rounded down to the 4 KiB page as the kernel stores it,
the CPU quota as systemd's whole percent (`cpu.max` `N*1000 100000` is `N%`), huge page limits in bytes;
keys are systemd's property names (`AllowedCPUs`, `AllowedMemoryNodes`, `CPUQuota`, `MemoryMax`,
`MemoryHigh`) and the huge page file stems (`hugetlb.2MB`, `hugetlb.1GB`). A missing file or the
kernel's default (`max`, an empty cpuset) is no limit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

MEMORY_PAGE = 4096
HUGETLB_FILES = {2048: "hugetlb.2MB", 1048576: "hugetlb.1GB"}  # page size in kB -> file stem
PAGE_BYTES = {2048: 2 * 1024 * 1024, 1048576: 1024 * 1024 * 1024}
# The cgroup attribute files `applied_limits` reads, relative to the slice's cgroup directory.
LIMIT_FILES = (
    "cpuset.cpus",
    "cpuset.mems",
    "cpu.max",
    "memory.max",
    "memory.high",
    "hugetlb.2MB.max",
    "hugetlb.1GB.max",
)
# Each normal-form key: the limit it comes from (DeviceLimits' field, the helper's slice.apply field) and
# the cgroup file the kernel shows it in.
LIMIT_FIELDS: dict[str, tuple[str, str]] = {
    "AllowedCPUs": ("cpus", "cpuset.cpus"),
    "AllowedMemoryNodes": ("mems", "cpuset.mems"),
    "CPUQuota": ("cpu_millis", "cpu.max"),
    "MemoryMax": ("memory_bytes", "memory.max"),
    "MemoryHigh": ("memory_bytes", "memory.high"),
    "hugetlb.2MB": ("hugepages_2mi", "hugetlb.2MB.max"),
    "hugetlb.1GB": ("hugepages_1gi", "hugetlb.1GB.max"),
}


def canonical_cpulist(text: str) -> str | None:
    """A cpulist in the kernel's merged form (`0-3,8`), without expanding ranges; None if malformed."""
    spans: list[tuple[int, int]] = []
    for part in text.strip().split(",") if text.strip() else ():
        m = re.fullmatch(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", part.strip())
        if m is None:
            return None
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            return None
        spans.append((lo, hi))
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return ",".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in merged)


def limit_properties(
    cpus: str | None,
    mems: str | None,
    cpu_millis: int | None,
    memory_bytes: int | None,
    hugepages_2mi: int | None,
    hugepages_1gi: int | None,
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[int, int], ...]]:
    """The systemd properties and huge page limits (page size kB, bytes) that a hold's limits become: a
    property only for a limit that is set (an empty cpulist, a 0 quota or memory is none: systemd
    refuses 0%), both huge page sizes when either is booked (the other as 0, Q-DEV-SLICE-02)."""
    props: list[tuple[str, str]] = []
    if cpus:
        props.append(("AllowedCPUs", cpus))
    if mems:
        props.append(("AllowedMemoryNodes", mems))
    if cpu_millis:
        props.append(("CPUQuota", f"{math.ceil(cpu_millis / 10)}%"))
    if memory_bytes:
        props.append(("MemoryMax", str(memory_bytes)))
        props.append(("MemoryHigh", str(memory_bytes * 9 // 10)))
    huge: list[tuple[int, int]] = []
    if hugepages_2mi is not None or hugepages_1gi is not None:
        huge.append((2048, (hugepages_2mi or 0) * PAGE_BYTES[2048]))
        huge.append((1048576, (hugepages_1gi or 0) * PAGE_BYTES[1048576]))
    return tuple(props), tuple(huge)


def _memory(value: str) -> str:
    return str(int(value) // MEMORY_PAGE * MEMORY_PAGE)


def wanted_limits(
    properties: Iterable[tuple[str, str]], hugetlb_max: Iterable[tuple[int, int]]
) -> dict[str, str]:
    """What the slice's cgroup files show once `properties` and `hugetlb_max` are applied, normalised."""
    out: dict[str, str] = {}
    for key, value in properties:
        if key in ("AllowedCPUs", "AllowedMemoryNodes"):
            out[key] = canonical_cpulist(value) or value
        elif key in ("MemoryMax", "MemoryHigh"):
            out[key] = _memory(value)
        else:
            out[key] = value
    for size, limit in hugetlb_max:
        out[HUGETLB_FILES[size]] = str(limit)
    return out


def applied_limits(files: Mapping[str, str]) -> dict[str, str]:
    """What the kernel enforces, from the slice's cgroup files (name -> content), normalised.

    A missing file or a default value (`max`, an empty cpuset) is no limit. A value bcd cannot read is
    kept as it is, so that it differs from any wanted value."""
    out: dict[str, str] = {}
    for key, name in (("AllowedCPUs", "cpuset.cpus"), ("AllowedMemoryNodes", "cpuset.mems")):
        text = files.get(name, "").strip()
        if text:
            out[key] = canonical_cpulist(text) or text
    words = files.get("cpu.max", "").split()
    if words and words[0] != "max":
        if len(words) == 2 and words[0].isdigit() and words[1].isdigit() and int(words[1]) > 0:
            out["CPUQuota"] = f"{math.ceil(int(words[0]) * 100 / int(words[1]))}%"
        else:
            out["CPUQuota"] = " ".join(words)
    for key, name in (("MemoryMax", "memory.max"), ("MemoryHigh", "memory.high")):
        text = files.get(name, "").strip()
        if text and text != "max":
            out[key] = _memory(text) if text.isdigit() else text
    for stem in HUGETLB_FILES.values():
        text = files.get(f"{stem}.max", "").strip()
        if text and text != "max":
            out[stem] = text
    return out


def first_difference(wanted: Mapping[str, str], applied: Mapping[str, str]) -> str | None:
    """The first normal-form key (LIMIT_FIELDS order) on which `applied` is not `wanted`; None when equal."""
    for key in LIMIT_FIELDS:
        if wanted.get(key) != applied.get(key):
            return key
    return None
