"""The journal's basic rules: open, commands through their states, Resolve rows, results and acks."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from bcd_agent.journal import (
    Action,
    CommandState,
    Journal,
    JournalLocked,
    Outcome,
    StateError,
    StoredSpec,
    UnsafeDataDir,
)
from jhelpers import KEXEC, NOT_RETRY_SAFE, REBOOT, RETRY_SAFE, Clock, cmd, crash_copy


def test_DLV_JRN_01_open_creates_private_files(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Journal.open(data, boot_id="b1") as j:
        assert j.path == data / "journal.db"
        assert j.report.created and j.report.moved_aside == ()
        assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
        for name in ("journal.db", "journal.db-wal"):
            assert stat.S_IMODE(os.stat(data / name).st_mode) == 0o600
        mode = j._conn.execute("PRAGMA journal_mode").fetchone()[0]
        sync = j._conn.execute("PRAGMA synchronous").fetchone()[0]
        assert (mode, sync) == ("wal", 2)  # DLV-JRN-15: WAL, synchronous=FULL
        jid = j.journal_id
    with Journal.open(data, boot_id="b1") as j:
        assert not j.report.created and j.journal_id == jid


def test_data_dir_modes_fixed_or_refused(tmp_path: Path) -> None:
    wide = tmp_path / "wide"
    wide.mkdir()
    os.chmod(wide, 0o755)
    Journal.open(wide, boot_id="b").close()
    assert stat.S_IMODE(os.stat(wide).st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeDataDir, match="lets others write"):
        Journal.open(shared, boot_id="b")
    link = tmp_path / "link"
    link.symlink_to(wide)
    with pytest.raises(UnsafeDataDir, match="not a directory"):
        Journal.open(link, boot_id="b")


def test_one_process_per_journal(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b"), pytest.raises(JournalLocked):
        Journal.open(tmp_path / "d", boot_id="b")


def test_DLV_REC_01_fresh_incarnation_per_open(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        first = j.incarnation
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.incarnation != first


def test_DLV_JRN_03_command_lifecycle_and_resolve(tmp_path: Path) -> None:
    """Covers DLV-JRN-03, DLV-JRN-16, DLV-REC-04/05/06, DLV-RES-06."""
    clock = Clock()
    with Journal.open(tmp_path / "d", boot_id="b1", clock=clock) as j:
        assert j.resolve("c1").action is Action.NONE
        e = j.accept_command(cmd("c1"))
        assert e.state is CommandState.ACCEPTED and e.incarnation == j.incarnation
        assert j.get_command("c1") == e
        assert j.resolve("c1").action is Action.REATTACH
        r = j.mark_running("c1")
        assert r.state is CommandState.RUNNING and r.boot_id == "b1"
        assert j.resolve("c1").action is Action.REATTACH
        clock.t += 5
        d = j.complete("c1", Outcome.SUCCEEDED, body=b"result-bytes", node_sig=b"nsig")
        assert d.state is CommandState.DONE and d.result is not None
        assert (d.result.body, d.result.node_sig, d.result.boot_id) == (b"result-bytes", b"nsig", "b1")
        res = j.resolve("c1")
        assert res.action is Action.DONE and res.entry == d
        # the first terminal outcome wins; a repeated update changes nothing
        assert j.complete("c1", Outcome.FAILED, code="internal") == d
        assert j.cancel("c1", "late") == d
        with pytest.raises(StateError, match="already journaled"):
            j.accept_command(cmd("c1"))
        assert j.get_command("c1") == d
        assert j.get_command("c1").body == b"body:c1"  # type: ignore[union-attr]


def test_DLV_CAN_cancel_rules(tmp_path: Path) -> None:
    """Covers DLV-CAN-04/05/06/07: queued -> CANCELLED, running keeps its real outcome."""
    with Journal.open(tmp_path / "d", boot_id="b1") as j:
        assert j.cancel("nope") is None
        j.accept_command(cmd("q"))
        c = j.cancel("q", "operator")
        assert c is not None and c.state is CommandState.CANCELLED
        assert c.result is not None and (c.result.outcome, c.result.code) == (Outcome.CANCELLED, "operator")
        assert j.resolve("q").action is Action.DONE
        j.accept_command(cmd("r"))
        j.mark_running("r")
        still = j.cancel("r", "operator")
        assert still is not None and still.state is CommandState.RUNNING
        done = j.complete("r", Outcome.SUCCEEDED)
        assert done.result is not None and done.result.outcome is Outcome.SUCCEEDED


def test_DLV_ACK_17_rejections_are_journaled(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b1") as j:
        e = j.reject(cmd("x"), "EXPIRED")
        assert e.state is CommandState.REJECTED
        assert e.result is not None and (e.result.outcome, e.result.code) == (Outcome.REJECTED, "EXPIRED")
        res = j.resolve("x")
        assert res.action is Action.DONE and res.entry is not None and res.entry.result == e.result
        assert j.reject(cmd("x"), "UNSUPPORTED") == res.entry  # the same answer on a duplicate
        j.accept_command(cmd("deferred"))
        assert j.reject(cmd("deferred"), "STALE_GENERATION").state is CommandState.REJECTED
        j.accept_command(cmd("run"))
        j.mark_running("run")
        with pytest.raises(StateError, match="side effect started"):
            j.reject(cmd("run"), "EXPIRED")


def test_transitions_refused_out_of_order(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b1") as j:
        with pytest.raises(StateError, match="not journaled"):
            j.mark_running("ghost")
        with pytest.raises(StateError, match="not journaled"):
            j.complete("ghost", Outcome.SUCCEEDED)
        j.accept_command(cmd("a"))
        j.mark_running("a")
        with pytest.raises(StateError, match="running"):
            j.mark_running("a")
        with pytest.raises(ValueError, match="SUCCEEDED or FAILED"):
            j.complete("a", Outcome.CANCELLED)


def test_DLV_REC_07_09_10_recover_after_crash(tmp_path: Path) -> None:
    """Each Resolve row of an earlier process, then Recover's settlement; also DLV-REC-02 (another
    incarnation's entry is re-executed, not re-attached, until this process accepts it again) and
    DLV-REC-17 (the rebooted result's previous boot id). That a retry-safe entry re-executes only after
    the acceptance checks is the dispatcher's test (tests/dispatch/test_dispatcher.py)."""
    j = Journal.open(tmp_path / "a", boot_id="boot1")
    j.accept_command(cmd("reboot-running", REBOOT, "node.reboot"))
    j.mark_running("reboot-running")
    j.accept_command(cmd("kexec-running", KEXEC, "boot.kexec"))
    j.mark_running("kexec-running")
    j.accept_command(cmd("reboot-accepted", REBOOT, "node.reboot"))
    j.accept_command(cmd("safe", RETRY_SAFE))
    j.accept_command(cmd("snapshot", NOT_RETRY_SAFE, "instance.snapshot"))
    j.mark_running("snapshot")
    j.accept_command(cmd("done"))
    j.complete("done", Outcome.SUCCEEDED)
    j.ack_results(["done"])
    old_inc = j.incarnation
    data = crash_copy(j, tmp_path / "b")

    with Journal.open(data, boot_id="boot2") as j2:
        assert j2.incarnation != old_inc
        expect = {
            "reboot-running": Action.REBOOTED,
            "kexec-running": Action.REBOOTED,
            "reboot-accepted": Action.REEXECUTE,
            "safe": Action.REEXECUTE,
            "snapshot": Action.INTERRUPTED,
            "done": Action.DONE,
        }
        assert {cid: j2.resolve(cid).action for cid in expect} == expect
        settled = {e.id: e for e in j2.recover()}
        assert set(settled) == {"reboot-running", "kexec-running", "snapshot"}
        r = settled["reboot-running"].result
        assert r is not None and (r.outcome, r.code, r.previous_boot_id, r.boot_id) == (
            Outcome.SUCCEEDED, "rebooted", "boot1", "boot2",
        )  # fmt: skip
        s = settled["snapshot"].result
        assert s is not None and (s.outcome, s.code) == (Outcome.FAILED, "interrupted")
        assert {e.id for e in j2.unacked_results()} == set(settled)
        # retry-safe leftovers wait for redelivery; accept takes them over
        assert j2.resolve("safe").action is Action.REEXECUTE
        taken = j2.accept_command(cmd("safe"))
        assert taken.incarnation == j2.incarnation
        assert j2.resolve("safe").action is Action.REATTACH
        assert j2.recover() == ()


def test_same_boot_self_terminating_is_not_rebooted(tmp_path: Path) -> None:
    """A self-terminating command running when the daemon died without the reboot: same boot."""
    j = Journal.open(tmp_path / "a", boot_id="boot1")
    j.accept_command(cmd("r", REBOOT, "node.reboot"))
    j.mark_running("r")
    j.accept_command(cmd("k", KEXEC, "boot.kexec"))
    j.mark_running("k")
    data = crash_copy(j, tmp_path / "b")
    with Journal.open(data, boot_id="boot1") as j2:
        assert j2.resolve("r").action is Action.REEXECUTE
        assert j2.resolve("k").action is Action.INTERRUPTED
        assert j2.settle("k").state is CommandState.DONE
        assert j2.resolve("k").action is Action.DONE


def test_DLV_RES_08_results_replayed_until_acked(tmp_path: Path) -> None:
    clock = Clock()
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        for i in range(3):
            clock.t += 1
            j.accept_command(cmd(f"c{i}"))
            j.complete(f"c{i}", Outcome.FAILED, code="internal")
        j.reject(cmd("r"), "UNSUPPORTED")
        assert [e.id for e in j.unacked_results()] == ["c0", "c1", "c2", "r"]
        assert j.ack_results(["c1", "unknown", "r"]) == 2
        assert [e.id for e in j.unacked_results()] == ["c0", "c2"]
        j.accept_command(cmd("live"))
        assert j.ack_results(["live"]) == 0  # not terminal: nothing to ack
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert [e.id for e in j.unacked_results()] == ["c0", "c2"]


def test_DLV_JRN_06_spec_exact_bytes(tmp_path: Path) -> None:
    """Covers DLV-JRN-06, DLV-RCV-19, DLV-RCV-08 (needs_spec)."""
    body = bytes(range(256)) * 3
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.needs_spec and j.load_spec() is None
        j.store_spec(StoredSpec(generation=4, body=body, spec_hash="h4", signature=b"\x00sig"))
        with pytest.raises(StateError, match="not above"):
            j.store_spec(StoredSpec(generation=4, body=b"x", spec_hash="h", signature=b""))
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert j.load_spec() == StoredSpec(generation=4, body=body, spec_hash="h4", signature=b"\x00sig")
        assert j.applied_generation == 4 and not j.needs_spec
        j.discard_spec()
        assert j.needs_spec and j.applied_generation == 0 and j.load_spec() is None


def test_DLV_JRN_02_meta_persists(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        j.set_node_id("node-7")
        j.set_last_epoch(12)
        jid = j.journal_id
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        assert (j.node_id, j.last_epoch, j.journal_id) == ("node-7", 12, jid)


def test_threads_share_one_journal(tmp_path: Path) -> None:
    """Callers run the store from worker threads (trio.to_thread): calls are serialised, seqs unique."""
    import threading

    from bcd_agent.journal import EventClass

    seqs: list[int] = []
    with Journal.open(tmp_path / "d", boot_id="b") as j:

        def work(k: int) -> None:
            for i in range(30):
                j.accept_command(cmd(f"t{k}-{i}"))
                seqs.append(j.append_event(EventClass.TRANSITION, "t", b"x"))
                j.complete(f"t{k}-{i}", Outcome.SUCCEEDED)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(seqs) == list(range(1, 121))
        assert len(j.unacked_results()) == 120


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    """A write that raises did not happen: the transaction is rolled back and the store stays usable."""
    with Journal.open(tmp_path / "d", boot_id="b") as j:
        j.accept_command(cmd("a"))
        with pytest.raises(StateError):
            j.complete("ghost", Outcome.SUCCEEDED)
        assert not j._conn.in_transaction
        assert j.complete("a", Outcome.SUCCEEDED).state is CommandState.DONE


def test_a_keyed_event_is_journaled_once_until_its_key_is_forgotten(tmp_path: Path) -> None:
    """`append_event(..., key)`: the key is remembered with the event, durably (a reopened journal
    still has it); a second append with it journals nothing and returns the first seq; forgetting it
    lets the next append journal again. Keys of other prefixes are left alone."""
    from bcd_agent.journal import EventClass

    data = tmp_path / "data"
    with Journal.open(data, boot_id="b1") as j:
        assert j.append_event(EventClass.RESULT, "plain", b"0") == 1
        assert j.append_event(EventClass.RESULT, "R", b"1", "devices:released:a:2") == 2
        assert j.append_event(EventClass.RESULT, "R", b"1", "other:x_%") == 3
    with Journal.open(data, boot_id="b1") as j:
        assert j.append_event(EventClass.RESULT, "R", b"again", "devices:released:a:2") == 2
        assert [(e.seq, e.payload) for e in j.unacked_events()] == [(1, b"0"), (2, b"1"), (3, b"1")]
        assert j.event_keys("devices:") == {"devices:released:a:2": 2}
        assert j.event_keys("other:x_") == {"other:x_%": 3}
        assert j.event_keys("devices:released:a:2x") == {}
        assert j.forget_event_keys(["devices:released:a:2", "devices:never"]) == 1
        assert j.forget_event_keys([]) == 0
        assert j.event_keys("devices:") == {}
        assert j.append_event(EventClass.RESULT, "R", b"new", "devices:released:a:2") == 4
        assert j.event_keys() == {"devices:released:a:2": 4, "other:x_%": 3}
