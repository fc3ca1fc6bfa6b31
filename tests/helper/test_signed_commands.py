"""Issue 9 item 10: with command-signing roots, gpu.reset and node.reboot act only on a signed command.

A real node account (realnode.RealNode) asks a real helper; root's join record carries a bundle with
command-signing roots for node-a. The node must forward the Command it received (body bytes, signature,
chain); root re-validates the signature, the kind, the node, `not_after` and, for gpu.reset, that every
GPU asked for is named in the command's GpuResetRequest. Without roots, root acts on the request alone
(HST-SIGN-33), which the last test checks still holds. Root acts on a destructive command once: a replay
before its `not_after` is refused, across a restart (bcd_helper.usedcommands).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from bcd_shared import wire
from bcd_shared.pki import Purpose
from bcd_shared.wire.strict import type_url
from intentkit import ControlPlane, Signer, b64, now
from realnode import RealNode

NODE = "node-a"
GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"
REBOOT_MARK = "var/lib/bcd-sim/reboot-requested"


def new_id() -> str:
    """A fresh command id (ULID-like): root acts on a destructive command once."""
    return "01J" + "".join(secrets.choice("0123456789ABCDEFGHJKMNPQRSTVWXYZ") for _ in range(23))


def command(
    signer: Signer,
    kind: str,
    payload: Any,
    *,
    node: str = NODE,
    target: str = "",
    not_after: dt.datetime | None = None,
    purpose: Purpose = Purpose.COMMAND,
    tamper: bool = False,
    command_id: str | None = None,
) -> dict[str, Any]:
    body = bytes(
        wire.CommandBody(
            id=command_id or new_id(),
            node_id=node,
            seq=1,
            kind=kind,
            payload=wire.ProtoAny(type_url=type_url(type(payload)), value=bytes(payload)),
            lane=wire.Lane.CONTROL,
            not_after=int((not_after or now() + dt.timedelta(minutes=10)).timestamp() * 1000),
            target_node_id=target,
        )
    )
    signature = signer.key.sign(purpose, body)
    if tamper:
        body = body[:-1] + bytes([body[-1] ^ 1])
    return {
        "body": b64(body),
        "signature": b64(signature),
        "chain": [b64(c) for c in signer.chain],
        "trust_bundle": None,
    }


def reset(uuids: list[str], signed: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {"gpu_uuids": uuids}
    if signed is not None:
        args["command"] = signed
    return {"op": "gpu.reset", "args": args}


def reboot(signed: dict[str, Any] | None) -> dict[str, Any]:
    return {"op": "node.reboot", "args": {} if signed is None else {"command": signed}}


@pytest.fixture(scope="module")
def node(cp: ControlPlane) -> Iterator[RealNode]:
    n = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    yield n
    n.close()


def test_issue9_item10_gpu_reset_needs_the_signed_command(node: RealNode, cp: ControlPlane) -> None:
    worker = cp.command.leaf()
    both = wire.GpuResetRequest(gpu_uuids=[GPU1, GPU2])
    node.refused(reset([GPU1], None), "command-required")
    node.refused(reset([GPU1], command(cp.other.leaf(), "gpu.reset", both)), "bad-command")  # unknown root
    node.refused(reset([GPU1], command(worker, "gpu.reset", both, tamper=True)), "bad-command")
    node.refused(
        reset([GPU1], command(worker, "gpu.reset", both, purpose=Purpose.DESIRED_STATE)), "bad-command"
    )
    node.refused(reset([GPU1], command(worker, "node.reboot", wire.NodeRebootRequest())), "command-mismatch")
    node.refused(reset([GPU1], command(worker, "gpu.reset", both, node="node-b")), "wrong-node")
    node.refused(reset([GPU1], command(worker, "gpu.reset", both, target="node-b")), "wrong-node")
    past = now() - dt.timedelta(seconds=1)
    node.refused(reset([GPU1], command(worker, "gpu.reset", both, not_after=past)), "command-expired")
    only2 = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU2]))
    node.refused(reset([GPU1], only2), "command-mismatch", GPU1)
    node.refused(reset([GPU1, GPU2], only2), "command-mismatch", GPU1)
    # The command names both GPUs; the node resets them one by one, each with the same command.
    signed = command(worker, "gpu.reset", both)
    for uuid in (GPU1, GPU2):
        assert node.ok(reset([uuid], signed))["gpus"] == [{"uuid": uuid, "reset": True, "message": ""}]


def test_issue9_item10_node_reboot_needs_the_signed_command(node: RealNode, cp: ControlPlane) -> None:
    worker = cp.command.leaf()
    node.refused(reboot(None), "command-required")
    gpu = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1]))
    node.refused(reboot(gpu), "command-mismatch")
    node.refused(
        reboot(command(worker, "node.reboot", wire.NodeRebootRequest(), node="node-b")), "wrong-node"
    )
    expired = command(
        worker, "node.reboot", wire.NodeRebootRequest(), not_after=now() - dt.timedelta(minutes=1)
    )
    node.refused(reboot(expired), "command-expired")
    assert not (node.root / REBOOT_MARK).exists()
    assert node.ok(reboot(command(worker, "node.reboot", wire.NodeRebootRequest(reason="kernel"))))[
        "rebooting"
    ]
    assert (node.root / REBOOT_MARK).exists()


def test_without_roots_root_acts_on_the_request_alone() -> None:
    """HST-SIGN-33 still holds for these ops: no pin, no record, no bundle: nothing to verify against."""
    bare = RealNode()
    try:
        assert bare.ok(reset([GPU1], None))["gpus"][0]["reset"] is True
        assert bare.ok(reboot(None))["rebooting"] is True
    finally:
        bare.close()


class _Ctx:
    boot_id = "b"
    cancel_requested = False

    async def begin_effect(self) -> None:
        return None


def test_issue9_item10_the_node_handlers_forward_the_signed_command(node: RealNode, cp: ControlPlane) -> None:
    """The agent's gpu.reset and node.reboot handlers, beside a helper with roots, forward the Command
    they received byte for byte: root accepts it; an unsigned command forwarded the same way is refused
    (the handler fails with root's reason)."""
    import trio
    from bcd_agent.dispatch.handlers import CommandFailed
    from bcd_agent.dispatch.wire import envelope_from_wire
    from bcd_agent.helperclient import HelperClient
    from bcd_agent.nodeparts.kinds import GpuResetHandler, NodeRebootHandler
    from bcd_simhost import sim_system

    worker = cp.command.leaf()

    def envelope(kind: str, payload: Any, signed: bool = True) -> Any:
        arg = command(worker, kind, payload)
        msg = wire.Command(
            body=base64.b64decode(arg["body"]),
            signature=base64.b64decode(arg["signature"]) if signed else b"",
            signer_chain=[base64.b64decode(c) for c in arg["chain"]] if signed else [],
            attempt=1,
        )
        return envelope_from_wire(msg)

    client = HelperClient(node.h.socket_path)
    system = sim_system(node.root)
    resets = GpuResetHandler(system, "/var/lib/bcd", helper=client)
    result = trio.run(resets.run, envelope("gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1])), _Ctx())
    assert wire.GpuResetResult.parse(result).gpus[0].reset is True
    assert node.h.last_audit()["op"] == "gpu.reset" and node.h.last_audit()["decision"] == "accepted"
    reboots = NodeRebootHandler(system, client, wait_s=0)
    with pytest.raises(CommandFailed) as exc:
        trio.run(reboots.run, envelope("node.reboot", wire.NodeRebootRequest(), signed=False), _Ctx())
    assert exc.value.code == "bad-command"
    with pytest.raises(CommandFailed) as exc:  # accepted: the handler then waits for the host to go down
        trio.run(reboots.run, envelope("node.reboot", wire.NodeRebootRequest()), _Ctx())
    assert exc.value.code == "reboot-timeout"
    assert node.h.last_audit()["op"] == "node.reboot" and node.h.last_audit()["decision"] == "accepted"


USED = "var/lib/bcd-hostconfig/helper-commands.json"


def _used(node: RealNode) -> list[dict[str, Any]]:
    entries = json.loads((node.root / USED).read_text())["used"]
    assert isinstance(entries, list)
    return entries


def test_issue9_residual_a_gpu_reset_command_resets_each_gpu_once_even_across_a_restart(
    node: RealNode, cp: ControlPlane
) -> None:
    """docs/helper.md's residual of item 10: a signed gpu.reset could be replayed until its not_after. Root
    now remembers (command id, GPU) before it resets: each GPU the command names is reset once; the same
    command again for that GPU is refused `command-replayed`, also after the helper restarts."""
    worker = cp.command.leaf()
    signed = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1, GPU2]))
    assert node.ok(reset([GPU1], signed))["gpus"][0]["reset"] is True
    node.refused(reset([GPU1], signed), "command-replayed", GPU1)
    node.refused(reset([GPU2, GPU1], signed), "command-replayed", GPU1)  # nothing reset, GPU2 neither
    assert node.ok(reset([GPU2], signed))["gpus"][0]["reset"] is True
    node.refused(reset([GPU2], signed), "command-replayed", GPU2)
    node.start(cp.config_lines())  # root's memory is a file: a restart keeps it
    node.refused(reset([GPU1], signed), "command-replayed")
    node.refused(reset([GPU2], signed), "command-replayed")
    # Another command for the same GPU is a new decision of the control plane: acted on.
    again = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1]))
    assert node.ok(reset([GPU1], again))["gpus"][0]["reset"] is True


def test_issue9_residual_a_node_reboot_command_reboots_once(node: RealNode, cp: ControlPlane) -> None:
    """A signed node.reboot replayed before its not_after no longer reboots the machine again."""
    worker = cp.command.leaf()
    signed = command(worker, "node.reboot", wire.NodeRebootRequest(reason="kernel"))
    mark = node.root / REBOOT_MARK
    mark.unlink(missing_ok=True)
    assert node.ok(reboot(signed))["rebooting"] is True
    assert mark.exists()
    mark.unlink()
    node.refused(reboot(signed), "command-replayed")
    node.start(cp.config_lines())
    node.refused(reboot(signed), "command-replayed")
    assert not mark.exists()
    entries = [e for e in _used(node) if e["op"] == "node.reboot"]
    body = wire.CommandBody().parse(base64.b64decode(signed["body"]))
    assert {"id": body.id, "op": "node.reboot", "target": "", "not_after_ms": body.not_after} in entries


def test_issue9_residual_root_forgets_a_command_at_its_not_after(node: RealNode, cp: ControlPlane) -> None:
    """Bounded by time: an entry goes at its command's not_after (the command is refused as expired from
    then on, never acted on again), pruned at the next remembered command."""
    worker = cp.command.leaf()
    soon = now() + dt.timedelta(seconds=2)
    short = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1]), not_after=soon)
    short_id = wire.CommandBody().parse(base64.b64decode(short["body"])).id
    assert node.ok(reset([GPU1], short))["gpus"][0]["reset"] is True
    assert short_id in {e["id"] for e in _used(node)}
    time.sleep(max(0.0, (soon - now()).total_seconds()) + 0.2)
    node.refused(reset([GPU1], short), "command-expired")
    assert node.ok(reset([GPU1], command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1]))))
    assert short_id not in {e["id"] for e in _used(node)}


def test_issue9_residual_root_remembers_a_bounded_number_and_then_refuses(
    node: RealNode, cp: ControlPlane
) -> None:
    """Bounded by count, failing closed: with MAX_USED commands still valid remembered, a new one is refused
    `command-memory-full` (not acted on, nothing forgotten); an unreadable memory refuses every
    destructive command (`command-memory`)."""
    from bcd_helper.usedcommands import MAX_USED

    path = node.root / USED
    saved = path.read_bytes() if path.exists() else None
    later = int((now() + dt.timedelta(hours=1)).timestamp() * 1000)
    full = [
        {"id": f"01JFULL{i:019d}", "op": "gpu.reset", "target": GPU2, "not_after_ms": later}
        for i in range(MAX_USED)
    ]
    path.write_text(json.dumps({"format": 1, "used": full}))
    try:
        worker = cp.command.leaf()
        node.refused(
            reset([GPU1], command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1]))),
            "command-memory-full",
        )
        assert len(_used(node)) == MAX_USED
        path.write_text('{"format": 1, "used": [{"id": 1}]}')
        (node.root / REBOOT_MARK).unlink(missing_ok=True)
        answer = node.call(reboot(command(worker, "node.reboot", wire.NodeRebootRequest())))
        assert (answer["ok"], answer["error"], answer["reason"]) == (False, "failed", "command-memory"), (
            answer
        )
        assert not (node.root / REBOOT_MARK).exists()
    finally:
        if saved is None:
            path.unlink()
        else:
            path.write_bytes(saved)
