"""Round 6 of the red team against the root helper (docs/helper.md, "Threat model, round 6"): the node's
account, compromised, against the code no red team had seen (the MIG hold check, signed holds and env files,
the access ops, the signed commands, the instances' ops). Each attack runs as a real unprivileged account
(`useradd` + `setpriv`, realnode.RealNode) against a real `bcd helper serve` over a simulated host; each test
failed on the code before its fix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from intentkit import ControlPlane, hold_text, intent
from realnode import RealNode
from test_signed_holds import NODE, cdi_doc, devices_body, env_doc


@pytest.fixture(scope="module")
def signed_node(cp: ControlPlane) -> Iterator[RealNode]:
    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    yield node
    node.close()


def _mig_gpu(node: RealNode) -> Any:
    from bcd_agent.inventory.gpus import collect_gpus
    from bcd_simhost import sim_system

    return next(g for g in collect_gpus(sim_system(node.root)).gpus if len(g.migs) >= 2)


def test_round6_a_mig_hold_never_takes_its_whole_parent_gpu(signed_node: RealNode, cp: ControlPlane) -> None:
    """A signed allocation holding one MIG device of a GPU (the GPU's other MIG devices are other tenants'):
    root took the parent GPU's whole-device vendor edits (`<index>` or the GPU's UUID: its DRM nodes) in the
    MIG hold device, and `NVIDIA_VISIBLE_DEVICES=<the parent GPU's UUID>` (the runtime hook then hands the
    container the whole GPU) in the CDI hold and the env file. The node's planner names only the MIG
    device (`vendor_names`, `visible_name`), so root now takes only that: `atoms-outside`, `env-outside`."""
    gpu = _mig_gpu(signed_node)
    mine = gpu.migs[0]
    assert mine.uuid
    vendor = json.loads((signed_node.root / "etc/cdi/nvidia.json").read_text())
    edits = {d["name"]: d["containerEdits"] for d in vendor["devices"]}
    atom = f"{gpu.uuid}/gi{mine.gpu_instance}/ci{mine.compute_instance}"
    spec = intent(cp.command.leaf(), devices_body(20, {"w1": [atom]}))

    def mig_hold(device_edits: dict[str, Any], env: tuple[str, ...] = ()) -> str:
        return hold_text("w1", [(atom, device_edits)], ["BCD_ALLOCATION_ID=w1", *env])

    for name in (str(gpu.index), gpu.uuid):  # the parent GPU's whole-device entry
        assert edits[name] != edits[mine.uuid]
        signed_node.refused(cdi_doc("w1", mig_hold(edits[name]), spec), "atoms-outside", "/dev/dri")
    whole = (f"NVIDIA_VISIBLE_DEVICES={gpu.uuid}",)
    signed_node.refused(cdi_doc("w1", mig_hold(edits[mine.uuid], whole), spec), "env-outside")
    signed_node.refused(env_doc("w1", whole[0] + "\n", spec), "env-outside")
    # What the planner writes is still taken.
    signed_node.ok(cdi_doc("w1", mig_hold(edits[mine.uuid], (f"NVIDIA_VISIBLE_DEVICES={mine.uuid}",)), spec))
    signed_node.ok(env_doc("w1", f"NVIDIA_VISIBLE_DEVICES={mine.uuid}\n", spec))


def test_round6_a_signed_hold_carries_every_atom_so_no_held_gpu_looks_free(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """The spec gives allocation w2 GPU1 and GPU2. Root's busy check (gpu.reset) reads the hold files, and
    removing a hold the spec lists is refused (issue 9 item 8), but rewriting it with GPU1 only was taken
    (each device had to be an atom of the allocation, not every atom a device): GPU2 then looked free and a
    signed gpu.reset naming it pulled it from under the tenant's workload. Now a signed hold carries each of
    its allocation's atoms exactly once (`atoms-missing`), as the planner writes it."""
    from bcd_shared import wire
    from test_signed_commands import command, reset

    g1, g2 = "GPU-5f1c2a90-0000-4000-8000-000000000001", "GPU-5f1c2a90-0000-4000-8000-000000000002"
    worker = cp.command.leaf()
    spec = intent(worker, devices_body(21, {"w2": [g1, g2]}))
    full = hold_text(
        "w2", [(g1, {"deviceNodes": [{"path": "/dev/nvidia0"}]}), (g2, None)], ["BCD_ALLOCATION_ID=w2"]
    )
    signed_node.ok(cdi_doc("w2", full, spec))
    partial = hold_text("w2", [(g1, {"deviceNodes": [{"path": "/dev/nvidia0"}]})], ["BCD_ALLOCATION_ID=w2"])
    signed_node.refused(cdi_doc("w2", partial, spec), "atoms-missing", g2)
    twice = hold_text("w2", [(g1, None), (g1, None), (g2, None)], ["BCD_ALLOCATION_ID=w2"])
    refused = signed_node.call(cdi_doc("w2", twice, spec))
    assert refused["ok"] is False, refused
    # The hold still names GPU2: a signed reset of it is root's gpu-busy.
    signed = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[g2]))
    signed_node.refused(reset([g2], signed), "gpu-busy", "w2")
