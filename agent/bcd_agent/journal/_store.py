"""The journal store: one SQLite file (`journal.db`) under data_dir, WAL with synchronous=FULL.

Synchronous by design: every public method runs one transaction and returns only once it is durable.
Callers on trio run it with `trio.to_thread.run_sync` (the store serialises calls with a lock), or call
it directly where a few milliseconds of blocking are acceptable.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType

import attrs

from bcd_agent.journal import _files
from bcd_agent.journal._resolve import resolve_entry, settlement
from bcd_agent.journal._schema import (
    DB_NAME,
    DDL,
    K_ACKED_SEQ,
    K_APPLIED_GEN,
    K_CREATED_AT,
    K_EVENT_KEY,
    K_JOURNAL_ID,
    K_LAST_EPOCH,
    K_NEXT_SEQ,
    K_NODE_ID,
    K_SERVER_MARK,
    LOCK_NAME,
    MIGRATIONS,
    SCHEMA_VERSION,
    TABLES,
)
from bcd_agent.journal._types import (
    MAX_EVENT_BYTES,
    MAX_EXEC_TICKETS,
    MAX_MESSAGE_CHARS,
    MAX_REFUSED_ROWS,
    MAX_UNACKED_EVENTS,
    RETENTION_S,
    WELCOME_SLACK_S,
    Action,
    Attester,
    BoundError,
    CommandEntry,
    CommandFlags,
    CommandResult,
    CommandState,
    Completion,
    DataDirFull,
    Event,
    EventClass,
    EventsAppended,
    EventStats,
    JournalError,
    JournalFull,
    JournalIOError,
    NewCommand,
    NewEvent,
    OpenReport,
    Outcome,
    RefusalsFull,
    Resolution,
    StateError,
    StoredSpec,
    TicketRefused,
    WelcomeRefused,
)

log = logging.getLogger(__name__)

_COLS = (
    "id, kind, retry_safe, self_terminating, attested, state, incarnation, boot_id, accepted_at, updated_at,"
    " body, signature, outcome, code, result, result_boot_id, node_sig, previous_boot_id, finished_at, acked,"
    " attestation, message, envelope_sha256"
)
_SQL_GET = f"SELECT {_COLS} FROM commands WHERE id = ?"  # noqa: S608 - constant column list
_SQL_INSERT_ACCEPTED = (
    "INSERT INTO commands (id, kind, retry_safe, self_terminating, attested, state, incarnation, boot_id,"
    " accepted_at, updated_at, body, signature) VALUES (?, ?, ?, ?, ?, 'accepted', ?, ?, ?, ?, ?, ?)"
)
_SQL_TAKE_OVER = (
    "UPDATE commands SET state = 'accepted', incarnation = ?, boot_id = ?, accepted_at = ?, updated_at = ?,"
    " body = ?, signature = ? WHERE id = ?"
)
_SQL_RUNNING = (
    "UPDATE commands SET state = 'running', boot_id = ?, updated_at = ?"
    " WHERE id = ? AND state = 'accepted' AND incarnation = ?"
)
_SQL_FINISH = (
    "UPDATE commands SET state = ?, updated_at = ?, outcome = ?, code = ?, result = ?, result_boot_id = ?,"
    " node_sig = ?, previous_boot_id = ?, finished_at = ?, acked = 0, attestation = ?, message = ?"
    " WHERE id = ?"
)
_SQL_INSERT_FINISHED = (
    "INSERT INTO commands (id, kind, retry_safe, self_terminating, attested, state, incarnation, boot_id,"
    " accepted_at, updated_at, body, signature, outcome, code, result, result_boot_id, node_sig,"
    " previous_boot_id, finished_at, acked, attestation, message, envelope_sha256)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?)"
)
# Rows on the gateway's word alone: refusals and cancels of commands never accepted, kept without a body
# (an accepted command always has one). Bounded by `max_refused` (MAX_REFUSED_ROWS).
_REFUSED_ROWS = "body = x'' AND state IN ('cancelled', 'rejected')"
_SQL_COUNT_REFUSED = f"SELECT count(*) FROM commands WHERE {_REFUSED_ROWS}"  # noqa: S608 - constant
_SQL_OLDEST_ACKED_REFUSED = (
    f"SELECT id FROM commands WHERE {_REFUSED_ROWS} AND acked = 1 ORDER BY finished_at, id LIMIT ?"  # noqa: S608
)
_SQL_UNSETTLED = f"SELECT {_COLS} FROM commands WHERE state IN ('accepted', 'running') AND incarnation != ?"  # noqa: S608
_SQL_UNACKED_RESULTS = (
    f"SELECT {_COLS} FROM commands WHERE acked = 0"  # noqa: S608
    " AND state IN ('done', 'cancelled', 'rejected') ORDER BY finished_at, id"
)
# Acks kept by `ack_results(defer=True)` are written at once beyond this many.
MAX_PENDING_ACKS = 1000
_SQL_ACK_RESULT = (
    "UPDATE commands SET acked = 1 WHERE id = ? AND acked = 0 AND state IN ('done', 'cancelled', 'rejected')"
)
_SQL_SWEEP_DONE = (
    "SELECT id, body FROM commands WHERE state IN ('done', 'cancelled', 'rejected') AND acked = 1"
    " AND finished_at < ?"
)
_SQL_SWEEP_LEFT = (
    "SELECT id, body FROM commands WHERE state IN ('accepted', 'running') AND incarnation != ?"
    " AND updated_at < ?"
)
_SQL_DELETE_COMMAND = "DELETE FROM commands WHERE id = ?"
_SQL_INSERT_EVENT = (
    "INSERT INTO events (seq, class, type, payload, size, created_at) VALUES (?, ?, ?, ?, ?, ?)"
)
_SQL_METRICS_OLDEST = "SELECT seq, size FROM events WHERE class = 0 ORDER BY seq"
_SQL_DROP_METRICS = "DELETE FROM events WHERE class = 0 AND seq <= ?"
_SQL_EVENTS_AFTER = (
    "SELECT seq, class, type, payload, created_at FROM events WHERE seq > ? ORDER BY seq LIMIT ?"
)
_SQL_ACKED_STATS = (
    "SELECT count(*), coalesce(sum(size), 0), coalesce(sum(class = 0), 0),"
    " coalesce(sum(CASE WHEN class = 0 THEN size ELSE 0 END), 0) FROM events WHERE seq <= ?"
)
_SQL_DELETE_EVENTS = "DELETE FROM events WHERE seq <= ?"
_SQL_SET_META = "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)"
_SQL_GET_META = "SELECT value FROM meta WHERE key = ?"
_SQL_DELETE_META = "DELETE FROM meta WHERE key = ?"
# LIKE with `_` and `%` in a prefix matches more than it should: the caller filters by startswith.
_SQL_EVENT_KEYS = "SELECT key, value FROM meta WHERE key LIKE ?"
_SQL_TICKET_GET = "SELECT expires_at FROM exec_tickets WHERE jti = ?"
_SQL_TICKET_PUT = "INSERT OR REPLACE INTO exec_tickets (jti, expires_at) VALUES (?, ?)"
_SQL_TICKET_PURGE = "DELETE FROM exec_tickets WHERE expires_at <= ?"
_SQLITE_FULL = 13  # SQLITE_FULL: the file system (or the db's size limit) is full
_SQLITE_IOERR = 10  # SQLITE_IOERR and its extended codes (low byte 10): the storage failed

_Row = tuple[
    str, str, int, int, int, str, str, str, float, float, bytes, bytes,
    str | None, str | None, bytes | None, str | None, bytes | None, str | None, float | None, int,
    bytes | None, str | None, bytes | None,
]  # fmt: skip


class _Corrupt(Exception):
    """The journal on disk failed its integrity or schema check (moved aside on open)."""


def _not_after_s(body: bytes | None) -> float:
    """`CommandBody.not_after` of a stored body in seconds; -inf without a body (a command refused on
    arrival, or cancelled before it was seen: it never ran) or when it names none (it never passes)."""
    if not body:
        return -math.inf
    from bcd_shared import wire  # the journal reads the wire only here, once a day

    try:
        ms = wire.CommandBody.parse(body).not_after
    except Exception:  # a body that does not parse never passed the wire edge: it never ran
        return -math.inf
    return ms / 1000 if ms else -math.inf


def _entry(row: _Row) -> CommandEntry:
    (cid, kind, rs, st, att, state, inc, boot, acc_at, upd_at, body, sig, outcome, code, res, rboot, nsig,
     prev, fin, acked, attestation, message, envelope_sha256) = row  # fmt: skip
    result = None
    if outcome is not None:
        result = CommandResult(
            outcome=Outcome(outcome),
            code=code or "",
            body=res or b"",
            boot_id=rboot or "",
            finished_at=fin if fin is not None else upd_at,
            node_sig=nsig or b"",
            previous_boot_id=prev or "",
            attestation=attestation or b"",
            message=message or "",
        )
    return CommandEntry(
        id=cid,
        kind=kind,
        flags=CommandFlags(retry_safe=bool(rs), self_terminating=bool(st), attested=bool(att)),
        state=CommandState(state),
        incarnation=inc,
        boot_id=boot,
        accepted_at=acc_at,
        updated_at=upd_at,
        body=body,
        signature=sig,
        result=result,
        acked=bool(acked),
        envelope_sha256=envelope_sha256 or b"",
    )


def _check_bound(name: str, value: int, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BoundError(f"{name}: must be an integer, got {value!r}")
    if value < 1:
        raise BoundError(f"{name}: must be at least 1, got {value}")
    if value > limit:
        raise BoundError(f"{name}: {value} is above the contract's limit {limit}; config may only lower it")
    return value


def new_incarnation() -> str:
    return uuid.uuid4().hex


class Journal:
    """bcd's durable memory. Open with `Journal.open(data_dir, boot_id=...)`; see the package docstring."""

    def __init__(  # private: use Journal.open
        self,
        *,
        conn: sqlite3.Connection,
        lock_fd: int,
        path: Path,
        incarnation: str,
        boot_id: str,
        clock: Callable[[], float],
        max_events: int,
        max_bytes: int,
        max_tickets: int,
        report: OpenReport,
        max_refused: int = MAX_REFUSED_ROWS,
    ) -> None:
        self._conn = conn
        self._lock_fd = lock_fd
        self._path = path
        self._incarnation = incarnation
        self._boot_id = boot_id
        self._clock = clock
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._max_tickets = max_tickets
        self._max_refused = max_refused
        self._report = report
        self._attester: Attester | None = None
        self._mutex = threading.RLock()
        self._closed = False
        self._space_ok = True
        self.durable_commits = 0  # fsyncs of the WAL by this process (the command-rate test counts them)
        self._pending_acks: list[str] = []  # `ack_results(defer=True)`, written with the next transaction
        self._unsynced = False
        self.group_commit = False  # set by `open` (see there): off, every write is fsynced when it returns
        self.commits = 0  # commits that `sync()` tracks, and how many of them are known fsynced
        self.synced_through = 0
        # Called with (space_ok, message) when a write fails for a full file system, or succeeds again.
        self.on_space_change: Callable[[bool, str], None] | None = None
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        self._journal_id = str(meta[K_JOURNAL_ID])
        self._node_id = str(meta.get(K_NODE_ID, ""))
        self._next_seq = int(meta[K_NEXT_SEQ])
        self._acked_seq = int(meta.get(K_ACKED_SEQ, 0))
        # Since this process opened the journal (bcd's own metrics, docs/telemetry.md).
        self._events_acked = 0
        self._metrics_dropped = 0
        self._last_epoch = int(meta.get(K_LAST_EPOCH, 0))
        self._applied_gen = int(meta.get(K_APPLIED_GEN, 0))
        self._server_mark = float(meta.get(K_SERVER_MARK, 0.0))
        count, size, m_count, m_size = conn.execute(_SQL_ACKED_STATS, (2**62,)).fetchone()
        self._ev_count, self._ev_bytes = int(count), int(size)
        self._m_count, self._m_bytes = int(m_count), int(m_size)
        self._tickets = int(conn.execute("SELECT count(*) FROM exec_tickets").fetchone()[0])
        # Rows on the gateway's word alone (`_REFUSED_ROWS`); `_refused_delta` is the change the open
        # transaction makes to it, applied when it commits.
        self._refused = int(conn.execute(_SQL_COUNT_REFUSED).fetchone()[0])
        self._refused_delta = 0

    # ------------------------------------------------------------------ open / close

    @classmethod
    def open(
        cls,
        data_dir: str | os.PathLike[str],
        *,
        boot_id: str,
        incarnation: str | None = None,
        max_events: int = MAX_UNACKED_EVENTS,
        max_bytes: int = MAX_EVENT_BYTES,
        max_tickets: int = MAX_EXEC_TICKETS,
        clock: Callable[[], float] = time.time,
        group_commit: bool = False,
        max_refused: int = MAX_REFUSED_ROWS,
    ) -> Journal:
        """Open (or create) `data_dir/journal.db`.

        `group_commit` off (the default): every write is fsynced before it returns, as DLV-JRN-15 says,
        whatever `durable` a caller passes. On (`[journal] group_commit`): the writes callers mark
        `durable=False` reach the WAL at once and are fsynced together by `sync()` (docs/journal.md).

        The bounds may be lowered, never raised (BoundError). A journal that fails `PRAGMA quick_check`
        or the schema check is moved aside (never deleted) and a new one, with a new journal_id, starts;
        `journal.report` says so. `incarnation` defaults to a fresh random id (one per process start).
        """
        max_events = _check_bound("max_events", max_events, MAX_UNACKED_EVENTS)
        max_bytes = _check_bound("max_bytes", max_bytes, MAX_EVENT_BYTES)
        max_tickets = _check_bound("max_tickets", max_tickets, MAX_EXEC_TICKETS)
        max_refused = _check_bound("max_refused", max_refused, MAX_REFUSED_ROWS)
        if not boot_id:
            raise JournalError("boot_id: must be set (the kernel's boot id)")
        data = Path(data_dir)
        _files.prepare_data_dir(data)
        lock_fd = _files.lock_data_dir(data / LOCK_NAME)
        conn: sqlite3.Connection | None = None
        try:
            conn, report = _open_db(data / DB_NAME, clock())
            _files.fix_file_modes(data / DB_NAME)
            journal = cls(
                conn=conn,
                lock_fd=lock_fd,
                path=data / DB_NAME,
                incarnation=incarnation or new_incarnation(),
                boot_id=boot_id,
                clock=clock,
                max_events=max_events,
                max_bytes=max_bytes,
                max_tickets=max_tickets,
                report=report,
                max_refused=max_refused,
            )
            journal.group_commit = group_commit
            return journal
        except BaseException:
            # Close the connection too: left open, its exclusive lock would make the next open in this
            # process find the journal locked and move a healthy journal aside.
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            _files.unlock(lock_fd)
            raise

    def close(self) -> None:
        """Close cleanly (SQLite checkpoints the WAL) and release the data_dir lock."""
        with self._mutex:
            if self._closed:
                return
            try:
                self.flush_acks()
            except JournalError as exc:  # a full or failing disk: they are replayed and acked again
                log.warning("journal: %s: acks not written at close: %s", self._path, exc)
            self._closed = True
            try:
                self._conn.close()
            except sqlite3.Error as exc:  # e.g. the closing checkpoint's fsync failed: nothing to add
                log.warning("journal: %s: closing: %s", self._path, exc)
            finally:
                _files.unlock(self._lock_fd)

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @contextlib.contextmanager
    def _tx(self, durable: bool = True, needs_sync: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction; durable (WAL fsynced) when the block exits without an exception.
        A full file system raises DataDirFull, a storage failure JournalIOError (see `_storage`).

        `durable=False` (synchronous=NORMAL for this commit) is for the writes whose loss in a power cut
        changes no decision (see `mark_running` and `ack_results`): they are written to the WAL at once
        and become durable with the next durable commit, which fsyncs the WAL up to its end.
        `needs_sync=False`: not even `sync()` waits for it (a write whose loss costs nothing)."""
        if not self.group_commit:  # DLV-JRN-15: every write fsynced before it returns
            durable = needs_sync = True
        conn = self._conn
        with self._storage():
            if not durable:
                conn.execute("PRAGMA synchronous=NORMAL")
            try:
                conn.execute("BEGIN IMMEDIATE")
                self._refused_delta = 0
                try:
                    yield conn
                    acks, self._pending_acks = self._pending_acks, []
                    if acks:  # `ack_results(defer=True)`: written with this transaction
                        conn.executemany(_SQL_ACK_RESULT, [(i,) for i in acks])
                    conn.execute("COMMIT")
                    self._refused += self._refused_delta
                except BaseException:
                    if conn.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                    raise
                finally:
                    self._refused_delta = 0
            finally:
                if not durable:
                    conn.execute("PRAGMA synchronous=FULL")
        if durable or needs_sync:
            self._committed(durable)

    def _committed(self, durable: bool) -> None:
        self.commits += 1
        if durable:
            self.durable_commits += 1
            self._unsynced = False  # a durable commit fsyncs the WAL to its end
            self.synced_through = self.commits
        else:
            self._unsynced = True

    @property
    def unsynced(self) -> bool:
        """A commit made with `durable=False` is not yet fsynced (`sync()` makes it so)."""
        return self._unsynced

    def sync(self) -> None:
        """Make every commit so far durable: one fdatasync of the WAL (what synchronous=FULL does at each
        commit), or nothing when nothing is pending. The dispatcher calls it before a side effect and the
        session before anything it writes to the gateway, so the commits made with `durable=False`
        (accepted, outcomes) are durable before they act or are told, one fsync for all of them."""
        with self._mutex:
            if not self._unsynced or self._closed:
                return
            wal = Path(str(self._path) + "-wal")
            try:
                fd = os.open(wal if wal.exists() else self._path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise JournalIOError(f"{wal}: fdatasync: errno {exc.errno} ({exc.strerror})") from exc
            self.durable_commits += 1
            self._unsynced = False
            self.synced_through = self.commits

    @contextlib.contextmanager
    def _mode(self, durable: bool) -> Iterator[None]:
        """synchronous=NORMAL around one autocommit statement when not `durable` (group commit only)."""
        if durable or not self.group_commit:
            yield
            return
        self._conn.execute("PRAGMA synchronous=NORMAL")
        try:
            yield
        finally:
            self._conn.execute("PRAGMA synchronous=FULL")

    @contextlib.contextmanager
    def _storage(self) -> Iterator[None]:
        """Translate SQLite's storage errors and track whether the data_dir has space."""
        try:
            yield
        except sqlite3.OperationalError as exc:
            code = getattr(exc, "sqlite_errorcode", 0)
            name = getattr(exc, "sqlite_errorname", "")
            if code == _SQLITE_FULL:
                self._space(False, f"{self._path}: {name or 'SQLITE_FULL'}: {exc}")
                raise DataDirFull(f"{self._path}: the file system is full ({name or 'SQLITE_FULL'})") from exc
            if code & 0xFF == _SQLITE_IOERR:
                raise JournalIOError(f"{self._path}: {name or 'SQLITE_IOERR'}: {exc}") from exc
            raise
        except OSError as exc:  # the data_dir's own files (create, fsync of the directory)
            if exc.errno == errno.ENOSPC:
                self._space(False, f"{self._path.parent}: {exc}")
                raise DataDirFull(f"{self._path.parent}: the file system is full") from exc
            raise
        else:
            if not self._space_ok:
                self._space(True, f"{self._path}: writes succeed again")

    def _space(self, ok: bool, message: str) -> None:
        if ok == self._space_ok:
            return
        self._space_ok = ok
        callback = self.on_space_change
        if ok:
            log.warning("journal: the data_dir has space again: %s", message)
        else:
            log.error("journal: the data_dir is full; new commands are answered BUSY: %s", message)
        if callback is not None:
            callback(ok, message)

    @property
    def space_ok(self) -> bool:
        """False since a write failed for a full file system, until one succeeds again."""
        return self._space_ok

    # ------------------------------------------------------------------ meta

    @property
    def path(self) -> Path:
        return self._path

    @property
    def report(self) -> OpenReport:
        return self._report

    @property
    def journal_id(self) -> str:
        return self._journal_id

    @property
    def incarnation(self) -> str:
        return self._incarnation

    @property
    def boot_id(self) -> str:
        return self._boot_id

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def last_epoch(self) -> int:
        return self._last_epoch

    @property
    def applied_generation(self) -> int:
        return self._applied_gen

    @property
    def server_time_mark(self) -> float:
        return self._server_mark

    @property
    def next_event_seq(self) -> int:
        return self._next_seq

    @property
    def acked_event_seq(self) -> int:
        return self._acked_seq

    @property
    def bounds(self) -> tuple[int, int, int]:
        """(max_events, max_bytes, max_tickets) in force."""
        return (self._max_events, self._max_bytes, self._max_tickets)

    def set_attester(self, attester: Attester | None) -> None:
        """Sign attested results as they are journaled: every terminal write of an attested command stores
        `attester(entry)`'s (attestation, node_sig) with the result, in the same transaction, and replays
        return exactly those bytes. Set it (dispatch.results.result_attester) before `recover()` so the
        results recover settles are signed too. An attester that raises is logged and the result is stored
        unsigned (the replay then signs it; a result is never lost for a signature)."""
        with self._mutex:
            self._attester = attester

    def set_node_id(self, node_id: str) -> None:
        with self._mutex, self._tx() as c:
            c.execute(_SQL_SET_META, (K_NODE_ID, node_id))
        self._node_id = node_id

    def set_last_epoch(self, epoch: int) -> None:
        with self._mutex, self._tx() as c:
            c.execute(_SQL_SET_META, (K_LAST_EPOCH, epoch))
        self._last_epoch = epoch

    def observe_server_time(self, server_time: float, ceiling: float | None = None) -> float:
        """Move the server time mark forward to `server_time` (never back), but not past `ceiling` when
        one is given (the session's bound on how far a gateway may lead the host clock); returns the
        mark."""
        if ceiling is not None:
            server_time = min(server_time, ceiling)
        with self._mutex:
            if server_time > self._server_mark:
                with self._tx() as c:
                    c.execute(_SQL_SET_META, (K_SERVER_MARK, float(server_time)))
                self._server_mark = float(server_time)
            return self._server_mark

    def check_welcome(self, server_time: float, ceiling: float | None = None) -> float:
        """Refuse a Welcome whose server_time is more than 5 minutes before the mark (WelcomeRefused);
        otherwise observe it (the mark moves no further than `ceiling`) and return the mark."""
        with self._mutex:
            if server_time < self._server_mark - WELCOME_SLACK_S:
                raise WelcomeRefused(
                    f"Welcome.server_time {server_time:.3f} is {self._server_mark - server_time:.0f} s"
                    f" before the server time mark {self._server_mark:.3f}"
                    f" (at most {WELCOME_SLACK_S:.0f} s allowed)"
                )
            return self.observe_server_time(server_time, ceiling)

    # ------------------------------------------------------------------ spec

    def store_spec(self, spec: StoredSpec) -> None:
        """Store the last full spec's exact bytes, hash and signature; it becomes the applied generation.
        A generation not above the stored one is refused (StateError)."""
        with self._mutex:
            if spec.generation <= self._applied_gen:
                raise StateError(
                    f"spec generation {spec.generation} is not above the applied generation"
                    f" {self._applied_gen}"
                )
            with self._tx() as c:
                c.execute(
                    "INSERT OR REPLACE INTO spec (one, generation, body, spec_hash, signature)"
                    " VALUES (1, ?, ?, ?, ?)",
                    (spec.generation, spec.body, spec.spec_hash, spec.signature),
                )
                c.execute(_SQL_SET_META, (K_APPLIED_GEN, spec.generation))
            self._applied_gen = spec.generation

    def load_spec(self) -> StoredSpec | None:
        with self._mutex:
            row = self._conn.execute("SELECT generation, body, spec_hash, signature FROM spec").fetchone()
        if row is None:
            return None
        return StoredSpec(generation=row[0], body=row[1], spec_hash=row[2], signature=row[3])

    def discard_spec(self) -> None:
        """Forget the stored spec (it failed its signature check): applied generation back to 0."""
        with self._mutex:
            with self._tx() as c:
                c.execute("DELETE FROM spec")
                c.execute(_SQL_SET_META, (K_APPLIED_GEN, 0))
            self._applied_gen = 0

    @property
    def needs_spec(self) -> bool:
        """No usable spec is held: the session sends SpecRequest NO_SPEC (DLV-RCV-08)."""
        return self._applied_gen == 0

    # ------------------------------------------------------------------ commands

    def get_command(self, command_id: str) -> CommandEntry | None:
        with self._mutex:
            row = self._conn.execute(_SQL_GET, (command_id,)).fetchone()
        return None if row is None else _entry(row)

    def resolve(self, command_id: str, envelope_sha256: bytes | None = None) -> Resolution:
        """The Resolve table's row for a delivered command (pure read; see `_resolve`). `envelope_sha256`:
        the delivered envelope's (`dispatch.command.envelope_sha256`), which a refusal on the gateway's
        word alone answers only when it is the refused one's."""
        entry = self.get_command(command_id)
        return Resolution(resolve_entry(entry, self._incarnation, self._boot_id, envelope_sha256), entry)

    def accept_command(self, command: NewCommand, *, durable: bool = True) -> CommandEntry:
        """Journal `accepted` durably, before any side effect. A retry-safe entry left by an earlier
        process (Resolve REEXECUTE) is taken over by this process. Raises JournalFull when the event
        bounds are exhausted (answer BUSY) and StateError when the id is already journaled otherwise.
        `durable=False`: committed to the WAL, fsynced by the next `sync()` or durable commit (the
        dispatcher syncs before the command's effect; the session before telling the gateway)."""
        with self._mutex:
            if self._full():
                raise JournalFull(self._full_message())
            now = self._clock()
            try:
                # A single statement in autocommit mode is one transaction.
                with self._storage(), self._mode(durable):
                    self._conn.execute(_SQL_INSERT_ACCEPTED, self._accepted_row(command, now))
                self._committed(durable or not self.group_commit)
            except sqlite3.IntegrityError:
                with self._tx(durable) as c:
                    self._take_over(c, command, now)
            return self._accepted_entry(command, now)

    def accept_commands(
        self, commands: Sequence[NewCommand], *, durable: bool = True
    ) -> list[CommandEntry | JournalError]:
        """Journal `accepted` for several commands in ONE transaction: one write, fsynced before it
        returns (DLV-JRN-15), so a burst of commands shares one fsync and none of their ACKED can leave
        before all of them are on disk. Per command, as `accept_command` (a retry-safe leftover is taken
        over); in the place of a command that cannot be accepted, its JournalFull or StateError (nothing
        written for it). DataDirFull or JournalIOError: nothing of the batch is written."""
        out: list[CommandEntry | JournalError] = []
        with self._mutex:
            now = self._clock()
            with self._tx(durable) as c:
                for command in commands:
                    if self._full():
                        out.append(JournalFull(self._full_message()))
                        continue
                    try:
                        out.append(self._accept_in(c, command, now))
                    except StateError as exc:
                        out.append(exc)
        return out

    def _accept_in(self, c: sqlite3.Connection, command: NewCommand, now: float) -> CommandEntry:
        """`accepted` for one command inside the caller's transaction (StateError: already journaled
        and not a retry-safe leftover of an earlier process; nothing written)."""
        try:
            c.execute(_SQL_INSERT_ACCEPTED, self._accepted_row(command, now))
        except sqlite3.IntegrityError:
            self._take_over(c, command, now)
        return self._accepted_entry(command, now)

    def _accepted_row(self, command: NewCommand, now: float) -> tuple[object, ...]:
        """_SQL_INSERT_ACCEPTED's parameters for `command` accepted by this process at `now`."""
        flags = command.flags
        return (
            command.id, command.kind, flags.retry_safe, flags.self_terminating, flags.attested,
            self._incarnation, self._boot_id, now, now, command.body, command.signature,
        )  # fmt: skip

    def _take_over(self, c: sqlite3.Connection, command: NewCommand, now: float) -> None:
        """`command` is already journaled: take over a retry-safe leftover of an earlier process
        (Resolve REEXECUTE), or a refusal on the gateway's word alone (the accepted command passed the
        checks, its signature included, so it is another envelope), inside the caller's transaction;
        anything else is a StateError."""
        old = _entry(c.execute(_SQL_GET, (command.id,)).fetchone())
        if old.state.terminal and not old.binds:
            self._delete_refusal(c, old)
            c.execute(_SQL_INSERT_ACCEPTED, self._accepted_row(command, now))
            return
        if resolve_entry(old, self._incarnation, self._boot_id) is not Action.REEXECUTE:
            raise StateError(
                f"command {command.id}: already journaled ({old.state.value}); resolve it first"
            ) from None
        c.execute(
            _SQL_TAKE_OVER,
            (self._incarnation, self._boot_id, now, now, command.body, command.signature, command.id),
        )

    def _accepted_entry(self, command: NewCommand, now: float) -> CommandEntry:
        """The entry `accepted` wrote for `command` (or its take-over)."""
        return CommandEntry(
            id=command.id,
            kind=command.kind,
            flags=command.flags,
            state=CommandState.ACCEPTED,
            incarnation=self._incarnation,
            boot_id=self._boot_id,
            accepted_at=now,
            updated_at=now,
            body=command.body,
            signature=command.signature,
            result=None,
            acked=False,
        )

    def mark_running(self, command_id: str, *, durable: bool = True) -> CommandEntry:
        """Journal `running{boot_id}` (self-terminating kinds: immediately before the side effect,
        durably: DLV-JRN-17). For other kinds the dispatcher passes `durable=False`: their `accepted`
        and `running` entries resolve alike after a crash (REEXECUTE or INTERRUPTED), so a `running` a
        power cut loses changes nothing, and the command's next durable write covers it."""
        with self._mutex:
            now = self._clock()
            with self._tx(durable, needs_sync=durable) as c:
                cur = c.execute(_SQL_RUNNING, (self._boot_id, now, command_id, self._incarnation))
                if cur.rowcount != 1:
                    raise StateError(self._why_not(command_id, "mark running"))
                row = c.execute(_SQL_GET, (command_id,)).fetchone()
            return _entry(row)

    def complete(
        self,
        command_id: str,
        outcome: Outcome,
        *,
        code: str = "",
        body: bytes = b"",
        node_sig: bytes = b"",
        attestation: bytes = b"",
        message: str = "",
        durable: bool = True,
    ) -> CommandEntry:
        """Journal the real outcome (SUCCEEDED or FAILED) of this process's accepted/running command.
        An entry already terminal is returned unchanged (the first terminal outcome wins). For an attested
        command without a given `node_sig`, the attester signs it (`set_attester`). `durable=False` as for
        `accept_command`: the session syncs before the outcome reaches the gateway."""
        if outcome not in (Outcome.SUCCEEDED, Outcome.FAILED):
            raise ValueError(f"outcome: complete() takes SUCCEEDED or FAILED, got {outcome.value}")
        with self._mutex, self._tx(durable) as c:
            return self._complete_in(c, command_id, outcome, code, body, message, node_sig, attestation)

    def complete_many(
        self, completions: Sequence[Completion], *, durable: bool = True
    ) -> list[CommandEntry | StateError]:
        """`complete` for several commands in ONE transaction: one write, fsynced before it returns
        (DLV-JRN-15), so the outcomes a burst of commands reached together share one fsync. In the place
        of an outcome that cannot be written, its StateError (nothing written for it). DataDirFull or
        JournalIOError: nothing of the batch is written."""
        for done in completions:
            if done.outcome not in (Outcome.SUCCEEDED, Outcome.FAILED):
                raise ValueError(
                    f"outcome: complete_many() takes SUCCEEDED or FAILED, got {done.outcome.value}"
                )
        out: list[CommandEntry | StateError] = []
        with self._mutex, self._tx(durable) as c:
            for done in completions:
                try:
                    out.append(
                        self._complete_in(
                            c, done.command_id, done.outcome, done.code, done.body, done.message
                        )
                    )
                except StateError as exc:
                    out.append(exc)
        return out

    def _complete_in(
        self,
        c: sqlite3.Connection,
        command_id: str,
        outcome: Outcome,
        code: str,
        body: bytes,
        message: str,
        node_sig: bytes = b"",
        attestation: bytes = b"",
    ) -> CommandEntry:
        row = c.execute(_SQL_GET, (command_id,)).fetchone()
        if row is None:
            raise StateError(f"command {command_id}: not journaled")
        entry = _entry(row)
        if entry.state.terminal:
            return entry
        if entry.incarnation != self._incarnation:
            raise StateError(f"command {command_id}: left by an earlier process; resolve it first")
        return self._finish(
            c,
            entry,
            CommandResult(
                outcome,
                code,
                body,
                self._boot_id,
                self._clock(),
                node_sig,
                attestation=attestation,
                message=message[:MAX_MESSAGE_CHARS],
            ),
        )

    def reject(
        self,
        command: NewCommand,
        reason: str,
        message: str = "",
        *,
        signed: bool = False,
        envelope_sha256: bytes = b"",
    ) -> CommandEntry:
        """Journal a terminal rejection (UNSUPPORTED, EXPIRED, ...; never BUSY). A new id gets a `rejected`
        row; an accepted entry (deferred, or a retry-safe one re-checked) becomes `rejected`. A terminal
        entry is returned unchanged; this process's running entry cannot be rejected (StateError).

        A new id's row, by what the refusal was judged on (docs/journal.md "Refusals"):
        - `signed`: the command's signature verified against the command-signing roots: the row keeps
          the body and signature, as an accepted command's does (the sweep keeps it while that body could
          be replayed), and binds the id;
        - `envelope_sha256` given: the signature did not verify (the gateway's word alone): no body, no
          node signature (the kind is the body's unverified claim), and the row answers only that
          envelope (Resolve); a later binding refusal of another envelope under the id replaces it;
        - neither (no command-signing roots in force): no body; binds the id.
        Rows without a body count against `max_refused` (RefusalsFull: nothing written, answer BUSY)."""
        if not reason:
            raise ValueError("reason: a rejection needs its reason")
        if signed and envelope_sha256:
            raise ValueError("envelope_sha256: only for a refusal whose signature did not verify")
        if envelope_sha256:
            command = attrs.evolve(command, flags=CommandFlags())
        if not signed:
            # A command refused on the gateway's word keeps no body or signature: its answer is the reason
            # and message, and a gateway that makes up bodies (up to the 4 MiB message cap each) could
            # otherwise fill the data_dir with them, one journaled refusal at a time.
            command = attrs.evolve(command, body=b"", signature=b"")
        with self._mutex, self._tx() as c:
            now = self._clock()
            result = CommandResult(
                Outcome.REJECTED, reason, b"", self._boot_id, now, message=message[:MAX_MESSAGE_CHARS]
            )
            row = c.execute(_SQL_GET, (command.id,)).fetchone()
            if row is None:
                return self._insert_finished(c, command, result, envelope_sha256)
            entry = _entry(row)
            if entry.state.terminal:
                if entry.binds or envelope_sha256:
                    return entry
                # A refusal on the gateway's word gives way to one that binds the id.
                self._delete_refusal(c, entry)
                return self._insert_finished(c, command, result)
            if entry.state is CommandState.RUNNING and entry.incarnation == self._incarnation:
                raise StateError(
                    f"command {command.id}: running; its side effect started, report its outcome"
                )
            return self._finish(c, entry, result)

    def cancel_new(self, command: NewCommand, reason: str = "") -> CommandEntry:
        """Journal CANCELLED for a command that never started, in one transaction: a new id (deferred, or
        never seen) gets a `cancelled` row at once, so a late delivery is answered CANCELLED and never runs,
        and no crash can leave it `accepted` (which recovery would report FAILED `interrupted`). An
        `accepted` entry becomes cancelled as with `cancel`; a running or terminal one is returned
        unchanged. Like `reject`, it is not refused when the event bounds are full (commands are not
        events). A new id's row keeps no body (the command never ran, and a deferred body was never
        verified: a gateway could otherwise park bodies near the message cap and cancel them) and counts
        against `max_refused` (RefusalsFull: nothing written)."""
        with self._mutex, self._tx() as c:
            result = CommandResult(Outcome.CANCELLED, reason, b"", self._boot_id, self._clock())
            row = c.execute(_SQL_GET, (command.id,)).fetchone()
            if row is None:
                return self._insert_finished(c, attrs.evolve(command, body=b"", signature=b""), result)
            entry = _entry(row)
            if entry.state is not CommandState.ACCEPTED:
                return entry
            return self._finish(c, entry, result)

    def cancel(self, command_id: str, reason: str = "") -> CommandEntry | None:
        """Journal CANCELLED for a command still `accepted` (queued or deferred). A running or terminal
        entry is returned unchanged (a started side effect reports its real outcome); unknown: None."""
        with self._mutex, self._tx() as c:
            row = c.execute(_SQL_GET, (command_id,)).fetchone()
            if row is None:
                return None
            entry = _entry(row)
            if entry.state is not CommandState.ACCEPTED:
                return entry
            result = CommandResult(Outcome.CANCELLED, reason, b"", self._boot_id, self._clock())
            return self._finish(c, entry, result)

    def settle(self, command_id: str) -> CommandEntry:
        """Journal the outcome of a REBOOTED (SUCCEEDED `rebooted`) or INTERRUPTED (FAILED `interrupted`)
        entry; any other entry is returned unchanged. Recover does this for all of them at start."""
        with self._mutex, self._tx() as c:
            row = c.execute(_SQL_GET, (command_id,)).fetchone()
            if row is None:
                raise StateError(f"command {command_id}: not journaled")
            entry = _entry(row)
            result = settlement(
                entry, resolve_entry(entry, self._incarnation, self._boot_id), self._boot_id, self._clock()
            )
            return entry if result is None else self._finish(c, entry, result)

    def recover(self) -> tuple[CommandEntry, ...]:
        """At start: settle every entry an earlier process left whose outcome needs no server input
        (REBOOTED, INTERRUPTED), in one transaction, and return them (for Hello.unacked_results with the
        rest of `unacked_results()`). Retry-safe entries stay for the server to redeliver (REEXECUTE)."""
        settled: list[CommandEntry] = []
        with self._mutex, self._tx() as c:
            now = self._clock()
            for row in c.execute(_SQL_UNSETTLED, (self._incarnation,)).fetchall():
                entry = _entry(row)
                result = settlement(
                    entry, resolve_entry(entry, self._incarnation, self._boot_id), self._boot_id, now
                )
                if result is not None:
                    settled.append(self._finish(c, entry, result))
        return tuple(settled)

    def _finish(self, c: sqlite3.Connection, entry: CommandEntry, result: CommandResult) -> CommandEntry:
        state = result.outcome.state
        done = self._attest(
            CommandEntry(
                id=entry.id, kind=entry.kind, flags=entry.flags, state=state, incarnation=entry.incarnation,
                boot_id=entry.boot_id, accepted_at=entry.accepted_at, updated_at=result.finished_at,
                body=entry.body, signature=entry.signature, result=result, acked=False,
            )
        )  # fmt: skip
        r = done.result
        assert r is not None
        c.execute(
            _SQL_FINISH,
            (
                state.value, r.finished_at, r.outcome.value, r.code, r.body, r.boot_id, r.node_sig,
                r.previous_boot_id, r.finished_at, r.attestation, r.message, entry.id,
            ),
        )  # fmt: skip
        return done

    def _insert_finished(
        self, c: sqlite3.Connection, command: NewCommand, result: CommandResult, envelope_sha256: bytes = b""
    ) -> CommandEntry:
        """A terminal row for an id never journaled (a rejection, or a cancel before acceptance). One
        without a body is on the gateway's word alone and counts against `max_refused`."""
        if not command.body:
            self._make_refusal_room(c)
            self._refused_delta += 1
        now = result.finished_at
        f = command.flags
        done = self._attest(
            CommandEntry(
                id=command.id, kind=command.kind, flags=f, state=result.outcome.state,
                incarnation=self._incarnation, boot_id=self._boot_id, accepted_at=now, updated_at=now,
                body=command.body, signature=command.signature, result=result, acked=False,
                envelope_sha256=envelope_sha256,
            )
        )  # fmt: skip
        r = done.result
        assert r is not None
        c.execute(
            _SQL_INSERT_FINISHED,
            (
                command.id, command.kind, f.retry_safe, f.self_terminating, f.attested, done.state.value,
                self._incarnation, self._boot_id, now, now, command.body, command.signature, r.outcome.value,
                r.code, r.body, r.boot_id, r.node_sig, r.previous_boot_id, now, r.attestation, r.message,
                envelope_sha256 or None,
            ),
        )  # fmt: skip
        return done

    def _make_refusal_room(self, c: sqlite3.Connection) -> None:
        """Room for one more row on the gateway's word (inside the caller's transaction): at
        `max_refused`, the oldest acked such rows go (a hundredth of the bound at once, so a flood does not
        scan the table per row); when none is acked, RefusalsFull. An unacked result is never deleted (it
        is the only copy, DLV-RES-08), and deleting an acked one forgets only a command that never ran,
        as the 7-day sweep does."""
        if self._refused + self._refused_delta < self._max_refused:
            return
        if self._pending_acks:  # `ack_results(defer=True)` kept: they count (written again at commit)
            c.executemany(_SQL_ACK_RESULT, [(i,) for i in self._pending_acks])
        gone = c.execute(_SQL_OLDEST_ACKED_REFUSED, (max(1, self._max_refused // 100),)).fetchall()
        if not gone:
            raise RefusalsFull(
                f"journal full: {self._refused + self._refused_delta} refusals and cancels of commands never"
                f" accepted are unacked (at most {self._max_refused}); acks must drain them"
            )
        c.executemany(_SQL_DELETE_COMMAND, gone)
        self._refused_delta -= len(gone)

    def _delete_refusal(self, c: sqlite3.Connection, entry: CommandEntry) -> None:
        """Delete a row on the gateway's word that a later envelope under its id takes over."""
        c.execute(_SQL_DELETE_COMMAND, (entry.id,))
        if not entry.body:
            self._refused_delta -= 1

    @property
    def refused_rows(self) -> int:
        """Rows on the gateway's word alone (refusals and cancels of commands never accepted)."""
        with self._mutex:
            return self._refused

    def _attest(self, done: CommandEntry) -> CommandEntry:
        """The entry with its result signed by the attester, for attested commands (see set_attester)."""
        r = done.result
        if self._attester is None or not done.flags.attested or r is None or r.node_sig:
            return done
        try:
            attestation, node_sig = self._attester(done)
        except Exception:
            log.exception("command %s: signing its attested result failed; stored unsigned", done.id)
            return done
        return attrs.evolve(done, result=attrs.evolve(r, attestation=attestation, node_sig=node_sig))

    def _why_not(self, command_id: str, what: str) -> str:
        row = self._conn.execute(_SQL_GET, (command_id,)).fetchone()
        if row is None:
            return f"command {command_id}: cannot {what}: not journaled"
        entry = _entry(row)
        owner = "this process" if entry.incarnation == self._incarnation else "an earlier process"
        return f"command {command_id}: cannot {what}: it is {entry.state.value} (written by {owner})"

    def unacked_results(self, limit: int | None = None) -> tuple[CommandEntry, ...]:
        """Terminal entries not yet in an `Ack.command_ids`: replayed at Hello and after reconnect. An
        ack kept by `ack_results(defer=True)` counts as written (it is, with the next transaction).
        `limit`: at most the oldest that many rows are read (a replay reads no more than it can send)."""
        with self._mutex:
            if limit is None:
                rows = self._conn.execute(_SQL_UNACKED_RESULTS).fetchall()
            else:
                rows = self._conn.execute(_SQL_UNACKED_RESULTS + " LIMIT ?", (limit,)).fetchall()
            pending = set(self._pending_acks)
        return tuple(e for e in (_entry(r) for r in rows) if e.id not in pending)

    def ack_results(self, command_ids: Iterable[str], *, defer: bool = False) -> int:
        """Stop replaying these results (ids unknown or not terminal are ignored). Returns how many.
        With [journal] group_commit not fsynced by itself (`_tx(durable=False)`): an ack a power cut loses
        only means the result is replayed once more, and the gateway acks a result it already stored
        again (DLV-RES-11). `defer=True`: nothing is written now (returns 0); the ids are written inside
        the next write transaction (a batch's accepts or outcomes: one fsync for both), by
        `flush_acks()` (the session's replay timer, `close()`), or at once past MAX_PENDING_ACKS; a
        crash before that loses only acks, which costs a replay the gateway acks again. Meanwhile
        `unacked_results()` leaves them out (they are not replayed)."""
        if defer:
            with self._mutex:
                self._pending_acks.extend(command_ids)
                if len(self._pending_acks) >= MAX_PENDING_ACKS:
                    self.flush_acks()
            return 0
        ids = [(i,) for i in command_ids]
        if not ids:
            return 0
        with self._mutex, self._tx(durable=False, needs_sync=False) as c:
            cur = c.executemany(_SQL_ACK_RESULT, ids)
            return max(cur.rowcount, 0)

    def flush_acks(self) -> None:
        """Write the acks `ack_results(defer=True)` kept that no transaction took yet."""
        with self._mutex:
            if self._pending_acks and not self._closed:
                with self._tx(durable=False, needs_sync=False):
                    pass  # `_tx` writes the pending acks

    def sweep(self, now: float | None = None) -> int:
        """Delete acked terminal entries finished more than 7 days ago and accepted/running entries of
        earlier processes not written for 7 days; never this process's entries. Unacked results are kept
        until acked (DLV-RES-08 wins over the 7 days). Also purges expired exec tickets. Returns the
        number of command entries deleted."""
        with self._mutex:
            now = self._clock() if now is None else now
            cutoff = now - RETENTION_S
            # An entry is kept, whatever its age, while its command's not_after could still pass the
            # EXPIRED check: a Welcome can set server time no earlier than the mark less the slack, so a
            # gateway holding the signed body could otherwise replay it once the entry is gone and run
            # it a second time.
            horizon = self._server_mark - WELCOME_SLACK_S
            with self._tx() as c:
                rows = c.execute(_SQL_SWEEP_DONE, (cutoff,)).fetchall()
                rows += c.execute(_SQL_SWEEP_LEFT, (self._incarnation, cutoff)).fetchall()
                gone = [(cid,) for cid, body in rows if _not_after_s(body) <= horizon]
                n = c.executemany(_SQL_DELETE_COMMAND, gone).rowcount if gone else 0
                purged = c.execute(_SQL_TICKET_PURGE, (now,)).rowcount
                refused = int(c.execute(_SQL_COUNT_REFUSED).fetchone()[0])
            self._tickets -= purged
            self._refused = refused
            return n

    # ------------------------------------------------------------------ events

    def event_stats(self) -> EventStats:
        return EventStats(self._ev_count, self._ev_bytes, self._m_count, self._m_bytes)

    def event_totals(self) -> tuple[int, int]:
        """(events acked, metric events dropped for room) since this process opened the journal."""
        with self._mutex:
            return self._events_acked, self._metrics_dropped

    def _full(self) -> bool:
        return (self._ev_count - self._m_count) >= self._max_events or (
            self._ev_bytes - self._m_bytes
        ) >= self._max_bytes

    def _full_message(self) -> str:
        return (
            f"journal full: {self._ev_count - self._m_count} unacked transition/result events "
            f"({self._ev_bytes - self._m_bytes} bytes) against bounds of {self._max_events} events and "
            f"{self._max_bytes} bytes; acks must drain it"
        )

    def is_full(self) -> bool:
        """Dropping every metric event would not make room: new commands are answered BUSY."""
        with self._mutex:
            return self._full()

    def append_event(self, cls: EventClass, type: str, payload: bytes, key: str | None = None) -> int:
        """Append one event; returns its seq.

        `key` makes the append idempotent: the journal remembers the key (in `meta`, in the event's own
        transaction) and a later append with the same key appends nothing and returns the first one's
        seq. A section that records its intent before an effect and emits after it (the devices
        section's releases and binds) uses it to send the event exactly once across a crash between the append
        and its own record of it; it forgets the key (`forget_event_keys`) once that record is durable."""
        if key is None:
            return self.append_events((NewEvent(cls, type, payload),)).first_seq
        meta_key = K_EVENT_KEY + key
        with self._mutex:
            row = self._conn.execute(_SQL_GET_META, (meta_key,)).fetchone()
            if row is not None:
                return int(row[0])
            return self.append_events((NewEvent(cls, type, payload),), _key=meta_key).first_seq

    def event_keys(self, prefix: str = "") -> dict[str, int]:
        """The remembered event keys starting with `prefix`, with the seq each was appended at."""
        with self._mutex:
            rows = self._conn.execute(_SQL_EVENT_KEYS, (K_EVENT_KEY + prefix + "%",)).fetchall()
        return {
            str(k)[len(K_EVENT_KEY) :]: int(v) for k, v in rows if str(k).startswith(K_EVENT_KEY + prefix)
        }

    def forget_event_keys(self, keys: Iterable[str]) -> int:
        """Forget event keys (one durable transaction); returns how many were remembered."""
        wanted = [(K_EVENT_KEY + k,) for k in keys]
        if not wanted:
            return 0
        with self._mutex, self._tx() as c:
            return sum(c.execute(_SQL_DELETE_META, k).rowcount for k in wanted)

    def append_events(self, batch: Sequence[NewEvent], *, _key: str | None = None) -> EventsAppended:
        """Append a batch in one transaction, seqs increasing from 1 per journal_id, never reused.

        Over the bounds, the oldest metric events (this batch's included) are dropped. Transition and
        result events are never dropped: if the batch's non-metric events do not fit even with every
        metric gone, nothing is written and JournalFull is raised (answer BUSY; keep the events)."""
        n = len(batch)
        if n == 0:
            return EventsAppended(self._next_seq, 0, 0)
        sizes = [len(e.payload) + len(e.type) for e in batch]
        m_count = 0
        m_bytes = 0
        for e, s in zip(batch, sizes, strict=True):
            if e.cls is EventClass.METRIC:
                m_count += 1
                m_bytes += s
        total = sum(sizes)
        with self._mutex:
            nm_count = self._ev_count - self._m_count + (n - m_count)
            nm_bytes = self._ev_bytes - self._m_bytes + (total - m_bytes)
            if nm_count > self._max_events or nm_bytes > self._max_bytes:
                raise JournalFull(self._full_message())
            first = self._next_seq
            now = self._clock()
            count = self._ev_count + n
            size = self._ev_bytes + total
            mc = self._m_count + m_count
            mb = self._m_bytes + m_bytes
            dropped = 0
            with self._tx() as c:
                c.executemany(
                    _SQL_INSERT_EVENT,
                    [
                        (first + i, int(e.cls), e.type, e.payload, s, now)
                        for i, (e, s) in enumerate(zip(batch, sizes, strict=True))
                    ],
                )
                c.execute(_SQL_SET_META, (K_NEXT_SEQ, first + n))
                if _key is not None:
                    c.execute(_SQL_SET_META, (_key, first))
                if count > self._max_events or size > self._max_bytes:
                    last = 0
                    for seq, s in c.execute(_SQL_METRICS_OLDEST):
                        if count <= self._max_events and size <= self._max_bytes:
                            break
                        last = seq
                        count -= 1
                        size -= s
                        mc -= 1
                        mb -= s
                        dropped += 1
                    c.execute(_SQL_DROP_METRICS, (last,))
            self._next_seq = first + n
            self._ev_count, self._ev_bytes, self._m_count, self._m_bytes = count, size, mc, mb
            self._metrics_dropped += dropped
            return EventsAppended(first, n, dropped)

    def unacked_events(
        self, after_seq: int = 0, limit: int = 1000, max_bytes: int | None = None
    ) -> list[Event]:
        """Unacked events with seq above `after_seq`, oldest first, at most `limit`, and (with
        `max_bytes`) no more payload bytes than that, but always the first one."""
        out: list[Event] = []
        total = 0
        with self._mutex:
            for seq, cls, t, p, at in self._conn.execute(_SQL_EVENTS_AFTER, (after_seq, limit)):
                total += len(p)
                if max_bytes is not None and out and total > max_bytes:
                    break
                out.append(Event(seq, EventClass(cls), t, p, at))
        return out

    def restart_events(self) -> str:
        """A new journal_id, for when seqs this journal issued were lost with its tail (the gateway
        acked, or the node sent, seqs above `next_event_seq`): the unacked events are renumbered from 1
        under it, so no seq the gateway already holds is reused. Returns the new journal_id."""
        with self._mutex:
            new_id = uuid.uuid4().hex
            offset = self._acked_seq
            with self._tx() as c:
                # Two steps, so no intermediate row collides with another's seq.
                c.execute("UPDATE events SET seq = -seq")
                c.execute("UPDATE events SET seq = -seq - ?", (offset,))
                top = c.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
                c.execute(_SQL_SET_META, (K_JOURNAL_ID, new_id))
                c.execute(_SQL_SET_META, (K_NEXT_SEQ, int(top) + 1))
                c.execute(_SQL_SET_META, (K_ACKED_SEQ, 0))
            old = self._journal_id
            self._journal_id = new_id
            self._next_seq = int(top) + 1
            self._acked_seq = 0
            log.error("journal: events restarted under journal_id %s (was %s)", new_id, old)
            return new_id

    def ack_events(self, journal_id: str, seq: int) -> int:
        """A cumulative Ack{journal_id, event_seq}: drop every event up to `seq`. An ack for another
        journal_id (or one not above the last) is ignored. Returns how many events were dropped."""
        with self._mutex:
            if journal_id != self._journal_id:
                return 0
            seq = min(seq, self._next_seq - 1)
            if seq <= self._acked_seq:
                return 0
            with self._tx() as c:
                count, size, m_count, m_size = c.execute(_SQL_ACKED_STATS, (seq,)).fetchone()
                c.execute(_SQL_DELETE_EVENTS, (seq,))
                c.execute(_SQL_SET_META, (K_ACKED_SEQ, seq))
            self._acked_seq = seq
            self._events_acked += int(count)
            self._ev_count -= count
            self._ev_bytes -= size
            self._m_count -= m_count
            self._m_bytes -= m_size
            return int(count)

    # ------------------------------------------------------------------ exec tickets

    def use_exec_ticket(self, jti: str, expires_at: float, now: float | None = None) -> None:
        """Record an exec ticket's jti as used until it expires. Refused (TicketRefused) when the jti was
        already used (`replayed`), the ticket has expired (`expired`), or the set is full (`full`)."""
        with self._mutex:
            now = self._clock() if now is None else now
            if expires_at <= now:
                raise TicketRefused(jti, "expired")
            with self._tx() as c:
                row = c.execute(_SQL_TICKET_GET, (jti,)).fetchone()
                if row is not None and row[0] > now:
                    raise TicketRefused(jti, "replayed")
                purged = 0
                if row is None and self._tickets >= self._max_tickets:
                    purged = c.execute(_SQL_TICKET_PURGE, (now,)).rowcount
                    if self._tickets - purged >= self._max_tickets:
                        raise TicketRefused(jti, "full")
                c.execute(_SQL_TICKET_PUT, (jti, expires_at))
            self._tickets += (1 if row is None else 0) - purged

    def exec_ticket_count(self) -> int:
        return self._tickets


def _open_db(path: Path, now: float) -> tuple[sqlite3.Connection, OpenReport]:
    moved: tuple[Path, ...] = ()
    reason = ""
    if path.exists():
        conn = None
        try:
            conn = _connect(path)
            migrated_from = _check(conn)
            return conn, OpenReport(created=False, moved_aside=(), reason="", migrated_from=migrated_from)
        except (sqlite3.DatabaseError, _Corrupt) as e:
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            reason = f"{type(e).__name__}: {e}"
            moved = _files.move_aside(path, now)
    elif any(Path(str(path) + s).exists() for s in _files.SIDE_SUFFIXES):
        # A WAL without its database must not be replayed into a new one.
        reason = "side files without a journal.db"
        moved = _files.move_aside(path, now)
    _files.create_db_file(path)
    conn = _connect(path)
    conn.execute("BEGIN IMMEDIATE")
    for stmt in DDL.split(";"):
        if stmt.strip():
            conn.execute(stmt)
    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
    conn.executemany(
        _SQL_SET_META,
        [(K_JOURNAL_ID, uuid.uuid4().hex), (K_NEXT_SEQ, 1), (K_ACKED_SEQ, 0), (K_CREATED_AT, now)],
    )
    conn.execute("COMMIT")
    # The WAL file now exists; make its name durable too.
    _files.fsync_dir(path.parent)
    return conn, OpenReport(created=True, moved_aside=moved, reason=reason)


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, cached_statements=64)
    # One process owns the journal (the flock): exclusive locking keeps the WAL index in process memory
    # (no -shm file) and saves the ~6 fcntl lock calls each transaction would otherwise make.
    conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        conn.close()
        raise _Corrupt(f"journal_mode is {mode}, not wal")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA trusted_schema=OFF")
    return conn


def _check(conn: sqlite3.Connection) -> int:
    """Check an existing journal (raise _Corrupt); migrate an older schema version in place. Returns the
    version it was migrated from (0: none)."""
    rows = conn.execute("PRAGMA quick_check").fetchall()
    if rows != [("ok",)]:
        raise _Corrupt("quick_check: " + "; ".join(str(r[0]) for r in rows[:5]))
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables >= TABLES:
        raise _Corrupt(f"schema: missing tables {sorted(TABLES - tables)}")
    versions = conn.execute("SELECT version FROM schema_version").fetchall()
    migrated_from = 0
    if (
        len(versions) == 1
        and isinstance(versions[0][0], int)
        and all(v in MIGRATIONS for v in range(versions[0][0], SCHEMA_VERSION))
        and versions[0][0] < SCHEMA_VERSION
    ):
        migrated_from = versions[0][0]
        _migrate(conn, migrated_from)
    elif versions != [(SCHEMA_VERSION,)]:
        raise _Corrupt(f"schema_version is {versions}, this bcd reads version {SCHEMA_VERSION}")
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    if not meta.get(K_JOURNAL_ID) or not isinstance(meta.get(K_NEXT_SEQ), int):
        raise _Corrupt("meta: journal_id or the event sequence is missing")
    # The event sequence must be above every stored event (never reuse a seq).
    top = conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    if top is not None and top >= meta[K_NEXT_SEQ]:
        raise _Corrupt(f"meta: next_event_seq {meta[K_NEXT_SEQ]} is not above the stored event {top}")
    return migrated_from


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    """Take the journal from `version` to SCHEMA_VERSION in one durable transaction (all or nothing)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for v in range(version, SCHEMA_VERSION):
            for stmt in MIGRATIONS[v]:
                conn.execute(stmt)
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
