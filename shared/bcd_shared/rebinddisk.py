"""The identity rebind disk's layout, shared by the node and the helper (seeds "Identity rebind").

A raw file of exactly 1 MiB in the instance's directory (`<instance dir>/rebind.img`), hot-added to the
running guest as virtio disk `vdz` with serial `bc-rebind` (DLV-REB-07/09), read-write: the tar of the
bundle at offset 0, the guest's answer `BCREBOUND <nonce>` at the start of its last 4 KiB
(DLV-REB-05/06). The helper builds the same `virsh attach-disk` argv from the instance's name alone.
The file is zeroed before it is deleted (`zero_and_remove`), so the secret never stays on the host.
"""

from __future__ import annotations

import os

REBIND_FILE = "rebind.img"
REBIND_SIZE = 1 << 20
ANSWER_SIZE = 4096
REBIND_TARGET = "vdz"
REBIND_SERIAL = "bc-rebind"


def attach_args(path: str) -> list[str]:
    """`virsh attach-disk NAME` + these: the disk raw (never probed), virtio, its serial, live only."""
    return [path, REBIND_TARGET, "--targetbus", "virtio", "--driver", "qemu", "--subdriver", "raw",
            "--serial", REBIND_SERIAL, "--live"]  # fmt: skip


def detach_args() -> list[str]:
    return [REBIND_TARGET, "--live"]


def zero_and_remove(real: str) -> None:
    """Overwrite a file with zeros, fsync, unlink (O_NOFOLLOW: never a link's target)."""
    try:
        fd = os.open(real, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        chunk = b"\0" * min(size, 1 << 20)
        written = 0
        while written < size:
            written += os.write(fd, chunk[: size - written])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(real)
