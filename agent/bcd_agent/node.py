"""`bcd node`: the agent's composition root, one nursery tree (docs/session.md).

    journal (open, the result attester, recover, sweep) -> dispatcher (kinds, lanes) -> converge runner
    (the sections this build has) -> session (reconnecting) -> the daily journal sweep -> sd_notify READY,
    then WATCHDOG every half interval

`Node(config, NodeOptions(...))` is a trio service: `await nursery.start(node.run)` returns once every part
runs; cancelling it stops them and closes the journal. `bcd node` runs it until SIGTERM/SIGINT.

What is wired (docs/session.md "bcd node"):
- sections: `host` (bcd_agent.nodeparts.host.NodeHostSection over sections.host; not built with
  `[host] units = false`, so the runner reports a listed host section UNSUPPORTED HostManagedExternally)
  and `devices`. Both act through the helper when `[helper] socket` is set, directly as root or on the
  simulated host otherwise; an unprivileged node without a helper builds neither host nor hold writes.
- the observation's `inventory` part and the heartbeat's inventory hash (nodeparts.inventory);
- kinds: inventory.refresh, diag.nvml, gpu.reset, node.reboot (nodeparts.kinds; gpu.reset and
  node.reboot only where the node can act: root, the helper, or the simulated host), the test kinds
  with `--test-kinds`;
- `telemetry` (sections.telemetry): the OTLP export of bcd's own metrics (NodeMetrics reads the journal,
  the dispatcher, the runner's passes and status, the devices section's holds and the helper clients'
  calls), its exporter a task of its own; headers from a SecretRequest (docs/telemetry.md);
- SecretRequest/SecretResponse (session.secrets) for the k8s-join token and the telemetry headers;
- after a host unit changed the host: the inventory read again and a devices pass triggered.
- the XID watcher (nodeparts.xid): NVIDIA XID errors of this boot from journald, one `XidError` condition
  per GPU through the runner; gpu.reset clears a GPU that reads healthy, diag.nvml lists the codes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio
from attrs import field, frozen
from bcd_shared import logsetup
from bcd_shared.version import VERSION

from bcd_agent.config import Config

log = logging.getLogger("bcd.node")

# Q-DLV-REC-01 (docs/journal.md): the journal is swept at start, right after recover, and then daily.
SWEEP_INTERVAL_S = 24 * 3600.0
# Under bcd helper: how often the helper's audit head is read for the StatusReport (docs/helper.md).
AUDIT_HEAD_INTERVAL_S = 300.0
# How long start-up waits for a first converge pass before it hands the free heap back anyway.
STARTUP_PASS_WAIT_S = 60.0


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
    secret_timeout_s: float = 30.0  # how long a SecretRequest waits for its SecretResponse
    reboot_wait_s: float = 600.0  # node.reboot: how long the host may stay up after the request
    sweep_interval_s: float = SWEEP_INTERVAL_S  # journal.sweep() again this long after the last one
    drain_s: float = 5.0  # at shutdown, commands in flight get this long to finish before cancelled
    xid_poll_s: float = 10.0  # the XID watcher reads the kernel log this often (nodeparts.xid)


def _boot_id(system: Any) -> str:
    text = system.read_text("/proc/sys/kernel/random/boot_id")
    if not text:
        text = Path("/proc/sys/kernel/random/boot_id").read_text()
    return str(text).strip()


def acts_on_host(helper_socket: str | None, euid: int, root: str) -> bool:
    """The node can change the host: through the helper, as root, or on a simulated host."""
    return helper_socket is not None or euid == 0 or root != "/"


def device_capabilities(devices_section: bool, acts_on_host: bool, nvml: bool = False) -> tuple[str, ...]:
    """What Hello advertises for holds. An unprivileged node without a helper takes no holds and says
    so: no cdi, devices.limits or binding.kubernetes capability (DEV-CAP-01, DEV-UNPRIV-02); `nvml`
    whenever nvidia-smi answered, privileged or not (devices-and-holds.md "Hello claims nothing")."""
    holds = ("cdi", "devices.limits", "binding.kubernetes") if devices_section and acts_on_host else ()
    return (*holds, "nvml") if nvml else holds


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
        self.inventory: Any = None  # nodeparts.inventory.InventoryState
        self.host_section: Any = None  # nodeparts.host.NodeHostSection, when built
        self.access_section: Any = None  # sections.access.AccessSection, when built (its JWKS: tunnels)
        self.instances_section: Any = None  # sections.instances.section.InstancesSection, when built
        self.runtimes: tuple[str, ...] = ()  # the instance runtimes this host runs (Hello)
        self.secrets: Any = None  # session.secrets.SecretRequests
        self.metrics: Any = None  # sections.telemetry.metrics.NodeMetrics
        self.exporter: Any = None  # sections.telemetry.exporter.Exporter
        self.telemetry: Any = None  # sections.telemetry.section.TelemetrySection
        self.helper_stats: Any = None  # helperclient.HelperCallStats, shared by every helper client
        self.handlers: dict[str, Any] = {}
        self.upgrader: Any = None  # sections.daemon.upgrade.Upgrader, under the helper
        self.xid: Any = None  # nodeparts.xid.XidWatcher
        self.started_monotonic: float | None = None
        self.sweeps = 0  # journal sweeps run by this process (the one at start included)
        self._status_pokes: trio.MemorySendChannel[None] | None = None
        # Shutdown order (`_shutdown`): the lanes, then the session, then the other parts.
        self._parts_scope = trio.CancelScope(shield=True)
        self._lanes_scope = trio.CancelScope()
        self._session_scope = trio.CancelScope()
        self._has_devices = False

    # --- composition ----------------------------------------------------------------------------------

    def _system(self) -> Any:
        from bcd_shared.system import LocalSystem

        if self.options.root == "/":
            return LocalSystem(Path("/"))
        from bcd_shared.simroot import sim_system

        return sim_system(Path(self.options.root))

    def _records_dir(self) -> str:
        """data_dir as the System names it, for the records the devices section (and the host section's
        busy GPUs, gpu.reset) keep there: releasing.json, the marker, the event ledger. The System takes
        host paths, so under a simulated root a data_dir inside ROOT is named by its host path
        (ROOT/var/lib/bcd -> /var/lib/bcd); taken as is it landed at ROOT/ROOT/var/lib/bcd, where the
        node running as its own account (`bcd sim --helper yes`) cannot write. A data_dir outside ROOT
        has no host path: it is taken as is (its records then live under ROOT)."""
        data_dir = self.config.data_dir
        if self.options.root == "/":
            return data_dir
        try:
            rel = Path(data_dir).resolve().relative_to(Path(self.options.root).resolve())
        except ValueError:
            return data_dir
        return "/" + rel.as_posix() if rel.parts else "/"

    def _helper_socket(self) -> str | None:
        sock = self.config.helper.socket
        return None if sock is None else self._host_socket(sock)

    def _host_socket(self, path: str) -> str:
        """A socket path of the host: under --root on a simulated host."""
        if self.options.root == "/":
            return path
        return str(Path(self.options.root) / path.lstrip("/"))

    def _acts_on_host(self) -> bool:
        return acts_on_host(self._helper_socket(), os.geteuid(), self.options.root)

    def _helper_client(self) -> Any:
        from bcd_agent.helperclient import HelperCallStats, HelperClient

        sock = self._helper_socket()
        assert sock is not None
        if self.helper_stats is None:
            self.helper_stats = HelperCallStats()
        return HelperClient(sock, stats=self.helper_stats)

    def _sections(self, system: Any, sink: Any, signer: Any, identity: Any, trio_token: Any) -> list[Any]:
        sections: list[Any] = []
        if not self.options.sections:
            return sections
        host = self._host_section(system, identity, trio_token)
        if host is not None:
            sections.append(host)
        try:
            from bcd_agent.sections.devices.apply import DirectExecutor, HelperExecutor
            from bcd_agent.sections.devices.section import DevicesSection
        except ImportError as exc:  # a build without the devices section
            log.info("node: no devices section: %s", exc)
        else:
            from bcd_agent.sections.devices.kube import PodResourcesClient

            helper = self._helper_socket()
            privileged = self._acts_on_host()
            if helper is not None:
                executor: Any = HelperExecutor(self._helper_client(), self._kept_intent)
            else:
                executor = DirectExecutor(system)
            devices = DevicesSection(
                system,
                executor,
                sink,
                signer,
                self._records_dir(),
                privileged=privileged,
                # Asked before a Kubernetes hold's release is reported (DEV-K8S; [devices]
                # pod_resources_socket); without it a release would stay pending for ever.
                pod_resources=PodResourcesClient(self._host_socket(self.config.devices.pod_resources_socket)),
            )
            sections.append(devices)
            if self.metrics is not None:
                from bcd_agent.sections.telemetry.metrics import holds_per_gpu

                self.metrics.holds = lambda: holds_per_gpu(devices.gpu_uuids, devices.held_device_ids)
            instances = self._instances_section(system, trio_token)
            if instances is not None:
                # The devices section's VFIO conflict: GPUs the instances pass through (DEV-PASS).
                devices.vfio = self._vfio
                # Host admission both ways (DEV-ADM-05, DEV-ADM-17, DLV-ADM-07): holds count the domains'
                # committed memory, and starts count the holds' bookings (a Kubernetes hold's from the spec).
                devices.domains_committed_bytes = instances.committed_bytes
                instances.hold_assignments = lambda: devices.assignments
                if self.metrics is not None:
                    # What each ballooned guest lends the host, as the controller's last tick set it
                    # (DLV-BAL-17); read at each export, so a controller set later is seen.
                    self.metrics.balloons = lambda: (
                        dict(instances.balloons.lent) if instances.balloons is not None else {}
                    )
                sections.append(instances)
        access = self._access_section(system, identity)
        if access is not None:
            sections.append(access)
        upgrader = self._upgrader()
        if upgrader is not None:
            from bcd_agent.sections.daemon.section import DaemonSection

            sections.append(DaemonSection(upgrader, self.config.data_dir))
        sections.append(self._telemetry_section(identity))
        return sections

    def _telemetry_section(self, identity: Any) -> Any:
        """The telemetry converger and its exporter (started in `run`, before the runner)."""
        from functools import partial

        from bcd_agent.sections.telemetry.exporter import Exporter
        from bcd_agent.sections.telemetry.section import STEP_HEADERS, WORKFLOW_TELEMETRY, TelemetrySection

        self.exporter = Exporter(self.metrics, scope_version=VERSION)
        fetch = partial(self.secrets.fetch, workflow_id=WORKFLOW_TELEMETRY, step_id=STEP_HEADERS)
        base = (
            ("service.instance.id", identity.node_id),
            ("service.name", "bcd"),
            ("service.version", VERSION),
        )
        self.telemetry = TelemetrySection(self.exporter, fetch, self._trigger, base_resource=base)
        return self.telemetry

    def _trigger(self, reason: str) -> None:
        if self.runner is not None:
            self.runner.trigger(reason)

    def _access_section(self, system: Any, identity: Any) -> Any:
        """The access section (docs/access.md): beside the helper one `access.apply` with the kept signed
        spec, as root (or on the simulated host) in-process; None for a node that cannot change the host
        (the runner reports a non-empty section UNSUPPORTED)."""
        if not self._acts_on_host():
            return None
        from bcd_agent.sections import access as ax

        if self._helper_socket() is not None:
            executor: Any = ax.HelperExecutor(self._helper_client(), self._kept_intent, system)
        else:
            executor = ax.DirectExecutor(system, root_principals=self.config.helper.root_principals)
        self.access_section = ax.AccessSection(executor, identity.node_id, data_dir=self.config.data_dir)
        return self.access_section

    def _instances_section(self, system: Any, trio_token: Any) -> Any:
        try:
            from bcd_agent.nodeparts.instances import SessionUserData, build_runtimes
            from bcd_agent.sections.instances.section import InstancesSection
        except ImportError as exc:  # a build without the instances section
            log.info("node: no instances section: %s", exc)
            return None
        helper = self._helper_client() if self._helper_socket() is not None else None
        data_dir = self.config.data_dir
        root = Path(self.options.root)
        if root != Path("/") and Path(data_dir).is_relative_to(root):
            # On the simulated host the node's config names real paths; runtimes speak host paths
            # (as root's config and the helper do).
            data_dir = "/" + str(Path(data_dir).relative_to(root))
        runtimes = build_runtimes(
            system,
            data_dir,
            simulated=self.options.root != "/",
            helper=helper,
            as_root=os.geteuid() == 0,
            intent_dir=self.config.data_dir,
        )
        self.runtimes = tuple(r.name for r in runtimes)
        network = None
        if runtimes and self.options.root == "/" and (helper is not None or os.geteuid() == 0):
            # The instances' nftables rules (docs/instances.md "Network policy"): root's nft, or the
            # helper's typed nft.apply/nft.check. The simulated host has no nft: no rules there.
            from bcd_agent.nodeparts.instances import helper_intent
            from bcd_agent.sections.instances.network import DirectNft, HelperNft, NetworkPolicy

            intent_dir = self.config.data_dir
            network = NetworkPolicy(
                HelperNft(helper, intent=lambda: helper_intent(intent_dir))
                if helper is not None
                else DirectNft(system)
            )
        volumes = None
        if runtimes:
            # The persistent volume store, data_dir/volumes (docs/instances.md "Persistent volumes"):
            # instance.volumes is advertised only when it exists.
            from bcd_shared.instancenames import volumes_dir

            from bcd_agent.sections.instances.volumes import VolumeStore

            volumes = VolumeStore(str(system.host_path(volumes_dir(data_dir))))
            try:
                volumes.ensure()
            except OSError as exc:
                log.warning("node: no volume store (%s): instances with volumes fail here", exc)
                volumes = None
        snapshots = None
        if runtimes:
            # restore_from downloads in the background (docs/instances.md "Snapshots and restores"); a
            # download's end triggers a pass (DLV-SNAP-10).
            from bcd_agent.sections.instances.restores import SnapshotDownloads

            def downloaded() -> None:
                if self.runner is not None:
                    self.runner.trigger("snapshot-download")

            snapshots = SnapshotDownloads(system, data_dir, on_done=downloaded)
        self.instances_section = InstancesSection(
            system,
            runtimes,
            data_dir,
            records_dir=self._records_dir(),
            user_data=SessionUserData(self.secrets, trio_token),
            network=network,
            volumes=volumes,
            snapshots=snapshots,
        )
        if runtimes:
            # Off the pass (docs/instances.md): the identity rebind and the balloon controller.
            from bcd_agent.nodeparts.instances import off_pass_parts

            off_pass_parts(
                self.instances_section, system, data_dir, self.config.instances.balloon_floor_percent
            )
        return self.instances_section

    def _host_section(self, system: Any, identity: Any, trio_token: Any) -> Any:
        """The host section, or None: `[host] units = false` (the runner reports HostManagedExternally),
        or a node that cannot change the host (unprivileged without a helper: SectionUnsupported)."""
        cfg = self.config
        if not cfg.host.units:
            log.info("node: [host] units = false: no host converger; host units are managed outside bcd")
            return None
        if not self._acts_on_host():
            log.warning(
                "node: unprivileged without [helper] socket: the host section cannot be converged; set "
                "[helper] socket in config.toml (deploy/install.sh writes it) beside a root bcd helper"
            )
            return None
        try:
            from bcd_shared.units import ApplyContext, UnitContext

            from bcd_agent.nodeparts import host as nh
            from bcd_agent.sections.host import DirectExecutor, HelperExecutor
            from bcd_agent.session.secrets import SessionTokenSource
        except ImportError as exc:  # a build without the host units
            log.info("node: no host section: %s", exc)
            return None
        tokens = SessionTokenSource(self.secrets, trio_token)
        clusters = nh.allowed_clusters(cfg.kubernetes.allowed_clusters)
        data_dir = self._records_dir()
        node_id = identity.node_id

        def context_for(observation: Any) -> Any:
            gpus = nh.observed_gpus(observation)
            return UnitContext(
                busy_gpus=nh.busy_devices(system, data_dir, gpus),
                allowed_clusters=clusters,
                identity_labels=nh.identity_labels(node_id, gpus),
            )

        if self._helper_socket() is not None:
            from bcd_agent.sections.host.intent import HelperHostSend

            client = self._helper_client()
            inner = HelperHostSend(client, Path(cfg.data_dir), trust_bundle=self._signed_bundle)
            send = nh.TokenStagingSend(inner, client, system, tokens)

            def executor_for(ctx: Any) -> Any:
                return HelperExecutor(system, send, ctx)

        else:
            actx = ApplyContext(guard=self._root_guard(), tokens=tokens)

            def executor_for(ctx: Any) -> Any:
                return DirectExecutor(system, ctx, actx)

        self.host_section = nh.NodeHostSection(executor_for, context_for, on_changed=self._host_changed)
        return self.host_section

    def _kept_intent(self) -> dict[str, Any] | None:
        """The signed spec the node keeps (data_dir/host-intent.json: the newest full spec), as the helper's
        `intent` argument, with the node's trust bundle; None without one (or unreadable: root decides)."""
        from bcd_agent.sections.host.intent import intent_args, read_host_intent

        try:
            kept = read_host_intent(self.config.data_dir)
        except ValueError as exc:
            log.warning("node: %s", exc)
            return None
        return intent_args(kept, self._signed_bundle())

    def _signed_bundle(self) -> bytes | None:
        """The serialized SignedTrustBundle the node holds now (host.unit presents it to the helper)."""
        identity = self.core.identity if self.core is not None else None
        held = identity.trust_bundle if identity is not None else None
        if held is None:
            return None
        from bcd_agent.sections.host.intent import signed_bundle_bytes

        return signed_bundle_bytes(held.bundle, held.signature, held.signer_spki)

    def _root_guard(self) -> Any:
        """As root, the units' writes go through the root-only rule (HST-ROOT-*); None otherwise."""
        if os.geteuid() != 0:
            return None
        from bcd_shared.errors import RetryableError
        from bcd_shared.rootpath import RootPathRefused, check_root_only

        root = Path(self.options.root)

        def guard(path: str) -> None:
            try:
                check_root_only(root, path)
            except RootPathRefused as exc:
                raise RetryableError("RootOnly", str(exc)) from None

        return guard

    async def _read_audit_head(self) -> None:
        """Under bcd helper: read the helper's audit head (op audit.head) every AUDIT_HEAD_INTERVAL_S and
        hand it to the runner, whose next StatusReport carries it (issue 9 item 6). Reading it lets the
        helper rotate away the lines up to it, so it is read only here, to be reported."""
        client = self._helper_client()
        try:
            while True:
                try:
                    result = await trio.to_thread.run_sync(client.call, "audit.head", {})
                    head = (int(result["seq"]), str(result["sha256"]))
                except Exception as exc:  # unreachable helper, an old one without the op: try again later
                    log.warning("node: cannot read the helper's audit head: %s", exc)
                else:
                    if self.runner is not None:
                        self.runner.set_audit_head(head)
                await trio.sleep(AUDIT_HEAD_INTERVAL_S)
        finally:
            client.close()

    def _host_changed(self) -> None:
        """A host unit changed the host (runner worker thread): read the inventory again (hash, heartbeat)
        and ask for a pass, in which the devices section sees the new GPUs / MIG layout (HST-LVL-13)."""
        from bcd_agent.converge.runner import TRIGGER_CHANGED

        if self.inventory is not None:
            self.inventory.refresh()
        if self.runner is not None:
            self.runner.trigger(TRIGGER_CHANGED)

    def _observer(self, system: Any) -> Any:
        from bcd_agent.converge.section import PartsObserver

        readers: dict[str, Callable[[], object]] = {}
        if self.inventory is not None:
            readers["inventory"] = self.inventory.read_gpus
        return PartsObserver(readers, clock=trio.current_time)

    def _vfio(self) -> dict[str, str]:
        """GPU uuid -> the instance it is passed through to, as the instances section has it now (none
        without that section): what the devices section refuses holds on, and the busy checks of
        gpu.reset and diag.dcgm refuse (DEV-BUSY-05, DEV-BUSY-07)."""
        instances = self.instances_section
        if instances is None:
            return {}
        spec = self.runner.spec if self.runner is not None else None
        return dict(instances.vfio(spec.payload("instances") if spec else None))

    def _handlers(self, system: Any) -> dict[str, Any]:
        handlers: dict[str, Any] = {}
        try:
            from bcd_agent.inventory.handlers import SystemInventoryCollector
            from bcd_agent.kinds.inventory import KIND as INVENTORY
            from bcd_agent.kinds.inventory import InventoryRefreshHandler
            from bcd_agent.nodeparts import kinds as nk
        except ImportError:
            pass
        else:
            publish = self.inventory.publish if self.inventory is not None else (lambda _r: None)
            handlers[INVENTORY] = InventoryRefreshHandler(SystemInventoryCollector(system, publish))
            xid = self.xid
            handlers[nk.DIAG_NVML] = nk.DiagNvmlHandler(system, xids=xid.by_gpu if xid is not None else None)
            from bcd_agent.kinds.dcgm import KIND as DIAG_DCGM
            from bcd_agent.kinds.dcgm import DiagDcgmHandler

            handlers[DIAG_DCGM] = DiagDcgmHandler(system, self.config.data_dir, vfio=self._vfio)
            if self._acts_on_host():
                helper = self._helper_client() if self._helper_socket() is not None else None
                handlers[nk.GPU_RESET] = nk.GpuResetHandler(
                    system,
                    self._records_dir(),
                    helper,
                    trust_bundle=self._signed_bundle,
                    on_reset=xid.gpus_reset if xid is not None else None,
                    vfio=self._vfio,
                )
                reboot_helper = self._helper_client() if helper is not None else None
                handlers[nk.NODE_REBOOT] = nk.NodeRebootHandler(
                    system, reboot_helper, wait_s=self.options.reboot_wait_s, trust_bundle=self._signed_bundle
                )
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
        section = self.instances_section
        if section is not None and section.runtimes:
            from bcd_agent.kinds.snapshot import KIND as SNAPSHOT
            from bcd_agent.kinds.snapshot import InstanceSnapshotHandler
            from bcd_agent.sections.instances.section import spec_instance

            def instance(instance_id: str) -> Any:
                spec = self.runner.spec if self.runner is not None else None
                return spec_instance(spec.payload("instances") if spec else None, 1, instance_id)

            handlers[SNAPSHOT] = InstanceSnapshotHandler(
                system,
                section.data_dir,
                instance=instance,
                runtimes=lambda: section.runtimes,
                hold=section.hold,
            )
        from bcd_agent.kinds import logs

        journal = self.journal
        tail = self._helper_client().audit_tail if self._helper_socket() is not None else None
        handlers[logs.KIND] = logs.LogsCollectHandler(
            system,
            self.config.data_dir,
            journal_summary=lambda: logs.journal_summary(journal),
            audit_tail=tail,
        )
        upgrader = self._upgrader()
        if upgrader is not None:
            from bcd_agent.kinds.daemon import KIND as UPGRADE
            from bcd_agent.kinds.daemon import DaemonUpgradeHandler

            handlers[UPGRADE] = DaemonUpgradeHandler(upgrader)
        handlers.update(self.options.extra_handlers)
        return handlers

    def _upgrader(self) -> Any:
        """Self-update's node half (sections.daemon), only under the helper on a real host (DLV-CONV-15;
        a simulated host, `bcd sim`, reports a non-empty daemon section UNSUPPORTED as the seeds say); one
        per process so that the running release confirms itself once."""
        if self._helper_socket() is None or self.options.root != "/":
            return None
        if self.upgrader is None:
            from bcd_agent.sections.daemon import running_version
            from bcd_agent.sections.daemon.upgrade import Upgrader

            self.upgrader = Upgrader(
                self._helper_client(),
                self.config.data_dir,
                running_version(),
                trust_bundle=self._signed_bundle,
            )
        return self.upgrader

    def _endpoint(self, identity: Any) -> Any:
        from bcd_agent.session.identity import write_tls_client_pem
        from bcd_agent.session.transport import Endpoint

        cp = self.config.control_plane
        if cp.unix_socket:
            return Endpoint(unix_path=cp.unix_socket)
        address = cp.address or identity.address
        if not address:
            from bcd_shared.subcommands import EX_CONFIG, CliError

            raise CliError("no control plane: set [control_plane] address or unix_socket, or join", EX_CONFIG)
        ca = Path(cp.ca_file).read_text() if cp.ca_file else identity.gateway_ca_pem
        client = str(write_tls_client_pem(self.config.data_dir, identity))
        return Endpoint.parse(address, ca_pem=ca, client_pem_path=client, server_name=cp.server_name)

    # --- the service ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        from bcd_shared.sdnotify import Notifier

        from bcd_agent.converge.runner import ConvergeRunner
        from bcd_agent.converge.status import StatusCell
        from bcd_agent.dispatch.clock import OffsetClock
        from bcd_agent.dispatch.dispatcher import Dispatcher
        from bcd_agent.dispatch.kinds import KINDS, Role
        from bcd_agent.dispatch.quorum import QuorumLedger
        from bcd_agent.dispatch.results import result_attester
        from bcd_agent.dispatch.trust import BundleTrust, NodeResultSigner
        from bcd_agent.helperclient import HelperCallStats
        from bcd_agent.journal import Journal
        from bcd_agent.kinds.testing import TEST_KINDS
        from bcd_agent.nodeparts.inventory import InventoryState
        from bcd_agent.nodeparts.xid import XidWatcher
        from bcd_agent.sections.devices.events import KeyReportSigner
        from bcd_agent.sections.telemetry.metrics import NodeMetrics
        from bcd_agent.session import identity as ident
        from bcd_agent.session.backoff import Backoff
        from bcd_agent.session.core import SessionCore
        from bcd_agent.session.events import JournalEventSink
        from bcd_agent.session.secrets import SecretRequests
        from bcd_agent.session.service import Session
        from bcd_agent.session.transport import StreamLimits

        self.started_monotonic = trio.current_time()
        cfg = self.config
        identity = ident.load(cfg.data_dir)
        system = self._system()
        boot_id = _boot_id(system)
        journal = Journal.open(
            cfg.data_dir,
            boot_id=boot_id,
            max_events=cfg.journal.max_events,
            max_bytes=cfg.journal.max_bytes,
            group_commit=cfg.journal.group_commit,
        )
        self.journal = journal
        try:
            if journal.report.moved_aside:
                log.error("node: the journal failed its check and was moved aside: %s", journal.report.reason)
            if journal.node_id != identity.node_id:
                journal.set_node_id(identity.node_id)
            # The attester before recover: the results recover settles for attested kinds (interrupted,
            # rebooted) are stored signed, in the same transaction, like every later one (DLV-SIG-17).
            result_signer = NodeResultSigner(identity.node_key, identity.node_id)
            journal.set_attester(result_attester(result_signer))
            settled = journal.recover()
            swept = journal.sweep()
            self.sweeps += 1
            log.info(
                "node: journal %s: %d settled at start, %d swept", journal.journal_id, len(settled), swept
            )
            clock = OffsetClock()
            trust = BundleTrust()
            self.status = StatusCell()
            self.secrets = SecretRequests(timeout_s=self.options.secret_timeout_s)
            self.metrics = metrics = NodeMetrics()
            self.helper_stats = HelperCallStats()
            metrics.journal = journal
            metrics.status = self.status
            self.inventory = inventory = InventoryState(system, on_change=self._inventory_changed)
            # XID errors of this boot from the kernel log, as conditions (nodeparts.xid; docs/devices.md).
            self.xid = XidWatcher(
                system,
                cfg.data_dir,
                boot_id,
                publish=self._xid_conditions,
                inventory=lambda: inventory.gpus,
                poll_interval_s=self.options.xid_poll_s,
            )
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
                version=self._upgrader().running_version if self._upgrader() is not None else VERSION,
                monotonic=trio.current_time,
                inventory_hashes=inventory.hashes,
                secrets=self.secrets,
            )
            self.core = core
            sink = JournalEventSink(journal, boot_id)
            sections = self._sections(
                system,
                sink,
                KeyReportSigner(identity.node_key, identity.node_id, boot_id),
                identity,
                trio.lowlevel.current_trio_token(),
            )
            from bcd_agent.sections.instances.section import capabilities as instance_capabilities

            has_devices = any(s.name == "devices" for s in sections)
            # `nvml` when nvidia-smi answers: `nvidia-smi -L` once before Hello (bounded); the full
            # inventory read stays off the path to Hello (_first_inventory), and a later read that
            # finds nvidia-smi answering (or no longer) changes the next Hello's capabilities.
            nvml = await trio.to_thread.run_sync(nvml_answers, system)
            core.capabilities = device_capabilities(
                has_devices, self._acts_on_host(), nvml
            ) + instance_capabilities(
                self.runtimes,
                network=getattr(self.instances_section, "network", None) is not None,
                volumes=getattr(self.instances_section, "volumes", None) is not None
                and self.instances_section.volumes.exists(),
            )
            core.runtimes = self.runtimes
            self._has_devices = has_devices
            self.runner = ConvergeRunner(
                sections,
                self._observer(system),
                host_units=cfg.host.units,
                initial_spec=core.load_spec(),
                status=self.status,
                on_pass=metrics.record_pass,
            )
            kinds = {**KINDS, **TEST_KINDS} if self.options.test_kinds else KINDS
            self.handlers = self._handlers(system)
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
                handlers=self.handlers,
                signer=result_signer,
                secrets=self.secrets,
                kinds=kinds,
                applied_generation=journal.applied_generation,
            )
            core.dispatcher = self.dispatcher
            metrics.dispatcher = self.dispatcher
            metrics.helper = self.helper_stats
            core.runner = self.runner
            self.session = Session(
                core,
                self._endpoint(identity),
                backoff=Backoff(initial_s=self.options.backoff_initial_s, max_s=self.options.backoff_max_s),
                heartbeat_s=self.options.heartbeat_s,
                status_interval_s=self.options.status_interval_s,
                on_link_change=self._poke_status_file,
                limits=StreamLimits(
                    max_message_bytes=cfg.control_plane.max_message_bytes,
                    frame_deadline_s=float(cfg.control_plane.frame_deadline_s),
                ),
                stall_timeout_s=float(cfg.control_plane.stall_timeout_s),
            )
            sink.wake = self.session.events_changed
            # The session's link changed: status.json is rewritten at once (bcd status --check).
            self._status_pokes, pokes = trio.open_memory_channel[None](1)
            notifier = Notifier()
            async with trio.open_nursery() as outer:
                # The parts run under a shielded scope: cancelling `run` (SIGTERM) does not stop them
                # all at once, `_shutdown` stops them in order.
                await outer.start(self._parts, journal, notifier, identity.node_id, pokes)
                task_status.started(self)
                try:
                    await trio.sleep_forever()
                finally:
                    with trio.CancelScope(shield=True):
                        await self._shutdown()
        finally:
            journal.close()

    async def _parts(
        self, journal: Any, notifier: Any, node_id: str, pokes: Any, *, task_status: trio.TaskStatus[None]
    ) -> None:
        from bcd_agent import statusfile

        with self._parts_scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(_scoped, self._lanes_scope, self.dispatcher.run)
                if self.exporter is not None:
                    await nursery.start(self.exporter.run)
                    await nursery.start(self.telemetry.run)
                await nursery.start(self.runner.run)
                await nursery.start(self.xid.run)
                # bcd status: each new status to data_dir/status.json (bcd_agent.statusfile; docs/sim.md).
                await nursery.start(
                    functools.partial(
                        statusfile.serve, self.status, self.config.data_dir, extra=self.liveness, pokes=pokes
                    )
                )
                await nursery.start(_scoped, self._session_scope, self.session.run)
                nursery.start_soon(sweep_periodically, journal, self.options.sweep_interval_s, self._swept)
                if getattr(self.instances_section, "snapshots", None) is not None:
                    nursery.start_soon(self.instances_section.snapshots.serve)
                if getattr(self.instances_section, "network", None) is not None:
                    from bcd_agent.sections.instances.network import check_periodically

                    nursery.start_soon(check_periodically, self.instances_section.network)
                if getattr(self.instances_section, "rebinder", None) is not None:
                    from bcd_agent.nodeparts.instances import balloon_periodically, rebind_periodically

                    def instances_payload() -> Any:
                        spec = self.runner.spec
                        return spec.payload("instances") if spec is not None else None  # None: no spec yet

                    nursery.start_soon(
                        rebind_periodically, self.instances_section, instances_payload, self._trigger
                    )
                    nursery.start_soon(balloon_periodically, self.instances_section, instances_payload)
                # The first inventory read (the heartbeat's hash) off the path to Hello, then the heap's
                # free pages back once start-up is over.
                nursery.start_soon(self._start_tail)
                if self._helper_socket() is not None:
                    nursery.start_soon(self._read_audit_head)
                notifier.ready(f"node {node_id}")
                if notifier.watchdog_interval_s is not None:
                    nursery.start_soon(_watchdog, notifier, notifier.watchdog_interval_s)
                task_status.started()

    async def _shutdown(self) -> None:
        """Stop accepting commands, drain the lanes (or cancel them after DRAIN_S), close the session,
        then everything else; `run`'s caller closes the journal last."""
        if self.dispatcher is not None:
            self.dispatcher.stop_accepting()
            with trio.move_on_after(self.options.drain_s):
                await self.dispatcher.drained()
        self._lanes_scope.cancel()
        self._session_scope.cancel()
        self._parts_scope.cancel()

    def _xid_conditions(self, conditions: tuple[Any, ...]) -> None:
        if self.runner is not None:
            from bcd_agent.nodeparts.xid import SOURCE

            self.runner.set_conditions(SOURCE, conditions)

    def _poke_status_file(self) -> None:
        if self._status_pokes is not None:
            with contextlib.suppress(trio.WouldBlock):  # one pending poke is enough
                self._status_pokes.send_nowait(None)

    def liveness(self) -> dict[str, object]:
        """What status.json carries beyond the converge status (bcd_agent.statusfile): the session's link
        and the converge passes, as wall times, for `bcd status` and `bcd status --check`; and the GPUs
        passed through to instances, for the holders table."""
        wall, mono = time.time(), trio.current_time()

        def to_wall(t: float | None) -> float | None:
            return None if t is None or t in (math.inf, -math.inf) else round(wall - (mono - t), 3)

        doc: dict[str, object] = {"version": VERSION, "root": self.options.root}
        if self.started_monotonic is not None:
            doc["started_at"] = to_wall(self.started_monotonic)
        session = self.session
        if session is not None:
            doc["session"] = {
                "state": session.link,
                "since": round(session.link_since, 3),
                "last_error": session.link_error,
                "retry_at": None if session.retry_at is None else round(session.retry_at, 3),
                "attempts": session.attempts,
                "last_heartbeat_at": None
                if session.last_heartbeat_at is None
                else round(session.last_heartbeat_at, 3),
                "endpoint": session.endpoint.describe(),
            }
        runner = self.runner
        if runner is not None:
            latest = runner.status.latest()
            next_at, next_reason = runner.next_pass()
            doc["converge"] = {
                "last_pass_at": to_wall(latest.last_pass_monotonic) if latest is not None else None,
                "next_pass_at": to_wall(next_at),
                "next_pass_reason": next_reason if next_at != math.inf else "",
            }
        out: dict[str, object] = {"node": doc}
        instances = self.instances_section
        if instances is not None:
            # GPU uuid -> instance: `bcd status` shows a GPU passed through to a VM as held by it (no CDI
            # file names it); the same map the devices section refuses holds on (DEV-PASS).
            out["passthrough"] = self._vfio()
        return out

    async def _start_tail(self) -> None:
        """After Hello: the first inventory read; then, once the first converge pass ran (or
        STARTUP_PASS_WAIT_S went by without a spec), the free heap start-up left behind goes back to
        the system (nodeparts.memory; docs/benchmarks.md, idle_rss_mb)."""
        from bcd_agent.nodeparts.memory import release_free_heap

        await self._first_inventory()
        with trio.move_on_after(STARTUP_PASS_WAIT_S):
            version = 0
            while True:
                status = await self.status.wait_newer(version)
                if status.passes > 0:
                    break
                version = status.version
        release_free_heap()

    async def _first_inventory(self) -> None:
        await self.session.hello_sent.wait()
        if self.inventory is not None and not self.inventory.hash:
            try:
                await trio.to_thread.run_sync(self.inventory.refresh)
            except Exception:  # the next converge pass reads it again
                log.warning("node: the first inventory read failed", exc_info=True)

    def _inventory_changed(self) -> None:
        gpus = self.inventory.gpus if self.inventory is not None else None
        if self.core is not None and gpus is not None:
            self.core.capabilities = device_capabilities(self._has_devices, self._acts_on_host(), gpus.nvml)
        if self.session is not None:
            self.session.heartbeat_soon()

    def _swept(self, deleted: int) -> None:
        self.sweeps += 1
        log.info("node: journal swept: %d command entries deleted", deleted)


async def _scoped(
    scope: trio.CancelScope, service: Callable[..., Any], *, task_status: trio.TaskStatus[Any]
) -> None:
    """Run `service` (a nursery.start service) inside `scope`, so it can be stopped on its own."""
    with scope:
        await service(task_status=task_status)


def nvml_answers(system: Any) -> bool:
    """Whether nvidia-smi answers (`nvidia-smi -L` exits 0): Hello's `nvml` capability."""
    from bcd_agent.inventory.gpus import NVIDIA_SMI, TOOL_TIMEOUT_S

    try:
        return bool(system.run([NVIDIA_SMI, "-L"], timeout=min(TOOL_TIMEOUT_S, 10.0)).ok)
    except OSError:
        return False


async def sweep_periodically(journal: Any, interval_s: float, swept: Callable[[int], None]) -> None:
    """`journal.sweep()` every `interval_s` (daily in `bcd node`) for as long as the process runs.

    Q-DLV-REC-01 (docs/journal.md): once at start, right after recover, then daily. Sweep is one short
    transaction (a scan of at most ~7 days of commands); it runs in a worker thread so a slow disk never
    stalls the session. A failed sweep is logged and tried again at the next interval: nothing depends on
    it but the journal's size."""
    while True:
        await trio.sleep(interval_s)
        try:
            deleted = await trio.to_thread.run_sync(journal.sweep)
        except Exception:
            log.warning("node: journal sweep failed; trying again in %.0f s", interval_s, exc_info=True)
            continue
        swept(deleted)


async def _watchdog(notifier: Any, interval_s: float) -> None:
    while True:
        notifier.watchdog()
        await trio.sleep(interval_s)


# --- CLI ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_shared.subcommands import non_negative_float, root_dir

    from bcd_agent.config import add_config_argument

    add_config_argument(parser)
    parser.add_argument(
        "--root", default="/", type=root_dir, help="a simulated host directory standing for /"
    )
    logsetup.add_argument(parser)
    parser.add_argument("--test-kinds", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--test-effect-delay", type=non_negative_float, default=0.0, help=argparse.SUPPRESS)


def _preflight(config: Config) -> None:
    """What stops `bcd node` before anything starts, as CliError EX_CONFIG (78): the unit's
    RestartPreventExitStatus=78 then stops systemd's restart loop instead of retrying every 5 s."""
    from bcd_shared.subcommands import EX_CONFIG, EX_NOPERM, CliError

    from bcd_agent.session.identity import IdentityError, identity_path, load

    data_dir = Path(config.data_dir)
    where = f"data_dir {data_dir} (from {config.source})"
    if not data_dir.exists():
        raise CliError(f"{where} does not exist: run deploy/install.sh, then `bcd join`", EX_CONFIG)
    if not data_dir.is_dir():
        raise CliError(f"{where} is not a directory: correct data_dir in {config.source}", EX_CONFIG)
    if not os.access(data_dir, os.R_OK | os.W_OK | os.X_OK):
        # Before: "<data_dir>/identity.json: Permission denied", which names neither account.
        owner = data_dir.stat().st_uid
        raise CliError(
            f"{where} is owned by uid {owner} (mode {data_dir.stat().st_mode & 0o7777:04o}) and this "
            f"process (uid {os.geteuid()}) cannot use it: run bcd node as the data_dir's owner (on a "
            "host: systemctl start bcd-node, which runs it as the bcd account)",
            EX_NOPERM,
        )
    if not identity_path(data_dir).exists():
        raise CliError(
            f"not joined: {identity_path(data_dir)} does not exist: "
            "run `bcd join --token TOKEN --address HOST:PORT` first",
            EX_CONFIG,
        )
    try:
        load(data_dir)
    except IdentityError as exc:
        raise CliError(f"{exc} (restore it, or `bcd join --reset --yes`)", EX_CONFIG) from None


def _start_error(exc: BaseException) -> BaseException:
    """A failure of the node's start (one exception inside trio's groups) as a CliError, where it is one
    an operator fixes outside bcd; anything else unchanged (a bug keeps its traceback)."""
    from bcd_shared.subcommands import EX_CONFIG, EX_TEMPFAIL, CliError

    from bcd_agent.journal import JournalLocked, UnsafeDataDir
    from bcd_agent.journal._types import BoundError
    from bcd_agent.session.identity import IdentityError

    leaf = exc
    while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
        leaf = leaf.exceptions[0]
    if isinstance(leaf, JournalLocked):
        return CliError(f"{leaf} (is another bcd node running with this data_dir?)", EX_TEMPFAIL)
    if isinstance(leaf, (IdentityError, UnsafeDataDir, BoundError)):
        return CliError(str(leaf), EX_CONFIG)
    return leaf


def run(args: argparse.Namespace) -> int:
    from bcd_shared.simroot import SimHostMissing, simhost_module
    from bcd_shared.subcommands import EX_CONFIG, EX_USAGE, CliError

    from bcd_agent.config import ConfigError, default_config_path, load_config

    try:
        if args.root != "/":
            simhost_module(args.root)  # a simulated root needs bcd-simhost
        config = load_config(args.config or default_config_path())
    except SimHostMissing as exc:
        raise CliError(str(exc), EX_USAGE) from None
    except ConfigError as exc:
        raise CliError(str(exc), EX_CONFIG) from None
    _preflight(config)
    logsetup.configure(config.log.level, args.log_format)
    node = Node(
        config,
        NodeOptions(root=args.root, test_kinds=args.test_kinds, test_effect_delay_s=args.test_effect_delay),
    )

    from bcd_agent.earlystop import installed

    early = installed()  # `bcd` installed it before importing the node; None when run otherwise

    async def main() -> None:
        from bcd_shared.sdnotify import Notifier

        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            if early is not None and early.received:
                log.info(
                    "bcd node: %s received while starting, stopping", signal.Signals(early.received[0]).name
                )
                Notifier().stopping()
                return
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                # Once started (journal open, identity loaded): a node that cannot start says so in
                # its one error line alone.
                log.info("%s", start_line(args.config, config, args.root, os.geteuid()))
                async for signum in signals:
                    log.info("bcd node: %s received, stopping", signal.Signals(signum).name)
                    Notifier().stopping()
                    nursery.cancel_scope.cancel()
                    break

    from bcd_agent.nodeparts.memory import limit_arenas

    limit_arenas()  # before trio's first worker thread (nodeparts.memory)
    try:
        trio.run(main)
    except BaseException as exc:
        fatal = _storage_failure(exc)
        if fatal is not None:
            # As PostgreSQL does on a failed fsync: end, in one line naming the file and the error.
            log.error("bcd node %s stopped: storage failure: %s", VERSION, fatal)
            print(f"bcd node: storage failure, exiting: {fatal}", file=sys.stderr)
            return 1
        error = _start_error(exc)
        log.error("bcd node %s stopped: %s", VERSION, error)
        raise error from None
    log.info("bcd node %s stopped", VERSION)
    return 0


def helper_mode(config: Config, root: str, euid: int) -> str:
    """How this node changes the host, for the start line and `bcd doctor`."""
    if config.helper.socket:
        return f"through bcd helper at {config.helper.socket}"
    if euid == 0 or root != "/":
        return "itself (no [helper] socket; acting as root)" if euid == 0 else "itself on the simulated host"
    return "none (unprivileged without [helper] socket: host changes unsupported)"


def start_line(config_path: object, config: Config, root: str, euid: int) -> str:
    """The node's start-up log line (once it has started): version, config path, data_dir, root, helper
    mode."""
    where = f", root {root}" if root != "/" else ""
    return (
        f"bcd node {VERSION} started: config {config_path}, data_dir {config.data_dir}{where},"
        f" host changes {helper_mode(config, root, euid)}"
    )


def _storage_failure(exc: BaseException) -> str | None:
    """The one-line cause when `exc` (or one inside its groups) is a storage failure: the journal's
    JournalIOError, or EIO from a file of the data_dir."""
    import errno

    from bcd_agent.journal import JournalIOError

    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _storage_failure(inner)
            if found is not None:
                return found
        return None
    if isinstance(exc, JournalIOError):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.EIO:
        return f"{exc.filename or 'a data_dir file'}: errno {exc.errno} (EIO): {exc.strerror}"
    return None
