"""The libvirt domain XML of an instance, built with the standard library from the spec (pure).

What it writes (seeds "Runtime libvirt-kvm", "Placement"): bcd's metadata in namespace
`https://better-compute.dev/libvirt/1` (allocation, image digest and format, base format, addresses;
DLV-LIBVIRT-16); `<vcpu cpuset>` for a floating placement or `<cputune><vcpupin>` one CPU per vCPU
(DLV-PLC-07); `<numatune><memory mode='strict'>` (DLV-PLC-08); locked `<memoryBacking>` huge pages
(DLV-PLC-09); an explicit `<memballoon>`, model none unless a balloon is asked (DLV-PLC-10);
`host-passthrough` CPU (DLV-LIBVIRT-15; `maximum` for TCG test guests); the overlay with an explicit
backingStore chain ending empty, so QEMU never follows a name in a header; the NoCloud seed as a
read-only cdrom (DLV-LIBVIRT-11); virtio NICs on the named bridges with taps `tap_name(id, i)`
(DLV-LIBVIRT-12); managed VFIO PCI hostdevs (DLV-LIBVIRT-13); a pty serial console (DLV-LIBVIRT-29).
Everything it writes is inside bcd_shared.domaincheck's allowlist (a test checks every variant).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from bcd_shared.instancenames import METADATA_NS, domain_uuid, tap_name

from bcd_agent.sections.instances.model import InstanceSpec, definition_digest
from bcd_agent.sections.instances.placement import cpu_placement
from bcd_agent.sections.instances.runtimes.base import DomainFiles

ET.register_namespace("bcd", METADATA_NS)
_NS = "{" + METADATA_NS + "}"


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrs)
    if text is not None:
        el.text = text
    return el


def _pci(address: str) -> dict[str, str]:
    """A sysfs PCI address (0000:53:00.0) as libvirt's address attributes."""
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return {"domain": f"0x{domain}", "bus": f"0x{bus}", "slot": f"0x{slot}", "function": f"0x{function}"}


def build_domain_xml(
    inst: InstanceSpec,
    files: DomainFiles,
    gpu_addresses: tuple[str, ...] = (),
    *,
    domain_type: str = "kvm",
    cpu_mode: str = "host-passthrough",
    restored_from: str = "",
) -> bytes:
    dom = ET.Element("domain", {"type": domain_type})
    _sub(dom, "name", inst.id)
    _sub(dom, "uuid", domain_uuid(inst.id))
    meta = _sub(_sub(dom, "metadata"), f"{_NS}instance")
    _sub(meta, f"{_NS}runtime", inst.runtime)
    _sub(meta, f"{_NS}allocation", inst.allocation_id)
    _sub(meta, f"{_NS}definition", definition_digest(inst, gpu_addresses))
    if inst.image is not None:
        _sub(meta, f"{_NS}image", inst.image.sha256)
        _sub(meta, f"{_NS}image-format", inst.image.format)
    if files.base_format:
        _sub(meta, f"{_NS}base-format", files.base_format)
    if restored_from:  # the snapshot's SHA-256 (DLV-LIBVIRT-16)
        _sub(meta, f"{_NS}restored-from", restored_from)
    addresses = " ".join(a for nic in inst.nics for a in nic.addresses)
    if addresses:
        _sub(meta, f"{_NS}addresses", addresses)
    kib = str(inst.memory_bytes // 1024)
    _sub(dom, "memory", kib, unit="KiB")
    _sub(dom, "currentMemory", kib, unit="KiB")
    cpu = cpu_placement(inst)
    vcpu_attrs = {"placement": "static"}
    if cpu is not None and not cpu.pinned:
        vcpu_attrs["cpuset"] = inst.placement.cpus if inst.placement else ""
    _sub(dom, "vcpu", str(inst.vcpus), **vcpu_attrs)
    if cpu is not None and cpu.pinned:
        tune = _sub(dom, "cputune")
        for i, host_cpu in enumerate(cpu.cpus):
            _sub(tune, "vcpupin", vcpu=str(i), cpuset=str(host_cpu))
    pl = inst.placement
    if pl is not None and pl.mems:
        _sub(_sub(dom, "numatune"), "memory", mode="strict", nodeset=pl.mems)
    if inst.hugepages:
        backing = _sub(dom, "memoryBacking")
        pages = _sub(backing, "hugepages")
        # No `nodeset` on the page: it names guest NUMA nodes; the host's come from numatune.
        _sub(pages, "page", size=str(inst.hugepages // 1024), unit="KiB")
        _sub(backing, "locked")
    os_el = _sub(dom, "os")
    _sub(os_el, "type", "hvm", arch="x86_64", machine="pc")
    if files.kernel:
        _sub(os_el, "kernel", files.kernel)
        if files.initrd:
            _sub(os_el, "initrd", files.initrd)
        if files.cmdline:
            _sub(os_el, "cmdline", files.cmdline)
    else:
        _sub(os_el, "boot", dev="hd")
        if files.install_iso:
            _sub(os_el, "boot", dev="cdrom")
    feats = _sub(dom, "features")
    _sub(feats, "acpi")
    _sub(feats, "apic")
    _sub(dom, "cpu", mode=cpu_mode)
    _sub(dom, "clock", offset="utc")
    _sub(dom, "on_poweroff", "destroy")
    _sub(dom, "on_reboot", "restart")
    _sub(dom, "on_crash", "destroy")
    dev = _sub(dom, "devices")
    disk = _sub(dev, "disk", type="file", device="disk")
    _sub(disk, "driver", name="qemu", type="qcow2", discard="unmap")
    _sub(disk, "source", file=files.disk)
    if files.base is not None and files.base_format is not None:
        bs = _sub(disk, "backingStore", type="file")
        _sub(bs, "format", type=files.base_format)
        _sub(bs, "source", file=files.base)
        _sub(bs, "backingStore")
    elif restored_from:  # a restored snapshot's flat disk: libvirt follows no name its header could gain
        _sub(disk, "backingStore")
    _sub(disk, "target", dev="vda", bus="virtio")
    # Volumes: raw virtio disks as vdb onward, with their serial (the guest's
    # /dev/disk/by-id/virtio-<serial>), read-only when asked; the format is stated, never probed.
    for i, (path, vol_serial, ro) in enumerate(files.volumes):
        vd = _sub(dev, "disk", type="file", device="disk")
        _sub(vd, "driver", name="qemu", type="raw")
        _sub(vd, "source", file=path)
        _sub(vd, "target", dev=f"vd{chr(ord('b') + i)}", bus="virtio")
        _sub(vd, "serial", vol_serial)
        if ro:
            _sub(vd, "readonly")
    letter = iter("cdefghijklmnopqrstuvwxyz")
    for iso in (files.install_iso, files.seed):
        if iso is None:
            continue
        cd = _sub(dev, "disk", type="file", device="cdrom")
        _sub(cd, "driver", name="qemu", type="raw")
        _sub(cd, "source", file=iso)
        _sub(cd, "target", dev=f"sd{next(letter)}", bus="sata")
        _sub(cd, "readonly")
    for i, nic in enumerate(inst.nics):
        iface = _sub(dev, "interface", type="bridge")
        _sub(iface, "mac", address=nic.mac)
        _sub(iface, "source", bridge=nic.bridge)
        _sub(iface, "target", dev=tap_name(inst.id, i))
        _sub(iface, "model", type="virtio")
    for address in gpu_addresses:
        hd = _sub(dev, "hostdev", mode="subsystem", type="pci", managed="yes")
        _sub(_sub(hd, "source"), "address", **_pci(address))
    serial = _sub(dev, "serial", type="pty")
    _sub(serial, "target", port="0")
    console = _sub(dev, "console", type="pty")
    _sub(console, "target", type="serial", port="0")
    balloon = pl is not None and pl.balloon and not inst.hugepages
    if balloon:
        mb = _sub(dev, "memballoon", model="virtio", freePageReporting="on")
        # The guest's driver reports its use every 10 s: the balloon controller's floor (DLV-BAL-11).
        _sub(mb, "stats", period="10")
    else:
        _sub(dev, "memballoon", model="none")
    ET.indent(dom)
    return ET.tostring(dom, encoding="unicode").encode() + b"\n"


def metadata_of(xml: bytes) -> dict[str, str] | None:
    """bcd's metadata of a domain's XML (None: not bcd's domain; unmanaged, DLV-INST-05)."""
    try:
        root = ET.fromstring(xml)  # noqa: S314 (libvirt's own dumpxml output, read-only)
    except ET.ParseError:
        return None
    inst = root.find(f"metadata/{_NS}instance")
    if inst is None:
        return None
    return {child.tag[len(_NS) :]: (child.text or "") for child in inst if child.tag.startswith(_NS)}
