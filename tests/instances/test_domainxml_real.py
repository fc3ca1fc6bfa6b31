"""Every domain XML bcd writes, against the real schema and the real libvirt: `virt-xml-validate`
(libvirt's RelaxNG schema) and `virsh define --validate` on the test driver (`test:///default`); and
the same XML accepted by root's default-deny check. The variants cover every branch of the builder."""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from bcd_agent.sections.instances.model import Image, InstanceSpec, Nic, Placement
from bcd_agent.sections.instances.runtimes.domainxml import DomainFiles, build_domain_xml, metadata_of
from bcd_shared.domaincheck import DomainPolicy, check_domain
from bcd_shared.instancenames import METADATA_NS, tap_name
from testsupport import require_tool

GIB = 1 << 30
MIB = 1 << 20
SHA = "ab" * 32
D = "/var/lib/bcd/libvirt"
IMG = Image("https://images.example/x.qcow2", SHA, "qcow2")
NICS = (Nic("br0", "52:54:00:00:00:01", ("10.0.0.5/24", "2001:db8::5/64")), Nic("br1", "52:54:00:00:00:02"))
GPUS = ("0000:53:00.0", "0000:9a:00.1")


def files(
    i: str, *, fmt: str = "qcow2", seed: bool = True, iso: bool = False, kernel: bool = False
) -> DomainFiles:
    base = f"{D}/images/{SHA}.{fmt}"
    return DomainFiles(
        disk=f"{D}/instances/{i}/disk.qcow2",
        base=None if iso else base,
        base_format=None if iso else fmt,
        seed=f"{D}/instances/{i}/seed.iso" if seed else None,
        install_iso=base if iso else None,
        kernel=f"{D}/instances/{i}/vmlinuz" if kernel else None,
        initrd=f"{D}/instances/{i}/initrd.img" if kernel else None,
        cmdline="console=ttyS0" if kernel else None,
    )


def inst(i: str, **kw: object) -> InstanceSpec:
    args: dict[str, object] = {
        "allocation_id": f"alloc_{i}",
        "vcpus": 4,
        "memory_bytes": 4 * GIB,
        "image": IMG,
    }
    args.update(kw)
    return InstanceSpec(id=i, **args)  # type: ignore[arg-type]


VARIANTS: dict[str, tuple[InstanceSpec, DomainFiles, tuple[str, ...], dict[str, str]]] = {
    "plain": (inst("plain", nics=NICS), files("plain"), (), {}),
    "raw-base": (
        inst("raw-base", image=Image(IMG.url, SHA, "raw")),
        files("raw-base", fmt="raw", seed=False),
        (),
        {},
    ),
    "iso-install": (
        inst("iso-install", image=Image(IMG.url, SHA, "iso")),
        files("iso-install", fmt="iso", iso=True),
        (),
        {},
    ),
    "pinned": (inst("pinned", placement=Placement(cpus="8-11", mems="0")), files("pinned"), (), {}),
    "floating": (inst("floating", placement=Placement(cpus="0-15")), files("floating"), (), {}),
    "huge-2m": (
        inst("huge-2m", placement=Placement(mems="0-1", hugepage_size_bytes=2 * MIB)),
        files("huge-2m"),
        (),
        {},
    ),
    "huge-1g": (inst("huge-1g", placement=Placement(hugepage_size_bytes=GIB)), files("huge-1g"), (), {}),
    "balloon": (inst("balloon", placement=Placement(balloon=True)), files("balloon"), (), {}),
    "gpus": (inst("gpus", gpu_uuids=("GPU-a", "GPU-b"), nics=NICS[:1]), files("gpus"), GPUS, {}),
    "tcg-kernel": (
        inst("tcg-kernel"),
        files("tcg-kernel", kernel=True),
        (),
        {"domain_type": "qemu", "cpu_mode": "maximum"},
    ),
}


def _xml(name: str) -> bytes:
    spec, f, gpus, kw = VARIANTS[name]
    return build_domain_xml(spec, f, gpus, **kw)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_passes_the_schema_libvirt_and_roots_check(name: str, tmp_path: Path) -> None:
    """DLV-HLP-04: what bcd builds is inside root's default-deny allowlist; and real libvirt takes it."""
    validate = require_tool("virt-xml-validate")
    virsh = require_tool("virsh")
    xml = _xml(name)
    checked = check_domain(xml, DomainPolicy(name, "/var/lib/bcd", ("br0", "br1"), GPUS))
    assert checked.name == name
    path = tmp_path / f"{name}.xml"
    path.write_bytes(xml)
    out = subprocess.run([validate, str(path), "domain"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [virsh, "-c", "test:///default", "define", "--validate", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def _root(name: str) -> ET.Element:
    return ET.fromstring(_xml(name))


def test_cpu_placement_floats_or_pins_dlv_plc_07() -> None:
    """DLV-PLC-07 (Q-DLV-PLC-01: pinned when cpus has exactly one CPU per vCPU)."""
    floating = _root("floating")
    assert floating.find("vcpu").get("cpuset") == "0-15" and floating.find("cputune") is None  # type: ignore[union-attr]
    pinned = _root("pinned")
    assert pinned.find("vcpu").get("cpuset") is None  # type: ignore[union-attr]
    pins = [(p.get("vcpu"), p.get("cpuset")) for p in pinned.findall("cputune/vcpupin")]
    assert pins == [("0", "8"), ("1", "9"), ("2", "10"), ("3", "11")]


def test_numatune_strict_dlv_plc_08() -> None:
    """DLV-PLC-08."""
    mem = _root("pinned").find("numatune/memory")
    assert mem is not None and (mem.get("mode"), mem.get("nodeset")) == ("strict", "0")
    assert _root("plain").find("numatune") is None


def test_huge_pages_locked_dlv_plc_09() -> None:
    """DLV-PLC-09."""
    for name, size in (("huge-2m", "2048"), ("huge-1g", "1048576")):
        mb = _root(name).find("memoryBacking")
        assert mb is not None and mb.find("locked") is not None
        page = mb.find("hugepages/page")
        assert page is not None and (page.get("size"), page.get("unit")) == (size, "KiB")
    # The host's NUMA nodes come from numatune; a page's nodeset would name guest nodes.
    assert _root("huge-2m").find("memoryBacking/hugepages/page").get("nodeset") is None  # type: ignore[union-attr]
    assert _root("huge-2m").find("numatune/memory").get("nodeset") == "0-1"  # type: ignore[union-attr]
    assert _root("plain").find("memoryBacking") is None


def test_memballoon_explicit_none_unless_asked_dlv_plc_10() -> None:
    """DLV-PLC-10."""
    for name in VARIANTS:
        models = [b.get("model") for b in _root(name).findall("devices/memballoon")]
        assert models == (["virtio"] if name == "balloon" else ["none"]), name


def test_nics_and_taps_dlv_libvirt_12() -> None:
    """DLV-LIBVIRT-12: virtio NICs on the named bridges, taps runtime.TapName(id, i)."""
    nics = _root("plain").findall("devices/interface")
    got = [
        (
            n.get("type"),
            n.find("source").get("bridge"),
            n.find("mac").get("address"),
            n.find("target").get("dev"),
            n.find("model").get("type"),
        )  # type: ignore[union-attr]
        for n in nics
    ]
    assert got == [
        ("bridge", "br0", "52:54:00:00:00:01", tap_name("plain", 0), "virtio"),
        ("bridge", "br1", "52:54:00:00:00:02", tap_name("plain", 1), "virtio"),
    ]
    assert all(t.startswith("bc") and len(t) <= 15 for _, _, _, t, _ in got)


def test_gpus_are_managed_vfio_hostdevs_dlv_libvirt_13() -> None:
    """DLV-LIBVIRT-13."""
    devs = _root("gpus").findall("devices/hostdev")
    assert [(d.get("mode"), d.get("type"), d.get("managed")) for d in devs] == [
        ("subsystem", "pci", "yes")
    ] * 2
    a = devs[1].find("source/address")
    assert a is not None and dict(a.attrib) == {
        "domain": "0x0000",
        "bus": "0x9a",
        "slot": "0x00",
        "function": "0x1",
    }


def test_seed_cdrom_read_only_and_overlay_backing_chain_dlv_libvirt_11() -> None:
    """DLV-LIBVIRT-11, DLV-LIBVIRT-06: the seed a read-only raw cdrom; an iso boots from a cdrom onto a
    blank disk; the overlay's backingStore is explicit and ends empty."""
    disks = _root("plain").findall("devices/disk")
    cd = [d for d in disks if d.get("device") == "cdrom"]
    assert len(cd) == 1 and cd[0].find("readonly") is not None and cd[0].find("driver").get("type") == "raw"  # type: ignore[union-attr]
    bs = disks[0].find("backingStore")
    assert bs is not None and bs.find("backingStore") is not None and len(bs.find("backingStore")) == 0  # type: ignore[arg-type]
    iso = _root("iso-install")
    assert [b.get("dev") for b in iso.findall("os/boot")] == ["hd", "cdrom"]
    assert iso.find("devices/disk/backingStore") is None
    assert len([d for d in iso.findall("devices/disk") if d.get("device") == "cdrom"]) == 2


def test_cpu_host_passthrough_dlv_libvirt_15() -> None:
    """DLV-LIBVIRT-15."""
    assert _root("plain").find("cpu").get("mode") == "host-passthrough"  # type: ignore[union-attr]
    assert _root("plain").get("type") == "kvm"


def test_metadata_namespace_dlv_libvirt_16() -> None:
    """DLV-LIBVIRT-16: allocation, image digest, addresses and the base format in bcd's namespace."""
    xml = _xml("plain")
    assert f'xmlns:bcd="{METADATA_NS}"'.encode() in xml
    meta = metadata_of(xml)
    assert meta is not None and len(meta.pop("definition")) == 64
    assert meta == {
        "runtime": "libvirt-kvm",
        "allocation": "alloc_plain",
        "image": SHA,
        "image-format": "qcow2",
        "base-format": "qcow2",
        "addresses": "10.0.0.5/24 2001:db8::5/64",
    }
    assert metadata_of(b"<domain><name>x</name></domain>") is None
