"""`cancel_new` (a cancelled row in one transaction), stored attestations, and the schema-1 migration."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
from bcd_agent.config import JOURNAL_MAX_BYTES, JOURNAL_MAX_EVENTS, JOURNAL_MIN_BYTES, JOURNAL_MIN_EVENTS
from bcd_agent.journal import (
    MAX_EVENT_BYTES,
    MAX_UNACKED_EVENTS,
    Action,
    BoundError,
    CommandEntry,
    CommandFlags,
    CommandState,
    EventClass,
    Journal,
    JournalFull,
    Outcome,
)
from bcd_agent.journal._schema import SCHEMA_VERSION
from bcd_agent.journal._types import MAX_MESSAGE_CHARS
from jhelpers import KEXEC, NOT_RETRY_SAFE, RETRY_SAFE, Clock, cmd, crash_copy

ATTESTED = CommandFlags(attested=True)


# ---------------------------------------------------------------- cancel_new


def test_DLV_CAN_04_07_cancel_new_journals_cancelled_in_one_write(tmp_path: Path) -> None:
    """A command never accepted (deferred, or unseen) gets its `cancelled` row at once: after a crash right
    after the call nothing is left `accepted`, so recovery never reports it FAILED `interrupted`."""
    clock = Clock()
    j = Journal.open(tmp_path / "a", boot_id="b1", clock=clock)
    entry = j.cancel_new(cmd("u", NOT_RETRY_SAFE, kind="gpu.reset"), "operator")
    assert entry.state is CommandState.CANCELLED
    assert entry.result is not None
    assert (entry.result.outcome, entry.result.code, entry.result.boot_id) == (
        Outcome.CANCELLED,
        "operator",
        "b1",
    )
    # No body kept: the command never ran, and a deferred body was never verified (hostile gateway, round 2).
    assert (entry.kind, entry.body, entry.signature) == ("gpu.reset", b"", b"")
    assert j.get_command("u") == entry
    copy = crash_copy(j, tmp_path / "crashed")
    with Journal.open(copy, boot_id="b2", clock=clock) as k:
        assert k.recover() == ()  # nothing to settle: no `interrupted`
        res = k.resolve("u")
        assert res.action is Action.DONE and res.entry == entry  # a late delivery gets CANCELLED
        assert [e.id for e in k.unacked_results()] == ["u"]


def test_DLV_CAN_05_06_cancel_new_keeps_what_is_already_journaled(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "a", boot_id="b1") as j:
        j.accept_command(cmd("q"))
        queued = j.cancel_new(cmd("q"), "operator")
        assert queued.state is CommandState.CANCELLED
        j.accept_command(cmd("r", KEXEC))
        running = j.mark_running("r")
        assert j.cancel_new(cmd("r", KEXEC), "operator") == running  # a started effect reports its outcome
        done = j.complete("r", Outcome.SUCCEEDED, body=b"ok")
        assert j.cancel_new(cmd("r", KEXEC), "late") == done  # the real outcome wins
        rejected = j.reject(cmd("x"), "EXPIRED")
        assert j.cancel_new(cmd("x"), "operator") == rejected


def test_DLV_JRN_21_cancel_new_is_journaled_when_the_event_bounds_are_full(tmp_path: Path) -> None:
    """Commands are not events: a full journal refuses new accepts (BUSY) but still records a cancel."""
    with Journal.open(tmp_path / "a", boot_id="b1", max_events=2) as j:
        j.append_event(EventClass.RESULT, "r", b"1")
        j.append_event(EventClass.TRANSITION, "t", b"2")
        assert j.is_full()
        with pytest.raises(JournalFull):
            j.accept_command(cmd("n"))
        assert j.cancel_new(cmd("n"), "operator").state is CommandState.CANCELLED


# ---------------------------------------------------------------- stored attestations


class Attester:
    def __init__(self) -> None:
        self.calls: list[CommandEntry] = []

    def __call__(self, entry: CommandEntry) -> tuple[bytes, bytes]:
        self.calls.append(entry)
        assert entry.result is not None and entry.state.terminal
        r = entry.result
        return (f"att:{entry.id}:{r.outcome.value}:{r.code}".encode(), b"sig:" + entry.id.encode())


def test_DLV_SIG_17_attested_results_are_signed_once_and_stored(tmp_path: Path) -> None:
    """Every terminal write of an attested command stores the attester's exact bytes with the result; a
    reopened journal (a new process, maybe a new encoder or node key) returns the same bytes."""
    clock = Clock()
    att = Attester()
    j = Journal.open(tmp_path / "a", boot_id="b1", clock=clock)
    j.set_attester(att)
    j.accept_command(cmd("s", ATTESTED, kind="diag.nvml"))
    s = j.complete("s", Outcome.SUCCEEDED, body=b"report")
    j.accept_command(cmd("f", ATTESTED))
    f = j.complete("f", Outcome.FAILED, code="gpu-busy")
    rj = j.reject(cmd("r", ATTESTED), "EXPIRED")
    cn = j.cancel_new(cmd("c", ATTESTED), "operator")
    j.accept_command(cmd("q", ATTESTED))
    cq = j.cancel("q", "operator")
    j.accept_command(cmd("plain", RETRY_SAFE))
    plain = j.complete("plain", Outcome.SUCCEEDED)
    j.accept_command(cmd("given", ATTESTED))
    given = j.complete("given", Outcome.SUCCEEDED, attestation=b"mine", node_sig=b"my-sig")
    assert cq is not None
    signed = {e.id: e for e in (s, f, rj, cn, cq)}
    for cid, e in signed.items():
        assert e.result is not None
        assert e.result.attestation == f"att:{cid}:{e.result.outcome.value}:{e.result.code}".encode()
        assert e.result.node_sig == b"sig:" + cid.encode()
    assert [c.id for c in att.calls] == ["s", "f", "r", "c", "q"]  # once each; never the unattested
    assert plain.result is not None and (plain.result.attestation, plain.result.node_sig) == (b"", b"")
    assert given.result is not None and (given.result.attestation, given.result.node_sig) == (
        b"mine",
        b"my-sig",
    )
    copy = crash_copy(j, tmp_path / "crashed")
    with Journal.open(copy, boot_id="b1", clock=clock) as k:  # no attester set: the stored bytes come back
        for cid, e in signed.items():
            assert k.get_command(cid) == e
        assert {e.id: e for e in k.unacked_results()}["s"] == s


def test_DLV_REC_10_recover_signs_what_it_settles(tmp_path: Path) -> None:
    clock = Clock()
    j = Journal.open(tmp_path / "a", boot_id="b1", clock=clock)
    j.accept_command(cmd("i", ATTESTED))
    copy = crash_copy(j, tmp_path / "crashed")
    with Journal.open(copy, boot_id="b1", clock=clock) as k:
        k.set_attester(Attester())
        (settled,) = k.recover()
        assert settled.result is not None and settled.result.code == "interrupted"
        assert settled.result.attestation == b"att:i:failed:interrupted"
        assert k.get_command("i") == settled


def test_a_failing_attester_never_loses_the_result(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def broken(entry: CommandEntry) -> tuple[bytes, bytes]:
        raise RuntimeError("no node key")

    with Journal.open(tmp_path / "a", boot_id="b1") as j:
        j.set_attester(broken)
        j.accept_command(cmd("s", ATTESTED))
        with caplog.at_level(logging.ERROR):
            e = j.complete("s", Outcome.SUCCEEDED, body=b"x")
        assert e.result is not None and e.result.body == b"x" and e.result.node_sig == b""
        assert j.get_command("s") == e
        assert caplog.messages == ["command s: signing its attested result failed; stored unsigned"]


def test_DLV_RES_04_05_result_messages_are_journaled(tmp_path: Path) -> None:
    """A failure's or rejection's message is stored with the result, so a replay (which may be the first
    send, when the session was offline) carries it too; it is capped, the code is what counts."""
    with Journal.open(tmp_path / "a", boot_id="b1") as j:
        j.accept_command(cmd("f"))
        f = j.complete("f", Outcome.FAILED, code="gpu-busy", message="GPU-1 is held by alloc-7")
        r = j.reject(cmd("r"), "BAD_SIGNATURE", "unknown-root: no trusted root issued 'worker-1'")
        j.accept_command(cmd("long"))
        long = j.complete("long", Outcome.FAILED, code="internal", message="x" * 5000)
    with Journal.open(tmp_path / "a", boot_id="b1") as j:
        assert (
            j.get_command("f") == f
            and f.result is not None
            and f.result.message == "GPU-1 is held by alloc-7"
        )
        assert (
            j.get_command("r") == r and r.result is not None and r.result.message.startswith("unknown-root")
        )
        assert long.result is not None and long.result.message == "x" * MAX_MESSAGE_CHARS


# ---------------------------------------------------------------- schema migration


def test_schema_1_journal_is_migrated_in_place(tmp_path: Path) -> None:
    """A version-1 journal (no attestation column) keeps its journal_id, commands and events; it is taken
    through version 2 to 3 (envelope_sha256) in one migration."""
    data = tmp_path / "d"
    with Journal.open(data, boot_id="b1") as j:
        jid = j.journal_id
        j.accept_command(cmd("a", NOT_RETRY_SAFE))
        j.accept_command(cmd("done"))
        j.complete("done", Outcome.SUCCEEDED, body=b"r")
        seq = j.append_event(EventClass.RESULT, "allocation.bound", b"p")
    conn = sqlite3.connect(data / "journal.db")
    conn.execute("ALTER TABLE commands DROP COLUMN attestation")
    conn.execute("ALTER TABLE commands DROP COLUMN message")
    conn.execute("ALTER TABLE commands DROP COLUMN envelope_sha256")
    conn.execute("UPDATE schema_version SET version = 1")
    conn.commit()
    conn.close()
    with Journal.open(data, boot_id="b1") as j:
        assert j.report.migrated_from == 1 and j.report.moved_aside == ()
        assert j.journal_id == jid
        assert [e.seq for e in j.unacked_events()] == [seq]
        done = j.get_command("done")
        assert done is not None and done.result is not None and done.result.body == b"r"
        assert (done.result.attestation, done.result.message) == (b"", "")
        assert done.binds and done.envelope_sha256 == b""
        (settled,) = j.recover()
        assert settled.id == "a" and settled.result is not None and settled.result.code == "interrupted"
    conn = sqlite3.connect(data / "journal.db")
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    conn.close()
    with Journal.open(data, boot_id="b1") as j:
        assert j.report.migrated_from == 0 and j.journal_id == jid


# ---------------------------------------------------------------- bounds and config


def test_DLV_JRN_18_config_bounds_are_the_journals_and_may_only_lower_them() -> None:
    """config.toml's [journal] ceilings are the journal's own (64 MiB, 10,000 events); node.py passes the
    configured values to Journal.open, which refuses anything above them."""
    assert (JOURNAL_MAX_BYTES, JOURNAL_MAX_EVENTS) == (MAX_EVENT_BYTES, MAX_UNACKED_EVENTS)
    assert 1 <= JOURNAL_MIN_BYTES < JOURNAL_MAX_BYTES and 1 <= JOURNAL_MIN_EVENTS < JOURNAL_MAX_EVENTS


def test_DLV_JRN_18_lowered_bounds_are_in_force(tmp_path: Path) -> None:
    with Journal.open(
        tmp_path / "a", boot_id="b", max_events=JOURNAL_MIN_EVENTS, max_bytes=JOURNAL_MIN_BYTES
    ) as j:
        assert j.bounds[:2] == (JOURNAL_MIN_EVENTS, JOURNAL_MIN_BYTES)
    with pytest.raises(BoundError, match="max_events"):
        Journal.open(tmp_path / "b", boot_id="b", max_events=JOURNAL_MAX_EVENTS + 1)


def test_without_an_attester_attested_results_are_stored_unsigned_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No attester set (a journal opened by `bcd journal`, or before the node key is loaded): nothing to
    call, nothing logged; the replay signs it later."""
    with Journal.open(tmp_path / "a", boot_id="b1") as j, caplog.at_level(logging.DEBUG):
        j.accept_command(cmd("s", ATTESTED))
        e = j.complete("s", Outcome.SUCCEEDED, body=b"x")
        assert e.result is not None and (e.result.attestation, e.result.node_sig) == (b"", b"")
        j.set_attester(None)
        r = j.reject(cmd("r", ATTESTED), "EXPIRED")
        assert r.result is not None and (r.result.attestation, r.result.node_sig) == (b"", b"")
    assert caplog.records == []
