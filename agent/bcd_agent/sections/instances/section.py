"""The instances section: observe -> plan (pure) -> apply, once per pass (a synchronous Section).

Built with the System, the runtimes this host runs (`runtimes_on_path`: `virsh` on PATH turns on
libvirt-kvm, DLV-RT-01/02; none: `this host runs no instance runtime`), data_dir, and a user-data
source (the session's SecretRequests: a SecretRequest bound to the instance's allocation, DLV-INST-06).

Outcome: FAILED with reason InstanceFailed when an instance is in ERROR and nothing waits
(DLV-INST-13); PROGRESSING (reason InstancesPending) while an instance waits (user data, admission,
a held GPU) or a step failed retryably, its message naming failures too, so a start refused by
admission is retried on the next pass even beside a failed instance (docs/instances.md); CONVERGED
otherwise. Each outcome carries the instances report (StatusReport.instances and instances_complete:
every runtime listed without error, Q-DLV-INST-02).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from bcd_shared import wire
from bcd_shared.errors import StepError, TerminalError
from bcd_shared.system import System

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import (
    InstanceReport,
    InstancesReport,
    SectionOutcome,
    SectionState,
    VolumeStorageReport,
)
from bcd_agent.inventory.gpus import GpuInventory, collect_gpus, sysfs_pci_address
from bcd_agent.inventory.host import parse_cpulist, read_host_memory
from bcd_agent.sections.instances.model import Desired, InstanceSpec, InstancesSpec, spec_from_wire
from bcd_agent.sections.instances.placement import HeldPages, HostFacts
from bcd_agent.sections.instances.plan import (
    Create,
    Delete,
    Grow,
    Observed,
    Plan,
    RemoveFiles,
    Resume,
    RuntimeView,
    Start,
    Step,
    Stop,
    Suspend,
    UserData,
    needs_user_data,
    plan,
    restore_limits,
    restores_kept,
    restores_wanted,
)
from bcd_agent.sections.instances.restores import SnapshotDownloads
from bcd_agent.sections.instances.runtimes.base import (
    PAUSED,
    RUNNING,
    CapacityRefused,
    Domain,
    Prepared,
    Runtime,
)
from bcd_agent.sections.instances.volumes import VolumeStore

if TYPE_CHECKING:  # the nftables policy (and bcd_shared.netpolicy) only where the node loads rules
    from bcd_agent.sections.instances.network import NetworkPolicy

log = logging.getLogger("bcd.instances")

SECTION = "instances"
REASON_FAILED = "InstanceFailed"
REASON_PENDING = "InstancesPending"
REASON_NO_RUNTIME = "NoInstanceRuntime"
CAPABILITIES = ("instance.placement",)


class UserDataSource(Protocol):
    def fetch(self, instance_id: str, allocation_id: str, ref: str) -> UserData: ...


def to_spec(desired: object | None, generation: int) -> InstancesSpec:
    if desired is None:
        return InstancesSpec(generation)
    if isinstance(desired, InstancesSpec):
        return desired
    if isinstance(desired, wire.InstancesSection):
        return spec_from_wire(generation, desired)
    raise TypeError(
        f"instances payload {type(desired).__name__} is neither InstancesSpec nor InstancesSection"
    )


def runtimes_on_path(which: Callable[[str], str | None] = shutil.which) -> tuple[str, ...]:
    """The built-in runtimes whose tools are on PATH (DLV-RT-01..04): libvirt-kvm here; cloud-hypervisor
    needs more (runtimes.cloudhypervisor.ch_available, checked in nodeparts.instances)."""
    return ("libvirt-kvm",) if which("virsh") else ()


def capabilities(runtimes: Sequence[object], network: bool = False, volumes: bool = False) -> tuple[str, ...]:
    """What Hello advertises: only what this bcd enforces (DLV-CAP-03/05): network policy and SSH from
    the host only when the node loads the nftables rules, volumes when the volume store exists."""
    if not runtimes:
        return ()
    extra = ("instance.network-policy", "instance.ssh-host-only") if network else ()
    return CAPABILITIES + extra + (("instance.volumes",) if volumes else ())


def host_facts(system: System) -> HostFacts:
    def ids(path: str) -> frozenset[int]:
        try:
            return frozenset(parse_cpulist(system.read_text(path) or ""))
        except ValueError:
            return frozenset()

    sizes = set()
    for entry in system.listdir("/sys/kernel/mm/hugepages"):
        if entry.startswith("hugepages-") and entry.endswith("kB") and entry[10:-2].isdigit():
            sizes.add(int(entry[10:-2]) * 1024)
    return HostFacts(
        ids("/sys/devices/system/cpu/online"), ids("/sys/devices/system/node/online"), frozenset(sizes)
    )


class InstancesSection:
    name = SECTION

    def __init__(
        self,
        system: System,
        runtimes: Sequence[Runtime],
        data_dir: str,
        *,
        user_data: UserDataSource | None = None,
        slice_records: bool = False,
        network: NetworkPolicy | None = None,
        volumes: VolumeStore | None = None,
        snapshots: SnapshotDownloads | None = None,
        records_dir: str | None = None,
    ) -> None:
        self.system = system
        self.runtimes = {r.name: r for r in runtimes}
        self.data_dir = data_dir
        # Where the devices section keeps releasing.json and its marker (the node's _records_dir).
        self.records_dir = data_dir if records_dir is None else records_dir
        # The devices spec's assignments (the node wires the devices section's): a Kubernetes hold's
        # booked memory has no slice to read back, yet starts count it (DEV-ADM-06, DEV-ADM-17).
        self.hold_assignments: Callable[[], Sequence[Any]] = tuple
        self.user_data = user_data
        self.slice_records = slice_records
        self.network = network  # None: no nftables rules (not advertised)
        self.volumes = volumes  # None: no volume store (instance.volumes not advertised)
        self.rebinder: Any = None  # rebind.Rebinder, set by the node (identity rebind, DLV-REB)
        self.balloons: Any = None  # balloon.BalloonController, set by the node (DLV-BAL)
        self.snapshots = snapshots  # None: restore_from instances wait (no downloader)
        import threading

        self._apply_lock = threading.Lock()  # an apply, or a snapshot registering its hold
        self._held: set[str] = set()  # instances an instance.snapshot has: no step touches them
        self.last_plan: Plan | None = None
        self.last_report = InstancesReport((), False)
        self._last_views: dict[str, RuntimeView] = {}

    def is_empty(self, desired: object | None) -> bool:
        if desired is None:
            return True
        if isinstance(desired, InstancesSpec | wire.InstancesSection):
            return not desired.instances and not desired.volumes
        return False

    # --- the devices section's VFIO conflict ---------------------------------------------------

    def vfio(self, desired: object | None) -> dict[str, str]:
        """GPU uuid -> instance: GPUs the current spec passes through, and those domains still running
        had at the last pass (DEV-PASS; fed to the devices section)."""
        out: dict[str, str] = {}
        if desired is not None:
            for inst in to_spec(desired, 1).instances:
                if inst.desired is not Desired.DELETED:
                    for uuid in inst.gpu_uuids:
                        out.setdefault(uuid, inst.id)
        if self.last_plan is not None:
            for uuid, who in self.last_plan.vfio.items():
                out.setdefault(uuid, who)
        return out

    def committed_bytes(self) -> int:
        """Normal memory the running and paused domains bcd manages hold, as of the last pass (the
        devices section's admission of holds counts it, DEV-ADM: VMs and holds never take what the
        other was promised)."""
        from bcd_agent.sections.instances.placement import committed_bytes

        return sum(
            committed_bytes(d.memory_bytes, d.hugepages)
            for view in self._last_views.values()
            for d in view.domains
            if d.managed and d.state in (RUNNING, PAUSED)
        )

    # --- observe -------------------------------------------------------------------------------

    def _inventory(self, observation: Observation | None) -> GpuInventory:
        if observation is not None and observation.has("inventory"):
            inv = observation.get("inventory")
            if isinstance(inv, GpuInventory):
                return inv
        return collect_gpus(self.system)

    def _holds(self) -> tuple[dict[str, str], int, tuple[HeldPages, ...]]:
        """GPU uuid -> the allocation holding it, and the bound holds' commitments a start counts in
        turn (DEV-ADM-17): their memory and the huge pages they may still take."""
        from bcd_agent.sections.devices import observe as dobs
        from bcd_agent.sections.devices.atoms import atom_from_id
        from bcd_agent.sections.devices.plan import commitments

        holds, _bad = dobs.read_holds(self.system)
        gpus: dict[str, str] = {}
        for alloc, hold in holds.items():
            for dev in hold.record.device_ids:
                try:
                    gpus.setdefault(atom_from_id(dev).gpu, alloc)
                except ValueError:
                    continue
        slices = dobs.read_slice_records(self.system) if self.slice_records else dobs.read_slices(self.system)
        takers = commitments(holds, slices, tuple(self.hold_assignments()))
        pages = tuple(
            HeldPages(size_kb * 1024, count, t.nodes)
            for t in takers
            for size_kb, count in sorted(t.hugepages.items())
            if count
        )
        return gpus, sum(t.memory_bytes for t in takers), pages

    def _release_claims(self, gpus: Mapping[str, object]) -> dict[str, str]:
        """GPUs a pending Kubernetes release claims (DEV-K8S-11), every GPU while the releases file is
        unreadable or its marker is set (DEV-K8S-16): the withdrawn hold's CDI spec is gone, so
        _holds no longer names them, but a pod may still use them."""
        from bcd_agent.sections.devices.busy import read_busy

        state = read_busy(self.system, self.records_dir, {})
        claims: dict[str, str] = {}
        for uuid in gpus:
            for alloc, held in sorted(state.releases.items()):
                if uuid in held:
                    claims.setdefault(
                        uuid, f"GPU {uuid} is claimed by the pending Kubernetes release of {alloc}"
                    )
            if state.unreadable:
                claims.setdefault(
                    uuid, f"GPU {uuid} is claimed: pending Kubernetes releases could not be read"
                )
        return claims

    def list_runtimes(self) -> dict[str, RuntimeView]:
        views: dict[str, RuntimeView] = {}
        for name, rt in self.runtimes.items():
            try:
                domains = rt.list()
                views[name] = RuntimeView(
                    name, domains, None, rt.checks_capacity, rt.leftovers(domains), hasattr(rt, "restore")
                )
            except StepError as exc:
                views[name] = RuntimeView(name, (), exc.message, rt.checks_capacity)
        return views

    def observe(self, spec: InstancesSpec, observation: Observation | None = None) -> Observed:
        views = self.list_runtimes()
        if self.snapshots is not None:
            try:  # every pass, an empty spec's too (DLV-SNAP-12)
                self.snapshots.prune(restores_kept(spec))
            except OSError as exc:
                log.warning("instances: pruning the downloaded snapshots: %s", exc)
        if not spec.instances:
            return Observed(runtimes=views)
        inventory = self._inventory(observation)
        addresses = {g.uuid: (sysfs_pci_address(g.bus_id) if g.bus_id else None) for g in inventory.gpus}
        gpu_holds, holds_bytes, holds_pages = self._holds()
        observed = Observed(
            runtimes=views,
            host=host_facts(self.system),
            memory=read_host_memory(self.system),
            holds_memory_bytes=holds_bytes,
            holds_pages=holds_pages,
            gpu_addresses=addresses,
            gpu_holds=gpu_holds,
            gpu_claims=self._release_claims(addresses),
        )
        listed = {d.name: d for v in views.values() for d in v.domains}
        if self.snapshots is not None:
            # The downloads never hold the pass up (DLV-SNAP-08/09).
            from attrs import evolve

            states = self.snapshots.states(restores_wanted(spec, listed), restore_limits(spec, listed))
            observed = evolve(observed, snapshots=states)
        wanted_data = needs_user_data(spec, listed)
        if wanted_data and self.user_data is not None:
            by_id = {i.id: i for i in spec.instances}
            fetched = {
                i: self.user_data.fetch(i, by_id[i].allocation_id, by_id[i].user_data_ref)
                for i in wanted_data
            }
            from attrs import evolve

            observed = evolve(observed, user_data=fetched)
        return observed

    # --- apply ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Keep the converger's steps off instance `name` (an `instance.snapshot` capturing it): taken
        between passes' applies, so no step of that instance is under way meanwhile."""
        with self._apply_lock:
            if name in self._held:
                raise TerminalError("InstanceBusy", f"instance {name} is being snapshotted already")
            self._held.add(name)
        try:
            yield
        finally:
            with self._apply_lock:
                self._held.discard(name)

    def apply(self, the_plan: Plan) -> tuple[dict[str, str], dict[str, str], dict[str, str], bool]:
        with self._apply_lock:
            return self._apply(the_plan)

    def _apply(self, the_plan: Plan) -> tuple[dict[str, str], dict[str, str], dict[str, str], bool]:
        """Run the steps in order; (errors, waits, retryable failures, changed). A failed create skips
        that instance's start; an instance a snapshot holds waits."""
        errors: dict[str, str] = {}
        waits: dict[str, str] = {}
        retry: dict[str, str] = {}
        changed = False
        for step in the_plan.steps:
            name = step.name if not isinstance(step, Create | Grow) else step.instance.id
            if name in self._held:
                waits[name] = "a snapshot of this instance is being taken"
                continue
            if name in errors or name in retry:
                continue
            rt = self.runtimes[step.runtime]
            try:
                self._run(rt, step)
                changed = True
            except CapacityRefused as exc:
                if rt.checks_capacity:
                    waits[name] = f"ResourcesExhausted: {exc.message}"
                else:
                    errors[name] = exc.message
            except TerminalError as exc:
                errors[name] = exc.message
            except StepError as exc:
                retry[name] = exc.message
        return errors, waits, retry, changed

    @staticmethod
    def _run(rt: Runtime, step: Step) -> None:
        if isinstance(step, Delete):
            rt.delete(step.name)
        elif isinstance(step, RemoveFiles):
            rt.remove_files(step.name)
        elif isinstance(step, Stop):
            rt.stop(step.name)
        elif isinstance(step, Suspend):
            rt.suspend(step.name)
        elif isinstance(step, Resume):
            rt.resume(step.name)
        elif isinstance(step, Create) and step.snapshot is not None:
            rt.restore(step.instance, step.snapshot, Prepared(step.gpu_addresses))  # type: ignore[attr-defined]
        elif isinstance(step, Create):
            rt.create(step.instance, Prepared(step.gpu_addresses, step.user_data))
        elif isinstance(step, Grow):
            rt.grow(step.instance, step.running)
        elif isinstance(step, Start):
            rt.start(step.instance, step.paused)

    # --- off the pass: identity rebind and balloons ---------------------------------------------

    def _rebound(self) -> Mapping[str, str]:
        return self.rebinder.rebound() if self.rebinder is not None else {}

    def _domains(self) -> list[Domain]:
        return [d for v in dict(self._last_views).values() for d in v.domains]

    def rebind_due(self, desired: object | None) -> bool:
        """Whether a rebind tick has anything to look at: an instance with an identity_rebind_ref, or
        kept rebind state (a tick prunes the state of instances gone). Cheap, on trio's thread: the
        node starts no worker thread every 10 s for a spec without rebinds."""
        if self.rebinder is None:
            return False
        state = self.rebinder.state
        if state.rebound or state.attempts:
            return True
        instances = getattr(desired, "instances", None) or ()
        return any(i.identity_rebind_ref for i in instances)

    def rebind_tick(self, desired: object | None) -> list[tuple[str, str]]:
        """Rebind the running instances that need it (off the pass, DLV-REB-04); a success shows in the
        report at once (DLV-REB-14)."""
        if self.rebinder is None:
            return []
        spec = to_spec(desired, 0)
        done: list[tuple[str, str]] = self.rebinder.tick(spec, self._domains())
        if any(outcome == "rebound" for _i, outcome in done):
            rebound = self._rebound()
            by_id = {i.id: i.identity_rebind_ref for i in spec.instances}
            self.last_report = attrs.evolve(
                self.last_report,
                instances=tuple(
                    attrs.evolve(r, identity_rebound_ref=_rebound_ref(r.instance_id, by_id, rebound))
                    for r in self.last_report.instances
                ),
            )
        return done

    def balloon_tick(self, desired: object | None) -> tuple[Any, ...]:
        """One balloon controller tick over the last pass's domains (DLV-BAL-03/04)."""
        if self.balloons is None:
            return ()
        return tuple(self.balloons.tick(to_spec(desired, 0), self._domains()))

    # --- volumes -------------------------------------------------------------------------------

    def volume_storage(self) -> VolumeStorageReport | None:
        """StatusReport.volume_storage (DLV-VOL-31..36); None without a store or when statfs fails."""
        if self.volumes is None:
            return None
        try:
            sp = self.volumes.space()
        except OSError as exc:
            log.warning("instances: volume store unreadable: %s", exc)
            return None
        return VolumeStorageReport(
            sp.total_bytes, sp.available_bytes, sp.reserved_bytes, sp.committed_bytes, sp.outstanding_bytes
        )

    # --- converge ------------------------------------------------------------------------------

    def plan(self, desired: object | None, generation: int, observation: Observation | None = None) -> Plan:
        spec = to_spec(desired, generation)
        return plan(spec, self.observe(spec, observation))

    def converge(self, desired: object | None, observation: Observation, ctx: PassContext) -> SectionOutcome:
        spec = to_spec(desired, ctx.generation)
        observed = self.observe(spec, observation)
        the_plan = plan(spec, observed)
        if self.network is not None and the_plan.section_error is None:
            from bcd_agent.sections.instances.network import enforce

            the_plan = enforce(self.network, spec, observed.runtimes, the_plan)
        vplan = None
        if the_plan.section_error is None:
            from bcd_agent.sections.instances import volumepass

            if self.volumes is not None:
                the_plan, vplan = volumepass.before(self.volumes, spec, observed.runtimes, the_plan)
            else:
                the_plan = volumepass.no_store(spec, the_plan)
        self.last_plan = the_plan
        for w in the_plan.warnings:
            log.warning("instances: %s", w)
        if the_plan.section_error is not None:
            self.last_report = InstancesReport((), True)
            return SectionOutcome(
                SECTION,
                SectionState.FAILED,
                REASON_NO_RUNTIME,
                the_plan.section_error,
                instances=self.last_report,
            )
        errors, waits, retry, changed = self.apply(the_plan)
        errors = {**the_plan.errors, **errors}
        waiting = {**the_plan.waiting, **waits, **retry}
        views = self.list_runtimes() if the_plan.steps else observed.runtimes
        if vplan is not None and self.volumes is not None:
            from bcd_agent.sections.instances import volumepass

            failed = volumepass.after(self.volumes, vplan, self.runtimes, observed.runtimes, views)
            waiting = {**waiting, **failed}
        self._last_views = dict(views)
        self.last_report = report(spec, views, errors, waiting, the_plan.notes, self._rebound())
        if self.volumes is not None:
            self.last_report = attrs.evolve(self.last_report, volume_storage=self.volume_storage())
        return outcome(errors, waiting, changed, self.last_report)


def _rebound_ref(name: str, refs: Mapping[str, str], rebound: Mapping[str, str]) -> str:
    """The reference reported for an instance: the one it was rebound to, while its spec still asks
    for exactly that one (a new reference is reported only once installed)."""
    got = rebound.get(name, "")
    return got if got and refs.get(name) == got else ""


def report(
    spec: InstancesSpec,
    views: Mapping[str, RuntimeView],
    errors: Mapping[str, str],
    waiting: Mapping[str, str],
    notes: Mapping[str, str] | None = None,
    rebound: Mapping[str, str] | None = None,
) -> InstancesReport:
    """StatusReport.instances: every domain the runtimes hold, and each spec instance without one."""
    out: list[InstanceReport] = []
    seen: set[str] = set()
    by_id = {i.id: i for i in spec.instances}
    refs = {i.id: i.identity_rebind_ref for i in spec.instances}
    domains: list[Domain] = [d for v in views.values() for d in v.domains]
    for d in domains:
        seen.add(d.name)
        inst = by_id.get(d.name) if d.managed else None
        state = {RUNNING: "RUNNING", PAUSED: "PAUSED"}.get(d.state, "STOPPED")
        message = ""
        if inst is not None and d.name in errors:
            state, message = "ERROR", errors[d.name]
        elif inst is not None and d.name in waiting:
            message = waiting[d.name]
        elif inst is not None and notes and d.name in notes:
            message = notes[d.name]
        ref = _rebound_ref(d.name, refs, rebound or {}) if inst is not None else ""
        out.append(InstanceReport(d.name, d.runtime, state, d.managed, message, d.allocation_id, d.name, ref))
    for inst in spec.instances:
        if inst.id in seen or inst.desired is Desired.DELETED:
            continue
        if inst.id in errors:
            out.append(
                InstanceReport(inst.id, inst.runtime, "ERROR", True, errors[inst.id], inst.allocation_id)
            )
        else:
            why = waiting.get(inst.id, "")
            out.append(InstanceReport(inst.id, inst.runtime, "PENDING", True, why, inst.allocation_id))
    complete = bool(views) and all(v.error is None for v in views.values())
    return InstancesReport(tuple(out), complete)


def outcome(
    errors: Mapping[str, str], waiting: Mapping[str, str], changed: bool, rep: InstancesReport
) -> SectionOutcome:
    failed = "; ".join(f"{i}: {m}" for i, m in errors.items())
    pending = "; ".join(f"{i}: {m}" for i, m in waiting.items())
    if waiting:
        message = "; ".join(x for x in (pending, failed) if x)
        return SectionOutcome(
            SECTION, SectionState.PROGRESSING, REASON_PENDING, message, changed=changed, instances=rep
        )
    if errors:
        return SectionOutcome(
            SECTION, SectionState.FAILED, REASON_FAILED, failed, changed=changed, instances=rep
        )
    return SectionOutcome(SECTION, SectionState.CONVERGED, "", "", changed=changed, instances=rep)


def spec_instance(desired: object | None, generation: int, instance_id: str) -> InstanceSpec | None:
    """The current spec's instance `instance_id` (None when the spec names none, or it is DELETED)."""
    for inst in to_spec(desired, generation).instances:
        if inst.id == instance_id and inst.desired is not Desired.DELETED:
            return inst
    return None
