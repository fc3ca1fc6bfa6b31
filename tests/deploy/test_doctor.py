"""`bcd doctor`: each check's ok / warn / fail on a scratch host, human and --json output."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_agent.doctor import CLOCK_FLOOR, Finding, HostView, check_all, render
from bcd_agent.session import identity as ident
from testsupport import node_identity


def by_check(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.check, []).append(f)
    return out


def levels(findings: list[Finding], check: str) -> list[str]:
    return [f.level for f in by_check(findings).get(check, [])]


@pytest.fixture
def host(tmp_path: Path) -> HostView:
    """The scratch directory stands for /: every path doctor reads is a host path under it."""
    (tmp_path / "etc").mkdir(parents=True)
    return HostView(root=tmp_path, euid=990, which=lambda name: None, wall_clock=lambda: 1_800_000_000.0)


def write_config(tmp_path: Path, text: str = "", data_dir: Path | None = None) -> str:
    """tmp_path/config.toml, returned as its host path /config.toml; data_dir /data by default."""
    data = "/" + str((data_dir or (tmp_path / "data")).relative_to(tmp_path))
    path = tmp_path / "config.toml"
    path.write_text(f'data_dir = "{data}"\n{text}')
    return "/config.toml"


def write_identity(data: Path, *, not_after: float, address: str = "") -> None:
    """A real identity.json whose node certificate ends at `not_after` (0600, as bcd join writes it)."""
    end = dt.datetime.fromtimestamp(not_after, dt.UTC)
    ident.save(data, node_identity("node-doctor", end - dt.timedelta(days=365), end, address=address))


def make_data_dir(tmp_path: Path, mode: int = 0o700) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(mode)
    return data


def test_a_healthy_unprivileged_host_without_gpus(tmp_path: Path, host: HostView) -> None:
    data = make_data_dir(tmp_path)
    write_identity(data, not_after=1_800_000_000.0 + 90 * 86400)
    (data / "journal.db").write_bytes(b"")
    (data / "journal.db").chmod(0o600)
    findings = check_all(write_config(tmp_path), host)
    assert levels(findings, "config") == ["ok"]
    assert levels(findings, "data-dir") == ["ok"]
    assert levels(findings, "data-files") == ["ok", "ok"]
    assert levels(findings, "identity") == ["ok"]
    assert levels(findings, "helper") == ["ok"]
    assert levels(findings, "clock") == ["ok"]
    assert "gpu-binding" not in by_check(findings)
    assert not [f for f in findings if f.level == "fail"]


def test_a_refused_config_fails_naming_the_key(tmp_path: Path, host: HostView) -> None:
    path = write_config(tmp_path, "[journal]\nmax_events = 20000\n")
    [config] = by_check(check_all(path, host))["config"]
    assert config.level == "fail"
    assert "[journal] max_events" in config.message and "never raise" in config.message
    assert "docs/config.md" in config.fix


def test_data_dir_and_file_modes(tmp_path: Path, host: HostView) -> None:
    data = make_data_dir(tmp_path, 0o755)
    (data / "journal.db").write_bytes(b"")
    (data / "journal.db").chmod(0o644)
    findings = check_all(write_config(tmp_path), host)
    [d] = by_check(findings)["data-dir"]
    assert d.level == "fail" and "0755" in d.message and "chmod 0700" in d.fix
    [j] = by_check(findings)["data-files"]
    assert j.level == "fail" and "journal.db is mode 0644" in j.message and j.fix.startswith("chmod 0600")
    [i] = by_check(findings)["identity"]
    assert i.level == "warn" and "bcd join" in i.fix
    missing = check_all(write_config(tmp_path, data_dir=tmp_path / "nope"), host)
    assert levels(missing, "data-dir") == ["fail"]


@pytest.fixture
def helper_socket(tmp_path: Path) -> Iterator[str]:
    """A socket that accepts (and never answers) at tmp_path/helper.sock: host path /helper.sock."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(tmp_path / "helper.sock"))
        server.listen(1)
        yield "/helper.sock"


def test_helper_socket_reachable_or_not(tmp_path: Path, host: HostView, helper_socket: str) -> None:
    make_data_dir(tmp_path)
    ok = check_all(write_config(tmp_path, f'[helper]\nsocket = "{helper_socket}"\n'), host)
    assert levels(ok, "helper") == ["ok"]
    dead = check_all(write_config(tmp_path, '[helper]\nsocket = "/gone.sock"\n'), host)
    [h] = by_check(dead)["helper"]
    assert h.level == "fail" and "nothing accepts" in h.message and "bcd-helper" in h.fix


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to root needs root")
def test_config_owner_under_the_helper(tmp_path: Path, host: HostView) -> None:
    """HST-HLP-29/30 as doctor sees them: root:bcd 0640 is fine; group-writable is not."""
    make_data_dir(tmp_path)
    path = write_config(tmp_path, '[helper]\nsocket = "/h.sock"\n')
    os.chown(tmp_path / "config.toml", 0, 990)
    os.chmod(tmp_path / "config.toml", 0o640)
    assert levels(check_all(path, host), "config-owner") == ["ok"]
    os.chmod(tmp_path / "config.toml", 0o660)
    [c] = by_check(check_all(path, host))["config-owner"]
    assert c.level == "fail" and "must be a regular file root owns that no one else can write" in c.message


def test_DEV_UNPRIV_05_gpu_binding_warns_on_an_unprivileged_gpu_host_without_helper(
    tmp_path: Path, host: HostView, helper_socket: str
) -> None:
    make_data_dir(tmp_path)  # owned by the test's uid: what matters is the node's uid, not 0 here
    gpus = host.root / "proc/driver/nvidia/gpus/0000:17:00.0"
    gpus.mkdir(parents=True)
    unprivileged = HostView(root=host.root, euid=990, which=host.which, wall_clock=host.wall_clock)
    data_owner = (tmp_path / "data").stat().st_uid
    findings = check_all(write_config(tmp_path), unprivileged)
    if data_owner == 0:
        assert "gpu-binding" not in by_check(findings)  # a node running as root binds holds itself
        os.chown(tmp_path / "data", 990, 990)
        findings = check_all(write_config(tmp_path), unprivileged)
    [g] = by_check(findings)["gpu-binding"]
    assert g.level == "warn" and "without root and without [helper]" in g.message
    assert "bcd helper" in g.fix
    under_helper = check_all(write_config(tmp_path, f'[helper]\nsocket = "{helper_socket}"\n'), unprivileged)
    assert "gpu-binding" not in by_check(under_helper)
    gpus.rmdir()  # the same unprivileged node on a host without GPUs: nothing to warn about
    assert "gpu-binding" not in by_check(check_all(write_config(tmp_path), unprivileged))


def test_vm_runtime_and_instance_bridges(tmp_path: Path, host: HostView, helper_socket: str) -> None:
    """DLV-RT-11 and DLV-CHH-24."""
    make_data_dir(tmp_path)
    [v] = by_check(check_all(write_config(tmp_path), host))["vm-runtime"]
    assert (v.level, v.message) == (
        "warn",
        "neither virsh nor cloud-hypervisor: this host runs no VPS instances",
    )
    with_virsh = HostView(
        root=host.root, euid=990, which=lambda n: "/usr/bin/virsh" if n == "virsh" else None
    )
    cfg = write_config(tmp_path, f'[helper]\nsocket = "{helper_socket}"\n')
    findings = check_all(cfg, with_virsh)
    assert levels(findings, "vm-runtime") == ["ok"]
    [b] = by_check(findings)["instance-bridges"]
    assert b.level == "warn" and "refuses every instance tap" in b.message
    cfg = write_config(tmp_path, f'[helper]\nsocket = "{helper_socket}"\ninstance_bridges = "br0"\n')
    assert "instance-bridges" not in by_check(check_all(cfg, with_virsh))


def test_HST_HLP_32_libvirt_group_fails_under_the_helper(
    tmp_path: Path, host: HostView, helper_socket: str
) -> None:
    make_data_dir(tmp_path)
    (host.root / "etc/group").write_text("kvm:x:104:\nlibvirt:x:120:qemu,bcd\n")
    cfg = write_config(tmp_path, f'[helper]\nsocket = "{helper_socket}"\n')
    [g] = by_check(check_all(cfg, host))["libvirt-group"]
    assert g.level == "fail" and "root-equivalent libvirt group" in g.message
    (host.root / "etc/group").write_text("libvirt:x:120:qemu\n")
    assert levels(check_all(cfg, host), "libvirt-group") == ["ok"]


def test_libvirt_qemu_warns_until_install_sh_set_it_up_dlv_hlp_13(
    tmp_path: Path, host: HostView, helper_socket: str
) -> None:
    """DLV-HLP-13: under the helper, qemu.conf's dynamic_ownership (the last active line; 1 when
    commented out, libvirt's default) and QEMU's user in the node's group; nothing without the helper
    or without libvirt."""
    make_data_dir(tmp_path)
    cfg = write_config(tmp_path, f'[helper]\nsocket = "{helper_socket}"\n')
    assert "libvirt-qemu" not in by_check(check_all(cfg, host))  # no libvirt here
    (host.root / "etc/libvirt").mkdir(parents=True)
    conf = host.root / "etc/libvirt/qemu.conf"
    conf.write_text('#user = "libvirt-qemu"\n#dynamic_ownership = 1\n')
    (host.root / "etc/passwd").write_text(
        "libvirt-qemu:x:64055:107::/:/usr/sbin/nologin\nbcd:x:990:990::/:/x\n"
    )
    (host.root / "etc/group").write_text("bcd:x:990:\n")
    [f] = by_check(check_all(cfg, host))["libvirt-qemu"]
    assert f.level == "warn"
    assert (
        "dynamic_ownership = 1 (the default)" in f.message and "libvirt-qemu is not in group bcd" in f.message
    )
    conf.write_text("dynamic_ownership = 0\ndynamic_ownership = 1 # the last one counts\n")
    (host.root / "etc/group").write_text("bcd:x:990:libvirt-qemu\n")
    [f] = by_check(check_all(cfg, host))["libvirt-qemu"]
    assert f.level == "warn" and f.message.startswith("qemu.conf has dynamic_ownership = 1:")
    conf.write_text('user = "vmm"\ndynamic_ownership = 0\n')
    [f] = by_check(check_all(cfg, host))["libvirt-qemu"]
    assert f.level == "warn" and "QEMU's user vmm is not in group bcd" in f.message
    (host.root / "etc/group").write_text("bcd:x:990:libvirt-qemu,vmm\n")
    [f] = by_check(check_all(cfg, host))["libvirt-qemu"]
    assert (f.level, f.message) == ("ok", "dynamic_ownership = 0, QEMU's user vmm in group bcd")
    assert "libvirt-qemu" not in by_check(check_all(write_config(tmp_path), host))  # no helper


def test_HST_K8S_60_a_joined_kubernetes_node_needs_allowed_clusters(tmp_path: Path, host: HostView) -> None:
    make_data_dir(tmp_path)
    assert "kubernetes" not in by_check(check_all(write_config(tmp_path), host))
    (host.root / "etc/kubernetes").mkdir()
    (host.root / "etc/kubernetes/kubelet.conf").write_text("apiVersion: v1\n")
    assert levels(check_all(write_config(tmp_path), host), "kubernetes") == ["fail"]
    pin = "a" * 64
    cfg = write_config(tmp_path, f'[kubernetes]\nallowed_clusters = "https://10.0.0.1:6443#sha256:{pin}"\n')
    assert levels(check_all(cfg, host), "kubernetes") == ["ok"]


def test_HST_IOMMU_12_active_iommu_without_vfio_pci(tmp_path: Path, host: HostView) -> None:
    make_data_dir(tmp_path)
    (host.root / "sys/class/iommu/dmar0").mkdir(parents=True)
    [i] = by_check(check_all(write_config(tmp_path), host))["iommu"]
    assert i.level == "warn" and "vfio-pci" in i.message
    (host.root / "sys/bus/pci/drivers/vfio-pci").mkdir(parents=True)
    assert levels(check_all(write_config(tmp_path), host), "iommu") == ["ok"]


def test_an_unset_clock_fails(tmp_path: Path, host: HostView) -> None:
    make_data_dir(tmp_path)
    unset = HostView(root=host.root, euid=990, which=host.which, wall_clock=lambda: 0.0)
    [c] = by_check(check_all(write_config(tmp_path), unset))["clock"]
    assert c.level == "fail" and "1970-01-01" in c.message
    assert CLOCK_FLOOR > 0


def test_render_shows_the_fix_of_what_is_not_ok() -> None:
    text = render(
        [Finding("clock", "ok", "fine", "never shown"), Finding("helper", "fail", "down", "start it")]
    )
    assert "never shown" not in text
    assert "fail  helper" in text and "fix: start it" in text


def test_bcd_doctor_json_and_exit_status(tmp_path: Path) -> None:
    data = make_data_dir(tmp_path)
    cfg = write_config(tmp_path, data_dir=data)
    out = subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", "doctor", "--config", cfg, "--root", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(out.stdout)
    assert report["ok"] is True and out.returncode == 0
    assert {"check", "level", "message", "fix"} <= set(report["findings"][0])
    (tmp_path / "config.toml").write_text("bogus = 1\n")
    out = subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", "doctor", "--config", cfg, "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "fail  config" in out.stdout and "bogus" in out.stdout


@pytest.mark.parametrize(
    ("mode", "level"), [(0o701, "ok"), (0o710, "ok"), (0o711, "ok"), (0o705, "fail"), (0o750, "fail")]
)
def test_data_dir_may_carry_the_search_bit_for_qemu_dlv_qfa_03(
    tmp_path: Path, host: HostView, mode: int, level: str
) -> None:
    """DLV-QFA-01, DLV-QFA-03: libvirt-kvm adds search (x) for QEMU's user; reading stays closed."""
    make_data_dir(tmp_path, mode)
    [d] = by_check(check_all(write_config(tmp_path), host))["data-dir"]
    assert d.level == level, d
