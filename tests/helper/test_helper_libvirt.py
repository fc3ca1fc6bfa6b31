"""The helper's libvirt.* operations against a real helper process on a simulated host (fake virsh).

The node's libvirt-kvm runtime drives them (HelperVirsh): define, start, suspend, resume, shutdown,
undefine through root, reads through `virsh -r`. Refusals are properties: any definition outside the
default-deny rules is refused, audited, and the tree under the simulated root is unchanged (1,000
examples per property under CI)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.sections.instances.model import Desired
from bcd_agent.sections.instances.section import InstancesSection
from bcd_shared.instancenames import tap_name
from bcd_simhost import sim_system
from bcd_simhost.libvirt import STATE
from helperproc import HELPER_SETTINGS, HelperProcess, assert_refused, base_config, make_root
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from instkit import converge, helper_section, spec, vm

DATA = "/var/lib/bcd"


@pytest.fixture(scope="module")
def lv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HelperProcess, InstancesSection]]:
    root = make_root(tmp_path_factory.mktemp("libvirt"))
    proc = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    sec, _rt = helper_section(sim_system(root), proc.client)
    out = converge(sec, spec(vm("good", user_data_ref="ud")))
    assert out.state is SectionState.CONVERGED, out.message
    yield proc, sec
    proc.stop()


def _good_xml(h: HelperProcess) -> str:
    return (h.root / DATA.lstrip("/") / "libvirt/instances/good/domain.xml").read_text()


def test_the_runtime_drives_the_helper_dlv_hlp_02(lv: tuple[HelperProcess, InstancesSection]) -> None:
    """DLV-HLP-02, DLV-HLP-14: changes go through libvirt.*, audited; disks 0660 (the read-only seed
    0640), directories 0710."""
    h, sec = lv
    ops = [e["op"] for e in h.audit_lines() if e["decision"] == "accepted"]
    assert "libvirt.define" in ops and "libvirt.start" in ops
    converge(sec, spec(vm("good", desired=Desired.PAUSED), generation=2))
    converge(sec, spec(vm("good"), generation=3))
    converge(sec, spec(vm("good", desired=Desired.STOPPED), generation=4))
    ops = [e["op"] for e in h.audit_lines() if e["decision"] == "accepted"]
    assert ops[-3:] == ["libvirt.suspend", "libvirt.resume", "libvirt.shutdown"]
    disk = h.root / DATA.lstrip("/") / "libvirt/instances/good/disk.qcow2"
    assert os.stat(disk).st_mode & 0o777 == 0o660
    assert os.stat(disk.parent).st_mode & 0o777 == 0o710
    # the read-only one (the user-data seed) 0640, and group search on every directory on the way
    assert os.stat(disk.parent / "seed.iso").st_mode & 0o777 == 0o640
    for up in (disk.parent.parent, disk.parent.parent.parent):
        assert os.stat(up).st_mode & 0o070 == 0o010, up
    converge(sec, spec(vm("good"), generation=5))
    assert [i.state for i in sec.last_report.instances] == ["RUNNING"]


def test_restore_without_a_definition_is_refused_dlv_hlp_08(
    lv: tuple[HelperProcess, InstancesSection],
) -> None:
    """DLV-HLP-08."""
    h, _ = lv
    assert_refused(h, {"op": "libvirt.restore", "args": {"name": "good"}}, "no-definition")


def test_unmanaged_domain_is_never_changed_through_the_helper(
    lv: tuple[HelperProcess, InstancesSection],
) -> None:
    """DLV-LIBVIRT-17 under the helper: root's own dumpxml decides what is bcd's."""
    h, _ = lv
    d = h.root / STATE.lstrip("/")
    (d / "theirs.xml").write_text("<domain type='kvm'><name>theirs</name><memory>1024</memory></domain>")
    (d / "theirs.json").write_text('{"state": "running", "boot_id": "x"}')
    for op in ("libvirt.destroy", "libvirt.undefine", "libvirt.shutdown"):
        assert_refused(h, {"op": op, "args": {"name": "theirs"}}, "unmanaged")
    from bcd_shared.instancenames import domain_uuid

    xml = (
        _good_xml(h)
        .replace("<name>good</name>", "<name>theirs</name>")
        .replace(domain_uuid("good"), domain_uuid("theirs"))
        .replace("instances/good/", "instances/theirs/")
    )
    before = (d / "theirs.xml").read_bytes()
    answer = h.raw({"op": "libvirt.define", "args": {"name": "theirs", "xml": xml}})
    assert answer["ok"] is False  # libvirt refuses the name under another UUID (or root's disk check does)
    assert (d / "theirs.xml").read_bytes() == before


# --- refusals as properties ----------------------------------------------------------------------------

GOOD_DISK = f"{DATA}/libvirt/instances/good/disk.qcow2"
MUTATIONS = [
    ("<domain", '<!DOCTYPE domain [<!ENTITY x SYSTEM "file:///etc/shadow">]>\n<domain', "domain-doctype"),
    (
        "<devices>",
        "<devices><qemu:commandline xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'/>",
        "domain-qemu-commandline",
    ),
    (
        "<devices>",
        "<devices><filesystem type='mount'><source dir='/'/><target dir='r'/></filesystem>",
        "domain-element",
    ),
    (GOOD_DISK, "/etc/shadow", "domain-disk"),
    (GOOD_DISK, f"{DATA}/libvirt/instances/other/disk.qcow2", "domain-disk"),
    (GOOD_DISK, f"{DATA}/libvirt/instances/good/../other/disk.qcow2", "domain-disk"),
    ('<source bridge="br0" />', '<source bridge="br9" />', "domain-tap"),
    (f'<target dev="{tap_name("good", 0)}" />', '<target dev="bcevil0" />', "domain-tap"),
    (
        "<memballoon",
        "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
        "<address domain='0x0000' bus='0x99' slot='0x00' function='0x0'/></source></hostdev><memballoon",
        "domain-hostdev",
    ),
    ("<name>good</name>", "<name>evil</name>", "domain-name"),
    ('type="kvm"', 'type="xen"', "domain-attribute"),
    ('<disk type="file" device="disk">', '<disk type="network" device="disk">', "domain-attribute"),
    ('<boot dev="hd" />', '<boot dev="hd" /><kernel>/boot/vmlinuz</kernel>', "domain-kernel"),
    (
        "<backingStore />",
        "<backingStore type='file'><format type='qcow2'/><source file='/etc/passwd'/>"
        "<backingStore/></backingStore>",
        "domain-disk",
    ),
    ('<memory unit="KiB">', '<memory unit="KiB">99999999', "domain-size"),
]


@HELPER_SETTINGS
@given(
    which=st.integers(0, len(MUTATIONS) - 1),
    junk=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30),
    where=st.integers(0, 3),
)
def test_definitions_outside_the_rules_are_refused_and_change_nothing_dlv_hlp_04_05_06(
    lv: tuple[HelperProcess, InstancesSection], which: int, junk: str, where: int
) -> None:
    """DLV-HLP-04, DLV-HLP-05, DLV-HLP-06: default-deny; audited as refused; the tree is unchanged."""
    h, _ = lv
    old, new, reason = MUTATIONS[which]
    xml = _good_xml(h)
    assert old in xml, old
    bad = xml.replace(old, new, 1)
    if where == 1:  # junk in a comment never turns a refusal into an acceptance
        bad = bad.replace("</domain>", f"<!-- {junk.replace('--', '')} --></domain>")
    answer = assert_refused(h, {"op": "libvirt.define", "args": {"name": "good", "xml": bad}})
    assert answer["reason"] == reason or answer["reason"].startswith("domain-"), (reason, answer)


@settings(HELPER_SETTINGS, max_examples=min(HELPER_SETTINGS.max_examples, 200))  # one cheap rule
@given(name=st.text(min_size=0, max_size=80))
def test_names_that_are_not_instance_ids_are_refused(
    lv: tuple[HelperProcess, InstancesSection], name: str
) -> None:
    h, _ = lv
    from bcd_shared.instancenames import valid_instance_id

    if valid_instance_id(name):
        return
    assert_refused(h, {"op": "libvirt.destroy", "args": {"name": name}}, "bad-name")


def test_restore_stages_the_checked_definition_and_passes_xml_dlv_hlp_09_10(
    lv: tuple[HelperProcess, InstancesSection],
) -> None:
    """DLV-HLP-09, DLV-HLP-10: checked like a define (and must be the requested domain's), staged in
    root's directory and always given as --xml (the simulated virsh restores only so)."""
    h, _ = lv
    xml = _good_xml(h)
    assert_refused(h, {"op": "libvirt.restore", "args": {"name": "other", "xml": xml}}, "domain-name")
    state = h.root / DATA.lstrip("/") / "libvirt/instances/good/save.state"
    import struct

    state.write_bytes(struct.pack("<16s5I56x", b"LibvirtQemudSave", 2, 4096, 1, 0, 0) + b"\0" * 4096)
    answer = h.raw({"op": "libvirt.restore", "args": {"name": "good", "xml": xml}})
    assert answer["ok"] is True, answer
    # root stages the checked definition with relabel off on every file source (docs/helper.md, row 20)
    assert (h.root / "var/lib/bcd-hostconfig/libvirt/good.xml").read_bytes() == _no_relabel(xml.encode())


def test_the_base_image_is_checked_as_root_dlv_hlp_11(lv: tuple[HelperProcess, InstancesSection]) -> None:
    """DLV-HLP-11: root re-reads the overlay's base: one naming a backing file is refused."""
    from bcd_simhost.libvirt import IMAGE_SHA256, qcow2_bytes

    h, _ = lv
    base = h.root / DATA.lstrip("/") / f"libvirt/images/{IMAGE_SHA256}.qcow2"
    good = base.read_bytes()
    try:
        base.write_bytes(qcow2_bytes(1 << 30, "/etc/shadow", "raw"))
        answer = assert_refused(h, {"op": "libvirt.define", "args": {"name": "good", "xml": _good_xml(h)}})
        assert answer["reason"] == "domain-disk" and "backing file" in answer["message"]
        # a symlink on the way is refused too (re-checked as root)
        inst = h.root / DATA.lstrip("/") / "libvirt/instances/good"
        base.write_bytes(good)
        disk = inst / "disk.qcow2"
        real = inst / "real.qcow2"
        os.rename(disk, real)
        os.symlink(real, disk)
        try:
            answer = assert_refused(
                h, {"op": "libvirt.define", "args": {"name": "good", "xml": _good_xml(h)}}
            )
            assert answer["reason"] == "domain-disk" and "symlink" in answer["message"]
        finally:
            os.unlink(disk)
            os.rename(real, disk)
    finally:
        base.write_bytes(good)


def test_setmem_stays_within_the_domain(lv: tuple[HelperProcess, InstancesSection]) -> None:
    """The libvirt.setmem op: within the domain's own memory only; a domain without a balloon device
    fails in libvirt (the accepted case: tests/helper/test_helper_rebind.py)."""
    h, _ = lv
    assert_refused(h, {"op": "libvirt.setmem", "args": {"name": "good", "kib": 1 << 40}}, "bad-arguments")
    assert_refused(h, {"op": "libvirt.setmem", "args": {"name": "good", "kib": 0}}, "bad-arguments")
    answer = h.raw({"op": "libvirt.setmem", "args": {"name": "good", "kib": 1 << 20}})
    assert answer["ok"] is False and "no balloon device" in answer["message"], answer


def test_a_hard_link_in_the_instance_directory_is_refused(lv: tuple[HelperProcess, InstancesSection]) -> None:
    """DLV-HLP-04: a disk with a second hard link (a file the node linked in) is not bcd's own."""
    h, _ = lv
    inst = h.root / DATA.lstrip("/") / "libvirt/instances/good"
    extra = h.root / "var/tmp-link"
    os.link(inst / "seed.iso", extra)
    try:
        answer = assert_refused(h, {"op": "libvirt.define", "args": {"name": "good", "xml": _good_xml(h)}})
        assert answer["reason"] == "domain-disk" and "hard links" in answer["message"]
    finally:
        os.unlink(extra)


def test_undefine_drops_roots_staged_definition(lv: tuple[HelperProcess, InstancesSection]) -> None:
    h, sec = lv
    staged = h.root / "var/lib/bcd-hostconfig/libvirt/good.xml"
    assert staged.exists()
    converge(sec, spec(generation=9))
    assert not staged.exists()
    assert [e["op"] for e in h.audit_lines() if e["decision"] == "accepted"][-1] == "libvirt.undefine"


def test_a_start_never_takes_a_gpu_a_hold_has_dlv_dev_21(lv: tuple[HelperProcess, InstancesSection]) -> None:
    """DLV-DEV-21 as root: libvirt.start refuses a domain whose GPU root sees held by a live hold."""
    from bcd_shared import cdi
    from bcd_simhost.gpus import gpu_uuid

    h, sec = lv
    g5 = gpu_uuid(5)
    converge(sec, spec(vm("gv", gpu_uuids=(g5,), desired=Desired.STOPPED), generation=20))
    hold = cdi.build_hold_spec(
        allocation_id="alloc_h",
        reservation_id="r",
        generation=1,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(g5)],
        env=["BCD_ALLOCATION_ID=alloc_h"],
        vendor=None,
    )
    path = h.root / "etc/cdi/bcd-alloc_h.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cdi.encode_spec(hold))
    try:
        answer = assert_refused(h, {"op": "libvirt.start", "args": {"name": "gv"}}, "gpu-busy")
        assert "is held by alloc_h" in answer["message"]
    finally:
        path.unlink()
    assert h.raw({"op": "libvirt.start", "args": {"name": "gv"}})["ok"] is True


def _no_relabel(xml: bytes) -> bytes:
    from bcd_helper.ops.libvirt import root_definition

    return root_definition(xml)
