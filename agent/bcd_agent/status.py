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

A GPU passed through to a VM is held by no CDI file: its holder is the instance, which only the node
knows (its spec and the domains it saw running). The node publishes that map in status.json
(`passthrough`, GPU uuid -> instance id) and each such GPU is shown with `instance ID` as its holder;
a GPU bound to vfio-pci is not listed by nvidia-smi, so it gets a row of its own ("passed through").
When the node is down the map is its last known one, as the rest of status.json.

Liveness (issue 15, item 5): the first lines say whether the node process is alive (the pid in
status.json, checked against /proc with its start time, so a recycled pid is not mistaken for the node),
how old status.json is (the node rewrites it every 10 s: an old file is a stale node), the session's
link state and since when, with the last heartbeat, and the last and next converge pass; each
PROGRESSING section shows when the next retry runs and why it is retrying. A stopped node's last
status is shown as "last known", never as the node's present state.

`--root DIR` reads a simulated host; `--watch` redraws the view every `--interval` seconds (a live
view on a terminal; a new block of plain lines whenever something changed otherwise); `--json`
prints one JSON object. Exit status: 0 when the node is up and has published a status that is
settled, 1 when it is down, has not published one, or a section is PROGRESSING or FAILED; the
usage and read errors of docs/operations.md "Exit codes".

`--check [--max-disconnected N] [--max-stale N]` is the probe (the DaemonSet's liveness and readiness):
one line on stdout, exit 0 when the node is up, status.json is at most N s old (default 60) and the
session has not been disconnected for more than N s (default 300); else exit 1, the line naming each
problem. It reads no holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

from attrs import frozen
from bcd_shared.shown import shown
from bcd_shared.system import System
from bcd_shared.version import VERSION

from bcd_agent.statusfile import (
    REFRESH_S,
    StatusFileError,
    StatusView,
    pid_namespace,
    process_start,
    read_status,
)

DEFAULT_MAX_STALE_S = 60
DEFAULT_MAX_DISCONNECTED_S = 300


@frozen
class HolderRow:
    """One line of the holders table: a GPU, or a MIG instance / slot under it."""

    gpu_index: int | None  # None: an atom on a GPU the inventory does not list
    device: str  # the GPU's UUID, or a MIG instance / slot id
    kind: str  # "gpu", "gpu.mig", "gpu.slot"
    detail: str  # the MIG profile, "MIG on", ...
    holder: str  # allocation id, or "" when no hold names it
    instance: str = ""  # the instance it is passed through to (the node's `passthrough`), or ""

    def holders(self) -> str:
        """The HOLDER column: the allocation, the instance, both (a conflict shows as such), or `-`."""
        parts = [self.holder] if self.holder else []
        if self.instance:
            parts.append(f"instance {self.instance}")
        return ", ".join(parts) or "-"


@frozen
class Holds:
    rows: tuple[HolderRow, ...]
    unparseable: tuple[str, ...] = ()  # allocation ids whose hold spec did not parse
    inventory_errors: tuple[str, ...] = ()


def passthrough_of(status: StatusView | None) -> dict[str, str]:
    """GPU uuid -> instance from status.json's `passthrough` (what the node last published); entries
    that are not two strings are ignored (an older or damaged file shows no instance, never a crash)."""
    doc = status.extra.get("passthrough") if status is not None else None
    if not isinstance(doc, Mapping):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str) and k and v}


def read_holders(system: System, passthrough: Mapping[str, str] | None = None) -> Holds:
    """Every GPU, MIG instance and slot with the allocation that holds it (read-only), and the instance
    each GPU of `passthrough` (GPU uuid -> instance id) is passed through to."""
    from bcd_agent.inventory.gpus import collect_gpus
    from bcd_agent.sections.devices.atoms import MIG_ID_RE, SLOT_ID_RE, atom_from_id
    from bcd_agent.sections.devices.observe import read_holds

    holds, bad = read_holds(system)
    vfio = dict(passthrough or {})
    held: dict[str, str] = {}
    for alloc, live in sorted(holds.items()):
        for device_id in live.record.device_ids:
            held[device_id] = alloc
    inventory = collect_gpus(system)
    rows: list[HolderRow] = []
    rowed: set[str] = set()  # the devices that have a row already
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        detail = "MIG on" if gpu.mig_enabled else ""
        rows.append(
            HolderRow(gpu.index, gpu.uuid, "gpu", detail, held.get(gpu.uuid, ""), vfio.get(gpu.uuid, ""))
        )
        rowed.add(gpu.uuid)
        for mig in gpu.migs:
            atom = f"{gpu.uuid}/gi{mig.gpu_instance}/ci{mig.compute_instance}"
            rows.append(HolderRow(gpu.index, atom, "gpu.mig", mig.profile, held.get(atom, "")))
            rowed.add(atom)
        for atom, alloc in sorted(held.items()):
            if atom not in rowed and SLOT_ID_RE.match(atom) and atom_from_id(atom).gpu == gpu.uuid:
                rows.append(HolderRow(gpu.index, atom, "gpu.slot", "", alloc))
                rowed.add(atom)
    for atom, alloc in sorted(held.items()):
        if atom in rowed:
            continue
        kind = "gpu.mig" if MIG_ID_RE.match(atom) else "gpu.slot" if SLOT_ID_RE.match(atom) else "gpu"
        rows.append(HolderRow(None, atom, kind, "not in the inventory", alloc, vfio.get(atom, "")))
        rowed.add(atom)
    for uuid, instance in sorted(vfio.items()):
        if uuid not in rowed:  # bound to vfio-pci: nvidia-smi does not list it
            rows.append(HolderRow(None, uuid, "gpu", "passed through", "", instance))
    return Holds(tuple(rows), bad, inventory.errors)


def pid_state(pid: int, pid_start: int | None, proc: Path = Path("/proc"), pid_ns: str | None = None) -> str:
    """`running`, `gone` (no such process), `recycled` (another process has the pid now), or `foreign`
    (the node runs in another pid namespace, a container seen from the host: its pid means nothing here)."""
    if pid_ns is not None and pid_namespace(proc) not in (None, pid_ns):
        return "foreign"
    start = process_start(pid, proc)
    if start is None:
        return "gone"
    if pid_start is not None and start != pid_start:
        return "recycled"
    return "running"


def _number(doc: Mapping[str, object], key: str) -> float | None:
    value = doc.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(doc: Mapping[str, object], key: str) -> str:
    value = doc.get(key)
    return value if isinstance(value, str) else ""


@frozen
class Liveness:
    """Is the node alive, connected and current: from status.json and the process table."""

    process: str  # "running", "gone", "recycled"
    pid: int
    written_age_s: float  # how old status.json is
    version: str = ""
    link: str = ""  # "connected", "disconnected", "" (not written by this node: an older bcd, a test)
    link_for_s: float | None = None
    link_error: str = ""
    retry_in_s: float | None = None
    attempts: int = 0
    endpoint: str = ""
    heartbeat_age_s: float | None = None
    last_pass_age_s: float | None = None
    next_pass_in_s: float | None = None
    next_pass_reason: str = ""

    @property
    def alive(self) -> bool:
        # In another pid namespace only the file's age tells: three missed rewrites and it is not.
        if self.process == "foreign":
            return self.written_age_s <= 3 * REFRESH_S
        return self.process == "running"

    def to_json(self) -> dict[str, object]:
        return {
            "alive": self.alive,
            "process": self.process,
            "pid": self.pid,
            "version": self.version,
            "status_age_s": round(self.written_age_s, 3),
            "session": {
                "state": self.link or None,
                "for_s": _round(self.link_for_s),
                "last_error": self.link_error,
                "retry_in_s": _round(self.retry_in_s),
                "attempts": self.attempts,
                "endpoint": self.endpoint,
                "last_heartbeat_age_s": _round(self.heartbeat_age_s),
            },
            "converge": {
                "last_pass_age_s": _round(self.last_pass_age_s),
                "next_pass_in_s": _round(self.next_pass_in_s),
                "next_pass_reason": self.next_pass_reason,
            },
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def liveness(status: StatusView, now_wall: float, proc: Path = Path("/proc")) -> Liveness:
    node = status.extra.get("node")
    node = node if isinstance(node, Mapping) else {}
    session = node.get("session")
    session = session if isinstance(session, Mapping) else {}
    converge = node.get("converge")
    converge = converge if isinstance(converge, Mapping) else {}

    def age(t: float | None) -> float | None:
        return None if t is None else max(0.0, now_wall - t)

    def until(t: float | None) -> float | None:
        return None if t is None else max(0.0, t - now_wall)

    attempts = session.get("attempts")
    return Liveness(
        process=pid_state(status.pid, status.pid_start, proc, status.pid_ns),
        pid=status.pid,
        written_age_s=max(0.0, now_wall - status.written_at),
        version=_text(node, "version"),
        link=_text(session, "state"),
        link_for_s=age(_number(session, "since")),
        link_error=_text(session, "last_error"),
        retry_in_s=until(_number(session, "retry_at")),
        attempts=attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else 0,
        endpoint=_text(session, "endpoint"),
        heartbeat_age_s=age(_number(session, "last_heartbeat_at")),
        last_pass_age_s=age(_number(converge, "last_pass_at")),
        next_pass_in_s=until(_number(converge, "next_pass_at")),
        next_pass_reason=_text(converge, "next_pass_reason"),
    )


@frozen
class StatusSnapshot:
    status: StatusView | None
    holds: Holds | None
    errors: tuple[str, ...] = ()
    live: Liveness | None = None
    # Why there is no status, when it is not simply "no node has run here": status.json unreadable,
    # or data_dir itself missing (a mistyped --data-dir). Also among `errors`.
    status_problem: str = ""
    data_dir: str = ""  # the directory read, named when it holds no status.json yet

    @property
    def exit_code(self) -> int:
        if self.status is None or (self.live is not None and not self.live.alive):
            return 1
        ok = self.status.settled and all(s.state != "FAILED" for s in self.status.sections)
        return 0 if ok else 1


def snapshot(
    data_dir: str, system: System | None, *, now_wall: float | None = None, proc: Path = Path("/proc")
) -> StatusSnapshot:
    errors: list[str] = []
    status: StatusView | None = None
    now = time.time() if now_wall is None else now_wall
    problem = ""
    try:
        status = read_status(data_dir, now_wall=now)
    except StatusFileError as e:
        problem = str(e)
    if status is None and not problem:
        where = Path(data_dir)
        if not where.exists():
            problem = f"data_dir {data_dir} does not exist (check --data-dir, or the config's data_dir)"
        elif not where.is_dir():
            problem = f"data_dir {data_dir} is not a directory"
    if problem:
        errors.append(problem)
    holds: Holds | None = None
    if system is not None:
        try:
            holds = read_holders(system, passthrough_of(status))
        except OSError as e:
            errors.append(f"reading the holds failed: {e}")
    live = liveness(status, now, proc) if status is not None else None
    return StatusSnapshot(status, holds, tuple(errors), live, problem, str(data_dir))


def check(snap: StatusSnapshot, *, max_disconnected_s: float, max_stale_s: float) -> list[str]:
    """`bcd status --check`: what makes the node unhealthy, or [] when it is up, current and connected."""
    live = snap.live
    if snap.status is None or live is None:
        if snap.status_problem:
            return [f"down: {snap.status_problem}", *(e for e in snap.errors if e != snap.status_problem)]
        return ["down: no status.json (bcd node has not run with this data_dir)", *snap.errors]
    problems = []
    if live.process == "gone":
        problems.append(f"down: pid {live.pid} is not running")
    elif live.process == "recycled":
        problems.append(f"down: pid {live.pid} is another process now")
    elif not live.alive:
        problems.append(
            f"down: no status.json written for {_age_s(live.written_age_s)} (another pid namespace)"
        )
    if live.written_age_s > max_stale_s:
        problems.append(
            f"stale: status.json written {_age_s(live.written_age_s)} ago (over {max_stale_s:g} s)"
        )
    if live.link == "disconnected" and live.link_for_s is not None and live.link_for_s > max_disconnected_s:
        why = f": {live.link_error}" if live.link_error else ""
        problems.append(f"disconnected for {_age_s(live.link_for_s)} (over {max_disconnected_s:g} s){why}")
    return problems


def _age_s(seconds: float) -> str:
    return _age(int(seconds * 1000))


def _age(ms: int) -> str:
    s = ms // 1000
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _live_lines(live: Liveness) -> list[str]:
    version = f", bcd {live.version}" if live.version else ""
    written = _age_s(live.written_age_s)
    if live.process == "running":
        head = f"node: up (pid {live.pid}{version}); status written {written} ago"
    elif live.process == "recycled":
        head = f"node: DOWN (pid {live.pid} is another process now); last status {written} ago"
    elif live.process == "foreign":
        state = "up" if live.alive else "DOWN"
        head = (
            f"node: {state} (pid {live.pid} in another pid namespace: judged by status.json's age{version});"
            f" status written {written} ago"
        )
    else:
        head = f"node: DOWN (pid {live.pid} is not running); last status {written} ago"
    lines = [head]
    # A stopped node's session and passes are history: shown as last known, with no future times.
    was = "" if live.alive else "last known "
    if live.link:
        to = f" {'to' if live.link == 'connected' else 'from'} {live.endpoint}" if live.endpoint else ""
        since = f" for {_age_s(live.link_for_s)}" if live.link_for_s is not None and live.alive else ""
        text = f"{was}session: {live.link}{to}{since}"
        if live.link == "connected":
            beat = "none yet" if live.heartbeat_age_s is None else f"{_age_s(live.heartbeat_age_s)} ago"
            text += f"; last heartbeat {beat}"
        else:
            if live.link_error:
                text += f"; last error: {live.link_error}"
            if live.retry_in_s is not None and live.alive:
                text += f"; attempt {live.attempts + 1} in {_age_s(live.retry_in_s)}"
        lines.append(text)
    if live.link or live.last_pass_age_s is not None:  # `bcd node` wrote its liveness
        last = "none yet" if live.last_pass_age_s is None else f"{_age_s(live.last_pass_age_s)} ago"
        text = f"{was}converge: last pass {last}"
        if live.next_pass_in_s is not None and live.alive:
            text += f"; next pass in {_age_s(live.next_pass_in_s)} ({live.next_pass_reason})"
        lines.append(text)
    return lines


def render(snap: StatusSnapshot, *, now_wall: float | None = None) -> str:
    """The human view: version, liveness, generations, sections, conditions, holders."""
    lines: list[str] = [f"bcd {VERSION}; node {node_version(snap) or 'version unknown'}"]
    st = snap.status
    live = snap.live
    if st is None and snap.status_problem:
        lines.append(f"node: no status: {snap.status_problem}")
    elif st is None:
        # The file read: under --root a config's data_dir is the simulated host's, which surprises.
        where = f": {Path(snap.data_dir) / 'status.json'} does not exist" if snap.data_dir else ""
        lines.append(f"node: no status published yet{where} (is bcd node running with this data_dir?)")
    else:
        now = time.time() if now_wall is None else now_wall
        if live is not None:
            lines.extend(_live_lines(live))
        verdict = "converged" if st.converged else "settled" if st.settled else "converging"
        if live is not None and not live.alive:
            verdict = f"last known: {verdict}"
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
            if s.state == "PROGRESSING" and live is not None and live.alive:
                when = (
                    f"in {_age_s(live.next_pass_in_s)}"
                    if live.next_pass_in_s is not None
                    else "at the next pass"
                )
                lines.append(f"{'':<28}next retry {when}, because {s.reason or 'it is not done'}")
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
            lines.append(f"{index:<5}{device:<58}{r.detail:<14}{r.holders()}")
        if not snap.holds.rows:
            lines.append("(no GPUs listed and no holds)")
        for alloc in snap.holds.unparseable:
            lines.append(f"! /etc/cdi/bcd-{alloc}.json does not parse: its GPUs are unknown to bcd status")
        for err in snap.holds.inventory_errors:
            lines.append(f"! inventory: {err}")
    for err in snap.errors:
        if err != snap.status_problem:  # already on the node line
            lines.append(f"! {err}")
    # No trailing blanks (a section with no reason ended in two): what docs/operations.md shows.
    # Every line carries text the node, a tool or the control plane chose: none reaches the terminal raw.
    return "\n".join(shown(line).rstrip() for line in lines) + "\n"


def node_version(snap: StatusSnapshot) -> str | None:
    """The version of the bcd node that wrote the status (None: no status, or a node too old to say)."""
    value = snap.status.extra.get("version") if snap.status is not None else None
    return value if isinstance(value, str) else None


def to_json(snap: StatusSnapshot) -> dict[str, object]:
    doc: dict[str, object] = {
        "version": VERSION,
        "node_version": node_version(snap),
        "status": snap.status.to_json() if snap.status else None,
        "errors": list(snap.errors),
        "liveness": snap.live.to_json() if snap.live else None,
    }
    if snap.holds is not None:
        doc["holders"] = [
            {"gpu_index": r.gpu_index, "device": r.device, "device_class": r.kind, "detail": r.detail,
             "holder": r.holder or None, "instance": r.instance or None}
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


_LIVE_PREFIXES = ("node:", "session:", "converge:", "last known ")


def _stable(text: str) -> str:
    # Lines with ages ("updated N s ago", "for 5s", "next retry in 3s") change every round: compare
    # without them. The liveness lines all carry ages; a section line never starts with their prefixes.
    return "\n".join(
        line
        for line in text.splitlines()
        if "ago" not in line
        and " for " not in line
        and not line.startswith(_LIVE_PREFIXES)
        and not line.lstrip().startswith("next retry ")
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_shared.subcommands import non_negative_float, positive_float, root_dir

    from bcd_agent.config import add_config_argument

    add_config_argument(parser)
    parser.add_argument("--data-dir", default=None, help="the node's data_dir (default: config's)")
    parser.add_argument(
        "--root", default="/", type=root_dir, help="the directory standing for / (a simulated host)"
    )
    parser.add_argument("--no-holds", action="store_true", help="skip reading the holds and GPUs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--watch", action="store_true", help="a live view, redrawn every --interval seconds")
    parser.add_argument(
        "--interval", type=positive_float, default=None, help="seconds between redraws (--watch; default 1)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="probe: one line, exit 1 when the node is down, stale or disconnected too long",
    )
    parser.add_argument(
        "--max-disconnected",
        type=non_negative_float,
        default=None,
        metavar="N",
        help=f"--check: seconds the session may be down (default {DEFAULT_MAX_DISCONNECTED_S})",
    )
    parser.add_argument(
        "--max-stale",
        type=non_negative_float,
        default=None,
        metavar="N",
        help=f"--check: seconds status.json may be old (default {DEFAULT_MAX_STALE_S}; rewritten every 10)",
    )


def _refuse_mixed_flags(args: argparse.Namespace) -> None:
    """Flags that would be silently ignored in the mode chosen are a usage error (64), naming both."""
    from bcd_shared.subcommands import EX_USAGE, CliError

    def given(flag: str) -> bool:
        return getattr(args, flag.lstrip("-").replace("-", "_"), None) not in (None, False)

    # --check reads no holds, so --no-holds (the DaemonSet's probes give it) and --root are harmless.
    for mode, other in (("--check", "--json"), ("--check", "--watch"), ("--watch", "--json")):
        if given(mode) and given(other):
            raise CliError(f"{mode} and {other} do not go together", EX_USAGE)
    for flag in ("--max-disconnected", "--max-stale"):
        if given(flag) and not args.check:
            raise CliError(f"{flag} applies to --check only", EX_USAGE)
    if given("--interval") and not args.watch:
        raise CliError("--interval applies to --watch only", EX_USAGE)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from bcd_shared.simroot import SimHostMissing
    from bcd_shared.subcommands import EX_USAGE, CliError

    _refuse_mixed_flags(args)

    from bcd_agent.config import config_of
    from bcd_agent.plan import host_system

    stream = out or sys.stdout
    config = config_of(args)
    data_dir = args.data_dir or config.data_dir
    if args.data_dir is None and args.root != "/":
        # The config's data_dir is a host path: under --root DIR it is DIR's, as `bcd doctor --root` reads it.
        data_dir = str(Path(args.root) / config.data_dir.lstrip("/"))
    if args.check:
        snap = snapshot(data_dir, None)
        problems = check(
            snap,
            max_disconnected_s=(
                DEFAULT_MAX_DISCONNECTED_S if args.max_disconnected is None else args.max_disconnected
            ),
            max_stale_s=DEFAULT_MAX_STALE_S if args.max_stale is None else args.max_stale,
        )
        if problems:
            stream.write("FAIL: " + shown("; ".join(problems)) + "\n")
            return 1
        assert snap.live is not None
        link = f", {snap.live.link}" if snap.live.link else ""
        stream.write(f"ok: pid {snap.live.pid} up{link}, status {_age_s(snap.live.written_age_s)} old\n")
        return 0
    try:
        system = None if args.no_holds else host_system(args.root)
    except SimHostMissing as e:
        raise CliError(str(e), EX_USAGE) from None

    def take() -> StatusSnapshot:
        return snapshot(data_dir, system)

    if args.watch:
        try:
            interval = 1.0 if args.interval is None else args.interval
            snap = watch(take, stream, interval=max(0.1, interval), tty=stream.isatty())
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
