"""ch.launch and ch.taps with command-signing roots (root's join record names them): root re-validates
the node's vm.json (and the taps' bridges) against the signed spec's instance before anything runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from bcd_shared import wire
from bcd_shared.chunit import VMM_UID_BASE
from bcd_simhost.chapi import CH_BASE_SHA256, lay_out_instance
from helperproc import HelperProcess, assert_refused, base_config, make_root
from intentkit import ControlPlane, intent

GIB = 1 << 30
NODE = "node-ch"
MAC = "52:54:00:00:00:01"  # lay_out_instance's NIC


def body(generation: int, *instances: wire.InstanceSpec) -> bytes:
    spec = wire.NodeSpec(instances=wire.InstancesSection(instances=list(instances)))
    return bytes(
        wire.DesiredStateBody(node_id=NODE, generation=generation, spec_hash=f"h{generation}", full=spec)
    )


def wire_vm(
    vcpus: int = 2, memory: int = GIB, sha: str = CH_BASE_SHA256, state: int = 1, bridge: str = "br0"
) -> Any:
    return wire.InstanceSpec(
        id="vm1",
        allocation_id="alloc-vm1",
        runtime="cloud-hypervisor",
        desired_state=wire.InstanceDesiredState(state),
        size=wire.InstanceSize(vcpus=vcpus, memory_bytes=memory, disk_bytes=10 * GIB),
        image=wire.ImageRef(url="https://images.sim.bcd/x.qcow2", sha256=sha, format="qcow2"),
        nics=[wire.Nic(bridge=bridge, mac=MAC)],
    )


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HelperProcess, ControlPlane]]:
    cp = ControlPlane.build()
    root = make_root(tmp_path_factory.mktemp("chsigned"))
    cp.write_record(root, NODE, cp.bundle(1))
    lay_out_instance(root, "vm1", 4242, VMM_UID_BASE + 1)
    proc = HelperProcess(root, cp.config_lines() + base_config(extra='instance_bridges = "br0,br1"\n'))
    yield proc, cp
    proc.stop()


def _launch(intent_arg: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {"name": "vm1"}
    if intent_arg is not None:
        args["intent"] = intent_arg
    return {"op": "ch.launch", "args": args}


def test_launch_is_revalidated_against_the_signed_spec(signed: tuple[HelperProcess, ControlPlane]) -> None:
    """With roots, ch.launch needs the signed spec; vm.json must match its instance in vCPUs, memory,
    NICs and image, and the instance must be named and not DELETED (DLV-HLP-style re-validation)."""
    h, cp = signed
    signer = cp.command.leaf()
    assert_refused(h, _launch(None), "intent-required")
    assert_refused(h, _launch(intent(signer, body(1))), "not-in-spec")
    assert_refused(h, _launch(intent(signer, body(1, wire_vm(state=4)))), "not-in-spec")
    assert_refused(h, _launch(intent(signer, body(1, wire_vm(vcpus=8)))), "spec-mismatch")
    assert_refused(h, _launch(intent(signer, body(1, wire_vm(memory=2 * GIB)))), "spec-mismatch")
    assert_refused(h, _launch(intent(signer, body(1, wire_vm(sha="e" * 64)))), "spec-mismatch")
    assert_refused(h, _launch(intent(signer, body(1, wire_vm(bridge="br1")))), "spec-mismatch")
    assert_refused(h, _launch(intent(cp.other.leaf(), body(1, wire_vm()))), "bad-intent")
    answer = h.raw(_launch(intent(signer, body(2, wire_vm()))))
    assert answer["ok"] is True, answer
    units = json.loads((h.root / "var/lib/bcd-sim/systemd/units.json").read_text())
    assert units["bcd-ch-vm1.service"]["active"] is True
    assert h.raw({"op": "ch.stop", "args": {"name": "vm1"}})["ok"] is True
    assert_refused(h, _launch(intent(signer, body(1, wire_vm()))), "stale-generation")


def test_taps_are_revalidated_against_the_signed_nics(signed: tuple[HelperProcess, ControlPlane]) -> None:
    """With roots, ch.taps' bridges must be the signed instance's NICs' (both are allowed here)."""
    h, cp = signed
    signer = cp.command.leaf()
    args = {"name": "vm1", "bridges": ["br1"], "intent": intent(signer, body(3, wire_vm()))}
    assert_refused(h, {"op": "ch.taps", "args": args}, "spec-mismatch")
    assert_refused(h, {"op": "ch.taps", "args": {"name": "vm1", "bridges": ["br0"]}}, "intent-required")
