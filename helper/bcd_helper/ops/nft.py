"""nft.*: the instances' nftables rules, loaded and checked by root for an unprivileged node (DLV-PRIV-08).

- `nft.apply` receives a typed policy per instance NIC (`bcd_shared.netpolicy.NicPolicy`: instance id,
  NIC index, bridge, MAC, IPAM addresses, policy, ssh_from_host_only), never nft text. Root checks
  every NIC (`checked_nics`, with the bridges limited to `[helper] instance_bridges`), reads the host's
  addresses on those bridges itself (`ip -j addr show`), derives each tap from the instance id and index,
  builds the rules with the node's own builder (`build_checked`, build_ruleset's core: the same bytes for
  the same input) and loads them with `nft -f FILE` in one transaction. The NICs of the last load are
  kept checked (`NicMemo`, in the helper's memory): a reload checks again only what changed and what
  depends on the other NICs. It then lists the three tables; the listing becomes root's reference
  digest only if its rule and set-element counts are what was built. The answer
  carries the SHA-256 of the loaded text.
- `nft.check` lists the tables and compares their digest (counters and handles left out, set elements
  in) with root's reference: `{"intact": bool}`. The reference lives in the helper's memory: a restarted
  helper answers `intact: false`, and the node loads the rules again.
- With command-signing roots, `nft.apply` takes the signed spec (`intent`, re-validated as for
  `libvirt.start`: chain, node, generation never older) and the NICs may grant no guest more than it
  does (`_signed_policies`): root derives each kept instance's NIC policies from the spec's instances
  section itself (`spec_policies`) and the request must carry exactly those.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from attrs import frozen
from bcd_shared.netpolicy import (
    LIST_ARGVS,
    HostAddresses,
    NicMemo,
    NicPolicy,
    PolicyError,
    build_checked,
    check_nics,
    checked_nics,
    eui64_link_local,
    listing_counts,
    listing_digest,
    load_argv,
    parse_cidr,
    parse_ip_addr,
    ruleset_counts,
)

from bcd_helper.ops.base import Call, Failed, Refused, no_roots_possible
from bcd_helper.ops.hostunit import SignedIntent


def _with_roots(call: Call, intent: SignedIntent | None) -> bool:
    return not no_roots_possible(call.ctx, intent)


@frozen
class NftApply:
    nics: tuple[NicPolicy, ...] = ()
    intent: SignedIntent | None = None


_POLICIES = {1: "EGRESS", 2: "PRIVATE", 3: "NONE"}
_DELETED = 4  # InstanceDesiredState.DELETED


def spec_policies(instances: Any) -> dict[str, tuple[NicPolicy, ...] | None]:
    """Root's own derivation of the NIC policies from the signed spec's instances (wire InstanceSpec),
    as the node's `nic_policies` makes them: for each instance the spec keeps (not DELETED), in order,
    its NICs' policies, or None where they cannot be expressed (an unset policy, a field the builder
    refuses, an address an earlier instance claims): such an instance gets no rules."""
    out: dict[str, tuple[NicPolicy, ...] | None] = {}
    owner: set[str] = set()
    for inst in instances:
        if int(inst.desired_state) == _DELETED:
            continue
        policy = _POLICIES.get(int(inst.network_policy))
        if policy is None:
            out[inst.id] = None
            continue
        nics = tuple(
            NicPolicy(inst.id, i, n.bridge, n.mac, tuple(n.addresses), policy, bool(inst.ssh_from_host_only))
            for i, n in enumerate(inst.nics)
        )
        try:
            check_nics(nics)
            owned = [parse_cidr(a)[1] for n in nics if n.guarded for a in n.addresses]
            owned += [eui64_link_local(n.mac) for n in nics if n.guarded]
        except (PolicyError, ValueError):
            out[inst.id] = None
            continue
        if any(a in owner for a in owned):
            out[inst.id] = None
            continue
        owner.update(owned)
        out[inst.id] = nics
    return out


def require_loaded(call: Call, op: str, inst: Any) -> None:
    """With roots, before a guest runs (`libvirt.start`, `libvirt.restore`, `ch.launch`): an instance
    the signed spec guards (PRIVATE, NONE, SSH from the host only, or a NIC with a MAC and addresses)
    starts only when root's last successful `nft.apply` holds every NIC policy root derives for it from
    the spec (`network-policy`): the node loads the rules before any domain starts (DLV-NFT-01), so
    an honest node never meets this; a node that skips the load never runs the guest unguarded. An
    instance whose policy cannot be expressed gets no rules, and the node fails it (DLV-NFT-05)."""
    if not call.ctx.config.guest_network_rules:
        return  # root's config says this host has no nftables to load (`bcd sim`'s simulated host)
    nics = spec_policies([inst]).get(inst.id)
    if not nics or not any(n.policy != "EGRESS" or n.ssh_from_host_only or n.guarded for n in nics):
        return
    if any(n not in call.ctx.nft_loaded for n in nics):
        raise Refused(
            "network-policy",
            f"{op}: {inst.id}: the signed spec's network rules for it are not loaded: nft.apply first",
        )


def _signed_policies(call: Call, req: NftApply) -> None:
    """With command-signing roots, the NICs must grant no guest more than the signed spec does: every
    instance the spec keeps whose policy can be expressed is in the request with exactly root's own
    derivation of its NICs (none missing, none changed), an instance whose policy cannot be expressed
    has none, and no other entry names a tap of the spec's instances. Entries of instances the spec
    does not keep (a deleted instance's guard, kept while its domain exists) are taken as sent: a tap's
    rules only drop, and leaving them out entirely is the node's to decide. The state is saved last."""
    op = "nft.apply"
    verifier = call.ctx.intent_verifier()
    checked = verifier.check_spec(op, req.intent)
    if checked.roots:
        decoded = checked.decoded
        assert decoded is not None  # verified against the roots
        # A full spec decides the instances (unset: none kept); a patch speaks for them only when it sets
        # the section (round 11: a host-only patch read as "no instances" let any policy load).
        if decoded.full is not None:
            section = decoded.full.instances
        elif decoded.patch is not None and decoded.patch.instances is not None:
            section = decoded.patch.instances
        else:
            raise Refused(
                "bad-intent",
                f"{op}: the signed spec (generation {decoded.generation}) is a patch that sets no instances "
                "section: it says nothing about the guests' network policies",
            )
        derived = spec_policies(section.instances if section is not None else [])
        sent: dict[str, list[NicPolicy]] = {}
        for n in req.nics:
            sent.setdefault(n.instance, []).append(n)
        spec_taps = {n.tap for nics in derived.values() if nics for n in nics}
        for inst, want in derived.items():
            got = tuple(sorted(sent.get(inst, ()), key=lambda n: n.index))
            if got != (want or ()):
                what = "cannot be expressed: it gets no rules" if want is None else "differ or are missing"
                raise Refused(
                    "spec-mismatch",
                    f"{op}: instance {inst}: the NIC policies differ from the signed spec's "
                    f"(generation {decoded.generation}; its policy {what})",
                )
        for n in req.nics:
            if n.instance not in derived and n.tap in spec_taps:
                raise Refused(
                    "spec-mismatch",
                    f"{op}: instance {n.instance[:80]}: NIC {n.index}'s tap is a spec instance's",
                )
    if checked.next_state is not None:
        verifier.save_state(checked.next_state)


@frozen
class NftCheck:
    pass


def _listing(call: Call) -> list[bytes]:
    outs = []
    for argv in LIST_ARGVS:
        result = call.system.run(list(argv), timeout=60)
        if not result.ok:
            raise Failed("nft", f"{' '.join(argv)}: {result.describe()}")
        outs.append(result.stdout)
    return outs


def nft_apply(call: Call, req: NftApply) -> dict[str, Any]:
    bridges = frozenset(call.ctx.config.instance_bridges)
    if call.ctx.nft_memo is None:
        call.ctx.nft_memo = NicMemo()  # under the nft lock, as every use of it
    try:
        # refused before anything runs; checked once (the last load's NICs from the memo)
        accepted = checked_nics(req.nics, bridges, call.ctx.nft_memo)
    except PolicyError as exc:
        raise Refused("bad-policy", f"nft.apply: {exc}") from None
    if _with_roots(call, req.intent):
        _signed_policies(call, req)
    wanted = tuple(sorted({n.bridge for n in req.nics}))
    host = _host(call, wanted)
    text = build_checked(accepted, host)
    call.ctx.nft_reference = None
    call.ctx.nft_loaded = frozenset()
    argv, staged = load_argv(text)
    try:
        result = call.system.run(argv, timeout=120)
    finally:
        os.unlink(staged)
    if not result.ok:
        raise Failed("nft", f"nft -f: {result.describe()}")
    outs = _listing(call)
    if listing_counts(outs) != ruleset_counts(text):
        raise Failed("nft", "nft: the tables changed while they were loaded")
    call.ctx.nft_reference = (listing_digest(outs), wanted, host)
    call.ctx.nft_loaded = frozenset(req.nics)
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "nics": len(req.nics)}


def _host(call: Call, wanted: tuple[str, ...]) -> HostAddresses:
    """The host's addresses on the `wanted` bridges, as root reads them (`ip -j addr show dev BR`)."""
    host = HostAddresses()
    for br in wanted:
        result = call.system.run(["ip", "-j", "addr", "show", "dev", br], timeout=30)
        if not result.ok:
            if b"does not exist" in result.stderr:
                continue  # a bridge not made yet has no host address
            raise Failed("ip", f"ip -j addr show dev {br}: {result.describe()}")
        try:
            got = parse_ip_addr(result.stdout, wanted)
        except ValueError as exc:
            raise Failed("ip", f"ip -j addr show: unreadable output: {exc}") from None
        host = HostAddresses(tuple(sorted({*host.v4, *got.v4})), tuple(sorted({*host.v6, *got.v6})))
    return host


def nft_check(call: Call, req: NftCheck) -> dict[str, Any]:
    """Intact: the tables are what the last load left, and the host's addresses on the bridges are still
    those the rules were built with (a changed address makes the node load them again)."""
    if call.ctx.nft_reference is None:
        return {"intact": False}
    reference, wanted, host = call.ctx.nft_reference
    try:
        if _host(call, wanted) != host:
            return {"intact": False}
        digest = listing_digest(_listing(call))
    except Failed:
        return {"intact": False}  # a listing that fails: the table is gone
    except ValueError:
        return {"intact": False}
    return {"intact": digest == reference}
