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
        assert not caps & {"instance.network-policy", "instance.ssh-host-only", "instance.volumes"}
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
