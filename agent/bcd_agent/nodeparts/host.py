"""The host section inside `bcd node`: wire spec in, the host section's converger, the unit context.

`NodeHostSection` is the converge runner's `host` Section. Each pass it
1. converts NodeSpec.host (the wire `HostSection`, as the session hands it over) with
   `bcd_agent.sections.host.wire.from_wire`;
2. builds the units' `UnitContext` from this pass: the busy devices (`busy_devices`: every device id a
   live hold or a pending Kubernetes release names, and every GPU when a hold file does not parse or
   the releases cannot be read), root's `[kubernetes] allowed_clusters` from config.toml, and the
   identity labels (`identity_labels`: `bcd.dev/node-id` from the identity, `bcd.dev/gpu.count`,
   `bcd.dev/gpu.product`, `bcd.dev/gpu.driver` from the observation's GPU inventory; host-config.md
   k8s-join "Kept", HST-K8S-44);
3. runs `HostConverger` with the executor the node chose (`DirectExecutor` as root or on the simulated
   host, with the SecretRequest token source and, as root, the root-only path guard; `HelperExecutor`
   with `HelperHostSend` beside `bcd helper`);
4. when the outcome says a unit changed the host, runs `on_changed` (the node refreshes the inventory
   and triggers the devices section's pass; HST-LVL-13).

Under the helper the executor's send is `TokenStagingSend` around `sections.host.intent.HelperHostSend`
(one `host.unit` per unit not converged, with the busy devices, the signed spec the session kept in
data_dir/host-intent.json and the node's trust bundle; the helper's answer as a `HelperAnswer`). For
`k8s-join` while `/etc/kubernetes/kubelet.conf` does not exist it first fetches the token
(SecretRequest) and stages it with the helper's file kind `k8s-token` (HST-K8S-52); the helper's join
removes it on success, and the node removes a staged token the unit did not use.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from typing import Any

from attrs import evolve
from bcd_shared import wire
from bcd_shared.errors import HelperRefused, RetryableError, StepError
from bcd_shared.system import System
from bcd_shared.units import ClusterPin, TokenSource, UnitContext

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import SectionOutcome
from bcd_agent.inventory.gpus import GpuInventory
from bcd_agent.sections.host import HelperAnswer, HostConverger, HostSection, UnitExecutor
from bcd_agent.sections.host.wire import from_wire
from bcd_agent.sections.host.wire import is_empty as payload_is_empty

log = logging.getLogger("bcd.host")

SECTION = "host"
K8S_JOIN = "k8s-join"
KUBELET_CONF = "/etc/kubernetes/kubelet.conf"
TOKEN_KIND = "k8s-token"  # noqa: S105 (the helper file kind, not a secret)

LABEL_NODE_ID = "bcd.dev/node-id"
LABEL_SITE = "bcd.dev/site"
LABEL_GPU_COUNT = "bcd.dev/gpu.count"
LABEL_GPU_PRODUCT = "bcd.dev/gpu.product"
LABEL_GPU_DRIVER = "bcd.dev/gpu.driver"


# --- the unit context ---------------------------------------------------------------------------------


def identity_labels(node_id: str, gpus: GpuInventory | None, site: str = "") -> tuple[tuple[str, str], ...]:
    """The labels k8s-join keeps besides the spec's (HST-K8S-44), label-safe. GPU labels only when
    nvidia-smi answered; the product is the most common GPU name (ties: the first GPU's)."""
    from bcd_shared.units.k8s import label_safe

    labels: list[tuple[str, str]] = [(LABEL_NODE_ID, label_safe(node_id))]
    if site:
        labels.append((LABEL_SITE, label_safe(site)))
    if gpus is not None and gpus.nvml:
        labels.append((LABEL_GPU_COUNT, str(len(gpus.gpus))))
        names = [g.name for g in gpus.gpus if g.name]
        if names:
            product = collections.Counter(names).most_common(1)[0][0]
            labels.append((LABEL_GPU_PRODUCT, label_safe(product)))
        if gpus.driver_version:
            labels.append((LABEL_GPU_DRIVER, label_safe(gpus.driver_version)))
    return tuple((k, v) for k, v in labels if v)


def busy_devices(system: System, data_dir: str, gpus: GpuInventory | None) -> frozenset[str]:
    """Device ids the units must leave alone: what live holds and pending Kubernetes releases name (as
    the devices section records them); every GPU when a hold spec does not parse, the releases file
    cannot be read or the unknown-release marker is set (the helper's rule for an unreadable hold)."""
    from bcd_agent.sections.devices import observe

    holds, unparseable = observe.read_holds(system)
    releases, unreadable = observe.read_releases(system, data_dir)
    ids: set[str] = {d for h in holds.values() for d in h.record.device_ids}
    ids |= {d for r in releases for d in r.device_ids}
    if unparseable or unreadable or system.exists(f"{data_dir}/{observe.MARKER_FILE}"):
        ids |= {g.uuid for g in (gpus.gpus if gpus is not None else ())}
    return frozenset(ids)


def allowed_clusters(clusters: object) -> tuple[ClusterPin, ...]:
    """config.toml's `[kubernetes] allowed_clusters` entries as the units' ClusterPins (normalised)."""
    from bcd_shared.units import parse_allowed_clusters

    entries = [str(c) for c in clusters] if isinstance(clusters, tuple | list) else []
    return parse_allowed_clusters(",".join(entries))


def observed_gpus(observation: Observation) -> GpuInventory | None:
    if observation.has("inventory"):
        inv = observation.get("inventory")
        if isinstance(inv, GpuInventory):
            return inv
    return None


# --- the section --------------------------------------------------------------------------------------

ContextFor = Callable[[Observation], UnitContext]
ExecutorFor = Callable[[UnitContext], UnitExecutor]


class NodeHostSection:
    """The runner's `host` Section in `bcd node` (sync: it runs in the runner's worker thread)."""

    name = SECTION

    def __init__(
        self,
        executor_for: ExecutorFor,
        context_for: ContextFor,
        on_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self._executor_for = executor_for
        self._context_for = context_for
        self._on_changed = on_changed
        self.passes = 0

    def is_empty(self, desired: object | None) -> bool:
        return payload_is_empty(desired)

    def converge(self, desired: object | None, observation: Observation, ctx: PassContext) -> SectionOutcome:
        self.passes += 1
        if isinstance(desired, HostSection):
            section = desired
        elif desired is None or isinstance(desired, wire.HostSection):
            section = from_wire(desired)
        else:
            raise TypeError(f"host payload {type(desired).__name__} is not a HostSection")
        uctx = self._context_for(observation)
        converger = HostConverger(
            lambda busy: self._executor_for(evolve(uctx, busy_gpus=busy)), busy_gpus=lambda: uctx.busy_gpus
        )
        outcome = converger.converge(section, observation, ctx)
        if outcome.changed:
            try:
                self._on_changed()
            except Exception:  # the outcome stands; the runner's follow-up pass reads the host again
                log.warning("host: the after-change hook failed", exc_info=True)
        return outcome


# --- under the helper ---------------------------------------------------------------------------------


class TokenStagingSend:
    """`HelperSend` for `HelperExecutor`: `inner` (sections.host.intent.HelperHostSend: host.unit with the
    kept signed spec) preceded, for k8s-join while kubelet.conf does not exist, by the token's SecretRequest
    and its staging through the helper (file kind `k8s-token`, HST-K8S-52). A token the unit did not use is
    removed again. Never raises: a failed fetch or staging is the unit's failure."""

    def __init__(
        self,
        inner: Callable[[str, str | None, frozenset[str]], HelperAnswer],
        client: Any,
        system: System,
        tokens: TokenSource | None,
    ) -> None:
        self.inner = inner
        self.client = client
        self.system = system
        self.tokens = tokens
        self.staged = 0

    def __call__(self, name: str, settings_json: str | None, busy: frozenset[str]) -> HelperAnswer:
        staged = False
        try:
            if name == K8S_JOIN and settings_json is not None and not self.system.exists(KUBELET_CONF):
                staged = self._stage_token(settings_json)
            return self.inner(name, settings_json, busy)
        except StepError as exc:  # HelperRefused included
            return HelperAnswer(False, exc.message, terminal=exc.terminal)
        finally:
            if staged and not self.system.exists(KUBELET_CONF):
                self._unstage()

    def _stage_token(self, settings_json: str) -> bool:
        if self.tokens is None:
            raise RetryableError("NoToken", "k8s-join: no way to fetch the bootstrap token here")
        try:
            ref = json.loads(settings_json).get("tokenRef")
        except (ValueError, AttributeError):
            return False  # the unit's own decoding reports it
        if not isinstance(ref, str) or not ref:
            return False
        token = self.tokens.fetch(ref)
        self.client.file_write(TOKEN_KIND, "", token.strip() + "\n")
        self.staged += 1
        return True

    def _unstage(self) -> None:
        try:
            self.client.file_remove(TOKEN_KIND, "")
        except HelperRefused as exc:
            log.warning("host: the staged k8s token could not be removed: %s", exc.message)
