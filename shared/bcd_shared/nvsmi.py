"""Parsers for nvidia-smi's real output formats (pure: text in, frozen values out).

Formats (see ../shared/reference/nvidia-smi/README.md, "Format notes"):
- `nvidia-smi -L`: `GPU <i>: <name> (UUID: GPU-…)`, then MIG lines indented two spaces,
  `  MIG <profile> <pad>Device <n>: (UUID: MIG-…)`; the device number is the MIG device index that
  `-q -x` gives with its GPU and compute instance ids. Older drivers wrote `MIG-GPU-<uuid>/<gi>/<ci>`.
- `--query-gpu=… --format=csv[,noheader]`: `", "` separated, no quoting; values carry units
  (`81559 MiB`) unless `nounits`; unavailable is `[N/A]`, deprecated
  `[Requested functionality has been deprecated]`. A header carries units too (`memory.total [MiB]`).
- `-q -x`: `<gpu id="bus">` blocks; `N/A` for unavailable; `<mig_devices>` holds `None` without MIG;
  `<remapped_rows>N/A</remapped_rows>` under MIG; ECC volatile counters differ by driver (DTD v11
  `sram_uncorrectable`, 570+ `sram_uncorrectable_parity`/`_secded`).
- `mig -lgi` / `mig -lci`: boxed tables, one row per instance.
Every parser refuses what it does not understand with NvsmiParseError naming the line.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence

from attrs import frozen


class NvsmiParseError(ValueError):
    """nvidia-smi printed something this parser does not understand."""


UNAVAILABLE = frozenset(
    {
        "N/A",
        "[N/A]",
        "Requested functionality has been deprecated",
        "[Requested functionality has been deprecated]",
        "[Not Supported]",
        "Not Supported",
    }
)

# What bcd asks `--query-gpu` for, in this order (`--format=csv,noheader`).
QUERY_GPU_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "memory.total",
    "mig.mode.current",
    "ecc.mode.current",
    "ecc.errors.uncorrected.volatile.total",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "driver_version",
)
QUERY_COMPUTE_APPS_FIELDS: tuple[str, ...] = ("gpu_uuid", "pid", "process_name", "used_gpu_memory")


def value(text: str | None) -> str | None:
    """A field's value, or None when nvidia-smi says it is unavailable."""
    if text is None:
        return None
    t = text.strip()
    return None if t in UNAVAILABLE or t == "" else t


def int_value(text: str | None) -> int | None:
    v = value(text)
    if v is None:
        return None
    m = re.fullmatch(r"(-?\d+)(?:\s*\S+)?", v)
    if m is None:
        raise NvsmiParseError(f"{text!r} is not a number")
    return int(m[1])


def yes_no(text: str | None) -> bool | None:
    v = value(text)
    if v is None:
        return None
    if v in ("Yes", "No"):
        return v == "Yes"
    raise NvsmiParseError(f"{text!r} is neither Yes nor No")


# --- -L ------------------------------------------------------------------------------------------


@frozen
class ListedMig:
    index: int  # "Device <n>"
    profile: str  # "3g.40gb", "1c.3g.71gb"
    uuid: str  # "MIG-…"


@frozen
class ListedGpu:
    index: int
    name: str
    uuid: str
    migs: tuple[ListedMig, ...] = ()


_L_GPU = re.compile(r"^GPU (\d+): (.+) \(UUID: (GPU-[0-9A-Za-z-]+)\)$")
_L_MIG = re.compile(r"^  MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[0-9A-Za-z/-]+)\)$")


def parse_list(text: str) -> tuple[ListedGpu, ...]:
    gpus: list[ListedGpu] = []
    migs: list[ListedMig] = []

    def close() -> None:
        if gpus:
            gpus[-1] = ListedGpu(gpus[-1].index, gpus[-1].name, gpus[-1].uuid, tuple(migs))

    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not line:
            continue
        if m := _L_GPU.match(line):
            close()
            migs = []
            gpus.append(ListedGpu(int(m[1]), m[2], m[3]))
        elif m := _L_MIG.match(line):
            if not gpus:
                raise NvsmiParseError(f"-L line {n}: a MIG device before any GPU")
            migs.append(ListedMig(int(m[2]), m[1], m[3]))
        else:
            raise NvsmiParseError(f"-L line {n}: {line!r} is not a GPU or MIG line")
    close()
    return tuple(gpus)


# --- CSV -----------------------------------------------------------------------------------------


def _header_field(col: str) -> str:
    return re.sub(r"\s*\[[^\]]*\]$", "", col.strip())


def parse_csv(text: str, fields: Sequence[str] | None = None) -> tuple[Mapping[str, str], ...]:
    """Rows of a `--query-*` CSV as field -> raw value. With `fields`, the text has no header."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if fields is None:
        if not lines:
            raise NvsmiParseError("csv: no header")
        names = [_header_field(c) for c in lines[0].split(", ")]
        lines = lines[1:]
    else:
        names = list(fields)
    rows: list[Mapping[str, str]] = []
    for n, line in enumerate(lines, 1):
        cells = line.split(", ")
        if len(cells) != len(names):
            raise NvsmiParseError(f"csv row {n}: {len(cells)} values for {len(names)} fields")
        rows.append(dict(zip(names, (c.strip() for c in cells), strict=True)))
    return tuple(rows)


@frozen
class QueriedGpu:
    index: int
    uuid: str
    name: str
    bus_id: str
    memory_mib: int | None
    mig_enabled: bool
    ecc_enabled: bool | None
    ecc_uncorrected_volatile: int | None
    remap_pending: bool | None
    remap_failure: bool | None
    driver_version: str | None


def queried_gpus(rows: Sequence[Mapping[str, str]]) -> tuple[QueriedGpu, ...]:
    out: list[QueriedGpu] = []
    for n, row in enumerate(rows, 1):
        try:
            idx = int_value(row["index"])
            uuid = value(row["uuid"])
            bus = value(row["pci.bus_id"])
            if idx is None or uuid is None or bus is None:
                raise NvsmiParseError(f"query-gpu row {n}: index, uuid and pci.bus_id are required")
            ecc_mode = value(row.get("ecc.mode.current"))
            out.append(
                QueriedGpu(
                    index=idx,
                    uuid=uuid,
                    name=value(row.get("name")) or "",
                    bus_id=bus,
                    memory_mib=int_value(row.get("memory.total")),
                    mig_enabled=value(row.get("mig.mode.current")) == "Enabled",
                    ecc_enabled=None if ecc_mode is None else ecc_mode == "Enabled",
                    ecc_uncorrected_volatile=int_value(row.get("ecc.errors.uncorrected.volatile.total")),
                    remap_pending=yes_no(row.get("remapped_rows.pending")),
                    remap_failure=yes_no(row.get("remapped_rows.failure")),
                    driver_version=value(row.get("driver_version")),
                )
            )
        except KeyError as exc:
            raise NvsmiParseError(f"query-gpu row {n}: field {exc} missing") from None
    return tuple(out)


@frozen
class ComputeApp:
    gpu_uuid: str
    pid: int
    process_name: str


def compute_apps(rows: Sequence[Mapping[str, str]]) -> tuple[ComputeApp, ...]:
    out = []
    for n, row in enumerate(rows, 1):
        pid = int_value(row.get("pid"))
        uuid = value(row.get("gpu_uuid"))
        if pid is None or uuid is None:
            raise NvsmiParseError(f"query-compute-apps row {n}: gpu_uuid and pid are required")
        out.append(ComputeApp(uuid, pid, row.get("process_name", "")))
    return tuple(out)


# --- -q -x ---------------------------------------------------------------------------------------


@frozen
class QxMig:
    index: int
    gpu_instance: int
    compute_instance: int
    memory_mib: int | None = None


@frozen
class QxGpu:
    bus_id: str
    uuid: str
    product: str
    minor: int | None
    mig_enabled: bool
    migs: tuple[QxMig, ...]
    ecc_enabled: bool | None
    # Sum of the volatile uncorrectable ECC counters; None when the GPU reports none.
    ecc_uncorrected_volatile: int | None
    remap_pending: bool | None
    remap_failure: bool | None
    memory_mib: int | None


@frozen
class QxLog:
    driver_version: str | None
    gpus: tuple[QxGpu, ...]


def _text(el: ET.Element | None, path: str) -> str | None:
    if el is None:
        return None
    found = el.find(path)
    return None if found is None or found.text is None else found.text.strip()


def _ecc_volatile_uncorrected(gpu: ET.Element) -> int | None:
    vol = gpu.find("ecc_errors/volatile")
    if vol is None:
        return None
    total: int | None = None
    for child in vol:
        # Old and new drivers: *_uncorrectable, sram_uncorrectable_parity/_secded, dram_uncorrectable.
        if "uncorrectable" in child.tag:
            n = int_value(child.text)
            if n is not None:
                total = (total or 0) + n
    return total


def parse_qx(text: str | bytes) -> QxLog:
    try:
        root = ET.fromstring(text)  # noqa: S314 - nvidia-smi's own output, no external entities
    except ET.ParseError as exc:
        raise NvsmiParseError(f"-q -x: not XML: {exc}") from None
    if root.tag != "nvidia_smi_log":
        raise NvsmiParseError(f"-q -x: root element {root.tag!r} is not nvidia_smi_log")
    gpus: list[QxGpu] = []
    for gpu in root.findall("gpu"):
        uuid = _text(gpu, "uuid")
        bus = gpu.get("id") or _text(gpu, "pci/pci_bus_id")
        if not uuid or not bus:
            raise NvsmiParseError("-q -x: a <gpu> without uuid or bus id")
        migs = []
        for md in gpu.findall("mig_devices/mig_device"):
            idx = int_value(_text(md, "index"))
            gi = int_value(_text(md, "gpu_instance_id"))
            ci = int_value(_text(md, "compute_instance_id"))
            if idx is None or gi is None or ci is None:
                raise NvsmiParseError(f"-q -x: GPU {uuid} has a mig_device without index/gi/ci")
            migs.append(QxMig(idx, gi, ci, int_value(_text(md, "fb_memory_usage/total"))))
        ecc_mode = value(_text(gpu, "ecc_mode/current_ecc"))
        remap = gpu.find("remapped_rows")
        gpus.append(
            QxGpu(
                bus_id=bus,
                uuid=uuid,
                product=_text(gpu, "product_name") or "",
                minor=int_value(_text(gpu, "minor_number")),
                mig_enabled=value(_text(gpu, "mig_mode/current_mig")) == "Enabled",
                migs=tuple(migs),
                ecc_enabled=None if ecc_mode is None else ecc_mode == "Enabled",
                ecc_uncorrected_volatile=_ecc_volatile_uncorrected(gpu),
                remap_pending=yes_no(_text(remap, "remapped_row_pending")),
                remap_failure=yes_no(_text(remap, "remapped_row_failure")),
                memory_mib=int_value(_text(gpu, "fb_memory_usage/total")),
            )
        )
    return QxLog(driver_version=_text(root, "driver_version"), gpus=tuple(gpus))


# --- -L and -q -x together ---------------------------------------------------------------------


@frozen
class MigRef:
    """A MIG device as `-L` and `-q -x` name it together: its GPU and compute instance ids, its MIG device
    index (the vendor CDI spec's `<gpu index>:<index>` name) and its `MIG-…` UUID (None when -L gave none)."""

    gpu_instance: int
    compute_instance: int
    index: int
    uuid: str | None
    profile: str = ""


def join_migs(listed: ListedGpu, qx: QxGpu | None) -> tuple[MigRef, ...]:
    """The GPU's MIG devices (pure): `-q -x`'s ids matched with `-L`'s UUIDs through the MIG device index
    both print. Without `-q -x`, old drivers' `MIG-GPU-<uuid>/<gi>/<ci>` names carry the ids; newer
    names do not, so those devices are left out (nothing says which instance they are)."""
    by_index = {m.index: m for m in listed.migs}
    if qx is not None:
        out = []
        for xm in qx.migs:
            lm = by_index.get(xm.index)
            out.append(
                MigRef(
                    xm.gpu_instance,
                    xm.compute_instance,
                    xm.index,
                    lm.uuid if lm else None,
                    lm.profile if lm else "",
                )
            )
        return tuple(out)
    old = []
    for lm in listed.migs:
        parts = lm.uuid.split("/")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            old.append(MigRef(int(parts[1]), int(parts[2]), lm.index, lm.uuid, lm.profile))
    return tuple(old)


# --- mig -lgi / -lci -----------------------------------------------------------------------------


@frozen
class GpuInstanceRow:
    gpu: int
    profile: str
    profile_id: int
    instance: int
    placement: str


@frozen
class ComputeInstanceRow:
    gpu: int
    gpu_instance: int
    profile: str
    profile_id: int
    instance: int
    placement: str


_LGI_ROW = re.compile(r"^\|\s+(\d+)\s+MIG (\S+)\s+(\d+)\s+(\d+)\s+(\d+:\d+)\s+\|$")
_LCI_ROW = re.compile(r"^\|\s+(\d+)\s+(\d+)\s+MIG (\S+)\s+(\d+)\*?\s+(\d+)\s+(\d+:\d+)\s+\|$")


def parse_lgi(text: str) -> tuple[GpuInstanceRow, ...]:
    if text.strip().startswith("No GPU instances found"):
        return ()
    return tuple(
        GpuInstanceRow(int(m[1]), m[2], int(m[3]), int(m[4]), m[5])
        for line in text.splitlines()
        if (m := _LGI_ROW.match(line.strip()))
    )


def parse_lci(text: str) -> tuple[ComputeInstanceRow, ...]:
    if text.strip().startswith("No compute instances found"):
        return ()
    return tuple(
        ComputeInstanceRow(int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5]), m[6])
        for line in text.splitlines()
        if (m := _LCI_ROW.match(line.strip()))
    )
