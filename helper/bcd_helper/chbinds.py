"""Root's bind sources for the cloud-hypervisor units (docs/helper.md, "Threat model, round 11").

`ch.launch` binds files into the VMM's namespace (`BindReadOnlyPaths=` the base image,
`BindPaths=` / `BindReadOnlyPaths=` each volume), and systemd, as root, resolves each source when it
sets that namespace up, after root's checks. The node's own paths (`data_dir/volumes/<name>`,
`data_dir/cloud-hypervisor/images/<sha256>.<format>`) go through directories the node owns, which it
can swap for a symlink in that window. So root binds, instead, a hard link of the very inode it
checked, in directories only root can write:

    BINDS = `<data_dir>-ch-binds`   root 0700, beside data_dir (its parent must pass the root-only
                                    rule, bcd_shared.rootpath: every directory from `/` root's and
                                    writable by no one else)
    BINDS/<id>/                     root 0700, one per instance
    BINDS/<id>/image                the base image
    BINDS/<id>/vol-<name>           each volume of vm.json

Each source is opened O_PATH|O_NOFOLLOW through the node's directories opened one by one without
following a link (a symlink anywhere on the way fails the open), checked on its descriptor (a regular
file the node owns), and linked from that descriptor (`linkat` of `/proc/self/fd/N` with
AT_SYMLINK_FOLLOW, which follows the descriptor, never a name); the link is checked again to be that
inode. The unit gets `SRC:DEST` (bcd_shared.chunit `bind_sources`): SRC the link, DEST the node's
path, where the VMM looks.

A hard link must be on the source's file system: a source on another file system than BINDS is
refused `bind-other-fs` with the layout to use (data_dir must not be a mount point itself: mount the
disk one level up). Lifecycle: `ch.launch` removes the instance's links before it makes new ones (a
re-launch), and again when the unit does not start; `ch.stop` removes them once the unit is inactive
or failed (the node's delete stops first). A link keeps its inode's blocks while it lasts: a volume
the node deletes while its instance's unit is launched is freed at that `ch.stop`, never later.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, split_host_path, verified_dir

from bcd_helper.ops.base import Call, Refused

IMAGE = "image"
VOLUME_PREFIX = "vol-"
SUFFIX = "-ch-binds"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def binds_dir(data_dir: str) -> str:
    """`<data_dir>-ch-binds`: beside data_dir, in data_dir's parent (root's)."""
    return data_dir.rstrip("/") + SUFFIX


def instance_binds(data_dir: str, name: str) -> str:
    return f"{binds_dir(data_dir)}/{name}"


@frozen
class Source:
    """A file to bind: the path the VMM sees (the node's, under data_dir), the link's name, the
    refusal's reason, and the op's own check of the opened inode (raises Refused)."""

    dest: str
    link_name: str
    reason: str
    check: Callable[[os.stat_result], None]


def _root_dir(parent: int, name: str, shown: str, create: bool) -> int | None:
    """`name` in the verified directory `parent`: made 0700 by root when missing (with `create`),
    opened without following a link, root's and 0700 (a root-only one is tightened to 0700); None when
    missing and not `create`."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
            os.fsync(parent)
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused("root-only", f"{shown} is not a directory only root can write") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        os.close(fd)
        raise Refused("root-only", f"{shown} is not a directory only root can write")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def _open_top(call: Call, create: bool) -> int | None:
    data_dir = call.ctx.config.data_dir.rstrip("/")
    top = binds_dir(data_dir)
    parts = split_host_path(top)
    try:
        with verified_dir(call.system.root, parts[:-1], create=False) as parent:
            return _root_dir(parent, parts[-1], top, create)
    except RootPathRefused as exc:
        raise Refused(
            "root-only",
            f"{exc.message} (root links the files it binds into a VMM's unit into {top}, beside data_dir)",
        ) from None


def remove(call: Call, name: str) -> list[str]:
    """Remove the instance's links and their directory; the links removed (host paths)."""
    top = _open_top(call, create=False)
    if top is None:
        return []
    shown = instance_binds(call.ctx.config.data_dir, name)
    try:
        ifd = _root_dir(top, name, shown, create=False)
        if ifd is None:
            return []
        removed: list[str] = []
        try:
            for entry in sorted(os.listdir(ifd)):
                if stat.S_ISDIR(os.stat(entry, dir_fd=ifd, follow_symlinks=False).st_mode):
                    continue  # root makes none; never followed
                os.unlink(entry, dir_fd=ifd)
                removed.append(f"{shown}/{entry}")
            os.fsync(ifd)
        finally:
            os.close(ifd)
        with contextlib.suppress(OSError):  # not empty: something root did not make stays
            os.rmdir(name, dir_fd=top)
        os.fsync(top)
        return removed
    finally:
        os.close(top)


def links(call: Call, name: str) -> list[str]:
    """The instance's links now (host paths): what `ch.stop` takes the VMM's ACL entries off."""
    top = _open_top(call, create=False)
    if top is None:
        return []
    shown = instance_binds(call.ctx.config.data_dir, name)
    try:
        ifd = _root_dir(top, name, shown, create=False)
        if ifd is None:
            return []
        try:
            return [f"{shown}/{e}" for e in sorted(os.listdir(ifd))]
        finally:
            os.close(ifd)
    finally:
        os.close(top)


def _open_source(call: Call, op: str, path: str, reason: str) -> int:
    """`path` (under data_dir) opened O_PATH|O_NOFOLLOW through directories opened without a link."""
    data_dir = call.ctx.config.data_dir.rstrip("/")
    parts = path[len(data_dir) + 1 :].split("/")
    try:
        dfd = os.open(call.system.host_path(data_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused("bad-layout", f"{op}: the node's data_dir: {exc.strerror}") from None
    try:
        for part in parts[:-1]:
            nxt = os.open(part, _DIR, dir_fd=dfd)
            os.close(dfd)
            dfd = nxt
        fd = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        raise Refused(
            reason, f"{op}: {path}: {exc.strerror} (a regular file, no symlink on the way)"
        ) from None
    finally:
        os.close(dfd)
    return fd


def link(call: Call, op: str, name: str, sources: list[Source]) -> dict[str, str]:
    """Link each source's checked inode into the instance's root-only directory (the old links removed
    first): {the path the VMM sees: the link's host path}. On any failure the links made go again."""
    remove(call, name)
    if not sources:
        return {}
    data_dir = call.ctx.config.data_dir.rstrip("/")
    shown = instance_binds(data_dir, name)
    top = _open_top(call, create=True)
    assert top is not None
    made: dict[str, str] = {}
    try:
        ifd = _root_dir(top, name, shown, create=True)
        assert ifd is not None
        try:
            dev = os.fstat(ifd).st_dev
            for src in sources:
                made[src.dest] = f"{shown}/{src.link_name}"
                _link_one(call, op, src, ifd, dev)
            os.fsync(ifd)
        finally:
            os.close(ifd)
    except BaseException:
        with contextlib.suppress(OSError, Refused):
            remove(call, name)
        raise
    finally:
        os.close(top)
    return made


def _link_one(call: Call, op: str, src: Source, ifd: int, dev: int) -> None:
    dest, link_name, reason = src.dest, src.link_name, src.reason
    fd = _open_source(call, op, dest, reason)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(reason, f"{op}: {dest} must be a regular file (no symlink)")
        src.check(st)
        if st.st_dev != dev:
            raise Refused("bind-other-fs", other_fs_message(op, dest, call.ctx.config.data_dir))
        try:
            os.link(f"/proc/self/fd/{fd}", link_name, dst_dir_fd=ifd, follow_symlinks=True)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise Refused("bind-other-fs", other_fs_message(op, dest, call.ctx.config.data_dir)) from None
            raise
        got = os.stat(link_name, dir_fd=ifd, follow_symlinks=False)
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):  # never: the directory is root's
            raise Refused("root-only", f"{op}: the link of {dest} is not the inode root checked")
    finally:
        os.close(fd)


def other_fs_message(op: str, path: str, data_dir: str) -> str:
    return (
        f"{op}: {path} is on another file system than {binds_dir(data_dir)}: root binds a hard link of "
        "the file it checked, which must be on the same file system, in a directory only root can "
        "write; data_dir must not be a mount point itself (mount the disk one level up, e.g. at "
        "/srv/bcd with data_dir = /srv/bcd/data, whose parent is root's)"
    )
