"""Snapshots and restores through the helper (libvirt.save, libvirt.restore) against a real helper process
on a simulated host (fake virsh and qemu-img), the test the unprivileged node's client.

The node's runtime takes a memory snapshot through root: `libvirt.save` has libvirtd write the state into
root's own directory and hands it to the node as the instance's `save.state` (the node's uid, 0640);
the domain carries on with `libvirt.restore` of bcd's definition. A restore into a new instance
defines it and its first start is `libvirt.restore` of the new definition (paused when asked). Root
refuses, audited and changing nothing: a memory save of a domain with passthrough GPUs or a writable
volume (its own view of DLV-RT-13/14), a domain bcd did not define, a name that is no instance id, and an
instance directory the node swapped for a symlink."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.sections.instances.model import InstanceSpec, Nic
from bcd_agent.sections.instances.runtimes.base import Prepared
from bcd_agent.sections.instances.runtimes.libvirt import HelperVirsh, LibvirtRuntime
from bcd_agent.sections.instances.section import InstancesSection
from bcd_shared.instancenames import domain_uuid
from bcd_simhost import sim_system
from bcd_simhost.libvirt import STATE
from helperproc import HelperProcess, assert_refused, base_config, make_root, tree
from hostilekit import as_node, verify_audit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from instkit import FixedUserData, converge, spec, vm

DATA = "/var/lib/bcd"
GIB = 1 << 30


@pytest.fixture(scope="module")
def lv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HelperProcess, LibvirtRuntime]]:
    root = make_root(tmp_path_factory.mktemp("snap"))
    proc = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    system = sim_system(root)
    rt = LibvirtRuntime(
        system, HelperVirsh(system, proc.client), DATA, under_helper=True, sleep=lambda s: None
    )
    sec = InstancesSection(system, [rt], DATA, user_data=FixedUserData())
    out = converge(sec, spec(vm("good", user_data_ref="ud")))
    assert out.state is SectionState.CONVERGED, out.message
    yield proc, rt
    proc.stop()


def refused_as_node(h: HelperProcess, doc: dict[str, Any], reason: str) -> dict[str, Any]:
    """`doc` sent by a client of the node's own uid and group (a real unprivileged process): refused
    for `reason`, audited as the next line, the tree under the root unchanged, the chain intact."""
    before = tree(h.root)
    seq = h.last_audit()["seq"]
    answer = as_node(h, doc)
    assert (answer["ok"], answer["error"], answer["reason"]) == (
        False,
        "refused",
        reason,
    )
    last = h.last_audit()
    assert (last["seq"], last["op"], last["decision"], last["reason"]) == (
        seq + 1,
        doc["op"],
        "refused",
        reason,
    )
    assert tree(h.root) == before
    assert verify_audit(h)
    return answer


def _state(h: HelperProcess, name: str) -> str:
    import json

    return str(json.loads((h.root / STATE.lstrip("/") / f"{name}.json").read_text())["state"])


def test_a_memory_snapshot_and_its_restore_go_through_root_dlv_hlp_02_dlv_libvirt_23(
    lv: tuple[HelperProcess, LibvirtRuntime], tmp_path: Path
) -> None:
    """DLV-HLP-02 (save and restore through libvirt.*), DLV-LIBVIRT-23 (the source carries on with
    bcd's own definition as --xml), DLV-LIBVIRT-28 (the new instance's first start is a restore with
    its own definition): audited, the state handed to the node and gone once restored."""
    h, rt = lv
    seq = h.last_audit()["seq"]
    tar = tmp_path / "s.tar"
    meta = rt.snapshot(vm("good"), True, str(tar))
    assert meta.include_memory and _state(h, "good") == "running"
    ops = [(e["op"], e["decision"]) for e in h.audit_lines() if e["seq"] > seq]
    assert ops == [("libvirt.save", "accepted"), ("libvirt.restore", "accepted")]
    inst_dir = h.root / DATA.lstrip("/") / "libvirt/instances/good"
    assert not (inst_dir / "save.state").exists()
    assert sorted(os.listdir(h.root / "var/lib/bcd-hostconfig/libvirt")) == ["good.xml"]  # no state left
    with tarfile.open(tar) as t:
        assert t.getnames() == ["meta.json", "disk.qcow2", "seed.iso", "save.state"]
        state = t.extractfile("save.state").read()  # type: ignore[union-attr]
    assert state.startswith(b"LibvirtQemudSave") and b"<name>good</name>" in state

    new = InstanceSpec(
        id="restored", vcpus=2, memory_bytes=2 * GIB, restore_from="https://s.example/s.tar",
        restore_sha256=hashlib.sha256(tar.read_bytes()).hexdigest(),
        nics=(Nic("br0", "52:54:00:00:00:02", ("10.0.0.6/24",)),),
    )  # fmt: skip
    rt.restore(new, str(tar), Prepared())
    nd = h.root / DATA.lstrip("/") / "libvirt/instances/restored"
    assert b"<name>restored</name>" in (nd / "save.state").read_bytes()
    rt.start(new, paused=True)
    assert _state(h, "restored") == "paused" and not (nd / "save.state").exists()
    last = h.audit_lines()[-1]
    assert (last["op"], last["decision"]) == ("libvirt.restore", "accepted")
    staged = (h.root / "var/lib/bcd-hostconfig/libvirt/restored.xml").read_text()
    assert domain_uuid("restored") in staged and "restored-from" in staged


def test_a_memory_snapshot_of_a_guest_the_spec_now_pauses_carries_on_paused(
    lv: tuple[HelperProcess, LibvirtRuntime], tmp_path: Path
) -> None:
    """A running guest whose spec now wants it PAUSED (its suspend not made yet) carries on paused after
    a memory snapshot's save: with roots, root restores a guest running only while the signed spec wants
    it RUNNING (docs/helper.md, round 7), so the node asks for the restore paused."""
    from bcd_agent.sections.instances.model import Desired

    h, rt = lv
    assert _state(h, "good") == "running"
    rt.snapshot(vm("good", desired=Desired.PAUSED), True, str(tmp_path / "p.tar"))
    last = h.audit_lines()[-1]
    assert (last["op"], last["args"].get("paused")) == ("libvirt.restore", True)
    assert _state(h, "good") == "paused"
    rt.resume("good")
    assert _state(h, "good") == "running"


def test_the_state_is_handed_to_the_node_and_a_symlinked_directory_is_refused(
    lv: tuple[HelperProcess, LibvirtRuntime], tmp_path: Path
) -> None:
    """libvirt.save: the state reaches the instance's directory as the node's file (0640); a node that
    swapped its instance directory for a symlink (to steer root's rename elsewhere) is refused."""
    h, rt = lv
    answer = h.raw({"op": "libvirt.save", "args": {"name": "good"}})
    assert answer["ok"] is True, answer
    state = h.root / DATA.lstrip("/") / "libvirt/instances/good/save.state"
    st = os.stat(state)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (4242, 4242, 0o640)
    rt.start(vm("good"), paused=False)  # the saved domain carries on (a restore)
    assert _state(h, "good") == "running" and not state.exists()

    inst = h.root / DATA.lstrip("/") / "libvirt/instances"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rename(inst / "good", elsewhere / "good")
    os.symlink(elsewhere / "good", inst / "good")
    try:
        refused_as_node(h, {"op": "libvirt.save", "args": {"name": "good"}}, "bad-path")
        assert _state(h, "good") == "running"
        assert not (elsewhere / "good/save.state").exists()
    finally:
        os.unlink(inst / "good")
        os.rename(elsewhere / "good", inst / "good")


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        (
            "<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x0000' bus='0x53' "
            "slot='0x00' function='0x0'/></source></hostdev>",
            "memory-snapshot-gpus",
        ),
        (
            "<disk type='file' device='disk'><driver name='qemu' type='raw'/>"
            f"<source file='{DATA}/volumes/v1.raw'/><target dev='vdb' bus='virtio'/></disk>",
            "memory-snapshot-volumes",
        ),
    ],
)
def test_root_refuses_a_memory_save_with_gpus_or_a_writable_volume_dlv_rt_13_14(
    lv: tuple[HelperProcess, LibvirtRuntime], device: str, reason: str
) -> None:
    """DLV-RT-13, DLV-RT-14 as root sees the domain: refused, audited, nothing changed."""
    h, _ = lv
    d = h.root / STATE.lstrip("/")
    xml = (d / "good.xml").read_text().replace("<devices>", "<devices>" + device, 1)
    xml = xml.replace("<name>good</name>", "<name>withdev</name>")
    (d / "withdev.xml").write_text(xml)
    (d / "withdev.json").write_text((d / "good.json").read_text())
    try:
        answer = refused_as_node(h, {"op": "libvirt.save", "args": {"name": "withdev"}}, reason)
        assert "snapshot" in answer["message"]
    finally:
        (d / "withdev.xml").unlink()
        (d / "withdev.json").unlink()


def test_save_refuses_other_domains_and_names(lv: tuple[HelperProcess, LibvirtRuntime]) -> None:
    h, _ = lv
    d = h.root / STATE.lstrip("/")
    (d / "theirs.xml").write_text("<domain type='kvm'><name>theirs</name><memory>1024</memory></domain>")
    (d / "theirs.json").write_text('{"state": "running", "boot_id": "x"}')
    refused_as_node(h, {"op": "libvirt.save", "args": {"name": "theirs"}}, "unmanaged")
    refused_as_node(h, {"op": "libvirt.save", "args": {"name": "../etc"}}, "bad-name")
    assert_refused(h, {"op": "libvirt.save", "args": {"name": "good", "path": "/etc/x"}})


def test_with_roots_a_save_needs_the_signed_spec_naming_the_instance(tmp_path: Path) -> None:
    """With command-signing roots, libvirt.save is re-validated against the signed spec's instance (as
    start is): no intent, a spec that does not name it or names it DELETED, or another signer's intent,
    is refused; a signed one saves."""
    from helperproc import make_root as _make_root
    from intentkit import ControlPlane, intent
    from test_helper_libvirt_signed import NODE, Keep, body, wire_vm

    cp = ControlPlane.build()
    root = _make_root(tmp_path)
    cp.write_record(root, NODE, cp.bundle(1))
    h = HelperProcess(root, cp.config_lines() + base_config(extra='instance_bridges = "br0"\n'))
    try:
        system = sim_system(root)
        keep = Keep()
        inst = vm(
            "vm1", allocation_id="a1", vcpus=2, memory_bytes=GIB, nics=(Nic("br0", "52:54:00:00:00:01"),)
        )
        LibvirtRuntime(system, keep, DATA, under_helper=True).create(inst, Prepared())
        d = root / STATE.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "vm1.xml").write_bytes(keep.xml)
        (d / "vm1.json").write_text(json.dumps({"state": "running", "boot_id": system.boot_id()}))
        signer = cp.command.leaf()

        def save(intent_arg: dict[str, Any] | None) -> dict[str, Any]:
            args: dict[str, Any] = {"name": "vm1"}
            if intent_arg is not None:
                args["intent"] = intent_arg
            return {"op": "libvirt.save", "args": args}

        assert_refused(h, save(None), "intent-required")
        assert_refused(h, save(intent(signer, body(1))), "not-in-spec")
        assert_refused(h, save(intent(signer, body(1, wire_vm(state=4)))), "not-in-spec")
        assert_refused(h, save(intent(cp.other.leaf(), body(1, wire_vm()))), "bad-intent")
        answer = h.raw(save(intent(signer, body(2, wire_vm()))))
        assert answer["ok"] is True, answer
        assert (
            (root / DATA.lstrip("/") / "libvirt/instances/vm1/save.state")
            .read_bytes()
            .startswith(b"LibvirtQemudSave")
        )
    finally:
        h.stop()


def test_restore_refuses_a_state_that_is_not_a_bounded_save_image(
    lv: tuple[HelperProcess, LibvirtRuntime],
) -> None:
    """The node writes the state's header: root reads it first and refuses anything but libvirt's
    magic, a known version and a data area of at most 16 MiB (libvirtd would allocate what it says)."""
    import struct

    h, _ = lv
    xml = (h.root / DATA.lstrip("/") / "libvirt/instances/good/domain.xml").read_text()
    state = h.root / DATA.lstrip("/") / "libvirt/instances/good/save.state"
    for head in (
        b"QEVM" + b"\0" * 88,
        struct.pack("<16s5I56x", b"LibvirtQemudSave", 2, 1 << 30, 1, 0, 0),
        struct.pack("<16s5I56x", b"LibvirtQemudSave", 7, 4096, 1, 0, 0),
        b"LibvirtQemudSave",
    ):
        state.write_bytes(head)
        try:
            refused_as_node(h, {"op": "libvirt.restore", "args": {"name": "good", "xml": xml}}, "bad-state")
        finally:
            state.unlink()
