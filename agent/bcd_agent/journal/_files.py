"""File-system duties of the journal: the data_dir's modes, creating the db file durably, the process
lock, and moving a failed journal aside (renamed with a timestamp suffix, never deleted)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from pathlib import Path

from bcd_agent.journal._types import JournalLocked, UnsafeDataDir

SIDE_SUFFIXES = ("-wal", "-shm")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_data_dir(data_dir: Path) -> None:
    """Create data_dir 0700 (and fsync its parent), or check an existing one: it must be a directory
    owned by this user and not group- or world-writable (refused: someone else could swap the journal);
    broader read/search bits are narrowed to 0700."""
    try:
        st = os.lstat(data_dir)
    except FileNotFoundError:
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(data_dir, 0o700)
        except FileExistsError:
            pass
        else:
            fsync_dir(data_dir.parent)
        st = os.lstat(data_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDataDir(f"data_dir {data_dir}: not a directory (a symlink or file is refused)")
    if st.st_uid != os.geteuid():
        raise UnsafeDataDir(
            f"data_dir {data_dir}: owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDataDir(
            f"data_dir {data_dir}: mode {stat.S_IMODE(st.st_mode):04o} lets others write; must be 0700"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(data_dir, 0o700)


def create_db_file(path: Path) -> None:
    """Create an empty 0600 file and make its name durable (file and directory fsynced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def fix_file_modes(db_path: Path) -> None:
    """The db and its WAL/SHM files are 0600 (SQLite gives the side files the db's mode)."""
    for p in (db_path, *(Path(str(db_path) + s) for s in SIDE_SUFFIXES)):
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != 0o600:
                os.chmod(p, 0o600)


def move_aside(db_path: Path, now: float) -> tuple[Path, ...]:
    """Rename the db and its side files to `<name>.failed-<UTC timestamp>[-n]<side>`; fsync the dir."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    base = f"{db_path.name}.failed-{stamp}"
    n = 0
    while any((db_path.parent / (base + (f"-{n}" if n else "") + s)).exists() for s in ("", *SIDE_SUFFIXES)):
        n += 1
    target = base + (f"-{n}" if n else "")
    moved: list[Path] = []
    for s in ("", *SIDE_SUFFIXES):
        src = Path(str(db_path) + s)
        if src.exists():
            dst = db_path.parent / (target + s)
            os.rename(src, dst)
            moved.append(dst)
    fsync_dir(db_path.parent)
    return tuple(moved)


def lock_data_dir(lock_path: Path) -> int:
    """Take the journal's exclusive lock (released when the process dies); returns the fd to keep."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JournalLocked(f"{lock_path}: another process holds this journal") from None
    return fd


def unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
