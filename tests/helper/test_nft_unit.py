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
    assert ctx.nft_loaded == frozenset([nic()])  # what a guarded guest's start asks for
    error = b"/tmp/bcd-nft-x.nft:3:1-5: Error: Could not process rule: Operation not permitted\n"
    ctx.system.script = nft_script((1, b"", error), {})  # type: ignore[attr-defined]
    assert failed(nft_apply, ctx, apply_req(GOOD)) == (
        "nft",
        "nft -f: nft exited 1: /tmp/bcd-nft-x.nft:3:1-5: Error: Could not process rule: Operation not "
        "permitted",
    )
    assert not os.path.exists(programs(ctx).runs[-1][2])
    assert ctx.nft_reference is None
    assert ctx.nft_loaded == frozenset()  # the old rules may be half gone: no guest is taken on them
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


# --- with command-signing roots: the NICs are the signed spec's (root derives them itself) -----------------

NODE = "node-nft"
MAC_A, MAC_B, MAC_C, MAC_D, MAC_E, MAC_F = (f"52:54:00:00:00:0{c}" for c in "abcdef")
# Two instance ids whose taps are the same name (the first 11 hex digits of their sha256 agree).
SAME_TAP = ("vm-1762438", "vm-3742940")


def _inst(
    name: str,
    policy: int,
    nics: tuple[tuple[str, str, tuple[str, ...]], ...] = (),
    *,
    ssh: bool = False,
    state: int = 1,
) -> Any:
    from bcd_shared import wire

    return wire.InstanceSpec(
        id=name,
        allocation_id=f"a-{name}",
        runtime="libvirt-kvm",
        desired_state=wire.InstanceDesiredState(state),
        nics=[wire.Nic(bridge=b, mac=m, addresses=list(a)) for b, m, a in nics],
        network_policy=wire.NetworkPolicy(policy),
        ssh_from_host_only=ssh,
    )


def _signed(signer: Any, generation: int, *instances: Any, patch: bool = False, node: str = NODE) -> Any:
    from bcd_helper.ops.hostunit import SignedIntent
    from bcd_shared import wire
    from intentkit import intent

    section = wire.InstancesSection(instances=list(instances)) if instances else None
    body = wire.DesiredStateBody(node_id=node, generation=generation, spec_hash=f"h{generation}")
    if patch:
        body.patch = wire.NodeSpecPatch(instances=section)
        body.base_generation = generation - 1
    else:
        body.full = wire.NodeSpec(instances=section)
    doc = intent(signer, bytes(body))
    return SignedIntent(doc["body"], doc["signature"], tuple(doc["chain"]), None)


def _pol(name: str, index: int, mac: str, addresses: tuple[str, ...], policy: str, ssh: bool = False) -> Any:
    return NicPolicy(name, index, "br0", mac, addresses, policy, ssh)


def _state_generation(root: Path) -> int | None:
    path = root / "var/lib/bcd-hostconfig/helper-intent.json"
    return int(json.loads(path.read_text())["generation"]) if path.exists() else None


@pytest.fixture
def signed_ctx(tmp_path: Path, cp: Any) -> Iterator[HelperContext]:
    root = make_root(tmp_path)
    cp.write_record(root, NODE, cp.bundle(1))
    c = context(root, cp.config_lines() + HELPER)
    yield c
    c.audit.close()


def test_spec_policies_is_roots_own_derivation_instance_by_instance() -> None:
    """`spec_policies`: each kept instance's NICs in order with its policy and SSH rule; a DELETED instance
    left out; None (no rules) for an unset policy, a NIC the builder refuses, or an address or a MAC
    (EUI-64 link-local) an earlier instance claims; each such case leaves the instances after it
    derived."""
    from bcd_helper.ops.nft import spec_policies

    a = ("br0", MAC_A, ("10.0.0.5/24",))
    got = spec_policies(
        [
            _inst("vm-gone", 2, (a,), state=4),
            _inst("vm-a", 2, (a, ("br1", MAC_D, ("10.0.1.8/24",))), ssh=True),
            _inst("vm-unset", 0, (("br0", MAC_F, ()),)),
            _inst("vm-bad", 1, (("br0", "not-a-mac", ()),)),
            _inst("vm-same-address", 1, (("br0", MAC_E, ("10.0.0.5/24",)),)),
            _inst("vm-same-mac", 3, (("br0", MAC_A, ("10.0.0.9/24",)),)),
            _inst("vm-b", 1, (("br0", MAC_B, ("10.0.0.6/24",)),)),
            _inst("vm-c", 1, (("br0", MAC_C, ()),)),
        ]
    )
    assert list(got) == ["vm-a", "vm-unset", "vm-bad", "vm-same-address", "vm-same-mac", "vm-b", "vm-c"]
    assert got["vm-a"] == (
        _pol("vm-a", 0, MAC_A, ("10.0.0.5/24",), "PRIVATE", True),
        NicPolicy("vm-a", 1, "br1", MAC_D, ("10.0.1.8/24",), "PRIVATE", True),
    )
    for name in ("vm-unset", "vm-bad", "vm-same-address", "vm-same-mac"):
        assert got[name] is None, name
    # another address of the same prefix length is not a claimed one
    assert got["vm-b"] == (_pol("vm-b", 0, MAC_B, ("10.0.0.6/24",), "EGRESS"),)
    assert got["vm-c"] == (_pol("vm-c", 0, MAC_C, (), "EGRESS"),)


@pytest.mark.parametrize(
    ("policy", "ssh", "addresses", "needed"),
    [
        (1, False, (), False),  # EGRESS, no SSH rule, no addresses: nothing to guard
        (1, True, (), True),
        (2, False, ("10.0.0.5/24",), True),  # PRIVATE and NONE need addresses: always guarded
        (3, False, ("10.0.0.5/24",), True),
        (1, False, ("10.0.0.5/24",), True),  # anti-spoofing of a NIC with a MAC and addresses
    ],
)
def test_a_guest_needs_its_rules_loaded_only_when_the_spec_guards_it(
    signed_ctx: HelperContext, policy: int, ssh: bool, addresses: tuple[str, ...], needed: bool
) -> None:
    """`require_loaded` (libvirt.start, libvirt.restore, ch.launch): nothing loaded, an instance the spec
    guards is refused `network-policy`; an EGRESS instance without SSH rule or addresses starts."""
    from bcd_helper.ops.nft import require_loaded

    inst = _inst("vm-a", policy, (("br0", MAC_A, addresses),), ssh=ssh)
    if needed:
        with pytest.raises(Refused) as info:
            require_loaded(call(signed_ctx), "ch.launch", inst)
        assert (info.value.reason, info.value.message) == (
            "network-policy",
            "ch.launch: vm-a: the signed spec's network rules for it are not loaded: nft.apply first",
        )
    else:
        require_loaded(call(signed_ctx), "ch.launch", inst)


def _refused_apply(ctx: HelperContext, req: NftApply) -> tuple[str, str]:
    with pytest.raises(Refused) as info:
        nft_apply(call(ctx), req)
    return info.value.reason, info.value.message


def test_with_roots_nft_apply_loads_exactly_the_signed_specs_nic_policies(
    signed_ctx: HelperContext, netns: str, cp: Any
) -> None:
    """With roots, nft.apply needs the signed spec, and the request's NICs must be root's derivation for
    every instance the spec keeps (in any order of NICs), none for one whose policy cannot be expressed;
    an instance the spec does not keep is taken as sent unless its tap is a spec instance's. A refusal runs
    nothing and keeps root's state; an accepted load saves the spec's generation and what it loaded."""
    signer = cp.command.leaf()
    root = signed_ctx.root
    flush(netns)
    signed_ctx.system.script = in_netns(netns)  # type: ignore[attr-defined]
    a0 = _pol("vm-a", 0, MAC_A, ("10.0.0.5/24",), "PRIVATE", True)
    a1 = _pol("vm-a", 1, MAC_C, ("10.0.0.8/24",), "PRIVATE", True)
    b0 = _pol("vm-b", 0, MAC_B, (), "EGRESS")
    spec = (
        _inst("vm-a", 2, (("br0", MAC_A, ("10.0.0.5/24",)), ("br0", MAC_C, ("10.0.0.8/24",))), ssh=True),
        _inst("vm-b", 1, (("br0", MAC_B, ()),)),
        _inst("vm-unset", 0, (("br0", "52:54:00:00:00:0d", ()),)),
        _inst("vm-gone", 2, (("br0", "52:54:00:00:00:0e", ()),), state=4),
        _inst(SAME_TAP[0], 1, (("br0", MAC_F, ()),)),
    )
    s0 = _pol(SAME_TAP[0], 0, MAC_F, (), "EGRESS")
    assert _refused_apply(signed_ctx, NftApply((a0, a1, b0))) == (
        "intent-required",
        "nft.apply: a signed spec is required (command-signing roots from join record)",
    )
    mismatch = (
        "nft.apply: instance {}: the NIC policies differ from the signed spec's (generation 2; its policy {})"
    )
    missing = "differ or are missing"
    cases = [
        ((a0, b0), "vm-a", missing),  # a NIC left out
        ((a0, a1), "vm-b", missing),  # an instance left out
        ((a0, a1, b0, _pol("vm-b", 1, MAC_C, (), "EGRESS")), "vm-b", missing),  # one more NIC
        ((attrs_evolve(a0, policy="NONE"), a1, b0), "vm-a", missing),
        ((attrs_evolve(a0, ssh_from_host_only=False), a1, b0), "vm-a", missing),
        ((attrs_evolve(a0, addresses=("10.0.0.7/24",)), a1, b0), "vm-a", missing),
        ((a0, a1, attrs_evolve(b0, ssh_from_host_only=True)), "vm-b", missing),
        (
            (a0, a1, b0, _pol("vm-unset", 0, "52:54:00:00:00:0d", (), "EGRESS")),
            "vm-unset",
            "cannot be expressed: it gets no rules",
        ),
    ]
    for nics, inst, what in cases:
        assert _refused_apply(signed_ctx, NftApply((*nics, s0), _signed(signer, 2, *spec))) == (
            "spec-mismatch",
            mismatch.format(inst, what),
        ), nics
    stolen = _pol(SAME_TAP[1], 0, "52:54:00:00:00:0f", (), "EGRESS")
    assert stolen.tap == s0.tap
    # A tap another instance's NIC has is refused before the spec is read (the tap-name rule, bad-policy).
    twins = NftApply((a0, a1, b0, s0, stolen), _signed(signer, 2, *spec))
    reason, message = _refused_apply(signed_ctx, twins)
    assert reason == "bad-policy" and SAME_TAP[1] in message and SAME_TAP[0] in message, message
    assert programs(signed_ctx).runs == [] and _state_generation(root) is None
    assert signed_ctx.nft_loaded == frozenset()
    # Accepted: the NICs in another order, and a deleted instance's guard taken as sent.
    gone = _pol("vm-gone", 0, "52:54:00:00:00:0e", ("10.0.0.9/24",), "PRIVATE")
    got = nft_apply(
        call(signed_ctx, bounded=False), NftApply((b0, a1, gone, s0, a0), _signed(signer, 2, *spec))
    )
    assert got["nics"] == 5 and _state_generation(root) == 2
    assert signed_ctx.nft_loaded == frozenset((a0, a1, b0, gone, s0))
    # A patch's instances section is the spec's too; an older generation is refused.
    patch = _signed(signer, 3, _inst("vm-b", 1, (("br0", MAC_B, ()),)), patch=True)
    assert _refused_apply(signed_ctx, NftApply((a0,), patch)) == (
        "spec-mismatch",
        mismatch.format("vm-b", missing).replace("generation 2", "generation 3"),
    )
    nft_apply(call(signed_ctx, bounded=False), NftApply((b0,), patch))
    assert _state_generation(root) == 3 and signed_ctx.nft_loaded == frozenset((b0,))
    assert (
        _refused_apply(signed_ctx, NftApply((a0, a1, b0), _signed(signer, 2, *spec)))[0] == "stale-generation"
    )
    # A spec without an instances section keeps no instance: the NICs are taken as sent.
    nft_apply(call(signed_ctx, bounded=False), NftApply((gone,), _signed(signer, 4)))
    assert _state_generation(root) == 4 and signed_ctx.nft_loaded == frozenset((gone,))
    flush(netns)


def test_a_presented_spec_is_checked_without_roots(tmp_path: Path, netns: str) -> None:
    """With nothing naming roots, a spec the node presents still turns the check on (no_roots_possible):
    one that is not even base64 is refused before anything runs; without one the NICs load as sent."""
    from bcd_helper.ops.hostunit import SignedIntent

    c = context(make_root(tmp_path), HELPER)
    try:
        bad = SignedIntent("body", "sig", ("not base64!",), None)
        assert _refused_apply(c, NftApply((nic(),), bad)) == (
            "bad-intent",
            "nft.apply: intent.chain[0] is not base64",
        )
        assert programs(c).runs == []
        flush(netns)
        c.system.script = in_netns(netns)  # type: ignore[attr-defined]
        assert nft_apply(call(c, bounded=False), NftApply((nic(),)))["nics"] == 1
        flush(netns)
    finally:
        c.audit.close()


def attrs_evolve(p: NicPolicy, **changes: Any) -> NicPolicy:
    import attrs

    return attrs.evolve(p, **changes)
