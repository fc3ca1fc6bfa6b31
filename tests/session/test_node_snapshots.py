"""`bcd node` on the simulated host takes an `instance.snapshot` and restores it through `restore_from`,
end to end through the development control plane: the upload and the download go to a real HTTPS server
on loopback that the test starts (its throwaway CA given to curl by CURL_CA_BUNDLE; the simulated host's
curl hands loopback URLs to the real one)."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_shared import wire
from test_node_wiring import World, running, world_payload
from testsupport import require_tool
from tlskit import https_server, make_tls, object_store

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, bytes]]]:
    """An HTTPS object store on loopback: PUT /<name> keeps the body, GET /<name> serves it."""
    require_tool("curl")
    (tmp_path / "tls").mkdir()
    ca, cert, key = make_tls(tmp_path / "tls")
    monkeypatch.setenv("CURL_CA_BUNDLE", str(ca))
    objects: dict[str, bytes] = {}
    with https_server(object_store(objects), cert, key) as base:
        yield base, objects


async def test_a_snapshot_uploaded_then_restored_dlv_kind_21_dlv_snap_01_10_13_14_dlv_rt_13(
    tmp_path: Path, store: tuple[str, dict[str, bytes]]
) -> None:
    """DLV-KIND-21, DLV-SNAP-13, DLV-SNAP-14: the node runs instance.snapshot of its VM and uploads the
    tar to the presigned URL, its result naming the tar's digest; DLV-RT-13: a memory snapshot of the
    VM, which has a passthrough GPU, fails `snapshot-refused` with the seeds' message; DLV-SNAP-01,
    DLV-SNAP-10: a new spec restoring the upload into another instance waits for the download, whose end
    triggers the pass that restores it, and the instance runs."""
    base, objects = store
    world = World(tmp_path)
    spec = json.loads((REPO / "examples/vm-node.json").read_text())
    async with running(world, world.config()) as node:
        assert world.plane.apply_spec(world.node_id, spec) == 1
        await world.observed(1)

        def snapshot(memory: bool, name: str) -> Any:
            payload = {"instanceId": "vm-gpu-0001", "includeMemory": memory, "uploadUrl": f"{base}/{name}"}
            return world.plane.enqueue(
                world.node_id, "instance.snapshot", world_payload("instance.snapshot", payload)
            )

        refused = await world.command(snapshot(True, "mem.tar"))
        assert refused["state"] == "failed" and refused["error_code"] == "snapshot-refused", refused
        assert "passthrough GPUs cannot be snapshotted with its memory" in refused["message"]
        assert "mem.tar" not in objects

        done = await world.command(snapshot(False, "disk.tar"))
        assert done["state"] == "succeeded", done
        result = wire.InstanceSnapshotResult.parse(bytes.fromhex(done["result"]))
        body = objects["disk.tar"]
        assert result.sha256 == hashlib.sha256(body).hexdigest() and result.size_bytes == len(body)
        assert (result.runtime, result.includes_memory) == ("libvirt-kvm", False)
        staging = Path(node.instances_section.data_dir)
        assert list((world.root / str(staging).lstrip("/") / "snapshots/staging").iterdir()) == []

        restored = copy.deepcopy(spec)
        vm = restored["instances"]["instances"][0]
        copy_vm = {key: vm[key] for key in ("runtime", "desiredState", "size", "networkPolicy")} | {
            "id": "vm-restored",
            "allocationId": "alloc_vm_0002",
            "nics": [{"bridge": "br0", "mac": "52:54:00:12:34:57", "addresses": ["10.20.0.6/24"]}],
            "restoreFrom": {"url": f"{base}/disk.tar", "sha256": result.sha256},
        }
        restored["instances"]["instances"].append(copy_vm)
        assert world.plane.apply_spec(world.node_id, restored) == 2

        def running_copy() -> bool:
            status = world.record().get("status", {})
            return any(
                i["instanceId"] == "vm-restored" and i["state"] == "INSTANCE_STATE_RUNNING"
                for i in status.get("instances", [])
            )

        await world.until("the restored instance runs", running_copy, within=60)
        tar = world.root / str(staging).lstrip("/") / f"snapshots/{result.sha256}.tar"
        assert tar.read_bytes() == body
