"""`bcd journal`: inspect the node's journal (data_dir/journal.db) without changing it.

Shows the meta part (journal id, node id, event sequence and cumulative ack, last epoch, applied
generation, server time mark), the stored spec (generation, spec_hash, size, signed or not, the
SHA-256 of the exact stored bytes), every command with its state and outcome, the unacked results,
and the unacked events (seq, class, type, size). `--json` prints one JSON object.

The journal is opened READ-ONLY through SQLite (`mode=ro`), without the node's data_dir lock
(journal.lock). A running node keeps its connection in SQLite's EXCLUSIVE locking mode (journal/_store.py),
so no other connection can read the file while it runs; then `bcd journal` reads a snapshot instead:
it copies journal.db and its WAL into a private temporary directory (0700, removed afterwards) and
opens the copy. WAL recovery on the copy keeps exactly the transactions whose frames were complete
when copied (SQLite checks each frame's checksum), so the snapshot is a consistent past state; if a
checkpoint ran during the copy and the copy fails `PRAGMA quick_check`, the copy is taken again (3
tries). The output says when it is such a snapshot. Nothing is ever written to the node's files.
Payloads and signatures are never printed (sizes and digests only). A journal with another schema
version is refused with a message.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from attrs import asdict, frozen
from bcd_shared.shown import shown

from bcd_agent.journal._schema import (
    DB_NAME,
    K_ACKED_SEQ,
    K_APPLIED_GEN,
    K_CREATED_AT,
    K_JOURNAL_ID,
    K_LAST_EPOCH,
    K_NEXT_SEQ,
    K_NODE_ID,
    K_SERVER_MARK,
    SCHEMA_VERSION,
)

EVENT_CLASSES = {0: "metric", 1: "transition", 2: "result"}


class JournalReadError(Exception):
    def __init__(self, message: str, code: int = 65) -> None:  # EX_DATAERR: it is there, but refused
        super().__init__(message)
        self.code = code


@frozen
class CommandRow:
    id: str
    kind: str
    state: str
    outcome: str | None
    code: str | None
    accepted_at: float
    updated_at: float
    finished_at: float | None
    acked: bool
    retry_safe: bool
    self_terminating: bool
    attested: bool


@frozen
class EventRow:
    seq: int
    event_class: str
    type: str
    size: int
    created_at: float


@frozen
class SpecRow:
    generation: int
    spec_hash: str
    size: int
    sha256: str
    signed: bool


@frozen
class JournalView:
    path: str
    schema_version: int
    meta: Mapping[str, object]
    spec: SpecRow | None
    commands: tuple[CommandRow, ...]
    events: tuple[EventRow, ...]
    snapshot: bool = False  # read from a copy: a running node holds the journal

    @property
    def unacked_results(self) -> tuple[CommandRow, ...]:
        return tuple(c for c in self.commands if not c.acked and c.state in ("done", "cancelled", "rejected"))

    def to_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for c in self.commands:
            counts[c.state] = counts.get(c.state, 0) + 1
        return {
            "path": self.path,
            "schema_version": self.schema_version,
            "snapshot": self.snapshot,
            "meta": dict(self.meta),
            "spec": asdict(self.spec) if self.spec else None,
            "commands": [asdict(c) for c in self.commands],
            "command_states": counts,
            "unacked_results": [c.id for c in self.unacked_results],
            "unacked_events": [
                {
                    "seq": e.seq,
                    "class": e.event_class,
                    "type": e.type,
                    "size": e.size,
                    "created_at": e.created_at,
                }
                for e in self.events
            ],
        }


def _connect(path: Path, *, read_only: bool) -> sqlite3.Connection:
    if not path.exists():
        raise JournalReadError(f"{path}: no journal here (has bcd node run with this data_dir?)", 66)
    try:
        # The snapshot copy is opened read-write so that SQLite can recover its WAL; it is ours alone.
        mode = "?mode=ro" if read_only else ""
        conn = sqlite3.connect(f"{path.resolve().as_uri()}{mode}", uri=True, timeout=0.5)
        if read_only:
            conn.execute("PRAGMA query_only = ON")
        return conn
    except sqlite3.Error as e:
        raise JournalReadError(f"{path}: cannot be opened read-only: {e}") from None


def read_journal(data_dir: str | Path, *, command_limit: int = 1000, event_limit: int = 1000) -> JournalView:
    """A consistent read-only view of data_dir/journal.db (a snapshot copy while a node holds it)."""
    path = Path(data_dir) / DB_NAME
    try:
        return _read(path, path, command_limit, event_limit, snapshot=False)
    except _Locked:
        pass
    last = ""
    for _ in range(3):
        with tempfile.TemporaryDirectory(prefix="bcd-journal-") as tmp:
            copy = Path(tmp) / DB_NAME
            try:
                shutil.copyfile(path, copy)
                wal = path.with_name(DB_NAME + "-wal")
                if wal.exists():
                    shutil.copyfile(wal, copy.with_name(DB_NAME + "-wal"))
            except OSError as e:
                raise JournalReadError(f"{path}: the node holds it, and copying it failed: {e}") from None
            try:
                return _read(copy, path, command_limit, event_limit, snapshot=True)
            except (JournalReadError, _Locked) as e:
                last = str(e)
    raise JournalReadError(f"{path}: the node holds it, and no consistent snapshot could be taken ({last})")


class _Locked(Exception):
    pass


def _read(path: Path, shown: Path, command_limit: int, event_limit: int, *, snapshot: bool) -> JournalView:
    conn = _connect(path, read_only=not snapshot)
    try:
        if snapshot and conn.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise JournalReadError(f"{shown}: the snapshot copy fails quick_check")
        conn.execute("BEGIN")  # one snapshot for every read below
        try:
            (version,) = conn.execute("SELECT version FROM schema_version").fetchone()
        except sqlite3.OperationalError as e:
            if "locked" in str(e) and not snapshot:
                raise _Locked(str(e)) from None
            raise JournalReadError(f"{shown}: not a bcd journal ({e})") from None
        except (sqlite3.Error, TypeError) as e:
            raise JournalReadError(f"{shown}: not a bcd journal ({e})") from None
        if version != SCHEMA_VERSION:
            raise JournalReadError(f"{shown}: schema version {version}, this bcd reads {SCHEMA_VERSION}")
        raw = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        meta = {
            "journal_id": str(raw.get(K_JOURNAL_ID, "")),
            "node_id": str(raw.get(K_NODE_ID, "")),
            "next_event_seq": int(raw.get(K_NEXT_SEQ, 1)),
            "acked_event_seq": int(raw.get(K_ACKED_SEQ, 0)),
            "last_epoch": int(raw.get(K_LAST_EPOCH, 0)),
            "applied_generation": int(raw.get(K_APPLIED_GEN, 0)),
            "server_time_mark": float(raw.get(K_SERVER_MARK, 0.0)),
            "created_at": float(raw.get(K_CREATED_AT, 0.0)),
        }
        spec = None
        row = conn.execute("SELECT generation, body, spec_hash, signature FROM spec WHERE one = 1").fetchone()
        if row is not None:
            generation, body, spec_hash, signature = row
            spec = SpecRow(
                int(generation), str(spec_hash), len(body), hashlib.sha256(body).hexdigest(), bool(signature)
            )
        commands = tuple(
            CommandRow(
                id=r[0],
                kind=r[1],
                state=r[2],
                outcome=r[3],
                code=r[4],
                accepted_at=r[5],
                updated_at=r[6],
                finished_at=r[7],
                acked=bool(r[8]),
                retry_safe=bool(r[9]),
                self_terminating=bool(r[10]),
                attested=bool(r[11]),
            )
            for r in conn.execute(
                "SELECT id, kind, state, outcome, code, accepted_at, updated_at, finished_at, acked,"
                " retry_safe, self_terminating, attested FROM commands ORDER BY accepted_at, id LIMIT ?",
                (command_limit,),
            )
        )
        events = tuple(
            EventRow(int(r[0]), EVENT_CLASSES.get(int(r[1]), str(r[1])), str(r[2]), int(r[3]), float(r[4]))
            for r in conn.execute(
                "SELECT seq, class, type, size, created_at FROM events ORDER BY seq LIMIT ?", (event_limit,)
            )
        )
        conn.execute("COMMIT")
    except sqlite3.OperationalError as e:
        if "locked" in str(e) and not snapshot:
            raise _Locked(str(e)) from None
        raise JournalReadError(f"{shown}: {e}") from None
    except sqlite3.Error as e:
        raise JournalReadError(f"{shown}: {e}") from None
    finally:
        conn.close()
    return JournalView(str(shown), int(version), meta, spec, commands, events, snapshot)


def render(view: JournalView) -> str:
    m = view.meta
    lines = [
        f"journal   {view.path} (schema {view.schema_version})"
        + (" - a snapshot: a running node holds it" if view.snapshot else ""),
        f"id        {m['journal_id']}",
        f"node      {m['node_id'] or '(not joined)'}",
        f"events    next seq {m['next_event_seq']}, acked through {m['acked_event_seq']},"
        f" {len(view.events)} unacked",
        f"epoch     {m['last_epoch']}",
        f"applied   generation {m['applied_generation']}",
        f"time mark {m['server_time_mark']:.3f}",
    ]
    if view.spec is None:
        lines.append("spec      none stored (the session asks with SpecRequest NO_SPEC)")
    else:
        s = view.spec
        lines.append(
            f"spec      generation {s.generation}, hash {s.spec_hash}, {s.size} bytes"
            f" ({'signed' if s.signed else 'unsigned'}), sha256 {s.sha256}"
        )
    lines.append("")
    lines.append(f"COMMANDS ({len(view.commands)})")
    for c in view.commands:
        result = f" {c.outcome}" + (f" {c.code}" if c.code else "") if c.outcome else ""
        ack = "" if c.state in ("accepted", "running") else (" acked" if c.acked else " UNACKED")
        lines.append(f"  {c.id:<38} {c.kind:<22} {c.state:<10}{result}{ack}")
    lines.append("")
    lines.append(f"UNACKED EVENTS ({len(view.events)})")
    for e in view.events:
        lines.append(f"  {e.seq:>6} {e.event_class:<10} {e.type:<24} {e.size} bytes")
    # The journal holds what the control plane and the node's tools said: escaped, never raw.
    return "\n".join(shown(line) for line in lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_shared.subcommands import non_negative_int

    from bcd_agent.config import add_config_argument

    add_config_argument(parser)
    parser.add_argument("--data-dir", default=None, help="the node's data_dir (default: config's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--limit", type=non_negative_int, default=1000, help="at most this many commands and events"
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from bcd_shared.subcommands import CliError

    from bcd_agent.config import config_of

    stream = out or sys.stdout
    config = config_of(args)
    try:
        view = read_journal(
            args.data_dir or config.data_dir, command_limit=args.limit, event_limit=args.limit
        )
    except JournalReadError as e:
        raise CliError(str(e), e.code) from None
    if args.json:
        json.dump(view.to_json(), stream, sort_keys=True)
        stream.write("\n")
    else:
        stream.write(render(view))
    return 0
