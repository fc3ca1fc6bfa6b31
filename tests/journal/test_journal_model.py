"""The journal against a model (plain dicts and lists), with crashes: a hypothesis state machine.

Checks, after every step: the unacked events are exactly the model's (no acked event replayed, no
unacked event lost except metric drops under the bounds, which the model makes too), seqs only grow
within the journal_id (never repeated, even across crashes), the unacked results are the model's, and
every `resolve` answers the model's row of the Resolve table. Over the whole run every row of the
table must have been seen. Covers DLV-JRN-03/05/15/18/20/21, DLV-EVT-02/04, DLV-REC-01..15,
DLV-RES-08, DLV-CAN-04..07, DLV-ACK-17.

Default run is derandomized (reproducible, ~20 s); set BCD_JOURNAL_EXAMPLES=N for a longer random run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import hypothesis.strategies as st
from bcd_agent.journal import (
    RETENTION_S,
    Action,
    CommandFlags,
    EventClass,
    Journal,
    JournalFull,
    NewEvent,
    Outcome,
    StateError,
)
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from jhelpers import KEXEC, NOT_RETRY_SAFE, REBOOT, RETRY_SAFE, Clock, cmd, crash_copy

MAX_EVENTS = 6
MAX_BYTES = 160
IDS = [f"c{i}" for i in range(5)]
FLAGS = [RETRY_SAFE, NOT_RETRY_SAFE, REBOOT, KEXEC]
TERMINAL = {"done", "cancelled", "rejected"}


@dataclass
class MCmd:
    flags: CommandFlags
    state: str
    inc: str
    boot: str
    updated: float
    outcome: Outcome | None = None
    code: str = ""
    prev_boot: str = ""
    acked: bool = False


def _events(n: int) -> st.SearchStrategy[list[tuple[EventClass, int]]]:
    return st.lists(st.tuples(st.sampled_from(list(EventClass)), st.integers(0, 50)), min_size=1, max_size=n)


class JournalMachine(RuleBasedStateMachine):
    seen: set[Action] = set()  # replaced per test run by _machine_class

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="jmodel-"))
        self.gen = 0
        self.boot_n = 1
        self.clock = Clock()
        self.j = self._open(self._new_dir())
        self.jid = self.j.journal_id
        self.cmds: dict[str, MCmd] = {}
        self.events: list[tuple[int, EventClass, bytes]] = []
        self.next_seq = 1
        self.acked_seq = 0
        self.top_seq = 0

    # ---------------------------------------------------------------- plumbing

    def _new_dir(self) -> Path:
        self.gen += 1
        return self.root / f"d{self.gen}"

    def _open(self, d: Path) -> Journal:
        j = Journal.open(
            d, boot_id=f"boot{self.boot_n}", max_events=MAX_EVENTS, max_bytes=MAX_BYTES, clock=self.clock
        )
        # A crash here is a process kill (crash_copy reads what the OS holds), not a power cut, so the
        # fsyncs would add only wall time on a shared disk; power-loss durability is the PRAGMA checked
        # in test_journal_basic, and the SIGKILL test runs with synchronous=FULL.
        j._conn.execute("PRAGMA synchronous=OFF")
        return j

    def teardown(self) -> None:
        self.j.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def inc(self) -> str:
        return self.j.incarnation

    @property
    def boot(self) -> str:
        return self.j.boot_id

    def _expected_action(self, cid: str) -> Action:
        m = self.cmds.get(cid)
        if m is None:
            return Action.NONE
        if m.state in TERMINAL:
            return Action.DONE
        if m.inc == self.inc:
            return Action.REATTACH
        if m.state == "running" and m.flags.self_terminating and m.boot != self.boot:
            return Action.REBOOTED
        return Action.REEXECUTE if m.flags.retry_safe else Action.INTERRUPTED

    def _finish(self, m: MCmd, outcome: Outcome, code: str, prev: str = "") -> None:
        m.state = {Outcome.REJECTED: "rejected", Outcome.CANCELLED: "cancelled"}.get(outcome, "done")
        m.outcome, m.code, m.prev_boot, m.acked = outcome, code, prev, False
        m.updated = self.clock.t

    def _nonmetric(self) -> tuple[int, int]:
        rows = [(1, len(p) + 1) for _, c, p in self.events if c is not EventClass.METRIC]
        return len(rows), sum(s for _, s in rows)

    def _full(self) -> bool:
        n, b = self._nonmetric()
        return n >= MAX_EVENTS or b >= MAX_BYTES

    def _check_entry(self, cid: str) -> None:
        e = self.j.get_command(cid)
        m = self.cmds.get(cid)
        if m is None:
            assert e is None
            return
        assert e is not None and e.state.value == m.state and e.incarnation == m.inc and e.flags == m.flags
        if m.state in TERMINAL:
            assert e.result is not None
            assert (e.result.outcome, e.result.code, e.result.previous_boot_id) == (
                m.outcome,
                m.code,
                m.prev_boot,
            )
        else:
            assert e.result is None and e.boot_id == m.boot

    # ---------------------------------------------------------------- commands

    @rule(cid=st.sampled_from(IDS), fi=st.integers(0, len(FLAGS) - 1))
    def accept(self, cid: str, fi: int) -> None:
        flags = self.cmds[cid].flags if cid in self.cmds else FLAGS[fi]
        expect = self._expected_action(cid)
        if self._full():
            try:
                self.j.accept_command(cmd(cid, flags))
                raise AssertionError("accept in a full journal must raise JournalFull")
            except JournalFull:
                return
        if expect in (Action.NONE, Action.REEXECUTE):
            e = self.j.accept_command(cmd(cid, flags))
            assert e.incarnation == self.inc
            self.cmds[cid] = MCmd(flags, "accepted", self.inc, self.boot, self.clock.t)
        else:
            try:
                self.j.accept_command(cmd(cid, flags))
                raise AssertionError(f"accept of a {expect} entry must be refused")
            except StateError:
                pass
        self._check_entry(cid)

    @rule(cid=st.sampled_from(IDS))
    def mark_running(self, cid: str) -> None:
        m = self.cmds.get(cid)
        if m is not None and m.state == "accepted" and m.inc == self.inc:
            self.j.mark_running(cid)
            m.state, m.boot, m.updated = "running", self.boot, self.clock.t
        else:
            try:
                self.j.mark_running(cid)
                raise AssertionError("mark_running must be refused")
            except StateError:
                pass
        self._check_entry(cid)

    @rule(cid=st.sampled_from(IDS), ok=st.booleans())
    def complete(self, cid: str, ok: bool) -> None:
        outcome = Outcome.SUCCEEDED if ok else Outcome.FAILED
        m = self.cmds.get(cid)
        if m is None or (m.state not in TERMINAL and m.inc != self.inc):
            try:
                self.j.complete(cid, outcome, code="" if ok else "internal")
                raise AssertionError("complete must be refused")
            except StateError:
                pass
        else:
            self.j.complete(cid, outcome, code="" if ok else "internal")
            if m.state not in TERMINAL:
                self._finish(m, outcome, "" if ok else "internal")
        self._check_entry(cid)

    @rule(cid=st.sampled_from(IDS), fi=st.integers(0, len(FLAGS) - 1))
    def reject(self, cid: str, fi: int) -> None:
        m = self.cmds.get(cid)
        if m is not None and m.state == "running" and m.inc == self.inc:
            try:
                self.j.reject(cmd(cid, m.flags), "EXPIRED")
                raise AssertionError("reject of a running command must be refused")
            except StateError:
                pass
        else:
            self.j.reject(cmd(cid, m.flags if m else FLAGS[fi]), "EXPIRED")
            if m is None:
                m = self.cmds[cid] = MCmd(FLAGS[fi], "rejected", self.inc, self.boot, self.clock.t)
                self._finish(m, Outcome.REJECTED, "EXPIRED")
            elif m.state not in TERMINAL:
                self._finish(m, Outcome.REJECTED, "EXPIRED")
        self._check_entry(cid)

    @rule(cid=st.sampled_from(IDS))
    def cancel(self, cid: str) -> None:
        m = self.cmds.get(cid)
        e = self.j.cancel(cid, "operator")
        if m is None:
            assert e is None
            return
        if m.state == "accepted":
            self._finish(m, Outcome.CANCELLED, "operator")
        self._check_entry(cid)

    @rule(cid=st.sampled_from(IDS), fi=st.integers(0, len(FLAGS) - 1))
    def cancel_new(self, cid: str, fi: int) -> None:
        """A cancel before acceptance (deferred or unseen): one write, a `cancelled` row for a new id."""
        m = self.cmds.get(cid)
        self.j.cancel_new(cmd(cid, m.flags if m else FLAGS[fi]), "operator")
        if m is None:
            m = self.cmds[cid] = MCmd(FLAGS[fi], "cancelled", self.inc, self.boot, self.clock.t)
            self._finish(m, Outcome.CANCELLED, "operator")
        elif m.state == "accepted":
            self._finish(m, Outcome.CANCELLED, "operator")
        self._check_entry(cid)

    @rule(cid=st.sampled_from(IDS))
    def resolve(self, cid: str) -> None:
        got = self.j.resolve(cid)
        assert got.action is self._expected_action(cid)
        self.seen.add(got.action)

    @rule(cid=st.sampled_from(IDS))
    def settle(self, cid: str) -> None:
        m = self.cmds.get(cid)
        if m is None:
            return
        action = self._expected_action(cid)
        self.j.settle(cid)
        if action is Action.REBOOTED:
            self._finish(m, Outcome.SUCCEEDED, "rebooted", prev=m.boot)
        elif action is Action.INTERRUPTED:
            self._finish(m, Outcome.FAILED, "interrupted")
        self._check_entry(cid)

    @rule()
    def recover(self) -> None:
        expect: set[str] = set()
        for cid, m in self.cmds.items():
            action = self._expected_action(cid)
            if action is Action.REBOOTED:
                self._finish(m, Outcome.SUCCEEDED, "rebooted", prev=m.boot)
                expect.add(cid)
            elif action is Action.INTERRUPTED:
                self._finish(m, Outcome.FAILED, "interrupted")
                expect.add(cid)
        assert {e.id for e in self.j.recover()} == expect

    @rule(ids=st.lists(st.sampled_from(IDS), max_size=4))
    def ack_results(self, ids: list[str]) -> None:
        n = 0
        for cid in set(ids):
            m = self.cmds.get(cid)
            if m is not None and m.state in TERMINAL and not m.acked:
                m.acked = True
                n += 1
        assert self.j.ack_results(ids) == n

    @rule(days=st.sampled_from([0.0, 1.0, 6.9, 7.5]))
    def sweep(self, days: float) -> None:
        self.clock.t += days * 86400
        cutoff = self.clock.t - RETENTION_S
        gone = {
            cid
            for cid, m in self.cmds.items()
            if (m.state in TERMINAL and m.acked and m.updated < cutoff)
            or (m.state not in TERMINAL and m.inc != self.inc and m.updated < cutoff)
        }
        assert self.j.sweep() == len(gone)
        for cid in gone:
            del self.cmds[cid]

    # ---------------------------------------------------------------- events

    @rule(batch=_events(5))
    def append(self, batch: list[tuple[EventClass, int]]) -> None:
        new = [
            NewEvent(c, {0: "m", 1: "t", 2: "r"}[int(c)], bytes([self.next_seq % 251]) * n) for c, n in batch
        ]
        nm_n, nm_b = self._nonmetric()
        add_n = sum(1 for e in new if e.cls is not EventClass.METRIC)
        add_b = sum(len(e.payload) + 1 for e in new if e.cls is not EventClass.METRIC)
        if nm_n + add_n > MAX_EVENTS or nm_b + add_b > MAX_BYTES:
            try:
                self.j.append_events(new)
                raise AssertionError("append over the bounds must raise JournalFull")
            except JournalFull:
                return
        out = self.j.append_events(new)
        assert out.first_seq == self.next_seq and out.first_seq > self.top_seq  # never repeated
        for i, e in enumerate(new):
            self.events.append((self.next_seq + i, e.cls, e.payload))
        self.next_seq += len(new)
        self.top_seq = self.next_seq - 1
        dropped = 0
        while len(self.events) > MAX_EVENTS or sum(len(p) + 1 for _, _, p in self.events) > MAX_BYTES:
            i = next(k for k, (_, c, _) in enumerate(self.events) if c is EventClass.METRIC)
            del self.events[i]
            dropped += 1
        assert out.dropped_metrics == dropped

    @rule(delta=st.integers(-2, 4), wrong=st.booleans())
    def ack_events(self, delta: int, wrong: bool) -> None:
        seq = self.acked_seq + delta
        jid = "another" if wrong else self.jid
        n = self.j.ack_events(jid, seq)
        if wrong:
            assert n == 0
            return
        seq = min(seq, self.next_seq - 1)
        if seq <= self.acked_seq:
            assert n == 0
            return
        before = len(self.events)
        self.events = [e for e in self.events if e[0] > seq]
        self.acked_seq = seq
        assert n == before - len(self.events)

    # ---------------------------------------------------------------- crashes

    @rule(new_boot=st.booleans())
    def crash_and_reopen(self, new_boot: bool) -> None:
        """SIGKILL: what is on disk now, reopened by a new process (new incarnation), maybe after a reboot."""
        old_inc = self.inc
        data = crash_copy(self.j, self._new_dir())
        if new_boot:
            self.boot_n += 1
        self.j = self._open(data)
        assert self.j.incarnation != old_inc and self.j.journal_id == self.jid
        assert not self.j.report.created

    @rule(cid=st.sampled_from(IDS), kexec=st.booleans(), rebooted=st.booleans())
    def self_terminating_command(self, cid: str, kexec: bool, rebooted: bool) -> None:
        """A self-terminating command starts its side effect and the daemon dies: the host rebooted
        under it, or (rebooted=False) the daemon was killed before the reboot happened."""
        if self._full() or self._expected_action(cid) not in (Action.NONE, Action.REEXECUTE):
            return
        m = self.cmds.get(cid)
        flags = m.flags if m is not None else (KEXEC if kexec else REBOOT)
        if not flags.self_terminating:
            return
        self.accept(cid, FLAGS.index(flags))
        self.mark_running(cid)
        self.crash_and_reopen(new_boot=rebooted)

    @rule()
    def clean_reopen(self) -> None:
        d = self.j.path.parent
        self.j.close()
        self.j = self._open(d)
        assert self.j.journal_id == self.jid

    @precondition(lambda self: True)
    @invariant()
    def events_match(self) -> None:
        got = [(e.seq, e.cls, e.payload) for e in self.j.unacked_events(limit=100)]
        assert got == self.events
        assert self.j.next_event_seq == self.next_seq
        assert self.j.is_full() == self._full()

    @invariant()
    def results_match(self) -> None:
        want = {cid for cid, m in self.cmds.items() if m.state in TERMINAL and not m.acked}
        assert {e.id for e in self.j.unacked_results()} == want


def test_journal_against_model() -> None:
    examples = int(os.environ.get("BCD_JOURNAL_EXAMPLES", "0"))
    seen: set[Action] = set()
    machine = type("Machine", (JournalMachine,), {"seen": seen})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples or 450,
            stateful_step_count=50,
            derandomize=not examples,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    if not examples or examples >= 450:  # a short random run may not reach every row
        assert seen == set(Action), f"Resolve rows never exercised: {set(Action) - seen}"
