"""Reading what the devices section needs from the host, through a `System` (read-only).

Holds come from the files alone (DEV-PASS-03/04): `/etc/cdi/bcd-*.json` read back with
`bcd_shared.cdi.parse_hold_spec`, env files from `/run/bcd/allocations/<id>.env` (also those with
no CDI spec: orphans), slices from the cgroup tree `/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/`
(`cgroup.events`, `hugetlb.*.current`), the pending Kubernetes releases from
`<data_dir>/releasing.json`, the marker `<data_dir>/releasing.unreadable`, and the event ledger
`<data_dir>/devices-events.json`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bcd_shared import cdi
from bcd_shared.system import System

from bcd_agent.sections.devices.events import ReleasedEvent
from bcd_agent.sections.devices.plan import Ledger, LiveHold, PendingRelease, SliceState
from bcd_agent.sections.devices.slices import (
    HUGETLB_FILES,
    LIMIT_FILES,
    PARENT_CGROUP,
    SLICE_NAME_RE,
    SliceSpec,
    applied_limits,
    wanted_limits,
)

RELEASES_FILE = "releasing.json"
MARKER_FILE = "releasing.unreadable"
LEDGER_FILE = "devices-events.json"


class ReleasesUnreadable(ValueError):
    pass


def read_holds(system: System) -> tuple[dict[str, LiveHold], tuple[str, ...]]:
    """Every bcd hold on the host, and the allocation ids whose spec did not parse."""
    holds: dict[str, LiveHold] = {}
    bad: list[str] = []
    for alloc, _path, data in cdi.hold_spec_files(system):
        try:
            record = cdi.parse_hold_spec(data, alloc)
            doc: Mapping[str, Any] = json.loads(data)
        except cdi.CdiError:
            bad.append(alloc)
            continue
        env_data = system.read_bytes(cdi.env_file_path(alloc))
        env_lines: tuple[str, ...] | None = None
        if env_data is not None:
            try:
                env_lines = cdi.parse_env_file(env_data, alloc)
            except cdi.CdiError:
                env_lines = None
        holds[alloc] = LiveHold(record, doc, env_lines)
    return holds, tuple(bad)


def read_orphan_envs(system: System, with_spec: set[str]) -> dict[str, tuple[str, ...] | None]:
    """Env files whose allocation has no CDI spec file (`with_spec`: the ids of every bcd-<id>.json,
    parsed or not): their lines, None for one that does not parse."""
    out: dict[str, tuple[str, ...] | None] = {}
    for alloc, _path, data in cdi.env_files(system):
        if alloc in with_spec:
            continue
        try:
            out[alloc] = cdi.parse_env_file(data, alloc)
        except cdi.CdiError:
            out[alloc] = None
    return out


def read_slices(system: System) -> dict[str, SliceState]:
    out: dict[str, SliceState] = {}
    for name in system.listdir(PARENT_CGROUP):
        if not SLICE_NAME_RE.fullmatch(name):
            continue
        base = f"{PARENT_CGROUP}/{name}"
        events = system.read_text(f"{base}/cgroup.events")
        if events is None:
            continue
        populated = any(line.split() == ["populated", "1"] for line in events.splitlines())
        current: dict[int, int] = {}
        for size, stem in HUGETLB_FILES.items():
            text = system.read_text(f"{base}/{stem}.current")
            if text is not None and text.strip().isdigit():
                current[size] = int(text.strip())
        files = {f: t for f in LIMIT_FILES if (t := system.read_text(f"{base}/{f}")) is not None}
        out[name] = SliceState(name, populated, current, applied_limits(files))
    return out


SLICE_RECORDS_DIR = "/run/bcd/slices"


def read_slice_records(system: System) -> dict[str, SliceState]:
    """A fakehw host's slices: one JSON record per slice under /run/bcd/slices (DEV-SLICE-25)."""
    out: dict[str, SliceState] = {}
    for fname in system.listdir(SLICE_RECORDS_DIR):
        name = fname[: -len(".json")] if fname.endswith(".json") else ""
        if not SLICE_NAME_RE.fullmatch(name):
            continue
        try:
            rec = json.loads(system.read_bytes(f"{SLICE_RECORDS_DIR}/{fname}") or b"")
            current = {int(k): int(v) for k, v in rec.get("hugetlb_current", {}).items()}
            props = tuple((str(k), str(v)) for k, v in rec.get("properties", {}).items())
            huge = tuple((int(k), int(v)) for k, v in rec.get("hugetlb_max", {}).items())
            limits = wanted_limits(SliceSpec(name, props, huge))
            out[name] = SliceState(name, bool(rec.get("populated", False)), current, limits)
        except (ValueError, AttributeError, TypeError):
            out[name] = SliceState(name, True)  # unreadable: never stopped on a guess
    return out


def parse_releases(data: bytes) -> tuple[PendingRelease, ...]:
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("releases"), list):
            raise ReleasesUnreadable("releasing.json: not version 1 with a releases list")
        out: dict[str, PendingRelease] = {}
        for r in doc["releases"]:
            rel = PendingRelease(
                allocation_id=str(r["allocation_id"]),
                reservation_id=str(r.get("reservation_id", "")),
                generation=int(r["generation"]),
                device_ids=tuple(str(d) for d in r["device_ids"]),
                since=float(r["since"]),
            )
            out[rel.allocation_id] = rel
        return tuple(out.values())
    except (ValueError, KeyError, TypeError) as exc:
        raise ReleasesUnreadable(f"releasing.json: {exc}") from None


def encode_releases(releases: tuple[PendingRelease, ...]) -> bytes:
    doc = {
        "version": 1,
        "releases": [
            {
                "allocation_id": r.allocation_id,
                "reservation_id": r.reservation_id,
                "generation": r.generation,
                "device_ids": list(r.device_ids),
                "since": r.since,
            }
            for r in releases
        ],
    }
    return (json.dumps(doc, indent=1) + "\n").encode()


def read_releases(system: System, data_dir: str) -> tuple[tuple[PendingRelease, ...], bool]:
    """(releases, unreadable): a missing file is no releases; one that does not parse is unreadable."""
    data = system.read_bytes(f"{data_dir}/{RELEASES_FILE}")
    if data is None:
        return (), False
    try:
        return parse_releases(data), False
    except ReleasesUnreadable:
        return (), True


def read_ledger(system: System, data_dir: str) -> Ledger:
    data = system.read_bytes(f"{data_dir}/{LEDGER_FILE}")
    if data is None:
        return Ledger()
    try:
        doc = json.loads(data)
        return Ledger(
            bound={str(k): int(v) for k, v in doc.get("bound", {}).items()},
            failed={str(k): int(v) for k, v in doc.get("failed", {}).items()},
            releasing={str(k): _released(v) for k, v in doc.get("releasing", {}).items()},
        )
    except (ValueError, AttributeError, TypeError, KeyError):
        # Disk damage or an edit (writes are atomic): bound and failed events may be sent once more
        # (never lost); the releases it recorded are not reported (docs/devices.md).
        return Ledger()


def _released(doc: Any) -> ReleasedEvent:
    return ReleasedEvent(
        allocation_id=str(doc["allocation_id"]),
        reservation_id=str(doc["reservation_id"]),
        generation=int(doc["generation"]),
        device_ids=tuple(str(d) for d in doc["device_ids"]),
        kubernetes=bool(doc["kubernetes"]),
    )


def encode_ledger(ledger: Ledger) -> bytes:
    doc: dict[str, Any] = {"bound": dict(ledger.bound), "failed": dict(ledger.failed)}
    if ledger.releasing:
        doc["releasing"] = {
            k: {
                "allocation_id": e.allocation_id,
                "reservation_id": e.reservation_id,
                "generation": e.generation,
                "device_ids": list(e.device_ids),
                "kubernetes": e.kubernetes,
            }
            for k, e in ledger.releasing.items()
        }
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def read_vendor_spec(system: System) -> cdi.VendorSpec | None:
    data = system.read_bytes(cdi.VENDOR_SPEC_PATH)
    if data is None:
        return None
    try:
        return cdi.parse_vendor_spec(data)
    except cdi.CdiError:
        return None
