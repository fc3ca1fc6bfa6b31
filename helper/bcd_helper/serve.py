"""`bcd helper serve`: run the root helper on its Unix socket until SIGTERM or SIGINT.

`--root DIR` serves a simulated host (a directory standing for `/`, with the simulated host's fake
programs); the config path is a host path under it. Everything else (the root-only rule on the
config and on every write, ownership, modes) is the real thing, checked on the real files.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from bcd_shared import logsetup
from bcd_shared.rootpath import RootPathRefused, split_host_path, verified_dir
from bcd_shared.sdnotify import Notifier
from bcd_shared.simroot import SimHostMissing, sim_system, simhost_module
from bcd_shared.system import LocalSystem
from bcd_shared.version import VERSION

from bcd_helper.audit import AuditLog
from bcd_helper.config import DEFAULT_CONFIG, ConfigError, load_config
from bcd_helper.ops.base import Failed, HelperContext
from bcd_helper.ops.daemon import RELEASE_STATE
from bcd_helper.ops.table import lock_names
from bcd_helper.server import HelperServer

log = logging.getLogger("bcd.helper")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", default="/", help="the directory standing for / (a simulated host)")
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


def build(root: Path, config_path: str) -> HelperServer:
    """Check root's config, open the audit log and bind the socket. Raises ConfigError."""
    config = load_config(root, config_path)
    try:
        audit = AuditLog(root, config.audit_dir)
        sock_parts = split_host_path(config.socket)
        with verified_dir(root, sock_parts[:-1], create=True):
            pass
    except RootPathRefused as exc:
        raise ConfigError(str(exc)) from None
    ctx = HelperContext(root=root, config=config, system=_system(root), audit=audit, lock_names=lock_names())
    if os.path.lexists(root.joinpath(*split_host_path(RELEASE_STATE))):
        from bcd_helper.ops.daemon import resume

        try:
            resume(ctx)  # a self-update still waiting for its confirmation gets its timer back
        except Failed as exc:  # daemon.swap and daemon.confirm fail the same way until it is fixed
            print(f"bcd helper: {exc.message}", file=sys.stderr)
    real_socket = str(root.joinpath(*sock_parts))
    return HelperServer(ctx, real_socket)


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    from bcd_shared.subcommands import EX_CONFIG, EX_NOPERM, EX_USAGE, CliError

    logsetup.configure(logging.INFO, args.log_format)
    root = Path(args.root).resolve()
    if root == Path("/") and os.geteuid() != 0:
        raise CliError(
            "must run as root (it is the node's root helper; systemctl start bcd-helper)", EX_NOPERM
        )
    try:
        if root != Path("/"):
            simhost_module(root)  # before anything else: a simulated root needs bcd-simhost
        server = build(root, args.config)
    except SimHostMissing as exc:
        raise CliError(str(exc), EX_USAGE) from None
    except ConfigError as exc:
        raise CliError(str(exc), EX_CONFIG) from None
    notifier = Notifier()
    # The socket is bound (HelperServer binds in its constructor): systemd may start bcd-node now.
    log.info(
        "bcd-helper %s serving on %s (root %s, config %s, node uid %d)",
        VERSION, server.server_address, root, args.config, server.ctx.config.node_uid,
    )  # fmt: skip
    why = "stopped"
    try:  # once _stop is installed, a SIGTERM (SystemExit) always reaches the stop line
        signal.signal(signal.SIGTERM, _stop)
        notifier.ready(f"serving on {server.server_address}")
        server.serve_forever(poll_interval=0.2)
    except SystemExit as exc:
        why = f"{exc.code} received"
    except KeyboardInterrupt:
        why = "SIGINT received"
    finally:
        notifier.stopping()
        server.server_close()
    log.info("bcd-helper %s stopped (%s)", VERSION, why)
    return 0
