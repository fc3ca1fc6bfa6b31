"""Parsers for the nvidia-smi output gpu-settings and mig-layout read.

Formats follow real output (../shared/reference/nvidia-smi: `--query-gpu ... --format=csv` rows
separated by ", " with `[N/A]` for unavailable values; the `mig -lgip` and `mig -lgi` tables of the
A30/A100/H100 transcripts, and "No GPU instances found: Not Found").
"""

from __future__ import annotations

import re

from attrs import frozen

from bcd_shared.system import System

GPU_QUERY = "index,uuid,power.limit,power.min_limit,power.max_limit,ecc.mode.current,ecc.mode.pending"
MIG_QUERY = "index,uuid,mig.mode.current,mig.mode.pending"


def query(system: System, fields: str) -> list[list[str]] | None:
    """Rows of `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`; None when it does not answer."""
    res = system.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"])
    if not res.ok:
        return None
    rows = []
    n = len(fields.split(","))
    for line in res.stdout.decode(errors="replace").splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(", ")]
        if len(cells) == n:
            rows.append(cells)
    return rows


def number(cell: str) -> float | None:
    try:
        return float(cell.split()[0])
    except (ValueError, IndexError):
        return None


@frozen
class MigProfile:
    name: str  # "1g.10gb"
    id: int
    total: int  # instances that fit on an empty GPU


_LGIP_ROW = re.compile(r"^\|\s+(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)/(\d+)\s")
_LGI_ROW = re.compile(r"^\|\s+(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s")


def parse_lgip(text: str) -> dict[int, tuple[MigProfile, ...]]:
    out: dict[int, list[MigProfile]] = {}
    for line in text.splitlines():
        m = _LGIP_ROW.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(
                MigProfile(m.group(2), int(m.group(3)), int(m.group(5)))
            )
    return {k: tuple(v) for k, v in out.items()}


def parse_lgi(text: str) -> dict[int, tuple[str, ...]]:
    """GPU index -> the profile names of its GPU instances."""
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = _LGI_ROW.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return {k: tuple(sorted(v)) for k, v in out.items()}
