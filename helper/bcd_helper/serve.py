"""`bcd helper serve`: run the root helper on its Unix socket until SIGTERM or SIGINT.

`--root DIR` serves a simulated host (a directory standing for `/`, with the simulated host's fake
programs); the config path is a host path under it. Everything else (the root-only rule on the
config and on every write, ownership, modes) is the real thing, checked on the real files.

One helper per socket (issue 9 item 12): before it touches the socket, `serve` takes an exclusive,
non-blocking flock on `<socket>.lock` beside it (0600 root) and writes its pid there; a second `serve`
finds it held and exits 1 with one line naming the pid that holds it. The lock goes with the process.

The audit log's sealing key is made by `bcd helper audit init` at set-up, which prints its verification key
once; a start without one makes a key no one holds and warns (docs/helper.md "Audit log").
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from bcd_shared.rootpath import RootPathRefused, split_host_path, verified_dir
from bcd_shared.system import LocalSystem

from bcd_helper.audit import AuditError, AuditLog
from bcd_helper.config import DEFAULT_CONFIG, ConfigError, load_config
from bcd_helper.ops.base import Failed, HelperContext
from bcd_helper.ops.daemon import RELEASE_STATE
from bcd_helper.ops.table import lock_names
from bcd_helper.server import Guards, HelperServer, RootServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", default="/", help="the directory standing for / (a simulated host)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="root's config.toml (host path)")


def _system(root: Path) -> LocalSystem:
    if root == Path("/"):
        return LocalSystem(root)
    from bcd_shared.simhost import sim_system

    return sim_system(root)


class Helper:
    """The two servers of one helper, the lock that makes it the only one, and their shared guards."""

    def __init__(self, node: HelperServer, root: RootServer, guards: Guards, lock_fd: int) -> None:
        self.node = node
        self.root = root
        self.guards = guards
        self.lock_fd = lock_fd

    def serve_forever(self) -> None:
        thread = threading.Thread(
            target=self.root.serve_forever, args=(0.2,), name="root-socket", daemon=True
        )
        thread.start()
        try:
            self.node.serve_forever(poll_interval=0.2)
        finally:
            self.root.shutdown()
            thread.join(timeout=5)

    def close(self) -> None:
        self.node.server_close()
        self.root.server_close()
        self.guards.close()
        os.close(self.lock_fd)


def take_lock(path: Path) -> int:
    """The helper's lock fd (flock held, our pid written). Raises ConfigError naming the holder's pid."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"another helper (pid {holder}) holds {path}: not starting a second one") from None
    os.fchmod(fd, 0o600)
    pid = f"{os.getpid()}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, pid, 0)
    return fd


def build(root: Path, config_path: str) -> Helper:
    """Check root's config, take the lock, open the audit log and bind both sockets. Raises ConfigError."""
    config = load_config(root, config_path)
    sock_parts = split_host_path(config.socket)
    root_parts = split_host_path(config.root_socket)
    try:
        with verified_dir(root, sock_parts[:-1], create=True):
            pass
        with verified_dir(root, root_parts[:-1], create=True):
            pass
    except RootPathRefused as exc:
        raise ConfigError(str(exc)) from None
    real_socket = str(root.joinpath(*sock_parts))
    lock_fd = take_lock(Path(real_socket + ".lock"))
    try:
        try:
            audit = AuditLog(root, config.audit_dir, max_bytes=config.audit_max_bytes, keep=config.audit_keep)
        except RootPathRefused as exc:
            raise ConfigError(str(exc)) from None
        except AuditError as exc:
            raise ConfigError(f"audit log: {exc}") from None
        if audit.created_key is not None:  # never printed here: the journal is on this host
            print(
                "bcd helper: warning: the audit log had no sealing key; one was made that no one holds, so "
                "`audit verify --key` cannot be used for this log (run `bcd helper audit init` at set-up, "
                "before the first start, and keep the key it prints off this host)",
                file=sys.stderr,
                flush=True,
            )
        ctx = HelperContext(
            root=root, config=config, system=_system(root), audit=audit, lock_names=lock_names()
        )
        if os.path.lexists(root.joinpath(*split_host_path(RELEASE_STATE))):
            from bcd_helper.ops.daemon import resume

            try:
                resume(ctx)  # a self-update still waiting for its confirmation gets its timer back
            except Failed as exc:  # daemon.swap and daemon.confirm fail the same way until it is fixed
                print(f"bcd helper: {exc.message}", file=sys.stderr)
        guards = Guards(ctx)
        node = HelperServer(ctx, real_socket, guards)
        try:
            root_server = RootServer(ctx, str(root.joinpath(*root_parts)), guards)
        except BaseException:
            node.server_close()
            raise
    except BaseException:
        os.close(lock_fd)
        raise
    return Helper(node, root_server, guards, lock_fd)


def _stop(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def _bound_malloc() -> None:
    """glibc's malloc raises its mmap threshold to the largest block freed (up to 32 MiB) and gives each
    thread an arena of its own: a frame's 4 MiB buffer, freed, would then stay resident in every
    connection thread's arena. A fixed threshold (blocks of 128 KiB and more are mmapped and unmapped
    when freed) and two arenas keep the helper's memory to what is in flight (issue 9 item 3)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_mmap_threshold, m_arena_max = -3, -8
    mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(128 * 1024))
    mallopt(ctypes.c_int(m_arena_max), ctypes.c_int(2))


def run(args: argparse.Namespace) -> int:
    root = Path(args.root).resolve()
    _bound_malloc()
    try:
        helper = build(root, args.config)
    except ConfigError as exc:
        print(f"bcd helper: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _stop)
    try:
        helper.serve_forever()
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        with contextlib.suppress(OSError):
            helper.close()
    return 0
