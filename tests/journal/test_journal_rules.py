"""Integrity check and move-aside, bounds, the server time mark, sweep and exec tickets."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from bcd_agent.journal import (
    MAX_EVENT_BYTES,
    MAX_EXEC_TICKETS,
    MAX_UNACKED_EVENTS,
    RETENTION_S,
    Action,
    BoundError,
    CommandState,
    EventClass,
    Journal,
    JournalFull,
    NewCommand,
    NewEvent,
    Outcome,
    TicketRefused,
    WelcomeRefused,
)
from bcd_shared import wire
from jhelpers import NOT_RETRY_SAFE, REBOOT, RETRY_SAFE, Clock, cmd, crash_copy

M, T, R = EventClass.METRIC, EventClass.TRANSITION, EventClass.RESULT


def _filled(path: Path) -> str:
    with Journal.open(path, boot_id="b") as j:
        for i in range(50):
            j.accept_command(cmd(f"c{i}"))
        j.append_events([NewEvent(T, "t", b"p" * 500)] * 200)
        return j.journal_id


# ---------------------------------------------------------------- integrity and move-aside


def test_corrupt_page_is_moved_aside(tmp_path: Path) -> None:
    """A journal failing quick_check is renamed (never deleted) and a new journal_id starts (DLV-RCV-08)."""
    data = tmp_path / "d"
    old_id = _filled(data)
    db = data / "journal.db"
    size = db.stat().st_size
    assert size > 8 * 4096
    original = db.read_bytes()
    with open(db, "r+b") as f:  # scribble over b-tree pages past the header page
        for off in range(4096, size, 4096 * 2):
            f.seek(off)
            f.write(os.urandom(600))
    clock = Clock(1_700_000_000.0)
    with Journal.open(data, boot_id="b", clock=clock) as j:
        assert j.report.created
        assert j.report.reason
        assert j.journal_id != old_id
        assert j.needs_spec and j.next_event_seq == 1
        assert j.resolve("c1").action is Action.NONE
        moved = j.report.moved_aside
    assert moved and moved[0].name.startswith("journal.db.failed-20231114T")
    assert moved[0].exists() and moved[0].stat().st_size == size
    assert moved[0].read_bytes() != original  # it is the scribbled file, kept for inspection


def test_garbage_header_is_moved_aside(tmp_path: Path) -> None:
    data = tmp_path / "d"
    old_id = _filled(data)
    with open(data / "journal.db", "r+b") as f:
        f.write(b"not a database at all" * 5)
    with Journal.open(data, boot_id="b") as j:
        assert j.journal_id != old_id and j.report.moved_aside
        assert "DatabaseError" in j.report.reason
    # opening again finds the new journal healthy
    with Journal.open(data, boot_id="b") as j2:
        assert not j2.report.created and j2.report.moved_aside == ()


def test_schema_version_mismatch_is_moved_aside(tmp_path: Path) -> None:
    data = tmp_path / "d"
    old_id = _filled(data)
    conn = sqlite3.connect(data / "journal.db")
    conn.execute("UPDATE schema_version SET version = 99")
    conn.commit()
    conn.close()
    with Journal.open(data, boot_id="b") as j:
        assert j.journal_id != old_id
        assert "schema_version" in j.report.reason
    assert len(list(data.glob("journal.db.failed-*"))) >= 1


def test_orphan_wal_is_never_replayed_into_a_new_journal(tmp_path: Path) -> None:
    data = tmp_path / "d"
    j = Journal.open(data, boot_id="b")
    j.accept_command(cmd("x"))
    crash = crash_copy(j, tmp_path / "crash")
    os.remove(crash / "journal.db")
    with Journal.open(crash, boot_id="b") as j2:
        assert j2.report.created and any(p.name.endswith("-wal") for p in j2.report.moved_aside)
        assert j2.resolve("x").action is Action.NONE


# ---------------------------------------------------------------- bounds


def test_DLV_JRN_18_bounds_lowered_never_raised(tmp_path: Path) -> None:
    with pytest.raises(BoundError, match="max_events: 10001 is above"):
        Journal.open(tmp_path / "d", boot_id="b", max_events=MAX_UNACKED_EVENTS + 1)
    with pytest.raises(BoundError, match="max_bytes"):
        Journal.open(tmp_path / "d", boot_id="b", max_bytes=MAX_EVENT_BYTES + 1)
    with pytest.raises(BoundError, match="max_tickets"):
        Journal.open(tmp_path / "d", boot_id="b", max_tickets=MAX_EXEC_TICKETS + 1)
    with pytest.raises(BoundError, match="at least 1"):
        Journal.open(tmp_path / "d", boot_id="b", max_events=0)
    with Journal.open(tmp_path / "d", boot_id="b", max_events=10, max_bytes=1000, max_tickets=3) as j:
        assert j.bounds == (10, 1000, 3)


def test_DLV_JRN_20_oldest_metrics_dropped_first(tmp_path: Path) -> None:
    """Covers DLV-JRN-19 (each event is classed metric, transition or result) and DLV-JRN-05."""
    with Journal.open(tmp_path / "d", boot_id="b", max_events=5) as j:
        j.append_events([NewEvent(M, "m", b"1"), NewEvent(T, "t", b"2"), NewEvent(M, "m", b"3")])
        j.append_events([NewEvent(R, "r", b"4"), NewEvent(M, "m", b"5")])
        out = j.append_events([NewEvent(T, "t", b"6"), NewEvent(M, "m", b"7")])
        assert out.seqs == range(6, 8) and out.dropped_metrics == 2
        assert [e.seq for e in j.unacked_events()] == [2, 4, 5, 6, 7]  # metrics 1 and 3 went first
        st = j.event_stats()
        assert (st.count, st.metric_count) == (5, 2)


def test_DLV_JRN_20_byte_bound_drops_metrics(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b", max_bytes=100) as j:
        j.append_events([NewEvent(M, "m", b"x" * 39)] * 2)  # 40 bytes each (payload + type)
        j.append_event(R, "r", b"y" * 39)  # 120 > 100: the oldest metric goes
        assert [(e.seq, e.cls) for e in j.unacked_events()] == [(2, M), (3, R)]
        assert j.event_stats().bytes == 80


def test_DLV_JRN_21_full_of_results_refuses_and_reports_busy(tmp_path: Path) -> None:
    """Results and transitions are never dropped; when they alone fill the journal, appends of them
    raise JournalFull, is_full() holds and accepts raise JournalFull (BUSY) until acks drain it."""
    with Journal.open(tmp_path / "d", boot_id="b", max_events=4) as j:
        j.append_events([NewEvent(R, "r", b"1"), NewEvent(T, "t", b"2"), NewEvent(M, "m", b"3")])
        assert not j.is_full()
        j.append_event(R, "r", b"4")
        out = j.append_events([NewEvent(T, "t", b"5")])  # the metric makes room
        assert out.dropped_metrics == 1
        assert j.is_full()
        with pytest.raises(JournalFull, match="acks must drain it"):
            j.append_event(R, "r", b"6")
        with pytest.raises(JournalFull):
            j.accept_command(cmd("c"))
        # a metric into a journal full of results is dropped at once, not an error
        m = j.append_event(M, "m", b"7")
        assert [e.seq for e in j.unacked_events()] == [1, 2, 4, 5]
        assert m == 6  # its seq is spent, never reused (the refused append took none)
        # rejections and results of commands already accepted are still journaled
        assert j.reject(cmd("late"), "EXPIRED").result is not None
        assert j.ack_events(j.journal_id, 2) == 2
        assert not j.is_full()
        assert j.append_event(R, "r", b"8") == 7
        j.accept_command(cmd("c"))


def test_DLV_EVT_02_seq_never_reused(tmp_path: Path) -> None:
    """Covers DLV-EVT-02/03/04: seq from 1 per journal_id, cumulative acks, other journal ids ignored."""
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.append_events([NewEvent(T, "t", b"")] * 3).seqs == range(1, 4)
        assert j.ack_events("another-journal", 3) == 0
        assert j.ack_events(j.journal_id, 3) == 3
        assert j.ack_events(j.journal_id, 2) == 0  # not above the last ack
        assert j.unacked_events() == []
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.append_event(T, "t", b"") == 4
        assert j.acked_event_seq == 3
        assert j.ack_events(j.journal_id, 999) == 1  # clamped to the last seq handed out
        assert j.acked_event_seq == 4
        assert j.append_event(T, "t", b"") == 5
        j.append_events([NewEvent(T, "t", bytes([i])) for i in range(10)])
        assert [e.seq for e in j.unacked_events(after_seq=8, limit=3)] == [9, 10, 11]


# ---------------------------------------------------------------- server time mark


def test_DLV_JRN_12_13_server_time_mark(tmp_path: Path) -> None:
    """The journal's rules for the mark; that the node feeds it every Welcome and heartbeat is shown by
    the mirroring test in tests/session/test_session_core.py."""
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.observe_server_time(1000.0) == 1000.0
        assert j.observe_server_time(900.0) == 1000.0  # only forward
        assert j.check_welcome(1000.0 - 300.0) == 1000.0  # exactly 5 minutes before: allowed
        with pytest.raises(WelcomeRefused, match="before the server time mark"):
            j.check_welcome(1000.0 - 300.5)
        assert j.check_welcome(1200.0) == 1200.0  # a good Welcome moves the mark
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.server_time_mark == 1200.0


# ---------------------------------------------------------------- sweep


def test_DLV_REC_13_to_15_sweep(tmp_path: Path) -> None:
    """Done entries are swept after the journal's retention, and kept until acked (the 7 days
    themselves are asserted by the next test)."""
    clock = Clock(1_000_000.0)
    j = Journal.open(tmp_path / "a", boot_id="b", clock=clock)
    j.accept_command(cmd("old-done"))
    j.complete("old-done", Outcome.SUCCEEDED)
    j.ack_results(["old-done"])
    j.accept_command(cmd("old-unacked"))
    j.complete("old-unacked", Outcome.FAILED, code="internal")
    j.accept_command(cmd("left-safe", RETRY_SAFE))
    j.accept_command(cmd("left-unsafe", NOT_RETRY_SAFE))
    j.accept_command(cmd("left-running", NOT_RETRY_SAFE))
    j.mark_running("left-running")
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="b", clock=clock) as j2:
        j2.accept_command(cmd("mine"))  # this process's entry: never swept
        clock.t += 10
        j2.accept_command(cmd("recent-left"))
        assert j2.sweep(clock.t + RETENTION_S - 20) == 0  # nothing is 7 days old yet
        clock.t += RETENTION_S + 1
        assert j2.sweep() == 4  # old-done, left-safe, left-unsafe, left-running
        ids = {c for c in ("old-done", "old-unacked", "left-safe", "left-unsafe", "left-running", "mine")}
        assert {c for c in ids if j2.get_command(c) is not None} == {"old-unacked", "mine"}
        # an unacked result is kept until acked, then swept
        j2.ack_results(["old-unacked"])
        assert j2.sweep() == 1
        assert j2.get_command("mine") is not None


def test_DLV_JRN_04_an_acked_done_entry_is_kept_7_days_and_not_a_second_more(tmp_path: Path) -> None:
    """Covers DLV-JRN-04 against the seeds' 7 days written out here (the test above reads the journal's
    own constant, so a wrong constant would pass it): kept one second before, swept one second after."""
    week = 7 * 24 * 3600
    clock = Clock(1_000_000.0)
    j = Journal.open(tmp_path / "a", boot_id="b", clock=clock)
    j.accept_command(cmd("done"))
    j.complete("done", Outcome.SUCCEEDED)
    j.ack_results(["done"])
    finished = clock.t
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="b", clock=clock) as j2:
        assert j2.sweep(finished + week - 1) == 0 and j2.get_command("done") is not None
        assert j2.sweep(finished + week + 1) == 1 and j2.get_command("done") is None


def test_DLV_REC_15_sweep_keeps_every_entry_of_the_running_process_however_old(tmp_path: Path) -> None:
    """This process's `accepted`, `running{boot_id}` and unacked `done` entries, all past 7 days, stay;
    the same `running` entry left by an earlier process goes."""
    clock = Clock(1_000_000.0)
    j = Journal.open(tmp_path / "a", boot_id="b", clock=clock)
    j.accept_command(cmd("left-running", REBOOT))
    j.mark_running("left-running")
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="b", clock=clock) as j2:
        j2.accept_command(cmd("mine-accepted", NOT_RETRY_SAFE))
        j2.accept_command(cmd("mine-running", REBOOT))
        j2.mark_running("mine-running")
        j2.accept_command(cmd("mine-done"))
        j2.complete("mine-done", Outcome.SUCCEEDED)
        clock.t += 3 * RETENTION_S
        assert j2.sweep() == 1
        assert j2.get_command("left-running") is None
        kept = {c: j2.get_command(c) for c in ("mine-accepted", "mine-running", "mine-done")}
        assert all(e is not None for e in kept.values()), kept
        running = kept["mine-running"]
        assert running is not None and running.state is CommandState.RUNNING


def _signed_body(cid: str, not_after_ms: int) -> NewCommand:
    """A command whose stored body names `not_after_ms` (0: none), as a gateway sends it."""
    body = bytes(
        wire.CommandBody(id=cid, node_id="n", seq=1, kind="inventory.refresh", not_after=not_after_ms)
    )
    return NewCommand(id=cid, kind="inventory.refresh", flags=RETRY_SAFE, body=body, signature=b"sig")


def test_DLV_REC_13_sweep_keeps_an_entry_until_its_not_after_is_behind_any_welcome(tmp_path: Path) -> None:
    """An entry past the 7 days goes only once its body's not_after is at or before the server time mark
    less the Welcome slack (5 minutes, written out here): a Welcome can set server time no earlier, and
    a command at or past its not_after is EXPIRED, so a replay of the signed bytes can no longer run. At
    the horizon itself it goes; a millisecond later it stays, done or left by an earlier process, until
    the mark moves. A body naming no not_after, one that does not parse, and a refusal journaled without
    its body (whatever not_after the refused body named) never ran again: they go at 7 days."""
    clock = Clock(1_000_000.0)
    mark = 2_000_000.0
    horizon_ms = int((mark - 300.0) * 1000)
    j = Journal.open(tmp_path / "a", boot_id="b", clock=clock)
    j.accept_command(_signed_body("left-later", horizon_ms + 1))  # left accepted by this process
    done = {
        "at-horizon": _signed_body("at-horizon", horizon_ms),
        "after-horizon": _signed_body("after-horizon", horizon_ms + 1),
        "no-not-after": _signed_body("no-not-after", 0),
        "unparsable": NewCommand(id="unparsable", kind="k", flags=RETRY_SAFE, body=b"\x08", signature=b"s"),
    }
    for cid, command in done.items():
        j.accept_command(command)
        j.complete(cid, Outcome.SUCCEEDED)
    refused = j.reject(_signed_body("refused", horizon_ms + 86_400_000), "BAD_SIGNATURE")
    assert (refused.body, refused.signature) == (b"", b"")  # the refusal keeps neither
    assert j.ack_results([*done, "refused"]) == 5
    assert j.observe_server_time(mark) == mark
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="b", clock=clock) as j2:
        every = ("left-later", *done, "refused")
        assert j2.sweep(clock.t + RETENTION_S + 1) == 4
        assert {c for c in every if j2.get_command(c) is not None} == {"left-later", "after-horizon"}
        assert j2.sweep(clock.t + RETENTION_S + 1) == 0
        j2.observe_server_time(mark + 1.0)  # the horizon passes both not_afters
        assert j2.sweep(clock.t + RETENTION_S + 1) == 2
        assert {c for c in every if j2.get_command(c) is not None} == set()


def test_DLV_JRN_13_a_ceiling_bounds_how_far_the_mark_moves(tmp_path: Path) -> None:
    """The session's bound on a gateway's lead (the ceiling): observe_server_time and check_welcome move
    the mark to the server time or the ceiling, whichever is earlier, never back; without a ceiling the
    server time alone. The bounded mark is what a later Welcome is judged by."""
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.observe_server_time(5000.0, ceiling=1000.0) == 1000.0
        assert j.observe_server_time(900.0, ceiling=2000.0) == 1000.0  # below the mark: unchanged
        assert j.observe_server_time(1500.0, ceiling=2000.0) == 1500.0  # under the ceiling: itself
        assert j.check_welcome(9000.0, 1600.0) == 1600.0
        assert j.check_welcome(1600.0 - 300.0, 1700.0) == 1600.0  # judged by the bounded mark: taken
        assert j.check_welcome(1650.0, None) == 1650.0
        assert j.observe_server_time(1700.0) == 1700.0
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.server_time_mark == 1700.0


def test_DLV_RES_08_a_replay_reads_at_most_the_oldest_limit_results(tmp_path: Path) -> None:
    """unacked_results(limit=n): the n oldest unacked results (by finish time), acked ones not counted
    against the limit."""
    clock = Clock()
    with Journal.open(tmp_path / "d", boot_id="b", clock=clock) as j:
        for i in range(5):
            clock.t += 1
            j.accept_command(cmd(f"c{i}"))
            j.complete(f"c{i}", Outcome.SUCCEEDED)
        j.ack_results(["c0"])
        assert [e.id for e in j.unacked_results(limit=2)] == ["c1", "c2"]
        assert [e.id for e in j.unacked_results(limit=1)] == ["c1"]
        assert [e.id for e in j.unacked_results(limit=10)] == ["c1", "c2", "c3", "c4"]
        assert [e.id for e in j.unacked_results()] == ["c1", "c2", "c3", "c4"]


# ---------------------------------------------------------------- exec tickets


def test_DLV_JRN_08_to_10_exec_tickets(tmp_path: Path) -> None:
    """The rules on a set of 3; the contract's bound is 10,000, and no config may raise it."""
    with Journal.open(tmp_path / "default", boot_id="b") as j:
        assert j.bounds[2] == 10_000
    with pytest.raises(BoundError, match="max_tickets: 10001 is above the contract's limit 10000"):
        Journal.open(tmp_path / "default", boot_id="b", max_tickets=10_001)
    clock = Clock(1000.0)
    with Journal.open(tmp_path / "d", boot_id="b", max_tickets=3, clock=clock) as j:
        j.use_exec_ticket("a", 1100.0)
        with pytest.raises(TicketRefused, match="replayed"):
            j.use_exec_ticket("a", 1100.0)
        with pytest.raises(TicketRefused, match="expired"):
            j.use_exec_ticket("z", 1000.0)
        j.use_exec_ticket("b", 1050.0)
        j.use_exec_ticket("c", 1200.0)
        with pytest.raises(TicketRefused) as exc:
            j.use_exec_ticket("d", 1200.0)
        assert exc.value.reason == "full"
        clock.t = 1060.0  # b expired: purged to make room
        j.use_exec_ticket("d", 1200.0)
        assert j.exec_ticket_count() == 3
    clock.t = 1101.0
    with Journal.open(tmp_path / "d", boot_id="b", max_tickets=3, clock=clock) as j:
        with pytest.raises(TicketRefused, match="replayed"):
            j.use_exec_ticket("c", 1200.0)  # survives a restart
        j.use_exec_ticket("a", 1300.0)  # a's first use has expired: it no longer blocks
        j.sweep()
        assert j.exec_ticket_count() == 3
