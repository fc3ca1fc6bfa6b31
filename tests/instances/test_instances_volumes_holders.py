"""Volumes and their holders (DLV-VOL-24, DLV-VOL-41) through the section over libvirt-kvm on the
simulated host, the real volume store under the simulated root."""

from __future__ import annotations

import os
from pathlib import Path

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.instances.model import Desired, InstancesSpec, Nic
from bcd_agent.sections.instances.plan import Stop
from bcd_agent.sections.instances.section import InstancesSection
from bcd_agent.sections.instances.volumes import GIB, VolumeSpec, VolumeStore, plan_volumes
from bcd_shared.system import LocalSystem
from bcd_simhost.libvirt import STATE
from instkit import DATA_DIR, converge, section, sim_host, vm

DATA = VolumeSpec("data", "data-1", GIB)
SHARED = VolumeSpec("shared", "shared-1", GIB)


def _sec(tmp_path: Path, **kw: object) -> tuple[InstancesSection, LocalSystem]:
    system = sim_host(tmp_path)
    sec, _rt = section(system, **kw)
    sec.volumes = VolumeStore(str(system.host_path(f"{DATA_DIR}/volumes")))
    return sec, system


def spec(*inst: object, volumes: tuple[VolumeSpec, ...] = (DATA,), generation: int = 1) -> InstancesSpec:
    return InstancesSpec(generation, tuple(inst), volumes)  # type: ignore[arg-type]


def nic(n: int) -> tuple[Nic, ...]:
    return (Nic("br0", f"52:54:00:00:02:{n:02x}", (f"10.0.2.{n}/24",)),)


def _states(sec: InstancesSection) -> dict[str, tuple[str, str]]:
    return {i.instance_id: (i.state, i.message) for i in sec.last_report.instances}


def _also_holds(system: LocalSystem, sec: InstancesSection, name: str, donor: str) -> None:
    """Make `name`'s running domain hold `donor`'s volume disk as well (what an operator's hand, or a
    stop bcd believed done, could leave): the disk element copied into its definition."""
    import xml.etree.ElementTree as ET

    state = system.host_path(STATE)
    src = ET.fromstring((state / f"{donor}.xml").read_bytes())
    disk = next(d for d in src.findall("devices/disk") if "/volumes/" in (d.find("source").get("file", "")))  # type: ignore[union-attr]
    dst = ET.fromstring((state / f"{name}.xml").read_bytes())
    dst.find("devices").append(disk)  # type: ignore[union-attr]
    (state / f"{name}.xml").write_bytes(ET.tostring(dst))
    sec.runtimes["libvirt-kvm"].forget(name)  # type: ignore[attr-defined]


def test_a_second_holder_of_an_open_volume_lets_go_the_first_in_spec_order_keeps_it_dlv_vol_24(
    tmp_path: Path,
) -> None:
    """DLV-VOL-24, DLV-VOL-19: two running domains hold one volume for writing: the one later in spec
    order is stopped (it lets go) and reports why; the first runs on; nothing else stops (a pass with
    the spec order swapped would have stopped the other). The stopped one is not started again while
    the first holds the volume."""
    sec, system = _sec(tmp_path)
    a = vm("a", nics=nic(1), volumes=(("data", False),))
    b = vm("b", nics=nic(2))
    assert converge(sec, spec(a, b)).state is SectionState.CONVERGED
    _also_holds(system, sec, "b", "a")
    b2 = vm("b", nics=nic(2), volumes=(("data", False),))
    out = converge(sec, spec(a, b2, generation=2))
    st = _states(sec)
    assert st["a"][0] == "RUNNING"
    assert st["b"][0] == "ERROR" and "volume data is open for writing by instance a" in st["b"][1]
    assert "lets go" in st["b"][1] and out.state is SectionState.FAILED
    assert [d.state for d in sec.list_runtimes()["libvirt-kvm"].domains if d.name == "b"] == ["stopped"]
    converge(sec, spec(a, b2, generation=3))
    assert _states(sec)["b"][0] == "ERROR"  # not started again beside a's writer
    assert {d.name: d.state for d in sec.list_runtimes()["libvirt-kvm"].domains}["b"] == "stopped"


def test_which_holder_lets_go_follows_spec_order_and_spec_refusals_stop_none_dlv_vol_23_24() -> None:
    """DLV-VOL-24, DLV-VOL-23 in the pure planner: with both holding `data` for writing, the holder later
    in spec order lets go, whichever it is; readers beside readers keep it; a spec-level refusal (a
    volume the section does not list) lets nothing go."""
    from bcd_agent.sections.instances.volumes import Volume

    stored = {"data": Volume("data", "data-1", GIB, 0), "shared": Volume("shared", "shared-1", GIB, 0)}
    held = {"a": (("data", False),), "b": (("data", False),)}
    ab = [("a", (("data", False),), True), ("b", (("data", False),), True)]
    assert set(plan_volumes([DATA], ab, held, stored, None).let_go) == {"b"}
    assert set(plan_volumes([DATA], ab[::-1], held, stored, None).let_go) == {"a"}
    ro = {"a": (("shared", True),), "b": (("shared", True),)}
    both_ro = [("a", (("shared", True),), True), ("b", (("shared", True),), True)]
    assert plan_volumes([SHARED], both_ro, ro, stored, None).let_go == {}
    mixed = {"a": (("shared", True),), "b": (("shared", False),)}
    assert set(plan_volumes([SHARED], both_ro, mixed, stored, None).let_go) == {"b"}
    unlisted = plan_volumes([], ab[:1], {"a": (("data", False),)}, stored, None)
    assert unlisted.let_go == {} and "not a volume of this host's section" in unlisted.errors["a"]


def test_the_let_go_stop_is_a_step_of_the_pass_then_nothing(tmp_path: Path) -> None:
    """Plan, apply, plan again: the stop is planned once; the next pass plans no step for b."""
    from bcd_agent.sections.instances import volumepass

    sec, system = _sec(tmp_path)
    a = vm("a", nics=nic(1), volumes=(("data", False),))
    converge(sec, spec(a, vm("b", nics=nic(2))))
    _also_holds(system, sec, "b", "a")
    desired = spec(a, vm("b", nics=nic(2), volumes=(("data", False),)), generation=2)
    views = sec.list_runtimes()
    planned, _ = volumepass.before(sec.volumes, desired, views, sec.plan(desired, 2))  # type: ignore[arg-type]
    assert [s for s in planned.steps if isinstance(s, Stop)] == [Stop("libvirt-kvm", "b")]
    converge(sec, desired)
    again, _ = volumepass.before(sec.volumes, desired, sec.list_runtimes(), sec.plan(desired, 3))  # type: ignore[arg-type]
    assert [s for s in again.steps if getattr(s, "name", None) == "b"] == []


def test_under_the_helper_volumes_go_back_to_0600_when_no_running_domain_has_them_dlv_vol_41(
    tmp_path: Path,
) -> None:
    """DLV-VOL-41: under the helper a domain's volumes are group-readable for QEMU while it runs (0660,
    read-only 0640); stopping the writer puts its volume back to 0600; a read-only volume stays open
    to the group while another running domain reads it, and goes back to 0600 once the last reader is
    deleted."""
    sec, system = _sec(tmp_path, under_helper=True)
    vols = (DATA, SHARED)
    a = vm("a", nics=nic(1), volumes=(("data", False),))
    b = vm("b", nics=nic(2), volumes=(("shared", True),))
    c = vm("c", nics=nic(3), volumes=(("shared", True),))
    out = converge(sec, spec(a, b, c, volumes=vols))
    assert out.state is SectionState.CONVERGED, out.message
    raw = {v: system.host_path(f"{DATA_DIR}/volumes/{v}.raw") for v in ("data", "shared")}

    def mode(v: str) -> int:
        return os.stat(raw[v]).st_mode & 0o777

    assert (mode("data"), mode("shared")) == (0o660, 0o640)
    stopped = Desired.STOPPED
    converge(sec, spec(vm("a", nics=nic(1), volumes=(("data", False),), desired=stopped), b, c, volumes=vols,
                       generation=2))  # fmt: skip
    assert (mode("data"), mode("shared")) == (0o600, 0o640)
    converge(sec, spec(vm("b", nics=nic(2), volumes=(("shared", True),), desired=stopped), c, volumes=vols,
                       generation=3))  # fmt: skip
    assert mode("shared") == 0o640  # c still reads it
    converge(sec, spec(vm("b", nics=nic(2), volumes=(("shared", True),), desired=stopped), volumes=vols,
                       generation=4))  # fmt: skip
    assert mode("shared") == 0o600
