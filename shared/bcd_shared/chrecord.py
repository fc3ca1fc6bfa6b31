"""`instances/<id>/vm.json`: bcd's record of a cloud-hypervisor instance (DLV-CH-26; the seeds'
runtime.CHRecord). The node writes it; root reads it itself in `ch.launch`/`ch.vfio` and trusts
nothing in it it has not checked: this module only decodes it strictly (unknown or missing fields,
wrong types, trailing data, out-of-range values refused, naming the field and the rule).

Bounds (Q-DLV-CHH-01, docs/instances.md): 1 to MAX_VCPUS vCPUs, MIN_MEMORY to MAX_MEMORY bytes in
whole MiB, at most MAX_NICS NICs, MAX_GPUS GPUs and MAX_VOLUMES volumes, a file of at most MAX_BYTES.
"""

from __future__ import annotations

import json
import re
from typing import Any

from attrs import frozen

from bcd_shared.chunit import valid_vmm_uid
from bcd_shared.instancenames import BRIDGE_RE, MAC_RE, MAX_NICS, SHA256_RE, valid_instance_id
from bcd_shared.strictjson import unique_keys, value_bound

VERSION = 1
MAX_BYTES = 1 << 20
MAX_VALUES = 16384
MAX_VCPUS = 512
MIN_MEMORY = 64 << 20
MAX_MEMORY = 4 << 40
MAX_GPUS = 16
MAX_VOLUMES = 16
PCI_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
CPULIST_RE = re.compile(r"^$|^[0-9]{1,4}(-[0-9]{1,4})?(,[0-9]{1,4}(-[0-9]{1,4})?){0,255}$")
VOLUME_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
CH_IMAGE_FORMATS = ("qcow2", "raw")  # an iso is refused (DLV-CH-08)


class RecordError(ValueError):
    pass


@frozen
class CHNic:
    mac: str
    bridge: str


@frozen
class CHVolume:
    name: str  # a file of the volume store, data_dir/volumes/<name>
    read_only: bool
    serial: str


@frozen
class CHRecord:
    name: str
    allocation_id: str
    uid: int
    vcpus: int
    memory_bytes: int
    image_sha256: str | None
    image_format: str | None
    seed: bool
    nics: tuple[CHNic, ...]
    gpus: tuple[str, ...]
    volumes: tuple[CHVolume, ...]
    hugepages: bool
    cpus: str
    mems: str
    restored: bool
    config: dict[str, Any]
    definition: str = ""  # the digest of what the configuration was built from (as libvirt-kvm's)


_FIELDS = {
    "v": int,
    "name": str,
    "allocation_id": str,
    "uid": int,
    "vcpus": int,
    "memory_bytes": int,
    "image": (dict, type(None)),
    "seed": bool,
    "nics": list,
    "gpus": list,
    "volumes": list,
    "hugepages": bool,
    "cpus": str,
    "mems": str,
    "restored": bool,
    "config": dict,
    "definition": str,
}


def _typed(doc: dict[str, Any], where: str, fields: dict[str, Any]) -> None:
    for key in doc:
        if key not in fields:
            raise RecordError(f"{where}.{key}: unknown field")
    for key, kind in fields.items():
        if key not in doc:
            raise RecordError(f"{where}.{key}: required field missing")
        value = doc[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if type(value) not in kinds:  # exact: a bool is not an int
            raise RecordError(f"{where}.{key}: expected {' or '.join(k.__name__ for k in kinds)}")


def _obj(value: Any, where: str, fields: dict[str, Any]) -> dict[str, Any]:
    if type(value) is not dict:
        raise RecordError(f"{where}: expected an object")
    _typed(value, where, fields)
    return value


_no_duplicates = unique_keys(lambda k: RecordError(f"duplicate key {k!r}"))


def parse_record(data: bytes) -> CHRecord:
    if len(data) > MAX_BYTES:
        raise RecordError(f"vm.json: larger than {MAX_BYTES} bytes")
    # Bounded before decoding, as the helper's frames are: 1 MiB of `{},` decodes to ~55 MiB in root
    # (round 6). A record has ~100 values.
    if value_bound(data) > MAX_VALUES:
        raise RecordError(f"vm.json: more than {MAX_VALUES} JSON values")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecordError(f"vm.json: not JSON: {exc}") from None
    except RecursionError:  # the node's file: json's decoder stops at the interpreter's recursion limit
        raise RecordError("vm.json: nested too deeply") from None
    doc = _obj(doc, "vm.json", _FIELDS)
    if doc["v"] != VERSION:
        raise RecordError(f"vm.json.v: must be {VERSION}")
    if not valid_instance_id(doc["name"]):
        raise RecordError("vm.json.name: not an instance id")
    if len(doc["allocation_id"]) > 128:
        raise RecordError("vm.json.allocation_id: at most 128 characters")
    if not valid_vmm_uid(doc["uid"]):
        raise RecordError("vm.json.uid: outside bcd's VMM uid range")
    if not 1 <= doc["vcpus"] <= MAX_VCPUS:
        raise RecordError(f"vm.json.vcpus: must be 1 to {MAX_VCPUS}")
    mem = doc["memory_bytes"]
    if not MIN_MEMORY <= mem <= MAX_MEMORY or mem % (1 << 20):
        raise RecordError("vm.json.memory_bytes: must be 64 MiB to 4 TiB in whole MiB")
    sha = fmt = None
    if doc["image"] is not None:
        image = _obj(doc["image"], "vm.json.image", {"sha256": str, "format": str})
        sha, fmt = image["sha256"], image["format"]
        if not SHA256_RE.fullmatch(sha):
            raise RecordError("vm.json.image.sha256: must be 64 lowercase hex digits")
        if fmt not in CH_IMAGE_FORMATS:
            raise RecordError(
                "vm.json.image.format: must be qcow2 or raw (cloud-hypervisor boots disk images)"
            )
    nics = []
    if len(doc["nics"]) > MAX_NICS:
        raise RecordError(f"vm.json.nics: at most {MAX_NICS}")
    for i, n in enumerate(doc["nics"]):
        n = _obj(n, f"vm.json.nics[{i}]", {"mac": str, "bridge": str})
        if not MAC_RE.fullmatch(n["mac"]) or not BRIDGE_RE.fullmatch(n["bridge"]):
            raise RecordError(f"vm.json.nics[{i}]: a lowercase MAC and an interface name")
        nics.append(CHNic(n["mac"], n["bridge"]))
    if len(doc["gpus"]) > MAX_GPUS:
        raise RecordError(f"vm.json.gpus: at most {MAX_GPUS}")
    for i, g in enumerate(doc["gpus"]):
        if type(g) is not str or not PCI_RE.fullmatch(g):
            raise RecordError(f"vm.json.gpus[{i}]: a PCI address 0000:00:00.0")
    if len(set(doc["gpus"])) != len(doc["gpus"]):
        raise RecordError("vm.json.gpus: a GPU twice")
    vols = []
    if len(doc["volumes"]) > MAX_VOLUMES:
        raise RecordError(f"vm.json.volumes: at most {MAX_VOLUMES}")
    for i, v in enumerate(doc["volumes"]):
        v = _obj(v, f"vm.json.volumes[{i}]", {"name": str, "read_only": bool, "serial": str})
        if not VOLUME_NAME_RE.fullmatch(v["name"]) or ".." in v["name"]:
            raise RecordError(f"vm.json.volumes[{i}].name: a file name of the volume store")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,20}", v["serial"]):
            raise RecordError(f"vm.json.volumes[{i}].serial: 1 to 20 of [A-Za-z0-9_.-]")
        vols.append(CHVolume(v["name"], v["read_only"], v["serial"]))
    if len({v.name for v in vols}) != len(vols):
        raise RecordError("vm.json.volumes: a volume twice")
    for key in ("cpus", "mems"):
        if not CPULIST_RE.fullmatch(doc[key]):
            raise RecordError(f"vm.json.{key}: a cpulist")
    if len(doc["definition"]) > 64:
        raise RecordError("vm.json.definition: at most 64 characters")
    if doc["hugepages"] and doc["config"].get("balloon") is not None:
        raise RecordError("vm.json: a balloon with huge pages")
    return CHRecord(
        name=doc["name"],
        allocation_id=doc["allocation_id"],
        uid=doc["uid"],
        vcpus=doc["vcpus"],
        memory_bytes=mem,
        image_sha256=sha,
        image_format=fmt,
        seed=doc["seed"],
        nics=tuple(nics),
        gpus=tuple(doc["gpus"]),
        volumes=tuple(vols),
        hugepages=doc["hugepages"],
        cpus=doc["cpus"],
        mems=doc["mems"],
        restored=doc["restored"],
        config=doc["config"],
        definition=doc["definition"],
    )


def encode_record(rec: CHRecord) -> bytes:
    """The node's side: vm.json as parse_record reads it."""
    doc = {
        "v": VERSION,
        "name": rec.name,
        "allocation_id": rec.allocation_id,
        "uid": rec.uid,
        "vcpus": rec.vcpus,
        "memory_bytes": rec.memory_bytes,
        "image": None
        if rec.image_sha256 is None
        else {"sha256": rec.image_sha256, "format": rec.image_format},
        "seed": rec.seed,
        "nics": [{"mac": n.mac, "bridge": n.bridge} for n in rec.nics],
        "gpus": list(rec.gpus),
        "volumes": [{"name": v.name, "read_only": v.read_only, "serial": v.serial} for v in rec.volumes],
        "hugepages": rec.hugepages,
        "cpus": rec.cpus,
        "mems": rec.mems,
        "restored": rec.restored,
        "config": rec.config,
        "definition": rec.definition,
    }
    return json.dumps(doc, sort_keys=True, indent=1).encode() + b"\n"
