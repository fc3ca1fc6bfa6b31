"""`bcd doctor`: checks of this host's bcd setup, each ok / warn / fail with its fix.

Each finding has an id: its check's name, or `check/subject` where a check reports several (a file, a
unit); ids are stable across runs and releases, and `--json` prints them in a versioned document
(`format` 1; docs/operations.md "bcd doctor" lists every id and the schema). The checks:

- config: config.toml missing, unreadable or refused by the strict parser (fail; the fix fits the fault:
  missing: write it; EACCES: run as root or in the bcd group; refused: correct the key).
- config-owner: under the helper, the file is not a regular root-owned file that no one else can
  write (fail; HST-HLP-24..30).
- data-dir / data-files/<name>: data_dir missing (fix: create it), not a directory (fix: move the file
  aside), not 0700 (fix: chmod; a search bit for QEMU's user is allowed, DLV-QFA-01); journal.db or
  identity.json not 0600 (fail).
- identity: identity.json missing, not joined yet (warn).
- helper: [helper] socket set but nothing accepts on it (fail). helper-version: the helper's
  helper.ping answer names another bcd version than the node's, or none (warn).
- control-plane: the gateway ([control_plane] unix_socket or address, else the join's address) does not
  accept a connection (fail), or none is configured (warn).
- certificate: the node certificate in identity.json expired (fail) or ends within 14 days (warn).
- nvidia: NVIDIA GPUs on the PCI bus without nvidia-smi, or nvidia-smi failing with a GPU or driver
  present (fail); the GPU count and driver version otherwise.
- gpu-binding: a host with GPUs whose node would run unprivileged without [helper] (warn;
  DEV-UNPRIV-05).
- kvm: /dev/kvm missing (warn), not a character device (fail), open to every user (warn); its mode and
  group otherwise.
- cgroup: a v1 or hybrid hierarchy (fail), cgroup v2 without cpu, cpuset, memory or hugetlb (warn).
- vm-runtime: neither virsh nor cloud-hypervisor (warn; DLV-RT-11).
- instance-bridges: under the helper with a VM runtime and no [helper] instance_bridges (warn;
  DLV-CHH-24).
- ch-vmm / ch-uid-range (where `cloud-hypervisor` is on PATH; docs/instances.md): its version
  (`--version`) below v51, the runtime's minimum, or unreadable (warn: the runtime is not run); no
  /dev/kvm (warn); an account that is not bcd's (`bcd-vmm-<n>`) holding a uid of bcd's VMM range
  0x7FFD0000..+65535 (fail: a VMM would run as it).
- libvirt-group: under the helper, the node's account is in the root-equivalent libvirt group
  (fail; HST-HLP-32).
- libvirt-qemu: under the helper where libvirt is installed, qemu.conf's dynamic_ownership is not 0
  (checked when readable: it is root's) or QEMU's user is not in the node's group (warn; DLV-HLP-13).
- kubernetes: a joined Kubernetes node without [kubernetes] allowed_clusters (fail; HST-K8S-60).
- iommu: an active IOMMU without the vfio-pci driver (warn; HST-IOMMU-12).
- clock: the wall clock is before 2024, an unset RTC: certificates and signed intent cannot verify
  (fail). time-sync: adjtimex(2) says the clock is not synchronized (TIME_ERROR or STA_UNSYNC; warn).
- units/bcd-helper.service, units/bcd-node.service: failed (fail), inactive or not enabled (warn); one
  `units` finding when systemctl cannot reach systemd (a container).
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

`--root DIR` applies to every check: the config (an absolute --config is a host path), data_dir, the
sockets, /dev, /proc, /sys and /etc are read under DIR, and programs are the simulated host's. Exit
status: 1 when any check fails, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from attrs import evolve, frozen
from bcd_shared.shown import shown
from bcd_shared.system import CommandResult
from bcd_shared.version import VERSION

from bcd_agent.config import Config, ConfigError, add_config_argument, default_config_path, parse_config

Level = Literal["ok", "warn", "fail"]
# 2024-01-01T00:00:00Z: a clock before this was never set (an RTC reset reads 1970 or 2000).
CLOCK_FLOOR = 1_704_067_200
# The --json document's format; bumped only when a key changes meaning or goes (docs/operations.md).
JSON_FORMAT = 1
CERT_WARN_DAYS = 14
# Controllers hold slices use: cpuset (cpus, mems), cpu (cpu_millis), memory, hugetlb (hugepages).
CGROUP_CONTROLLERS = ("cpu", "cpuset", "memory", "hugetlb")
UNITS = ("bcd-helper.service", "bcd-node.service")
TOOL_TIMEOUT_S = 10.0


@frozen
class Finding:
    """One finding. `check` names the check (the table in docs/operations.md); `subject` what it is about
    when a check reports several (a file, a unit); `id` = check or check/subject, stable across runs."""

    check: str
    level: Level
    message: str
    fix: str = ""
    subject: str = ""

    @property
    def id(self) -> str:
        return f"{self.check}/{self.subject}" if self.subject else self.check

    def to_json(self) -> dict[str, str]:
        return {
            "id": self.id,
            "check": self.check,
            "subject": self.subject,
            "level": self.level,
            "message": self.message,
            "fix": self.fix,
        }


@frozen
class TimeSync:
    """The kernel's clock discipline state (adjtimex(2) with modes 0: read-only)."""

    synchronized: bool  # return value not TIME_ERROR and STA_UNSYNC clear
    state: str  # TIME_OK, TIME_ERROR, ...
    max_error_us: int


Runner = Callable[[Sequence[str]], CommandResult]


def _no_tool(argv: Sequence[str]) -> CommandResult:
    return CommandResult(tuple(argv), 127)


@frozen
class HostView:
    """What doctor reads of the host; tests give a scratch root and fakes. Every path doctor reads is a
    host path under `root` (config, data_dir, sockets, /dev, /proc, /sys, /etc): `--root` applies to
    every check."""

    root: Path = Path("/")
    euid: int = 0
    which: Callable[[str], str | None] = shutil.which
    wall_clock: Callable[[], float] = time.time
    run: Runner = _no_tool  # a host program (the simulated host's fakes under --root)
    time_sync: Callable[[], TimeSync | None] = lambda: read_adjtimex()
    # This process's supplementary groups: in a container they come from the pod's supplementalGroups,
    # which no /etc/group or unit file shows.
    groups: Callable[[], Sequence[int]] = os.getgroups

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")


def read_adjtimex() -> TimeSync | None:
    """adjtimex(2) with modes = 0 (reads, changes nothing; allowed unprivileged). None off Linux/glibc."""
    import ctypes
    import ctypes.util

    class Timeval(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]

    class Timex(ctypes.Structure):  # struct timex, <sys/timex.h>
        _fields_ = [
            ("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
            ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
            ("constant", ctypes.c_long), ("precision", ctypes.c_long), ("tolerance", ctypes.c_long),
            ("time", Timeval), ("tick", ctypes.c_long), ("ppsfreq", ctypes.c_long),
            ("jitter", ctypes.c_long), ("shift", ctypes.c_int), ("stabil", ctypes.c_long),
            ("jitcnt", ctypes.c_long), ("calcnt", ctypes.c_long), ("errcnt", ctypes.c_long),
            ("stbcnt", ctypes.c_long), ("tai", ctypes.c_int), ("_pad", ctypes.c_int * 11),
        ]  # fmt: skip

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        tx = Timex()
        rc = int(libc.adjtimex(ctypes.byref(tx)))
    except (OSError, AttributeError):
        return None
    if rc < 0:
        return None
    states = {0: "TIME_OK", 1: "TIME_INS", 2: "TIME_DEL", 3: "TIME_OOP", 4: "TIME_WAIT", 5: "TIME_ERROR"}
    sta_unsync = 0x0040
    return TimeSync(
        synchronized=rc != 5 and not tx.status & sta_unsync,
        state=states.get(rc, str(rc)),
        max_error_us=int(tx.maxerror),
    )


def host_view(root: str, euid: int) -> HostView:
    """The real host, or a simulated one (its fake programs) under `root`."""
    from bcd_agent.plan import host_system

    system = host_system(root)
    rooted = Path(root).resolve() != Path("/")

    def run(argv: Sequence[str]) -> CommandResult:
        try:
            return system.run(list(argv), timeout=TOOL_TIMEOUT_S)
        except OSError as exc:
            return CommandResult(tuple(argv), 127, b"", str(exc).encode())

    def which(name: str) -> str | None:
        if rooted:  # the simulated host's programs are fakes the System runs, not files on PATH
            return name if run([name, "--version"]).returncode != 127 else None
        return shutil.which(name)

    return HostView(root=Path(root), euid=euid, which=which, run=run)


def rooted_config(config: Config, host: HostView) -> Config:
    """The config with its paths (data_dir, sockets, ca_file) as real paths under host.root."""
    if host.root == Path("/"):
        return config

    def under(path: str | None) -> str | None:
        return None if path is None else str(host.path(path))

    cp = config.control_plane
    return evolve(
        config,
        data_dir=str(host.path(config.data_dir)),
        helper=evolve(config.helper, socket=under(config.helper.socket)),
        control_plane=evolve(cp, unix_socket=under(cp.unix_socket), ca_file=under(cp.ca_file)),
    )


def config_file(config_path: str, host: HostView) -> Path:
    """An absolute --config is a host path (under --root); a relative one is relative to the working
    directory, as every command's file arguments are."""
    return host.path(config_path) if config_path.startswith("/") else Path(config_path)


def check_all(config_path: str, host: HostView) -> list[Finding]:
    findings: list[Finding] = []
    path = config_file(config_path, host)
    config = rooted_config(_check_config(path, findings), host)
    if config.under_helper:
        findings.append(_check_config_owner(str(path)))
    findings.extend(_check_data_dir(config))
    findings.extend(_check_helper(config))
    findings.extend(_check_control_plane(config))
    findings.extend(_check_certificate(config, host))
    findings.extend(_check_nvidia(host))
    findings.extend(_check_gpu_binding(config, host))
    findings.extend(_check_kernel_log(config, host))
    findings.extend(_check_kvm(host))
    findings.extend(_check_cgroup(host))
    findings.extend(_check_vm_runtime(config, host))
    findings.extend(_check_libvirt_group(config, host))
    findings.extend(_check_libvirt_qemu(config, host))
    findings.extend(_check_ch(host))
    findings.extend(_check_kubernetes(config, host))
    findings.extend(_check_iommu(host))
    findings.append(_check_clock(host))
    findings.append(_check_time_sync(host))
    findings.extend(_check_units(config, host))
    if host.euid == 0 and config.under_helper:
        findings.extend(_check_join_binding(config, host))
    return findings


def _check_config(path: Path, findings: list[Finding]) -> Config:
    fallback = Config(source=f"{path} (refused: defaults)")
    meanwhile = "; the other checks use the defaults meanwhile"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        findings.append(
            Finding(
                "config",
                "fail",
                f"{path}: no such file",
                f"write it with deploy/install.sh, or name another with --config or $BCD_CONFIG{meanwhile}",
            )
        )
        return fallback
    except PermissionError:
        findings.append(
            Finding(
                "config",
                "fail",
                f"{path}: permission denied",
                "run bcd doctor as root or as a member of the bcd group (the file is root:bcd 0640)"
                + meanwhile,
            )
        )
        return fallback
    except OSError as e:
        findings.append(
            Finding("config", "fail", f"{path}: {e.strerror}", f"{path} must be a regular file{meanwhile}")
        )
        return fallback
    try:
        config = parse_config(text.decode("utf-8", errors="strict"), str(path))
    except UnicodeDecodeError:
        findings.append(
            Finding("config", "fail", f"{path}: is not UTF-8", f"write it as UTF-8 text{meanwhile}")
        )
        return fallback
    except ConfigError as e:
        findings.append(
            Finding("config", "fail", str(e), f"correct the key as docs/config.md says{meanwhile}")
        )
        return fallback
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
    make = f"install -d -m 0700 -o bcd -g bcd {data_dir} (deploy/install.sh makes it)"
    try:
        st = data_dir.stat()
    except FileNotFoundError:
        return [Finding("data-dir", "fail", f"{data_dir} does not exist", f"create it: {make}")]
    except PermissionError:
        return [
            Finding(
                "data-dir",
                "fail",
                f"{data_dir}: permission denied",
                "run bcd doctor as root or as the node's account (bcd): data_dir is 0700",
            )
        ]
    except OSError as e:
        return [
            Finding("data-dir", "fail", f"{data_dir}: {e.strerror}", f"correct data_dir in {config.source}")
        ]
    if not stat.S_ISDIR(st.st_mode):
        return [
            Finding(
                "data-dir",
                "fail",
                f"{data_dir} is not a directory",
                f"move the file aside (mv {data_dir} {data_dir}.old) and create the directory: {make}; "
                f"or correct data_dir in {config.source}",
            )
        ]
    findings = []
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o066:
        findings.append(
            Finding("data-dir", "fail", f"{data_dir} is mode {mode:04o}, not 0700", f"chmod 0700 {data_dir}")
        )
    elif mode & 0o011:
        # The search bit alone: the libvirt-kvm runtime lets QEMU's user reach its disks (DLV-QFA-01,
        # DLV-HLP-14); listing stays closed and bcd's own files are 0600 (DLV-QFA-04).
        findings.append(
            Finding("data-dir", "ok", f"{data_dir} is {mode:04o} (search only, for QEMU), uid {st.st_uid}")
        )
    else:
        findings.append(Finding("data-dir", "ok", f"{data_dir} is 0700, owned by uid {st.st_uid}"))
    for name in ("journal.db", "identity.json"):
        p = data_dir / name
        try:
            fmode = stat.S_IMODE(p.lstat().st_mode)
        except FileNotFoundError:
            continue
        except OSError as e:
            findings.append(
                Finding("data-files", "fail", f"{p}: {e.strerror}", f"check {data_dir}'s owner", subject=name)
            )
            continue
        if fmode & 0o077:
            findings.append(
                Finding(
                    "data-files",
                    "fail",
                    f"{p} is mode {fmode:04o}, not 0600",
                    f"chmod 0600 {p}",
                    subject=name,
                )
            )
        else:
            findings.append(Finding("data-files", "ok", f"{p} is 0600", subject=name))
    if config.identity_path.exists():
        findings.append(Finding("identity", "ok", f"joined: {config.identity_path} is there"))
    else:
        findings.append(
            Finding(
                "identity",
                "warn",
                f"not joined: {config.identity_path} does not exist",
                "run `bcd join --token TOKEN --address HOST:PORT` (as root on a node with [helper], so "
                "that root keeps the join record)",
            )
        )
    return findings


def _check_helper(config: Config) -> list[Finding]:
    """The helper's socket accepts (`helper`), and its helper.ping answer names the node's version
    (`helper-version`)."""
    from bcd_shared.errors import HelperRefused
    from bcd_shared.version import VERSION

    from bcd_agent.helperclient import HelperClient

    path = config.helper.socket
    if path is None:
        return [
            Finding("helper", "ok", "no [helper] socket: the node acts itself (as root) or takes no holds")
        ]
    fix = f"start the helper (systemctl start bcd-helper), or correct [helper] socket ({path})"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(path)
        except OSError as e:
            return [Finding("helper", "fail", f"nothing accepts on {path}: {e.strerror or e}", fix)]
    findings = [Finding("helper", "ok", f"the helper accepts on {path}")]
    client = HelperClient(path, connect_timeout=2.0)
    try:
        answer = client.call("helper.ping", timeout=3.0)
    except HelperRefused as e:
        findings.append(
            Finding(
                "helper-version",
                "warn",
                f"the helper on {path} did not answer helper.ping: {e}",
                "systemctl status bcd-helper; journalctl -u bcd-helper",
            )
        )
        return findings
    finally:
        client.close()
    theirs = str(answer.get("version", "")) or "older than 0.1.0 (its ping names no version)"
    if theirs == VERSION:
        findings.append(Finding("helper-version", "ok", f"the helper is bcd {theirs}, as the node is"))
    else:
        findings.append(
            Finding(
                "helper-version",
                "warn",
                f"the helper is bcd {theirs}, the node bcd {VERSION}",
                "upgrade bcd-helper and bcd-node together (same release), then systemctl restart bcd-helper"
                " (after a self-update, the daemon section, the node runs ahead of the packaged helper"
                " until bcd-helper is upgraded)",
            )
        )
    return findings


def _split_address(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _check_control_plane(config: Config) -> list[Finding]:
    """The gateway accepts connections (TCP or Unix socket; no TLS handshake: that is the session's)."""
    from bcd_agent.session import identity as ident

    cp = config.control_plane
    address = cp.address
    if cp.unix_socket is None and address is None and config.identity_path.exists():
        try:
            address = ident.load(config.data_dir).address or None
        except ident.IdentityError:
            address = None
    fix = "check [control_plane] in config.toml, the network path and the firewall to the gateway"
    try:
        if cp.unix_socket is not None or (address is not None and address.startswith("unix:")):
            where = cp.unix_socket or (address or "").removeprefix("unix:")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(3.0)
                sock.connect(where)
            return [Finding("control-plane", "ok", f"the control plane accepts on unix:{where}")]
        if address is None:
            return [
                Finding(
                    "control-plane",
                    "warn",
                    "no control plane: neither [control_plane] address nor unix_socket, and not joined",
                    "run `bcd join --token TOKEN --address HOST:PORT`, or set [control_plane] address",
                )
            ]
        parts = _split_address(address)
        if parts is None:
            return [Finding("control-plane", "fail", f"{address!r} is not HOST:PORT", fix)]
        with socket.create_connection(parts, timeout=3.0):
            pass
    except OSError as e:
        shown = address or f"unix:{cp.unix_socket}"
        return [Finding("control-plane", "fail", f"cannot connect to {shown}: {e.strerror or e}", fix)]
    return [Finding("control-plane", "ok", f"the control plane accepts on {address}")]


def _check_certificate(config: Config, host: HostView) -> list[Finding]:
    """The node certificate in identity.json: expired (fail), expiring within 14 days (warn)."""
    from cryptography import x509

    from bcd_agent.session import identity as ident

    if not config.identity_path.exists():
        return []
    rejoin = "bcd join --reset --yes --token TOKEN --address ADDRESS (a new certificate)"
    try:
        identity = ident.load(config.data_dir)
        cert = x509.load_der_x509_certificate(identity.certificate_chain[0])
    except (ident.IdentityError, ValueError, OSError) as e:
        return [Finding("certificate", "fail", f"{config.identity_path}: {e}", f"restore it, or {rejoin}")]
    not_after = cert.not_valid_after_utc.timestamp()
    left_days = (not_after - host.wall_clock()) / 86400
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(not_after))
    if left_days < 0:
        return [Finding("certificate", "fail", f"the node certificate expired on {when}", rejoin)]
    if left_days < CERT_WARN_DAYS:
        return [
            Finding(
                "certificate",
                "warn",
                f"the node certificate expires on {when}, in {left_days:.1f} days",
                f"let the node renew it while connected, or {rejoin}",
            )
        ]
    return [
        Finding("certificate", "ok", f"the node certificate is valid until {when} ({int(left_days)} days)")
    ]


def _pci_nvidia_gpus(host: HostView) -> list[str]:
    """PCI functions of vendor NVIDIA (0x10de) and class display (0x03xxxx): GPUs, driver or not."""
    base = host.path("/sys/bus/pci/devices")
    found = []
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return []
    for dev in entries:
        try:
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith("0x03"):
            found.append(dev.name)
    return found


def _check_nvidia(host: HostView) -> list[Finding]:
    """nvidia-smi and the driver: GPUs with a driver that answers, or why not."""
    pci = _pci_nvidia_gpus(host)
    version_file = host.path("/proc/driver/nvidia/version")
    try:
        driver = version_file.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        driver = ""
    if host.which("nvidia-smi") is None:
        if pci:
            return [
                Finding(
                    "nvidia",
                    "fail",
                    f"{len(pci)} NVIDIA GPU(s) on the PCI bus ({', '.join(pci[:4])}) but no nvidia-smi: "
                    "bcd sees no GPU and binds no hold",
                    "install the NVIDIA driver and its utilities (the host's nvidia-driver unit, or "
                    "apt-get install nvidia-driver nvidia-smi)",
                )
            ]
        return [Finding("nvidia", "ok", "no NVIDIA GPU and no nvidia-smi: this host takes no GPU holds")]
    res = host.run(["nvidia-smi", "-L"])
    if not res.ok:
        detail = (res.stdout + res.stderr).decode(errors="replace").strip().splitlines()
        why = detail[0] if detail else f"exit status {res.returncode}"
        if not pci and not driver:  # the utilities without a GPU or a driver: nothing to hold here
            return [
                Finding(
                    "nvidia",
                    "warn",
                    f"nvidia-smi is installed but fails ({why}), and no NVIDIA GPU is on the PCI bus",
                    "nothing to do on a host without GPUs; else check the GPU is seated and powered (lspci)",
                )
            ]
        return [
            Finding(
                "nvidia",
                "fail",
                f"nvidia-smi fails: {why}"
                + ("" if driver else " (no driver loaded: /proc/driver/nvidia missing)"),
                "load the driver (modprobe nvidia; dmesg says why it failed), or reinstall the driver "
                "matching the running kernel",
            )
        ]
    gpus = [line for line in res.stdout.decode(errors="replace").splitlines() if line.startswith("GPU ")]
    shown = f"; driver: {driver}" if driver else ""
    return [Finding("nvidia", "ok", f"nvidia-smi answers: {len(gpus)} GPU(s){shown}")]


def _group_name(host: HostView, gid: int) -> str:
    try:
        for line in host.path("/etc/group").read_text().splitlines():
            fields = line.split(":")
            if len(fields) >= 3 and fields[2] == str(gid):
                return fields[0]
    except OSError:
        pass
    return str(gid)


def _check_kvm(host: HostView) -> list[Finding]:
    """/dev/kvm: a character device, crw-rw---- root:kvm as udev makes it."""
    path = host.path("/dev/kvm")
    fix = "enable virtualization (VT-x/AMD-V) in the firmware and load kvm_intel or kvm_amd"
    try:
        st = path.stat()
    except FileNotFoundError:
        return [
            Finding(
                "kvm", "warn", "no /dev/kvm: VMs would run without KVM (TCG, far slower) or not at all", fix
            )
        ]
    except OSError as e:
        return [Finding("kvm", "warn", f"/dev/kvm: {e.strerror}", fix)]
    mode = stat.S_IMODE(st.st_mode)
    group = _group_name(host, st.st_gid)
    shown = f"{stat.filemode(st.st_mode)} uid {st.st_uid} group {group}"
    if not stat.S_ISCHR(st.st_mode):
        return [
            Finding("kvm", "fail", f"/dev/kvm is not a character device ({shown})", f"remove it and {fix}")
        ]
    if mode & 0o006:
        return [
            Finding(
                "kvm",
                "warn",
                f"/dev/kvm is open to every user ({shown})",
                "chmod 0660 /dev/kvm and chgrp kvm /dev/kvm (udev's 50-udev-default.rules does)",
            )
        ]
    if mode & 0o060 != 0o060 or group != "kvm":
        # Before: ok for crw------- root:root, where no VM gets KVM.
        return [
            Finding(
                "kvm",
                "warn",
                f"/dev/kvm is {shown}: QEMU (libvirt's account, in group kvm) and cloud-hypervisor's VMMs "
                "cannot open it, so VMs run without KVM (TCG, far slower) or not at all",
                "chmod 0660 /dev/kvm and chgrp kvm /dev/kvm (udev's 50-udev-default.rules does)",
            )
        ]
    return [Finding("kvm", "ok", f"/dev/kvm is {shown}")]


def _check_cgroup(host: HostView) -> list[Finding]:
    """cgroup v2 with the controllers hold slices use."""
    base = host.path("/sys/fs/cgroup")
    controllers_file = base / "cgroup.controllers"
    try:
        controllers = controllers_file.read_text().split()
    except FileNotFoundError:
        # cgroup v1 (or hybrid) mounts one hierarchy per controller: /sys/fs/cgroup/memory, .../cpu, ...
        if any((base / name).is_dir() for name in ("memory", "cpu", "cpuset", "pids", "devices")):
            return [
                Finding(
                    "cgroup",
                    "fail",
                    "the cgroup hierarchy is v1 or hybrid: hold slices need the unified one (cgroup v2)",
                    "boot with systemd.unified_cgroup_hierarchy=1 (the default of systemd 247 and later)",
                )
            ]
        return [
            Finding(
                "cgroup",
                "warn",
                "no cgroup.controllers at /sys/fs/cgroup: the controllers cannot be checked",
                "mount cgroup2 on /sys/fs/cgroup",
            )
        ]
    except OSError as e:
        return [Finding("cgroup", "warn", f"{controllers_file}: {e.strerror}", "run bcd doctor as root")]
    missing = [c for c in CGROUP_CONTROLLERS if c not in controllers]
    if missing:
        return [
            Finding(
                "cgroup",
                "warn",
                f"cgroup v2 without the {', '.join(missing)} controller(s): holds with those limits fail",
                "enable them in the kernel (cgroup_enable=, or a kernel built with them)",
            )
        ]
    return [Finding("cgroup", "ok", f"cgroup v2 with {', '.join(CGROUP_CONTROLLERS)}")]


def _check_time_sync(host: HostView) -> Finding:
    state = host.time_sync()
    if state is None:
        return Finding("time-sync", "warn", "the clock's sync state cannot be read (adjtimex failed)", "")
    if state.synchronized:
        return Finding(
            "time-sync",
            "ok",
            f"the clock is synchronized (adjtimex {state.state}, "
            f"max error {state.max_error_us / 1000:.0f} ms)",
        )
    return Finding(
        "time-sync",
        "warn",
        f"the clock is not synchronized (adjtimex {state.state}, STA_UNSYNC): certificate and signature "
        "times drift",
        "enable NTP: timedatectl set-ntp true (or start chronyd / systemd-timesyncd)",
    )


def _check_units(config: Config, host: HostView) -> list[Finding]:
    """bcd-helper.service and bcd-node.service: active, enabled."""
    # A node that has not joined exits 78 and RestartPreventExitStatus=78 keeps it down: (re)starting
    # its unit fails again until `bcd join` ran.
    join_first = (
        ""
        if (Path(config.data_dir) / "identity.json").exists()
        else "not joined: bcd join --token=TOKEN --address HOST:PORT first (as root), then "
    )
    if host.which("systemctl") is None:
        return [Finding("units", "ok", "no systemctl (a container?): the units were not checked")]
    # Started before `bcd-helper audit init`, the helper seals with a key no one holds; the node's unit
    # Wants= the helper's, so starting either starts the helper (docs/deploy.md).
    seal_first = (
        "the helper's audit log is not sealed: bcd-helper audit init first (as root; keep the key it "
        "prints off the host), then "
        if _audit_unsealed(config, host)
        else ""
    )
    findings = []
    for unit in UNITS:
        res = host.run(["systemctl", "is-active", unit])
        active = res.stdout.decode(errors="replace").strip()
        if not active:  # "System has not been booted with systemd", "Failed to connect to bus"
            err = res.stderr.decode(errors="replace").strip().splitlines()
            why = f": {err[0]}" if err else ""
            if host.path("/run/systemd/system").is_dir():
                # systemd is PID 1 and yet unreachable (no D-Bus, a full /run): the units are not known
                # to be running, which an ok would have hidden.
                return [
                    Finding(
                        "units",
                        "warn",
                        f"the units were not checked: systemd runs, but systemctl cannot reach it{why}",
                        "run bcd doctor as root on the host (not in a container or another namespace); "
                        "systemctl status bcd-helper bcd-node",
                    )
                ]
            return [
                Finding("units", "ok", f"the units were not checked: systemctl cannot reach systemd{why}")
            ]
        enabled = host.run(["systemctl", "is-enabled", unit]).stdout.decode(errors="replace").strip()
        shown = f"{unit} is {active or 'unknown'} ({enabled or 'unknown'})"
        if active == "active":
            level: Level = "ok" if enabled == "enabled" else "warn"
            fix = "" if level == "ok" else f"systemctl enable {unit} (it would not start at boot)"
        elif active == "failed":
            level = "fail"
            fix = f"journalctl -u {unit} says why; then systemctl restart {unit}"
            if unit == "bcd-node.service" and join_first:
                fix = f"{join_first}systemctl restart {unit}"
        else:
            level, fix = "warn", f"{seal_first}systemctl enable --now {unit}"
            if unit == "bcd-node.service" and join_first:
                fix = f"{join_first}{seal_first}systemctl enable --now {unit}"
        findings.append(Finding("units", level, shown, fix, subject=unit))
    return findings


def _audit_unsealed(config: Config, host: HostView) -> bool:
    """Whether the helper's audit log has neither a sealing key nor entries. Only root can tell (the
    directory is root's, 0700): False for anyone else, and where no helper is configured."""
    if config.helper.socket is None:
        return False
    logs = host.path(config.helper.audit_dir or "/var/log/bcd-helper")
    try:
        return not any((logs / name).exists() for name in ("audit.key", "audit.log"))
    except OSError:
        return False


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


# Groups whose members read every entry of journald's system journal (journal files 0640
# root:systemd-journal; Debian also grants adm by ACL).
JOURNAL_GROUPS = ("systemd-journal", "adm")
# Where journald keeps the system journal: persistent, volatile (journalctl reads both).
JOURNAL_DIRS = ("/var/log/journal", "/run/log/journal")
# How the Kubernetes DaemonSet grants what a unit's SupplementaryGroups= grants on a host.
IN_A_POD = (
    "in the Kubernetes DaemonSet: mount the host's /var/log, /run/log and /etc/machine-id read-only into "
    "the node container and put the host journal's gid (stat -c %g /var/log/journal) in the pod's "
    "securityContext.supplementalGroups, as deploy/kubernetes/bcd-daemonset.yaml does"
)
NODE_UNIT_FILES = (
    "/etc/systemd/system/bcd-node.service",
    "/lib/systemd/system/bcd-node.service",
    "/usr/lib/systemd/system/bcd-node.service",
)


def _user_name(host: HostView, uid: int) -> str | None:
    try:
        lines = host.path("/etc/passwd").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(":")
        if len(fields) > 2 and fields[2] == str(uid):
            return fields[0]
    return None


def _unit_groups(host: HostView) -> tuple[str, list[str]]:
    """The installed bcd-node.service and the groups its SupplementaryGroups= name ("" if none found)."""
    for path in NODE_UNIT_FILES:
        try:
            text = host.path(path).read_text()
        except OSError:
            continue
        groups: list[str] = []
        for line in text.splitlines():
            key, _, value = line.strip().partition("=")
            if key.strip() == "SupplementaryGroups":
                groups = [] if not value.strip() else groups + value.split()
        return path, groups
    return "", []


def _check_kernel_log(config: Config, host: HostView) -> list[Finding]:
    """On a GPU host: the node can read the kernel's journal entries, where the XID watcher finds NVIDIA's
    XID errors (docs/devices.md "XID errors")."""
    if not _has_gpus(host):
        return []
    blind = "so XID errors of the GPUs raise no conditions"
    if host.which("journalctl") is None:
        return [
            Finding(
                "kernel-log",
                "fail",
                f"no journalctl: bcd node cannot read the kernel log, {blind}",
                "install systemd's journalctl (Debian: the systemd package; the DaemonSet's image, "
                "deploy/kubernetes/Containerfile, installs it): bcd reads the kernel's entries "
                "through journald",
            )
        ]
    uid = _node_uid(config, host)
    if uid == 0:
        return [Finding("kernel-log", "ok", "bcd node runs as root: it reads the kernel's journal entries")]
    user = _user_name(host, uid) or config.helper.node_user or "bcd"
    try:
        lines = host.path("/etc/group").read_text().splitlines()
    except OSError:
        lines = []
    member = [
        f[0]
        for f in (line.split(":") for line in lines)
        if len(f) >= 4 and f[0] in JOURNAL_GROUPS and user in f[3].split(",")
    ]
    unit, unit_groups = _unit_groups(host)
    # The unit's grant holds only where systemd runs the node: the DaemonSet's image carries the
    # packaged unit too, and there it grants nothing.
    under_systemd = host.path("/run/systemd/system").is_dir()
    granted = [g for g in unit_groups if g in JOURNAL_GROUPS] if under_systemd else []
    if member:
        return [Finding("kernel-log", "ok", f"{user} reads the kernel's journal entries (group {member[0]})")]
    if granted:
        return [
            Finding(
                "kernel-log",
                "ok",
                f"{user} reads the kernel's journal entries ({unit}: SupplementaryGroups={granted[0]})",
            )
        ]
    journals = _journal_gids(host)
    if host.euid == uid:  # doctor runs as the node's account: its own groups are the node's
        held = sorted({path for path, gid in journals.items() if gid in host.groups()})
        if held:
            return [
                Finding(
                    "kernel-log",
                    "ok",
                    f"{user} reads the kernel's journal entries: it holds gid {journals[held[0]]}, "
                    f"{held[0]}'s group (a supplementary group, as a pod's supplementalGroups give)",
                )
            ]
    where = (
        "; ".join(f"{path} is gid {gid}" for path, gid in sorted(journals.items()))
        if journals
        else f"and there is no journal at {' or '.join(JOURNAL_DIRS)}"
    )
    return [
        Finding(
            "kernel-log",
            "fail",
            f"the node's account {user} is neither in group systemd-journal nor in adm ({where}): journalctl "
            f"shows it only its own entries, {blind}",
            "install deploy/bcd-node.service (SupplementaryGroups=systemd-journal), "
            f"or usermod -aG systemd-journal {user}; {IN_A_POD}",
        )
    ]


def _journal_gids(host: HostView) -> dict[str, int]:
    """Each journal directory there is -> its group (systemd-journal's gid on the host)."""
    out: dict[str, int] = {}
    for path in JOURNAL_DIRS:
        try:
            st = host.path(path).stat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            out[path] = st.st_gid
    return out


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
    answer = host.run([binary, "--version"])
    text = answer.stdout.decode(errors="replace").strip() if answer.ok else ""
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


_QEMU_CONF_LINE = re.compile(r"^\s*(user|dynamic_ownership)\s*=\s*(\"[^\"]*\"|[^\s#]+)")


def _check_libvirt_qemu(config: Config, host: HostView) -> list[Finding]:
    """DLV-HLP-13 (Q-DLV-HLP-01): under the helper, where libvirt is installed, qemu.conf says
    `dynamic_ownership = 0` and QEMU's user is in the node's group, as install.sh leaves them."""
    conf = host.path("/etc/libvirt/qemu.conf")
    if not config.under_helper or not conf.is_file():
        return []
    settings: dict[str, str] = {}
    try:
        for line in conf.read_text(errors="replace").splitlines():
            m = _QEMU_CONF_LINE.match(line)
            if m:  # libvirt keeps the last of two settings
                settings[m.group(1)] = m.group(2).strip('"')
        readable = True
    except PermissionError:  # 0600 root on Debian: the node's account cannot read it
        readable = False
    except OSError:
        return []
    try:
        passwd = [line.split(":")[0] for line in host.path("/etc/passwd").read_text().splitlines()]
        groups = host.path("/etc/group").read_text().splitlines()
    except OSError:
        return []
    user = config.helper.node_user or "bcd"
    qemu = settings.get("user") or next((u for u in ("libvirt-qemu", "qemu") if u in passwd), "")
    problems: list[str] = []
    if readable and settings.get("dynamic_ownership", "1") != "0":
        problems.append(
            f"{conf.name} has dynamic_ownership = {settings.get('dynamic_ownership', '1 (the default)')}"
        )
    members = next(
        (g.split(":")[3].split(",") for g in groups if g.split(":")[0] == user and g.count(":") >= 3), []
    )
    if qemu and qemu not in members and qemu not in ("root", "+0", "0"):
        problems.append(f"QEMU's user {qemu} is not in group {user}")
    if problems:
        return [
            Finding(
                "libvirt-qemu",
                "warn",
                "; ".join(problems) + ": QEMU cannot open a direct-boot kernel the node staged",
                "run deploy/install.sh again (it sets both), then systemctl restart libvirtd",
            )
        ]
    checked = (
        "dynamic_ownership = 0, "
        if readable
        else "qemu.conf is root's (run as root to see dynamic_ownership); "
    )
    return [Finding("libvirt-qemu", "ok", f"{checked}QEMU's user {qemu or '(none)'} in group {user}")]


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
    from bcd_shared.subcommands import root_dir

    add_config_argument(parser)
    parser.add_argument(
        "--root", default="/", type=root_dir, help="the directory standing for / (a simulated host)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def render(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"{f.level:<4}  {f.id:<24} {f.message}")
        if f.fix and f.level != "ok":
            lines.append(f"{'':<6}{'':<24} fix: {f.fix}")
    # Findings quote files and tools' output: escaped, never raw.
    return "\n".join(shown(line) for line in lines) + "\n"


def to_json(findings: list[Finding], *, root: str, config: str) -> dict[str, object]:
    """The --json document (format 1; docs/operations.md "bcd doctor --json")."""
    from bcd_shared.version import VERSION

    counts = {level: sum(f.level == level for f in findings) for level in ("ok", "warn", "fail")}
    return {
        "format": JSON_FORMAT,
        "ok": counts["fail"] == 0,
        "version": VERSION,
        "root": root,
        "config": config,
        "counts": counts,
        "findings": [f.to_json() for f in findings],
    }


def run(args: argparse.Namespace) -> int:
    host = host_view(args.root, os.geteuid())
    config_path = args.config or default_config_path()
    findings = check_all(config_path, host)
    failed = any(f.level == "fail" for f in findings)
    if args.json:
        doc = to_json(findings, root=args.root, config=config_path)
        json.dump(doc, sys.stdout, indent=None, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(f"bcd doctor {VERSION}\n" + render(findings))
    return 1 if failed else 0
