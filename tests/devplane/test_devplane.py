"""The development control plane's gateway rules, and DevPlane + Node in one trio process (as `bcd sim`)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import trio
from bcd_agent.config import Config, ControlPlaneConfig
from bcd_agent.devplane.plane import DevPlane, GatewaySession
from bcd_agent.join import join
from bcd_agent.node import Node, NodeOptions
from bcd_shared import wire
from bcd_shared.pki import KeyPair
from bcd_simhost.seed import seed


def _joined(plane: DevPlane) -> str:
    response = plane.join(
        wire.JoinRequest(
            token=plane.issue_token(), node_public_key=KeyPair.generate().public_key, hostname="h"
        )
    )
    body = wire.JoinResponseBody.parse(response.body)
    return body.node_id


def _session(
    plane: DevPlane, node_id: str, journal_id: str = "j1"
) -> tuple[GatewaySession, list[wire.GatewayMessage]]:
    send, receive = trio.open_memory_channel[wire.GatewayMessage](math.inf)
    session = plane.open_session(wire.Hello(node_id=node_id, journal_id=journal_id, boot_id="b"), send)
    got: list[wire.GatewayMessage] = []
    while True:
        try:
            got.append(receive.receive_nowait())
        except trio.WouldBlock:
            break
    session.send = send
    return session, got


def test_DLV_TMO_02_03_sweeper_expires_pending_and_times_out_in_flight(tmp_path: Path) -> None:
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    pending = plane.enqueue(node, "inventory.refresh", not_after_s=1)
    flying = plane.enqueue(node, "inventory.refresh", not_after_s=1)
    plane.store.conn.execute("UPDATE commands SET state = 'dispatched' WHERE id = ?", (flying,))
    now = time.time()
    assert plane.sweep(now + 2) == 1  # pending past not_after -> expired; in flight waits for the timeout
    assert plane.command(pending)["state"] == "expired"  # type: ignore[index]
    assert plane.sweep(now + 2 + 120) == 1  # inventory.refresh: 2 minutes (DLV-TMO-05)
    record = plane.command(flying)
    assert record is not None and record["state"] == "failed" and record["error_code"] == "timeout"


def test_DLV_RCV_01_welcome_then_full_spec_before_commands(tmp_path: Path) -> None:
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    plane.apply_spec(node, {"telemetry": {"otlpEndpoint": "https://o"}})
    assert (
        plane.apply_spec(node, {"telemetry": {"otlpEndpoint": "https://o"}}) == 1
    )  # same JSON: no new generation
    plane.enqueue(node, "inventory.refresh")
    _, got = _session(plane, node)
    kinds = [
        (m.welcome is not None and "welcome") or (m.desired_state is not None and "spec") or "command"
        for m in got
    ]
    assert kinds == ["welcome", "spec", "command"]


def test_DLV_RES_11_terminal_updates_acked_even_unknown_and_stored_once(tmp_path: Path) -> None:
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    cid = plane.enqueue(node, "inventory.refresh")
    session, _ = _session(plane, node)
    send, receive = trio.open_memory_channel[wire.GatewayMessage](math.inf)
    session.send = send
    ok = wire.CommandUpdate(command_id=cid, state=wire.CommandState.SUCCEEDED, result=b"\x01exact")
    plane.on_update(session, ok)
    plane.on_update(session, wire.CommandUpdate(command_id=cid, state=wire.CommandState.FAILED))
    plane.on_update(
        session, wire.CommandUpdate(command_id="01UNKNOWN0000000000000000A", state=wire.CommandState.FAILED)
    )
    acks = [receive.receive_nowait().ack for _ in range(3)]
    assert [a.command_ids for a in acks if a] == [[cid], [cid], ["01UNKNOWN0000000000000000A"]]
    record = plane.command(cid)
    assert (
        record is not None
        and record["state"] == "succeeded"
        and bytes.fromhex(record["result"]) == b"\x01exact"
    )


def test_DLV_EVT_05_08_events_above_the_ack_and_other_journals_ignored(tmp_path: Path) -> None:
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    session, _ = _session(plane, node, journal_id="j1")
    events = [wire.Event(seq=i, type="T", payload=b"x") for i in (1, 2)]
    plane.on_events(session, wire.EventBatch(journal_id="j1", events=events))
    plane.on_events(session, wire.EventBatch(journal_id="j1", events=events))  # a replay: stored once
    plane.on_events(session, wire.EventBatch(journal_id="other", events=[wire.Event(seq=3, type="X")]))
    record = plane.node(node)
    assert (
        record is not None
        and [e["seq"] for e in record["events"]] == [1, 2]
        and record["acked_event_seq"] == 2
    )


def test_DLV_CAN_01_cancel_before_dispatch_wins(tmp_path: Path) -> None:
    """Covers DLV-DSP-05: a pending command whose cancel was requested is cancelled, never sent."""
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    cid = plane.enqueue(node, "inventory.refresh")
    assert plane.cancel(cid) == "cancelled"
    _s, got = _session(plane, node)
    assert [m for m in got if m.command is not None] == []


def test_secret_broker_releases_only_what_the_current_spec_names(tmp_path: Path) -> None:
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    plane.put_secret("secret://otlp", b"headers")
    request = wire.SecretRequest(request_id="r", ref="secret://otlp")
    assert plane.secret(node, request).status == wire.SecretStatus.REFUSED
    plane.apply_spec(node, {"telemetry": {"headersSecretRef": "secret://otlp"}})
    answer = plane.secret(node, request)
    assert answer.status == wire.SecretStatus.OK and answer.value == b"headers"
    plane.apply_spec(node, {})
    assert plane.secret(node, request).status == wire.SecretStatus.REFUSED


async def test_devplane_and_node_in_one_process_over_a_unix_socket(tmp_path: Path) -> None:
    """Covers DLV-GEN-03 and DLV-RCV-02: a pushed spec observed; the embedding `bcd sim` uses."""
    os.chmod(tmp_path, 0o755)
    root = tmp_path / "host"
    seed(root)
    gw = tmp_path / "gw.sock"
    plane = DevPlane(tmp_path / "dp", listen="127.0.0.1:0", unix_socket=gw)
    config = Config(data_dir=str(tmp_path / "data"), control_plane=ControlPlaneConfig(unix_socket=str(gw)))
    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        identity = await join(config, token=plane.issue_token(), address=f"unix:{gw}")
        node = Node(config, NodeOptions(root=str(root), status_interval_s=0.05))
        await nursery.start(node.run)
        with trio.fail_after(20):
            while not node.core.state.welcomed:  # noqa: ASYNC110 (polling another service's state)
                await trio.sleep(0.02)
            generation = plane.apply_spec(identity.node_id, {"telemetry": {"otlpEndpoint": "https://o"}})
            while (plane.node(identity.node_id) or {}).get("observed_generation") != generation:  # noqa: ASYNC110
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
