"""The journal's rules at their edges: each bound at the limit and one past it, the event sequence and
acks, a lost tail's restart, exec tickets at their expiry instant, Sweep at exactly 7 days, the server
time mark at exactly 5 minutes, and every refusal's message naming the command and the rule.

In process and fast: mutation testing (docs/mutation.md, `journal`) sees these tests' coverage.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from bcd_agent.journal import (
    RETENTION_S,
    Action,
    CommandState,
    Completion,
    EventClass,
    EventsAppended,
    Journal,
    JournalFull,
    NewEvent,
    Outcome,
    StateError,
    TicketRefused,
    WelcomeRefused,
)
from jhelpers import KEXEC, NOT_RETRY_SAFE, REBOOT, RETRY_SAFE, Clock, cmd, crash_copy

M, T, R = EventClass.METRIC, EventClass.TRANSITION, EventClass.RESULT


def _ev(cls: EventClass, payload: bytes, type: str = "t") -> NewEvent:
    return NewEvent(cls, type, payload)


def _seqs(j: Journal) -> list[int]:
    return [e.seq for e in j.unacked_events()]


# ---------------------------------------------------------------- event bounds


def test_DLV_JRN_21_the_event_count_bound_at_the_limit_and_one_past(tmp_path: Path) -> None:
    """max_events transition/result events fit; is_full() holds exactly at the bound (accepts BUSY);
    one more is refused whole, nothing written and no seq spent."""
    with Journal.open(tmp_path / "d", boot_id="b", max_events=3) as j:
        assert j.append_events([_ev(T, b"1"), _ev(R, b"2")]) == EventsAppended(1, 2, 0)
        assert not j.is_full()
        j.accept_command(cmd("ok"))  # one below the bound: accepted
        with pytest.raises(JournalFull) as exc:
            j.append_events([_ev(R, b"3"), _ev(T, b"4")])
        assert str(exc.value) == (
            "journal full: 2 unacked transition/result events (4 bytes) against bounds of 3 events and"
            f" {64 * 1024 * 1024} bytes; acks must drain it"
        )
        assert _seqs(j) == [1, 2] and j.next_event_seq == 3
        assert j.append_event(R, "t", b"3") == 3  # exactly at the bound: written
        assert j.is_full()
        with pytest.raises(JournalFull) as exc:
            j.accept_command(cmd("busy"))
        assert str(exc.value).startswith("journal full: 3 unacked transition/result events (6 bytes)")
        assert j.get_command("busy") is None
        (refused,) = j.accept_commands([cmd("busy")])
        assert isinstance(refused, JournalFull) and j.get_command("busy") is None


def test_DLV_JRN_21_the_byte_bound_at_the_limit_and_one_past(tmp_path: Path) -> None:
    """An event's size is its payload plus its type."""
    with Journal.open(tmp_path / "d", boot_id="b", max_bytes=100) as j:
        j.append_event(T, "tt", b"x" * 48)  # 50 bytes
        with pytest.raises(JournalFull):
            j.append_event(R, "r", b"y" * 50)  # 51: one past
        assert not j.is_full()
        j.append_event(R, "r", b"y" * 49)  # 50: exactly at the bound
        assert j.is_full() and j.event_stats().bytes == 100
        j.ack_events(j.journal_id, 1)
        assert not j.is_full() and j.event_stats().bytes == 50


def test_DLV_JRN_20_metrics_make_room_oldest_first_and_never_more_than_needed(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b", max_events=4) as j:
        j.append_events([_ev(M, b"1"), _ev(M, b"2"), _ev(T, b"3"), _ev(M, b"4")])  # exactly 4: none dropped
        assert _seqs(j) == [1, 2, 3, 4] and j.event_totals() == (0, 0)
        out = j.append_events([_ev(R, b"5")])
        assert out == EventsAppended(5, 1, 1)
        assert _seqs(j) == [2, 3, 4, 5]
        out = j.append_events([_ev(M, b"6"), _ev(T, b"7")])
        assert out == EventsAppended(6, 2, 2)
        assert _seqs(j) == [3, 5, 6, 7]
        st = j.event_stats()
        assert (st.count, st.bytes, st.metric_count, st.metric_bytes) == (4, 8, 1, 2)
        assert j.event_totals() == (0, 3)
        # a batch of metrics alone larger than the bound keeps only its newest
        out = j.append_events([_ev(M, bytes([i])) for i in range(5)])
        assert out == EventsAppended(8, 5, 5)  # the old metric 6 and four of the five new ones
        assert [(e.seq, e.payload) for e in j.unacked_events()] == [
            (3, b"3"),
            (5, b"5"),
            (7, b"7"),
            (12, b"\x04"),
        ]
        assert j.event_totals() == (0, 8)


def test_DLV_JRN_20_the_byte_bound_drops_metrics_until_it_fits(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b", max_bytes=30) as j:
        j.append_events([_ev(M, b"a" * 9), _ev(M, b"b" * 9), _ev(M, b"c" * 9)])  # 30 bytes: fits
        out = j.append_event(T, "t", b"d" * 14)  # 15 more: two metrics must go
        assert out == 4
        assert [(e.seq, e.cls) for e in j.unacked_events()] == [(3, M), (4, T)]
        st = j.event_stats()
        assert (st.count, st.bytes, st.metric_count, st.metric_bytes) == (2, 25, 1, 10)


def test_an_empty_batch_writes_nothing(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        j.append_event(T, "t", b"")
        assert j.append_events([]) == EventsAppended(2, 0, 0)
        assert j.append_events([]).seqs == range(2, 2)
        assert j.commits == 1 and j.next_event_seq == 2


# ---------------------------------------------------------------- reading and acking events


def test_unacked_events_by_count_and_by_bytes(tmp_path: Path) -> None:
    clock = Clock(5000.0)
    with Journal.open(tmp_path / "d", boot_id="b", clock=clock) as j:
        j.append_events([_ev(T, b"x" * 10, type=f"t{i}") for i in range(1001)])
        got = j.unacked_events()
        assert len(got) == 1000 and got[0].seq == 1 and got[-1].seq == 1000  # the default limit
        assert (got[0].cls, got[0].type, got[0].payload, got[0].created_at) == (T, "t0", b"x" * 10, 5000.0)
        assert [e.seq for e in j.unacked_events(after_seq=999)] == [1000, 1001]
        assert [e.seq for e in j.unacked_events(max_bytes=30)] == [1, 2, 3]  # exactly 30 payload bytes
        assert [e.seq for e in j.unacked_events(max_bytes=29)] == [1, 2]
        assert [e.seq for e in j.unacked_events(max_bytes=1)] == [1]  # always the first
        assert [e.seq for e in j.unacked_events(after_seq=5, limit=2, max_bytes=0)] == [6]


def test_DLV_EVT_04_acks_are_cumulative_clamped_and_counted(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        j.append_events([_ev(M, b"1"), _ev(T, b"22"), _ev(R, b"333")])
        assert j.ack_events(j.journal_id, 0) == 0 and j.acked_event_seq == 0
        assert j.ack_events(j.journal_id, 1) == 1
        assert (j.acked_event_seq, j.event_totals()) == (1, (1, 0))
        st = j.event_stats()
        assert (st.count, st.bytes, st.metric_count, st.metric_bytes) == (2, 7, 0, 0)
        assert j.ack_events(j.journal_id, 1) == 0  # not above the last ack
        assert j.ack_events("another", 3) == 0 and j.acked_event_seq == 1
        assert j.ack_events(j.journal_id, 10) == 2  # clamped to the last seq handed out
        assert (j.acked_event_seq, j.event_totals()) == (3, (3, 0))
        assert j.event_stats().count == 0 and j.unacked_events() == []
        assert j.ack_events(j.journal_id, 10) == 0
        assert j.append_event(T, "t", b"") == 4  # a seq is never handed out twice


def test_restart_events_renumbers_the_unacked_events_under_a_new_journal_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lost tail: the unacked events keep their order and payloads, numbered from 1 under a new id;
    an ack for the old id is ignored; it survives a restart."""
    data = tmp_path / "d"
    with Journal.open(data, boot_id="b") as j:
        old = j.journal_id
        j.append_events([_ev(T, bytes([i]), type=f"t{i}") for i in range(1, 6)])
        j.ack_events(old, 2)
        with caplog.at_level(logging.ERROR, logger="bcd_agent.journal._store"):
            new = j.restart_events()
        assert new == j.journal_id and new != old and len(new) == 32
        assert caplog.messages == [f"journal: events restarted under journal_id {new} (was {old})"]
        assert [(e.seq, e.type, e.payload) for e in j.unacked_events()] == [
            (1, "t3", b"\x03"), (2, "t4", b"\x04"), (3, "t5", b"\x05"),
        ]  # fmt: skip
        assert (j.next_event_seq, j.acked_event_seq) == (4, 0)
        assert j.ack_events(old, 3) == 0
        assert j.append_event(T, "t", b"") == 4
        assert j.ack_events(new, 1) == 1
    with Journal.open(data, boot_id="b") as j:
        assert j.journal_id == new and (j.next_event_seq, j.acked_event_seq) == (5, 1)
        assert [e.seq for e in j.unacked_events()] == [2, 3, 4]
        j.ack_events(new, 4)
        j.restart_events()  # nothing unacked: the sequence starts again at 1
        assert (j.next_event_seq, j.acked_event_seq, j.unacked_events()) == (1, 0, [])


# ---------------------------------------------------------------- the server time mark


def test_DLV_JRN_13_a_welcome_just_past_5_minutes_is_refused_with_both_times(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        j.observe_server_time(10_000.0)
        with pytest.raises(WelcomeRefused) as exc:
            j.check_welcome(9_699.5)
        assert str(exc.value) == (
            "Welcome.server_time 9699.500 is 300 s before the server time mark 10000.000"
            " (at most 300 s allowed)"
        )
        assert j.server_time_mark == 10_000.0  # the refusal changes nothing
        assert j.check_welcome(9_700.0) == 10_000.0
        assert j.check_welcome(10_000.25) == 10_000.25
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.server_time_mark == 10_000.25


# ---------------------------------------------------------------- commands: refusals by name


def test_each_refused_transition_names_the_command_and_the_rule(tmp_path: Path) -> None:
    j = Journal.open(tmp_path / "a", boot_id="b1")
    j.accept_command(cmd("left", NOT_RETRY_SAFE))
    j.accept_command(cmd("left-safe", RETRY_SAFE))
    j.accept_command(cmd("left-run", NOT_RETRY_SAFE))
    j.mark_running("left-run")
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="b1") as k:
        with pytest.raises(StateError) as exc:
            k.mark_running("ghost")
        assert str(exc.value) == "command ghost: cannot mark running: not journaled"
        with pytest.raises(StateError) as exc:
            k.mark_running("left")
        assert (
            str(exc.value)
            == "command left: cannot mark running: it is accepted (written by an earlier process)"
        )
        k.accept_command(cmd("mine"))
        k.mark_running("mine")
        with pytest.raises(StateError) as exc:
            k.mark_running("mine")
        assert str(exc.value) == "command mine: cannot mark running: it is running (written by this process)"
        with pytest.raises(StateError) as exc:
            k.accept_command(cmd("left"))
        assert str(exc.value) == "command left: already journaled (accepted); resolve it first"
        with pytest.raises(StateError) as exc:
            k.accept_command(cmd("mine"))
        assert str(exc.value) == "command mine: already journaled (running); resolve it first"
        with pytest.raises(StateError) as exc:
            k.complete("left", Outcome.FAILED)
        assert str(exc.value) == "command left: left by an earlier process; resolve it first"
        with pytest.raises(StateError) as exc:
            k.complete("ghost", Outcome.FAILED)
        assert str(exc.value) == "command ghost: not journaled"
        with pytest.raises(StateError) as exc:
            k.settle("ghost")
        assert str(exc.value) == "command ghost: not journaled"
        with pytest.raises(StateError) as exc:
            k.reject(cmd("mine"), "EXPIRED")
        assert str(exc.value) == "command mine: running; its side effect started, report its outcome"
        with pytest.raises(ValueError) as bad:
            k.complete("mine", Outcome.REJECTED)
        assert str(bad.value) == "outcome: complete() takes SUCCEEDED or FAILED, got rejected"
        with pytest.raises(ValueError) as bad:
            k.complete_many([Completion("mine", Outcome.SUCCEEDED), Completion("mine", Outcome.CANCELLED)])
        assert str(bad.value) == "outcome: complete_many() takes SUCCEEDED or FAILED, got cancelled"
        assert k.get_command("mine").state is CommandState.RUNNING  # type: ignore[union-attr]
        with pytest.raises(ValueError) as bad:
            k.reject(cmd("new"), "")
        assert str(bad.value) == "reason: a rejection needs its reason"
        assert k.get_command("new") is None
        # a running entry an earlier process left may be rejected (re-checked), as may its accepted one
        assert k.reject(cmd("left-run"), "EXPIRED").state is CommandState.REJECTED
        # settle leaves what needs the server alone
        safe = k.get_command("left-safe")
        assert k.settle("left-safe") == safe and k.resolve("left-safe").action is Action.REEXECUTE
        assert k.settle("mine").state is CommandState.RUNNING


def test_accept_commands_refuses_in_place_and_takes_over_leftovers(tmp_path: Path) -> None:
    clock = Clock(100.0)
    j = Journal.open(tmp_path / "a", boot_id="b1", clock=clock)
    j.accept_command(cmd("safe", RETRY_SAFE))
    j.accept_command(cmd("unsafe", NOT_RETRY_SAFE))
    data = crash_copy(j, tmp_path / "b")
    clock.t = 200.0
    with Journal.open(data, boot_id="b2", clock=clock) as k:
        out = k.accept_commands([cmd("safe"), cmd("unsafe"), cmd("new")])
        assert isinstance(out[1], StateError)
        assert str(out[1]) == "command unsafe: already journaled (accepted); resolve it first"
        for e in (out[0], out[2]):
            assert not isinstance(e, Exception)
            assert (e.state, e.incarnation, e.boot_id, e.accepted_at) == (
                CommandState.ACCEPTED, k.incarnation, "b2", 200.0,
            )  # fmt: skip
            assert k.get_command(e.id) == e
        assert k.resolve("unsafe").action is Action.INTERRUPTED


def test_complete_many_writes_each_outcome_and_refuses_in_place(tmp_path: Path) -> None:
    clock = Clock(100.0)
    with Journal.open(tmp_path / "a", boot_id="b1", clock=clock) as j:
        j.accept_commands([cmd("a"), cmd("b")])
        clock.t = 150.0
        out = j.complete_many(
            [
                Completion("a", Outcome.SUCCEEDED, body=b"ra", message="m" * 2000),
                Completion("ghost", Outcome.FAILED),
                Completion("b", Outcome.FAILED, code="gpu-busy"),
            ]
        )
        assert isinstance(out[1], StateError) and str(out[1]) == "command ghost: not journaled"
        a, b = out[0], out[2]
        assert not isinstance(a, Exception) and not isinstance(b, Exception)
        assert a.result is not None and b.result is not None
        assert (a.result.outcome, a.result.body, a.result.message, a.result.finished_at) == (
            Outcome.SUCCEEDED, b"ra", "m" * 1024, 150.0,
        )  # fmt: skip
        assert (b.result.outcome, b.result.code, b.updated_at, b.accepted_at) == (
            Outcome.FAILED,
            "gpu-busy",
            150.0,
            100.0,
        )
        assert j.get_command("a") == a and j.get_command("b") == b
        assert [e.id for e in j.unacked_results()] == ["a", "b"]


def test_message_cap_is_1024_characters(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "a", boot_id="b1") as j:
        j.accept_command(cmd("a"))
        assert j.complete("a", Outcome.FAILED, message="y" * 1024).result.message == "y" * 1024  # type: ignore[union-attr]
        assert j.reject(cmd("r"), "EXPIRED", "z" * 1025).result.message == "z" * 1024  # type: ignore[union-attr]


def test_a_rebooted_result_names_both_boots_and_an_interrupted_one_this_boot(tmp_path: Path) -> None:
    """DLV-REC-17: the `rebooted` result carries the previous boot id; each settled result carries the
    boot it was produced in, its time, and leaves the rest of the entry as it was."""
    clock = Clock(100.0)
    j = Journal.open(tmp_path / "a", boot_id="boot1", clock=clock)
    j.accept_command(cmd("r", REBOOT, "node.reboot"))
    j.mark_running("r")
    j.accept_command(cmd("k", KEXEC, "boot.kexec"))  # accepted only: not known to have started
    data = crash_copy(j, tmp_path / "b")
    clock.t = 300.0
    with Journal.open(data, boot_id="boot2", clock=clock) as k:
        assert k.resolve("k").action is Action.INTERRUPTED
        settled = {e.id: e for e in k.recover()}
        r, i = settled["r"], settled["k"]
        assert r.result is not None and i.result is not None
        assert (r.result.outcome, r.result.code, r.result.boot_id, r.result.previous_boot_id) == (
            Outcome.SUCCEEDED, "rebooted", "boot2", "boot1",
        )  # fmt: skip
        assert (i.result.outcome, i.result.code, i.result.boot_id, i.result.previous_boot_id) == (
            Outcome.FAILED, "interrupted", "boot2", "",
        )  # fmt: skip
        assert (r.result.finished_at, r.updated_at, r.accepted_at, r.boot_id) == (
            300.0,
            300.0,
            100.0,
            "boot1",
        )
        assert (r.result.body, i.result.body, r.result.message, i.result.message) == (b"", b"", "", "")
        assert (r.kind, r.body, r.signature, r.incarnation) == (
            "node.reboot",
            b"body:r",
            b"sig:r",
            j.incarnation,
        )
        assert k.get_command("r") == r and k.get_command("k") == i


def test_settle_does_what_recover_does_for_one_entry(tmp_path: Path) -> None:
    clock = Clock(100.0)
    j = Journal.open(tmp_path / "a", boot_id="boot1", clock=clock)
    j.accept_command(cmd("r", REBOOT, "node.reboot"))
    j.mark_running("r")
    data = crash_copy(j, tmp_path / "b")
    clock.t = 400.0
    with Journal.open(data, boot_id="boot2", clock=clock) as k:
        e = k.settle("r")
        assert e.result is not None
        assert (e.state, e.result.code, e.result.previous_boot_id, e.result.finished_at) == (
            CommandState.DONE, "rebooted", "boot1", 400.0,
        )  # fmt: skip
        assert k.settle("r") == e  # terminal: unchanged
        assert k.recover() == ()


def test_cancel_and_cancel_new_carry_their_reason_and_boot(tmp_path: Path) -> None:
    clock = Clock(100.0)
    with Journal.open(tmp_path / "a", boot_id="b1", clock=clock) as j:
        j.accept_command(cmd("q"))
        clock.t = 120.0
        c = j.cancel("q")
        assert c is not None and c.result is not None
        assert (c.result.outcome, c.result.code, c.result.boot_id, c.result.finished_at, c.result.body) == (
            Outcome.CANCELLED, "", "b1", 120.0, b"",
        )  # fmt: skip
        n = j.cancel_new(cmd("n"))
        assert n.result is not None and (n.result.code, n.accepted_at, n.incarnation) == (
            "",
            120.0,
            j.incarnation,
        )
        assert j.cancel("q", "again") == c


# ---------------------------------------------------------------- sweep at exactly 7 days


def test_DLV_REC_13_14_sweep_at_exactly_seven_days_keeps_and_one_second_past_deletes(tmp_path: Path) -> None:
    assert RETENTION_S == 7 * 24 * 3600
    clock = Clock(1_000_000.0)
    j = Journal.open(tmp_path / "a", boot_id="b", clock=clock)
    j.accept_command(cmd("done"))
    j.complete("done", Outcome.SUCCEEDED)
    j.ack_results(["done"])
    j.accept_command(cmd("left"))
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="b", clock=clock) as k:
        k.use_exec_ticket("t1", 1_000_000.0 + RETENTION_S)
        assert k.sweep(1_000_000.0 + RETENTION_S) == 0  # exactly 7 days: kept (and the ticket: its expiry)
        assert k.get_command("done") is not None and k.get_command("left") is not None
        assert k.exec_ticket_count() == 0  # expired at its instant: purged
        k.use_exec_ticket("t2", 1_000_000.0 + RETENTION_S + 10)
        assert k.sweep(1_000_000.0 + RETENTION_S + 1) == 2
        assert k.get_command("done") is None and k.get_command("left") is None
        assert k.exec_ticket_count() == 1
        clock.t = 1_000_000.0 + 2 * RETENTION_S
        assert k.sweep() == 0 and k.exec_ticket_count() == 0  # `now` from the clock


# ---------------------------------------------------------------- exec tickets at their edges


def test_DLV_JRN_09_a_ticket_is_replayed_until_its_expiry_instant(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    with Journal.open(tmp_path / "d", boot_id="b", clock=clock) as j:
        with pytest.raises(TicketRefused) as exc:
            j.use_exec_ticket("late", 1000.0)
        assert (str(exc.value), exc.value.jti, exc.value.reason) == (
            "exec ticket 'late' refused: expired", "late", "expired",
        )  # fmt: skip
        j.use_exec_ticket("early", 1000.5)
        j.use_exec_ticket("a", 1100.0)
        with pytest.raises(TicketRefused) as exc:
            j.use_exec_ticket("a", 1200.0, now=1099.9)
        assert str(exc.value) == "exec ticket 'a' refused: replayed"
        j.use_exec_ticket("a", 1200.0, now=1100.0)  # its first use expired at 1100: a new use
        assert j.exec_ticket_count() == 2  # the row was replaced, not added
        with pytest.raises(TicketRefused, match="replayed"):
            j.use_exec_ticket("a", 1300.0, now=1150.0)


def test_DLV_JRN_10_the_ticket_set_at_its_bound_and_one_past(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    with Journal.open(tmp_path / "d", boot_id="b", clock=clock, max_tickets=2) as j:
        j.use_exec_ticket("a", 1010.0)
        j.use_exec_ticket("b", 1020.0)  # at the bound
        with pytest.raises(TicketRefused) as exc:
            j.use_exec_ticket("c", 1030.0)
        assert str(exc.value) == "exec ticket 'c' refused: full"
        assert j.exec_ticket_count() == 2
        clock.t = 1010.0  # a expires at this instant: purged to make room for one
        j.use_exec_ticket("c", 1030.0)
        assert j.exec_ticket_count() == 2
        with pytest.raises(TicketRefused, match="full"):
            j.use_exec_ticket("d", 1030.0)
        clock.t = 1020.0
        with pytest.raises(TicketRefused, match="replayed"):
            j.use_exec_ticket("c", 1040.0)
    with Journal.open(tmp_path / "d", boot_id="b", clock=clock, max_tickets=2) as j:
        assert j.exec_ticket_count() == 2  # b (expired, not yet purged) and c
        clock.t = 1031.0
        j.use_exec_ticket("e", 1040.0)
        assert j.exec_ticket_count() == 1  # both purged, e added


# ---------------------------------------------------------------- spec


def test_store_spec_refuses_a_generation_not_above_the_held_one(tmp_path: Path) -> None:
    from bcd_agent.journal import StoredSpec

    with Journal.open(tmp_path / "d", boot_id="b") as j:
        j.store_spec(StoredSpec(generation=1, body=b"a", spec_hash="h1", signature=b""))
        with pytest.raises(StateError) as exc:
            j.store_spec(StoredSpec(generation=0, body=b"b", spec_hash="h0", signature=b""))
        assert str(exc.value) == "spec generation 0 is not above the applied generation 1"
        j.store_spec(StoredSpec(generation=2, body=b"c", spec_hash="h2", signature=b"s"))
        assert j.load_spec() == StoredSpec(generation=2, body=b"c", spec_hash="h2", signature=b"s")
        j.discard_spec()
        j.store_spec(StoredSpec(generation=1, body=b"d", spec_hash="h1", signature=b""))  # after discard: any
        assert j.applied_generation == 1


# ---------------------------------------------------------------- what each write leaves


def test_meta_setters_take_effect_at_once_and_survive_a_restart(tmp_path: Path) -> None:
    from bcd_agent.journal import StoredSpec

    with Journal.open(tmp_path / "d", boot_id="b") as j:
        j.set_node_id("node-9")
        j.set_last_epoch(4)
        assert (j.node_id, j.last_epoch) == ("node-9", 4)
        j.store_spec(StoredSpec(generation=3, body=b"x", spec_hash="h", signature=b""))
        j.discard_spec()
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert (j.node_id, j.last_epoch, j.applied_generation, j.needs_spec) == ("node-9", 4, 0, True)


def test_results_carry_empty_defaults_and_the_ack_flag(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b1") as j:
        j.accept_commands([cmd("a"), cmd("m")])
        a = j.complete("a", Outcome.SUCCEEDED)
        (m,) = j.complete_many([Completion("m", Outcome.SUCCEEDED)])
        r = j.reject(cmd("r"), "EXPIRED")
        n = j.cancel_new(cmd("n"), "operator")
        for e in (a, m, r, n):
            assert not isinstance(e, Exception) and e.result is not None
            got = (e.result.body, e.result.node_sig, e.result.attestation, e.result.message, e.result.boot_id)
            assert got == (b"", b"", b"", "", "b1")
        assert a.result is not None and a.result.code == ""
        assert j.get_command("a").acked is False  # type: ignore[union-attr]
        j.ack_results(["a"])
        assert j.get_command("a").acked is True  # type: ignore[union-attr]
        assert j.get_command("r").acked is False  # type: ignore[union-attr]


def test_a_full_journal_refuses_every_command_of_a_batch_by_name(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b", max_events=2) as j:
        j.append_events([_ev(M, b"m"), _ev(R, b"1"), _ev(T, b"2")])  # the metric is dropped
        out = j.accept_commands([cmd("x"), cmd("y")])
        expected = (
            "journal full: 2 unacked transition/result events (4 bytes) against bounds of 2 events and"
            f" {64 * 1024 * 1024} bytes; acks must drain it"
        )
        assert [str(e) for e in out] == [expected, expected]
        assert all(isinstance(e, JournalFull) for e in out)
    with Journal.open(tmp_path / "e", boot_id="b", max_bytes=4) as j:
        # Full by bytes, with a metric of no bytes still held (the only metric a full journal can hold):
        # the message counts transitions and results only.
        j.append_events([_ev(R, b"123", type="r"), NewEvent(M, "", b"")])
        assert j.is_full() and j.event_stats().count == 2
        with pytest.raises(JournalFull) as exc:
            j.accept_command(cmd("z"))
        assert str(exc.value) == (
            "journal full: 1 unacked transition/result events (4 bytes) against bounds of 10000 events and"
            " 4 bytes; acks must drain it"
        )


def test_the_byte_bound_drops_metrics_down_to_exactly_the_limit(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b", max_bytes=30) as j:
        j.append_events([_ev(M, b"a" * 9), _ev(M, b"b" * 9), _ev(M, b"c" * 9)])  # 30 bytes
        assert j.append_events([_ev(T, b"d" * 9)]) == EventsAppended(4, 1, 1)  # 40: one metric goes
        assert [e.seq for e in j.unacked_events()] == [2, 3, 4] and j.event_stats().bytes == 30


def test_an_ack_not_above_the_last_writes_nothing(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        j.append_events([_ev(T, b"1"), _ev(T, b"2")])
        j.ack_events(j.journal_id, 1)
        commits = j.commits
        assert j.ack_events(j.journal_id, 1) == 0 and j.ack_events(j.journal_id, 0) == 0
        assert j.ack_events("other", 2) == 0
        assert j.commits == commits


def test_same_boot_leftovers_are_taken_over_or_settled_interrupted(tmp_path: Path) -> None:
    """The daemon died in the same boot: a running node.reboot (retry-safe) is taken over by a
    redelivery; a running boot.kexec (not retry-safe) is settled FAILED `interrupted`, not `rebooted`."""
    j = Journal.open(tmp_path / "a", boot_id="boot1")
    j.accept_command(cmd("r", REBOOT, "node.reboot"))
    j.mark_running("r")
    j.accept_command(cmd("k", KEXEC, "boot.kexec"))
    j.mark_running("k")
    j.accept_command(cmd("k2", KEXEC, "boot.kexec"))
    j.mark_running("k2")
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="boot1") as k:
        taken = k.accept_command(cmd("r", REBOOT, "node.reboot"))
        assert (taken.state, taken.incarnation) == (CommandState.ACCEPTED, k.incarnation)
        s = k.settle("k")
        assert s.result is not None
        assert (s.result.outcome, s.result.code, s.result.boot_id, s.result.previous_boot_id) == (
            Outcome.FAILED, "interrupted", "boot1", "",
        )  # fmt: skip
        (rec,) = k.recover()
        assert rec.id == "k2" and rec.result is not None and rec.result.code == "interrupted"


def test_settle_leaves_this_process_s_own_commands_alone(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "a", boot_id="b1") as j:
        mine = j.accept_command(cmd("u", NOT_RETRY_SAFE, "gpu.reset"))
        assert j.settle("u") == mine
        running = j.mark_running("u")
        assert j.settle("u") == running and j.recover() == ()


def test_metrics_count_toward_neither_fullness_nor_the_refusal_s_message(tmp_path: Path) -> None:
    """`is_full()` and JournalFull's message weigh transitions and results only: metrics held beside
    them (which would be dropped for room) neither make the journal full nor show in the count."""
    with Journal.open(tmp_path / "d", boot_id="b", max_bytes=100) as j:
        j.append_events([_ev(R, b"r" * 59), _ev(M, b"m" * 29)])  # 60 result bytes, 30 metric bytes
        assert not j.is_full()
        j.accept_command(cmd("ok"))
        with pytest.raises(JournalFull) as exc:
            j.append_event(R, "r", b"x" * 40)  # 60 + 41 result bytes: over, even with the metric gone
        assert str(exc.value) == (
            "journal full: 1 unacked transition/result events (60 bytes) against bounds of 10000 events and"
            " 100 bytes; acks must drain it"
        )
        assert [e.seq for e in j.unacked_events()] == [1, 2] and j.next_event_seq == 3


def test_restart_events_is_durable_as_it_returns(tmp_path: Path) -> None:
    data = tmp_path / "d"
    j = Journal.open(data, boot_id="b")
    j.append_events([_ev(T, b"1"), _ev(T, b"2"), _ev(T, b"3")])
    j.ack_events(j.journal_id, 1)
    new = j.restart_events()
    copy = crash_copy(j, tmp_path / "crash")
    with Journal.open(copy, boot_id="b") as k:
        assert (k.journal_id, k.next_event_seq, k.acked_event_seq) == (new, 3, 0)
        assert [(e.seq, e.payload) for e in k.unacked_events()] == [(1, b"2"), (2, b"3")]
