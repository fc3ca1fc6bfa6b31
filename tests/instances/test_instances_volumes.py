"""Persistent volumes through the instances section: the real store (sparse files under the simulated
root, on this machine's filesystem) and libvirt-kvm over the simulated host's virsh."""

from __future__ import annotations

import os
from pathlib import Path

from bcd_agent.converge.types import NodeStatus, SectionState
from bcd_agent.sections.instances.model import Desired, InstancesSpec, Nic
from bcd_agent.sections.instances.section import InstancesSection, capabilities
from bcd_agent.sections.instances.volumes import GIB, VolumeSpec, VolumeStore
from bcd_agent.session.status import status_report
from bcd_shared.domaincheck import DomainPolicy, check_domain
from bcd_shared.system import LocalSystem
from bcd_simhost.libvirt import STATE
from instkit import DATA_DIR, converge, section, sim_host, vm


def _sec(tmp_path: Path) -> tuple[InstancesSection, LocalSystem]:
    system = sim_host(tmp_path)
    sec, _rt = section(system)
    sec.volumes = VolumeStore(str(system.host_path(f"{DATA_DIR}/volumes")))
    return sec, system


def spec(*inst: object, volumes: tuple[VolumeSpec, ...] = (), generation: int = 1) -> InstancesSpec:
    return InstancesSpec(generation, tuple(inst), volumes)  # type: ignore[arg-type]


def nic(n: int) -> tuple[Nic, ...]:
    return (Nic("br0", f"52:54:00:00:01:{n:02x}", (f"10.0.1.{n}/24",)),)


DATA = VolumeSpec("data", "data-1", GIB)


def _states(sec: InstancesSection) -> dict[str, tuple[str, str]]:
    return {i.instance_id: (i.state, i.message) for i in sec.last_report.instances}


def test_created_before_define_and_attached_by_serial_dlv_vol_08_12_13(tmp_path: Path) -> None:
    """DLV-VOL-08, DLV-VOL-12, DLV-VOL-13: the volume exists before the domain is defined, which attaches
    it as the raw virtio disk vdb with its serial (read-only when asked, as vdc), a definition root's
    default-deny check accepts; the listing reports what the domain has open."""
    sec, system = _sec(tmp_path)
    ro = VolumeSpec("shared", "ro-1", GIB)
    out = converge(
        sec, spec(vm("a", nics=nic(1), volumes=(("data", False), ("shared", True))), volumes=(DATA, ro))
    )
    assert out.state is SectionState.CONVERGED, out.message
    raw = system.host_path(f"{DATA_DIR}/volumes/data.raw")
    assert os.stat(raw).st_size == GIB and os.stat(raw).st_blocks == 0
    xml = system.host_path(f"{DATA_DIR}/libvirt/instances/a/domain.xml").read_text()
    assert '<driver name="qemu" type="raw" />' in xml or '<driver name="qemu" type="raw"/>' in xml
    assert f'<source file="{DATA_DIR}/volumes/data.raw"' in xml and "<serial>data-1</serial>" in xml
    assert '<target dev="vdb" bus="virtio"' in xml and '<target dev="vdc" bus="virtio"' in xml
    checked = check_domain(xml.encode(), DomainPolicy("a", DATA_DIR, bridges=("br0",)))
    assert sorted(d.kind for d in checked.disks if d.kind == "volume") == ["volume", "volume"]
    dom = next(d for v in sec.list_runtimes().values() for d in v.domains)
    assert dom.volumes == (("data", False, "vdb"), ("shared", True, "vdc"))


def test_growth_reaches_the_running_guest_dlv_vol_09_11(tmp_path: Path) -> None:
    """DLV-VOL-09, DLV-VOL-11: a grown volume is truncated up before anything is defined and resized
    live in the running guest that has it open (`virsh blockresize` on its target)."""
    sec, system = _sec(tmp_path)
    converge(sec, spec(vm("a", nics=nic(1), volumes=(("data", False),)), volumes=(DATA,)))
    big = VolumeSpec("data", "data-1", 2 * GIB)
    out = converge(sec, spec(vm("a", nics=nic(1), volumes=(("data", False),)), volumes=(big,), generation=2))
    assert out.state is SectionState.CONVERGED, out.message
    assert os.stat(system.host_path(f"{DATA_DIR}/volumes/data.raw")).st_size == 2 * GIB
    assert system.host_path(f"{STATE}/a.resized").read_text() == f"vdb {2 * GIB}\n"


def test_second_writer_refused_first_keeps_it_dlv_vol_17_22(tmp_path: Path) -> None:
    """DLV-VOL-17, DLV-VOL-22: b asks for the volume a runs with as a writer: b fails, a runs on."""
    sec, _ = _sec(tmp_path)
    a = vm("a", nics=nic(1), volumes=(("data", False),))
    converge(sec, spec(a, volumes=(DATA,)))
    b = vm("b", nics=nic(2), volumes=(("data", False),))
    out = converge(sec, spec(b, a, volumes=(DATA,), generation=2))
    st = _states(sec)
    assert st["a"][0] == "RUNNING" and st["b"] == ("ERROR", "volume data is open for writing by instance a")
    assert out.state is SectionState.FAILED


def test_handed_over_in_one_pass_dlv_vol_20(tmp_path: Path) -> None:
    """DLV-VOL-20: a stopped in the same pass lets the volume go before b takes it."""
    sec, _ = _sec(tmp_path)
    converge(sec, spec(vm("a", nics=nic(1), volumes=(("data", False),)), volumes=(DATA,)))
    a = vm("a", nics=nic(1), volumes=(("data", False),), desired=Desired.STOPPED)
    b = vm("b", nics=nic(2), volumes=(("data", False),))
    out = converge(sec, spec(b, a, volumes=(DATA,), generation=2))
    assert out.state is SectionState.CONVERGED, out.message
    assert {k: v[0] for k, v in _states(sec).items()} == {"a": "STOPPED", "b": "RUNNING"}


def test_unlisted_volume_kept_while_open_then_destroyed_dlv_vol_23_25_26(tmp_path: Path) -> None:
    """DLV-VOL-23, DLV-VOL-25, DLV-VOL-26, DLV-VOL-27: the section stops listing a volume a running VM
    has open: the instance reports it but is not stopped, and the volume stays; once the instance is
    deleted (in that same pass) the volume's file is destroyed."""
    sec, system = _sec(tmp_path)
    a = vm("a", nics=nic(1), volumes=(("data", False),))
    converge(sec, spec(a, volumes=(DATA,)))
    raw = system.host_path(f"{DATA_DIR}/volumes/data.raw")
    converge(sec, spec(a, generation=2))
    st = _states(sec)
    assert st["a"][0] == "ERROR" and "not a volume of this host's section" in st["a"][1]
    dom = next(d for v in sec.list_runtimes().values() for d in v.domains)
    assert dom.state == "running" and raw.exists()
    out = converge(sec, spec(generation=3))
    assert out.state is SectionState.CONVERGED, out.message
    assert not raw.exists() and not raw.with_suffix(".json").exists()


def test_volume_storage_reported_and_volumes_advertised_dlv_vol_31_43(tmp_path: Path) -> None:
    """DLV-VOL-31, DLV-VOL-35, DLV-VOL-43, DLV-CAP-04: every report of a host with the store carries
    volume_storage, sizes summed; `instance.volumes` is advertised only with a store."""
    sec, _ = _sec(tmp_path)
    converge(sec, spec(volumes=(DATA, VolumeSpec("two", "two", 2 * GIB))))
    vs = sec.last_report.volume_storage
    assert vs is not None and vs.committed_bytes == 3 * GIB and vs.outstanding_bytes == 3 * GIB
    wire_report = status_report(NodeStatus(1, 1, 1, "h", (), (), 1, 0.0, instances=sec.last_report), 0.0)
    assert wire_report.volume_storage is not None and wire_report.volume_storage.committed_bytes == 3 * GIB
    assert "instance.volumes" in capabilities(["libvirt-kvm"], volumes=True)
    assert "instance.volumes" not in capabilities(["libvirt-kvm"])


def test_without_a_store_an_instance_with_volumes_fails(tmp_path: Path) -> None:
    sec, _rt = section(sim_host(tmp_path))
    converge(sec, spec(vm("a", nics=nic(1), volumes=(("data", False),)), volumes=(DATA,)))
    assert _states(sec)["a"] == ("ERROR", "volumes: this host keeps no volume store")


def test_a_listed_volume_outlives_its_instances_dlv_vol_01(tmp_path: Path) -> None:
    """DLV-VOL-01: the host keeps a listed volume when the instance that attached it is deleted, and the
    next instance attaching it gets the same file, its data kept."""
    sec, system = _sec(tmp_path)
    converge(sec, spec(vm("a", nics=nic(1), volumes=(("data", False),)), volumes=(DATA,)))
    raw = system.host_path(f"{DATA_DIR}/volumes/data.raw")
    with open(raw, "r+b") as f:
        f.write(b"kept")
    out = converge(sec, spec(volumes=(DATA,), generation=2))
    assert out.state is SectionState.CONVERGED and not sec.list_runtimes()["libvirt-kvm"].domains
    out = converge(sec, spec(vm("b", nics=nic(2), volumes=(("data", False),)), volumes=(DATA,), generation=3))
    assert out.state is SectionState.CONVERGED, out.message
    assert raw.read_bytes()[:4] == b"kept"
    assert next(d for v in sec.list_runtimes().values() for d in v.domains).volumes == (
        ("data", False, "vdb"),
    )


def test_nothing_destroyed_while_a_runtime_cannot_be_listed_dlv_vol_26(tmp_path: Path) -> None:
    """DLV-VOL-26: when the runtime's listing fails, a domain may hold any volume open: an unlisted
    volume is kept until a pass sees every domain."""
    sec, system = _sec(tmp_path)
    converge(sec, spec(vm("a", nics=nic(1), volumes=(("data", False),)), volumes=(DATA,)))
    raw = system.host_path(f"{DATA_DIR}/volumes/data.raw")
    rt = sec.runtimes["libvirt-kvm"]
    real_list = rt.list

    def broken() -> tuple[object, ...]:
        from bcd_shared.errors import RetryableError

        raise RetryableError("ListFailed", "virsh list: error: failed to connect to the hypervisor")

    rt.list = broken  # type: ignore[method-assign]
    converge(sec, spec(generation=2))
    assert raw.exists()
    rt.list = real_list  # type: ignore[method-assign]
    converge(sec, spec(generation=3))
    assert not raw.exists()
