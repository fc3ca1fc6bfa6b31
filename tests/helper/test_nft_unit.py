"""nft.apply and nft.check called in process (DLV-PRIV-08; docs/mutation.md). The accepted path runs the
real `nft` and `ip` in a private network namespace of their own (`ip netns exec`: a bridge br0 with
10.0.0.1/24), recorded as root would run them; failures of the tools are scripted with their real
messages (iproute2 6.1's `Device "X" does not exist.`, nft 1.0's `Error: ...`). The helper process and the
node's HelperNft are in test_helper_nft.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.ops.base import Failed, HelperContext, Refused
from bcd_helper.ops.nft import NftApply, NftCheck, nft_apply, nft_check
from bcd_helper.protocol import structure
from bcd_shared.netpolicy import LIST_ARGVS, HostAddresses, NicMemo, NicPolicy, build_ruleset
from opskit import GOOD_NIC as GOOD
from opskit import NODE_UID, call, context, make_root, programs
from testsupport import require_root, require_tool

HELPER = f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE_UID}\ninstance_bridges = "br0,br1"\n'
IP_BR0 = ("ip", "-j", "addr", "show", "dev", "br0")
IP_BR1 = ("ip", "-j", "addr", "show", "dev", "br1")
Script = Callable[[tuple[str, ...]], tuple[int, bytes, bytes]]


def nic(**fields: Any) -> NicPolicy:
    return structure({**GOOD, **fields}, NicPolicy)


def apply_req(*nics: dict[str, Any]) -> NftApply:
    return structure({"nics": list(nics)}, NftApply)


@pytest.fixture(scope="module")
def netns() -> Iterator[str]:
    """A network namespace with bridge br0 (10.0.0.1/24, up); no br1."""
    require_tool("nft")
    require_tool("ip")
    require_root("ip netns add")
    name = f"bcd-nft-unit-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for argv in (
            ("link", "add", "br0", "type", "bridge"),
            ("addr", "add", "10.0.0.1/24", "dev", "br0"),
            ("link", "set", "br0", "up"),
        ):
            subprocess.run(["ip", "-n", name, *argv], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_netns(name: str, override: dict[tuple[str, ...], tuple[int, bytes, bytes]] | None = None) -> Script:
    """Root's programs run for real inside the namespace, except the argvs in `override`."""

    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if override and argv in override:
            return override[argv]
        done = subprocess.run(["ip", "netns", "exec", name, *argv], capture_output=True, check=False)
        return done.returncode, done.stdout, done.stderr

    return script


def ns(name: str, *argv: str) -> bytes:
    return subprocess.run(["ip", "netns", "exec", name, *argv], check=True, capture_output=True).stdout


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[HelperContext]:
    c = context(make_root(tmp_path), HELPER)
    yield c
    c.audit.close()


def flush(name: str) -> None:
    subprocess.run(["ip", "netns", "exec", name, "nft", "flush", "ruleset"], check=True)


def test_a_nic_outside_the_rules_is_refused_before_anything_runs(ctx: HelperContext) -> None:
    with pytest.raises(Refused) as info:
        nft_apply(call(ctx), apply_req(GOOD, {**GOOD, "bridge": "br2"}))
    assert info.value.reason == "bad-policy"
    assert info.value.message.startswith("nft.apply: nics[1].bridge: ")
    assert "br2" in info.value.message
    assert programs(ctx).runs == [] and ctx.nft_reference is None


def test_DLV_PRIV_08_root_builds_loads_and_keeps_the_reference(ctx: HelperContext, netns: str) -> None:
    """Root reads the host's addresses on the NICs' bridges itself, loads the rules it built (the bytes
    the node's builder makes for the same input) with `nft -f`, lists the three tables and keeps their
    digest; nft.check then compares against it."""
    flush(netns)
    ctx.system.script = in_netns(netns)  # type: ignore[attr-defined]
    got = nft_apply(call(ctx, bounded=False), apply_req(GOOD))
    host = HostAddresses(("10.0.0.1",), ctx.nft_reference[2].v6 if ctx.nft_reference else ())
    text = build_ruleset([nic()], host)
    assert got == {"sha256": hashlib.sha256(text.encode()).hexdigest(), "nics": 1}
    runs = programs(ctx).runs
    assert runs[0] == IP_BR0 and runs[1][:2] == ("nft", "-f") and runs[2:] == list(LIST_ARGVS)
    assert programs(ctx).timeouts == [30, 120, 60, 60, 60]
    staged = runs[1][2]
    assert not os.path.exists(staged)  # the staged text is removed after the load
    listed = json.loads(ns(netns, "nft", "-j", "list", "set", "bridge", "bcd_instances", "bind4"))
    assert listed["nftables"][1]["set"]["elem"] == [{"concat": [nic().tap, "10.0.0.5"]}]
    assert ctx.nft_reference is not None
    digest, wanted, kept = ctx.nft_reference
    assert (len(digest), wanted, kept.v4) == (64, ("br0",), ("10.0.0.1",))
    memo = ctx.nft_memo
    assert isinstance(memo, NicMemo) and list(memo.last) == [nic()]  # kept for the next load
    # nft.check: intact; then intact no longer once a set is flushed or the host's addresses changed.
    programs(ctx).runs.clear()
    assert nft_check(call(ctx), NftCheck()) == {"intact": True}
    assert programs(ctx).runs == [IP_BR0, *LIST_ARGVS]
    ns(netns, "nft", "flush", "set", "bridge", "bcd_instances", "bind4")
    assert nft_check(call(ctx), NftCheck()) == {"intact": False}
    # Loaded again (the same NICs: the memo is kept), intact again.
    nft_apply(call(ctx), apply_req(GOOD))
    assert ctx.nft_memo is memo and list(memo.last) == [nic()]
    assert nft_check(call(ctx), NftCheck()) == {"intact": True}
    ns(netns, "ip", "addr", "add", "10.0.0.2/24", "dev", "br0")
    try:
        programs(ctx).runs.clear()
        assert nft_check(call(ctx), NftCheck()) == {"intact": False}
        assert programs(ctx).runs == [IP_BR0]  # the tables are not even listed
    finally:
        ns(netns, "ip", "addr", "del", "10.0.0.2/24", "dev", "br0")
    # The tables gone: the listing fails, so not intact.
    flush(netns)
    assert nft_check(call(ctx), NftCheck()) == {"intact": False}


def test_a_bridge_not_made_yet_has_no_host_address(ctx: HelperContext, netns: str) -> None:
    flush(netns)
    ctx.system.script = in_netns(netns)  # type: ignore[attr-defined]
    other = {**GOOD, "instance": "vm-2", "bridge": "br1", "mac": "52:54:00:00:00:02", "addresses": []}
    nft_apply(call(ctx), apply_req({**other, "policy": "EGRESS"}, GOOD))
    assert programs(ctx).runs[:2] == [IP_BR0, IP_BR1]
    assert ctx.nft_reference is not None
    assert ctx.nft_reference[1:] == (("br0", "br1"), ctx.nft_reference[2])
    assert ctx.nft_reference[2].v4 == ("10.0.0.1",)


def ip_json(*links: tuple[str, list[tuple[str, str]]]) -> bytes:
    """`ip -j addr show` as iproute2 prints it (abridged to the fields read)."""
    return json.dumps(
        [
            {
                "ifindex": i + 2,
                "ifname": name,
                "addr_info": [
                    {
                        "family": fam,
                        "local": local,
                        "prefixlen": 24 if fam == "inet" else 64,
                        "scope": "global",
                    }
                    for fam, local in addrs
                ],
            }
            for i, (name, addrs) in enumerate(links)
        ]
    ).encode()


def test_the_addresses_of_every_bridge_are_merged(ctx: HelperContext, netns: str) -> None:
    flush(netns)
    override = {
        IP_BR0: (
            0,
            ip_json(("br0", [("inet", "10.0.1.1"), ("inet6", "fd00::1"), ("inet", "10.0.0.1")])),
            b"",
        ),
        IP_BR1: (
            0,
            ip_json(("br1", [("inet", "10.0.0.1"), ("inet", "10.0.2.1"), ("inet6", "fd00::2")])),
            b"",
        ),
    }
    ctx.system.script = in_netns(netns, override)  # type: ignore[attr-defined]
    other = {**GOOD, "instance": "vm-2", "bridge": "br1", "mac": "52:54:00:00:00:02", "addresses": []}
    nft_apply(call(ctx), apply_req(GOOD, {**other, "policy": "EGRESS"}))
    assert ctx.nft_reference is not None
    assert ctx.nft_reference[2] == HostAddresses(("10.0.0.1", "10.0.1.1", "10.0.2.1"), ("fd00::1", "fd00::2"))
    flush(netns)


def failed(fn: Any, ctx: HelperContext, req: Any) -> tuple[str, str]:
    with pytest.raises(Failed) as info:
        fn(call(ctx), req)
    return info.value.reason, info.value.message


def test_ip_failures_fail_the_load(ctx: HelperContext) -> None:
    ctx.system.script = lambda argv: (2, b"", b"RTNETLINK answers: Operation not permitted\n")  # type: ignore[attr-defined]
    assert failed(nft_apply, ctx, apply_req(GOOD)) == (
        "ip",
        "ip -j addr show dev br0: ip exited 2: RTNETLINK answers: Operation not permitted",
    )
    ctx.system.script = lambda argv: (0, b"[{]", b"")  # type: ignore[attr-defined]
    reason, message = failed(nft_apply, ctx, apply_req(GOOD))
    assert reason == "ip" and message.startswith("ip -j addr show: unreadable output: ")
    assert [r[0] for r in programs(ctx).runs] == ["ip", "ip"]  # nothing loaded


def nft_script(load: tuple[int, bytes, bytes], listing: dict[int, tuple[int, bytes, bytes]]) -> Script:
    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[0] == "ip":
            return 0, ip_json(("br0", [("inet", "10.0.0.1")])), b""
        if argv[:2] == ("nft", "-f"):
            return load
        return listing.get(LIST_ARGVS.index(argv), (0, b'{"nftables": [{"metainfo": {}}]}', b""))

    return script


def test_a_failed_load_fails_and_forgets_the_reference(ctx: HelperContext, netns: str) -> None:
    flush(netns)
    ctx.system.script = in_netns(netns)  # type: ignore[attr-defined]
    nft_apply(call(ctx), apply_req(GOOD))
    assert ctx.nft_reference is not None
    error = b"/tmp/bcd-nft-x.nft:3:1-5: Error: Could not process rule: Operation not permitted\n"
    ctx.system.script = nft_script((1, b"", error), {})  # type: ignore[attr-defined]
    assert failed(nft_apply, ctx, apply_req(GOOD)) == (
        "nft",
        "nft -f: nft exited 1: /tmp/bcd-nft-x.nft:3:1-5: Error: Could not process rule: Operation not "
        "permitted",
    )
    assert not os.path.exists(programs(ctx).runs[-1][2])
    assert ctx.nft_reference is None
    assert nft_check(call(ctx), NftCheck()) == {"intact": False}
    flush(netns)


def test_a_listing_that_fails_or_does_not_match_fails_the_load(ctx: HelperContext) -> None:
    gone = (1, b"", b"Error: No such file or directory\nlist table arp bcd_taps\n")
    ctx.system.script = nft_script((0, b"", b""), {2: gone})  # type: ignore[attr-defined]
    assert failed(nft_apply, ctx, apply_req(GOOD)) == (
        "nft",
        "nft -j list table arp bcd_taps: nft exited 1: Error: No such file or directory",
    )
    ctx.system.script = nft_script((0, b"", b""), {})  # type: ignore[attr-defined]
    assert failed(nft_apply, ctx, apply_req(GOOD)) == (
        "nft",
        "nft: the tables changed while they were loaded",
    )
    assert ctx.nft_reference is None


def test_check_without_a_load_runs_nothing(ctx: HelperContext) -> None:
    assert nft_check(call(ctx), NftCheck()) == {"intact": False}
    assert programs(ctx).runs == []


def test_check_is_not_intact_when_ip_or_the_listing_cannot_be_read(ctx: HelperContext) -> None:
    host = HostAddresses(("10.0.0.1",), ())
    ctx.nft_reference = ("0" * 64, ("br0",), host)
    ctx.system.script = lambda argv: (1, b"", b"Cannot open netlink socket\n")  # type: ignore[attr-defined]
    assert nft_check(call(ctx), NftCheck()) == {"intact": False}
    ctx.system.script = nft_script((0, b"", b""), {0: (0, b"not json", b"")})  # type: ignore[attr-defined]
    assert nft_check(call(ctx), NftCheck()) == {"intact": False}
    assert programs(ctx).runs[-4:] == [IP_BR0, *LIST_ARGVS]


def test_a_missing_bridge_is_skipped_and_the_next_one_read(ctx: HelperContext) -> None:
    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv == IP_BR0:
            return 1, b"", b'Device "br0" does not exist.\n'
        if argv == IP_BR1:
            return 0, ip_json(("br1", [("inet", "10.0.2.1")])), b""
        return (1, b"", b"Error: stop here\n")

    ctx.system.script = script  # type: ignore[attr-defined]
    other = {**GOOD, "instance": "vm-2", "bridge": "br1", "mac": "52:54:00:00:00:02", "addresses": []}
    assert failed(nft_apply, ctx, apply_req(GOOD, {**other, "policy": "EGRESS"}))[0] == "nft"
    assert programs(ctx).runs[:2] == [IP_BR0, IP_BR1]
    ctx.nft_reference = ("0" * 64, ("br0", "br1"), HostAddresses(("10.0.2.1",), ()))
    programs(ctx).runs.clear()
    assert nft_check(call(ctx), NftCheck()) == {"intact": False}  # the listing fails
    assert programs(ctx).runs == [IP_BR0, IP_BR1, LIST_ARGVS[0]]
