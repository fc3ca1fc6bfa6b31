"""`bcd doctor`'s host findings (issue 15, item 6): nvidia-smi and the driver, /dev/kvm, cgroup v2, time sync,
the node certificate, the control plane, the helper's version, the units; ids and the --json schema; fix
texts that fit the fault; `--root` applied to every path.

A scratch directory stands for / (HostView.root); programs are fakes given to HostView.run, with output in
the form the real ones print (nvidia-smi -L: "GPU 0: <name> (UUID: GPU-...)", as in
../shared/reference/nvidia-smi; systemctl is-active/is-enabled: one word on stdout).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import pytest
from bcd_agent.doctor import JSON_FORMAT, Finding, HostView, TimeSync, check_all, read_adjtimex, to_json
from bcd_agent.node import VERSION
from bcd_agent.session import identity as ident
from bcd_shared.system import CommandResult
from testsupport import node_identity

NOW = 1_800_000_000.0
GPU_LIST = (
    b"GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f1c2a90-0000-4000-8000-000000000001)\n"
    b"GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-5f1c2a90-0000-4000-8000-000000000002)\n"
)
NO_DRIVER = (
    b"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    b"Make sure that the latest NVIDIA driver is installed and running.\n"
)


def fake_run(answers: dict[str, CommandResult]) -> Callable[[Sequence[str]], CommandResult]:
    def run(argv: Sequence[str]) -> CommandResult:
        return answers.get(" ".join(argv), CommandResult(tuple(argv), 127))

    return run


def view(root: Path, *, tools: dict[str, CommandResult] | None = None, synced: bool = True) -> HostView:
    answers = tools or {}
    names = {key.split()[0] for key in answers}
    return HostView(
        root=root,
        euid=990,
        which=lambda n: f"/usr/bin/{n}" if n in names else None,
        wall_clock=lambda: NOW,
        run=fake_run(answers),
        time_sync=lambda: TimeSync(synced, "TIME_OK" if synced else "TIME_ERROR", 16_000),
    )


def ok(argv: str, out: bytes = b"") -> CommandResult:
    return CommandResult(tuple(argv.split()), 0, out)


def config(root: Path, text: str = "") -> str:
    data = root / "var/lib/bcd"
    data.mkdir(parents=True, exist_ok=True, mode=0o700)
    data.chmod(0o700)
    (root / "etc/bcd").mkdir(parents=True, exist_ok=True)
    (root / "etc/bcd/config.toml").write_text(text)
    return "/etc/bcd/config.toml"


def by_id(findings: list[Finding]) -> dict[str, Finding]:
    out = {f.id: f for f in findings}
    assert len(out) == len(findings), [f.id for f in findings]  # ids are unique in a run
    return out


def write_identity(data: Path, not_after: float, address: str = "") -> None:
    end = dt.datetime.fromtimestamp(not_after, dt.UTC)
    ident.save(data, node_identity("node-d", end - dt.timedelta(days=365), end, address=address))


def test_nvidia_smi_and_the_driver(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    none = by_id(check_all(cfg, view(tmp_path)))["nvidia"]
    assert (none.level, none.message) == (
        "ok",
        "no NVIDIA GPU and no nvidia-smi: this host takes no GPU holds",
    )
    gpu = tmp_path / "sys/bus/pci/devices/0000:17:00.0"
    gpu.mkdir(parents=True)
    (gpu / "vendor").write_text("0x10de\n")
    (gpu / "class").write_text("0x030200\n")
    missing = by_id(check_all(cfg, view(tmp_path)))["nvidia"]
    assert (
        missing.level == "fail"
        and "0000:17:00.0" in missing.message
        and "but no nvidia-smi" in missing.message
    )
    failing = view(tmp_path, tools={"nvidia-smi -L": CommandResult(("nvidia-smi", "-L"), 9, NO_DRIVER)})
    broken = by_id(check_all(cfg, failing))["nvidia"]
    assert broken.level == "fail" and "couldn't communicate with the NVIDIA driver" in broken.message
    assert "/proc/driver/nvidia missing" in broken.message and "modprobe nvidia" in broken.fix
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    )
    good = by_id(check_all(cfg, view(tmp_path, tools={"nvidia-smi -L": ok("nvidia-smi -L", GPU_LIST)})))[
        "nvidia"
    ]
    assert good.level == "ok" and good.message.startswith(
        "nvidia-smi answers: 2 GPU(s); driver: NVRM version"
    )


def test_dev_kvm_mode_and_group(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    cfg = config(tmp_path)
    assert by_id(check_all(cfg, view(tmp_path)))["kvm"].level == "warn"  # no /dev/kvm
    (tmp_path / "dev").mkdir()
    (tmp_path / "etc/group").write_text("root:x:0:\nkvm:x:993:\n")
    kvm = tmp_path / "dev/kvm"
    os.mknod(kvm, 0o660 | 0o020000, os.makedev(10, 232))  # S_IFCHR
    os.chown(kvm, 0, 993)
    os.chmod(kvm, 0o660)
    f = by_id(check_all(cfg, view(tmp_path)))["kvm"]
    assert (f.level, f.message) == ("ok", "/dev/kvm is crw-rw---- uid 0 group kvm")
    os.chmod(kvm, 0o666)
    f = by_id(check_all(cfg, view(tmp_path)))["kvm"]
    assert f.level == "warn" and "open to every user" in f.message and "chmod 0660" in f.fix
    # root's alone (a container's /dev, a missing udev rule): no VMM opens it. Before: ok.
    os.chmod(kvm, 0o600)
    os.chown(kvm, 0, 0)
    f = by_id(check_all(cfg, view(tmp_path)))["kvm"]
    assert f.level == "warn" and f.message.startswith("/dev/kvm is crw------- uid 0 group root: QEMU")
    assert f.fix.startswith("chmod 0660 /dev/kvm and chgrp kvm /dev/kvm")
    os.chmod(kvm, 0o660)  # the group's, but not kvm's
    assert by_id(check_all(cfg, view(tmp_path)))["kvm"].level == "warn"
    kvm.unlink()
    kvm.write_text("")
    assert by_id(check_all(cfg, view(tmp_path)))["kvm"].level == "fail"  # not a character device


def test_cgroup_v2_and_its_controllers(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cg = tmp_path / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "cpu").mkdir()  # a v1 hierarchy: one directory per controller, no cgroup.controllers
    v1 = by_id(check_all(cfg, view(tmp_path)))["cgroup"]
    assert v1.level == "fail" and "v1 or hybrid" in v1.message and "unified_cgroup_hierarchy" in v1.fix
    (cg / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    partial = by_id(check_all(cfg, view(tmp_path)))["cgroup"]
    assert partial.level == "warn" and "without the hugetlb controller" in partial.message
    (cg / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    assert by_id(check_all(cfg, view(tmp_path)))["cgroup"].level == "ok"


def test_time_sync_from_adjtimex(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    synced = by_id(check_all(cfg, view(tmp_path)))["time-sync"]
    assert (synced.level, synced.message) == (
        "ok",
        "the clock is synchronized (adjtimex TIME_OK, max error 16 ms)",
    )
    unsynced = by_id(check_all(cfg, view(tmp_path, synced=False)))["time-sync"]
    assert unsynced.level == "warn" and "STA_UNSYNC" in unsynced.message and "set-ntp true" in unsynced.fix
    real = read_adjtimex()  # the real call on this machine: reads, changes nothing
    assert real is None or real.state in (
        "TIME_OK",
        "TIME_INS",
        "TIME_DEL",
        "TIME_OOP",
        "TIME_WAIT",
        "TIME_ERROR",
    )


@pytest.mark.parametrize(
    ("days_left", "level", "words"),
    [(-1.0, "fail", "expired on"), (3.0, "warn", "in 3.0 days"), (200.0, "ok", "(200 days)")],
)
def test_certificate_expiry(tmp_path: Path, days_left: float, level: str, words: str) -> None:
    cfg = config(tmp_path)
    write_identity(tmp_path / "var/lib/bcd", NOW + days_left * 86400)
    f = by_id(check_all(cfg, view(tmp_path)))["certificate"]
    assert f.level == level and words in f.message, f
    if level != "ok":
        assert "bcd join --reset" in f.fix


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "run/gw.sock"
    path.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(4)
        yield path


def test_control_plane_reachability(tmp_path: Path, listening: Path) -> None:
    unix = config(tmp_path, '[control_plane]\nunix_socket = "/run/gw.sock"\n')
    f = by_id(check_all(unix, view(tmp_path)))["control-plane"]
    assert (f.level, f.message) == ("ok", f"the control plane accepts on unix:{listening}")
    gone = config(tmp_path, '[control_plane]\nunix_socket = "/run/none.sock"\n')
    f = by_id(check_all(gone, view(tmp_path)))["control-plane"]
    assert f.level == "fail" and "cannot connect to unix:" in f.message
    with socket.socket() as tcp:
        tcp.bind(("127.0.0.1", 0))
        port = tcp.getsockname()[1]  # bound, not listening: refused
        refused = config(tmp_path, f'[control_plane]\naddress = "127.0.0.1:{port}"\n')
        f = by_id(check_all(refused, view(tmp_path)))["control-plane"]
        assert f.level == "fail" and f"cannot connect to 127.0.0.1:{port}" in f.message
        tcp.listen(1)
        assert by_id(check_all(refused, view(tmp_path)))["control-plane"].level == "ok"
    joined = config(tmp_path)
    write_identity(tmp_path / "var/lib/bcd", NOW + 90 * 86400, address=f"127.0.0.1:{port}")
    assert by_id(check_all(joined, view(tmp_path)))["control-plane"].level == "fail"  # the join's address


def _ping_server(path: Path, result: dict[str, object]) -> threading.Thread:
    """One helper.ping answered as the helper frames it (4-byte big-endian length, JSON)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(2)

    def serve() -> None:
        with server:
            for _ in range(2):  # doctor connects once to see that it accepts, then pings
                conn, _addr = server.accept()
                with conn:
                    head = conn.recv(4)
                    if len(head) < 4:
                        continue
                    (n,) = struct.unpack(">I", head)
                    conn.recv(n)
                    body = json.dumps({"ok": True, "result": result}).encode()
                    conn.sendall(struct.pack(">I", len(body)) + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("theirs", "level"), [(VERSION, "ok"), ("0.0.9", "warn"), (None, "warn")])
def test_helper_version_matches_the_node(tmp_path: Path, theirs: str | None, level: str) -> None:
    cfg = config(tmp_path, '[helper]\nsocket = "/run/bcd/helper.sock"\n')
    (tmp_path / "run/bcd").mkdir(parents=True)
    result: dict[str, object] = {"peer_uid": 0, "host_units": True}
    if theirs is not None:
        result["version"] = theirs
    thread = _ping_server(tmp_path / "run/bcd/helper.sock", result)
    findings = by_id(check_all(cfg, view(tmp_path)))
    thread.join(10)
    assert findings["helper"].level == "ok"
    f = findings["helper-version"]
    assert f.level == level, f
    if theirs == "0.0.9":
        assert f.message == f"the helper is bcd 0.0.9, the node bcd {VERSION}" and "together" in f.fix


def test_units_inactive_with_an_unsealed_audit_log_say_audit_init_first(tmp_path: Path) -> None:
    """Found on the install pass: doctor's fix for an inactive helper, `systemctl enable --now`, would
    have started it before `bcd-helper audit init` (sealing with a key no one holds); the node's too, as
    its unit Wants= the helper's. Now both fixes start with `audit init` while the log is unsealed."""
    cfg = config(tmp_path, '[helper]\nsocket = "/run/bcd/helper.sock"\n')
    (tmp_path / "var/lib/bcd/identity.json").write_text("{}")  # joined
    tools = {
        f"systemctl {verb} {unit}": ok("systemctl", b"inactive\n" if verb == "is-active" else b"disabled\n")
        for verb in ("is-active", "is-enabled")
        for unit in ("bcd-helper.service", "bcd-node.service")
    }
    seal = (
        "the helper's audit log is not sealed: bcd-helper audit init first (as root; keep the key it prints"
    )
    found = by_id(check_all(cfg, view(tmp_path, tools=tools)))
    for unit in ("bcd-helper.service", "bcd-node.service"):
        fix = found[f"units/{unit}"].fix
        assert fix.startswith(seal) and fix.endswith(f"then systemctl enable --now {unit}"), fix
    (tmp_path / "var/log/bcd-helper").mkdir(parents=True)
    (tmp_path / "var/log/bcd-helper/audit.key").write_bytes(b"")
    found = by_id(check_all(cfg, view(tmp_path, tools=tools)))
    assert found["units/bcd-helper.service"].fix == "systemctl enable --now bcd-helper.service"


def test_units_state(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    (tmp_path / "var/lib/bcd/identity.json").write_text("{}")  # joined
    tools = {
        "systemctl is-active bcd-helper.service": ok("systemctl", b"active\n"),
        "systemctl is-enabled bcd-helper.service": ok("systemctl", b"enabled\n"),
        "systemctl is-active bcd-node.service": CommandResult(("systemctl",), 3, b"failed\n"),
        "systemctl is-enabled bcd-node.service": ok("systemctl", b"enabled\n"),
    }
    found = by_id(check_all(cfg, view(tmp_path, tools=tools)))
    assert found["units/bcd-helper.service"].level == "ok"
    node = found["units/bcd-node.service"]
    assert (node.level, node.message) == ("fail", "bcd-node.service is failed (enabled)")
    assert "journalctl -u bcd-node.service" in node.fix
    # Not joined: the node exits 78 and stays down until `bcd join` ran; the fix says so first.
    (tmp_path / "var/lib/bcd/identity.json").unlink(missing_ok=True)
    unjoined = by_id(check_all(cfg, view(tmp_path, tools=tools)))["units/bcd-node.service"]
    assert unjoined.fix == (
        "not joined: bcd join --token=TOKEN --address HOST:PORT first (as root), then "
        "systemctl restart bcd-node.service"
    )
    offline = {
        "systemctl is-active bcd-helper.service": CommandResult(
            ("systemctl",),
            1,
            b"",
            b"System has not been booted with systemd as init system (PID 1). Can't operate.\n",
        )
    }
    [units] = [f for f in check_all(cfg, view(tmp_path, tools=offline)) if f.check == "units"]
    assert (
        units.level == "ok"
        and "not checked" in units.message
        and "not been booted with systemd" in units.message
    )
    # systemd is PID 1 (/run/systemd/system) and systemctl still cannot reach it: not ok. Before: ok.
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    unreachable = {
        "systemctl is-active bcd-helper.service": CommandResult(
            ("systemctl",), 1, b"", b"Failed to connect to bus\n"
        )
    }
    [units] = [f for f in check_all(cfg, view(tmp_path, tools=unreachable)) if f.check == "units"]
    assert (
        units.level == "warn"
        and "systemd runs, but systemctl cannot reach it: Failed to connect" in units.message
    )


def test_fix_texts_fit_the_fault(tmp_path: Path) -> None:
    """A missing data_dir is created, not chmod-ed; a file in its place is moved aside; an unreadable config
    is a question of who runs doctor, not of writing the file again."""
    (tmp_path / "etc/bcd").mkdir(parents=True)
    (tmp_path / "etc/bcd/config.toml").write_text('data_dir = "/srv/bcd"\n')
    missing = by_id(check_all("/etc/bcd/config.toml", view(tmp_path)))["data-dir"]
    assert missing.fix.startswith(f"create it: install -d -m 0700 -o bcd -g bcd {tmp_path}/srv/bcd")
    assert "chmod" not in missing.fix
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv/bcd").write_text("")
    a_file = by_id(check_all("/etc/bcd/config.toml", view(tmp_path)))["data-dir"]
    assert a_file.message.endswith("is not a directory") and a_file.fix.startswith(
        f"move the file aside (mv {tmp_path}"
    )
    assert "chmod" not in a_file.fix
    absent = by_id(check_all("/etc/bcd/none.toml", view(tmp_path)))["config"]
    assert "deploy/install.sh" in absent.fix
    if os.geteuid() == 0:
        return  # root reads a 0600 file anyway; the EACCES case needs another user (below)
    (tmp_path / "etc/bcd/config.toml").chmod(0)
    denied = by_id(check_all("/etc/bcd/config.toml", view(tmp_path)))["config"]
    assert "permission denied" in denied.message and "install.sh" not in denied.fix


def test_an_unreadable_config_fix_names_the_group(tmp_path: Path) -> None:
    """EACCES, as an operator outside the bcd group sees it: root without CAP_DAC_OVERRIDE."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop the capability")
    from testsupport import require_tool

    setpriv = require_tool("setpriv")
    cfg = tmp_path / "etc/bcd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('data_dir = "/var/lib/bcd"\n')
    os.chown(cfg, 54321, 54321)
    cfg.chmod(0o640)
    os.chmod(tmp_path, 0o755)
    res = subprocess.run(
        [setpriv, "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m", "bcd_agent.cli",
         "doctor", "--root", str(tmp_path), "--config", "/etc/bcd/config.toml", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    doc = json.loads(res.stdout)
    [config_finding] = [f for f in doc["findings"] if f["id"] == "config"]
    assert config_finding["level"] == "fail" and "permission denied" in config_finding["message"]
    assert "bcd group" in config_finding["fix"] and "install.sh" not in config_finding["fix"]


def test_root_applies_to_config_and_data_dir(tmp_path: Path) -> None:
    """The same host path under two roots reads two different hosts."""
    a, b = tmp_path / "a", tmp_path / "b"
    config(a)
    config(b, "[journal]\nmax_events = 20000\n")
    (b / "var/lib/bcd").chmod(0o755)
    fa, fb = (
        by_id(check_all("/etc/bcd/config.toml", view(a))),
        by_id(check_all("/etc/bcd/config.toml", view(b))),
    )
    assert fa["config"].level == "ok" and fa["config"].message == f"{a}/etc/bcd/config.toml parses"
    assert fa["data-dir"].level == "ok" and str(a / "var/lib/bcd") in fa["data-dir"].message
    assert fb["config"].level == "fail" and "max_events" in fb["config"].message
    assert fb["data-dir"].level == "fail" and "0755" in fb["data-dir"].message


def test_json_schema(tmp_path: Path) -> None:
    """Format 1 (docs/operations.md): the keys and their types, and the exit status, through the CLI."""
    root = tmp_path / "host"
    config(root)
    res = subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", "doctor", "--root", str(root),
         "--config", "/etc/bcd/config.toml", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    doc = json.loads(res.stdout)
    assert set(doc) == {"format", "ok", "version", "root", "config", "counts", "findings"}
    assert doc["format"] == JSON_FORMAT == 1 and doc["version"] == VERSION
    assert (doc["root"], doc["config"]) == (str(root), "/etc/bcd/config.toml")
    assert set(doc["counts"]) == {"ok", "warn", "fail"}
    assert sum(doc["counts"].values()) == len(doc["findings"])
    for f in doc["findings"]:
        assert set(f) == {"id", "check", "subject", "level", "message", "fix"}
        assert f["level"] in ("ok", "warn", "fail")
        assert f["id"] == (f"{f['check']}/{f['subject']}" if f["subject"] else f["check"])
    assert len({f["id"] for f in doc["findings"]}) == len(doc["findings"])
    assert doc["ok"] is (doc["counts"]["fail"] == 0) and res.returncode == (0 if doc["ok"] else 1)
    assert to_json([Finding("x", "fail", "m")], root="/", config="c")["ok"] is False


def test_kernel_log_readable_by_the_node_on_a_gpu_host(tmp_path: Path) -> None:
    """`kernel-log`: the XID watcher reads the kernel's journal entries; on a GPU host the node's account
    needs journalctl and group systemd-journal (or adm), by /etc/group or the unit's SupplementaryGroups=."""
    cfg = config(tmp_path)
    assert "kernel-log" not in by_id(check_all(cfg, view(tmp_path)))  # no GPU: no XIDs to read
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidia0").write_text("")
    data = tmp_path / "var/lib/bcd"
    if os.geteuid() == 0:  # the node runs as the owner of data_dir: an account, not root
        os.chown(data, 990, 990)
    uid = data.stat().st_uid
    (tmp_path / "etc/passwd").write_text(f"root:x:0:0::/root:/bin/sh\nbcd:x:{uid}:{uid}::/:/sbin/nologin\n")
    (tmp_path / "etc/group").write_text("adm:x:4:syslog\nsystemd-journal:x:101:\n")
    missing = by_id(check_all(cfg, view(tmp_path)))["kernel-log"]
    assert missing.level == "fail" and missing.message.startswith("no journalctl")
    tools = {"journalctl --version": ok("journalctl --version", b"systemd 252 (252.39-1~deb12u2)\n")}
    blind = by_id(check_all(cfg, view(tmp_path, tools=tools)))["kernel-log"]
    assert blind.level == "fail" and "account bcd is neither in group systemd-journal" in blind.message
    assert (
        "SupplementaryGroups=systemd-journal" in blind.fix and "usermod -aG systemd-journal bcd" in blind.fix
    )
    unit = tmp_path / "lib/systemd/system/bcd-node.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nUser=bcd\nSupplementaryGroups=systemd-journal\n")
    # The unit file alone grants nothing where systemd does not run the node (the DaemonSet's image
    # carries the packaged unit): before, this passed in a pod whatever its groups.
    assert by_id(check_all(cfg, view(tmp_path, tools=tools)))["kernel-log"].level == "fail"
    (tmp_path / "run/systemd/system").mkdir(parents=True)  # systemd is PID 1 here
    granted = by_id(check_all(cfg, view(tmp_path, tools=tools)))["kernel-log"]
    assert granted.level == "ok" and "SupplementaryGroups=systemd-journal" in granted.message
    unit.write_text("[Service]\nUser=bcd\nSupplementaryGroups=systemd-journal\nSupplementaryGroups=\n")
    assert by_id(check_all(cfg, view(tmp_path, tools=tools)))["kernel-log"].level == "fail"  # reset by =
    (tmp_path / "etc/group").write_text("adm:x:4:syslog,bcd\nsystemd-journal:x:101:\n")
    member = by_id(check_all(cfg, view(tmp_path, tools=tools)))["kernel-log"]
    assert member.level == "ok" and "(group adm)" in member.message
    if os.geteuid() == 0:
        os.chown(data, 0, 0)
        (tmp_path / "etc/group").write_text("")
        as_root = by_id(check_all(cfg, view(tmp_path, tools=tools)))["kernel-log"]
        assert as_root.level == "ok" and "runs as root" in as_root.message


def test_kernel_log_in_a_pod_reads_the_journal_through_its_supplementary_group(tmp_path: Path) -> None:
    """`kernel-log` in the DaemonSet's node container (doctor as the node's uid): no /etc/group entry and no
    unit grant the journal, the pod's supplementalGroups do. ok when this process holds the gid of the
    journal directory; else fail naming that gid, with a fix for the DaemonSet too. Before: fail whatever
    the pod's groups, with only the systemd fixes (SupplementaryGroups=, usermod)."""
    cfg = config(tmp_path)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidia0").write_text("")
    data = tmp_path / "var/lib/bcd"
    if os.geteuid() == 0:
        os.chown(data, 990, 990)
    uid = data.stat().st_uid
    (tmp_path / "etc/passwd").write_text(f"bcd:x:{uid}:{uid}::/:/sbin/nologin\n")
    (tmp_path / "etc/group").write_text("systemd-journal:x:999:\n")  # the image's group, no members
    journal = tmp_path / "var/log/journal"
    journal.mkdir(parents=True)
    gid = journal.stat().st_gid
    tools = {"journalctl --version": ok("journalctl --version", b"systemd 252\n")}

    def finding(groups: list[int]) -> Finding:
        host = view(tmp_path, tools=tools)
        return by_id(check_all(cfg, HostView(**{**attrs.asdict(host, recurse=False), "euid": uid,
                                                 "groups": lambda: groups})))["kernel-log"]  # fmt: skip

    held = finding([gid])
    assert held.level == "ok" and f"gid {gid}" in held.message and "/var/log/journal" in held.message
    missing = finding([])
    assert missing.level == "fail" and f"/var/log/journal is gid {gid}" in missing.message
    assert "supplementalGroups" in missing.fix and "deploy/kubernetes/bcd-daemonset.yaml" in missing.fix
    journal.rmdir()
    gone = finding([gid])
    assert gone.level == "fail" and "no journal at /var/log/journal or /run/log/journal" in gone.message
    assert "/var/log, /run/log and /etc/machine-id" in gone.fix
