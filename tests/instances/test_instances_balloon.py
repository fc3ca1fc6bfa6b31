"""Memory ballooning (DLV-BAL): the pure controller by the seed's table, then the controller's shell over
libvirt-kvm on the simulated host (its virsh answers `domstats --balloon` and records `setmem`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bcd_agent.inventory.host import HostMemory
from bcd_agent.sections.instances.balloon import (
    BALLOON_METRIC,
    BalloonController,
    Guest,
    HostPressure,
    Resize,
    floor_bytes,
    parse_pressure,
    plan_balloons,
)
from bcd_agent.sections.instances.model import Desired, Placement
from bcd_agent.sections.instances.placement import Admission
from bcd_agent.sections.instances.runtimes.base import Domain, ErrNoBalloon
from bcd_agent.sections.instances.runtimes.libvirt import parse_domstats
from bcd_simhost.libvirt import STATE
from instkit import converge, section, sim_host, spec, vm

GIB = 1 << 30
MIB = 1 << 20
HOST = 64 * GIB


def host(available: int, stall: float | None = 0.0) -> HostPressure:
    return HostPressure(HOST, available, stall)


def guest(name: str, mem: int = 8 * GIB, balloon: int = 0, used: int | None = GIB) -> Guest:
    return Guest(name, "libvirt-kvm", mem, balloon, used)


def apply(
    h: HostPressure, guests: list[Guest], steps: tuple[Resize, ...]
) -> tuple[HostPressure, list[Guest]]:
    """The fake host: what a balloon takes from a guest becomes available to the host, and back."""
    by = {s.name: s for s in steps}
    freed = sum(s.balloon_bytes - s.previous_bytes for s in steps)
    new = [
        Guest(g.name, g.runtime, g.memory_bytes, by[g.name].balloon_bytes, g.used_bytes)
        if g.name in by
        else g
        for g in guests
    ]
    return HostPressure(h.total_bytes, h.available_bytes + freed, h.stall_avg10), new


def test_inflates_to_cover_the_shortfall_below_ten_percent_then_nothing_dlv_bal_05_09() -> None:
    """DLV-BAL-05, DLV-BAL-09: 4 GiB available of 64 (6.25%): the balloons take the 2.4 GiB shortfall
    below 10%; applied, the host is at 10% exactly (in between): planning again gives no steps."""
    h = host(4 * GIB)
    guests = [guest("a"), guest("b")]
    steps = plan_balloons(h, guests, 50)
    shortfall = HOST // 10 - 4 * GIB
    taken = sum(s.balloon_bytes for s in steps)
    assert shortfall <= taken < shortfall + MIB * len(guests) + MIB
    h2, g2 = apply(h, guests, steps)
    assert h2.available_bytes >= HOST // 10
    assert plan_balloons(h2, g2, 50) == ()
    inflated = [guest("a", balloon=2 * GIB), guest("b", balloon=GIB)]
    for percent in (11, 15, 20):  # in between: neither inflated nor deflated
        assert plan_balloons(host(HOST * percent // 100), inflated, 50) == ()


def test_most_room_above_the_floor_first_at_most_a_quarter_each_dlv_bal_06_07() -> None:
    """DLV-BAL-06, DLV-BAL-07: b (16 GiB, 1 GiB used) has the most above its floor and gives first, but
    never more than a quarter of its memory in one pass; a (8 GiB) gives the rest."""
    h = HostPressure(HOST, 0, 0.0)  # a shortfall of 6.4 GiB
    a, b = guest("a", 8 * GIB), guest("b", 16 * GIB)
    steps = {s.name: s.balloon_bytes for s in plan_balloons(h, [a, b], 50)}
    assert steps["b"] == 4 * GIB  # a quarter of 16 GiB, though more is needed
    assert steps["a"] == 2 * GIB  # a quarter of 8 GiB: the rest of the shortfall stays for the next pass
    small = plan_balloons(HostPressure(HOST, HOST // 10 - GIB, 0.0), [a, b], 50)
    assert [(s.name, s.balloon_bytes) for s in small] == [("b", GIB)]  # b alone covers 1 GiB


def test_a_stall_takes_at_least_two_percent_even_with_memory_available_dlv_bal_05() -> None:
    """DLV-BAL-05 with Q-DLV-BAL-01: PSI `some avg10` of 10.00 or more is a stall: even at 15% available
    the balloons take 2% of host memory; 9.99 is no stall."""
    guests = [guest("a", 16 * GIB)]
    steps = plan_balloons(host(HOST * 15 // 100, 10.0), guests, 50)
    assert sum(s.balloon_bytes for s in steps) >= HOST * 2 // 100
    assert plan_balloons(host(HOST * 15 // 100, 9.99), guests, 50) == ()
    # Exactly: 2% of 64 GiB is 1310.72 MiB, taken as 1311 MiB; stalled with a larger shortfall (5%
    # available: 3276.8 MiB short of 10%), the shortfall, 3277 MiB, and no more.
    whole_mib = -(-(HOST * 2 // 100) // MIB) * MIB
    assert [s.balloon_bytes for s in steps] == [whole_mib] == [1311 * MIB]
    short = plan_balloons(host(HOST * 5 // 100, 10.0), guests, 50)
    assert [s.balloon_bytes for s in short] == [3277 * MIB]


def test_deflates_a_quarter_at_a_time_within_what_is_free_above_twenty_percent_dlv_bal_08() -> None:
    """DLV-BAL-08: with 21% available the balloons give back only the 1% free above 20%, the most
    inflated first; with 40% each
    gives back a quarter of its guest's memory per pass; repeated passes empty them, then no steps."""
    guests = [guest("a", 8 * GIB, balloon=4 * GIB), guest("b", 8 * GIB, balloon=3 * GIB)]
    tight = plan_balloons(host(HOST * 21 // 100), guests, 50)
    assert 0 < sum(s.previous_bytes - s.balloon_bytes for s in tight) <= HOST // 100  # 1% is free above 20%
    assert [s.name for s in tight] == ["a"]  # the most inflated is given back first
    h = host(HOST * 40 // 100)
    steps = plan_balloons(h, guests, 50)
    assert {s.name: s.previous_bytes - s.balloon_bytes for s in steps} == {"a": 2 * GIB, "b": 2 * GIB}
    for _ in range(5):
        if not steps:
            break
        h, guests = apply(h, guests, steps)
        steps = plan_balloons(h, guests, 50)
    assert steps == () and all(g.balloon_bytes == 0 for g in guests)
    stalled = host(HOST * 30 // 100, 12.0)
    assert all(s.balloon_bytes >= s.previous_bytes for s in plan_balloons(stalled, guests, 50))


def test_floor_is_the_percent_or_use_plus_ten_percent_never_crossed_dlv_bal_10_11() -> None:
    """DLV-BAL-10, DLV-BAL-11: the floor is balloon_floor_percent of memory, or use + 10% when higher;
    a guest without a usage reading is never taken from; one below its floor is given back to it."""
    assert floor_bytes(guest("a", 10 * GIB, used=GIB), 50) == 5 * GIB
    assert floor_bytes(guest("a", 10 * GIB, used=6 * GIB), 50) == 7 * GIB
    assert floor_bytes(guest("a", 10 * GIB, used=None), 10) == 10 * GIB
    h = HostPressure(HOST, 0, 50.0)  # desperate
    steps = plan_balloons(h, [guest("a", 8 * GIB, used=None), guest("b", 8 * GIB, balloon=3 * GIB)], 50)
    assert [s.name for s in steps] == ["b"] and steps[0].balloon_bytes == 4 * GIB  # b's floor: 4 GiB left
    for _ in range(4):
        h, gs = apply(h, [guest("b", 8 * GIB, balloon=steps[0].balloon_bytes)], steps)
        assert plan_balloons(h, gs, 50) == ()  # at its floor: nothing more, even while stalled
    grown = guest("c", 8 * GIB, balloon=5 * GIB, used=5 * GIB)  # its use grew: floor 5.8 GiB left
    (back,) = plan_balloons(host(HOST * 15 // 100), [grown], 50)
    assert back.guest_bytes == floor_bytes(grown, 50)


def test_pressure_parsed_from_proc() -> None:
    meminfo = "MemTotal:       65536000 kB\nMemFree:  1 kB\nMemAvailable:    6553600 kB\n"
    psi = "some avg10=12.50 avg60=3.00 avg300=1.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    assert parse_pressure(meminfo, psi) == HostPressure(65536000 * 1024, 6553600 * 1024, 12.5)
    assert parse_pressure(meminfo, None) == HostPressure(65536000 * 1024, 6553600 * 1024, None)
    assert parse_pressure("MemTotal: 1 kB\n", None) is None


def test_domstats_parsed() -> None:
    """`virsh domstats --balloon`'s shape (libvirt 9.0's virsh, one block per domain)."""
    text = (
        "Domain: 'a'\n  balloon.current=262144\n  balloon.maximum=524288\n  balloon.last-update=17\n"
        "  balloon.available=250000\n  balloon.usable=200000\n\nDomain: 'b'\n  balloon.current=1024\n\n"
    )
    assert parse_domstats(text) == {
        "a": {
            "balloon.current": 262144,
            "balloon.maximum": 524288,
            "balloon.last-update": 17,
            "balloon.available": 250000,
            "balloon.usable": 200000,
        },
        "b": {"balloon.current": 1024},
    }


# --- the controller over libvirt-kvm on the simulated host ------------------------------------------


def _pressure(system: object, available_kb: int) -> None:
    path = system.host_path("/proc/meminfo")  # type: ignore[attr-defined]
    text = path.read_text()
    total = int(next(line.split()[1] for line in text.splitlines() if line.startswith("MemTotal:")))
    lines = [
        f"MemAvailable:   {min(available_kb, total)} kB" if line.startswith("MemAvailable:") else line
        for line in text.splitlines()
    ]
    path.write_text("\n".join(lines) + "\n")


def test_controller_sets_balloons_of_running_ballooned_guests_only_dlv_bal_01_02_04_12_14(
    tmp_path: Path,
) -> None:
    """DLV-BAL-01, DLV-BAL-02, DLV-BAL-04, DLV-BAL-12, DLV-BAL-14, DLV-BAL-18: under pressure the
    controller reads `domstats --balloon` and sets `setmem --live` only for the running guest whose
    placement asks for a balloon; a guest without one (memballoon none), a stopped one, a paused one
    and one in huge pages are never touched; the set size is what the guest is left, in KiB; setting a
    guest without a balloon device answers ErrNoBalloon."""
    system = sim_host(tmp_path)
    sec, rt = section(system)
    ball = Placement(balloon=True)
    desired = spec(
        vm("a", placement=ball),
        vm("plain"),
        vm("off", placement=ball, desired=Desired.STOPPED),
        vm("paused", placement=ball, desired=Desired.PAUSED),
    )
    out = converge(sec, desired)
    assert out.state.name == "CONVERGED", out.message
    total_kb = int(system.host_path("/proc/meminfo").read_text().split()[1])
    _pressure(system, total_kb // 20)  # 5% available
    (system.host_path(STATE) / "a.used").write_text(f"{256 * 1024}\n")  # the guest uses 256 MiB
    ctl = BalloonController(system, {"libvirt-kvm": rt}, floor_percent=50)
    domains = [d for v in sec.list_runtimes().values() for d in v.domains]
    steps = ctl.tick(desired, domains)
    assert [s.name for s in steps] == ["a"]
    assert steps[0].balloon_bytes == 512 * MIB  # a quarter of its 2 GiB
    kib = int((system.host_path(STATE) / "a.balloon").read_text())
    assert kib == (2 * GIB - 512 * MIB) // 1024
    assert not (system.host_path(STATE) / "plain.balloon").exists()
    assert not (system.host_path(STATE) / "paused.balloon").exists()  # only running guests
    assert rt.balloon_readings()["a"].balloon_bytes == 512 * MIB
    assert "plain" not in rt.balloon_readings()
    with pytest.raises(ErrNoBalloon):
        rt.set_balloon("plain", MIB)
    assert ctl.lent == {"a": 512 * MIB}
    huge = vm("h", placement=Placement(hugepage_size_bytes=2 * MIB, balloon=True))
    dom = Domain("h", "libvirt-kvm", "running", True, memory_bytes=2 * GIB, hugepages=2 * MIB)
    assert ctl.guests(spec(huge), [dom]) == []  # huge pages: never ballooned
    assert BALLOON_METRIC == "bcd.instance.memory.balloon.reclaimed"


def test_controller_deflates_when_memory_returns_and_plans_nothing_after_dlv_bal_08(tmp_path: Path) -> None:
    """DLV-BAL-08 over the runtime: with memory back above 20%, the balloon is emptied in quarters, and
    once empty a tick sets nothing."""
    system = sim_host(tmp_path)
    sec, rt = section(system)
    desired = spec(vm("a", placement=Placement(balloon=True)))
    converge(sec, desired)
    (system.host_path(STATE) / "a.used").write_text(f"{256 * 1024}\n")
    total_kb = int(system.host_path("/proc/meminfo").read_text().split()[1])
    ctl = BalloonController(system, {"libvirt-kvm": rt}, floor_percent=50)
    domains = [d for v in sec.list_runtimes().values() for d in v.domains]
    _pressure(system, total_kb // 20)
    ctl.tick(desired, domains)
    ctl.tick(desired, domains)
    assert rt.balloon_readings()["a"].balloon_bytes == GIB  # two quarters of 2 GiB, down to the floor
    _pressure(system, total_kb // 2)
    ctl.tick(desired, domains)
    assert rt.balloon_readings()["a"].balloon_bytes == 512 * MIB
    ctl.tick(desired, domains)
    assert rt.balloon_readings()["a"].balloon_bytes == 0
    assert ctl.tick(desired, domains) == ()


def test_admission_still_charges_the_full_memory_of_a_ballooned_guest_dlv_bal_16(tmp_path: Path) -> None:
    """DLV-BAL-16: with a's balloon holding half its memory, the next pass's admission still charges
    a its full configured memory: a start that fits only by the balloon's loan waits."""
    system = sim_host(tmp_path)
    sec, rt = section(system)
    desired = spec(vm("a", placement=Placement(balloon=True)))
    converge(sec, desired)
    rt.set_balloon("a", GIB)
    assert rt.balloon_readings()["a"].balloon_bytes == GIB
    committed = sec.committed_bytes()
    assert committed >= 2 * GIB  # the whole 2 GiB, not the GiB the balloon leaves it
    mem = HostMemory((committed + GIB + 3 * GIB) // 1024, 0, {}, ())  # 3 GiB left after a's full charge
    assert Admission.open(mem, committed, 0).admit(vm("b", memory_bytes=3 * GIB)) is not None
    lent = Admission.open(mem, committed - GIB, 0)  # had the balloon's loan been counted, b would fit
    assert lent.admit(vm("b", memory_bytes=3 * GIB)) is None


def test_what_each_ballooned_guest_lends_is_exported_under_the_seeds_name_dlv_bal_17(tmp_path: Path) -> None:
    """DLV-BAL-17: after a tick the node's metrics carry `bcd.instance.memory.balloon.reclaimed`, one
    point per running guest whose spec asks for a balloon (its memory less what the balloon leaves it),
    none for a guest without one."""
    from bcd_agent.sections.telemetry.metrics import NodeMetrics

    system = sim_host(tmp_path)
    sec, rt = section(system)
    desired = spec(vm("a", placement=Placement(balloon=True)), vm("plain"))
    converge(sec, desired)
    (system.host_path(STATE) / "a.used").write_text(f"{256 * 1024}\n")
    total_kb = int(system.host_path("/proc/meminfo").read_text().split()[1])
    _pressure(system, total_kb // 20)
    ctl = BalloonController(system, {"libvirt-kvm": rt}, floor_percent=50)
    ctl.tick(desired, [d for v in sec.list_runtimes().values() for d in v.domains])
    metrics = NodeMetrics()
    metrics.balloons = lambda: dict(ctl.lent)
    (m,) = [m for m in metrics.collect() if m.name == "bcd.instance.memory.balloon.reclaimed"]
    assert m.unit == "By"
    assert [(p.attributes, p.value) for p in m.points] == [((("bcd.instance.id", "a"),), 512 * MIB)]
