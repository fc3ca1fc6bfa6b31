"""Hold slices: names, checks and the properties a hold's limits become (pure).

| Slice      | `bcd-alloc-<allocation-id>.slice`, refused unless `^bcd-alloc-[A-Za-z0-9_]{1,80}\\.slice$` |
| Path       | `/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-<id>.slice`                              |
| Properties | AllowedCPUs (cpus), AllowedMemoryNodes (mems), CPUQuota (ceil(cpu_millis/10)%),             |
|            | MemoryMax (memory_bytes), MemoryHigh (floor(0.9 x memory_bytes))                             |
| Huge pages | `+hugetlb` into cgroup.subtree_control of /sys/fs/cgroup, bcd.slice, bcd-alloc.slice, then |
|            | hugetlb.2MB.max = pages x 2 MiB, hugetlb.1GB.max = pages x 1 GiB                              |

A property is set only for a limit that is present; CPUQuota only for cpu_millis > 0 (systemd refuses
0%), MemoryMax/MemoryHigh only for memory_bytes > 0; a huge page file is written for a present
count, 0 included (Q-DEV-SLICE-02).
"""

from __future__ import annotations

import math
import re

from attrs import field, frozen

from bcd_agent.sections.devices.model import Limits

SLICE_NAME_RE = re.compile(r"^bcd-alloc-[A-Za-z0-9_]{1,80}\.slice$")
CPULIST_RE = re.compile(r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")
CPULIST_MAX = 1024
CGROUP_ROOT = "/sys/fs/cgroup"
PARENT_CGROUP = f"{CGROUP_ROOT}/bcd.slice/bcd-alloc.slice"
HUGETLB_FILES = {2048: "hugetlb.2MB", 1048576: "hugetlb.1GB"}
PAGE_BYTES = {2048: 2 * 1024 * 1024, 1048576: 1024 * 1024 * 1024}


def slice_name(allocation_id: str) -> str:
    return f"bcd-alloc-{allocation_id}.slice"


def slice_cgroup(name: str) -> str:
    return f"{PARENT_CGROUP}/{name}"


def check_slice_name(name: str) -> str | None:
    return (
        None if SLICE_NAME_RE.fullmatch(name) else f"slice name {name!r} must match {SLICE_NAME_RE.pattern}"
    )


def check_cpulist(field: str, text: str) -> str | None:
    if not text:
        return None
    if len(text) > CPULIST_MAX:
        return f"limits.{field}: a cpulist of at most {CPULIST_MAX} characters"
    if not CPULIST_RE.fullmatch(text):
        return f"limits.{field}: {text!r} is not a cpulist"
    return None


@frozen
class SliceSpec:
    name: str
    properties: tuple[tuple[str, str], ...]
    hugetlb_max: tuple[tuple[int, int], ...]  # (page size kB, bytes)
    limits: Limits = field(factory=Limits)

    @property
    def cgroup(self) -> str:
        return slice_cgroup(self.name)


def slice_spec(allocation_id: str, limits: Limits) -> SliceSpec:
    props: list[tuple[str, str]] = []
    if limits.cpus:
        props.append(("AllowedCPUs", limits.cpus))
    if limits.mems:
        props.append(("AllowedMemoryNodes", limits.mems))
    if limits.cpu_millis:
        props.append(("CPUQuota", f"{math.ceil(limits.cpu_millis / 10)}%"))
    if limits.memory_bytes:
        props.append(("MemoryMax", str(limits.memory_bytes)))
        props.append(("MemoryHigh", str(limits.memory_bytes * 9 // 10)))
    huge: list[tuple[int, int]] = []
    if limits.hugepages_2mi is not None:
        huge.append((2048, limits.hugepages_2mi * PAGE_BYTES[2048]))
    if limits.hugepages_1gi is not None:
        huge.append((1048576, limits.hugepages_1gi * PAGE_BYTES[1048576]))
    return SliceSpec(slice_name(allocation_id), tuple(props), tuple(huge), limits)
