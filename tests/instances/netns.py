"""Run test code in a private network namespace that vanishes with it (no machine state touched).

`in_netns(fn)` runs `fn` in a fresh thread that first unshares its network namespace
(CLONE_NEWNET applies to the calling thread only), so the interfaces `fn` creates, and the programs
it starts (they inherit the thread's namespace), live and die there. Needs root."""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def in_netns(fn: Callable[[], T]) -> T:
    out: list[T] = []
    err: list[BaseException] = []

    def body() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) != 0:
            err.append(OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)"))
            return
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            err.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def open_tap(name: str) -> int:
    """Open (creating it when absent, in this thread's namespace) the tap `name`; its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd
