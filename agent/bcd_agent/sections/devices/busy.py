"""Busy checks (gpu.reset, diag.dcgm from level 2, VM starts, mig-layout) and the gpu.reset core.

A GPU is busy when a live CDI hold names it (whole, by a MIG instance or by a slot), a VM has it
through VFIO, a pending Kubernetes release names it, or the releases file is unreadable (the marker:
every GPU). Everything is read from the files (holds, releasing.json, the marker) and the VFIO map
the instances side gives, never from memory.

Messages (Q-DEV-BUSY-01): `<gpu> is held by allocation <id>`, `<gpu> is passed through to instance
<id>`, `<gpu> is claimed by the pending Kubernetes release of <id>`, `<gpu> is claimed: pending
Kubernetes releases could not be read`; several are joined by `; `.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from attrs import frozen
from bcd_shared import wire
from bcd_shared.system import CommandResult, System

from bcd_agent.inventory.gpus import GpuInventory, collect_gpus
from bcd_agent.sections.devices import observe
from bcd_agent.sections.devices.atoms import atom_from_id

GPU_BUSY = "gpu-busy"
INVALID_PAYLOAD = "invalid-payload"


class GpuBusy(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = GPU_BUSY
        self.message = message


@frozen
class BusyState:
    holds: Mapping[str, tuple[str, ...]]  # allocation -> GPU uuids it names
    releases: Mapping[str, tuple[str, ...]]  # pending release allocation -> GPU uuids
    unreadable: bool
    vfio: Mapping[str, str]

    def why(self, gpu: str) -> list[str]:
        reasons = [
            f"{gpu} is held by allocation {a}" for a, gpus in sorted(self.holds.items()) if gpu in gpus
        ]
        if gpu in self.vfio:
            reasons.append(f"{gpu} is passed through to instance {self.vfio[gpu]}")
        reasons += [
            f"{gpu} is claimed by the pending Kubernetes release of {a}"
            for a, gpus in sorted(self.releases.items())
            if gpu in gpus
        ]
        if self.unreadable:
            reasons.append(f"{gpu} is claimed: pending Kubernetes releases could not be read")
        return reasons

    def busy(self) -> set[str]:
        """Named GPUs (the all-GPUs claim of an unreadable file is not expanded here)."""
        out = set(self.vfio)
        for gpus in (*self.holds.values(), *self.releases.values()):
            out.update(gpus)
        return out


def read_busy(system: System, data_dir: str, vfio: Mapping[str, str]) -> BusyState:
    holds, _ = observe.read_holds(system)
    releases, unreadable = observe.read_releases(system, data_dir)
    marker = system.exists(f"{data_dir}/{observe.MARKER_FILE}")

    def gpus(ids: Sequence[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(atom_from_id(i).gpu for i in ids))

    return BusyState(
        holds={a: gpus(h.record.device_ids) for a, h in holds.items()},
        releases={r.allocation_id: gpus(r.device_ids) for r in releases},
        unreadable=unreadable or marker,
        vfio=dict(vfio),
    )


def check_not_busy(gpu_uuids: Sequence[str], state: BusyState) -> None:
    """Raise GpuBusy naming every hold, instance or release that has one of `gpu_uuids`."""
    reasons: list[str] = []
    for g in gpu_uuids:
        reasons += state.why(g)
    if reasons:
        raise GpuBusy("; ".join(dict.fromkeys(reasons)))


def dcgm_busy_check(level: int, gpu_uuids: Sequence[str], inventory: GpuInventory, state: BusyState) -> None:
    """diag.dcgm from level 2: the gpu.reset check over the payload's GPUs (empty: every GPU)."""
    if level < 2:
        return
    check_not_busy(list(gpu_uuids) or [g.uuid for g in inventory.gpus], state)


Resetter = Callable[[str], CommandResult]


def gpu_reset(
    system: System,
    gpu_uuids: Sequence[str],
    state: BusyState,
    reset: Resetter | None = None,
) -> wire.GpuResetResult:
    """The gpu.reset core (DEV-BUSY-02..12). Raises ValueError (invalid-payload) for an empty list and
    GpuBusy before touching any GPU. `reset` runs the reset (default `nvidia-smi --gpu-reset -i <uuid>`
    through the System; under the helper, the helper's gpu.reset op)."""
    if not gpu_uuids:
        raise ValueError("gpu_uuids must not be empty")
    check_not_busy(gpu_uuids, state)
    before = collect_gpus(system)
    known = {g.uuid for g in before.gpus}
    run = reset or (lambda uuid: system.run(["nvidia-smi", "--gpu-reset", "-i", uuid], timeout=300))
    outcomes: dict[str, wire.GpuResetOutcome] = {}
    for uuid in gpu_uuids:
        if uuid not in known:
            outcomes[uuid] = wire.GpuResetOutcome(
                gpu_uuid=uuid, reset=False, healthy=False, message="unknown GPU"
            )
            continue
        result = run(uuid)
        if result.ok:
            outcomes[uuid] = wire.GpuResetOutcome(gpu_uuid=uuid, reset=True)
        else:
            text = (result.stdout + result.stderr).decode(errors="replace").strip()
            outcomes[uuid] = wire.GpuResetOutcome(
                gpu_uuid=uuid, reset=False, message=text or result.describe()
            )
    after = collect_gpus(system)
    for uuid, out in outcomes.items():
        if out.reset:
            gpu = after.gpu(uuid)
            out.healthy = gpu is not None and gpu.health.healthy
            if gpu is None:
                out.message = "not listed after the reset"
    return wire.GpuResetResult(gpus=[outcomes[u] for u in gpu_uuids])
