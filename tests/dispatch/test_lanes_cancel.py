"""Lanes, credits, workers, resource locks and cancel (DLV-LANE-05..09, DLV-CAN-03..07, Q-DLV-CAN-01)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from bcd_agent.dispatch.command import CommandUpdate, UpdateState
from bcd_agent.dispatch.dispatcher import Dispatcher
from bcd_agent.dispatch.kinds import Lane
from bcd_agent.dispatch.lanes import LANES, ResourceLocks
from bcd_agent.journal import CommandState
from bcd_agent.kinds.testing import EffectHandler, effect_handlers, effect_payload
from dhelpers import JOURNAL_WRITES, Gate, Harness, Pki, effect_ids, make_command, start, ulid


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


LANE_KINDS = {Lane.CONTROL: "test.effect", Lane.PROVISION: "test.provision", Lane.BULK: "test.bulk"}


@pytest.mark.parametrize("lane", list(Lane))
async def test_DLV_LANE_05_06_credits_and_workers_bound_the_load(
    tmp_path: Path, pki: Pki, lane: Lane
) -> None:
    """Credits bound admitted commands (running or waiting), workers bound running ones; one more
    command than credits is BUSY. The worker tasks are the same fixed set before and after the load."""
    cfg = LANES[lane]
    h = Harness(tmp_path / "data", pki)
    gate = Gate()
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, during_effect=gate))))
        await trio.testing.wait_all_tasks_blocked()
        tasks_idle = len(n.child_tasks)
        cmds = [make_command(h.pki, kind=LANE_KINDS[lane]) for _ in range(cfg.credits + 1)]
        for c in cmds:
            d.deliver(c)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.active == cfg.workers
        assert d.credits_in_use(lane) == cfg.credits
        assert [h.sink.states(c.id) for c in cmds[: cfg.credits]].count([UpdateState.ACKED]) == (
            cfg.credits - cfg.workers
        )
        assert h.sink.states(cmds[-1].id) == [UpdateState.BUSY]
        assert len(n.child_tasks) == tasks_idle  # never a task per command
        gate.release.set()
        for c in cmds[:-1]:
            assert (await h.sink.wait_terminal(c.id)).state is UpdateState.SUCCEEDED
        assert d.credits_in_use(lane) == 0
        n.cancel_scope.cancel()
    assert gate.max_active == cfg.workers
    assert sorted(effect_ids(log)) == sorted(c.id for c in cmds[:-1])


async def test_DLV_LANE_09_credit_held_until_result_journaled(tmp_path: Path, pki: Pki) -> None:
    """At the journal's write of the outcome (complete_many: the outcomes of one tick in one durable
    transaction) the credit is still held; when the terminal update goes out it is already journaled and
    the credit is back."""
    h = Harness(tmp_path / "data", pki)
    seen: list[tuple[str, Any, Any]] = []
    d_ref: list[Dispatcher] = []
    real_complete = h.journal.complete_many

    def complete(completions: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(("complete", d_ref[0].credits_in_use(Lane.CONTROL), None))
        return real_complete(completions, *args, **kwargs)

    h.journal.complete_many = complete  # type: ignore[method-assign]
    real_send = h.sink.send

    def send(update: CommandUpdate) -> None:
        if update.terminal:
            entry = h.journal.get_command(update.command_id)
            seen.append(("send", d_ref[0].credits_in_use(Lane.CONTROL), entry.state if entry else None))
        real_send(update)

    h.sink.send = send  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        d_ref.append(d)
        cmd = make_command(pki)
        d.deliver(cmd)
        await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert seen == [("complete", 1, None), ("send", 0, CommandState.DONE)]


async def test_DLV_LANE_08_resource_lock_serializes_two_lanes_on_one_gpu(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    gate = Gate()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e", during_effect=gate))))
        a = make_command(pki, kind="test.effect", payload=effect_payload("a", ("gpu:GPU-1",)))
        b = make_command(pki, kind="test.provision", payload=effect_payload("b", ("gpu:GPU-1", "gpu:GPU-2")))
        c = make_command(pki, kind="test.bulk", payload=effect_payload("c", ("gpu:GPU-3",)))
        for cmd in (a, b, c):
            d.deliver(cmd)
        await trio.testing.wait_all_tasks_blocked()
        # one of a and b holds GPU-1 and the other waits for it; c's GPU-3 is free
        first, second = (a, b) if a.id in gate.entered else (b, a)
        assert sorted(gate.entered) == sorted([first.id, c.id])
        assert h.sink.states(second.id) == [UpdateState.ACKED]
        gate.release.set()
        for cmd in (a, b, c):
            await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert gate.entered.index(second.id) > gate.entered.index(first.id)


async def test_resource_locks_forget_free_names() -> None:
    locks = ResourceLocks()
    async with locks.hold(["gpu:B", "gpu:A", "gpu:A"]):
        assert locks.held() == {"gpu:A", "gpu:B"}
    assert locks.held() == frozenset()
    assert locks._locks == {}


# --- cancel --------------------------------------------------------------------------------------------


async def test_DLV_CAN_04_07_queued_command_cancelled_and_never_runs(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    gate = Gate()
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, during_effect=gate))))
        running, queued = (make_command(pki, kind="test.bulk") for _ in range(2))
        d.deliver(running)
        d.deliver(queued)
        await trio.testing.wait_all_tasks_blocked()
        d.cancel(queued.id, "operator")
        assert [(u.state, u.reason) for u in h.sink.of(queued.id)][-1] == (UpdateState.CANCELLED, "operator")
        assert d.credits_in_use(Lane.BULK) == 1
        gate.release.set()
        await h.sink.wait_terminal(running.id)
        await trio.testing.wait_all_tasks_blocked()
        n.cancel_scope.cancel()
    entry = h.journal.get_command(queued.id)
    assert entry is not None and entry.state is CommandState.CANCELLED
    assert list(effect_ids(log)) == [running.id]


async def test_DLV_CAN_03_cancel_before_the_effect_wins(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    gate = Gate()
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, before_effect=gate))))
        cmd = make_command(pki)
        d.deliver(cmd)
        await trio.testing.wait_all_tasks_blocked()
        d.cancel(cmd.id, "changed my mind")
        gate.release.set()
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert (done.state, done.reason) == (UpdateState.CANCELLED, "changed my mind")
    assert UpdateState.RUNNING not in h.sink.states(cmd.id)
    assert not log.exists()


async def test_DLV_CAN_05_06_started_effect_reports_real_outcome(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    gate = Gate()
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, during_effect=gate))))
        cmd = make_command(pki)
        d.deliver(cmd)
        await h.sink.wait_state(cmd.id, UpdateState.RUNNING)
        d.cancel(cmd.id, "too late")
        gate.release.set()
        done = await h.sink.wait_terminal(cmd.id)
        d.cancel(cmd.id, "again")  # a cancel after the outcome resends the outcome
        n.cancel_scope.cancel()
    assert done.state is UpdateState.SUCCEEDED
    assert h.sink.of(cmd.id)[-1] == done
    assert list(effect_ids(log)) == [cmd.id]


async def test_DLV_CAN_04_deferred_command_cancelled(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log)), applied_generation=1))
        cmd = make_command(pki, min_generation=2)
        d.deliver(cmd)
        assert d.deferred_ids() == (cmd.id,)
        d.cancel(cmd.id, "superseded")
        assert d.deferred_ids() == ()
        d.spec_applied(2)
        d.deliver(cmd)  # a redelivery is answered from the journal
        n.cancel_scope.cancel()
    assert [(u.state, u.reason) for u in h.sink.of(cmd.id)] == [(UpdateState.CANCELLED, "superseded")] * 2
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.state is CommandState.CANCELLED
    assert not log.exists()


async def test_Q_DLV_CAN_01_cancel_of_unseen_command_settles_it(tmp_path: Path, pki: Pki) -> None:
    """A Cancel for a command never delivered journals CANCELLED; the late delivery never runs."""
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        cmd = make_command(pki, id=ulid())
        d.cancel(cmd.id, "cancelled before delivery")
        d.deliver(cmd)
        n.cancel_scope.cancel()
    assert [u.state for u in h.sink.of(cmd.id)] == [UpdateState.CANCELLED] * 2
    assert not log.exists()


class CountingJournal:
    """The real journal, counting its writes (every write is one durable transaction)."""

    WRITES = JOURNAL_WRITES

    def __init__(self, journal: Any) -> None:
        self._j = journal
        self.writes: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._j, name)
        if name not in self.WRITES:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.writes.append(name)
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("how", ["unseen", "deferred"])
async def test_DLV_CAN_04_07_never_accepted_command_is_cancelled_in_one_journal_write(
    tmp_path: Path, pki: Pki, how: str
) -> None:
    """No accept-then-cancel: a crash can never leave the command `accepted` (which recovery would report
    FAILED `interrupted` though nothing ran). The record is written even when the journal is full."""
    from bcd_agent.journal import EventClass

    h = Harness(tmp_path / "data", pki, journal_options={"max_events": 1})
    h.journal.append_event(EventClass.RESULT, "allocation.bound", b"x")
    assert h.journal.is_full()
    counting = CountingJournal(h.journal)
    h.journal = counting  # type: ignore[assignment]
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log)), applied_generation=1))
        cmd = make_command(pki, kind="test.attested", min_generation=2 if how == "deferred" else 0)
        if how == "deferred":
            d.deliver(cmd)
            assert d.deferred_ids() == (cmd.id,)
        d.cancel(cmd.id, "operator")
        n.cancel_scope.cancel()
    assert counting.writes == ["cancel_new"]
    (update,) = h.sink.of(cmd.id)
    assert (update.state, update.reason) == (UpdateState.CANCELLED, "operator")
    # A deferred command's kind is known: an attested kind's CANCELLED is signed as it is journaled. An
    # unseen command's kind is not, so its record is unattested.
    assert bool(update.node_sig and update.attestation) is (how == "deferred")
    h.reopen()
    assert h.journal.recover() == ()
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.state is CommandState.CANCELLED
    assert entry.result is not None and entry.result.attestation == update.attestation
    assert not log.exists()


async def test_DLV_LANE_02_03_long_provisioning_and_bulk_work_leave_the_control_lane_free(
    tmp_path: Path, pki: Pki
) -> None:
    """On a ramdisk agent, disk wipes, image writes and DCGM diagnostics fill the provision lane and log
    collection the bulk lane; while all of them hang, an inventory refresh on the control lane runs and
    finishes. The production kinds, by their table rows, with the test kinds' effect handler."""
    from bcd_agent.dispatch.kinds import KINDS, Role

    h = Harness(tmp_path / "data", pki, role=Role.RAMDISK)
    log = tmp_path / "e"
    long_work, slow_jobs = Gate(), Gate()
    provision = ("disk.wipe", "deploy.image", "diag.dcgm", "disk.wipe")
    handlers: dict[str, Any] = dict.fromkeys(provision, EffectHandler(log, during_effect=long_work))
    handlers["logs.collect"] = EffectHandler(log, during_effect=slow_jobs)
    handlers["inventory.refresh"] = EffectHandler(log)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(handlers, kinds=KINDS))
        waiting = [
            make_command(pki, kind=k, kinds=KINDS) for k in (*provision, "logs.collect", "logs.collect")
        ]
        for cmd in waiting:
            d.deliver(cmd)
        await trio.testing.wait_all_tasks_blocked()
        assert (long_work.active, slow_jobs.active) == (
            LANES[Lane.PROVISION].workers,
            LANES[Lane.BULK].workers,
        )
        assert (d.credits_in_use(Lane.PROVISION), d.credits_in_use(Lane.BULK)) == (4, 2)
        assert d.credits_in_use(Lane.CONTROL) == 0
        quick = make_command(pki, kind="inventory.refresh", kinds=KINDS)
        d.deliver(quick)
        assert (await h.sink.wait_terminal(quick.id)).state is UpdateState.SUCCEEDED
        assert all(h.sink.terminal(c.id) is None for c in waiting)
        long_work.release.set()
        slow_jobs.release.set()
        for cmd in waiting:
            assert (await h.sink.wait_terminal(cmd.id)).state is UpdateState.SUCCEEDED
        n.cancel_scope.cancel()
    assert next(effect_ids(log)) == quick.id
