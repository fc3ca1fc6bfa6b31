"""The devices section's VFIO conflict, fed from the instances section (DEV-PASS): both sections on
one simulated GPU host."""

from __future__ import annotations

from pathlib import Path

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import Host
from instkit import converge, section, spec, vm


def _hold(alloc: str, device: str, device_class: str = "gpu") -> DevicesSpec:
    return DevicesSpec(1, (DeviceAssignment(alloc, devices=(DeviceRef(device, device_class),)),))


def test_no_hold_on_a_gpu_an_instance_passes_through_dlv_dev_20(sim_root: Path) -> None:
    """DLV-DEV-20: the spec's passthrough GPUs, and those of domains still running at the last pass."""
    devices = Host(sim_root)
    inst, _ = section(devices.system)
    devices.section.vfio = lambda: inst.vfio(current)
    g3 = gpu_uuid(3)
    current = spec(vm("gpuvm", gpu_uuids=(g3,)))
    out = converge(inst, current)
    assert out.state is SectionState.CONVERGED, out.message
    assert inst.vfio(current) == {g3: "gpuvm"}
    refused = devices.run(_hold("alloc_a", g3))
    assert (
        refused.state is SectionState.FAILED
        and f"{g3} is passed through to instance gpuvm" in refused.message
    )
    # The spec drops the VM: the domain ran at the last pass, so the GPU stays claimed for this one.
    current = spec(generation=2)
    assert inst.vfio(current) == {g3: "gpuvm"}
    converge(inst, current)  # deletes it; the next pass frees the GPU
    converge(inst, current)
    assert inst.vfio(current) == {}
    assert devices.run(DevicesSpec(2, _hold("alloc_a", g3).assignments)).state is SectionState.CONVERGED


def test_a_vm_start_waits_for_a_gpu_a_live_hold_has_dlv_dev_21(sim_root: Path) -> None:
    """DLV-DEV-21: held whole or as a MIG instance, the GPU is not passed through; the VM waits."""
    devices = Host(sim_root)
    g1, g7 = gpu_uuid(1), gpu_uuid(7)
    spec_holds = DevicesSpec(
        1,
        (
            DeviceAssignment("alloc_whole", devices=(DeviceRef(g1),)),
            DeviceAssignment("alloc_mig", devices=(DeviceRef(f"{g7}/gi1/ci0", "gpu.mig"),)),
        ),
    )
    assert devices.run(spec_holds).state is SectionState.CONVERGED
    inst, _ = section(devices.system)
    out = converge(inst, spec(vm("w", gpu_uuids=(g1,)), vm("m", gpu_uuids=(g7,))))
    assert out.state is SectionState.PROGRESSING
    waits = {i.instance_id: i.message for i in inst.last_report.instances}
    assert waits == {
        "w": f"GPU {g1} is held by allocation alloc_whole",
        "m": f"GPU {g7} is held by allocation alloc_mig",
    }


def test_holds_are_admitted_against_running_domains_dlv_adm_07(sim_root: Path) -> None:
    """DLV-ADM-07 (and its mirror, DEV-ADM): a hold's memory limit is admitted against what the running
    domains bcd manages hold, so VMs and holds never take what the other was promised."""
    from bcd_agent.inventory.host import read_host_memory
    from bcd_agent.sections.devices.model import Limits

    devices = Host(sim_root)
    inst, _ = section(devices.system)
    devices.section.domains_committed_bytes = inst.committed_bytes
    mem = read_host_memory(devices.system)
    assert mem is not None
    half = (mem.normal_available_bytes // 2) // (1 << 30) * (1 << 30)
    hold = DevicesSpec(
        1,
        (DeviceAssignment("alloc_big", devices=(DeviceRef(gpu_uuid(0)),), limits=Limits(memory_bytes=half)),),
    )
    out = converge(inst, spec(vm("big", memory_bytes=half)))
    assert out.state is SectionState.CONVERGED, out.message
    assert inst.committed_bytes() == half + half // 32 + (256 << 20)
    refused = devices.run(hold)
    assert refused.state is SectionState.FAILED and "ResourcesExhausted" in refused.message
    converge(inst, spec(generation=2))
    assert inst.committed_bytes() == 0
    assert devices.run(DevicesSpec(2, hold.assignments)).state is SectionState.CONVERGED


class _Pods:
    """The kubelet's pod-resources answer: `held` device ids in one pod (nothing when empty)."""

    def __init__(self, *held: str) -> None:
        self.held = held

    def list(self) -> tuple[object, ...]:
        from bcd_agent.sections.devices.kube import PodDevices

        return (PodDevices("p", "ns", "c", "bcd.dev/gpu", self.held),) if self.held else ()


def test_DEV_K8S_11_a_vm_start_waits_for_a_gpu_a_pending_kubernetes_release_claims(sim_root: Path) -> None:
    """DEV-K8S-11: a withdrawn Kubernetes hold whose GPU a pod still holds keeps it from a VM, which
    waits naming the release; once reported, the VM gets it. DEV-K8S-16: while the releases file is
    unreadable (the marker), every GPU is claimed and the VM waits too."""
    g2 = gpu_uuid(2)
    pods = _Pods(g2)
    devices = Host(sim_root, pod_resources=pods)
    kube = DeviceAssignment("k1", "rsv_k1", "BINDING_KUBERNETES", (DeviceRef(g2),))
    assert devices.run(DevicesSpec(1, (kube,))).state is SectionState.CONVERGED
    assert devices.run(DevicesSpec(2, ())).state is SectionState.PROGRESSING  # the release is pending
    inst, _ = section(devices.system)
    current = spec(vm("w", gpu_uuids=(g2,)))
    assert converge(inst, current).state is SectionState.PROGRESSING
    waits = {i.instance_id: i.message for i in inst.last_report.instances}
    assert waits == {"w": f"GPU {g2} is claimed by the pending Kubernetes release of k1"}
    pods.held = ()
    devices.run(DevicesSpec(3, ()))
    assert converge(inst, current).state is SectionState.CONVERGED
    # the unreadable-releases marker claims every GPU, this VM's too once it is stopped and started again
    marker = sim_root / "var/lib/bcd/releasing.unreadable"
    marker.write_text("")
    other = spec(vm("w", gpu_uuids=(g2,)), vm("x", gpu_uuids=(gpu_uuid(3),)), generation=2)
    assert converge(inst, other).state is SectionState.PROGRESSING
    waits = {i.instance_id: i.message for i in inst.last_report.instances if i.message}
    assert waits == {"x": f"GPU {gpu_uuid(3)} is claimed: pending Kubernetes releases could not be read"}


def test_DEV_CONF_12_a_vm_start_is_refused_a_gpu_held_whole_as_mig_as_slot_or_pending_release(
    sim_root: Path,
) -> None:
    """DEV-CONF-12: a VM start is refused a GPU a live hold names whole, as a MIG instance or as a slot,
    and one a pending Kubernetes release names; each VM waits naming who has it, and is not started.
    A VM on a GPU nothing names starts in the same pass. Once the holds go and the release is reported,
    every VM starts."""
    g1, g4, g7, g2, g5 = (gpu_uuid(i) for i in (1, 4, 7, 2, 5))
    pods = _Pods(g2)
    devices = Host(sim_root, pod_resources=pods)
    kube = DeviceAssignment("k1", "rsv_k1", "BINDING_KUBERNETES", (DeviceRef(g2),))
    assert devices.run(DevicesSpec(1, (kube,))).state is SectionState.CONVERGED
    holds = (
        DeviceAssignment("alloc_whole", devices=(DeviceRef(g1),)),
        DeviceAssignment("alloc_mig", devices=(DeviceRef(f"{g7}/gi1/ci0", "gpu.mig"),)),
        DeviceAssignment("alloc_slot", devices=(DeviceRef(f"{g4}/s1", "gpu.slot"),)),
    )
    # k1 withdrawn while a pod still holds its GPU: its release stays pending.
    assert devices.run(DevicesSpec(2, holds)).state is SectionState.PROGRESSING
    inst, rt = section(devices.system)
    vms = (
        vm("whole", gpu_uuids=(g1,)),
        vm("mig", gpu_uuids=(g7,)),
        vm("slot", gpu_uuids=(g4,)),
        vm("kube", gpu_uuids=(g2,)),
        vm("free", gpu_uuids=(g5,)),
    )
    assert converge(inst, spec(*vms)).state is SectionState.PROGRESSING
    waits = {i.instance_id: i.message for i in inst.last_report.instances if i.message}
    assert waits == {
        "whole": f"GPU {g1} is held by allocation alloc_whole",
        "mig": f"GPU {g7} is held by allocation alloc_mig",
        "slot": f"GPU {g4} is held by allocation alloc_slot",
        "kube": f"GPU {g2} is claimed by the pending Kubernetes release of k1",
    }
    # the refused ones were never created, let alone started
    assert {d.name: d.state for d in rt.list()} == {"free": "running"}
    pods.held = ()
    assert devices.run(DevicesSpec(3, ())).state is SectionState.CONVERGED
    assert converge(inst, spec(*vms)).state is SectionState.CONVERGED
    assert {d.name: d.state for d in rt.list()} == dict.fromkeys(
        ("whole", "mig", "slot", "kube", "free"), "running"
    )


def test_DEV_CONF_11_a_gpu_dropped_from_a_running_vms_spec_stays_the_vms_until_its_next_start(
    sim_root: Path,
) -> None:
    """DEV-CONF-11: the spec drops a GPU from a VM that runs: the domain keeps it (its definition applies
    at its next start), so a hold on it is refused naming the VM and another VM that asks for it waits,
    never started on it. The VM stops (its guest shut down) and bcd starts it again without the GPU:
    from then on the hold binds."""
    devices = Host(sim_root)
    inst, rt = section(devices.system)
    devices.section.vfio = lambda: inst.vfio(current)
    g3 = gpu_uuid(3)
    current = spec(vm("a", gpu_uuids=(g3,)))
    assert converge(inst, current).state is SectionState.CONVERGED
    current = spec(vm("a"), vm("b", gpu_uuids=(g3,)), generation=2)
    for _ in range(2):  # the claim lasts, pass after pass, while the domain runs
        assert converge(inst, current).state is SectionState.PROGRESSING
        assert inst.vfio(current)[g3] in ("a", "b") and inst.last_plan is not None
        assert inst.last_plan.vfio[g3] == "a"
        waits = {i.instance_id: i.message for i in inst.last_report.instances if i.message}
        assert waits["b"] == f"GPU {g3} is still passed through to instance a, whose domain runs"
        assert {d.name: d.state for d in rt.list()} == {"a": "running"}
        refused = devices.run(_hold("alloc_a", g3))  # the spec's b or the running a: both refuse it
        assert (
            refused.state is SectionState.FAILED and f"{g3} is passed through to instance" in refused.message
        )
    # Without b, the VFIO claim the devices section sees is a's alone, from its running domain.
    current = spec(vm("a"), generation=3)
    converge(inst, current)
    assert inst.vfio(current) == {g3: "a"}
    refused = devices.run(DevicesSpec(2, _hold("alloc_a", g3).assignments))
    assert refused.state is SectionState.FAILED and f"{g3} is passed through to instance a" in refused.message
    assert rt.virsh.act("destroy", "a").ok  # the guest powers off
    converge(inst, current)  # a starts again, defined without the GPU
    assert {d.name: d.state for d in rt.list()} == {"a": "running"}
    assert inst.vfio(current) == {}
    assert devices.run(DevicesSpec(3, _hold("alloc_a", g3).assignments)).state is SectionState.CONVERGED
