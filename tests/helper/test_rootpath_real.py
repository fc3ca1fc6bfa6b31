"""The root-only rule on the real filesystem, with a real unprivileged user; SO_PEERCRED across uids.

Covers HST-ROOT-01..08, HST-REC-02 (a node-owned directory is refused), HST-HLP-24..30.
The unprivileged side runs as a `useradd --system` user through `setpriv --reuid`, with /usr/bin/python3
(the pyenv interpreter under /root is not reachable by other users). Users are removed afterwards.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_helper.config import ConfigError, load_config
from bcd_helper.ops.host import helper_version
from bcd_shared.rootpath import (
    RootPathRefused,
    refusal_message,
    remove_root_only,
    verified_dir,
    write_root_only,
)
from helperproc import HelperProcess, base_config, make_root, write_config
from testsupport import IN_CI, require_tool

SYS_PY = "/usr/bin/python3"


def _need(tool: str) -> str:
    return require_tool(tool)


class User:
    def __init__(self, name: str, groups: str | None = None) -> None:
        _need("useradd")
        args = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
        if groups:
            args += ["-G", groups]
        subprocess.run([*args, name], check=True, capture_output=True)
        self.name = name
        out = subprocess.run(["id", "-u", name], check=True, capture_output=True, text=True).stdout
        self.uid = int(out)
        self.gid = int(subprocess.run(["id", "-g", name], check=True, capture_output=True, text=True).stdout)

    def run(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        _need("setpriv")
        if not os.path.exists(SYS_PY):
            if IN_CI:
                pytest.fail(f"{SYS_PY} is missing under CI: .ci/run installs python3")
            pytest.skip(f"{SYS_PY} missing")
        return subprocess.run(
            [
                "setpriv",
                f"--reuid={self.uid}",
                f"--regid={self.gid}",
                "--init-groups",
                SYS_PY,
                "-c",
                code,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def remove(self) -> None:
        subprocess.run(["userdel", self.name], capture_output=True)


@pytest.fixture
def node_user() -> Iterator[User]:
    user = User(f"bcdt{secrets.token_hex(3)}")
    yield user
    user.remove()


@pytest.fixture
def world_root() -> Iterator[Path]:
    """A simulated host others can traverse (pytest's tmp dirs are 0700 root)."""
    parent = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/var/tmp"))
    root = make_root(parent)
    yield root
    shutil.rmtree(parent)


def test_HST_ROOT_05_tmp_is_refused_on_the_real_host() -> None:
    with pytest.raises(RootPathRefused) as exc:
        write_root_only(Path("/"), f"/tmp/bcd-never-{secrets.token_hex(4)}", b"x")
    assert str(exc.value) == refusal_message("/tmp")
    with pytest.raises(RootPathRefused):
        remove_root_only(Path("/"), "/var/tmp/x")


def test_HST_ROOT_02_06_symlinked_component_refused(fresh_root: Path) -> None:
    (fresh_root / "etc/real").mkdir()
    (fresh_root / "etc/link").symlink_to("real")
    with pytest.raises(RootPathRefused) as exc:
        write_root_only(fresh_root, "/etc/link/f", b"x")
    assert "/etc/link is not a directory only root can write" in str(exc.value)
    assert not (fresh_root / "etc/real/f").exists()
    # Every directory from / down, not only the file's own: a symlinked or world-writable grandparent.
    (fresh_root / "etc/real/sub").mkdir()
    with pytest.raises(RootPathRefused) as exc:
        write_root_only(fresh_root, "/etc/link/sub/f", b"x")
    assert str(exc.value) == refusal_message("/etc/link")
    (fresh_root / "etc/open/sub").mkdir(parents=True)
    (fresh_root / "etc/open").chmod(0o777)
    with pytest.raises(RootPathRefused) as exc:
        write_root_only(fresh_root, "/etc/open/sub/f", b"x")
    assert str(exc.value) == refusal_message("/etc/open")
    assert not (fresh_root / "etc/real/sub/f").exists() and not (fresh_root / "etc/open/sub/f").exists()


def test_HST_ROOT_04_group_writable_and_acl_widened_dirs_refused(fresh_root: Path, node_user: User) -> None:
    d = fresh_root / "etc/gw"
    d.mkdir()
    os.chmod(d, 0o775)
    with pytest.raises(RootPathRefused, match="/etc/gw is not a directory only root can write"):
        write_root_only(fresh_root, "/etc/gw/f", b"x")
    os.chmod(d, 0o755)
    write_root_only(fresh_root, "/etc/gw/f", b"x")
    _need("setfacl")
    subprocess.run(["setfacl", "-m", f"u:{node_user.name}:rwx", str(d)], check=True)
    assert d.stat().st_mode & 0o020  # the ACL mask shows in the group bits
    with pytest.raises(RootPathRefused):
        write_root_only(fresh_root, "/etc/gw/g", b"x")
    with pytest.raises(RootPathRefused):
        remove_root_only(fresh_root, "/etc/gw/f")
    assert (d / "f").exists()


def test_HST_ROOT_05_node_owned_dir_refused_and_node_cannot_steer(world_root: Path, node_user: User) -> None:
    """The node owns a directory (as it owns data_dir): root refuses it, whatever the node plants."""
    d = world_root / "var/lib/nodeowned"
    d.mkdir(parents=True)
    os.chown(d, node_user.uid, node_user.gid)
    target = world_root / "etc/victim"
    target.write_text("root's\n")
    planted = node_user.run(
        "import os,sys; os.symlink(sys.argv[1], sys.argv[2])", str(target), str(d / "rec")
    )
    assert planted.returncode == 0, planted.stderr
    with pytest.raises(RootPathRefused, match="/var/lib/nodeowned is not a directory only root can write"):
        write_root_only(world_root, "/var/lib/nodeowned/rec", b"owned")
    assert target.read_text() == "root's\n"
    # The node cannot create anything in a root-only directory to begin with.
    denied = node_user.run("open(__import__('sys').argv[1], 'w')", str(world_root / "etc/cdi/x"))
    assert denied.returncode != 0 and "PermissionError" in denied.stderr


def test_HST_ROOT_01_symlink_swapped_in_between_check_and_use(fresh_root: Path) -> None:
    """What was checked is what is used: the write lands in the directory the fd verified."""
    (fresh_root / "etc/a").mkdir()
    (fresh_root / "attacker").mkdir()
    with verified_dir(fresh_root, ("etc", "a"), create=False) as dfd:
        os.rename(fresh_root / "etc/a", fresh_root / "etc/a-moved")
        (fresh_root / "etc/a").symlink_to(fresh_root / "attacker")
        fd = os.open("f", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        os.close(fd)
    assert (fresh_root / "etc/a-moved/f").exists()
    assert list((fresh_root / "attacker").iterdir()) == []
    with pytest.raises(RootPathRefused):
        write_root_only(fresh_root, "/etc/a/g", b"x")


def test_HST_ROOT_01_racing_symlink_swaps_never_steer_a_write(fresh_root: Path) -> None:
    (fresh_root / "etc/r").mkdir()
    (fresh_root / "attacker").mkdir()
    stop = threading.Event()

    def flip() -> None:
        link = fresh_root / "etc/r-link"
        while not stop.is_set():
            try:  # the writer may recreate etc/r in between: every step is best effort
                os.rename(fresh_root / "etc/r", fresh_root / "etc/r-real")
                if not link.is_symlink():
                    link.symlink_to(fresh_root / "attacker")
                os.rename(link, fresh_root / "etc/r")
                os.unlink(fresh_root / "etc/r")
                os.rename(fresh_root / "etc/r-real", fresh_root / "etc/r")
            except OSError:
                continue

    t = threading.Thread(target=flip)
    t.start()
    outcomes = {"ok": 0, "refused": 0, "gone": 0}
    try:
        for i in range(300):
            try:
                write_root_only(fresh_root, f"/etc/r/f{i}", b"x")
                outcomes["ok"] += 1
            except RootPathRefused:
                outcomes["refused"] += 1
            except FileNotFoundError:
                outcomes["gone"] += 1
    finally:
        stop.set()
        t.join()
    assert list((fresh_root / "attacker").iterdir()) == []
    assert sum(outcomes.values()) == 300


def test_HST_HLP_24_to_30_config_ownership(world_root: Path, node_user: User) -> None:
    good = base_config(node_uid=node_user.uid, node_gid=node_user.gid)
    cfg = write_config(world_root, good)
    os.chown(cfg, 0, node_user.gid)  # the install's root:bcd 0640 in /etc/bcd 0750
    os.chown(cfg.parent, 0, node_user.gid)
    assert load_config(world_root, "/etc/bcd/config.toml").node_uid == node_user.uid
    message = "/etc/bcd/config.toml must be a regular file root owns that no one else can write"
    for mode in (0o660, 0o642):  # the group's write bit, then the others'
        os.chmod(cfg, mode)
        with pytest.raises(ConfigError, match=message):
            load_config(world_root, "/etc/bcd/config.toml")
    os.chmod(cfg, 0o640)
    os.chown(cfg, node_user.uid, node_user.gid)
    with pytest.raises(ConfigError, match=message):
        load_config(world_root, "/etc/bcd/config.toml")
    os.chown(cfg, 0, 0)
    os.chmod(cfg.parent, 0o770)
    with pytest.raises(ConfigError, match=message):
        load_config(world_root, "/etc/bcd/config.toml")
    os.chmod(cfg.parent, 0o750)
    etc_mode = (world_root / "etc").stat().st_mode & 0o7777
    os.chmod(world_root / "etc", 0o777)  # a directory further up that anyone can write
    with pytest.raises(ConfigError, match=message):
        load_config(world_root, "/etc/bcd/config.toml")
    os.chmod(world_root / "etc", etc_mode)
    assert load_config(world_root, "/etc/bcd/config.toml").node_uid == node_user.uid
    real = world_root / "etc/bcd/real.toml"
    cfg.rename(real)
    cfg.symlink_to("real.toml")
    with pytest.raises(ConfigError, match=message):
        load_config(world_root, "/etc/bcd/config.toml")


def _serve(root: Path) -> subprocess.CompletedProcess[str]:
    """`bcd helper serve` as root over the simulated host; it must exit (a refused config) within 30 s."""
    return subprocess.run(
        [sys.executable, "-m", "bcd_helper.cli", "serve", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_HST_HLP_25_26_27_28_helper_serve_refuses_a_config_the_node_could_change(
    world_root: Path, node_user: User
) -> None:
    """A real `bcd helper serve` (as root) starts on the install's root:bcd 0640 config in /etc/bcd 0750,
    and refuses to start, exit 78 with the one-line refusal and no socket bound, when the config is owned
    by the node's account (HLP-25), writable by its group or by others (HLP-26), or in a directory the
    node could write, at any depth (HLP-27); the message is `<path> must be a regular file root owns that
    no one else can write` (HLP-28)."""
    cfg = write_config(world_root, base_config(node_uid=node_user.uid, node_gid=node_user.gid))
    os.chown(cfg, 0, node_user.gid)
    os.chown(cfg.parent, 0, node_user.gid)
    HelperProcess(world_root).stop()  # the install's layout starts
    socket = world_root / "run/bcd/helper.sock"
    shutil.rmtree(world_root / "run/bcd")
    message = (
        "bcd helper serve: /etc/bcd/config.toml must be a regular file root owns that no one else can write"
    )

    def refused(why: str) -> None:
        out = _serve(world_root)
        assert out.returncode == 78, (why, out.returncode, out.stderr)
        line = out.stderr.strip().splitlines()[-1]
        assert line.startswith(message), (why, line)
        assert not socket.exists(), why

    os.chown(cfg, node_user.uid, node_user.gid)
    refused("owned by the node (HLP-25)")
    os.chown(cfg, 0, node_user.gid)
    for mode in (0o660, 0o642, 0o620, 0o602):
        os.chmod(cfg, mode)
        refused(f"mode {mode:o} (HLP-26)")
    os.chmod(cfg, 0o640)
    os.chmod(cfg.parent, 0o770)
    refused("/etc/bcd group-writable (HLP-27)")
    os.chmod(cfg.parent, 0o750)
    os.chown(cfg.parent, node_user.uid, node_user.gid)
    refused("/etc/bcd owned by the node (HLP-27)")
    os.chown(cfg.parent, 0, node_user.gid)
    os.chmod(world_root / "etc", 0o777)
    refused("/etc world-writable (HLP-27)")
    os.chmod(world_root / "etc", 0o755)
    HelperProcess(world_root).stop()  # put right, it starts again


def _client_code() -> str:
    return (
        "import json,socket,struct,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "b=json.dumps({'op':'helper.ping','args':{}}).encode()\n"
        # A peer refused at connect may be answered and closed before it writes: the answer still waits.
        "try: s.sendall(struct.pack('>I',len(b))+b)\n"
        "except BrokenPipeError: pass\n"
        "w=socket.MSG_WAITALL; n=struct.unpack('>I',s.recv(4,w))[0]; print(s.recv(n,w).decode())\n"
    )


def test_so_peercred_real_clients_of_other_uids(world_root: Path, node_user: User) -> None:
    """Only root and the configured node uid are served; another uid that can reach the socket is refused."""
    other = User(f"bcdo{secrets.token_hex(3)}", groups=node_user.name)
    helper = HelperProcess(world_root, base_config(node_uid=node_user.uid, node_gid=node_user.gid))
    try:
        st = os.stat(helper.socket_path)
        assert oct(st.st_mode & 0o777) == "0o660" and st.st_gid == node_user.gid
        ok = node_user.run(_client_code(), helper.socket_path)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout) == {
            "ok": True,
            "result": {"peer_uid": node_user.uid, "host_units": True, "version": helper_version()},
        }
        bad = other.run(_client_code(), helper.socket_path)
        assert bad.returncode == 0, bad.stderr
        answer = json.loads(bad.stdout)
        assert answer["ok"] is False and answer["reason"] == "peer"
        last = helper.last_audit()
        assert last["op"] == "(connect)" and last["peer_uid"] == other.uid and last["decision"] == "refused"
    finally:
        helper.stop()
        other.remove()
