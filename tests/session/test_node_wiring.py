"""`bcd node` with every finished part wired, beside the development control plane in one trio process.

The node acts directly on a simulated host (bcd_simhost; no helper): the host section converges
config units from the wire spec, the devices section takes holds, the k8s-join token comes through a
SecretRequest, commands of the kinds this build runs (inventory.refresh, diag.nvml, gpu.reset,
node.reboot) go through the dispatcher, and heartbeats carry the inventory hash.

Covers HST-LVL-13 (inventory read again after a unit changed the host), HST-K8S-50, HST-K8S-51,
HST-HLP-13/15, DLV-KIND-02..05, DLV-JRN-17, DLV-REC-07, DLV-REC-17, DEV-BUSY-02, and the identity labels
(not HST-K8S-44 as a whole: bcd.dev/site is never set).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from bcd_agent.config import Config, HostConfig, load_config
from bcd_agent.devplane.plane import DevPlane
from bcd_agent.inventory.handlers import collect_inventory, inventory_hash
from bcd_agent.join import join
from bcd_agent.node import Node, NodeOptions
from bcd_shared import wire
from bcd_simhost import sim_system
from bcd_simhost.seed import seed

PIN = "ab" * 32
SERVER = "https://10.0.0.1:6443"
TOKEN_REF = "secret://pool/k8s-token"
TOKEN = "abcdef.0123456789abcdef"


def _unit(name: str, settings: dict[str, Any]) -> dict[str, str]:
    return {"name": name, "settings": json.dumps(settings, sort_keys=True, separators=(",", ":"))}


class World:
    def __init__(self, tmp: Path) -> None:
        os.chmod(tmp, 0o755)
        self.tmp = tmp
        self.root = tmp / "host"
        seed(self.root)
        os.chmod(self.root, 0o755)
        self.system = sim_system(self.root)
        self.gw = tmp / "gw.sock"
        self.plane = DevPlane(tmp / "dp", listen=None, unix_socket=self.gw)
        self.data = tmp / "data"
        self.node_id = ""

    def config(self, *, units: bool = True, gateway: Path | None = None) -> Config:
        toml = self.tmp / "node.toml"
        toml.write_text(
            f'data_dir = "{self.data}"\n[control_plane]\nunix_socket = "{gateway or self.gw}"\n'
            f'[kubernetes]\nallowed_clusters = "{SERVER}#sha256:{PIN}"\n'
        )
        config = load_config(str(toml))
        assert config.kubernetes.allowed_clusters
        if not units:
            from attrs import evolve

            config = evolve(config, host=HostConfig(units=False))
        return config

    def gpus(self) -> list[str]:
        out = self.system.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"]).stdout
        return (out.decode() if isinstance(out, bytes) else out).split()

    async def until(self, what: str, check: Callable[[], Any], within: float = 60) -> Any:
        # Generous: only a loaded machine is slower, and a pass costs no more. On time out the
        # AssertionError names what was awaited (trio's TooSlowError says nothing).
        with trio.move_on_after(within):
            while True:
                got = check()
                if got:
                    return got
                await trio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what} ({within} s)")

    def record(self) -> dict[str, Any]:
        return self.plane.node(self.node_id) or {}

    def section(self, name: str) -> dict[str, Any]:
        status = self.record().get("status") or {}
        wanted = f"SECTION_{name.upper()}"
        return next((s for s in status.get("sections", []) if s["section"] == wanted), {})

    async def observed(self, generation: int) -> dict[str, Any]:
        return await self.until(
            f"observed generation {generation}",
            lambda: self.record().get("observed_generation") == generation and self.record(),
        )

    async def command(self, cid: str, states: tuple[str, ...] = ("succeeded", "failed")) -> dict[str, Any]:
        return await self.until(
            f"command {cid}", lambda: (c := self.plane.command(cid)) and c["state"] in states and c
        )


@asynccontextmanager
async def running(world: World, config: Config, **options: Any) -> AsyncIterator[Node]:
    async with trio.open_nursery() as nursery:
        await nursery.start(world.plane.run)
        if not world.node_id:
            identity = await join(config, token=world.plane.issue_token(), address=f"unix:{world.gw}")
            world.node_id = identity.node_id
        node = Node(config, NodeOptions(root=str(world.root), status_interval_s=0.05, **options))
        await nursery.start(node.run)
        await world.until("the session", lambda: node.core.state.welcomed)
        yield node
        nursery.cancel_scope.cancel()


async def test_HST_LVL_13_host_units_and_holds_converge_directly_with_the_inventory_hash(
    tmp_path: Path,
) -> None:
    world = World(tmp_path)
    gpu = world.gpus()[0]
    hold = {
        "allocationId": "alloc_1",
        "reservationId": "res_1",
        "binding": "BINDING_HOLD",
        "devices": [{"id": gpu, "deviceClass": "gpu"}],
    }
    spec = {
        "host": {
            "units": [
                _unit("sysctl", {"vm.swappiness": 10}),
                _unit("kernel-modules", {"load": ["vfio_pci"]}),
            ]
        },
        "devices": {"assignments": [hold]},
    }
    async with running(world, world.config()) as node:
        assert world.plane.apply_spec(world.node_id, spec) == 1
        await world.observed(1)
        assert world.section("host")["state"] == "SECTION_STATE_CONVERGED", world.section("host")
        assert world.section("devices")["state"] == "SECTION_STATE_CONVERGED", world.section("devices")
        # The files on the simulated root: the units' and the hold's.
        assert "vm.swappiness = 10" in (world.root / "etc/sysctl.d/90-bcd.conf").read_text()
        assert (world.root / "proc/sys/vm/swappiness").read_text().strip() == "10"
        assert "vfio_pci" in (world.root / "etc/modules-load.d/bcd.conf").read_text()
        assert (world.root / "etc/cdi/bcd-alloc_1.json").exists()
        # The units changed the host: the inventory was read again (the follow-up pass and the hook). The
        # follow-up pass starts right after the first pass's status, so it is waited for, not assumed.
        await world.until("the follow-up pass", lambda: node.host_section.passes >= 2)
        # Heartbeats carry the inventory hash of inventory.refresh (the inventory package's digest).
        expected = inventory_hash(collect_inventory(world.system))
        heartbeat = node.core.heartbeat().heartbeat
        assert heartbeat.inventory_hashes == {"inventory": expected}
        # A refresh command returns the same hash.
        cid = world.plane.enqueue(world.node_id, "inventory.refresh", world_payload("inventory.refresh"))
        done = await world.command(cid)
        assert done["state"] == "succeeded", done
        result = wire.InventoryRefreshResult.parse(bytes.fromhex(done["result"]))
        assert result.inventory_hash == expected and len(result.inventory.gpus) == 8
        # The busy devices the units saw: the hold's GPU.
        from bcd_agent.nodeparts.host import busy_devices

        assert busy_devices(world.system, str(world.data), None) == frozenset({gpu})


def world_payload(kind: str, payload: dict[str, Any] | None = None) -> wire.ProtoAny | None:
    from bcd_agent.devplane.plane import payload_for

    return payload_for(kind, payload or {})


async def test_HST_K8S_50_51_k8s_join_fetches_its_token_through_the_session(tmp_path: Path) -> None:
    world = World(tmp_path)
    k8s = {
        "server": SERVER,
        "caCertSha256": PIN,
        "tokenRef": TOKEN_REF,
        "kubernetesVersion": "1.34.1",
        "nodeLabels": {"team": "ml"},
    }
    async with running(world, world.config()) as node:
        # No value stored yet: the broker answers UNAVAILABLE, the unit stays PROGRESSING (retried).
        world.plane.apply_spec(world.node_id, {"host": {"units": [_unit("k8s-join", k8s)]}})
        await world.until(
            "k8s-join waiting for its token",
            lambda: (
                "SecretUnavailable" in world.section("host").get("message", "")
                or "could not release" in world.section("host").get("message", "")
            ),
        )
        assert world.section("host")["state"] == "SECTION_STATE_PROGRESSING"
        world.plane.put_secret(TOKEN_REF, TOKEN.encode())
        node.runner.trigger("retry")
        await world.observed(1)
        assert world.section("host")["state"] == "SECTION_STATE_CONVERGED", world.section("host")
        sent = node.secrets.sent
        assert sent and all(
            (r.ref, r.workflow_id, r.step_id) == (TOKEN_REF, "host:k8s-join", "tokenRef") for r in sent
        )
        # Joined on the simulated cluster, with the identity labels from identity and inventory.
        cluster = json.loads((world.root / "var/lib/bcd-sim/k8s.json").read_text())
        labels = cluster["nodes"]["gpu-node-01"]["labels"]
        assert labels["team"] == "ml"
        assert labels["bcd.dev/node-id"] == world.node_id
        assert labels["bcd.dev/gpu.count"] == "8"
        assert labels["bcd.dev/gpu.product"].startswith("NVIDIA")
        assert "bcd.dev/gpu.driver" in labels
        assert (world.root / "var/lib/bcd-hostconfig/k8s-join.json").exists()
        assert not (world.root / "var/lib/bcd-hostconfig/k8s-join.yaml").exists()


async def test_HST_HLP_13_15_units_false_builds_no_host_section(tmp_path: Path) -> None:
    world = World(tmp_path)
    spec = {"host": {"units": [_unit("sysctl", {"vm.swappiness": 10})]}}
    async with running(world, world.config(units=False)) as node:
        assert node.host_section is None
        world.plane.apply_spec(world.node_id, spec)
        await world.observed(1)
        host = world.section("host")
        assert host["state"] == "SECTION_STATE_UNSUPPORTED" and host["reason"] == "HostManagedExternally"
        assert not (world.root / "etc/sysctl.d/90-bcd.conf").exists()


async def test_DLV_KIND_03_04_diag_nvml_and_gpu_reset_busy_then_free(tmp_path: Path) -> None:
    world = World(tmp_path)
    held, free = world.gpus()[:2]
    hold = {
        "allocationId": "alloc_1",
        "reservationId": "res_1",
        "binding": "BINDING_HOLD",
        "devices": [{"id": held, "deviceClass": "gpu"}],
    }
    async with running(world, world.config()):
        world.plane.apply_spec(world.node_id, {"devices": {"assignments": [hold]}})
        await world.observed(1)
        diag = await world.command(
            world.plane.enqueue(world.node_id, "diag.nvml", world_payload("diag.nvml"))
        )
        assert diag["state"] == "succeeded", diag
        health = wire.DiagNvmlResult.parse(bytes.fromhex(diag["result"]))
        assert len(health.gpus) == 8 and all(g.uuid for g in health.gpus)
        assert diag.get("node_sig"), "an attested kind's result is node-signed"

        busy = await world.command(
            world.plane.enqueue(world.node_id, "gpu.reset", world_payload("gpu.reset", {"gpuUuids": [held]}))
        )
        assert busy["state"] == "failed" and busy["error_code"] == "gpu-busy", busy
        assert "alloc_1" in busy["message"], busy

        ok = await world.command(
            world.plane.enqueue(world.node_id, "gpu.reset", world_payload("gpu.reset", {"gpuUuids": [free]}))
        )
        assert ok["state"] == "succeeded", ok
        result = wire.GpuResetResult.parse(bytes.fromhex(ok["result"]))
        assert [(g.gpu_uuid, g.reset) for g in result.gpus] == [(free, True)]

        empty = await world.command(
            world.plane.enqueue(world.node_id, "gpu.reset", world_payload("gpu.reset", {"gpuUuids": []}))
        )
        assert empty["state"] == "failed" and empty["error_code"] == "invalid-payload", empty


async def test_DLV_JRN_17_REC_07_17_node_reboot_completed_by_the_next_boot(tmp_path: Path) -> None:
    world = World(tmp_path)
    config = world.config()
    boot_file = world.root / "proc/sys/kernel/random/boot_id"
    first_boot = boot_file.read_text().strip()
    async with running(world, config):
        cid = world.plane.enqueue(
            world.node_id, "node.reboot", world_payload("node.reboot", {"reason": "test"})
        )
        await world.until(
            "the reboot requested", lambda: (world.root / "var/lib/bcd-sim/reboot-requested").exists()
        )
        await world.command(cid, ("running",))
    # The host "rebooted": a new boot id; the node starts again and reports the command completed.
    boot_file.write_text("0f0e0d0c-0b0a-4909-8807-060504030201\n")
    world.plane = DevPlane(tmp_path / "dp", listen=None, unix_socket=world.gw)  # the same state, reopened
    async with running(world, config):
        done = await world.command(cid)
    assert done["state"] == "succeeded" and done["reason"] == "rebooted", done
    result = wire.NodeRebootResult.parse(bytes.fromhex(done["result"]))
    assert result.previous_boot_id == first_boot


async def test_DLV_RCV_20_the_stored_spec_is_enforced_with_the_control_plane_gone(tmp_path: Path) -> None:
    """With the control plane gone the node keeps converging the spec it stored: a drift pass while
    disconnected puts a changed sysctl and a deleted CDI spec back, and a node started again with no
    control plane at all converges the journaled spec at its first pass."""
    from bcd_agent.bench.stallproxy import StallProxy

    world = World(tmp_path)
    link = StallProxy(tmp_path / "link.sock", world.gw)  # the node's way to the control plane
    config = world.config(gateway=link.listen)
    hold = {
        "allocationId": "alloc_1",
        "reservationId": "res_1",
        "binding": "BINDING_HOLD",
        "devices": [{"id": world.gpus()[0], "deviceClass": "gpu"}],
    }
    spec = {"host": {"units": [_unit("sysctl", {"vm.swappiness": 10})]}, "devices": {"assignments": [hold]}}
    swappiness = world.root / "proc/sys/vm/swappiness"
    cdi = world.root / "etc/cdi/bcd-alloc_1.json"

    def drift() -> None:
        swappiness.write_text("60\n")
        cdi.unlink()

    def enforced() -> bool:
        return swappiness.read_text().strip() == "10" and cdi.exists()

    options = NodeOptions(root=str(world.root), status_interval_s=0.05, backoff_max_s=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(world.plane.run)
        link_scope = trio.CancelScope()

        async def serve_link(task_status: trio.TaskStatus[None]) -> None:
            with link_scope:
                await link.run(task_status=task_status)

        await nursery.start(serve_link)
        identity = await join(config, token=world.plane.issue_token(), address=f"unix:{world.gw}")
        world.node_id = identity.node_id
        node = Node(config, options)
        await nursery.start(node.run)
        await world.until("the session", lambda: node.core.state.welcomed)
        assert world.plane.apply_spec(world.node_id, spec) == 1
        await world.observed(1)
        assert enforced()

        # The control plane becomes unreachable: the connection drops and no new one can be made.
        link_scope.cancel()
        await world.until("the session lost", lambda: not node.core.state.welcomed)
        assert node.runner.observed_generation == 1
        # The timed passes go on while disconnected: the next is a drift pass at a finite time.
        when, why = node.runner.next_pass()
        assert why == "drift" and when < float("inf")
        drift()
        node.runner.trigger("drift")  # what the drift timer does every drift interval
        await world.until("drift undone while disconnected", enforced)
        assert not node.core.state.welcomed
        nursery.cancel_scope.cancel()

    # A new process with the control plane gone still: the spec comes from the journal alone.
    drift()
    async with trio.open_nursery() as nursery:
        node = Node(config, options)
        await nursery.start(node.run)
        await world.until("the stored spec enforced at start", enforced)
        assert node.runner.spec is not None and node.runner.spec.generation == 1
        assert not node.core.state.welcomed
        nursery.cancel_scope.cancel()


def _heartbeats(world: World) -> list[dict[str, str]]:
    """Every heartbeat the control plane receives: its inventory hashes, in order."""
    seen: list[dict[str, str]] = []
    on_message = world.plane.on_message

    def spy(session: Any, message: wire.NodeMessage) -> None:
        if message.heartbeat is not None:
            seen.append(dict(message.heartbeat.inventory_hashes))
        on_message(session, message)

    world.plane.on_message = spy  # type: ignore[method-assign]
    return seen


async def test_HST_LVL_14_the_heartbeat_right_after_a_host_change_carries_the_new_inventory_hash(
    tmp_path: Path,
) -> None:
    """With the regular heartbeat ten minutes away, a host unit that changes what the inventory reports
    (2 MiB huge pages) still gets a heartbeat to the control plane, carrying the new inventory's hash."""
    world = World(tmp_path)
    seen = _heartbeats(world)
    async with running(world, world.config(), heartbeat_s=600.0):
        first = await world.until("a heartbeat with a hash", lambda: seen and seen[-1].get("inventory"))
        assert first == inventory_hash(collect_inventory(world.system))
        since = len(seen)
        spec = {"host": {"units": [_unit("hugepages", {"pages2m": 64})]}}
        world.plane.apply_spec(world.node_id, spec)
        await world.until("the unit applied", lambda: "64" in (world.root / HP2M).read_text())
        expected = inventory_hash(collect_inventory(world.system))
        assert expected != first
        # The regular heartbeat is ten minutes away: this one is the change's.
        await world.until("a heartbeat with the new hash", lambda: {"inventory": expected} in seen[since:])
        assert all(h["inventory"] in (first, expected) for h in seen[since:])


HP2M = "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"


async def test_HST_HLP_19_units_false_the_inventory_still_reports_what_the_host_has(tmp_path: Path) -> None:
    """Another tool owns the host ([host] units = false): the huge pages and the MIG instance it set up
    are in the inventory (inventory.refresh) and its hash in the heartbeat, as on any node."""
    world = World(tmp_path)
    (world.root / HP2M).write_text("512\n")  # the other tool's pool
    for argv in (
        ["nvidia-smi", "-i", "0", "-mig", "1"],
        ["nvidia-smi", "mig", "-i", "0", "-cgi", "1g.18gb", "-C"],
    ):
        assert world.system.run(argv).ok
    async with running(world, world.config(units=False)) as node:
        assert node.host_section is None
        cid = world.plane.enqueue(world.node_id, "inventory.refresh", world_payload("inventory.refresh"))
        done = await world.command(cid)
        assert done["state"] == "succeeded", done
        result = wire.InventoryRefreshResult.parse(bytes.fromhex(done["result"]))
        pools = {(p.page_size_bytes, p.numa_node): p.total for p in result.inventory.hugepages}
        assert pools[(2 * 1024 * 1024, -1)] == 512
        gpu0 = result.inventory.gpus[0]
        assert gpu0.mig_enabled and [m.profile for m in gpu0.mig_devices] == ["1g.18gb"]
        assert node.core.heartbeat().heartbeat.inventory_hashes == {"inventory": result.inventory_hash}
