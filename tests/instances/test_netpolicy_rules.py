"""The rule builder's own rules (bcd_shared.netpolicy), without nft: what the text says, and the checks."""

from __future__ import annotations

import ipaddress

import attrs
import pytest
from bcd_shared.netpolicy import (
    HostAddresses,
    NicMemo,
    NicPolicy,
    PolicyError,
    build_ruleset,
    check_nics,
    eui64_link_local,
    parse_cidr,
)
from hypothesis import given
from hypothesis import strategies as st

A = NicPolicy("a", 0, "br0", "52:54:00:00:00:0a", ("10.0.0.10/24", "fd00::10/64"), "PRIVATE", True)
B = NicPolicy("b", 1, "br1", "52:54:00:00:00:0b", ("10.1.0.11/24",), "NONE", True)


def _chain(text: str, name: str) -> list[str]:
    body = text.split(f"chain {name} {{", 1)[1].split("}", 1)[0]
    return [
        line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith("type ")
    ]


def test_tcp22_sits_ahead_of_every_accept_dlv_nft_32() -> None:
    """DLV-NFT-32: in the forward and output chains the tcp/22 drops come first, and no chain after the
    prerouting guard accepts anything (the base chains' policy is accept, judged after every rule)."""
    text = build_ruleset([A, B], HostAddresses(("10.0.0.1",), ("fd00::1",)))
    assert _chain(text, "tap_fwd")[0].startswith("oifname @ssh tcp dport 22 ")
    assert [r.split(" counter")[0] for r in _chain(text, "tap_out")[:2]] == [
        "oifname @ssh ether type ip tcp dport 22 ip saddr != @host4",
        "oifname @ssh ether type ip6 tcp dport 22 ip6 saddr != @host6",
    ]
    for chain in ("tap_fwd", "tap_in", "tap_out"):
        assert not any(r.endswith("accept") for r in _chain(text, chain)), chain


def test_a_family_without_host_address_drops_tcp22_outright_dlv_nft_31() -> None:
    """DLV-NFT-31: with no host IPv6 address on the bridges, tcp/22 over IPv6 into the tap is dropped
    whatever its source; IPv4 keeps the host's exception."""
    text = build_ruleset([A], HostAddresses(("10.0.0.1",), ()))
    out = [r.split(" counter")[0] for r in _chain(text, "tap_out")]
    assert "oifname @ssh ether type ip6 tcp dport 22" in out
    assert "oifname @ssh ether type ip tcp dport 22 ip saddr != @host4" in out


def test_same_input_same_bytes_whatever_the_order_dlv_priv_08() -> None:
    """DLV-PRIV-08: the node and the helper build the same bytes for the same NICs (order-independent)."""
    host = HostAddresses(("10.0.0.1",), ())
    assert build_ruleset([A, B], host) == build_ruleset([B, A], host)
    assert build_ruleset([A], host) != build_ruleset([A, B], host)


def test_eui64_link_local() -> None:
    assert eui64_link_local("52:54:00:12:34:56") == "fe80::5054:ff:fe12:3456"


@given(st.ip_addresses(), st.integers(min_value=0, max_value=128))
def test_parse_cidr_agrees_with_ipaddress(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, prefix: int
) -> None:
    """bcd's inet_pton parser gives ipaddress's address and network, and refuses what it refuses."""
    text = f"{ip}/{prefix}"
    try:
        iface = ipaddress.ip_interface(text)
    except ValueError:
        with pytest.raises(ValueError):
            parse_cidr(text)
        return
    fam, addr, net, _raw = parse_cidr(text)
    assert (fam, ipaddress.ip_address(addr), ipaddress.ip_network(net)) == (
        iface.version,
        iface.ip,
        iface.network,
    )


@pytest.mark.parametrize(
    ("nic", "rule"),
    [
        (NicPolicy("a", 0, "bcbr0", "52:54:00:00:00:01", ("10.0.0.5/24",)), "starts with 'bc'"),
        (NicPolicy("a", 0, "br0", "", (), "PRIVATE"), "needs a MAC and IPAM addresses"),
        (NicPolicy("a", 0, "br0", "52:54:00:00:00:01", (), "NONE"), "needs a MAC and IPAM addresses"),
        (NicPolicy("a", 0, "br0", "01:00:5e:00:00:01", ("10.0.0.5/24",)), "not a unicast address"),
        (NicPolicy("a", 0, "br0", "52:54:00:00:00:01", ("10.0.0.255/24",)), "broadcast"),
        (NicPolicy("a", 0, "br0", "52:54:00:00:00:01", ("fe80::1/64",)), "not a unicast address"),
        (NicPolicy("a", 16, "br0"), "NIC index"),
    ],
)
def test_policies_that_cannot_be_expressed_dlv_nft_05_22(nic: NicPolicy, rule: str) -> None:
    """DLV-NFT-05, DLV-NFT-22."""
    with pytest.raises(PolicyError, match=rule):
        check_nics([nic])


def _outcome(nics: list[NicPolicy], bridges: frozenset[str] | None, memo: NicMemo | None) -> str:
    try:
        return build_ruleset(nics, HostAddresses(("10.0.0.1",), ("fd00::1",)), bridges, memo)
    except PolicyError as exc:
        return f"refused: {exc}"


_POOL = [
    A,
    B,
    NicPolicy("c", 0, "br0", "52:54:00:00:00:0c", ("10.0.0.10/24",), "EGRESS"),  # A's address
    NicPolicy("d", 0, "br1", "52:54:00:00:00:0a", ("10.1.0.20/24",), "PRIVATE"),  # A's link-local
    NicPolicy("a", 0, "br1", "52:54:00:00:00:0e", ("10.1.0.30/24",), "NONE"),  # A's NIC again
    NicPolicy("e", 2, "br0", "", (), "EGRESS"),
    NicPolicy("f", 0, "bcx", "52:54:00:00:00:0f", ("10.0.0.40/24",)),
]


@given(
    st.lists(
        st.tuples(
            st.lists(st.sampled_from(_POOL), max_size=4),
            st.sampled_from([None, frozenset({"br0"}), frozenset({"br0", "br1"})]),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_a_reload_through_the_memo_gives_what_a_fresh_build_gives(
    loads: list[tuple[list[NicPolicy], frozenset[str] | None]],
) -> None:
    """DLV-PRIV-08 (one builder, the same bytes): a loader keeps the last load's NICs checked (NicMemo).
    Whatever came before, each load through the memo gives the text, or the refusal, of a build without
    it: a NIC known from the last load is still refused for a bridge not allowed now, a NIC listed
    twice, or an address (or link-local) another NIC of this load claims."""
    memo = NicMemo()
    for nics, bridges in loads:
        assert _outcome(nics, bridges, memo) == _outcome(nics, bridges, None)


def test_the_memo_keeps_the_cross_nic_checks() -> None:
    memo = NicMemo()
    build_ruleset([A], HostAddresses(), None, memo)
    assert A in memo.last
    with pytest.raises(PolicyError, match="is claimed by nics"):
        build_ruleset([A, _POOL[2]], HostAddresses(), None, memo)
    with pytest.raises(PolicyError, match="not one of the instance bridges"):
        build_ruleset([A], HostAddresses(), frozenset({"br1"}), memo)
    assert set(memo.last) == {A}  # a refused load leaves the memo as it was
    build_ruleset([B], HostAddresses(), None, memo)
    assert set(memo.last) == {B}  # only the last load's NICs are kept
    # An index True equals (and hashes as) index 1: it is checked, not taken from the memo.
    with pytest.raises(PolicyError, match="is not a NIC index"):
        build_ruleset([attrs.evolve(B, index=True)], HostAddresses(), None, memo)


def test_two_instances_whose_taps_collide_are_never_guarded_on_one_tap() -> None:
    """`vm-1762438` and `vm-3742940` share every tap name: NICs of both (any index pair that gives one
    tap) are refused naming the later NIC's field, both ids, the earlier NIC and the rule; the same
    instance's NICs, and the twins on different tap indexes, are not."""
    from bcd_shared.instancenames import tap_stem

    one = NicPolicy("vm-1762438", 0, "br0", "52:54:00:00:00:01", ("10.0.0.5/24",))
    twin = NicPolicy("vm-3742940", 0, "br1", "52:54:00:00:00:02", ("10.1.0.6/24",))
    with pytest.raises(PolicyError) as exc:
        check_nics([A, one, twin])
    assert str(exc.value) == (
        f"nics[2].instance: instance vm-3742940's taps ({tap_stem('vm-3742940')}<NIC>) are instance "
        "vm-1762438's too: tap names hash the instance id into 15 characters (IFNAMSIZ), and no two live "
        "instances may share one (rename one of them) (nics[1])"
    )
    check_nics([one, NicPolicy("vm-1762438", 1, "br0", "52:54:00:00:00:03", ("10.0.0.7/24",))])
    check_nics([one, NicPolicy("vm-3742940", 1, "br1", "52:54:00:00:00:02", ("10.1.0.6/24",))])


def test_tap_names_are_the_stem_and_the_index_of_at_most_16_nics() -> None:
    """instancenames.tap_name: `bc` + 11 hex digits of the id's SHA-256 (tap_stem) + the NIC index in
    hex, 14 characters; an index outside 0..15 is refused naming it."""
    from bcd_shared.instancenames import tap_name, tap_stem

    assert tap_stem("vm1") == "bc7b11e3d1b4e" and tap_name("vm1", 15) == "bc7b11e3d1b4ef"
    for bad in (16, -1):
        with pytest.raises(ValueError, match=rf"^NIC index {bad} out of range \(at most 16 NICs\)$"):
            tap_name("vm1", bad)
