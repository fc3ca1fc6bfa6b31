"""CDI holds: the spec bcd writes for an allocation, how it is read back, and CDI's naming rules.

Shared by the agent (which builds and reads holds) and the root helper (which checks the content
of a `file.write` of kind `cdi` or `allocation-env` before it writes, and builds the path itself).
Everything here is pure (bytes in, values or errors out) but `hold_spec_files`, the one walk of the
hold files through a System that both the agent's and root's views of the holds use.

Rules (devices-and-holds.md, "The CDI spec"; notes/real-host-testing.md for the parser's rules):
- path `/etc/cdi/bcd-<allocation-id>.json`, kind `bcd.dev/gpu`;
- `cdiVersion` is the least version the content needs (0.6.0 for annotations, 0.7.0 for
  additionalGids or intelRdt, 1.0.0 for netDevices), or the vendor spec's version when later;
- spec annotations `bcd.dev/allocation-id`, `bcd.dev/reservation-id`, `bcd.dev/generation`, plus
  `bcd.dev/cgroup-parent` (sliced) or `bcd.dev/binding: kubernetes`;
- one device per atom, named by the atom id with `/` as `_`, its real id in `bcd.dev/device-id`;
  a device is never bare: without edits of its own it carries `BCD_DEVICE_<name>=<id>`
  (device_marker_env), since CDI's loader refuses a device with empty edits;
- empty fields are omitted (the schema types `env` as an array and refuses `null`);
- kind `vendor/class`, each part starting with a letter and ending with a letter or digit, with
  letters, digits and `-_.` between; a device name starts and ends with a letter or digit, with
  letters, digits and `-_.:` between; annotation keys follow Kubernetes' key rules; unknown fields
  are refused (CDI loaders refuse them).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from attrs import field, frozen

if TYPE_CHECKING:
    from bcd_shared.system import System

KIND = "bcd.dev/gpu"
CDI_DIR = "/etc/cdi"
ENV_DIR = "/run/bcd/allocations"
VENDOR_SPEC_PATH = "/etc/cdi/nvidia.json"
SPEC_PREFIX = "bcd-"
BASE_VERSION = "0.6.0"  # device annotations need it

ANN_ALLOCATION = "bcd.dev/allocation-id"
ANN_RESERVATION = "bcd.dev/reservation-id"
ANN_GENERATION = "bcd.dev/generation"
ANN_CGROUP_PARENT = "bcd.dev/cgroup-parent"
ANN_BINDING = "bcd.dev/binding"
ANN_DEVICE_ID = "bcd.dev/device-id"

# The allocation id keys files, slices and events; it must be safe in a path and a unit name.
ALLOCATION_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,80}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_GENERATION_RE = re.compile(r"[0-9]{1,20}")

_KIND_PART = r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
_KIND_RE = re.compile(rf"^{_KIND_PART}/{_KIND_PART}$")
_DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ANN_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]*[a-z0-9])?$")

# Fields a CDI loader knows (spec 1.0/1.1); anything else is refused.
_SPEC_FIELDS = frozenset({"cdiVersion", "kind", "annotations", "devices", "containerEdits"})
_DEVICE_FIELDS = frozenset({"name", "annotations", "containerEdits"})
_EDIT_FIELDS = frozenset(
    {"env", "deviceNodes", "netDevices", "mounts", "hooks", "intelRdt", "additionalGids"}
)


class CdiError(ValueError):
    """A CDI document is malformed or breaks a rule; the message names the field and the rule."""


@functools.lru_cache(maxsize=64)
def version_key(version: str) -> tuple[int, int, int]:
    # ASCII digits, bounded: `\d` takes any script's digits and int() then parses them (or raises
    # past 4,300 digits); CDI's loaders read ASCII semver only (red team round 8).
    m = re.fullmatch(r"v?([0-9]{1,9})\.([0-9]{1,9})\.([0-9]{1,9})", version)
    if m is None:
        raise CdiError(f"cdiVersion {version!r} is not a version (MAJOR.MINOR.PATCH)")
    return int(m[1]), int(m[2]), int(m[3])


def later_version(a: str, b: str) -> str:
    return a if version_key(a) >= version_key(b) else b


def check_allocation_id(allocation_id: str) -> str:
    if not ALLOCATION_ID_RE.fullmatch(allocation_id):
        raise CdiError(f"allocation id {allocation_id!r} must match {ALLOCATION_ID_RE.pattern}")
    return allocation_id


def cdi_spec_path(allocation_id: str) -> str:
    """`/etc/cdi/bcd-<allocation-id>.json`, for a valid allocation id only."""
    return f"{CDI_DIR}/{SPEC_PREFIX}{check_allocation_id(allocation_id)}.json"


def env_file_path(allocation_id: str) -> str:
    return f"{ENV_DIR}/{check_allocation_id(allocation_id)}.env"


def allocation_of_spec_file(filename: str) -> str | None:
    """The allocation id of a `bcd-<id>.json` file name, or None for any other name."""
    if not (filename.startswith(SPEC_PREFIX) and filename.endswith(".json")):
        return None
    alloc = filename[len(SPEC_PREFIX) : -len(".json")]
    return alloc if ALLOCATION_ID_RE.fullmatch(alloc) else None


def hold_spec_files(system: System) -> Iterator[tuple[str, str, bytes]]:
    """(allocation id, path, bytes) of every `bcd-<id>.json` in CDI_DIR, read now through `system`.

    Other names are skipped, and so is a file that vanished between the listing and the read.
    """
    for name in system.listdir(CDI_DIR):
        alloc = allocation_of_spec_file(name)
        if alloc is None:
            continue
        path = f"{CDI_DIR}/{name}"
        data = system.read_bytes(path)
        if data is not None:
            yield alloc, path, data


def env_files(system: System) -> Iterator[tuple[str, str, bytes]]:
    """(allocation id, path, bytes) of every `<id>.env` in ENV_DIR, read now through `system`, as
    `hold_spec_files` reads CDI_DIR: other names and a file that vanished are skipped."""
    for name in system.listdir(ENV_DIR):
        alloc = name[: -len(".env")] if name.endswith(".env") else ""
        if not ALLOCATION_ID_RE.fullmatch(alloc):
            continue
        path = f"{ENV_DIR}/{name}"
        data = system.read_bytes(path)
        if data is not None:
            yield alloc, path, data


def device_name(atom_id: str) -> str:
    """An atom's CDI device name: its id with every `/` as `_` (CDI names allow no `/`)."""
    return atom_id.replace("/", "_")


def qualified_name(name: str) -> str:
    return f"{KIND}={name}"


def valid_kind(kind: str) -> bool:
    return bool(_KIND_RE.fullmatch(kind))


def valid_device_name(name: str) -> bool:
    return bool(_DEVICE_NAME_RE.fullmatch(name))


# The longest key the rule allows: a prefix of 253, the `/`, a name of 63.
_MAX_ANNOTATION_KEY = 253 + 1 + 63


def valid_annotation_key(key: str) -> bool:
    """Kubernetes' qualified-name rule: optional DNS-subdomain prefix and `/`, then a name of ≤63."""
    if len(key) > _MAX_ANNOTATION_KEY:
        return False  # never remembered: the memo below holds at most 256 keys of at most 317 characters
    return _annotation_key_rule(key)


@functools.lru_cache(maxsize=256)
def _annotation_key_rule(key: str) -> bool:
    """valid_annotation_key's rule, remembered per key: a hold names the same few keys at every write."""
    prefix, slash, name = key.rpartition("/")
    if slash:
        if not prefix or len(prefix) > 253:
            return False
        if not all(_DNS_LABEL_RE.fullmatch(label) for label in prefix.split(".")):
            return False
    return 0 < len(name) <= 63 and bool(_ANN_NAME_RE.fullmatch(name))


def _edit_needs(edits: Mapping[str, Any]) -> str:
    need = "0.3.0"
    if edits.get("additionalGids") or edits.get("intelRdt"):
        need = later_version(need, "0.7.0")
    if edits.get("netDevices"):
        need = later_version(need, "1.0.0")
    return need


def required_version(doc: Mapping[str, Any]) -> str:
    """The least cdiVersion whose loaders accept this document's fields."""
    need = "0.3.0"
    if doc.get("annotations") or any(d.get("annotations") for d in doc.get("devices", ())):
        need = later_version(need, "0.6.0")
    for edits in [doc.get("containerEdits", {})] + [
        d.get("containerEdits", {}) for d in doc.get("devices", ())
    ]:
        need = later_version(need, _edit_needs(edits))
    return need


def _check_edits(where: str, edits: Any, errors: list[str]) -> None:
    if not isinstance(edits, dict):
        errors.append(f"{where}: must be an object")
        return
    for key in edits:
        if key not in _EDIT_FIELDS:
            errors.append(f"{where}.{key}: unknown field")
    env = edits.get("env", [])
    if not isinstance(env, list) or not all(isinstance(e, str) and "=" in e for e in env):
        errors.append(f"{where}.env: must be a list of KEY=VALUE strings")


def _check_annotations(where: str, ann: Any, errors: list[str]) -> None:
    if not isinstance(ann, dict):
        errors.append(f"{where}: must be an object of strings")
        return
    for key, value in ann.items():
        if not valid_annotation_key(key):
            errors.append(f"{where}: key {key!r} breaks the Kubernetes annotation key rules")
        if not isinstance(value, str):
            errors.append(f"{where}.{key}: value must be a string")


def naming_errors(doc: Any) -> list[str]:
    """What the CDI parser (beyond the JSON schema) would refuse in `doc`; [] when it loads."""
    errors: list[str] = []
    if not isinstance(doc, dict):
        return ["spec: must be a JSON object"]
    for key in doc:
        if key not in _SPEC_FIELDS:
            errors.append(f"spec.{key}: unknown field")
    version = doc.get("cdiVersion")
    try:
        have = version_key(version) if isinstance(version, str) else None
    except CdiError as exc:
        errors.append(f"cdiVersion: {exc}")
        have = None
    if have is None and not errors:
        errors.append("cdiVersion: missing")
    kind = doc.get("kind")
    if not isinstance(kind, str) or not valid_kind(kind):
        errors.append(f"kind {kind!r}: must be vendor/class with CDI's character rules")
    if "annotations" in doc:
        _check_annotations("annotations", doc["annotations"], errors)
    if "containerEdits" in doc:
        _check_edits("containerEdits", doc["containerEdits"], errors)
    devices = doc.get("devices")
    if not isinstance(devices, list):
        errors.append("devices: must be a list")
        devices = []
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        where = f"devices[{i}]"
        if not isinstance(dev, dict):
            errors.append(f"{where}: must be an object")
            continue
        for key in dev:
            if key not in _DEVICE_FIELDS:
                errors.append(f"{where}.{key}: unknown field")
        name = dev.get("name")
        if not isinstance(name, str) or not valid_device_name(name):
            errors.append(f"{where}.name {name!r}: breaks CDI's device name rules")
        elif name in seen:
            errors.append(f"{where}.name {name!r}: listed twice")
        else:
            seen.add(name)
        if "annotations" in dev:
            _check_annotations(f"{where}.annotations", dev["annotations"], errors)
        if "containerEdits" not in dev:
            errors.append(f"{where}.containerEdits: required")
        else:
            _check_edits(f"{where}.containerEdits", dev["containerEdits"], errors)
    if have is not None and not errors:
        need = required_version(doc)
        if have < version_key(need):
            errors.append(f"cdiVersion {version}: the content needs at least {need}")
    return errors


# --- NVIDIA's vendor spec ------------------------------------------------------------------------


@frozen
class VendorSpec:
    """What bcd takes from the toolkit's `/etc/cdi/nvidia.json`."""

    cdi_version: str
    common_edits: Mapping[str, Any]  # without NVIDIA_VISIBLE_DEVICES=void
    devices: Mapping[str, Mapping[str, Any]]  # device name -> its containerEdits

    def edits_for(self, names: Sequence[str]) -> Mapping[str, Any] | None:
        """The edits of the first device named by any of `names`; for WSL's lone `all`, those."""
        for name in names:
            if name in self.devices:
                return self.devices[name]
        if set(self.devices) == {"all"}:
            return self.devices["all"]
        return None


def _loads(what: str, data: bytes) -> Any:
    """json.loads, every failure a CdiError: json's decoder stops at the interpreter's recursion limit
    with RecursionError, which no caller expects (the fuzz target `cdi` found `[[[…`)."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CdiError(f"{what} is not JSON: {exc}") from None
    except RecursionError:
        raise CdiError(f"{what} is not JSON: nested past the decoder's depth") from None


def _vendor_edits_of(where: str, edits: Any) -> dict[str, Any]:
    """A vendor containerEdits object as a dict (absent or null: none); its `env` a list of strings."""
    if edits is None:
        return {}
    if not isinstance(edits, dict):
        raise CdiError(f"vendor spec: {where}: must be an object")
    env = edits.get("env")
    if env is not None and not (isinstance(env, list) and all(isinstance(e, str) for e in env)):
        raise CdiError(f"vendor spec: {where}.env: must be a list of strings")
    return dict(edits)


def parse_vendor_spec(data: bytes) -> VendorSpec:
    """Parse a JSON vendor spec. Raises CdiError when it is not a usable CDI document. Devices without a
    string name are skipped (nothing can ask for them); a containerEdits that is not an object is an
    error wherever it is, since the toolkit never writes one and a loader would refuse the file."""
    doc = _loads("vendor spec", data)
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list):
        raise CdiError("vendor spec: not a CDI spec (no devices list)")
    version = doc.get("cdiVersion")
    if not isinstance(version, str):
        raise CdiError("vendor spec: cdiVersion missing")
    version_key(version)
    common = _vendor_edits_of("containerEdits", doc.get("containerEdits"))
    env = [e for e in common.get("env") or [] if e != "NVIDIA_VISIBLE_DEVICES=void"]
    if env:
        common["env"] = env
    else:
        common.pop("env", None)
    devices: dict[str, Mapping[str, Any]] = {}
    for i, dev in enumerate(doc["devices"]):
        if isinstance(dev, dict) and isinstance(dev.get("name"), str):
            devices[dev["name"]] = _vendor_edits_of(f"devices[{i}].containerEdits", dev.get("containerEdits"))
    return VendorSpec(cdi_version=version, common_edits=common, devices=devices)


# --- bcd's hold spec --------------------------------------------------------------------------------


@frozen
class HoldDevice:
    """One atom of a hold and the vendor edits it carries (None: bare)."""

    atom_id: str
    edits: Mapping[str, Any] | None = None


def device_marker_env(atom_id: str) -> str:
    """The one edit of a device that would otherwise have none (every device of a Kubernetes hold, and a
    hold's device the vendor spec gives no edits): `BCD_DEVICE_<name>=<device id>` (docs/devices.md,
    "Devices never bare"). The reference CDI library refuses a device whose containerEdits are empty
    ("invalid device, empty device edits") and with it the whole spec; an env entry is the one edit that
    grants nothing (no device node, mount, hook or group), and a key per device keeps two devices of one
    pod from setting the same variable."""
    key = "BCD_DEVICE_" + re.sub(r"[^A-Za-z0-9_]", "_", device_name(atom_id))
    return f"{key}={atom_id}"


def _strip_device_edits(edits: Mapping[str, Any]) -> dict[str, Any]:
    # Devices carry no env of their own (DEV-CDI-13); empty fields are omitted.
    return {k: v for k, v in edits.items() if k != "env" and v not in (None, [], {})}


def build_hold_spec(
    *,
    allocation_id: str,
    reservation_id: str,
    generation: int,
    kubernetes: bool,
    cgroup_parent: str | None,
    devices: Sequence[HoldDevice],
    env: Sequence[str],
    vendor: VendorSpec | None,
) -> dict[str, Any]:
    """The CDI document of one hold (see the module rules). `env` is the spec-level env, in order."""
    check_allocation_id(allocation_id)
    annotations = {
        ANN_ALLOCATION: allocation_id,
        ANN_RESERVATION: reservation_id,
        ANN_GENERATION: str(generation),
    }
    if cgroup_parent:
        annotations[ANN_CGROUP_PARENT] = cgroup_parent
    if kubernetes:
        annotations[ANN_BINDING] = "kubernetes"
    devs: list[dict[str, Any]] = []
    for d in devices:
        edits = {} if kubernetes or d.edits is None else _strip_device_edits(d.edits)
        if not edits:
            edits = {"env": [device_marker_env(d.atom_id)]}
        devs.append(
            {
                "name": device_name(d.atom_id),
                "annotations": {ANN_DEVICE_ID: d.atom_id},
                "containerEdits": edits,
            }
        )
    common: dict[str, Any] = {}
    if env:
        common["env"] = list(env)
    if vendor is not None and not kubernetes:
        for key, value in vendor.common_edits.items():
            if value in (None, [], {}):
                continue
            if key == "env":
                common["env"] = list(env) + [e for e in value if e not in env]
            else:
                common[key] = value
    doc: dict[str, Any] = {
        "cdiVersion": BASE_VERSION,
        "kind": KIND,
        "annotations": annotations,
        "devices": devs,
    }
    if common:
        doc["containerEdits"] = common
    version = later_version(BASE_VERSION, required_version(doc))
    if vendor is not None and not kubernetes:
        version = later_version(version, vendor.cdi_version)
    doc["cdiVersion"] = version
    return doc


def encode_spec(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


@frozen
class HoldRecord:
    """A hold as read back from its CDI spec alone."""

    allocation_id: str
    reservation_id: str
    generation: int
    kubernetes: bool
    cgroup_parent: str | None
    device_ids: tuple[str, ...]
    env: tuple[str, ...] = field(factory=tuple)


def parse_hold_spec(data: bytes, allocation_id: str | None = None) -> HoldRecord:
    """Read a bcd hold back from its spec. Raises CdiError naming the field and the rule."""
    return parse_hold_doc(_loads("spec", data), allocation_id)


def parse_hold_doc(doc: Any, allocation_id: str | None = None) -> HoldRecord:
    """parse_hold_spec of a spec already decoded (the helper decodes it strictly first)."""
    errors = naming_errors(doc)
    if errors:
        raise CdiError("; ".join(errors))
    if doc["kind"] != KIND:
        raise CdiError(f"kind {doc['kind']!r}: a bcd hold's kind is {KIND}")
    ann = doc.get("annotations") or {}
    alloc = ann.get(ANN_ALLOCATION)
    if not isinstance(alloc, str) or not ALLOCATION_ID_RE.fullmatch(alloc):
        raise CdiError(f"annotations.{ANN_ALLOCATION}: missing or not an allocation id")
    if allocation_id is not None and alloc != allocation_id:
        raise CdiError(
            f"annotations.{ANN_ALLOCATION}: {alloc!r} is not the file's allocation {allocation_id!r}"
        )
    gen_text = ann.get(ANN_GENERATION, "")
    # [0-9]{1,20} (a uint64), not str.isdigit: that takes '²' and '①' (which int() then refuses with
    # ValueError, an internal failure in root) and any script's digits (red team round 8).
    if not (isinstance(gen_text, str) and _GENERATION_RE.fullmatch(gen_text)):
        raise CdiError(f"annotations.{ANN_GENERATION}: must be a decimal generation (1 to 20 digits 0-9)")
    binding = ann.get(ANN_BINDING)
    if binding not in (None, "kubernetes"):
        raise CdiError(f"annotations.{ANN_BINDING}: {binding!r} is not 'kubernetes'")
    ids: list[str] = []
    for i, dev in enumerate(doc["devices"]):
        dev_id = (dev.get("annotations") or {}).get(ANN_DEVICE_ID)
        if not isinstance(dev_id, str) or not dev_id:
            raise CdiError(f"devices[{i}].annotations.{ANN_DEVICE_ID}: missing")
        if device_name(dev_id) != dev["name"]:
            raise CdiError(
                f"devices[{i}].name {dev['name']!r}: is not the device id {dev_id!r} with '/' as '_'"
            )
        ids.append(dev_id)
    parent = ann.get(ANN_CGROUP_PARENT)
    env = (doc.get("containerEdits") or {}).get("env") or []
    return HoldRecord(
        allocation_id=alloc,
        reservation_id=str(ann.get(ANN_RESERVATION, "")),
        generation=int(gen_text),
        kubernetes=binding == "kubernetes",
        cgroup_parent=parent if isinstance(parent, str) and parent else None,
        device_ids=tuple(ids),
        env=tuple(env),
    )


# --- the env file -----------------------------------------------------------------------------------


def check_env_line(line: str) -> str:
    key, eq, value = line.partition("=")
    if not eq or not ENV_KEY_RE.fullmatch(key):
        raise CdiError(f"env line {line!r}: must be KEY=VALUE with KEY of [A-Za-z_][A-Za-z0-9_]*")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise CdiError(f"env line for {key}: the value carries a control character")
    return line


def encode_env_file(lines: Sequence[str]) -> bytes:
    return "".join(check_env_line(line) + "\n" for line in lines).encode()


def visible_device_names(lines: Sequence[str]) -> Iterator[str]:
    """Each name the env lines' `NVIDIA_VISIBLE_DEVICES` values list, in order (an empty value none)."""
    for line in lines:
        key, _, value = line.partition("=")
        if key == "NVIDIA_VISIBLE_DEVICES" and value:
            yield from value.split(",")


def parse_env_file(data: bytes, allocation_id: str | None = None) -> tuple[str, ...]:
    """The lines of an allocation env file; the first must be BCD_ALLOCATION_ID of its allocation."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise CdiError("env file is not UTF-8") from None
    if text and not text.endswith("\n"):
        raise CdiError("env file must end with a newline")
    lines = tuple(text.splitlines())
    for line in lines:
        check_env_line(line)
    if allocation_id is not None and (not lines or lines[0] != f"BCD_ALLOCATION_ID={allocation_id}"):
        raise CdiError(f"env file: the first line must be BCD_ALLOCATION_ID={allocation_id}")
    return lines
