"""The helper's `libvirt.rebind` / `libvirt.unrebind` (identity rebind, DLV-REB-09/11) and
`libvirt.setmem` as the balloon controller sends it (DLV-HLP-03), from a real unprivileged node account
(tests/helper/realnode.py: SO_PEERCRED sees the account) against a real helper on a simulated host.

Each refusal is audited as the next line with the node's uid and changes nothing under the simulated
root; root builds the disk's path, target and serial itself, so the node can name none of them."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.sections.instances.balloon import BalloonController
from bcd_agent.sections.instances.model import Placement
from bcd_agent.sections.instances.rebind import answered, parse_rebind, rebind_image
from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime
from bcd_agent.sections.instances.section import InstancesSection
from bcd_shared.rebinddisk import REBIND_SIZE
from bcd_simhost import sim_system
from bcd_simhost.libvirt import STATE
from hypothesis import given, settings
from hypothesis import strategies as st
from realnode import RealNode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from instkit import converge, helper_section, spec, vm

DATA = "/var/lib/bcd"


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[RealNode, InstancesSection, LibvirtRuntime]]:
    n = RealNode('[helper]\ninstance_bridges = "br0"\n')
    try:
        sec, rt = helper_section(sim_system(n.root), n.h.client)
        out = converge(sec, spec(vm("good", placement=Placement(balloon=True))))
        assert out.state is SectionState.CONVERGED, out.message
        yield n, sec, rt
    finally:
        n.close()


def _disk(n: RealNode, name: str = "good") -> Path:
    return n.root / DATA.lstrip("/") / "libvirt/instances" / name / "rebind.img"


def _attach(name: str = "good", **extra: Any) -> dict[str, Any]:
    return {"op": "libvirt.rebind", "args": {"name": name, **extra}}


def test_the_node_attaches_and_detaches_only_roots_own_rebind_disk_dlv_reb_09_11(
    node: tuple[RealNode, InstancesSection, LibvirtRuntime],
) -> None:
    """DLV-REB-09, DLV-REB-11 under the helper: the node's runtime writes the disk and root hot-adds it
    (`attach-device`, the disk `attach-disk … vdz … --serial bc-rebind --live` makes, relabelling off,
    on root's own path); detach removes it; both
    audited with the node's uid."""
    n, _sec, rt = node
    rt.list()
    nonce = "5" * 32
    rt.rebind_attach("good", rebind_image(parse_rebind(b'{"v":1,"account":"t","principals":["p"]}'), nonce))
    assert answered(rt.rebind_answer("good"), nonce)  # the simulated guest read the tar and answered
    marker = n.root / STATE.lstrip("/") / "good.attached"
    assert marker.read_text().strip() == str(_disk(n))  # root's path, the file it checked
    assert n.h.last_audit()["op"] == "libvirt.rebind"
    rt.rebind_detach("good")
    assert not marker.exists() and not _disk(n).exists()
    assert n.h.last_audit()["op"] == "libvirt.unrebind"


def test_rebind_disk_refusals_as_the_real_node(
    node: tuple[RealNode, InstancesSection, LibvirtRuntime],
) -> None:
    """Root refuses: a name that is no instance id, a domain that is not there, a disk that is missing,
    a symlink, the wrong size, a second hard link, and any path, target or serial of the node's."""
    n, _sec, _rt = node
    n.refused(_attach("../etc"), "bad-name")
    n.refused(_attach("nope"), "no-domain")
    n.refused(_attach(), "no-rebind-disk")
    disk = _disk(n)
    os.symlink("/etc/shadow", disk)
    try:
        n.refused(_attach(), "rebind-disk", "symlink")
    finally:
        disk.unlink()
    disk.write_bytes(b"\0" * (REBIND_SIZE + 512))
    try:
        n.refused(_attach(), "rebind-disk")
        disk.write_bytes(b"\0" * REBIND_SIZE)
        other = disk.with_name("other")
        os.link(disk, other)
        try:
            n.refused(_attach(), "rebind-disk", "one link")
        finally:
            other.unlink()
        for field in ("path", "target", "serial"):
            answer = n.call(_attach(**{field: "/etc/shadow"}))
            assert answer["ok"] is False and field in answer["message"], answer
    finally:
        disk.unlink()


@settings(max_examples=60, deadline=None)
@given(name=st.text(min_size=0, max_size=70))
def test_detach_names_only_bcds_domains(
    node: tuple[RealNode, InstancesSection, LibvirtRuntime], name: str
) -> None:
    """Any name but bcd's running domain is refused (bad-name or no-domain) and changes nothing."""
    n, _sec, _rt = node
    if name == "good":
        return
    answer = n.call({"op": "libvirt.unrebind", "args": {"name": name}})
    assert answer["ok"] is False and answer.get("reason") in ("bad-name", "no-domain"), answer


def test_the_balloon_controller_sets_the_balloon_through_libvirt_setmem_dlv_hlp_03(
    node: tuple[RealNode, InstancesSection, LibvirtRuntime],
) -> None:
    """DLV-HLP-03: under the helper the controller's size goes to `libvirt.setmem` (the guest's new
    size in KiB, within its memory), audited; root passes it to `virsh setmem --live`."""
    n, sec, rt = node
    meminfo = n.root / "proc/meminfo"
    text = meminfo.read_text()
    total = int(next(line.split()[1] for line in text.splitlines() if line.startswith("MemTotal:")))
    meminfo.write_text(
        "\n".join(
            f"MemAvailable:   {total // 20} kB" if line.startswith("MemAvailable:") else line
            for line in text.splitlines()
        )
        + "\n"
    )
    (n.root / STATE.lstrip("/") / "good.used").write_text(f"{128 * 1024}\n")
    try:
        ctl = BalloonController(sec.system, {"libvirt-kvm": rt}, floor_percent=50)
        steps = ctl.tick(spec(vm("good", placement=Placement(balloon=True))), rt.list())
        assert [s.name for s in steps] == ["good"]
        last = n.h.last_audit()
        assert last["op"] == "libvirt.setmem" and last["decision"] == "accepted"
        kib = int((n.root / STATE.lstrip("/") / "good.balloon").read_text())
        assert kib * 1024 == steps[0].guest_bytes
    finally:
        meminfo.write_text(text)


def test_with_roots_the_signed_spec_must_ask_for_the_rebind(tmp_path: Path) -> None:
    """Root re-validates `libvirt.rebind` against the signed spec's instance when command-signing
    roots exist: no spec, a spec without the instance, or one whose instance carries no
    identity_rebind_ref is refused before anything runs; a spec that asks for it passes the check (and
    then meets root's own domain check)."""
    from bcd_shared import wire
    from helperproc import HelperProcess, assert_refused, base_config, make_root
    from intentkit import ControlPlane, intent

    node_id = "node-rb"
    cp = ControlPlane.build()
    root = make_root(tmp_path)
    cp.write_record(root, node_id, cp.bundle(1))
    h = HelperProcess(root, cp.config_lines() + base_config(extra='instance_bridges = "br0"\n'))
    try:

        def body(gen: int, ref: str) -> bytes:
            inst = wire.InstanceSpec(
                id="vm1", runtime="libvirt-kvm", desired_state=wire.InstanceDesiredState(1),
                identity_rebind_ref=ref,
            )  # fmt: skip
            full = wire.NodeSpec(instances=wire.InstancesSection(instances=[inst]))
            return bytes(
                wire.DesiredStateBody(node_id=node_id, generation=gen, spec_hash=f"h{gen}", full=full)
            )

        signer = cp.command.leaf()
        doc: dict[str, Any] = {"op": "libvirt.rebind", "args": {"name": "vm1"}}
        assert_refused(h, doc, "intent-required")
        doc["args"]["intent"] = intent(signer, body(1, ""))
        assert_refused(h, doc, "spec-mismatch")
        doc["args"]["intent"] = intent(signer, body(1, "ref-1"))
        assert_refused(h, doc, "no-domain")  # past the signed check: root's own view has no such domain
    finally:
        h.stop()
