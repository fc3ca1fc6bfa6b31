"""Hostile gateway, round 1 (docs/session.md): a compromised gateway holds the TLS session but no signing
key. Each test drives the real SessionCore over a real journal (and identity.json where it matters) with
what such a gateway can send, and checks that nothing it says outlives the compromise."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.clock import OffsetClock
from bcd_agent.dispatch.dispatcher import Dispatcher
from bcd_agent.dispatch.kinds import KINDS, Role
from bcd_agent.dispatch.ports import ResultSigner
from bcd_agent.dispatch.quorum import QuorumLedger
from bcd_agent.dispatch.trust import BundleTrust
from bcd_agent.journal import Journal
from bcd_agent.kinds.testing import TEST_KINDS, EffectHandler, effect_handlers, effect_payload
from bcd_agent.session import identity as ident
from bcd_agent.session.core import SessionCore
from bcd_shared import wire
from bcd_shared.pki.signing import Purpose
from session.test_session_core import (
    NODE,
    Clock,
    Pki,
    Recorder,
    _done_command,
    _persisting,
    connect,
    make,
    welcome,
)

YEAR_MS = 365 * 86400 * 1000
LEAD_S = 240.0  # session.core.MAX_SERVER_LEAD_S


def test_a_far_future_server_time_does_not_lock_out_the_next_honest_gateway(tmp_path: Path) -> None:
    """A compromised gateway's Welcome and heartbeats say the year is ten years on. The mark (journal and
    identity.json) moves no further than the host clock + 4 minutes, so once an honest gateway
    is back, its Welcome with the true server time is admitted, in this process and after a restart;
    before the fix the mark kept the gateway's time and every later Welcome was refused forever."""
    pki = Pki()
    data = tmp_path / "data"
    core = _persisting(data, pki)
    now_ms = int(time.time() * 1000)
    connect(core, [], server_ms=now_ms + 10 * YEAR_MS)
    core.handle(wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=now_ms + 20 * YEAR_MS)))
    ceiling = time.time() + LEAD_S
    assert core.journal.server_time_mark <= ceiling
    assert ident.load(data).server_time_mark_ms / 1000 <= ceiling
    core.detach()
    core.attach([].append)
    core.handle(welcome(int(time.time() * 1000)))  # the honest gateway, same process
    assert core.state.welcomed
    core.journal.close()
    again = _persisting(data, pki, identity=ident.load(data))
    again.attach([].append)
    again.handle(welcome(int(time.time() * 1000)))  # and after a restart
    assert again.state.welcomed
    again.journal.close()


def _forged(
    node: str, n: int, kind: str = "test.effect", pad: int = 0, min_generation: int = 0
) -> wire.GatewayMessage:
    """A command as a gateway without a signing key makes it: well-formed, fresh, unsigned."""
    type_url, value = effect_payload("forged" + "x" * pad)
    body = wire.CommandBody(
        id=_ulid(n),
        node_id=node,
        seq=n,
        kind=kind,
        payload=wire.ProtoAny(type_url=type_url, value=value),
        lane=wire.Lane.CONTROL,
        not_after=int(time.time() * 1000) + 600_000,
        min_generation=min_generation,
    )
    return wire.GatewayMessage(command=wire.Command(body=bytes(body), attempt=1))


def _ulid(n: int) -> str:
    digits = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    out = ""
    for _ in range(24):
        out = digits[n % 32] + out
        n //= 32
    return "01" + out


@contextlib.asynccontextmanager
async def _node(
    data: Path, pki: Pki, *, signer: ResultSigner | None = None, **bounds: Any
) -> AsyncIterator[SessionCore]:
    """The real SessionCore over a real Dispatcher, journal and quorum ledger in `data`, as `bcd node`
    wires them (test kinds registered, as `bcd node --test-kinds` does). `bounds`: Journal.open's bounds;
    `signer`: the node key's result signer (attested results)."""
    journal = Journal.open(data, boot_id="boot-1", **bounds)
    trust = BundleTrust()
    clock = OffsetClock()
    runner = Recorder()
    core = SessionCore(
        journal=journal,
        dispatcher=None,
        runner=runner,
        trust=trust,
        clock=clock,
        identity=pki.identity(),
        data_dir=data,
        persist_identity=False,
    )
    dispatcher = Dispatcher(
        node_id=NODE,
        role=Role.NODE,
        journal=journal,
        sink=core,
        spec_requester=core,
        trust=trust,
        batches=trust,
        ledger=QuorumLedger.open(data),
        clock=clock,
        handlers=effect_handlers(EffectHandler(data / "test-effects.log")),
        kinds={**KINDS, **TEST_KINDS},
        signer=signer,
    )
    core.dispatcher = dispatcher
    async with trio.open_nursery() as nursery:
        await nursery.start(dispatcher.run)
        try:
            yield core
        finally:
            nursery.cancel_scope.cancel()
    journal.close()


async def test_a_flood_of_unsigned_commands_never_grows_hello_past_a_gateways_message_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compromised gateway sends unsigned commands under fresh ids and never acks their refusals. Each
    refusal is journaled (BAD_SIGNATURE, DLV-ACK-17) and replayed until acked (DLV-RES-08); before the fix
    every one of them rode in the next Hello, so enough of them (about 40,000 at ~100 bytes) made a Hello
    no gateway takes (gRPC's 4 MiB cap) and the node could never reconnect to have them acked. Hello now
    carries at most HELLO_RESULTS_MAX_BYTES of results (lowered here so a few hundred show it) and the
    rest follow the Welcome."""
    import bcd_agent.session.core as coremod

    cap = 4096
    monkeypatch.setattr(coremod, "HELLO_RESULTS_MAX_BYTES", cap, raising=False)
    pki = Pki()
    data = tmp_path / "data"
    n = 300
    async with _node(data, pki) as core:
        out: list[wire.NodeMessage] = []
        connect(core, out, bundle=pki.bundle())
        core.handle_batch([_forged(NODE, i) for i in range(n)])
        refused = [m.command_update for m in out if m.command_update is not None]
        assert len(refused) == n
        assert {u.reason for u in refused} == {"BAD_SIGNATURE"}
        assert not (data / "test-effects.log").exists()
        core.detach()
        # The next connection (the gateway acked nothing).
        out = []
        hello = core.attach(out.append).hello
        assert hello is not None
        assert len(bytes(hello)) < cap + 1024
        in_hello = {u.command_id for u in hello.unacked_results}
        assert 0 < len(in_hello) < n
        core.handle(welcome(bundle=pki.bundle()))
        after = {m.command_update.command_id for m in out if m.command_update is not None}
        assert in_hello | after == {_ulid(i) for i in range(n)}  # none lost: the rest follow the Welcome


async def test_deferred_unsigned_commands_are_bounded_in_bytes_not_only_in_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deferral is judged before the signature (Q-DLV-ACK-01), so a gateway can park unsigned commands
    with a min_generation no spec reaches. The count bound (1000) alone let it hold 1000 x 4 MiB bodies
    (the message cap) in the node's memory; the deferred bytes are bounded too (MAX_DEFERRED_BYTES,
    lowered here) and the excess answered BUSY, never journaled."""
    import bcd_agent.dispatch.dispatcher as dispmod

    monkeypatch.setattr(dispmod, "MAX_DEFERRED_BYTES", 4 * 1024 * 1024, raising=False)
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out: list[wire.NodeMessage] = []
        connect(core, out, bundle=pki.bundle())
        core.handle_batch([_forged(NODE, i, pad=512 * 1024, min_generation=99) for i in range(20)])
        dispatcher = core.dispatcher
        assert isinstance(dispatcher, Dispatcher)
        held = dispatcher.deferred_ids()
        assert 0 < len(held) <= 4  # ~1 MiB each (body and payload): at most 4 MiB held
        busy = [m.command_update for m in out if m.command_update is not None]
        assert len(busy) == 20 - len(held)
        assert {u.state for u in busy} == {wire.CommandState.BUSY}
        assert all(core.journal.get_command(u.command_id) is None for u in busy)


def _journal_bytes(data: Path) -> int:
    return sum(f.stat().st_size for f in data.glob("journal.db*"))


async def test_a_refused_command_keeps_no_body_so_forged_bodies_cannot_fill_the_data_dir(
    tmp_path: Path,
) -> None:
    """Every unsigned command is refused BAD_SIGNATURE and journaled (DLV-ACK-17), but before the fix with
    its body: a gateway sending bodies near the 4 MiB message cap filled the data_dir at 4 MiB per
    message, and every Hello read those bodies back into memory. Now 40 refusals of 256 KiB bodies grow
    the journal by well under one body's size each, and a duplicate still gets the same answer."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out: list[wire.NodeMessage] = []
        connect(core, out, bundle=pki.bundle())
        before = _journal_bytes(data)
        core.handle_batch([_forged(NODE, i, pad=256 * 1024) for i in range(40)])
        refused = [m.command_update for m in out if m.command_update is not None]
        assert [u.reason for u in refused] == ["BAD_SIGNATURE"] * 40
        assert _journal_bytes(data) - before < 1024 * 1024  # 40 bodies would be 10 MiB
        entry = core.journal.get_command(_ulid(0))
        assert entry is not None and entry.body == b"" and entry.signature == b""
        out.clear()
        core.handle(_forged(NODE, 0, pad=256 * 1024))  # a duplicate: the journaled answer
        again = [m.command_update for m in out if m.command_update is not None]
        assert [(u.command_id, u.reason) for u in again] == [(_ulid(0), "BAD_SIGNATURE")]


def _signed(pki: Pki, n: int, not_after_ms: int) -> wire.GatewayMessage:
    type_url, value = effect_payload("signed")
    body = bytes(
        wire.CommandBody(
            id=_ulid(n),
            node_id=NODE,
            seq=n,
            kind="test.effect",
            payload=wire.ProtoAny(type_url=type_url, value=value),
            lane=wire.Lane.CONTROL,
            not_after=not_after_ms,
        )
    )
    signature = pki.worker.sign(Purpose.COMMAND, body)
    return wire.GatewayMessage(
        command=wire.Command(body=body, signature=signature, signer_chain=[pki.worker_der], attempt=1)
    )


class _Watch(list[wire.NodeMessage]):
    """The session's sent messages, with a wait for a command's terminal update."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = trio.Event()

    def append(self, message: wire.NodeMessage) -> None:
        super().append(message)
        self._changed.set()
        self._changed = trio.Event()

    async def settled(
        self,
        command_id: str,
        terminal: frozenset[wire.CommandState] = frozenset(
            {wire.CommandState.SUCCEEDED, wire.CommandState.FAILED, wire.CommandState.REJECTED}
        ),
    ) -> None:
        with trio.fail_after(30):  # a hang guard, not a timing assertion
            while not any(
                m.command_update is not None
                and m.command_update.command_id == command_id
                and m.command_update.state in terminal
                for m in self
            ):
                await self._changed.wait()

    async def succeeded(self, command_id: str) -> None:
        await self.settled(command_id, frozenset({wire.CommandState.SUCCEEDED}))


async def test_DLV_REC_13_sweep_keeps_a_done_entry_while_its_signed_body_could_still_be_replayed(
    tmp_path: Path,
) -> None:
    """A gateway keeps a validly signed command whose not_after is weeks away, lets it run and acks it,
    and replays the same bytes once the 7-day sweep has run. Before the fix the sweep had deleted the
    entry, so the replay ran a second time (two effects); now an entry stays until its not_after is behind
    anything a Welcome may set (the server time mark less 5 minutes), and the replay gets the stored
    result. A command refused on arrival (no body kept) is still swept after 7 days."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        command = _signed(pki, 1, int(time.time() * 1000) + 20 * 86400 * 1000)
        core.handle_batch([command])
        await out.settled(_ulid(1))
        core.handle_batch([_forged(NODE, 2)])  # refused BAD_SIGNATURE
        core.handle(wire.GatewayMessage(ack=wire.Ack(command_ids=[_ulid(1), _ulid(2)])))
        core.journal.flush_acks()
        assert core.journal.sweep(now=time.time() + 8 * 86400) == 1  # only the refusal
        assert core.journal.get_command(_ulid(2)) is None
        out.clear()
        core.handle_batch([command])  # the replay
        await out.settled(_ulid(1))
        effects = (data / "test-effects.log").read_text().splitlines()
        assert len(effects) == 1, effects


def _mutations(signed: wire.Command) -> dict[str, wire.Command]:
    """What a gateway without the key can make of a signed command it relays (same id throughout)."""
    body = bytes(signed.body)
    parsed = wire.CommandBody.parse(body)
    later = wire.CommandBody.parse(body)
    later.not_after += 3600_000
    other_node = wire.CommandBody.parse(body)
    other_node.node_id = "node-2"
    # The same fields, not_after written first: equal in meaning, other bytes.
    rest = wire.CommandBody.parse(body)
    rest.not_after = 0
    reordered = bytes(wire.CommandBody(not_after=parsed.not_after)) + bytes(rest)

    def with_body(b: bytes) -> wire.Command:
        return wire.Command(body=b, signature=signed.signature, signer_chain=signed.signer_chain, attempt=2)

    return {
        "trailing-byte": with_body(body + b"\x00"),
        "reordered": with_body(reordered),
        "later-not-after": with_body(bytes(later)),
        "other-node": with_body(bytes(other_node)),
        "no-signature": wire.Command(body=body, attempt=2),
    }


@pytest.mark.parametrize(
    ("mutation", "reason"),
    [
        ("trailing-byte", None),  # no readable id: dropped, nothing journaled
        ("reordered", "BAD_SIGNATURE"),  # verified over the exact bytes, never re-encoded
        ("later-not-after", "BAD_SIGNATURE"),
        ("other-node", "UNSUPPORTED"),
        ("no-signature", "BAD_SIGNATURE"),
    ],
)
async def test_what_a_gateway_makes_of_a_signed_command_never_runs(
    tmp_path: Path, mutation: str, reason: str | None
) -> None:
    """Held in round 1: each mutation of a validly signed command is refused with its reason and has no
    effect. Round 2: delivered first under the real id, the refusal no longer answers the real command
    (it answers only the mutated envelope, nobody signed it): the real command runs once
    (test_hostile_gateway2.py has the detail)."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        good = _signed(pki, 7, int(time.time() * 1000) + 600_000)
        assert good.command is not None
        core.handle_batch([wire.GatewayMessage(command=_mutations(good.command)[mutation])])
        refused = [m.command_update for m in out if m.command_update is not None]
        assert [u.reason for u in refused] == ([reason] if reason else [])
        assert not (data / "test-effects.log").exists()
        core.handle_batch([good])
        await out.succeeded(_ulid(7))
        assert len((data / "test-effects.log").read_text().splitlines()) == 1


async def test_a_replay_reads_a_bounded_number_of_results_from_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hello, the results after the Welcome and the 10 s replay read at most REPLAY_MAX_ROWS (lowered
    here) of the oldest unacked results from the journal: before the fix each read every row a flood of
    refusals left (all of them into memory, every 10 s), however little of it could be sent."""
    import bcd_agent.session.core as coremod

    monkeypatch.setattr(coremod, "REPLAY_MAX_ROWS", 50, raising=False)
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out: list[wire.NodeMessage] = []
        connect(core, out, bundle=pki.bundle())
        core.handle_batch([_forged(NODE, i) for i in range(200)])
        core.detach()
        read: list[int] = []
        unacked = core.journal.unacked_results

        def counting(limit: int | None = None) -> object:
            rows = unacked() if limit is None else unacked(limit=limit)
            read.append(len(rows))
            return rows

        monkeypatch.setattr(core.journal, "unacked_results", counting)
        out = []
        hello = core.attach(out.append).hello
        assert hello is not None and len(hello.unacked_results) == 50
        core.handle(welcome(bundle=pki.bundle()))
        assert read and max(read) <= 50
        after = {m.command_update.command_id for m in out if m.command_update is not None}
        assert after == {_ulid(i) for i in range(50)}  # the oldest, again after the Welcome
        core.handle(wire.GatewayMessage(ack=wire.Ack(command_ids=sorted(after))))
        core.journal.flush_acks()
        out.clear()
        core.detach()
        hello = core.attach(out.append).hello
        assert hello is not None  # the acks let the next ones through, oldest first
        assert {u.command_id for u in hello.unacked_results} == {_ulid(i) for i in range(50, 100)}


@pytest.mark.parametrize(
    ("upgrade_only", "ahead_ms", "reason"),
    [(True, 0, "UNSUPPORTED"), (False, 2 * 3600_000, "EXPIRED")],
)
async def test_a_welcome_the_gateway_controls_can_refuse_but_never_run_a_command(
    tmp_path: Path, upgrade_only: bool, ahead_ms: int, reason: str
) -> None:
    """Held in round 1: `upgrade_only`, or a server_time past the command's not_after, makes the node
    refuse a validly signed command (journaled: the id pre-emption of the table), never run it."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        core.attach(out.append)
        now_ms = int(time.time() * 1000)
        core.handle(
            wire.GatewayMessage(
                welcome=wire.Welcome(
                    server_time=now_ms + ahead_ms, trust_bundle=pki.bundle(), upgrade_only=upgrade_only
                )
            )
        )
        core.handle_batch([_signed(pki, 3, now_ms + 600_000)])
        await out.settled(_ulid(3))
        refused = [m.command_update for m in out if m.command_update is not None]
        assert [(u.state, u.reason) for u in refused] == [(wire.CommandState.REJECTED, reason)]
        assert not (data / "test-effects.log").exists()


def _core_on(tmp_path: Path, pki: Pki, host: list[float]) -> tuple[SessionCore, Clock]:
    """A core whose host clock reads host[0] (the monotonic clock is the returned one)."""
    mono = Clock()
    rec = Recorder()
    core = SessionCore(
        journal=Journal.open(tmp_path / "data", boot_id="boot-1"),
        dispatcher=rec,
        runner=rec,
        trust=BundleTrust(),
        clock=OffsetClock(host_time=lambda: host[0]),
        identity=pki.identity(),
        data_dir=tmp_path / "data",
        monotonic=mono,
        persist_identity=False,
    )
    return core, mono


def _heartbeat(server_ms: int) -> wire.GatewayMessage:
    return wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=server_ms))


def test_the_mark_leads_the_host_clock_by_at_most_240_s_and_a_larger_lead_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Welcome or heartbeat ahead of the host clock moves the mark to exactly the host clock + 240 s
    (written out here), and a warning names the server time, its lead and the bound; a server time at
    the bound itself is taken whole and logs nothing. The bound follows the host clock."""
    host = [1_800_000_000.0]
    start = host[0]
    core, mono = _core_on(tmp_path, Pki(), host)
    caplog.set_level(logging.WARNING, logger="bcd_agent.session.core")
    core.attach([].append)
    core.handle(welcome(int((start + 1000) * 1000)))
    assert core.state.welcomed
    assert core.journal.server_time_mark == start + 240.0
    assert [r.getMessage() for r in caplog.records] == [
        "session: server_time 1800001000000 ms leads the host clock by 1000 s (more than 240 s): the server"
        " time mark moves only to the host clock + 240 s"
    ]
    caplog.clear()
    mono.t += 61  # past the repeat log's interval: a new lead would be logged
    host[0] = start + 10
    core.handle(_heartbeat(int((start + 250) * 1000)))  # exactly the bound: taken, not logged
    assert core.journal.server_time_mark == start + 250.0
    assert caplog.records == []
    host[0] = start + 20
    core.handle(_heartbeat(int((start + 260) * 1000) + 1))  # a millisecond past it
    assert core.journal.server_time_mark == start + 260.0
    assert [r.getMessage() for r in caplog.records] == [
        "session: server_time 1800000260001 ms leads the host clock by 240 s (more than 240 s): the server"
        " time mark moves only to the host clock + 240 s"
    ]
    core.journal.close()


def _results_in(out: list[wire.NodeMessage]) -> list[str]:
    return [m.command_update.command_id for m in out if m.command_update is not None]


def test_hello_carries_results_up_to_exactly_its_byte_cap_the_rest_after_the_welcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each result counts its encoded size and 8 bytes of field framing against HELLO_RESULTS_MAX_BYTES:
    results that fill it exactly all ride in Hello (and none is sent again after the Welcome); a byte
    less and the last one follows the Welcome with the rest, oldest first."""
    import bcd_agent.session.core as coremod

    core, _out, _rec, _mono = make(tmp_path, Pki())
    ids = [_ulid(i) for i in range(4)]
    for cid in ids:
        _done_command(core.journal, cid)
    hello = core.attach([].append).hello
    assert hello is not None and [u.command_id for u in hello.unacked_results] == ids
    sizes = [len(bytes(u)) + 8 for u in hello.unacked_results]
    core.detach()
    for cap, carried in ((sum(sizes), ids), (sum(sizes[:2]), ids[:2]), (sum(sizes[:2]) - 1, ids[:1])):
        monkeypatch.setattr(coremod, "HELLO_RESULTS_MAX_BYTES", cap)
        out: list[wire.NodeMessage] = []
        hello = core.attach(out.append).hello
        assert hello is not None and [u.command_id for u in hello.unacked_results] == carried, cap
        core.handle(welcome())
        assert _results_in(out) == ([] if carried == ids else ids), cap
        core.detach()
    core.journal.close()


def test_a_replay_reads_at_most_replay_max_rows_results_the_rest_once_those_are_acked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hello and every replay read at most REPLAY_MAX_ROWS (lowered here) of the oldest unacked results.
    A Hello that read the limit may have left some behind, so the replay after the Welcome runs; one that
    read fewer has them all and nothing follows. The ones behind go out once the first are acked."""
    import bcd_agent.session.core as coremod

    core, _out, _rec, mono = make(tmp_path, Pki())
    ids = [_ulid(i) for i in range(4)]
    for cid in ids:
        _done_command(core.journal, cid)
    monkeypatch.setattr(coremod, "REPLAY_MAX_ROWS", 5)
    out: list[wire.NodeMessage] = []
    hello = connect(core, out)
    assert [u.command_id for u in hello.unacked_results] == ids
    assert _results_in(out) == []  # fewer than the limit read: Hello had them all
    core.detach()
    monkeypatch.setattr(coremod, "REPLAY_MAX_ROWS", 3)
    out = []
    hello = connect(core, out)
    assert [u.command_id for u in hello.unacked_results] == ids[:3]
    assert _results_in(out) == ids[:3]  # the limit read: the replay after the Welcome, at most 3 again
    core.handle(wire.GatewayMessage(ack=wire.Ack(command_ids=ids[:3])))
    out.clear()
    mono.t += 11
    assert core.resend_due()
    assert _results_in(out) == ids[3:]
    core.journal.close()
