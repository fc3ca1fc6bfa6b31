"""The cloud-hypervisor VMM's confined unit (bcd_shared.chunit): the seed's property table, checked
value by value, and the generated unit run through the real `systemd-analyze verify` (empty stderr)
and `systemd-analyze security --offline=true` (exposure at most 1.5)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from bcd_shared.chunit import (
    FIRMWARE,
    SLICE,
    VMM_UID_BASE,
    VMM_UID_COUNT,
    CHLaunch,
    account_add_argv,
    account_del_argv,
    memory_max,
    properties,
    run_argv,
    unit_file,
    unit_name,
    vmm_user_name,
)
from testsupport import require_tool, systemd_root, systemd_verify

GIB = 1 << 30
MIB = 1 << 20
DATA = "/var/lib/bcd"
BASE = f"{DATA}/cloud-hypervisor/images/{'a' * 64}.qcow2"
EXPOSURE_TARGET = 1.5


VOL = f"{DATA}/volumes/a.raw"
# The helper's unit: the base image and a volume bound from root's links (round 11).
HELPER_LINKS: dict[str, object] = {
    "under_helper": True,
    "volumes_rw": (VOL,),
    "bind_sources": ((BASE, f"{DATA}-ch-binds/vm-1/image"), (VOL, f"{DATA}-ch-binds/vm-1/vol-a.raw")),
}


def launch(**kw: object) -> CHLaunch:
    args: dict[str, object] = {
        "instance_id": "vm-1",
        "uid": VMM_UID_BASE + 7,
        "data_dir": DATA,
        "binary": "/usr/bin/cloud-hypervisor",
        "vcpus": 2,
        "memory_bytes": 4 * GIB,
        "base_image": BASE,
    }
    args.update(kw)
    return CHLaunch(**args)  # type: ignore[arg-type]


def props(spec: CHLaunch) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in properties(spec):
        out.setdefault(k, []).append(v)
    return out


def test_unit_name_and_slice_dlv_chu_01_dlv_chu_03_dlv_ch_01() -> None:
    """DLV-CHU-01, DLV-CHU-03, DLV-CH-01: bcd-ch-<id>.service in bcd-instances.slice, --collect."""
    spec = launch()
    argv = run_argv(spec)
    assert argv[:4] == ["systemd-run", "--unit=bcd-ch-vm-1.service", "--collect", f"--slice={SLICE}"]
    assert SLICE == "bcd-instances.slice"
    assert argv[argv.index("--") + 1 :] == [
        "/usr/bin/cloud-hypervisor",
        "--api-socket",
        f"path={DATA}/cloud-hypervisor/instances/vm-1/api.sock",
    ]
    for bad in ("x.slice/../y", "a/b", "..", "", "-x", "a" * 65, "x y"):
        with pytest.raises(ValueError):
            unit_name(bad)
    assert unit_name("foo.socket") == "bcd-ch-foo.socket.service"  # always ends in .service
    assert FIRMWARE == "/usr/share/cloud-hypervisor/CLOUDHV.fd"


def test_identity_and_privileges_dlv_chu_11_dlv_chu_12_dlv_chu_13_dlv_chu_14() -> None:
    """DLV-CHU-11..14, DLV-CHH-03: User/Group the uid, no capabilities, UMask 0077 (0007 helper)."""
    p = props(launch())
    uid = str(VMM_UID_BASE + 7)
    assert p["User"] == [uid] and p["Group"] == [uid]
    assert p["CapabilityBoundingSet"] == [""] and p["AmbientCapabilities"] == [""]
    assert p["NoNewPrivileges"] == ["yes"] and p["LimitMEMLOCK"] == ["infinity"]
    assert p["UMask"] == ["0077"]
    assert props(launch(under_helper=True))["UMask"] == ["0007"]


def test_uid_range_dlv_chu_02() -> None:
    """DLV-CHU-02: VMM uids from 0x7FFD0000 up; anything outside is refused."""
    assert VMM_UID_BASE == 0x7FFD0000
    assert vmm_user_name(VMM_UID_BASE) == "bcd-vmm-0"
    for uid in (0, 1000, VMM_UID_BASE - 1, VMM_UID_BASE + VMM_UID_COUNT):
        with pytest.raises(ValueError):
            properties(launch(uid=uid))
        with pytest.raises(ValueError):
            vmm_user_name(uid)
    properties(launch(uid=VMM_UID_BASE + VMM_UID_COUNT - 1))


def test_devices_dlv_chu_15_dlv_chu_16() -> None:
    """DLV-CHU-15, DLV-CHU-16."""
    assert props(launch())["DevicePolicy"] == ["closed"]
    assert props(launch())["DeviceAllow"] == ["/dev/kvm rw"]
    assert props(launch(vfio=True))["DeviceAllow"] == ["/dev/kvm rw", "/dev/vfio/vfio rw", "char-vfio rw"]


def test_files_dlv_chu_17_to_22() -> None:
    """DLV-CHU-17..22: protect, tmpfs over /run and /var (and bcd's dirs outside /var), the secrets
    inaccessible, only the instance's directory read-write and its base image read-only."""
    p = props(launch(volumes_rw=("/srv/vol/a.raw",), volumes_ro=("/srv/vol/b.raw",)))
    assert p["ProtectSystem"] == ["strict"] and p["ProtectHome"] == ["yes"]
    assert p["PrivateTmp"] == ["yes"] and p["ProtectProc"] == ["invisible"]
    assert p["TemporaryFileSystem"] == ["/run:ro", "/var:ro"]
    assert p["InaccessiblePaths"] == [
        "-/etc/bcd",
        "-/etc/ssh",
        "-/etc/libvirt",
        "-/etc/shadow",
        "-/etc/gshadow",
    ]
    inst = f"{DATA}/cloud-hypervisor/instances/vm-1"
    assert p["BindPaths"] == [inst, "/srv/vol/a.raw"]
    assert p["ReadWritePaths"] == [inst, "/srv/vol/a.raw"]
    assert p["BindReadOnlyPaths"] == [BASE, "/srv/vol/b.raw"]
    linked = props(launch(**HELPER_LINKS))  # the helper's: SRC (root's link) : DEST (where the VMM looks)
    assert linked["BindReadOnlyPaths"] == [f"{DATA}-ch-binds/vm-1/image:{BASE}"]
    assert linked["BindPaths"] == [
        f"{DATA}/cloud-hypervisor/instances/vm-1",
        f"{DATA}-ch-binds/vm-1/vol-a.raw:{VOL}",
    ]
    assert linked["ReadWritePaths"] == [f"{DATA}/cloud-hypervisor/instances/vm-1", VOL]
    with pytest.raises(ValueError):  # a ':' would split the value differently
        properties(launch(bind_sources=((BASE, "/x:y"),)))
    outside = props(launch(data_dir="/srv/bcd"))
    assert outside["TemporaryFileSystem"] == [
        "/run:ro",
        "/var:ro",
        "/srv/bcd:ro",  # every bind's destination on the unit's tmpfs (round 11)
        "/srv/bcd/cloud-hypervisor/instances:ro",
        "/srv/bcd/cloud-hypervisor/images:ro",
    ]


def test_kernel_system_network_dlv_chu_23_dlv_chu_24_dlv_chu_25() -> None:
    """DLV-CHU-23, DLV-CHU-24, DLV-CHU-25."""
    p = props(launch())
    for key in (
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectClock",
        "ProtectHostname",
        "RestrictSUIDSGID",
        "RestrictRealtime",
        "RestrictNamespaces",
        "LockPersonality",
    ):
        assert p[key] == ["yes"], key
    assert p["SystemCallFilter"] == [
        "~@debug @mount @reboot @swap @module @raw-io @clock @cpu-emulation @obsolete"
    ]
    assert p["PrivateNetwork"] == ["yes"]
    assert p["RestrictAddressFamilies"] == ["AF_UNIX"] and p["IPAddressDeny"] == ["any"]


def test_limits_dlv_chu_26_dlv_chu_27_dlv_chu_28_dlv_chu_29() -> None:
    """DLV-CHU-26..29, DLV-PLC-14, DLV-PLC-15: MemoryMax memory + memory/32 + 256 MiB (the overhead
    only with huge pages, the whole again after a memory restore dropped them), TasksMax, CPUQuota;
    the placement's AllowedCPUs and AllowedMemoryNodes."""
    p = props(launch(vcpus=3, memory_bytes=4 * GIB))
    assert p["MemoryMax"] == [str(4 * GIB + 128 * MIB + 256 * MIB)]
    assert p["TasksMax"] == [str(4 * 3 + 128)] and p["CPUQuota"] == ["400%"]
    assert memory_max(launch(memory_bytes=4 * GIB, hugepages=True)) == 128 * MIB + 256 * MIB
    assert (
        memory_max(launch(memory_bytes=4 * GIB, hugepages=True, restored_memory=True)) == 4 * GIB + 384 * MIB
    )
    placed = props(launch(cpus="2-3", mems="0"))
    assert placed["AllowedCPUs"] == ["2-3"] and placed["AllowedMemoryNodes"] == ["0"]
    assert "AllowedCPUs" not in p


def test_accounts_argv() -> None:
    uid = VMM_UID_BASE + 5
    add = account_add_argv(uid)
    assert add[0] == ["groupadd", "--gid", str(uid), "bcd-vmm-5"]
    assert add[1][0] == "useradd" and add[1][-1] == "bcd-vmm-5"
    assert "--no-create-home" in add[1] and add[1][add[1].index("--shell") + 1] == "/usr/sbin/nologin"
    assert account_del_argv(uid) == [["userdel", "bcd-vmm-5"], ["groupdel", "bcd-vmm-5"]]


def _scratch(tmp_path: Path, spec: CHLaunch) -> Path:
    root = systemd_root(tmp_path, (spec.binary,))
    (root / "etc/systemd/system" / spec.unit).write_text(unit_file(spec))
    return root


@pytest.mark.realhost
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"vfio": True, "under_helper": True},
        {"data_dir": "/srv/bcd", "base_image": None},
        {"cpus": "0", "mems": "0"},
        HELPER_LINKS,
    ],
)
def test_the_generated_unit_passes_systemd_analyze_verify_dlv_chu_30(
    tmp_path: Path, kw: dict[str, object]
) -> None:
    """DLV-CHU-30: the whole generated unit, through the real systemd (verify: empty stderr)."""
    spec = launch(**kw)
    result = systemd_verify(_scratch(tmp_path, spec), spec.unit)
    assert result.stderr == "" and result.returncode == 0


@pytest.mark.realhost
def test_verify_is_live(tmp_path: Path) -> None:
    """The check above is real: a unit with a property systemd does not know fails it."""
    spec = launch()
    root = _scratch(tmp_path, spec)
    path = root / "etc/systemd/system" / spec.unit
    path.write_text(path.read_text().replace("LockPersonality=yes", "LockPersonalty=yes"))
    assert "LockPersonalty" in systemd_verify(root, spec.unit).stderr


@pytest.mark.realhost
@pytest.mark.parametrize("kw", [{}, {"vfio": True, "under_helper": True}, HELPER_LINKS])
def test_exposure_within_target_dlv_chu_30(tmp_path: Path, kw: dict[str, object]) -> None:
    """DLV-CHU-30: `systemd-analyze security --offline=true` scores the unit at most 1.5."""
    tool = require_tool("systemd-analyze")
    spec = launch(**kw)
    root = _scratch(tmp_path, spec)
    result = subprocess.run(
        [tool, "security", "--offline=true", "--no-pager", str(root / "etc/systemd/system" / spec.unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(rf"Overall exposure level for {re.escape(spec.unit)}: (\d+\.\d+)", result.stdout)
    assert m is not None, result.stdout[-2000:] + result.stderr
    assert float(m.group(1)) <= EXPOSURE_TARGET
