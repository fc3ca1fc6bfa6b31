"""`bcd status`: generations, section states, conditions and the holder of each GPU.

Two sources, both local, neither the node's memory:

- the node's published status, `data_dir/status.json` (bcd_agent.statusfile; the node writes it
  whenever the converge runner publishes a new status): applied and observed generation, the spec
  hash, one state per section with its generation, reason and message, and the conditions with
  their ages (DLV-CONV-18, DLV-CONV-19);
- the holds as they stand on the host: `/etc/cdi/bcd-*.json` read back with the devices section's own
  reader (the files are the only source of truth for what is held, DEV-PASS-03), and the GPUs with
  their MIG instances from nvidia-smi, so that each GPU, MIG instance and slot is shown with the
  allocation holding it (devices-and-holds.md, "Seeing the holds").

`--root DIR` reads a simulated host; `--watch` redraws the view every `--interval` seconds (a live
view on a terminal; a new block of plain lines whenever something changed otherwise); `--json`
prints one JSON object. Exit status: 0 when the node has published a status and it is settled, 1 when
it has not or a section is PROGRESSING or FAILED, 2 on a usage or read error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from attrs import frozen
from bcd_shared.system import System

from bcd_agent.statusfile import StatusFileError, StatusView, read_status


@frozen
class HolderRow:
    """One line of the holders table: a GPU, or a MIG instance / slot under it."""

    gpu_index: int | None  # None: an atom on a GPU the inventory does not list
    device: str  # the GPU's UUID, or a MIG instance / slot id
    kind: str  # "gpu", "gpu.mig", "gpu.slot"
    detail: str  # the MIG profile, "MIG on", ...
    holder: str  # allocation id, or "" when free


@frozen
class Holds:
    rows: tuple[HolderRow, ...]
    unparseable: tuple[str, ...] = ()  # allocation ids whose hold spec did not parse
    inventory_errors: tuple[str, ...] = ()


def read_holders(system: System) -> Holds:
    """Every GPU, MIG instance and slot with the allocation that holds it (read-only)."""
    from bcd_agent.inventory.gpus import collect_gpus
    from bcd_agent.sections.devices.atoms import MIG_ID_RE, SLOT_ID_RE, atom_from_id
    from bcd_agent.sections.devices.observe import read_holds

    holds, bad = read_holds(system)
    held: dict[str, str] = {}
    for alloc, live in sorted(holds.items()):
        for device_id in live.record.device_ids:
            held[device_id] = alloc
    inventory = collect_gpus(system)
    rows: list[HolderRow] = []
    shown: set[str] = set()
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        detail = "MIG on" if gpu.mig_enabled else ""
        rows.append(HolderRow(gpu.index, gpu.uuid, "gpu", detail, held.get(gpu.uuid, "")))
        shown.add(gpu.uuid)
        for mig in gpu.migs:
            atom = f"{gpu.uuid}/gi{mig.gpu_instance}/ci{mig.compute_instance}"
            rows.append(HolderRow(gpu.index, atom, "gpu.mig", mig.profile, held.get(atom, "")))
            shown.add(atom)
        for atom, alloc in sorted(held.items()):
            if atom not in shown and SLOT_ID_RE.match(atom) and atom_from_id(atom).gpu == gpu.uuid:
                rows.append(HolderRow(gpu.index, atom, "gpu.slot", "", alloc))
                shown.add(atom)
    for atom, alloc in sorted(held.items()):
        if atom in shown:
            continue
        kind = "gpu.mig" if MIG_ID_RE.match(atom) else "gpu.slot" if SLOT_ID_RE.match(atom) else "gpu"
        rows.append(HolderRow(None, atom, kind, "not in the inventory", alloc))
    return Holds(tuple(rows), bad, inventory.errors)


@frozen
class StatusSnapshot:
    status: StatusView | None
    holds: Holds | None
    errors: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        if self.status is None:
            return 1
        ok = self.status.settled and all(s.state != "FAILED" for s in self.status.sections)
        return 0 if ok else 1


def snapshot(data_dir: str, system: System | None) -> StatusSnapshot:
    errors: list[str] = []
    status: StatusView | None = None
    try:
        status = read_status(data_dir)
    except StatusFileError as e:
        errors.append(str(e))
    holds: Holds | None = None
    if system is not None:
        try:
            holds = read_holders(system)
        except OSError as e:
            errors.append(f"reading the holds failed: {e}")
    return StatusSnapshot(status, holds, tuple(errors))


def _age(ms: int) -> str:
    s = ms // 1000
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def render(snap: StatusSnapshot, *, now_wall: float | None = None) -> str:
    """The human view: generations, sections, conditions, holders."""
    lines: list[str] = []
    st = snap.status
    if st is None:
        lines.append("node: no status published yet (is bcd node running with this data_dir?)")
    else:
        now = time.time() if now_wall is None else now_wall
        verdict = "converged" if st.converged else "settled" if st.settled else "converging"
        lines.append(
            f"generation: applied {st.applied_generation}, observed {st.observed_generation} ({verdict});"
            f" {st.passes} passes; updated {_age(max(0, int((now - st.written_at) * 1000)))} ago"
        )
        if st.spec_hash:
            lines.append(f"spec hash: {st.spec_hash}")
        lines.append("")
        lines.append(f"{'SECTION':<11}{'STATE':<13}{'GEN':>4}  REASON: MESSAGE")
        for s in st.sections:
            why = f"{s.reason}: {s.message}" if s.reason and s.message else s.reason or s.message
            lines.append(f"{s.section:<11}{s.state:<13}{s.generation:>4}  {why}")
        lines.append("")
        if st.conditions:
            lines.append("CONDITIONS")
            for c in st.conditions:
                where = f" [{c.section}]" if c.section else ""
                lines.append(f"  {c.type}{where} {c.reason} for {_age(c.age_ms)}: {c.message}")
        else:
            lines.append("conditions: none")
    if snap.holds is not None:
        lines.append("")
        lines.append(f"{'GPU':<5}{'DEVICE':<58}{'':<14}HOLDER")
        for r in snap.holds.rows:
            index = "?" if r.gpu_index is None else str(r.gpu_index)
            device = r.device if r.kind == "gpu" else "  " + r.device.split("/", 1)[-1]
            if r.gpu_index is None:
                device = r.device
            lines.append(f"{index:<5}{device:<58}{r.detail:<14}{r.holder or '-'}")
        if not snap.holds.rows:
            lines.append("(no GPUs listed and no holds)")
        for alloc in snap.holds.unparseable:
            lines.append(f"! /etc/cdi/bcd-{alloc}.json does not parse: its GPUs are unknown to bcd status")
        for err in snap.holds.inventory_errors:
            lines.append(f"! inventory: {err}")
    for err in snap.errors:
        lines.append(f"! {err}")
    return "\n".join(lines) + "\n"


def to_json(snap: StatusSnapshot) -> dict[str, object]:
    doc: dict[str, object] = {
        "status": snap.status.to_json() if snap.status else None,
        "errors": list(snap.errors),
    }
    if snap.holds is not None:
        doc["holders"] = [
            {"gpu_index": r.gpu_index, "device": r.device, "device_class": r.kind, "detail": r.detail,
             "holder": r.holder or None}
            for r in snap.holds.rows
        ]  # fmt: skip
        doc["unparseable_holds"] = list(snap.holds.unparseable)
        doc["inventory_errors"] = list(snap.holds.inventory_errors)
    return doc


def watch(
    take: Callable[[], StatusSnapshot],
    out: TextIO,
    *,
    interval: float,
    tty: bool,
    count: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> StatusSnapshot:
    """Redraw (tty) or print on change (otherwise) every `interval` s; `count` rounds, or forever."""
    last = ""
    snap = take()
    rounds = 0
    while True:
        text = render(snap)
        if tty:
            out.write("\x1b[H\x1b[2J" + text)
            out.flush()
        elif _stable(text) != last:
            out.write(text + "\n")
            out.flush()
        last = _stable(text)
        rounds += 1
        if count is not None and rounds >= count:
            return snap
        sleep(interval)
        snap = take()


def _stable(text: str) -> str:
    # The first line carries "updated N s ago" and ages: compare without them.
    return "\n".join(line for line in text.splitlines() if "ago" not in line and " for " not in line)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_shared.subcommands import positive_float

    from bcd_agent.config import add_config_argument

    add_config_argument(parser)
    parser.add_argument("--data-dir", default=None, help="the node's data_dir (default: config's)")
    parser.add_argument("--root", default="/", help="the directory standing for / (a simulated host)")
    parser.add_argument("--no-holds", action="store_true", help="skip reading the holds and GPUs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--watch", action="store_true", help="a live view, redrawn every --interval seconds")
    parser.add_argument(
        "--interval", type=positive_float, default=1.0, help="seconds between redraws (--watch)"
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from bcd_shared.subcommands import EX_CONFIG, CliError

    from bcd_agent.config import ConfigError, default_config_path, load_config
    from bcd_agent.plan import host_system

    stream = out or sys.stdout
    try:
        config = load_config(args.config or default_config_path(), missing_ok=True)
    except ConfigError as e:
        raise CliError(str(e), EX_CONFIG) from None
    data_dir = args.data_dir or config.data_dir
    system = None if args.no_holds else host_system(args.root)

    def take() -> StatusSnapshot:
        return snapshot(data_dir, system)

    if args.watch:
        try:
            snap = watch(take, stream, interval=max(0.1, args.interval), tty=stream.isatty())
        except KeyboardInterrupt:
            return 0
        return snap.exit_code
    snap = take()
    if args.json:
        json.dump(to_json(snap), stream, sort_keys=True)
        stream.write("\n")
    else:
        stream.write(render(snap))
    return snap.exit_code


def main(argv: Sequence[str] | None = None) -> int:  # for `python -m bcd_agent.status`
    parser = argparse.ArgumentParser(prog="bcd status")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
