"""The Dispatcher over the real journal and quorum ledger: results, duplicates, BUSY, deferral, restarts.

Covers DLV-RES-01..07, DLV-ACK-01/08/09/14..18, DLV-REC-03..10, DLV-JRN-16/17, DLV-SIG-17, DLV-QRM-03..05."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import trio
import trio.testing
from bcd_agent.dispatch.command import CommandEnvelope, UpdateState
from bcd_agent.dispatch.handlers import CommandFailed, RunContext
from bcd_agent.dispatch.kinds import UPGRADE_KIND, Lane
from bcd_agent.dispatch.trust import BundleTrust
from bcd_agent.journal import CommandState, EventClass
from bcd_agent.kinds.testing import EffectHandler, effect_handlers, effect_payload
from bcd_shared import wire
from bcd_shared.pki import verify_command_result
from dhelpers import (
    NODE,
    T0,
    Gate,
    Harness,
    Pki,
    approved_batch,
    effect_ids,
    leaf_for,
    make_command,
    start,
    ulid,
)


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


# --- results --------------------------------------------------------------------------------------


async def test_DLV_RES_01_02_03_06_acked_running_one_outcome_with_boot_id(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle())
    log = tmp_path / "effects"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        cmd = make_command(pki, kind="test.effect", payload=effect_payload("hello"))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert h.sink.states(cmd.id) == [UpdateState.ACKED, UpdateState.RUNNING, UpdateState.SUCCEEDED]
    assert all(u.boot_id == "boot-1" for u in h.sink.of(cmd.id))
    assert json.loads(done.result) == {"token": "hello"}
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.state is CommandState.DONE and entry.body == cmd.body_bytes
    assert list(effect_ids(log)) == [cmd.id]


async def test_DLV_REC_05_DLV_REC_06_duplicates_resend_or_reattach(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "effects"
    gate = Gate()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, during_effect=gate))))
        cmd = make_command(pki)
        d.deliver(cmd)
        await h.sink.wait_state(cmd.id, UpdateState.RUNNING)
        before = len(h.sink.of(cmd.id))
        d.deliver(cmd)  # in flight: the run reports, nothing is resent
        assert len(h.sink.of(cmd.id)) == before
        gate.release.set()
        first = await h.sink.wait_terminal(cmd.id)
        d.deliver(cmd)  # done: the stored result again
        d.deliver(cmd)
        n.cancel_scope.cancel()
    terminals = [u for u in h.sink.of(cmd.id) if u.terminal]
    assert terminals == [first, first, first]
    assert list(effect_ids(log)) == [cmd.id]


async def test_DLV_ACK_16_17_terminal_rejection_journaled_and_repeated(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle())
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        cmd = make_command(pki, sign="other")
        d.deliver(cmd)
        d.deliver(cmd)
        n.cancel_scope.cancel()
    ups = h.sink.of(cmd.id)
    assert [(u.state, u.reason) for u in ups] == [(UpdateState.REJECTED, "BAD_SIGNATURE")] * 2
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.state is CommandState.REJECTED
    assert entry.result is not None and entry.result.code == "BAD_SIGNATURE"


async def test_DLV_SIG_17_attested_result_is_node_signed(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        cmd = make_command(pki, kind="test.attested")
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        d.deliver(cmd)  # the replayed update carries the same attestation and signature
        n.cancel_scope.cancel()
    assert done.node_sig and done.attestation
    signed = verify_command_result(
        done.attestation,
        done.node_sig,
        pki.node_key.public_key,
        command_id=cmd.id,
        state=wire.CommandState.SUCCEEDED,
        result=done.result,
        node_id=NODE,
    )
    assert signed.boot_id == "boot-1"
    assert h.sink.of(cmd.id)[-1] == done
    plain = make_command(pki, kind="test.effect")
    assert not plain.attested


async def test_DLV_SIG_17_a_refused_command_of_an_attested_kind_is_node_signed_whatever_its_body_says(
    tmp_path: Path, pki: Pki
) -> None:
    """A refusal is journaled with the kind table's flags, not the body's: a `test.attested` command whose
    body says it is not attested, refused EXPIRED, still gets a node-signed result."""
    h = Harness(tmp_path / "data", pki)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        cmd = make_command(pki, kind="test.attested", attested=False, not_after=T0 - dt.timedelta(minutes=1))
        assert not cmd.attested
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert (done.state, done.reason) == (UpdateState.REJECTED, "EXPIRED")
    assert done.node_sig and done.attestation


async def test_DLV_SIG_17_attestation_is_stored_with_the_result_and_replayed_exactly(
    tmp_path: Path, pki: Pki
) -> None:
    """The attestation and node signature are made once, journaled with the result, and every later send
    (a duplicate delivery, the session's replay after a restart) carries those stored bytes, even if the
    node key has changed since."""
    from bcd_agent.dispatch.results import update_from_entry
    from bcd_agent.dispatch.trust import NodeResultSigner
    from bcd_shared.pki import KeyPair

    h = Harness(tmp_path / "data", pki)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        cmd = make_command(pki, kind="test.attested")
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.result is not None
    assert (entry.result.attestation, entry.result.node_sig) == (done.attestation, done.node_sig)
    h.reopen()
    (stored,) = [e for e in h.journal.unacked_results() if e.id == cmd.id]
    rotated = NodeResultSigner(KeyPair.generate(), NODE)
    replay = update_from_entry(stored, rotated)
    assert replay == done
    verify_command_result(
        replay.attestation,
        replay.node_sig,
        pki.node_key.public_key,
        command_id=cmd.id,
        state=wire.CommandState.SUCCEEDED,
        result=replay.result,
        node_id=NODE,
    )


class Failing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        return frozenset()

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        await ctx.begin_effect()
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "code"),
    [(CommandFailed("gpu-busy", "GPU-1 is held by alloc-7"), "gpu-busy"), (RuntimeError("boom"), "internal")],
)
async def test_DLV_RES_04_failed_carries_its_code(
    tmp_path: Path, pki: Pki, exc: Exception, code: str
) -> None:
    h = Harness(tmp_path / "data", pki)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher({"test.effect": Failing(exc)}))
        cmd = make_command(pki)
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert (done.state, done.error_code) == (UpdateState.FAILED, code)
    assert done.message  # the handler's text ...
    assert d.credits_in_use(cmd.lane) == 0  # type: ignore[arg-type]
    from bcd_agent.dispatch.results import update_from_entry

    h.reopen()
    (entry,) = h.journal.unacked_results()
    assert update_from_entry(entry, None) == done  # ... is journaled, so the replay carries it too


async def test_DLV_RES_04_invalid_payload(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        cmd = make_command(pki, payload=("type.googleapis.com/bcd.v1.GpuResetRequest", b""))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert (done.state, done.error_code) == (UpdateState.FAILED, "invalid-payload")
    assert UpdateState.RUNNING not in h.sink.states(cmd.id)
    assert not log.exists()


# --- BUSY -----------------------------------------------------------------------------------------


async def test_DLV_ACK_14_15_18_busy_not_journaled_and_bad_signature_first(tmp_path: Path, pki: Pki) -> None:
    """A full lane answers BUSY (never journaled, accepted on redelivery later); a bad signature on that
    full lane is still BAD_SIGNATURE."""
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle())
    gate = Gate()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e", during_effect=gate))))
        cmds = [make_command(pki, kind="test.bulk") for _ in range(3)]
        for c in cmds:
            d.deliver(c)
        assert h.sink.states(cmds[2].id) == [UpdateState.BUSY]
        assert h.sink.of(cmds[2].id)[0].message == "lane bulk has no free credit (2 in use)"
        assert h.journal.get_command(cmds[2].id) is None
        forged = make_command(pki, kind="test.bulk", sign="none")
        d.deliver(forged)
        assert [(u.state, u.reason) for u in h.sink.of(forged.id)] == [
            (UpdateState.REJECTED, "BAD_SIGNATURE")
        ]
        gate.release.set()
        for c in cmds[:2]:
            await h.sink.wait_terminal(c.id)
        d.deliver(cmds[2])
        assert (await h.sink.wait_terminal(cmds[2].id)).state is UpdateState.SUCCEEDED
        n.cancel_scope.cancel()


def _refused_on_a_full_lane(pki: Pki, fault: str, kind: str) -> CommandEnvelope:
    if fault == "wrong node":
        return make_command(pki, kind=kind, node_id="node-z")
    if fault == "unknown kind":
        return make_command(pki, kind="no.such.kind", lane=Lane.CONTROL)
    if fault == "outside role":
        return make_command(pki, kind="bmc.query")  # site only; this agent is a node
    if fault == "stale generation":
        return make_command(pki, kind=kind, min_generation=9, not_after=T0 - dt.timedelta(seconds=1))
    if fault == "expired":
        return make_command(pki, kind=kind, not_after=T0 - dt.timedelta(seconds=1))
    if fault == "no signature":
        return make_command(pki, kind=kind, sign="none")
    if fault == "unknown key":
        return make_command(pki, kind=kind, sign="other")
    if fault == "one byte changed":
        return make_command(pki, kind=kind, sign="tamper")
    if fault == "unbatched destructive":
        return make_command(pki, kind="test.destructive")
    assert fault == "one approver of two"
    cid = ulid()
    batch = approved_batch(pki, "b-1", [leaf_for(cid, "test.destructive")], 0, signers=(0,))
    return make_command(pki, id=cid, kind="test.destructive", batch_id="b-1", batch=batch)


FULL_LANE_FAULTS = {
    "wrong node": "UNSUPPORTED",
    "unknown kind": "UNSUPPORTED",
    "outside role": "UNSUPPORTED",
    "stale generation": "STALE_GENERATION",
    "expired": "EXPIRED",
    "no signature": "BAD_SIGNATURE",
    "unknown key": "BAD_SIGNATURE",
    "one byte changed": "BAD_SIGNATURE",
    "unbatched destructive": "UNBATCHED_LIMIT",
    "one approver of two": "BATCH_UNAPPROVED",
}


@pytest.mark.parametrize("fault", list(FULL_LANE_FAULTS))
async def test_DLV_ACK_16_18_terminal_reasons_decide_before_busy(
    tmp_path: Path, pki: Pki, fault: str
) -> None:
    """The acceptance order's table with every lane out of credit and the journal full: each terminal
    reason is still answered (REJECTED, journaled), never BUSY; a good command then is BUSY (DLV-ACK-14)."""
    from bcd_agent.dispatch.lanes import LANES

    h = Harness(
        tmp_path / "data",
        pki,
        bundle=pki.bundle(approvers=3, required=2, allowance=0),
        journal_options={"max_events": 1},
    )
    gate = Gate()
    fill = {Lane.CONTROL: "test.effect", Lane.PROVISION: "test.provision", Lane.BULK: "test.bulk"}
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e", during_effect=gate))))
        for lane, kind in fill.items():
            for _ in range(LANES[lane].credits):
                d.deliver(make_command(pki, kind=kind))
            assert d.credits_in_use(lane) == LANES[lane].credits
        h.journal.append_event(EventClass.RESULT, "allocation.bound", b"x")
        assert h.journal.is_full()
        cmd = _refused_on_a_full_lane(pki, fault, "test.effect")
        d.deliver(cmd)
        good = make_command(pki, kind="test.effect")
        d.deliver(good)
        n.cancel_scope.cancel()
    assert [(u.state, u.reason) for u in h.sink.of(cmd.id)] == [
        (UpdateState.REJECTED, FULL_LANE_FAULTS[fault])
    ]
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.state is CommandState.REJECTED
    assert [u.state for u in h.sink.of(good.id)] == [UpdateState.BUSY]
    assert h.journal.get_command(good.id) is None


async def test_DLV_JRN_21_full_journal_answers_busy(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki, journal_options={"max_events": 3})
    for i in range(3):
        h.journal.append_event(EventClass.TRANSITION, "allocation.bound", f"{i}".encode())
    assert h.journal.is_full()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        cmd = make_command(pki)
        d.deliver(cmd)
        n.cancel_scope.cancel()
    assert [(u.state, u.reason) for u in h.sink.of(cmd.id)] == [(UpdateState.BUSY, "BUSY")]
    assert "journal full" in h.sink.of(cmd.id)[0].message
    assert h.journal.get_command(cmd.id) is None
    assert d.credits_in_use(cmd.lane) == 0  # type: ignore[arg-type]


# --- deferral -------------------------------------------------------------------------------------


async def test_DLV_ACK_07_08_RCV_07_deferral_and_recheck_on_newer_spec(
    tmp_path: Path, pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle())
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log)), applied_generation=5))
        a = make_command(pki, seq=1, min_generation=6)
        b = make_command(pki, seq=2, min_generation=7)
        d.deliver(a)
        d.deliver(b)
        assert h.specs.sent == [5]  # one SpecRequest MIN_GENERATION per applied generation
        assert set(d.deferred_ids()) == {a.id, b.id}
        assert h.sink.of(a.id) == [] and h.journal.get_command(a.id) is None  # deferred: not journaled
        await trio.sleep(60)
        d.spec_applied(6)
        assert (await h.sink.wait_terminal(a.id)).state is UpdateState.SUCCEEDED
        assert d.deferred_ids() == (b.id,)
        assert h.specs.sent == [5, 6]
        d.spec_applied(7)
        assert (await h.sink.wait_terminal(b.id)).state is UpdateState.SUCCEEDED
        n.cancel_scope.cancel()
    assert sorted(effect_ids(log)) == sorted([a.id, b.id])


def _held(cmd: CommandEnvelope) -> int:
    """What a deferred command holds in memory, counted as the bound counts it: the signed body, the
    payload decoded from it, the signature and the signer chain."""
    return (
        len(cmd.body_bytes)
        + len(cmd.payload.value)
        + len(cmd.signature)
        + sum(len(c) for c in cmd.signer_chain)
    )


async def test_DLV_ACK_14_deferred_commands_are_bounded_in_bytes_exactly(tmp_path: Path, pki: Pki) -> None:
    """Deferral holds commands in memory before their signature is checked, so their bytes are bounded
    (max_deferred_bytes): a command that fits exactly is deferred; one byte more is BUSY, never
    journaled, the message naming the count and bytes already held and the bound. Every part of a command
    counts: two commands whose bodies fit but whose signature and chain do not are not both held."""
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle())
    a = make_command(pki, seq=1, min_generation=9, payload=effect_payload("a" * 3000))
    b = make_command(pki, seq=2, min_generation=9, payload=effect_payload("b" * 3000))
    c = make_command(pki, seq=3, min_generation=9, payload=effect_payload("c" * 3000))
    assert a.signature and a.signer_chain  # each part is counted: none may be empty here
    bound = _held(a) + _held(b)
    async with trio.open_nursery() as n:
        d = await start(
            n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e")), max_deferred_bytes=bound)
        )
        d.deliver(a)
        d.deliver(b)  # exactly at the bound: held
        d.deliver(c)
        assert d.deferred_ids() == (a.id, b.id)
        assert h.sink.of(a.id) == [] and h.sink.of(b.id) == []
        assert [(u.state, u.reason, u.message) for u in h.sink.of(c.id)] == [
            (
                UpdateState.BUSY,
                "BUSY",
                f"2 commands of {bound} bytes already wait for a newer spec (at most {bound} bytes)",
            )
        ]
        assert h.journal.get_command(c.id) is None
        n.cancel_scope.cancel()
    for part in ("body", "payload", "signature", "chain"):
        sizes = {
            "body": len(a.body_bytes),
            "payload": len(a.payload.value),
            "signature": len(a.signature),
            "chain": sum(len(x) for x in a.signer_chain),
        }
        h = Harness(tmp_path / f"data-{part}", pki, bundle=pki.bundle())
        async with trio.open_nursery() as n:
            d = await start(
                n,
                h.dispatcher(
                    effect_handlers(EffectHandler(tmp_path / "e")), max_deferred_bytes=bound - sizes[part]
                ),
            )
            d.deliver(a)
            d.deliver(b)
            assert d.deferred_ids() == (a.id,), part  # without that part b would fit
            assert [u.state for u in h.sink.of(b.id)] == [UpdateState.BUSY]
            n.cancel_scope.cancel()


async def test_DLV_ACK_14_deferred_commands_are_bounded_in_count_exactly(tmp_path: Path, pki: Pki) -> None:
    """max_deferred commands are held (exactly that many); the next is BUSY, never journaled, the message
    naming how many wait."""
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle())
    cmds = [make_command(pki, seq=i, min_generation=9) for i in range(1, 4)]
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e")), max_deferred=2))
        for c in cmds:
            d.deliver(c)
        assert d.deferred_ids() == (cmds[0].id, cmds[1].id)
        assert [(u.state, u.message) for u in h.sink.of(cmds[2].id)] == [
            (UpdateState.BUSY, "2 commands already wait for a newer spec")
        ]
        assert h.journal.get_command(cmds[2].id) is None
        n.cancel_scope.cancel()


async def test_DLV_ACK_09_still_behind_at_not_after_is_stale(
    tmp_path: Path, pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(tmp_path / "data", pki)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e")), applied_generation=1))
        cmd = make_command(pki, min_generation=2, not_after=T0 + dt.timedelta(minutes=3))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        elapsed = trio.current_time()
        n.cancel_scope.cancel()
    assert (done.state, done.reason) == (UpdateState.REJECTED, "STALE_GENERATION")
    assert h.clock.server_now() >= T0 + dt.timedelta(minutes=3)
    assert elapsed > 0
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.state is CommandState.REJECTED


async def test_Q_DLV_CMD_03_waited_past_not_after_never_starts(
    tmp_path: Path, pki: Pki, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    gate = Gate()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, during_effect=gate))))
        first = make_command(pki, kind="test.bulk", payload=effect_payload("first"))
        late = make_command(pki, kind="test.bulk", not_after=T0 + dt.timedelta(seconds=30))
        d.deliver(first)
        d.deliver(late)
        assert h.sink.states(late.id) == [UpdateState.ACKED]
        await trio.sleep(60)
        gate.release.set()
        done = await h.sink.wait_terminal(late.id)
        n.cancel_scope.cancel()
    assert (done.state, done.reason) == (UpdateState.REJECTED, "EXPIRED")
    assert list(effect_ids(log)) == [first.id]


async def test_DLV_ACK_06_upgrade_only_switch(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    handler = EffectHandler(tmp_path / "e")
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher({**effect_handlers(handler), UPGRADE_KIND: handler}))
        d.set_upgrade_only(True)
        other = make_command(pki, kind="test.echo")
        upgrade = make_command(pki, kind=UPGRADE_KIND)
        d.deliver(other)
        d.deliver(upgrade)
        assert (await h.sink.wait_terminal(upgrade.id)).state is UpdateState.SUCCEEDED
        n.cancel_scope.cancel()
    assert [(u.state, u.reason) for u in h.sink.of(other.id)] == [(UpdateState.REJECTED, "UNSUPPORTED")]


# --- restarts -------------------------------------------------------------------------------------


async def _crash_while_running(
    h: Harness, tmp_path: Path, cmd: CommandEnvelope, *, after_effect: bool
) -> None:
    """Run `cmd` until it blocks (before or after begin_effect), then stop the process without settling."""
    gate = Gate()
    handler = EffectHandler(
        tmp_path / "e",
        before_effect=None if after_effect else gate,
        during_effect=gate if after_effect else None,
    )
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(handler)))
        d.deliver(cmd)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.entered == [cmd.id]
        n.cancel_scope.cancel()  # the process dies: nothing settles


async def test_DLV_REC_08_retry_safe_reexecutes_after_checks(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    cmd = make_command(pki, kind="test.retry")
    await _crash_while_running(h, tmp_path, cmd, after_effect=True)
    h.reopen()
    assert h.journal.recover() == ()  # retry-safe entries wait for redelivery (DLV-REC-11)
    log = tmp_path / "e2"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert done.state is UpdateState.SUCCEEDED and list(effect_ids(log)) == [cmd.id]


async def test_DLV_REC_11_reexecution_passes_not_after_again(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    cmd = make_command(pki, kind="test.retry", not_after=T0 + dt.timedelta(minutes=2))
    await _crash_while_running(h, tmp_path, cmd, after_effect=False)
    h.reopen()
    h.clock.offset_s = 300  # the restart took five minutes
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e2"))))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert (done.state, done.reason) == (UpdateState.REJECTED, "EXPIRED")


@pytest.mark.parametrize("recover_first", [True, False])
async def test_DLV_REC_09_10_not_retry_safe_is_interrupted(
    tmp_path: Path, pki: Pki, recover_first: bool
) -> None:
    h = Harness(tmp_path / "data", pki)
    cmd = make_command(pki, kind="test.effect")
    await _crash_while_running(h, tmp_path, cmd, after_effect=True)
    h.reopen()
    if recover_first:
        settled = h.journal.recover()
        assert [e.id for e in settled] == [cmd.id]
    log = tmp_path / "e2"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert (done.state, done.error_code) == (UpdateState.FAILED, "interrupted")
    assert not log.exists()


async def test_DLV_REC_07_17_self_terminating_completed_by_reboot(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    cmd = make_command(pki, kind="test.reboot")
    await _crash_while_running(h, tmp_path, cmd, after_effect=True)
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and entry.state is CommandState.RUNNING and entry.boot_id == "boot-1"
    h.reopen(boot_id="boot-2")
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e2"))))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert (done.state, done.reason, done.boot_id) == (UpdateState.SUCCEEDED, "rebooted", "boot-2")
    assert wire.NodeRebootResult.parse(done.result).previous_boot_id == "boot-1"


# --- the quorum across restarts -------------------------------------------------------------------


async def test_DLV_QRM_03_04_unbatched_allowance_survives_restart(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle(approvers=3, allowance=1))
    handlers = effect_handlers(EffectHandler(tmp_path / "e"))
    first, second, third = (make_command(pki, kind="test.destructive") for _ in range(3))
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(handlers))
        d.deliver(first)
        assert (await h.sink.wait_terminal(first.id)).state is UpdateState.SUCCEEDED
        n.cancel_scope.cancel()
    h.reopen()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(handlers))
        d.deliver(second)
        h.clock.host_jump_s = 3601  # the host's own clock: an hour later
        d.deliver(third)
        await h.sink.wait_terminal(third.id)
        n.cancel_scope.cancel()
    assert h.sink.terminal(second.id).reason == "UNBATCHED_LIMIT"  # type: ignore[union-attr]
    assert h.sink.terminal(third.id).state is UpdateState.SUCCEEDED  # type: ignore[union-attr]


async def test_DLV_QRM_05_leaf_runs_once_even_after_journal_loss(tmp_path: Path, pki: Pki) -> None:
    data = tmp_path / "data"
    h = Harness(data, pki, bundle=pki.bundle(approvers=3, required=2))
    log = tmp_path / "e"
    handlers = effect_handlers(EffectHandler(log))
    cid = ulid()
    batch = approved_batch(pki, "b1", [leaf_for(cid, "test.destructive")], 0)
    cmd = make_command(pki, id=cid, kind="test.destructive", batch_id="b1", batch=batch)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(handlers))
        d.deliver(cmd)
        assert (await h.sink.wait_terminal(cid)).state is UpdateState.SUCCEEDED
        n.cancel_scope.cancel()
    h.journal.close()
    for f in data.glob("journal.db*"):
        f.unlink()  # the journal is lost; the ledger is not
    h.reopen()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(handlers))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cid)
        n.cancel_scope.cancel()
    assert (done.state, done.reason) == (UpdateState.REJECTED, "BATCH_UNAPPROVED")
    assert list(effect_ids(log)) == [cid]


# --- the command body's fields (DLV-CMD) ------------------------------------------------------------


def _relaned(cmd: CommandEnvelope, lane: wire.Lane) -> CommandEnvelope:
    """`cmd` with its body's lane replaced, through the wire edge (unsigned: the harness has no roots)."""
    from bcd_agent.dispatch.wire import envelope_from_wire

    body = wire.CommandBody.parse(cmd.body_bytes)
    body.lane = lane
    return envelope_from_wire(wire.Command(body=bytes(body)))


async def test_DLV_CMD_04_a_command_for_another_node_never_runs(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        other = make_command(pki, node_id="node-b")
        mine = make_command(pki)
        d.deliver(other)
        d.deliver(mine)
        await h.sink.wait_terminal(mine.id)
        n.cancel_scope.cancel()
    assert [(u.state, u.reason) for u in h.sink.of(other.id)] == [(UpdateState.REJECTED, "UNSUPPORTED")]
    assert "node-b" in h.sink.of(other.id)[0].message
    assert list(effect_ids(log)) == [mine.id]
    entry = h.journal.get_command(other.id)
    assert entry is not None and entry.state is CommandState.REJECTED


async def test_DLV_CMD_07_each_lane_takes_its_own_commands_and_a_body_without_one_is_refused(
    tmp_path: Path, pki: Pki
) -> None:
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    gate = Gate()
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, during_effect=gate))))
        by_lane = {
            Lane.CONTROL: make_command(pki, kind="test.effect"),
            Lane.PROVISION: make_command(pki, kind="test.provision"),
            Lane.BULK: make_command(pki, kind="test.bulk"),
        }
        laneless = _relaned(make_command(pki, kind="test.effect"), wire.Lane.UNSPECIFIED)
        elsewhere = _relaned(make_command(pki, kind="test.provision"), wire.Lane.BULK)
        for cmd in (*by_lane.values(), laneless, elsewhere):
            d.deliver(cmd)
        for cmd in by_lane.values():
            await h.sink.wait_state(cmd.id, UpdateState.RUNNING)
        # Each command holds a credit of its own lane, and only that.
        assert {lane: d.credits_in_use(lane) for lane in Lane} == dict.fromkeys(Lane, 1)
        gate.release.set()
        for cmd in by_lane.values():
            assert (await h.sink.wait_terminal(cmd.id)).state is UpdateState.SUCCEEDED
        n.cancel_scope.cancel()
    assert laneless.lane is None
    for refused in (laneless, elsewhere):
        done = h.sink.terminal(refused.id)
        assert done is not None and (done.state, done.reason) == (UpdateState.REJECTED, "UNSUPPORTED")
        assert "lane" in done.message
    assert sorted(effect_ids(log)) == sorted(c.id for c in by_lane.values())


async def test_DLV_CMD_08_not_after_is_judged_in_server_time_and_a_late_command_never_starts(
    tmp_path: Path, pki: Pki
) -> None:
    """The host clock is an hour off either way; only the server time (the Welcome offset) decides."""
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        now = h.clock.server_now()
        h.clock.host_jump_s = 3600.0  # the host thinks it is an hour later: still in time
        in_time = make_command(pki, not_after=now + dt.timedelta(minutes=5))
        d.deliver(in_time)
        assert (await h.sink.wait_terminal(in_time.id)).state is UpdateState.SUCCEEDED
        h.clock.host_jump_s = -3600.0  # the host thinks it is an hour earlier: still too late
        late = make_command(pki, not_after=now - dt.timedelta(seconds=1))
        d.deliver(late)
        done = await h.sink.wait_terminal(late.id)
        n.cancel_scope.cancel()
    assert (done.state, done.reason) == (UpdateState.REJECTED, "EXPIRED")
    assert UpdateState.RUNNING not in h.sink.states(late.id)
    assert list(effect_ids(log)) == [in_time.id]


async def test_DLV_CMD_09_min_generation_0_presupposes_no_spec(tmp_path: Path, pki: Pki) -> None:
    """0 runs on a node that holds no spec at all and asks for none; a generation above the applied one
    waits for it, one at or below runs."""
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log)), applied_generation=0))
        none = make_command(pki, min_generation=0)
        d.deliver(none)
        assert (await h.sink.wait_terminal(none.id)).state is UpdateState.SUCCEEDED
        assert h.specs.sent == []
        needs_3 = make_command(pki, min_generation=3)
        d.deliver(needs_3)
        assert d.deferred_ids() == (needs_3.id,) and h.specs.sent == [0]
        d.spec_applied(2)
        assert d.deferred_ids() == (needs_3.id,)
        needs_2 = make_command(pki, min_generation=2)
        d.deliver(needs_2)
        assert (await h.sink.wait_terminal(needs_2.id)).state is UpdateState.SUCCEEDED
        d.spec_applied(3)
        assert (await h.sink.wait_terminal(needs_3.id)).state is UpdateState.SUCCEEDED
        n.cancel_scope.cancel()
    assert list(effect_ids(log)) == [none.id, needs_2.id, needs_3.id]


@pytest.mark.parametrize("retry_safe", [True, False])
async def test_DLV_CMD_10_retry_safe_in_the_body_decides_whether_a_crash_reruns_the_command(
    tmp_path: Path, pki: Pki, retry_safe: bool
) -> None:
    """test.retry is retry-safe in the table; the body's flag decides: re-run, or FAILED interrupted."""
    h = Harness(tmp_path / "data", pki)
    cmd = make_command(pki, kind="test.retry", retry_safe=retry_safe)
    await _crash_while_running(h, tmp_path, cmd, after_effect=True)
    h.reopen()
    log = tmp_path / "e2"
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    if retry_safe:
        assert done.state is UpdateState.SUCCEEDED and list(effect_ids(log)) == [cmd.id]
    else:
        assert (done.state, done.error_code) == (UpdateState.FAILED, "interrupted")
        assert not log.exists()


class _ProcessEnded(BaseException):
    """What a self-terminating side effect does to the process: nothing after it runs."""


def _end_process() -> None:
    raise _ProcessEnded


async def test_DLV_CMD_12_a_self_terminating_effect_ends_the_process_and_the_next_boot_completes_it(
    tmp_path: Path, pki: Pki
) -> None:
    """The process that runs the effect reports no outcome (it ends with it); `running{boot_id}` is on
    disk by then, so the next boot reports SUCCEEDED `rebooted` and the effect is not run again."""
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    cmd = make_command(pki, kind="test.reboot")
    assert cmd.self_terminating
    with pytest.raises(BaseExceptionGroup) as ended:
        async with trio.open_nursery() as n:
            d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log, terminate=_end_process))))
            d.deliver(cmd)
            await trio.sleep_forever()
    assert ended.group_contains(_ProcessEnded)
    assert h.sink.states(cmd.id) == [UpdateState.ACKED, UpdateState.RUNNING]
    entry = h.journal.get_command(cmd.id)
    assert entry is not None and (entry.state, entry.boot_id) == (CommandState.RUNNING, "boot-1")
    h.reopen(boot_id="boot-2")
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert (done.state, done.reason) == (UpdateState.SUCCEEDED, "rebooted")
    assert list(effect_ids(log)) == [cmd.id]


@pytest.mark.parametrize("attested", [True, False])
async def test_DLV_CMD_13_attested_in_the_body_makes_the_result_node_signed(
    tmp_path: Path, pki: Pki, attested: bool
) -> None:
    """test.echo is not attested in the table: the body's flag alone asks for the node's signature."""
    h = Harness(tmp_path / "data", pki)
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "e"))))
        cmd = make_command(pki, kind="test.echo", attested=attested)
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert done.state is UpdateState.SUCCEEDED
    if not attested:
        assert (done.attestation, done.node_sig) == (b"", b"")
        return
    verify_command_result(
        done.attestation,
        done.node_sig,
        pki.node_key.public_key,
        command_id=cmd.id,
        state=wire.CommandState.SUCCEEDED,
        result=done.result,
        node_id=NODE,
    )


async def test_DLV_ACK_01_REC_03_a_delivery_is_resolved_against_the_journal_before_any_check(
    tmp_path: Path, pki: Pki
) -> None:
    """Redelivered once every acceptance check would refuse it (past not_after, upgrade-only, now
    unsigned under roots), a settled command still gets its stored result, and an interrupted one its
    `interrupted`: the journal answers first."""
    h = Harness(tmp_path / "data", pki)
    log = tmp_path / "e"
    done_cmd = make_command(pki, kind="test.effect", not_after=T0 + dt.timedelta(minutes=1), sign="none")
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        d.deliver(done_cmd)
        first = await h.sink.wait_terminal(done_cmd.id)
        n.cancel_scope.cancel()
    assert first.state is UpdateState.SUCCEEDED
    cut = make_command(pki, kind="test.effect", not_after=T0 + dt.timedelta(minutes=1), sign="none")
    await _crash_while_running(h, tmp_path, cut, after_effect=True)
    h.reopen()
    h.trust = BundleTrust(pki.bundle())  # roots now: both bodies are unsigned
    h.clock.offset_s = 600  # and past their not_after
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(log))))
        d.set_upgrade_only(True)
        d.deliver(done_cmd)
        d.deliver(cut)
        n.cancel_scope.cancel()
    assert h.sink.of(done_cmd.id) == [first]
    (again,) = h.sink.of(cut.id)
    assert (again.state, again.error_code) == (UpdateState.FAILED, "interrupted")
    assert list(effect_ids(log)).count(done_cmd.id) == 1


def _with_body(cmd: CommandEnvelope, **fields: object) -> CommandEnvelope:
    """`cmd` with body fields replaced, through the wire edge (unsigned: the harness has no roots)."""
    from bcd_agent.dispatch.wire import envelope_from_wire

    body = wire.CommandBody.parse(cmd.body_bytes)
    for name, value in fields.items():
        setattr(body, name, value)
    return envelope_from_wire(wire.Command(body=bytes(body)))


class _Broker:
    """The session's secret requests, as the dispatcher sees them: records what was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, str]] = []

    async def fetch(self, ref: str, *, workflow_id: str, step_id: str) -> bytes:
        self.asked.append((ref, workflow_id, step_id))
        return b"value-of-" + ref.encode()


class _NeedsSecret:
    """A kind that needs a secret before its effect (a BMC password, a registry token)."""

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        return frozenset()

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        value = await ctx.secret("secret://pool/bmc")
        await ctx.begin_effect()
        return value


async def test_DLV_CMD_14_a_secret_asked_for_a_command_binds_to_its_workflow_step(
    tmp_path: Path, pki: Pki
) -> None:
    """The secret request names the command's workflow_id and step_id; a command that names no workflow
    step gets no secret (FAILED `secret-unbound`, nothing asked, no effect begun), nor does a command on an
    agent without a broker (`secret-unavailable`)."""
    h = Harness(tmp_path / "data", pki)
    broker = _Broker()
    bound = _with_body(make_command(pki), workflow_id="wf-9", step_id="power-cycle")
    unbound = make_command(pki)
    half = _with_body(make_command(pki), workflow_id="wf-9")
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher({"test.effect": _NeedsSecret()}, secrets=broker))
        for cmd in (bound, unbound, half):
            d.deliver(cmd)
        done = await h.sink.wait_terminal(bound.id)
        refused = [await h.sink.wait_terminal(c.id) for c in (unbound, half)]
        n.cancel_scope.cancel()
    assert done.state is UpdateState.SUCCEEDED and done.result == b"value-of-secret://pool/bmc"
    assert broker.asked == [("secret://pool/bmc", "wf-9", "power-cycle")]
    for cmd, r in zip((unbound, half), refused, strict=True):
        assert (r.state, r.error_code) == (UpdateState.FAILED, "secret-unbound")
        assert UpdateState.RUNNING not in h.sink.states(cmd.id)
    h.reopen()
    lone = _with_body(make_command(pki), workflow_id="wf-9", step_id="power-cycle")
    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher({"test.effect": _NeedsSecret()}))
        d.deliver(lone)
        r = await h.sink.wait_terminal(lone.id)
        n.cancel_scope.cancel()
    assert (r.state, r.error_code) == (UpdateState.FAILED, "secret-unavailable")
