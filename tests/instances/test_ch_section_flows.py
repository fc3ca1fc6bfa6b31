"""The cloud-hypervisor runtime driven whole through the instances section, as test_snapshots.py,
test_instances_rebind.py and test_instances_balloon.py drive libvirt-kvm: `instance.snapshot`'s handler
(staging, hash, a real HTTPS upload) and a `restore_from` instance restored from it by the section;
the `Rebinder` over vm.add-disk / vm.remove-device; the `BalloonController` over vm.info / vm.resize.

The VMM is the simulated v51 API server (bcd_simhost.chapi), started by a stand-in helper on each
instance's api.sock (test_ch_snapshot.Recorder); its simulated guest answers a rebind disk unless told
to stay silent. qemu-img is the real one and the NICs real taps in a private network namespace (the
server checks each received fd by fstat and TUNGETIFF)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from attrs import frozen
from bcd_agent.converge.types import SectionState
from bcd_agent.kinds.snapshot import KIND, InstanceSnapshotHandler
from bcd_agent.sections.instances.balloon import BalloonController
from bcd_agent.sections.instances.model import Desired, Image, InstanceSpec, Nic
from bcd_agent.sections.instances.plan import UserData
from bcd_agent.sections.instances.rebind import RETRY_MS, Rebinder, state_from_json
from bcd_agent.sections.instances.restores import SnapshotDownloads
from bcd_agent.sections.instances.runtimes.base import ErrNoBalloon
from bcd_agent.sections.instances.runtimes.cloudhypervisor import CloudHypervisorRuntime
from bcd_agent.sections.instances.section import InstancesSection
from bcd_agent.sections.instances.transfers import TransferRules
from bcd_shared import wire
from bcd_shared.chunit import ch_instance_dir
from bcd_shared.instancenames import tap_name
from bcd_shared.rebinddisk import REBIND_SIZE
from bcd_shared.system import LocalSystem
from bcd_shared.wire.strict import type_url
from dispatch.dhelpers import EffectCtx, make_command
from instkit import FixedUserData, converge, spec
from netns import in_netns
from rebindkit import bundle
from test_ch_snapshot import Recorder, ch_host, chvm, members, requests
from testsupport import require_tool
from tlskit import https_server, make_tls, object_store

DATA = "/var/lib/bcd"
MIB = 1 << 20
IN_CI = os.environ.get("CI") == "true"
pytestmark = pytest.mark.skipif(
    not IN_CI and (os.geteuid() != 0 or not os.path.exists("/dev/net/tun") or not shutil.which("qemu-io")),
    reason="needs root, /dev/net/tun and qemu-utils",
)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@frozen
class World:
    system: LocalSystem
    rec: Recorder
    rt: CloudHypervisorRuntime
    sec: InstancesSection
    source: FixedUserData
    image: Image
    clock: Clock


@pytest.fixture
def world() -> Iterator[World]:
    tmp = Path(tempfile.mkdtemp(prefix="chf", dir="/tmp"))
    system, rec, rt, image = ch_host(tmp)

    def never(fn: Any) -> None:
        raise AssertionError("a snapshot already downloaded is not fetched again")

    source = FixedUserData()
    downloads = SnapshotDownloads(system, DATA, start=never)
    sec = InstancesSection(system, [rt], DATA, user_data=source, snapshots=downloads)
    clock = Clock()
    sec.rebinder = Rebinder(
        system, DATA, sec.runtimes, source, wait_s=0.0, clock=clock, sleep=lambda _s: None
    )
    sec.balloons = BalloonController(system, sec.runtimes, floor_percent=50)
    yield World(system, rec, rt, sec, source, image, clock)
    rec.close()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[str, str, dict[str, bytes]]]:
    """An HTTPS object store on loopback (a throwaway CA): PUT /<name> keeps the body."""
    require_tool("curl")
    ca, cert, key = make_tls(tmp_path)
    objects: dict[str, bytes] = {}
    with https_server(object_store(objects), cert, key) as base:
        yield base, str(ca), objects


def _snapshot_command(instance_id: str, url: str, memory: bool) -> Any:
    req = wire.InstanceSnapshotRequest(instance_id=instance_id, include_memory=memory, upload_url=url)
    return make_command(kind=KIND, payload=(type_url(wire.InstanceSnapshotRequest), bytes(req)))


def test_a_ch_memory_snapshot_through_the_handler_restores_through_the_section_dlv_snap_01_13_dlv_bal_15(
    world: World, store: tuple[str, str, dict[str, bytes]]
) -> None:
    """DLV-SNAP-13, DLV-SNAP-14, DLV-SNAP-01, DLV-CH-38, DLV-CHU-07, DLV-BAL-15 through the section on
    cloud-hypervisor: instance.snapshot of a running ch instance whose balloon is inflated stages the
    tar under data_dir/snapshots/staging, uploads it (meta.json: runtime cloud-hypervisor, memory) and
    leaves no staging file; a `restore_from` instance of that tar is restored by the section and its
    first start is vm.restore with each NIC's tap by SCM_RIGHTS as net_fds, then vm.resume; the VMM
    received bcd's empty balloon, never the snapshot's; planning again gives no step."""
    w = world
    base, ca, objects = store
    src = chvm("src", w.image, user_data_ref="ud")

    def start_src() -> None:
        out = converge(w.sec, spec(src, generation=1))
        assert out.state is SectionState.CONVERGED, out.message
        w.rt.set_balloon("src", 256 * MIB)

    in_netns(start_src)
    assert w.rec.vmms["src"].state == "Running" and w.rt.balloon_bytes("src") == 256 * MIB

    # The handler outside the namespace: the store is on this one's loopback; the VMM's API is a
    # Unix socket, reachable from both.
    handler = InstanceSnapshotHandler(
        LocalSystem(Path("/")), str(w.system.host_path(DATA)),
        instance=lambda i: src if i == "src" else None, runtimes=lambda: w.sec.runtimes,
        hold=w.sec.hold, rules=TransferRules(cacert=ca),
    )  # fmt: skip
    out = trio.run(handler.run, _snapshot_command("src", f"{base}/src.tar", True), EffectCtx())
    result = wire.InstanceSnapshotResult.parse(out)
    body = objects["src.tar"]
    assert result.sha256 == hashlib.sha256(body).hexdigest() and result.size_bytes == len(body)
    assert (result.runtime, result.includes_memory) == ("cloud-hypervisor", True)
    assert result.cpu_model == w.rt.cpu_model() != ""
    assert requests(w.rec.vmms["src"])[-3:] == ["vm.pause", "vm.snapshot", "vm.resume"]
    assert os.listdir(w.system.host_path(f"{DATA}/snapshots/staging")) == []
    tar = w.system.host_path(f"{DATA}/snapshots/staging/x.tar")
    tar.write_bytes(body)
    got = members(tar)
    tar.unlink()
    assert sorted(got) == sorted(
        ["meta.json", "disk.qcow2", "seed.iso", "ch/config.json", "ch/state.json", "ch/memory-ranges"]
    )
    assert json.loads(got["meta.json"]) == {
        "runtime": "cloud-hypervisor",
        "cpuModel": result.cpu_model,
        "includeMemory": True,
    }
    assert json.loads(got["ch/config.json"])["balloon"]["size"] == 256 * MIB  # the tenant's balloon

    # As the download leaves it: data_dir/snapshots/<sha>.tar (the downloader must not fetch).
    w.system.host_path(f"{DATA}/snapshots/{result.sha256}.tar").write_bytes(body)
    copy = chvm(
        "copy",
        None,
        restore_from=f"{base}/src.tar",
        restore_sha256=result.sha256,
        nics=(Nic("br0", "52:54:00:00:01:01"), Nic("br0", "52:54:00:00:01:02")),
    )
    desired = spec(src, copy, generation=2)

    def restore() -> None:
        out = converge(w.sec, desired)
        assert out.state is SectionState.CONVERGED, out.message
        assert w.sec.plan(desired, 2).steps == ()

    in_netns(restore)
    vmm = w.rec.vmms["copy"]
    assert requests(vmm) == ["vm.restore", "vm.resume"]
    _endpoint, doc, nfds = next(r for r in vmm.requests if r[0] == "vm.restore")
    assert nfds == 2 and doc["net_fds"] == [{"id": "net0", "num_fds": 1}, {"id": "net1", "num_fds": 1}]
    assert [n["tap"] for n in vmm.nets] == [tap_name("copy", 0), tap_name("copy", 1)]  # by fstat
    assert [n["mac"] for n in vmm.nets] == ["52:54:00:00:01:01", "52:54:00:00:01:02"]
    assert vmm.config["balloon"] == {"size": 0, "free_page_reporting": True}  # bcd's, not 256 MiB
    assert vmm.state == "Running" and w.rt.balloon_bytes("copy") == 0 and vmm.ignored_fields == []
    assert {i.instance_id: i.state for i in w.sec.last_report.instances} == {
        "src": "RUNNING",
        "copy": "RUNNING",
    }
    d = w.system.host_path(ch_instance_dir(DATA, "copy"))
    assert sorted(os.listdir(d)) == ["api.sock", "disk.qcow2", "seed.iso", "vm.json"]  # memory files gone
    assert w.sec.plan(desired, 2).steps == ()
    converge(w.sec, spec(generation=3))  # no spec restores from it any more: the tar goes
    assert not w.system.host_path(f"{DATA}/snapshots/{result.sha256}.tar").exists()


def _running(w: World, *instances: InstanceSpec) -> Any:
    desired = spec(*instances, generation=1)

    def up() -> None:
        out = converge(w.sec, desired)
        assert out.state is SectionState.CONVERGED, out.message

    in_netns(up)
    return desired


def test_the_rebinder_drives_ch_add_disk_and_remove_device_dlv_reb_02_07_11_12_13_14(world: World) -> None:
    """DLV-REB-02, DLV-REB-07, DLV-REB-11, DLV-REB-12, DLV-REB-13, DLV-REB-14 on cloud-hypervisor: the
    bundle is fetched bound to the allocation, the 1 MiB disk hot-added by vm.add-disk (raw, serial
    bc-rebind), the simulated guest answers in its last 4 KiB, vm.remove-device takes it away and its
    file is zeroed and gone; the reference is in instances-rebound.json and the report; planning
    again runs nothing."""
    w = world
    w.source.answers["a"] = UserData(data=bundle(with_key=False))
    desired = _running(w, chvm("a", w.image, nics=(), identity_rebind_ref="ref-1"))
    vmm = w.rec.vmms["a"]
    path = w.system.host_path(f"{ch_instance_dir(DATA, 'a')}/rebind.img")
    seen: list[bytes] = []
    real_detach = w.rt.rebind_detach

    def detach(name: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 5, 0) == b"nonce" and b"BCREBOUND " in os.pread(fd, 4096, REBIND_SIZE - 4096)
            real_detach(name)
            seen.append(os.pread(fd, REBIND_SIZE, 0))
        finally:
            os.close(fd)

    w.rt.rebind_detach = detach  # type: ignore[method-assign]
    assert w.sec.rebind_tick(desired) == [("a", "rebound")]
    assert w.source.asked[-1] == ("a", "alloc_a", "ref-1")
    add = next(r[1] for r in vmm.requests if r[0] == "vm.add-disk")
    assert add == {
        "id": w.rt.REBIND_ID,
        "path": f"{ch_instance_dir(DATA, 'a')}/rebind.img",
        "image_type": "Raw",
        "serial": "bc-rebind",
    }
    assert requests(vmm)[-2:] == ["vm.add-disk", "vm.remove-device"]
    assert [d["id"] for d in vmm.disks] == ["disk0"]  # the rebind disk gone
    assert seen == [b"\0" * REBIND_SIZE] and not path.exists()
    recorded = json.loads(w.system.host_path(f"{DATA}/instances-rebound.json").read_text())
    assert recorded["rebound"] == {"a": "ref-1"}
    assert w.sec.rebind_tick(desired) == []  # plan again: nothing
    assert requests(vmm)[-1] == "vm.remove-device" and w.sec.plan(desired, 1).steps == ()
    converge(w.sec, desired)
    assert w.sec.last_report.instances[0].identity_rebound_ref == "ref-1"
    assert Rebinder(w.system, DATA, w.sec.runtimes, w.source).rebound() == {"a": "ref-1"}  # a restart


def test_a_silent_ch_guest_is_detached_zeroed_and_retried_dlv_reb_10_12_16(world: World) -> None:
    """DLV-REB-10, DLV-REB-12, DLV-REB-16 on cloud-hypervisor: a guest that never answers: the disk is
    removed by vm.remove-device and its file zeroed and deleted; nothing is reported; tried again only
    after 5 minutes."""
    w = world
    w.source.answers["s"] = UserData(data=bundle(with_key=False))
    desired = _running(w, chvm("s", w.image, nics=(), identity_rebind_ref="ref-1"))
    vmm = w.rec.vmms["s"]
    vmm.guest_rebind = False
    path = w.system.host_path(f"{ch_instance_dir(DATA, 's')}/rebind.img")
    seen: list[bytes] = []
    real_detach = w.rt.rebind_detach

    def detach(name: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            real_detach(name)
            seen.append(os.pread(fd, REBIND_SIZE, 0))
        finally:
            os.close(fd)

    w.rt.rebind_detach = detach  # type: ignore[method-assign]
    assert w.sec.rebind_tick(desired) == [("s", "the guest did not answer")]
    assert requests(vmm)[-2:] == ["vm.add-disk", "vm.remove-device"]
    assert seen == [b"\0" * REBIND_SIZE] and not path.exists()
    assert [d["id"] for d in vmm.disks] == ["disk0"]  # the rebind disk gone
    assert w.sec.rebind_tick(desired) == []  # not before 5 minutes
    converge(w.sec, desired)
    assert w.sec.last_report.instances[0].identity_rebound_ref == ""  # nothing reported
    assert w.sec.rebinder.state.attempts["s"].tries == 1
    w.clock.t += RETRY_MS / 1000
    vmm.guest_rebind = True
    assert w.sec.rebind_tick(desired) == [("s", "rebound")]
    state = state_from_json(w.system.host_path(f"{DATA}/instances-rebound.json").read_bytes())
    assert state.rebound == {"s": "ref-1"} and state.attempts == {}


def test_the_balloon_controller_over_ch_resizes_and_leaves_a_vm_without_balloon_dlv_bal_13_14(
    world: World,
) -> None:
    """DLV-BAL-13, DLV-BAL-14, DLV-BAL-11 on cloud-hypervisor, through the section's balloon tick: the
    controller reads each ballooned VM's balloon from vm.info (no usage reading: nothing is taken from
    the guest, so an inflated balloon is emptied to its floor) and sends the target as vm.resize
    desired_balloon; a VM defined without a balloon device is never read nor resized (ErrNoBalloon);
    a second tick changes nothing."""
    w = world
    w.system.host_path("/proc/meminfo").write_text(
        "MemTotal:       67108864 kB\nMemAvailable:    3355443 kB\n"  # 5 %: the host is short
    )
    desired = _running(w, chvm("b1", w.image, nics=()), chvm("b2", w.image, nics=(), placement=None))
    w.rt.set_balloon("b1", 256 * MIB)
    with pytest.raises(ErrNoBalloon):
        w.rt.set_balloon("b2", 64 * MIB)
    steps = w.sec.balloon_tick(desired)
    assert [(s.name, s.previous_bytes, s.balloon_bytes) for s in steps] == [("b1", 256 * MIB, 0)]
    assert [r[1] for r in w.rec.vmms["b1"].requests if r[0] == "vm.resize"][-1] == {"desired_balloon": 0}
    assert w.rt.balloon_bytes("b1") == 0
    assert "vm.resize" not in requests(w.rec.vmms["b2"])
    assert w.sec.balloons.lent == {"b1": 0}
    assert w.sec.balloon_tick(desired) == ()  # plan again: nothing
    assert w.sec.plan(desired, 1).steps == ()  # the section's plan is untouched by the balloons
    assert [r[0] for r in w.rec.vmms["b1"].requests].count("vm.resize") == 2  # bcd's set, the tick's
    stopped = spec(chvm("b1", w.image, nics=(), desired=Desired.STOPPED), generation=2)
    in_netns(lambda: converge(w.sec, stopped))
    assert w.sec.balloon_tick(stopped) == ()
