"""What a command costs the node (issue 16, item 8). The rate itself is `bcd bench session`'s
`commands_per_s`; here, what bounds it: the fsynced journal commits per command, and the lanes' credits
under a stream of commands sent as fast as the gateway may.

With `[journal] group_commit` on (off by default: then every journal write is fsynced before it
returns, DLV-JRN-15, tested last here), a command's `accepted` and its outcome are committed to the WAL
at once and fsynced together with
whatever else is pending (`Journal.sync`): before the command's side effect (DLV-JRN-16, in
`begin_effect`) and before the session writes anything to the gateway. One fsync then covers a burst of
commands. Its `running` entry (which resolves as `accepted` does after a crash, for kinds that are not
self-terminating) and the gateway's Ack of its result (a lost ack is a replay the gateway acks again) need
no fsync at all. A self-terminating kind still fsyncs its `running{boot_id}` before its effect
(DLV-JRN-17).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from bcd_agent.dispatch.command import UpdateState
from bcd_agent.dispatch.kinds import Lane
from bcd_agent.journal import CommandState
from bcd_agent.kinds.testing import EffectHandler, effect_handlers
from dhelpers import Harness, Pki, make_command, start


async def test_DLV_JRN_16_accepted_is_fsynced_before_each_effect_with_one_fsync_per_command(
    tmp_path: Path,
) -> None:
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki, journal_options={"group_commit": True})
    pending_at_effect: list[bool] = []

    async def during(_cmd: object) -> None:
        pending_at_effect.append(h.journal.unsynced)

    async with trio.open_nursery() as n:
        d = await start(
            n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "effects", during_effect=during)))
        )
        commands = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(20)]
        before = h.journal.durable_commits
        for cmd in commands:
            d.deliver(cmd)
            await h.sink.wait_terminal(cmd.id)
        during_run = h.journal.durable_commits - before
        h.journal.ack_results([c.id for c in commands])
        assert not h.journal.unsynced or h.journal.durable_commits == before + during_run
        n.cancel_scope.cancel()
    assert pending_at_effect == [False] * len(commands)  # accepted was on disk when each effect began
    assert during_run <= len(commands), f"{during_run / len(commands):.1f} fsyncs per command"
    assert all(h.sink.states(c.id)[-1] is UpdateState.SUCCEEDED for c in commands)
    assert all(UpdateState.RUNNING in h.sink.states(c.id) for c in commands)
    h.reopen()
    assert h.journal.unacked_results() == ()
    entry = h.journal.get_command(commands[0].id)
    assert entry is not None and entry.state is CommandState.DONE


async def test_a_burst_of_commands_shares_one_fsync_of_their_accepts(tmp_path: Path) -> None:
    """Eight commands delivered together (as the gateway sends a lane's credits' worth): their accepts
    are fsynced once, by the first effect, and no effect starts before its accept is on disk."""
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki, journal_options={"group_commit": True})
    accepted_at: dict[str, int] = {}
    synced_at_effect: dict[str, int] = {}
    syncs_at_effect: list[int] = []

    async def during(cmd: Any) -> None:
        synced_at_effect[cmd.id] = h.journal.synced_through
        syncs_at_effect.append(h.journal.durable_commits)

    async with trio.open_nursery() as n:
        d = await start(
            n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "effects", during_effect=during)))
        )
        before = h.journal.durable_commits
        commands = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(8)]
        for cmd in commands:
            d.deliver(cmd)  # no checkpoint in between: all eight accepted before any worker runs
            accepted_at[cmd.id] = h.journal.commits
        assert h.journal.durable_commits == before and h.journal.unsynced
        for cmd in commands:
            await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert all(synced_at_effect[c.id] >= accepted_at[c.id] for c in commands), (accepted_at, synced_at_effect)
    # The first four effects (four control workers) start after a single fsync of all eight accepts.
    assert syncs_at_effect[:4] == [before + 1] * 4, syncs_at_effect


async def test_DLV_JRN_17_a_self_terminating_kind_fsyncs_running_before_its_effect(tmp_path: Path) -> None:
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki, journal_options={"group_commit": True})
    seen: list[tuple[Any, bool]] = []

    async def during(cmd: Any) -> None:
        entry = h.journal.get_command(cmd.id)
        seen.append((entry.state if entry else None, h.journal.unsynced))

    async with trio.open_nursery() as n:
        d = await start(
            n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "effects", during_effect=during)))
        )
        cmd = make_command(pki, kind="test.reboot")
        d.deliver(cmd)
        await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert seen == [(CommandState.RUNNING, False)]  # running{boot_id} on disk when the effect began


async def test_a_stream_of_commands_never_exceeds_the_lane_credits(tmp_path: Path) -> None:
    """200 commands delivered as they come (each as soon as a terminal result frees a credit, and the rest
    at once as the gateway would after a reconnect): at most 8 admitted on the control lane, the excess
    answered BUSY, every admitted one succeeds once."""
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki, journal_options={"group_commit": True})
    peak = 0
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "effects"))))
        commands = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(200)]
        for cmd in commands:
            d.deliver(cmd)
            peak = max(peak, d.credits_in_use(Lane.CONTROL))
        with trio.fail_after(60):
            while d.in_flight_ids():
                peak = max(peak, d.credits_in_use(Lane.CONTROL))
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    busy = [c.id for c in commands if UpdateState.BUSY in h.sink.states(c.id)]
    done = [
        c.id for c in commands if h.sink.states(c.id) and h.sink.states(c.id)[-1] is UpdateState.SUCCEEDED
    ]
    assert peak == 8
    assert len(done) == 8 and len(busy) == 192
    lines = (tmp_path / "effects").read_text().splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(done)


async def test_DLV_JRN_15_by_default_every_journal_write_is_fsynced_before_it_returns(tmp_path: Path) -> None:
    """Group commit off (the default): each command's accepted and outcome writes are each fsynced when
    they return, so nothing is ever left unsynced, even a result ack."""
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki)
    unsynced_seen: list[bool] = []

    async def during(_cmd: object) -> None:
        unsynced_seen.append(h.journal.unsynced)

    async with trio.open_nursery() as n:
        d = await start(
            n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "effects", during_effect=during)))
        )
        commands = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(5)]
        for cmd in commands:
            before = h.journal.durable_commits
            d.deliver(cmd)
            assert not h.journal.unsynced and h.journal.durable_commits == before + 1  # accepted, fsynced
            await h.sink.wait_terminal(cmd.id)
            assert not h.journal.unsynced
            # accepted and the outcome, each fsynced (a kind that is not self-terminating writes no running)
            assert h.journal.durable_commits == before + 2
        before = h.journal.durable_commits
        h.journal.ack_results([c.id for c in commands])
        assert h.journal.durable_commits == before + 1 and not h.journal.unsynced
        n.cancel_scope.cancel()
    assert unsynced_seen == [False] * 5
