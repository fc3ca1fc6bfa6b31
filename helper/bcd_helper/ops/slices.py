"""slice.apply and slice.remove: a hold's cgroup-v2 slice, with exactly the seeds' properties.

Rules (devices-and-holds.md "Hold slices"; DEV-SLICE-07..24, DLV-PRIV-04):
- the name must match `^bcd-alloc-[A-Za-z0-9_]{1,80}\\.slice$`; `cpus` and `mems` must be cpulists
  (`N` or `N-M` with N <= M, comma-separated, each number below 65536) of at most 1024 characters;
- apply: a slice not there yet only while fewer than MAX_SLICES (1024) hold slices are (root lists
  bcd-alloc.slice's cgroup directory itself; `too-many-slices`); then `systemctl start NAME`, then
  one `systemctl set-property --runtime NAME` with AllowedCPUs (cpus), AllowedMemoryNodes (mems),
  CPUQuota (ceil(cpu_millis / 10)%), MemoryMax (memory_bytes) and MemoryHigh (memory_bytes * 9 // 10),
  each only when given; with huge pages, `+hugetlb` into cgroup.subtree_control of /sys/fs/cgroup,
  bcd.slice and bcd-alloc.slice, then hugetlb.2MB.max and hugetlb.1GB.max in bytes (both written when
  either is booked, the other as 0: a hold gets the huge pages it booked and no others;
  Q-DEV-SLICE-02);
- reset (a kept hold whose spec dropped a limit): `reset` names limits, by the same field names, to
  put back to the kernel's default in the same call. Only the LIMITS table's names; none twice, none
  also given, and no huge page size while the other size is given (that size is then 0 by the rule
  above). A reset property is assigned its default in the same `set-property` call, before the set
  ones (`AllowedCPUs=`, `AllowedMemoryNodes=`, `CPUQuota=`, `MemoryMax=infinity` and
  `MemoryHigh=infinity`); a reset huge page size gets `max` in its `hugetlb.<size>.max` (a slice
  without that file has no such limit to reset);
- remove: root reads the slice's `cgroup.events` itself and runs `systemctl stop` only when it says
  `populated 0`; a populated slice is kept (answer `stopped: false, populated: true`), so a release
  never kills a workload (Q-DEV-SLICE-03, decided: yes, root checks itself). A slice whose cgroup does
  not exist is already gone.
"""

from __future__ import annotations

import os
import re
from typing import Any

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, read_root_only, split_host_path, verified_dir
from bcd_shared.strictjson import value_bound

from bcd_helper.ops.base import Call, Failed, Refused, no_roots_possible, refused_path
from bcd_helper.ops.files import (  # the hold writes' signed spec: slice.apply carries it too
    MAX_CONTENT,
    MAX_HOLD_VALUES,
    SignedSpec,
)
from bcd_helper.protocol import strict_loads

SLICE_RE = re.compile(r"^bcd-alloc-[A-Za-z0-9_]{1,80}\.slice$")
MAX_CPULIST = 1024
CGROUP = "/sys/fs/cgroup"
PARENTS = (CGROUP, f"{CGROUP}/bcd.slice", f"{CGROUP}/bcd.slice/bcd-alloc.slice")
MAX_MEMORY = 1 << 52
MAX_PAGES = 1 << 24
MAX_MILLIS = 1 << 24
# Hold slices root keeps under bcd-alloc.slice: far above a host's holds (one per allocation), and a bound
# on the units and cgroups an unsigned slice.apply makes systemd and the kernel keep (round 5).
MAX_SLICES = 1024
ALLOC_PARENT = f"{CGROUP}/bcd.slice/bcd-alloc.slice"
# The seeds' limits ("Hold slices"), by request field: the systemd properties each becomes, with the
# value that resets each to systemd's default; huge pages are cgroup files (systemd has no property).
LIMITS: dict[str, tuple[tuple[str, str], ...]] = {
    "cpus": (("AllowedCPUs", ""),),
    "mems": (("AllowedMemoryNodes", ""),),
    "cpu_millis": (("CPUQuota", ""),),
    "memory_bytes": (("MemoryMax", "infinity"), ("MemoryHigh", "infinity")),
    "hugepages_2mi": (),
    "hugepages_1gi": (),
}
HUGETLB = {
    "hugepages_2mi": ("hugetlb.2MB.max", 2 * 1024 * 1024),
    "hugepages_1gi": ("hugetlb.1GB.max", 1 << 30),
}


@frozen
class SliceApply:
    name: str
    cpus: str | None = None
    mems: str | None = None
    cpu_millis: int | None = None
    memory_bytes: int | None = None
    hugepages_2mi: int | None = None
    hugepages_1gi: int | None = None
    reset: tuple[str, ...] = ()
    intent: SignedSpec | None = None


@frozen
class SliceRemove:
    name: str


def check_cpulist(value: str, field: str) -> str:
    """DEV-SLICE-17: a cpulist of at most 1024 characters."""
    if len(value) > MAX_CPULIST:
        raise Refused("bad-cpulist", f"{field}: longer than {MAX_CPULIST} characters")
    if not value:
        raise Refused("bad-cpulist", f"{field}: empty")
    for part in value.split(","):
        m = re.fullmatch(r"([0-9]{1,5})(?:-([0-9]{1,5}))?", part)
        if m is None:
            raise Refused("bad-cpulist", f"{field}: {part!r} is not N or N-M")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo > hi or hi >= 65536:
            raise Refused("bad-cpulist", f"{field}: {part!r} is not an increasing range below 65536")
    return value


def check_slice_name(name: str) -> str:
    if not SLICE_RE.fullmatch(name):
        raise Refused(
            "bad-slice-name", f"{name!r} is not a hold slice name (bcd-alloc-<allocation-id>.slice)"
        )
    return name


def slice_cgroup(name: str) -> str:
    return f"{ALLOC_PARENT}/{name}"


def _bounded(value: int | None, field: str, hi: int) -> int | None:
    if value is not None and not 0 <= value <= hi:
        raise Refused("bad-limit", f"{field}: must be from 0 to {hi}")
    return value


def check_reset(req: SliceApply) -> tuple[str, ...]:
    """The limits `req` resets, checked against the LIMITS table (pure)."""
    seen: list[str] = []
    for name in req.reset:
        if name not in LIMITS:
            raise Refused("bad-reset", f"reset: {name[:40]!r} is not a limit (one of {', '.join(LIMITS)})")
        if name in seen:
            raise Refused("bad-reset", f"reset: {name} is listed twice")
        if getattr(req, name) is not None:
            raise Refused("bad-reset", f"reset: {name} is also given")
        seen.append(name)
    for name in seen:
        other = "hugepages_1gi" if name == "hugepages_2mi" else "hugepages_2mi"
        if name in HUGETLB and getattr(req, other) is not None:
            raise Refused(
                "bad-reset",
                f"reset: {name} while {other} is given (a hold gets the huge pages it booked and no "
                "others: that size is then 0)",
            )
    return tuple(seen)


def properties(req: SliceApply) -> list[str]:
    """The set-property assignments for the request (pure): resets first, then the limits given."""
    props = [f"{prop}={default}" for name in check_reset(req) for prop, default in LIMITS[name]]
    if req.cpus is not None:
        props.append(f"AllowedCPUs={check_cpulist(req.cpus, 'cpus')}")
    if req.mems is not None:
        props.append(f"AllowedMemoryNodes={check_cpulist(req.mems, 'mems')}")
    if _bounded(req.cpu_millis, "cpu_millis", MAX_MILLIS) is not None:
        assert req.cpu_millis is not None
        props.append(f"CPUQuota={-(-req.cpu_millis // 10)}%")
    if _bounded(req.memory_bytes, "memory_bytes", MAX_MEMORY) is not None:
        assert req.memory_bytes is not None
        props.append(f"MemoryMax={req.memory_bytes}")
        props.append(f"MemoryHigh={req.memory_bytes * 9 // 10}")
    return props


def write_kernel_file(call: Call, path: str, data: bytes, *, missing_ok: bool = False) -> bool:
    """Write an existing cgroupfs file in place (no rename on kernel files), under the root-only rule.
    With `missing_ok`, a file that does not exist is left so (False); else written (True)."""
    parts = split_host_path(path)
    try:
        with verified_dir(call.ctx.root, parts[:-1], create=False) as dfd:
            try:
                fd = os.open(parts[-1], os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                if missing_ok:
                    return False
                raise
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    except OSError as exc:
        raise Failed("cgroup", f"writing {path}: {exc.strerror}") from None
    return True


def _systemctl(call: Call, *args: str) -> None:
    result = call.system.run(["systemctl", *args])
    if not result.ok:
        raise Failed("systemctl", result.describe())


def check_slice_count(call: Call, name: str) -> None:
    """A slice that is not there yet is started only while fewer than MAX_SLICES hold slices are, as root
    reads bcd-alloc.slice's cgroup directory itself (none there: none started yet)."""
    try:
        with verified_dir(call.ctx.root, split_host_path(ALLOC_PARENT), create=False) as dfd:
            names = [n for n in os.listdir(dfd) if SLICE_RE.fullmatch(n)]
    except FileNotFoundError:
        return
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    if name not in names and len(names) >= MAX_SLICES:
        raise Refused(
            "too-many-slices",
            f"slice.apply: root keeps at most {MAX_SLICES} hold slices under bcd-alloc.slice: "
            f"{name} is not one of them",
        )


def signed_limits(limits: Any) -> dict[str, Any]:
    """The slice.apply limits the node sends for a signed assignment's DeviceLimits (its HelperExecutor:
    an empty cpulist, a 0 CPU quota or memory limit is no limit; huge pages as booked)."""
    return {
        "cpus": limits.cpus or None,
        "mems": limits.mems or None,
        "cpu_millis": limits.cpu_millis or None,
        "memory_bytes": limits.memory_bytes or None,
        "hugepages_2mi": limits.hugepages_2mi,
        "hugepages_1gi": limits.hugepages_1gi,
    }


def check_signed_slice(call: Call, req: SliceApply, name: str) -> Any | None:
    """With command-signing roots (round 5): the slice's allocation must be a sliced hold of the signed
    devices section, and the limits sent exactly its own (so a reset only of what it does not set);
    returns the intent state to write (None: nothing to write, or no roots: nothing is checked,
    HST-SIGN-33)."""
    from bcd_helper.ops.files import _signed_assignment

    ident = name[len("bcd-alloc-") : -len(".slice")]
    assignment, signed = _signed_assignment(call, "slice.apply", "slice", ident, req.intent)
    if signed is None:
        return None
    next_state, generation = signed
    if assignment is None or assignment.limits is None or int(assignment.binding) == 2:  # 2: KUBERNETES
        raise Refused(
            "not-in-spec",
            f"slice.apply: allocation {ident} is not a sliced hold of the signed spec's devices section "
            f"(generation {generation})",
        )
    want = signed_limits(assignment.limits)
    for field, value in want.items():
        sent = getattr(req, field)
        if sent != value:
            raise Refused(
                "spec-mismatch",
                f"slice.apply: {field} {sent!r} is not the signed spec's {value!r} for {ident} "
                f"(generation {generation})",
            )
    # A reset names only fields not sent (check_reset), so only limits the signed spec does not set.
    return next_state


def slice_apply(call: Call, req: SliceApply) -> dict[str, Any]:
    name = check_slice_name(req.name)
    props = properties(req)
    reset = check_reset(req)
    p2 = _bounded(req.hugepages_2mi, "hugepages_2mi", MAX_PAGES)
    p1 = _bounded(req.hugepages_1gi, "hugepages_1gi", MAX_PAGES)
    next_state = check_signed_slice(call, req, name)
    check_slice_count(call, name)
    if next_state is not None:  # durable before effect
        call.ctx.intent_verifier().save_state(next_state)
    _systemctl(call, "start", name)
    if props:
        _systemctl(call, "set-property", "--runtime", name, *props)
    cg = slice_cgroup(name)
    if p2 is not None or p1 is not None:
        for parent in PARENTS:
            write_kernel_file(call, f"{parent}/cgroup.subtree_control", b"+hugetlb")
        for field, pages in (("hugepages_2mi", p2), ("hugepages_1gi", p1)):
            file, size = HUGETLB[field]
            write_kernel_file(call, f"{cg}/{file}", str((pages or 0) * size).encode())
    for field in reset:
        if field in HUGETLB:
            write_kernel_file(call, f"{cg}/{HUGETLB[field][0]}", b"max", missing_ok=True)
    return {"name": name, "cgroup": cg, "properties": props, "reset": list(reset)}


def populated(call: Call, name: str) -> bool | None:
    """What cgroup.events says: True/False, or None when the slice's cgroup does not exist."""
    text = call.system.read_text(f"{slice_cgroup(name)}/cgroup.events")
    if text is None:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "populated":
            return value.strip() != "0"
    raise Failed("cgroup", f"{slice_cgroup(name)}/cgroup.events has no populated line")


def names_slice(call: Call, path: str, name: str) -> bool:
    """Whether root's copy of a hold file names the slice `name`, anywhere: every string of a CDI spec
    once decoded (its `bcd.dev/cgroup-parent` or an env value; a JSON escape hides nothing), every byte of
    an env file (KEY=VALUE lines, no escapes). A file root cannot read under the root-only rule, or
    cannot decode within the hold's bounds, names it."""
    try:
        data = read_root_only(call.ctx.root, path, MAX_CONTENT)
    except (RootPathRefused, OSError):
        return True
    if data is None:
        return False
    if not path.endswith(".json"):
        return name.encode() in data
    if value_bound(data) > MAX_HOLD_VALUES:
        return True
    try:
        doc = strict_loads(data)
    except ValueError:
        return True
    pending: list[Any] = [doc]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            if name in value:
                return True
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return False


def slice_remove(call: Call, req: SliceRemove) -> dict[str, Any]:
    name = check_slice_name(req.name)
    ident = name[len("bcd-alloc-") : -len(".slice")]
    if not no_roots_possible(call.ctx, None):
        from bcd_shared import cdi

        # With roots a hold the signed spec lists cannot be removed (hold-in-spec), and while one of its
        # files names this slice, stopping it would let the next job under it run without the signed
        # limits (systemd makes a missing parent slice anew, without any; round 6). A hold written over
        # without it (the spec dropped the limits) no longer names it: the slice may go.
        for hold in (cdi.cdi_spec_path(ident), cdi.env_file_path(ident)):
            if names_slice(call, hold, name):
                raise Refused(
                    "hold-exists",
                    f"slice.remove: {name}: the hold {hold} still names it: write the hold without it "
                    "or remove the hold first",
                )
    state = populated(call, name)
    if state is None:
        return {"name": name, "stopped": False, "populated": False, "absent": True}
    if state:
        return {"name": name, "stopped": False, "populated": True, "absent": False}
    _systemctl(call, "stop", name)
    return {"name": name, "stopped": True, "populated": False, "absent": False}
