"""The cloud-hypervisor runtime's NICs and failures, with the helper's ch.* replaced by a recorder that
starts the simulated v51 VMM on ch.launch: real taps opened in a private network namespace and their
fds sent to the VMM (which checks each by fstat and TUNGETIFF), a failed attach, an out-of-memory boot."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.sections.instances.model import RUNTIME_CH, Nic
from bcd_agent.sections.instances.runtimes.base import CapacityRefused, Prepared
from bcd_agent.sections.instances.runtimes.cloudhypervisor import CloudHypervisorRuntime
from bcd_shared.chunit import ch_instance_dir
from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.instancenames import tap_name
from bcd_simhost.chapi import FakeCHServer
from instkit import sim_host, vm
from netns import in_netns

DATA = "/var/lib/bcd"
IN_CI = os.environ.get("CI") == "true"
needs_tun = pytest.mark.skipif(
    not IN_CI and (os.geteuid() != 0 or not os.path.exists("/dev/net/tun")),
    reason="needs root and /dev/net/tun",
)


class Recorder:
    """ch.* as the helper answers them; ch.launch starts the simulated VMM on the instance's socket."""

    def __init__(self, system: Any, **server: Any) -> None:
        self.system = system
        self.server_kw = server
        self.calls: list[str] = []
        self.vmm: FakeCHServer | None = None

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(op)
        name = args["name"]
        if op == "ch.taps":
            return {"taps": [tap_name(name, i) for i in range(len(args["bridges"]))]}
        if op == "ch.launch":
            sock = self.system.host_path(f"{ch_instance_dir(DATA, name)}/api.sock")
            self.vmm = FakeCHServer(sock, root=self.system.root, **self.server_kw)
            return {}
        if op == "ch.stop":
            if self.vmm is not None:
                self.vmm.close()
            return {"state": "inactive"}
        return {}


@pytest.fixture
def short_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="chn", dir="/tmp"))  # short: sun_path holds 108 bytes
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _runtime(root: Path, **server: Any) -> tuple[CloudHypervisorRuntime, Recorder]:
    system = sim_host(root)
    rec = Recorder(system, **server)
    return CloudHypervisorRuntime(system, rec, DATA, stop_timeout_s=1.0, sleep=lambda s: None), rec


def chvm(ident: str, **kw: Any) -> Any:
    base: dict[str, Any] = {
        "runtime": RUNTIME_CH,
        "nics": (Nic("br0", "52:54:00:00:00:01"), Nic("br0", "52:54:00:00:00:02")),
    }
    base.update(kw)
    return vm(ident, **base)


@needs_tun
def test_each_nic_gets_its_tap_fd_and_the_taps_go_at_stop_dlv_chh_08_dlv_ch_16(short_root: Path) -> None:
    """DLV-CHH-08, DLV-CH-12, DLV-CH-16, DLV-CHU-06: the node attaches to each tap ch.taps made and
    sends its fd with vm.add-net (the VMM reads the tap's name from the fd it got); a stop ends with
    ch.stop and ch.untaps."""
    rt, rec = _runtime(short_root)
    inst = chvm("n1")

    def body() -> None:
        rt.create(inst, Prepared(user_data=b"#cloud-config\n"))
        rt.start(inst, paused=False)
        vmm = rec.vmm
        assert vmm is not None
        assert [(n["id"], n["tap"], n["mac"]) for n in vmm.nets] == [
            ("net0", tap_name("n1", 0), "52:54:00:00:00:01"),
            ("net1", tap_name("n1", 1), "52:54:00:00:00:02"),
        ]
        assert vmm.state == "Running" and vmm.ignored_fields == []
        assert [r[0] for r in vmm.requests if r[0] != "vmm.ping"] == [
            "vm.create",
            "vm.add-net",
            "vm.add-net",
            "vm.boot",
        ]
        rt.stop("n1")

    in_netns(body)
    assert rec.calls == ["ch.taps", "ch.launch", "ch.stop", "ch.untaps"]


def test_a_failed_nic_attach_means_no_vm_dlv_ch_14(short_root: Path) -> None:
    """DLV-CH-14: the VMM refuses a fd that is not a tap: the start fails and the VMM is stopped."""
    rt, rec = _runtime(short_root)
    rt.tap_opener = lambda name: os.open("/dev/null", os.O_RDWR)
    inst = chvm("n2")
    rt.create(inst, Prepared())
    with pytest.raises(RetryableError, match="not /dev/net/tun"):
        rt.start(inst, paused=False)
    assert rec.calls == ["ch.taps", "ch.launch", "ch.stop"]
    assert rec.vmm is not None and "vm.boot" not in [r[0] for r in rec.vmm.requests]


def test_a_nic_without_a_network_is_refused_dlv_ch_15(short_root: Path) -> None:
    """DLV-CH-15."""
    rt, _ = _runtime(short_root)
    with pytest.raises(TerminalError, match="without a network"):
        rt.create(chvm("n3", nics=(Nic("", "52:54:00:00:00:03"),)), Prepared())


def test_a_boot_out_of_memory_is_a_capacity_failure_dlv_ch_32(short_root: Path) -> None:
    """DLV-CH-32: the VMM's "Cannot allocate memory" on vm.boot is CapacityRefused."""
    rt, rec = _runtime(short_root, boot_error="Error booting VM: Cannot allocate memory (os error 12)")
    inst = chvm("n4", nics=())
    rt.create(inst, Prepared())
    with pytest.raises(CapacityRefused):
        rt.start(inst, paused=False)
    assert rec.calls[-1] == "ch.stop"


def test_a_paused_start_pauses_after_boot_dlv_ch_29(short_root: Path) -> None:
    """DLV-CH-29: vm.create, vm.boot, then vm.pause."""
    rt, rec = _runtime(short_root)
    inst = chvm("n5", nics=())
    rt.create(inst, Prepared())
    rt.start(inst, paused=True)
    assert rec.vmm is not None and rec.vmm.state == "Paused"
    assert [r[0] for r in rec.vmm.requests if r[0] != "vmm.ping"] == ["vm.create", "vm.boot", "vm.pause"]
    rt.delete("n5")
    assert not rt.system.exists(ch_instance_dir(DATA, "n5"))


def test_gpus_are_bound_before_the_launch_and_given_back_at_delete_dlv_ch_17_dlv_ch_23(
    short_root: Path,
) -> None:
    """DLV-CH-17, DLV-CH-18, DLV-CH-23: the GPU passes as a VFIO device from its sysfs
    directory, recorded in vm.json; ch.vfio runs before ch.launch, ch.unvfio after the stop at delete;
    a GPU without an inventory address fails the instance."""
    from bcd_shared.chrecord import parse_record

    rt, rec = _runtime(short_root)
    inst = chvm("g1", nics=(), gpu_uuids=("GPU-1",))
    with pytest.raises(TerminalError, match="without a PCI address"):
        rt.create(inst, Prepared())
    rt.create(inst, Prepared(gpu_addresses=("0000:18:00.0",)))
    record = parse_record(rt.system.read_bytes(f"{ch_instance_dir(DATA, 'g1')}/vm.json") or b"")
    assert record.gpus == ("0000:18:00.0",)
    assert record.config["devices"] == [{"id": "gpu0", "path": "/sys/bus/pci/devices/0000:18:00.0/"}]
    rt.start(inst, paused=False)
    assert rec.calls == ["ch.vfio", "ch.launch"]
    rt.delete("g1")
    assert rec.calls == ["ch.vfio", "ch.launch", "ch.stop", "ch.unvfio"]


def test_the_rebind_disk_is_hot_added_then_removed_and_zeroed_dlv_reb_08_dlv_reb_11_dlv_reb_12(
    short_root: Path,
) -> None:
    """DLV-REB-07, DLV-REB-08, DLV-REB-11, DLV-REB-12 (cloud-hypervisor's half): vm.add-disk with
    serial bc-rebind of a file in the instance's directory, then vm.remove-device, and the file zeroed
    (seen through a second link) and deleted."""
    rt, rec = _runtime(short_root)
    inst = chvm("r1", nics=())
    rt.create(inst, Prepared())
    rt.start(inst, paused=False)
    image = b"secret" + b"\0" * (1 << 20)
    rt.rebind_attach("r1", image)
    vmm = rec.vmm
    assert vmm is not None
    added = [d for d in vmm.disks if d["id"] == "rebind"]
    assert added and added[0]["serial"] == "bc-rebind" and added[0]["image_type"] == "Raw"
    real = Path(rt._real(added[0]["path"]))
    assert real.read_bytes() == image and real.stat().st_mode & 0o777 == 0o660
    witness = real.parent / "witness"
    os.link(real, witness)
    rt.rebind_detach("r1")
    assert [d["id"] for d in vmm.disks] == ["disk0"]
    assert not real.exists()
    assert witness.read_bytes() == b"\0" * len(image)


def test_base_images_are_verified_and_checked_as_libvirt_kvms_in_their_own_directory_dlv_ch_05(
    short_root: Path,
) -> None:
    """DLV-CH-05: over the same simulated image server, cloud-hypervisor refuses what libvirt-kvm
    refuses (an http URL, a SHA-256 mismatch, a qcow2 naming a backing file: each BadImage, nothing
    kept in either images directory) and keeps an accepted base in its own `images/`, 0644, which its
    overlay names."""
    import hashlib

    from bcd_agent.sections.instances.model import Image
    from bcd_agent.sections.instances.runtimes.libvirt import DirectVirsh, LibvirtRuntime
    from bcd_shared.chunit import ch_images_dir
    from bcd_shared.images import check_overlay
    from bcd_shared.instancenames import images_dir
    from bcd_simhost.libvirt import HOSTILE_IMAGES, IMAGE_SHA256

    ch, _ = _runtime(short_root)
    lv = LibvirtRuntime(ch.system, DirectVirsh(ch.system), DATA, stop_timeout_s=0.0, sleep=lambda s: None)
    hostile = hashlib.sha256(HOSTILE_IMAGES["backing.qcow2"]).hexdigest()
    bad = [
        (Image("http://images.sim.bcd/debian-12.qcow2", IMAGE_SHA256, "qcow2"), "https only"),
        (Image("https://images.sim.bcd/debian-12.qcow2", "0" * 64, "qcow2"), "is not " + "0" * 64),
        (Image("https://images.sim.bcd/backing.qcow2", hostile, "qcow2"), "backing file"),
    ]
    for i, (image, why) in enumerate(bad):
        for rt in (lv, ch):
            with pytest.raises(TerminalError, match=why) as exc:
                rt.create(chvm(f"b{i}", nics=(), image=image), Prepared())
            assert exc.value.reason == "BadImage"
    for d in (images_dir(DATA), ch_images_dir(DATA)):
        assert [n for n in ch.system.listdir(d) if not n.startswith(".")] == []
    inst = chvm("ok", nics=())
    ch.create(inst, Prepared())
    base = f"{ch_images_dir(DATA)}/{IMAGE_SHA256}.qcow2"
    assert ch.system.host_path(base).stat().st_mode & 0o777 == 0o644
    assert ch.system.listdir(images_dir(DATA)) == []  # not libvirt-kvm's directory
    disk = ch.system.host_path(f"{ch_instance_dir(DATA, 'ok')}/disk.qcow2")
    assert check_overlay(str(disk), base, "qcow2", 1 << 40).backing_file == base
