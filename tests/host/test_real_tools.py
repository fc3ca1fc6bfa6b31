"""What bcd writes, checked by the real tools (../shared/notes/real-host-testing.md).

- sysctl drop-ins applied with `sysctl -p` inside `unshare -n` (net.* keys only: others are global);
- modprobe.d drop-ins parsed by libkmod (`modprobe -d DIR -S 6.1.0-fake -C FILE -c`);
- the systemd units bcd generates pass `systemd-analyze verify --man=no` with empty stderr
  (bcd-mps.service under `--root` with stub programs, since nvidia-smi is not installed here);
- the containerd drop-in and config parse as TOML, the JoinConfiguration as YAML.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from bcd_shared.units import REGISTRY
from bcd_shared.units.hugepages import mount_unit_text
from bcd_shared.units.k8s import containerd_config, containerd_dropin, join_configuration
from bcd_shared.units.kmod import options_file
from bcd_shared.units.sharing import service_text
from bcd_shared.units.sysctl import dropin
from testsupport import require_tool

pytestmark = pytest.mark.realhost


def test_HST_SYS_07_drop_in_applies_with_sysctl_p_in_a_network_namespace(tmp_path: Path) -> None:
    require_tool("unshare")
    sysctl = require_tool("sysctl")
    s = REGISTRY["sysctl"].decode_settings(
        json.dumps(
            {
                "net.ipv4.ip_forward": True,
                "net.core.somaxconn": 1024,
                "net.ipv4.tcp_rmem": "4096  87380\t6291456",
            }
        )
    )
    f = tmp_path / "90-bcd.conf"
    f.write_bytes(dropin(s) or b"")
    res = subprocess.run(["unshare", "-n", sysctl, "-p", str(f)], capture_output=True, text=True, check=False)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "net.ipv4.tcp_rmem = 4096 87380 6291456" in res.stdout
    # The oracle refuses what it should: an unknown key is an error.
    f.write_text("net.ipv4.no_such_key = 1\n")
    bad = subprocess.run(["unshare", "-n", sysctl, "-p", str(f)], capture_output=True, text=True, check=False)
    assert bad.returncode != 0


def test_HST_MOD_09_modprobe_d_drop_in_parses_with_libkmod(tmp_path: Path) -> None:
    modprobe = require_tool("modprobe")
    s = REGISTRY["kernel-modules"].decode_settings(
        json.dumps(
            {
                "load": ["vfio-pci"],
                "options": {"vfio-pci": "ids=10de:2330,10de:2331", "kvm_intel": "nested=1 ept=Y"},
            }
        )
    )
    conf = tmp_path / "bcd.conf"
    conf.write_bytes(options_file(s) or b"")
    (tmp_path / "d/lib/modules/6.1.0-fake").mkdir(parents=True)
    res = subprocess.run(
        [modprobe, "-d", str(tmp_path / "d"), "-S", "6.1.0-fake", "-C", str(conf), "-c"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "options vfio_pci ids=10de:2330,10de:2331" in res.stdout.splitlines()
    assert "options kvm_intel nested=1 ept=Y" in res.stdout.splitlines()


def test_HST_HP_23_mount_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    unit = tmp_path / "dev-hugepages1G.mount"
    unit.write_bytes(mount_unit_text())
    res = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False
    )
    assert res.stderr == "", res.stderr


def test_HST_SHARE_04_mps_service_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "lib/systemd").mkdir(parents=True)
    shutil.copytree("/lib/systemd/system", root / "lib/systemd/system", symlinks=True)
    for prog in ("usr/bin/nvidia-smi", "usr/bin/nvidia-cuda-mps-control"):
        (root / prog).parent.mkdir(parents=True, exist_ok=True)
        (root / prog).write_text("#!/bin/sh\n")
        (root / prog).chmod(0o755)
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy("/bin/sh", root / "bin/sh")
    (root / "etc/systemd/system/bcd-mps.service").write_bytes(service_text(10))
    res = subprocess.run(
        [analyze, "verify", "--man=no", f"--root={root}", "/etc/systemd/system/bcd-mps.service"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr


@pytest.mark.parametrize("version", [2, 3])
def test_HST_K8S_26_28_29_30_containerd_files_parse_as_toml(version: int) -> None:
    doc = tomllib.loads(containerd_dropin(version).decode())
    assert doc["version"] == version
    cri = doc["plugins"]["io.containerd.cri.v1.runtime" if version == 3 else "io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True and cri["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    fresh = containerd_config(None, version) or ""
    assert tomllib.loads(fresh)["imports"] == ["/etc/containerd/conf.d/*.toml"]
    added = (
        containerd_config('version = 2\n\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "x"\n', 2)
        or ""
    )
    assert tomllib.loads(added)["imports"] == ["/etc/containerd/conf.d/*.toml"]


@pytest.mark.parametrize(
    ("kubeadm", "api"), [((1, 30), "kubeadm.k8s.io/v1beta3"), ((1, 31), "kubeadm.k8s.io/v1beta4")]
)
def test_HST_K8S_33_34_join_configuration_parses_as_yaml(kubeadm: tuple[int, int], api: str) -> None:
    s = REGISTRY["k8s-join"].decode_settings(
        json.dumps(
            {
                "server": "https://k8s.example.com",
                "caCertSha256": "sha256:" + "ab" * 32,
                "tokenRef": "secret://x",
                "nodeLabels": {"team": "ml", "bcd.dev/pool": "gpu-a"},
                "taints": ["gpu=true:NoSchedule", "spot:PreferNoSchedule"],
            }
        )
    )
    doc = yaml.safe_load(join_configuration(s, "gpu-node-01", "abcdef.0123456789abcdef", kubeadm))
    assert doc["apiVersion"] == api and doc["kind"] == "JoinConfiguration"
    bt = doc["discovery"]["bootstrapToken"]
    assert bt == {
        "apiServerEndpoint": "k8s.example.com:443",
        "token": "abcdef.0123456789abcdef",
        "caCertHashes": ["sha256:" + "ab" * 32],
    }
    reg = doc["nodeRegistration"]
    assert reg["name"] == "gpu-node-01" and reg["criSocket"] == "unix:///run/containerd/containerd.sock"
    assert reg["taints"] == [
        {"key": "gpu", "value": "true", "effect": "NoSchedule"},
        {"key": "spot", "effect": "PreferNoSchedule"},
    ]
    labels = "bcd.dev/pool=gpu-a,team=ml"
    if kubeadm >= (1, 31):
        assert reg["kubeletExtraArgs"] == [{"name": "node-labels", "value": labels}]
    else:
        assert reg["kubeletExtraArgs"] == {"node-labels": labels}
