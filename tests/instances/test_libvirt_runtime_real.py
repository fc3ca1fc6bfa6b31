"""The libvirt-kvm runtime's files with the real tools: qemu-img builds the overlay without opening
the base (-u, explicit -F), grows it (never shrinks), genisoimage writes the NoCloud seed, and QEMU's
user can reach the files as root (o+x on the way, never o+r). libvirt itself is a recording stand-in
here: its real half is test_domainxml_real.py (schema and test driver) and the helper's tests."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
from bcd_agent.sections.instances.model import Image, InstanceSpec
from bcd_agent.sections.instances.runtimes.base import Prepared
from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime
from bcd_shared.errors import TerminalError
from bcd_shared.system import CommandResult, LocalSystem
from testsupport import require_tool

GIB = 1 << 30
DATA = "/var/lib/bcd"


class RecordingVirsh:
    def __init__(self) -> None:
        self.defined: list[tuple[str, bytes]] = []

    def read(self, *args: str) -> CommandResult:
        return CommandResult(("virsh", *args), 0, b"shut off\n")

    def define(self, name: str, xml: bytes, xml_path: str) -> None:
        self.defined.append((name, xml))

    def act(self, verb: str, name: str, *args: str) -> CommandResult:
        return CommandResult(("virsh", verb, name), 0)


@pytest.fixture
def host(tmp_path: Path) -> tuple[LocalSystem, LibvirtRuntime, RecordingVirsh, InstanceSpec]:
    qemu_img = require_tool("qemu-img")
    require_tool("genisoimage")
    root = tmp_path / "root"
    images = root / DATA.lstrip("/") / "libvirt/images"
    images.mkdir(parents=True)
    for d in (root / DATA.lstrip("/"), images.parent, images):
        os.chmod(d, 0o700)  # bcd's directories as root (DLV-QFA-05)
    tmp = tmp_path / "base.qcow2"
    subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", str(tmp), str(2 * GIB)], check=True)
    sha = hashlib.sha256(tmp.read_bytes()).hexdigest()
    os.replace(tmp, images / f"{sha}.qcow2")
    system = LocalSystem(root)  # no fake tools: the real qemu-img and genisoimage run
    virsh = RecordingVirsh()
    rt = LibvirtRuntime(system, virsh, DATA)
    inst = InstanceSpec(
        id="vm1", allocation_id="a1", vcpus=1, memory_bytes=GIB, disk_bytes=4 * GIB,
        image=Image("https://images.example/base.qcow2", sha, "qcow2"),
    )  # fmt: skip
    return system, rt, virsh, inst


def _info(path: Path) -> dict[str, object]:
    out = subprocess.run(
        ["qemu-img", "info", "--output=json", "-f", "qcow2", "--backing-chain", str(path)],
        capture_output=True,
        check=True,
    )
    chain: list[dict[str, object]] = json.loads(out.stdout)
    return chain[0]


def test_overlay_with_u_and_explicit_format_dlv_img_18(
    host: tuple[LocalSystem, LibvirtRuntime, RecordingVirsh, InstanceSpec],
) -> None:
    """DLV-IMG-18, DLV-LIBVIRT-02, DLV-LIBVIRT-05: instances/<id>/disk.qcow2 on images/<sha256>.qcow2."""
    system, rt, virsh, inst = host
    rt.create(inst, Prepared(user_data=b"#cloud-config\n"))
    assert inst.image is not None
    disk = system.host_path(f"{DATA}/libvirt/instances/vm1/disk.qcow2")
    info = _info(disk)
    base = system.host_path(f"{DATA}/libvirt/images/{inst.image.sha256}.qcow2")
    assert info["backing-filename"] == str(base)
    assert info["backing-filename-format"] == "qcow2"
    assert info["virtual-size"] == 4 * GIB
    assert virsh.defined and virsh.defined[0][0] == "vm1"


def test_seed_is_a_nocloud_iso_dlv_libvirt_09_10(
    host: tuple[LocalSystem, LibvirtRuntime, RecordingVirsh, InstanceSpec],
) -> None:
    """DLV-LIBVIRT-09, DLV-LIBVIRT-10: volume cidata, user-data and meta-data (instance-id, hostname)."""
    system, rt, _virsh, inst = host
    rt.create(inst, Prepared(user_data=b"#cloud-config\nhostname: vm1\n"))
    iso = system.host_path(f"{DATA}/libvirt/instances/vm1/seed.iso").read_bytes()
    assert iso[0x8001:0x8006] == b"CD001" and iso[0x8028:0x8030] == b"cidata  "
    assert b"instance-id: vm1\nlocal-hostname: vm1\n" in iso and b"hostname: vm1" in iso
    assert b"USER-DATA" in iso.upper() and b"META-DATA" in iso.upper()


def test_grow_with_qemu_img_while_stopped_and_never_shrink_dlv_libvirt_07_08(
    host: tuple[LocalSystem, LibvirtRuntime, RecordingVirsh, InstanceSpec],
) -> None:
    """DLV-LIBVIRT-07, DLV-LIBVIRT-08, DLV-IMG-19: the size read from the header, grown for real."""
    system, rt, _virsh, inst = host
    rt.create(inst, Prepared())
    from attrs import evolve

    rt.grow(evolve(inst, disk_bytes=6 * GIB), running=False)
    disk = system.host_path(f"{DATA}/libvirt/instances/vm1/disk.qcow2")
    assert _info(disk)["virtual-size"] == 6 * GIB
    with pytest.raises(TerminalError, match="disks only grow"):
        rt.grow(evolve(inst, disk_bytes=5 * GIB), running=False)
    assert _info(disk)["virtual-size"] == 6 * GIB
    assert _info(disk)["backing-filename"] == str(
        system.host_path(f"{DATA}/libvirt/images/{inst.image.sha256}.qcow2")  # type: ignore[union-attr]
    )  # the resize kept the overlay's base


def test_qemu_reaches_its_files_as_root_dlv_qfa_01_02_03(
    host: tuple[LocalSystem, LibvirtRuntime, RecordingVirsh, InstanceSpec],
) -> None:
    """DLV-QFA-01, DLV-QFA-02, DLV-QFA-03, DLV-QFA-05: o+x (never o+r) from data_dir down."""
    system, rt, _virsh, inst = host
    rt.create(inst, Prepared(user_data=b"x"))
    for d in ("", "/libvirt", "/libvirt/instances", "/libvirt/instances/vm1", "/libvirt/images"):
        mode = stat.S_IMODE(os.stat(system.host_path(DATA + d)).st_mode)
        assert mode & 0o001, (d, oct(mode))
        assert not mode & 0o006, (d, oct(mode))
    assert stat.S_IMODE(os.stat(system.host_path(f"{DATA}/libvirt/images")).st_mode) == 0o701


def test_bcds_own_files_stay_0600_dlv_qfa_04(
    host: tuple[LocalSystem, LibvirtRuntime, RecordingVirsh, InstanceSpec],
) -> None:
    """DLV-QFA-04: the definition bcd keeps is 0600; the seed's staged user data does not stay."""
    system, rt, _virsh, inst = host
    rt.create(inst, Prepared(user_data=b"secret user data"))
    d = system.host_path(f"{DATA}/libvirt/instances/vm1")
    assert stat.S_IMODE(os.stat(d / "domain.xml").st_mode) == 0o600
    assert sorted(os.listdir(d)) == ["disk.qcow2", "domain.xml", "seed.iso"]


def test_resize_opens_no_file_a_header_names(tmp_path: Path) -> None:
    """qemu-img resize of the overlay alone: a header naming a trap file, the trap is never opened
    (strace), and the overlay is resized."""
    qemu_img = require_tool("qemu-img")
    strace = require_tool("strace")
    from bcd_agent.sections.instances.runtimes.libvirt import overlay_only

    trap = tmp_path / "trap.qcow2"
    subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", str(trap), str(GIB)], check=True)
    disk = tmp_path / "disk.qcow2"
    subprocess.run(
        [qemu_img, "create", "-q", "-f", "qcow2", "-u", "-b", str(trap), "-F", "qcow2", str(disk), str(GIB)],
        check=True,
    )
    out = subprocess.run(
        [strace, "-f", "-e", "trace=open,openat", qemu_img, "resize", overlay_only(str(disk)), str(2 * GIB)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "trap.qcow2" not in out.stderr
    assert _info(disk)["virtual-size"] == 2 * GIB


def test_a_rewritten_overlay_does_not_start_dlv_img_11_14(
    host: tuple[LocalSystem, LibvirtRuntime, RecordingVirsh, InstanceSpec],
) -> None:
    """DLV-IMG-11, DLV-IMG-14: an overlay naming another backing file fails the instance."""
    system, rt, _virsh, inst = host
    rt.create(inst, Prepared())
    disk = system.host_path(f"{DATA}/libvirt/instances/vm1/disk.qcow2")
    subprocess.run(
        ["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "raw", "-b", "/etc/passwd", str(disk)], check=True
    )
    with pytest.raises(TerminalError, match="not bcd's base"):
        rt.check_overlay(inst)


def test_a_start_gives_qemu_its_way_back_after_the_journal_closed_data_dir(
    host: tuple[LocalSystem, LibvirtRuntime, RecordingVirsh, InstanceSpec],
) -> None:
    """DLV-QFA-01: bcd's journal sets data_dir back to 0700 at every start of bcd; the runtime adds the
    search bit again before every domain start, so a stopped VM still starts after a restart of bcd."""
    system, rt, _virsh, inst = host
    rt.create(inst, Prepared())
    top = system.host_path(DATA)
    os.chmod(top, 0o700)  # what Journal.open does
    rt.start(inst, paused=False)
    assert stat.S_IMODE(os.stat(top).st_mode) == 0o701
