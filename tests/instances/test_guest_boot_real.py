"""A guest booted for real (issue 10): Debian's cloud kernel and a busybox initramfs (tests/instances/
guestkit.py) under `qemu:///system`, `<domain type='qemu'>` (TCG) with `<cpu mode='maximum'>`: the
paravirtualised KVM here boots no stock kernel (../shared/notes/instances-facts.md "KVM and guests").

Two drivers of the same run (`_drive`): the real libvirt-kvm runtime as root (DirectVirsh), and the
real runtime through a real helper process (`bcd helper serve --root /` with [helper] libvirt_uri =
qemu:///system, its config, sockets and audit log in a root-only directory of the test's own): every
change a libvirt.* operation with root's domain check, reads through `virsh -r`. In the helper run the
test plays the node's part in file ownership (uid 4242, group kvm, which QEMU's user is in: the install
step DLV-HLP-13 is not built).

The only test-only parts: `domain_type="qemu"` and `cpu_mode="maximum"` (constructor arguments whose
production defaults are kvm and host-passthrough), and `_BootRuntime.files`, a subclass that adds a
direct kernel boot (kernel, initrd, cmdline in the instance's directory) to the files the runtime gives
the domain XML builder. Everything else is the production path: the base image checked and the overlay
created by qemu-img (-u, -F), the domain XML built and defined with `virsh define --validate`, file
access for QEMU, `start --paused`, `suspend`/`resume`, `shutdown` (ACPI) and `undefine`.

The test reads the serial console from the pty root's `dumpxml` names (the domain starts paused so the
console is open before the guest prints anything). Locally it skips when libvirtd does not answer on
qemu:///system; under CI=true it fails instead (.ci/run installs and starts it).
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
import tty
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from bcd_agent.sections.instances.model import Image, InstanceSpec, Nic
from bcd_agent.sections.instances.runtimes.base import PAUSED, RUNNING, STOPPED, DomainFiles, Prepared
from bcd_agent.sections.instances.runtimes.libvirt import SYSTEM_URI, DirectVirsh, LibvirtRuntime
from bcd_shared.instancenames import tap_name
from bcd_shared.system import LocalSystem
from guestkit import MARK, guest_boot_files
from testsupport import IN_CI, require_root, require_tool

MIB = 1 << 20
MAC = "52:54:00:bc:d0:01"


class _BootRuntime(LibvirtRuntime):
    """Test-only: the production runtime plus a direct kernel boot from the instance's directory; the
    guest powers itself off after `poweroff_after` seconds, whatever happens to the test."""

    poweroff_after = 120

    def files(self, inst: InstanceSpec, base: str | None, seed: bool) -> DomainFiles:
        files = super().files(inst, base, seed)
        d = self._dir(inst.id)
        return DomainFiles(
            disk=files.disk, base=files.base, base_format=files.base_format, seed=files.seed,
            install_iso=files.install_iso, kernel=f"{d}/vmlinuz", initrd=f"{d}/initrd",
            cmdline=f"console=ttyS0 panic=-1 quiet bcd.poweroff_after={self.poweroff_after}",
            volumes=files.volumes,
        )  # fmt: skip


def _require_libvirtd() -> str:
    virsh = require_tool("virsh")
    require_tool("qemu-system-x86_64")
    for tool in ("busybox", "cpio", "mkfs.ext4", "apt-get", "dpkg-deb", "ip"):
        require_tool(tool)
    res = subprocess.run([virsh, "-c", SYSTEM_URI, "version"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        why = f"libvirtd does not answer on {SYSTEM_URI}: {res.stderr.strip()[:200]}"
        if IN_CI:
            pytest.fail(why + " (.ci/run starts it)")
        pytest.skip(why)
    require_root("the booted guest is driven as root")
    return virsh


@pytest.fixture(scope="session")
def boot_files() -> tuple[Path, Path]:
    _require_libvirtd()
    return guest_boot_files()


@pytest.fixture
def bridge() -> Iterator[str]:
    name = f"bcdgt{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Not under pytest's tmp (0700): QEMU runs as libvirt-qemu and needs the search bit on the way.
    path = Path(f"/var/tmp/bcd-guest-{uuid.uuid4().hex[:8]}")
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _base_image(work: Path, data: str, marker: str) -> str:
    """A flat qcow2 holding an ext4 filesystem with /marker, stored as the runtime's images/<sha>.qcow2."""
    content = work / "content"
    content.mkdir()
    (content / "marker").write_text(marker + "\n")
    raw = work / "base.raw"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(content), str(raw), "16M"], check=True)
    tmp = work / "base.qcow2"
    subprocess.run(["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", str(raw), str(tmp)], check=True)
    sha = hashlib.sha256(tmp.read_bytes()).hexdigest()
    images = Path(data) / "libvirt/images"
    images.mkdir(parents=True, mode=0o700)
    os.replace(tmp, images / f"{sha}.qcow2")
    return sha


class _Console:
    def __init__(self, pty: str) -> None:
        self.fd = os.open(pty, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
        tty.setraw(self.fd)  # no echo back into the guest, no line editing
        self.text = ""

    def wait_for(self, pattern: str, timeout: float, since: int = 0) -> re.Match[str]:
        """The first match of `pattern` in the console's text from offset `since` (a `len(text)` taken
        before the change whose output is awaited), waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern).search(self.text, since)
            if found:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} on the console in {timeout}s:\n{self.text[-3000:]}")
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready and not self._read():
                time.sleep(min(left, 0.2))

    def drain(self, seconds: float) -> None:
        """Read whatever arrives for `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready and not self._read():
                time.sleep(min(left, 0.2))

    def _read(self) -> bool:
        """Append what the pty holds; False once QEMU has closed its side (the guest is gone: EIO, or
        end of file after the hangup, which select reports as ready forever)."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        self.text += chunk.decode(errors="replace")
        return bool(chunk)

    def close(self) -> None:
        os.close(self.fd)


def _virsh(*args: str) -> str:
    return subprocess.run(
        ["virsh", "-c", SYSTEM_URI, *args], capture_output=True, text=True, check=True
    ).stdout


def _instance(workdir: Path, bridge: str) -> tuple[InstanceSpec, str, str]:
    data = str(workdir / "data")
    marker = f"disk-{uuid.uuid4().hex[:12]}"
    sha = _base_image(workdir, data, marker)
    inst = InstanceSpec(
        id=f"bcd-guest-test-{uuid.uuid4().hex[:8]}", allocation_id="alloc-guest", vcpus=1,
        memory_bytes=256 * MIB, disk_bytes=32 * MIB,
        image=Image("https://images.example/guest.qcow2", sha, "qcow2"),
        nics=(Nic(bridge, MAC, ()),),
    )  # fmt: skip
    return inst, data, marker


def _drive(
    rt: LibvirtRuntime,
    inst: InstanceSpec,
    marker: str,
    boot_files: tuple[Path, Path],
    before_start: Callable[[], None] = lambda: None,
) -> None:
    """Create, start paused, resume, see it run, suspend/resume, stop gracefully, delete."""
    kernel, initrd = boot_files
    console: _Console | None = None
    name, data, bridge = inst.id, rt.data_dir, inst.nics[0].bridge
    try:
        d = Path(data) / "libvirt/instances" / name
        d.mkdir(parents=True)
        shutil.copy(kernel, d / "vmlinuz")  # before the define: root's check wants the kernel there
        shutil.copy(initrd, d / "initrd")
        rt.create(inst, Prepared())
        before_start()
        xml = _virsh("dumpxml", "--inactive", name)
        assert "<domain type='qemu'" in xml and "mode='maximum'" in xml
        assert "<backingStore/>" in xml  # the overlay's chain is explicit and ends there

        rt.start(inst, paused=True)
        assert {dom.name: dom.state for dom in rt.list()}[name] == PAUSED
        live = _virsh("dumpxml", name)
        pty = re.search(r"<serial type='pty'>\s*<source path='(/dev/pts/\d+)'", live)
        assert pty, live
        console = _Console(pty.group(1))
        time.sleep(1.2)  # QEMU's pty chardev notices a reader within a second; before that it drops output
        rt.resume(name)

        console.wait_for(rf"{MARK}-UP", 75)
        assert f"{MARK}-DISK {marker}" in console.text, console.text[-3000:]
        assert f"{MARK}-NIC {MAC}" in console.text, console.text[-3000:]
        tap = tap_name(name, 0)
        assert Path(f"/sys/class/net/{bridge}/brif/{tap}").exists(), os.listdir(
            f"/sys/class/net/{bridge}/brif"
        )
        assert Path(data, "libvirt/instances", name, "disk.qcow2").as_posix() in _virsh("domblklist", name)
        listed = {dom.name: dom for dom in rt.list()}[name]
        assert (listed.state, listed.managed, listed.allocation_id) == (RUNNING, True, "alloc-guest")
        assert listed.disk_bytes == 32 * MIB and listed.vcpus == 1 and listed.memory_bytes == 256 * MIB

        console.wait_for(rf"{MARK}-TICK 1\b", 20)  # the guest's clock ticks
        rt.suspend(name)
        assert _virsh("domstate", name).strip() == "paused"
        console.drain(1.0)
        ticks_paused = console.text.count(f"{MARK}-TICK")
        console.drain(3.0)
        assert console.text.count(f"{MARK}-TICK") == ticks_paused, "the guest ticked while paused"
        rt.resume(name)
        assert _virsh("domstate", name).strip() == "running"
        console.wait_for(rf"(?s)(?:{MARK}-TICK.*){{{ticks_paused + 1}}}", 20)  # ticking again

        # virsh shutdown (ACPI power button), waiting up to stop_timeout_s before a destroy; the console
        # is read meanwhile, since QEMU closes it when the guest is gone.
        failed: list[BaseException] = []

        def stop() -> None:
            try:
                rt.stop(name)
            except BaseException as exc:  # raised again below, in the test's thread
                failed.append(exc)

        stopper = threading.Thread(target=stop)
        stopper.start()
        while stopper.is_alive():
            console.drain(0.2)
        stopper.join()
        if failed:
            raise failed[0]
        console.drain(0.5)
        assert _virsh("domstate", name).strip() == "shut off"
        assert {dom.name: dom.state for dom in rt.list()}[name] == STOPPED
        console.wait_for(rf"{MARK}-POWEROFF", 5)  # the guest powered itself off: the stop was graceful
        qemu_log = Path(f"/var/log/libvirt/qemu/{name}.log").read_text(errors="replace")
        assert "reason=shutdown" in qemu_log and "reason=destroyed" not in qemu_log, qemu_log[-2000:]
        ticks = [int(t) for t in re.findall(rf"{MARK}-TICK (\d+)", console.text)]
        assert ticks and max(ticks) < 110, "the guest's own poweroff_after timer did not stop it"

        rt.delete(name)
        assert name not in _virsh("list", "--all", "--name").split()
        assert not d.exists()
    finally:
        if console is not None:
            console.close()
        subprocess.run(["virsh", "-c", SYSTEM_URI, "destroy", name], capture_output=True, check=False)
        subprocess.run(["virsh", "-c", SYSTEM_URI, "undefine", name], capture_output=True, check=False)


def test_a_guest_boots_pauses_resumes_stops_gracefully_and_is_undefined_dlv_libvirt_18_19_21(
    boot_files: tuple[Path, Path], bridge: str, workdir: Path
) -> None:
    """DLV-LIBVIRT-18, DLV-LIBVIRT-19, DLV-LIBVIRT-21 on a real guest.

    The real runtime as root on qemu:///system (TCG): the guest runs (markers on its serial console),
    sees its disk (the overlay over bcd's base image) and its NIC (the spec's MAC, on a tap named for the
    instance on the spec's bridge); a start paused, then resume; a suspend that stops the guest's clock
    ticks and a resume that restarts them; a graceful stop (ACPI power button: the guest powers itself
    off, no destroy) and a delete that undefines the domain and removes its directory."""
    inst, data, marker = _instance(workdir, bridge)
    system = LocalSystem(Path("/"))
    rt = _BootRuntime(
        system, DirectVirsh(system, SYSTEM_URI), data,
        domain_type="qemu", cpu_mode="maximum", stop_timeout_s=60.0,
    )  # fmt: skip
    _drive(rt, inst, marker, boot_files)


@pytest.fixture
def helper_socket(workdir: Path, bridge: str) -> Iterator[tuple[str, Path]]:
    """A real `bcd helper serve` as root on the real host (`--root /`), its config, sockets and audit log
    in a root-only directory of its own, [helper] libvirt_uri = qemu:///system. Root stages definitions
    in its fixed /var/lib/bcd-hostconfig/libvirt/; that directory is removed again when this fixture made
    it (tests/conftest.py refuses a session that leaves real host paths behind)."""
    hostconfig = Path("/var/lib/bcd-hostconfig")
    made_hostconfig = not hostconfig.exists()
    from bcd_agent.helperclient import HelperClient
    from bcd_helper.audit import init_key

    kvm_gid = grp.getgrnam("kvm").gr_gid  # QEMU's user (libvirt-qemu) is in kvm: the node group here
    home = Path(f"/var/lib/bcd-guest-helper-{uuid.uuid4().hex[:8]}")
    home.mkdir(mode=0o750)
    config = home / "config.toml"
    config.write_text(
        f'data_dir = "{workdir / "data"}"\n[helper]\nsocket = "{home}/helper.sock"\n'
        f'root_socket = "{home}/helper-root.sock"\nnode_uid = 4242\nnode_gid = {kvm_gid}\n'
        f'audit_dir = "{home}/audit"\ninstance_bridges = "{bridge}"\nlibvirt_uri = "{SYSTEM_URI}"\n'
    )
    os.chmod(config, 0o640)
    init_key(Path("/"), f"{home}/audit")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bcd_helper.cli", "serve", "--root", "/", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    sock = f"{home}/helper.sock"
    try:
        deadline = time.monotonic() + 60  # a loaded machine imports and starts the helper slowly
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"helper exited {proc.returncode}: {proc.communicate()[1].decode()}")
            if os.path.exists(sock):
                with contextlib.suppress(Exception):
                    HelperClient(sock).ping()
                    break
            assert time.monotonic() < deadline, "the helper did not start"
            time.sleep(0.05)
        yield sock, home
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)
        if made_hostconfig:
            shutil.rmtree(hostconfig, ignore_errors=True)


def test_a_guest_driven_through_the_real_helper_dlv_hlp_02(
    boot_files: tuple[Path, Path], bridge: str, workdir: Path, helper_socket: tuple[str, Path]
) -> None:
    """DLV-HLP-02 on a real guest: the same run, every change through a real helper process's libvirt.*
    operations (root's domain check, staging, `virsh define --validate`, start, suspend, resume,
    shutdown, undefine on qemu:///system) and reads through `virsh -r`; each op audited."""
    from bcd_agent.helperclient import HelperClient
    from bcd_agent.sections.instances.runtimes.libvirt import HelperVirsh

    sock, home = helper_socket
    inst, data, marker = _instance(workdir, bridge)
    system = LocalSystem(Path("/"))
    client = HelperClient(sock)
    rt = _BootRuntime(
        system, HelperVirsh(system, client, SYSTEM_URI), data, under_helper=True,
        domain_type="qemu", cpu_mode="maximum", stop_timeout_s=60.0,
    )  # fmt: skip
    kvm_gid = grp.getgrnam("kvm").gr_gid

    def node_owns_the_files() -> None:
        # What the node (uid 4242, group kvm here) would own had it created them.
        for dirpath, _dirs, files in os.walk(data):
            os.chown(dirpath, 4242, kvm_gid)
            for f in files:
                os.chown(os.path.join(dirpath, f), 4242, kvm_gid)

    try:
        _drive(rt, inst, marker, boot_files, before_start=node_owns_the_files)
    finally:
        client.close()
    audit = (home / "audit/audit.log").read_text()
    for op in (
        "libvirt.define",
        "libvirt.start",
        "libvirt.suspend",
        "libvirt.resume",
        "libvirt.shutdown",
        "libvirt.undefine",
    ):
        assert op in audit, op
