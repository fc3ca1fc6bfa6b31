"""What a command costs the node (issue 16, item 8). The rate itself is `bcd bench session`'s
`commands_per_s`; here, what bounds it: the fsynced journal commits per command, and the lanes' credits
under a stream of commands sent as fast as the gateway may.

A retry-safe, not self-terminating command needs two durable commits: `accepted` before its effect
(DLV-JRN-16) and its outcome before the credit returns (DLV-LANE-09). Its `running` entry (which resolves
as `accepted` does after a crash, for such kinds) and the gateway's Ack of its result (a lost ack is a
replay the gateway acks again) ride on the next durable commit. A self-terminating kind still fsyncs its
`running{boot_id}` before its effect (DLV-JRN-17).
"""

from __future__ import annotations

from pathlib import Path

import trio
from bcd_agent.dispatch.command import UpdateState
from bcd_agent.dispatch.kinds import Lane
from bcd_agent.journal import CommandState
from bcd_agent.kinds.testing import EffectHandler, effect_handlers
from dhelpers import Harness, Pki, make_command, start


async def test_a_retry_safe_command_costs_two_durable_commits(tmp_path: Path) -> None:
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "effects"))))
        commands = [make_command(pki, kind="test.echo", seq=i + 1) for i in range(20)]
        before = h.journal.durable_commits
        for cmd in commands:
            d.deliver(cmd)
            await h.sink.wait_terminal(cmd.id)
        during = h.journal.durable_commits - before
        h.journal.ack_results([c.id for c in commands])
        assert h.journal.durable_commits - before == during  # the acks: no fsync of their own
        n.cancel_scope.cancel()
    assert during == 2 * len(commands), f"{during / len(commands):.1f} durable commits per command"
    assert all(h.sink.states(c.id)[-1] is UpdateState.SUCCEEDED for c in commands)
    assert all(UpdateState.RUNNING in h.sink.states(c.id) for c in commands)
    # Each entry went through running; after a reopen (all commits flushed) they are acked and done.
    h.reopen()
    assert h.journal.unacked_results() == ()
    entry = h.journal.get_command(commands[0].id)
    assert entry is not None and entry.state is CommandState.DONE


async def test_DLV_JRN_17_a_self_terminating_kind_still_fsyncs_running(tmp_path: Path) -> None:
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki)
    seen: list[int] = []

    async def during(_cmd: object) -> None:
        seen.append(h.journal.durable_commits)

    async with trio.open_nursery() as n:
        d = await start(
            n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "effects", during_effect=during)))
        )
        before = h.journal.durable_commits
        cmd = make_command(pki, kind="test.reboot")
        d.deliver(cmd)
        await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert seen == [before + 2]  # accepted, then running{boot_id}, both fsynced before the effect


async def test_a_stream_of_commands_never_exceeds_the_lane_credits(tmp_path: Path) -> None:
    """200 commands delivered as they come (each as soon as a terminal result frees a credit, and the rest
    at once as the gateway would after a reconnect): at most 8 admitted on the control lane, the excess
    answered BUSY, every admitted one succeeds once."""
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki)
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
