"""Opening the journal: the data_dir's rules, the files and their modes, the lock, the connection's
settings, the on-disk format docs/journal.md gives, and each check that moves a journal aside (with the
reason it names), the schema migration refused when it cannot apply.

In process and fast: mutation testing (docs/mutation.md, `journal`) sees these tests' coverage.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import attrs
import pytest
from bcd_agent.journal import (
    Action,
    BoundError,
    CommandFlags,
    EventClass,
    Journal,
    JournalError,
    JournalLocked,
    NewCommand,
    NewEvent,
    Outcome,
    StoredSpec,
    UnsafeDataDir,
    _files,
)
from jhelpers import NOT_RETRY_SAFE, Clock, cmd

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
STAMP = "20231114T221320Z"


def _sql(db: Path, *statements: str) -> None:
    conn = sqlite3.connect(db)
    for s in statements:
        conn.execute(s)
    conn.commit()
    conn.close()


def _made(data: Path) -> str:
    """A closed journal with one command and one event; returns its journal_id."""
    with Journal.open(data, boot_id="b") as j:
        j.accept_command(cmd("c1"))
        j.append_event(EventClass.RESULT, "r", b"p")
        return j.journal_id


def _reopened(data: Path) -> Journal:
    return Journal.open(data, boot_id="b", clock=Clock(T0))


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"max_events": 10_001},
            "max_events: 10001 is above the contract's limit 10000; config may only lower it",
        ),
        (
            {"max_bytes": 64 * 1024 * 1024 + 1},
            "max_bytes: 67108865 is above the contract's limit 67108864; config may only lower it",
        ),
        (
            {"max_tickets": 10_001},
            "max_tickets: 10001 is above the contract's limit 10000; config may only lower it",
        ),
        ({"max_events": 0}, "max_events: must be at least 1, got 0"),
        ({"max_bytes": -1}, "max_bytes: must be at least 1, got -1"),
        ({"max_tickets": 0}, "max_tickets: must be at least 1, got 0"),
        ({"max_events": True}, "max_events: must be an integer, got True"),
        ({"max_bytes": 1.5}, "max_bytes: must be an integer, got 1.5"),
        ({"max_tickets": "10"}, "max_tickets: must be an integer, got '10'"),
    ],
)
def test_DLV_JRN_18_a_bound_above_the_contract_or_not_a_count_is_refused_by_name(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(BoundError) as exc:
        Journal.open(tmp_path / "d", boot_id="b", **kwargs)  # type: ignore[arg-type]
    assert str(exc.value) == message
    assert not (tmp_path / "d").exists()  # refused before anything is created


def test_DLV_JRN_18_bounds_at_the_contract_and_at_one_are_accepted(tmp_path: Path) -> None:
    with Journal.open(
        tmp_path / "d", boot_id="b", max_events=10_000, max_bytes=64 * 1024 * 1024, max_tickets=10_000
    ) as j:
        assert j.bounds == (10_000, 64 * 1024 * 1024, 10_000)
    with Journal.open(tmp_path / "d", boot_id="b", max_events=1, max_bytes=1, max_tickets=1) as j:
        assert j.bounds == (1, 1, 1)


def test_a_boot_id_is_required(tmp_path: Path) -> None:
    with pytest.raises(JournalError) as exc:
        Journal.open(tmp_path / "d", boot_id="")
    assert str(exc.value) == "boot_id: must be set (the kernel's boot id)"
    assert not (tmp_path / "d").exists()


def test_a_fresh_journal_holds_nothing(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="boot-1", incarnation="inc-1") as j:
        assert (j.incarnation, j.boot_id, j.node_id, j.last_epoch) == ("inc-1", "boot-1", "", 0)
        assert (j.applied_generation, j.server_time_mark, j.needs_spec) == (0, 0.0, True)
        assert (j.next_event_seq, j.acked_event_seq, j.exec_ticket_count()) == (1, 0, 0)
        assert (j.event_totals(), attrs.astuple(j.event_stats())) == ((0, 0), (0, 0, 0, 0))
        assert j.space_ok and not j.unsynced and not j.group_commit
        assert len(j.journal_id) == 32 and int(j.journal_id, 16) >= 0
        assert j.report.created and j.report.moved_aside == () and j.report.reason == ""
        assert j.report.migrated_from == 0


# ---------------------------------------------------------------- the data_dir and its files


def test_data_dir_is_created_0700_under_missing_parents(tmp_path: Path) -> None:
    data = tmp_path / "a" / "b" / "data"
    with Journal.open(data, boot_id="b") as j:
        assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(data / "journal.db").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(data / "journal.lock").st_mode) == 0o600
        assert j.path == data / "journal.db"
        assert not (data / "journal.db-shm").exists()  # locking_mode=EXCLUSIVE: no shared-memory file


@pytest.mark.parametrize("mode", [0o720, 0o702, 0o770, 0o707])
def test_a_data_dir_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    data = tmp_path / "d"
    data.mkdir()
    os.chmod(data, mode)
    with pytest.raises(UnsafeDataDir) as exc:
        Journal.open(data, boot_id="b")
    assert str(exc.value) == f"data_dir {data}: mode {mode:04o} lets others write; must be 0700"
    assert list(data.iterdir()) == []


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o705, 0o701])
def test_read_and_search_bits_are_narrowed_to_0700(tmp_path: Path, mode: int) -> None:
    data = tmp_path / "d"
    data.mkdir()
    os.chmod(data, mode)
    Journal.open(data, boot_id="b").close()
    assert stat.S_IMODE(os.stat(data).st_mode) == 0o700


def test_a_data_dir_that_is_a_file_or_another_users_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(UnsafeDataDir) as exc:
        Journal.open(f, boot_id="b")
    assert str(exc.value) == f"data_dir {f}: not a directory (a symlink or file is refused)"
    if os.geteuid() != 0:
        return
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 12345, 12345)
    with pytest.raises(UnsafeDataDir) as exc:
        Journal.open(other, boot_id="b")
    assert str(exc.value) == f"data_dir {other}: owned by uid 12345, not by this user (0)"


def test_a_wider_journal_file_is_narrowed_to_0600(tmp_path: Path) -> None:
    data = tmp_path / "d"
    _made(data)
    os.chmod(data / "journal.db", 0o601)
    os.symlink("/nonexistent", data / "journal.db-shm")  # not a regular file: left alone
    with _reopened(data) as j:
        assert stat.S_IMODE(os.stat(data / "journal.db").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(data / "journal.db-wal").st_mode) == 0o600
        assert os.readlink(data / "journal.db-shm") == "/nonexistent"
        assert not j.report.created


def test_fix_file_modes_leaves_non_regular_files_alone(tmp_path: Path) -> None:
    db = tmp_path / "journal.db"
    db.write_bytes(b"")
    os.chmod(db, 0o640)
    (tmp_path / "journal.db-wal").mkdir(mode=0o755)
    os.chmod(tmp_path / "journal.db-wal", 0o755)
    _files.fix_file_modes(db)
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "journal.db-wal").st_mode) == 0o755


def test_the_lock_is_one_process_per_data_dir_and_released_at_close(tmp_path: Path) -> None:
    data = tmp_path / "d"
    j = Journal.open(data, boot_id="b")
    with pytest.raises(JournalLocked) as exc:
        Journal.open(data, boot_id="b")
    assert str(exc.value) == f"{data / 'journal.lock'}: another process holds this journal"
    j.close()
    Journal.open(data, boot_id="b").close()


def test_a_failure_while_opening_releases_the_lock_and_the_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "d"

    def broken(db: Path) -> None:
        raise PermissionError(13, "chmod refused", str(db))

    monkeypatch.setattr(_files, "fix_file_modes", broken)
    with pytest.raises(PermissionError):
        Journal.open(data, boot_id="b")
    monkeypatch.undo()
    # Neither JournalLocked (the lock) nor a healthy journal moved aside as locked (its connection).
    with Journal.open(data, boot_id="b") as j:
        assert not j.report.created and j.report.moved_aside == () and j.report.reason == ""


def test_the_connection_is_wal_full_exclusive_and_distrusts_the_schema(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        c = j._conn
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert c.execute("PRAGMA synchronous").fetchone()[0] == 2
        assert c.execute("PRAGMA locking_mode").fetchone()[0] == "exclusive"
        assert c.execute("PRAGMA trusted_schema").fetchone()[0] == 0
        assert c.isolation_level is None  # autocommit: the journal's own BEGIN/COMMIT


def test_the_on_disk_format_is_the_documented_one(tmp_path: Path) -> None:
    """docs/journal.md "Schema": the meta keys, the command states and outcomes, the event classes as
    stored (another bcd, `bcd journal` and a migration read them by these names and numbers)."""
    data = tmp_path / "d"
    clock = Clock(T0)
    with Journal.open(data, boot_id="b1", clock=clock) as j:
        jid = j.journal_id
        j.set_node_id("node-1")
        j.set_last_epoch(3)
        j.observe_server_time(5000.5)
        j.store_spec(StoredSpec(generation=9, body=b"spec", spec_hash="h", signature=b"s"))
        j.accept_command(cmd("acc"))
        j.accept_command(cmd("run", CommandFlags(retry_safe=False, self_terminating=True, attested=True)))
        j.mark_running("run")
        j.accept_command(cmd("ok"))
        j.complete("ok", Outcome.SUCCEEDED, body=b"res", message="fine")
        j.accept_command(cmd("bad"))
        j.complete("bad", Outcome.FAILED, code="internal")
        j.reject(cmd("rej"), "EXPIRED")
        j.reject(cmd("rjx"), "BAD_SIGNATURE", envelope_sha256=b"\x01" * 32)
        j.cancel_new(cmd("can"), "operator")
        j.append_events(
            [
                NewEvent(EventClass.METRIC, "m", b"1"),
                NewEvent(EventClass.TRANSITION, "t", b"22"),
                NewEvent(EventClass.RESULT, "res", b"333"),
            ]
        )
        j.ack_events(jid, 0)
    conn = sqlite3.connect(data / "journal.db")
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    assert meta == {
        "journal_id": jid,
        "next_event_seq": 4,
        "acked_event_seq": 0,
        "created_at": T0,
        "node_id": "node-1",
        "last_epoch": 3,
        "server_time_mark": 5000.5,
        "applied_generation": 9,
    }
    rows = conn.execute(
        "SELECT id, retry_safe, self_terminating, attested, state, outcome, code, result, message, acked,"
        " envelope_sha256 FROM commands ORDER BY id"
    ).fetchall()
    assert rows == [
        ("acc", 1, 0, 0, "accepted", None, None, None, None, 0, None),
        ("bad", 1, 0, 0, "done", "failed", "internal", b"", "", 0, None),
        ("can", 1, 0, 0, "cancelled", "cancelled", "operator", b"", "", 0, None),
        ("ok", 1, 0, 0, "done", "succeeded", "", b"res", "fine", 0, None),
        ("rej", 1, 0, 0, "rejected", "rejected", "EXPIRED", b"", "", 0, None),
        # A refusal of an envelope nobody signed: flags cleared (no node signature), its digest kept.
        ("rjx", 0, 0, 0, "rejected", "rejected", "BAD_SIGNATURE", b"", "", 0, b"\x01" * 32),
        ("run", 0, 1, 1, "running", None, None, None, None, 0, None),
    ]
    events = conn.execute("SELECT seq, class, type, payload, size, created_at FROM events").fetchall()
    assert events == [(1, 0, "m", b"1", 2, T0), (2, 1, "t", b"22", 3, T0), (3, 2, "res", b"333", 6, T0)]
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(3,)]
    assert conn.execute("SELECT one, generation, body, spec_hash, signature FROM spec").fetchall() == [
        (1, 9, b"spec", "h", b"s")
    ]
    conn.close()


# ---------------------------------------------------------------- checked on open; moved aside


def _moved_aside_for(data: Path, old_id: str, reason: str) -> Journal:
    j = _reopened(data)
    assert j.report.created and j.report.reason == reason
    assert [p.name for p in j.report.moved_aside] == [f"journal.db.failed-{STAMP}"]
    assert j.journal_id != old_id and j.needs_spec and j.next_event_seq == 1
    assert j.resolve("c1").action is Action.NONE and j.unacked_events() == []
    return j


def test_a_missing_table_is_moved_aside(tmp_path: Path) -> None:
    data = tmp_path / "d"
    old = _made(data)
    _sql(data / "journal.db", "DROP TABLE exec_tickets", "DROP TABLE spec")
    _moved_aside_for(data, old, "_Corrupt: schema: missing tables ['exec_tickets', 'spec']").close()


@pytest.mark.parametrize(
    ("statements", "shown"),
    [
        (["UPDATE schema_version SET version = 4"], "[(4,)]"),
        (["UPDATE schema_version SET version = 0"], "[(0,)]"),
        (["UPDATE schema_version SET version = '1x'"], "[('1x',)]"),
        (["INSERT INTO schema_version VALUES (3)"], "[(3,), (3,)]"),
        (["DELETE FROM schema_version"], "[]"),
    ],
)
def test_a_schema_version_this_bcd_cannot_read_is_moved_aside(
    tmp_path: Path, statements: list[str], shown: str
) -> None:
    data = tmp_path / "d"
    old = _made(data)
    _sql(data / "journal.db", *statements)
    reason = f"_Corrupt: schema_version is {shown}, this bcd reads version 3"
    _moved_aside_for(data, old, reason).close()


@pytest.mark.parametrize(
    "statement",
    [
        "DELETE FROM meta WHERE key = 'journal_id'",
        "UPDATE meta SET value = '' WHERE key = 'journal_id'",
        "DELETE FROM meta WHERE key = 'next_event_seq'",
        "UPDATE meta SET value = '2' WHERE key = 'next_event_seq'",
    ],
)
def test_meta_without_journal_id_or_sequence_is_moved_aside(tmp_path: Path, statement: str) -> None:
    data = tmp_path / "d"
    old = _made(data)
    _sql(data / "journal.db", statement)
    _moved_aside_for(data, old, "_Corrupt: meta: journal_id or the event sequence is missing").close()


@pytest.mark.parametrize(("next_seq", "moved"), [(1, True), (2, False)])
def test_an_event_at_or_above_the_next_seq_is_moved_aside(tmp_path: Path, next_seq: int, moved: bool) -> None:
    """The sequence must be above every stored event, or a seq would be handed out twice."""
    data = tmp_path / "d"
    old = _made(data)  # event seq 1 stored, next_event_seq 2
    _sql(data / "journal.db", f"UPDATE meta SET value = {next_seq} WHERE key = 'next_event_seq'")
    if moved:
        reason = "_Corrupt: meta: next_event_seq 1 is not above the stored event 1"
        _moved_aside_for(data, old, reason).close()
    else:
        with _reopened(data) as j:
            assert j.journal_id == old and j.next_event_seq == 2 and not j.report.moved_aside


def test_a_version_1_journal_that_cannot_be_migrated_is_moved_aside(tmp_path: Path) -> None:
    """Version 1 claimed, but the columns version 2 adds are there: the migration fails as a whole
    (nothing half-applied) and the journal is moved aside, never opened half-migrated."""
    data = tmp_path / "d"
    old = _made(data)
    _sql(data / "journal.db", "UPDATE schema_version SET version = 1")
    j = _moved_aside_for(data, old, "OperationalError: duplicate column name: attestation")
    j.close()
    kept = sqlite3.connect(data / f"journal.db.failed-{STAMP}")
    assert kept.execute("SELECT version FROM schema_version").fetchall() == [(1,)]
    kept.close()


def test_move_aside_never_overwrites_an_earlier_failed_journal(tmp_path: Path) -> None:
    """Two failures in the same second: the second is `-1`, its WAL beside it; nothing deleted."""
    data = tmp_path / "d"
    for i in range(3):
        _made(data)
        (data / "journal.db").write_bytes(b"garbage" * 100)
        (data / "journal.db-wal").write_bytes(b"wal" * 10)
        with _reopened(data) as j:
            assert [p.name for p in j.report.moved_aside] == [
                f"journal.db.failed-{STAMP}" + ("" if i == 0 else f"-{i}"),
                f"journal.db.failed-{STAMP}" + ("" if i == 0 else f"-{i}") + "-wal",
            ]
            assert j.report.reason.startswith("DatabaseError: ")
    names = sorted(p.name for p in data.iterdir() if ".failed-" in p.name)
    assert names == sorted(f"journal.db.failed-{STAMP}{n}{s}" for n in ("", "-1", "-2") for s in ("", "-wal"))
    assert (data / f"journal.db.failed-{STAMP}-1").read_bytes() == b"garbage" * 100


def test_move_aside_skips_a_name_taken_by_a_side_file_only(tmp_path: Path) -> None:
    db = tmp_path / "journal.db"
    db.write_bytes(b"x")
    (tmp_path / f"journal.db.failed-{STAMP}-shm").write_bytes(b"old")
    moved = _files.move_aside(db, T0)
    assert [p.name for p in moved] == [f"journal.db.failed-{STAMP}-1"]
    assert (tmp_path / f"journal.db.failed-{STAMP}-shm").read_bytes() == b"old"


def test_an_orphan_wal_is_moved_aside_with_its_reason(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir(mode=0o700)
    (data / "journal.db-wal").write_bytes(b"a wal from an older life")
    with _reopened(data) as j:
        assert j.report.created and j.report.reason == "side files without a journal.db"
        assert [p.name for p in j.report.moved_aside] == [f"journal.db.failed-{STAMP}-wal"]
    assert (data / f"journal.db.failed-{STAMP}-wal").read_bytes() == b"a wal from an older life"


def test_a_healthy_journal_reopens_as_it_was(tmp_path: Path) -> None:
    data = tmp_path / "d"
    old = _made(data)
    with _reopened(data) as j:
        assert j.report.created is False and j.report.moved_aside == () and j.report.reason == ""
        assert j.journal_id == old and j.next_event_seq == 2
        assert j.event_stats().count == 1
        assert j.resolve("c1").action is Action.REEXECUTE
    assert not any(".failed-" in p.name for p in data.iterdir())


def test_event_counters_are_rebuilt_on_open(tmp_path: Path) -> None:
    """The bounds' counters come from every stored event, however many (not only the first ones)."""
    data = tmp_path / "d"
    with Journal.open(data, boot_id="b") as j:
        j.append_events([NewEvent(EventClass.METRIC, "m", b"xy")] * 150)
        j.append_events([NewEvent(EventClass.RESULT, "r", b"xyz")] * 150)
        j.ack_events(j.journal_id, 10)
    with Journal.open(data, boot_id="b") as j:
        st = j.event_stats()
        assert (st.count, st.bytes, st.metric_count, st.metric_bytes) == (290, 140 * 3 + 150 * 4, 140, 420)
        assert j.acked_event_seq == 10 and j.next_event_seq == 301


def test_a_command_without_body_or_signature_is_stored_empty(tmp_path: Path) -> None:
    data = tmp_path / "d"
    with Journal.open(data, boot_id="b") as j:
        j.accept_command(NewCommand("x", "gpu.reset", NOT_RETRY_SAFE))
    with Journal.open(data, boot_id="b") as j:
        e = j.get_command("x")
        assert e is not None and (e.body, e.signature, e.kind) == (b"", b"", "gpu.reset")


def test_a_new_data_dir_is_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with Journal.open(tmp_path / "d", boot_id="b"):
            assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o700
            assert stat.S_IMODE(os.stat(tmp_path / "d" / "journal.lock").st_mode) == 0o600
    finally:
        os.umask(old)


def test_fsync_dir_takes_directories_only(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(NotADirectoryError):
        _files.fsync_dir(f)
    _files.fsync_dir(tmp_path)


def test_a_journal_failing_quick_check_is_moved_aside_naming_the_first_five_problems(tmp_path: Path) -> None:
    """A NOT NULL column holding NULLs (written behind SQLite's back): quick_check names each row; the
    reason keeps the first five."""
    data = tmp_path / "d"
    with Journal.open(data, boot_id="b") as j:
        old = j.journal_id
        for i in range(7):
            j.use_exec_ticket(f"t{i}", 2e9)
    db = data / "journal.db"
    conn = sqlite3.connect(db)
    ddl = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'exec_tickets'").fetchone()[0]
    conn.close()
    loose = ddl.replace("REAL NOT NULL", "REAL")
    _sql(
        db,
        "PRAGMA writable_schema=ON",
        f"UPDATE sqlite_master SET sql = '{loose}' WHERE name = 'exec_tickets'",
    )
    _sql(db, "UPDATE exec_tickets SET expires_at = NULL")
    _sql(
        db, "PRAGMA writable_schema=ON", f"UPDATE sqlite_master SET sql = '{ddl}' WHERE name = 'exec_tickets'"
    )
    with _reopened(data) as j:
        assert j.report.reason == "_Corrupt: quick_check: " + "; ".join(
            ["NULL value in exec_tickets.expires_at"] * 5
        )
        assert j.journal_id != old and j.exec_ticket_count() == 0


def test_a_failure_creating_the_journal_is_raised_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure before any connection exists (creating the file) is the caller's error, unchanged,
    and the lock is released."""
    data = tmp_path / "d"

    def refused(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(_files, "create_db_file", refused)
    with pytest.raises(PermissionError) as exc:
        Journal.open(data, boot_id="b")
    assert exc.value.filename == str(data / "journal.db")
    monkeypatch.undo()
    with Journal.open(data, boot_id="b") as j:
        assert j.report.created


def test_move_aside_never_renames_over_an_earlier_failed_journal_without_side_files(tmp_path: Path) -> None:
    db = tmp_path / "journal.db"
    db.write_bytes(b"first")
    assert [p.name for p in _files.move_aside(db, T0)] == [f"journal.db.failed-{STAMP}"]
    db.write_bytes(b"second")
    assert [p.name for p in _files.move_aside(db, T0)] == [f"journal.db.failed-{STAMP}-1"]
    assert (tmp_path / f"journal.db.failed-{STAMP}").read_bytes() == b"first"
