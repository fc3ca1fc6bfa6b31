"""Red team round 11 (docs/helper.md, "Threat model, round 11: ch.launch bind paths"): `ch.launch` checked
the base image and the volumes as root, then handed their *paths* to systemd-run (`BindPaths=` /
`BindReadOnlyPaths=`), which systemd, as root, resolves again later; the node, which owns `volumes` and
`images`, could swap one for a symlink in that window and have a file only root reaches bound into the
VMM's namespace. Now root links the inode it checked into `<data_dir>-ch-binds/<id>/` (root 0700) and
binds that link. The node's account is a real process of its uid (hostilekit.as_node, and a forked
swapper dropped to that uid) against a real `bcd helper serve` over a simulated host; the fake
systemd-run resolves each bind source as systemd does, when it runs (bcd_simhost.chtools). Each test
failed on the code before the fix (the sources were the node's paths)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from attrs import evolve
from bcd_shared import posixacl
from bcd_shared.chrecord import CHVolume, encode_record, parse_record
from bcd_shared.chunit import VMM_UID_BASE
from bcd_simhost.chapi import CH_BASE_SHA256, lay_out_instance
from helperproc import HelperProcess, base_config, make_root
from hostilekit import NODE_GID, NODE_UID, as_node

DATA = "/var/lib/bcd"
BINDS = f"{DATA}-ch-binds"
BASE = f"{DATA}/cloud-hypervisor/images/{CH_BASE_SHA256}.qcow2"
UID1 = VMM_UID_BASE + 1
RENAME_EXCHANGE = 2


@pytest.fixture
def host() -> Iterator[tuple[Path, HelperProcess]]:
    # under /var/tmp, short: the simulated VMM's socket paths
    parent = Path(tempfile.mkdtemp(prefix="bcd-r11-", dir="/var/tmp"))
    root = make_root(parent)
    lay_out_instance(root, "vm1", NODE_UID, UID1, volumes=(("v1.raw", False), ("v2.raw", True)))
    h = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    try:
        yield root, h
    finally:
        h.stop()
        shutil.rmtree(parent, ignore_errors=True)


def _unit(root: Path) -> dict[str, Any]:
    units = json.loads((root / "var/lib/bcd-sim/systemd/units.json").read_text())
    return dict(units["bcd-ch-vm1.service"])


def _log(root: Path) -> str:
    from bcd_simhost.systemctl import LOG

    return (root / LOG.lstrip("/")).read_text()


def _ino(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def _launch(root: Path, h: HelperProcess) -> dict[str, Any]:
    return as_node(h, {"op": "ch.launch", "args": {"name": "vm1"}})


def _stop(h: HelperProcess) -> None:
    answer = as_node(h, {"op": "ch.stop", "args": {"name": "vm1"}})
    assert answer["ok"] is True and answer["result"]["state"] == "inactive", answer


def test_round11_systemd_binds_roots_link_of_the_inode_root_checked(host: tuple[Path, HelperProcess]) -> None:
    """The base image and each volume reach the unit as `SRC:DEST`: SRC root's hard link of the very
    inode root checked (same st_dev and st_ino), in `<data_dir>-ch-binds/vm1/`, a directory root owns,
    0700, below one root owns, 0700; DEST the node's path, where the VMM looks. No bind source of a file
    is the node's path. The VMM's ACL entry is on that inode. ch.stop removes the links and their
    directory (the volumes have one link again, no entry of the VMM's)."""
    root, h = host
    answer = _launch(root, h)
    assert answer["ok"] is True, answer
    unit = _unit(root)
    files = {
        BASE: ("BindReadOnlyPaths", f"{BINDS}/vm1/image"),
        f"{DATA}/volumes/v1.raw": ("BindPaths", f"{BINDS}/vm1/vol-v1.raw"),
        f"{DATA}/volumes/v2.raw": ("BindReadOnlyPaths", f"{BINDS}/vm1/vol-v2.raw"),
    }
    binds = {dest: (key, src, dev, ino) for key, src, dest, dev, ino in unit["binds"]}
    inst = f"{DATA}/cloud-hypervisor/instances/vm1"
    assert set(binds) == {inst, *files}  # the instance directory is bound as a directory (see the doc)
    for dest, (key, link) in files.items():
        got_key, src, dev, ino = binds[dest]
        assert (got_key, src) == (key, link)
        node_file = root / dest.lstrip("/")
        assert (dev, ino) == _ino(node_file) == _ino(root / link.lstrip("/"))  # what systemd resolved
        assert os.lstat(node_file).st_nlink == 2
    lines = [line for line in _log(root).splitlines() if "--unit=bcd-ch-vm1.service" in line]
    argv = [a for line in lines for a in line.split()]
    sources = [
        a.split("=", 2)[2].partition(":")[0]
        for a in argv
        if a.startswith(("--property=BindPaths=", "--property=BindReadOnlyPaths="))
    ]
    assert sources and not set(sources) & set(files)  # never the node's path as a source
    for d in (root / BINDS.lstrip("/"), root / BINDS.lstrip("/") / "vm1"):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    fd = os.open(root / f"{BINDS}/vm1/vol-v1.raw".lstrip("/"), os.O_RDONLY)
    try:
        assert posixacl.user_perms(fd, UID1) == 0o6
    finally:
        os.close(fd)

    _stop(h)
    assert not (root / BINDS.lstrip("/") / "vm1").exists()
    for dest in files:
        node_file = root / dest.lstrip("/")
        assert os.lstat(node_file).st_nlink == 1
        fd = os.open(node_file, os.O_RDONLY)
        try:
            assert posixacl.user_perms(fd, UID1) is None
        finally:
            os.close(fd)


def test_round11_a_relaunch_replaces_the_links_of_a_unit_gone_without_its_stop(
    host: tuple[Path, HelperProcess],
) -> None:
    """A VMM whose unit ended without `ch.stop` (it exited; `--collect` forgets the unit) leaves its
    links; the next `ch.launch` removes them before it links what the record names now: a volume the
    record no longer names is held by no link of root's (its blocks go with the node's deletion)."""
    root, h = host
    assert _launch(root, h)["ok"] is True
    units_path = root / "var/lib/bcd-sim/systemd/units.json"
    units = json.loads(units_path.read_text())
    units["bcd-ch-vm1.service"]["active"] = False  # the VMM exited, nobody stopped it
    units_path.write_text(json.dumps(units))
    vm_json = root / f"{DATA}/cloud-hypervisor/instances/vm1/vm.json".lstrip("/")
    rec = parse_record(vm_json.read_bytes())
    vm_json.write_bytes(encode_record(evolve(rec, volumes=(CHVolume("v1.raw", False, "vol0"),))))
    assert _launch(root, h)["ok"] is True
    assert sorted(os.listdir(root / BINDS.lstrip("/") / "vm1")) == ["image", "vol-v1.raw"]
    assert os.lstat(root / f"{DATA}/volumes/v2.raw".lstrip("/")).st_nlink == 1
    _stop(h)
    assert not (root / BINDS.lstrip("/") / "vm1").exists()


def _swapper(data: Path) -> int:
    """A process of the node's uid exchanging `volumes` with `volumes.swap` (a symlink of the node's to a
    directory only root enters) in a loop, with renameat2(RENAME_EXCHANGE): the name is always one or
    the other."""
    dfd = os.open(data, os.O_RDONLY | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgroups([])
            os.setgid(NODE_GID)
            os.setuid(NODE_UID)
            libc = ctypes.CDLL(None, use_errno=True)
            a, b = b"volumes", b"volumes.swap"
            n = 0
            while True:
                if libc.renameat2(dfd, a, dfd, b, RENAME_EXCHANGE) != 0:
                    os._exit(3)
                n += 1
                if n % 64 == 0:
                    os.sched_yield()
        finally:
            os._exit(1)
    os.close(dfd)
    return pid


def test_round11_a_node_swapping_volumes_for_a_symlink_never_gets_a_bind_of_roots_file(
    host: tuple[Path, HelperProcess],
) -> None:
    """The node exchanges its `volumes` directory with a symlink to a directory only root enters,
    holding a root-owned 0644 `v1.raw` (a secret), in a loop, while `ch.launch` runs again and again.
    Every launch root accepts hands systemd a source that resolves (when the fake systemd-run runs, as
    systemd would) to the inode of the node's own `v1.raw`, in root's directory, never the secret; the
    others are refused (`bad-volume`: a symlink on the way)."""
    root, h = host
    data = root / DATA.lstrip("/")
    hidden = root / "var/lib/root-only"
    hidden.mkdir(mode=0o700)
    (hidden / "v1.raw").write_bytes(b"secret" * 100)
    (hidden / "v2.raw").write_bytes(b"secret" * 100)
    for f in hidden.iterdir():
        os.chmod(f, 0o644)
    secret = {_ino(hidden / "v1.raw"), _ino(hidden / "v2.raw")}
    mine = {n: _ino(data / "volumes" / n) for n in ("v1.raw", "v2.raw")}
    (data / "volumes.swap").symlink_to(hidden)
    os.lchown(data / "volumes.swap", NODE_UID, NODE_UID)
    pid = _swapper(data)
    accepted = refused = 0
    try:
        for _ in range(400):
            answer = _launch(root, h)
            if not answer["ok"]:
                assert answer["reason"] == "bad-volume", answer
                refused += 1
                continue
            accepted += 1
            for key, src, dest, dev, ino in _unit(root)["binds"]:
                if not dest.startswith(f"{DATA}/volumes/"):
                    continue
                name = dest.rsplit("/", 1)[1]
                assert src == f"{BINDS}/vm1/vol-{name}", (key, src, dest)
                assert (dev, ino) not in secret
                assert (dev, ino) == mine[name]
            _stop(h)
            if accepted >= 12:
                break
    finally:
        os.kill(pid, signal.SIGKILL)
        _pid, status = os.waitpid(pid, 0)
        if not (data / "volumes").is_dir() or (data / "volumes").is_symlink():
            os.rename(data / "volumes", data / "volumes.tmp")
            os.rename(data / "volumes.swap", data / "volumes")
            os.rename(data / "volumes.tmp", data / "volumes.swap")
    assert os.WIFSIGNALED(status), "the swapper stopped by itself (renameat2 failed)"
    assert accepted >= 3, (accepted, refused)
    assert refused >= 1, (accepted, refused)  # the swap was seen
    assert not (root / BINDS.lstrip("/") / "vm1").exists()


def test_round11_a_volume_on_another_file_system_than_roots_links_is_refused_by_name() -> None:
    """A hard link cannot leave its file system: a volume store mounted on its own (a tmpfs over
    `volumes`, in the helper's private mount namespace) is refused `bind-other-fs`, naming the layout to
    use, before any unit starts, and no link of the instance stays. (Before the fix the launch was
    taken, binding the node's path.)"""
    parent = Path(tempfile.mkdtemp(prefix="bcd-r11-", dir="/var/tmp"))
    try:
        root = make_root(parent)
        lay_out_instance(root, "vm1", NODE_UID, UID1)
        vols = root / DATA.lstrip("/") / "volumes"
        rec_path = root / f"{DATA}/cloud-hypervisor/instances/vm1/vm.json".lstrip("/")
        rec = parse_record(rec_path.read_bytes())
        rec_path.write_bytes(encode_record(evolve(rec, volumes=(CHVolume("v1.raw", False, "vol0"),))))
        u = NODE_UID
        mount = (
            f'mount -t tmpfs -o mode=0711 tmpfs "$0" && chown {u}:{u} "$0" && printf v > "$0/v1.raw" '
            f'&& chown {u}:{u} "$0/v1.raw" && exec "$@"'
        )
        prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(vols))
        h = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'), prefix)
        try:
            answer = _launch(root, h)
        finally:
            h.stop()
        assert (answer["ok"], answer.get("reason")) == (False, "bind-other-fs"), answer
        assert f"{DATA}/volumes/v1.raw is on another file system than {BINDS}" in answer["message"]
        assert "data_dir must not be a mount point itself" in answer["message"]
        assert not (root / BINDS.lstrip("/") / "vm1").exists()
        assert not (root / "var/lib/bcd-sim/systemd/units.json").exists() or "bcd-ch-vm1.service" not in (
            json.loads((root / "var/lib/bcd-sim/systemd/units.json").read_text())
        )
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_round11_ch_stop_removes_the_links_when_the_instance_directory_is_already_gone(
    host: tuple[Path, HelperProcess],
) -> None:
    """The links go with the stopped unit even when no record is left to name its uid (a directory the
    node removed first): nothing of root's keeps a deleted instance's volumes alive."""
    root, h = host
    assert _launch(root, h)["ok"] is True
    shutil.rmtree(root / f"{DATA}/cloud-hypervisor/instances/vm1".lstrip("/"))
    units_path = root / "var/lib/bcd-sim/systemd/units.json"
    units = json.loads(units_path.read_text())
    units["bcd-ch-vm1.service"]["properties"].pop("User")  # a unit systemd forgot (--collect)
    units_path.write_text(json.dumps(units))
    _stop(h)
    assert not (root / BINDS.lstrip("/") / "vm1").exists()
    assert os.lstat(root / f"{DATA}/volumes/v1.raw".lstrip("/")).st_nlink == 1
