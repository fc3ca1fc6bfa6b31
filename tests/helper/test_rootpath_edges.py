"""The root-only rule's edges, each refusal checked for its path and message (issue 14, mutation testing).

Real files on a simulated host made by root (`fresh_root`): the refusals of `split_host_path` with each
kind of bad path, the never-under list at its boundary, the simulated `/` itself held to the rule, the
last directory of a deep path, targets that are symlinks or directories, `read_root_only` (the records
and config root reads back), the mode and owner `write_root_only` gives by default and on request, the
temporary file removed when a write fails, and the same rule through the O_NOFOLLOW fallback used where
the kernel lacks openat2.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

import pytest
from bcd_shared import rootpath
from bcd_shared.rootpath import (
    RootPathRefused,
    check_root_only,
    open_regular_nofollow,
    openat2,
    read_root_only,
    refusal_message,
    remove_root_only,
    split_host_path,
    write_root_only,
)

NOT_REGULAR = "is not a regular file: bcd will not write as root through it"


def _refused(call: object, *args: object, **kw: object) -> RootPathRefused:
    with pytest.raises(RootPathRefused) as exc:
        call(*args, **kw)  # type: ignore[operator]
    return exc.value


def test_refusal_carries_its_path_and_message() -> None:
    err = RootPathRefused("/etc/x", "the message")
    assert (err.path, err.message, str(err), err.args) == (
        "/etc/x",
        "the message",
        "the message",
        ("the message",),
    )


@pytest.mark.parametrize("path", ["etc/x", "", "x", "\x00/etc/x", "/etc/a\x00b", "/etc/\x00"])
def test_split_refuses_relative_paths_and_nul(path: str) -> None:
    err = _refused(split_host_path, path)
    assert (err.path, err.message) == (path, f"{path!r} is not an absolute host path")


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/etc/../x",
        "/etc/./x",
        "/..",
        "/.",
        "/etc//x",
        "/etc/x/..",
        "/a/b//",
        "/etc/x/",
        "/etc/x/.",
        "//etc/x",
    ],
)
def test_split_refuses_dot_parts_double_slashes_and_the_root(path: str) -> None:
    err = _refused(split_host_path, path)
    assert (err.path, err.message) == (path, f"{path!r} is not a plain absolute host path")


def test_split_keeps_plain_paths() -> None:
    assert split_host_path("/etc/cdi/bcd-a.json") == ("etc", "cdi", "bcd-a.json")
    assert split_host_path("/etc/..x/.y") == ("etc", "..x", ".y")


@pytest.mark.parametrize(
    ("path", "banned"),
    [("/tmp", "/tmp"), ("/tmp/x", "/tmp"), ("/var/tmp/a/b", "/var/tmp"), ("/dev/shm/x", "/dev/shm")],
)
def test_never_under_even_when_the_directory_is_root_only(fresh_root: Path, path: str, banned: str) -> None:
    """The simulated /tmp is root's and 0755 here: the list refuses it, not the modes."""
    (fresh_root / "var/tmp").mkdir(exist_ok=True)
    (fresh_root / "dev/shm").mkdir(exist_ok=True)
    for call in (write_root_only, remove_root_only):
        args = (fresh_root, path, b"x") if call is write_root_only else (fresh_root, path)
        err = _refused(call, *args)
        assert (err.path, err.message) == (banned, refusal_message(banned))
    err = _refused(check_root_only, fresh_root, path)
    assert err.path == banned
    assert list((fresh_root / "tmp").iterdir()) == []


def test_never_under_is_a_prefix_of_whole_components(fresh_root: Path) -> None:
    write_root_only(fresh_root, "/tmpx/f", b"1")
    write_root_only(fresh_root, "/var/tmpfiles/f", b"2")
    assert (fresh_root / "tmpx/f").read_bytes() == b"1"
    assert (fresh_root / "var/tmpfiles/f").read_bytes() == b"2"


def test_the_simulated_root_itself_is_held_to_the_rule(fresh_root: Path) -> None:
    os.chmod(fresh_root, 0o775)
    expected = ("/", refusal_message("/"))
    for call, args in (
        (write_root_only, (fresh_root, "/etc/x", b"x")),
        (remove_root_only, (fresh_root, "/etc/x")),
        (read_root_only, (fresh_root, "/etc/x")),
        (check_root_only, (fresh_root, "/etc/x")),
        (open_regular_nofollow, (fresh_root, "/etc/x")),
    ):
        err = _refused(call, *args)
        assert (err.path, err.message) == expected, call
    assert not (fresh_root / "etc/x").exists()


def test_check_walks_every_directory_down_to_the_last(fresh_root: Path) -> None:
    (fresh_root / "etc/a/b/c").mkdir(parents=True)
    check_root_only(fresh_root, "/etc/a/b/c/f")
    os.chmod(fresh_root / "etc/a/b/c", 0o777)
    err = _refused(check_root_only, fresh_root, "/etc/a/b/c/f")
    assert (err.path, err.message) == ("/etc/a/b/c", refusal_message("/etc/a/b/c"))
    os.chmod(fresh_root / "etc/a/b/c", 0o755)
    os.chmod(fresh_root / "etc/a/b", 0o757)
    assert _refused(check_root_only, fresh_root, "/etc/a/b/c/f").path == "/etc/a/b"
    # A directory not there yet ends the walk: root will create it.
    check_root_only(fresh_root, "/etc/new/deeper/f")


def test_a_directory_root_does_not_own_is_refused_whatever_its_mode(fresh_root: Path) -> None:
    (fresh_root / "etc/theirs").mkdir()
    os.chown(fresh_root / "etc/theirs", 4321, 0)  # 0755, but not root's
    for call, args in (
        (write_root_only, (fresh_root, "/etc/theirs/f", b"x")),
        (check_root_only, (fresh_root, "/etc/theirs/f")),
        (read_root_only, (fresh_root, "/etc/theirs/f")),
    ):
        err = _refused(call, *args)
        assert (err.path, err.message) == ("/etc/theirs", refusal_message("/etc/theirs")), call
    assert list((fresh_root / "etc/theirs").iterdir()) == []


def test_write_refusals_name_their_directory(fresh_root: Path) -> None:
    (fresh_root / "etc/gw").mkdir()
    os.chmod(fresh_root / "etc/gw", 0o775)
    err = _refused(write_root_only, fresh_root, "/etc/gw/sub/f", b"x")
    assert (err.path, err.message) == ("/etc/gw", refusal_message("/etc/gw"))
    assert not (fresh_root / "etc/gw/sub").exists()


@pytest.mark.parametrize("kind", ["symlink-to-file", "dangling-symlink", "directory", "fifo"])
def test_a_target_that_is_not_a_regular_file_is_refused(fresh_root: Path, kind: str) -> None:
    (fresh_root / "etc/real").write_bytes(b"root's\n")
    target = fresh_root / "etc/t"
    if kind == "symlink-to-file":
        target.symlink_to("real")
    elif kind == "dangling-symlink":
        target.symlink_to("nowhere")
    elif kind == "directory":
        target.mkdir()
    else:
        os.mkfifo(target)
    expected = ("/etc/t", f"/etc/t {NOT_REGULAR}")
    err = _refused(write_root_only, fresh_root, "/etc/t", b"new")
    assert (err.path, err.message) == expected
    err = _refused(remove_root_only, fresh_root, "/etc/t")
    assert (err.path, err.message) == expected
    err = _refused(read_root_only, fresh_root, "/etc/t")
    assert (err.path, err.message) == expected
    assert (fresh_root / "etc/real").read_bytes() == b"root's\n"
    assert os.path.lexists(target)


def test_write_gives_root_0644_by_default_and_what_is_asked_otherwise(fresh_root: Path) -> None:
    write_root_only(fresh_root, "/etc/new/dir/f", b"abc")
    st = (fresh_root / "etc/new/dir/f").stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o644, 0, 0)
    for d in ("etc/new", "etc/new/dir"):
        dst = (fresh_root / d).stat()
        assert (stat.S_IMODE(dst.st_mode), dst.st_uid, dst.st_gid) == (0o755, 0, 0)
    write_root_only(fresh_root, "/etc/new/dir/g", b"x" * 100_000, 0o640, uid=4321, gid=4322)
    st = (fresh_root / "etc/new/dir/g").stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, 4321, 4322)
    assert (fresh_root / "etc/new/dir/g").read_bytes() == b"x" * 100_000
    write_root_only(fresh_root, "/etc/new/dir/g", b"replaced")
    st = (fresh_root / "etc/new/dir/g").stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size) == (0o644, 0, 0, 8)
    assert sorted(os.listdir(fresh_root / "etc/new/dir")) == ["f", "g"]


def test_a_failed_write_leaves_neither_the_file_nor_its_temporary(fresh_root: Path) -> None:
    """An owner the kernel cannot take fails between create and rename: the error is the write's own."""
    (fresh_root / "etc/d").mkdir()
    with pytest.raises(OverflowError):
        write_root_only(fresh_root, "/etc/d/f", b"x", uid=2**40)
    assert os.listdir(fresh_root / "etc/d") == []


def test_remove(fresh_root: Path) -> None:
    (fresh_root / "etc/d").mkdir()
    (fresh_root / "etc/d/f").write_bytes(b"x")
    assert remove_root_only(fresh_root, "/etc/d/f") is True
    assert not (fresh_root / "etc/d/f").exists()
    assert remove_root_only(fresh_root, "/etc/d/f") is False
    # A missing directory: nothing to remove, and nothing created on the way.
    assert remove_root_only(fresh_root, "/etc/missing/deeper/f") is False
    assert not (fresh_root / "etc/missing").exists()


def test_read_root_only(fresh_root: Path) -> None:
    (fresh_root / "etc/d").mkdir()
    (fresh_root / "etc/d/f").write_bytes(b"0123456789")
    assert read_root_only(fresh_root, "/etc/d/f") == b"0123456789"
    assert read_root_only(fresh_root, "/etc/d/f", limit=10) == b"0123456789"
    err = _refused(read_root_only, fresh_root, "/etc/d/f", limit=9)
    assert (err.path, err.message) == ("/etc/d/f", "/etc/d/f is larger than 9 bytes")
    assert read_root_only(fresh_root, "/etc/d/none") is None
    assert read_root_only(fresh_root, "/etc/missing/f") is None
    assert not (fresh_root / "etc/missing").exists()
    (fresh_root / "etc/d/empty").write_bytes(b"")
    assert read_root_only(fresh_root, "/etc/d/empty") == b""
    os.chmod(fresh_root / "etc/d", 0o775)
    err = _refused(read_root_only, fresh_root, "/etc/d/f")
    assert (err.path, err.message) == ("/etc/d", refusal_message("/etc/d"))
    err = _refused(read_root_only, fresh_root, "etc/d/f")
    assert err.message == "'etc/d/f' is not an absolute host path"


def test_read_root_only_does_not_leak_its_fds(fresh_root: Path) -> None:
    (fresh_root / "etc/f").write_bytes(b"x")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        assert read_root_only(fresh_root, "/etc/f") == b"x"
        assert read_root_only(fresh_root, "/etc/none") is None
    assert len(os.listdir("/proc/self/fd")) == before


def test_open_regular_nofollow(fresh_root: Path) -> None:
    (fresh_root / "etc/f").write_bytes(b"cfg")
    fd, st = open_regular_nofollow(fresh_root, "/etc/f")
    try:
        assert os.read(fd, 10) == b"cfg" and st.st_size == 3 and stat.S_ISREG(st.st_mode)
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(fd)
    (fresh_root / "etc/link").symlink_to("f")
    err = _refused(open_regular_nofollow, fresh_root, "/etc/link")
    assert (err.path, err.message) == ("/etc/link", "/etc/link is a symbolic link")
    with pytest.raises(FileNotFoundError):
        open_regular_nofollow(fresh_root, "/etc/missing/f")
    assert not (fresh_root / "etc/missing").exists()


def test_openat2_defaults_and_errors(tmp_path: Path) -> None:
    """mode 0 and no resolve flags by default (the kernel refuses a mode without O_CREAT, and
    RESOLVE_NO_XDEV would refuse /proc's mount); a failure carries errno and the name."""
    (tmp_path / "f").write_bytes(b"y")
    fd = openat2(-100, str(tmp_path / "f"), os.O_RDONLY | os.O_CLOEXEC)
    try:
        assert os.read(fd, 2) == b"y"
    finally:
        os.close(fd)
    fd = openat2(-100, "/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    with pytest.raises(OSError) as exc:
        openat2(-100, str(tmp_path / "none"), os.O_RDONLY)
    assert exc.value.errno == errno.ENOENT
    assert (
        str(exc.value)
        == f"[Errno {errno.ENOENT}] openat2 {str(tmp_path / 'none')!r}: No such file or directory"
    )


def test_openat2_may_return_fd_0(tmp_path: Path) -> None:
    """fd 0 is a valid result (a daemon may run with stdin closed): only a negative one is an error."""
    (tmp_path / "f").write_bytes(b"z")
    saved = os.dup(0)
    try:
        os.close(0)
        fd = openat2(-100, str(tmp_path / "f"), os.O_RDONLY)
        assert fd == 0
        assert os.read(fd, 1) == b"z"
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def test_openat2_without_libc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rootpath, "_LIBC", None)
    with pytest.raises(OSError) as exc:
        openat2(-100, "/", os.O_RDONLY)
    assert (exc.value.errno, exc.value.strerror) == (errno.ENOSYS, "openat2: no libc")


def test_libc_reports_errno(monkeypatch: pytest.MonkeyPatch) -> None:
    """The libc handle keeps errno (use_errno): without it a failure would read as errno 0."""
    monkeypatch.setattr(rootpath, "_LIBC", rootpath._libc())
    with pytest.raises(OSError) as exc:
        openat2(-100, "/nonexistent-bcd-path", os.O_RDONLY)
    assert exc.value.errno == errno.ENOENT


def test_probe_says_no_where_openat2_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rootpath, "_LIBC", None)
    assert rootpath._probe_openat2() is False


def test_read_reads_no_more_than_its_limit(fresh_root: Path) -> None:
    """A (sparse) 1 TiB file is refused after reading limit + 1 bytes, not read whole into memory."""
    with open(fresh_root / "etc/huge", "wb") as f:
        f.truncate(1 << 40)
    err = _refused(read_root_only, fresh_root, "/etc/huge", limit=10)
    assert (err.path, err.message) == ("/etc/huge", "/etc/huge is larger than 10 bytes")


def test_probe_finds_openat2_on_this_kernel() -> None:
    """Linux 5.6+ has openat2 (every kernel bcd supports); the probe opens / and closes it."""
    before = len(os.listdir("/proc/self/fd"))
    assert rootpath._probe_openat2() is True
    assert len(os.listdir("/proc/self/fd")) == before


def test_components_stay_beneath_their_directory(fresh_root: Path) -> None:
    """RESOLVE_BENEATH: a '..' or an absolute name cannot leave the verified directory."""
    dfd = os.open(fresh_root / "etc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in ("..", "../etc", str(fresh_root)):
            with pytest.raises(OSError) as exc:
                rootpath._open_component(dfd, name, os.O_RDONLY | os.O_DIRECTORY)
            assert exc.value.errno == errno.EXDEV, name
    finally:
        os.close(dfd)


class TestWithoutOpenat2:
    """The O_NOFOLLOW-per-component fallback (kernels before 5.6) keeps the same rule."""

    @pytest.fixture(autouse=True)
    def _no_openat2(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(rootpath, "HAVE_OPENAT2", False)

    def test_write_read_remove(self, fresh_root: Path) -> None:
        write_root_only(fresh_root, "/etc/fb/f", b"data", 0o600)
        st = (fresh_root / "etc/fb/f").stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert read_root_only(fresh_root, "/etc/fb/f") == b"data"
        fd, _ = open_regular_nofollow(fresh_root, "/etc/fb/f")
        try:
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            assert os.read(fd, 10) == b"data"
        finally:
            os.close(fd)
        assert remove_root_only(fresh_root, "/etc/fb/f") is True

    def test_symlinks_refused(self, fresh_root: Path) -> None:
        (fresh_root / "etc/real").mkdir()
        (fresh_root / "etc/real/f").write_bytes(b"x")
        (fresh_root / "etc/link").symlink_to("real")
        err = _refused(write_root_only, fresh_root, "/etc/link/g", b"x")
        assert (err.path, err.message) == ("/etc/link", refusal_message("/etc/link"))
        (fresh_root / "etc/flink").symlink_to("real/f")
        err = _refused(open_regular_nofollow, fresh_root, "/etc/flink")
        assert (err.path, err.message) == ("/etc/flink", "/etc/flink is a symbolic link")
        assert list((fresh_root / "etc/real").iterdir()) == [fresh_root / "etc/real/f"]


def test_check_is_handed_the_verified_directory_before_anything_is_written_there(fresh_root: Path) -> None:
    """`check` (a kind's limits, counted on the write's own directory) gets the target's verified directory
    as an open descriptor, before the temporary file exists; what it raises stops the write."""
    etc = fresh_root / "etc"
    before = sorted(os.listdir(etc))
    seen: list[tuple[bool, int, list[str]]] = []

    def check(dfd: int) -> None:
        st = os.fstat(dfd)
        seen.append((stat.S_ISDIR(st.st_mode), st.st_ino, sorted(os.listdir(dfd))))

    write_root_only(fresh_root, "/etc/checked", b"x\n", check=check)
    assert seen == [(True, os.stat(etc).st_ino, before)]
    assert (etc / "checked").read_bytes() == b"x\n"

    def full(dfd: int) -> None:
        raise RootPathRefused("/etc", "full")

    with pytest.raises(RootPathRefused):
        write_root_only(fresh_root, "/etc/refused", b"x\n", check=full)
    assert sorted(os.listdir(etc)) == sorted([*before, "checked"])
