"""`bcd doctor`: checks of this host's bcd setup, each ok / warn / fail with its fix.

The checks that apply so far (docs/deploy.md, docs/config.md; the seeds' doctor findings):

- config: config.toml missing or refused by the strict parser (fail).
- config-owner: under the helper, the file is not a regular root-owned file that no one else can
  write (fail; HST-HLP-24..30).
- data-dir / data-files: data_dir missing or not 0700; journal.db or identity.json not 0600 (fail).
- identity: identity.json missing, not joined yet (warn).
- helper: [helper] socket set but nothing accepts on it (fail).
- gpu-binding: a host with GPUs whose node would run unprivileged without [helper] (warn;
  DEV-UNPRIV-05).
- vm-runtime: neither virsh nor cloud-hypervisor (warn; DLV-RT-11).
- instance-bridges: under the helper with a VM runtime and no [helper] instance_bridges (warn;
  DLV-CHH-24).
- libvirt-group: under the helper, the node's account is in the root-equivalent libvirt group
  (fail; HST-HLP-32).
- kubernetes: a joined Kubernetes node without [kubernetes] allowed_clusters (fail; HST-K8S-60).
- iommu: an active IOMMU without the vfio-pci driver (warn; HST-IOMMU-12).
- clock: the wall clock is before 2024, an unset RTC: certificates and signed intent cannot verify
  (fail).

Host paths (/proc, /sys, /dev, /etc) are read under `--root` (a simulated host); data_dir and the
config are real paths. Exit status: 1 when any check fails, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from attrs import asdict, frozen

from bcd_agent.config import Config, ConfigError, add_config_argument, default_config_path, load_config

Level = Literal["ok", "warn", "fail"]
# 2024-01-01T00:00:00Z: a clock before this was never set (an RTC reset reads 1970 or 2000).
CLOCK_FLOOR = 1_704_067_200


@frozen
class Finding:
    check: str
    level: Level
    message: str
    fix: str = ""


@frozen
class HostView:
    """What doctor reads of the host; tests give a scratch root and fakes."""

    root: Path = Path("/")
    euid: int = 0
    which: Callable[[str], str | None] = shutil.which
    wall_clock: Callable[[], float] = time.time

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")


def check_all(config_path: str, host: HostView) -> list[Finding]:
    findings: list[Finding] = []
    config = _check_config(config_path, findings)
    if config.under_helper:
        findings.append(_check_config_owner(config_path))
    findings.extend(_check_data_dir(config))
    findings.append(_check_helper(config))
    findings.extend(_check_gpu_binding(config, host))
    findings.extend(_check_vm_runtime(config, host))
    findings.extend(_check_libvirt_group(config, host))
    findings.extend(_check_kubernetes(config, host))
    findings.extend(_check_iommu(host))
    findings.append(_check_clock(host))
    return findings


def _check_config(path: str, findings: list[Finding]) -> Config:
    try:
        config = load_config(path)
    except ConfigError as e:
        findings.append(
            Finding(
                "config",
                "fail",
                str(e),
                "write the file with deploy/install.sh, or correct the key as docs/config.md says; "
                "the other checks use the defaults meanwhile",
            )
        )
        return Config(source=f"{path} (refused: defaults)")
    findings.append(Finding("config", "ok", f"{path} parses"))
    return config


def _check_config_owner(path: str) -> Finding:
    rule = f"{path} must be a regular file root owns that no one else can write"
    fix = f"chown root:bcd {path} && chmod 0640 {path} (or run deploy/install.sh again)"
    try:
        st = os.lstat(path)
    except OSError as e:
        return Finding("config-owner", "fail", f"{rule}: {e.strerror}", fix)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return Finding("config-owner", "fail", f"{rule} (the helper refuses to start)", fix)
    return Finding("config-owner", "ok", f"{path} is root's: owner root, mode {stat.S_IMODE(st.st_mode):04o}")


def _check_data_dir(config: Config) -> list[Finding]:
    data_dir = Path(config.data_dir)
    fix = f"chmod 0700 {data_dir} (owned by the node's account; deploy/install.sh makes it)"
    try:
        st = data_dir.stat()
    except FileNotFoundError:
        return [Finding("data-dir", "fail", f"{data_dir} does not exist", f"run deploy/install.sh, or {fix}")]
    except OSError as e:
        return [Finding("data-dir", "fail", f"{data_dir}: {e.strerror}", fix)]
    if not stat.S_ISDIR(st.st_mode):
        return [Finding("data-dir", "fail", f"{data_dir} is not a directory", fix)]
    findings = []
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        findings.append(Finding("data-dir", "fail", f"{data_dir} is mode {mode:04o}, not 0700", fix))
    else:
        findings.append(Finding("data-dir", "ok", f"{data_dir} is 0700, owned by uid {st.st_uid}"))
    for name in ("journal.db", "identity.json"):
        p = data_dir / name
        try:
            fmode = stat.S_IMODE(p.lstat().st_mode)
        except FileNotFoundError:
            continue
        except OSError as e:
            findings.append(Finding("data-files", "fail", f"{p}: {e.strerror}", f"check {data_dir}'s owner"))
            continue
        if fmode & 0o077:
            findings.append(
                Finding("data-files", "fail", f"{p} is mode {fmode:04o}, not 0600", f"chmod 0600 {p}")
            )
        else:
            findings.append(Finding("data-files", "ok", f"{p} is 0600"))
    if config.identity_path.exists():
        findings.append(Finding("identity", "ok", f"joined: {config.identity_path} is there"))
    else:
        findings.append(
            Finding(
                "identity",
                "warn",
                f"not joined: {config.identity_path} does not exist",
                "run `bcd join --token TOKEN` (as root on a node with [helper], so that root keeps "
                "the join record)",
            )
        )
    return findings


def _check_helper(config: Config) -> Finding:
    path = config.helper.socket
    if path is None:
        return Finding("helper", "ok", "no [helper] socket: the node acts itself (as root) or takes no holds")
    fix = f"start the helper (systemctl start bcd-helper), or correct [helper] socket ({path})"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(path)
        except OSError as e:
            return Finding("helper", "fail", f"nothing accepts on {path}: {e.strerror or e}", fix)
    return Finding("helper", "ok", f"the helper accepts on {path}")


def _node_uid(config: Config, host: HostView) -> int:
    """The uid the node runs as: the owner of data_dir, else whoever runs doctor."""
    try:
        return Path(config.data_dir).stat().st_uid
    except OSError:
        return host.euid


def _has_gpus(host: HostView) -> bool:
    gpus = host.path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or host.path("/dev/nvidia0").exists()


def _check_gpu_binding(config: Config, host: HostView) -> list[Finding]:
    if not _has_gpus(host) or config.under_helper or _node_uid(config, host) == 0:
        return []
    return [
        Finding(
            "gpu-binding",
            "warn",
            "bcd node runs without root and without [helper]: it cannot write /etc/cdi or create hold "
            "slices, so every GPU hold fails with node-unprivileged",
            "run bcd node as root, or as the unprivileged bcd account beside a root bcd helper "
            "(deploy/install.sh sets [helper] socket)",
        )
    ]


def _check_vm_runtime(config: Config, host: HostView) -> list[Finding]:
    runtimes = [name for name in ("virsh", "cloud-hypervisor") if host.which(name)]
    if not runtimes:
        return [
            Finding(
                "vm-runtime",
                "warn",
                "neither virsh nor cloud-hypervisor: this host runs no VPS instances",
                "install libvirt-clients (with libvirt and QEMU) or cloud-hypervisor if it should",
            )
        ]
    findings = [Finding("vm-runtime", "ok", f"VM runtimes: {', '.join(runtimes)}")]
    if config.under_helper and not config.helper.instance_bridges:
        findings.append(
            Finding(
                "instance-bridges",
                "warn",
                "[helper] instance_bridges is empty: the helper refuses every instance tap",
                'set [helper] instance_bridges = "br0" (the bridges instance NICs join) '
                "in root's config.toml",
            )
        )
    return findings


def _check_libvirt_group(config: Config, host: HostView) -> list[Finding]:
    if not config.under_helper:
        return []
    group_file = host.path("/etc/group")
    try:
        lines = group_file.read_text().splitlines()
    except OSError:
        return []
    user = config.helper.node_user or "bcd"
    for line in lines:
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == "libvirt" and user in fields[3].split(","):
            return [
                Finding(
                    "libvirt-group",
                    "fail",
                    f"the node's account {user} is in the root-equivalent libvirt group",
                    "run deploy/install.sh again (it takes the account out), or gpasswd -d bcd libvirt",
                )
            ]
    return [Finding("libvirt-group", "ok", f"{user} is not in the libvirt group")]


def _check_kubernetes(config: Config, host: HostView) -> list[Finding]:
    if not host.path("/etc/kubernetes/kubelet.conf").exists():
        return []
    if config.kubernetes.allowed_clusters:
        return [Finding("kubernetes", "ok", f"{len(config.kubernetes.allowed_clusters)} allowed cluster(s)")]
    return [
        Finding(
            "kubernetes",
            "fail",
            "a joined Kubernetes node without [kubernetes] allowed_clusters",
            'set [kubernetes] allowed_clusters = "https://<api>:6443#sha256:<CA pin>" in root\'s config.toml',
        )
    ]


def _check_iommu(host: HostView) -> list[Finding]:
    iommu = host.path("/sys/class/iommu")
    if not (iommu.is_dir() and any(iommu.iterdir())):
        return []
    if host.path("/sys/bus/pci/drivers/vfio-pci").is_dir():
        return [Finding("iommu", "ok", "the IOMMU is active and vfio-pci is loaded")]
    return [
        Finding(
            "iommu",
            "warn",
            "the IOMMU is active but the vfio-pci driver is not loaded: no GPU can be passed through",
            "add vfio-pci to the host's kernel-modules unit (or modprobe vfio-pci)",
        )
    ]


def _check_clock(host: HostView) -> Finding:
    now = host.wall_clock()
    if now < CLOCK_FLOOR:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
        return Finding(
            "clock",
            "fail",
            f"the wall clock reads {when}: certificates and signed intent cannot verify",
            "set the clock (enable NTP: timedatectl set-ntp true)",
        )
    return Finding(
        "clock", "ok", time.strftime("the wall clock reads %Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    )


# --- the command --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser)
    parser.add_argument("--root", default="/", help="the directory standing for / (a simulated host)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def render(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"{f.level:<4}  {f.check:<16} {f.message}")
        if f.fix and f.level != "ok":
            lines.append(f"{'':<6}{'':<16} fix: {f.fix}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    host = HostView(root=Path(args.root), euid=os.geteuid())
    findings = check_all(args.config or default_config_path(), host)
    failed = any(f.level == "fail" for f in findings)
    if args.json:
        json.dump({"ok": not failed, "findings": [asdict(f) for f in findings]}, sys.stdout, indent=None)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(findings))
    return 1 if failed else 0
