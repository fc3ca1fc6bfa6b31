"""The root-only rule: root writes and removes files only under directories only root can write.

Whenever bcd acts as root (the helper, or `bcd node` run as root), every file it writes or removes
goes through this module (host-config.md, "Root's records"; HST-ROOT-01..08):

- each existing directory from `/` down to the file must be a real directory (not a symlink),
  owned by root, writable by neither group nor others. A POSIX ACL that grants a named user or
  group write shows in the group bits (the ACL mask), so it is caught by the same check;
- `/tmp` (and `/var/tmp`, `/dev/shm`) and anything the unprivileged node owns or could have created
  is refused with "<directory> is not a directory only root can write: bcd will not write as root
  under it", and nothing is written;
- the walk opens each component relative to the directory fd verified before it, never following a
  symlink (`openat2` with RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH when the kernel has it, else
  O_NOFOLLOW per component). Directory fds are opened O_RDONLY|O_DIRECTORY (root can read any
  directory, and an O_PATH fd could not be fsynced after a mkdir or rename). The checks are made
  on the open fds, so a symlink or directory swapped in between the check and the use makes the
  open fail instead of steering the write;
- the final component is never followed either: an existing symlink, directory or other non-regular
  file at the target is refused (Q-HST-ROOT-01, decided: refuse, naming the file);
- writes are atomic relative to the verified directory fd: a temporary file created O_EXCL with no
  follow, written, fchmod, fsync, renamed over the target, then the directory fsynced;
- directories that do not exist yet are created by root on the way, mode 0755 root:root, each
  relative to its verified parent fd (Q-HST-ROOT-02, decided: the rule applies to what exists;
  what root creates is root-only by construction).

`root` is the directory that stands for `/`: `/` on a real host, the simulated host's directory in
tests and `bcd sim`. The walk starts there, so on a simulated host the directories from the
simulated root down are held to the rule, with their real ownership and modes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

# Host paths under which root never writes, whatever their modes (world-writable by design).
NEVER_UNDER: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm")  # noqa: S108 (refused, never used)

_SYS_OPENAT2 = 437  # x86_64 and aarch64 (asm-generic) alike
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08

_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class RootPathRefused(Exception):
    """A write or removal as root that the rule refuses. `path` is the offending host path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message

    def __str__(self) -> str:
        return self.message


def refusal_message(path: str) -> str:
    """The seeds' message (HST-ROOT-07)."""
    return f"{path} is not a directory only root can write: bcd will not write as root under it"


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - every Linux has a libc
        return None


_LIBC = _libc()


def openat2(dir_fd: int, name: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2) through syscall 437. Raises OSError (ENOSYS where the kernel lacks it)."""
    if _LIBC is None:
        raise OSError(errno.ENOSYS, "openat2: no libc")
    how = _OpenHow(flags, mode, resolve)
    syscall = _LIBC.syscall
    syscall.restype = ctypes.c_long
    fd = int(
        syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(os.fsencode(name)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"openat2 {name!r}: {os.strerror(err)}")
    return fd


def _probe_openat2() -> bool:
    try:
        fd = openat2(-100, "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS)
    except OSError:
        return False
    os.close(fd)
    return True


HAVE_OPENAT2 = _probe_openat2()


def _open_component(dir_fd: int, name: str, flags: int, mode: int = 0) -> int:
    """Open one name relative to `dir_fd`, never following a symlink at it."""
    if HAVE_OPENAT2:
        return openat2(
            dir_fd,
            name,
            flags | os.O_CLOEXEC,
            mode,
            _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_BENEATH,
        )
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)


def split_host_path(path: str) -> tuple[str, ...]:
    """The components of an absolute host path free of '..', '.' and empty parts."""
    if not path.startswith("/") or "\x00" in path:
        raise RootPathRefused(path, f"{path!r} is not an absolute host path")
    # Split by hand: PurePosixPath drops '.' parts and a trailing '/', and would accept them.
    parts = tuple(path[1:].split("/"))
    if any(p in ("..", ".", "") for p in parts):
        raise RootPathRefused(path, f"{path!r} is not a plain absolute host path")
    return parts


def _check_dir_stat(st: os.stat_result, shown: str) -> None:
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise RootPathRefused(shown, refusal_message(shown))


def _host_join(parts: tuple[str, ...]) -> str:
    return "/" + "/".join(parts)


def _refuse_never_under(parts: tuple[str, ...]) -> None:
    host = _host_join(parts)
    for banned in NEVER_UNDER:
        if host == banned or host.startswith(banned + "/"):
            raise RootPathRefused(banned, refusal_message(banned))


def _open_root(root: Path) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_dir_stat(os.fstat(fd), "/")
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def verified_dir(root: Path, dir_parts: tuple[str, ...], *, create: bool) -> Iterator[int]:
    """An O_RDONLY fd of host directory `/dir_parts...` under `root`, checked from `/` down.

    Every component is opened relative to the fd before it without following symlinks, and its
    stat is read from that fd: what was checked is what is used. With `create`, missing
    directories are made 0755 by root (root-only by construction).
    """
    if dir_parts:
        _refuse_never_under(dir_parts)
    fd = _open_root(root)
    try:
        for i, name in enumerate(dir_parts):
            shown = _host_join(dir_parts[: i + 1])
            flags = os.O_RDONLY | _DIR_FLAGS
            try:
                try:
                    nfd = _open_component(fd, name, flags)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                        os.fsync(fd)
                    nfd = _open_component(fd, name, flags)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
                    raise RootPathRefused(shown, refusal_message(shown)) from exc
                raise
            os.close(fd)
            fd = nfd
            _check_dir_stat(os.fstat(fd), shown)
        yield fd
    finally:
        os.close(fd)


def check_root_only(root: Path, path: str) -> None:
    """Raise RootPathRefused unless every existing directory down to `path` is root-only."""
    parts = split_host_path(path)
    _refuse_never_under(parts)
    existing: list[str] = []
    for name in parts[:-1]:
        existing.append(name)
        real = root.joinpath(*existing)
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            return
        _check_dir_stat(st, _host_join(tuple(existing)))
    _check_dir_stat(os.lstat(root), "/")


def _check_target(dir_fd: int, name: str, shown: str) -> bool:
    """True when `name` exists as a regular file; refuses a symlink or other file type."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise RootPathRefused(shown, f"{shown} is not a regular file: bcd will not write as root through it")
    return True


def write_root_only(
    root: Path,
    path: str,
    data: bytes,
    mode: int = 0o644,
    *,
    uid: int = 0,
    gid: int = 0,
    check: Callable[[int], None] | None = None,
    before_fsync: Callable[[], None] | None = None,
) -> None:
    """Write `data` to host path `path` as root, atomically and durably, under the rule. `check`, when
    given, is called with the verified directory's fd before anything is written there (a limit on
    the directory's files): what it raises stops the write. `before_fsync`, when given, is called once
    the temporary file holds the data, just before its fsync (the helper starts its audit line's
    write there, so that the line's fsync overlaps the file's)."""
    parts = split_host_path(path)
    _refuse_never_under(parts)
    with verified_dir(root, parts[:-1], create=True) as dfd:
        name = parts[-1]
        _check_target(dfd, name, path)
        if check is not None:
            check(dfd)
        tmp = f".{name}.{os.urandom(6).hex()}.tmp"
        fd = _open_component(dfd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if (uid, gid) != (os.geteuid(), os.getegid()):
                    os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
                if before_fsync is not None:
                    before_fsync()
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)


def remove_root_only(root: Path, path: str) -> bool:
    """Remove host path `path` as root under the rule; True when something was removed."""
    parts = split_host_path(path)
    _refuse_never_under(parts)
    try:
        ctx = verified_dir(root, parts[:-1], create=False)
        dfd = ctx.__enter__()
    except FileNotFoundError:
        return False
    try:
        if not _check_target(dfd, parts[-1], path):
            return False
        os.unlink(parts[-1], dir_fd=dfd)
        os.fsync(dfd)
        return True
    finally:
        ctx.__exit__(None, None, None)


def read_root_only(root: Path, path: str, limit: int = 64 * 1024 * 1024) -> bytes | None:
    """Read a file root relies on (records, config) under the rule; None when it does not exist."""
    parts = split_host_path(path)
    try:
        with verified_dir(root, parts[:-1], create=False) as dfd:
            if not _check_target(dfd, parts[-1], path):
                return None
            fd = _open_component(dfd, parts[-1], os.O_RDONLY)
            try:
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read(limit + 1)
            finally:
                os.close(fd)
    except FileNotFoundError:
        return None
    if len(data) > limit:
        raise RootPathRefused(path, f"{path} is larger than {limit} bytes")
    return data


def open_regular_nofollow(root: Path, path: str) -> tuple[int, os.stat_result]:
    """Open an existing file for reading through verified directories, never following a symlink.

    Returns the fd and its fstat. Used where root must read a file it did not write itself but
    whose directories it trusts (its own config).
    """
    parts = split_host_path(path)
    with verified_dir(root, parts[:-1], create=False) as dfd:
        try:
            fd = _open_component(dfd, parts[-1], os.O_RDONLY)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                raise RootPathRefused(path, f"{path} is a symbolic link") from exc
            raise
    return fd, os.fstat(fd)
