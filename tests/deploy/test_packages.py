"""Issue 15 item 1: the Debian packages, built with `make deb` and installed for real with `dpkg -i`.

One test, in order, because each step stands on the one before: build; install both; the files, their
owners and modes; `--version`; `systemd-analyze verify` and `security --offline` on the installed units;
the installed helper started and pinged (and refusing a simulated root: the package carries no
simulator); `dpkg -r` (programs gone, config and data kept); `dpkg -P` (nothing left but root's records:
/var/lib/bcd-hostconfig and /var/log/bcd-helper, which the test then removes). It changes the real
machine, so it runs as root under CI=true (where it must not skip) or with BCD_TEST_DPKG=1, and leaves
the machine as it found it.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_agent.helperclient import HelperClient
from bcd_agent.sections.daemon.release import build_release
from bcd_shared.version import VERSION
from deploy.test_deploy import containerfile_copies
from testsupport import REPO, require_tool

IN_CI = os.environ.get("CI") == "true"
PACKAGES = ("bcd-helper", "bcd-node")
UNITS = {"bcd-helper": "bcd-helper.service", "bcd-node": "bcd-node.service"}
EXPOSURE_TARGETS = {"bcd-node.service": 2.0, "bcd-helper.service": 5.0}
# What the packages make outside dpkg's own file list (set aside first if present, restored after).
MADE = ("/etc/bcd", "/var/lib/bcd", "/var/lib/bcd-hostconfig", "/var/log/bcd-helper", "/run/bcd", "/opt/bcd")
ROOTS_RECORDS = ("/var/lib/bcd-hostconfig", "/var/log/bcd-helper")

pytestmark = [
    pytest.mark.realhost,
    pytest.mark.skipif(
        not IN_CI and os.environ.get("BCD_TEST_DPKG") != "1",
        reason="installs packages on this machine: runs under CI=true or BCD_TEST_DPKG=1",
    ),
]


def sh(
    *argv: str, check: bool = True, timeout: float = 120, **kw: object
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    if check and res.returncode != 0:
        raise AssertionError(f"{argv}: exit {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


def owner_mode(path: str) -> tuple[str, str, int]:
    st = os.lstat(path)
    return pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name, stat.S_IMODE(st.st_mode)


def installed(pkg: str) -> bool:
    res = sh("dpkg-query", "-W", "-f=${db:Status-Status}", pkg, check=False)
    return res.returncode == 0 and res.stdout not in ("", "not-installed")


def account_exists() -> bool:
    try:
        pwd.getpwnam("bcd")
    except KeyError:
        return False
    return True


@pytest.fixture
def machine() -> Iterator[None]:
    """Refuse to run over an installed bcd; set aside what another test left at the packages' paths (a
    real-host test may leave /var/lib/bcd/...), and afterwards put back the machine as it was."""
    assert os.geteuid() == 0, "dpkg -i needs root"
    for tool in ("dpkg", "dpkg-deb", "systemd-analyze", "useradd"):
        require_tool(tool)
    assert not any(installed(p) for p in PACKAGES), "bcd packages are already installed here"
    assert not account_exists(), "a bcd account exists here already"
    aside = [p for p in MADE if os.path.lexists(p)]
    for p in aside:
        os.rename(p, p + ".bcd-test-aside")
    try:
        yield
    finally:
        for pkg in PACKAGES:
            if installed(pkg):
                sh("dpkg", "-P", pkg, check=False)
        for p in MADE:
            if os.path.lexists(p):
                shutil.rmtree(p, ignore_errors=True)
        for p in aside:
            os.rename(p + ".bcd-test-aside", p)
        if account_exists():
            sh("userdel", "bcd", check=False)
        try:
            grp.getgrnam("bcd")
        except KeyError:
            pass
        else:
            sh("groupdel", "bcd", check=False)


def _debs() -> dict[str, Path]:
    sh("make", "deb", cwd=REPO, timeout=600)
    for path in containerfile_copies():  # what deploy/kubernetes/Containerfile COPYs, make deb made
        assert path.is_file(), path
    # The distributions install from the repository alone: dist/ (make dist) and the dependencies'
    # wheels, no index (`pip install ./helper` needed a bcd-shared from an index).
    for dist in ("bcd-helper", "bcd-agent"):
        local = ("--no-index", "--find-links", "dist", "--find-links", "build/deb/wheels")
        pip = str(REPO / ".venv/bin/pip")
        sh(pip, "install", "--dry-run", "--ignore-installed", *local, f"{dist}=={VERSION}", cwd=REPO)
    out = {}
    for pkg in PACKAGES:
        [deb] = (REPO / "dist").glob(f"{pkg}_{VERSION}_*.deb")
        out[pkg] = deb
    return out


def _start_helper() -> subprocess.Popen[str]:
    """The installed /usr/bin/bcd-helper with a notify socket; returns once READY=1 arrived."""
    notify_path = "/run/bcd-test-notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        if os.path.lexists(notify_path):
            os.unlink(notify_path)
        notify.bind(notify_path)
        notify.settimeout(30)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "NOTIFY_SOCKET": notify_path}
        proc = subprocess.Popen(
            ["/usr/bin/bcd-helper", "serve", "--log-format", "text"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        try:
            assert notify.recv(4096).decode().startswith("READY=1")
        except BaseException:
            proc.kill()
            raise AssertionError(f"the installed helper did not start: {proc.communicate()[1]}") from None
        finally:
            os.unlink(notify_path)
    return proc


def test_packages_install_run_and_go_away(machine: None, tmp_path: Path) -> None:
    debs = _debs()
    for pkg, deb in debs.items():
        names = sh("dpkg-deb", "-c", str(deb)).stdout
        assert "bcd_simhost" not in names, f"{pkg} carries the simulated host"
        assert "/etc/" not in names, f"{pkg} ships files in /etc (root's config is the operator's)"
        if pkg == "bcd-helper":
            for banned in ("site-packages/trio/", "site-packages/grpclib/", "site-packages/bcd_agent/"):
                assert banned not in names, f"the helper's venv carries {banned}"

    sh("dpkg", "-i", *(str(d) for d in debs.values()), timeout=300)
    assert all(installed(p) for p in PACKAGES)

    # Files, owners and modes (docs/deploy.md "Layout").
    # /usr/bin/bcd runs /usr/lib/bcd/bcd, the path self-update flips (docs/daemon.md "Where it runs"): a
    # regular file running the venv's bcd, which root keeps as the `initial` release at the first swap.
    assert os.readlink("/usr/bin/bcd") == "/usr/lib/bcd/bcd"
    assert owner_mode("/usr/lib/bcd/bcd") == ("root", "root", 0o755)
    assert stat.S_ISREG(os.lstat("/usr/lib/bcd/bcd").st_mode)
    assert Path("/usr/lib/bcd/bcd").read_text().startswith("#!/opt/bcd/node/bin/python3\n")
    assert os.readlink("/usr/bin/bcd-helper") == "/opt/bcd/helper/bin/bcd-helper"
    for unit in UNITS.values():
        path = f"/lib/systemd/system/{unit}"
        assert Path(path).read_bytes() == (REPO / "deploy" / unit).read_bytes()
        assert owner_mode(path) == ("root", "root", 0o644)
        # Documentation= names pages the package installs (offline: no URL that may not answer).
        docs = [d for line in Path(path).read_text().splitlines() if line.startswith("Documentation=")
                for d in line.removeprefix("Documentation=").split()]  # fmt: skip
        assert docs and all(d.startswith("file:/usr/share/doc/") for d in docs), docs
        for doc in docs:
            assert owner_mode(doc.removeprefix("file:")) == ("root", "root", 0o644), doc
    assert owner_mode("/etc/bcd") == ("root", "bcd", 0o750)
    assert owner_mode("/var/lib/bcd") == ("bcd", "bcd", 0o700)
    assert owner_mode("/var/lib/bcd-hostconfig") == ("root", "root", 0o700)
    assert owner_mode("/var/log/bcd-helper") == ("root", "root", 0o700)
    assert pwd.getpwnam("bcd").pw_shell == "/usr/sbin/nologin"
    for venv in ("/opt/bcd/helper", "/opt/bcd/node"):
        assert owner_mode(venv) == ("root", "root", 0o755)
        writable = sh("find", venv, "-perm", "/022", "!", "-type", "l").stdout
        assert writable == "", f"group- or world-writable in {venv}: {writable}"
    assert sh("/usr/bin/bcd-helper", "--version").stdout == f"bcd-helper {VERSION}\n"
    assert sh("/usr/bin/bcd", "--version").stdout == f"bcd {VERSION}\n"
    # A release as self-update installs it runs on the host's python3 with the packaged venv's libraries
    # (none system-wide here: -S keeps the host's site directories out).
    release = tmp_path / "bcd.pyz"
    build_release(sorted((REPO / "dist").glob(f"bcd_*-{VERSION}-py3-none-any.whl")), release)
    assert sh("/usr/bin/python3", "-I", "-S", str(release), "release", "version").stdout == f"{VERSION}\n"
    # The packaged helper has no simulator: a simulated root is refused in one line.
    res = sh("/usr/bin/bcd-helper", "serve", "--root", "/tmp", check=False)
    assert res.returncode == 64 and "bcd-simhost" in res.stderr and "Traceback" not in res.stderr

    # The installed units, as systemd reads them.
    for unit in UNITS.values():
        res = sh("systemd-analyze", "verify", "--man=no", f"/lib/systemd/system/{unit}", check=False)
        assert res.returncode == 0 and res.stderr == "", res.stderr
        res = sh("systemd-analyze", "security", "--offline=true", "--no-pager", f"/lib/systemd/system/{unit}")
        m = re.search(rf"Overall exposure level for {re.escape(unit)}: (\d+\.\d+)", res.stdout)
        assert m is not None and float(m.group(1)) <= EXPOSURE_TARGETS[unit], res.stdout[-500:]

    # Start the installed helper on root's config and ping it.
    config = Path("/etc/bcd/config.toml")
    config.write_text(
        'data_dir = "/var/lib/bcd"\n\n[helper]\nsocket = "/run/bcd/helper.sock"\nnode_user = "bcd"\n'
    )
    os.chown(config, 0, grp.getgrnam("bcd").gr_gid)
    config.chmod(0o640)
    proc = _start_helper()
    try:
        answer = HelperClient("/run/bcd/helper.sock").ping()
        assert answer["peer_uid"] == 0, answer
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"bcd-helper {VERSION} serving on /run/bcd/helper.sock" in err
    assert f"bcd-helper {VERSION} stopped (SIGTERM received)" in err

    # Remove: the programs go, the config and the data stay.
    sh("dpkg", "-r", *PACKAGES, timeout=300)
    gone_after_remove = ("/usr/bin/bcd", "/usr/lib/bcd", "/usr/bin/bcd-helper", "/opt/bcd")
    for gone in (*gone_after_remove, "/lib/systemd/system/bcd-node.service"):
        assert not os.path.lexists(gone), gone
    assert config.exists() and os.path.isdir("/var/lib/bcd") and account_exists()

    # Purge: nothing left but root's records.
    sh("dpkg", "-P", *PACKAGES, timeout=300)
    assert not any(installed(p) for p in PACKAGES)
    for gone in ("/etc/bcd", "/var/lib/bcd", "/run/bcd"):
        assert not os.path.lexists(gone), gone
    assert not account_exists()
    for kept in ROOTS_RECORDS:
        assert os.path.isdir(kept), kept  # the join record and the audit log: removed by hand (deploy.md)
    assert Path("/var/log/bcd-helper/audit.log").exists()
