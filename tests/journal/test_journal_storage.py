"""The journal's storage: commits and fsyncs counted, group commit and `sync()`, a full file system
(SQLITE_FULL from SQLite's own page limit, in process) and a failing one (SQLITE_IOERR), close.

In process and fast: mutation testing (docs/mutation.md, `journal`) sees these tests' coverage.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.journal import (
    CommandState,
    Completion,
    DataDirFull,
    EventClass,
    Journal,
    JournalIOError,
    NewEvent,
    Outcome,
)
from jhelpers import Clock, cmd, crash_copy


def _pages(j: Journal) -> int:
    return int(j._conn.execute("PRAGMA page_count").fetchone()[0])


def _cap(j: Journal, pages: int) -> None:
    """SQLite's own size limit: a write that needs a page more fails with SQLITE_FULL, as on a full disk."""
    j._conn.execute(f"PRAGMA max_page_count={pages}")


def _fill_until_full(j: Journal) -> int:
    """Accept commands until one is refused DataDirFull; returns how many were accepted."""
    _cap(j, _pages(j))
    for i in range(10_000):
        try:
            j.accept_command(cmd(f"fill{i}"))
        except DataDirFull:
            return i
    raise AssertionError("the capped journal never filled")


class _Failing:
    """The journal's connection, with one statement (matched by its start) failing as the disk would."""

    def __init__(self, conn: sqlite3.Connection, prefix: str, exc: BaseException) -> None:
        self._conn, self._prefix, self._exc = conn, prefix, exc

    def execute(self, sql: str, *args: Any) -> Any:
        if sql.startswith(self._prefix):
            raise self._exc
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _sqlite_error(code: int, name: str, text: str) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(text)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    exc.sqlite_errorname = name  # type: ignore[attr-defined]
    return exc


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    with Journal.open(tmp_path / "d", boot_id="b1", clock=Clock()) as j:
        yield j


# ---------------------------------------------------------------- commits and fsyncs


def test_DLV_JRN_15_each_write_counts_one_durable_commit(journal: Journal) -> None:
    """Group commit off: every public write is one transaction, fsynced when it returns, whatever
    `durable` the caller passed; a read or a write with nothing to do commits nothing."""
    j = journal
    assert (j.commits, j.durable_commits, j.synced_through, j.unsynced) == (0, 0, 0, False)
    j.accept_command(cmd("a"), durable=False)
    j.mark_running("a", durable=False)
    j.complete("a", Outcome.SUCCEEDED, durable=False)
    j.ack_results(["a"])
    assert (j.commits, j.durable_commits, j.synced_through, j.unsynced) == (4, 4, 4, False)
    j.observe_server_time(100.0)
    j.observe_server_time(100.0)  # the same time: nothing to write
    j.observe_server_time(99.0)
    assert j.ack_results([]) == 0
    j.flush_acks()  # nothing kept
    j.resolve("a")
    j.unacked_events()
    assert (j.commits, j.durable_commits) == (5, 5)
    j.sync()  # nothing unsynced: no fsync
    assert (j.commits, j.durable_commits, j.synced_through) == (5, 5, 5)


def test_group_commit_leaves_writes_unsynced_until_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`[journal] group_commit`: writes marked `durable=False` reach the WAL and are counted unsynced;
    `sync()` fdatasyncs the WAL file once for all of them; a durable write covers them as well."""
    synced: list[str] = []
    real = os.fdatasync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    with Journal.open(tmp_path / "d", boot_id="b1", group_commit=True) as j:
        assert j.group_commit
        j.accept_command(cmd("a"), durable=False)
        assert (j.commits, j.durable_commits, j.synced_through, j.unsynced) == (1, 0, 0, True)
        j.accept_commands([cmd("b"), cmd("c")], durable=False)
        j.complete_many([Completion("b", Outcome.SUCCEEDED)], durable=False)
        assert (j.commits, j.durable_commits, j.synced_through, j.unsynced) == (3, 0, 0, True)
        # synchronous is FULL again after each NORMAL commit
        assert j._conn.execute("PRAGMA synchronous").fetchone()[0] == 2
        j.mark_running("a", durable=False)  # needs no sync at all: not counted
        j.ack_results(["b"])  # likewise (a lost ack is one more replay)
        assert (j.commits, j.unsynced) == (3, True)
        assert synced == []
        j.sync()
        assert synced == [str(j.path) + "-wal"]
        assert (j.commits, j.durable_commits, j.synced_through, j.unsynced) == (3, 1, 3, False)
        j.sync()  # nothing pending: no second fdatasync
        assert len(synced) == 1
        j.accept_command(cmd("d"), durable=False)
        assert j.unsynced
        j.complete("a", Outcome.SUCCEEDED)  # durable: fsyncs the WAL to its end
        assert (j.commits, j.durable_commits, j.synced_through, j.unsynced) == (5, 2, 5, False)
        j.accept_command(cmd("e"))  # durable by default, also the single-statement path
        assert (j.commits, j.durable_commits, j.synced_through, j.unsynced) == (6, 3, 6, False)
        j.accept_command(cmd("f"), durable=False)
        j.sync()  # counted on top of the durable commits before it
        assert (j.commits, j.durable_commits, j.synced_through, j.unsynced) == (7, 4, 7, False)
        j.accept_command(cmd("g"), durable=False)
        j.close()
        j.sync()  # closed: nothing to do, no error
        assert len(synced) == 2


def test_a_failed_sync_is_a_journal_io_error_naming_the_wal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with Journal.open(tmp_path / "d", boot_id="b1", group_commit=True) as j:
        j.accept_command(cmd("a"), durable=False)
        monkeypatch.setattr(os, "fdatasync", eio)
        with pytest.raises(JournalIOError) as exc:
            j.sync()
        assert str(exc.value) == f"{j.path}-wal: fdatasync: errno 5 (Input/output error)"
        assert j.unsynced and j.durable_commits == 0
        monkeypatch.undo()


# ---------------------------------------------------------------- a full file system


def test_a_full_file_system_refuses_the_write_and_reports_once_per_change(
    journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLITE_FULL: DataDirFull naming the file, nothing written, `space_ok` false and `on_space_change`
    called once per change (not once per failed write); the next write that succeeds turns it back."""
    j = journal
    calls: list[tuple[bool, str]] = []
    j.on_space_change = lambda ok, message: calls.append((ok, message))
    assert j.space_ok
    j.accept_command(cmd("before"))
    assert calls == []  # a write that succeeds while space was fine reports nothing
    with caplog.at_level(logging.WARNING, logger="bcd_agent.journal._store"):
        n = _fill_until_full(j)
        with pytest.raises(DataDirFull) as exc:
            j.accept_command(cmd("refused"))
        assert str(exc.value) == f"{j.path}: the file system is full (SQLITE_FULL)"
        assert isinstance(exc.value.__cause__, sqlite3.OperationalError)
        with pytest.raises(DataDirFull):
            j.append_events([NewEvent(EventClass.RESULT, "r", b"x" * 100_000)])
        assert not j.space_ok
        assert calls == [(False, f"{j.path}: SQLITE_FULL: database or disk is full")]
        assert j.get_command("refused") is None and j.get_command(f"fill{n}") is None
        assert j.unacked_events() == [] and j.next_event_seq == 1 and j.event_stats().count == 0
        _cap(j, 1_000_000)
        assert j.accept_command(cmd("after")).state is CommandState.ACCEPTED
        assert j.space_ok
        assert calls[1:] == [(True, f"{j.path}: writes succeed again")]
        j.accept_command(cmd("after2"))
        assert len(calls) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"journal: the data_dir is full; new commands are answered BUSY: {j.path}: SQLITE_FULL:"
        " database or disk is full",
        f"journal: the data_dir has space again: {j.path}: writes succeed again",
    ]
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING]


def test_a_full_file_system_without_a_callback_still_turns_space_ok(journal: Journal) -> None:
    j = journal
    _fill_until_full(j)
    assert not j.space_ok
    _cap(j, 1_000_000)
    j.set_node_id("n")
    assert j.space_ok


def test_enospc_from_the_data_dir_is_data_dir_full(journal: Journal) -> None:
    j = journal
    calls: list[tuple[bool, str]] = []
    j.on_space_change = lambda ok, message: calls.append((ok, message))
    j._conn = _Failing(j._conn, "BEGIN", OSError(errno.ENOSPC, "No space left on device"))  # type: ignore[assignment]
    with pytest.raises(DataDirFull) as exc:
        j.set_node_id("n")
    assert str(exc.value) == f"{j.path.parent}: the file system is full"
    assert calls == [(False, f"{j.path.parent}: [Errno 28] No space left on device")]
    j._conn = j._conn._conn  # type: ignore[attr-defined]


def test_other_os_and_sqlite_errors_pass_through_unchanged(journal: Journal) -> None:
    j = journal
    real = j._conn
    j._conn = _Failing(real, "BEGIN", OSError(errno.EACCES, "denied"))  # type: ignore[assignment]
    with pytest.raises(PermissionError):
        j.set_node_id("n")
    busy = _sqlite_error(5, "SQLITE_BUSY", "database is locked")
    j._conn = _Failing(real, "BEGIN", busy)  # type: ignore[assignment]
    with pytest.raises(sqlite3.OperationalError) as exc:
        j.set_node_id("n")
    assert exc.value is busy
    j._conn = real
    assert j.space_ok


@pytest.mark.parametrize(
    ("code", "name", "shown"),
    [
        (10, "SQLITE_IOERR", "SQLITE_IOERR"),
        (1034, "SQLITE_IOERR_FSYNC", "SQLITE_IOERR_FSYNC"),
        (266, "", "SQLITE_IOERR"),
    ],
)
def test_an_io_error_is_a_journal_io_error_naming_the_file(
    journal: Journal, code: int, name: str, shown: str
) -> None:
    """SQLITE_IOERR and its extended codes (low byte 10) end the node: the error names the file and
    SQLite's error; nothing was written."""
    j = journal
    real = j._conn
    j._conn = _Failing(real, "COMMIT", _sqlite_error(code, name, "disk I/O error"))  # type: ignore[assignment]
    with pytest.raises(JournalIOError) as exc:
        j.set_last_epoch(7)
    assert str(exc.value) == f"{j.path}: {shown}: disk I/O error"
    j._conn = real
    assert not real.in_transaction
    assert j.last_epoch == 0 and j.space_ok


def test_a_full_file_system_on_a_single_statement_accept(journal: Journal) -> None:
    j = journal
    _cap(j, _pages(j))
    j._conn = _Failing(j._conn, "INSERT INTO commands", _sqlite_error(13, "", "database or disk is full"))  # type: ignore[assignment]
    with pytest.raises(DataDirFull) as exc:
        j.accept_command(cmd("x"))
    assert str(exc.value) == f"{j.path}: the file system is full (SQLITE_FULL)"
    assert j.commits == 0


# ---------------------------------------------------------------- close


def test_close_writes_kept_acks_and_may_be_called_twice(tmp_path: Path) -> None:
    j = Journal.open(tmp_path / "d", boot_id="b1")
    j.accept_commands([cmd("a"), cmd("b")])
    j.complete_many([Completion("a", Outcome.SUCCEEDED), Completion("b", Outcome.FAILED, code="x")])
    j.ack_results(["a"], defer=True)
    j.close()
    j.close()  # a second close does nothing (the lock's fd is not closed twice)
    j.flush_acks()  # closed: nothing written, no error
    with Journal.open(tmp_path / "d", boot_id="b1") as k:
        assert [e.id for e in k.unacked_results()] == ["b"]


def test_close_logs_acks_it_cannot_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    j = Journal.open(tmp_path / "d", boot_id="b1")
    j.accept_command(cmd("a"))
    j.complete("a", Outcome.SUCCEEDED)
    j.ack_results(["a"], defer=True)
    real = j._conn
    j._conn = _Failing(real, "BEGIN", _sqlite_error(13, "SQLITE_FULL", "database or disk is full"))  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="bcd_agent.journal._store"):
        j.close()
    assert (
        f"journal: {j.path}: acks not written at close: {j.path}: the file system is full (SQLITE_FULL)"
        in caplog.messages
    )
    with Journal.open(tmp_path / "d", boot_id="b1") as k:  # the lock was released all the same
        assert [e.id for e in k.unacked_results()] == ["a"]  # replayed, acked again


def test_deferred_acks_are_written_at_a_thousand(tmp_path: Path) -> None:
    """`ack_results(defer=True)` keeps at most 999 ids in memory: the 1000th writes them all at once."""
    j = Journal.open(tmp_path / "a", boot_id="b1")
    ids = [f"c{i:04}" for i in range(1001)]
    j.accept_commands([cmd(i) for i in ids])
    j.complete_many([Completion(i, Outcome.SUCCEEDED) for i in ids])
    before = j.commits
    j.ack_results(ids[:999], defer=True)
    assert j.commits == before
    assert j.unacked_results()[0].id == ids[999]  # the kept ones are not replayed meanwhile
    kept = crash_copy(j, tmp_path / "kept")
    with Journal.open(kept, boot_id="b1") as k:  # a crash: kept acks were never written
        assert len(k.unacked_results()) == 1001
        k.ack_results(ids[:999], defer=True)
        k.ack_results([ids[999]], defer=True)  # the 1000th: written now
        assert k.commits == 1
        written = crash_copy(k, tmp_path / "written")
    with Journal.open(written, boot_id="b1") as w:
        assert [e.id for e in w.unacked_results()] == [ids[1000]]


def test_ack_results_counts_what_it_acked(journal: Journal) -> None:
    j = journal
    j.accept_commands([cmd("a"), cmd("b"), cmd("open")])
    j.complete_many([Completion("a", Outcome.SUCCEEDED), Completion("b", Outcome.SUCCEEDED)])
    assert j.ack_results(["a", "a", "ghost", "open"]) == 1
    assert j.ack_results(["a"]) == 0  # already acked
    assert j.ack_results(iter(["b"])) == 1
    assert j.unacked_results() == ()


def test_group_commit_keeps_every_write_durable_unless_the_caller_says_otherwise(tmp_path: Path) -> None:
    """Under group commit only the writes a caller marks `durable=False` wait for `sync()`: by default
    each write (a take-over, a batch, running, an outcome) is fsynced when it returns."""
    j = Journal.open(tmp_path / "a", boot_id="b1")
    j.accept_command(cmd("left"))
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="b1", group_commit=True) as k:
        k.accept_command(cmd("left"))  # the take-over of a retry-safe leftover
        assert (k.commits, k.durable_commits, k.unsynced) == (1, 1, False)
        k.accept_commands([cmd("a")])
        k.mark_running("a")
        k.complete("a", Outcome.SUCCEEDED)
        k.complete_many([Completion("left", Outcome.FAILED, code="x")])
        assert (k.commits, k.durable_commits, k.unsynced) == (5, 5, False)
        k.ack_results(["a"], defer=True)
        k.flush_acks()  # acks: never waited for, not even by sync()
        assert (k.commits, k.durable_commits, k.unsynced) == (5, 5, False)
        k.accept_command(cmd("left2"), durable=False)
        k.mark_running("left2", durable=True)  # durable: fsyncs the WAL to its end
        assert (k.commits, k.durable_commits, k.synced_through, k.unsynced) == (7, 6, 7, False)
    with Journal.open(data, boot_id="b1") as k:
        assert [e.id for e in k.unacked_results()] == ["left"]


class _Watching:
    """The journal's connection, recording SQLite's own `synchronous` setting in force when each write
    is committed: at an INSERT into commands outside a transaction (its own), or at a COMMIT. FULL (2):
    SQLite fsyncs the WAL at that commit; NORMAL (1): it does not (in WAL mode)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.modes: list[tuple[str, int]] = []

    def execute(self, sql: str, *args: Any) -> Any:
        autocommit = sql.startswith("INSERT INTO commands") and not self._conn.in_transaction
        if autocommit or sql.startswith("COMMIT"):
            mode = int(self._conn.execute("PRAGMA synchronous").fetchone()[0])
            self.modes.append((sql.split(" ", 1)[0], mode))
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def test_group_commit_commits_a_durable_accept_with_synchronous_full(tmp_path: Path) -> None:
    """`accept_command`'s one-statement path (no leftover to take over: the INSERT is its own
    transaction) under group commit: committed with synchronous=FULL, so SQLite fsyncs the WAL before
    it returns, unless the caller passes `durable=False` (NORMAL for that statement alone). The
    counters alone cannot tell: they count what the journal believes, not what SQLite was told."""
    with Journal.open(tmp_path / "d", boot_id="b1", group_commit=True) as j:
        watching = _Watching(j._conn)
        j._conn = watching  # type: ignore[assignment]
        j.accept_command(cmd("a"))  # durable by default
        j.accept_command(cmd("b"), durable=False)
        j.accept_command(cmd("c"), durable=True)
        j.accept_commands([cmd("d")], durable=False)  # the transaction path, for contrast
        j.accept_commands([cmd("e")])
        assert watching.modes == [("INSERT", 2), ("INSERT", 1), ("INSERT", 2), ("COMMIT", 1), ("COMMIT", 2)]
        assert (j.commits, j.durable_commits) == (5, 3)
        j._conn = watching._conn
        assert j._conn.execute("PRAGMA synchronous").fetchone()[0] == 2
    with Journal.open(tmp_path / "e", boot_id="b1") as j:  # no group commit: FULL whatever the caller says
        watching = _Watching(j._conn)
        j._conn = watching  # type: ignore[assignment]
        j.accept_command(cmd("a"), durable=False)
        j.accept_commands([cmd("b")], durable=False)
        assert watching.modes == [("INSERT", 2), ("COMMIT", 2)]
        j._conn = watching._conn


def test_a_failing_close_is_logged_and_still_releases_the_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class _BadClose(_Failing):
        def close(self) -> None:
            self._conn.close()
            raise sqlite3.OperationalError("disk I/O error")

    j = Journal.open(tmp_path / "d", boot_id="b1")
    j._conn = _BadClose(j._conn, "never", RuntimeError())  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="bcd_agent.journal._store"):
        j.close()
    assert caplog.messages == [f"journal: {j.path}: closing: disk I/O error"]
    Journal.open(tmp_path / "d", boot_id="b1").close()
