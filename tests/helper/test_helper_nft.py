"""The helper's nft.apply / nft.check (DLV-PRIV-08) against a real helper process.

Refusals are properties on a simulated root (nothing runs: a policy outside the rules is refused,
audited and the tree unchanged; 1,000 examples per property under CI). The accepted path runs the
helper under `unshare -n` with BCD_SIM_NETNS=1, so its `nft` and `ip` are the real programs in a private
network namespace (bcd_simhost.netns): root builds the rules from the typed policy, byte for byte what
the node's builder makes, loads them, and its check sees a flushed set.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from bcd_agent.sections.instances.network import HelperNft, NetworkPolicy
from bcd_shared.netpolicy import NicPolicy, build_ruleset, parse_ip_addr
from helperproc import HELPER_SETTINGS, HelperProcess, assert_refused, base_config, make_root, require_netns
from hypothesis import given
from hypothesis import strategies as st
from opskit import GOOD_NIC as GOOD

CONFIG = base_config(extra='instance_bridges = "br0,br1"\n')


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelperProcess]:
    h = HelperProcess(make_root(tmp_path_factory.mktemp("nft")), CONFIG)
    yield h
    h.stop()


# Each strategy breaks exactly one rule of one NIC.
bad_field = st.one_of(
    st.tuples(st.just("instance"), st.sampled_from(["", "..", "a/b", "-x", "x" * 65, "a b", "é", "a..b"])),
    st.tuples(st.just("index"), st.one_of(st.integers(max_value=-1), st.integers(min_value=16))),
    st.tuples(
        st.just("bridge"), st.sampled_from(["br2", "bcbr", "bc0", "", "x" * 16, "br0 ", "br/0", "eth0"])
    ),
    st.tuples(
        st.just("mac"),
        st.sampled_from(
            [
                "01:00:5e:00:00:01",
                "ff:ff:ff:ff:ff:ff",
                "00:00:00:00:00:00",
                "52:54:00:00:00",
                "52-54-00-00-00-01",
                "52:54:00:00:00:0G",
                "52:54:00:00:00:0A",
                "53:54:00:00:00:01",
            ]
        ),
    ),
    st.tuples(
        st.just("addresses"),
        st.sampled_from(
            [
                ["10.0.0.5"],
                ["10.0.0.255/24"],
                ["224.0.0.1/4"],
                ["127.0.0.1/8"],
                ["fe80::1/64"],
                ["0.0.0.0/0"],
                ["::/0"],
                ["10.0.0.5/33"],
                ["nonsense"],
                ["10.0.0.5/24"] * 65,
                [],
            ]
        ),
    ),
    st.tuples(st.just("policy"), st.sampled_from(["", "egress", "ALLOW", "UNSPECIFIED", "NONE "])),
)


def _apply(nics: list[dict[str, Any]]) -> dict[str, Any]:
    return {"op": "nft.apply", "args": {"nics": nics}}


@HELPER_SETTINGS
@given(bad_field, st.integers(min_value=0, max_value=2))
def test_any_broken_nic_is_refused_dlv_priv_08(
    helper: HelperProcess, bad: tuple[str, Any], where: int
) -> None:
    """DLV-PRIV-08, DLV-NFT-05, DLV-NFT-22: one broken field of any NIC (an id, an index, a bridge outside
    `[helper] instance_bridges` or named bc*, a multicast or malformed MAC, an address that is not a
    unicast CIDR, an unknown policy, a PRIVATE NIC without addresses) refuses the whole request; audited,
    tree unchanged, nothing run."""
    field, value = bad
    nics = [
        {**GOOD, "instance": f"vm-{i}", "mac": f"52:54:00:00:01:{i:02x}", "addresses": [f"10.0.{i}.5/24"]}
        for i in range(3)
    ]
    nics[where] = {**nics[where], field: value}
    answer = assert_refused(helper, _apply(nics))
    assert answer["reason"] in ("bad-policy", "bad-arguments"), answer


@HELPER_SETTINGS
@given(
    st.sampled_from(["nft", "table bridge x { }", "flush ruleset"]),
    st.sampled_from(["text", "ruleset", "rules", "script"]),
)
def test_nft_text_is_never_accepted_dlv_priv_08(helper: HelperProcess, text: str, key: str) -> None:
    """DLV-PRIV-08: root takes no nft text, in any field: unknown fields refuse the request."""
    assert_refused(helper, {"op": "nft.apply", "args": {key: text}}, "bad-arguments")
    assert_refused(helper, {"op": "nft.apply", "args": {"nics": [{**GOOD, key: text}]}}, "bad-arguments")


def test_an_address_two_nics_claim_is_refused_dlv_nft_18(helper: HelperProcess) -> None:
    """DLV-NFT-18: two NICs claiming one address (or one NIC listed twice) are refused."""
    other = {**GOOD, "instance": "vm-2", "mac": "52:54:00:00:00:02"}
    assert "claimed by" in assert_refused(helper, _apply([GOOD, other]), "bad-policy")["message"]
    assert "listed twice" in assert_refused(helper, _apply([GOOD, GOOD]), "bad-policy")["message"]


def test_check_without_a_load_is_not_intact(helper: HelperProcess) -> None:
    assert helper.client.call("nft.check", {}) == {"intact": False}


# --- the accepted path: real nft in the helper's own network namespace -----------------------------


@pytest.fixture(scope="module")
def netns_helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelperProcess]:
    require_netns("nft")
    h = HelperProcess(make_root(tmp_path_factory.mktemp("nftns")), CONFIG, netns=True)
    h.in_netns("ip", "link", "add", "br0", "type", "bridge")
    h.in_netns("ip", "addr", "add", "10.0.0.1/24", "dev", "br0")
    h.in_netns("ip", "link", "set", "br0", "up")
    yield h
    h.stop()


def test_root_builds_the_same_bytes_and_checks_them_dlv_priv_08(netns_helper: HelperProcess) -> None:
    """DLV-PRIV-08: under the helper, root loads the rules it built from the typed policy (the same bytes
    the node's builder makes for the same NICs and host addresses) and its check, reached through the
    node's HelperNft, sees `nft flush set` and loads them again."""
    h = netns_helper
    answer = h.client.call("nft.apply", {"nics": [GOOD]})
    nic = NicPolicy(**{**GOOD, "addresses": tuple(GOOD["addresses"])})
    host = parse_ip_addr(h.in_netns("ip", "-j", "addr", "show"), ["br0"])
    assert "10.0.0.1" in host.v4
    text = build_ruleset([nic], host)
    assert answer == {"sha256": hashlib.sha256(text.encode()).hexdigest(), "nics": 1}
    listed = json.loads(h.in_netns("nft", "-j", "list", "set", "bridge", "bcd_instances", "bind4"))
    assert listed["nftables"][1]["set"]["elem"] == [{"concat": [nic.tap, "10.0.0.5"]}]
    policy = NetworkPolicy(HelperNft(h.client))
    policy.apply({"vm-1": (nic,)})
    assert policy.trusted and policy.integrity_check() is True
    h.in_netns("nft", "flush", "set", "bridge", "bcd_instances", "bind4")
    assert h.client.call("nft.check", {}) == {"intact": False}
    assert policy.integrity_check() is False  # seen, and loaded again through nft.apply
    assert policy.integrity_check() is True
    listed = json.loads(h.in_netns("nft", "-j", "list", "set", "bridge", "bcd_instances", "bind4"))
    assert listed["nftables"][1]["set"]["elem"] == [{"concat": [nic.tap, "10.0.0.5"]}]
    h.in_netns("ip", "addr", "add", "10.0.0.2/24", "dev", "br0")  # root reads the host's addresses again
    assert h.client.call("nft.check", {}) == {"intact": False}
    assert policy.integrity_check() is False and policy.integrity_check() is True
    ops = [e["op"] for e in h.audit_lines() if e["decision"] == "accepted"]
    assert ops.count("nft.apply") == 4 and "nft.check" in ops
