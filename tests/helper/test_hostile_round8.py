"""Red team round 8 (docs/helper.md, "Threat model, round 8"): the node's account, compromised, against
every op's arguments at their limits, the paths root touches, the libvirt and cloud-hypervisor ops, the
audit log and per-peer resources, as a real unprivileged client (a forked child dropped to the node's uid,
hostilekit.as_node: SO_PEERCRED sees that uid) against a real `bcd helper serve` over a simulated host, or
on the real libvirt 9.0 (qemu:///system, TCG) where libvirt's own parsing is the point. Each test failed
on the code before its fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
from helperproc import AUDIT_DIR, HelperProcess
from hostilekit import NODE_UID, SignedHost, as_node, refused_as_node
from intentkit import hold_text

GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"  # the simulated host's GPU 0


def _hold(**annotations: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(hold_text("r8", [(GPU0, None)], ["BCD_ALLOCATION_ID=r8"]))
    doc["annotations"].update(annotations)
    return doc


def test_round8_a_holds_numbers_are_ascii_decimal_refused_by_field_never_an_internal_failure(
    helper: HelperProcess,
) -> None:
    """A CDI hold's `bcd.dev/generation` was checked with `str.isdigit` and read with `int()`, its
    `cdiVersion` with `\\d+`: '²' and '①' (digits to isdigit, not to int) and a generation of 4,301 digits
    (past Python's integer-string limit) failed the write as `internal` (the interpreter's ValueError
    answered), a cdiVersion of 4,400 digits too, and Arabic-Indic digits were written into
    /etc/cdi as the hold's generation and version (which CDI's loaders, reading ASCII, refuse). Now both
    are ASCII digits, bounded: `bad-content` naming the field, nothing written."""

    def write(doc: dict[str, Any]) -> dict[str, Any]:
        return {"op": "file.write", "args": {"kind": "cdi", "id": "r8", "content": json.dumps(doc)}}

    # One refusal checked whole (audited as the node's, nothing under the root changed), the rest by answer.
    refused_as_node(helper, write(_hold(**{"bcd.dev/generation": "\u00b2"})), "bad-content",
                    "annotations.bcd.dev/generation: must be a decimal generation")  # fmt: skip
    generations = ("\u2460", "9" * 4301, "\u0663", "1" * 21, "+1", " 1")
    versions = ("\u0660.\u0666.\u0660", "9" * 4400 + ".6.0", "0.\u0666.0")
    docs = [_hold(**{"bcd.dev/generation": g}) for g in generations]
    docs += [{**_hold(), "cdiVersion": v} for v in versions]
    for doc in docs:
        answer = as_node(helper, write(doc))
        assert (answer["ok"], answer.get("reason")) == (False, "bad-content"), answer
        assert "generation" in answer["message"] or "cdiVersion" in answer["message"], answer
    assert not (helper.root / "etc/cdi/bcd-r8.json").exists()
    assert as_node(helper, write(_hold()))["ok"] is True  # the planner's hold, as before


def test_round8_audit_show_prints_an_op_name_as_one_token(helper: HelperProcess) -> None:
    """`bcd helper audit show` prints `TIME #SEQ uid=U pid=P OP DECISION REASON ARGS MESSAGE`, every
    unprintable character escaped, but a space is printable: the node's unknown op
    `file.write accepted  {"id": "a1", "kind": "cdi"}` (refused `unknown-op`, audited with the op as
    sent, cut to 100 characters) printed as what reads as an accepted hold write, the real decision pushed
    after it. Now an op is one token: a space in it is shown as `\\x20`, so the field after the op is
    always the decision."""
    forged = 'file.write accepted  {"id": "a1", "kind": "cdi"}'
    answer = as_node(helper, {"op": forged, "args": {}})
    assert (answer["ok"], answer["reason"]) == (False, "unknown-op"), answer
    assert helper.last_audit()["op"] == forged
    shown = subprocess.run(
        [sys.executable, "-m", "bcd_helper.cli", "audit", "--root", str(helper.root), "--dir", AUDIT_DIR,
         "show", "--decision", "refused"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    line = shown.stdout.splitlines()[-1]
    fields = line.split(" ")
    assert fields[4] == forged.replace(" ", "\\x20") and fields[5:7] == ["refused", "unknown-op"], line


def test_round8_ch_launch_reaches_the_base_image_and_volumes_without_a_symlink() -> None:
    """`ch.launch` opened the instance directory without following a link, but reached the base image
    (`cloud-hypervisor/images/<sha256>.<format>`) and the volumes (`volumes/<name>`) by path, checking
    only the last component: a node that made `images` a symlink to a directory only root can enter had
    root read the header of root's file there and launch the VMM with it bound read-only
    (`BindReadOnlyPaths`, which systemd resolves as root, so a world-readable file a root-only directory
    protects becomes the guest's). The libvirt ops refuse a symlink on the way from data_dir (round 3);
    now `ch.launch` does too: `bad-image` / `bad-volume`, naming the link, before anything is granted."""
    import shutil
    import tempfile

    from helperproc import make_root

    parent = Path(tempfile.mkdtemp(prefix="bcd-r8-", dir="/var/tmp"))  # short: the VMM's socket paths
    try:
        _launch_through_links(make_root(parent))
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _launch_through_links(root: Path) -> None:
    import os
    import shutil

    from bcd_shared.chunit import VMM_UID_BASE
    from bcd_simhost.chapi import lay_out_instance
    from helperproc import base_config

    lay_out_instance(root, "vm1", NODE_UID, VMM_UID_BASE + 1, volumes=(("v1.raw", False),))
    data = root / "var/lib/bcd"
    hidden = root / "var/lib/root-only"
    for link, reason in (("cloud-hypervisor/images", "bad-image"), ("volumes", "bad-volume")):
        shutil.rmtree(hidden, ignore_errors=True)
        shutil.move(data / link, hidden)  # the node's own files, behind a directory only root enters
        os.chmod(hidden, 0o700)
        os.chown(hidden, 0, 0)
        (data / link).symlink_to(hidden)
        os.lchown(data / link, NODE_UID, NODE_UID)
        h = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
        try:
            answer = refused_as_node(h, {"op": "ch.launch", "args": {"name": "vm1"}}, reason)
            assert "a symlink on the way" in answer["message"], answer
        finally:
            h.stop()
        (data / link).unlink()
        shutil.move(hidden, data / link)
        os.chown(data / link, NODE_UID, NODE_UID)
    h = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    try:
        assert as_node(h, {"op": "ch.launch", "args": {"name": "vm1"}})["ok"] is True  # as laid out: taken
    finally:
        h.stop()


def test_round8_a_guest_runs_only_on_the_cpus_and_memory_nodes_the_signed_spec_places_it(
    signed_host: SignedHost,
) -> None:
    """With roots, root compared a definition (or `vm.json`) with the signed spec's instance in runtime,
    vCPUs, memory, NICs, GPUs and image, never in placement: the spec pins vm1's two vCPUs to host CPUs
    0-1 (another allocation's hold has 5-6), and the node's definition pinned them to 5 and 6
    (`cputune/vcpupin`), floated them over every CPU (no pinning), pinned only one, or put the guest's
    memory on another NUMA node (`numatune`) or on huge pages the spec does not give; a cloud-hypervisor
    record's `cpus`/`mems` (the unit's `AllowedCPUs`/`AllowedMemoryNodes`) likewise. The node cannot
    place a QEMU or VMM process itself: root did it on the node's word. Now the CPUs each vCPU may run on,
    the memory nodes, the huge page size and a balloon must be the spec's placement (`spec-mismatch`, naming
    placement); the planner's own definition (vcpupin one CPU per vCPU) is taken."""
    from bcd_shared import wire
    from bcd_shared.chrecord import encode_record, parse_record
    from bcd_shared.chunit import VMM_UID_BASE
    from bcd_simhost.chapi import lay_out_instance
    from hostilekit import LibvirtVm, ch_instance

    lay_out_instance(signed_host.root, "vm2", NODE_UID, VMM_UID_BASE + 2)
    h = signed_host.start()
    vm = LibvirtVm(signed_host, "vm1", "a1")
    generation = iter(range(1, 100))

    def define(xml: str, placement: wire.Placement | None) -> dict[str, Any]:
        spec = vm.spec()
        spec.placement = placement
        signed = signed_host.signed(next(generation), spec)
        return {"op": "libvirt.define", "args": {"name": "vm1", "xml": xml, "intent": signed}}

    vcpu = '<vcpu placement="static">2</vcpu>'
    assert vcpu in vm.xml

    def pinned(*cpus: int) -> str:
        pins = "".join(f'<vcpupin vcpu="{i}" cpuset="{c}" />' for i, c in enumerate(cpus))
        return vm.xml.replace(vcpu, f"{vcpu}<cputune>{pins}</cputune>")

    on_0_1 = wire.Placement(cpus="0-1")
    for xml, placement in (
        (vm.xml, on_0_1),  # floating over every CPU
        (pinned(5, 6), on_0_1),  # another allocation's CPUs
        (pinned(0), on_0_1),  # vCPU 1 floats
        (vm.xml.replace(vcpu, '<vcpu placement="static" cpuset="0-7">2</vcpu>'), on_0_1),
        (pinned(0, 1), None),  # the spec places it nowhere: no pinning either
        (
            pinned(0, 1).replace("<os>", '<numatune><memory mode="strict" nodeset="1" /></numatune><os>'),
            on_0_1,
        ),
        # A balloon the spec does not give (none written: libvirt adds a virtio one), which libvirt.setmem
        # as root then inflates in the tenant's guest.
        (pinned(0, 1).replace('<memballoon model="none" />', ""), on_0_1),
        (pinned(0, 1).replace('<memballoon model="none" />', '<memballoon model="virtio" />'), on_0_1),
    ):
        refused_as_node(h, define(xml, placement), "spec-mismatch", "placement")
    # A spec cpulist that is not one places the guest nowhere it could run: refused, never an internal
    # failure (mutation session 26).
    refused_as_node(h, define(pinned(0, 1), wire.Placement(cpus="0-1,x")), "spec-mismatch", "placement")
    answer = as_node(h, define(pinned(0, 1), on_0_1))
    assert answer["ok"] is True, answer
    # No placement in the spec: a floating definition without huge pages or balloon is taken.
    assert as_node(h, define(vm.xml, None))["ok"] is True
    floating = wire.Placement(cpus="0-3")
    xml = vm.xml.replace(vcpu, '<vcpu placement="static" cpuset="0-3">2</vcpu>')
    assert as_node(h, define(xml, floating))["ok"] is True
    # What the node's runtime builds for a placement (pinned or floating, NUMA, huge pages) is taken.
    from bcd_agent.sections.instances.model import Placement

    planner = (
        ("0-1", "0", 0, True),
        ("0-3", "", 2 << 20, False),
        ("", "0", 1 << 30, True),
        ("", "", 0, True),
    )
    for cpus, mems, huge, balloon in planner:
        planned = LibvirtVm(signed_host, "vm1", "a1", Placement(cpus, mems, huge, balloon))
        placement = wire.Placement(cpus=cpus, mems=mems, hugepage_size_bytes=huge, balloon=balloon)
        answer = as_node(h, define(planned.xml, placement))
        assert answer["ok"] is True, (cpus, mems, huge, balloon, answer)

    # cloud-hypervisor: the record's cpus and mems become the unit's AllowedCPUs / AllowedMemoryNodes.
    record = signed_host.root / "var/lib/bcd/cloud-hypervisor/instances/vm2/vm.json"

    def launch(cpus: str, mems: str, placement: wire.Placement | None, huge: bool = False) -> dict[str, Any]:
        rec = parse_record(record.read_bytes())
        record.write_bytes(encode_record(attrs.evolve(rec, cpus=cpus, mems=mems, hugepages=huge)))
        spec = ch_instance("vm2", placement=placement)
        return {
            "op": "ch.launch",
            "args": {"name": "vm2", "intent": signed_host.signed(next(generation), spec)},
        }

    refused_as_node(h, launch("5-6", "", on_0_1), "spec-mismatch", "placement")
    refused_as_node(h, launch("", "", on_0_1), "spec-mismatch", "placement")
    refused_as_node(h, launch("0-1", "", None), "spec-mismatch", "placement")
    refused_as_node(h, launch("0-1", "1", wire.Placement(cpus="0-1", mems="0")), "spec-mismatch", "placement")
    # Huge pages are compared as on or off (the VMM config's size is the node's); a spec cpulist or a
    # record's that is not one is refused, never an internal failure (mutation session 26).
    huge = wire.Placement(cpus="0-1", hugepage_size_bytes=2 << 20)
    answer = as_node(h, launch("0-1", "", huge, huge=True))
    assert answer["ok"] is True, answer
    assert as_node(h, {"op": "ch.stop", "args": {"name": "vm2"}})["ok"] is True
    refused_as_node(h, launch("0-1", "", huge), "spec-mismatch", "placement")
    refused_as_node(h, launch("0-1", "", on_0_1, huge=True), "spec-mismatch", "placement")
    refused_as_node(h, launch("0-1", "", wire.Placement(cpus="0-1,x")), "spec-mismatch", "placement")
    answer = as_node(
        h, launch("0-1", "0", wire.Placement(cpus="0-1", mems="0", balloon=True))
    )  # its VMM config
    assert answer["ok"] is True, answer


def test_round8_unsafe_vfio_options_are_refused_for_every_module_name(helper: HelperProcess) -> None:
    """`kernel-modules` refused `enable_unsafe_noiommu_mode` for `vfio` and `allow_unsafe_interrupts` for
    `vfio_iommu_type1` (a passed-through device reaching host memory), keyed by (module, option): the
    same `allow_unsafe_interrupts` of `iommufd` (the backend vfio's device files use) was written, and so
    was `enable_unsafe_noiommu_mode` under `char-major-10-196`, an alias of vfio, whose options modprobe
    applies when the module is loaded through the alias (modprobe.d(5): "the module modulename (which
    might be an alias)"), e.g. by the same unit's `load`. Now the two options are refused under any
    module name (`invalid-settings`), nothing written."""
    for module, key in (
        ("iommufd", "allow_unsafe_interrupts"),
        ("char-major-10-196", "enable_unsafe_noiommu_mode"),
        ("vfio_pci", "allow_unsafe_interrupts"),
    ):
        settings = json.dumps({"load": [module], "options": {module: f"{key}=1"}})
        args = {"unit": "kernel-modules", "settings": settings, "busy_gpus": []}
        answer = refused_as_node(helper, {"op": "host.unit", "args": args}, "invalid-settings", key)
        assert "is refused" in answer["message"], answer
    assert not (helper.root / "etc/modprobe.d/bcd.conf").exists()


def test_round8_io_uring_stays_closed_to_the_nodes_group(helper: HelperProcess) -> None:
    """Round 2 (item 11) holds `kernel.io_uring_disabled` at 1 or 2, never 0, but with 1 the kernel lets
    the members of `kernel.io_uring_group` create io_uring instances, and that key was taken at any value:
    `{"kernel.io_uring_disabled": 1, "kernel.io_uring_group": 4242}` gives the node's own group io_uring
    back (the kernel's default, -1, is CAP_SYS_ADMIN only). Now `kernel.io_uring_group` is taken at -1
    only (`invalid-settings`), nothing written."""
    settings = json.dumps({"kernel.io_uring_disabled": 1, "kernel.io_uring_group": NODE_UID})
    args = {"unit": "sysctl", "settings": settings, "busy_gpus": []}
    answer = refused_as_node(helper, {"op": "host.unit", "args": args}, "invalid-settings", "io_uring_group")
    assert "is refused" in answer["message"], answer
    assert not (helper.root / "etc/sysctl.d/90-bcd.conf").exists()


# The real helper on the real libvirt (qemu:///system, TCG), as rounds 4 and 7 drive it (their fixtures).
from test_hostile_round4 import Guest, _node_owns, guest, node_wins_the_race, real_libvirt  # noqa: E402, F401
from test_hostile_round7 import _as_kvm_node  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from test_guest_boot_real import bridge, helper_socket, workdir  # noqa: E402, F401  (fixtures)


def test_round8_an_instance_id_of_digits_never_reaches_the_domain_running_with_that_id(
    guest: Guest,  # noqa: F811
    helper_socket: tuple[str, Path],  # noqa: F811
) -> None:
    """virsh looks a domain argument up by id first, then by UUID, then by name, and root handed it the
    instance id as sent: `libvirt.resume` (or destroy, suspend, setmem, save, ...) of the name "5", an
    instance id of digits, acted on whichever domain libvirt runs with id 5, another instance's. With
    roots the resume rule is checked for the instance named (a spec wanting "5" RUNNING), so the node
    resumed a guest its spec keeps PAUSED; an honest node with an instance "5" would destroy another
    tenant's guest. Now root's read of the domain (`dumpxml`, which every libvirt.* op makes first) must
    be the domain of that name (`bad-name`), and nothing is run. Real libvirt 9.0 (TCG)."""
    from bcd_agent.sections.instances.runtimes.base import Prepared
    from test_guest_boot_real import _virsh

    sock, home = helper_socket
    home.chmod(0o751)  # the node's account reaches its socket (root-only config and audit stay so)
    name = guest.name
    _node_owns(guest.data)
    guest.rt.create(guest.inst, Prepared())
    _node_owns(guest.data)
    answer = _as_kvm_node(sock, {"op": "libvirt.start", "args": {"name": name, "paused": True}})
    assert answer["ok"] is True, answer
    domid = _virsh("domid", name).strip()
    assert domid.isdigit(), domid
    for op in ("libvirt.resume", "libvirt.destroy"):
        answer = _as_kvm_node(sock, {"op": op, "args": {"name": domid}})
        assert (answer["ok"], answer.get("reason")) == (False, "bad-name"), answer
        assert f"virsh reads '{domid}' as the id or UUID of domain '{name}'" in answer["message"], answer
        assert _virsh("domstate", name).strip() == "paused"
    assert _as_kvm_node(sock, {"op": "libvirt.destroy", "args": {"name": name}})["ok"] is True


def test_round8_a_definition_names_its_domain_exactly_as_libvirt_reads_it(
    guest: Guest,  # noqa: F811
    helper_socket: tuple[str, Path],  # noqa: F811
) -> None:
    """Root compared the definition's `<name>` with the instance id after stripping it, libvirt takes the
    text as it is: `<name> vm </name>` passed root's check for `vm` and libvirt defined a domain named
    ' vm ' with vm's UUID, which no libvirt.* op reaches by name (the ids are checked; `virsh undefine vm`
    finds nothing), so root could never undefine it, and vm itself could not be defined again while it
    held the UUID. Now the name and UUID are compared exactly as written (`domain-name`). Real libvirt 9.0."""
    from bcd_agent.sections.instances.runtimes.base import Prepared
    from test_guest_boot_real import _virsh

    sock, home = helper_socket
    home.chmod(0o751)
    name = guest.name
    _node_owns(guest.data)
    guest.rt.create(guest.inst, Prepared())
    _node_owns(guest.data)
    xml = (guest.dir / "domain.xml").read_text()
    assert _as_kvm_node(sock, {"op": "libvirt.undefine", "args": {"name": name}})["ok"] is True
    spaced = xml.replace(f"<name>{name}</name>", f"<name> {name} </name>", 1)
    assert spaced != xml
    try:
        answer = _as_kvm_node(sock, {"op": "libvirt.define", "args": {"name": name, "xml": spaced}})
        assert (answer["ok"], answer.get("reason")) == (False, "domain-name"), answer
        assert f" {name} " not in _virsh("list", "--all", "--name").splitlines()
    finally:
        subprocess.run(["virsh", "-c", "qemu:///system", "undefine", f" {name} "], capture_output=True)
