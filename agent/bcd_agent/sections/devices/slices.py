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

Limits of a running slice (a kept hold whose limits changed, Q-DEV-PASS-01): `applied_limits` reads
what the kernel enforces from the slice's cgroup attribute files (cpuset.cpus, cpuset.mems, cpu.max,
memory.max, memory.high, hugetlb.*.max), `wanted_limits` says what the spec's limits make them, both
in one normal form (cpulists merged, memory rounded down to the 4 KiB page as the kernel stores it,
CPU quota as systemd's whole percent). When they differ the slice is applied again, and the
properties the spec no longer sets are reset (`reset_assignments`: `AllowedCPUs=`, `CPUQuota=`,
`MemoryMax=infinity`, ...; huge page limits back to `max`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from attrs import field, frozen

from bcd_agent.sections.devices.model import Limits

SLICE_NAME_RE = re.compile(r"^bcd-alloc-[A-Za-z0-9_]{1,80}\.slice$")
CPULIST_RE = re.compile(r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")
CPULIST_MAX = 1024
CGROUP_ROOT = "/sys/fs/cgroup"
PARENT_CGROUP = f"{CGROUP_ROOT}/bcd.slice/bcd-alloc.slice"
HUGETLB_FILES = {2048: "hugetlb.2MB", 1048576: "hugetlb.1GB"}
PAGE_BYTES = {2048: 2 * 1024 * 1024, 1048576: 1024 * 1024 * 1024}
MEMORY_PAGE = 4096
CPU_PERIOD_US = 100_000  # systemd's default CPUQuotaPeriodSec
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
    if limits.hugepages_2mi is not None or limits.hugepages_1gi is not None:
        huge.append((2048, (limits.hugepages_2mi or 0) * PAGE_BYTES[2048]))
        huge.append((1048576, (limits.hugepages_1gi or 0) * PAGE_BYTES[1048576]))
    return SliceSpec(slice_name(allocation_id), tuple(props), tuple(huge), limits)


def _memory(value: str) -> str:
    return str(int(value) // MEMORY_PAGE * MEMORY_PAGE)


def wanted_limits(spec: SliceSpec) -> dict[str, str]:
    """What the slice's cgroup files show once `spec` is applied, in the normal form."""
    out: dict[str, str] = {}
    for key, value in spec.properties:
        if key in ("AllowedCPUs", "AllowedMemoryNodes"):
            out[key] = canonical_cpulist(value) or value
        elif key in ("MemoryMax", "MemoryHigh"):
            out[key] = _memory(value)
        else:
            out[key] = value
    for size, limit in spec.hugetlb_max:
        out[HUGETLB_FILES[size]] = str(limit)
    return out


def applied_limits(files: Mapping[str, str]) -> dict[str, str]:
    """What the kernel enforces, from the slice's cgroup files (name -> content), in the normal form.

    A missing file or a default value (`max`, an empty cpuset) is no limit. A value bcd cannot read
    is kept as it is, so that it differs from any wanted value and the slice is applied again."""
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


def reset_assignments(spec: SliceSpec, applied: Mapping[str, str]) -> tuple[str, ...]:
    """The properties set on the running slice that `spec` no longer sets, in RESET_VALUES order."""
    wanted = {k for k, _ in spec.properties}
    props = tuple(k for k in RESET_VALUES if k in applied and k not in wanted)
    huge = () if spec.hugetlb_max else tuple(s for s in HUGETLB_FILES.values() if s in applied)
    return props + huge
