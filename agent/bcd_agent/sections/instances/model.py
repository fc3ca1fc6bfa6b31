"""The instances section's domain types, built once at the edge (`spec_from_wire`), and their checks.

An instance the spec describes badly fails alone (DLV-INST-12): `check_instance` returns the message
of the first rule it breaks, and the planner turns it into that instance's ERROR; the section is then
FAILED with InstanceFailed (DLV-INST-13). Rules, in order: the id (bcd_shared.instancenames), the
desired state, the size (vCPUs and memory above 0), the image (https only, a lowercase SHA-256, a
known format; or `restore_from`: an https URL and a lowercase SHA-256, and no image), the NICs (at
most 16, a bridge name not starting with `bc`, a lowercase MAC), the placement
(bcd_agent.sections.instances.placement).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from attrs import field, frozen
from bcd_shared.instancenames import (
    BRIDGE_RE,
    IMAGE_FORMATS,
    MAC_RE,
    MAX_NICS,
    SHA256_RE,
    valid_instance_id,
)

from bcd_agent.sections.instances.volumes import VolumeSpec

if TYPE_CHECKING:
    from bcd_shared import wire

RUNTIME_LIBVIRT = "libvirt-kvm"
RUNTIME_CH = "cloud-hypervisor"
HUGE_2M = 2 * 1024 * 1024
HUGE_1G = 1024 * 1024 * 1024


class Desired(enum.Enum):
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    STOPPED = "STOPPED"
    DELETED = "DELETED"
    UNSPECIFIED = "UNSPECIFIED"


@frozen
class Image:
    url: str
    sha256: str
    format: str


@frozen
class Nic:
    bridge: str
    mac: str
    addresses: tuple[str, ...] = ()


@frozen
class Placement:
    cpus: str = ""
    mems: str = ""
    hugepage_size_bytes: int = 0
    balloon: bool = False


@frozen
class InstanceSpec:
    id: str
    allocation_id: str = ""
    runtime: str = RUNTIME_LIBVIRT
    desired: Desired = Desired.RUNNING
    vcpus: int = 1
    memory_bytes: int = 512 * 1024 * 1024
    disk_bytes: int = 0
    image: Image | None = None
    nics: tuple[Nic, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    placement: Placement | None = None
    volumes: tuple[tuple[str, bool], ...] = ()
    network_policy: str = "EGRESS"
    ssh_from_host_only: bool = False
    restore_from: str = ""  # SnapshotRef.url
    restore_sha256: str = ""  # SnapshotRef.sha256
    identity_rebind_ref: str = ""
    user_data_ref: str = ""

    @property
    def hugepages(self) -> int:
        """The huge page size in bytes this instance's memory is in; 0 for normal pages."""
        return self.placement.hugepage_size_bytes if self.placement is not None else 0


@frozen
class InstancesSpec:
    generation: int
    instances: tuple[InstanceSpec, ...] = field(factory=tuple)
    volumes: tuple[VolumeSpec, ...] = field(factory=tuple)  # InstancesSection.volumes (DLV-VOL-01)


def definition_digest(inst: InstanceSpec, gpu_addresses: tuple[str, ...]) -> str:
    """What the domain's definition is built from (size, NICs, GPUs, placement, image, allocation), as
    a SHA-256 kept in bcd's metadata: a different digest is a spec change the domain must be defined
    again for (docs/instances.md). User data is not in it: it is fetched once, at the first define."""
    import hashlib
    import json

    pl = inst.placement
    doc = [
        inst.allocation_id,
        inst.vcpus,
        inst.memory_bytes,
        [[n.bridge, n.mac, list(n.addresses)] for n in inst.nics],
        list(gpu_addresses),
        [pl.cpus, pl.mems, pl.hugepage_size_bytes, pl.balloon] if pl is not None else None,
        [inst.image.sha256, inst.image.format] if inst.image is not None else None,
    ]
    if inst.volumes:  # only then: the digests of domains without volumes stay what part 1 recorded
        doc.append([[v, ro] for v, ro in inst.volumes])
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def check_instance(inst: InstanceSpec) -> str | None:
    """The first spec rule `inst` breaks (the instance's ERROR message), or None (pure)."""
    if not valid_instance_id(inst.id):
        return f"instance id {inst.id[:80]!r} must be 1 to 64 of [A-Za-z0-9_.-], starting alphanumeric"
    if inst.desired is Desired.UNSPECIFIED:
        return "desired_state is unset"
    if inst.vcpus < 1 or inst.memory_bytes < 1:
        return f"size: {inst.vcpus} vCPUs and {inst.memory_bytes} bytes of memory: both must be above 0"
    if inst.restore_from or inst.restore_sha256:
        # DLV-SNAP-03/04: https only (a snapshot may hold a tenant's memory), the digest mandatory.
        if inst.image is not None:
            return "image: set beside restore_from (a restore boots its snapshot, never an image)"
        if not inst.restore_from.startswith("https://") or any(c.isspace() for c in inst.restore_from):
            return (
                f"restore_from.url: {inst.restore_from[:200]!r} is not an https URL "
                "(snapshots are downloaded over https only)"
            )
        if not inst.restore_sha256:
            return "restore_from.sha256: missing (a snapshot is verified against its digest before use)"
        if not SHA256_RE.fullmatch(inst.restore_sha256):
            return "restore_from.sha256: must be 64 lowercase hex digits"
    elif inst.image is None:
        return "image: unset (an instance boots an image or restores a snapshot)"
    if inst.image is not None:
        if not inst.image.url.startswith("https://"):
            return (
                f"image: {inst.image.url[:200]!r} is not an https URL (images are downloaded over https only)"
            )
        if not SHA256_RE.fullmatch(inst.image.sha256):
            return "image: sha256 must be 64 lowercase hex digits"
        if inst.image.format not in IMAGE_FORMATS:
            return f"image: format {inst.image.format[:40]!r} is not one of {', '.join(IMAGE_FORMATS)}"
    if len(inst.nics) > MAX_NICS:
        return f"nics: {len(inst.nics)} NICs, at most {MAX_NICS}"
    for i, nic in enumerate(inst.nics):
        if not BRIDGE_RE.fullmatch(nic.bridge):
            return f"nics[{i}]: bridge {nic.bridge[:40]!r} is not an interface name"
        if nic.bridge.startswith("bc"):
            return f"nics[{i}]: bridge {nic.bridge!r} starts with 'bc' (it would match every tap rule)"
        if not MAC_RE.fullmatch(nic.mac):
            return f"nics[{i}]: MAC {nic.mac[:40]!r} is not a lowercase colon-separated MAC address"
    return None


_DESIRED = {1: Desired.RUNNING, 2: Desired.PAUSED, 3: Desired.STOPPED, 4: Desired.DELETED}
_POLICY = {0: "UNSPECIFIED", 1: "EGRESS", 2: "PRIVATE", 3: "NONE"}


def instance_from_wire(msg: wire.InstanceSpec) -> InstanceSpec:
    img = msg.image
    pl = msg.placement
    size = msg.size
    return InstanceSpec(
        id=msg.id,
        allocation_id=msg.allocation_id,
        runtime=msg.runtime,
        desired=_DESIRED.get(int(msg.desired_state), Desired.UNSPECIFIED),
        vcpus=int(size.vcpus) if size is not None else 0,
        memory_bytes=int(size.memory_bytes) if size is not None else 0,
        disk_bytes=int(size.disk_bytes) if size is not None else 0,
        image=Image(img.url, img.sha256, img.format) if img is not None else None,
        nics=tuple(Nic(n.bridge, n.mac, tuple(n.addresses)) for n in msg.nics),
        gpu_uuids=tuple(msg.gpu_uuids),
        placement=(
            Placement(pl.cpus, pl.mems, int(pl.hugepage_size_bytes), bool(pl.balloon))
            if pl is not None and (pl.cpus or pl.mems or pl.hugepage_size_bytes or pl.balloon)
            else None
        ),
        volumes=tuple((v.volume_id, bool(v.read_only)) for v in msg.volumes),
        network_policy=_POLICY.get(int(msg.network_policy), str(int(msg.network_policy))),
        ssh_from_host_only=bool(msg.ssh_from_host_only),
        restore_from=msg.restore_from.url if msg.restore_from is not None else "",
        restore_sha256=msg.restore_from.sha256 if msg.restore_from is not None else "",
        identity_rebind_ref=msg.identity_rebind_ref,
        user_data_ref=msg.user_data_ref,
    )


def spec_from_wire(generation: int, section: wire.InstancesSection | None) -> InstancesSpec:
    if section is None:
        return InstancesSpec(generation=generation)
    return InstancesSpec(
        generation,
        tuple(instance_from_wire(i) for i in section.instances),
        tuple(VolumeSpec(v.id, v.serial, int(v.size_bytes)) for v in section.volumes),
    )
