"""The devices planner: `plan(spec, observed) -> Plan`. Pure: no I/O, no clock (time is an input).

One pass, in the seeds' order (devices-and-holds.md, "One pass"):
0. An unreadable releases file is renamed aside and the marker written (every GPU then claimed).
1. Pending Kubernetes releases: dropped unreported when the spec wants the allocation again,
   reported (AllocationReleased) once no pod holds their devices, kept otherwise
   (KubernetesReleaseStuck after 5 minutes).
2. Holds no longer wanted: a plain hold's spec and env file are removed, then AllocationReleased; a
   Kubernetes hold is recorded in releasing.json first, then withdrawn. A released slice is stopped
   only when empty.
   An orphan env file (one whose allocation has no CDI spec: a crash between a release's two
   removals) is removed here too, unless its allocation is bound in this pass (the bind rewrites it
   after the spec); a bind waits for the removal of an orphan naming one of its GPUs.
3. Leftover slices whose hold is neither wanted nor released in this pass: stopped once empty.
4. Holds still wanted are kept: a missing slice is created again, a missing or stale env file and a
   stale spec are rewritten (the generation annotation stays the bind generation), a running slice
   whose limits are not the spec's is applied again (properties no longer set are reset), an owed
   AllocationBound is sent. New limits that need more memory or huge pages than the running slice
   holds are admitted first, the hold's old booking counted as freed (`_kept_bookings`); refused,
   the hold keeps its slice and files as they are and fails with resources-exhausted (its
   AllocationFailed once per generation).
5. New holds in spec order: invalid-assignment, binding, privilege, atoms (unsupported-device, then
   device-missing), conflicts, host admission; the first failure decides. Each that passes is bound
   (slice, spec, env file, AllocationBound) and its atoms count against the holds after it.
6. One AllocationFailed per failed allocation and generation (once: the ledger remembers).

A kept hold whose atoms or binding changed is checked as a new hold. When its old and new atoms share
one it is written over in place (5a, "rebind", before the new holds: an atomic rename replaces each
file, so no instant leaves the shared GPU unheld; only AllocationBound is sent; refused, the old hold
stays as it is); when they share none it is released (2) and bound again as new (5) in the same pass
(Q-DEV-PASS-01). The plan is a tuple of Actions; the applier runs each action's steps in order and
stops an action at its first failed step (no event is sent for a bind whose files are not all in place).

AllocationBound and AllocationReleased are journaled under keys (`bound_key`, `release_key`: allocation
and generation), so each is sent exactly once across a crash between its event and the ledger's write
(docs/devices.md, "Releases across a crash", "Binds across a crash").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import evolve, field, frozen
from bcd_shared import cdi
from bcd_shared.cdi import HoldDevice, HoldRecord, VendorSpec

from bcd_agent.inventory.gpus import GpuInventory
from bcd_agent.inventory.host import HostMemory
from bcd_agent.sections.devices.atoms import (
    Atom,
    Refusal,
    atom_from_id,
    missing,
    parse_atom,
    vendor_names,
    visible_devices,
)
from bcd_agent.sections.devices.events import BoundEvent, FailedEvent, ReleasedEvent
from bcd_agent.sections.devices.model import (
    BINDING_HOLD,
    BINDING_KUBERNETES,
    DEVICE_CLASS_SLOT,
    REASON_BINDING,
    REASON_DEVICE,
    REASON_EXHAUSTED,
    REASON_INVALID,
    REASON_MISSING,
    REASON_OVERLAP,
    REASON_UNPRIVILEGED,
    DeviceAssignment,
    DevicesSpec,
    Limits,
)
from bcd_agent.sections.devices.slices import (
    HUGETLB_FILES,
    MEMORY_PAGE,
    PAGE_BYTES,
    SliceSpec,
    check_cpulist,
    check_slice_name,
    reset_assignments,
    slice_name,
    slice_spec,
    wanted_limits,
)

MIB = 1024 * 1024
STUCK_AFTER_S = 300.0
UNREADABLE_OWNER = "(pending Kubernetes releases that could not be read)"
MPS_PIPE_DIRECTORY = "/run/nvidia-mps"
UNPRIVILEGED_MESSAGE = (
    "bcd node runs without root and without [helper]: it cannot write /etc/cdi or create hold slices "
    "(run bcd node as root, or under bcd helper)"
)
ADMISSION_UNREADABLE_WARNING = "host memory unreadable; binding without host-side admission"
CONDITION_STUCK = "KubernetesReleaseStuck"
REASON_STUCK = "PodsHoldDevices"
CONDITION_UNREADABLE = "KubernetesReleasesUnreadable"
REASON_UNREADABLE = "ReleasesFileUnreadable"
RESERVED_ENV_KEYS = frozenset(
    {
        "BCD_ALLOCATION_ID",
        "BCD_CGROUP_PARENT",
        "BCD_RESERVATION_ID",
        "CUDA_MPS_PIPE_DIRECTORY",
        "NVIDIA_VISIBLE_DEVICES",
    }
)


# --- observations ---------------------------------------------------------------------------------


@frozen
class LiveHold:
    """A hold on disk: its spec read back (the only source of truth for what it holds)."""

    record: HoldRecord
    doc: Mapping[str, Any]
    env_lines: tuple[str, ...] | None  # None: the env file is missing or unreadable


@frozen
class SliceState:
    name: str
    populated: bool
    hugetlb_current: Mapping[int, int] = field(factory=dict)  # page size kB -> bytes faulted in
    # The limits the kernel enforces now (slices.applied_limits); None when they were not read.
    limits: Mapping[str, str] | None = None


@frozen
class PendingRelease:
    allocation_id: str
    reservation_id: str
    generation: int
    device_ids: tuple[str, ...]
    since: float  # unix time the release was recorded


@frozen
class Ledger:
    """Which events were already sent (data_dir/devices-events.json): bound and failed generations,
    and the plain releases under way (`releasing`: release key -> its AllocationReleased), written
    before a release's first removal and dropped once its event is journaled (docs/devices.md,
    "Releases across a crash")."""

    bound: Mapping[str, int] = field(factory=dict)
    failed: Mapping[str, int] = field(factory=dict)
    releasing: Mapping[str, ReleasedEvent] = field(factory=dict)


EVENT_KEY_PREFIX = "devices:"
RELEASE_KEY_PREFIX = "devices:released:"
BOUND_KEY_PREFIX = "devices:bound:"


def release_key(event: ReleasedEvent) -> str:
    """The journal key of an AllocationReleased: one per allocation and generation (a spec at one
    generation releases an allocation at most once: kept holds are not released, and a hold bound
    again in the pass is kept at that generation)."""
    return f"{RELEASE_KEY_PREFIX}{event.allocation_id}:{event.generation}"


def bound_key(allocation_id: str, generation: int) -> str:
    """The journal key of an AllocationBound: one per allocation and generation, the generation the
    hold's files carry (`bcd.dev/generation`: the bind's, or an in-place rewrite's, which is always a
    later spec's, so a rebind's key is never its first bind's). A spec at one generation names one
    assignment per allocation, so the key names one report."""
    return f"{BOUND_KEY_PREFIX}{allocation_id}:{generation}"


class NotRead:
    """Host memory was not read this pass (no new hold needed admission)."""


NOT_READ = NotRead()


@frozen
class Observed:
    inventory: GpuInventory
    holds: Mapping[str, LiveHold] = field(factory=dict)
    unparseable_specs: tuple[str, ...] = ()  # allocation ids whose bcd-<id>.json does not parse
    slices: Mapping[str, SliceState] = field(factory=dict)
    releases: tuple[PendingRelease, ...] = ()
    releases_unreadable: bool = False  # releasing.json exists and did not parse in this read
    marker: bool = False  # data_dir/releasing.unreadable exists
    pods_holding: Mapping[str, bool] = field(factory=dict)  # pending release -> a pod holds a device
    kube_unknown_clear: bool = False  # no pod holds a bcd GPU of an allocation the node does not know
    vfio: Mapping[str, str] = field(factory=dict)  # GPU uuid -> instance id that has or will have it
    vendor: VendorSpec | None = None
    mps_dir: bool = False
    privileged: bool = True
    admission: bool = True  # False on a fakehw host (never admitted)
    host_memory: HostMemory | NotRead | None = NOT_READ
    domains_committed_bytes: int = 0
    ledger: Ledger = field(factory=Ledger)
    now: float = 0.0
    # Env files (/run/bcd/allocations/<id>.env) whose allocation has no CDI spec file at all (neither
    # a hold nor an unparseable one), by allocation id: their lines, None when unreadable.
    orphan_envs: Mapping[str, tuple[str, ...] | None] = field(factory=dict)
    # The journal's remembered event keys, AllocationReleased's and AllocationBound's
    # (EventSink.event_keys(EVENT_KEY_PREFIX)).
    event_keys: frozenset[str] = frozenset()


# --- steps ----------------------------------------------------------------------------------------


@frozen
class WriteSpec:
    allocation_id: str
    doc: Mapping[str, Any]


@frozen
class RemoveSpec:
    allocation_id: str


@frozen
class WriteEnv:
    allocation_id: str
    lines: tuple[str, ...]


@frozen
class RemoveEnv:
    allocation_id: str


@frozen
class ApplySlice:
    """Start the slice (a no-op when it runs) and set its limits; `reset` names the properties (and
    `hugetlb.*` stems) the running slice has that the spec no longer sets."""

    slice: SliceSpec
    reset: tuple[str, ...] = ()


@frozen
class StopSlice:
    name: str


@frozen
class WriteReleases:
    releases: tuple[PendingRelease, ...]


@frozen
class SetAsideReleases:
    """Rename the unreadable releases file to releasing.json.unreadable-<suffix> and write the marker."""

    suffix: str


@frozen
class RemoveMarker:
    pass


@frozen
class Emit:
    event: BoundEvent | ReleasedEvent | FailedEvent
    key: str | None = None  # journaled at most once per key (EventSink.emit); allocation reports'


@frozen
class ForgetEventKeys:
    """Forget journal keys: those of the pass's reports once the ledger that records them is written;
    a bound key whose hold the pass removed or wrote over; keys a crash left that nothing needs."""

    keys: tuple[str, ...]


@frozen
class WriteLedger:
    ledger: Ledger


Step = (
    WriteSpec
    | RemoveSpec
    | WriteEnv
    | RemoveEnv
    | ApplySlice
    | StopSlice
    | WriteReleases
    | SetAsideReleases
    | RemoveMarker
    | Emit
    | WriteLedger
    | ForgetEventKeys
)


@frozen
class Action:
    """Steps for one purpose, run in order; the action stops at its first failed step.

    `after`: actions (by key) whose failure makes this one skip (a bind waits for the release of
    the hold whose atoms it takes)."""

    key: str
    # "intent", "release", "kube-release", "slice", "keep", "bind", "rebind", "report", "ledger", "releases"
    kind: str
    steps: tuple[Step, ...]
    after: frozenset[str] = frozenset()


@frozen
class Failure:
    allocation_id: str
    reason: str
    message: str


@frozen
class PlanCondition:
    type: str
    reason: str
    message: str


@frozen
class Plan:
    actions: tuple[Action, ...]
    failures: tuple[Failure, ...] = ()
    conditions: tuple[PlanCondition, ...] = ()
    warnings: tuple[str, ...] = ()
    # The holds that stand after this plan is applied, by allocation id, with their atoms.
    holders: Mapping[str, tuple[str, ...]] = field(factory=dict)

    @property
    def empty(self) -> bool:
        return not self.actions


# --- building a hold's files -----------------------------------------------------------------------


def _atoms_of(assignment: DeviceAssignment) -> tuple[Atom, ...]:
    out = []
    for ref in assignment.devices:
        a = parse_atom(ref)
        assert isinstance(a, Atom)
        out.append(a)
    return tuple(out)


def hold_files(
    assignment: DeviceAssignment,
    atoms: tuple[Atom, ...],
    generation: int,
    obs: Observed,
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The CDI document and env-file lines of a hold (atoms resolve against obs.inventory)."""
    alloc = assignment.allocation_id
    parent = slice_name(alloc) if assignment.sliced else None
    kube = assignment.kubernetes
    has_slot = any(a.device_class == DEVICE_CLASS_SLOT for a in atoms)
    visible = visible_devices(atoms, obs.inventory)
    env = [f"BCD_ALLOCATION_ID={alloc}"]
    if parent:
        env.append(f"BCD_CGROUP_PARENT={parent}")
    if has_slot and obs.mps_dir:
        env.append(f"CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_DIRECTORY}")
    spec_env = list(env)
    if not kube:
        spec_env.append(f"NVIDIA_VISIBLE_DEVICES={visible}")
    devices = []
    for a in atoms:
        gpu = obs.inventory.gpu(a.gpu)
        edits = None
        if obs.vendor is not None and gpu is not None and not kube:
            edits = obs.vendor.edits_for(vendor_names(a, gpu))
        devices.append(HoldDevice(a.id, edits))
    doc = cdi.build_hold_spec(
        allocation_id=alloc,
        reservation_id=assignment.reservation_id,
        generation=generation,
        kubernetes=kube,
        cgroup_parent=parent,
        devices=devices,
        env=spec_env,
        vendor=None if kube else obs.vendor,
    )
    lines = (*env, f"BCD_RESERVATION_ID={assignment.reservation_id}", f"NVIDIA_VISIBLE_DEVICES={visible}")
    return doc, lines + assignment.env


def bound_event(assignment: DeviceAssignment, atoms: tuple[Atom, ...], generation: int) -> BoundEvent:
    alloc = assignment.allocation_id
    return BoundEvent(
        allocation_id=alloc,
        reservation_id=assignment.reservation_id,
        generation=generation,
        device_ids=tuple(a.id for a in atoms),
        cdi_devices=tuple(cdi.qualified_name(cdi.device_name(a.id)) for a in atoms),
        cdi_spec_path=cdi.cdi_spec_path(alloc),
        env_file=cdi.env_file_path(alloc),
        cgroup_parent=slice_name(alloc) if assignment.sliced else "",
        kubernetes=assignment.kubernetes,
    )


# --- claims and conflicts --------------------------------------------------------------------------


class Claims:
    """Who holds what, while the pass is planned: whole GPUs, parts, VFIO, the all-GPUs claim."""

    def __init__(self, vfio: Mapping[str, str], all_owner: str | None) -> None:
        self.whole: dict[str, str] = {}
        self.parts: dict[str, str] = {}
        self.parts_of: dict[str, list[tuple[str, str]]] = {}
        self.vfio = dict(vfio)
        self.all_owner = all_owner

    def drop(self, owner: str) -> None:
        """Forget what `owner` claims (a hold written over in place claims its new atoms instead)."""
        self.whole = {g: o for g, o in self.whole.items() if o != owner}
        self.parts = {p: o for p, o in self.parts.items() if o != owner}
        self.parts_of = {g: [(p, o) for p, o in ps if o != owner] for g, ps in self.parts_of.items()}

    def add(self, owner: str, atoms: tuple[Atom, ...]) -> None:
        for a in atoms:
            if a.whole:
                self.whole.setdefault(a.gpu, owner)
            else:
                self.parts.setdefault(a.id, owner)
                self.parts_of.setdefault(a.gpu, []).append((a.id, owner))

    def conflict(self, owner: str, a: Atom) -> str | None:
        """The first conflict of atom `a` for allocation `owner`, in the seeds' table order."""
        if a.gpu in self.vfio:
            return f"{a.gpu} is passed through to instance {self.vfio[a.gpu]}"
        if self.all_owner is not None:
            return f"{a.gpu} is assigned to {self.all_owner}"
        held = self.whole.get(a.gpu) if a.whole else self.parts.get(a.id)
        if held is not None and held != owner:
            return f"{a.id} is assigned to {held}"
        if a.whole:
            for part, part_owner in self.parts_of.get(a.gpu, ()):
                if part_owner != owner:
                    return f"{a.gpu} has {part} assigned to {part_owner}"
        else:
            gpu_owner = self.whole.get(a.gpu)
            if gpu_owner is not None and gpu_owner != owner:
                return f"{a.gpu} is assigned to {gpu_owner}"
        return None


# --- admission ------------------------------------------------------------------------------------


@frozen
class Taker:
    """A bound hold's commitments: memory, and huge pages still to take per size, on its nodes."""

    memory_bytes: int
    hugepages: Mapping[int, int]  # page size kB -> pages it may still take
    nodes: tuple[int, ...]  # its mems nodes; () for none


def _mems(text: str) -> tuple[int, ...]:
    from bcd_agent.inventory.host import parse_cpulist

    try:
        return parse_cpulist(text)
    except ValueError:
        return ()


def taker(assignment: DeviceAssignment, slice_state: SliceState | None) -> Taker:
    lim = assignment.limits
    if lim is None:
        return Taker(0, {}, ())
    pages: dict[int, int] = {}
    for size, count in ((2048, lim.hugepages_2mi), (1048576, lim.hugepages_1gi)):
        if count:
            faulted = (slice_state.hugetlb_current.get(size, 0) if slice_state else 0) // PAGE_BYTES[size]
            pages[size] = max(0, count - faulted)
    return Taker(lim.memory_bytes or 0, pages, _mems(lim.mems))


def admit(
    assignment: DeviceAssignment,
    host: HostMemory,
    committed_bytes: int,
    takers: list[Taker],
    own: Taker | None = None,
) -> str | None:
    """The ResourcesExhausted message when `assignment` does not fit, else None. Memory first.

    `own`: for a kept hold whose limits change, the huge pages its slice has faulted in (per size, on
    its old memory nodes): the kernel's free counts no longer have them, but they are the hold's own,
    so they count as free again (host-wide, and on the new nodes when the old ones are among them)."""
    lim = assignment.limits
    assert lim is not None
    if lim.memory_bytes:
        left = host.normal_available_bytes - committed_bytes - sum(t.memory_bytes for t in takers)
        if lim.memory_bytes > left:
            need_mib = -(-lim.memory_bytes // MIB)
            left_mib = max(0, left) // MIB
            return f"ResourcesExhausted: {need_mib} MiB of memory needed, {left_mib} MiB left on this host"
    nodes = _mems(lim.mems)
    for size, need in ((2048, lim.hugepages_2mi), (1048576, lim.hugepages_1gi)):
        if not need:
            continue
        pool = host.pools.get(size)
        credit = own.hugepages.get(size, 0) if own is not None else 0
        free_host = (pool.free if pool else 0) + credit
        free_host -= sum(t.hugepages.get(size, 0) for t in takers)
        free = free_host
        if nodes and pool is not None:
            on_nodes = sum(pool.per_node_free.get(n, 0) for n in nodes)
            if own is not None and own.nodes and set(own.nodes) <= set(nodes):
                on_nodes += credit
            on_nodes -= sum(t.hugepages.get(size, 0) for t in takers if set(t.nodes) & set(nodes))
            free = min(free_host, on_nodes)
        if need > free:
            return f"ResourcesExhausted: {need} hugepages of {size} KiB needed, {max(0, free)} free"
    return None


def needs_host_memory(
    spec: DevicesSpec, holds: Mapping[str, LiveHold], slices: Mapping[str, SliceState] | None = None
) -> bool:
    """Whether an assignment needs admission in this pass (the observer then reads meminfo): one that is
    not yet a hold, or a hold bound again (its atoms or binding changed), or a kept hold whose running
    slice is to get other limits (`slices`: the observed slices)."""
    for a in spec.assignments:
        if a.limits is None or not a.limits.needs_admission:
            continue
        hold = holds.get(a.allocation_id)
        if hold is None or not _same_hold(a, hold.record):
            return True
        if slices is not None and _changing_slice(a, slices) is not None:
            return True
    return False


def _same_hold(want: DeviceAssignment, rec: HoldRecord) -> bool:
    """Whether the hold on disk is kept for `want` (step 2): same binding and the same atoms."""
    same_binding = want.kubernetes == rec.kubernetes and want.binding in (BINDING_HOLD, BINDING_KUBERNETES)
    same_atoms = tuple(d.id for d in want.devices) == rec.device_ids and all(
        isinstance(parse_atom(d), Atom) for d in want.devices
    )
    return same_binding and same_atoms


def _overlap_atom(a: Atom, b: Atom) -> bool:
    """Two atoms one allocation cannot give up without the other (root's `_overlaps`): the same atom, or
    a whole GPU and any atom of it."""
    return a.id == b.id or (a.gpu == b.gpu and (a.whole or b.whole))


def _shares_atom(want: DeviceAssignment, rec: HoldRecord) -> bool:
    """Whether the hold on disk and the assignment share an atom by root's rule (`_overlaps` in
    bcd_helper.ops.files, on the ids as the signed spec lists them, whatever their class): the hold is
    then written over in place (with roots, root refuses its removal while the spec gives the
    allocation a shared atom), or kept as it is when the assignment is refused."""
    return any(_overlap_id(d.id, i) for d in want.devices for i in rec.device_ids)


def _overlap_id(a: str, b: str) -> bool:
    ga, gb = a.split("/")[0], b.split("/")[0]
    return a == b or (ga == gb and (a == ga or b == gb))


def _changing_slice(want: DeviceAssignment, slices: Mapping[str, SliceState]) -> SliceSpec | None:
    """The slice spec of a kept hold whose running slice enforces other limits than `want`'s."""
    if not want.sliced:
        return None
    assert want.limits is not None
    spec = slice_spec(want.allocation_id, want.limits)
    running = slices.get(spec.name)
    if running is None or running.limits is None or wanted_limits(spec) == running.limits:
        return None
    return spec


def applied_taker(slice_state: SliceState) -> Taker:
    """What a running slice holds now, from the limits its cgroup files enforce (its booking before a
    change): MemoryMax, and the huge page limits less what it has faulted in, on its memory nodes."""
    applied = slice_state.limits or {}
    memory = applied.get("MemoryMax", "")
    pages: dict[int, int] = {}
    for size, stem in HUGETLB_FILES.items():
        text = applied.get(stem, "")
        if text.isdigit() and int(text):
            faulted = slice_state.hugetlb_current.get(size, 0)
            pages[size] = max(0, (int(text) - faulted) // PAGE_BYTES[size])
    return Taker(int(memory) if memory.isdigit() else 0, pages, _mems(applied.get("AllowedMemoryNodes", "")))


def commitments(
    holds: Mapping[str, LiveHold],
    slices: Mapping[str, SliceState],
    assignments: tuple[DeviceAssignment, ...] = (),
) -> tuple[Taker, ...]:
    """The bound holds' commitments, which VM starts count in turn (DEV-ADM-17): a hold whose slice
    runs holds what the slice enforces (`applied_taker`: MemoryMax, huge page limits less what it has
    faulted in, on its memory nodes); a hold without one (a Kubernetes hold) what its assignment in
    `assignments` (the devices spec) booked (DEV-ADM-06: its memory, and its huge pages, none faulted
    in that bcd can see); a slice whose hold is gone, until it is stopped, what it enforces."""
    wanted = {a.allocation_id: a for a in assignments}
    out: list[Taker] = []
    counted: set[str] = set()
    for alloc in sorted(holds):
        name = slice_name(alloc)
        running = slices.get(name)
        if running is not None and running.limits is not None:
            out.append(applied_taker(running))
            counted.add(name)
        elif alloc in wanted:
            out.append(taker(wanted[alloc], running))
    for name in sorted(slices):
        running = slices[name]
        if name not in counted and running.limits is not None:
            out.append(applied_taker(running))
    return tuple(t for t in out if t.memory_bytes or any(t.hugepages.values()))


def faulted_taker(slice_state: SliceState) -> Taker:
    """The huge pages a running slice has faulted in (`hugetlb.<size>.current`), on its memory nodes."""
    pages = {
        size: b // PAGE_BYTES[size] for size, b in slice_state.hugetlb_current.items() if size in PAGE_BYTES
    }
    return Taker(0, pages, _mems((slice_state.limits or {}).get("AllowedMemoryNodes", "")))


def grown_limits(limits: Limits, slice_state: SliceState) -> Limits | None:
    """The quantities of `limits` that need more of the host than the running slice holds: memory
    above its MemoryMax; a huge page size above its limit, or any booked size when the memory nodes
    change (the pages must then fit on the new nodes). None when nothing grows (a hold that shrinks
    or keeps its booking is never refused)."""
    applied = slice_state.limits or {}
    old_memory = applied.get("MemoryMax", "")
    memory = limits.memory_bytes or 0
    grows_memory = memory // MEMORY_PAGE * MEMORY_PAGE > (int(old_memory) if old_memory.isdigit() else 0)
    old_nodes = _mems(applied.get("AllowedMemoryNodes", ""))
    moved = _mems(limits.mems) != old_nodes
    pages: dict[int, int | None] = {}
    for size, count in ((2048, limits.hugepages_2mi), (1048576, limits.hugepages_1gi)):
        text = applied.get(HUGETLB_FILES[size], "")
        old = int(text) // PAGE_BYTES[size] if text.isdigit() else 0
        pages[size] = count if count and (count > old or moved) else None
    if not grows_memory and pages[2048] is None and pages[1048576] is None:
        return None
    return Limits(
        mems=limits.mems,
        memory_bytes=limits.memory_bytes if grows_memory else None,
        hugepages_2mi=pages[2048],
        hugepages_1gi=pages[1048576],
    )


# --- checks ---------------------------------------------------------------------------------------


def _invalid(a: DeviceAssignment, seen_allocs: set[str]) -> str | None:
    if not cdi.ALLOCATION_ID_RE.fullmatch(a.allocation_id):
        return f"allocation id {a.allocation_id!r} must match {cdi.ALLOCATION_ID_RE.pattern}"
    if a.allocation_id in seen_allocs:
        return f"allocation {a.allocation_id} is listed twice"
    for line in a.env:
        try:
            cdi.check_env_line(line)
        except cdi.CdiError as exc:
            return str(exc)
        if line.partition("=")[0] in RESERVED_ENV_KEYS:
            return f"env line for {line.partition('=')[0]}: bcd sets that key itself"
    if a.limits is not None and a.sliced:
        err = check_slice_name(slice_name(a.allocation_id))
        if err:
            return err
    if a.limits is not None:
        for name in ("cpus", "mems"):
            err = check_cpulist(name, getattr(a.limits, name))
            if err:
                return err
    return None


def _resolve(a: DeviceAssignment, inventory: GpuInventory) -> tuple[tuple[Atom, ...], Refusal | None]:
    atoms: list[Atom] = []
    unsupported: list[str] = []
    for ref in a.devices:
        parsed = parse_atom(ref)
        if isinstance(parsed, Refusal):
            if parsed.message not in unsupported:
                unsupported.append(parsed.message)
        else:
            atoms.append(parsed)
    if unsupported:
        return (), Refusal(REASON_DEVICE, "; ".join(unsupported))
    missing_msgs: list[str] = []
    for atom in atoms:
        msg = missing(atom, inventory)
        if msg is not None and msg not in missing_msgs:
            missing_msgs.append(msg)
    if missing_msgs:
        return (), Refusal(REASON_MISSING, "; ".join(missing_msgs))
    return tuple(atoms), None


def _env_gpus(lines: tuple[str, ...] | None, inventory: GpuInventory) -> frozenset[str] | None:
    """The GPUs an env file's NVIDIA_VISIBLE_DEVICES names (a MIG UUID as its parent GPU); None for
    any GPU: an unreadable file, or a name the inventory does not know."""
    if lines is None:
        return None
    parents = {g.uuid: g.uuid for g in inventory.gpus}
    parents |= {m.uuid: g.uuid for g in inventory.gpus for m in g.migs if m.uuid}
    out: set[str] = set()
    for name in cdi.visible_device_names(lines):
        gpu = parents.get(name)
        if gpu is None:
            return None
        out.add(gpu)
    return frozenset(out)


def _pending_event(r: PendingRelease) -> ReleasedEvent:
    """The AllocationReleased of a pending Kubernetes release."""
    return ReleasedEvent(r.allocation_id, r.reservation_id, r.generation, r.device_ids, kubernetes=True)


def _released_as(rec: HoldRecord, event: ReleasedEvent) -> bool:
    """Whether the hold on disk is the one `event` released (its removals never began)."""
    return (
        rec.device_ids == event.device_ids
        and rec.kubernetes == event.kubernetes
        and rec.reservation_id == event.reservation_id
    )


def _orphan_key(alloc: str, finishing: Mapping[str, object]) -> str:
    """The action that removes an orphan env file: its interrupted release's, or its own."""
    return f"release-done:{alloc}" if alloc in finishing else f"release-env:{alloc}"


def _env_stays(
    alloc: str, lines: tuple[str, ...] | None, wanted: Mapping[str, DeviceAssignment], obs: Observed
) -> bool:
    """Whether the env file of `alloc`, with no CDI hold beside it, must stay: the spec lists the
    allocation and the file names an atom the spec gives it, or one the planner cannot place (root's
    rule for `file.remove`, bcd_helper.ops.files `_released_env`: with roots it refuses the removal,
    `hold-in-spec`, since the GPUs would look free to its busy check while jobs started under the file
    may run). Such a file is written over by the allocation's bind instead. Read as root reads it: a
    GPU's UUID names the whole GPU (no hold names its slots), a MIG UUID its MIG atom."""
    want = wanted.get(alloc)
    if want is None:
        return False
    if lines is None:
        return True
    migs = {
        m.uuid: f"{g.uuid}/gi{m.gpu_instance}/ci{m.compute_instance}"
        for g in obs.inventory.gpus
        for m in g.migs
        if m.uuid
    }
    named: set[str] = set()
    for name in cdi.visible_device_names(lines):
        if name in ("void", "none"):
            continue
        if name.startswith("GPU-"):
            named.add(name)
        elif name in migs:
            named.add(migs[name])
        else:
            return True
    return any(_overlap_id(d.id, n) for d in want.devices for n in named)


def _names_any(named: frozenset[str] | None, gpus: set[str]) -> bool:
    return named is None or bool(named & gpus)


def _overlap(alloc: str, atoms: tuple[Atom, ...], claims: Claims) -> str | None:
    ids = [a.id for a in atoms]
    wholes = {a.gpu for a in atoms if a.whole}
    if len(set(ids)) != len(ids) or any(not a.whole and a.gpu in wholes for a in atoms):
        return "a device is listed twice"
    msgs: list[str] = []
    for a in atoms:
        msg = claims.conflict(alloc, a)
        if msg is not None and msg not in msgs:
            msgs.append(msg)
    return "; ".join(msgs) if msgs else None


# --- the planner ----------------------------------------------------------------------------------


def plan(spec: DevicesSpec, obs: Observed) -> Plan:
    wanted: dict[str, DeviceAssignment] = {}
    for a in spec.assignments:
        wanted.setdefault(a.allocation_id, a)
    actions: list[Action] = []
    conditions: list[PlanCondition] = []
    warnings: list[str] = []
    bound = dict(obs.ledger.bound)
    failed = dict(obs.ledger.failed)
    releases = list(obs.releases)
    releases_changed = False
    marker = obs.marker

    # 0. an unreadable releases file: set it aside, write the marker.
    if obs.releases_unreadable:
        actions.append(Action("releases-unreadable", "releases", (SetAsideReleases(f"{int(obs.now)}"),)))
        releases = []
        marker = True

    # 1. pending Kubernetes releases.
    report_steps: list[Step] = []
    kept_releases: list[PendingRelease] = []
    forget: list[str] = []  # the journal keys of the releases this pass reports (ForgetEventKeys)
    for r in releases:
        if r.allocation_id in wanted:
            releases_changed = True  # taken back, unreported
            continue
        if not obs.pods_holding.get(r.allocation_id, True):
            reported = _pending_event(r)
            # Keyed: a crash after the event is journaled but before releasing.json drops the
            # record would otherwise report it again.
            report_steps.append(Emit(reported, release_key(reported)))
            forget.append(release_key(reported))
            bound.pop(r.allocation_id, None)
            releases_changed = True
            continue
        kept_releases.append(r)
        if obs.now - r.since > STUCK_AFTER_S:
            conditions.append(
                PlanCondition(
                    CONDITION_STUCK,
                    REASON_STUCK,
                    f"{r.allocation_id}: a pod still holds its devices after {int(obs.now - r.since)} s",
                )
            )
    if releases_changed:
        actions.append(
            Action("kube-reported", "releases", (*report_steps, WriteReleases(tuple(kept_releases))))
        )
    releases = kept_releases
    if marker and obs.kube_unknown_clear and not obs.releases_unreadable:
        actions.append(Action("marker", "releases", (RemoveMarker(),)))
        marker = False
    if marker:
        conditions.append(
            PlanCondition(
                CONDITION_UNREADABLE,
                REASON_UNREADABLE,
                "releasing.json could not be read; every GPU counts as claimed until the marker goes",
            )
        )

    # 2. holds no longer wanted (and changed holds that share no atom with their new assignment).
    # First the plain releases a crash interrupted (the ledger's `releasing`). One whose hold is on
    # disk as it was released never began its removals (the CDI spec goes first): dropped, and
    # released again below if still not wanted. Any other removed its spec at least (a bind may
    # have written a new one since): finished, its orphan env file removed and its event sent,
    # keyed, so an event the crash left journaled is not sent twice.
    finishing: dict[str, list[tuple[str, ReleasedEvent]]] = {}
    for key in sorted(obs.ledger.releasing):
        intent = obs.ledger.releasing[key]
        on_disk = obs.holds.get(intent.allocation_id)
        if on_disk is not None and _released_as(on_disk.record, intent):
            continue
        finishing.setdefault(intent.allocation_id, []).append((key, intent))
        forget.append(key)
    finish_at = len(actions)  # the intent and the finishing actions go here, once binds are known (5)
    # The AllocationBound keys the journal remembers for a hold on disk whose event the ledger has not
    # recorded (a crash between the event and the ledger's write): kept while that hold stands, so its
    # owed event journals nothing; forgotten by the action that removes or writes over the hold, or
    # with the ledger that records it. Any other bound key is stale: forgotten first thing (forget-keys)
    # and every bind or rebind under that key waits for it, so a new bind is never taken for a re-send.
    unrecorded: dict[str, str] = {}
    for alloc, hold in obs.holds.items():
        hold_key = bound_key(alloc, hold.record.generation)
        if obs.ledger.bound.get(alloc) != hold.record.generation and hold_key in obs.event_keys:
            unrecorded[alloc] = hold_key
    stale = {k for k in obs.event_keys if k.startswith(BOUND_KEY_PREFIX)} - set(unrecorded.values())
    new_intents: dict[str, ReleasedEvent] = {}
    released_slices: set[str] = set()
    released_atoms: dict[str, tuple[Atom, ...]] = {}
    kept: dict[str, LiveHold] = {}
    changed: dict[str, LiveHold] = {}
    for alloc in sorted(obs.holds):
        hold = obs.holds[alloc]
        rec = hold.record
        want = wanted.get(alloc)
        if want is not None and _same_hold(want, rec):
            kept[alloc] = hold
            continue
        if want is not None and _shares_atom(want, rec):
            changed[alloc] = hold  # written over in place (5), never removed
            continue
        atoms = tuple(atom_from_id(i) for i in rec.device_ids)
        released_atoms[alloc] = atoms
        steps: list[Step] = []
        event = ReleasedEvent(alloc, rec.reservation_id, spec.generation, rec.device_ids, rec.kubernetes)
        if rec.kubernetes and want is None:
            pending = PendingRelease(alloc, rec.reservation_id, spec.generation, rec.device_ids, obs.now)
            steps += [WriteReleases(tuple([*releases, pending])), RemoveSpec(alloc), RemoveEnv(alloc)]
            if obs.pods_holding.get(alloc, True):
                releases = [*releases, pending]
            else:
                # Recorded first; no pod holds the devices already: reported in this same pass.
                steps += [Emit(event, release_key(event)), WriteReleases(tuple(releases))]
                forget.append(release_key(event))
                bound.pop(alloc, None)
        else:
            # Recorded first (the ledger's `releasing`, by the "release-intent" action), so a crash
            # after the spec's removal still sends the event once (docs/devices.md).
            key = release_key(event)
            # A moved allocation's old env file naming a GPU its new atoms are on (a slot moved to
            # another slot of its GPU) stays: root keeps it while the spec lists the allocation, and the
            # bind writes it over.
            keep_env = want is not None and _env_stays(alloc, hold.env_lines, wanted, obs)
            steps += [RemoveSpec(alloc), *(() if keep_env else (RemoveEnv(alloc),)), Emit(event, key)]
            new_intents[key] = event
            forget.append(key)
            bound.pop(alloc, None)
        if alloc in unrecorded:
            steps.append(ForgetEventKeys((unrecorded[alloc],)))  # its hold is gone: never owed again
        if rec.cgroup_parent:
            released_slices.add(rec.cgroup_parent)
            st = obs.slices.get(rec.cgroup_parent)
            if st is not None and not st.populated:
                steps.append(StopSlice(rec.cgroup_parent))
        waits = {"release-intent"} if release_key(event) in new_intents else set()
        if alloc in finishing:
            waits.add(f"release-done:{alloc}")
        actions.append(
            Action(
                f"release:{alloc}",
                "kube-release" if rec.kubernetes else "release",
                tuple(steps),
                frozenset(waits),
            )
        )
    for alloc in obs.unparseable_specs:
        if alloc not in wanted:
            actions.append(Action(f"release:{alloc}", "release", (RemoveSpec(alloc), RemoveEnv(alloc))))
            warnings.append(
                f"{cdi.cdi_spec_path(alloc)} did not parse; removed (its allocation is not wanted)"
            )

    orphans_at = len(actions)  # orphan env files' removals go here, once the binds are known (5)

    # 3. leftover slices: stopped once the holds are written (their actions go after 5). The slice of
    # a hold the spec keeps without limits goes after that hold is written over without it (root
    # refuses to stop a slice a hold file still names: `hold-exists`), and not when that write failed.
    wanted_slices = {slice_name(a) for a, w in wanted.items() if w.sliced}
    leftover_slices: list[Action] = []
    for name in sorted(obs.slices):
        st = obs.slices[name]
        if name in wanted_slices or name in released_slices or st.populated:
            continue
        owner = name[len("bcd-alloc-") : -len(".slice")]
        held = owner in kept or owner in changed
        after = frozenset({f"keep:{owner}", f"rebind:{owner}"}) if held else frozenset()
        leftover_slices.append(Action(f"slice:{name}", "slice", (StopSlice(name),), after))

    # 4. holds still wanted. A running slice whose limits change is admitted again first (the hold's
    # old booking counts as freed; only what grows is checked); refused, the hold and its slice stay
    # as they are and the allocation fails with resources-exhausted.
    failures: list[Failure] = []
    committed = obs.domains_committed_bytes
    bookings, refused = _kept_bookings(kept, wanted, obs, committed, warnings)
    takers: list[Taker] = list(bookings.values())
    pending_devices = Claims(obs.vfio, UNREADABLE_OWNER if marker else None)
    holders: dict[str, tuple[str, ...]] = {}
    for alloc, hold in kept.items():
        want = wanted[alloc]
        rec = hold.record
        atoms = _atoms_of(want)
        pending_devices.add(alloc, atoms)
        holders[alloc] = rec.device_ids
        steps = []
        if alloc in refused:
            failures.append(Failure(alloc, REASON_EXHAUSTED, refused[alloc]))
        elif want.sliced:
            assert want.limits is not None
            wanted_slice = slice_spec(alloc, want.limits)
            running = obs.slices.get(wanted_slice.name)
            if running is None:
                steps.append(ApplySlice(wanted_slice))
            elif running.limits is not None and wanted_limits(wanted_slice) != running.limits:
                # Changed limits of a kept hold reach its running slice (Q-DEV-PASS-01).
                steps.append(ApplySlice(wanted_slice, reset_assignments(wanted_slice, running.limits)))
        resolvable = all(missing(a, obs.inventory) is None for a in atoms)
        if resolvable:
            doc, lines = hold_files(want, atoms, rec.generation, obs)
            if doc != hold.doc and alloc not in refused:
                steps.append(WriteSpec(alloc, doc))
            if hold.env_lines != lines and (alloc not in refused or hold.env_lines is None):
                steps.append(WriteEnv(alloc, lines))
        elif hold.env_lines is None:
            warnings.append(f"{alloc}: its devices are not in the inventory; env file not rewritten")
        after = frozenset[str]()
        if bound.get(alloc) != rec.generation:
            # Owed: never sent, or a crash after the bind's (or a rebind's) files and before the ledger;
            # keyed, so an event the crash left journaled is not journaled again. After the
            # allocation's interrupted release, if any (its AllocationReleased goes first).
            key = bound_key(alloc, rec.generation)
            steps.append(Emit(bound_event(want, atoms, rec.generation), key))
            forget.append(key)
            bound[alloc] = rec.generation
            after = frozenset({f"release-done:{alloc}"}) if alloc in finishing else frozenset()
        if steps:
            actions.append(Action(f"keep:{alloc}", "keep", tuple(steps), after))
    for r in releases:
        pending_devices.add(r.allocation_id, tuple(atom_from_id(i) for i in r.device_ids))
    for alloc, hold in changed.items():
        pending_devices.add(alloc, tuple(atom_from_id(i) for i in hold.record.device_ids))
    claims = pending_devices

    # 5a. changed holds sharing an atom with their new assignment (Q-DEV-PASS-01), before the new
    # holds, so that the atoms they drop are free to those. Each is checked as a new hold against the
    # claims (its own old atoms excepted); one that passes is written over in place, and then claims
    # its new atoms; one that fails keeps its old hold and files (its AllocationFailed once per
    # generation). A refused one is checked again while another passes (two that swap a GPU).
    rebinds: dict[str, frozenset[str]] = {}  # admitted, by allocation: the GPUs of their old holds
    todo = [a for a in _firsts(spec.assignments) if a.allocation_id in changed]
    last: dict[str, Refusal] = {}
    while todo:
        left: list[DeviceAssignment] = []
        for a in todo:
            checked = _check(a, obs, claims, set(), committed, takers, warnings)
            if isinstance(checked, Refusal):
                last[a.allocation_id] = checked
                left.append(a)
                continue
            alloc = a.allocation_id
            hold = changed[alloc]
            claims.drop(alloc)
            claims.add(alloc, checked)
            holders[alloc] = tuple(x.id for x in checked)
            if a.limits is not None:
                takers.append(taker(a, None))
            gpus = {x.gpu for x in checked}
            after = _waits(alloc, gpus, released_atoms, rebinds, obs, finishing)
            key = bound_key(alloc, spec.generation)
            if key in stale:
                after |= {"forget-keys"}
            forget.append(key)
            rebinds[alloc] = frozenset(i.split("/")[0] for i in hold.record.device_ids)
            steps = list(_rebind_steps(a, checked, hold, spec, obs))
            if alloc in unrecorded:
                # The old hold's key, once the hold on disk is the new one (before the new event, whose
                # key it is at the same generation).
                steps.insert(-1, ForgetEventKeys((unrecorded[alloc],)))
            actions.append(Action(f"rebind:{alloc}", "rebind", tuple(steps), after))
            bound[alloc] = spec.generation
            failed.pop(alloc, None)
        if len(left) == len(todo):
            break
        todo = left
    for a in todo:
        alloc = a.allocation_id
        failures.append(Failure(alloc, last[alloc].reason, last[alloc].message))
        refused[alloc] = last[alloc].message
        holders[alloc] = changed[alloc].record.device_ids
        running = obs.slices.get(slice_name(alloc))
        if running is not None and running.limits is not None:
            takers.append(applied_taker(running))

    # 5. new holds, in spec order.
    seen: set[str] = set()
    for a in spec.assignments:
        if (a.allocation_id in kept or a.allocation_id in changed) and a.allocation_id not in seen:
            seen.add(a.allocation_id)
            continue
        refusal = _check(a, obs, claims, seen, committed, takers, warnings)
        seen.add(a.allocation_id)
        if isinstance(refusal, Refusal):
            failures.append(Failure(a.allocation_id, refusal.reason, refusal.message))
            continue
        atoms = refusal
        alloc = a.allocation_id
        claims.add(alloc, atoms)
        holders[alloc] = tuple(x.id for x in atoms)
        if a.limits is not None:
            takers.append(taker(a, None))
        doc, lines = hold_files(a, atoms, spec.generation, obs)
        steps = []
        if a.sliced:
            assert a.limits is not None
            steps.append(ApplySlice(slice_spec(alloc, a.limits)))
        key = bound_key(alloc, spec.generation)
        steps += [
            WriteSpec(alloc, doc),
            WriteEnv(alloc, lines),
            Emit(bound_event(a, atoms, spec.generation), key),
        ]
        forget.append(key)
        bound[alloc] = spec.generation
        failed.pop(alloc, None)
        after = _waits(alloc, {x.gpu for x in atoms}, released_atoms, rebinds, obs, finishing)
        if key in stale:
            after |= {"forget-keys"}
        actions.append(Action(f"bind:{alloc}", "bind", tuple(steps), after))

    # 2 (continued). Orphan env files: removed before any bind, unless bound in this pass.
    actions[orphans_at:orphans_at] = [
        Action(f"release-env:{alloc}", "release", (RemoveEnv(alloc),))
        for alloc in sorted(obs.orphan_envs)
        if alloc not in holders
        and alloc not in finishing
        and not _env_stays(alloc, obs.orphan_envs[alloc], wanted, obs)
    ]
    # 2 (continued). The interrupted releases are finished, after the new ones are recorded.
    early: list[Action] = []
    if new_intents:
        intents = {k: v for k, v in obs.ledger.releasing.items() if k not in new_intents} | new_intents
        early.append(
            Action(
                "release-intent",
                "intent",
                (WriteLedger(Ledger(obs.ledger.bound, obs.ledger.failed, intents)),),
            )
        )
    for alloc in sorted(finishing):
        done: list[Step] = []
        if (
            alloc in obs.orphan_envs
            and alloc not in holders
            and not _env_stays(alloc, obs.orphan_envs[alloc], wanted, obs)
        ):
            done.append(RemoveEnv(alloc))
        done += [Emit(event, key) for key, event in finishing[alloc]]
        early.append(Action(f"release-done:{alloc}", "release", tuple(done)))
    actions[finish_at:finish_at] = early

    actions += leftover_slices  # 3 (continued)

    # 6. failures, once per allocation and generation.
    report: list[Step] = []
    by_alloc = {a.allocation_id: a for a in spec.assignments}
    for f in failures:
        if failed.get(f.allocation_id) == spec.generation or (
            f.allocation_id in holders and f.allocation_id not in refused
        ):
            # Once per allocation and generation; a later duplicate entry of an allocation its first
            # entry holds fails the section (its message names it) but sends no AllocationFailed.
            # A kept hold whose new limits were refused is reported (its assignment at this
            # generation cannot be honoured) though it stays bound with its old limits.
            continue
        a = by_alloc[f.allocation_id]
        report.append(
            Emit(
                FailedEvent(
                    f.allocation_id,
                    a.reservation_id,
                    spec.generation,
                    f.reason,
                    f.message,
                    tuple(d.id for d in a.devices),
                )
            )
        )
        failed[f.allocation_id] = spec.generation
    if report:
        actions.append(Action("failures", "report", tuple(report)))

    failed = {k: v for k, v in failed.items() if k in wanted and (k not in holders or k in refused)}
    bound = {k: v for k, v in bound.items() if k in holders or any(r.allocation_id == k for r in releases)}
    # A key the journal remembers for no release under way (a crash after the ledger dropped the
    # release, before its key was forgotten) and a stale bound key: forgotten now, before anything
    # is emitted.
    needed = {*obs.ledger.releasing, *(k for k in forget if k.startswith(RELEASE_KEY_PREFIX))}
    needed |= {release_key(_pending_event(r)) for r in obs.releases}
    needed |= set(unrecorded.values())
    leftover = tuple(sorted(obs.event_keys - needed))
    if leftover:
        actions.insert(0, Action("forget-keys", "keys", (ForgetEventKeys(leftover),)))

    # Every release planned in this pass is journaled in it: none stays under way (the applier keeps
    # those whose action failed, and forgets only the keys of events it journaled). The bound keys of
    # the pass are forgotten once the ledger that records their events is written.
    ledger = Ledger(bound=bound, failed=failed)
    if ledger != obs.ledger or forget:
        forgets = (ForgetEventKeys(tuple(sorted(set(forget)))),) if forget else ()
        actions.append(Action("ledger", "ledger", (WriteLedger(ledger), *forgets)))
    return Plan(tuple(actions), tuple(failures), tuple(conditions), tuple(warnings), holders)


def _firsts(assignments: tuple[DeviceAssignment, ...]) -> list[DeviceAssignment]:
    """Each allocation's first entry, in spec order (a later one is `listed twice`)."""
    seen: set[str] = set()
    out = []
    for a in assignments:
        if a.allocation_id not in seen:
            seen.add(a.allocation_id)
            out.append(a)
    return out


def _waits(
    alloc: str,
    gpus: set[str],
    released_atoms: Mapping[str, tuple[Atom, ...]],
    rebinds: Mapping[str, frozenset[str]],
    obs: Observed,
    finishing: Mapping[str, object],
) -> frozenset[str]:
    """The actions a hold written on `gpus` waits for (`Action.after`): the releases of holds on those
    GPUs and the allocation's own (its AllocationReleased before its AllocationBound), the holds written
    over in place earlier in the pass whose old atoms were on them (root refuses a hold naming an atom
    another allocation's hold or env file still names), the removal of orphan env files naming them,
    and the allocation's own interrupted release being finished."""
    return (
        frozenset(
            f"release:{o}" for o, old in released_atoms.items() if o == alloc or {x.gpu for x in old} & gpus
        )
        | frozenset(f"rebind:{o}" for o, old in rebinds.items() if o != alloc and old & gpus)
        | frozenset(
            _orphan_key(o, finishing)
            for o, lines in obs.orphan_envs.items()
            if o != alloc and _names_any(_env_gpus(lines, obs.inventory), gpus)
        )
        | (frozenset({f"release-done:{alloc}"}) if alloc in finishing else frozenset())
    )


def _rebind_steps(
    a: DeviceAssignment, atoms: tuple[Atom, ...], hold: LiveHold, spec: DevicesSpec, obs: Observed
) -> tuple[Step, ...]:
    """Writing a changed hold over in place (Q-DEV-PASS-01): its slice first (a sliced hold names it;
    its limits may change too), then the two files in the order that keeps the env file's
    NVIDIA_VISIBLE_DEVICES within the atoms the CDI hold on disk names at every step (root's busy
    check reads the CDI hold; NVIDIA's legacy hook reads the env file), so a crash between any two
    leaves no GPU handed out that no hold backs: growing, the hold first; shrinking, the env file
    first; both at once, the env file with the shared atoms only, the hold, the env file. Each write is
    an atomic rename: the old file or the new one, never none. Then AllocationBound (the new atoms,
    this generation, under this generation's key): no AllocationReleased, since the allocation never
    stopped holding."""
    alloc = a.allocation_id
    doc, lines = hold_files(a, atoms, spec.generation, obs)
    steps: list[Step] = []
    if a.sliced:
        assert a.limits is not None
        wanted_slice = slice_spec(alloc, a.limits)
        running = obs.slices.get(wanted_slice.name)
        if running is None or running.limits is None:
            steps.append(ApplySlice(wanted_slice))
        elif wanted_limits(wanted_slice) != running.limits:
            steps.append(ApplySlice(wanted_slice, reset_assignments(wanted_slice, running.limits)))
    first: tuple[str, ...] | None = None
    if hold.env_lines is not None and not set(cdi.visible_device_names(hold.env_lines)) <= set(
        cdi.visible_device_names(lines)
    ):
        old = tuple(atom_from_id(i) for i in hold.record.device_ids)
        shared = tuple(x for x in atoms if any(_overlap_atom(x, o) for o in old))
        first = hold_files(a, shared, spec.generation, obs)[1]
        steps.append(WriteEnv(alloc, first))
    steps.append(WriteSpec(alloc, doc))
    if lines != first:
        steps.append(WriteEnv(alloc, lines))
    steps.append(Emit(bound_event(a, atoms, spec.generation), bound_key(alloc, spec.generation)))
    return tuple(steps)


def _kept_bookings(
    kept: Mapping[str, LiveHold],
    wanted: Mapping[str, DeviceAssignment],
    obs: Observed,
    committed: int,
    warnings: list[str],
) -> tuple[dict[str, Taker], dict[str, str]]:
    """What each kept hold holds after this pass (its Taker), and the refused limit changes
    (allocation -> the ResourcesExhausted message).

    A kept hold whose running slice is to get other limits holds, until admitted, what its slice
    enforces now (`applied_taker`). Each such change is admitted in allocation order against every
    other kept hold's booking (an admitted change counts with its new limits against the next ones)
    and the domains' committed memory; only the quantities that grow are checked (`grown_limits`).
    Admission is skipped on a fakehw host; an unreadable host binds without it (with the warning)."""
    bookings: dict[str, Taker] = {}
    changing: list[str] = []
    for alloc in kept:
        want = wanted[alloc]
        running = obs.slices.get(slice_name(alloc))
        if running is not None and _changing_slice(want, obs.slices) is not None:
            bookings[alloc] = applied_taker(running)
            changing.append(alloc)
        else:
            bookings[alloc] = taker(want, running)
    refused: dict[str, str] = {}
    for alloc in changing:
        want = wanted[alloc]
        running = obs.slices[slice_name(alloc)]
        assert want.limits is not None
        grown = grown_limits(want.limits, running)
        if grown is not None and obs.admission:
            host = obs.host_memory
            if host is None:
                if ADMISSION_UNREADABLE_WARNING not in warnings:
                    warnings.append(ADMISSION_UNREADABLE_WARNING)
            elif isinstance(host, HostMemory):
                others = [t for other, t in bookings.items() if other != alloc]
                msg = admit(evolve(want, limits=grown), host, committed, others, faulted_taker(running))
                if msg:
                    refused[alloc] = msg
                    continue
        bookings[alloc] = taker(want, running)
    return bookings, refused


def _check(
    a: DeviceAssignment,
    obs: Observed,
    claims: Claims,
    seen: set[str],
    committed: int,
    takers: list[Taker],
    warnings: list[str],
) -> tuple[Atom, ...] | Refusal:
    """The checks in their order (DEV-FAIL-07); the atoms when every check passes."""
    invalid = _invalid(a, seen)
    if invalid:
        return Refusal(REASON_INVALID, invalid)
    if a.binding not in (BINDING_HOLD, BINDING_KUBERNETES):
        return Refusal(REASON_BINDING, f"binding {a.binding} is not supported")
    if not obs.privileged:
        return Refusal(REASON_UNPRIVILEGED, UNPRIVILEGED_MESSAGE)
    atoms, refusal = _resolve(a, obs.inventory)
    if refusal is not None:
        return refusal
    overlap = _overlap(a.allocation_id, atoms, claims)
    if overlap:
        return Refusal(REASON_OVERLAP, overlap)
    if obs.admission and a.limits is not None and a.limits.needs_admission:
        host = obs.host_memory
        if host is None:
            if ADMISSION_UNREADABLE_WARNING not in warnings:
                warnings.append(ADMISSION_UNREADABLE_WARNING)
        elif isinstance(host, HostMemory):
            msg = admit(a, host, committed, takers)
            if msg:
                return Refusal(REASON_EXHAUSTED, msg)
    return atoms


def with_host_memory(obs: Observed, host: HostMemory | None) -> Observed:
    return evolve(obs, host_memory=host)
