"""Gateway rules of the development control plane, checked so that a wrong implementation fails."""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from pathlib import Path

import pytest
import trio
from bcd_agent.devplane.plane import DevPlane, GatewaySession
from bcd_shared import wire
from bcd_shared.pki import KeyPair
from bcd_shared.pki.bundle import Approver
from bcd_shared.pki.errors import PkiError
from bcd_shared.pki.quorum import verify_batch_approval, verify_scope_proof


def _joined(plane: DevPlane) -> str:
    response = plane.join(
        wire.JoinRequest(
            token=plane.issue_token(), node_public_key=KeyPair.generate().public_key, hostname="h"
        )
    )
    return wire.JoinResponseBody.parse(response.body).node_id


def _session(
    plane: DevPlane, node: str, journal_id: str = "j1"
) -> tuple[GatewaySession, list[wire.GatewayMessage]]:
    send, receive = trio.open_memory_channel[wire.GatewayMessage](math.inf)
    hello = wire.Hello(node_id=node, journal_id=journal_id, boot_id="b", applied_generation=0)
    session = plane.open_session(hello, send)
    got: list[wire.GatewayMessage] = []
    while True:
        try:
            got.append(receive.receive_nowait())
        except trio.WouldBlock:
            return session, got


def test_DLV_EVT_05_an_event_at_or_below_the_cumulative_ack_is_never_stored(tmp_path: Path) -> None:
    """DLV-EVT-05: once seq 2 is acked, a seq 1 the plane never stored (so no primary-key duplicate hides
    the rule) is dropped, and the ack does not move back."""
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    session, _ = _session(plane, node)
    plane.on_events(session, wire.EventBatch(journal_id="j1", events=[wire.Event(seq=2, type="T")]))
    plane.on_events(session, wire.EventBatch(journal_id="j1", events=[wire.Event(seq=1, type="LATE")]))
    plane.on_events(
        session,
        wire.EventBatch(
            journal_id="j1", events=[wire.Event(seq=2, type="AGAIN"), wire.Event(seq=3, type="T")]
        ),
    )
    record = plane.node(node)
    assert record is not None
    assert [(e["seq"], e["type"]) for e in record["events"]] == [(2, "T"), (3, "T")]
    assert record["acked_event_seq"] == 3


def test_DLV_QRM_07_each_batched_command_carries_its_own_leafs_proof(tmp_path: Path) -> None:
    """DLV-QRM-07: the approval verifies under the plane's approvers, and the proof proves exactly this
    command's (subject, kind, payload hash, id) leaf; another command's proof does not."""
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    plane.enqueue(node, "gpu.reset")
    plane.enqueue(node, "gpu.reset")
    _s, got = _session(plane, node)
    commands = [m.command for m in got if m.command is not None]
    assert len(commands) == 2
    approvers = [Approver(n, plane.keys.key(n).public_key) for n in ("a1", "a2", "a3")]
    now = dt.datetime.now(dt.UTC)
    bodies = [wire.CommandBody.parse(c.body) for c in commands]
    assert bodies[0].id != bodies[1].id
    for command, body in zip(commands, bodies, strict=True):
        assert command.batch_approval is not None and command.batch_proof is not None
        approved = verify_batch_approval(
            command.batch_approval.scope,
            [(s.key_id, s.signature) for s in command.batch_approval.signatures],
            approvers,
            2,
            now,
        )
        assert approved.batch_id == body.batch_id
        payload = bytes(body.payload.value) if body.payload else b""
        proof = command.batch_proof
        proven = verify_scope_proof(
            approved,
            proof.leaf,
            proof.leaf_index,
            proof.path,
            command_id=body.id,
            subject=body.target_node_id or body.node_id,
            kind=body.kind,
            payload_sha256=hashlib.sha256(payload).digest(),
        )
        assert proven.leaf.command_id == body.id
    # the proofs are not interchangeable
    first, second = commands
    assert first.batch_proof is not None and second.batch_approval is not None
    other = verify_batch_approval(
        second.batch_approval.scope,
        [(s.key_id, s.signature) for s in second.batch_approval.signatures],
        approvers,
        2,
        now,
    )
    with pytest.raises(PkiError):
        verify_scope_proof(
            other,
            first.batch_proof.leaf,
            first.batch_proof.leaf_index,
            first.batch_proof.path,
            command_id=bodies[1].id,
            subject=bodies[1].target_node_id or bodies[1].node_id,
            kind=bodies[1].kind,
            payload_sha256=hashlib.sha256(
                bytes(bodies[1].payload.value) if bodies[1].payload else b""
            ).digest(),
        )
