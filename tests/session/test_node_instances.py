"""`bcd node` with the instances section on the simulated host (its file-backed libvirt-kvm): Hello
advertises the runtime and only the capabilities bcd enforces, the VM runs beside a hold, and the
status report lists it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bcd_shared import wire
from test_node_wiring import World, running

REPO = Path(__file__).resolve().parents[2]


async def test_hello_runtimes_and_a_vm_reported_running_dlv_rt_06_dlv_cap_05(tmp_path: Path) -> None:
    """DLV-RT-06, DLV-CAP-03, DLV-CAP-05, DLV-INST-15: Hello names libvirt-kvm and instance.placement
    (and no capability bcd does not enforce); StatusReport.instances lists the VM RUNNING, complete."""
    world = World(tmp_path)
    hellos: list[wire.Hello] = []
    opened = world.plane.open_session

    def recording(hello: wire.Hello, send: Any) -> Any:
        hellos.append(hello)
        return opened(hello, send)

    world.plane.open_session = recording  # type: ignore[method-assign]
    spec = json.loads((REPO / "examples/vm-node.json").read_text())
    async with running(world, world.config()) as node:
        assert hellos and list(hellos[-1].runtimes) == ["libvirt-kvm"]
        caps = set(hellos[-1].capabilities)
        assert "instance.placement" in caps
        # Only what this host enforces (DLV-CAP-05): the simulated host loads no nft rules, so neither
        # network capability; its volume store exists, so volumes are advertised.
        assert not caps & {"instance.network-policy", "instance.ssh-host-only"}
        assert ("instance.volumes" in caps) is node.instances_section.volumes.exists()
        assert world.plane.apply_spec(world.node_id, spec) == 1
        await world.observed(1)
        assert world.section("instances")["state"] == "SECTION_STATE_CONVERGED", world.section("instances")
        status = world.record()["status"]
        assert status["instancesComplete"] is True
        [inst] = status["instances"]
        assert (inst["instanceId"], inst["state"], inst["managed"]) == (
            "vm-gpu-0001",
            "INSTANCE_STATE_RUNNING",
            True,
        )
        assert node.instances_section is not None


async def test_bcd_status_shows_the_vm_holding_its_gpu(tmp_path: Path) -> None:
    """The node publishes the GPUs its instances pass through in status.json (`passthrough`), and
    `bcd status` shows the VM's GPU held by the instance, not free; the hold's GPUs keep their
    allocation."""
    import sys

    import trio
    from bcd_agent.statusfile import read_status

    world = World(tmp_path)
    spec = json.loads((REPO / "examples/vm-node.json").read_text())
    [vm_gpu] = spec["instances"]["instances"][0]["gpuUuids"]
    async with running(world, world.config()):
        assert world.plane.apply_spec(world.node_id, spec) == 1
        await world.observed(1)

        def published() -> object:
            view = read_status(world.data)
            return view is not None and view.extra.get("passthrough") == {vm_gpu: "vm-gpu-0001"}

        await world.until("passthrough in status.json", published)
        argv = [sys.executable, "-m", "bcd_agent.cli", "status", "--json"]
        argv += ["--root", str(world.root), "--data-dir", str(world.data)]
        env = {"PATH": "/usr/bin:/bin", "BCD_CONFIG": "/nonexistent/bcd-config.toml"}
        res = await trio.run_process(argv, capture_stdout=True, check=False, env=env)
    rows = {r["device"]: r for r in json.loads(res.stdout)["holders"]}
    assert (rows[vm_gpu]["holder"], rows[vm_gpu]["instance"]) == (None, "vm-gpu-0001")
    held = spec["devices"]["assignments"][0]["devices"]
    assert {rows[d["id"]]["holder"] for d in held} == {"alloc_train_0001"}
    assert all(r["instance"] is None for d, r in rows.items() if d != vm_gpu)
