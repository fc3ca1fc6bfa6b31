"""Round 6 of the red team against the root helper (docs/helper.md, "Threat model, round 6"): the node's
account, compromised, against the code no red team had seen (the MIG hold check, signed holds and env files,
the access ops, the signed commands, the instances' ops). Each attack runs as a real unprivileged client (a
`useradd` account through `setpriv`, realnode.RealNode, or a forked child dropped to the node's uid,
hostilekit.as_node: SO_PEERCRED sees that uid) against a real `bcd helper serve` over a simulated host; each
test failed on the code before its fix. The tests on `signed_node` share one helper and run in file order
(the signed generations grow from test to test)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hostilekit import vm_hwm_kib
from intentkit import ControlPlane, devices_spec, hold_text, intent
from realnode import RealNode
from test_signed_holds import NODE, atom_class, cdi_doc, devices_body, env_doc, remove_doc


@pytest.fixture(scope="module")
def signed_node(cp: ControlPlane) -> Iterator[RealNode]:
    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    yield node
    node.close()


def _clear(node: RealNode, spec: dict[str, Any]) -> None:
    """Remove the holds and env files earlier tests of this module left, under `spec` (which does not list
    them): the module shares one helper, and root refuses a hold naming an atom another hold or env file
    names (row 7)."""
    for ident in ("w1", "w2", "w3", "w4", "w6", "w7", "w8", "w9", "w10", "w11"):
        for kind in ("cdi", "allocation-env"):
            node.ok({"op": "file.remove", "args": {"kind": kind, "id": ident, "intent": spec}})


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
    # Refused before this round too: NVIDIA's hook grants MIG management (create and destroy the GPU's
    # instances, other tenants' among them) on these env keys.
    for line in ("NVIDIA_MIG_CONFIG_DEVICES=all", "NVIDIA_MIG_MONITOR_DEVICES=all"):
        signed_node.refused(cdi_doc("w1", mig_hold(edits[mine.uuid], (line,)), spec), "env-outside")
        signed_node.refused(env_doc("w1", line + "\n", spec), "env-outside")
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
    _clear(signed_node, intent(worker, devices_body(21, {})))
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


def _sliced_body(generation: int) -> bytes:
    """w3: a sliced hold of GPU1 (it booked memory); w4: a plain hold of GPU2, no slice."""
    from bcd_shared import wire

    def assignment(ident: str, gpu: str, limits: Any) -> Any:
        return wire.DeviceAssignment(
            allocation_id=ident,
            reservation_id=f"r-{ident}",
            binding=wire.Binding.HOLD,
            devices=[wire.DeviceAtom(id=gpu, device_class="gpu")],
            limits=limits,
        )

    section = wire.DevicesSection(
        assignments=[
            assignment("w3", GPU1, wire.DeviceLimits(memory_bytes=1 << 30)),
            assignment("w4", GPU2, None),
        ]
    )
    return devices_spec(NODE, generation, section)


GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"


def _annotated(ident: str, gpu: str, parent: str | None, **annotations: str | None) -> str:
    env = [f"BCD_ALLOCATION_ID={ident}"] + ([f"BCD_CGROUP_PARENT={parent}"] if parent else [])
    doc = json.loads(hold_text(ident, [(gpu, None)], env, cgroup_parent=parent))
    doc["annotations"]["bcd.dev/reservation-id"] = f"r-{ident}"
    for key, value in annotations.items():
        name = "bcd.dev/" + key.replace("_", "-")
        if value is None:
            doc["annotations"].pop(name, None)
        else:
            doc["annotations"][name] = value
    return json.dumps(doc)


def test_round6_a_signed_holds_annotations_are_the_assignments(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """Round 5 bound a signed hold's env (BCD_CGROUP_PARENT among it) to the assignment, but not the hold's
    annotations, which say the same things to other readers: `bcd.dev/cgroup-parent` (where containerd,
    Slurm or a wrapper places the workload: another tenant's slice, or none, so the booked limits do not
    apply), `bcd.dev/binding: kubernetes` (how the device plugins find what to advertise to the kubelet:
    a HOLD's GPUs offered to pods) and `bcd.dev/reservation-id`; any other key was taken too. Now each is
    the value root derives from the signed assignment, and no other key (`annotations-outside`)."""
    spec = intent(cp.command.leaf(), _sliced_body(22))
    _clear(signed_node, intent(cp.command.leaf(), devices_body(22, {})))
    own = "bcd-alloc-w3.slice"
    signed_node.ok({"op": "slice.apply", "args": {"name": own, "memory_bytes": 1 << 30, "intent": spec}})
    signed_node.ok(cdi_doc("w3", _annotated("w3", GPU1, own), spec))
    signed_node.ok(cdi_doc("w4", _annotated("w4", GPU2, None), spec))
    for ident, gpu, parent, extra in (
        ("w3", GPU1, own, {"cgroup_parent": "bcd-alloc-w4.slice"}),  # another allocation's slice
        ("w3", GPU1, own, {"cgroup_parent": "system.slice"}),
        ("w3", GPU1, own, {"cgroup_parent": None}),  # no slice: the booked limits never apply
        ("w4", GPU2, None, {"cgroup_parent": own}),  # an unsliced hold in w3's slice
        ("w4", GPU2, None, {"binding": "kubernetes"}),  # a HOLD's GPU advertised to the kubelet
        ("w3", GPU1, own, {"reservation_id": "r-w4"}),
        ("w3", GPU1, own, {"runtime_class": "x"}),  # a key root does not know
    ):
        signed_node.refused(
            cdi_doc(ident, _annotated(ident, gpu, parent, **extra), spec), "annotations-outside"
        )
    doc = json.loads(_annotated("w4", GPU2, None))
    doc["devices"][0]["annotations"]["bcd.dev/extra"] = "1"  # a device's annotations: only its atom id
    signed_node.refused(cdi_doc("w4", json.dumps(doc), spec), "annotations-outside")


def test_round6_roots_annotation_rule_takes_what_the_node_plans() -> None:
    """The annotation rule above must take every hold the node's planner writes: a plain hold, a sliced
    one, a Kubernetes one with limits (no slice), each against the wire assignment root reads."""
    from bcd_agent.inventory.gpus import Gpu, GpuHealth, GpuInventory
    from bcd_agent.sections.devices import plan as planner
    from bcd_agent.sections.devices.model import assignment_from_wire
    from bcd_helper.ops.files import _check_annotations
    from bcd_shared import wire

    def gpu(i: int, uuid: str) -> Gpu:
        return Gpu(i, uuid, "NVIDIA H200", f"00000000:{i + 1:02X}:00.0", i, i, 143771, False, (),
                   GpuHealth(0, False, False))  # fmt: skip

    inventory = GpuInventory((gpu(0, GPU1), gpu(1, GPU2)), "590.48.01", True)
    limits = wire.DeviceLimits(memory_bytes=1 << 30)
    seen = set()
    for binding, lim in (
        (wire.Binding.HOLD, None),
        (wire.Binding.HOLD, limits),
        (wire.Binding.KUBERNETES, limits),
    ):
        asg = wire.DeviceAssignment(
            allocation_id="al1",
            reservation_id="rsv1",
            binding=binding,
            devices=[
                wire.DeviceAtom(id=GPU1, device_class="gpu"),
                wire.DeviceAtom(id=GPU2, device_class="gpu"),
            ],
            limits=lim,
        )
        model = assignment_from_wire(asg)
        doc, _lines = planner.hold_files(
            model, planner._atoms_of(model), 3, planner.Observed(inventory=inventory)
        )
        _check_annotations("al1", doc, asg)
        seen.add(tuple(sorted(doc["annotations"])))
    assert len(seen) == 3  # the three shapes differ (cgroup-parent, binding)


def _many_assignments(n: int) -> bytes:
    """A DesiredStateBody whose devices section holds `n` empty assignments: two bytes each on the wire,
    hundreds of bytes each once decoded. Built by hand: it is never signed."""

    def varint(v: int) -> bytes:
        out = b""
        while v > 0x7F:
            out += bytes([(v & 0x7F) | 0x80])
            v >>= 7
        return out + bytes([v])

    assignments = b"\x0a\x00" * n  # DevicesSection.assignments (1), empty
    devices = b"\x12" + varint(len(assignments)) + assignments  # NodeSpec.devices (2)
    return b"\x0a\x01n\x10\x01" + b"\x22" + varint(len(devices)) + devices  # node_id, generation, full (4)


def test_round6_an_unsigned_access_spec_is_refused_before_root_decodes_it(tmp_path: Path) -> None:
    """Without command-signing roots and without `[helper] unsigned_access`, access.apply is refused
    (`access-unsigned`), but root decoded the node's unverified spec body first: 2.7 MiB of empty
    assignments (base64 in one 4 MiB frame, inside the in-flight budget) took the helper from ~26 MiB to
    ~340 MiB resident and 5 s of CPU under the `access` lock, for a request refused anyway, again at
    every request. The refusal now comes before any decoding; the helper's peak stays under a generous
    100 MiB (the bench's bomb target)."""
    import base64

    from helperproc import HelperProcess, base_config, make_root
    from hostilekit import NODE_GID, NODE_UID, refused_as_node, verify_audit

    h = HelperProcess(make_root(tmp_path), base_config(NODE_UID, NODE_GID))
    try:
        body = base64.b64encode(_many_assignments(1_400_000)).decode()
        doc = {"op": "access.apply", "args": {"intent": {"body": body, "signature": ""}}}
        refused_as_node(h, doc, "access-unsigned")
        assert vm_hwm_kib(h.proc.pid) < 100 * 1024
        verify_audit(h)
    finally:
        h.stop()


def _node_owned(path: Path, data: bytes | None = None) -> None:
    from hostilekit import NODE_GID, NODE_UID

    if data is None:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o711)
    else:
        path.write_bytes(data)
        path.chmod(0o600)
    os.chown(path, NODE_UID, NODE_GID)


def test_round6_json_the_node_hands_root_is_value_counted_before_decoding(tmp_path: Path) -> None:
    """Issue 9 item 3 bounds the values of a request frame before decoding it, but a hold's content is one
    string of the frame and the node's `vm.json` is a file root reads: root decoded either whole. A 1 MiB
    hold of 350,000 empty objects took the helper from ~26 MiB to ~81 MiB resident (refused `bad-content`
    only after decoding); 56 such holds with 8 `host.unit` settings bombs at once reached ~104 MiB, past
    the 100 MiB the bench's bomb target holds; `ch.launch` decodes a 1 MiB `vm.json` the same way. Now a
    hold's content is refused past 65,536 values (four times the values of NVIDIA's whole spec for a
    DGX A100 with MIG) and `vm.json` past 16,384, counted on the bytes before decoding: the helper's peak
    stays under 60 MiB."""
    from helperproc import HelperProcess, base_config, make_root
    from hostilekit import NODE_GID, NODE_UID, refused_as_node, verify_audit

    root = make_root(tmp_path)
    objects = b"[" + b"{}," * 349_000 + b"{}]"
    data = root / "var/lib/bcd"
    for d in (data, data / "cloud-hypervisor", data / "cloud-hypervisor/instances"):
        _node_owned(d)
    inst = data / "cloud-hypervisor/instances/vm1"
    _node_owned(inst)
    _node_owned(inst / "vm.json", objects)
    h = HelperProcess(root, base_config(NODE_UID, NODE_GID))
    try:
        hold = {"op": "file.write", "args": {"kind": "cdi", "id": "a1", "content": objects.decode()}}
        refused_as_node(h, hold, "bad-content", "values")
        assert vm_hwm_kib(h.proc.pid) < 60 * 1024
        refused_as_node(h, {"op": "ch.launch", "args": {"name": "vm1"}}, "bad-record", "values")
        assert vm_hwm_kib(h.proc.pid) < 60 * 1024
        verify_audit(h)
    finally:
        h.stop()


def test_round6_a_signed_sliced_hold_never_runs_without_its_slice(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """With roots, slice.apply takes only the signed limits (round 5), but nothing made the node create
    the slice, or keep it: a hold whose CDI spec names `bcd-alloc-w5.slice` was written with no slice
    started, and `slice.remove` stopped an empty slice while its hold still named it. Either way a workload
    manager's next job under that parent makes systemd create the slice again without limits: the hold
    outgrows what capacity placed. Now a signed hold of a sliced assignment is written only once root
    sees its slice started (`slice-missing`), and with roots a slice is not stopped while its hold file
    exists (`hold-exists`); the node removes the hold first, which the spec must have released."""
    remove = {"op": "slice.remove", "args": {"name": "bcd-alloc-w3.slice"}}
    # From no hold and no slice (an earlier test of this module wrote w3's hold).
    released = intent(cp.command.leaf(), _sliced_body_without_w3(31))
    signed_node.ok({"op": "file.remove", "args": {"kind": "cdi", "id": "w3", "intent": released}})
    signed_node.ok(remove)
    spec = intent(cp.command.leaf(), _sliced_body(32))
    hold = cdi_doc("w3", _annotated("w3", GPU1, "bcd-alloc-w3.slice"), spec)
    signed_node.refused(hold, "slice-missing", "bcd-alloc-w3.slice")
    env = env_doc("w3", "BCD_CGROUP_PARENT=bcd-alloc-w3.slice\n", spec)  # a workload manager reads it too
    signed_node.refused(env, "slice-missing", "bcd-alloc-w3.slice")
    apply = {
        "op": "slice.apply",
        "args": {"name": "bcd-alloc-w3.slice", "memory_bytes": 1 << 30, "intent": spec},
    }
    signed_node.ok(apply)
    signed_node.ok(hold)
    signed_node.ok(env)
    signed_node.refused(remove, "hold-exists", "bcd-w3.json")
    # Root reads the hold decoded: the slice's name behind a JSON escape still names it.
    escaped = json.loads(json.dumps(hold))
    content = hold["args"]["content"]
    escaped["args"]["content"] = content.replace("bcd-alloc-w3.slice", "bcd-alloc-w3\\u002eslice")
    assert escaped["args"]["content"] != hold["args"]["content"]
    signed_node.ok(escaped)
    signed_node.refused(remove, "hold-exists", "bcd-w3.json")
    released = intent(cp.command.leaf(), _sliced_body_without_w3(33))
    signed_node.ok({"op": "file.remove", "args": {"kind": "cdi", "id": "w3", "intent": released}})
    signed_node.refused(remove, "hold-exists", "w3.env")
    signed_node.ok({"op": "file.remove", "args": {"kind": "allocation-env", "id": "w3", "intent": released}})
    assert signed_node.ok(remove)["stopped"] is True


def _sliced_body_without_w3(generation: int) -> bytes:
    from bcd_shared import wire

    body = wire.DesiredStateBody().parse(_sliced_body(generation))
    body.full.devices.assignments = [a for a in body.full.devices.assignments if a.allocation_id != "w3"]
    return bytes(body)


def test_round6_a_signed_hold_never_names_an_atom_another_hold_still_names(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """The spec at generation 40 gives GPU2 to w6; the one at 41 moves it to w7 (w6 released). The node
    writes w7's hold and keeps w6's file: root refuses removing a hold the spec lists, but nothing makes
    the node remove one the spec released, and w7's hold was written beside it. w6's tenant kept its CDI
    device for GPU2 while w7's tenant ran on it. Now a signed hold naming an atom that another allocation's
    hold file names (the same atom, or a whole GPU and any atom of it) is refused (`atoms-held`, naming
    the other hold): the node's planner releases before it binds, so it removes w6's first."""
    worker = cp.command.leaf()
    _clear(signed_node, intent(worker, devices_body(40, {})))
    first = intent(worker, devices_body(40, {"w6": [GPU2]}))
    signed_node.ok(cdi_doc("w6", _annotated("w6", GPU2, None, reservation_id="r1"), first))
    moved = intent(worker, devices_body(41, {"w7": [GPU2]}))
    w7 = cdi_doc("w7", _annotated("w7", GPU2, None, reservation_id="r1"), moved)
    signed_node.refused(w7, "atoms-held", "w6")
    signed_node.ok({"op": "file.remove", "args": {"kind": "cdi", "id": "w6", "intent": moved}})
    signed_node.ok(w7)
    signed_node.ok(w7)  # its own hold again: not another's


def test_round6_a_signed_hold_never_names_a_gpu_a_released_allocations_env_file_names(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """Row 7 read only the CDI hold files. The spec at generation 42 gives GPU2 to w8; the one at 43 moves
    it to w9. The node removes w8's CDI hold but keeps its env file (`NVIDIA_VISIBLE_DEVICES=<GPU2>`): a
    workload manager starting jobs through NVIDIA's legacy runtime hook still hands w8's tenant GPU2, and
    w9's hold was written beside it. Now `atoms-held` names w8's env file until it goes; an env file left
    without its hold can go while the spec lists its allocation (the planner removes one it does not bind
    in the pass: a crash between a release's two removals), a hold's own env file cannot."""
    worker = cp.command.leaf()
    _clear(signed_node, intent(worker, devices_body(42, {})))
    first = intent(worker, devices_body(42, {"w8": [GPU2]}))
    signed_node.ok(cdi_doc("w8", _annotated("w8", GPU2, None, reservation_id="r1"), first))
    signed_node.ok(env_doc("w8", f"BCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES={GPU2}\n", first))
    moved = intent(worker, devices_body(43, {"w9": [GPU2]}))
    signed_node.ok({"op": "file.remove", "args": {"kind": "cdi", "id": "w8", "intent": moved}})
    w9 = cdi_doc("w9", _annotated("w9", GPU2, None, reservation_id="r1"), moved)
    signed_node.refused(w9, "atoms-held", "w8's env file")
    signed_node.ok({"op": "file.remove", "args": {"kind": "allocation-env", "id": "w8", "intent": moved}})
    signed_node.ok(w9)
    signed_node.ok(env_doc("w9", f"BCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES={GPU2}\n", moved))
    # w8 back on GPU1 at 44: its env file written, its hold not (a crash between them, or a node that
    # stops there). Since 2026-12-02 the env file stays while the spec gives w8 the GPU it names (its
    # removal made GPU1 look free to root's busy check: tests/helper/test_hostile_envfile.py); w9's,
    # beside its hold, cannot go either. Once the spec moves w8 elsewhere, its old env file goes.
    back = intent(worker, devices_body(44, {"w9": [GPU2], "w8": [GPU1]}))
    signed_node.ok(env_doc("w8", f"BCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES={GPU1}\n", back))
    signed_node.refused(
        {"op": "file.remove", "args": {"kind": "allocation-env", "id": "w9", "intent": back}}, "hold-in-spec"
    )
    signed_node.refused(
        {"op": "file.remove", "args": {"kind": "cdi", "id": "w9", "intent": back}}, "hold-in-spec"
    )
    w8_env = {"op": "file.remove", "args": {"kind": "allocation-env", "id": "w8", "intent": back}}
    signed_node.refused(w8_env, "hold-in-spec", "names a GPU the spec gives it")
    away = intent(worker, devices_body(45, {"w9": [GPU2]}))
    signed_node.ok({"op": "file.remove", "args": {"kind": "allocation-env", "id": "w8", "intent": away}})
    assert not (signed_node.root / "run/bcd/allocations/w8.env").exists()


class SignedDevices:
    """The node's devices section (the real DevicesSection and HelperExecutor) over a simulated host,
    through a real helper started with root's join record (command-signing roots)."""

    def __init__(self, tmp_path: Path, cp: ControlPlane) -> None:
        from bcd_agent.helperclient import HelperClient
        from bcd_agent.sections.devices.apply import HelperExecutor
        from bcd_agent.sections.devices.events import KeyReportSigner, MemorySink
        from bcd_agent.sections.devices.section import DevicesSection
        from bcd_simhost import sim_system
        from helperproc import HelperProcess, base_config, make_root

        self.root = make_root(tmp_path)
        cp.write_record(self.root, NODE, cp.bundle(1))
        self.helper = HelperProcess(self.root, cp.config_lines() + base_config())
        self.worker = cp.command.leaf()
        self.client = HelperClient(self.helper.socket_path)
        self.spec: Any = None  # the signed spec the node keeps (what the executor forwards)
        self.section = DevicesSection(
            sim_system(self.root),
            HelperExecutor(self.client, lambda: self.spec),
            MemorySink(),
            KeyReportSigner.fresh(NODE, "boot-1"),
            "/var/lib/bcd",
        )

    def sign(
        self, generation: int, assignments: dict[str, list[str]], memory: dict[str, int] | None = None
    ) -> Any:
        """Sign a devices spec and keep it as the node's; `memory`: a memory limit (a sliced hold) by
        allocation."""
        if memory:
            from bcd_shared import wire

            body = devices_spec(
                NODE,
                generation,
                wire.DevicesSection(
                    assignments=[
                        wire.DeviceAssignment(
                            allocation_id=a,
                            reservation_id="r1",
                            binding=wire.Binding.HOLD,
                            devices=[wire.DeviceAtom(id=g, device_class="gpu") for g in gpus],
                            limits=wire.DeviceLimits(memory_bytes=memory[a]) if a in memory else None,
                        )
                        for a, gpus in assignments.items()
                    ]
                ),
            )
        else:
            body = devices_body(generation, assignments)
        self.spec = intent(self.worker, body)
        return self.spec

    def converge(
        self, generation: int, assignments: dict[str, list[str]], memory: dict[str, int] | None = None
    ) -> Any:
        """One pass of the section over the signed spec (holds of reservation r1, sliced where `memory`
        limits them); its state."""
        from bcd_agent.converge.section import Observation, PassContext
        from bcd_agent.converge.types import DesiredSpec
        from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec, Limits

        memory = memory or {}
        self.sign(generation, assignments, memory)
        spec = DevicesSpec(
            generation,
            tuple(
                DeviceAssignment(
                    alloc,
                    "r1",
                    devices=tuple(DeviceRef(g, atom_class(g)) for g in gpus),
                    limits=Limits(memory_bytes=memory[alloc]) if alloc in memory else None,
                )
                for alloc, gpus in assignments.items()
            ),
        )
        ctx = PassContext(DesiredSpec(generation, "h"), 1, frozenset(), 0.0)
        return self.section.converge(spec, Observation(), ctx).state

    def audit(self) -> list[dict[str, Any]]:
        return list(self.helper.audit_lines())

    def file_ops(self) -> int:
        return len([a for a in self.audit() if a["op"].startswith("file.")])


@pytest.fixture
def devices(tmp_path: Path, cp: ControlPlane) -> Iterator[SignedDevices]:
    d = SignedDevices(tmp_path, cp)
    try:
        yield d
    finally:
        d.helper.stop()


def test_round6_the_devices_section_converges_past_a_released_allocations_env_file(
    devices: SignedDevices,
) -> None:
    """The honest side of the env file rule: the node's devices section, through a real helper with
    command-signing roots, binds allocation a on GPU 0; the spec then moves GPU 0 to b, and a crash
    between a's two removals leaves a's env file without its hold (root refuses b's hold while it is
    there). The next pass removes the orphan env file before it binds b, and the pass after plans
    nothing: an honest node is never stopped by the rule."""
    from bcd_agent.converge.types import SectionState
    from bcd_simhost.gpus import gpu_uuid

    root, g0 = devices.root, gpu_uuid(0)
    env = root / "run/bcd/allocations"
    assert devices.converge(1, {"a": [g0]}) is SectionState.CONVERGED
    assert (env / "a.env").exists() and (root / "etc/cdi/bcd-a.json").exists()
    devices.client.file_remove("cdi", "a", devices.sign(2, {"b": [g0]}))  # the crash: a's env file left
    assert (env / "a.env").exists()
    assert devices.converge(2, {"b": [g0]}) is SectionState.CONVERGED
    assert not (env / "a.env").exists() and (env / "b.env").exists()
    assert (root / "etc/cdi/bcd-b.json").exists()
    refusals = [a for a in devices.audit() if a["decision"] == "refused"]
    assert refusals == []  # the removal went first: root never had to refuse b's hold
    writes = devices.file_ops()
    assert devices.converge(2, {"b": [g0]}) is SectionState.CONVERGED
    assert devices.file_ops() == writes  # nothing left


def test_round6_env_atoms_reads_an_env_file_as_the_cdi_rule_reads_a_hold() -> None:
    """The env file side of `atoms-held` (`_env_atoms`): a GPU's UUID is its slots the allocation's own
    hold holds (slots of one GPU are different allocations'), else the whole GPU; a MIG UUID its MIG atom;
    `void`/`none` nothing; a file that does not parse, `all`, an index or a MIG UUID root cannot place:
    every atom (None)."""
    from bcd_helper.ops.files import _env_atoms, _overlaps

    mig = f"{GPU1}/gi1/ci0"

    def named(value: str, held: tuple[str, ...] = ()) -> set[str] | None:
        data = f"BCD_ALLOCATION_ID=o\nNVIDIA_VISIBLE_DEVICES={value}\n".encode()
        return _env_atoms(data, "o", held, lambda: {"MIG-1": mig})

    assert named(GPU2) == {GPU2}
    assert named(f"{GPU1},{GPU2}", (f"{GPU1}/s1", f"{GPU1}/s2")) == {f"{GPU1}/s1", f"{GPU1}/s2", GPU2}
    assert named(GPU1, (GPU1, f"{GPU1}/s1")) == {GPU1}
    assert named(GPU1, (f"{GPU2}/s1",)) == {GPU1}
    assert named("MIG-1") == {mig}
    assert named("void") == set() and named("none") == set() and named("") == set()
    assert named(f"void,{GPU2}") == {GPU2}
    assert named(f"{GPU2}=x") == {f"{GPU2}=x"}  # the first `=` ends the key
    for value in ("all", "0", "MIG-2", f"{GPU1},all"):
        assert named(value) is None, value
    assert _env_atoms(b"BCD_ALLOCATION_ID=other\n", "o", (), dict) is None
    assert _env_atoms(b"BCD_ALLOCATION_ID=o\nX=1\n", "o", (), dict) == set()
    # The overlap the rule then applies: a slot is not another slot of its GPU, but is its whole GPU.
    assert not _overlaps(f"{GPU1}/s3", f"{GPU1}/s1") and _overlaps(f"{GPU1}/s3", GPU1)


def test_round6_a_rejoin_that_keeps_the_node_id_keeps_the_generation_floor(
    tmp_path: Path, cp: ControlPlane
) -> None:
    """HST-SIGN-22: joined again *as another node*, the binding moves and generations start over. A `tpm`
    or `provisioned` re-join keeps the node id (and the control plane its generation), but root reset
    the floor at any new join record: after the operator re-joined as root (the documented way to pin a
    node that joined before the record), the node handed access.apply the older signed spec of
    generation 40 after 50 had been applied, and root took it (an access section the newer spec had
    revoked, back). Now a new record naming the node root is already bound to keeps the generation floor
    (`stale-generation`); another node's record still starts over."""
    from helperproc import HelperProcess, base_config, make_root
    from hostilekit import NODE_GID, NODE_UID, as_node, refused_as_node
    from intentkit import access_body, access_doc

    root = make_root(tmp_path)
    cp.write_record(root, NODE, cp.bundle(2))
    worker = cp.command.leaf()
    h = HelperProcess(root, cp.config_lines() + base_config(NODE_UID, NODE_GID))
    try:
        assert as_node(h, access_doc(intent(worker, access_body(NODE, 50, empty=True))))["ok"] is True
        cp.write_record(root, NODE, cp.bundle(2))  # root joins again, keeping the node id
        refused_as_node(h, access_doc(intent(worker, access_body(NODE, 40, empty=True))), "stale-generation")
        assert as_node(h, access_doc(intent(worker, access_body(NODE, 51, empty=True))))["ok"] is True
        cp.write_record(root, "node-z", cp.bundle(2))  # as another node: generations start over
        assert as_node(h, access_doc(intent(worker, access_body("node-z", 1, empty=True))))["ok"] is True
    finally:
        h.stop()


def test_round6_slice_remove_and_a_hold_write_share_a_lock() -> None:
    """Row 6's two checks (a hold write sees its slice; slice.remove sees no hold) run under one lock, so
    a node on two connections cannot stop the slice between a hold write's check and its write."""
    from bcd_helper.ops.table import OPS

    assert set(OPS["slice.remove"].locks) & set(OPS["file.write"].locks)


def test_round6_ch_ops_name_a_missing_data_dir(tmp_path: Path) -> None:
    """Found by this round's fuzzing of every op's arguments: `ch.launch`, `ch.vfio`, `ch.unvfio` and
    `ch.stop` failed as `internal` ("FileNotFoundError" and root's host path) when the node's data_dir
    did not exist; now a refusal naming it."""
    from helperproc import HelperProcess, base_config, make_root
    from hostilekit import NODE_GID, NODE_UID, as_node, refused_as_node

    h = HelperProcess(make_root(tmp_path), base_config(NODE_UID, NODE_GID))
    try:
        for op in ("ch.launch", "ch.vfio"):
            answer = refused_as_node(h, {"op": op, "args": {"name": "vm1"}}, "bad-layout", "data_dir")
            assert "FileNotFoundError" not in answer["message"]
        for op in ("ch.unvfio", "ch.stop"):  # nothing to give back: answered, never internal
            answer = as_node(h, {"op": op, "args": {"name": "vm1"}})
            assert answer.get("reason") != "internal", answer
    finally:
        h.stop()


def test_round6_a_kept_hold_moved_to_other_gpus_converges(devices: SignedDevices) -> None:
    """The honest side of `hold-in-spec`: the spec keeps allocation a but moves it from GPU 0 to GPU 1.
    The node's devices section (through a real helper with command-signing roots) releases a's old hold
    and binds it again on GPU 1 in one pass (Q-DEV-PASS-01); root lets the old file go, since none of its
    atoms is a's any more: converged in that pass, nothing refused, the hold names GPU 1 only, and the
    next pass writes nothing. (A change that keeps an atom is written over in place instead:
    `test_round6_a_kept_hold_that_grows_or_shrinks_converges_written_over_in_place`.)"""
    from bcd_agent.converge.types import SectionState
    from bcd_simhost.gpus import gpu_uuid

    def held() -> list[str]:
        doc = json.loads((devices.root / "etc/cdi/bcd-a.json").read_text())
        return [d["annotations"]["bcd.dev/device-id"] for d in doc["devices"]]

    def refusals() -> list[str]:
        return [a["reason"] for a in devices.audit() if a["decision"] == "refused"]

    g0, g1, g2, g3 = (gpu_uuid(i) for i in range(4))
    assert devices.converge(1, {"a": [g0]}) is SectionState.CONVERGED
    assert devices.converge(2, {"a": [g1]}) is SectionState.CONVERGED  # moved: released and bound in one pass
    assert held() == [g1] and refusals() == []
    ops = devices.file_ops()
    assert devices.converge(2, {"a": [g1]}) is SectionState.CONVERGED and devices.file_ops() == ops
    assert devices.converge(3, {"a": [g2, g3]}) is SectionState.CONVERGED  # moved to two others at once
    assert held() == [g2, g3] and refusals() == []


def test_round6_a_kept_hold_that_grows_or_shrinks_converges_written_over_in_place(
    devices: SignedDevices,
) -> None:
    """Found by the lead after round 6 (docs/helper.md, "Found and not closed" then): the spec keeps
    allocation a and grows it from GPU 1 to GPUs 1 and 2, later shrinks it back. The planner released the
    old hold before binding the new (Q-DEV-PASS-01) and root refused that removal `hold-in-spec` (GPU 1 would
    have looked free to the busy check until the bind), on every pass: never converged. Now the node's
    devices section (through a real helper with command-signing roots) writes the hold over in place
    (root's `atoms-held` does not count a's own hold and env file against it): each change converges in
    its pass with nothing refused, and the pass after writes nothing. The control plane sees one
    AllocationBound per change (the new atoms), no AllocationReleased."""
    from bcd_agent.converge.types import SectionState
    from bcd_simhost.gpus import gpu_uuid

    def held() -> list[str]:
        doc = json.loads((devices.root / "etc/cdi/bcd-a.json").read_text())
        return [d["annotations"]["bcd.dev/device-id"] for d in doc["devices"]]

    def visible() -> str:
        lines = (devices.root / "run/bcd/allocations/a.env").read_text().splitlines()
        return next(line for line in lines if line.startswith("NVIDIA_VISIBLE_DEVICES="))

    g1, g2 = gpu_uuid(0), gpu_uuid(1)
    assert devices.converge(1, {"a": [g1]}) is SectionState.CONVERGED
    for generation, gpus in ((2, [g1, g2]), (3, [g1])):  # grown, then shrunk
        assert devices.converge(generation, {"a": gpus}) is SectionState.CONVERGED, generation
        assert held() == gpus and visible() == "NVIDIA_VISIBLE_DEVICES=" + ",".join(gpus)
        assert [a for a in devices.audit() if a["decision"] == "refused"] == []
        ops = devices.file_ops()
        assert devices.converge(generation, {"a": gpus}) is SectionState.CONVERGED
        assert devices.file_ops() == ops  # nothing left to write
    removals = [a for a in devices.audit() if a["op"] == "file.remove"]
    assert removals == []  # written over, never removed
    events = [type(e.event).__name__ for e in devices.section.sink.events]  # type: ignore[attr-defined]
    assert events == ["BoundEvent"] * 3


def test_a_kept_hold_whose_limits_go_converges_its_slice_stopped_after_the_hold_stops_naming_it(
    devices: SignedDevices,
) -> None:
    """Found after round 6's shared-atoms fix: the spec keeps allocation a on GPU 1 and drops its limits
    (sliced -> plain). Root's `slice.remove` refused while a's hold files existed at all (`hold-exists`),
    though the rewritten hold no longer names the slice, so the node's stop of the unneeded slice was
    refused on every pass: never converged. Now the hold is written over first (no cgroup parent in
    either file), root refuses the slice's removal only while a file still names it, and the section
    converges with nothing refused; the pass after writes nothing. Back to sliced converges too."""
    from bcd_agent.converge.types import SectionState
    from bcd_simhost.gpus import gpu_uuid

    def parent() -> tuple[str | None, bool]:
        doc = json.loads((devices.root / "etc/cdi/bcd-a.json").read_text())
        env = (devices.root / "run/bcd/allocations/a.env").read_text()
        return doc.get("annotations", {}).get("bcd.dev/cgroup-parent"), "BCD_CGROUP_PARENT=" in env

    from bcd_helper.ops.slices import slice_cgroup

    slice_dir = devices.root / slice_cgroup("bcd-alloc-a.slice").lstrip("/")
    g1 = gpu_uuid(0)
    assert devices.converge(1, {"a": [g1]}, {"a": 1 << 30}) is SectionState.CONVERGED
    assert parent() == ("bcd-alloc-a.slice", True) and slice_dir.is_dir()
    for generation, memory in ((2, {}), (3, {"a": 1 << 30})):
        assert devices.converge(generation, {"a": [g1]}, memory) is SectionState.CONVERGED, generation
        assert [a for a in devices.audit() if a["decision"] == "refused"] == []
        sliced = bool(memory)
        assert parent() == (("bcd-alloc-a.slice", True) if sliced else (None, False))
        assert slice_dir.is_dir() is sliced  # stopped once no file names it; started again
        ops = len(devices.audit())
        assert devices.converge(generation, {"a": [g1]}, memory) is SectionState.CONVERGED
        assert [a["op"] for a in devices.audit()[ops:] if a["op"] != "helper.ping"] == []


def test_round6_the_in_place_path_frees_no_gpu_and_takes_no_other_allocations_atom(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """The hostile side of writing a changed hold over in place, as the node's account against the real
    helper with roots: root takes w10's own hold and env file as no obstacle to its new hold (so the
    honest node converges), and nothing else. Under the spec that grows w10 to GPUs 1 and 2, a hold or
    env file also naming w11's GPU 3 is `atoms-outside` / `env-outside` (and `atoms-held`, naming w11's
    hold, when a signed spec gives GPU 3 to both); once grown, writing it over with GPU 1 only (GPU 2
    then looking free) is `atoms-missing` and a signed reset of GPU 2 stays `gpu-busy`; the spec before
    the growth is `stale-generation`. Shrinking back, the env file goes first: GPU 2 stays busy while the
    old hold names it, and removing the hold the spec lists is `hold-in-spec`."""
    from bcd_shared import wire
    from test_signed_commands import command, reset

    gpu3 = "GPU-5f1c2a90-0000-4000-8000-000000000003"
    worker = cp.command.leaf()
    _clear(signed_node, intent(worker, devices_body(60, {})))

    def w10(*gpus: str) -> str:
        return hold_text("w10", [(g, None) for g in gpus], ["BCD_ALLOCATION_ID=w10"])

    def env(*gpus: str) -> str:
        return f"BCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES={','.join(gpus)}\n"

    first = intent(worker, devices_body(60, {"w10": [GPU1], "w11": [gpu3]}))
    signed_node.ok(cdi_doc("w10", w10(GPU1), first))
    signed_node.ok(env_doc("w10", env(GPU1), first))
    signed_node.ok(cdi_doc("w11", hold_text("w11", [(gpu3, None)], ["BCD_ALLOCATION_ID=w11"]), first))
    signed_node.ok(env_doc("w11", env(gpu3), first))
    grown = intent(worker, devices_body(61, {"w10": [GPU1, GPU2], "w11": [gpu3]}))
    signed_node.refused(cdi_doc("w10", w10(GPU1, GPU2, gpu3), grown), "atoms-outside", gpu3)
    signed_node.refused(env_doc("w10", env(GPU1, GPU2, gpu3), grown), "env-outside")
    # The honest grow: the hold over its own old hold and env file (not another's), then the env file.
    signed_node.ok(cdi_doc("w10", w10(GPU1, GPU2), grown))
    signed_node.ok(env_doc("w10", env(GPU1, GPU2), grown))
    # Written over in place again with GPU 1 only, GPU 2 would look free: refused, and it stays busy.
    signed_node.refused(cdi_doc("w10", w10(GPU1), grown), "atoms-missing", GPU2)
    busy = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU2]))
    signed_node.refused(reset([GPU2], busy), "gpu-busy", "w10")
    signed_node.refused(cdi_doc("w10", w10(GPU1), first), "stale-generation")
    twice = intent(worker, devices_body(62, {"w10": [GPU1, GPU2, gpu3], "w11": [gpu3]}))
    signed_node.refused(cdi_doc("w10", w10(GPU1, GPU2, gpu3), twice), "atoms-held", "w11")
    shrunk = intent(worker, devices_body(63, {"w10": [GPU1], "w11": [gpu3]}))
    signed_node.refused(remove_doc("cdi", "w10", shrunk), "hold-in-spec")
    signed_node.ok(env_doc("w10", env(GPU1), shrunk))  # the env file first: the hold still names GPU 2
    still = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU2]))
    signed_node.refused(reset([GPU2], still), "gpu-busy", "w10")
    signed_node.ok(cdi_doc("w10", w10(GPU1), shrunk))
