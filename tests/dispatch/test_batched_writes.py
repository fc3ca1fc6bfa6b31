"""Group commit that keeps DLV-JRN-15 to the letter (issue 16, item 8; docs/journal.md "Durability").

The commands the gateway sends together (one received batch, `Dispatcher.admitting()`) are journaled
`accepted` in ONE transaction, fsynced before the call returns (`Journal.accept_commands`), and only then
is any of their ACKED sent; the outcomes workers reach in the same tick are journaled together the same
way (`Journal.complete_many`) before their credits return and their results are sent. Each write is
durable when it returns, and no update leaves before the write it reports is durable. Checked here with
the real journal: the fsync count, the journal's state at each update sent, and real SIGKILLs between
the batch's fsync and the first ACKED.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.command import CommandUpdate, UpdateState
from bcd_agent.dispatch.kinds import Lane
from bcd_agent.journal import (
    CommandFlags,
    CommandState,
    Completion,
    EventClass,
    Journal,
    JournalFull,
    NewCommand,
    Outcome,
    StateError,
)
from bcd_agent.kinds.testing import EffectHandler, effect_handlers
from dhelpers import Gate, Harness, Pki, Sink, make_command, start


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


def _new(cid: str) -> NewCommand:
    return NewCommand(
        id=cid, kind="test.echo", flags=CommandFlags(retry_safe=True), body=b"b", signature=b"s"
    )


# --- the journal's batch writes ------------------------------------------------------------------------


def test_DLV_JRN_15_accept_commands_is_one_write_fsynced_before_it_returns(tmp_path: Path) -> None:
    with Journal.open(tmp_path, boot_id="b1") as j:
        before = j.durable_commits
        out = j.accept_commands([_new(f"c{i}") for i in range(8)])
        assert j.durable_commits == before + 1 and not j.unsynced  # one fsync, done when it returned
        assert [e.state for e in out if not isinstance(e, Exception)] == [CommandState.ACCEPTED] * 8
        # A duplicate inside a later batch: refused in its place, the rest written.
        again = j.accept_commands([_new("c0"), _new("c8")])
        assert isinstance(again[0], StateError) and not isinstance(again[1], Exception)
        assert j.durable_commits == before + 2
    with Journal.open(tmp_path, boot_id="b1") as j:
        assert all(j.get_command(f"c{i}") is not None for i in range(9))


def test_accept_commands_answers_JournalFull_in_place(tmp_path: Path) -> None:
    with Journal.open(tmp_path, boot_id="b1", max_events=1) as j:
        j.append_event(EventClass.RESULT, "x", b"x")
        out = j.accept_commands([_new("a"), _new("b")])
        assert all(isinstance(e, JournalFull) for e in out)
        assert j.get_command("a") is None and j.get_command("b") is None


def test_DLV_JRN_15_complete_many_is_one_write_fsynced_before_it_returns(tmp_path: Path) -> None:
    with Journal.open(tmp_path, boot_id="b1") as j:
        j.accept_commands([_new(f"c{i}") for i in range(4)])
        before = j.durable_commits
        out = j.complete_many(
            [Completion(f"c{i}", Outcome.SUCCEEDED, body=b"r") for i in range(3)]
            + [Completion("ghost", Outcome.FAILED, code="x")]
        )
        assert j.durable_commits == before + 1 and not j.unsynced
        assert [getattr(e, "state", None) for e in out[:3]] == [CommandState.DONE] * 3
        assert isinstance(out[3], StateError)
        with pytest.raises(ValueError, match="SUCCEEDED or FAILED"):
            j.complete_many([Completion("c3", Outcome.CANCELLED)])
    with Journal.open(tmp_path, boot_id="b1") as j:
        assert [r.id for r in j.unacked_results()] == ["c0", "c1", "c2"]


# --- the dispatcher: each update only after the write it reports is durable ------------------------------


class CheckingSink(Sink):
    """Records, at each update sent, what the journal holds for its command and whether anything written
    is not yet fsynced: an update must only ever report a durable write."""

    def __init__(self, h: Harness) -> None:
        super().__init__()
        self.h = h
        self.seen: list[tuple[str, UpdateState, CommandState | None, bool, int]] = []

    def send(self, update: CommandUpdate) -> None:
        entry = self.h.journal.get_command(update.command_id)
        state = entry.state if entry is not None else None
        j = self.h.journal
        self.seen.append((update.command_id, update.state, state, j.unsynced, j.durable_commits))
        super().send(update)


async def test_DLV_JRN_15_a_batch_of_commands_shares_one_fsync_and_no_ACKED_precedes_it(
    tmp_path: Path, pki: Pki
) -> None:
    h = Harness(tmp_path / "data", pki)
    sink = h.sink = CheckingSink(h)
    gate = Gate()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e", during_effect=gate))))
        cmds = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(8)]
        before = h.journal.durable_commits
        with d.admitting():
            for c in cmds:
                d.deliver(c)
                # Inside the batch: nothing written, nothing sent, the credit already taken.
                assert h.journal.get_command(c.id) is None and sink.seen == []
            assert d.credits_in_use(Lane.CONTROL) == 8
        # The batch ended: one durable transaction for the eight, then their ACKED.
        assert h.journal.durable_commits == before + 1
        acked = [s for s in sink.seen if s[1] is UpdateState.ACKED]
        assert [s[0] for s in acked] == [c.id for c in cmds]
        assert all(s[2] is CommandState.ACCEPTED and not s[3] and s[4] == before + 1 for s in acked), acked
        gate.release.set()
        for c in cmds:
            await h.sink.wait_terminal(c.id)
        n.cancel_scope.cancel()
    terminal = [s for s in sink.seen if s[1] is UpdateState.SUCCEEDED]
    assert len(terminal) == 8
    # Each result left after its outcome was durable (DONE in the journal, nothing unsynced).
    assert all(s[2] is CommandState.DONE and not s[3] for s in terminal), terminal
    # The four control workers held at the gate finish in one tick: their outcomes share fsyncs.
    outcome_fsyncs = len({s[4] for s in terminal})
    assert outcome_fsyncs < 8, terminal


async def test_a_cancel_in_the_same_batch_sees_the_command_in_flight(tmp_path: Path, pki: Pki) -> None:
    """A Cancel after its command in one received batch: the batch's accepts are written first, so the
    command is cancelled as a queued one (journaled CANCELLED, never run)."""
    h = Harness(tmp_path / "data", pki)
    gate = Gate()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e", during_effect=gate))))
        cmds = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(6)]
        with d.admitting():
            for c in cmds:
                d.deliver(c)
            d.deliver(cmds[0])  # a duplicate in the batch: answered by the run in flight
            d.cancel(cmds[5].id, "operator")
        gate.release.set()
        for c in cmds:
            await h.sink.wait_terminal(c.id)
        n.cancel_scope.cancel()
    assert h.sink.states(cmds[5].id) == [UpdateState.ACKED, UpdateState.CANCELLED]
    assert h.sink.states(cmds[0].id) == [UpdateState.ACKED, UpdateState.RUNNING, UpdateState.SUCCEEDED]
    entry = h.journal.get_command(cmds[5].id)
    assert entry is not None and entry.state is CommandState.CANCELLED
    assert cmds[5].id not in (tmp_path / "e").read_text()


async def test_a_destructive_command_in_a_batch_is_never_batched_past_its_quorum_claim(
    tmp_path: Path, pki: Pki
) -> None:
    """Two unbatched destructive commands in one received batch: the allowance (1 per hour in this bundle)
    is claimed by the first before the second is checked, so the second is rejected."""
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle(approvers=3, allowance=1))
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        a = make_command(pki, kind="test.destructive", seq=1)
        b = make_command(pki, kind="test.destructive", seq=2)
        with d.admitting():
            d.deliver(a)
            d.deliver(b)
        first = await h.sink.wait_terminal(a.id)
        second = await h.sink.wait_terminal(b.id)
        n.cancel_scope.cancel()
    assert first.state is UpdateState.SUCCEEDED
    assert second.state is UpdateState.REJECTED and second.reason == "UNBATCHED_LIMIT"


# --- real SIGKILLs around the batch's fsync ---------------------------------------------------------------


def _life(data: Path, sent: Path, pki: Pki, cmds: list[Any], kill: str) -> int:
    """A forked child that delivers `cmds` in one batch and SIGKILLs itself `kill` the batch write."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = trio.run(_life_main, data, sent, pki, cmds, kill)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


async def _life_main(data: Path, sent: Path, pki: Pki, cmds: list[Any], kill: str) -> int:
    h = Harness(data, pki)
    real = h.journal.accept_commands

    def accept_commands(*args: Any, **kwargs: Any) -> Any:
        if kill == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if kill == "after":  # fsynced, no ACKED sent yet
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    h.journal.accept_commands = accept_commands  # type: ignore[method-assign]

    class FileSink(Sink):
        def send(self, update: CommandUpdate) -> None:
            with sent.open("a") as f:
                f.write(f"{update.command_id} {update.state.value}\n")
                f.flush()
                os.fsync(f.fileno())

    h.sink = FileSink()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(data.parent / "e"))))
        with d.admitting():
            for c in cmds:
                d.deliver(c)
        n.cancel_scope.cancel()
    return 0


@pytest.mark.parametrize("kill", ["before", "after"])
def test_DLV_JRN_16_a_kill_around_the_batch_write_never_leaves_an_ACKED_without_its_record(
    tmp_path: Path, pki: Pki, kill: str
) -> None:
    cmds = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(8)]
    data, sent = tmp_path / "data", tmp_path / "sent"
    assert _life(data, sent, pki, cmds, kill) == -signal.SIGKILL
    assert not sent.exists()  # no ACKED left before the kill, whichever side of the fsync it came
    with Journal.open(data, boot_id="inspect") as j:
        entries = [j.get_command(c.id) for c in cmds]
    if kill == "before":
        assert entries == [None] * 8  # nothing written: the gateway redelivers
    else:
        assert [e.state if e else None for e in entries] == [CommandState.ACCEPTED] * 8
    # The next life (no kill) delivers them again: each runs, is ACKED after its record, and succeeds.
    assert _life(data, sent, pki, cmds, "never") == 0
    lines = sent.read_text().split("\n")
    assert {ln.split()[0] for ln in lines if ln.endswith(" ACKED")} == {c.id for c in cmds}


def test_DLV_JRN_15_deferred_acks_ride_with_the_next_write(tmp_path: Path) -> None:
    """The session's result acks are written in the next write transaction (a batch's accepts or
    outcomes: one fsync for both), by flush_acks, or at close; kept ones are not replayed meanwhile."""
    with Journal.open(tmp_path, boot_id="b1") as j:
        j.accept_commands([_new("a"), _new("b"), _new("c")])
        j.complete_many([Completion(i, Outcome.SUCCEEDED) for i in "abc"])
        before = j.durable_commits
        assert j.ack_results(["a"], defer=True) == 0
        assert j.durable_commits == before  # nothing written
        assert [r.id for r in j.unacked_results()] == ["b", "c"]  # not replayed meanwhile
        j.accept_commands([_new("d")])
        assert j.durable_commits == before + 1  # the accept and the ack: one durable transaction
        j.ack_results(["b"], defer=True)
        j.flush_acks()
        assert j.durable_commits == before + 2
        j.flush_acks()  # nothing kept: no write
        assert j.durable_commits == before + 2
        j.ack_results(["c"], defer=True)  # written by close
    with Journal.open(tmp_path, boot_id="b1") as j:
        assert j.unacked_results() == ()


async def test_test_kinds_effects_of_one_tick_share_an_fsync_and_each_returns_once_durable(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test kinds' effect log (what the crash tests count): the lines of the workers that reach
    their effect together are fsynced once, and no handler returns before an fsync after its line."""
    import bcd_agent.kinds.testing as testing

    log = tmp_path / "e"
    fsynced: list[set[str]] = []  # the lines on disk at each fsync
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if os.readlink(f"/proc/self/fd/{fd}") == str(log):
            fsynced.append(set(log.read_text().splitlines()))

    monkeypatch.setattr(testing.os, "fsync", fsync)
    returned: dict[str, int] = {}

    async def during(cmd: Any) -> None:
        await trio.lowlevel.checkpoint()

    h = Harness(tmp_path / "data", pki)
    handler = EffectHandler(log, during_effect=during)
    real_run = handler.run

    async def run(cmd: Any, ctx: Any) -> bytes:
        out = await real_run(cmd, ctx)
        returned[cmd.id] = len(fsynced)  # fsyncs done when this handler returned
        return out

    handler.run = run  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(handler)))
        cmds = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(24)]
        for round_start in range(0, 24, 4):  # rounds of four: trio's scheduling order varies between them
            with d.admitting():
                for c in cmds[round_start : round_start + 4]:
                    d.deliver(c)
            for c in cmds[round_start : round_start + 4]:
                await h.sink.wait_terminal(c.id)
        n.cancel_scope.cancel()
    assert len(fsynced) < 24, fsynced  # the four control workers share fsyncs
    for c in cmds:
        k = returned[c.id]
        assert k >= 1 and any(line.startswith(c.id) for line in fsynced[k - 1]), (c.id, fsynced)
