"""`bcd helper serve`: run the root helper on its Unix socket until SIGTERM or SIGINT.

`--root DIR` serves a simulated host (a directory standing for `/`, with the simulated host's fake
programs); the config path is a host path under it. Everything else (the root-only rule on the
config and on every write, ownership, modes) is the real thing, checked on the real files.

One helper per socket (issue 9 item 12): before it touches the socket, `serve` takes an exclusive,
non-blocking flock on `<socket>.lock` beside it (0600 root) and writes its pid there; a second `serve`
finds it held and exits 75 (EX_TEMPFAIL) with one line naming the pid that holds it.
The lock goes with the process.

The audit log's sealing key is made by `bcd helper audit init` at set-up, which prints its verification key
once; a start without one makes a key no one holds and warns (docs/helper.md "Audit log").
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from bcd_shared import logsetup
from bcd_shared.rootpath import RootPathRefused, split_host_path, verified_dir
from bcd_shared.sdnotify import Notifier
from bcd_shared.simroot import SimHostMissing, sim_system, simhost_module
from bcd_shared.subcommands import root_dir
from bcd_shared.system import LocalSystem
from bcd_shared.version import VERSION

from bcd_helper.audit import AuditError, AuditLog
from bcd_helper.config import DEFAULT_CONFIG, ConfigError, load_config
from bcd_helper.ops.base import RELEASE_STATE, Failed, HelperContext
from bcd_helper.ops.table import lock_names
from bcd_helper.server import Guards, HelperServer, RootServer

log = logging.getLogger("bcd.helper")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root", default="/", type=root_dir, help="the directory standing for / (a simulated host)"
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="root's config.toml (host path)")
    logsetup.add_argument(parser)


def _system(root: Path) -> LocalSystem:
    if root == Path("/"):
        return LocalSystem(root)
    # A simulated root needs the development distribution bcd-simhost; the packages never carry it.
    try:
        return sim_system(root)
    except SimHostMissing as exc:
        raise ConfigError(str(exc)) from None


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
        try:  # a SIGTERM (SystemExit) may land anywhere here, even before the root thread runs
            thread.start()
            self.node.serve_forever(poll_interval=0.2)
        finally:
            if thread.ident is not None:  # started: stop its loop before close() shuts its socket
                self.root.shutdown()
                thread.join(timeout=5)

    def close(self) -> None:
        self.node.server_close()
        self.root.server_close()
        self.guards.close()
        os.close(self.lock_fd)


class HelperLocked(ConfigError):
    """Another helper holds the lock beside the socket (exit EX_TEMPFAIL, like a node whose journal
    another process holds)."""


def take_lock(path: Path) -> int:
    """The helper's lock fd (flock held, our pid written). Raises HelperLocked naming the holder's pid."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise HelperLocked(f"another helper (pid {holder}) holds {path}: not starting a second one") from None
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
            audit = AuditLog(
                root,
                config.audit_dir,
                max_bytes=config.audit_max_bytes,
                keep=config.audit_keep,
                min_age_s=config.audit_min_age_s,
            )
        except RootPathRefused as exc:
            raise ConfigError(str(exc)) from None
        except AuditError as exc:
            raise ConfigError(f"audit log: {exc}") from None
        if audit.created_key is not None:  # never printed here: the journal is on this host
            log.warning(
                "the audit log had no sealing key; one was made that no one holds, so `audit verify --key`"
                " cannot be used for this log (run `bcd helper audit init` at set-up, before the first"
                " start, and keep the key it prints off this host)"
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


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(signal.Signals(signum).name)


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
    from bcd_shared.subcommands import EX_CONFIG, EX_NOPERM, EX_TEMPFAIL, EX_USAGE, CliError

    logsetup.configure(logging.INFO, args.log_format)
    root = Path(args.root).resolve()
    if root == Path("/") and os.geteuid() != 0:
        raise CliError(
            "must run as root (it is the node's root helper; systemctl start bcd-helper)", EX_NOPERM
        )
    _bound_malloc()
    try:
        if root != Path("/"):
            simhost_module(root)  # before anything else: a simulated root needs bcd-simhost
        helper = build(root, args.config)
    except SimHostMissing as exc:
        raise CliError(str(exc), EX_USAGE) from None
    except HelperLocked as exc:
        raise CliError(str(exc), EX_TEMPFAIL) from None
    except ConfigError as exc:
        raise CliError(str(exc), EX_CONFIG) from None
    notifier = Notifier()
    # Both sockets are bound (build binds them): systemd may start bcd-node now.
    log.info(
        "bcd-helper %s serving on %s (root %s, config %s, node uid %d)",
        VERSION, helper.node.server_address, root, args.config, helper.node.ctx.config.node_uid,
    )  # fmt: skip
    log.info("root's own socket (the node can neither reach nor fill it): %s", helper.root.server_address)
    why = "stopped"
    try:  # once _stop is installed, a SIGTERM (SystemExit) always reaches the stop line
        signal.signal(signal.SIGTERM, _stop)
        notifier.ready(f"serving on {helper.node.server_address}")
        helper.serve_forever()
    except SystemExit as exc:
        why = f"{exc.code} received"
    except KeyboardInterrupt:
        why = "SIGINT received"
    finally:
        notifier.stopping()
        with contextlib.suppress(OSError):
            helper.close()
    log.info("bcd-helper %s stopped (%s)", VERSION, why)
    return 0
