"""Hold slices: names, checks and the properties a hold's limits become (pure).

| Slice      | `bcd-alloc-<allocation-id>.slice`, refused unless `^bcd-alloc-[A-Za-z0-9_]{1,80}\\.slice$` |
| Path       | `/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-<id>.slice`                              |
| Properties | AllowedCPUs (cpus), AllowedMemoryNodes (mems), CPUQuota (ceil(cpu_millis/10)%),             |
|            | MemoryMax (memory_bytes), MemoryHigh (floor(0.9 x memory_bytes))                             |
| Huge pages | `+hugetlb` into cgroup.subtree_control of /sys/fs/cgroup, bcd.slice, bcd-alloc.slice, then |
|            | hugetlb.2MB.max = pages x 2 MiB, hugetlb.1GB.max = pages x 1 GiB                              |

A property is set only for a limit that is present; CPUQuota only for cpu_millis > 0 (systemd refuses
0%), MemoryMax/MemoryHigh only for memory_bytes > 0. When either huge page count is present both
`hugetlb.*.max` files are written, the other size as 0 (a hold gets the huge pages it booked and no
others; the helper's `slice.apply` does the same), Q-DEV-SLICE-02.

Limits of a running slice (a kept hold whose limits changed, Q-DEV-PASS-01): `applied_limits` reads what
the kernel enforces from the slice's cgroup attribute files (cpuset.cpus, cpuset.mems, cpu.max,
memory.max, memory.high, hugetlb.*.max), `wanted_limits` says what the spec's limits make them, both in
one normal form (bcd_shared.slicelimits, which root's hold check reads too: cpulists merged, memory
rounded down to the 4 KiB page as the kernel stores it, CPU quota as systemd's whole percent). When they
differ the slice is applied again, and the properties the spec no longer sets are reset
(`reset_assignments`: `AllowedCPUs=`, `CPUQuota=`, `MemoryMax=infinity`, ...; huge page limits back to
`max`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from attrs import field, frozen
from bcd_shared.slicelimits import (
    HUGETLB_FILES,
    LIMIT_FILES,
    MEMORY_PAGE,
    PAGE_BYTES,
    applied_limits,
    canonical_cpulist,
    limit_properties,
)
from bcd_shared.slicelimits import wanted_limits as shared_wanted_limits

from bcd_agent.sections.devices.model import Limits

__all__ = ["HUGETLB_FILES", "LIMIT_FILES", "MEMORY_PAGE", "PAGE_BYTES", "applied_limits", "canonical_cpulist"]

SLICE_NAME_RE = re.compile(r"^bcd-alloc-[A-Za-z0-9_]{1,80}\.slice$")
CPULIST_RE = re.compile(r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")
CPULIST_MAX = 1024
CGROUP_ROOT = "/sys/fs/cgroup"
PARENT_CGROUP = f"{CGROUP_ROOT}/bcd.slice/bcd-alloc.slice"
CPU_PERIOD_US = 100_000  # systemd's default CPUQuotaPeriodSec
# What resets a property systemd set: an empty assignment, or infinity for memory.
RESET_VALUES = {
    "AllowedCPUs": "",
    "AllowedMemoryNodes": "",
    "CPUQuota": "",
    "MemoryMax": "infinity",
    "MemoryHigh": "infinity",
}

# The limit (the helper's `slice.apply` field, DeviceLimits' name) each resettable property or huge
# page file belongs to: the helper resets limits by these names (docs/helper-rpc.md).
RESET_FIELDS = {
    "AllowedCPUs": "cpus",
    "AllowedMemoryNodes": "mems",
    "CPUQuota": "cpu_millis",
    "MemoryMax": "memory_bytes",
    "MemoryHigh": "memory_bytes",
    "hugetlb.2MB": "hugepages_2mi",
    "hugetlb.1GB": "hugepages_1gi",
}


def reset_fields(reset: tuple[str, ...]) -> tuple[str, ...]:
    """The limits (field names, in order, each once) that `reset`'s properties belong to."""
    return tuple(dict.fromkeys(RESET_FIELDS[k] for k in reset))


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
    props, huge = limit_properties(
        limits.cpus,
        limits.mems,
        limits.cpu_millis,
        limits.memory_bytes,
        limits.hugepages_2mi,
        limits.hugepages_1gi,
    )
    return SliceSpec(slice_name(allocation_id), props, huge, limits)


def wanted_limits(spec: SliceSpec) -> dict[str, str]:
    """What the slice's cgroup files show once `spec` is applied, in the normal form
    (bcd_shared.slicelimits, which root's hold check reads too)."""
    return shared_wanted_limits(spec.properties, spec.hugetlb_max)


def reset_assignments(spec: SliceSpec, applied: Mapping[str, str]) -> tuple[str, ...]:
    """The properties set on the running slice that `spec` no longer sets, in RESET_VALUES order."""
    wanted = {k for k, _ in spec.properties}
    props = tuple(k for k in RESET_VALUES if k in applied and k not in wanted)
    huge = () if spec.hugetlb_max else tuple(s for s in HUGETLB_FILES.values() if s in applied)
    return props + huge
