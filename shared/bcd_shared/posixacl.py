"""POSIX ACL entries for one user, set and removed through an open file descriptor.

Root grants the VMM's user entries on files the node owns (DLV-CHH-02/04). `setfacl PATH` would
follow a symlink the node swapped in after root's check, so root opens each file itself
(O_NOFOLLOW), checks what it opened, and writes the `system.posix_acl_access` (and, on a directory,
`system.posix_acl_default`) extended attribute on that descriptor. The format is the kernel's
(include/uapi/linux/posix_acl_xattr.h): a little-endian u32 version 2, then entries of u16 tag,
u16 permissions, u32 id. The mask is recomputed as the union of the group-class entries, as
setfacl does, so an entry is effective as granted.
"""

from __future__ import annotations

import os
import stat
import struct

ACCESS = "system.posix_acl_access"
DEFAULT = "system.posix_acl_default"
VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
_HEAD = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")

Entry = tuple[int, int, int]  # tag, perms (rwx bits), id


def parse(blob: bytes) -> list[Entry]:
    if len(blob) < 4 or (len(blob) - 4) % _ENTRY.size or _HEAD.unpack_from(blob)[0] != VERSION:
        raise ValueError("not a version 2 POSIX ACL")
    return [_ENTRY.unpack_from(blob, off) for off in range(4, len(blob), _ENTRY.size)]


def encode(entries: list[Entry]) -> bytes:
    order = {USER_OBJ: 0, USER: 1, GROUP_OBJ: 2, GROUP: 3, MASK: 4, OTHER: 5}
    ordered = sorted(entries, key=lambda e: (order[e[0]], e[2] if e[0] in (USER, GROUP) else 0))
    return _HEAD.pack(VERSION) + b"".join(_ENTRY.pack(t, p, i) for t, p, i in ordered)


def _from_mode(mode: int) -> list[Entry]:
    return [
        (USER_OBJ, (mode >> 6) & 7, UNDEFINED_ID),
        (GROUP_OBJ, (mode >> 3) & 7, UNDEFINED_ID),
        (OTHER, mode & 7, UNDEFINED_ID),
    ]


def _read(fd: int, name: str, mode: int | None) -> list[Entry]:
    try:
        return parse(os.getxattr(fd, name))
    except OSError as exc:
        if exc.errno in (61, 95):  # ENODATA: no ACL yet; EOPNOTSUPP handled by the caller's write
            return _from_mode(mode) if mode is not None else []
        raise


def _with_user(entries: list[Entry], uid: int, perms: int | None) -> list[Entry]:
    kept = [e for e in entries if not (e[0] == USER and e[2] == uid) and e[0] != MASK]
    if perms is not None:
        kept.append((USER, perms, uid))
    named = [e for e in kept if e[0] in (USER, GROUP)]
    if named:
        group_class = 0
        for tag, p, _i in kept:
            if tag in (USER, GROUP, GROUP_OBJ):
                group_class |= p
        kept.append((MASK, group_class, UNDEFINED_ID))
    return kept


def set_user(fd: int, uid: int, perms: int, default: bool = False, access: bool = True) -> None:
    """Give `uid` the entry `perms` (rwx bits) on the open file; with `default`, in the directory's
    default ACL too, so what is created there inherits it (only there, without `access`)."""
    st = os.fstat(fd)
    if access:
        os.setxattr(fd, ACCESS, encode(_with_user(_read(fd, ACCESS, st.st_mode), uid, perms)))
    if default and stat.S_ISDIR(st.st_mode):
        os.setxattr(fd, DEFAULT, encode(_with_user(_read(fd, DEFAULT, st.st_mode), uid, perms)))


def remove_user(fd: int, uid: int) -> None:
    """Remove `uid`'s entries (access and, on a directory, default) from the open file."""
    st = os.fstat(fd)
    entries = _with_user(_read(fd, ACCESS, st.st_mode), uid, None)
    os.setxattr(fd, ACCESS, encode(entries))
    if stat.S_ISDIR(st.st_mode):
        current = _read(fd, DEFAULT, None)
        if current:
            os.setxattr(fd, DEFAULT, encode(_with_user(current, uid, None)))


def user_perms(fd: int, uid: int) -> int | None:
    """The entry `uid` has in the access ACL, or None."""
    entries = _read(fd, ACCESS, None)
    return next((p for t, p, i in entries if t == USER and i == uid), None)
