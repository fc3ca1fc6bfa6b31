"""`bcd node`: the agent's composition root, one nursery tree (docs/session.md).

    journal (open, recover, sweep) -> dispatcher (kinds, lanes) -> converge runner (the sections this
    build has) -> session (reconnecting) -> sd_notify READY, then WATCHDOG every half interval

`Node(config, NodeOptions(...))` is a trio service: `await nursery.start(node.run)` returns once every part
runs; cancelling it stops them and closes the journal. `bcd node` runs it until SIGTERM/SIGINT.
Sections are plugged in through the converge runner's Section interface when their packages exist; the
helper client is used for the devices section's writes when `[helper] socket` is set.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio
from attrs import field, frozen

from bcd_agent.config import Config

log = logging.getLogger("bcd.node")

VERSION = "0.1.0"


@frozen
class NodeOptions:
    """How to run the node beyond config.toml (for `bcd sim`, tests, benches)."""

    root: str = "/"  # a simulated host directory standing for /, or / itself
    test_kinds: bool = False  # register the test.* kinds (bcd_agent.kinds.testing)
    test_effect_delay_s: float = 0.0  # test kinds sleep this long inside their side effect
    heartbeat_s: float = 30.0
    status_interval_s: float = 1.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    sections: bool = True  # plug in the section convergers this build has
    extra_handlers: Mapping[str, Any] = field(factory=dict)


class _ReportSigner:
    def __init__(self, key: Any, node_id: str, boot_id: str) -> None:
        self._key = key
        self.node_id = node_id
        self.boot_id = boot_id

    def sign(self, purpose: Any, data: bytes) -> bytes:
        signature: bytes = self._key.sign(purpose, data)
        return signature


def _boot_id(system: Any) -> str:
    text = system.read_text("/proc/sys/kernel/random/boot_id")
    if not text:
        text = Path("/proc/sys/kernel/random/boot_id").read_text()
    return str(text).strip()


class Node:
    def __init__(self, config: Config, options: NodeOptions | None = None) -> None:
        self.config = config
        self.options = options or NodeOptions()
        self.journal: Any = None
        self.session: Any = None
        self.runner: Any = None
        self.dispatcher: Any = None
        self.core: Any = None
        self.status: Any = None
        self.started_monotonic: float | None = None

    # --- composition ----------------------------------------------------------------------------------

    def _system(self) -> Any:
        from bcd_shared.system import LocalSystem

        if self.options.root == "/":
            return LocalSystem(Path("/"))
        from bcd_shared.simhost import sim_system

        return sim_system(Path(self.options.root))

    def _helper_socket(self) -> str | None:
        sock = self.config.helper.socket
        if sock is None or self.options.root == "/":
            return sock
        return str(Path(self.options.root) / sock.lstrip("/"))

    def _sections(self, system: Any, sink: Any, signer: Any) -> list[Any]:
        sections: list[Any] = []
        if not self.options.sections:
            return sections
        try:
            from bcd_agent.sections.devices.apply import DirectExecutor, HelperExecutor
            from bcd_agent.sections.devices.section import DevicesSection
        except ImportError as exc:  # a build without the devices section
            log.info("node: no devices section: %s", exc)
        else:
            helper = self._helper_socket()
            privileged = helper is not None or os.geteuid() == 0 or self.options.root != "/"
            if helper is not None:
                from bcd_agent.helperclient import HelperClient

                executor: Any = HelperExecutor(HelperClient(helper))
            else:
                executor = DirectExecutor(system)
            sections.append(
                DevicesSection(system, executor, sink, signer, self.config.data_dir, privileged=privileged)
            )
        return sections

    def _observer(self, system: Any) -> Any:
        from bcd_agent.converge.section import PartsObserver

        readers: dict[str, Callable[[], object]] = {}
        try:
            from bcd_agent.inventory.gpus import collect_gpus
        except ImportError:
            pass
        else:
            readers["inventory"] = lambda: collect_gpus(system)
        return PartsObserver(readers, clock=trio.current_time)

    def _handlers(self, system: Any) -> dict[str, Any]:
        handlers: dict[str, Any] = {}
        try:
            from bcd_agent.inventory.handlers import SystemInventoryCollector
            from bcd_agent.kinds.inventory import KIND as INVENTORY
            from bcd_agent.kinds.inventory import InventoryRefreshHandler
        except ImportError:
            pass
        else:
            handlers[INVENTORY] = InventoryRefreshHandler(SystemInventoryCollector(system))
        if self.options.test_kinds:
            from bcd_agent.kinds.testing import EffectHandler, effect_handlers

            delay = self.options.test_effect_delay_s

            async def during(_command: Any) -> None:
                if delay > 0:
                    await trio.sleep(delay)

            handlers.update(
                effect_handlers(
                    EffectHandler(Path(self.config.data_dir) / "test-effects.log", during_effect=during)
                )
            )
        handlers.update(self.options.extra_handlers)
        return handlers

    def _endpoint(self, identity: Any) -> Any:
        from bcd_agent.session.identity import write_tls_client_pem
        from bcd_agent.session.transport import Endpoint

        cp = self.config.control_plane
        if cp.unix_socket:
            return Endpoint(unix_path=cp.unix_socket)
        address = cp.address or identity.address
        if not address:
            raise SystemExit(
                "bcd node: no control plane: set [control_plane] address or unix_socket, or join"
            )
        ca = Path(cp.ca_file).read_text() if cp.ca_file else identity.gateway_ca_pem
        client = str(write_tls_client_pem(self.config.data_dir, identity))
        return Endpoint.parse(address, ca_pem=ca, client_pem_path=client, server_name=cp.server_name)

    # --- the service ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        from bcd_agent.converge.runner import ConvergeRunner
        from bcd_agent.converge.status import StatusCell
        from bcd_agent.dispatch.clock import OffsetClock
        from bcd_agent.dispatch.dispatcher import Dispatcher
        from bcd_agent.dispatch.kinds import KINDS, Role
        from bcd_agent.dispatch.quorum import QuorumLedger
        from bcd_agent.dispatch.trust import BundleTrust, NodeResultSigner
        from bcd_agent.journal import Journal
        from bcd_agent.kinds.testing import TEST_KINDS
        from bcd_agent.sdnotify import Notifier
        from bcd_agent.session import identity as ident
        from bcd_agent.session.backoff import Backoff
        from bcd_agent.session.core import SessionCore
        from bcd_agent.session.events import JournalEventSink
        from bcd_agent.session.service import Session

        self.started_monotonic = trio.current_time()
        cfg = self.config
        identity = ident.load(cfg.data_dir)
        system = self._system()
        boot_id = _boot_id(system)
        journal = Journal.open(
            cfg.data_dir, boot_id=boot_id, max_events=cfg.journal.max_events, max_bytes=cfg.journal.max_bytes
        )
        self.journal = journal
        try:
            if journal.report.moved_aside:
                log.error("node: the journal failed its check and was moved aside: %s", journal.report.reason)
            if journal.node_id != identity.node_id:
                journal.set_node_id(identity.node_id)
            settled = journal.recover()
            swept = journal.sweep()
            log.info(
                "node: journal %s: %d settled at start, %d swept", journal.journal_id, len(settled), swept
            )
            clock = OffsetClock()
            trust = BundleTrust()
            result_signer = NodeResultSigner(identity.node_key, identity.node_id)
            self.status = StatusCell()
            core = SessionCore(
                journal=journal,
                dispatcher=None,
                runner=None,
                trust=trust,
                clock=clock,
                identity=identity,
                data_dir=cfg.data_dir,
                status=self.status,
                signer=result_signer,
                version=VERSION,
                monotonic=trio.current_time,
            )
            self.core = core
            sink = JournalEventSink(journal, boot_id)
            sections = self._sections(
                system, sink, _ReportSigner(identity.node_key, identity.node_id, boot_id)
            )
            if any(s.name == "devices" for s in sections):
                core.capabilities = ("cdi", "devices.limits", "binding.kubernetes")
            self.runner = ConvergeRunner(
                sections,
                self._observer(system),
                host_units=cfg.host.units,
                initial_spec=core.load_spec(),
                status=self.status,
            )
            kinds = {**KINDS, **TEST_KINDS} if self.options.test_kinds else KINDS
            self.dispatcher = Dispatcher(
                node_id=identity.node_id,
                role=Role.NODE,
                journal=journal,
                sink=core,
                spec_requester=core,
                trust=trust,
                batches=trust,
                ledger=QuorumLedger.open(Path(cfg.data_dir)),
                clock=clock,
                handlers=self._handlers(system),
                signer=result_signer,
                kinds=kinds,
                applied_generation=journal.applied_generation,
            )
            core.dispatcher = self.dispatcher
            core.runner = self.runner
            self.session = Session(
                core,
                self._endpoint(identity),
                backoff=Backoff(initial_s=self.options.backoff_initial_s, max_s=self.options.backoff_max_s),
                heartbeat_s=self.options.heartbeat_s,
                status_interval_s=self.options.status_interval_s,
            )
            sink.wake = self.session.events_changed
            notifier = Notifier()
            async with trio.open_nursery() as nursery:
                await nursery.start(self.dispatcher.run)
                await nursery.start(self.runner.run)
                # bcd status: each new status to data_dir/status.json (bcd_agent.statusfile; docs/sim.md).
                from bcd_agent import statusfile

                await nursery.start(statusfile.serve, self.status, cfg.data_dir)
                await nursery.start(self.session.run)
                notifier.ready(f"node {identity.node_id}")
                if notifier.watchdog_interval_s is not None:
                    nursery.start_soon(_watchdog, notifier, notifier.watchdog_interval_s)
                task_status.started(self)
        finally:
            journal.close()


async def _watchdog(notifier: Any, interval_s: float) -> None:
    while True:
        notifier.watchdog()
        await trio.sleep(interval_s)


# --- CLI ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_agent.config import add_config_argument

    add_config_argument(parser)
    parser.add_argument("--root", default="/", help="a simulated host directory standing for /")
    parser.add_argument("--test-kinds", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--test-effect-delay", type=float, default=0.0, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from bcd_agent.config import ConfigError, load_config
    from bcd_agent.session.identity import IdentityError

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"bcd node: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log.level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    node = Node(
        config,
        NodeOptions(root=args.root, test_kinds=args.test_kinds, test_effect_delay_s=args.test_effect_delay),
    )

    async def main() -> None:
        from bcd_agent.sdnotify import Notifier

        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                async for _ in signals:
                    Notifier().stopping()
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    except IdentityError as exc:
        print(f"bcd node: {exc}", file=sys.stderr)
        return 2
    return 0
