"""Dispatch checks that a wrong implementation fails: the whole task tree, not the test's own nursery,
and a cancel that arrives while an action is in progress."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from bcd_agent.dispatch.command import CommandEnvelope, InvalidCommand, UpdateState
from bcd_agent.dispatch.kinds import Lane
from bcd_agent.dispatch.lanes import LANES
from bcd_agent.dispatch.wire import envelope_from_wire, is_ulid
from bcd_agent.journal import CommandState
from bcd_agent.kinds.testing import EffectHandler, effect_handlers
from bcd_shared import wire
from dhelpers import Gate, Harness, Pki, effect_ids, make_command, start


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


def _tree(nursery: trio.Nursery) -> set[trio.lowlevel.Task]:
    """Every task under `nursery`, at any depth (the dispatcher's workers live in its own nursery)."""
    found: set[trio.lowlevel.Task] = set()
    todo = [nursery]
    while todo:
        for task in todo.pop().child_tasks:
            found.add(task)
            todo.extend(task.child_nurseries)
    return found


LANE_KINDS = {Lane.CONTROL: "test.effect", Lane.PROVISION: "test.provision", Lane.BULK: "test.bulk"}


@pytest.mark.parametrize("lane", list(Lane))
async def test_DLV_LANE_07_the_same_worker_tasks_serve_every_command(
    tmp_path: Path, pki: Pki, lane: Lane
) -> None:
    """DLV-LANE-07: the set of tasks in the dispatcher's whole tree is the same when idle, while the
    lane's workers are all busy, and after three rounds of load: no task is started per command, even one
    capped at the worker count."""
    cfg = LANES[lane]
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        gate = Gate()
        hook_gate: list[Gate] = [gate]

        async def during(cmd: CommandEnvelope) -> None:
            await hook_gate[0](cmd)

        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, during_effect=during))))
        await trio.testing.wait_all_tasks_blocked()
        idle = _tree(n)
        sent: list[str] = []
        for _round in range(3):
            gate = Gate()
            hook_gate[0] = gate
            cmds = [make_command(h.pki, kind=LANE_KINDS[lane]) for _ in range(cfg.credits)]
            for c in cmds:
                d.deliver(c)
            await trio.testing.wait_all_tasks_blocked()
            assert gate.active == cfg.workers
            assert _tree(n) == idle  # the busy workers are the idle ones, nothing was added
            gate.release.set()
            for c in cmds:
                assert (await h.sink.wait_terminal(c.id)).state is UpdateState.SUCCEEDED
            sent += [c.id for c in cmds]
            await trio.testing.wait_all_tasks_blocked()
            assert _tree(n) == idle
        n.cancel_scope.cancel()
    assert sorted(effect_ids(log)) == sorted(sent)


async def test_DLV_CAN_03_a_cancel_waits_for_the_action_in_progress(tmp_path: Path, pki: Pki) -> None:
    """DLV-CAN-03: a cancel that arrives while the handler is inside an action (before its effect) is
    neither answered at once nor allowed to interrupt that action: the action runs to its end, and only
    at the next boundary (begin_effect) does the command end CANCELLED, with no effect."""
    h = Harness(tmp_path / "data", pki)
    release = trio.Event()
    entered = trio.Event()
    finished: list[str] = []
    log = tmp_path / "e"

    async def action(cmd: CommandEnvelope) -> None:
        entered.set()
        await release.wait()  # a trio cancel here would skip the next line
        finished.append(cmd.id)

    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, before_effect=action))))
        cmd = make_command(pki)
        d.deliver(cmd)
        await entered.wait()
        d.cancel(cmd.id, "stop")
        await trio.testing.wait_all_tasks_blocked()
        # the action is still in progress: no terminal answer yet, nothing journaled as cancelled
        assert h.sink.states(cmd.id) == [UpdateState.ACKED]
        entry = h.journal.get_command(cmd.id)
        assert entry is not None and not entry.state.terminal
        assert finished == []
        release.set()
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert finished == [cmd.id]  # the action ran to its end
    assert (done.state, done.reason) == (UpdateState.CANCELLED, "stop")
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.state is CommandState.CANCELLED
    assert not log.exists()


@pytest.mark.parametrize(
    "value",
    [
        "01ARZ3NDEKTSV4RRFFQ69G5FAV",
        "00000000000000000000000000",
        "7ZZZZZZZZZZZZZZZZZZZZZZZZZ",
    ],
)
def test_DLV_CMD_03_a_ulid_is_accepted(value: str) -> None:
    assert is_ulid(value)


@pytest.mark.parametrize(
    "value",
    [
        "01ARZ3NDEKTSV4RRFFQ69G5FA",  # 25
        "01ARZ3NDEKTSV4RRFFQ69G5FAVX",  # 27
        "01ARZ3NDEKTSV4RRFFQ69G5FAV\n",  # `$` matches before a newline
        "01arz3ndektsv4rrffq69g5fav",  # lower case is not the canonical form
        "01ARZ3NDEKTSV4RRFFQ69G5FAI",  # I, L, O, U are not Crockford digits
        "01ARZ3NDEKTSV4RRFFQ69G5FAL",
        "01ARZ3NDEKTSV4RRFFQ69G5FAO",
        "01ARZ3NDEKTSV4RRFFQ69G5FAU",
        "8ZZZZZZZZZZZZZZZZZZZZZZZZZ",  # above 2^128
        "01ARZ3NDEKTSV4RRFFQ69G5FA-",
        "01ARZ3NDEKTSV4RRFFQ69G5F V",
        "",
        "a" * 26,
    ],
)
def test_DLV_CMD_03_anything_else_is_not_a_ulid(value: str) -> None:
    """DLV-CMD-03: exactly 26 Crockford base-32 digits, the first at most 7; a wire body whose id is not
    one is refused naming `body.id`."""
    assert not is_ulid(value)
    with pytest.raises(InvalidCommand, match=r"body\.id"):
        envelope_from_wire(wire.Command(body=bytes(_body(value))))


def _body(command_id: str) -> wire.CommandBody:
    return wire.CommandBody(
        id=command_id, node_id="node-a", seq=1, kind="test.effect", lane=wire.Lane.CONTROL
    )
