"""deploy/: the systemd units (verified and scored by the real systemd-analyze), install.sh run for
real into a scratch root, and the Kubernetes DaemonSet manifest."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from bcd_agent.config import parse_config
from bcd_shared.version import VERSION
from testsupport import REPO, require_tool, systemd_root
from testsupport import systemd_verify as verify

DEPLOY = REPO / "deploy"
UNITS = ("bcd-node.service", "bcd-helper.service")
# docs/deploy.md records the scores; these are the targets.
EXPOSURE_TARGETS = {"bcd-node.service": 2.0, "bcd-helper.service": 5.0}
PROGRAMS = ("/usr/bin/bcd", "/usr/bin/bcd-helper")


def unit_settings(name: str) -> dict[str, list[str]]:
    """`Key=value` lines of a unit file (keys may repeat, as in systemd)."""
    out: dict[str, list[str]] = {}
    for line in (DEPLOY / name).read_text().splitlines():
        if not line or line.startswith(("#", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


def scratch_root(tmp_path: Path, *, programs: bool = True) -> Path:
    """A directory standing for / with the system's own units (so targets resolve), the two units,
    and, unless told otherwise, executable stand-ins for the programs the units run: the real
    programs are installed by the package, not by the units, and verify checks ExecStart exists."""
    root = systemd_root(tmp_path, PROGRAMS if programs else ())
    for unit in UNITS:
        shutil.copy(DEPLOY / unit, root / "etc/systemd/system" / unit)
    return root


@pytest.mark.realhost
@pytest.mark.parametrize("unit", UNITS)
def test_units_pass_systemd_analyze_verify(tmp_path: Path, unit: str) -> None:
    result = verify(scratch_root(tmp_path), unit)
    assert result.stderr == ""
    assert result.returncode == 0


@pytest.mark.realhost
def test_verify_really_checks_the_programs(tmp_path: Path) -> None:
    """The stand-ins matter: without them verify refuses the unit (so the check above is live)."""
    result = verify(scratch_root(tmp_path, programs=False), "bcd-node.service")
    assert "/usr/bin/bcd is not executable" in result.stderr


@pytest.mark.realhost
@pytest.mark.parametrize("unit", UNITS)
def test_exposure_scores_stay_within_target(unit: str) -> None:
    tool = require_tool("systemd-analyze")
    result = subprocess.run(
        [tool, "security", "--offline=true", "--no-pager", str(DEPLOY / unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(rf"Overall exposure level for {re.escape(unit)}: (\d+\.\d+)", result.stdout)
    assert m is not None, result.stdout[-2000:] + result.stderr
    score = float(m.group(1))
    assert score <= EXPOSURE_TARGETS[unit]
    recorded = (REPO / "docs" / "deploy.md").read_text()
    assert f"| `{unit}` | {score:.1f} |" in recorded, "docs/deploy.md must record the current score"


def test_node_unit_is_unprivileged_notify_with_a_watchdog() -> None:
    s = unit_settings("bcd-node.service")
    assert s["Type"] == ["notify"]
    assert s["User"] == ["bcd"] and s["Group"] == ["bcd"]
    assert re.fullmatch(r"\d+s?", s["WatchdogSec"][0])
    assert s["ExecStart"][0].startswith("/usr/bin/bcd node ")
    assert s["CapabilityBoundingSet"] == [""]
    assert s["NoNewPrivileges"] == ["yes"]
    assert s["StateDirectory"] == ["bcd"] and s["StateDirectoryMode"] == ["0700"]
    # The XID watcher reads the kernel's journal entries (docs/devices.md "XID errors"), nothing more.
    assert s["SupplementaryGroups"] == ["systemd-journal"]


def test_units_order_notify_and_stop_restarting_on_config_errors() -> None:
    """Issue 15: the helper is Type=notify (READY=1 once its socket is bound) and the node wants it and
    starts after it; a node that exits 78 (EX_CONFIG: not joined, bad config) is not restarted."""
    helper = unit_settings("bcd-helper.service")
    assert helper["Type"] == ["notify"] and helper["NotifyAccess"] == ["main"]
    node = unit_settings("bcd-node.service")
    assert "bcd-helper.service" in node["Wants"][0].split()
    assert "bcd-helper.service" in node["After"][0].split()
    assert node["RestartPreventExitStatus"] == ["78"]
    # The helper exits 78 too (root's config missing, refused, or not root's own); without this line
    # systemd 252 restarted it every 2 s for as long as the config stayed wrong (seen under nspawn).
    assert helper["RestartPreventExitStatus"] == ["78"]


def test_helper_unit_runs_the_helper_as_root_and_keeps_the_holds_env_files() -> None:
    s = unit_settings("bcd-helper.service")
    assert "User" not in s
    assert s["ExecStart"][0].startswith("/usr/bin/bcd-helper serve ")
    assert s["RuntimeDirectory"] == ["bcd"] and s["RuntimeDirectoryPreserve"] == ["yes"]
    assert s["NoNewPrivileges"] == ["yes"]


# --- install.sh ----------------------------------------------------------------------------------


def run_install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    for tool in ("useradd", "groupadd", "install"):
        require_tool(tool)
    return subprocess.run(
        ["bash", str(DEPLOY / "install.sh"), "--root", str(root), "--no-enable", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_install_help_is_the_usage_and_nothing_of_the_script() -> None:
    """`install.sh --help` prints its header comment (the usage included), uncommented, and no code."""
    out = subprocess.run(
        ["bash", str(DEPLOY / "install.sh"), "--help"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    lines = out.splitlines()
    assert lines[0].startswith("Install bcd on a host")
    assert lines[-1].strip() == "[--no-helper] [--no-enable] [--replace]"
    assert "set -euo pipefail" not in out and "ROOT=" not in out
    assert not any(line.startswith("#") for line in lines)


@pytest.mark.parametrize(
    "flag", ["--root", "--join-signing-key-pin", "--control-plane", "--allowed-clusters"]
)
def test_install_flag_without_its_value_is_one_line_naming_it(flag: str) -> None:
    """Before, bash's own `${2:?}` error named a line number of the script and exited 1."""
    done = subprocess.run(
        ["bash", str(DEPLOY / "install.sh"), "--no-enable", flag], capture_output=True, text=True, timeout=10
    )
    assert done.returncode == 2
    assert done.stderr == f"install.sh: {flag} needs a value (see install.sh --help)\n"


def owner_mode(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def account(root: Path, name: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2]), int(fields[3])
    raise AssertionError(f"no {name} in {root}/etc/passwd")


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_lays_out_the_account_directories_and_roots_config(tmp_path: Path) -> None:
    """Covers HST-HLP-29 (root:bcd 0640 in /etc/bcd 0750, accepted by the helper's own reader)."""
    root = tmp_path / "host"
    pin = "sha256/" + "A" * 43 + "="
    result = run_install(root, "--join-signing-key-pin", pin, "--host-units-external")
    assert result.returncode == 0, result.stderr
    uid, gid = account(root, "bcd")
    assert uid != 0 and gid != 0
    assert owner_mode(root / "etc/bcd") == (0, gid, 0o750)
    config = root / "etc/bcd/config.toml"
    assert owner_mode(config) == (0, gid, 0o640) and config.is_file() and not config.is_symlink()
    assert owner_mode(root / "var/lib/bcd") == (uid, gid, 0o700)
    assert owner_mode(root / "var/lib/bcd-hostconfig") == (0, 0, 0o700)
    assert owner_mode(root / "var/log/bcd-helper") == (0, 0, 0o700)
    for unit in UNITS:
        assert (root / "etc/systemd/system" / unit).read_bytes() == (DEPLOY / unit).read_bytes()
        assert owner_mode(root / "etc/systemd/system" / unit) == (0, 0, 0o644)

    node = parse_config(config.read_text(), str(config))
    assert node.host.units is False
    assert str(node.join_signing_key_pin) == pin
    assert node.helper.socket == "/run/bcd/helper.sock"

    helper_config = pytest.importorskip("bcd_helper.config")
    # The helper's ownership rules on the real file (regular, root-owned, no group/other write,
    # root-only directories from the scratch root down).
    data = helper_config.read_root_config(root, "/etc/bcd/config.toml")
    # node_user resolves against the real passwd database, where the scratch account is absent.
    as_root = helper_config.parse_config(data.replace(b'node_user = "bcd"', f"node_uid = {uid}".encode()))
    assert as_root.host_units is False and as_root.node_uid == uid


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_again_keeps_the_config_puts_modes_right_and_leaves_libvirt(tmp_path: Path) -> None:
    """HST-HLP-30/32: a config made writable by the node's group is put back to root:bcd 0640; an
    account an older install left in the root-equivalent libvirt group is taken out."""
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "etc/group").write_text("libvirt:x:120:qemu,bcd\n")
    assert run_install(root).returncode == 0
    uid, gid = account(root, "bcd")
    assert "libvirt:x:120:qemu\n" in (root / "etc/group").read_text()
    config = root / "etc/bcd/config.toml"
    config.write_text(config.read_text() + '\n[log]\nlevel = "debug"\n')
    os.chown(config, uid, gid)
    config.chmod(0o664)
    result = run_install(root)
    assert result.returncode == 0, result.stderr
    assert "kept the existing" in result.stdout
    assert 'level = "debug"' in config.read_text()
    assert owner_mode(config) == (0, gid, 0o640)
    assert account(root, "bcd") == (uid, gid)  # the account is not made twice
    assert [line.split(":")[0] for line in (root / "etc/passwd").read_text().splitlines()].count("bcd") == 1


# Debian 12's libvirt-daemon-system ships qemu.conf with these lines commented (libvirt 9.0.0,
# /etc/libvirt/qemu.conf lines 519-528 on this machine); the rest of the file is comments.
QEMU_CONF = """# Some examples of valid values are:
#user = "libvirt-qemu"
#group = "libvirt-qemu"

# Whether libvirt should dynamically change file ownership
# to match the configured user/group above. Defaults to 1.
# Set to 0 to disable file ownership changes.
#dynamic_ownership = 1
"""


def _libvirt_host(root: Path, qemu_conf: str = QEMU_CONF) -> Path:
    (root / "etc/libvirt").mkdir(parents=True)
    (root / "etc/passwd").write_text(
        "libvirt-qemu:x:64055:107:Libvirt Qemu,,,:/var/lib/libvirt:/usr/sbin/nologin\n"
    )
    (root / "etc/group").write_text("kvm:x:107:\nlibvirt-qemu:x:64055:libvirt-qemu\n")
    (root / "etc/gshadow").write_text("kvm:!::\nlibvirt-qemu:!::libvirt-qemu\n")
    conf = root / "etc/libvirt/qemu.conf"
    conf.write_text(qemu_conf)
    conf.chmod(0o600)
    return conf


def _members(path: Path, group: str) -> list[str]:
    for line in path.read_text().splitlines():
        fields = line.split(":")
        if fields[0] == group:
            return [m for m in fields[3].split(",") if m]
    raise AssertionError(f"no group {group} in {path}")


def _active(conf: Path, key: str) -> list[str]:
    return [line.strip() for line in conf.read_text().splitlines() if re.match(rf"\s*{key}\s*=", line)]


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_under_the_helper_gives_libvirt_no_dynamic_ownership_and_qemu_the_nodes_group_dlv_hlp_13(
    tmp_path: Path,
) -> None:
    """DLV-HLP-13: where libvirt is installed, install.sh sets `dynamic_ownership = 0` in qemu.conf
    (appended: the shipped line is a comment) and puts QEMU's user (the distribution's libvirt-qemu, as
    qemu.conf names none) in the node's group, in group and gshadow; the file keeps its mode; a re-run
    changes nothing and says nothing; the operator is told to restart libvirtd."""
    root = tmp_path / "host"
    conf = _libvirt_host(root)
    result = run_install(root)
    assert result.returncode == 0, result.stderr
    assert _active(conf, "dynamic_ownership") == ["dynamic_ownership = 0"]
    assert conf.read_text().startswith(QEMU_CONF) and stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert _members(root / "etc/group", "bcd") == ["libvirt-qemu"]
    assert _members(root / "etc/gshadow", "bcd") == ["libvirt-qemu"]
    assert _members(root / "etc/group", "libvirt-qemu") == ["libvirt-qemu"]  # other groups untouched
    assert "added QEMU's user libvirt-qemu to group bcd" in result.stdout
    assert "systemctl restart libvirtd" in result.stdout
    before = conf.read_bytes(), (root / "etc/group").read_bytes()
    again = run_install(root)
    assert again.returncode == 0, again.stderr
    assert (conf.read_bytes(), (root / "etc/group").read_bytes()) == before
    assert "qemu" not in again.stdout and "libvirtd" not in again.stdout


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_rewrites_every_active_dynamic_ownership_and_takes_qemu_confs_user(tmp_path: Path) -> None:
    """libvirt's reader keeps the last of two settings: both lines become 0. qemu.conf's own `user`
    is the account added (not the distribution's default)."""
    root = tmp_path / "host"
    conf = _libvirt_host(
        root, QEMU_CONF + 'user = "vmm"\ndynamic_ownership = 1\n  dynamic_ownership=1 # again\n'
    )
    (root / "etc/passwd").write_text(
        (root / "etc/passwd").read_text() + "vmm:x:5000:5000::/:/usr/sbin/nologin\n"
    )
    assert run_install(root).returncode == 0
    assert _active(conf, "dynamic_ownership") == ["dynamic_ownership = 0", "dynamic_ownership = 0"]
    assert _members(root / "etc/group", "bcd") == ["vmm"]


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
@pytest.mark.parametrize(
    ("user_line", "warning"),
    [
        ('user = "root"\n', "runs QEMU as root"),
        ('user = "+0"\n', "runs QEMU as root"),
        ('user = "ghost"\n', "has no account here"),
    ],
)
def test_install_never_adds_root_or_a_missing_account_to_the_nodes_group(
    tmp_path: Path, user_line: str, warning: str
) -> None:
    root = tmp_path / "host"
    conf = _libvirt_host(root, QEMU_CONF + user_line)
    result = run_install(root)
    assert result.returncode == 0 and warning in result.stderr
    assert _members(root / "etc/group", "bcd") == []
    assert _active(conf, "dynamic_ownership") == ["dynamic_ownership = 0"]


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_without_the_helper_or_without_libvirt_leaves_qemu_alone(tmp_path: Path) -> None:
    """--no-helper: the node as root drives libvirt itself (DLV-QFA-01..02: dynamic ownership and o+x);
    no qemu.conf: nothing made."""
    root = tmp_path / "host"
    conf = _libvirt_host(root)
    assert run_install(root, "--no-helper").returncode == 0
    assert conf.read_text() == QEMU_CONF and _members(root / "etc/group", "bcd") == []
    other = tmp_path / "bare"
    assert run_install(other).returncode == 0
    assert not (other / "etc/libvirt").exists()


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_refuses_values_that_would_break_out_of_toml(tmp_path: Path) -> None:
    result = run_install(tmp_path / "host", "--control-plane", 'gw:1"\nunits = false')
    assert result.returncode == 2
    assert "quote" in result.stderr
    assert not (tmp_path / "host/etc/bcd/config.toml").exists()


def test_install_run_with_sh_says_bash(tmp_path: Path) -> None:
    """`sh install.sh` (dash on Debian) stopped with `set: Illegal option -o pipefail`."""
    done = subprocess.run(
        ["sh", str(DEPLOY / "install.sh"), "--root", str(tmp_path / "host")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == f"install.sh: run it with bash (bash {DEPLOY / 'install.sh'} ...), not sh\n"
    assert not (tmp_path / "host").exists()


def test_install_without_python_311_refuses_before_writing(tmp_path: Path) -> None:
    """The packages depend on python3.11, which brings no /usr/bin/python3: install.sh takes either,
    and with neither it refuses in one line before it writes anything."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("id", "dirname"):
        (bin_dir / tool).symlink_to(require_tool(tool))
    done = subprocess.run(
        ["/bin/bash", str(DEPLOY / "install.sh"), "--root", str(tmp_path / "host"), "--no-enable"],
        capture_output=True, text=True, timeout=30, env={"PATH": str(bin_dir)},
    )  # fmt: skip
    if os.geteuid() != 0:
        assert done.stderr == "install.sh: must run as root\n"
        return
    assert done.returncode == 2
    assert done.stderr.startswith("install.sh: Python 3.11 or later is needed"), done.stderr
    assert not (tmp_path / "host").exists()


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_without_the_helpers_unit_refuses_before_writing_or_takes_no_helper(tmp_path: Path) -> None:
    """Only bcd-node installed (the script is /usr/share/bcd/install.sh, beside no unit): without
    --no-helper it refuses, naming the package and the flag, before it writes anything; with
    --no-helper it installs the node alone and says nothing of the helper's program."""
    script = tmp_path / "share/install.sh"
    script.parent.mkdir()
    shutil.copy(DEPLOY / "install.sh", script)
    root = tmp_path / "host"
    (root / "lib/systemd/system").mkdir(parents=True)
    shutil.copy(DEPLOY / "bcd-node.service", root / "lib/systemd/system")
    argv = ["bash", str(script), "--root", str(root), "--no-enable"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == (
        "install.sh: bcd-helper.service: not installed by a package (dpkg -i bcd-helper_VERSION_ARCH.deb)"
        " and not beside this script (or --no-helper, for a node without the root helper)\n"
    )
    assert not (root / "etc").exists()
    done = subprocess.run([*argv, "--no-helper"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "bcd-node.service comes from the package" in done.stdout
    assert "bcd-helper" not in done.stderr and not (root / "etc/systemd/system/bcd-node.service").exists()
    assert "[helper]" not in (root / "etc/bcd/config.toml").read_text()


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_warns_of_a_copy_in_etc_that_hides_the_packages_unit(tmp_path: Path) -> None:
    root = tmp_path / "host"
    for d in ("lib/systemd/system", "etc/systemd/system"):
        (root / d).mkdir(parents=True)
        for unit in UNITS:
            shutil.copy(DEPLOY / unit, root / d / unit)
    done = run_install(root)
    assert done.returncode == 0, done.stderr
    for unit in UNITS:
        assert f"install.sh: warning: {root}/etc/systemd/system/{unit} (an earlier install" in done.stderr


# --- Kubernetes -----------------------------------------------------------------------------------


def test_daemonset_manifest() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "bcd-daemonset.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"}
    config = parse_config(kinds["ConfigMap"]["data"]["config.toml"], "configmap")
    assert config.host.units is False  # the cluster's GPU operator owns the host (DLV-CONV-12)
    assert config.helper.socket == "/run/bcd/helper.sock"
    spec = kinds["DaemonSet"]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    node = containers["node"]["securityContext"]
    assert node["runAsNonRoot"] is True and node["runAsUser"] == config.helper.node_uid
    assert node["allowPrivilegeEscalation"] is False and node["capabilities"]["drop"] == ["ALL"]
    assert node["readOnlyRootFilesystem"] is True
    assert containers["helper"]["command"][:2] == ["bcd-helper", "serve"]
    assert containers["node"]["command"][:2] == ["bcd", "node"]
    # Root's config reaches the host as a regular file, not the ConfigMap's symlinks.
    init = {c["name"]: c for c in spec["initContainers"]}
    assert [c["name"] for c in spec["initContainers"]] == ["config", "join"]
    cmd = init["config"]["command"][-1]
    assert "install -o 0 -g 990 -m 0640 /config/config.toml /host/etc/bcd/config.toml" in cmd
    mounted = {m["name"] for c in spec["containers"] + spec["initContainers"] for m in c["volumeMounts"]}
    assert mounted <= {v["name"] for v in spec["volumes"]}


def _daemonset() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "bcd-daemonset.yaml").read_text()))
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    spec: dict[str, Any] = ds["spec"]["template"]["spec"]
    return spec


def _mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def test_daemonset_joins_once_with_the_token_from_a_secret() -> None:
    """Issue 15: an init container, after `config`, runs `bcd join` with the token (and address) from the
    Secret bcd-join, as root so root's join record is written, then hands data_dir to the node's uid."""
    spec = _daemonset()
    join = spec["initContainers"][1]
    script = join["command"][-1]
    assert join["command"][:2] == ["/bin/sh", "-ec"]
    assert (
        'bcd join --token="$BCD_JOIN_TOKEN" --address "$BCD_JOIN_ADDRESS" --config /etc/bcd/config.toml'
        in script
    )
    assert "chown -R 990:990 /var/lib/bcd" in script
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in join["env"]}
    assert env == {
        "BCD_JOIN_TOKEN": {"name": "bcd-join", "key": "token"},
        "BCD_JOIN_ADDRESS": {"name": "bcd-join", "key": "address"},
    }
    assert join["securityContext"]["runAsUser"] == 0
    assert join["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["CHOWN", "FOWNER", "DAC_OVERRIDE"],
    }
    mounts = _mounts(join)
    assert mounts["/etc/bcd"]["readOnly"] is True
    assert {"/var/lib/bcd", "/var/lib/bcd-hostconfig"} <= set(mounts)
    # `bcd join` takes these options (the CLI's own parser), so the script is not a guess.
    help_text = subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", "join", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "--token" in help_text and "--address" in help_text and "--config" in help_text


def test_daemonset_probes_resources_and_gpu_access() -> None:
    """The node's probes run `bcd status --check`; every container has requests and a memory limit; the
    pod runs under the NVIDIA runtime with the variables that give the node the GPU device nodes and
    the driver's tools, and the node reads the host's sysfs read-only."""
    spec = _daemonset()
    containers = {c["name"]: c for c in spec["containers"]}
    node = containers["node"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = node[probe]["exec"]["command"]
        assert cmd[:3] == ["bcd", "status", "--check"], probe
        assert "--config" in cmd and cmd[cmd.index("--config") + 1] == "/etc/bcd/config.toml"
        assert node[probe]["timeoutSeconds"] >= 5
    for c in spec["containers"] + spec["initContainers"]:
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], c["name"]
        assert c["resources"]["limits"]["memory"], c["name"]
    assert spec["runtimeClassName"] == "nvidia"
    for name in ("node", "helper"):
        env = {e["name"]: e["value"] for e in containers[name]["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]
    mounts = _mounts(node)
    assert mounts["/sys"]["readOnly"] is True and mounts["/etc/cdi"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/sys"]["name"]]["hostPath"]["path"] == "/sys"
    helper = _mounts(containers["helper"])
    assert volumes[helper["/dev"]["name"]]["hostPath"]["path"] == "/dev"


def test_daemonset_node_reads_the_hosts_journal() -> None:
    """The XID watcher runs journalctl in the node container: it needs the host's journal (/var/log/journal,
    /run/log/journal, through their parents), the host's machine id (journalctl reads only that machine's
    files), read-only, and the journal's group as a supplementary group of the pod; the image has
    journalctl. Before: no journal was mounted, and the node saw no XID errors."""
    spec = _daemonset()
    node = {c["name"]: c for c in spec["containers"]}["node"]
    mounts = _mounts(node)
    volumes = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    for path in ("/var/log", "/run/log", "/etc/machine-id"):
        assert mounts[path]["readOnly"] is True, path
        assert volumes[mounts[path]["name"]]["path"] == path
    # Never created on a host: a /var/log/journal made by the runtime would turn journald persistent.
    assert volumes[mounts["/var/log"]["name"]]["type"] == "Directory"
    assert volumes[mounts["/etc/machine-id"]["name"]]["type"] == "File"
    groups = spec["securityContext"]["supplementalGroups"]
    assert len(groups) == 1 and isinstance(groups[0], int) and groups[0] > 0
    assert node["securityContext"]["runAsNonRoot"] is True  # the group, not root, grants the read
    containerfile = (DEPLOY / "kubernetes" / "Containerfile").read_text()
    install = re.search(r"apt-get install[^&]*", containerfile)
    assert install and re.search(r"\ssystemd\s", install.group(0))  # Debian's journalctl
    assert "journalctl --version" in containerfile


def _journal_check(root: Path) -> str:
    """The `config` init container's journal check, reading `root` for the host's /var/log and /run/log."""
    script = _daemonset()["initContainers"][0]["command"][-1]
    start = script.index('groups=" $(id -G) "')
    end = script.index("done", start) + len("done")
    return script[start:end].replace("/host-log", str(root))


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a scratch journal directory another group")
def test_daemonset_refuses_a_pod_whose_groups_miss_the_journals(tmp_path: Path) -> None:
    """The `config` init container compares the host journal's group with the pod's groups (its
    supplementalGroups) and stops the pod naming both and the fix, unless BCD_KERNEL_LOG=optional."""
    journal = tmp_path / "var/log/journal"
    journal.mkdir(parents=True)
    script = _journal_check(tmp_path)

    def run(gid: int, policy: str) -> subprocess.CompletedProcess[str]:
        os.chown(journal, 0, gid)
        return run_sh(script, policy)

    assert run(os.getegid(), "required").returncode == 0  # `id -G` names the egid too
    missing = 4242
    assert missing not in os.getgroups() and missing != os.getegid()
    refused = run(missing, "required")
    assert refused.returncode == 1
    assert "/var/log/journal belongs to gid 4242" in refused.stderr
    assert "supplementalGroups to [4242]" in refused.stderr
    warned = run(missing, "optional")
    assert warned.returncode == 0 and "gid 4242" in warned.stderr
    shutil.rmtree(tmp_path / "var")  # no journal on the host: nothing to compare
    assert run_sh(script).returncode == 0


def run_sh(script: str, policy: str = "required") -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "BCD_KERNEL_LOG": policy}
    return subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=30)


def containerfile_copies() -> list[Path]:
    """The files deploy/kubernetes/Containerfile COPYs (build context: the repository root), with its
    ARG defaults substituted."""
    text = (DEPLOY / "kubernetes" / "Containerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    out = []
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            out.append(REPO / re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], src))
    return out


def test_containerfile_installs_the_packages_make_deb_builds() -> None:
    """The image installs the bcd-node (and bcd-helper) packages: it COPYs exactly the file names
    packaging/build-deb.sh writes for this version (tests/deploy/test_packages.py builds them and checks
    they exist), and runs what the DaemonSet's containers run."""
    text = (DEPLOY / "kubernetes" / "Containerfile").read_text()
    assert re.search(r"^FROM \S*debian:12", text, re.M)
    copies = containerfile_copies()
    assert [p.relative_to(REPO).as_posix() for p in copies] == [
        f"dist/bcd-node_{VERSION}_amd64.deb",
        f"dist/bcd-helper_{VERSION}_amd64.deb",
    ]
    build = (REPO / "packaging" / "build-deb.sh").read_text()
    assert '"$OUT/${name}_${VERSION}_${ARCH}.deb"' in build
    assert "apt-get install" in text and "/tmp/bcd/bcd-node_${VERSION}_${ARCH}.deb" in text
    assert re.search(r"^USER 990:990$", text, re.M)
    spec = _daemonset()
    images = {c["image"] for c in spec["containers"] + spec["initContainers"]}
    assert images == {f"registry.example.com/bcd:{VERSION}"}


GOOD_PIN = "sha256/" + "A" * 43 + "="
GOOD_ROOT = "ab" * 32


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--control-plane", "gateway.example.com", "must name a port"),
        ("--control-plane", "gw:0", "outside 1-65535"),
        ("--control-plane", "gw:70000", "outside 1-65535"),
        ("--control-plane", "bad_host!:443", "is not a DNS name"),
        ("--control-plane", "300.1.1.1:443", "is not an IPv4 address"),
        ("--control-plane", "[::zz]:443", "is not an IPv6 address"),
        ("--join-signing-key-pin", "sha256/" + "A" * 42 + "=", "44 characters"),
        ("--join-signing-key-pin", "sha256/" + "A" * 44, "44 characters"),
        ("--join-signing-key-pin", "sha256/" + "A" * 42 + "B=", "canonical base64"),  # B: bits past 256
        ("--join-signing-key-pin", "sha1/" + "A" * 43 + "=", "sha256/"),
        ("--command-root-sha256", "AB" * 32, "64 lowercase hex"),
        ("--command-root-sha256", "ab" * 31, "64 lowercase hex"),
        ("--command-root-sha256", f"{GOOD_ROOT},{GOOD_ROOT}", "repeated"),
        ("--allowed-clusters", "http://k8s:6443#sha256:" + "ab" * 32, "must be https://"),
        ("--allowed-clusters", "https://k8s:6443#sha256:abc", "must be https://"),
    ],
)
def test_install_refuses_each_bad_value_before_writing(
    tmp_path: Path, flag: str, value: str, says: str
) -> None:
    """Issue 15: every value install.sh writes is checked first, with docs/config.md's rule."""
    result = run_install(tmp_path / "host", flag, value)
    assert result.returncode == 2, result.stdout + result.stderr
    assert flag in result.stderr and says in result.stderr, result.stderr
    assert not (tmp_path / "host/etc/bcd").exists()


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_accepts_good_values_of_every_form(tmp_path: Path) -> None:
    for address in ("gw.example.com:7443", "10.0.0.1:443", "[fd00::1]:7443"):
        root = tmp_path / address.replace(":", "_").strip("[]")
        result = run_install(
            root, "--control-plane", address, "--join-signing-key-pin", GOOD_PIN,
            "--command-root-sha256", f"{GOOD_ROOT},{'cd' * 32}",
            "--allowed-clusters", f"https://10.0.0.1:6443#sha256:{GOOD_ROOT}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        config = parse_config((root / "etc/bcd/config.toml").read_text(), "c")
        assert config.control_plane.address == address


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_rerun_with_other_flags_shows_each_difference_and_needs_replace(tmp_path: Path) -> None:
    """A re-run whose flags differ from the kept config prints each difference and exits 3, keeping the
    config; `--replace` writes the flags' config and keeps the old one beside it. Flags not given are
    not differences: a bare re-run (to put modes right) still succeeds."""
    root = tmp_path / "host"
    assert (
        run_install(root, "--control-plane", "a.example.com:1", "--join-signing-key-pin", GOOD_PIN).returncode
        == 0
    )
    config = root / "etc/bcd/config.toml"
    first = config.read_text()
    other_pin = "sha256/" + base64.b64encode(hashlib.sha256(b"another key").digest()).decode()
    result = run_install(
        root,
        "--control-plane",
        "b.example.com:2",
        "--join-signing-key-pin",
        other_pin,
        "--host-units-external",
    )
    assert result.returncode == 3
    lines = sorted(line for line in result.stderr.splitlines() if "differs:" in line)
    assert lines == sorted(
        [
            f"install.sh: differs: join_signing_key_pin: kept '{GOOD_PIN}', the flags give '{other_pin}'",
            "install.sh: differs: control_plane.address: kept 'a.example.com:1',"
            " the flags give 'b.example.com:2'",
            "install.sh: differs: host.units: kept True, the flags give False",
        ]
    ), result.stderr
    assert "--replace" in result.stderr
    assert config.read_text() == first
    assert run_install(root).returncode == 0  # no flags: nothing differs
    assert run_install(root, "--control-plane", "a.example.com:1").returncode == 0  # the same value
    result = run_install(root, "--control-plane", "b.example.com:2", "--replace")
    assert result.returncode == 0, result.stderr
    assert parse_config(config.read_text(), "c").control_plane.address == "b.example.com:2"
    assert (root / "etc/bcd/config.toml.old").read_text() == first
    _, gid = account(root, "bcd")
    assert owner_mode(config) == (0, gid, 0o640)
    assert owner_mode(root / "etc/bcd/config.toml.old") == (0, gid, 0o640)


@pytest.mark.realhost
@pytest.mark.skipif(os.geteuid() != 0, reason="install.sh runs as root")
def test_install_starts_the_units_only_when_ready_and_warns_of_no_journal_group(tmp_path: Path) -> None:
    """Before: `systemctl enable --now` of both units right after writing the config, so the node (not
    joined) exited 78 and RestartPreventExitStatus=78 left it failed, after `bcd join` too; and a host
    without group systemd-journal got a unit that cannot start (216/GROUP), unannounced; and the helper
    started before `bcd-helper audit init`, sealing with a key no one holds. Now each unit is enabled and
    started only once ready (the node joined, the helper's log sealed; the node also waits for the seal,
    since it Wants= the helper), and the output says what to run next. (Then both were enabled at once,
    so a reboot before `audit init` started the helper unsealed; tests/deploy/test_units_booted.py
    checks the enabling under a real systemd.)"""
    for tool in ("useradd", "groupadd", "install"):
        require_tool(tool)
    root = tmp_path / "host"

    def install() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(DEPLOY / "install.sh"), "--root", str(root), "--control-plane", "gw.example:443"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    first = install()
    assert first.returncode == 0, first.stderr
    assert (
        "bcd-node.service not enabled or started: the node has not joined. Next, as root: bcd join "
        "--token=TOKEN --address HOST:PORT, then systemctl enable --now bcd-node.service"
    ) in first.stdout
    assert "no group systemd-journal" in first.stderr and "216/GROUP" in first.stderr
    # And the helper only once its audit log has a sealing key someone holds (docs/deploy.md).
    assert (
        "bcd-helper.service not enabled or started: its audit log has no sealing key yet. Next, as root: "
        "bcd-helper audit init (keep the verification key it prints off this host), then systemctl "
        "enable --now bcd-helper.service"
    ) in first.stdout
    with (root / "etc/group").open("a") as f:
        f.write("systemd-journal:x:999:\n")
    (root / "var/lib/bcd/identity.json").write_text("{}")
    joined = install()
    assert joined.returncode == 0, joined.stderr
    assert (
        "bcd-node.service not enabled or started: it would start bcd-helper.service (Wants=)" in joined.stdout
    )
    (root / "var/log/bcd-helper/audit.key").write_bytes(b"")
    again = install()
    assert again.returncode == 0, again.stderr
    assert "not enabled" not in again.stdout and "systemd-journal" not in again.stderr
