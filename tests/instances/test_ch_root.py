"""The cloud-hypervisor runtime as root, without `bcd helper` (runtimes/chlocal.py), on the simulated
host: a sysfs shaped like the kernel's (bcd_simhost.pcisim, whose `tee` binds as the kernel does and
makes /dev/vfio/<group>), the simulated systemd-run whose unit serves the simulated v51 VMM, the
simulated useradd; chowns and ACL entries on the real filesystem under the simulated root."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.sections.instances.model import RUNTIME_CH, definition_digest
from bcd_agent.sections.instances.runtimes.base import Prepared
from bcd_agent.sections.instances.runtimes.chlocal import LocalChOps
from bcd_agent.sections.instances.runtimes.cloudhypervisor import CloudHypervisorRuntime
from bcd_shared import posixacl
from bcd_shared.chrecord import parse_record
from bcd_shared.chunit import VMM_UID_BASE, ch_instance_dir, vmm_user_name
from bcd_shared.errors import RetryableError, TerminalError
from bcd_simhost import sim_system
from bcd_simhost.pcisim import lay_out_pci
from bcd_simhost.seed import seed
from instkit import vm

DATA = "/var/lib/bcd"
GPU = "0000:18:00.0"
AUDIO = "0000:18:00.1"
BRIDGE = "0000:17:00.0"
NIC = "0000:2b:00.0"
IN_CI = os.environ.get("CI") == "true"
pytestmark = pytest.mark.skipif(not IN_CI and os.geteuid() != 0, reason="chowns need root")


@pytest.fixture
def host() -> Iterator[tuple[CloudHypervisorRuntime, Path]]:
    tmp = Path(tempfile.mkdtemp(prefix="chr", dir="/var/tmp"))  # a disk filesystem: POSIX ACLs
    os.chmod(tmp, 0o755)  # the VMM's uid reaches its directory, as through its unit's binds
    root = tmp / "h"
    seed(root)
    lay_out_pci(
        root,
        [
            (GPU, "0x030200", 10, "nvidia"),
            (AUDIO, "0x040300", 10, "snd_hda_intel"),
            (BRIDGE, "0x060400", 10, "pcieport"),
            ("0000:2a:00.0", "0x030200", 11, "nvidia"),
            (NIC, "0x020000", 11, "ixgbe"),
        ],
    )
    binary = root / "usr/bin/cloud-hypervisor"  # the simulated systemd-run serves its API
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(binary, 0o755)
    system = sim_system(root)
    ops = LocalChOps(system, DATA, which=lambda name: f"/usr/bin/{name}")
    rt = CloudHypervisorRuntime(system, ops, DATA, stop_timeout_s=1.0, sleep=lambda s: None)
    store = root / DATA.lstrip("/") / "volumes"
    store.mkdir(parents=True)
    for vid in ("data", "ro"):
        (store / f"{vid}.raw").write_bytes(b"\0" * 4096)
        os.chmod(store / f"{vid}.raw", 0o600)
        (store / f"{vid}.json").write_text(json.dumps({"id": vid, "serial": f"s-{vid}", "size_bytes": 4096}))
    yield rt, root
    with contextlib.suppress(Exception):
        for d in rt.list():
            rt.stop(d.name)
    shutil.rmtree(tmp, ignore_errors=True)


def _as_uid(uid: int, code: str) -> str:
    """Run `code` as `uid` for real (its own group only); its stdout."""
    import subprocess

    from testsupport import require_tool

    setpriv = require_tool("setpriv")
    argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3", "-c", code]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def chvm(ident: str, **kw: Any) -> Any:
    return vm(ident, runtime=RUNTIME_CH, nics=(), **kw)


def _driver(root: Path, addr: str) -> str:
    return os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{addr}/driver"))


def _units(root: Path) -> dict[str, Any]:
    path = root / "var/lib/bcd-sim/systemd/units.json"
    units: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return units


def test_as_root_the_files_and_vfio_groups_go_to_the_vmm_and_back_dlv_chu_09_dlv_chu_10(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """DLV-CHU-09, DLV-CHU-10, DLV-CHU-14 (UMask 0077 as root), DLV-CH-18, DLV-CH-19, DLV-CH-22, DLV-VOL-37,
    DLV-CH-23: at start the VMM's account exists, the instance's directory and files (not vm.json)
    are its uid's, a read-write volume is its uid's 0600 and a read-only one carries an ACL entry r
    for it; every endpoint of the GPU's group is on vfio-pci (the bridge stays on pcieport) and
    /dev/vfio/10 is the VMM's 0600; the unit runs as the uid with UMask 0077. At stop the group and
    the volumes go back to root; at delete the devices go back to their host drivers."""
    rt, root = host
    inst = chvm("a1", gpu_uuids=("GPU-1",), volumes=(("data", False), ("ro", True)))
    rt.create(inst, Prepared(gpu_addresses=(GPU,), user_data=b"#cloud-config\n"))
    d = root / ch_instance_dir(DATA, "a1").lstrip("/")
    uid = parse_record((d / "vm.json").read_bytes()).uid
    assert uid == VMM_UID_BASE
    rt.start(inst, paused=False)
    assert [(x.name, x.state) for x in rt.list()] == [("a1", "running")]
    assert f"{vmm_user_name(uid)}:x:{uid}:{uid}:" in (root / "etc/passwd").read_text()
    for f in (d / "disk.qcow2", d / "seed.iso"):
        assert (f.stat().st_uid, f.stat().st_gid) == (uid, uid), f
    assert (d.stat().st_uid, d.stat().st_gid, d.stat().st_mode & 0o7777) == (0, uid, 0o1770)
    assert (d / "vm.json").stat().st_uid == 0
    # As the VMM's uid for real: it creates in its directory, but never renames root's record.
    assert _as_uid(uid, f"open({str(d / 'api.sock.x')!r}, 'xb').close()") == ""
    assert "PermissionError" in _as_uid(
        uid,
        f"import os\ntry:\n    os.rename({str(d / 'vm.json')!r}, {str(d / 'x.json')!r})\n"
        "except OSError as e:\n    print(type(e).__name__)",
    )
    (d / "api.sock.x").unlink()
    vols = root / DATA.lstrip("/") / "volumes"
    assert (vols / "data.raw").stat().st_uid == uid and (vols / "data.raw").stat().st_mode & 0o777 == 0o600
    fd = os.open(vols / "ro.raw", os.O_RDONLY)
    try:
        assert posixacl.user_perms(fd, uid) == 0o4
    finally:
        os.close(fd)
    assert [_driver(root, a) for a in (GPU, AUDIO, BRIDGE)] == ["vfio-pci", "vfio-pci", "pcieport"]
    node = (root / "dev/vfio/10").stat()
    assert (node.st_uid, node.st_mode & 0o777) == (uid, 0o600)
    props = _units(root)["bcd-ch-a1.service"]["properties"]
    assert (props["User"], props["UMask"]) == (str(uid), "0077")
    assert "DeviceAllow" in props and "/dev/vfio/vfio rw" in props["DeviceAllow"]

    # The rebind disk added to the running VM is the VMM's too (DLV-REB-08 as root).
    rt.rebind_attach("a1", b"\0" * 4096)
    assert (d / "rebind.img").stat().st_uid == uid
    rt.rebind_detach("a1")

    [dom] = rt.list()
    assert dom.definition == definition_digest(inst, (GPU,))  # what the planner compares it with
    rt.stop("a1")
    node = (root / "dev/vfio/10").stat()
    assert (node.st_uid, node.st_gid) == (0, 0)
    assert (vols / "data.raw").stat().st_uid == 0
    fd = os.open(vols / "ro.raw", os.O_RDONLY)
    try:
        assert posixacl.user_perms(fd, uid) is None
    finally:
        os.close(fd)
    rt.delete("a1")
    assert [_driver(root, a) for a in (GPU, AUDIO, BRIDGE)] == ["nvidia", "snd_hda_intel", "pcieport"]
    assert not d.exists()


def test_as_root_a_group_with_a_foreign_device_is_refused_and_nothing_bound(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """VFIO takes whole groups: a GPU sharing its group with a NIC is refused before any bind, and no
    VMM is launched."""
    rt, root = host
    inst = chvm("a2", gpu_uuids=("GPU-2",))
    rt.create(inst, Prepared(gpu_addresses=("0000:2a:00.0",)))
    with pytest.raises(TerminalError, match="not the GPU's"):
        rt.start(inst, paused=False)
    assert _driver(root, NIC) == "ixgbe" and _driver(root, "0000:2a:00.0") == "nvidia"
    assert "bcd-ch-a2.service" not in _units(root)


def test_as_root_without_a_helper_the_runtime_is_offered_with_its_binary_and_kvm(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """bcd node as root runs cloud-hypervisor (and Hello advertises it) with its binary at v51 or
    later and /dev/kvm, its root steps in process; still not without either."""
    from bcd_agent.sections.instances.runtimes.cloudhypervisor import ch_available

    rt, _root = host
    ops = rt.priv

    def v51(path: str) -> str:
        return "cloud-hypervisor v51.0"

    assert ch_available(lambda n: "/usr/bin/cloud-hypervisor", True, ops, v51) is None
    assert ch_available(lambda n: "/usr/bin/cloud-hypervisor", False, ops, v51) == "no /dev/kvm"
    assert ch_available(lambda n: None, True, ops, v51) == "no cloud-hypervisor on PATH"


def test_as_root_taps_are_real_persistent_taps_on_their_bridge_and_only_taps_go_dlv_ch_11() -> None:
    """DLV-CH-11 (as root; under the helper DLV-CHH-05..07): in a private network namespace with the
    real `ip`, ch.taps creates `runtime.TapName(instance, i)` with `ip tuntap add` (a persistent tap),
    on its bridge and up; an existing interface of that name that is not a tap is refused and left;
    ch.untaps deletes only taps."""
    import subprocess
    from collections.abc import Sequence

    from bcd_shared.instancenames import tap_name
    from bcd_shared.system import CommandResult, LocalSystem
    from netns import in_netns

    def real_ip(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
        proc = subprocess.run(list(argv), input=stdin, capture_output=True, timeout=60, check=False)
        return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def link(dev: str) -> dict[str, Any]:
        out = subprocess.run(["ip", "-j", "-d", "link", "show", "dev", dev], capture_output=True, check=True)
        doc: dict[str, Any] = json.loads(out.stdout)[0]
        return doc

    def body() -> None:
        subprocess.run(["ip", "link", "add", "br0", "type", "bridge"], check=True)
        subprocess.run(["ip", "link", "add", tap_name("t2", 0), "type", "bridge"], check=True)
        ops = LocalChOps(LocalSystem(tools={"ip": real_ip}), DATA)
        assert ops.call("ch.taps", {"name": "t1", "bridges": ["br0", "br0"]})["taps"] == [
            tap_name("t1", 0),
            tap_name("t1", 1),
        ]
        for i in (0, 1):
            got = link(tap_name("t1", i))
            assert got["linkinfo"]["info_kind"] == "tun" and got["linkinfo"]["info_data"]["type"] == "tap"
            assert got["linkinfo"]["info_data"].get("persist") is True
            assert got["master"] == "br0" and "UP" in got["flags"]
        with pytest.raises(TerminalError, match="not a tap"):
            ops.call("ch.taps", {"name": "t2", "bridges": ["br0"]})
        assert link(tap_name("t2", 0))["linkinfo"]["info_kind"] == "bridge"
        assert ops.call("ch.untaps", {"name": "t1"})["deleted"] == [tap_name("t1", 0), tap_name("t1", 1)]
        assert ops.call("ch.untaps", {"name": "t2"})["deleted"] == []
        assert link(tap_name("t2", 0))["linkinfo"]["info_kind"] == "bridge"

    in_netns(body)


def test_a_gpu_the_spec_dropped_goes_back_to_its_host_driver_dlv_ch_23(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """DLV-CH-23: the spec drops the GPU of a stopped instance; its new definition hands the recorded
    group's devices back to their host drivers before the record forgets them."""
    rt, root = host
    inst = chvm("a3", gpu_uuids=("GPU-1",))
    rt.create(inst, Prepared(gpu_addresses=(GPU,)))
    rt.start(inst, paused=False)
    rt.stop("a3")
    assert _driver(root, GPU) == "vfio-pci"
    rt.create(chvm("a3"), Prepared())
    assert [_driver(root, a) for a in (GPU, AUDIO, BRIDGE)] == ["nvidia", "snd_hda_intel", "pcieport"]
    assert parse_record((root / ch_instance_dir(DATA, "a3").lstrip("/") / "vm.json").read_bytes()).gpus == ()


def test_as_root_nics_are_real_taps_handed_to_the_vmm_and_deleted_at_stop(
    host: tuple[CloudHypervisorRuntime, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DLV-CHU-04, DLV-CH-12, DLV-CH-16 as root: in a private network namespace (the simulated host's
    `ip` runs the real one there), the start creates the taps on the bridge, opens each and sends its
    fd to the VMM with vm.add-net (the VMM names the tap from the fd it got); the stop deletes them."""
    import subprocess

    from bcd_agent.sections.instances.model import Nic
    from bcd_shared.instancenames import tap_name
    from bcd_simhost import chtools
    from bcd_simhost.netns import ENV
    from netns import in_netns

    rt, root = host
    monkeypatch.setenv(ENV, "1")
    inst = vm("n1", runtime=RUNTIME_CH, nics=(Nic("br0", "52:54:00:00:00:07"),))

    def body() -> list[tuple[str, str]]:
        subprocess.run(["ip", "link", "add", "br0", "type", "bridge"], check=True)
        rt.create(inst, Prepared())
        rt.start(inst, paused=False)
        vmm = chtools._VMMS[(str(root), "bcd-ch-n1.service")]
        nets = [(n["tap"], n["mac"]) for n in vmm.nets]
        shown = subprocess.run(["ip", "-j", "link", "show", "master", "br0"], capture_output=True, check=True)
        assert [link["ifname"] for link in json.loads(shown.stdout)] == [tap_name("n1", 0)]
        rt.stop("n1")
        gone = subprocess.run(["ip", "link", "show", "dev", tap_name("n1", 0)], capture_output=True)
        assert gone.returncode != 0
        return nets

    assert in_netns(body) == [(tap_name("n1", 0), "52:54:00:00:00:07")]


def test_as_root_a_record_the_vmms_user_planted_is_refused(host: tuple[CloudHypervisorRuntime, Path]) -> None:
    """As root the instance's directory is the VMM's user's: a vm.json it replaced (its own file naming
    another GPU) is not root's record, so ch.vfio binds nothing for it."""
    rt, root = host
    rt.create(chvm("a4"), Prepared())
    d = root / ch_instance_dir(DATA, "a4").lstrip("/")
    forged = (d / "vm.json").read_text().replace('"gpus": []', '"gpus": ["0000:18:00.0"]')
    (d / "vm.json").unlink()
    (d / "vm.json").write_text(forged)
    os.chown(d / "vm.json", VMM_UID_BASE, VMM_UID_BASE)
    with pytest.raises(RetryableError, match="not root's own regular file"):
        rt.priv.call("ch.vfio", {"name": "a4"})
    assert _driver(root, GPU) == "nvidia"


def _two_readers(rt: CloudHypervisorRuntime) -> tuple[Any, Any]:
    a = chvm("r1", volumes=(("ro", True),))
    b = chvm("r2", volumes=(("ro", True),))
    for inst in (a, b):
        rt.create(inst, Prepared())
        rt.start(inst, paused=False)
    return a, b


def _acl(path: Path) -> bytes | None:
    import errno

    fd = os.open(path, os.O_RDONLY)
    try:
        return os.getxattr(fd, posixacl.ACCESS)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP):
            return None
        raise
    finally:
        os.close(fd)


def test_as_root_a_read_only_volume_is_roots_alone_after_its_last_reader_dlv_vol_38_dlv_vol_39(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """DLV-VOL-38, DLV-VOL-39, DLV-VOL-14: two VMMs read one volume, each through its own ACL entry
    r; the first stop removes only its entry; after the last, the volume is root's 0600 with no ACL
    at all."""
    rt, root = host
    vol = root / DATA.lstrip("/") / "volumes/ro.raw"
    _two_readers(rt)
    fd = os.open(vol, os.O_RDONLY)
    try:
        assert (posixacl.user_perms(fd, VMM_UID_BASE), posixacl.user_perms(fd, VMM_UID_BASE + 1)) == (4, 4)
    finally:
        os.close(fd)
    rt.stop("r1")
    fd = os.open(vol, os.O_RDONLY)
    try:
        assert (posixacl.user_perms(fd, VMM_UID_BASE), posixacl.user_perms(fd, VMM_UID_BASE + 1)) == (None, 4)
    finally:
        os.close(fd)
    rt.stop("r2")
    st = vol.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777, _acl(vol)) == (0, 0, 0o600, None)


def test_as_root_without_acls_a_read_only_volume_falls_back_to_group_kvm_dlv_vol_40(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """DLV-VOL-40, for real on a filesystem without POSIX ACLs (ramfs mounted over the volume store):
    a read-only volume is group kvm 0640 while VMMs read it, still so after the first of two stops,
    and root's 0600 again once no other running instance was given it."""
    import subprocess

    rt, root = host
    with (root / "etc/group").open("a") as f:
        f.write("kvm:x:993:\n")
    store = root / DATA.lstrip("/") / "volumes"
    saved = {p.name: p.read_bytes() for p in store.iterdir()}
    subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0700", "ramfs", str(store)], check=True)
    try:
        for name, data in saved.items():
            (store / name).write_bytes(data)
            os.chmod(store / name, 0o600)
        vol = store / "ro.raw"
        _two_readers(rt)
        st = vol.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777, _acl(vol)) == (0, 993, 0o640, None)
        rt.stop("r1")
        assert (vol.stat().st_gid, vol.stat().st_mode & 0o777) == (993, 0o640)  # r2 still reads it
        rt.stop("r2")
        st = vol.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)
    finally:
        subprocess.run(["umount", str(store)], check=False)


def test_the_cloud_hypervisor_binary_on_path_turns_the_runtime_on_dlv_rt_03_dlv_rt_04(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """DLV-RT-03, DLV-RT-04, DLV-RT-01: a `cloud-hypervisor` binary on PATH (with /dev/kvm, at v51)
    turns on cloud-hypervisor with its files under data_dir/cloud-hypervisor; with `virsh` too, both
    run; without it, only libvirt-kvm; no configuration key (a root node, no helper)."""
    from bcd_agent.nodeparts.instances import HostTools, build_runtimes
    from bcd_shared.chunit import ch_dir

    rt, _root = host

    def tools(*on_path: str) -> HostTools:
        return HostTools(
            which=lambda name: f"/usr/bin/{name}" if name in on_path else None,
            kvm=lambda: True,
            version_of=lambda path: "cloud-hypervisor v51.0",
        )

    def built(*on_path: str) -> list[Any]:
        return build_runtimes(
            rt.system, DATA, simulated=False, helper=None, as_root=True, host=tools(*on_path)
        )

    both = built("virsh", "cloud-hypervisor")
    assert [r.name for r in both] == ["libvirt-kvm", "cloud-hypervisor"]
    [ch] = built("cloud-hypervisor")
    assert ch.name == "cloud-hypervisor" and isinstance(ch.priv, LocalChOps)
    assert ch._dir("x").startswith(ch_dir(DATA) + "/")
    assert [r.name for r in built("virsh")] == ["libvirt-kvm"]
    assert built() == []


def test_as_root_a_vmm_binary_others_can_write_is_never_run(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """As the helper runs only root's own binary: a `cloud-hypervisor` on PATH that a group can write
    is refused before any unit starts."""
    rt, root = host
    os.chmod(root / "usr/bin/cloud-hypervisor", 0o775)
    inst = chvm("u1")
    rt.create(inst, Prepared())
    with pytest.raises(TerminalError, match="only root can write"):
        rt.start(inst, paused=False)
    assert "bcd-ch-u1.service" not in _units(root)


def test_the_placement_reaches_the_vmms_unit_dlv_plc_14_dlv_plc_15(
    host: tuple[CloudHypervisorRuntime, Path],
) -> None:
    """DLV-PLC-14, DLV-PLC-15 end to end on the runtime: an instance placed on CPUs 2-3 and NUMA node 0
    in 2 MiB huge pages starts a unit with AllowedCPUs=2-3, AllowedMemoryNodes=0 and MemoryMax of the
    VMM's overhead alone (1 GiB / 32 + 256 MiB); the same instance unplaced gets neither property and
    its whole memory plus the overhead. (The unit tests hand the launch its placement directly.)"""
    from bcd_agent.sections.instances.model import Placement

    rt, root = host
    mib = 1 << 20
    placed = chvm(
        "p1",
        vcpus=2,
        memory_bytes=1 << 30,
        placement=Placement(cpus="2-3", mems="0", hugepage_size_bytes=2 * mib),
    )
    rt.create(placed, Prepared())
    rt.start(placed, paused=False)
    props = _units(root)["bcd-ch-p1.service"]["properties"]
    assert (props["AllowedCPUs"], props["AllowedMemoryNodes"]) == ("2-3", "0")
    assert props["MemoryMax"] == str((1 << 30) // 32 + 256 * mib)
    plain = chvm("p2", vcpus=2, memory_bytes=1 << 30)
    rt.create(plain, Prepared())
    rt.start(plain, paused=False)
    props = _units(root)["bcd-ch-p2.service"]["properties"]
    assert "AllowedCPUs" not in props and "AllowedMemoryNodes" not in props
    assert props["MemoryMax"] == str((1 << 30) + (1 << 30) // 32 + 256 * mib)
