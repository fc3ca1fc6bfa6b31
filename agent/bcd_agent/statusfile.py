"""The node's status published locally: `data_dir/status.json`, for `bcd status` and `bcd sim`.

The converge runner publishes a NodeStatus to its StatusCell after every pass; `serve(cell, data_dir)`
(a trio service: `await nursery.start(statusfile.serve, runner.status, data_dir)`) writes each new
one to `status.json`, coalesced latest-wins like the session's reports: a status published while a
write is under way is written next, the ones in between are skipped.

The file is written atomically (temporary file, fsync, rename, fsync of the directory), mode 0640
(the node's account and its group, which operators are in; nothing in it is secret: generations,
section states, conditions). It carries what a StatusReport carries plus when it was written:
conditions carry `age_ms` at `written_at`, and the reader adds the wall time since (`read_status`),
so an age keeps growing while the node is quiet. The format is versioned (`format`); a reader refuses
a file of another format or one that does not parse, with a message naming the file.

Liveness (`bcd status`, `bcd status --check`; docs/operations.md): the file is rewritten at least every
`REFRESH_S` even when nothing changed, so its `written_at` ages only when the node stops writing (stale);
`pid` with `pid_start` (the process's start time in clock ticks since boot, /proc/PID/stat field 22)
tells a live node from a stopped one, and from an unrelated process that got the same pid, where the
reader shares the node's pid namespace (`pid_ns`; a host reading a container's node judges by age); `node`
(written by `bcd node`) carries the session's link state and since when, the last heartbeat, and the
last and next converge pass with the next pass's reason, all as wall times.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import trio
from attrs import field, frozen
from bcd_shared.system import atomic_write
from bcd_shared.version import VERSION

from bcd_agent.converge.status import StatusCell
from bcd_agent.converge.types import NodeStatus

STATUS_FILE = "status.json"
FORMAT = 1
MODE = 0o640

STATE_NAMES = ("CONVERGED", "PROGRESSING", "FAILED", "UNSUPPORTED")
REFRESH_S = 10.0  # status.json is rewritten at least this often while the node runs


def pid_namespace(proc: Path = Path("/proc")) -> str | None:
    """This process's pid namespace ("pid:[4026531836]"), or None where /proc does not say."""
    try:
        return os.readlink(proc / "self/ns/pid")
    except OSError:
        return None


def process_start(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The start time of process `pid` (clock ticks since boot), or None when there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) is in parentheses and may hold spaces or ')': split after the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall
    except (IndexError, ValueError):
        return None


class StatusFileError(ValueError):
    pass


def status_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / STATUS_FILE


def encode(
    status: NodeStatus,
    *,
    now_monotonic: float,
    now_wall: float,
    pid: int,
    extra: Mapping[str, object] | None = None,
) -> bytes:
    """The file's bytes for `status` (sorted keys: equal statuses give equal files)."""
    doc: dict[str, object] = {
        "format": FORMAT,
        "written_at": round(now_wall, 3),
        "pid": pid,
        "version": VERSION,  # the node's bcd version (read back through `extra`)
        "pid_start": process_start(pid),
        "pid_ns": pid_namespace(),
        "status_version": status.version,
        "applied_generation": status.applied_generation,
        "observed_generation": status.observed_generation,
        "spec_hash": status.spec_hash,
        "passes": status.passes,
        "sections": [
            {
                "section": s.section,
                "state": s.state.value,
                "generation": s.generation,
                "reason": s.reason,
                "message": s.message,
            }
            for s in status.sections
        ],
        "conditions": [
            {
                "type": c.type,
                "reason": c.reason,
                "message": c.message,
                "section": c.section,
                "age_ms": c.age_ms,
            }
            for c in status.report_conditions(now_monotonic)
        ],
    }
    if extra:
        doc.update({k: v for k, v in extra.items() if k not in doc})
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()


def write_status(
    data_dir: str | os.PathLike[str],
    status: NodeStatus,
    *,
    now_monotonic: float,
    now_wall: float | None = None,
    extra: Mapping[str, object] | None = None,
) -> Path:
    """Write `status` to data_dir/status.json atomically (0640)."""
    path = status_path(data_dir)
    data = encode(
        status,
        now_monotonic=now_monotonic,
        now_wall=time.time() if now_wall is None else now_wall,
        pid=os.getpid(),
        extra=extra,
    )
    atomic_write(path, data, MODE)
    return path


@frozen
class SectionView:
    section: str
    state: str
    generation: int
    reason: str
    message: str


@frozen
class ConditionView:
    type: str
    reason: str
    message: str
    section: str
    age_ms: int


@frozen
class StatusView:
    """status.json as read back (ages brought up to the reader's wall clock)."""

    written_at: float
    pid: int
    status_version: int
    applied_generation: int
    observed_generation: int
    spec_hash: str
    passes: int
    sections: tuple[SectionView, ...]
    conditions: tuple[ConditionView, ...]
    extra: Mapping[str, object] = field(factory=dict)
    pid_start: int | None = None
    pid_ns: str | None = None  # the node's pid namespace: its pid means nothing in another one

    @property
    def settled(self) -> bool:
        """No section PROGRESSING and observed has reached applied (a spec is held)."""
        return (
            self.applied_generation > 0
            and self.observed_generation >= self.applied_generation
            and all(s.state != "PROGRESSING" for s in self.sections)
        )

    @property
    def converged(self) -> bool:
        """Settled with every section CONVERGED (none FAILED or UNSUPPORTED)."""
        return self.settled and all(s.state == "CONVERGED" for s in self.sections)

    def to_json(self) -> dict[str, object]:
        return {
            "written_at": self.written_at,
            "pid": self.pid,
            "status_version": self.status_version,
            "applied_generation": self.applied_generation,
            "observed_generation": self.observed_generation,
            "spec_hash": self.spec_hash,
            "passes": self.passes,
            "sections": [
                {"section": s.section, "state": s.state, "generation": s.generation, "reason": s.reason,
                 "message": s.message}
                for s in self.sections
            ],
            "conditions": [
                {"type": c.type, "reason": c.reason, "message": c.message, "section": c.section,
                 "age_ms": c.age_ms}
                for c in self.conditions
            ],
        }  # fmt: skip


def _get(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = doc.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise StatusFileError(f"{where}: {key}: missing or not {getattr(kind, '__name__', kind)}")
    return value


def decode(data: bytes, *, source: str = STATUS_FILE, now_wall: float | None = None) -> StatusView:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise StatusFileError(f"{source}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise StatusFileError(f"{source}: not a JSON object")
    if "format" not in doc:
        raise StatusFileError(f'{source}: has no "format" key (not a status.json bcd node wrote)')
    if doc.get("format") != FORMAT:
        raise StatusFileError(
            f"{source}: format {doc.get('format')!r} is not {FORMAT} (a bcd of another version?)"
        )
    written = float(_get(doc, "written_at", (int, float), source))
    now = time.time() if now_wall is None else now_wall
    grown_ms = max(0, int((now - written) * 1000))
    sections = []
    for i, s in enumerate(_get(doc, "sections", list, source)):
        w = f"{source}: sections[{i}]"
        if not isinstance(s, dict):
            raise StatusFileError(f"{w}: not an object")
        state = _get(s, "state", str, w)
        if state not in STATE_NAMES:
            raise StatusFileError(f"{w}: state {state!r} is not one of {STATE_NAMES}")
        sections.append(
            SectionView(
                _get(s, "section", str, w), state, _get(s, "generation", int, w), _get(s, "reason", str, w),
                _get(s, "message", str, w),
            )
        )  # fmt: skip
    conditions = []
    for i, c in enumerate(_get(doc, "conditions", list, source)):
        w = f"{source}: conditions[{i}]"
        if not isinstance(c, dict):
            raise StatusFileError(f"{w}: not an object")
        conditions.append(
            ConditionView(
                _get(c, "type", str, w), _get(c, "reason", str, w), _get(c, "message", str, w),
                _get(c, "section", str, w), _get(c, "age_ms", int, w) + grown_ms,
            )
        )  # fmt: skip
    known = {
        "format", "written_at", "pid", "status_version", "applied_generation", "observed_generation",
        "spec_hash", "passes", "sections", "conditions", "pid_start", "pid_ns",
    }  # fmt: skip
    pid_ns = doc.get("pid_ns")
    if pid_ns is not None and not isinstance(pid_ns, str):
        raise StatusFileError(f"{source}: pid_ns: not a string")
    pid_start = doc.get("pid_start")
    if pid_start is not None and (isinstance(pid_start, bool) or not isinstance(pid_start, int)):
        raise StatusFileError(f"{source}: pid_start: not an integer")
    return StatusView(
        written_at=written,
        pid=_get(doc, "pid", int, source),
        status_version=_get(doc, "status_version", int, source),
        applied_generation=_get(doc, "applied_generation", int, source),
        observed_generation=_get(doc, "observed_generation", int, source),
        spec_hash=_get(doc, "spec_hash", str, source),
        passes=_get(doc, "passes", int, source),
        sections=tuple(sections),
        conditions=tuple(conditions),
        extra={k: v for k, v in doc.items() if k not in known},
        pid_start=pid_start,
        pid_ns=pid_ns,
    )


def read_status(data_dir: str | os.PathLike[str], *, now_wall: float | None = None) -> StatusView | None:
    """The node's last published status, or None when it has published none yet."""
    path = status_path(data_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StatusFileError(f"{path}: cannot be read: {e.strerror}") from None
    return decode(data, source=str(path), now_wall=now_wall)


async def _newer_or_poke(
    cell: StatusCell, version: int, pokes: trio.abc.ReceiveChannel[None] | None, timeout_s: float
) -> NodeStatus | None:
    """A status newer than `version`, or None after a poke or `timeout_s`."""
    newer: list[NodeStatus] = []
    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as race:

            async def wait_status() -> None:
                newer.append(await cell.wait_newer(version))
                race.cancel_scope.cancel()

            async def wait_poke() -> None:
                assert pokes is not None
                await pokes.receive()
                race.cancel_scope.cancel()

            race.start_soon(wait_status)
            if pokes is not None:
                race.start_soon(wait_poke)
    return newer[0] if newer else None


async def serve(
    cell: StatusCell,
    data_dir: str | os.PathLike[str],
    *,
    clock: Callable[[], float] = trio.current_time,
    extra: Callable[[], Mapping[str, object]] | None = None,
    refresh_s: float = REFRESH_S,
    pokes: trio.abc.ReceiveChannel[None] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Write every new status the cell publishes to data_dir/status.json (latest wins), and the latest
    again every `refresh_s` and on each message of `pokes` (liveness: written_at, the session's link
    changed, the next pass). A failed write is logged once per distinct error; the service keeps
    running and writes the next status."""
    import logging

    log = logging.getLogger("bcd.status")
    task_status.started()
    version = 0
    last_error = ""
    while True:
        newer = await _newer_or_poke(cell, version, pokes, refresh_s)
        status_now = newer if newer is not None else cell.latest()
        if status_now is None:
            continue
        status = status_now
        version = status.version
        now = clock()
        more = extra() if extra is not None else None
        try:
            await trio.to_thread.run_sync(
                functools.partial(write_status, data_dir, status, now_monotonic=now, extra=more)
            )
            last_error = ""
        except OSError as e:
            if str(e) != last_error:
                log.warning("status: cannot write %s: %s", status_path(data_dir), e)
            last_error = str(e)
