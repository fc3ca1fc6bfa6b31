"""Names every party of an instance computes identically: the node, the helper and the simulated host.

- An instance id names the libvirt domain, its directory and (hashed) its taps. It must match
  INSTANCE_ID_RE: 1 to 64 of `[A-Za-z0-9_.-]`, starting with a letter or digit, so it is a safe file
  name and domain name and never `.`/`..` (docs/instances.md).
- `tap_name(instance_id, index)`: the seeds' `runtime.TapName`. Interface names have at most 15
  characters and instance ids up to 64, so the tap is `bc` + the first 11 hex digits of the id's
  SHA-256 + the NIC index in hex (at most MAX_NICS NICs): 14 characters, always starting `bc`, so the
  nftables rules (`bc*`) match every instance tap and can be written before the tap exists.
  44 bits of hash cannot name 64-character ids injectively (no 15-character name can), and ids do
  collide (`vm-1762438` and `vm-3742940` share `bcb87a92661950`): `tap_stem` is what two instances
  share when their taps collide, and root and the planner refuse a second live instance of a stem
  (`tap_collision`; docs/instances.md, "Tap names").
- `domain_uuid(instance_id)`: the domain's UUID, derived from the id (see its docstring).
- Files: `data_dir/libvirt/instances/<id>/` (disk.qcow2, seed.iso, domain.xml) and
  `data_dir/libvirt/images/<sha256>.<format>` (DLV-RT-02, DLV-LIBVIRT-02/05).
"""

from __future__ import annotations

import hashlib
import re

INSTANCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
BRIDGE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
IMAGE_FORMATS = ("qcow2", "raw", "iso")
MAX_NICS = 16
METADATA_NS = "https://better-compute.dev/libvirt/1"


def valid_instance_id(value: str) -> bool:
    return bool(INSTANCE_ID_RE.fullmatch(value)) and ".." not in value


def tap_stem(instance_id: str) -> str:
    """Every tap of `instance_id` but the NIC index: `bc` and 11 hex digits of the id's SHA-256."""
    return "bc" + hashlib.sha256(instance_id.encode()).hexdigest()[:11]


def tap_name(instance_id: str, index: int) -> str:
    """The tap of NIC `index` of `instance_id` (the seeds' runtime.TapName)."""
    if not 0 <= index < MAX_NICS:
        raise ValueError(f"NIC index {index} out of range (at most {MAX_NICS} NICs)")
    return f"{tap_stem(instance_id)}{index:x}"


def tap_collision(instance_id: str, other: str) -> str:
    """The refusal of `instance_id` beside live instance `other`, whose taps have its names."""
    return (
        f"instance {instance_id}'s taps ({tap_stem(instance_id)}<NIC>) are instance {other}'s too: tap names "
        "hash the instance id into 15 characters (IFNAMSIZ), and no two live instances may share one "
        "(rename one of them)"
    )


def domain_uuid(instance_id: str) -> str:
    """The libvirt UUID of bcd's domain for `instance_id` (UUIDv5 in bcd's namespace). libvirt refuses
    to define a domain whose name exists under another UUID, so a definition carrying this UUID can
    never be defined over a domain bcd did not create, with no check-then-act race."""
    import uuid

    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{METADATA_NS}/{instance_id}"))


def libvirt_dir(data_dir: str) -> str:
    return f"{data_dir.rstrip('/')}/libvirt"


def instance_dir(data_dir: str, instance_id: str) -> str:
    return f"{libvirt_dir(data_dir)}/instances/{instance_id}"


def images_dir(data_dir: str) -> str:
    return f"{libvirt_dir(data_dir)}/images"


def image_path(data_dir: str, sha256: str, fmt: str) -> str:
    return f"{images_dir(data_dir)}/{sha256}.{fmt}"


def volumes_dir(data_dir: str) -> str:
    return f"{data_dir.rstrip('/')}/volumes"
