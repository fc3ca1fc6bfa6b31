"""The devices section end to end on the simulated GPU host (files, slices, events, restart)."""

from __future__ import annotations

import json
import stat

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.devices.events import sign_report
from bcd_agent.sections.devices.model import (
    BINDING_HOLD,
    BINDING_KUBERNETES,
    DeviceAssignment,
    DeviceRef,
    DevicesSpec,
    Limits,
)
from bcd_agent.sections.devices.plan import UNPRIVILEGED_MESSAGE
from bcd_shared import wire
from bcd_shared.pki import Purpose, verify_signature
from bcd_simhost.gpus import gpu_uuid, mig_uuid, update_state
from devices.cdicheck import assert_host_cdi_valid
from devices.devhost import DATA_DIR, Host, systemctl_calls

G0, G1, G7 = gpu_uuid(0), gpu_uuid(1), gpu_uuid(7)


def hold(
    alloc: str,
    *devices: tuple[str, str],
    binding: str = BINDING_HOLD,
    limits: Limits | None = None,
    env: tuple[str, ...] = (),
    rsv: str = "",
) -> DeviceAssignment:
    return DeviceAssignment(
        alloc, rsv or f"rsv_{alloc}", binding, tuple(DeviceRef(i, c) for i, c in devices), limits, env
    )


def gpu(u: str) -> tuple[str, str]:
    return (u, "gpu")


def test_DEV_CDI_22_DEV_ENV_08_worked_example_whole_gpu_with_limits(host: Host) -> None:
    """Covers DEV-CDI-01..07, DEV-CDI-10..12, DEV-CDI-15, DEV-CDI-17..19, DEV-CDI-22, DEV-ENV-01..04,
    DEV-ENV-08,
    DEV-BIND-01, DEV-SLICE-09..14, DEV-SLICE-22, DEV-EVT-04/05, DLV-DEV-01/02/04/22/37,
    DEV-ASG-01..04, DEV-ASG-06, DEV-ASG-08, DEV-ATOM-01..03, DEV-SLICE-01, DEV-SLICE-06, DEV-SEE-03,
    DEV-SEE-04, DEV-ENV-06, DEV-CDI-21, DEV-PASS-16, DLV-DEV-09, DLV-DEV-13, DLV-DEV-23..25,
    DLV-DEV-30..33, DLV-DEV-35."""
    a = hold(
        "alloc_01jz8k2v",
        gpu(G0),
        rsv="rsv_01jz8k1q",
        limits=Limits(cpus="0-7", mems="0", cpu_millis=1500, memory_bytes=8 << 30),
    )
    out = host.run(DevicesSpec(42, (a,)))
    assert out.state is SectionState.CONVERGED
    spec_path = host.path("/etc/cdi/bcd-alloc_01jz8k2v.json")
    assert stat.S_IMODE(spec_path.stat().st_mode) == 0o644
    doc = json.loads(spec_path.read_text())
    assert doc["cdiVersion"] == "0.7.0" and doc["kind"] == "bcd.dev/gpu"
    assert doc["annotations"] == {
        "bcd.dev/allocation-id": "alloc_01jz8k2v",
        "bcd.dev/reservation-id": "rsv_01jz8k1q",
        "bcd.dev/generation": "42",
        "bcd.dev/cgroup-parent": "bcd-alloc-alloc_01jz8k2v.slice",
    }
    [dev] = doc["devices"]
    assert dev["name"] == G0 and dev["annotations"] == {"bcd.dev/device-id": G0}
    assert dev["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidia0"}, {"path": "/dev/dri/card1"}]}
    edits = doc["containerEdits"]
    assert edits["env"][:3] == [
        "BCD_ALLOCATION_ID=alloc_01jz8k2v",
        "BCD_CGROUP_PARENT=bcd-alloc-alloc_01jz8k2v.slice",
        f"NVIDIA_VISIBLE_DEVICES={G0}",
    ]
    assert "NVIDIA_VISIBLE_DEVICES=void" not in edits["env"]
    assert {"path": "/dev/nvidiactl"} in edits["deviceNodes"] and edits["additionalGids"] == [44]
    assert edits["hooks"][0]["path"] == "/usr/bin/nvidia-cdi-hook"
    env = host.path("/run/bcd/allocations/alloc_01jz8k2v.env")
    assert env.read_text().splitlines() == [
        "BCD_ALLOCATION_ID=alloc_01jz8k2v",
        "BCD_CGROUP_PARENT=bcd-alloc-alloc_01jz8k2v.slice",
        "BCD_RESERVATION_ID=rsv_01jz8k1q",
        f"NVIDIA_VISIBLE_DEVICES={G0}",
    ]
    assert stat.S_IMODE(env.stat().st_mode) == 0o644
    calls = systemctl_calls(host.root)
    assert calls == [
        "start bcd-alloc-alloc_01jz8k2v.slice",
        "set-property --runtime bcd-alloc-alloc_01jz8k2v.slice AllowedCPUs=0-7 AllowedMemoryNodes=0 "
        "CPUQuota=150% "
        f"MemoryMax={8 << 30} MemoryHigh={(8 << 30) * 9 // 10}",
    ]
    [bound] = host.events("BoundEvent")
    assert bound.cdi_devices == (f"bcd.dev/gpu={G0}",)
    assert bound.cdi_spec_path == "/etc/cdi/bcd-alloc_01jz8k2v.json"
    assert bound.env_file == "/run/bcd/allocations/alloc_01jz8k2v.env"
    assert bound.cgroup_parent == "bcd-alloc-alloc_01jz8k2v.slice"
    assert assert_host_cdi_valid(host.root) == 1


def test_DEV_EVT_01_bound_and_released_are_reports_signed_with_the_node_key(host: Host) -> None:
    """Covers DEV-EVT-01, DEV-EVT-07, DEV-PASS-07, DLV-DEV-05, DLV-DEV-11, DEV-BIND-08 (the files are gone
    once AllocationReleased is out)."""
    host.run(DevicesSpec(1, (hold("a1", gpu(G0)),)))
    host.run(DevicesSpec(2, ()))
    reports = host.sink.events
    assert [r.type for r in reports] == ["AllocationBound", "AllocationReleased"]
    for r in reports:
        verify_signature(host.signer.key.public_key, Purpose.ATTESTED_REPORT, r.body, r.signature)
        body = wire.AttestedReportBody.parse(r.body)
        assert body.node_id == "node-test-1" and body.boot_id == "boot-test-1"
    released = wire.AttestedReportBody.parse(reports[1].body).allocation_released
    assert released.allocation_id == "a1" and released.generation == 2 and list(released.device_ids) == [G0]
    assert not host.path("/etc/cdi/bcd-a1.json").exists()
    assert not host.path("/run/bcd/allocations/a1.env").exists()


def test_DEV_PASS_03_a_restarted_converger_reads_its_holds_back_from_the_files_alone(host: Host) -> None:
    """Covers DEV-PASS-03, DEV-PASS-04, DEV-PASS-11, DEV-PASS-13, DEV-ENV-07, DLV-DEV-10, DEV-ATOM-06,
    DLV-DEV-14, DLV-DEV-16 (a slot names its GPU, a MIG instance its MIG- UUID)."""
    spec = DevicesSpec(
        3,
        (
            hold("a1", (f"{G1}/s3", "gpu.slot"), (f"{G1}/s4", "gpu.slot")),
            hold("a2", (f"{G7}/gi1/ci0", "gpu.mig")),
        ),
    )
    host.run(spec)
    assert len(host.events("BoundEvent")) == 2
    host.restart()  # a new process: nothing in memory
    assert host.section.plan(spec, 3).empty
    # /run is tmpfs: after a reboot the env file is gone and the slice too; the hold stays.
    host.path("/run/bcd/allocations/a1.env").unlink()
    host.restart()
    p = host.section.plan(spec, 3)
    assert [a.key for a in p.actions] == ["keep:a1"]
    host.run(spec)
    assert (
        host.path("/run/bcd/allocations/a1.env").read_text().splitlines()[-1]
        == f"NVIDIA_VISIBLE_DEVICES={G1}"
    )
    assert len(host.events("BoundEvent")) == 2  # nothing re-sent
    doc = json.loads(host.path("/etc/cdi/bcd-a1.json").read_text())
    assert [d["name"] for d in doc["devices"]] == [f"{G1}_s3", f"{G1}_s4"]
    mig = json.loads(host.path("/etc/cdi/bcd-a2.json").read_text())
    assert f"NVIDIA_VISIBLE_DEVICES={mig_uuid(7, 1, 0)}" in mig["containerEdits"]["env"]
    assert mig["devices"][0]["name"] == f"{G7}_gi1_ci0"


def test_DEV_PASS_12_a_missing_slice_is_created_again_and_DEV_SLICE_19_only_empty_slices_stop(
    host: Host,
) -> None:
    """Covers DEV-PASS-09, DEV-PASS-10, DEV-PASS-12, DEV-SLICE-19, DEV-SLICE-20, DLV-DEV-36, DLV-DEV-39,
    DLV-DEV-40."""
    spec = DevicesSpec(1, (hold("a1", gpu(G0), limits=Limits(cpu_millis=1000)),))
    host.run(spec)
    cg = host.path("/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-a1.slice")
    for f in cg.iterdir():
        f.unlink()
    cg.rmdir()  # a reboot: runtime slices vanish, the hold stays
    host.run(spec)
    assert (cg / "cgroup.events").exists()
    (cg / "cgroup.events").write_text("populated 1\nfrozen 0\n")  # a workload runs there
    host.run(DevicesSpec(2, ()))
    assert not host.path("/etc/cdi/bcd-a1.json").exists()
    assert cg.exists() and not host.path("/var/lib/bcd-sim/killed-workloads").exists()
    host.run(DevicesSpec(3, ()))  # leftover slice: still busy, kept
    assert cg.exists()
    (cg / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    host.run(DevicesSpec(4, ()))  # the drift pass stops it once empty
    assert not cg.exists()
    assert not host.path("/var/lib/bcd-sim/killed-workloads").exists()


def test_DEV_SLICE_15_hugepage_limits_in_cgroupfs(host: Host) -> None:
    """Covers DEV-SLICE-15, DEV-SLICE-16, DLV-DEV-34."""
    host.run(
        DevicesSpec(1, (hold("a1", gpu(G0), limits=Limits(mems="0", hugepages_2mi=4, hugepages_1gi=2)),))
    )
    for parent in ("sys/fs/cgroup", "sys/fs/cgroup/bcd.slice", "sys/fs/cgroup/bcd.slice/bcd-alloc.slice"):
        assert (host.root / parent / "cgroup.subtree_control").read_text() == "+hugetlb\n"
    cg = host.path("/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-a1.slice")
    assert (cg / "hugetlb.2MB.max").read_text() == f"{4 * 2 * 1024 * 1024}\n"
    assert (cg / "hugetlb.1GB.max").read_text() == f"{2 << 30}\n"


def test_DEV_SLICE_03_kubernetes_hold_has_no_slice_no_parent_no_visible_devices_in_spec(host: Host) -> None:
    """Covers DEV-BND-03..05, DEV-SLICE-03, DEV-SLICE-04, DEV-CDI-08, DEV-ENV-05, DLV-DEV-27, DLV-DEV-42.
    DEV-CDI-14 (bare devices) is departed from: each device carries its one BCD_DEVICE_ marker, since the
    reference CDI library refuses a device with empty edits (docs/devices.md)."""
    host.run(
        DevicesSpec(
            1, (hold("k1", gpu(G0), binding=BINDING_KUBERNETES, limits=Limits(memory_bytes=1 << 30)),)
        )
    )
    doc = json.loads(host.path("/etc/cdi/bcd-k1.json").read_text())
    assert doc["annotations"]["bcd.dev/binding"] == "kubernetes"
    assert "bcd.dev/cgroup-parent" not in doc["annotations"]
    assert doc["devices"][0]["containerEdits"] == {"env": [f"BCD_DEVICE_{G0.replace('-', '_')}={G0}"]}
    assert doc["containerEdits"] == {"env": ["BCD_ALLOCATION_ID=k1"]}
    assert doc["cdiVersion"] == "0.6.0"
    assert f"NVIDIA_VISIBLE_DEVICES={G0}" in host.path("/run/bcd/allocations/k1.env").read_text()
    assert not host.path("/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-k1.slice").exists()
    assert host.events("BoundEvent")[0].cgroup_parent == ""
    assert_host_cdi_valid(host.root)


def test_DEV_CDI_16_mps_directory_for_slot_holds(host: Host) -> None:
    """Covers DEV-CDI-16, DLV-DEV-26, DEV-CDI-17 (a GPU once however many slots)."""
    host.path("/run/nvidia-mps").mkdir(parents=True)
    host.run(DevicesSpec(1, (hold("s1", (f"{G0}/s0", "gpu.slot"), (f"{G0}/s1", "gpu.slot"), gpu(G1)),)))
    env = json.loads(host.path("/etc/cdi/bcd-s1.json").read_text())["containerEdits"]["env"]
    assert env[:3] == [
        "BCD_ALLOCATION_ID=s1",
        "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
        f"NVIDIA_VISIBLE_DEVICES={G0},{G1}",
    ]


def test_DEV_UNPRIV_03_unprivileged_node_refuses_and_writes_nothing(make_host) -> None:  # type: ignore[no-untyped-def]
    """Covers DEV-UNPRIV-03, DEV-UNPRIV-04, DEV-FAIL-02, DEV-FAIL-12."""
    host = make_host(privileged=False)
    out = host.run(
        DevicesSpec(
            1, (hold("a1", gpu(G0), limits=Limits(cpus="0")), hold("a2", gpu(G1), binding="BINDING_NODE"))
        )
    )
    assert out.state is SectionState.FAILED
    fails = host.events("FailedEvent")
    assert [(f.allocation_id, f.reason) for f in fails] == [
        ("a1", "node-unprivileged"),
        ("a2", "unsupported-binding"),
    ]
    assert fails[0].message == UNPRIVILEGED_MESSAGE
    assert not list(host.path("/etc/cdi").glob("bcd-*")) and not list(
        host.path("/run/bcd/allocations").iterdir()
    )
    assert systemctl_calls(host.root) == []


def test_DEV_EVT_10_allocation_failed_once_per_generation_and_again_later(host: Host) -> None:
    """Covers DEV-EVT-10, DEV-FAIL-08, DEV-FAIL-09, DEV-FAIL-11, DEV-FAIL-13, DLV-DEV-07, DEV-PASS-17,
    DEV-ASG-13."""
    spec = DevicesSpec(5, (hold("a1", gpu(G0)), hold("a2", gpu(G0))))
    out = host.run(spec)
    assert out.state is SectionState.FAILED and out.message == f"a2: {G0} is assigned to a1"
    # DEV-FAIL-12 for a privileged node's refusal too: the refused hold has no spec and no env file.
    assert not host.path("/etc/cdi/bcd-a2.json").exists()
    assert not host.path("/run/bcd/allocations/a2.env").exists()
    host.run(spec)
    host.restart()
    host.run(spec)
    assert len(host.events("FailedEvent")) == 1
    host.run(DevicesSpec(6, spec.assignments))
    assert [f.generation for f in host.events("FailedEvent")] == [5, 6]
    assert len(host.events("BoundEvent")) == 1


def test_DEV_PASS_18_a_gpu_moves_between_allocations_in_one_generation(host: Host) -> None:
    """Covers DEV-PASS-18, DEV-CONF-07."""
    host.run(DevicesSpec(1, (hold("a1", gpu(G0)),)))
    out = host.run(DevicesSpec(2, (hold("a2", gpu(G0)),)))
    assert out.state is SectionState.CONVERGED
    assert [type(e).__name__ for e in host.events()] == ["BoundEvent", "ReleasedEvent", "BoundEvent"]


def test_DEV_BIND_02_a_failed_write_is_retryable_and_sends_no_event(host: Host) -> None:
    """Covers DEV-BIND-02, DEV-BIND-04."""
    env_dir = host.path("/run/bcd/allocations")
    env_dir.rmdir()
    env_dir.write_text("not a directory")  # the env write fails
    out = host.run(DevicesSpec(1, (hold("a1", gpu(G0)),)))
    assert out.state is SectionState.PROGRESSING
    assert host.events("BoundEvent") == []
    env_dir.unlink()
    env_dir.mkdir()
    assert host.run(DevicesSpec(1, (hold("a1", gpu(G0)),))).state is SectionState.CONVERGED
    assert len(host.events("BoundEvent")) == 1


def test_DEV_BIND_02_04_a_failed_cdi_spec_write_is_retryable_and_writes_nothing_after_it(host: Host) -> None:
    """Covers DEV-BIND-02 and DEV-BIND-04 for the spec, the write before the env file: it fails, the
    section stays PROGRESSING (retryable, not FAILED), neither the env file nor an event follows, and the
    next pass binds."""
    cdi_dir = host.path("/etc/cdi")
    kept = {p.name: p.read_bytes() for p in cdi_dir.iterdir()}
    for p in cdi_dir.iterdir():
        p.unlink()
    cdi_dir.rmdir()
    cdi_dir.write_text("not a directory")  # the spec write fails
    out = host.run(DevicesSpec(1, (hold("a1", gpu(G0)),)))
    assert out.state is SectionState.PROGRESSING
    assert host.events() == [] and not host.path("/run/bcd/allocations/a1.env").exists()
    cdi_dir.unlink()
    cdi_dir.mkdir()
    for name, data in kept.items():
        (cdi_dir / name).write_bytes(data)
    assert host.run(DevicesSpec(1, (hold("a1", gpu(G0)),))).state is SectionState.CONVERGED
    assert len(host.events("BoundEvent")) == 1 and host.path("/run/bcd/allocations/a1.env").exists()


def test_DEV_ATOM_10_mig_instance_created_later_binds_on_a_later_pass(host: Host) -> None:
    """Covers DEV-ATOM-10, DLV-DEV-15 and Q-DEV-PASS-03 (a later pass of the same generation binds)."""
    spec = DevicesSpec(1, (hold("m1", (f"{G7}/gi5/ci0", "gpu.mig")),))
    out = host.run(spec)
    assert out.message == f"m1: {G7} has no MIG instance gi5/ci0"

    def add(state: dict) -> None:  # type: ignore[type-arg]
        from bcd_simhost.gpus import make_mig

        state["gpus"][7]["migs"].append(make_mig(7, "1g.18gb", 5, 0, 5))

    update_state(host.root, add)
    assert host.run(spec).state is SectionState.CONVERGED
    assert len(host.events("FailedEvent")) == 1 and len(host.events("BoundEvent")) == 1


def test_sign_report_body_is_exact_bytes(host: Host) -> None:
    """Covers DEV-EVT-01: the signature covers the exact serialized body."""
    from bcd_agent.sections.devices.events import ReleasedEvent

    rep = sign_report(host.signer, ReleasedEvent("a", "r", 1, ("x",)))
    verify_signature(host.signer.key.public_key, Purpose.ATTESTED_REPORT, rep.body, rep.signature)
    assert DATA_DIR == "/var/lib/bcd"
