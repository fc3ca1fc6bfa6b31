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
    checked_nics,
    listing_counts,
    listing_digest,
    load_argv,
    parse_ip_addr,
    ruleset_counts,
)

from bcd_helper.ops.base import Call, Failed, Refused


@frozen
class NftApply:
    nics: tuple[NicPolicy, ...] = ()


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
    wanted = tuple(sorted({n.bridge for n in req.nics}))
    host = _host(call, wanted)
    text = build_checked(accepted, host)
    call.ctx.nft_reference = None
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
