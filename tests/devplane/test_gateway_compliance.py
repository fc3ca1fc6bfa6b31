"""The gateway rules the development control plane mimics ([gateway] items of seeds/delivery.md)."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import trio
import trio.testing
from bcd_agent.devplane.plane import LANE_CREDITS, DevPlane, GatewaySession
from bcd_agent.dispatch.kinds import Lane, timeout_for
from bcd_shared import wire
from bcd_shared.pki import KeyPair
from bcd_shared.pki.signing import Purpose, verify_signature


def _joined(plane: DevPlane) -> str:
    response = plane.join(
        wire.JoinRequest(
            token=plane.issue_token(), node_public_key=KeyPair.generate().public_key, hostname="h"
        )
    )
    body = wire.JoinResponseBody.parse(response.body)
    assert body.trust_bundle is not None  # the trust bundle travels in JoinResponse (DLV-SIG-02)
    return body.node_id


def _drain(receive: trio.MemoryReceiveChannel[wire.GatewayMessage]) -> list[wire.GatewayMessage]:
    got: list[wire.GatewayMessage] = []
    while True:
        try:
            got.append(receive.receive_nowait())
        except trio.WouldBlock:
            return got


def _session(
    plane: DevPlane, node: str, *, applied: int = 0, journal_id: str = "j1"
) -> tuple[GatewaySession, trio.MemoryReceiveChannel[wire.GatewayMessage], list[wire.GatewayMessage]]:
    send, receive = trio.open_memory_channel[wire.GatewayMessage](math.inf)
    hello = wire.Hello(node_id=node, journal_id=journal_id, boot_id="b", applied_generation=applied)
    session = plane.open_session(hello, send)
    return session, receive, _drain(receive)


def _commands(got: list[wire.GatewayMessage]) -> list[wire.CommandBody]:
    return [wire.CommandBody.parse(m.command.body) for m in got if m.command is not None]


def _specs(got: list[wire.GatewayMessage]) -> list[wire.DesiredState]:
    return [m.desired_state for m in got if m.desired_state is not None]


def _plane(tmp_path: Path) -> tuple[DevPlane, str]:
    plane = DevPlane(tmp_path / "dp", listen=None)
    return plane, _joined(plane)


def test_DLV_GEN_01_SPEC_12_generation_is_the_planes_and_moves_only_on_a_changed_spec(tmp_path: Path) -> None:
    """Covers DLV-GEN-01, DLV-SPEC-12."""
    plane, node = _plane(tmp_path)
    assert (
        plane.apply_spec(node, {"telemetry": {"otlpEndpoint": "https://o", "headersSecretRef": "secret://h"}})
        == 1
    )
    # The same spec with its keys in another order: canonical JSON equal, no new generation.
    assert (
        plane.apply_spec(node, {"telemetry": {"headersSecretRef": "secret://h", "otlpEndpoint": "https://o"}})
        == 1
    )
    assert plane.apply_spec(node, {"telemetry": {"otlpEndpoint": "https://p"}}) == 2
    session, _r, _ = _session(plane, node, applied=2)
    plane.on_status(session, wire.StatusReport(applied_generation=9, observed_generation=9))
    assert (plane.node(node) or {})["generation"] == 2  # a node's report never writes the generation


def test_DLV_GEN_04_observed_generation_never_moves_backwards_across_sessions(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    for n in range(3):
        plane.apply_spec(node, {"telemetry": {"otlpEndpoint": f"https://o{n}"}})
    old, _r1, _ = _session(plane, node)
    new, _r2, _ = _session(plane, node)
    plane.on_status(new, wire.StatusReport(applied_generation=3, observed_generation=3))
    plane.on_status(old, wire.StatusReport(applied_generation=2, observed_generation=2))  # late, old session
    assert (plane.node(node) or {})["observed_generation"] == 3


def test_DLV_SPEC_13_no_desired_state_for_a_node_not_adopted(tmp_path: Path) -> None:
    """The dev plane adopts a node by its join: a node that has not joined gets no spec and no session."""
    plane, _node = _plane(tmp_path)
    try:
        plane.apply_spec("stranger", {})
    except LookupError:
        pass
    else:
        raise AssertionError("a spec was written for a node that never joined")
    send, _receive = trio.open_memory_channel[wire.GatewayMessage](math.inf)
    try:
        plane.open_session(wire.Hello(node_id="stranger", journal_id="j", boot_id="b"), send)
    except PermissionError:
        pass
    else:
        raise AssertionError("a session opened for a node that never joined")


def test_DLV_RCV_03_backstop_sends_only_to_sessions_behind_held_and_sent(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    session, receive, _ = _session(plane, node)
    plane.store.conn.execute(
        "UPDATE nodes SET generation = 5 WHERE node_id = ?", (node,)
    )  # written without a push (a lost poke); no body stored, so it is rendered (DLV-RCV-18)
    plane.backstop()
    assert len(_specs(_drain(receive))) == 1 and session.sent_generation == 5
    plane.backstop()  # already sent on this session
    assert _specs(_drain(receive)) == []
    session.sent_generation = 0
    session.applied_generation = 5  # the node holds it
    plane.backstop()
    assert _specs(_drain(receive)) == []


def test_DLV_RCV_05_16_17_SIG_14_spec_request_answered_with_the_stored_signed_full_body(
    tmp_path: Path,
) -> None:
    """Covers DLV-RCV-05, DLV-RCV-16, DLV-RCV-17, DLV-SIG-14."""
    plane, node = _plane(tmp_path)
    plane.apply_spec(node, {"telemetry": {"otlpEndpoint": "https://o"}})
    session, receive, got = _session(plane, node, applied=1)
    assert _specs(got) == []  # the node holds generation 1
    plane.on_message(
        session,
        wire.NodeMessage(
            spec_request=wire.SpecRequest(have_generation=1, reason=wire.SpecRequestReason.NO_SPEC)
        ),
    )
    [envelope] = _specs(_drain(receive))
    row = plane.store.one("SELECT spec_body, spec_signature FROM nodes WHERE node_id = ?", node)
    assert envelope.body == bytes(row["spec_body"]) and envelope.signature == bytes(row["spec_signature"])
    verify_signature(
        plane.keys.key("worker").public_key, Purpose.DESIRED_STATE, envelope.body, envelope.signature
    )
    body = wire.DesiredStateBody.parse(envelope.body)
    assert body.full is not None and body.patch is None and body.base_generation == 0
    assert body.generation == 1 and body.node_id == node


def test_DLV_RCV_18_unstored_body_rendered_unsigned_byte_for_byte(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    plane.apply_spec(node, {"telemetry": {"otlpEndpoint": "https://o"}})
    stored = bytes(plane.store.one("SELECT spec_body FROM nodes WHERE node_id = ?", node)["spec_body"])
    plane.store.conn.execute(
        "UPDATE nodes SET spec_body = NULL, spec_signature = NULL WHERE node_id = ?", (node,)
    )
    current = plane.desired_state(node)
    assert current is not None
    generation, envelope = current
    assert generation == 1 and envelope.body == stored and envelope.signature == b""


def test_DLV_DS_03_commands_carry_not_after_and_min_generation(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    plane.enqueue(node, "inventory.refresh", not_after_s=60, min_generation=4)
    _s, _r, got = _session(plane, node)
    [body] = _commands(got)
    assert body.min_generation == 4 and body.not_after > time.time() * 1000


def test_DLV_DSP_01_enqueue_stores_pending_and_pokes(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    assert not plane._poke.is_set()
    cid = plane.enqueue(node, "inventory.refresh")
    assert (plane.command(cid) or {})["state"] == "pending" and plane._poke.is_set()


def test_DLV_DSP_02_window_and_seq_order(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    later = plane.enqueue(node, "inventory.refresh", not_before=time.time() + 3600)
    first = plane.enqueue(node, "inventory.refresh")
    expired = plane.enqueue(node, "inventory.refresh", not_after_s=-1)
    second = plane.enqueue(node, "diag.nvml")
    _s, _r, got = _session(plane, node)
    assert [b.id for b in _commands(got)] == [first, second]
    assert (plane.command(later) or {})["state"] == "pending" and (plane.command(expired) or {})[
        "state"
    ] == "pending"


def test_DLV_DSP_03_dispatched_with_the_current_epoch_only(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    old, _old_receive, _ = _session(plane, node)
    new, new_receive, _ = _session(plane, node)
    cid = plane.enqueue(node, "inventory.refresh")
    assert plane.dispatch(old) == 0 and (plane.command(cid) or {})["state"] == "pending"
    assert plane.dispatch(new) == 1
    record = plane.command(cid) or {}
    assert record["state"] == "dispatched" and record["dispatched_epoch"] == new.epoch != old.epoch
    assert [b.id for b in _commands(_drain(new_receive))] == [cid]


def test_DLV_DSP_04_LANE_04_credits_and_order_within_a_lane(tmp_path: Path) -> None:
    """Covers DLV-DSP-04, DLV-LANE-04."""
    assert LANE_CREDITS == {Lane.CONTROL: 8, Lane.PROVISION: 4, Lane.BULK: 2}
    plane, node = _plane(tmp_path)
    kinds = {Lane.CONTROL: "inventory.refresh", Lane.PROVISION: "diag.dcgm", Lane.BULK: "logs.collect"}
    ids = {
        lane: [plane.enqueue(node, kind) for _ in range(LANE_CREDITS[lane] + 1)]
        for lane, kind in kinds.items()
    }
    session, receive, got = _session(plane, node)
    sent = [b.id for b in _commands(got)]
    for lane, lane_ids in ids.items():
        assert [i for i in sent if i in lane_ids] == lane_ids[:-1], lane  # the last waits
    # One bulk command settles: the waiting one goes next, not anything after it.
    plane.on_update(
        session, wire.CommandUpdate(command_id=ids[Lane.BULK][0], state=wire.CommandState.SUCCEEDED)
    )
    _drain(receive)
    plane.dispatch(session)
    assert [b.id for b in _commands(_drain(receive))] == [ids[Lane.BULK][-1]]


def test_DLV_CMD_02_the_stored_body_and_signature_are_resent_byte_for_byte(tmp_path: Path) -> None:
    """Stored at enqueue; the first send and a redelivery on a new session carry exactly those bytes."""
    plane, node = _plane(tmp_path)
    cid = plane.enqueue(node, "inventory.refresh")
    row = plane.store.one("SELECT body, signature FROM commands WHERE id = ?", cid)
    stored = (bytes(row["body"]), bytes(row["signature"]))
    _s1, _r1, first = _session(plane, node)
    _s2, _r2, again = _session(plane, node)  # the node reconnects before answering: redelivered
    sent = [
        (bytes(m.command.body), bytes(m.command.signature)) for m in first + again if m.command is not None
    ]
    assert sent == [stored, stored]
    verify_signature(plane.keys.key("worker").public_key, Purpose.COMMAND, stored[0], stored[1])


def test_DLV_CMD_05_seq_is_per_node_and_gives_the_replay_order(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    other = _joined(plane)
    mine = [plane.enqueue(node, "inventory.refresh") for _ in range(3)]
    theirs = plane.enqueue(other, "inventory.refresh")
    mine.append(plane.enqueue(node, "diag.nvml"))
    _s, _r, got = _session(plane, node)
    bodies = _commands(got)
    assert [b.id for b in bodies] == mine  # replayed in seq order
    assert [b.seq for b in bodies] == [1, 2, 3, 4]  # the other node's command took none of them
    assert (plane.command(theirs) or {})["seq"] == 1


def test_DLV_CMD_17_invalid_stored_body_cancelled_not_sent(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    other = plane.enqueue(node, "inventory.refresh")
    garbage = plane.enqueue(node, "inventory.refresh")
    good = plane.enqueue(node, "inventory.refresh")
    foreign = wire.CommandBody.parse(
        bytes(plane.store.one("SELECT body FROM commands WHERE id = ?", other)["body"])
    )
    foreign.node_id = "another-node"
    plane.store.conn.execute("UPDATE commands SET body = ? WHERE id = ?", (bytes(foreign), other))
    plane.store.conn.execute("UPDATE commands SET body = ? WHERE id = ?", (b"\xff\xff\xff", garbage))
    _s, _r, got = _session(plane, node)
    assert [b.id for b in _commands(got)] == [good]
    for cid in (other, garbage):
        record = plane.command(cid) or {}
        assert (record["state"], record["reason"]) == ("cancelled", "invalid-body")


def test_DLV_SIG_02_QRM_07_commands_signed_bundle_in_welcome_batches_carry_approval(tmp_path: Path) -> None:
    """Covers DLV-SIG-02, DLV-QRM-07."""
    plane, node = _plane(tmp_path)
    plane.enqueue(node, "inventory.refresh")
    plane.enqueue(node, "gpu.reset")  # destructive: batched
    _s, _r, got = _session(plane, node)
    welcome = got[0].welcome
    assert welcome is not None and welcome.trust_bundle is not None
    commands = [m.command for m in got if m.command is not None]
    assert len(commands) == 2
    for command in commands:
        verify_signature(
            plane.keys.key("worker").public_key, Purpose.COMMAND, command.body, command.signature
        )
    plain, batched = commands
    assert plain.batch_approval is None and plain.batch_proof is None
    assert batched.batch_approval is not None and batched.batch_proof is not None
    assert len(batched.batch_approval.signatures) == 2


def test_DLV_RES_09_10_SIG_19_updates_scoped_to_the_node_and_stored_exactly(tmp_path: Path) -> None:
    """Covers DLV-RES-09, DLV-RES-10, DLV-SIG-19."""
    plane, node = _plane(tmp_path)
    intruder = _joined(plane)
    cid = plane.enqueue(node, "inventory.refresh")
    own, _r1, _ = _session(plane, node)
    theirs, _r2, _ = _session(plane, intruder)
    plane.on_update(theirs, wire.CommandUpdate(command_id=cid, state=wire.CommandState.FAILED))
    assert (plane.command(cid) or {})["state"] == "dispatched"
    bogus_sig = b"\x00not-a-valid-signature"  # the gateway neither judges nor strips it
    plane.on_update(
        own,
        wire.CommandUpdate(
            command_id=cid, state=wire.CommandState.SUCCEEDED, result=b"\x08\x01raw", node_sig=bogus_sig
        ),
    )
    record = plane.command(cid) or {}
    assert record["state"] == "succeeded"
    assert (
        bytes.fromhex(record["result"]) == b"\x08\x01raw" and bytes.fromhex(record["node_sig"]) == bogus_sig
    )


def test_DLV_RES_07_a_result_lands_without_the_steps_before_it(tmp_path: Path) -> None:
    """A terminal update on a command never reported ACKED or RUNNING is stored and acknowledged; a late
    ACKED or RUNNING (the one that was lost, arriving after) moves nothing back."""
    plane, node = _plane(tmp_path)
    straight = plane.enqueue(node, "inventory.refresh")
    acked_lost = plane.enqueue(node, "inventory.refresh")
    session, receive, got = _session(plane, node)
    assert {b.id for b in _commands(got)} == {straight, acked_lost}
    plane.on_update(session, wire.CommandUpdate(command_id=straight, state=wire.CommandState.REJECTED))
    plane.on_update(session, wire.CommandUpdate(command_id=acked_lost, state=wire.CommandState.RUNNING))
    plane.on_update(
        session, wire.CommandUpdate(command_id=acked_lost, state=wire.CommandState.SUCCEEDED, result=b"r")
    )
    acks = [m.ack.command_ids for m in _drain(receive) if m.ack is not None]
    assert acks == [[straight], [acked_lost]]
    for late in (wire.CommandState.ACKED, wire.CommandState.RUNNING):
        plane.on_update(session, wire.CommandUpdate(command_id=acked_lost, state=late))
        plane.on_update(session, wire.CommandUpdate(command_id=straight, state=late))
    assert (plane.command(straight) or {})["state"] == "rejected"
    record = plane.command(acked_lost) or {}
    assert record["state"] == "succeeded" and bytes.fromhex(record["result"]) == b"r"


def test_DLV_EVT_07_acked_event_seq_advanced_and_ack_answered(tmp_path: Path) -> None:
    """The ack half of DLV-EVT-07 (report handlers are the real gateway's, docs/devplane.md)."""
    plane, node = _plane(tmp_path)
    session, receive, _ = _session(plane, node, journal_id="j9")
    plane.on_events(session, wire.EventBatch(journal_id="j9", events=[wire.Event(seq=1, type="T")]))
    [message] = _drain(receive)
    assert message.ack is not None and (message.ack.journal_id, message.ack.event_seq) == ("j9", 1)
    assert (plane.node(node) or {})["acked_event_seq"] == 1


def test_DLV_TMO_04_self_terminating_timeout_covers_the_rejoin_window(tmp_path: Path) -> None:
    plane, node = _plane(tmp_path)
    cid = plane.enqueue(node, "node.reboot", not_after_s=1)
    plane.store.conn.execute("UPDATE commands SET state = 'dispatched' WHERE id = ?", (cid,))
    now = time.time()
    assert timeout_for("node.reboot") >= 15 * 60
    assert plane.sweep(now + 10 * 60) == 0  # a reboot still rejoining is not timed out
    assert plane.sweep(now + 2 + timeout_for("node.reboot")) == 1


async def test_DLV_TMO_01_sweeper_runs_every_five_seconds(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plane = DevPlane(tmp_path / "dp", listen=None)
    sweeps: list[float] = []
    plane.sweep = lambda now=None: sweeps.append(trio.current_time()) or 0  # type: ignore[method-assign]
    plane.backstop = lambda: None  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(plane._timers)
        await trio.sleep(16.5)
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in itertools.pairwise(sweeps)]
    assert len(sweeps) == 3 and all(abs(g - 5.0) < 1.01 for g in gaps), sweeps
