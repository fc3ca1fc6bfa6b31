"""libvirt.* with command-signing roots (root's join record names them): define and start are
re-validated against the signed spec's instance; defines reach the real libvirt test driver
(`[helper] libvirt_uri = "test:///default"`); the console comes back as a file descriptor."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.sections.instances.model import Image, InstanceSpec, Nic
from bcd_agent.sections.instances.runtimes.base import Prepared
from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime
from bcd_shared import wire
from bcd_shared.system import CommandResult
from bcd_simhost import sim_system
from bcd_simhost.libvirt import IMAGE_SHA256
from helperproc import HelperProcess, assert_refused, base_config, make_root
from intentkit import ControlPlane, intent
from testsupport import require_tool

GIB = 1 << 30
NODE = "node-lv"
MAC = "52:54:00:00:00:01"
URL = "https://images.sim.bcd/debian.qcow2"


class Keep:
    def __init__(self) -> None:
        self.xml = b""

    def read(self, *args: str) -> CommandResult:
        return CommandResult(args, 0, b"shut off\n")

    def define(self, name: str, xml: bytes, xml_path: str) -> None:
        self.xml = xml

    def act(self, verb: str, name: str, *args: str) -> CommandResult:
        return CommandResult((verb,), 0)


def body(generation: int, *instances: wire.InstanceSpec) -> bytes:
    spec = wire.NodeSpec(instances=wire.InstancesSection(instances=list(instances)))
    return bytes(
        wire.DesiredStateBody(node_id=NODE, generation=generation, spec_hash=f"h{generation}", full=spec)
    )


def wire_vm(name: str = "vm1", vcpus: int = 2, state: int = 1) -> wire.InstanceSpec:
    return wire.InstanceSpec(
        id=name,
        allocation_id="a1",
        runtime="libvirt-kvm",
        desired_state=wire.InstanceDesiredState(state),
        size=wire.InstanceSize(vcpus=vcpus, memory_bytes=GIB, disk_bytes=10 * GIB),
        image=wire.ImageRef(url=URL, sha256=IMAGE_SHA256, format="qcow2"),
        nics=[wire.Nic(bridge="br0", mac=MAC)],
    )


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HelperProcess, ControlPlane, str]]:
    require_tool("virsh")
    cp = ControlPlane.build()
    root = make_root(tmp_path_factory.mktemp("lvsigned"))
    cp.write_record(root, NODE, cp.bundle(1))
    extra = 'instance_bridges = "br0"\nlibvirt_uri = "test:///default"\n'
    proc = HelperProcess(root, cp.config_lines() + base_config(extra=extra))
    system = sim_system(root)
    keep = Keep()
    inst = InstanceSpec(
        id="vm1", allocation_id="a1", vcpus=2, memory_bytes=GIB, disk_bytes=10 * GIB,
        image=Image(URL, IMAGE_SHA256, "qcow2"), nics=(Nic("br0", MAC),),
    )  # fmt: skip
    LibvirtRuntime(system, keep, "/var/lib/bcd", under_helper=True).create(inst, Prepared())
    yield proc, cp, keep.xml.decode()
    proc.stop()


def _define(xml: str, intent_arg: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {"name": "vm1", "xml": xml}
    if intent_arg is not None:
        args["intent"] = intent_arg
    return {"op": "libvirt.define", "args": args}


def test_define_needs_the_signed_spec_when_roots_exist(
    signed: tuple[HelperProcess, ControlPlane, str],
) -> None:
    """DLV-HLP-09 (checked like a define), root re-validates each define against the signed spec."""
    h, cp, xml = signed
    signer = cp.command.leaf()
    assert_refused(h, _define(xml, None), "intent-required")
    assert_refused(h, _define(xml, intent(signer, body(1))), "not-in-spec")
    assert_refused(h, _define(xml, intent(signer, body(1, wire_vm(state=4)))), "not-in-spec")
    assert_refused(h, _define(xml, intent(signer, body(1, wire_vm(vcpus=8)))), "spec-mismatch")
    stranger = cp.other.leaf()
    assert_refused(h, _define(xml, intent(stranger, body(1, wire_vm()))), "bad-intent")


def test_a_signed_define_reaches_real_libvirt(signed: tuple[HelperProcess, ControlPlane, str]) -> None:
    """The definition root staged is accepted by libvirt itself (`virsh define --validate`, test driver)."""
    h, cp, xml = signed
    answer = h.raw(_define(xml, intent(cp.command.leaf(), body(2, wire_vm()))))
    assert answer["ok"] is True, answer
    assert answer["result"]["taps"] and answer["result"]["disks"][0].endswith("/vm1/disk.qcow2")
    staged = h.root / "var/lib/bcd-hostconfig/libvirt/vm1.xml"
    assert staged.read_bytes() == _no_relabel(xml.encode()) and (os.stat(staged).st_mode & 0o777) == 0o600
    # an older generation than one accepted is refused
    assert_refused(h, _define(xml, intent(cp.command.leaf(), body(1, wire_vm()))), "stale-generation")


def test_console_is_handed_back_as_a_descriptor_dlv_hlp_07(tmp_path: Path) -> None:
    """DLV-HLP-07: root opens the domain's pty and the node gets the descriptor over SCM_RIGHTS."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
    from bcd_agent.sections.instances.runtimes.libvirt import HelperVirsh
    from bcd_agent.sections.instances.section import InstancesSection
    from instkit import FixedUserData, converge, spec, vm

    root = make_root(tmp_path)
    h = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    try:
        system = sim_system(root)
        rt = LibvirtRuntime(system, HelperVirsh(system, h.client), "/var/lib/bcd", under_helper=True)
        converge(InstancesSection(system, [rt], "/var/lib/bcd", user_data=FixedUserData()), spec(vm("c1")))
        result, fd = h.client.call_fd("libvirt.console", {"name": "c1"})
        try:
            os.write(fd, b"hello console\n")
        finally:
            os.close(fd)
        pty = root / result["pty"].lstrip("/")
        assert pty.read_bytes() == b"hello console\n"
        assert h.last_audit()["op"] == "libvirt.console"
    finally:
        h.stop()


def test_libvirt_itself_refuses_defining_over_a_domain_bcd_did_not_create(tmp_path: Path) -> None:
    """DLV-LIBVIRT-17 with real libvirt: the test driver's own domain `test` exists under another
    UUID; bcd's definition of an instance `test` (bcd's UUID) is refused by libvirt, atomically."""
    root = make_root(tmp_path)
    h = HelperProcess(root, base_config(extra='instance_bridges = "br0"\nlibvirt_uri = "test:///default"\n'))
    try:
        system = sim_system(root)
        keep = Keep()
        inst = InstanceSpec(
            id="test", allocation_id="a1", vcpus=1, memory_bytes=GIB, disk_bytes=10 * GIB,
            image=Image(URL, IMAGE_SHA256, "qcow2"), nics=(Nic("br0", MAC),),
        )  # fmt: skip
        LibvirtRuntime(system, keep, "/var/lib/bcd", under_helper=True).create(inst, Prepared())
        answer = h.raw({"op": "libvirt.define", "args": {"name": "test", "xml": keep.xml.decode()}})
        assert answer["ok"] is False and answer["error"] == "failed", answer
        assert "already exists with uuid" in answer["message"]
    finally:
        h.stop()


def _no_relabel(xml: bytes) -> bytes:
    from bcd_helper.ops.libvirt import root_definition

    return root_definition(xml, fdgroups=False)  # the test driver passes no descriptors
