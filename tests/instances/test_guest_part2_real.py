"""Issue 11 on a guest booted for real (the TCG guest of tests/instances/test_guest_boot_real.py): one
guest, booted once for this module, with a volume attached by serial and a balloon, driven by the real
libvirt-kvm runtime as root on `qemu:///system`.

The guest's init (tests/instances/guestkit.py) prints its disks (name, serial from sysfs, size in
sectors) and MemTotal on its serial console whenever they change, and runs the identity rebind script
published in docs/instances.md when a disk with serial `bc-rebind` appears (the busybox guest has no udev
or systemd; the script is the same). What the tests fake: nothing on the guest's side; the bundle comes
from a fixed secret source instead of a SecretRequest, and the balloon controller reads a host
`/proc/meminfo` the test writes (this machine's own memory is not under pressure).

Locally it skips when libvirtd does not answer on qemu:///system; under CI=true it fails instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from attrs import frozen
from bcd_agent.sections.instances.balloon import BalloonController
from bcd_agent.sections.instances.model import Image, InstanceSpec, Nic, Placement
from bcd_agent.sections.instances.plan import UserData
from bcd_agent.sections.instances.rebind import Rebinder
from bcd_agent.sections.instances.runtimes.base import Prepared
from bcd_agent.sections.instances.runtimes.libvirt import SYSTEM_URI, DirectVirsh, LibvirtRuntime
from bcd_agent.sections.instances.volumes import VolumeSpec, VolumeStore
from bcd_shared.system import LocalSystem
from guestkit import MARK, guest_boot_files
from instkit import FixedUserData, spec
from rebindkit import bundle
from test_guest_boot_real import _base_image, _Console, _require_libvirtd, _virsh
from test_guest_boot_real import _BootRuntime as BootRuntime

MIB = 1 << 20
MAC = "52:54:00:bc:d0:02"
SERIAL = "vol-serial-1"


class _BootRuntime(BootRuntime):
    """test_guest_boot_real.py's direct kernel boot, with time for the whole module."""

    poweroff_after = 900


@frozen
class Guest:
    rt: LibvirtRuntime
    inst: InstanceSpec
    console: _Console
    data: str
    store: VolumeStore


def _state(console: _Console, pattern: str, timeout: float) -> re.Match[str]:
    return console.wait_for(rf"{MARK}-STATE [^\n]*{pattern}", timeout)


@pytest.fixture(scope="module")
def guest() -> Iterator[Guest]:
    _require_libvirtd()
    kernel, initrd = guest_boot_files()
    work = Path(f"/var/tmp/bcd-guest2-{uuid.uuid4().hex[:8]}")
    work.mkdir(mode=0o755)
    os.chmod(work, 0o755)  # QEMU (libvirt-qemu) needs the search bit on the way
    bridge = f"bcdgu{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    name = f"bcd-guest2-{uuid.uuid4().hex[:8]}"
    console: _Console | None = None
    try:
        subprocess.run(["ip", "link", "set", bridge, "up"], check=True)
        data = str(work / "data")
        sha = _base_image(work, data, "part2")
        store = VolumeStore(str(Path(data) / "volumes"))
        store.create(VolumeSpec("vol1", SERIAL, 8 * MIB))
        inst = InstanceSpec(
            id=name, allocation_id="alloc-guest2", vcpus=1, memory_bytes=256 * MIB, disk_bytes=32 * MIB,
            image=Image("https://images.example/guest.qcow2", sha, "qcow2"), nics=(Nic(bridge, MAC, ()),),
            placement=Placement(balloon=True), volumes=(("vol1", False),), identity_rebind_ref="ref-1",
        )  # fmt: skip
        system = LocalSystem(Path("/"))
        rt = _BootRuntime(
            system, DirectVirsh(system, SYSTEM_URI), data, domain_type="qemu", cpu_mode="maximum",
            stop_timeout_s=5.0,
        )  # fmt: skip
        d = Path(data) / "libvirt/instances" / name
        d.mkdir(parents=True)
        shutil.copy(kernel, d / "vmlinuz")
        shutil.copy(initrd, d / "initrd")
        rt.create(inst, Prepared())
        rt.start(inst, paused=True)
        pty = re.search(r"<serial type='pty'>\s*<source path='(/dev/pts/\d+)'", _virsh("dumpxml", name))
        assert pty, "no pty"
        console = _Console(pty.group(1))
        time.sleep(1.2)  # QEMU's pty notices a reader within a second; before that it drops output
        rt.resume(name)
        console.wait_for(rf"{MARK}-UP", 90)
        rt.list()  # the runtime reads the definition (its balloon device, its volumes)
        yield Guest(rt, inst, console, data, store)
    finally:
        if console is not None:
            console.close()
        subprocess.run(["virsh", "-c", SYSTEM_URI, "destroy", name], capture_output=True, check=False)
        subprocess.run(["virsh", "-c", SYSTEM_URI, "undefine", name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", bridge], check=False)
        shutil.rmtree(work, ignore_errors=True)


def test_a_volume_attached_by_serial_is_seen_by_the_guest_dlv_vol_16(guest: Guest) -> None:
    """DLV-VOL-16, DLV-VOL-12: the guest finds the volume as vdb with its serial (sysfs `serial`, which
    udev turns into /dev/disk/by-id/virtio-<serial>) and its 8 MiB."""
    _state(guest.console, rf"vdb:{SERIAL}:{8 * MIB // 512} ", 30)


def test_a_live_resize_reaches_the_guest_dlv_vol_11(guest: Guest) -> None:
    """DLV-VOL-11: the volume grown in the store and `virsh blockresize` on its target: the running
    guest sees 16 MiB without a reboot."""
    guest.store.grow(VolumeSpec("vol1", SERIAL, 16 * MIB), guest.store.list()["vol1"])
    guest.rt.resize_volume(guest.inst.id, "vdb", 16 * MIB)
    _state(guest.console, rf"vdb:{SERIAL}:{16 * MIB // 512} ", 30)


def _mem_total_kb(guest: Guest) -> int:
    # Whole lines only: the console may hold a line still being written ("mem:222" of "mem:222028").
    found = re.findall(rf"{MARK}-STATE [^\n]*mem:(\d+)\r?\n", guest.console.text)
    return int(found[-1])


class _Host:
    """The host's /proc for the balloon controller: a MemTotal with 5% available (pressure)."""

    def read_text(self, path: str) -> str | None:
        if path == "/proc/meminfo":
            return "MemTotal:       8388608 kB\nMemFree:  1 kB\nMemAvailable:    419430 kB\n"
        return None


def test_setmem_live_changes_the_balloon_dlv_bal_12(guest: Guest) -> None:
    """DLV-BAL-12, DLV-BAL-11, DLV-BAL-07: the controller, under (written) host pressure, reads the guest's
    balloon and use from `domstats --balloon` (the guest's driver reports them), takes a quarter of its
    256 MiB with `virsh setmem --live`, and the guest's MemTotal drops by as much; emptying the balloon
    gives it back."""
    rt, name = guest.rt, guest.inst.id
    deadline = time.monotonic() + 60
    while True:
        reading = rt.balloon_readings().get(name)
        if reading is not None and reading.used_bytes is not None:
            break
        assert time.monotonic() < deadline, f"no usage reading from the guest's balloon: {reading}"
        guest.console.drain(1.0)
    assert reading.balloon_bytes == 0 and 0 < reading.used_bytes < 256 * MIB
    before = _mem_total_kb(guest)
    ctl = BalloonController(_Host(), {"libvirt-kvm": rt}, floor_percent=50)
    mark = len(guest.console.text)
    steps = ctl.tick(spec(guest.inst), rt.list())
    assert [(s.name, s.balloon_bytes) for s in steps] == [(name, 64 * MIB)]
    _wait_balloon(guest, 64 * MIB)
    # The guest inflates in steps and prints MemTotal once a second: it may print a value on the way
    # down; what it must reach is 64 MiB less, printed on a whole line after the change.
    inflated = _mem_line(guest, before - 64 * 1024, mark)
    rt.set_balloon(name, 0)
    _wait_balloon(guest, 0)
    _mem_line(guest, before, inflated.end())


def _mem_line(guest: Guest, kb: int, since: int) -> re.Match[str]:
    """A whole STATE line printed after offset `since` with MemTotal `kb`; the values printed meanwhile
    are in the failure's console tail."""
    return guest.console.wait_for(rf"{MARK}-STATE [^\n]*mem:{kb}\r?\n", 90, since)


def _wait_balloon(guest: Guest, size: int) -> None:
    deadline = time.monotonic() + 30
    while (got := guest.rt.balloon_readings()[guest.inst.id].balloon_bytes) != size:
        assert time.monotonic() < deadline, f"balloon {got}, not {size}"
        guest.console.drain(0.5)


def test_the_identity_rebind_runs_whole_dlv_reb_05_07_09_10_11_12_13(guest: Guest) -> None:
    """DLV-REB-05, DLV-REB-07, DLV-REB-09, DLV-REB-10, DLV-REB-11, DLV-REB-12, DLV-REB-13, DLV-REB-19: the
    1 MiB disk is hot-added with serial bc-rebind, the guest runs the published script (it reads the tar:
    the principals and the host certificate are installed) and writes its answer, bcd reads it, detaches
    the disk (gone from the domain) and deletes the file; the reference is recorded."""
    rt, name = guest.rt, guest.inst.id
    source = FixedUserData({name: UserData(data=bundle())})
    rebinder = Rebinder(LocalSystem(Path("/")), guest.data, {"libvirt-kvm": rt}, source, poll_s=0.5)
    drained: list[Any] = []

    def sleep(s: float) -> None:
        drained.append(s)
        guest.console.drain(s)

    rebinder.sleep = sleep
    assert rebinder.tick(spec(guest.inst), rt.list()) == [(name, "rebound")]
    assert source.asked == [(name, "alloc-guest2", "ref-1")]
    guest.console.wait_for(rf"{MARK}-REBOUND tenant alloc-7,sandbox-7,", 60)
    guest.console.wait_for(rf"{MARK}-HOSTCERT ssh-ed25519-cert-v01@openssh.com", 60)
    assert not (Path(guest.data) / f"libvirt/instances/{name}/rebind.img").exists()
    deadline = time.monotonic() + 30
    while "vdz" in _virsh("domblklist", name):
        assert time.monotonic() < deadline, "the rebind disk was not detached"
        guest.console.drain(0.5)
    doc = json.loads((Path(guest.data) / "instances-rebound.json").read_text())
    assert doc["rebound"] == {name: "ref-1"}
    assert rebinder.tick(spec(guest.inst), rt.list()) == []  # plan again: nothing


@pytest.fixture
def real_helper(guest: Guest) -> Iterator[tuple[Any, Path]]:
    """A real `bcd helper serve --root /` for the guest's data_dir (as in test_guest_boot_real.py's
    helper_socket): [helper] libvirt_uri = qemu:///system, the guest's bridge allowed."""
    import contextlib
    import grp
    import sys

    from bcd_agent.helperclient import HelperClient
    from bcd_helper.audit import init_key

    hostconfig = Path("/var/lib/bcd-hostconfig")
    made_hostconfig = not hostconfig.exists()
    kvm_gid = grp.getgrnam("kvm").gr_gid
    home = Path(f"/var/lib/bcd-guest2-helper-{uuid.uuid4().hex[:8]}")
    home.mkdir(mode=0o750)
    (home / "config.toml").write_text(
        f'data_dir = "{guest.data}"\n[helper]\nsocket = "{home}/helper.sock"\n'
        f'root_socket = "{home}/helper-root.sock"\nnode_uid = 4242\nnode_gid = {kvm_gid}\n'
        f'audit_dir = "{home}/audit"\ninstance_bridges = "{guest.inst.nics[0].bridge}"\n'
        f'libvirt_uri = "{SYSTEM_URI}"\n'
    )
    init_key(Path("/"), f"{home}/audit")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bcd_helper.cli",
            "serve",
            "--root",
            "/",
            "--config",
            str(home / "config.toml"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    client = None
    try:
        deadline = time.monotonic() + 60  # a loaded machine imports and starts the helper slowly
        while client is None:
            assert proc.poll() is None, proc.communicate()[1].decode()
            if (home / "helper.sock").exists():
                with contextlib.suppress(Exception):
                    HelperClient(str(home / "helper.sock")).ping()
                    client = HelperClient(str(home / "helper.sock"))
            assert time.monotonic() < deadline, "the helper did not start"
            time.sleep(0.05)
        yield client, home
    finally:
        if client is not None:
            client.close()
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)
        if made_hostconfig:
            shutil.rmtree(hostconfig, ignore_errors=True)


def test_rebind_and_setmem_through_a_real_helper_dlv_hlp_03(
    guest: Guest, real_helper: tuple[Any, Path]
) -> None:
    """DLV-HLP-03, DLV-REB-09 under the helper, for real: a new reference is installed with root's
    `libvirt.rebind` (root builds the attach-disk argv from the name) and `libvirt.unrebind`, the guest
    answers again; the balloon's size goes through `libvirt.setmem` and reaches the guest; each op is
    in root's audit log."""
    from bcd_agent.sections.instances.runtimes.libvirt import HelperVirsh

    client, home = real_helper
    system = LocalSystem(Path("/"))
    rt = _BootRuntime(system, HelperVirsh(system, client, SYSTEM_URI), guest.data, under_helper=True,
                      domain_type="qemu", cpu_mode="maximum")  # fmt: skip
    rt.list()
    name = guest.inst.id
    # The node's files carry its group (QEMU's user is in it; kvm here): what the runtime writes in the
    # instance's directory from now on gets it, as the node's rebind disk would. Root hot-adds that
    # disk with relabelling off (docs/helper.md round 3, row 22): QEMU reaches it through the group.
    import grp
    import stat

    inst_dir = Path(guest.data) / "libvirt/instances" / name
    os.chown(inst_dir, -1, grp.getgrnam("kvm").gr_gid)
    os.chmod(inst_dir, stat.S_IMODE(os.stat(inst_dir).st_mode) | stat.S_ISGID | stat.S_IXGRP)
    inst = InstanceSpec(**{**_fields(guest.inst), "identity_rebind_ref": "ref-2"})
    source = FixedUserData({name: UserData(data=bundle(with_key=False, principals=["helper-8"]))})
    rebinder = Rebinder(system, guest.data, {"libvirt-kvm": rt}, source, poll_s=0.5)
    rebinder.sleep = guest.console.drain
    outcome = rebinder.tick(spec(inst), rt.list())
    assert outcome == [(name, "rebound")], guest.console.text[-3000:]
    guest.console.wait_for(rf"{MARK}-REBOUND tenant helper-8,", 60)
    rt.set_balloon(name, 32 * MIB)
    deadline = time.monotonic() + 30
    while rt.balloon_readings()[name].balloon_bytes != 32 * MIB:
        assert time.monotonic() < deadline, "the balloon did not reach 32 MiB"
        guest.console.drain(0.5)
    rt.set_balloon(name, 0)
    audit = (home / "audit/audit.log").read_text()
    for op in ("libvirt.rebind", "libvirt.unrebind", "libvirt.setmem"):
        assert f'"{op}"' in audit, op


def _fields(inst: InstanceSpec) -> dict[str, Any]:
    import attrs

    return attrs.asdict(inst, recurse=False)
