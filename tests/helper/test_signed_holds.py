"""Issue 9 item 8: limits on the files root writes for holds, and holds bound to the signed devices section.

A real node account (realnode.RealNode) against a real helper over a simulated host whose vendor CDI spec
names GPU 0 (`/dev/nvidia0`) and GPU 1 (`/dev/nvidia1`) by index and UUID.
- Without roots: at most 1024 files and 32 MiB (cdi) / 8 MiB (allocation-env, each at most 64 KiB) per
  kind; a replacement counts in place of the file it replaces.
- With roots (root's join record): a hold write needs the signed spec, its allocation must be in the
  spec's devices section, a cdi hold's devices must be that allocation's atoms each with its own GPU's
  vendor edits, and a hold the spec still lists cannot be removed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_shared import wire
from intentkit import ControlPlane, b64, devices_spec, hold_text, intent
from realnode import RealNode

NODE = "node-a"
GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"
ENV_DIR = "run/bcd/allocations"


def env_doc(ident: str, extra: str = "", signed: dict[str, Any] | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": "allocation-env",
        "id": ident,
        "content": f"BCD_ALLOCATION_ID={ident}\n{extra}",
    }
    if signed is not None:
        args["intent"] = signed
    return {"op": "file.write", "args": args}


def hold(ident: str, atoms: list[tuple[str, str]]) -> str:
    """A hold for `ident` whose devices are (atom id, device node path) pairs."""
    devices = [(atom, {"deviceNodes": [{"path": node}]}) for atom, node in atoms]
    return hold_text(ident, devices, [f"BCD_ALLOCATION_ID={ident}"])


def cdi_doc(ident: str, content: str, signed: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {"kind": "cdi", "id": ident, "content": content}
    if signed is not None:
        args["intent"] = signed
    return {"op": "file.write", "args": args}


def remove_doc(kind: str, ident: str, signed: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {"kind": kind, "id": ident}
    if signed is not None:
        args["intent"] = signed
    return {"op": "file.remove", "args": args}


def atom_class(atom: str) -> str:
    return "gpu.mig" if "/gi" in atom else "gpu.slot" if "/s" in atom else "gpu"


def devices_body(generation: int, assignments: dict[str, list[str]]) -> bytes:
    section = wire.DevicesSection(
        assignments=[
            wire.DeviceAssignment(
                allocation_id=a,
                reservation_id="r1",
                binding=wire.Binding.HOLD,
                devices=[wire.DeviceAtom(id=g, device_class=atom_class(g)) for g in gpus],
            )
            for a, gpus in assignments.items()
        ]
    )
    return devices_spec(NODE, generation, section)


def test_issue9_item8_env_and_cdi_files_are_bounded_per_kind() -> None:
    def plant(root: Path) -> None:
        d = root / ENV_DIR
        d.mkdir(parents=True, exist_ok=True)
        for i in range(1023):  # as if written before: 1023 small env files
            (d / f"p{i}.env").write_text(f"BCD_ALLOCATION_ID=p{i}\n")

    node = RealNode(setup=plant)
    try:
        node.refused(env_doc("big", "X=" + "a" * 64 * 1024 + "\n"), "too-large")
        node.ok(env_doc("a1024"))  # the 1024th
        node.refused(env_doc("a1025"), "too-many-files")
        node.ok(env_doc("p7", "EXTRA=1\n"))  # a replacement does not add a file
        (node.root / ENV_DIR / "p0.env").write_bytes(b"x" * (8 * 1024 * 1024 - 64 * 1024))
        node.ok(remove_doc("allocation-env", "p1", None))
        node.refused(env_doc("a2000", "X=" + "a" * 60 * 1024 + "\n"), "too-many-files", "bytes in all")
        for i in range(2, 40):
            (node.root / "etc/cdi" / f"bcd-q{i}.json").write_bytes(b"{}" + b" " * (1024 * 1024 - 8))
        node.refused(
            cdi_doc("c1", hold("c1", [(GPU1, "/dev/nvidia0")]), None), "too-many-files", "bytes in all"
        )
    finally:
        node.close()


@pytest.fixture(scope="module")
def signed_node(cp: ControlPlane) -> Iterator[RealNode]:
    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    yield node
    node.close()


def test_issue9_item8_holds_are_bound_to_the_signed_devices_section(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    worker = cp.command.leaf()
    spec = intent(worker, devices_body(2, {"a1": [GPU1]}))
    good = hold("a1", [(GPU1, "/dev/nvidia0")])
    signed_node.refused(cdi_doc("a1", good, None), "intent-required")
    signed_node.refused(env_doc("a1"), "intent-required")
    unsigned = {"body": spec["body"], "signature": "", "chain": [], "trust_bundle": None}
    signed_node.refused(cdi_doc("a1", good, unsigned), "bad-intent")
    # An invented allocation.
    signed_node.refused(cdi_doc("a9", hold("a9", [(GPU1, "/dev/nvidia0")]), spec), "not-in-spec")
    signed_node.refused(env_doc("a9", signed=spec), "not-in-spec")
    # Atoms outside the allocation, and a device carrying another GPU's device node.
    signed_node.refused(
        cdi_doc("a1", hold("a1", [(GPU1, "/dev/nvidia0"), (GPU2, "/dev/nvidia1")]), spec), "atoms-outside"
    )
    signed_node.refused(
        cdi_doc("a1", hold("a1", [(GPU1, "/dev/nvidia1")]), spec), "atoms-outside", "/dev/nvidia1"
    )
    every = hold("a1", [(GPU1, "/dev/nvidia0")])
    doc = json.loads(every)
    doc["containerEdits"]["deviceNodes"] = [{"path": "/dev/nvidia1"}]  # spec-level: every container gets it
    signed_node.refused(cdi_doc("a1", json.dumps(doc), spec), "atoms-outside")
    # The allocation's own hold.
    signed_node.ok(cdi_doc("a1", good, spec))
    signed_node.ok(env_doc("a1", signed=spec))
    # The spec still lists a1: its hold cannot be removed (then its GPU reset).
    signed_node.refused(remove_doc("cdi", "a1", spec), "hold-in-spec")
    signed_node.refused(remove_doc("allocation-env", "a1", spec), "hold-in-spec")
    signed_node.refused(remove_doc("cdi", "a1", None), "intent-required")
    # A newer spec without a1 releases it; the older one cannot come back.
    released = intent(worker, devices_body(3, {}))
    assert signed_node.ok(remove_doc("cdi", "a1", released))["removed"] is True
    assert signed_node.ok(remove_doc("allocation-env", "a1", released))["removed"] is True
    signed_node.refused(cdi_doc("a1", good, spec), "stale-generation")


def test_issue9_item8_signed_spec_bytes_are_the_kept_ones(signed_node: RealNode, cp: ControlPlane) -> None:
    """The body travels as received: one flipped byte in it is refused (never re-encoded by root)."""
    worker = cp.command.leaf()
    body = devices_body(5, {"b1": [GPU2]})
    spec = intent(worker, body)
    tampered = dict(spec, body=b64(body[:-1] + bytes([body[-1] ^ 1])))
    signed_node.refused(env_doc("b1", signed=tampered), "bad-intent")
    signed_node.ok(env_doc("b1", signed=spec))


def test_a_mig_hold_carries_only_its_own_mig_device(signed_node: RealNode, cp: ControlPlane) -> None:
    """Red team round 5's open item, closed: a signed MIG hold's device carries the vendor's edits of its own
    MIG device only (by `<index>:<n>` or its MIG UUID, which root maps from the atom's GPU and compute
    instance ids with its own `nvidia-smi -L` and `-q -x`), never those of another MIG device on the same
    GPU (another tenant's nvidia-caps); and NVIDIA_VISIBLE_DEVICES names its own MIG UUID only."""
    from bcd_agent.inventory.gpus import collect_gpus
    from bcd_simhost import sim_system

    gpu = next(g for g in collect_gpus(sim_system(signed_node.root)).gpus if len(g.migs) >= 2)
    mine, other = gpu.migs[0], gpu.migs[1]
    assert mine.uuid and other.uuid
    vendor = json.loads((signed_node.root / "etc/cdi/nvidia.json").read_text())
    edits = {d["name"]: d["containerEdits"] for d in vendor["devices"]}
    assert edits[f"{gpu.index}:{mine.index}"] != edits[f"{gpu.index}:{other.index}"]
    atom = f"{gpu.uuid}/gi{mine.gpu_instance}/ci{mine.compute_instance}"

    def mig_hold(device_edits: dict[str, Any]) -> str:
        return hold_text("m1", [(atom, device_edits)], ["BCD_ALLOCATION_ID=m1"])

    spec = intent(cp.command.leaf(), devices_body(10, {"m1": [atom]}))
    for name in (f"{gpu.index}:{other.index}", other.uuid):  # the GPU's other MIG device
        signed_node.refused(cdi_doc("m1", mig_hold(edits[name]), spec), "atoms-outside", "nvidia-cap")
    signed_node.refused(env_doc("m1", f"NVIDIA_VISIBLE_DEVICES={other.uuid}\n", spec), "env-outside")
    signed_node.ok(cdi_doc("m1", mig_hold(edits[f"{gpu.index}:{mine.index}"]), spec))
    signed_node.ok(cdi_doc("m1", mig_hold(edits[mine.uuid]), spec))
    signed_node.ok(env_doc("m1", f"NVIDIA_VISIBLE_DEVICES={mine.uuid}\n", spec))


def test_the_no_roots_fast_path_names_roots_own_files() -> None:
    """ops/base.py repeats two paths so that unsigned hold writes never import pki: they must be the same."""
    from bcd_helper.intent import STATE_PATH
    from bcd_helper.ops.base import INTENT_STATE_PATH, JOIN_RECORD_PATH
    from bcd_shared.joinrecord import JOIN_RECORD

    assert (JOIN_RECORD_PATH, INTENT_STATE_PATH) == (JOIN_RECORD, STATE_PATH)
