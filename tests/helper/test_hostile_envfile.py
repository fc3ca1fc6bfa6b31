"""An allocation's env file while the latest signed spec lists the allocation (docs/helper.md "Env files of a
listed allocation"). Root's busy check counts every GPU an env file names (round 6b, row 13), and a
workload manager starts jobs under it (NVIDIA's legacy runtime hook reads NVIDIA_VISIBLE_DEVICES). Before
2026-12-02 root refused removing a CDI hold the spec lists (`hold-in-spec`) but took the removal of an env
file whose hold was gone: the node wrote the env file of an allocation the spec gives GPU1 and no hold,
jobs ran on GPU1, the node removed the file, and GPU1 looked free to a signed `gpu.reset`. Now such an env
file stays while it names an atom the spec gives its allocation; one that names only atoms the spec moved
the allocation off (the planner's release before the re-bind) still goes.

The node's real account (realnode.RealNode) against a real `bcd helper serve` with command-signing roots;
then the node's real devices section through a real helper (test_hostile_round6.SignedDevices)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from intentkit import ControlPlane, intent
from realnode import RealNode
from test_hostile_round6 import SignedDevices
from test_signed_holds import GPU1, GPU2, NODE, devices_body, env_doc, remove_doc

ENV = "run/bcd/allocations"


@pytest.fixture(scope="module")
def signed_node(cp: ControlPlane) -> Iterator[RealNode]:
    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    yield node
    node.close()


def test_an_env_file_naming_a_gpu_the_signed_spec_gives_its_allocation_stays_without_its_hold(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """As the node's account: e1's env file names GPU1, which the spec gives e1, and no CDI hold is beside
    it: its removal is refused `hold-in-spec`, the message naming the rule, and the file stays; so under a
    spec giving e1 only a slot of GPU1 (without a hold the file hands the whole GPU). A listed allocation's
    env file root cannot read stays too (it may name any GPU). Once the spec moves e1 to GPU2, the old
    file (GPU1 only) goes; once it no longer lists e2, e2's goes; a missing one is a no-op, taken."""
    worker = cp.command.leaf()
    root = signed_node.root
    spec = intent(worker, devices_body(2, {"e1": [GPU1]}))
    signed_node.ok(env_doc("e1", f"BCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES={GPU1}\n", spec))
    assert not (root / "etc/cdi/bcd-e1.json").exists()
    answer = signed_node.refused(remove_doc("allocation-env", "e1", spec), "hold-in-spec")
    assert answer["message"] == (
        "allocation-env: allocation e1 is still in the signed spec's devices section (generation 2): its env "
        "file names a GPU the spec gives it (or cannot be read), so it stays"
    )
    assert (root / ENV / "e1.env").exists()
    slot = intent(worker, devices_body(3, {"e1": [f"{GPU1}/s1"]}))
    signed_node.refused(remove_doc("allocation-env", "e1", slot), "hold-in-spec", "names a GPU")
    (root / ENV / "e2.env").write_bytes(b"not an env file\n")  # as root: what the node cannot read
    moved = intent(worker, devices_body(4, {"e1": [GPU2], "e2": [GPU1]}))
    signed_node.refused(remove_doc("allocation-env", "e2", moved), "hold-in-spec", "cannot be read")
    assert signed_node.ok(remove_doc("allocation-env", "e1", moved))["removed"] is True
    assert not (root / ENV / "e1.env").exists()
    released = intent(worker, devices_body(5, {"e1": [GPU2]}))
    assert signed_node.ok(remove_doc("allocation-env", "e2", released))["removed"] is True
    assert signed_node.ok(remove_doc("allocation-env", "e1", released))["removed"] is False


@pytest.fixture
def devices(tmp_path: Path, cp: ControlPlane) -> Iterator[SignedDevices]:
    d = SignedDevices(tmp_path, cp)
    try:
        yield d
    finally:
        d.helper.stop()


def test_a_slot_moved_to_another_slot_of_its_gpu_converges_its_env_file_written_over(
    devices: SignedDevices,
) -> None:
    """The honest side: the spec moves allocation a from slot 0 to slot 1 of GPU 0. The slots share no
    atom, so the node's planner releases the old hold and binds the new in one pass (Q-DEV-PASS-01); the
    old env file names GPU 0, which the new slot is on, so root would refuse its removal: the planner leaves
    it to the bind, which writes it over. Converged in that pass with nothing refused, and the pass after
    writes nothing."""
    from bcd_agent.converge.types import SectionState
    from bcd_simhost.gpus import gpu_uuid

    g0 = gpu_uuid(0)

    def held() -> list[str]:
        doc = json.loads((devices.root / "etc/cdi/bcd-a.json").read_text())
        return [d["annotations"]["bcd.dev/device-id"] for d in doc["devices"]]

    assert devices.converge(1, {"a": [f"{g0}/s0"]}) is SectionState.CONVERGED
    assert held() == [f"{g0}/s0"]
    assert devices.converge(2, {"a": [f"{g0}/s1"]}) is SectionState.CONVERGED
    assert held() == [f"{g0}/s1"]
    assert [a for a in devices.audit() if a["decision"] == "refused"] == []
    env = (devices.root / ENV / "a.env").read_text().splitlines()
    assert f"NVIDIA_VISIBLE_DEVICES={g0}" in env
    ops = devices.file_ops()
    assert devices.converge(2, {"a": [f"{g0}/s1"]}) is SectionState.CONVERGED
    assert devices.file_ops() == ops
