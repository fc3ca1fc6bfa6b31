"""cloud-hypervisor snapshots and restores, the runtime's half (DLV-CH-25, DLV-CH-34..38, DLV-CHU-07,
DLV-BAL-15), and its volumes and the directories that are not bcd's (DLV-CH-28).

The VMM is the simulated v51 API server (bcd_simhost.chapi: `vm.snapshot` writes config.json,
state.json and memory-ranges; `vm.restore` takes the taps only by SCM_RIGHTS and checks each fd);
`qemu-img` is the real one (Debian's qemu-utils), so the flattened disk in a snapshot is read back
with `qemu-io` and must hold both the base image's and the overlay's bytes. NICs are real taps in a
private network namespace."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.sections.instances.model import RUNTIME_CH, Image, Nic, Placement
from bcd_agent.sections.instances.runtimes.base import Prepared
from bcd_agent.sections.instances.runtimes.cloudhypervisor import CloudHypervisorRuntime
from bcd_shared.chrecord import parse_record
from bcd_shared.chunit import ch_images_dir, ch_instance_dir
from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.instancenames import tap_name
from bcd_shared.system import CommandResult, FakeTool, LocalSystem
from bcd_simhost import TOOLS, _LazyTool
from bcd_simhost.chapi import FakeCHServer
from bcd_simhost.seed import seed
from netns import in_netns

DATA = "/var/lib/bcd"
MIB = 1 << 20
IN_CI = os.environ.get("CI") == "true"
needs_tools = pytest.mark.skipif(
    not IN_CI and (os.geteuid() != 0 or not os.path.exists("/dev/net/tun") or not shutil.which("qemu-io")),
    reason="needs root, /dev/net/tun and qemu-utils",
)
pytestmark = needs_tools


def sim_tools(qemu_img: FakeTool) -> dict[str, FakeTool]:
    tools: dict[str, FakeTool] = {name: _LazyTool(spec) for name, spec in TOOLS.items()}
    tools["qemu-img"] = qemu_img
    return tools


def real_tool(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, timeout=600, check=False)
    return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)


class Recorder:
    """ch.* as the helper answers them; ch.launch starts the simulated VMM on the instance's socket."""

    def __init__(self, system: LocalSystem) -> None:
        self.system = system
        self.calls: list[str] = []
        self.vmms: dict[str, FakeCHServer] = {}

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(op)
        name = args["name"]
        if op == "ch.taps":
            return {"taps": [tap_name(name, i) for i in range(len(args["bridges"]))]}
        if op == "ch.launch":
            sock = self.system.host_path(f"{ch_instance_dir(DATA, name)}/api.sock")
            self.vmms[name] = FakeCHServer(sock, root=self.system.root)
            return {}
        if op == "ch.stop":
            vmm = self.vmms.pop(name, None)
            if vmm is not None:
                vmm.close()
            return {"state": "inactive"}
        return {}

    def close(self) -> None:
        for vmm in self.vmms.values():
            vmm.close()


def qemu_io(path: Path, *cmds: str) -> subprocess.CompletedProcess[bytes]:
    spec = {"driver": "qcow2", "file": {"driver": "file", "filename": str(path)}, "backing": None}
    argv = ["qemu-io", "-f", "qcow2"]
    for c in cmds:
        argv += ["-c", c]
    return subprocess.run([*argv, "json:" + json.dumps(spec)], capture_output=True, check=False)


def ch_host(
    tmp: Path, *, pattern: bool = False
) -> tuple[LocalSystem, Recorder, CloudHypervisorRuntime, Image]:
    """A simulated host under `tmp` (keep it short: sun_path holds 108 bytes) with the real qemu-img
    (create, convert, a real flattened disk), the ch.* recorder and the runtime over them, and a real
    64 MiB base image under its SHA-256 as if downloaded before (`pattern`: 0xab in its first MiB)."""
    root = tmp / "h"
    seed(root)
    system = LocalSystem(root=root, tools=sim_tools(qemu_img=real_tool))
    rec = Recorder(system)
    rt = CloudHypervisorRuntime(system, rec, DATA, stop_timeout_s=1.0, sleep=lambda s: None)
    images = system.host_path(ch_images_dir(DATA))
    images.mkdir(parents=True)
    base = tmp / "base.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-f", "qcow2", str(base), str(64 * MIB)], check=True, capture_output=True
    )
    if pattern:
        subprocess.run(
            ["qemu-io", "-f", "qcow2", "-c", "write -P 0xab 0 1M", str(base)], check=True, capture_output=True
        )
    sha = hashlib.sha256(base.read_bytes()).hexdigest()
    shutil.move(base, images / f"{sha}.qcow2")
    return system, rec, rt, Image("https://images.sim.bcd/real.qcow2", sha, "qcow2")


@pytest.fixture
def host() -> Iterator[tuple[CloudHypervisorRuntime, Recorder, Image]]:
    tmp = Path(tempfile.mkdtemp(prefix="chs", dir="/tmp"))
    _system, rec, rt, image = ch_host(tmp, pattern=True)
    yield rt, rec, image
    rec.close()
    shutil.rmtree(tmp, ignore_errors=True)


def chvm(ident: str, image: Image | None, **kw: Any) -> Any:
    from bcd_agent.sections.instances.model import InstanceSpec

    base: dict[str, Any] = {
        "id": ident,
        "allocation_id": f"alloc_{ident}",
        "runtime": RUNTIME_CH,
        "vcpus": 2,
        "memory_bytes": 512 * MIB,
        "disk_bytes": 128 * MIB,
        "image": image,
        "nics": (Nic("br0", "52:54:00:00:00:01"), Nic("br0", "52:54:00:00:00:02")),
        "placement": Placement(balloon=True),
    }
    base.update(kw)
    return InstanceSpec(**base)


def requests(vmm: FakeCHServer) -> list[str]:
    return [r[0] for r in vmm.requests if r[0] not in ("vmm.ping", "vm.info")]


def members(tar_path: Path) -> dict[str, bytes]:
    with tarfile.open(tar_path) as tar:
        out = {}
        for m in tar:
            f = tar.extractfile(m)
            out[m.name] = f.read() if f is not None else b""
        return out


def write_tar(path: Path, files: dict[str, bytes], links: Sequence[str] = ()) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name in links:
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/shadow"
            tar.addfile(info)


def test_a_memory_snapshot_pauses_and_holds_the_flat_disk_and_the_vmms_state_dlv_ch_34_dlv_ch_35(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """DLV-CH-34, DLV-CH-35: a running VM is paused, snapshotted
    by the VMM into the instance's directory, its overlay flattened onto the base (both layers' bytes,
    no backing file) and resumed; the tar holds exactly meta.json, disk.qcow2, seed.iso and ch/'s
    config.json, state.json and memory-ranges. A disk-only snapshot of a stopped VM holds no ch/ and
    asks the VMM nothing; a memory snapshot of a stopped VM is refused."""
    rt, rec, image = host
    inst = chvm("s1", image)
    staging = rt.system.host_path(f"{DATA}/snapshots/s1.tar")
    staging.parent.mkdir(parents=True)

    def body() -> None:
        rt.create(inst, Prepared(user_data=b"#cloud-config\n"))
        disk = rt.system.host_path(f"{ch_instance_dir(DATA, 's1')}/disk.qcow2")
        assert qemu_io(disk, "write -P 0xcd 1M 1M").returncode == 0  # the guest's own write
        rt.start(inst, paused=False)
        vmm = rec.vmms["s1"]
        rt.snapshot(inst, True, str(staging))
        assert requests(vmm)[-3:] == ["vm.pause", "vm.snapshot", "vm.resume"]
        assert vmm.state == "Running"
        rt.stop("s1")

    in_netns(body)
    got = members(staging)
    assert sorted(got) == sorted(
        ["meta.json", "disk.qcow2", "seed.iso", "ch/config.json", "ch/state.json", "ch/memory-ranges"]
    )
    meta = json.loads(got["meta.json"])
    assert meta == {"runtime": "cloud-hypervisor", "cpuModel": rt.cpu_model(), "includeMemory": True}
    assert meta["cpuModel"]  # the simulated host's /proc/cpuinfo names one
    assert json.loads(got["ch/config.json"])["cpus"]["boot_vcpus"] == 2
    flat = staging.parent / "flat.qcow2"
    flat.write_bytes(got["disk.qcow2"])
    info = json.loads(
        subprocess.run(["qemu-img", "info", "--output=json", str(flat)], capture_output=True).stdout
    )
    assert "backing-filename" not in info and info["virtual-size"] == 128 * MIB
    assert qemu_io(flat, "read -P 0xab 0 1M", "read -P 0xcd 1M 1M").stdout.count(b"read 1048576/") == 2
    assert not rt.system.exists(f"{ch_instance_dir(DATA, 's1')}/snapshot")  # the work directory went

    # Stopped: a disk-only snapshot, no VMM asked; a memory one is refused.
    rt.snapshot(inst, False, str(staging.parent / "s1d.tar"))
    assert sorted(members(staging.parent / "s1d.tar")) == ["disk.qcow2", "meta.json", "seed.iso"]
    with pytest.raises(TerminalError, match="needs a running or paused VM"):
        rt.snapshot(inst, True, str(staging.parent / "s1m.tar"))


def test_a_memory_restore_is_vm_restore_with_net_fds_then_resume_dlv_ch_38_dlv_chu_07_dlv_bal_15(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """DLV-CH-38, DLV-CHU-07, DLV-CHU-08, DLV-BAL-15, DLV-CH-36 (as libvirt-kvm unpacks), DLV-CH-07: a tar
    of a VM whose balloon was inflated restores into a new instance: the directory holds the disk,
    the seed and the VMM's files, vm.json says restored with no base image; its first start is
    vm.restore from bcd's rebuilt config.json (NICs by id and MAC, no tap name, bcd's empty balloon,
    no backing_files) with each NIC's new tap by SCM_RIGHTS as net_fds, then vm.resume; the memory
    files go after. The restored VM's balloon is bcd's, never the snapshot's."""
    rt, rec, image = host
    src, dst = chvm("m1", image), chvm("m2", None, restore_from="https://snap.example/m1.tar")
    tar = rt.system.host_path(f"{DATA}/snapshots/m1.tar")
    tar.parent.mkdir(parents=True)

    def body() -> None:
        rt.create(src, Prepared(user_data=b"#cloud-config\n"))
        rt.start(src, paused=False)
        rt.set_balloon("m1", 256 * MIB)
        rt.snapshot(src, True, str(tar))
        assert json.loads(members(tar)["ch/config.json"])["balloon"]["size"] == 256 * MIB
        rt.restore(dst, str(tar), Prepared())
        d = rt.system.host_path(ch_instance_dir(DATA, "m2"))
        assert sorted(os.listdir(d)) == sorted(
            ["config.json", "disk.qcow2", "memory-ranges", "seed.iso", "state.json", "vm.json"]
        )
        record = parse_record((d / "vm.json").read_bytes())
        assert record.restored and record.image_sha256 is None
        rebuilt = json.loads((d / "config.json").read_text())
        assert rebuilt["net"] == [
            {"id": "net0", "mac": "52:54:00:00:00:01"},
            {"id": "net1", "mac": "52:54:00:00:00:02"},
        ]
        assert rebuilt["balloon"] == {"size": 0, "free_page_reporting": True}
        assert rebuilt["disks"][0]["backing_files"] is False
        assert rebuilt["disks"][0]["path"] == f"{ch_instance_dir(DATA, 'm2')}/disk.qcow2"
        rt.start(dst, paused=False)
        vmm = rec.vmms["m2"]
        assert requests(vmm) == ["vm.restore", "vm.resume"]
        restore = next(r for r in vmm.requests if r[0] == "vm.restore")
        assert restore[2] == 2 and restore[1]["net_fds"] == [
            {"id": "net0", "num_fds": 1},
            {"id": "net1", "num_fds": 1},
        ]
        assert [n["tap"] for n in vmm.nets] == [tap_name("m2", 0), tap_name("m2", 1)]
        assert vmm.state == "Running" and vmm.ignored_fields == []
        assert rt.balloon_bytes("m2") == 0
        assert sorted(os.listdir(d)) == ["api.sock", "disk.qcow2", "seed.iso", "vm.json"]
        rt.stop("m2")
        rt.stop("m1")

    in_netns(body)


def _refused(rt: CloudHypervisorRuntime, name: str, tar: str, match: str) -> None:
    inst = chvm(name, None, restore_from="https://snap.example/x.tar", nics=())
    with pytest.raises(TerminalError, match=match):
        rt.restore(inst, tar, Prepared())
    left = rt.system.listdir(f"{DATA}/cloud-hypervisor/instances")
    assert name not in left and f".{name}.new" not in left


def test_a_restore_refuses_another_runtime_cpu_or_a_bad_disk_and_leaves_nothing_dlv_ch_36_dlv_ch_25(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """DLV-CH-36 (libvirt-kvm's refusals and checks), DLV-CH-25, DLV-SNAP-06, DLV-SNAP-07, DLV-CH-37,
    DLV-RT-12, DLV-IMG-15, DLV-IMG-16, DLV-IMG-17 (cloud-hypervisor's restore): a tar taken by
    another runtime, a memory tar from another CPU model, one of another size, a disk naming a backing
    file, a member outside a snapshot's names (a path, a symlink), a member twice: each refused,
    and the new instance's directory is gone. A disk-only tar restores on any CPU."""
    rt, _rec, image = host
    snaps = rt.system.host_path(f"{DATA}/snapshots")
    snaps.mkdir(parents=True)
    rt.create(chvm("o1", image, nics=()), Prepared(user_data=b"#cloud-config\n"))
    rt.snapshot(chvm("o1", image, nics=()), False, str(snaps / "disk.tar"))
    good = members(snaps / "disk.tar")
    cpu = rt.cpu_model()
    mem = {
        "ch/config.json": json.dumps(
            {"cpus": {"boot_vcpus": 2, "max_vcpus": 2}, "memory": {"size": 512 * MIB}}
        ).encode(),
        "ch/state.json": b"{}",
        "ch/memory-ranges": b"\0" * 64,
    }

    def meta(runtime: str = "cloud-hypervisor", cpu_model: str = cpu, memory: bool = False) -> bytes:
        return json.dumps({"runtime": runtime, "cpuModel": cpu_model, "includeMemory": memory}).encode()

    cases: list[tuple[str, dict[str, bytes], Sequence[str], str]] = [
        ("runtime", {**good, "meta.json": meta("libvirt-kvm")}, (), "taken by the 'libvirt-kvm' runtime"),
        (
            "cpu",
            {**good, **mem, "meta.json": meta(cpu_model="Other CPU", memory=True)},
            (),
            "taken on CPU model",
        ),
        (
            "size",
            {
                **good,
                **mem,
                "meta.json": meta(memory=True),
                "ch/config.json": mem["ch/config.json"].replace(b"2", b"4"),
            },
            (),
            "vCPUs",
        ),
        (
            "nomem",
            {**good, "meta.json": meta(memory=True)},
            (),
            "includeMemory is set but the memory state is missing",
        ),
        ("path", {**good, "../escape": b"x"}, (), "not a snapshot file"),
        ("link", good, ("seed.iso",), "not a regular file"),
        ("twice", good, (), ""),
    ]
    for name, files, links, match in cases:
        path = snaps / f"{name}.tar"
        if name == "twice":
            write_tar(path, files)
            with tarfile.open(path, "a") as tar:
                info = tarfile.TarInfo("disk.qcow2")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
            match = "appears twice"
        else:
            write_tar(path, files, links)
        _refused(rt, f"x{name}", str(path), match)
    # A memory snapshot restores without a writable volume (the snapshot refused one).
    write_tar(snaps / "mem.tar", {**good, **mem, "meta.json": meta(memory=True)})
    store = rt.system.host_path(f"{DATA}/volumes")
    store.mkdir(parents=True)
    (store / "w.raw").write_bytes(b"\0" * 512)
    (store / "w.json").write_text(json.dumps({"id": "w", "serial": "s-w", "size_bytes": 512}))
    with pytest.raises(TerminalError, match="read-write volumes"):
        rt.restore(
            chvm("xvol", None, restore_from="https://s/x.tar", nics=(), volumes=(("w", False),)),
            str(snaps / "mem.tar"),
            Prepared(),
        )
    assert "xvol" not in rt.system.listdir(f"{DATA}/cloud-hypervisor/instances")
    # A disk naming a backing file (the overlay itself, not flattened).
    overlay = rt.system.read_bytes(f"{ch_instance_dir(DATA, 'o1')}/disk.qcow2") or b""
    write_tar(snaps / "backing.tar", {**good, "disk.qcow2": overlay})
    _refused(rt, "xbacking", str(snaps / "backing.tar"), "backing file")
    # A restored instance defined again (the spec changed while it was stopped) keeps its files and
    # its restored record; its new size is in the record.
    rt.restore(
        chvm("ok0", None, restore_from="https://snap.example/x.tar", nics=()),
        str(snaps / "disk.tar"),
        Prepared(),
    )
    rt.create(chvm("ok0", None, restore_from="https://snap.example/x.tar", nics=(), vcpus=4), Prepared())
    again = parse_record(rt.system.read_bytes(f"{ch_instance_dir(DATA, 'ok0')}/vm.json") or b"")
    assert again.restored and again.vcpus == 4 and again.config["cpus"]["boot_vcpus"] == 4
    with pytest.raises(TerminalError, match="restore"):
        rt.create(chvm("none0", None, restore_from="https://snap.example/x.tar", nics=()), Prepared())
    rt.delete("ok0")
    # The seed is attached raw, never probed: one that looks like a qcow2 naming /etc/shadow is data.
    write_tar(snaps / "oddseed.tar", {**good, "seed.iso": overlay})
    rt.restore(
        chvm("okseed", None, restore_from="https://s/x.tar", nics=()), str(snaps / "oddseed.tar"), Prepared()
    )
    seeded = parse_record(rt.system.read_bytes(f"{ch_instance_dir(DATA, 'okseed')}/vm.json") or b"")
    assert seeded.config["disks"][1]["image_type"] == "Raw" and seeded.config["disks"][1]["readonly"] is True
    rt.delete("okseed")
    # The same disk-only tar restores on another CPU: only memory is bound to the CPU model.
    rt.cpu_model = lambda: "Other CPU"  # type: ignore[method-assign]
    rt.restore(
        chvm("ok1", None, restore_from="https://snap.example/x.tar", nics=()),
        str(snaps / "disk.tar"),
        Prepared(),
    )
    assert [d.name for d in rt.list()] == ["o1", "ok1"]


def test_a_directory_without_vm_json_is_never_defined_over_dlv_ch_28(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """DLV-CH-28: an instance directory bcd did not record is refused by create and restore, left as
    it is, and never listed; a create that failed midway leaves no directory of that name behind."""
    rt, _rec, image = host
    d = rt.system.host_path(ch_instance_dir(DATA, "theirs"))
    d.mkdir(parents=True)
    (d / "disk.qcow2").write_bytes(b"someone else's")
    with pytest.raises(TerminalError, match="not bcd's"):
        rt.create(chvm("theirs", image, nics=()), Prepared())
    with pytest.raises(TerminalError, match="not bcd's"):
        rt.restore(chvm("theirs", None, restore_from="https://x/y.tar", nics=()), "/nonexistent", Prepared())
    assert os.listdir(d) == ["disk.qcow2"] and (d / "disk.qcow2").read_bytes() == b"someone else's"
    assert rt.list() == ()
    with pytest.raises(TerminalError):
        rt.remove_files("theirs")

    # A create that fails before its record (qemu-img cannot write) leaves nothing called "new1".
    def full(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
        return CommandResult(tuple(argv), 1, b"", b"no space left on device")

    rt = CloudHypervisorRuntime(LocalSystem(root=rt.system.root, tools=sim_tools(full)), None, DATA)
    with pytest.raises(RetryableError, match="no space"):
        rt.create(chvm("new1", image, nics=()), Prepared())
    assert sorted(rt.system.listdir(f"{DATA}/cloud-hypervisor/instances")) == ["theirs"]
    # A crash mid-create leaves its staging directory (never listed); the next create removes it.
    crashed = rt.system.host_path(f"{DATA}/cloud-hypervisor/instances/.gone.new")
    crashed.mkdir()
    (crashed / "disk.qcow2").write_bytes(b"half")
    assert rt.list() == ()
    with pytest.raises(RetryableError, match="no space"):
        rt.create(chvm("new2", image, nics=()), Prepared())
    assert sorted(rt.system.listdir(f"{DATA}/cloud-hypervisor/instances")) == ["theirs"]


def test_volumes_are_raw_disks_with_their_serial_resized_live_dlv_vol_14(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """DLV-VOL-14, DLV-CHU-21 (the volumes the instance attaches are in its record, which root binds into the
    unit and grants ACL entries for): each volume a Raw disk of the store with its serial, read-only
    when attached so; listed with its target; a grown volume reaches the running guest by
    vm.resize-disk; a volume not in the store yet is a retry."""
    rt, rec, image = host
    store = rt.system.host_path(f"{DATA}/volumes")
    store.mkdir(parents=True)
    inst = chvm("v1", image, nics=(), volumes=(("data", False), ("ro", True)))
    with pytest.raises(RetryableError, match="not in the store"):
        rt.create(inst, Prepared())
    for vid, serial in (("data", "vol-data"), ("ro", "vol-ro")):
        (store / f"{vid}.raw").write_bytes(b"\0" * 4096)
        (store / f"{vid}.json").write_text(json.dumps({"id": vid, "serial": serial, "size_bytes": 4096}))
    rt.create(inst, Prepared())
    record = parse_record(rt.system.read_bytes(f"{ch_instance_dir(DATA, 'v1')}/vm.json") or b"")
    assert [(v.name, v.read_only, v.serial) for v in record.volumes] == [
        ("data.raw", False, "vol-data"),
        ("ro.raw", True, "vol-ro"),
    ]
    assert record.config["disks"][1:] == [
        {
            "id": "vol0",
            "path": f"{DATA}/volumes/data.raw",
            "image_type": "Raw",
            "readonly": False,
            "serial": "vol-data",
        },
        {
            "id": "vol1",
            "path": f"{DATA}/volumes/ro.raw",
            "image_type": "Raw",
            "readonly": True,
            "serial": "vol-ro",
        },
    ]
    [dom] = rt.list()
    assert dom.volumes == (("data", False, "vol0"), ("ro", True, "vol1"))
    rt.start(inst, paused=False)
    rt.resize_volume("v1", "vol0", 8192)
    vmm = rec.vmms["v1"]
    assert ("vm.resize-disk", {"id": "vol0", "desired_size": 8192}, 0) in vmm.requests
    rt.stop("v1")


def test_the_console_is_the_serial_ports_socket_dlv_ch_42(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """DLV-CH-42: the VMM's configuration puts the serial port on instances/<id>/serial.sock, and the
    runtime's console is a connection to exactly that socket (here a stand-in for the VMM's serial
    end, echoing what the guest would read); no VMM: a retryable error, not a hang."""
    import socket

    rt, _rec, image = host
    inst = chvm("c1", image, nics=())
    rt.create(inst, Prepared())
    d = ch_instance_dir(DATA, "c1")
    record = parse_record(rt.system.read_bytes(f"{d}/vm.json") or b"")
    assert record.config["serial"] == {"mode": "Socket", "socket": f"{d}/serial.sock"}
    with pytest.raises(RetryableError, match="no serial console"):
        rt.console("c1")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(rt.system.host_path(f"{d}/serial.sock")))
    srv.listen(1)
    try:
        con = rt.console("c1")
        peer, _ = srv.accept()
        with con, peer:
            con.sendall(b"root\n")
            assert peer.recv(16) == b"root\n"
            peer.sendall(b"login: ")
            assert con.recv(16) == b"login: "
    finally:
        srv.close()


_NAMES = [
    "meta.json",
    "disk.qcow2",
    "seed.iso",
    "ch/config.json",
    "ch/state.json",
    "ch/memory-ranges",
    "ch",
    "../escape",
    "/etc/escape",
    "ch/../../escape",
    "vm.json",
    "api.sock",
    "save.state",
]


def test_any_tar_restores_whole_or_refuses_and_leaves_nothing_dlv_ch_36() -> None:
    """DLV-CH-36 (libvirt-kvm's refusals and checks) over drawn tars: members of a snapshot's names and
    others (paths out, a record, libvirt's state), of every type (file, directory, symlink, hard link,
    fifo), in any order and number, with a good or bad meta, a flat or a backing disk. Each restore
    either defines the instance (a vm.json, a flat disk, nothing but a snapshot's files) or refuses it
    with a TerminalError, leaving no instance or staging directory; nothing is ever written outside it."""
    from bcd_simhost.libvirt import qcow2_bytes
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tmp = Path(tempfile.mkdtemp(prefix="chp", dir="/var/tmp"))
    root = tmp / "h"
    seed(root)
    system = LocalSystem(root=root, tools=sim_tools(real_tool))
    rt = CloudHypervisorRuntime(system, None, DATA)
    cpu = rt.cpu_model()
    flat, backed = qcow2_bytes(1 << 30), qcow2_bytes(1 << 30, "/etc/shadow", "raw")
    memory_config = json.dumps({"cpus": {"boot_vcpus": 2, "max_vcpus": 2}, "memory": {"size": 512 * MIB}})
    types = [tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE]
    member = st.tuples(st.sampled_from(_NAMES), st.sampled_from(types), st.binary(max_size=64))
    before = {p for p in root.rglob("*")}
    counter = iter(range(10**6))

    @settings(max_examples=300 if IN_CI else 60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        memory=st.booleans(),
        runtime=st.sampled_from(["cloud-hypervisor"] * 3 + ["libvirt-kvm"]),
        same_cpu=st.sampled_from([True, True, False]),
        disk=st.sampled_from(["flat", "flat", "backed", "junk", "none"]),
        extra=st.one_of(st.just([]), st.lists(member, max_size=5)),
    )
    def check(
        memory: bool, runtime: str, same_cpu: bool, disk: str, extra: list[tuple[str, bytes, bytes]]
    ) -> None:
        name = f"p{next(counter)}"
        path = tmp / f"{name}.tar"
        with tarfile.open(path, "w") as tar:

            def add(n: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> None:
                info = tarfile.TarInfo(n)
                info.type = kind
                if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                    info.linkname = "/etc/shadow"
                if kind == tarfile.REGTYPE:
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.addfile(info)

            meta = {"runtime": runtime, "cpuModel": cpu if same_cpu else "Other", "includeMemory": memory}
            add("meta.json", json.dumps(meta).encode())
            if disk != "none":
                add("disk.qcow2", {"flat": flat, "backed": backed, "junk": b"junk" * 100}[disk])
            if memory:
                add("ch/config.json", memory_config.encode())
                add("ch/state.json", b"{}")
                add("ch/memory-ranges", b"\0" * 64)
            for n, kind, data in extra:
                add(n, data, kind)
        inst = chvm(name, None, restore_from="https://snap.example/x.tar", nics=())
        instances = root / f"{DATA}/cloud-hypervisor/instances".lstrip("/")
        try:
            rt.restore(inst, str(path), Prepared())
        except TerminalError:
            left = set(os.listdir(instances)) if instances.exists() else set()
            assert name not in left and f".{name}.new" not in left
        else:
            d = instances / name
            assert parse_record((d / "vm.json").read_bytes()).restored
            assert runtime == "cloud-hypervisor" and disk == "flat" and (same_cpu or not memory)
            files = set(os.listdir(d))
            assert {"vm.json", "disk.qcow2"} <= files <= {"vm.json", "disk.qcow2", "seed.iso", *MEMORY}
            shutil.rmtree(d)
        finally:
            path.unlink()
        assert not (root / "etc/escape").exists() and not (tmp / "escape").exists()
        assert not any(p.is_symlink() for p in instances.rglob("*")) if instances.exists() else True

    try:
        check()
        after = {p for p in root.rglob("*")}
        data = root / DATA.lstrip("/")
        assert {p for p in after - before if p != data and "cloud-hypervisor" not in p.parts} == set()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


MEMORY = ("config.json", "state.json", "memory-ranges")


def test_files_the_vmms_user_can_replace_are_never_followed(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """The VMM's user can rename and replace entries of its instance's directory (its ACL entry on
    the directory; as root it owns it). A disk, seed or rebind disk swapped for a symlink to another
    tenant's disk is refused by the snapshot, the grow and the rebind answer, which read nothing
    through it; a vm.json that is not the node's own file is not bcd's record."""
    rt, _rec, image = host
    for name in ("t1", "t2"):
        rt.create(chvm(name, image, nics=()), Prepared(user_data=b"#cloud-config\n"))
    d1 = rt.system.host_path(ch_instance_dir(DATA, "t1"))
    other = rt.system.host_path(ch_instance_dir(DATA, "t2")) / "disk.qcow2"
    before = other.read_bytes()
    snaps = rt.system.host_path(f"{DATA}/snapshots")
    snaps.mkdir(parents=True)

    (d1 / "seed.iso").unlink()
    (d1 / "seed.iso").symlink_to(other)
    with pytest.raises(TerminalError, match="no symlink"):
        rt.snapshot(chvm("t1", image, nics=()), False, str(snaps / "a.tar"))
    assert not (snaps / "a.tar.disk").exists()
    tar = snaps / "a.tar"
    assert not tar.exists() or before[:4096] not in tar.read_bytes()

    (d1 / "disk.qcow2").rename(d1 / "mine.qcow2")
    (d1 / "disk.qcow2").symlink_to(other)
    with pytest.raises(TerminalError, match="no symlink"):
        rt.snapshot(chvm("t1", image, nics=()), False, str(snaps / "b.tar"))
    assert not (snaps / "b.tar").exists()
    with pytest.raises(TerminalError, match="no symlink"):
        rt.grow(chvm("t1", image, nics=(), disk_bytes=512 * MIB), running=False)
    assert other.read_bytes() == before  # never resized through the link

    (d1 / "rebind.img").symlink_to(other)
    assert rt.rebind_answer("t1") == b""

    (d1 / "vm.json").rename(d1 / "old.json")
    (d1 / "vm.json").write_bytes((d1 / "old.json").read_bytes())
    os.chown(d1 / "vm.json", 4242, 4242)  # the VMM's user wrote it
    with pytest.raises(RetryableError, match="not the node's own regular file"):
        rt.record("t1")


def test_a_snapshot_directory_swapped_for_a_link_is_not_followed(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """The VMM's user replaces the directory bcd made for the VMM's snapshot with a symlink to another
    instance's directory holding a restored memory state: the tar holds what the VMM wrote into bcd's
    directory (read through its descriptor), never the other tenant's files, and the link's target
    is left as it was."""
    rt, rec, image = host
    inst = chvm("w1", image, nics=())
    rt.create(inst, Prepared())
    rt.start(inst, paused=False)
    victim = rt.system.host_path(ch_instance_dir(DATA, "w1")).parent / "victim"
    victim.mkdir()
    (victim / "state.json").write_text("the other tenant's memory")
    vmm = rec.vmms["w1"]
    original = vmm._handle

    def swap_then_snapshot(endpoint: str, doc: Any, fds: list[int]) -> tuple[int, Any]:
        out = original(endpoint, doc, fds)
        if endpoint == "vm.snapshot":  # after writing into bcd's directory, swap it for a link
            work = Path(vmm._host(doc["destination_url"][len("file://") :]))
            work.rename(work.with_name("moved"))
            work.symlink_to(victim)
        return out

    vmm._handle = swap_then_snapshot  # type: ignore[method-assign]
    tar = rt.system.host_path(f"{DATA}/snapshots/w1.tar")
    tar.parent.mkdir(parents=True)
    rt.snapshot(inst, True, str(tar))
    got = members(tar)
    assert got["ch/state.json"] == b'{"vm": "state"}'
    assert (victim / "state.json").read_text() == "the other tenant's memory"
    assert not (rt.system.host_path(ch_instance_dir(DATA, "w1")) / "snapshot").exists()
    rt.stop("w1")


def test_the_overlay_is_checked_before_every_start_snapshot_and_resize_dlv_img_13(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """DLV-IMG-13: a VMM that rewrote its overlay's header to name another backing file (here with
    the real `qemu-img rebase -u`) gets no start, no snapshot and no resize of it."""
    rt, rec, image = host
    inst = chvm("i1", image, nics=())
    rt.create(inst, Prepared())
    disk = rt.system.host_path(f"{ch_instance_dir(DATA, 'i1')}/disk.qcow2")
    subprocess.run(
        ["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "raw", "-b", "/etc/shadow", str(disk)], check=True
    )
    snaps = rt.system.host_path(f"{DATA}/snapshots")
    snaps.mkdir(parents=True)
    with pytest.raises(TerminalError, match="/etc/shadow"):
        rt.start(inst, paused=False)
    assert "i1" not in rec.vmms and "ch.launch" not in rec.calls
    with pytest.raises(TerminalError, match="/etc/shadow"):
        rt.snapshot(inst, False, str(snaps / "i1.tar"))
    assert not (snaps / "i1.tar").exists()
    size = disk.stat().st_size
    with pytest.raises(TerminalError, match="/etc/shadow"):
        rt.grow(chvm("i1", image, nics=(), disk_bytes=1 << 30), running=False)
    assert disk.stat().st_size == size


def test_memory_snapshots_with_gpus_or_writable_volumes_are_refused_up_front_dlv_rt_13_dlv_rt_14_dlv_rt_15(
    host: tuple[CloudHypervisorRuntime, Recorder, Image],
) -> None:
    """DLV-RT-13, DLV-RT-14, DLV-RT-15 (cloud-hypervisor): a memory snapshot of an instance with a
    passthrough GPU or a read-write volume is refused before anything runs (the VMM is asked nothing);
    a disk-only snapshot of the same instance works."""
    rt, rec, image = host
    store = rt.system.host_path(f"{DATA}/volumes")
    store.mkdir(parents=True)
    (store / "w.raw").write_bytes(b"\0" * 512)
    (store / "w.json").write_text(json.dumps({"id": "w", "serial": "s-w", "size_bytes": 512}))
    gpu = chvm("g1", image, nics=(), gpu_uuids=("GPU-1",))
    vol = chvm("v2", image, nics=(), volumes=(("w", False),))
    rt.create(gpu, Prepared(gpu_addresses=("0000:18:00.0",)))
    rt.create(vol, Prepared())
    snaps = rt.system.host_path(f"{DATA}/snapshots")
    snaps.mkdir(parents=True)
    with pytest.raises(TerminalError, match="passthrough GPUs cannot be snapshotted with its memory"):
        rt.snapshot(gpu, True, str(snaps / "g.tar"))
    with pytest.raises(TerminalError, match="ErrMemorySnapshotWithVolumes"):
        rt.snapshot(vol, True, str(snaps / "v.tar"))
    assert not list(snaps.iterdir()) and rec.calls == []
    for inst in (gpu, vol):
        rt.snapshot(inst, False, str(snaps / f"{inst.id}.tar"))
        assert sorted(members(snaps / f"{inst.id}.tar")) == ["disk.qcow2", "meta.json"]
