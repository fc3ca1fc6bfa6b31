"""The devices section: observe -> plan (pure) -> apply, once per pass (a synchronous Section).

Inputs given when the section is built (never module state): the System, a HoldExecutor (direct or
through the helper), the event sink and the node's report signer, data_dir, whether the node may
take holds (`privileged`: root, or a `[helper] socket`, or the simulated host), whether host
admission applies (False on a fakehw host), the VFIO source (GPU uuid -> instance id, as the
instances section sees them: current specs plus GPUs running domains had at the last pass), the
committed memory of running and paused domains, the pod-resources source, and a wall clock.

The outcome: FAILED with reason AllocationFailed when a new hold was refused (message
`<allocation>: <message>` per failure, joined by `; `); PROGRESSING when a write failed (retried in 30 s)
or a Kubernetes release is still pending (the 30-second recheck); CONVERGED otherwise. Conditions:
KubernetesReleaseStuck, KubernetesReleasesUnreadable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from attrs import evolve
from bcd_shared import cdi, wire
from bcd_shared.errors import RetryableError
from bcd_shared.system import System

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import Condition, SectionOutcome, SectionState
from bcd_agent.inventory.gpus import GpuInventory, collect_gpus
from bcd_agent.inventory.host import read_host_memory
from bcd_agent.sections.devices import observe
from bcd_agent.sections.devices.apply import Applier, HoldExecutor
from bcd_agent.sections.devices.atoms import atom_from_id
from bcd_agent.sections.devices.events import EventSink, ReportSigner
from bcd_agent.sections.devices.kube import (
    PodResourcesClient,
    PodResourcesError,
    bcd_devices,
    gpus_with_pod_processes,
)
from bcd_agent.sections.devices.model import DeviceAssignment, DevicesSpec, spec_from_wire
from bcd_agent.sections.devices.plan import EVENT_KEY_PREFIX, Observed, Plan, needs_host_memory, plan

log = logging.getLogger("bcd.devices")

SECTION = "devices"
REASON_FAILED = "AllocationFailed"
REASON_WRITE = "HoldWriteFailed"
REASON_PENDING = "KubernetesReleasePending"


def to_spec(desired: object | None, generation: int) -> DevicesSpec:
    if desired is None:
        return DevicesSpec(generation=generation)
    if isinstance(desired, DevicesSpec):
        return desired if desired.generation == generation else evolve(desired, generation=generation)
    if isinstance(desired, wire.DevicesSection):
        return spec_from_wire(generation, desired)
    raise TypeError(f"devices payload {type(desired).__name__} is neither DevicesSpec nor DevicesSection")


class DevicesSection:
    name = SECTION

    def __init__(
        self,
        system: System,
        executor: HoldExecutor,
        sink: EventSink,
        signer: ReportSigner,
        data_dir: str,
        *,
        privileged: bool = True,
        admission: bool = True,
        vfio: Callable[[], Mapping[str, str]] = dict,
        domains_committed_bytes: Callable[[], int] = lambda: 0,
        pod_resources: PodResourcesClient | None = None,
        clock: Callable[[], float] = time.time,
        slice_records: bool = False,
    ) -> None:
        self.slice_records = slice_records
        self.system = system
        self.executor = executor
        self.sink = sink
        self.signer = signer
        self.data_dir = data_dir
        self.privileged = privileged
        self.admission = admission
        self.vfio = vfio
        self.domains_committed_bytes = domains_committed_bytes
        self.pod_resources = pod_resources
        self.clock = clock
        self.gpu_uuids: tuple[str, ...] = ()
        self.held_device_ids: Mapping[str, tuple[str, ...]] = {}
        # The spec's assignments as of the last pass: the instances section counts the bound holds'
        # bookings from them (a Kubernetes hold's has no slice to read back; DEV-ADM-17).
        self.assignments: tuple[DeviceAssignment, ...] = ()

    def is_empty(self, desired: object | None) -> bool:
        if desired is None:
            return True
        if isinstance(desired, DevicesSpec):
            return not desired.assignments
        if isinstance(desired, wire.DevicesSection):
            return not desired.assignments
        return False

    # --- observe --------------------------------------------------------------------------------

    def inventory(self, observation: Observation | None) -> GpuInventory:
        if observation is not None and observation.has("inventory"):
            inv = observation.get("inventory")
            if isinstance(inv, GpuInventory):
                return inv
        return collect_gpus(self.system)

    def observe(self, spec: DevicesSpec, observation: Observation | None = None) -> Observed:
        inventory = self.inventory(observation)
        if inventory.errors and not inventory.nvml:
            raise RetryableError("InventoryUnreadable", "nvidia-smi failed: " + "; ".join(inventory.errors))
        holds, bad = observe.read_holds(self.system)
        releases, unreadable = observe.read_releases(self.system, self.data_dir)
        marker = self.system.exists(f"{self.data_dir}/{observe.MARKER_FILE}")
        obs = Observed(
            inventory=inventory,
            holds=holds,
            unparseable_specs=bad,
            slices=observe.read_slice_records(self.system)
            if self.slice_records
            else observe.read_slices(self.system),
            releases=releases,
            releases_unreadable=unreadable,
            marker=marker,
            vfio=dict(self.vfio()),
            vendor=observe.read_vendor_spec(self.system),
            mps_dir=self.system.exists("/run/nvidia-mps"),
            privileged=self.privileged,
            admission=self.admission,
            domains_committed_bytes=self.domains_committed_bytes(),
            ledger=observe.read_ledger(self.system, self.data_dir),
            now=self.clock(),
            orphan_envs=observe.read_orphan_envs(self.system, {*holds, *bad}),
            event_keys=self.sink.event_keys(EVENT_KEY_PREFIX),
        )
        if releases or marker or unreadable or any(h.record.kubernetes for h in holds.values()):
            holding, clear = self._kube_side(obs)
            obs = evolve(obs, pods_holding=holding, kube_unknown_clear=clear)
        if self.admission and needs_host_memory(spec, holds, obs.slices):
            obs = evolve(obs, host_memory=read_host_memory(self.system))
        return obs

    def _kube_side(self, obs: Observed) -> tuple[dict[str, bool], bool]:
        """Ask the kube side once: which pending releases pods still hold; whether the marker may go."""
        held: set[str] | None = None
        if self.pod_resources is not None:
            try:
                held = bcd_devices(self.pod_resources.list())
            except PodResourcesError as exc:
                log.warning("devices: %s", exc)
        gpus_busy = gpus_with_pod_processes(self.system)
        holding: dict[str, bool] = {}
        candidates = [(r.allocation_id, r.device_ids) for r in obs.releases]
        candidates += [(a, h.record.device_ids) for a, h in obs.holds.items() if h.record.kubernetes]
        for alloc, ids in candidates:
            if held is None or gpus_busy is None:
                holding[alloc] = True
                continue
            names = {*ids, *(cdi.device_name(d) for d in ids)}
            whole = {atom_from_id(d).gpu for d in ids if atom_from_id(d).whole}
            holding[alloc] = bool(names & held) or bool(whole & gpus_busy)
        known: set[str] = set()
        for h in obs.holds.values():
            known |= {*h.record.device_ids, *(cdi.device_name(d) for d in h.record.device_ids)}
        for r in obs.releases:
            known |= {*r.device_ids, *(cdi.device_name(d) for d in r.device_ids)}
        clear = held is not None and not (held - known)
        return holding, clear

    # --- converge -------------------------------------------------------------------------------

    def plan(self, desired: object | None, generation: int, observation: Observation | None = None) -> Plan:
        spec = to_spec(desired, generation)
        return plan(spec, self.observe(spec, observation))

    def converge(self, desired: object | None, observation: Observation, ctx: PassContext) -> SectionOutcome:
        spec = to_spec(desired, ctx.generation)
        self.assignments = spec.assignments
        observed = self.observe(spec, observation)
        # What bcd's own metrics report as holds per GPU (bcd.gpu.holds, docs/telemetry.md).
        self.gpu_uuids = tuple(g.uuid for g in observed.inventory.gpus)
        self.held_device_ids = {a: h.record.device_ids for a, h in observed.holds.items()}
        the_plan = plan(spec, observed)
        for w in the_plan.warnings:
            log.warning("devices: %s", w)
        # The agent's own records (data_dir) are written as the node writes its journal; the host's
        # files go through the executor (the root-only rule when acting as root, or the helper).
        result = Applier(self.executor, self.system, self.data_dir, self.sink, self.signer, log.warning).run(
            the_plan
        )
        conditions = tuple(
            Condition(type=c.type, reason=c.reason, message=c.message, section=SECTION)
            for c in the_plan.conditions
        )
        changed = result.changed
        if the_plan.failures:
            message = "; ".join(f"{f.allocation_id}: {f.message}" for f in the_plan.failures)
            log.error("devices: %s", message)
            return SectionOutcome(SECTION, SectionState.FAILED, REASON_FAILED, message, conditions, changed)
        if result.errors:
            message = "; ".join(f"{k}: {m}" for k, m in result.errors)
            log.warning("devices: %s", message)
            return SectionOutcome(
                SECTION, SectionState.PROGRESSING, REASON_WRITE, message, conditions, changed
            )
        pending = self._pending_after(the_plan)
        if pending:
            msg = "waiting for pods to free the devices of " + ", ".join(pending)
            return SectionOutcome(SECTION, SectionState.PROGRESSING, REASON_PENDING, msg, conditions, changed)
        return SectionOutcome(SECTION, SectionState.CONVERGED, "", "", conditions, changed)

    def _pending_after(self, the_plan: Plan) -> list[str]:
        releases, _ = observe.read_releases(self.system, self.data_dir)
        return [r.allocation_id for r in releases]
