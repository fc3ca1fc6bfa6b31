"""Host admission of changed limits on a kept hold (devices-and-holds.md "Host admission"; the project's
Q-DEV-PASS-01 makes limits of a kept hold reach its running slice, so growing limits are admitted
as a new hold's are): the new limits are checked against the host with the hold's old booking counted
as freed; refused, the hold and its slice stay as they are and the allocation fails with the seeds'
resources-exhausted message.

On the simulated host (tests/devices/devhost.py): MemTotal 512 GiB, Hugetlb 48 GiB, so normal memory
available is 512 - 48 - 1 = 463 GiB (DEV-ADM-04); 1 GiB pages: 32 host-wide, 16 per NUMA node."""

from __future__ import annotations

from typing import Any

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec, Limits
from bcd_agent.sections.devices.plan import (
    ADMISSION_UNREADABLE_WARNING,
    LiveHold,
    SliceState,
    grown_limits,
    needs_host_memory,
)
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import Host, systemctl_calls

GIB = 1 << 30
MIB = 1 << 20
G0, G1, G2 = gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)
PARENT = "/sys/fs/cgroup/bcd.slice/bcd-alloc.slice"


def hold(alloc: str, gpu: str, limits: Limits | None) -> DeviceAssignment:
    return DeviceAssignment(alloc, f"rsv_{alloc}", "BINDING_HOLD", (DeviceRef(gpu, "gpu"),), limits)


def mem(gib: int, cpus: str = "0-3") -> Limits:
    return Limits(cpus=cpus, memory_bytes=gib * GIB)


def cg(host: Host, alloc: str, name: str) -> str:
    return host.path(f"{PARENT}/bcd-alloc-{alloc}.slice/{name}").read_text().strip()


def failed_events(host: Host) -> list[Any]:
    return host.events("FailedEvent")


def test_DEV_ADM_10_a_kept_hold_grows_into_its_own_freed_booking(host: Host) -> None:
    """Covers DEV-ADM-01/10 for a kept hold's new limits: 463 GiB available, b holds 200 GiB; a grows
    from 200 to 260 GiB, which fits only because a's own 200 GiB count as freed (63 GiB are left
    with them counted)."""
    assert host.run(DevicesSpec(1, (hold("a", G0, mem(200)), hold("b", G1, mem(200))))).state is (
        SectionState.CONVERGED
    )
    out = host.run(DevicesSpec(2, (hold("a", G0, mem(260)), hold("b", G1, mem(200)))))
    assert out.state is SectionState.CONVERGED, out.message
    assert cg(host, "a", "memory.max") == str(260 * GIB)
    assert failed_events(host) == [] and len(host.events("BoundEvent")) == 2


def test_DEV_ADM_13_refused_growth_keeps_the_hold_and_its_slice(host: Host) -> None:
    """Covers DEV-ADM-13 (the seeds' message, MiB needed rounded up, MiB left rounded down), DEV-ADM-10
    and DEV-FAIL-06 for a kept hold: a grows from 200 to 270 GiB with 263 GiB left once its own booking
    is freed: refused. The slice keeps its limits (no set-property), the CDI spec and env file keep
    their bytes (the changed env line is not written), the hold is not released, one AllocationFailed
    per generation; new holds are admitted against a's old booking; once b goes, a grows."""
    first = DevicesSpec(1, (hold("a", G0, mem(200)), hold("b", G1, mem(200))))
    assert host.run(first).state is SectionState.CONVERGED
    cdi_before = host.path("/etc/cdi/bcd-a.json").read_bytes()
    env_before = host.path("/run/bcd/allocations/a.env").read_bytes()
    calls_before = len(systemctl_calls(host.root))

    grown = DeviceAssignment(
        "a", "rsv_a", "BINDING_HOLD", (DeviceRef(G0, "gpu"),), mem(270, cpus="0-7"), ("TEAM=x",)
    )
    spec = DevicesSpec(2, (grown, hold("b", G1, mem(200))))
    out = host.run(spec)
    message = "ResourcesExhausted: 276480 MiB of memory needed, 269312 MiB left on this host"
    assert out.state is SectionState.FAILED and out.reason == "AllocationFailed"
    assert out.message == f"a: {message}"
    assert cg(host, "a", "memory.max") == str(200 * GIB) and cg(host, "a", "cpuset.cpus") == "0-3"
    assert len(systemctl_calls(host.root)) == calls_before  # the slice was not touched
    assert host.path("/etc/cdi/bcd-a.json").read_bytes() == cdi_before
    assert host.path("/run/bcd/allocations/a.env").read_bytes() == env_before
    [failed] = failed_events(host)
    assert (failed.allocation_id, failed.generation, failed.reason, failed.message) == (
        "a",
        2,
        "resources-exhausted",
        message,
    )
    assert host.events("ReleasedEvent") == []

    # The same generation again: still FAILED, no second AllocationFailed, nothing applied.
    assert host.run(spec).state is SectionState.FAILED
    assert len(failed_events(host)) == 1 and cg(host, "a", "memory.max") == str(200 * GIB)

    # A new hold counts a's old booking (200 GiB), not its refused 270: 463 - 200 - 200 = 63 GiB left.
    out = host.run(DevicesSpec(3, (grown, hold("b", G1, mem(200)), hold("c", G2, mem(64)))))
    assert out.state is SectionState.FAILED
    assert "c: ResourcesExhausted: 65536 MiB of memory needed, 64512 MiB left on this host" in out.message
    assert [e.allocation_id for e in failed_events(host)] == ["a", "a", "c"]  # a again: generation 3
    out = host.run(DevicesSpec(4, (grown, hold("b", G1, mem(200)), hold("c", G2, mem(63)))))
    assert out.state is SectionState.FAILED and "c:" not in out.message
    assert host.path("/etc/cdi/bcd-c.json").exists()

    # b released: a's 270 GiB fit now (463 - 63 = 400 GiB left); the env line reaches its file.
    out = host.run(DevicesSpec(5, (grown, hold("c", G2, mem(63)))))
    assert out.state is SectionState.CONVERGED, out.message
    assert cg(host, "a", "memory.max") == str(270 * GIB) and cg(host, "a", "cpuset.cpus") == "0-7"
    assert "TEAM=x" in host.path("/run/bcd/allocations/a.env").read_text()
    assert [e.allocation_id for e in host.events("ReleasedEvent")] == ["b"]
    assert host.section.plan(DevicesSpec(5, (grown, hold("c", G2, mem(63)))), 5).empty


def test_DEV_ADM_05_shrinking_is_never_refused(make_host: Any) -> None:
    """Covers DEV-ADM-05/07 for a kept hold: with the domains' committed memory taking all but 100 GiB,
    a hold that shrinks (or keeps its memory and changes only its CPUs) is applied: only what grows
    is admitted."""
    committed = [0]
    host = make_host(domains_committed_bytes=lambda: committed[0])
    assert host.run(DevicesSpec(1, (hold("a", G0, mem(200)),))).state is SectionState.CONVERGED
    committed[0] = 163 * GIB  # 463 - 163 - 200: 100 GiB left with a's booking counted
    out = host.run(DevicesSpec(2, (hold("a", G0, mem(150, cpus="0-1")),)))
    assert out.state is SectionState.CONVERGED, out.message
    assert cg(host, "a", "memory.max") == str(150 * GIB) and cg(host, "a", "cpuset.cpus") == "0-1"
    out = host.run(DevicesSpec(3, (hold("a", G0, mem(301)),)))  # 300 GiB left with a's 150 freed
    assert out.state is SectionState.FAILED
    assert out.message == "a: ResourcesExhausted: 308224 MiB of memory needed, 307200 MiB left on this host"
    assert cg(host, "a", "memory.max") == str(150 * GIB)


def test_DEV_ADM_14_huge_pages_of_a_kept_hold(host: Host) -> None:
    """Covers DEV-ADM-08/09/11/14 for a kept hold: a books 10 x 1 GiB pages on node 0 (16 there) and has
    faulted 4 in (the kernel's free counts drop by 4). Growing to 14 fits: its own faulted pages count
    as free again (12 + 4 = 16 on node 0). b then books 2 on node 0, and a growing to 15 is refused
    with the seeds' message naming what is free to it (12 + 4 - 2 = 14)."""
    a = hold("a", G0, Limits(mems="0", hugepages_1gi=10))
    assert host.run(DevicesSpec(1, (a,))).state is SectionState.CONVERGED
    host.path(f"{PARENT}/bcd-alloc-a.slice/hugetlb.1GB.current").write_text(f"{4 * GIB}\n")
    for d in ("/sys/kernel/mm/hugepages", "/sys/devices/system/node/node0/hugepages"):
        f = host.path(f"{d}/hugepages-1048576kB/free_hugepages")
        f.write_text(f"{int(f.read_text()) - 4}\n")
    out = host.run(DevicesSpec(2, (hold("a", G0, Limits(mems="0", hugepages_1gi=14)),)))
    assert out.state is SectionState.CONVERGED, out.message
    assert cg(host, "a", "hugetlb.1GB.max") == str(14 * GIB)
    # b: 12 free on node 0, a may still take 14 - 4 = 10 of them: 2 left, b's 2 fit.
    b = hold("b", G1, Limits(mems="0", hugepages_1gi=2))
    a14 = hold("a", G0, Limits(mems="0", hugepages_1gi=14))
    assert host.run(DevicesSpec(3, (a14, b))).state is SectionState.CONVERGED
    out = host.run(DevicesSpec(4, (hold("a", G0, Limits(mems="0", hugepages_1gi=15)), b)))
    assert out.state is SectionState.FAILED
    assert out.message == "a: ResourcesExhausted: 15 hugepages of 1048576 KiB needed, 14 free"
    assert cg(host, "a", "hugetlb.1GB.max") == str(14 * GIB)


def test_DEV_ADM_15_unreadable_host_and_DEV_ADM_16_fakehw_apply_without_admission(make_host: Any) -> None:
    """Covers DEV-ADM-15 (the warning, the limits applied) and DEV-ADM-16 (admission=False)."""
    host = make_host()
    assert host.run(DevicesSpec(1, (hold("a", G0, mem(200)),))).state is SectionState.CONVERGED
    host.path("/proc/meminfo").unlink()
    p = host.section.plan(DevicesSpec(2, (hold("a", G0, mem(900)),)), 2)
    assert ADMISSION_UNREADABLE_WARNING in p.warnings and p.failures == ()
    assert host.run(DevicesSpec(2, (hold("a", G0, mem(900)),))).state is SectionState.CONVERGED
    assert cg(host, "a", "memory.max") == str(900 * GIB)
    fake = make_host(admission=False)
    fake.path("/proc/meminfo").write_text("MemTotal: 1048576 kB\nHugetlb: 0 kB\n")
    assert fake.run(DevicesSpec(3, (hold("a", G0, mem(950)),))).state is SectionState.CONVERGED
    assert cg(fake, "a", "memory.max") == str(950 * GIB)


def test_DEV_ADM_03_host_read_only_when_a_kept_hold_grows() -> None:
    """Covers DEV-ADM-03: meminfo is wanted for a kept hold only when its running slice is to get other
    limits that need admission; and grown_limits keeps exactly what grows."""
    from bcd_shared.cdi import HoldRecord

    a = hold("a", G0, mem(8))
    rec = HoldRecord("a", "rsv_a", 1, False, "bcd-alloc-a.slice", (G0,))
    holds = {"a": LiveHold(rec, {}, ())}
    applied = {
        "AllowedCPUs": "0-3",
        "MemoryMax": str(8 * GIB),
        "MemoryHigh": str(8 * GIB * 9 // 10 // 4096 * 4096),
    }
    same = {"bcd-alloc-a.slice": SliceState("bcd-alloc-a.slice", False, {}, applied)}
    spec = DevicesSpec(1, (a,))
    assert needs_host_memory(spec, holds, same) is False
    assert needs_host_memory(DevicesSpec(1, (hold("a", G0, mem(9)),)), holds, same) is True
    assert needs_host_memory(DevicesSpec(1, (hold("a", G1, mem(8)),)), holds, same) is True  # bound again
    assert needs_host_memory(DevicesSpec(1, (hold("a", G0, Limits(cpus="0-1")),)), holds, same) is False
    state = same["bcd-alloc-a.slice"]
    assert grown_limits(mem(7), state) is None
    assert grown_limits(mem(9), state) == Limits(memory_bytes=9 * GIB)
    assert grown_limits(Limits(memory_bytes=8 * GIB, hugepages_2mi=2), state) == Limits(hugepages_2mi=2)
    moved = SliceState("s", False, {}, {**applied, "AllowedMemoryNodes": "0", "hugetlb.2MB": str(4 * MIB)})
    assert grown_limits(Limits(mems="1", memory_bytes=GIB, hugepages_2mi=2), moved) == Limits(
        mems="1", hugepages_2mi=2
    )
