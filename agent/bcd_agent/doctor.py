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
- ch-vmm / ch-uid-range (where `cloud-hypervisor` is on PATH; docs/instances.md): its version
  (`--version`) below v51, the runtime's minimum, or unreadable (warn: the runtime is not run); no
  /dev/kvm (warn); an account that is not bcd's (`bcd-vmm-<n>`) holding a uid of bcd's VMM range
  0x7FFD0000..+65535 (fail: a VMM would run as it).
- libvirt-group: under the helper, the node's account is in the root-equivalent libvirt group
  (fail; HST-HLP-32).
- kubernetes: a joined Kubernetes node without [kubernetes] allowed_clusters (fail; HST-K8S-60).
- iommu: an active IOMMU without the vfio-pci driver (warn; HST-IOMMU-12).
- clock: the wall clock is before 2024, an unset RTC: certificates and signed intent cannot verify
  (fail).
- join-binding (as root on a node with [helper]; host-config.md "Signed specs", HST-SIGN-38..41): ok
  "host units bind to <node-id> (root's signed join record)" when root's join record names this
  machine's identity and the pinned JoinService key signed it; warn when the node joined before the
  record existed (the helper binds on trust on first use), fixed by `bcd join --reset --yes`; fail when
  the record names another node, when the pinned key did not sign it (or root's config has no
  join_signing_key_pin to check it with), when it cannot be read under the root-only rule, or when the
  helper was bound to a record that is gone or, on trust on first use, to another node.
- signed-intent (same condition, HST-SIGN-42): a second fail when neither command_root_sha256 nor root's
  join record names command-signing roots: "bcd helper applies host units unsigned unless the node
  itself presents a trust bundle". Not reported when the record cannot be verified: the helper then
  refuses every host unit, which join-binding says.

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
from bcd_shared.version import VERSION

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

    version_of: Callable[[str], str | None] = lambda path: _version_output(path)

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")


def _version_output(path: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


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
    findings.extend(_check_ch(host))
    findings.extend(_check_kubernetes(config, host))
    findings.extend(_check_iommu(host))
    findings.append(_check_clock(host))
    if host.euid == 0 and config.under_helper:
        findings.extend(_check_join_binding(config, host))
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


def _check_ch(host: HostView) -> list[Finding]:
    from bcd_shared.chunit import VMM_UID_BASE, VMM_UID_COUNT

    from bcd_agent.sections.instances.runtimes.chapi import MIN_VERSION, parse_version

    binary = host.which("cloud-hypervisor")
    if binary is None:
        return []
    out: list[Finding] = []
    text = host.version_of(binary)
    version = parse_version(text) if text else None
    minimum = f"v{MIN_VERSION[0]}.{MIN_VERSION[1]}"
    if version is None:
        out.append(Finding("ch-vmm", "warn", f"{binary} --version answers no version: bcd does not run it",
                           f"install cloud-hypervisor {minimum} or later"))  # fmt: skip
    elif version < MIN_VERSION:
        out.append(Finding("ch-vmm", "warn",
                           f"cloud-hypervisor v{version[0]}.{version[1]} is older than {minimum} (explicit "
                           "image_type and backing_files): bcd does not run it",
                           f"install cloud-hypervisor {minimum} or later"))  # fmt: skip
    elif not host.path("/dev/kvm").exists():
        fix = "load kvm (kvm_intel or kvm_amd) and enable virtualisation in the firmware"
        out.append(Finding("ch-vmm", "warn", "cloud-hypervisor without /dev/kvm: it runs no VM", fix))
    else:
        out.append(Finding("ch-vmm", "ok", f"cloud-hypervisor v{version[0]}.{version[1]} with /dev/kvm"))
    try:
        lines = host.path("/etc/passwd").read_text().splitlines()
    except OSError:
        lines = []
    foreign = []
    for line in lines:
        fields = line.split(":")
        if len(fields) > 2 and fields[2].isdigit():
            uid = int(fields[2])
            if VMM_UID_BASE <= uid < VMM_UID_BASE + VMM_UID_COUNT and not fields[0].startswith("bcd-vmm-"):
                foreign.append(f"{fields[0]} ({uid})")
    if foreign:
        message = f"accounts that are not bcd's hold uids of its VMM range: {', '.join(foreign[:5])}"
        fix = "move those accounts out of 2147287040..2147352575 (bcd's VMM uids)"
        out.append(Finding("ch-uid-range", "fail", message, fix))
    else:
        out.append(
            Finding(
                "ch-uid-range", "ok", "bcd's VMM uid range 2147287040..2147352575 is free of other accounts"
            )
        )
    return out


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


# --- root's join record and signed intent (HST-SIGN-38..42) --------------------------------------

# The helper's state file (helper/bcd_helper/intent.py STATE_PATH; the agent does not import the helper).
HELPER_INTENT = "/var/lib/bcd-hostconfig/helper-intent.json"
REJOIN = "bcd join --reset --yes --token TOKEN --address ADDRESS"
UNSIGNED = "bcd helper applies host units unsigned unless the node itself presents a trust bundle"


def _check_join_binding(config: Config, host: HostView) -> list[Finding]:
    """Which node root's helper binds host units to, and whether it checks signatures at all."""
    from bcd_shared.joinrecord import JOIN_RECORD, read_join_record
    from bcd_shared.pki.errors import PkiError
    from bcd_shared.rootpath import RootPathRefused

    from bcd_agent.session import identity as ident

    record_path = host.path(JOIN_RECORD)
    node_id: str | None = None
    if config.identity_path.exists():
        try:
            node_id = ident.load(config.data_dir).node_id
        except ident.IdentityError as exc:
            return [Finding("join-binding", "fail", str(exc), f"restore identity.json, or as root: {REJOIN}")]
    pin = config.join_signing_key_pin
    try:
        found = read_join_record(host.root, pin) if pin is not None else None
        exists = found is not None or (pin is None and record_path.exists())
    except RootPathRefused as exc:
        return [
            Finding(
                "join-binding",
                "fail",
                f"root's join record {record_path} cannot be read under the root-only rule ({exc}): "
                "the helper refuses every host unit",
                "make /var/lib/bcd-hostconfig root's alone (root:root 0700), then as root: " + REJOIN,
            )
        ]
    except PkiError as exc:
        return [
            Finding(
                "join-binding",
                "fail",
                f"root's join record {record_path} was not signed by the pinned JoinService key ({exc}): "
                "the helper refuses every host unit",
                f"check join_signing_key_pin in {config.source}; then re-join as root: {REJOIN}",
            )
        ]
    if exists and found is None:  # a record, but no pin to check it with
        return [
            Finding(
                "join-binding",
                "fail",
                f"root's config.toml ({config.source}) has no join_signing_key_pin: the helper cannot verify "
                f"root's join record {record_path} and refuses every host unit",
                'set join_signing_key_pin = "sha256/..." (the install\'s out-of-band pin; '
                "deploy/install.sh --join-signing-key-pin)",
            )
        ]
    findings: list[Finding] = []
    if found is not None:
        verified = found[1]
        if node_id is None:
            findings.append(
                Finding(
                    "join-binding",
                    "fail",
                    f"root's join record names node {verified.node_id}, but {config.identity_path} does not "
                    "exist: the helper refuses host units for any other node",
                    f"as root: {REJOIN}",
                )
            )
        elif verified.node_id != node_id:
            findings.append(
                Finding(
                    "join-binding",
                    "fail",
                    f"root's join record names node {verified.node_id}, this machine's identity is "
                    f"{node_id}: the helper refuses this node's host units",
                    f"re-join as root so that root's record names this node: {REJOIN}",
                )
            )
        else:
            findings.append(
                Finding("join-binding", "ok", f"host units bind to {node_id} (root's signed join record)")
            )
    elif node_id is not None:
        findings.append(_tofu_binding(node_id, record_path, host))
    findings.extend(_check_signed_intent(config, found[1] if found is not None else None, record_path))
    return findings


def _tofu_binding(node_id: str, record_path: Path, host: HostView) -> Finding:
    """No join record: the helper binds to the first signed spec it accepts (HST-SIGN-23), or it was bound
    to a record that is gone (it then refuses every host unit)."""
    from bcd_shared.rootpath import RootPathRefused, read_root_only

    bound, source = "", ""
    try:
        data = read_root_only(host.root, HELPER_INTENT, 64 * 1024)
        doc = json.loads(data) if data is not None else {}
        if isinstance(doc, dict):
            bound, source = str(doc.get("node_id", "")), str(doc.get("node_source", ""))
    except (RootPathRefused, ValueError):
        pass  # the helper reports its own state file (intent-state); the binding is what matters here
    fix = f"pin it: re-join as root, {REJOIN} (re-running the install script is not enough)"
    if source == "record":
        return Finding(
            "join-binding",
            "fail",
            f"root's join record {record_path} is gone, but the helper was bound to it: it refuses every "
            "host unit",
            fix,
        )
    if bound and bound != node_id:
        return Finding(
            "join-binding",
            "fail",
            f"no root's join record, and the helper bound itself on trust on first use to node {bound}, "
            f"not this machine's identity {node_id}: it refuses this node's host units",
            fix,
        )
    now = f"bound to {bound}" if bound else "not bound yet"
    return Finding(
        "join-binding",
        "warn",
        f"node {node_id} joined before root's join record existed ({record_path} is missing): the helper "
        f"binds host units on trust on first use, to the first signed spec it accepts ({now})",
        fix,
    )


def _check_signed_intent(config: Config, record: object, record_path: Path) -> list[Finding]:
    """HST-SIGN-42: where the helper takes command-signing roots from, if anywhere."""
    from bcd_shared.pki.join import VerifiedJoin

    pins = config.command_root_sha256
    if pins:
        return [
            Finding(
                "signed-intent",
                "ok",
                f"host units need a signed spec: command_root_sha256 pins {len(pins)} "
                "command-signing root(s)",
            )
        ]
    bundle = record.trust_bundle if isinstance(record, VerifiedJoin) else None
    if bundle is not None and bundle.bundle.has_command_roots:
        return [
            Finding(
                "signed-intent",
                "ok",
                f"host units need a signed spec: root's join record names {len(bundle.bundle.command_roots)} "
                f"command-signing root(s) (trust bundle version {bundle.version})",
            )
        ]
    where = "has no trust bundle with command-signing roots" if record is not None else "is missing"
    return [
        Finding(
            "signed-intent",
            "fail",
            f"neither command_root_sha256 nor root's join record names command-signing roots "
            f"({record_path} {where}): {UNSIGNED}",
            f"pin the roots in {config.source}: command_root_sha256 = \"<SHA-256 of each root certificate's "
            'DER>" (deploy/install.sh --command-root-sha256), or re-join as root against a control plane '
            f"that signs intent: {REJOIN}",
        )
    ]


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
        doc = {"version": VERSION, "ok": not failed, "findings": [asdict(f) for f in findings]}
        json.dump(doc, sys.stdout, indent=None)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(f"bcd doctor {VERSION}\n" + render(findings))
    return 1 if failed else 0
