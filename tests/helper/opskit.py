"""In-process calls of the helper's op handlers: a HelperContext over a temporary root, and a host whose
programs are scripted and recorded (the argv lists root would run)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from bcd_helper.audit import AuditLog
from bcd_helper.config import parse_config
from bcd_helper.ops.base import BoundedSystem, Call, Deadline, Failed, HelperContext, Peer, Refused
from bcd_helper.ops.table import LOCK_ORDER
from bcd_helper.protocol import structure
from bcd_shared.system import DEFAULT_TOOL_TIMEOUT_S, CommandResult, LocalSystem

NODE_UID = 4242
# A well-formed nft.apply NIC policy (test_nft_unit in process, test_helper_nft through a real helper).
GOOD_NIC: dict[str, Any] = {
    "instance": "vm-1",
    "index": 0,
    "bridge": "br0",
    "mac": "52:54:00:00:00:01",
    "addresses": ["10.0.0.5/24", "fd00::5/64"],
    "policy": "PRIVATE",
    "ssh_from_host_only": True,
}
Script = Callable[[tuple[str, ...]], tuple[int, bytes, bytes]]


class Handed(NamedTuple):
    """A descriptor a program was handed (`pass_fds`) as it was while the program ran: the file it names
    (/proc/self/fd/N), that file's (st_dev, st_ino), its access mode (os.O_RDONLY, os.O_RDWR) and
    whether it was inheritable in root's process (root opens with O_CLOEXEC; only the child gets it),
    and whether it was in blocking mode."""

    fd: int
    path: str
    inode: tuple[int, int]
    access: int
    inheritable: bool
    blocking: bool


def handed(fd: int) -> Handed:
    st = os.fstat(fd)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    path = os.readlink(f"/proc/self/fd/{fd}")
    inode = (st.st_dev, st.st_ino)
    return Handed(fd, path, inode, flags & os.O_ACCMODE, os.get_inheritable(fd), not flags & os.O_NONBLOCK)


class Programs(LocalSystem):
    """A simulated host whose programs answer from `script` (argv -> status, stdout, stderr; default: exit
    0, no output), every run recorded with its timeout, its stdin and the descriptors it was handed
    (`handed[i]` for `runs[i]`; a descriptor that is not open fails the run as subprocess would)."""

    def __init__(self, root: Path, script: Script | None = None) -> None:
        super().__init__(root)
        self.script = script
        self.runs: list[tuple[str, ...]] = []
        self.timeouts: list[float] = []
        self.inputs: list[bytes | None] = []
        self.handed: list[tuple[Handed, ...]] = []

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TOOL_TIMEOUT_S,
        input: bytes | None = None,
        pass_fds: Sequence[int] = (),
    ) -> CommandResult:
        args = tuple(argv)
        self.runs.append(args)
        self.timeouts.append(timeout)
        self.inputs.append(input)
        self.handed.append(tuple(handed(fd) for fd in pass_fds))
        rc, out, err = self.script(args) if self.script is not None else (0, b"", b"")
        return CommandResult(args, rc, out, err)


def make_root(parent: Path) -> Path:
    root = parent / "host"
    root.mkdir(mode=0o755)
    return root


def context(root: Path, config: str = "", script: Script | None = None) -> HelperContext:
    """`config`: lines added to root's config.toml (top-level keys first, then sections)."""
    text = config + f'\n[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE_UID}\n'
    if "[helper]" in config:
        text = config
    cfg = parse_config(text.encode())
    audit = AuditLog(root, cfg.audit_dir, syslog=False)
    return HelperContext(
        root=root, config=cfg, system=Programs(root, script), audit=audit, lock_names=LOCK_ORDER
    )


def call(ctx: HelperContext, timeout_s: float = 60.0, uid: int = NODE_UID, *, bounded: bool = True) -> Call:
    """`bounded` False: the op's programs reach the recorded host with the timeouts the op asks for
    (the server's BoundedSystem would cut them to the call's deadline)."""
    deadline = Deadline(timeout_s)
    system = BoundedSystem(ctx.system, deadline) if bounded else ctx.system
    return Call(ctx, Peer(1, uid, uid), deadline, system)  # type: ignore[arg-type]


def programs(ctx: HelperContext) -> Programs:
    assert isinstance(ctx.system, Programs)
    return ctx.system


def refused(fn: Any, *args: Any) -> tuple[str, str]:
    """fn(*args) refused: its reason and message."""
    with pytest.raises(Refused) as info:
        fn(*args)
    return info.value.reason, info.value.message


def failed(fn: Any, *args: Any) -> tuple[str, str]:
    """fn(*args) failed: its reason and message."""
    with pytest.raises(Failed) as info:
        fn(*args)
    return info.value.reason, info.value.message


def req(cls: type[Any], **args: Any) -> Any:
    """The request as the server decodes it from the frame's args."""
    return structure(args, cls)
