"""XID errors from the kernel log: the pure core of the XID watcher (docs/devices.md "XID errors").

NVIDIA's driver reports a GPU error to the kernel log as an "Xid" line. The formats, from the open
kernel modules' `krcReportXid` (NVIDIA/open-gpu-kernel-modules, src/nvidia/src/kernel/gpu/rc/kernel_rc.c):

    NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, <message>
    NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u): %d, pid=%s, name=%s, <message>
    NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u): %d, pid=%s, name=%s, <message>

(pid `'<unknown>'` and name `<unknown>` when no channel is to blame), and older drivers' shorter forms
(`…: 79, pid=1122, GPU has fallen off the bus.`, `…: 32, Channel ID 00000009 intr 00800000`). The same
driver prints, once per GPU, `NVRM: GPU at PCI:0000:01:00: GPU-<uuid>` (`_krcLogUuidOnce`), which maps
the address to the GPU even after the GPU fell off the bus and nvidia-smi no longer lists it.
NVSwitch errors (`nvidia-nvswitchN: SXid (PCI:0000:c3:00.0): 20009, Non-fatal, …`) are not GPU XIDs:
bcd ignores them (their fabric is Fabric Manager's; `FabricManagerDown`).

- `parse_entry(line, boot_id)`: one line of `journalctl -o json` -> `KernelEntry` or None. Only an entry
  the kernel itself logged counts: `_TRANSPORT=kernel` (a trusted field journald sets; a client of
  journald's sockets cannot set it) and `SYSLOG_FACILITY=0` (a line written to /dev/kmsg from user space
  gets facility LOG_USER or the one it names, never 0), of this boot. Bounded: a line over
  MAX_LINE_BYTES is refused unread.
- `parse_message(text)` -> `XidEvent`, `GpuAt` or None: strict to the format above; the free text is
  cut to MAX_DETAIL_CHARS and never interpreted.
- `XidState`: what this boot's log said, per PCI address: each distinct code with its count. Bounded:
  at most MAX_GPUS addresses and MAX_CODES distinct codes per address (further ones only counted), so
  a flood of XID lines grows counts, not memory. `record`, `learn`, `clear` return a new state.
- `xid_conditions(state, uuids)`: one `XidError` condition per GPU with XIDs this boot (reason: the
  GPU's UUID, or `PCI:<address>` while no UUID is known), the codes with NVIDIA's meaning.
- `to_json` / `from_json`: the state file (data_dir/xid.json), strict on read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from attrs import evolve, field, frozen

from bcd_agent.converge.types import Condition

CONDITION_XID = "XidError"
FORMAT = 1
MAX_LINE_BYTES = 16 * 1024
MAX_DETAIL_CHARS = 160
MAX_GPUS = 64
MAX_CODES = 32
MAX_COUNT = 1_000_000_000  # counts saturate here: the state file stays small
MAX_MESSAGE_BYTES = 1024  # a condition's message, as RebootRequired's

# NVIDIA's names for the codes an operator meets most (docs.nvidia.com/deploy/xid-errors, "Xid error
# listing"). Others are shown by number alone.
XID_MEANINGS: Mapping[int, str] = MappingProxyType(
    {
        8: "GPU stopped processing",
        13: "Graphics Engine Exception",
        31: "GPU memory page fault",
        32: "Invalid or corrupted push buffer stream",
        43: "GPU stopped processing",
        45: "Preemptive cleanup, due to previous errors",
        48: "Double Bit ECC Error",
        61: "Internal micro-controller breakpoint/warning",
        62: "Internal micro-controller halt",
        63: "ECC page retirement or row remapping recording event",
        64: "ECC page retirement or row remapper recording failure",
        68: "NVDEC0 Exception",
        69: "Graphics Engine class error",
        74: "NVLINK Error",
        79: "GPU has fallen off the bus",
        92: "High single-bit ECC error rate",
        94: "Contained ECC error",
        95: "Uncontained ECC error",
        109: "Context Switch Timeout Error",
        119: "GSP RPC Timeout",
        120: "GSP Error",
        154: "GPU recovery action changed",
    }
)

_HEX_ADDR = r"(?P<domain>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<device>[0-9a-fA-F]{2})"
_XID = re.compile(
    r"NVRM: Xid \(PCI:" + _HEX_ADDR + r"(?: GPU-I:(?P<gi>\d{1,5}))?(?: GPU-CI:(?P<ci>\d{1,5}))?\): "
    r"(?P<code>\d{1,5})(?:,(?P<detail>.*))?"
)
_GPU_AT = re.compile(
    r"NVRM: GPU at PCI:"
    + _HEX_ADDR
    + r": (?P<uuid>GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
)
# nvidia-smi's pci.bus_id: 8 hex digits of domain, bus, device, function (00000000:3B:00.0).
_SMI_BUS = re.compile(
    r"(?P<domain>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<device>[0-9a-fA-F]{2})\.[0-7]"
)
_ADDRESS_KEY = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}")


def _address(domain: str, bus: str, device: str) -> str:
    """The key bcd uses for a GPU's PCI address: NVRM's form, lower case (`0000:3b:00`)."""
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"


def address_of_bus_id(bus_id: str) -> str | None:
    """nvidia-smi's `00000000:3B:00.0` as NVRM names the GPU (`0000:3b:00`); None if it is not one."""
    m = _SMI_BUS.fullmatch(bus_id.strip())
    return _address(m["domain"], m["bus"], m["device"]) if m else None


@frozen
class KernelEntry:
    cursor: str
    message: str


@frozen
class XidEvent:
    address: str  # 0000:3b:00
    code: int
    gpu_instance: int | None = None
    compute_instance: int | None = None
    detail: str = ""


@frozen
class GpuAt:
    """`NVRM: GPU at PCI:<address>: <uuid>`: which GPU an address is."""

    address: str
    uuid: str


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def parse_message(text: str) -> XidEvent | GpuAt | None:
    """A kernel message as NVRM prints it; anything else (SXid lines included) is None."""
    m = _XID.fullmatch(text.rstrip("\n"))
    if m is not None:
        detail = (m["detail"] or "").strip()
        return XidEvent(
            address=_address(m["domain"], m["bus"], m["device"]),
            code=int(m["code"]),
            gpu_instance=int(m["gi"]) if m["gi"] is not None else None,
            compute_instance=int(m["ci"]) if m["ci"] is not None else None,
            detail=_printable(detail[:MAX_DETAIL_CHARS]),
        )
    g = _GPU_AT.fullmatch(text.rstrip("\n"))
    if g is not None:
        return GpuAt(_address(g["domain"], g["bus"], g["device"]), g["uuid"])
    return None


def _document(line: bytes) -> dict[str, Any] | None:
    """A `journalctl -o json` line within MAX_LINE_BYTES as its JSON object; None otherwise."""
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        doc = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def parse_entry(line: bytes, boot_id: str) -> KernelEntry | None:
    """One `journalctl -o json` line; None unless the kernel itself logged it during boot `boot_id`."""
    doc = _document(line)
    if doc is None:
        return None
    cursor, message = doc.get("__CURSOR"), doc.get("MESSAGE")
    if not isinstance(cursor, str) or not cursor or not isinstance(message, str):
        return None  # a MESSAGE that is not valid UTF-8 comes as a byte array: not NVRM's
    if doc.get("_TRANSPORT") != "kernel" or doc.get("SYSLOG_FACILITY") != "0":
        return None
    if doc.get("_BOOT_ID") != boot_id.replace("-", ""):
        return None
    return KernelEntry(cursor=cursor, message=message)


def cursor_of(line: bytes) -> str | None:
    """The cursor of any well-formed entry (the reader moves past entries it refuses, too)."""
    doc = _document(line)
    cursor = doc.get("__CURSOR") if doc is not None else None
    return cursor if isinstance(cursor, str) and cursor else None


def _codes(value: Mapping[int, int]) -> Mapping[int, int]:
    return MappingProxyType(dict(value))


@frozen
class GpuXids:
    """One GPU's XIDs this boot: each distinct code with how often it was logged."""

    codes: Mapping[int, int] = field(factory=dict, converter=_codes)
    overflow: int = 0  # XIDs of codes beyond MAX_CODES distinct ones

    def with_code(self, code: int) -> GpuXids:
        codes = dict(self.codes)
        if code in codes:
            codes[code] = min(codes[code] + 1, MAX_COUNT)
            return GpuXids(codes, self.overflow)
        if len(codes) >= MAX_CODES:
            return GpuXids(codes, min(self.overflow + 1, MAX_COUNT))
        codes[code] = 1
        return GpuXids(codes, self.overflow)


def _gpus(value: Mapping[str, GpuXids]) -> Mapping[str, GpuXids]:
    return MappingProxyType(dict(value))


def _uuids(value: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(value))


@frozen
class XidState:
    """This boot's XIDs by PCI address, where the reader stopped, and the UUIDs NVRM named."""

    boot_id: str
    cursor: str = ""
    gpus: Mapping[str, GpuXids] = field(factory=dict, converter=_gpus)
    uuids: Mapping[str, str] = field(factory=dict, converter=_uuids)  # address -> GPU-… from `GPU at`
    dropped: int = 0  # XIDs of addresses beyond MAX_GPUS

    def codes(self, address: str) -> tuple[int, ...]:
        held = self.gpus.get(address)
        return tuple(sorted(held.codes)) if held is not None else ()


def record(state: XidState, event: XidEvent) -> XidState:
    held = state.gpus.get(event.address)
    if held is None and len(state.gpus) >= MAX_GPUS:
        return evolve(state, dropped=min(state.dropped + 1, MAX_COUNT))
    return evolve(state, gpus={**state.gpus, event.address: (held or GpuXids()).with_code(event.code)})


def learn(state: XidState, fact: GpuAt) -> XidState:
    if state.uuids.get(fact.address) == fact.uuid:
        return state
    if fact.address not in state.uuids and len(state.uuids) >= MAX_GPUS:
        return state
    return evolve(state, uuids={**state.uuids, fact.address: fact.uuid})


def apply_entries(state: XidState, entries: Iterable[KernelEntry]) -> XidState:
    """Each entry's XID or address fact, in order; the cursor moves to the last entry."""
    for entry in entries:
        parsed = parse_message(entry.message)
        if isinstance(parsed, XidEvent):
            state = record(state, parsed)
        elif isinstance(parsed, GpuAt):
            state = learn(state, parsed)
        state = evolve(state, cursor=entry.cursor)
    return state


def clear(state: XidState, addresses: Iterable[str]) -> XidState:
    """The GPUs at `addresses` lose their XIDs (a reset that left them healthy: DLV-RST-14)."""
    gone = set(addresses)
    gpus = {a: x for a, x in state.gpus.items() if a not in gone}
    if len(gpus) == len(state.gpus):
        return state
    return evolve(state, gpus=gpus)


def uuid_map(state: XidState, inventory: Mapping[str, str]) -> dict[str, str]:
    """Address -> GPU UUID: the inventory's (nvidia-smi), else what NVRM said at the GPU's start."""
    return {**state.uuids, **inventory}


def describe(code: int) -> str:
    meaning = XID_MEANINGS.get(code)
    return f"XID {code} ({meaning})" if meaning else f"XID {code}"


def _message(address: str, uuid: str | None, held: GpuXids) -> str:
    parts = []
    for code in sorted(held.codes):
        n = held.codes[code]
        parts.append(describe(code) + (f" x{n}" if n > 1 else ""))
    if held.overflow:
        parts.append(f"{held.overflow} more of other codes")
    who = f"{uuid} (PCI {address})" if uuid else f"the GPU at PCI {address}"
    return bounded(
        f"{who}: {', '.join(parts)} this boot; a gpu.reset that leaves it healthy, or a reboot, clears it"
    )


def bounded(text: str) -> str:
    """At most MAX_MESSAGE_BYTES. The message is ASCII (hex addresses and UUIDs, numbers, the meanings
    above), so characters are bytes."""
    return text if len(text) <= MAX_MESSAGE_BYTES else text[: MAX_MESSAGE_BYTES - 3] + "..."


def xid_conditions(state: XidState, uuids: Mapping[str, str]) -> tuple[Condition, ...]:
    """One `XidError` condition per GPU with XIDs this boot, in address order."""
    out = []
    for address in sorted(state.gpus):
        held = state.gpus[address]
        if not held.codes and not held.overflow:
            continue
        uuid = uuids.get(address)
        out.append(
            Condition(
                type=CONDITION_XID, reason=uuid or f"PCI:{address}", message=_message(address, uuid, held)
            )
        )
    return tuple(out)


# --- the state file --------------------------------------------------------------------------------


class XidStateError(ValueError):
    pass


def to_json(state: XidState) -> bytes:
    doc = {
        "format": FORMAT,
        "boot_id": state.boot_id,
        "cursor": state.cursor,
        "gpus": {
            a: {"codes": {str(c): n for c, n in sorted(x.codes.items())}, "overflow": x.overflow}
            for a, x in sorted(state.gpus.items())
        },
        "uuids": dict(sorted(state.uuids.items())),
        "dropped": state.dropped,
    }
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def _exact_keys(doc: Any, keys: set[str], where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise XidStateError(f"{where}: must be an object")
    if set(doc) != keys:
        extra, missing = sorted(set(doc) - keys), sorted(keys - set(doc))
        raise XidStateError(
            f"{where}: unknown fields {extra}" if extra else f"{where}: missing fields {missing}"
        )
    return doc


def _count(value: Any, where: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise XidStateError(f"{where}: must be an integer from 0 to {MAX_COUNT}")
    return value


def from_json(data: bytes) -> XidState:
    """The state file, strictly: unknown fields, wrong types and bounds broken are refused."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise XidStateError(f"xid state: not JSON: {exc}") from None
    doc = _exact_keys(doc, {"format", "boot_id", "cursor", "gpus", "uuids", "dropped"}, "xid state")
    if doc["format"] != FORMAT:
        raise XidStateError(f"xid state: format: must be {FORMAT}")
    if not isinstance(doc["boot_id"], str) or not isinstance(doc["cursor"], str):
        raise XidStateError("xid state: boot_id and cursor must be strings")
    gpus_doc, uuids_doc = doc["gpus"], doc["uuids"]
    if not isinstance(gpus_doc, dict) or len(gpus_doc) > MAX_GPUS:
        raise XidStateError(f"xid state: gpus: must be an object of at most {MAX_GPUS} addresses")
    if not isinstance(uuids_doc, dict) or len(uuids_doc) > MAX_GPUS:
        raise XidStateError(f"xid state: uuids: must be an object of at most {MAX_GPUS} addresses")
    gpus: dict[str, GpuXids] = {}
    for address, entry in gpus_doc.items():
        where = f"xid state: gpus[{address!r}]"
        if not _ADDRESS_KEY.fullmatch(address):
            raise XidStateError(f"{where}: not a PCI address like 0000:3b:00")
        entry = _exact_keys(entry, {"codes", "overflow"}, where)
        codes_doc = entry["codes"]
        if not isinstance(codes_doc, dict) or len(codes_doc) > MAX_CODES:
            raise XidStateError(f"{where}.codes: must be an object of at most {MAX_CODES} codes")
        codes: dict[int, int] = {}
        for code, n in codes_doc.items():
            if not code.isdigit() or len(code) > 5:
                raise XidStateError(f"{where}.codes: {code!r} is not an XID code")
            codes[int(code)] = _count(n, f"{where}.codes[{code!r}]")
        gpus[address] = GpuXids(codes, _count(entry["overflow"], f"{where}.overflow"))
    uuids: dict[str, str] = {}
    for address, uuid in uuids_doc.items():
        # The driver's own line as the check: no JSON value but a UUID string prints as one.
        fact = parse_message(f"NVRM: GPU at PCI:{address}: {uuid}")
        if not isinstance(fact, GpuAt) or fact.address != address:
            raise XidStateError(f"xid state: uuids[{address!r}]: not a PCI address and a GPU UUID")
        uuids[address] = fact.uuid
    return XidState(doc["boot_id"], doc["cursor"], gpus, uuids, _count(doc["dropped"], "xid state: dropped"))
