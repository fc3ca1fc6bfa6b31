"""The instances planner and section: plan, apply to the simulated host (fake virsh and qemu-img),
plan again -> no steps; and the seeds' rules, each asserted on the plan or the host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.inventory.host import HostMemory, HugePool
from bcd_agent.sections.instances.model import Desired, Placement, definition_digest
from bcd_agent.sections.instances.placement import HostFacts
from bcd_agent.sections.instances.plan import (
    NO_RUNTIME,
    Create,
    Delete,
    Observed,
    Resume,
    RuntimeView,
    Start,
    Stop,
    UserData,
    plan,
)
from bcd_agent.sections.instances.runtimes.base import PAUSED, RUNNING, STOPPED, Domain
from bcd_simhost.libvirt import STATE
from instkit import GIB, FixedUserData, converge, section, sim_host, spec, vm

MIB = 1 << 20
HOST = HostFacts(frozenset(range(64)), frozenset({0, 1}), frozenset({2 * MIB, GIB}))


def memory(total_gib: int, pages_2m: int = 0) -> HostMemory:
    pools = {2048: HugePool(2048, pages_2m, {0: pages_2m // 2, 1: pages_2m // 2})}
    return HostMemory(total_gib * 1024 * 1024, pages_2m * 2048, pools, (0, 1))


def observed(*domains: Domain, mem: HostMemory | None = None, **kw: object) -> Observed:
    return Observed(
        runtimes={"libvirt-kvm": RuntimeView("libvirt-kvm", tuple(domains))},
        host=HOST,
        memory=mem if mem is not None else memory(512),
        **kw,  # type: ignore[arg-type]
    )


def dom(name: str, state: str = RUNNING, managed: bool = True, mem: int = 2 * GIB) -> Domain:
    """A domain as the runtime lists it, defined from `vm(name, memory_bytes=mem)`."""
    digest = definition_digest(vm(name, memory_bytes=mem), ())
    return Domain(
        name, "libvirt-kvm", state, managed, memory_bytes=mem, vcpus=2, disk_bytes=10 * GIB, definition=digest
    )


# --- convergence on the simulated host --------------------------------------------------------------


def test_converge_then_plan_again_gives_no_steps(tmp_path: Path) -> None:
    system = sim_host(tmp_path)
    sec, _rt = section(system)
    specs = [
        spec(vm("a", user_data_ref="ud"), vm("b", desired=Desired.PAUSED), vm("c", desired=Desired.STOPPED)),
        spec(vm("a", desired=Desired.PAUSED), vm("b"), vm("c", disk_bytes=20 * GIB), generation=2),
        spec(vm("a", desired=Desired.DELETED), vm("c", disk_bytes=20 * GIB), generation=3),
    ]
    for desired in specs:
        outcome = converge(sec, desired)
        assert outcome.state is SectionState.CONVERGED, outcome.message
        again = sec.plan(desired, desired.generation)
        assert again.steps == () and not again.errors and not again.waiting
    names = {i.instance_id: i.state for i in sec.last_report.instances}
    assert names == {"c": "RUNNING"}


def test_instances_report_lists_every_domain_with_complete_dlv_inst_15(tmp_path: Path) -> None:
    """DLV-INST-15, DLV-INST-05: managed and unmanaged domains are listed; complete when listed."""
    system = sim_host(tmp_path)
    _define_unmanaged(system, "leak")
    sec, _ = section(system)
    converge(sec, spec(vm("a")))
    rep = sec.last_report
    assert rep.complete
    assert {(i.instance_id, i.managed, i.state) for i in rep.instances} == {
        ("a", True, "RUNNING"),
        ("leak", False, "STOPPED"),
    }


def test_a_runtime_whose_listing_failed_makes_the_report_incomplete_dlv_inst_15(tmp_path: Path) -> None:
    """DLV-INST-15 (Q-DLV-INST-02): instances_complete only when every runtime listed without error; a
    failed listing reports it false and the instance waits for the listing, the section PROGRESSING."""
    from bcd_shared.errors import StepError

    system = sim_host(tmp_path)
    sec, rt = section(system)
    assert converge(sec, spec(vm("a"))).state is SectionState.CONVERGED and sec.last_report.complete

    def broken() -> tuple[Domain, ...]:
        raise StepError("virsh", "virsh list: failed to connect to the hypervisor")

    rt.list = broken  # type: ignore[method-assign]
    out = converge(sec, spec(vm("a"), generation=2))
    assert out.state is SectionState.PROGRESSING
    assert not sec.last_report.complete
    assert [(i.instance_id, i.state) for i in sec.last_report.instances] == [("a", "PENDING")]
    assert "waiting for the libvirt-kvm runtime's listing: virsh list: failed" in out.message


def _define_unmanaged(system: object, name: str, state: str = "shut off") -> None:
    from bcd_shared.system import atomic_write

    d = system.host_path(STATE)  # type: ignore[attr-defined]
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(
        d / f"{name}.xml", f"<domain type='kvm'><name>{name}</name><memory>1024</memory></domain>".encode()
    )
    boot = system.boot_id()  # type: ignore[attr-defined]
    atomic_write(d / f"{name}.json", json.dumps({"state": state, "boot_id": boot}).encode())


def test_unmanaged_domain_is_never_touched_dlv_inst_05(tmp_path: Path) -> None:
    """DLV-INST-05, DLV-LIBVIRT-17: not deleted, stopped or defined over; an instance of its name fails."""
    system = sim_host(tmp_path)
    _define_unmanaged(system, "other", "running")
    sec, _ = section(system)
    outcome = converge(sec, spec(vm("other")))
    assert outcome.state is SectionState.FAILED and outcome.reason == "InstanceFailed"
    assert "bcd did not create" in outcome.message
    xml = system.host_path(f"{STATE}/other.xml").read_text()
    assert (
        "bcd:instance" not in xml
        and json.loads(system.host_path(f"{STATE}/other.json").read_text())["state"] == "running"
    )
    assert plan(spec(), observed(dom("other", managed=False))).steps == ()


def test_managed_domain_no_spec_names_is_deleted_dlv_inst_03(tmp_path: Path) -> None:
    """DLV-INST-03, DLV-LIBVIRT-21: destroyed, undefined and its directory removed."""
    system = sim_host(tmp_path)
    sec, _ = section(system)
    converge(sec, spec(vm("a"), vm("b")))
    assert system.exists("/var/lib/bcd/libvirt/instances/b/disk.qcow2")
    converge(sec, spec(vm("a"), generation=2))
    assert not system.exists(f"{STATE}/b.xml")
    assert not system.exists("/var/lib/bcd/libvirt/instances/b")
    assert system.exists(f"{STATE}/a.xml")


def test_deleted_instance_is_removed_dlv_inst_04() -> None:
    """DLV-INST-04."""
    p = plan(spec(vm("a", desired=Desired.DELETED)), observed(dom("a")))
    assert p.steps == (Delete("libvirt-kvm", "a"),)


def test_user_data_by_secret_request_before_define_dlv_inst_06(tmp_path: Path) -> None:
    """DLV-INST-06, DLV-LIBVIRT-09/10/11, DLV-IMG-10: fetched with the allocation before define, into a
    cidata seed; the downloaded base is 0644 in a 0700 images/ (plus QEMU's o+x as root)."""
    system = sim_host(tmp_path)
    source = FixedUserData({"a": UserData(data=b"#cloud-config\nhostname: a\n")})
    sec, _ = section(system, source)
    converge(sec, spec(vm("a", user_data_ref="secret/ud-a")))
    assert source.asked == [("a", "alloc_a", "secret/ud-a")]
    import os
    import stat

    from bcd_simhost.libvirt import IMAGE_SHA256

    images = system.host_path("/var/lib/bcd/libvirt/images")
    assert stat.S_IMODE(os.stat(images).st_mode) == 0o701
    assert stat.S_IMODE(os.stat(images / f"{IMAGE_SHA256}.qcow2").st_mode) == 0o644
    iso = system.read_bytes("/var/lib/bcd/libvirt/instances/a/seed.iso") or b""
    assert b"CD001" in iso and b"hostname: a" in iso and b"instance-id: a\nlocal-hostname: a" in iso
    xml = system.read_text(f"{STATE}/a.xml") or ""
    assert "seed.iso" in xml and "<readonly />" in xml
    converge(sec, spec(vm("a", user_data_ref="secret/ud-a"), generation=2))
    assert len(source.asked) == 1  # a defined domain needs no user data again


def test_refused_user_data_fails_the_instance_dlv_inst_07_and_unavailable_waits_dlv_inst_08(
    tmp_path: Path,
) -> None:
    """DLV-INST-07, DLV-INST-08, DLV-INST-12, DLV-INST-13."""
    system = sim_host(tmp_path)
    refused = FixedUserData({"a": UserData(refused="not your allocation")})
    sec, _ = section(system, refused)
    out = converge(sec, spec(vm("a", user_data_ref="r")))
    assert (out.state, out.reason) == (SectionState.FAILED, "InstanceFailed")
    assert "user data refused: not your allocation" in out.message
    assert not system.exists(f"{STATE}/a.xml")
    waiting = FixedUserData({"a": UserData(unavailable="the secret broker did not answer")})
    sec, _ = section(system, waiting)
    out = converge(sec, spec(vm("a", user_data_ref="r")))
    assert out.state is SectionState.PROGRESSING and "waiting for the user data" in out.message
    assert [i.state for i in sec.last_report.instances] == ["PENDING"]


def test_resume_is_not_a_boot_and_not_admitted_dlv_inst_10_dlv_adm_02() -> None:
    """DLV-INST-10, DLV-ADM-02: PAUSED -> RUNNING is resume, even with no memory left."""
    p = plan(spec(vm("a")), observed(dom("a", PAUSED), mem=memory(2)))
    assert p.steps == (Resume("libvirt-kvm", "a"),) and not p.waiting


def test_after_a_reboot_the_next_pass_starts_what_should_run_dlv_inst_11(tmp_path: Path) -> None:
    """DLV-INST-11: domains recorded under another boot id are shut off; the pass starts them."""
    system = sim_host(tmp_path)
    sec, _ = section(system)
    converge(sec, spec(vm("a"), vm("s", desired=Desired.STOPPED)))
    system.host_path("/proc/sys/kernel/random/boot_id").write_text("00000000-0000-4000-8000-00000000beef\n")
    p = sec.plan(spec(vm("a"), vm("s", desired=Desired.STOPPED)), 2)
    assert [type(s) for s in p.steps] == [Start]
    converge(sec, spec(vm("a"), vm("s", desired=Desired.STOPPED), generation=2))
    assert json.loads(system.read_text(f"{STATE}/a.json") or "")["state"] == "running"


def test_unknown_runtime_fails_only_that_instance_dlv_inst_12_dlv_rt_05() -> None:
    """DLV-INST-12, DLV-RT-05."""
    p = plan(spec(vm("a", runtime="cloud-hypervisor"), vm("b")), observed())
    assert p.errors == {"a": "cloud-hypervisor runtime is not installed on this host"}
    assert [type(s) for s in p.steps] == [Create, Start]


def test_no_runtime_fails_a_non_empty_section_dlv_rt_10() -> None:
    """DLV-RT-10."""
    assert plan(spec(vm("a")), Observed()).section_error == NO_RUNTIME
    assert plan(spec(), Observed()).section_error is None


def test_stops_and_deletes_come_before_starts_dlv_inst_16() -> None:
    """DLV-INST-16, DLV-ADM-06: the memory a stop frees admits a start of the same pass."""
    # 6 GiB host: budget 6-1 = 5 GiB; each 2 GiB domain takes 2 GiB + 64 MiB + 256 MiB.
    obs = observed(dom("old"), dom("s"), dom("n", STOPPED), mem=memory(6))
    p = plan(spec(vm("s", desired=Desired.STOPPED), vm("n")), obs)
    kinds = [type(s).__name__ for s in p.steps]
    assert kinds == ["Delete", "Stop", "Start"], kinds
    assert not p.waiting


@pytest.mark.parametrize("state", [RUNNING, PAUSED])
def test_a_paused_or_running_domain_stopped_or_deleted_frees_its_memory_for_a_start_dlv_inst_16(
    state: str,
) -> None:
    """DLV-INST-16: on a 5 GiB host (4096 MiB budget) two 2 GiB domains, running or paused, hold 4736
    MiB; a start of the same pass fits only once both the delete and the stop have given theirs back."""
    obs = observed(dom("old", state), dom("s", state), dom("n", STOPPED), mem=memory(5))
    p = plan(spec(vm("s", desired=Desired.STOPPED), vm("n")), obs)
    assert [type(s).__name__ for s in p.steps] == ["Delete", "Stop", "Start"]
    assert not p.waiting


def test_admission_refusal_is_resources_exhausted_not_error_dlv_adm_12_13_dlv_inst_14() -> None:
    """DLV-ADM-01, DLV-ADM-04, DLV-ADM-05, DLV-ADM-06, DLV-ADM-08, DLV-ADM-12, DLV-ADM-13, DLV-INST-14."""
    # 8 GiB MemTotal, 1 GiB headroom: 7168 MiB; one running 2 GiB domain takes 2368 MiB; left 4800.
    obs = observed(dom("r"), dom("x", STOPPED), mem=memory(8))
    p = plan(spec(vm("r"), vm("x"), vm("y"), vm("z")), obs)
    # x and y fit (2368 each: 4800 -> 2432 -> 64), z does not: a new one is created, stays stopped.
    assert p.waiting == {"z": "ResourcesExhausted: 2368 MiB of memory needed, 64 MiB left on this host"}
    assert [(type(s).__name__, getattr(s, "name", "")) for s in p.steps] == [
        ("Create", ""),
        ("Create", ""),
        ("Start", "x"),
        ("Start", "y"),
    ]
    assert not p.errors


def test_admission_counts_bound_holds_dlv_adm_07() -> None:
    """DLV-ADM-07."""
    obs = observed(mem=memory(8), holds_memory_bytes=5 * GIB)
    p = plan(spec(vm("a")), obs)
    assert p.waiting["a"].startswith("ResourcesExhausted: 2368 MiB of memory needed, 2048 MiB left")


def test_huge_page_admission_and_overhead_dlv_adm_09_11() -> None:
    """DLV-ADM-09, DLV-ADM-10, DLV-ADM-11: pages on the placement's nodes; overhead on normal memory.
    DLV-ADM-04's Hugetlb: the 300 MiB left is MemTotal less the 4 GiB pool less 1 GiB (the other
    admission tests have no pool)."""
    # 300 MiB of normal memory left: a 2 GiB guest in huge pages still needs 64 + 256 MiB of it.
    pool = {2048: HugePool(2048, 2048, {0: 1024, 1: 1024})}
    tight = HostMemory((5 * 1024 + 300) * 1024, 4 * 1024 * 1024, pool, (0, 1))
    p = plan(spec(vm("a", placement=Placement(hugepage_size_bytes=2 * MIB))), observed(mem=tight))
    assert p.waiting == {"a": "ResourcesExhausted: 320 MiB of memory needed, 300 MiB left on this host"}
    huge = Placement(mems="0", hugepage_size_bytes=2 * MIB)
    obs = observed(mem=memory(64, pages_2m=2048))  # 1024 free pages on each node
    p = plan(spec(vm("a", memory_bytes=2 * GIB, placement=huge)), obs)
    assert [type(s) for s in p.steps] == [Create, Start]
    p = plan(spec(vm("a", memory_bytes=4 * GIB, placement=huge)), obs)
    assert p.waiting == {"a": "ResourcesExhausted: 2048 hugepages of 2048 KiB needed, 1024 free"}
    anywhere = Placement(hugepage_size_bytes=2 * MIB)
    assert not plan(spec(vm("a", memory_bytes=4 * GIB, placement=anywhere)), obs).waiting


def test_a_start_needing_exactly_what_is_left_is_admitted_a_byte_more_is_not_dlv_adm_12() -> None:
    """DLV-ADM-12: the bound is inclusive, at the byte. 8 GiB host: 7168 MiB budget; a 2 GiB guest needs
    2368 MiB, so holds of 4800 MiB leave it exactly that, and one more byte of holds refuses it."""
    exact = observed(mem=memory(8), holds_memory_bytes=4800 * MIB)
    assert [type(s) for s in plan(spec(vm("a")), exact).steps] == [Create, Start]
    over = observed(mem=memory(8), holds_memory_bytes=4800 * MIB + 1)
    p = plan(spec(vm("a")), over)
    assert p.waiting == {"a": "ResourcesExhausted: 2368 MiB of memory needed, 2367 MiB left on this host"}
    assert [type(s) for s in p.steps] == [Create]


def test_paused_domains_count_and_unmanaged_ones_do_not_dlv_adm_06() -> None:
    """DLV-ADM-06: a paused domain bcd manages is charged like a running one; a running domain bcd did
    not create is not charged; a stopped one is not charged."""
    obs = observed(
        dom("p", PAUSED), dom("u", managed=False), dom("s", STOPPED), mem=memory(8)
    )  # 7168 - 2368 (p) = 4800 left: two more 2 GiB guests fit, a third does not
    p = plan(
        spec(vm("p", desired=Desired.PAUSED), vm("s", desired=Desired.STOPPED), vm("a"), vm("b"), vm("c")),
        obs,
    )
    assert p.waiting == {"c": "ResourcesExhausted: 2368 MiB of memory needed, 64 MiB left on this host"}


def test_huge_pages_are_bounded_host_wide_by_what_takers_without_nodes_took_dlv_adm_09() -> None:
    """DLV-ADM-09: a guest on node 0 whose node still has its 1024 pages free is refused when an earlier
    start of the pass without NUMA nodes took the host-wide count down to 512 (2048 free, 1536 taken)."""
    obs = observed(mem=memory(64, pages_2m=2048))  # 1024 free on each node, 2048 host-wide
    anywhere = vm("any", memory_bytes=3 * GIB, placement=Placement(hugepage_size_bytes=2 * MIB))
    on0 = vm("on0", memory_bytes=2 * GIB, placement=Placement(mems="0", hugepage_size_bytes=2 * MIB))
    p = plan(spec(anywhere, on0), obs)
    assert p.waiting == {"on0": "ResourcesExhausted: 1024 hugepages of 2048 KiB needed, 512 free"}
    assert [(type(s).__name__, getattr(s, "name", "")) for s in p.steps] == [
        ("Create", ""),
        ("Create", ""),
        ("Start", "any"),
    ]
    # Alone, the same guest fits: its node and the host have the pages.
    assert not plan(spec(on0), obs).waiting


def test_host_wide_huge_pages_are_free_less_reserved_dlv_adm_10(tmp_path: Path) -> None:
    """DLV-ADM-10: a guest without NUMA nodes needs free less reserved pages host-wide: with 2048 free
    and 1025 reserved (promised to a mapping, not yet faulted in), a 1024-page guest does not fit, a
    1023-page one does. The count is read from sysfs as the node reads it."""
    from bcd_agent.inventory.host import read_host_memory

    system = sim_host(tmp_path)
    pool = "/sys/kernel/mm/hugepages/hugepages-2048kB"
    system.host_path(f"{pool}/free_hugepages").write_text("2048\n")
    system.host_path(f"{pool}/resv_hugepages").write_text("1025\n")
    mem = read_host_memory(system)
    assert mem is not None and mem.pools[2048].free == 1023
    anywhere = Placement(hugepage_size_bytes=2 * MIB)
    p = plan(spec(vm("a", memory_bytes=2 * GIB, placement=anywhere)), observed(mem=mem))
    assert p.waiting == {"a": "ResourcesExhausted: 1024 hugepages of 2048 KiB needed, 1023 free"}
    p = plan(spec(vm("a", memory_bytes=2 * GIB - 2 * MIB, placement=anywhere)), observed(mem=mem))
    assert not p.waiting and [type(s) for s in p.steps] == [Create, Start]


def test_unreadable_meminfo_starts_without_admission_dlv_adm_15() -> None:
    """DLV-ADM-15."""
    obs = Observed(runtimes={"libvirt-kvm": RuntimeView("libvirt-kvm")}, host=HOST, memory=None)
    p = plan(spec(vm("a", memory_bytes=1 << 45)), obs)
    assert [type(s) for s in p.steps] == [Create, Start] and p.warnings


def test_runtime_that_checks_capacity_is_not_admitted_dlv_adm_14() -> None:
    """DLV-ADM-14."""
    obs = Observed(
        runtimes={"libvirt-kvm": RuntimeView("libvirt-kvm", checks_capacity=True)},
        host=HOST,
        memory=memory(2),
    )
    assert [type(s) for s in plan(spec(vm("a")), obs).steps] == [Create, Start]


@pytest.mark.parametrize(
    ("placement", "vcpus", "memory_bytes", "message"),
    [
        (Placement(cpus="0"), 2, 2 * GIB, "placement.cpus: 1 CPUs for 2 vCPUs"),
        (Placement(cpus="100-101"), 2, 2 * GIB, "are not online"),
        (Placement(mems="5"), 2, 2 * GIB, "NUMA nodes [5] do not exist"),
        (Placement(hugepage_size_bytes=4096), 2, 2 * GIB, "neither 2 MiB nor 1 GiB"),
        (Placement(hugepage_size_bytes=GIB), 2, 3 * GIB // 2, "not whole 1024 MiB pages"),
        (Placement(hugepage_size_bytes=2 * MIB), 2, 2 * GIB, "this host has no 2 MiB huge page pool"),
        (
            Placement(hugepage_size_bytes=GIB, balloon=True),
            2,
            2 * GIB,
            "balloon is never used with huge pages",
        ),
    ],
)
def test_placement_the_host_cannot_apply_fails_the_instance_dlv_plc_06(
    placement: Placement, vcpus: int, memory_bytes: int, message: str
) -> None:
    """DLV-PLC-01, DLV-PLC-02, DLV-PLC-03, DLV-PLC-04, DLV-PLC-05, DLV-PLC-06: nothing created."""
    host = HostFacts(HOST.online_cpus, HOST.numa_nodes, frozenset({GIB}))  # no 2 MiB pool here
    obs = Observed(runtimes={"libvirt-kvm": RuntimeView("libvirt-kvm")}, host=host, memory=memory(512))
    p = plan(spec(vm("a", vcpus=vcpus, memory_bytes=memory_bytes, placement=placement)), obs)
    assert message in p.errors["a"] and p.steps == ()


def test_gpu_without_bus_id_fails_dlv_libvirt_14_and_vfio_claims() -> None:
    """DLV-LIBVIRT-14; the devices section's VFIO map names the instance that passes a GPU through."""
    obs = observed(gpu_addresses={"GPU-1": None, "GPU-2": "0000:53:00.0"})
    p = plan(spec(vm("a", gpu_uuids=("GPU-1",)), vm("b", gpu_uuids=("GPU-2",))), obs)
    assert p.errors == {"a": "GPU GPU-1 has no PCI bus id in the inventory"}
    assert p.vfio == {"GPU-2": "b"}
    created = [s for s in p.steps if isinstance(s, Create)]
    assert created[0].gpu_addresses == ("0000:53:00.0",)


def test_gpu_of_a_live_hold_waits() -> None:
    obs = observed(gpu_addresses={"GPU-2": "0000:53:00.0"}, gpu_holds={"GPU-2": "alloc_x"})
    p = plan(spec(vm("b", gpu_uuids=("GPU-2",))), obs)
    assert p.waiting == {"b": "GPU GPU-2 is held by allocation alloc_x"} and p.steps == ()


def test_disk_grows_and_never_shrinks_dlv_libvirt_07_08(tmp_path: Path) -> None:
    """DLV-LIBVIRT-07, DLV-LIBVIRT-08, DLV-IMG-19: the size read back from the overlay's header."""
    system = sim_host(tmp_path)
    sec, rt = section(system)
    converge(sec, spec(vm("a", desired=Desired.STOPPED)))
    converge(sec, spec(vm("a", desired=Desired.STOPPED, disk_bytes=20 * GIB), generation=2))
    assert rt._overlay_size("a") == 20 * GIB
    out = converge(sec, spec(vm("a", desired=Desired.STOPPED, disk_bytes=5 * GIB), generation=3))
    assert out.state is SectionState.FAILED and "disks only grow" in out.message
    assert rt._overlay_size("a") == 20 * GIB


def test_start_refused_for_memory_is_an_error_dlv_libvirt_20(tmp_path: Path) -> None:
    """DLV-LIBVIRT-20, DLV-INST-12: "Cannot allocate memory" from libvirt fails that instance."""
    system = sim_host(tmp_path)
    system.write_atomic(f"{STATE}/capacity.json", json.dumps({"vcpus": 64, "memory_bytes": 3 * GIB}).encode())
    sec, _ = section(system)
    out = converge(sec, spec(vm("a"), vm("b")))
    assert out.state is SectionState.FAILED
    states = {i.instance_id: (i.state, i.message) for i in sec.last_report.instances}
    assert states["a"] == ("RUNNING", "")
    assert states["b"][0] == "ERROR" and "Cannot allocate memory" in states["b"][1]


def test_stop_is_shutdown_then_destroy_dlv_libvirt_19(tmp_path: Path) -> None:
    """DLV-LIBVIRT-19: a guest that ignores shutdown is destroyed after the stop timeout."""
    from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime
    from bcd_shared.system import CommandResult

    calls: list[tuple[str, ...]] = []

    class Stubborn:
        def read(self, *args: str) -> CommandResult:
            calls.append(args)
            return CommandResult(
                args, 0, b"shut off\n" if ("destroy",) in [c[:1] for c in calls] else b"running\n"
            )

        def define(self, name: str, xml: bytes, xml_path: str) -> None: ...

        def act(self, verb: str, name: str, *args: str) -> CommandResult:
            calls.append((verb, name))
            return CommandResult((verb,), 0)

    rt = LibvirtRuntime(
        sim_host(tmp_path), Stubborn(), "/var/lib/bcd", stop_timeout_s=0.05, sleep=lambda s: None
    )
    rt.stop("a")
    verbs = [c[0] for c in calls if c[0] in ("shutdown", "destroy")]
    assert verbs == ["shutdown", "destroy"]


@pytest.mark.parametrize("stops_after_s", [59.0, None])
def test_stop_waits_sixty_seconds_for_the_shutdown_before_destroy_dlv_libvirt_19(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stops_after_s: float | None
) -> None:
    """DLV-LIBVIRT-19 on a fake clock (the runtime's default timeout): a guest that shuts down 59 s
    after `virsh shutdown` is never destroyed; one that ignores it is destroyed at 60 s, not before."""
    from types import SimpleNamespace

    from bcd_agent.sections.instances.runtimes import libvirt as lv
    from bcd_shared.system import CommandResult

    clock = [1000.0]
    monkeypatch.setattr(lv, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    acts: list[tuple[str, float]] = []

    class Guest:
        def read(self, *args: str) -> CommandResult:
            down = ("destroy", "a") in [(v, "a") for v, _ in acts] or (
                stops_after_s is not None and acts and clock[0] - acts[0][1] >= stops_after_s
            )
            return CommandResult(args, 0, b"shut off\n" if down else b"running\n")

        def define(self, name: str, xml: bytes, xml_path: str) -> None: ...

        def act(self, verb: str, name: str, *args: str) -> CommandResult:
            acts.append((verb, clock[0]))
            return CommandResult((verb,), 0)

    def sleep(s: float) -> None:
        clock[0] += s

    lv.LibvirtRuntime(sim_host(tmp_path), Guest(), "/var/lib/bcd", sleep=sleep).stop("a")
    if stops_after_s is None:
        assert acts == [("shutdown", 1000.0), ("destroy", 1060.0)]
    else:
        assert acts == [("shutdown", 1000.0)] and clock[0] == 1059.0


def test_state_changes_suspend_and_stop() -> None:
    """DLV-INST-09, DLV-LIBVIRT-18."""
    p = plan(
        spec(vm("a", desired=Desired.PAUSED), vm("b", desired=Desired.STOPPED)), observed(dom("a"), dom("b"))
    )
    assert [type(s).__name__ for s in p.steps] == ["Stop", "Suspend"]
    p = plan(spec(vm("c", desired=Desired.PAUSED)), observed(dom("c", STOPPED)))
    assert p.steps == (Start("libvirt-kvm", "c", True, vm("c", desired=Desired.PAUSED)),)
    assert (
        Stop("libvirt-kvm", "b")
        in plan(spec(vm("b", desired=Desired.STOPPED)), observed(dom("b", PAUSED))).steps
    )


def test_images_over_https_only_dlv_libvirt_03() -> None:
    """DLV-LIBVIRT-03: an http:// image fails the instance before anything is created."""
    from bcd_agent.sections.instances.model import Image

    p = plan(spec(vm("a", image=Image("http://images.sim.bcd/x.qcow2", "ab" * 32, "qcow2"))), observed())
    assert "https only" in p.errors["a"] and p.steps == ()


def test_a_digest_mismatch_never_becomes_visible_dlv_libvirt_04(tmp_path: Path) -> None:
    """DLV-LIBVIRT-04: verified against the SHA-256 before it is renamed into images/."""
    from bcd_agent.sections.instances.model import Image

    system = sim_host(tmp_path)
    sec, _ = section(system)
    wrong = Image("https://images.sim.bcd/debian.qcow2", "cd" * 32, "qcow2")
    out = converge(sec, spec(vm("a", image=wrong)))
    assert out.state is SectionState.FAILED and "SHA-256" in out.message
    assert system.listdir("/var/lib/bcd/libvirt/images") == []
    assert not system.exists(f"{STATE}/a.xml")


def test_a_base_naming_a_backing_file_is_refused_at_download_dlv_img_02_05(tmp_path: Path) -> None:
    """DLV-IMG-02, DLV-IMG-05: checked when downloaded, before it is renamed into images/."""
    import hashlib

    from bcd_agent.sections.instances.model import Image
    from bcd_simhost.libvirt import HOSTILE_IMAGES

    system = sim_host(tmp_path)
    sec, _ = section(system)
    sha = hashlib.sha256(HOSTILE_IMAGES["backing.qcow2"]).hexdigest()
    out = converge(sec, spec(vm("a", image=Image("https://images.sim.bcd/backing.qcow2", sha, "qcow2"))))
    assert out.state is SectionState.FAILED and "names a backing file" in out.message
    assert system.listdir("/var/lib/bcd/libvirt/images") == []


def test_base_and_overlay_checked_again_before_a_start_dlv_img_03_14(tmp_path: Path) -> None:
    """DLV-IMG-03, DLV-IMG-11, DLV-IMG-14: a rewritten overlay, or a cached base that now names a
    backing file, fails the start; nothing is started."""
    from bcd_shared.images import parse_header
    from bcd_simhost.libvirt import qcow2_bytes

    system = sim_host(tmp_path)
    sec, _ = section(system)
    converge(sec, spec(vm("a", desired=Desired.STOPPED)))
    disk = system.host_path("/var/lib/bcd/libvirt/instances/a/disk.qcow2")
    good = disk.read_bytes()
    size = parse_header(good, 1 << 50).virtual_size
    disk.write_bytes(qcow2_bytes(size, "/var/lib/bcd/libvirt/instances/b/disk.qcow2", "qcow2"))
    out = converge(sec, spec(vm("a"), generation=2))
    assert out.state is SectionState.FAILED and "not bcd's base" in out.message
    assert json.loads(system.read_text(f"{STATE}/a.json") or "")["state"] == "shut off"
    disk.write_bytes(good)
    from bcd_simhost.libvirt import IMAGE_SHA256

    base = system.host_path(f"/var/lib/bcd/libvirt/images/{IMAGE_SHA256}.qcow2")
    base.write_bytes(qcow2_bytes(1 << 30, "/etc/shadow", "raw"))
    out = converge(sec, spec(vm("a"), generation=3))
    assert out.state is SectionState.FAILED and "names a backing file" in out.message
    assert json.loads(system.read_text(f"{STATE}/a.json") or "")["state"] == "shut off"


def test_a_changed_definition_is_applied_while_stopped(tmp_path: Path) -> None:
    """A spec change (vCPUs, memory, NICs, GPUs, placement) defines the domain again while it is
    stopped; a running domain keeps its definition (a note) until it stops."""
    system = sim_host(tmp_path)
    sec, _ = section(system)
    converge(sec, spec(vm("a"), vm("s", desired=Desired.STOPPED)))
    bigger = spec(vm("a", vcpus=4), vm("s", vcpus=4, desired=Desired.STOPPED), generation=2)
    p = sec.plan(bigger, 2)
    assert [(type(s).__name__, getattr(s, "instance", None) and s.instance.id) for s in p.steps] == [
        ("Create", "s")
    ]
    assert p.notes == {"a": "the spec changed the definition: it applies when the domain next stops"}
    converge(sec, bigger)
    assert '<vcpu placement="static">4</vcpu>' in (system.read_text(f"{STATE}/s.xml") or "")
    assert '<vcpu placement="static">2</vcpu>' in (system.read_text(f"{STATE}/a.xml") or "")
    notes = {i.instance_id: i.message for i in sec.last_report.instances}
    assert notes["a"].startswith("the spec changed") and notes["s"] == ""
    stopped = spec(
        vm("a", vcpus=4, desired=Desired.STOPPED), vm("s", vcpus=4, desired=Desired.STOPPED), generation=3
    )
    converge(sec, stopped)
    assert '<vcpu placement="static">4</vcpu>' in (system.read_text(f"{STATE}/a.xml") or "")
    assert sec.plan(stopped, 3).steps == ()


def test_a_failed_create_leaves_no_directory_once_unwanted(tmp_path: Path) -> None:
    """A create that failed before its define leaves the instance's directory; it goes once the
    instance is no longer wanted (and is reused while it is)."""
    system = sim_host(tmp_path)
    sec, _ = section(system)
    d = "/var/lib/bcd/libvirt/instances/x"
    system.host_path(d).mkdir(parents=True)
    system.write_atomic(f"{d}/disk.qcow2", b"partial")
    p = sec.plan(spec(vm("y")), 1)
    assert [type(s).__name__ for s in p.steps] == ["RemoveFiles", "Create", "Start"]
    converge(sec, spec(vm("y")))
    assert not system.exists(d)
    assert sec.plan(spec(vm("y")), 1).steps == ()


# --- tap names (docs/instances.md, "Tap names") ------------------------------------------------------

# Two ids whose taps collide under instancenames.tap_name (44 bits of SHA-256; found by a search).
TWIN_A, TWIN_B = "vm-1762438", "vm-3742940"


def test_two_instances_whose_tap_names_collide_the_second_is_refused_naming_both() -> None:
    """The tap names really collide. Of two spec instances with NICs sharing them, the first in the
    spec keeps them and the second fails (`nics:` naming both ids and the rule) with no step of its
    own; one whose domain exists keeps them whatever the order; an instance without NICs has no
    taps, so it never collides."""
    from bcd_shared.instancenames import tap_name, tap_stem

    assert tap_name(TWIN_A, 0) == tap_name(TWIN_B, 0) and tap_stem(TWIN_A) == tap_stem(TWIN_B)
    p = plan(spec(vm(TWIN_A), vm(TWIN_B)), observed())
    assert [s.instance.id for s in p.steps if isinstance(s, Create)] == [TWIN_A]
    assert p.errors == {
        TWIN_B: f"nics: instance {TWIN_B}'s taps ({tap_stem(TWIN_B)}<NIC>) are instance {TWIN_A}'s too: "
        "tap names hash the instance id into 15 characters (IFNAMSIZ), and no two live instances may "
        "share one (rename one of them)"
    }
    # The live one keeps its names, even listed second.
    p = plan(spec(vm(TWIN_B), vm(TWIN_A)), observed(dom(TWIN_A)))
    assert set(p.errors) == {TWIN_B} and f"are instance {TWIN_A}'s too" in p.errors[TWIN_B]
    # No NICs, no taps.
    p = plan(spec(vm(TWIN_A), vm(TWIN_B, nics=())), observed())
    assert p.errors == {}
    # A DELETED or invalid twin holds nothing.
    p = plan(spec(vm(TWIN_A, desired=Desired.DELETED), vm(TWIN_B)), observed())
    assert p.errors == {}
    p = plan(spec(vm(TWIN_A, vcpus=0), vm(TWIN_B)), observed())
    assert set(p.errors) == {TWIN_A}
