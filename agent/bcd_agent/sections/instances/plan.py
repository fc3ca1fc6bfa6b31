"""The instances planner: `plan(spec, observed) -> Plan`. Pure: no I/O, no clock.

The seeds' rules first (delivery.md "Instances", DLV-INST, DLV-PLC, DLV-ADM, DLV-RT):
1. A host with no runtime runs no instances: a non-empty section fails, `this host runs no instance
   runtime` (DLV-RT-10).
2. A domain bcd created that no spec names, or whose desired state is DELETED, is deleted
   (DLV-INST-03/04). A domain bcd did not create is never touched, only reported (DLV-INST-05). An
   instance directory without a domain (a create that failed) goes when its instance is not wanted.
3. Each instance, in spec order, fails alone (ERROR, DLV-INST-12) when: its spec breaks a rule
   (model.check_instance); its taps' names are another instance's (`nics: instance <id>'s taps (...)
   are instance <other>'s too: ...`; the one whose domain exists, else the first in the spec, keeps
   them: instancenames.tap_collision); its runtime is not on this host (`<runtime> runtime is not installed on
   this host`, DLV-RT-05); a domain of that name exists that bcd did not create; its placement cannot
   apply (DLV-PLC-05/06); a GPU is not in the inventory or has no bus id (DLV-LIBVIRT-14), or an
   earlier instance passes it through already; its user data was refused (DLV-INST-07); a step
   failed terminally (a bad image, a shrink, a start the runtime refused for lack of memory).
4. It waits (PENDING, section PROGRESSING) for: its runtime's listing (failed this pass), its user
   data (the broker unavailable, DLV-INST-08), a GPU a live hold has or a pending Kubernetes release
   claims, a GPU another domain that runs still has (dropped from its spec, DEV-CONF-11), host admission
   (`ResourcesExhausted: ...`, DLV-ADM-12/13, never ERROR).
5. A missing domain is created (image, overlay, seed, define; user data fetched before); a domain
   whose definition digest (model.definition_digest) differs is defined again while it is stopped,
   and keeps its definition while it runs (a note in its status); a start
   (new or stopped domain, to RUNNING or PAUSED) is admitted first (DLV-ADM-01); PAUSED from running
   is `suspend`, RUNNING from paused is `resume` (not a boot, not admitted; DLV-INST-10, DLV-ADM-02);
   STOPPED from running or paused is `stop`. A disk whose size grew is grown; a smaller one fails.
6. Order: deletes and stops first, then suspends, creates, grows, resumes and starts (DLV-INST-16),
   so what a stop frees is there for a start in the same pass.
After a host reboot the domains are stopped, and rule 5 starts the ones that should run (DLV-INST-11).
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import field, frozen
from bcd_shared.instancenames import tap_collision, tap_stem

from bcd_agent.inventory.host import HostMemory
from bcd_agent.sections.instances.model import (
    Desired,
    InstanceSpec,
    InstancesSpec,
    check_instance,
    definition_digest,
)
from bcd_agent.sections.instances.placement import (
    Admission,
    HeldPages,
    HostFacts,
    check_placement,
    committed_bytes,
)
from bcd_agent.sections.instances.restores import SnapshotState
from bcd_agent.sections.instances.runtimes.base import PAUSED, RUNNING, STOPPED, Domain

NO_RUNTIME = "this host runs no instance runtime"


# --- observations ---------------------------------------------------------------------------------


@frozen
class RuntimeView:
    """One runtime's listing this pass: its domains, or why it could not be listed."""

    name: str
    domains: tuple[Domain, ...] = ()
    error: str | None = None
    checks_capacity: bool = False
    leftovers: tuple[str, ...] = ()  # instance directories without a domain
    snapshots: bool = False  # it takes snapshots, and so restores them (DLV-RT-09: plugins do not)


@frozen
class UserData:
    """The outcome of an instance's user-data SecretRequest."""

    data: bytes | None = None  # fetched
    refused: str | None = None  # the control plane refused: the instance fails
    unavailable: str | None = None  # the broker did not answer: wait


@frozen
class Observed:
    runtimes: Mapping[str, RuntimeView] = field(factory=dict)
    host: HostFacts = field(factory=lambda: HostFacts(frozenset(), frozenset(), frozenset()))
    memory: HostMemory | None = None  # None: /proc/meminfo unreadable (admitted with a warning)
    holds_memory_bytes: int = 0  # the bound holds' memory limits (DLV-ADM-07)
    holds_pages: tuple[HeldPages, ...] = ()  # the huge pages bound holds may still take (DEV-ADM-17)
    gpu_addresses: Mapping[str, str | None] = field(factory=dict)  # uuid -> sysfs PCI address or None
    gpu_holds: Mapping[str, str] = field(factory=dict)  # uuid -> allocation holding it
    gpu_claims: Mapping[str, str] = field(factory=dict)  # uuid -> why a pending Kubernetes release claims it
    user_data: Mapping[str, UserData] = field(factory=dict)  # instance id -> fetched or why not
    snapshots: Mapping[str, SnapshotState] = field(factory=dict)  # restore_from SHA-256 -> download


# --- steps ----------------------------------------------------------------------------------------


@frozen
class Delete:
    runtime: str
    name: str


@frozen
class RemoveFiles:
    """An instance directory no domain has, whose instance is not wanted (a create that failed)."""

    runtime: str
    name: str


@frozen
class Stop:
    runtime: str
    name: str


@frozen
class Suspend:
    runtime: str
    name: str


@frozen
class Resume:
    runtime: str
    name: str


@frozen
class Create:
    runtime: str
    instance: InstanceSpec
    gpu_addresses: tuple[str, ...] = ()
    user_data: bytes | None = None
    snapshot: str | None = None  # a restore: the verified tar (the runtime's `restore`, not `create`)


@frozen
class Grow:
    runtime: str
    instance: InstanceSpec
    running: bool


@frozen
class Start:
    runtime: str
    name: str
    paused: bool
    instance: InstanceSpec


Step = Delete | RemoveFiles | Stop | Suspend | Resume | Create | Grow | Start
_ORDER = {Delete: 0, RemoveFiles: 0, Stop: 1, Suspend: 2, Create: 3, Grow: 4, Resume: 5, Start: 6}


@frozen
class Plan:
    steps: tuple[Step, ...] = ()
    errors: Mapping[str, str] = field(factory=dict)  # instance id -> ERROR message
    waiting: Mapping[str, str] = field(factory=dict)  # instance id -> why it waits (PENDING)
    section_error: str | None = None  # the whole section fails (rule 1)
    warnings: tuple[str, ...] = ()
    # GPU uuid -> instance id that has or will have it passed through (the devices section's VFIO)
    vfio: Mapping[str, str] = field(factory=dict)
    needs_user_data: tuple[str, ...] = ()  # instances whose user data the section must fetch first
    notes: Mapping[str, str] = field(factory=dict)  # instance id -> a status message that is not a wait


def needs_user_data(spec: InstancesSpec, domains: Mapping[str, Domain]) -> tuple[str, ...]:
    """Instances that are about to be defined and have user data (fetched before the pass plans)."""
    return tuple(
        i.id
        for i in spec.instances
        if i.user_data_ref
        and not i.restore_from  # a restore boots with its snapshot's seed
        and i.desired is not Desired.DELETED
        and i.id not in domains
        and check_instance(i) is None
    )


def _domains(observed: Observed) -> dict[str, Domain]:
    out: dict[str, Domain] = {}
    for view in observed.runtimes.values():
        for d in view.domains:
            out.setdefault(d.name, d)
    return out


def _tap_owners(spec: InstancesSpec, domains: Mapping[str, Domain]) -> dict[str, str]:
    """Which instance each tap stem belongs to (instancenames.tap_collision): of the valid instances
    with NICs whose taps share names, one whose domain exists, else the first in the spec; the others
    are refused (root refuses them too: docs/instances.md, "Tap names")."""
    owners: dict[str, str] = {}
    candidates = [
        i for i in spec.instances if i.desired is not Desired.DELETED and i.nics and check_instance(i) is None
    ]
    for inst in sorted(candidates, key=lambda i: _rank(i, domains)):
        owners.setdefault(tap_stem(inst.id), inst.id)
    return owners


def _rank(inst: InstanceSpec, domains: Mapping[str, Domain]) -> int:
    """0 for an instance whose domain exists (it keeps its tap names), 1 otherwise."""
    return 0 if inst.id in domains else 1


def plan(spec: InstancesSpec, observed: Observed) -> Plan:
    domains = _domains(observed)
    wanted = {i.id: i for i in spec.instances if i.desired is not Desired.DELETED}
    if spec.instances and not observed.runtimes:
        return Plan(section_error=NO_RUNTIME)
    steps: list[Step] = []
    errors: dict[str, str] = {}
    waiting: dict[str, str] = {}
    notes: dict[str, str] = {}
    warnings: list[str] = []
    leaving: set[str] = set()
    # Rule 2: bcd's domains no spec names (or DELETED) go; unmanaged ones are never touched.
    for existing in domains.values():
        if existing.managed and existing.name not in wanted:
            steps.append(Delete(existing.runtime, existing.name))
            leaving.add(existing.name)
    for listed in observed.runtimes.values():
        for name in listed.leftovers:
            if name not in wanted or wanted[name].runtime != listed.name:
                steps.append(RemoveFiles(listed.name, name))
    vfio: dict[str, str] = {}
    # GPUs the domains that run (or are paused) have now, whatever their spec says: one dropped from a
    # running VM's spec stays that VM's until its next start (DEV-CONF-11), so no other VM starts on it.
    running_gpus: dict[str, str] = {}
    for dom in domains.values():
        if dom.state != STOPPED:
            for bus in dom.gpu_addresses:
                for uuid, a in observed.gpu_addresses.items():
                    if a == bus:
                        running_gpus.setdefault(uuid, dom.name)
    committed = sum(
        committed_bytes(d.memory_bytes, d.hugepages)
        for d in domains.values()
        if d.managed and d.state in (RUNNING, PAUSED) and not observed.runtimes[d.runtime].checks_capacity
    )
    # Stops run first: what they free counts for the starts of this pass.
    for inst in spec.instances:
        cur = domains.get(inst.id)
        if cur is not None and cur.managed and inst.desired is Desired.STOPPED and cur.state != STOPPED:
            committed -= committed_bytes(cur.memory_bytes, cur.hugepages)
    for name in leaving:
        gone = domains[name]
        if gone.state in (RUNNING, PAUSED) and not observed.runtimes[gone.runtime].checks_capacity:
            committed -= committed_bytes(gone.memory_bytes, gone.hugepages)
    admission = Admission.open(observed.memory, committed, observed.holds_memory_bytes, observed.holds_pages)
    if observed.memory is None and any(
        i.desired in (Desired.RUNNING, Desired.PAUSED) for i in wanted.values()
    ):
        warnings.append("host memory unreadable (/proc/meminfo): starting instances without host admission")
    tap_owners = _tap_owners(spec, domains)
    for inst in spec.instances:
        if inst.desired is Desired.DELETED:
            continue
        problem = check_instance(inst)
        if problem is not None:
            errors[inst.id] = problem
            continue
        other = tap_owners.get(tap_stem(inst.id), inst.id) if inst.nics else inst.id
        if other != inst.id:
            errors[inst.id] = f"nics: {tap_collision(inst.id, other)}"
            continue
        view = observed.runtimes.get(inst.runtime)
        if view is None:
            errors[inst.id] = f"{inst.runtime} runtime is not installed on this host"
            continue
        if view.error is not None:
            waiting[inst.id] = f"waiting for the {inst.runtime} runtime's listing: {view.error}"
            continue
        d = domains.get(inst.id)
        if d is not None and not d.managed:
            errors[inst.id] = (
                f"a domain named {inst.id} exists that bcd did not create: it is never defined over"
            )
            continue
        if d is not None and d.runtime != inst.runtime:
            errors[inst.id] = f"instance {inst.id} runs under {d.runtime}, not {inst.runtime}"
            continue
        problem = check_placement(inst, observed.host)
        if problem is not None:
            errors[inst.id] = problem
            continue
        addresses: list[str] = []
        gpu_problem = gpu_wait = None
        for uuid in inst.gpu_uuids:
            address = observed.gpu_addresses.get(uuid)
            if uuid not in observed.gpu_addresses:
                gpu_problem = f"GPU {uuid} is not in this host's inventory"
            elif address is None:
                gpu_problem = f"GPU {uuid} has no PCI bus id in the inventory"
            elif uuid in vfio:
                gpu_problem = f"GPU {uuid} is passed through to instance {vfio[uuid]} already"
            elif running_gpus.get(uuid, inst.id) != inst.id and (d is None or d.state == STOPPED):
                gpu_wait = (
                    f"GPU {uuid} is still passed through to instance {running_gpus[uuid]}, whose domain runs"
                )
            elif uuid in observed.gpu_holds and (d is None or d.state == STOPPED):
                gpu_wait = f"GPU {uuid} is held by allocation {observed.gpu_holds[uuid]}"
            elif uuid in observed.gpu_claims and (d is None or d.state == STOPPED):
                gpu_wait = observed.gpu_claims[uuid]
            if gpu_problem:
                break
            if address is not None:
                addresses.append(address)
        if gpu_problem is not None:
            errors[inst.id] = gpu_problem
            continue
        for uuid in inst.gpu_uuids:
            if running_gpus.get(uuid, inst.id) == inst.id:  # not the GPU of another running domain
                vfio[uuid] = inst.id
        if gpu_wait is not None:
            waiting[inst.id] = gpu_wait
            continue
        wants_up = inst.desired in (Desired.RUNNING, Desired.PAUSED)
        paused = inst.desired is Desired.PAUSED
        if d is None and inst.restore_from:
            if not view.snapshots:
                errors[inst.id] = (
                    f"restore_from: the {inst.runtime} runtime takes no snapshots, so it restores none"
                )
                continue
            snap = observed.snapshots.get(inst.restore_sha256)
            if snap is not None and snap.failed is not None and snap.mismatch:
                errors[inst.id] = snap.failed  # DLV-SNAP-05, for a minute; then it is fetched again
                continue
            if snap is None or snap.path is None:
                why = (
                    f"the download failed ({snap.failed}); it is tried again a minute after"
                    if snap is not None and snap.failed is not None
                    else "downloading the snapshot"
                )
                waiting[inst.id] = f"waiting for the user data or snapshot: {why}"
                continue
            steps.append(Create(inst.runtime, inst, tuple(addresses), None, snap.path))
            if wants_up:
                _start(steps, waiting, admission, inst, view, paused)
            continue
        if d is None:
            user_data: bytes | None = None
            if inst.user_data_ref:
                got = observed.user_data.get(inst.id)
                if got is not None and got.refused is not None:
                    errors[inst.id] = f"user data refused: {got.refused}"
                    continue
                if got is None or got.data is None:
                    why = got.unavailable if got is not None and got.unavailable else "not fetched yet"
                    waiting[inst.id] = f"waiting for the user data: {why}"
                    continue
                user_data = got.data
            steps.append(Create(inst.runtime, inst, tuple(addresses), user_data))
            if wants_up:
                _start(steps, waiting, admission, inst, view, paused)
            continue
        # A changed definition is defined again while the domain is stopped (or stopped in this pass:
        # creates run after stops); a running one keeps its definition until it stops.
        if d.definition != definition_digest(inst, tuple(addresses)):
            if d.state == STOPPED or inst.desired is Desired.STOPPED:
                steps.append(Create(inst.runtime, inst, tuple(addresses), None))
            else:
                notes[inst.id] = "the spec changed the definition: it applies when the domain next stops"
        if inst.disk_bytes and d.disk_bytes is not None and inst.disk_bytes != d.disk_bytes:
            if inst.disk_bytes < d.disk_bytes:
                errors[inst.id] = (
                    f"size.disk_bytes {inst.disk_bytes} is below the disk's {d.disk_bytes} (disks only grow)"
                )
                continue
            steps.append(Grow(inst.runtime, inst, running=d.state != STOPPED))
        if inst.desired is Desired.STOPPED:
            if d.state != STOPPED:
                steps.append(Stop(inst.runtime, inst.id))
        elif d.state == STOPPED:
            _start(steps, waiting, admission, inst, view, paused)
        elif d.state == RUNNING and paused:
            steps.append(Suspend(inst.runtime, inst.id))
        elif d.state == PAUSED and not paused:
            steps.append(Resume(inst.runtime, inst.id))
    for uuid, name in running_gpus.items():  # GPUs of domains still running keep their claim this pass
        vfio.setdefault(uuid, name)
    ordered = tuple(sorted(steps, key=lambda s: _ORDER[type(s)]))
    return Plan(
        steps=ordered,
        errors=errors,
        waiting=waiting,
        warnings=tuple(warnings),
        vfio=vfio,
        needs_user_data=needs_user_data(spec, domains),
        notes=notes,
    )


def _start(
    steps: list[Step],
    waiting: dict[str, str],
    admission: Admission,
    inst: InstanceSpec,
    view: RuntimeView,
    paused: bool,
) -> None:
    if not view.checks_capacity:
        refused = admission.admit(inst)
        if refused is not None:
            waiting[inst.id] = refused
            return
    steps.append(Start(inst.runtime, inst.id, paused, inst))


def _restoring(spec: InstancesSpec, domains: Mapping[str, Domain]) -> list[InstanceSpec]:
    """The valid instances without a domain that restore from a snapshot."""
    return [
        i
        for i in spec.instances
        if i.restore_from
        and i.desired is not Desired.DELETED
        and i.id not in domains
        and check_instance(i) is None
    ]


def restores_wanted(spec: InstancesSpec, domains: Mapping[str, Domain]) -> dict[str, str]:
    """The snapshots to fetch this pass (SHA-256 -> URL): those of valid instances without a domain."""
    return {i.restore_sha256: i.restore_from for i in _restoring(spec, domains)}


def snapshot_limit(inst: InstanceSpec) -> int:
    """The most a snapshot of `inst` can weigh (restore_from's download cap): its disk (a qcow2 of
    disk_bytes, with up to 1/64 of metadata), its memory (a memory snapshot's state) and 1 GiB for the
    seed, the configuration files and the tar's headers."""
    return inst.disk_bytes + inst.disk_bytes // 64 + inst.memory_bytes + (1 << 30)


def restore_limits(spec: InstancesSpec, domains: Mapping[str, Domain]) -> dict[str, int]:
    """Each snapshot of restores_wanted's with its download cap: the largest of the instances that
    restore from it."""
    out: dict[str, int] = {}
    for i in _restoring(spec, domains):
        out[i.restore_sha256] = max(out.get(i.restore_sha256, 0), snapshot_limit(i))
    return out


def restores_kept(spec: InstancesSpec) -> frozenset[str]:
    """The downloaded snapshots a spec still restores from (the others go, DLV-SNAP-12)."""
    return frozenset(
        i.restore_sha256 for i in spec.instances if i.restore_from and i.desired is not Desired.DELETED
    )
