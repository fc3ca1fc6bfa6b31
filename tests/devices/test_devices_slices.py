"""Hold slices on the shared simulated systemctl: limits of a kept hold reach its running slice, the
helper executor's limits, and the root-only rule of a node acting as root without a helper."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.helperclient import HelperClient
from bcd_agent.sections.devices.apply import DirectExecutor, HelperExecutor
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec, Limits
from bcd_agent.sections.devices.plan import ApplySlice
from bcd_agent.sections.devices.slices import (
    applied_limits,
    canonical_cpulist,
    reset_assignments,
    slice_spec,
    wanted_limits,
)
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import Host, systemctl_calls
from helper.helperproc import HelperProcess, base_config

G0 = gpu_uuid(0)
CG = "/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-a1.slice"
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the root-only rule applies to a process acting as root"
)


def hold(limits: Limits | None) -> DeviceAssignment:
    return DeviceAssignment("a1", "rsv_a1", "BINDING_HOLD", (DeviceRef(G0, "gpu"),), limits)


def cgroup(host: Host) -> dict[str, str]:
    base = host.path(CG)
    return {p.name: p.read_text().strip() for p in base.iterdir() if p.is_file()}


def assert_second_limits(host: Host) -> None:
    """The slice after the second spec (cpus 0-3, half a CPU, no memory or hugepage limits), as the
    kernel shows it, and the one set-property that made it (the dropped limits reset)."""
    files = cgroup(host)
    assert files["cpuset.cpus"] == "0-3" and files["cpuset.mems"] == ""  # as the kernel shows it
    assert files["cpu.max"] == "50000 100000"
    assert files["memory.max"] == "max" and files["memory.high"] == "max"
    assert files["hugetlb.2MB.max"] == "max" and files["hugetlb.1GB.max"] == "max"
    assert systemctl_calls(host.root)[-1] == (
        "set-property --runtime bcd-alloc-a1.slice AllowedMemoryNodes= MemoryMax=infinity "
        "MemoryHigh=infinity AllowedCPUs=0,1,2,3 CPUQuota=50%"
    )


def test_Q_DEV_PASS_01_changed_limits_reach_the_running_slice(host: Host) -> None:
    """Covers Q-DEV-PASS-01 (decided: limits of a kept hold are applied again to its slice, properties
    no longer set reset), DEV-SLICE-09..16, DEV-SLICE-20 (the slice is never stopped for it)."""
    first = Limits(cpus="0-7", mems="0", cpu_millis=1500, memory_bytes=8 << 30, hugepages_2mi=4)
    assert host.run(DevicesSpec(1, (hold(first),))).state is SectionState.CONVERGED
    files = cgroup(host)
    assert files["cpuset.cpus"] == "0-7" and files["cpuset.mems"] == "0"
    assert files["cpu.max"] == "150000 100000"
    assert files["memory.max"] == str(8 << 30) and files["memory.high"] == str(
        (8 << 30) * 9 // 10 // 4096 * 4096
    )
    assert files["hugetlb.2MB.max"] == str(4 << 21) and files["hugetlb.1GB.max"] == "0"
    host.path(f"{CG}/cgroup.events").write_text("populated 1\nfrozen 0\n")  # a workload runs there

    out = host.run(DevicesSpec(2, (hold(Limits(cpus="0,1,2,3", cpu_millis=500)),)))
    assert out.state is SectionState.CONVERGED
    assert_second_limits(host)
    assert not any(c.startswith("stop") for c in systemctl_calls(host.root))
    assert not host.path("/var/lib/bcd-sim/killed-workloads").exists()
    assert len(host.events("BoundEvent")) == 1  # the same hold: no second AllocationBound
    assert host.section.plan(DevicesSpec(2, (hold(Limits(cpus="0-3", cpu_millis=500)),)), 2).empty

    # Drift by hand is put back on the next pass (level-triggered).
    host.path(f"{CG}/memory.max").write_text("1048576\n")
    host.path(f"{CG}/cpu.max").write_text("max 100000\n")
    p = host.section.plan(DevicesSpec(2, (hold(Limits(cpus="0-3", cpu_millis=500)),)), 2)
    [step] = [s for a in p.actions for s in a.steps]
    assert isinstance(step, ApplySlice) and step.reset == ("MemoryMax",)
    host.run(DevicesSpec(2, (hold(Limits(cpus="0-3", cpu_millis=500)),)))
    assert cgroup(host)["memory.max"] == "max" and cgroup(host)["cpu.max"] == "50000 100000"


def test_limits_normal_form_is_what_the_kernel_shows() -> None:
    spec = slice_spec("a1", Limits(cpus="3,0-2,8", cpu_millis=1001, memory_bytes=10_000))
    assert wanted_limits(spec) == {
        "AllowedCPUs": "0-3,8",
        "CPUQuota": "101%",
        "MemoryMax": "8192",
        "MemoryHigh": "8192",
    }
    shown = {
        "cpuset.cpus": "0-3,8\n",
        "cpu.max": "101000 100000\n",
        "memory.max": "8192\n",
        "memory.high": "8192\n",
    }
    assert applied_limits(shown) == wanted_limits(spec)
    assert applied_limits({"cpu.max": "max 100000", "memory.max": "max", "cpuset.cpus": ""}) == {}
    assert applied_limits({"cpu.max": "garbage"}) == {"CPUQuota": "garbage"}  # unreadable: applied again
    assert canonical_cpulist("0-400000000,5") == "0-400000000"  # ranges are never expanded
    assert canonical_cpulist("3-1") is None
    assert reset_assignments(spec, {"AllowedMemoryNodes": "0", "hugetlb.1GB": "0"}) == (
        "AllowedMemoryNodes",
        "hugetlb.1GB",
    )


def test_DEV_SLICE_25_records_form_reapplies_changed_limits(sim_root: Path) -> None:
    """The fakehw form (JSON records under /run/bcd/slices) follows the same rule."""
    host = Host(sim_root, slice_records=True)
    host.section.executor = DirectExecutor(host.system, slice_records=True)
    host.run(DevicesSpec(1, (hold(Limits(cpus="0-7", memory_bytes=1 << 30)),)))
    rec = json.loads(host.path("/run/bcd/slices/bcd-alloc-a1.slice.json").read_text())
    assert rec["properties"]["MemoryMax"] == str(1 << 30)
    host.run(DevicesSpec(2, (hold(Limits(cpus="0-3")),)))
    rec = json.loads(host.path("/run/bcd/slices/bcd-alloc-a1.slice.json").read_text())
    assert rec["properties"] == {"AllowedCPUs": "0-3"}
    assert host.section.plan(DevicesSpec(2, (hold(Limits(cpus="0-3")),)), 2).empty


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def file_write(self, kind: str, ident: str, content: bytes | str) -> object:
        self.calls.append(("file_write", {"kind": kind, "ident": ident}))
        return None

    def file_remove(self, kind: str, ident: str) -> bool:
        self.calls.append(("file_remove", {"kind": kind, "ident": ident}))
        return True

    def slice_apply(self, name: str, **limits: Any) -> object:
        self.calls.append(("slice_apply", {"name": name, **limits}))
        return None

    def slice_remove(self, name: str) -> object:
        self.calls.append(("slice_remove", {"name": name}))
        return None


def test_DEV_SLICE_23_helper_executor_sends_the_limits_and_the_resets() -> None:
    """Covers DEV-SLICE-23: slice.apply with the limits; the properties a kept hold's spec dropped are
    named in `reset` by their limit (MemoryMax and MemoryHigh are both `memory_bytes`), and a 0 CPU
    quota or memory limit is no limit, as on the direct path."""
    client = FakeClient()
    ex = HelperExecutor(client)
    spec = slice_spec("a1", Limits(cpus="0-3", cpu_millis=0, memory_bytes=0, hugepages_1gi=2))
    ex.apply_slice(spec)
    ex.apply_slice(spec, ("AllowedMemoryNodes", "MemoryMax", "MemoryHigh", "CPUQuota"))
    ex.apply_slice(slice_spec("a1", Limits(cpus="0")), ("hugetlb.2MB", "hugetlb.1GB"))
    sent = {
        "name": "bcd-alloc-a1.slice",
        "cpus": "0-3",
        "mems": None,
        "cpu_millis": None,
        "memory_bytes": None,
        "hugepages_2mi": None,
        "hugepages_1gi": 2,
        "intent": None,  # the executor's intent provider: none kept here
    }
    assert client.calls == [
        ("slice_apply", {**sent, "reset": ()}),
        ("slice_apply", {**sent, "reset": ("mems", "memory_bytes", "cpu_millis")}),
        (
            "slice_apply",
            {**sent, "cpus": "0", "hugepages_1gi": None, "reset": ("hugepages_2mi", "hugepages_1gi")},
        ),
    ]


@pytest.fixture
def helper_host(sim_root: Path) -> Iterator[tuple[Host, HelperProcess]]:
    """The devices section of an unprivileged node beside a real `bcd helper serve` process on the same
    simulated host: every hold file and slice change goes through the helper's socket."""
    for p in (sim_root.parent, sim_root):
        os.chmod(p, 0o755)
    proc = HelperProcess(sim_root, base_config())
    try:
        host = Host(sim_root)
        host.section.executor = HelperExecutor(HelperClient(proc.socket_path))
        yield host, proc
    finally:
        proc.stop()


def test_Q_DEV_PASS_01_changed_limits_reach_the_slice_through_the_helper(
    helper_host: tuple[Host, HelperProcess],
) -> None:
    """Covers Q-DEV-PASS-01 and DEV-SLICE-23 through the real helper: the kept hold's new limits are
    applied and the dropped ones reset by `slice.apply`'s `reset`, in one call; the section converges
    (no SliceReset), the workload is never killed, and the next pass plans nothing."""
    host, helper = helper_host
    first = Limits(cpus="0-7", mems="0", cpu_millis=1500, memory_bytes=8 << 30, hugepages_2mi=4)
    assert host.run(DevicesSpec(1, (hold(first),))).state is SectionState.CONVERGED
    files = cgroup(host)
    assert files["memory.max"] == str(8 << 30) and files["hugetlb.2MB.max"] == str(4 << 21)
    host.path(f"{CG}/cgroup.events").write_text("populated 1\nfrozen 0\n")  # a workload runs there

    second = DevicesSpec(2, (hold(Limits(cpus="0,1,2,3", cpu_millis=500)),))
    out = host.run(second)
    assert out.state is SectionState.CONVERGED, out.message
    assert_second_limits(host)
    applies = [a for a in helper.audit_lines() if a["op"] == "slice.apply"]
    assert applies[-1]["decision"] == "accepted"
    assert applies[-1]["args"]["reset"] == ["mems", "memory_bytes", "hugepages_2mi", "hugepages_1gi"]
    assert not any(c.startswith("stop") for c in systemctl_calls(host.root))
    assert not host.path("/var/lib/bcd-sim/killed-workloads").exists()
    assert len(host.events("BoundEvent")) == 1
    assert host.section.plan(second, 2).empty


@as_root
def test_HST_ROOT_07_devices_refuse_a_directory_others_can_write(host: Host) -> None:
    """Acting as root without a helper, hold files are written only under root-only directories:
    a world-writable /etc/cdi is refused with the seeds' message and nothing is written there."""
    assert isinstance(host.section.executor, DirectExecutor) and host.section.executor.root_only
    cdi_dir = host.path("/etc/cdi")
    cdi_dir.chmod(0o777)
    out = host.run(DevicesSpec(1, (hold(None),)))
    assert out.state is SectionState.PROGRESSING
    assert (
        "/etc/cdi is not a directory only root can write: bcd will not write as root under it" in out.message
    )
    assert not (cdi_dir / "bcd-a1.json").exists() and host.events("BoundEvent") == []
    cdi_dir.chmod(0o755)
    assert host.run(DevicesSpec(1, (hold(None),))).state is SectionState.CONVERGED


@as_root
def test_HST_ROOT_05_devices_never_follow_a_symlink(host: Host, tmp_path: Path) -> None:
    env_dir = host.path("/run/bcd/allocations")
    env_dir.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env_dir.symlink_to(elsewhere)
    out = host.run(DevicesSpec(1, (hold(None),)))
    assert out.state is SectionState.PROGRESSING and "/run/bcd/allocations" in out.message
    assert list(elsewhere.iterdir()) == []
