"""The devices section's VFIO conflict, fed from the instances section (DEV-PASS): both sections on
one simulated GPU host."""

from __future__ import annotations

from pathlib import Path

from bcd_agent.converge.section import Observation
from bcd_agent.converge.types import SectionState
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec
from bcd_agent.sections.instances.model import InstancesSpec
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


def test_DEV_ADM_17_vm_starts_count_the_bound_holds_commitments(sim_root: Path) -> None:
    """DEV-ADM-17: a VM start counts what the bound holds were promised, not what they use: a
    Kubernetes hold's booked memory (it has no slice), a sliced hold's MemoryMax, and the huge pages a
    hold may still take on its memory nodes though its slice has faulted none in. Refused, the VMs wait
    with ResourcesExhausted and stay unstarted; once the holds go, all start."""
    from bcd_agent.inventory.host import read_host_memory
    from bcd_agent.sections.devices.model import BINDING_KUBERNETES, Limits
    from instkit import Placement

    devices = Host(sim_root, pod_resources=_Pods())
    inst, rt = section(devices.system)
    inst.hold_assignments = lambda: devices.section.assignments  # as the node wires it
    mem = read_host_memory(devices.system)
    assert mem is not None
    gib = 1 << 30
    available = mem.normal_available_bytes // gib * gib
    kube = DeviceAssignment(
        "k1",
        "rsv_k1",
        BINDING_KUBERNETES,
        (DeviceRef(gpu_uuid(0)),),
        Limits(memory_bytes=available - 3 * gib),
    )
    pages = DeviceAssignment(
        "h1",
        "rsv_h1",
        devices=(DeviceRef(gpu_uuid(1)),),
        limits=Limits(mems="0", memory_bytes=gib, hugepages_1gi=14),
    )
    wide = DeviceAssignment(
        "h2", "rsv_h2", devices=(DeviceRef(gpu_uuid(2)),), limits=Limits(hugepages_2mi=8000)
    )
    assert devices.run(DevicesSpec(1, (kube, pages, wide))).state is SectionState.CONVERGED
    big = vm("big", memory_bytes=2 * gib)  # 2368 MiB with its VMM overhead; 2048 MiB are left
    huge = vm("huge", memory_bytes=4 * gib, placement=Placement(mems="0", hugepage_size_bytes=gib))
    anywhere = vm("anywhere", memory_bytes=gib, placement=Placement(hugepage_size_bytes=2 << 20))
    current = spec(big, huge, anywhere)
    assert converge(inst, current).state is SectionState.PROGRESSING
    waits = {i.instance_id: i.message for i in inst.last_report.instances if i.message}
    assert waits == {
        "big": "ResourcesExhausted: 2368 MiB of memory needed, 2048 MiB left on this host",
        # node 0 has 16 free 1 GiB pages, 14 of them h1's
        "huge": "ResourcesExhausted: 4 hugepages of 1048576 KiB needed, 2 free",
        # 8192 free 2 MiB pages host-wide, 8000 of them h2's (no memory nodes: counted host-wide)
        "anywhere": "ResourcesExhausted: 512 hugepages of 2048 KiB needed, 192 free",
    }
    assert {d.name: d.state for d in rt.list() if d.state != "stopped"} == {}
    assert devices.run(DevicesSpec(2, ())).state is SectionState.CONVERGED
    assert converge(inst, current).state is SectionState.CONVERGED
    assert {d.name: d.state for d in rt.list()} == dict.fromkeys(("big", "huge", "anywhere"), "running")


def test_DEV_ADM_17_the_node_wires_admission_both_ways(sim_root: Path, tmp_path: Path) -> None:
    """DEV-ADM-17 (and DEV-ADM-05) as `bcd node` composes its sections on the simulated host: a VM start
    counts a Kubernetes hold's booked memory, read from the devices spec; a new hold counts the running
    VM's committed memory. Neither is admitted over what the other was promised."""
    from types import SimpleNamespace

    from bcd_agent.config import load_config
    from bcd_agent.inventory.host import read_host_memory
    from bcd_agent.node import Node, NodeOptions
    from bcd_agent.sections.devices.events import KeyReportSigner, MemorySink
    from bcd_agent.sections.devices.model import BINDING_KUBERNETES, Limits
    from instkit import ctx

    toml = tmp_path / "node.toml"
    toml.write_text(f'data_dir = "{sim_root / "var/lib/bcd"}"\n[host]\nunits = false\n')
    node = Node(load_config(str(toml)), NodeOptions(root=str(sim_root)))
    node.secrets = SimpleNamespace(fetch=print)  # built by `run`; the telemetry section keeps a reference
    signer = KeyReportSigner.fresh("node-test-1", "boot-test-1")
    system = node._system()
    sections = {
        s.name: s for s in node._sections(system, MemorySink(), signer, SimpleNamespace(node_id="n1"), None)
    }
    devices, inst = sections["devices"], sections["instances"]
    devices.pod_resources = _Pods()
    mem = read_host_memory(system)
    assert mem is not None
    gib = 1 << 30
    available = mem.normal_available_bytes // gib * gib

    def run_devices(spec: DevicesSpec) -> SectionState:
        return devices.converge(spec, Observation(), ctx(spec.generation)).state  # type: ignore[no-any-return]

    def run_instances(spec: InstancesSpec) -> SectionState:
        return inst.converge(spec, Observation(), ctx(spec.generation)).state  # type: ignore[no-any-return]

    kube = DeviceAssignment(
        "k1",
        "rsv_k1",
        BINDING_KUBERNETES,
        (DeviceRef(gpu_uuid(0)),),
        Limits(memory_bytes=available - 2 * gib),
    )
    assert run_devices(DevicesSpec(1, (kube,))) is SectionState.CONVERGED
    assert run_instances(spec(vm("a", memory_bytes=2 * gib))) is SectionState.PROGRESSING
    assert inst.last_report.instances[0].message.startswith("ResourcesExhausted: 2368 MiB of memory needed")
    assert run_devices(DevicesSpec(2, ())) is SectionState.CONVERGED
    assert run_instances(spec(vm("a", memory_bytes=2 * gib), generation=2)) is SectionState.CONVERGED
    # a's 2 GiB and its overhead are committed: a hold of all the host's normal memory does not fit
    whole = DeviceAssignment("k2", "rsv_k2", BINDING_KUBERNETES, kube.devices, Limits(memory_bytes=available))
    assert run_devices(DevicesSpec(3, (whole,))) is SectionState.FAILED
    assert "ResourcesExhausted" in devices.converge(DevicesSpec(3, (whole,)), Observation(), ctx(3)).message
