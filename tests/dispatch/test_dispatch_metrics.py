"""The dispatcher's counters for bcd's own metrics (docs/telemetry.md): outcomes per kind, each new
result counted once, BUSY answers, queue length per lane."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from bcd_agent.dispatch.kinds import Lane
from bcd_agent.kinds.testing import EffectHandler, effect_handlers, effect_payload
from bcd_agent.sections.telemetry.metrics import NodeMetrics
from dhelpers import Gate, Harness, Pki, make_command, start


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


async def test_outcomes_are_counted_per_kind_once_and_a_resent_result_is_not_counted_again(
    tmp_path: Path, pki: Pki
) -> None:
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle())
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        ok = make_command(pki, kind="test.effect", payload=effect_payload("x"))
        d.deliver(ok)
        await h.sink.wait_terminal(ok.id)
        bad = make_command(pki, sign="other")
        d.deliver(bad)
        d.deliver(bad)  # a duplicate: the stored REJECTED is resent, not counted again
        d.deliver(ok)  # likewise
        n.cancel_scope.cancel()
    counts = d.outcomes.snapshot()
    assert counts[("test.effect", "succeeded")] == 1
    assert counts[(bad.kind, "rejected")] == 1
    assert sum(counts.values()) == 2
    # As exported: bcd.dispatcher.commands with the kind and outcome attributes.
    metrics = NodeMetrics()
    metrics.dispatcher = d
    (commands,) = [m for m in metrics.collect() if m.name == "bcd.dispatcher.commands"]
    attrs = {p.attributes: p.value for p in commands.points}
    assert attrs[(("bcd.command.kind", "test.effect"), ("bcd.command.outcome", "succeeded"))] == 1


async def test_queue_length_counts_commands_waiting_for_a_worker_and_busy_answers_count(
    tmp_path: Path, pki: Pki
) -> None:
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle())
    gate = Gate()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e", during_effect=gate))))
        # The control lane: 4 workers, 8 credits. 4 run (held at the gate), 4 wait, the 9th is BUSY.
        cmds = [make_command(pki, kind="test.effect", payload=effect_payload(str(i))) for i in range(9)]
        for cmd in cmds:
            d.deliver(cmd)
        with trio.fail_after(10):
            while d.queue_length(Lane.CONTROL) != 4:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert d.queue_length(Lane.BULK) == 0
        assert d.outcomes.get(("test.effect", "busy")) == 1
        n.cancel_scope.cancel()
