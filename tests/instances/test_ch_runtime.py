"""The cloud-hypervisor runtime under the helper, through the instances section, on the simulated host:
a real helper process (root's ch.launch/ch.stop, fake systemd-run whose unit serves the simulated v51
VMM API on the instance's api.sock), the node's runtime in this process speaking h11 to it.

Instances here have no NICs: the simulated host has no `ip` (the taps run for real in
tests/helper/test_helper_ch.py, and a real tap fd over the API in test_ch_api.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.sections.instances.model import RUNTIME_CH, Desired, Image, Placement
from bcd_agent.sections.instances.runtimes.cloudhypervisor import CloudHypervisorRuntime, vm_config
from bcd_agent.sections.instances.section import InstancesSection
from bcd_shared.chrecord import parse_record
from bcd_shared.chunit import VMM_UID_BASE
from bcd_shared.errors import TerminalError
from bcd_simhost import sim_system
from bcd_simhost.libvirt import IMAGE_SHA256
from instkit import FixedUserData, converge, spec, vm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helper"))
from helperproc import HelperProcess, base_config, make_root

DATA = "/var/lib/bcd"
CHD = f"{DATA}/cloud-hypervisor"
GIB = 1 << 30


NODE = 4242


class NodeRuntime(CloudHypervisorRuntime):
    """The runtime as an unprivileged node leaves its files: this test process is root, so what
    `create` wrote is handed to the node's uid afterwards (root checks that it is the node's)."""

    def create(self, inst: Any, prepared: Any) -> None:
        super().create(inst, prepared)
        self._to_node()

    def restore(self, inst: Any, tar_path: str, prepared: Any) -> None:
        super().restore(inst, tar_path, prepared)
        self._to_node()

    def _to_node(self) -> None:
        top = self.system.host_path(self.data_dir)
        for dirpath, dirs, files in os.walk(top):
            for n in [dirpath, *(os.path.join(dirpath, f) for f in files + dirs)]:
                os.lchown(n, NODE, NODE)


def chvm(ident: str, **kw: object) -> object:
    return vm(ident, runtime=RUNTIME_CH, nics=(), **kw)


@pytest.fixture(scope="module")
def rt() -> Iterator[tuple[HelperProcess, CloudHypervisorRuntime, InstancesSection]]:
    parent = Path(tempfile.mkdtemp(prefix="bcd-chrt-", dir="/var/tmp"))
    root = make_root(parent)
    binary = root / "usr/bin/cloud-hypervisor"
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    data = root / DATA.lstrip("/")
    data.mkdir(parents=True, exist_ok=True)
    os.chown(data, NODE, NODE)
    proc = HelperProcess(root, base_config(node_uid=NODE, node_gid=NODE, extra='instance_bridges = "br0"\n'))
    system = sim_system(root)
    runtime = NodeRuntime(system, proc.client, DATA, stop_timeout_s=2.0, sleep=lambda s: None, owner=NODE)
    sec = InstancesSection(system, [runtime], DATA, user_data=FixedUserData())
    yield proc, runtime, sec
    proc.stop()
    shutil.rmtree(parent, ignore_errors=True)


def test_config_has_no_nics_and_explicit_image_types_dlv_chu_05_dlv_ch_06_dlv_ch_07_dlv_ch_24() -> None:
    """DLV-CHU-05, DLV-CH-06, DLV-CH-07, DLV-CH-24, DLV-CH-04, DLV-CH-42, DLV-CH-10 (the seed a Raw
    read-only disk)."""
    inst = vm("a", runtime=RUNTIME_CH, vcpus=3, placement=Placement(balloon=True))
    c = vm_config(inst, f"{CHD}/instances/a", f"{CHD}/images/x.qcow2", True)
    assert "net" not in c
    assert c["cpus"] == {"boot_vcpus": 3, "max_vcpus": 3}
    assert c["payload"] == {"firmware": "/usr/share/cloud-hypervisor/CLOUDHV.fd"}
    assert c["disks"] == [
        {
            "id": "disk0",
            "path": f"{CHD}/instances/a/disk.qcow2",
            "image_type": "Qcow2",
            "backing_files": True,
        },
        {"id": "seed", "path": f"{CHD}/instances/a/seed.iso", "image_type": "Raw", "readonly": True},
    ]
    assert c["serial"] == {"mode": "Socket", "socket": f"{CHD}/instances/a/serial.sock"}
    assert c["balloon"]["size"] == 0
    assert "balloon" not in vm_config(vm("b", runtime=RUNTIME_CH), "/d", None, False)


def test_an_iso_is_refused_dlv_ch_08(
    rt: tuple[HelperProcess, CloudHypervisorRuntime, InstancesSection],
) -> None:
    """DLV-CH-08."""
    _, runtime, _ = rt
    from bcd_agent.sections.instances.runtimes.base import Prepared

    with pytest.raises(TerminalError, match="cloud-hypervisor boots disk images, not an iso"):
        runtime.create(
            chvm("iso", image=Image("https://images.sim.bcd/x.iso", IMAGE_SHA256, "iso")), Prepared()
        )  # type: ignore[arg-type]


def test_lifecycle_through_the_helper_dlv_ch_29_dlv_ch_30_dlv_ch_27(
    rt: tuple[HelperProcess, CloudHypervisorRuntime, InstancesSection],
) -> None:
    """DLV-CH-26, DLV-CH-27, DLV-CH-29, DLV-CH-30, DLV-CH-31, DLV-CH-33, DLV-CHU-02, DLV-CHH-01: create
    (vm.json with a uid from bcd's range), start (ch.launch, vm.create, vm.boot), pause and resume,
    stop (power button, vm.shutdown, vmm.shutdown, ch.stop: inactive), delete; listed from vm.info."""
    h, runtime, sec = rt
    out = converge(sec, spec(chvm("ch1"), chvm("ch2")))
    assert out.state is SectionState.CONVERGED, out.message
    rec1 = parse_record((h.root / CHD.lstrip("/") / "instances/ch1/vm.json").read_bytes())
    rec2 = parse_record((h.root / CHD.lstrip("/") / "instances/ch2/vm.json").read_bytes())
    assert {rec1.uid, rec2.uid} == {VMM_UID_BASE, VMM_UID_BASE + 1}
    assert rec1.config["disks"][0]["image_type"] == "Qcow2"
    assert {(d.name, d.state) for d in runtime.list()} == {("ch1", "running"), ("ch2", "running")}
    ops = [e["op"] for e in h.audit_lines() if e["decision"] == "accepted"]
    assert ops.count("ch.launch") == 2
    units = json.loads((h.root / "var/lib/bcd-sim/systemd/units.json").read_text())
    assert units["bcd-ch-ch1.service"]["properties"]["User"] == str(rec1.uid)
    # pause, resume, stop
    converge(sec, spec(chvm("ch1", desired=Desired.PAUSED), chvm("ch2"), generation=2))
    assert {d.name: d.state for d in runtime.list()}["ch1"] == "paused"
    converge(sec, spec(chvm("ch1"), chvm("ch2"), generation=3))
    assert {d.name: d.state for d in runtime.list()}["ch1"] == "running"
    out = converge(sec, spec(chvm("ch1", desired=Desired.STOPPED), chvm("ch2"), generation=4))
    assert out.state is SectionState.CONVERGED, out.message
    assert {d.name: d.state for d in runtime.list()}["ch1"] == "stopped"
    units = json.loads((h.root / "var/lib/bcd-sim/systemd/units.json").read_text())
    assert units["bcd-ch-ch1.service"]["active"] is False
    ops = [e["op"] for e in h.audit_lines() if e["decision"] == "accepted"]
    assert ops[-1] == "ch.stop"
    # a directory without vm.json is never listed nor removed (DLV-CH-28)
    stranger = h.root / CHD.lstrip("/") / "instances/stranger"
    stranger.mkdir()
    (stranger / "disk.qcow2").write_bytes(b"x")
    out = converge(sec, spec(chvm("ch2"), generation=5))
    assert out.state is SectionState.CONVERGED, out.message
    assert [d.name for d in runtime.list()] == ["ch2"]
    assert not (h.root / CHD.lstrip("/") / "instances/ch1").exists()
    assert (stranger / "disk.qcow2").exists()


def test_grow_while_running_uses_resize_disk_dlv_ch_09(
    rt: tuple[HelperProcess, CloudHypervisorRuntime, InstancesSection],
) -> None:
    """DLV-CH-09: a running VM's disk grows with vm.resize-disk; a smaller size fails."""
    _h, runtime, sec = rt
    out = converge(sec, spec(chvm("g1"), generation=10))
    assert out.state is SectionState.CONVERGED, out.message
    runtime.grow(chvm("g1", disk_bytes=20 * GIB), running=True)  # type: ignore[arg-type]
    info = runtime.api("g1").info()
    assert [d.get("size") for d in info["config"]["disks"] if d["id"] == "disk0"] == [20 * GIB]
    with pytest.raises(TerminalError, match="disks only grow"):
        runtime.grow(chvm("g1", disk_bytes=GIB), running=True)  # type: ignore[arg-type]


def test_balloon_through_vm_resize_dlv_bal_13_dlv_bal_14(
    rt: tuple[HelperProcess, CloudHypervisorRuntime, InstancesSection],
) -> None:
    """DLV-BAL-13, DLV-BAL-14 (cloud-hypervisor's half): the balloon is vm.resize desired_balloon,
    read back from vm.info's balloon size; a VM defined without a balloon device is never touched
    (ErrNoBalloon)."""
    _h, runtime, sec = rt
    out = converge(sec, spec(chvm("b1", placement=Placement(balloon=True)), chvm("b2"), generation=20))
    assert out.state is SectionState.CONVERGED, out.message
    runtime.set_balloon("b1", GIB // 2)
    assert runtime.balloon_bytes("b1") == GIB // 2
    readings = runtime.balloon_readings()
    assert {k: (r.balloon_bytes, r.used_bytes) for k, r in readings.items() if k in ("b1", "b2")} == {
        "b1": (GIB // 2, None)
    }
    with pytest.raises(TerminalError, match="no balloon device"):
        runtime.set_balloon("b2", GIB // 2)


def test_hello_advertises_it_only_with_binary_kvm_and_the_helpers_ops_dlv_chh_01(
    rt: tuple[HelperProcess, CloudHypervisorRuntime, InstancesSection],
) -> None:
    """DLV-CHH-01, DLV-CHU-31 (Q-DLV-CHU-02): run (and so advertised in Hello) only where the binary
    is v51 or later, /dev/kvm exists and the helper serves ch.*."""
    from bcd_agent.sections.instances.runtimes.cloudhypervisor import ch_available, helper_has_ch_ops
    from bcd_shared.errors import HelperRefused

    h, _, _ = rt

    class OldHelper:
        def call(self, op: str, args: object) -> dict[str, object]:
            raise HelperRefused("unknown-op", f"unknown op {op}")

    assert helper_has_ch_ops(h.client) is True
    assert helper_has_ch_ops(OldHelper()) is False
    which = {"cloud-hypervisor": "/usr/bin/cloud-hypervisor"}.get
    v51 = lambda p: "cloud-hypervisor v51.0"  # noqa: E731
    assert ch_available(which, True, h.client, v51) is None
    assert ch_available(lambda n: None, True, h.client, v51) == "no cloud-hypervisor on PATH"
    assert "older than v51" in str(ch_available(which, True, h.client, lambda p: "cloud-hypervisor v50.0"))
    assert ch_available(which, False, h.client, v51) == "no /dev/kvm"
    assert ch_available(which, True, OldHelper(), v51) == "no helper serving ch.*"
    assert ch_available(which, True, None, v51) == "no helper serving ch.*"


SAVED = {
    "cpus": {
        "boot_vcpus": 2,
        "max_vcpus": 2,
        "topology": {"threads_per_core": 1},
        "affinity": [{"vcpu": 0, "host_cpus": [3]}],
    },
    "memory": {
        "size": GIB,
        "hugepages": True,
        "hugepage_size": 2 << 20,
        "zones": [{"id": "z", "size": GIB}],
        "shared": False,
    },
    "platform": {"num_pci_segments": 1, "uuid": "u", "oem_strings": ["x"]},
    "payload": {"kernel": "/etc/shadow"},
    "disks": [{"path": "/etc/shadow"}],
    "net": [{"id": "net0", "tap": "eth0", "mac": "52:54:00:00:00:09"}],
    "fs": [{"tag": "t", "socket": "/run/x"}],
    "pmem": [{"file": "/dev/mem"}],
    "vsock": {"cid": 3, "socket": "/run/v"},
    "debug_console": {"mode": "File", "file": "/etc/passwd"},
    "landlock_rules": [{"path": "/", "access": "rw"}],
    "balloon": {"size": 900 << 20},
    "serial": {"mode": "File", "file": "/etc/passwd"},
}


def test_the_restore_config_is_rebuilt_from_allowlists_dlv_ch_38_39_40_41() -> None:
    """DLV-CH-38, DLV-CH-39, DLV-CH-40, DLV-CH-41, DLV-CHU-08, DLV-CHU-29: only cpus, memory and
    platform keys through their allowlists; bcd's payload, disks, serial, rng and balloon (never the
    tenant's balloon); NICs by id and MAC, no tap; no affinity, zones, huge pages, fs, pmem, vsock,
    debug console or landlock rules."""
    from bcd_agent.sections.instances.runtimes.cloudhypervisor import restored_config

    fresh = vm_config(
        vm("r", runtime=RUNTIME_CH, vcpus=2, memory_bytes=GIB, placement=Placement(balloon=True)),
        "/d",
        "/b",
        True,
    )
    out = restored_config(SAVED, fresh, [("net0", "52:54:00:00:00:01")])
    assert set(out) == {
        "cpus",
        "memory",
        "platform",
        "payload",
        "disks",
        "serial",
        "console",
        "rng",
        "balloon",
        "net",
    }
    assert out["cpus"] == {"boot_vcpus": 2, "max_vcpus": 2, "topology": {"threads_per_core": 1}}
    assert out["memory"] == {"size": GIB, "shared": False}
    assert out["platform"] == {"num_pci_segments": 1, "uuid": "u"}
    for key in ("payload", "disks", "serial", "console", "rng", "balloon"):
        assert out[key] == fresh[key], key
    assert out["balloon"]["size"] == 0  # bcd's balloon, not the snapshot's 900 MiB
    assert out["net"] == [{"id": "net0", "mac": "52:54:00:00:00:01"}]


def test_a_snapshot_of_another_size_is_refused_dlv_ch_37() -> None:
    """DLV-CH-37."""
    from bcd_agent.sections.instances.runtimes.cloudhypervisor import check_snapshot_config

    check_snapshot_config(SAVED, 2, GIB)
    for vcpus, mem in ((4, GIB), (2, 2 * GIB), (1, GIB)):
        with pytest.raises(TerminalError):
            check_snapshot_config(SAVED, vcpus, mem)
    with pytest.raises(TerminalError):
        check_snapshot_config({"cpus": {"boot_vcpus": 2, "max_vcpus": 4}, "memory": {"size": GIB}}, 2, GIB)
    with pytest.raises(TerminalError):
        check_snapshot_config([], 2, GIB)


def test_a_memory_restore_launches_through_the_helper_dlv_chh_16_dlv_ch_38(
    rt: tuple[HelperProcess, CloudHypervisorRuntime, InstancesSection],
) -> None:
    """DLV-CHH-16, DLV-CHH-17, DLV-CH-07, DLV-CH-38, DLV-CH-41 through a real helper: a restored record
    (a flat disk, no base image) passes root's ch.launch checks and its unit binds no base image; the
    first start is vm.restore of bcd's rebuilt configuration (the snapshot's `fs` and CPU affinity
    dropped, no backing_files), then vm.resume; the VMM's state files go after."""
    from bcd_agent.sections.instances.runtimes.base import Prepared, SnapshotMeta
    from bcd_agent.sections.instances.snapshots import cpu_model, write_tar
    from bcd_simhost.libvirt import qcow2_bytes

    h, runtime, _sec = rt
    work = Path(tempfile.mkdtemp(prefix="chrs", dir="/var/tmp"))
    try:
        (work / "disk").write_bytes(qcow2_bytes(GIB))
        (work / "seed").write_bytes(b"\0" * 2048)
        saved = {
            "cpus": {"boot_vcpus": 2, "max_vcpus": 2, "affinity": [{"vcpu": 0, "host_cpus": [3]}]},
            "memory": {"size": 2 * GIB, "hugepages": True},
            "fs": [{"tag": "host", "socket": "/run/evil.sock"}],
            "payload": {"kernel": "/etc/shadow"},
        }
        (work / "config").write_text(json.dumps(saved))
        (work / "state").write_text("{}")
        (work / "mem").write_bytes(b"\0" * 64)
        tar = work / "snap.tar"
        write_tar(
            str(tar),
            SnapshotMeta("cloud-hypervisor", cpu_model(runtime.system), True),
            [
                ("disk.qcow2", str(work / "disk")),
                ("seed.iso", str(work / "seed")),
                ("ch/config.json", str(work / "config")),
                ("ch/state.json", str(work / "state")),
                ("ch/memory-ranges", str(work / "mem")),
            ],
        )
        inst = chvm("rs1", image=None, restore_from="https://snap.example/rs1.tar")
        runtime.restore(inst, str(tar), Prepared())  # type: ignore[arg-type]
        runtime.start(inst, paused=False)  # type: ignore[arg-type]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = runtime.api("rs1").info()
    assert info["state"] == "Running"
    config = info["config"]
    assert "fs" not in config and "affinity" not in config["cpus"] and "hugepages" not in config["memory"]
    assert config["payload"]["firmware"].endswith("CLOUDHV.fd") and "kernel" not in config["payload"]
    assert config["disks"][0]["backing_files"] is False
    units = json.loads((h.root / "var/lib/bcd-sim/systemd/units.json").read_text())
    props = units["bcd-ch-rs1.service"]["properties"]
    assert "BindReadOnlyPaths" not in props
    d = h.root / CHD.lstrip("/") / "instances/rs1"
    assert sorted(p.name for p in d.iterdir() if p.name != "api.sock") == [
        "disk.qcow2",
        "seed.iso",
        "vm.json",
    ]
    assert [e["op"] for e in h.audit_lines() if e["decision"] == "accepted"][-1] == "ch.launch"
    runtime.delete("rs1")


def test_the_placement_becomes_affinity_huge_pages_and_a_reporting_balloon_dlv_plc_11_12_13_16() -> None:
    """DLV-PLC-11, DLV-PLC-12, DLV-PLC-13, DLV-PLC-16: `cpus` becomes `cpus.affinity` (one host CPU
    per vCPU when it names exactly as many, else each vCPU floats over the set), huge pages
    `memory.hugepages` with their size, a balloon one with free page reporting; a memory restore
    keeps bcd's affinity from the spec, never the snapshot's."""
    from bcd_agent.sections.instances.runtimes.cloudhypervisor import restored_config

    def config(**pl: Any) -> dict[str, Any]:
        inst = vm(
            "p", runtime=RUNTIME_CH, vcpus=2, memory_bytes=GIB, placement=Placement(**pl) if pl else None
        )
        return vm_config(inst, "/d", "/b", False)  # type: ignore[arg-type]

    pinned = config(cpus="4-5")
    assert pinned["cpus"]["affinity"] == [{"vcpu": 0, "host_cpus": [4]}, {"vcpu": 1, "host_cpus": [5]}]
    floating = config(cpus="0-3,8")
    assert floating["cpus"]["affinity"] == [{"vcpu": i, "host_cpus": [0, 1, 2, 3, 8]} for i in (0, 1)]
    huge = config(hugepage_size_bytes=2 << 20)
    assert (huge["memory"]["hugepages"], huge["memory"]["hugepage_size"]) == (True, 2 << 20)
    assert "balloon" not in huge
    assert config(balloon=True)["balloon"] == {"size": 0, "free_page_reporting": True}
    plain = config()
    assert "affinity" not in plain["cpus"] and "hugepages" not in plain["memory"] and "balloon" not in plain
    restored = restored_config(SAVED, pinned, [])
    assert restored["cpus"]["affinity"] == pinned["cpus"]["affinity"]
    assert restored_config(SAVED, plain, [])["cpus"].get("affinity") is None  # never the snapshot's [3]


def test_the_vmms_user_never_renames_the_nodes_files_under_the_helper(
    rt: tuple[HelperProcess, CloudHypervisorRuntime, InstancesSection],
) -> None:
    """The instance's directory is sticky (1700): root's ACL entry lets the VMM's uid create in it
    (its sockets), but, checked as that uid for real, it can neither rename nor remove the node's
    vm.json or disk, so nothing it plants there is ever taken for bcd's record."""
    import subprocess

    from testsupport import require_tool

    h, runtime, sec = rt
    out = converge(sec, spec(chvm("st1"), generation=40))
    assert out.state is SectionState.CONVERGED, out.message
    d = h.root / CHD.lstrip("/") / "instances/st1"
    assert d.stat().st_mode & 0o1000  # sticky
    uid = parse_record((d / "vm.json").read_bytes()).uid
    code = (
        "import os, sys\nd = sys.argv[1]\nout = []\n"
        "open(os.path.join(d, 'made'), 'xb').close(); out.append('created')\n"
        "for op in (lambda: os.rename(os.path.join(d, 'vm.json'), os.path.join(d, 'x')),\n"
        "           lambda: os.unlink(os.path.join(d, 'disk.qcow2'))):\n"
        "    try:\n        op(); out.append('done')\n"
        "    except OSError as e:\n        out.append(type(e).__name__)\n"
        "print(' '.join(out))"
    )
    setpriv = require_tool("setpriv")
    argv = [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "/usr/bin/python3",
        "-c",
        code,
        str(d),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert result.stdout.split() == ["created", "PermissionError", "PermissionError"], result.stderr
    (d / "made").unlink()
    runtime.delete("st1")
