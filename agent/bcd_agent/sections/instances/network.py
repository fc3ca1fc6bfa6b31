"""The instances' network policy on the node: which NIC policies to load, loading them, and the 5-second
integrity check (seeds/delivery.md "Instances", DLV-NFT; the rules are bcd_shared.netpolicy's).

- `nic_policies(spec, live, previous)` (pure): one `NicPolicy` per NIC of every instance the spec keeps,
  plus the last loaded policies of an instance the spec dropped (or DELETED) whose domain still exists,
  so a deleted instance keeps its guard until its domain is gone (DLV-NFT-17). An instance whose policy
  cannot be expressed (an unset policy, a `bc*` bridge, PRIVATE/NONE without MAC or addresses, an address
  an earlier instance owns, tap names another instance's taps have) fails alone (DLV-NFT-05, -18, -22)
  and gets no rules.
- `DirectNft` (root): `nft -f -` of the built text; then the tables are listed and the listing becomes
  the reference digest only if its rule and set-element counts are what was built, so a change racing
  the load is not taken as the truth. `HelperNft`: the typed `nft.apply` / `nft.check` ops
  (DLV-PRIV-08): root builds the rules itself and keeps the reference.
- `NetworkPolicy`: the last NIC policies loaded, whether the loaded rules are trusted (DLV-NFT-18/24),
  `integrity_check()` (every 5 s, outside any converge pass: on a mismatch trust ends at once and the
  last ruleset is loaded again; a failed reload is retried by the next pass, DLV-NFT-23..26).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from bcd_shared.errors import RetryableError, StepError
from bcd_shared.instancenames import tap_collision, tap_stem
from bcd_shared.netpolicy import (
    LIST_ARGVS,
    HostAddresses,
    NicMemo,
    NicPolicy,
    PolicyError,
    check_nics,
    checked_nics,
    eui64_link_local,
    listing_counts,
    listing_digest,
    load_argv,
    nic_sets,
    parse_cidr,
    parse_ip_addr,
    render_ruleset,
    ruleset_counts,
)
from bcd_shared.system import System

from bcd_agent.sections.instances.model import Desired, InstancesSpec
from bcd_agent.sections.instances.plan import Plan, RuntimeView, Step
from bcd_agent.sections.instances.runtimes.base import PAUSED, RUNNING, Domain

log = logging.getLogger("bcd.instances.network")

CHECK_INTERVAL_S = 5.0


def guards(policy: str, ssh_from_host_only: bool) -> bool:
    """Whether the rules guard an instance: a failed load fails it (DLV-NFT-06; EGRESS runs on, -27)."""
    return policy in ("PRIVATE", "NONE") or ssh_from_host_only


def nic_policies(
    spec: InstancesSpec,
    live: Iterable[str],
    previous: Mapping[str, tuple[NicPolicy, ...]],
) -> tuple[dict[str, tuple[NicPolicy, ...]], dict[str, str]]:
    """(instance id -> its NIC policies, instance id -> why its policy cannot be expressed). Pure."""
    out: dict[str, tuple[NicPolicy, ...]] = {}
    errors: dict[str, str] = {}
    owner: dict[str, str] = {}
    kept = {i.id for i in spec.instances if i.desired is not Desired.DELETED}
    live = set(live)
    # Tap names (instancenames.tap_collision): a dropped instance's guard stays while its domain does;
    # of the kept ones, one whose domain exists keeps its names, else the first in the spec. Two
    # instances' NICs on one tap would fail the whole load (netpolicy refuses them): the other fails alone.
    taps = {tap_stem(name): name for name in sorted(live - kept) if previous.get(name)}
    for inst in sorted(spec.instances, key=lambda i: i.id not in live):
        if inst.id in kept and inst.nics:
            taps.setdefault(tap_stem(inst.id), inst.id)
    for inst in spec.instances:
        if inst.id not in kept:
            continue
        if inst.nics and taps[tap_stem(inst.id)] != inst.id:
            errors[inst.id] = f"network policy: nics: {tap_collision(inst.id, taps[tap_stem(inst.id)])}"
            continue
        if inst.network_policy not in ("EGRESS", "PRIVATE", "NONE"):
            errors[inst.id] = f"network_policy: {inst.network_policy} is not EGRESS, PRIVATE or NONE"
            continue
        nics = tuple(
            NicPolicy(inst.id, i, n.bridge, n.mac, n.addresses, inst.network_policy, inst.ssh_from_host_only)
            for i, n in enumerate(inst.nics)
        )
        try:
            check_nics(nics)
        except PolicyError as exc:
            errors[inst.id] = f"network policy: {exc}"
            continue
        clash = next((a for a in _owned(nics) if a in owner), None)
        if clash is not None:
            errors[inst.id] = f"network policy: address {clash} is claimed by instance {owner[clash]} too"
            continue
        for a in _owned(nics):
            owner[a] = inst.id
        out[inst.id] = nics
    for name in sorted(set(live) - kept):
        old = previous.get(name)
        if old and not any(a in owner for a in _owned(old)):
            out[name] = old  # a deleted instance keeps its guard until its domain is gone
            for a in _owned(old):
                owner[a] = name
    return out, errors


def _owned(nics: Iterable[NicPolicy]) -> list[str]:
    out: list[str] = []
    for n in nics:
        if n.guarded:
            out.extend(parse_cidr(a)[1] for a in n.addresses)
            out.append(eui64_link_local(n.mac))
    return out


class NftBackend(Protocol):
    def load(self, nics: Sequence[NicPolicy]) -> None:
        """Replace the tables with the rules for `nics`; StepError when nft refused or failed."""
        ...

    def check(self) -> bool:
        """Whether the tables are exactly what the last load left; StepError when they cannot be read."""
        ...


class DirectNft:
    """As root: `ip -j addr show` for the host's addresses on the bridges, `nft -f -`, `nft -j list`."""

    def __init__(self, system: System) -> None:
        self.system = system
        self._digest: str | None = None
        self._host: tuple[tuple[str, ...], HostAddresses] = ((), HostAddresses())
        self._memo = NicMemo()  # the last load's NICs, checked: a reload checks only what changed

    def host_addresses(self, bridges: Iterable[str]) -> HostAddresses:
        wanted = sorted(set(bridges))
        if not wanted:
            return HostAddresses()
        return host_addresses(self.system, wanted)

    def listing(self) -> list[bytes]:
        outs = []
        for argv in LIST_ARGVS:
            result = self.system.run(list(argv), timeout=60)
            if not result.ok:
                raise RetryableError("nft", f"{' '.join(argv)}: {result.describe()}")
            outs.append(result.stdout)
        return outs

    def ruleset(self, nics: Sequence[NicPolicy]) -> tuple[str, tuple[str, ...], HostAddresses]:
        """The rules' text for `nics`, the bridges and the host's addresses on them it was built with.
        The addresses are read (`ip`, a process of its own) while the NICs are checked and their sets
        made, in a worker joined before this returns: on 1,000 NICs each takes milliseconds, and a load
        waits for both. The last load's NICs come checked from the memo."""
        bridges = tuple(sorted({n.bridge for n in nics}))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcd-nft-host") as pool:
            reading = pool.submit(self.host_addresses, bridges)
            try:
                sets = nic_sets(checked_nics(nics, memo=self._memo))
            except PolicyError as exc:
                raise RetryableError("nft", f"network policy: {exc}") from None
            host = reading.result()
        return render_ruleset(sets, host), bridges, host

    def load(self, nics: Sequence[NicPolicy]) -> None:
        text, bridges, host = self.ruleset(nics)
        self._digest = None
        argv, staged = load_argv(text)
        try:
            result = self.system.run(argv, timeout=120)
        finally:
            os.unlink(staged)
        if not result.ok:
            raise RetryableError("nft", f"nft -f: {result.describe()}")
        outs = self.listing()
        if listing_counts(outs) != ruleset_counts(text):
            raise RetryableError("nft", "nft: the tables changed while they were loaded")
        self._digest = listing_digest(outs)
        self._host = (bridges, host)

    def check(self) -> bool:
        """Intact: the tables are what the last load left and the host's addresses on the bridges are
        those the rules were built with (DLV-NFT-30's exception follows a changed host address)."""
        if self._digest is None:
            return False
        try:
            if self.host_addresses(self._host[0]) != self._host[1]:
                return False
            return listing_digest(self.listing()) == self._digest
        except StepError:
            # `nft list table` of a deleted table fails: the table is gone, not unreadable.
            return False
        except ValueError:
            return False


def host_addresses(system: System, bridges: Sequence[str]) -> HostAddresses:
    """The host's addresses on `bridges` (`ip -j addr show dev BR`, one bridge at a time: a host with
    1,000 taps would list them all otherwise). A bridge that does not exist has none."""
    outs = []
    for br in bridges:
        result = system.run(["ip", "-j", "addr", "show", "dev", br], timeout=30)
        if not result.ok:
            if b"does not exist" in result.stderr:
                continue
            raise RetryableError("nft", f"ip -j addr show dev {br}: {result.describe()}")
        outs.append(result.stdout)
    try:
        parts = [parse_ip_addr(o, bridges) for o in outs]
    except ValueError as exc:
        raise RetryableError("nft", f"ip -j addr show: unreadable output: {exc}") from None
    return HostAddresses(
        tuple(sorted({a for p in parts for a in p.v4})), tuple(sorted({a for p in parts for a in p.v6}))
    )


class HelperNft:
    """Under the helper (DLV-PRIV-08): typed per-tap policies, never nft text."""

    def __init__(self, client: Any, intent: Callable[[], dict[str, Any]] | None = None) -> None:
        self.client = client
        # The signed spec the node keeps ({} when none): with command-signing roots root derives the
        # policies from its instances section and loads nothing else (docs/helper-rpc.md "nft.apply").
        self.intent = intent or dict

    def load(self, nics: Sequence[NicPolicy]) -> None:
        # HelperRefused (a RetryableError, "helper: ...") passes through (DLV-PRIV-05).
        args: dict[str, Any] = {"nics": [_wire(n) for n in nics]}
        intent = self.intent()
        if intent:
            args["intent"] = intent
        self.client.call("nft.apply", args)

    def check(self) -> bool:
        return bool(self.client.call("nft.check", {}).get("intact"))


def _wire(n: NicPolicy) -> dict[str, Any]:
    return {
        "instance": n.instance,
        "index": n.index,
        "bridge": n.bridge,
        "mac": n.mac,
        "addresses": list(n.addresses),
        "policy": n.policy,
        "ssh_from_host_only": n.ssh_from_host_only,
    }


class NetworkPolicy:
    """The loaded rules and their trust. `apply` runs in a converge pass; `integrity_check` beside it
    (a lock keeps the two from interleaving)."""

    def __init__(self, backend: NftBackend) -> None:
        self.backend = backend
        self.loaded: dict[str, tuple[NicPolicy, ...]] = {}
        self.trusted = False
        self.needs_reload = False
        self._lock = threading.Lock()

    def apply(self, policies: Mapping[str, tuple[NicPolicy, ...]]) -> None:
        """Load the rules for `policies` unless they are loaded and intact already; StepError (trust
        ended) when the load fails."""
        with self._lock:
            if not self.needs_reload and self.trusted and dict(policies) == self.loaded:
                return
            self._load(dict(policies))

    def _load(self, policies: dict[str, tuple[NicPolicy, ...]]) -> None:
        self.trusted = False
        nics = [n for k in sorted(policies) for n in policies[k]]
        try:
            self.backend.load(nics)
        except StepError:
            self.needs_reload = True
            raise
        self.loaded = policies
        self.trusted = True
        self.needs_reload = False

    def integrity_check(self) -> bool:
        """One 5-second check: True when the tables are intact. On a mismatch trust ends at once and the
        last ruleset is loaded again here, outside any pass; if that fails the next pass retries."""
        with self._lock:
            if not self.loaded and not self.trusted:
                return True  # nothing loaded yet
            try:
                intact = self.backend.check()
            except StepError as exc:
                log.warning("instances: network rules unreadable: %s", exc.message)
                intact = False
            if intact:
                return True
            log.warning("instances: the network rules changed under bcd; loading them again")
            try:
                self._load(self.loaded)
            except StepError as exc:
                log.warning(
                    "instances: reloading the network rules failed (the next pass retries): %s", exc.message
                )
            return False

    def bound_addresses(self) -> dict[str, str]:
        """address -> instance, for the metadata service and tunnels: only while the loaded rules are
        trusted; empty otherwise (DLV-NFT-18, -24)."""
        if not self.trusted:
            return {}
        return {a: name for name, nics in self.loaded.items() for a in _owned(nics)}


# --- the converge pass ------------------------------------------------------------------------------

NETWORK_WAIT = "network policy"  # the key of a retry the outcome reports (no instance has this id)


def gate(the_plan: Plan, failed: Mapping[str, str], domains: Mapping[str, Domain]) -> Plan:
    """`the_plan` without the creates, grows, starts and resumes of `failed` instances, which fail with
    their message, and with a stop for each of them that runs or is paused (DLV-NFT-05/06). Pure."""
    from attrs import evolve

    from bcd_agent.sections.instances.plan import _ORDER, Create, Delete, Grow, Stop

    if not failed:
        return the_plan
    steps: list[Step] = []
    for s in the_plan.steps:
        name = s.instance.id if isinstance(s, Create | Grow) else s.name
        if name in failed and not isinstance(s, Delete | Stop):
            continue
        steps.append(s)
    stopping = {s.name for s in steps if isinstance(s, Stop | Delete)}
    for name in sorted(failed):
        d = domains.get(name)
        if d is not None and d.managed and d.state in (RUNNING, PAUSED) and name not in stopping:
            steps.append(Stop(d.runtime, name))
    errors = {**the_plan.errors, **{k: v for k, v in failed.items() if k not in the_plan.errors}}
    waiting = {k: v for k, v in the_plan.waiting.items() if k not in failed}
    ordered = tuple(sorted(steps, key=lambda s: _ORDER[type(s)]))
    return evolve(the_plan, steps=ordered, errors=errors, waiting=waiting)


def enforce(
    network: NetworkPolicy, spec: InstancesSpec, views: Mapping[str, RuntimeView], the_plan: Plan
) -> Plan:
    """Load the rules before any domain starts (DLV-NFT-01) and gate the plan on them: an instance whose
    policy cannot be expressed fails and stops; when the load fails, the instances the rules guard
    fail and stop (DLV-NFT-06) while EGRESS ones run on with a warning, and the pass stays
    PROGRESSING so the next one retries (DLV-NFT-27, Q-DLV-NFT-03)."""
    from attrs import evolve

    domains = {d.name: d for v in views.values() for d in v.domains}
    live = [d.name for d in domains.values() if d.managed]
    if any(v.error is not None for v in views.values()):
        live += list(network.loaded)  # a runtime not listed may still run them: their guards stay
    policies, failed = nic_policies(spec, live, network.loaded)
    failed = {k: v for k, v in failed.items() if k not in the_plan.errors}
    try:
        network.apply(policies)
    except StepError as exc:
        msg = f"network rules failed to load: {exc.message}"
        log.warning("instances: %s (retried on the next pass)", msg)
        by_id = {i.id: i for i in spec.instances}
        for name in policies:
            inst = by_id.get(name)
            if inst is not None and guards(inst.network_policy, inst.ssh_from_host_only):
                failed.setdefault(name, msg)
        gated = gate(the_plan, failed, domains)
        return evolve(gated, waiting={**gated.waiting, NETWORK_WAIT: msg})
    return gate(the_plan, failed, domains)


async def check_periodically(network: NetworkPolicy, interval_s: float = CHECK_INTERVAL_S) -> None:
    """The integrity check every `interval_s`, in a worker thread, outside any converge pass
    (DLV-NFT-23..25); the node runs it for as long as it runs."""
    import trio

    while True:
        await trio.sleep(interval_s)
        try:
            await trio.to_thread.run_sync(network.integrity_check)
        except Exception:  # a check never ends the node; the next one runs in interval_s
            log.warning("instances: the network rules check failed", exc_info=True)
