"""XID errors end to end: `bcd node` on the simulated host beside the development control plane.

The simulated kernel log (bcd_simhost.kernellog) gets NVRM XID lines; the node's watcher raises one
`XidError` condition per GPU in its StatusReport and `bcd status`, diag.nvml lists the codes, and a
gpu.reset clears the condition of the GPU that reads healthy after it, keeps the one of a GPU that does
not (a row remap failure survives the simulated reset), and a node restarted in the same boot keeps
what it had.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from bcd_agent.join import join
from bcd_agent.node import Node, NodeOptions
from bcd_shared import wire
from bcd_simhost.gpus import bus_id, gpu_uuid, update_state
from bcd_simhost.kernellog import kernel_line, xid_message
from session.test_node_wiring import World, world_payload


def xid_reasons(world: World) -> list[str]:
    status = world.record().get("status") or {}
    return sorted(c.get("reason", "") for c in status.get("conditions", []) if c.get("type") == "XidError")


def runner_reasons(node: Any) -> list[str]:
    latest = node.runner.status.latest()
    return sorted(c.reason for c in latest.conditions if c.type == "XidError")


def status_file_reasons(world: World) -> list[str]:
    doc = json.loads((world.data / "status.json").read_text())
    return sorted(c["reason"] for c in doc["conditions"] if c["type"] == "XidError")


async def start_node(world: World, nursery: trio.Nursery) -> Node:
    node = Node(world.config(), NodeOptions(root=str(world.root), status_interval_s=0.05, xid_poll_s=0.05))
    await nursery.start(node.run)
    await world.until("the session", lambda: node.core.state.welcomed)
    return node


async def test_DLV_RST_14_DEV_BUSY_12_xid_raised_reported_then_cleared_by_a_healthy_reset(
    tmp_path: Path,
) -> None:
    """Covers DLV-RST-14, DEV-BUSY-12 end to end: XIDs on GPUs 2 and 6 are conditions in the
    StatusReport; gpu.reset of both leaves GPU 2 healthy and GPU 6 not (its row remap failed): GPU 2's
    condition is gone from the node's status by the time the command's result reaches the control
    plane, GPU 6's stays, also after the node restarts in the same boot."""
    world = World(tmp_path)
    g2, g6 = gpu_uuid(2), gpu_uuid(6)
    update_state(world.root, lambda s: s["gpus"][6].__setitem__("remap_failure", True))
    async with trio.open_nursery() as outer:
        await outer.start(world.plane.run)
        identity = await join(world.config(), token=world.plane.issue_token(), address=f"unix:{world.gw}")
        world.node_id = identity.node_id
        async with trio.open_nursery() as first:
            node = await start_node(world, first)
            kernel_line(world.root, xid_message(bus_id(2), 79))
            kernel_line(world.root, xid_message(bus_id(6), 48, "An uncorrectable double bit error (DBE)"))
            kernel_line(world.root, xid_message(bus_id(6), 63, "Row Remapper: New row marked for remapping"))
            await world.until(
                "both XID conditions at the control plane", lambda: xid_reasons(world) == [g2, g6]
            )
            status = world.record()["status"]
            message = next(c["message"] for c in status["conditions"] if c["reason"] == g2)
            assert "XID 79 (GPU has fallen off the bus)" in message, message
            await world.until("both in bcd status", lambda: status_file_reasons(world) == [g2, g6])

            diag = await world.command(
                world.plane.enqueue(world.node_id, "diag.nvml", world_payload("diag.nvml"))
            )
            health = {g.uuid: g for g in wire.DiagNvmlResult.parse(bytes.fromhex(diag["result"])).gpus}
            assert list(health[g6].xids) == [48, 63] and list(health[g2].xids) == [79]
            assert list(health[gpu_uuid(0)].xids) == []

            payload = world_payload("gpu.reset", {"gpuUuids": [g2, g6]})
            done = await world.command(world.plane.enqueue(world.node_id, "gpu.reset", payload))
            # At once: the node's own status had dropped GPU 2's condition before the result went out.
            assert runner_reasons(node) == [g6]
            assert done["state"] == "succeeded", done
            result = wire.GpuResetResult.parse(bytes.fromhex(done["result"]))
            outcomes = [(o.gpu_uuid, o.reset, o.healthy) for o in result.gpus]
            assert outcomes == [(g2, True, True), (g6, True, False)]
            await world.until(
                "GPU 2's condition cleared at the control plane", lambda: xid_reasons(world) == [g6]
            )
            await world.until("and in bcd status", lambda: status_file_reasons(world) == [g6])
            first.cancel_scope.cancel()
        # Restarted in the same boot: GPU 6's condition is back at once, GPU 2's cleared one is not.
        async with trio.open_nursery() as second:
            again = await start_node(world, second)
            await world.until("the restarted node's status", lambda: runner_reasons(again) == [g6])
            second.cancel_scope.cancel()
        outer.cancel_scope.cancel()
