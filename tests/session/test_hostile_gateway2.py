"""Hostile gateway, round 2 (docs/session.md): a compromised gateway holds the TLS session but no signing
key. As in round 1 each test drives the real SessionCore, Dispatcher and journal in process with what
such a gateway can send; here: forged bodies under a signed command's id, refusals and cancels it never
acks, bodies it parks and cancels, a signed command it gets refused and replays after the sweep, and
older signed specs it kept, after the journal is lost."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from bcd_agent.dispatch.dispatcher import Dispatcher
from bcd_agent.dispatch.trust import NodeResultSigner
from bcd_agent.kinds.testing import effect_payload
from bcd_agent.session import identity as ident
from bcd_agent.session.core import SessionCore
from bcd_shared import wire
from bcd_shared.pki.signing import Purpose
from session.test_hostile_gateway import _forged, _journal_bytes, _mutations, _node, _signed, _ulid, _Watch
from session.test_session_core import NODE, Pki, _persisting, connect, spec_requests

MINUTE_MS = 60_000
DAY_MS = 86400 * 1000


def _now_ms() -> int:
    return int(time.time() * 1000)


def _states(out: list[wire.NodeMessage], command_id: str) -> list[tuple[wire.CommandState, str]]:
    return [
        (m.command_update.state, m.command_update.reason)
        for m in out
        if m.command_update is not None and m.command_update.command_id == command_id
    ]


def _effects(data: Path) -> list[str]:
    log = data / "test-effects.log"
    return log.read_text().splitlines() if log.exists() else []


def _signed_kind(pki: Pki, n: int, kind: str) -> wire.Command:
    type_url, value = effect_payload("signed")
    body = bytes(
        wire.CommandBody(
            id=_ulid(n),
            node_id=NODE,
            seq=n,
            kind=kind,
            payload=wire.ProtoAny(type_url=type_url, value=value),
            lane=wire.Lane.CONTROL,
            not_after=_now_ms() + 10 * MINUTE_MS,
        )
    )
    return wire.Command(
        body=body, signature=pki.worker.sign(Purpose.COMMAND, body), signer_chain=[pki.worker_der], attempt=1
    )


def _dispatcher(core: SessionCore) -> Dispatcher:
    dispatcher = core.dispatcher
    assert isinstance(dispatcher, Dispatcher)
    return dispatcher


def _forge(signed: wire.Command, **fields: object) -> wire.Command:
    """The signed command's body with `fields` changed, under the old signature (the gateway has no key)."""
    body = wire.CommandBody.parse(bytes(signed.body))
    for name, value in fields.items():
        setattr(body, name, value)
    return wire.Command(body=bytes(body), signature=signed.signature, signer_chain=signed.signer_chain)


@pytest.mark.parametrize(
    ("forgery", "reason"),
    [
        ("no-signature", "BAD_SIGNATURE"),  # the signed body itself, signature stripped
        ("later-not-after", "BAD_SIGNATURE"),
        ("reordered", "BAD_SIGNATURE"),
        ("other-node", "UNSUPPORTED"),  # refused before the signature is judged (check 1)
        ("expired", "EXPIRED"),  # refused before the signature is judged (check 3)
        ("stale", "STALE_GENERATION"),  # a min_generation no spec reached, at its not_after
    ],
)
async def test_a_forged_body_under_a_signed_commands_id_cannot_make_the_node_refuse_the_signed_one(
    tmp_path: Path, forgery: str, reason: str
) -> None:
    """A gateway sends a body of its own making under a signed command's id first. Before the fix the
    journaled refusal bound the id: the signed command that followed was answered as a
    duplicate with the forged body's refusal and never ran, also later through an honest gateway. A refusal
    of an envelope whose signature does not verify now answers that envelope alone: the same bytes again
    get the same answer (DLV-ACK-17), and the signed command under the id is judged on its own and runs;
    after that, the forged bytes get the signed command's stored result."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        good = _signed(pki, 7, _now_ms() + 10 * MINUTE_MS)
        assert good.command is not None
        if forgery == "expired":
            forged = _forge(good.command, not_after=_now_ms() - MINUTE_MS)
        elif forgery == "stale":
            forged = _forge(good.command, not_after=_now_ms() - MINUTE_MS, min_generation=99)
        else:
            forged = _mutations(good.command)[forgery]
        core.handle_batch([wire.GatewayMessage(command=forged)])
        assert _states(out, _ulid(7)) == [(wire.CommandState.REJECTED, reason)]
        core.handle_batch([wire.GatewayMessage(command=forged)])  # the same bytes: the same answer
        assert _states(out, _ulid(7)) == [(wire.CommandState.REJECTED, reason)] * 2
        # Another forged envelope under the id is judged afresh, refused, and answered with the stored
        # refusal (one row, one refusal counted in the node's metrics).
        other = wire.Command(
            body=bytes(forged.body), signature=b"\x00" * 64, signer_chain=forged.signer_chain
        )
        core.handle_batch([wire.GatewayMessage(command=other)])
        assert _states(out, _ulid(7)) == [(wire.CommandState.REJECTED, reason)] * 3
        assert len(core.journal.unacked_results()) == 1
        dispatcher = _dispatcher(core)
        assert (
            sum(n for (_, outcome), n in dispatcher.outcomes.snapshot().items() if outcome == "rejected") == 1
        )
        core.handle_batch([good])
        await out.succeeded(_ulid(7))
        assert len(_effects(data)) == 1
        out.clear()
        core.handle_batch([wire.GatewayMessage(command=forged)])
        assert _states(out, _ulid(7)) == [(wire.CommandState.SUCCEEDED, "")]
        assert len(_effects(data)) == 1


async def test_a_forged_refusal_is_not_node_signed_and_gives_way_to_the_signed_commands_result(
    tmp_path: Path,
) -> None:
    """For an attested kind the node signs its results (DLV-SIG-17). Before the fix a forged body under a
    signed command's id got a node-signed REJECTED for that id, a statement about the signed command the
    gateway could hand to the control plane. Now the refusal of a body nobody signed carries no node
    signature (the kind it names is the body's unverified claim), and the signed command's own result,
    node-signed, is what the journal keeps and replays."""
    pki = Pki()
    data = tmp_path / "data"
    signer = NodeResultSigner(pki.node_key, NODE)
    async with _node(data, pki, signer=signer) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        good = _signed_kind(pki, 9, "test.attested")
        core.handle_batch([wire.GatewayMessage(command=_forge(good, not_after=_now_ms() + DAY_MS))])
        refused = [m.command_update for m in out if m.command_update is not None]
        assert [(u.state, u.reason, u.node_sig) for u in refused] == [
            (wire.CommandState.REJECTED, "BAD_SIGNATURE", b"")
        ]
        core.handle_batch([wire.GatewayMessage(command=good)])
        await out.succeeded(_ulid(9))
        [stored] = core.journal.unacked_results()
        assert stored.id == _ulid(9) and stored.result is not None
        assert stored.result.outcome.value == "succeeded" and stored.result.node_sig


async def test_a_forged_deferred_body_does_not_hold_a_signed_commands_id(tmp_path: Path) -> None:
    """A deferral is judged before the signature (Q-DLV-ACK-01). Before the fix a forged body under a signed
    command's id, with a min_generation no spec reaches and a not_after a year away, sat deferred and
    every delivery of the signed command under that id was ignored as "still waiting". Another envelope
    under a deferred id whose own signature does not verify now replaces it."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        good = _signed(pki, 5, _now_ms() + 10 * MINUTE_MS)
        assert good.command is not None
        parked = _forge(good.command, min_generation=99, not_after=_now_ms() + 365 * DAY_MS)
        core.handle_batch([wire.GatewayMessage(command=parked)])
        assert _states(out, _ulid(5)) == []  # deferred: no answer yet
        assert _dispatcher(core).deferred_ids() == (_ulid(5),)
        core.handle_batch([good])
        assert _states(out, _ulid(5))[:1] == [(wire.CommandState.ACKED, "")]
        await out.succeeded(_ulid(5))
        assert len(_effects(data)) == 1
        # the forged body the signed command replaced is dropped, not kept beside it (mutation session 26)
        assert _dispatcher(core).deferred_ids() == ()


async def test_a_signed_command_refused_on_a_gateways_welcome_is_never_run_by_a_replay_after_the_sweep(
    tmp_path: Path,
) -> None:
    """A gateway's Welcome says upgrade_only, so a signed command with a not_after weeks away is refused
    UNSUPPORTED, reported and acked. Before the fix the refusal kept no body and the 7-day sweep deleted it,
    so the same signed bytes replayed under an ordinary Welcome ran, after the control plane had recorded
    the command rejected. A refusal of a command whose signature verifies keeps its body as an accepted
    command's entry does, and the sweep keeps it while that body could still pass the EXPIRED check."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        core.attach(out.append)
        core.handle(
            wire.GatewayMessage(
                welcome=wire.Welcome(server_time=_now_ms(), trust_bundle=pki.bundle(), upgrade_only=True)
            )
        )
        command = _signed(pki, 3, _now_ms() + 20 * DAY_MS)
        core.handle_batch([command])
        assert _states(out, _ulid(3)) == [(wire.CommandState.REJECTED, "UNSUPPORTED")]
        core.handle(wire.GatewayMessage(ack=wire.Ack(command_ids=[_ulid(3)])))
        core.journal.flush_acks()
        core.journal.sweep(now=time.time() + 8 * 86400)
        core.detach()
        out = _Watch()
        connect(core, out, bundle=pki.bundle())  # an ordinary Welcome
        core.handle_batch([command])  # the replay
        assert _states(out, _ulid(3)) == [(wire.CommandState.REJECTED, "UNSUPPORTED")]
        assert _effects(data) == []


async def test_refusals_a_gateway_never_acks_are_bounded_then_answered_busy_and_none_is_lost(
    tmp_path: Path,
) -> None:
    """Each refused command is journaled (DLV-ACK-17) and replayed until acked; before the fix a gateway
    that never acks grew the journal by a row per forged command, without bound. Rows on the gateway's
    word alone are now bounded (`max_refused`, lowered here): past it, the oldest acked ones go, and with
    none acked a new refusal is answered BUSY and not journaled (DLV-ACK-15), so no
    unacked result is ever lost. A signed command is still accepted and run meanwhile, and the count
    holds across a restart."""
    cap = 40
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki, max_refused=cap) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        core.handle_batch([_forged(NODE, i) for i in range(cap + 10)])
        answers = [_states(out, _ulid(i)) for i in range(cap + 10)]
        assert answers[:cap] == [[(wire.CommandState.REJECTED, "BAD_SIGNATURE")]] * cap
        assert answers[cap:] == [[(wire.CommandState.BUSY, "BUSY")]] * 10
        assert all(core.journal.get_command(_ulid(i)) is None for i in range(cap, cap + 10))
        assert {e.id for e in core.journal.unacked_results()} == {_ulid(i) for i in range(cap)}
        good = _signed(pki, 1000, _now_ms() + 10 * MINUTE_MS)
        core.handle_batch([good])
        await out.succeeded(_ulid(1000))
        # The gateway acks the first half: as many new refusals are journaled, the oldest acked ones go.
        core.handle(wire.GatewayMessage(ack=wire.Ack(command_ids=[_ulid(i) for i in range(cap // 2)])))
        out.clear()
        core.handle_batch([_forged(NODE, i) for i in range(2000, 2000 + cap // 2)])
        assert {s for i in range(2000, 2000 + cap // 2) for s in _states(out, _ulid(i))} == {
            (wire.CommandState.REJECTED, "BAD_SIGNATURE")
        }
        assert core.journal.refused_rows == cap
        unacked = {e.id for e in core.journal.unacked_results()}
        assert unacked >= {_ulid(i) for i in range(cap // 2, cap)}  # none unacked lost
    async with _node(data, pki, max_refused=cap) as core:
        assert core.journal.refused_rows == cap
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        core.handle_batch([_forged(NODE, 3000)])
        assert _states(out, _ulid(3000)) == [(wire.CommandState.BUSY, "BUSY")]


async def test_cancels_of_ids_never_seen_are_bounded_and_none_unacked_is_lost(tmp_path: Path) -> None:
    """A Cancel of a command never seen is journaled CANCELLED at once (docs/dispatch.md), one row per id the
    gateway makes up; before the fix without bound. They count with the refusals: past the bound with none
    acked a Cancel is not journaled (the gateway repeats it after a reconnect)."""
    cap = 30
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki, max_refused=cap) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        core.handle_batch(
            [
                wire.GatewayMessage(cancel=wire.Cancel(command_id=_ulid(i), reason="x"))
                for i in range(cap + 25)
            ]
        )
        journaled = [i for i in range(cap + 25) if core.journal.get_command(_ulid(i)) is not None]
        assert journaled == list(range(cap))
        assert {e.id for e in core.journal.unacked_results()} == {_ulid(i) for i in range(cap)}
        assert core.journal.refused_rows == cap


async def test_a_cancelled_deferred_body_is_not_kept_so_parked_bodies_cannot_fill_the_data_dir(
    tmp_path: Path,
) -> None:
    """Round 1 kept refused bodies out of the journal; a body deferred (judged before its signature) and
    then cancelled was still journaled whole with its CANCELLED row: a gateway could park bodies near the
    4 MiB message cap and cancel each, 4 MiB of disk per pair. A command that never ran keeps no body."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        before = _journal_bytes(data)
        core.handle_batch([_forged(NODE, i, pad=256 * 1024, min_generation=99) for i in range(20)])
        core.handle_batch(
            [wire.GatewayMessage(cancel=wire.Cancel(command_id=_ulid(i), reason="x")) for i in range(20)]
        )
        assert {s for i in range(20) for s in _states(out, _ulid(i))} == {(wire.CommandState.CANCELLED, "x")}
        assert _journal_bytes(data) - before < 1024 * 1024  # 20 bodies would be 5 MiB
        entry = core.journal.get_command(_ulid(0))
        assert entry is not None and entry.body == b""


def test_a_lost_journal_does_not_let_a_gateway_roll_the_spec_back_to_an_older_signed_generation(
    tmp_path: Path,
) -> None:
    """A gateway keeps every signed spec it relayed. The journal holds the applied generation, and an older
    one is ignored (DLV-RCV-14); but once the journal is lost (moved aside: a new one asks NO_SPEC), before
    the fix any older signed generation was taken, so the gateway could roll the node back, e.g. to an
    access section that still trusted a revoked CA, for as long as the old worker certificate is valid.
    The applied generation is mirrored into identity.json, as the server time mark is, and a generation
    below it is ignored after a lost journal too; the current generation itself is taken again."""
    pki = Pki()
    data = tmp_path / "data"
    core = _persisting(data, pki)
    connect(core, [], bundle=pki.bundle())
    old, current = pki.spec(5), pki.spec(9)
    core.handle(wire.GatewayMessage(desired_state=old))
    core.handle(wire.GatewayMessage(desired_state=current))
    assert core.journal.applied_generation == 9
    core.journal.close()
    for f in data.glob("journal.db*"):
        f.unlink()  # lost (as after a move aside): a new journal, no spec
    again = _persisting(data, pki, identity=ident.load(data))
    out: list[wire.NodeMessage] = []
    connect(again, out, bundle=pki.bundle())
    assert spec_requests(out) == [(0, wire.SpecRequestReason.NO_SPEC)]
    again.handle(wire.GatewayMessage(desired_state=old))
    assert again.journal.applied_generation == 0
    again.handle(wire.GatewayMessage(desired_state=current))
    assert again.journal.applied_generation == 9
    again.journal.close()


def test_an_ack_above_every_event_seq_the_node_sent_does_not_restart_its_journal(tmp_path: Path) -> None:
    """An Ack of an event seq above anything the journal issued is how a lost journal tail shows at run
    time: the journal restarts its events under a new journal_id, and the next gateway fails the node's
    non-retry-safe in-flight commands `journal-lost`. Before the fix a gateway could send that Ack at will
    and get both. The event mark (written before any seq leaves) covers every seq this node sent; an Ack
    above it is refused as a protocol violation (the connection ends) and the journal_id stays. Without a
    mark for the journal (it was lost too) the Ack is still believed (test_session_backlog.py)."""
    from bcd_agent.journal import EventClass
    from bcd_agent.session.core import ProtocolViolation

    pki = Pki()
    data = tmp_path / "data"
    core = _persisting(data, pki)
    for i in range(3):
        core.journal.append_event(EventClass.RESULT, "allocation.bound", b"e%d" % i)
    out: list[wire.NodeMessage] = []
    connect(core, out, bundle=pki.bundle())
    sent = [e.seq for m in out if m.event_batch is not None for e in m.event_batch.events]
    assert sent == [1, 2, 3]
    journal_id = core.journal.journal_id
    with pytest.raises(ProtocolViolation, match="above the highest this node sent"):
        core.handle(wire.GatewayMessage(ack=wire.Ack(journal_id=journal_id, event_seq=1000)))
    assert core.journal.journal_id == journal_id and core.state.journal_restarts == 0
    core.journal.close()
    again = _persisting(data, pki, identity=ident.load(data))  # after a restart, from the mark file
    connect(again, [], bundle=pki.bundle())
    with pytest.raises(ProtocolViolation):
        again.handle(wire.GatewayMessage(ack=wire.Ack(journal_id=journal_id, event_seq=4)))
    assert again.journal.journal_id == journal_id
    again.journal.close()


@pytest.mark.parametrize("marked", [4, 10])
def test_after_the_journal_restarts_its_events_an_ack_above_every_seq_sent_under_the_new_id_is_refused(
    tmp_path: Path, marked: int
) -> None:
    """A restart of the journal's events (here at start: the mark names seq 4 or 10, the journal holds 3)
    starts the new journal_id with nothing sent under it, so the mark covers it at once: an Ack above
    the seqs then sent under the new id (its 3 events) is a protocol violation, not a second lost tail
    (round 2)."""
    import json

    from bcd_agent.journal import EventClass
    from bcd_agent.session.conditions import JOURNAL_TAIL_LOST
    from bcd_agent.session.core import ProtocolViolation

    pki = Pki()
    data = tmp_path / "data"
    core = _persisting(data, pki)
    for i in range(3):
        core.journal.append_event(EventClass.RESULT, "allocation.bound", b"e%d" % i)
    connect(core, [], bundle=pki.bundle())
    old = core.journal.journal_id
    core.journal.close()
    (data / "event-mark.json").write_text(json.dumps({"journal_id": old, "sent_seq": marked}))
    again = _persisting(data, pki, identity=ident.load(data))
    new = again.journal.journal_id
    assert new != old and again.state.journal_restarts == 1
    [lost] = [c for c in again.conditions.active() if c.type == JOURNAL_TAIL_LOST]
    assert lost.reason == "EventSeqAhead" and lost.message.startswith(f"event seq {marked} of journal ")
    connect(again, [], bundle=pki.bundle())
    with pytest.raises(ProtocolViolation) as exc:
        again.handle(wire.GatewayMessage(ack=wire.Ack(journal_id=new, event_seq=1000)))
    assert str(exc.value) == (
        f"the gateway acked event seq 1000 of journal {new}, above the highest this node sent (3):"
        " ignored, the connection ends"
    )
    assert again.journal.journal_id == new and again.state.journal_restarts == 1
    again.journal.close()


async def test_without_command_roots_another_body_under_a_deferred_id_waits_behind_it(tmp_path: Path) -> None:
    """Without command-signing roots nothing is signed, so no deferred body is a forgery: another envelope
    under a deferred command's id is ignored as "still waiting", never run in its place (mutation session
    26)."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        connect(core, out)
        good = _signed(pki, 5, _now_ms() + 10 * MINUTE_MS)
        assert good.command is not None
        parked = _forge(good.command, min_generation=99, not_after=_now_ms() + 365 * DAY_MS)
        core.handle_batch([wire.GatewayMessage(command=parked)])
        core.handle_batch([good])
        assert _states(out, _ulid(5)) == []
        dispatcher = _dispatcher(core)
        assert dispatcher.deferred_ids() == (_ulid(5),)
        assert _effects(data) == []


@pytest.mark.parametrize("via", ["session", "dispatcher"])
async def test_a_body_that_fails_the_wire_edge_under_a_signed_commands_id_answers_that_envelope_alone(
    tmp_path: Path, via: str
) -> None:
    """A gateway sends a body that fails the wire edge's rules (an empty kind) under a signed command's id:
    UNSUPPORTED, journaled for those bytes, so the same bytes again get the same answer, but the signed
    command under the id is judged on its own and runs (nothing verified the refused body; mutation
    session 26)."""
    pki = Pki()
    data = tmp_path / "data"
    async with _node(data, pki) as core:
        out = _Watch()
        connect(core, out, bundle=pki.bundle())
        good = _signed(pki, 6, _now_ms() + 10 * MINUTE_MS)
        assert good.command is not None
        bad = _forge(good.command, kind="")
        dispatcher = _dispatcher(core)
        deliver = {"session": lambda: core.handle_batch([wire.GatewayMessage(command=bad)])}
        deliver["dispatcher"] = lambda: dispatcher.deliver_wire(bad)  # Dispatcher.refuse_invalid's path
        deliver[via]()
        assert _states(out, _ulid(6)) == [(wire.CommandState.REJECTED, "UNSUPPORTED")]
        deliver[via]()
        assert _states(out, _ulid(6)) == [(wire.CommandState.REJECTED, "UNSUPPORTED")] * 2
        [refusal] = core.journal.unacked_results()
        assert refusal.envelope_sha256  # bound to these bytes alone
        core.handle_batch([good])
        await out.succeeded(_ulid(6))
        assert len(_effects(data)) == 1
