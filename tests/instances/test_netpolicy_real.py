"""The instances' nftables rules with real packets (real nft, in a network namespace the test makes).

netns_frames.py runs under `unshare -n` (a private namespace that vanishes with the process): a bridge
br0 with the host's 10.0.0.1/24 and fd00::1/64, taps for instance a (PRIVATE, 10.0.0.10/24 and
fd00::10/64, ssh_from_host_only), b (NONE, 10.0.0.11/24) and c (EGRESS, no MAC or addresses: unguarded),
a `bc*` tap off any bridge, and the rules loaded by the node's own DirectNft. Each frame is written
through /dev/net/tun as the guest would send it, carrying its own payload; delivered means that payload
was read on the receiving tap (or the host's UDP socket), dropped means the named rule's counter moved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from testsupport import require_root, require_tool

HERE = Path(__file__).resolve().parent
A, B, E = "bcca978112ca10", "bc3e23e8160030", "bc3f79bb7b4350"  # tap_name("a"|"b"|"e", 0)


@pytest.fixture(scope="module")
def frames() -> dict[str, Any]:
    require_tool("nft")
    require_tool("unshare")
    require_root("unshare -n, /dev/net/tun")
    proc = subprocess.run(
        ["unshare", "-n", sys.executable, str(HERE / "netns_frames.py")],
        capture_output=True,
        timeout=180,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def _dropped_by(frames: dict[str, Any], case: str, comment: str) -> None:
    c = frames["cases"][case]
    assert not c["delivered"], (case, c)
    assert c["moved"].get(comment, 0) >= 1, (case, c)


def _delivered(frames: dict[str, Any], case: str) -> None:
    c = frames["cases"][case]
    assert c["delivered"], (case, c)


def test_tap_names_match_the_runtime() -> None:
    from bcd_shared.instancenames import tap_name

    assert (tap_name("a", 0), tap_name("b", 0), tap_name("e", 0)) == (A, B, E)


def test_the_guard_passes_the_nics_own_frames_dlv_nft_13_14_15(frames: dict[str, Any]) -> None:
    """DLV-NFT-13, DLV-NFT-14, DLV-NFT-15: a guarded tap passes only its MAC, its own IPv4 and EUI-64
    link-local sources and ARP for its own IPv4 address; each spoof is dropped by its guard rule."""
    for case in ("a_ok", "a_ll_ok", "a_arp_ok"):
        _delivered(frames, case)
    _dropped_by(frames, "a_mac", "mac")
    _dropped_by(frames, "a_ip4", "ip4")
    _dropped_by(frames, "a_ll_bad", "ip6")
    _dropped_by(frames, "a_arp_bad", "arp")
    _dropped_by(frames, "a_vlan", "ethertype")
    _dropped_by(frames, "a_na_other", "na")


def test_guarded_addresses_are_bound_to_their_tap_dlv_nft_16(frames: dict[str, Any]) -> None:
    """DLV-NFT-16: another port may neither send from a guarded address nor claim it (ARP, NA)."""
    _dropped_by(frames, "c_bound", "bound4")
    _dropped_by(frames, "a_arp_claim", "bound-arp")
    _dropped_by(frames, "c_na_bound", "bound-na")


def test_dhcp_server_replies_ras_and_redirects_dropped_dlv_nft_08_09_10(frames: dict[str, Any]) -> None:
    """DLV-NFT-08, DLV-NFT-09, DLV-NFT-10."""
    _dropped_by(frames, "a_dhcp", "dhcp-server")
    _dropped_by(frames, "a_dhcp6", "dhcp-server6")
    _dropped_by(frames, "a_ra", "ra")
    _dropped_by(frames, "a_redirect6", "redirect6")
    _dropped_by(frames, "a_redirect", "redirect")


def test_host_addresses_protected_dlv_nft_11_12(frames: dict[str, Any]) -> None:
    """DLV-NFT-11, DLV-NFT-12: an unguarded tap cannot send from, or advertise, the host's address."""
    _dropped_by(frames, "c_host", "host4")
    _dropped_by(frames, "c_na_host", "host-na")


def test_private_keeps_to_its_subnet_and_the_host_dlv_nft_02(frames: dict[str, Any]) -> None:
    """DLV-NFT-02."""
    _delivered(frames, "a_ok")
    _delivered(frames, "a_host")
    _dropped_by(frames, "a_private", "private4")


def test_none_reaches_the_host_only_dlv_nft_03(frames: dict[str, Any]) -> None:
    """DLV-NFT-03: nothing forwarded to or from b's tap; the host still answers."""
    _delivered(frames, "b_host")
    _dropped_by(frames, "b_none", "none-fwd")
    assert frames["cases"]["a_ok"]["moved"].get("none-fwd-in") == 1  # the flood did not reach b


def test_ssh_from_another_port_dropped_dlv_nft_29(frames: dict[str, Any]) -> None:
    """DLV-NFT-28, DLV-NFT-29: tcp/22 forwarded into a's tap is dropped; tcp/80 is not."""
    _dropped_by(frames, "c_ssh", "ssh-fwd")
    _delivered(frames, "c_http")


def test_backstops_see_only_taps_off_their_bridge_dlv_nft_19_21(frames: dict[str, Any]) -> None:
    """DLV-NFT-19, DLV-NFT-21: the inet backstop drops a `bc*` tap off its bridge; a bridged tap reaches
    the host as the bridge, untouched by it."""
    off = frames["cases"]["off_bridge"]
    assert not off["delivered"] and off["moved"].get("inet-input") == 1, off
    assert frames["cases"]["a_host"]["moved"].get("inet-input", 0) == 0


def test_flushed_set_and_deleted_rule_restored_dlv_nft_23_24_25(frames: dict[str, Any]) -> None:
    """DLV-NFT-23, DLV-NFT-24, DLV-NFT-25: `nft flush set` (every rule still there), a deleted rule and a
    deleted table are each seen by the next check, which loads the rules again: the check after it
    finds them intact, the address guard's elements back."""
    ch = frames["checks"]
    assert ch["intact"] is True
    for what in ("flush_set", "delete_rule", "delete_table"):
        assert ch[f"after_{what}"] is False and ch[f"restored_{what}"] is True, (what, ch)
    assert {tuple(e["concat"]) for e in ch["bind4_after"]} == {
        (A, "10.0.0.10"),
        (B, "10.0.0.11"),
        (E, "10.0.0.14"),
    }


def test_failed_reload_ends_trust_and_the_pass_retries_dlv_nft_26(frames: dict[str, Any]) -> None:
    """DLV-NFT-18, DLV-NFT-24, DLV-NFT-26: while the reload fails no address is trusted; the next pass
    loads the rules again and trust returns."""
    ch = frames["checks"]
    assert frames["trusted"] is True and frames["bound"]["10.0.0.10"] == "a"
    assert "10.0.0.12" not in frames["bound"]  # c is unguarded: its addresses are never trusted
    assert ch["failed_reload"] is False and ch["trusted_after_failed_reload"] is False
    assert ch["bound_after_failed_reload"] == {} and ch["needs_reload"] is True
    assert ch["trusted_after_pass"] is True and ch["intact_after_pass"] is True


def test_egress_adds_no_policy_rule_dlv_nft_04(frames: dict[str, Any]) -> None:
    """DLV-NFT-04: a guarded EGRESS NIC reaches an address outside its subnet, which PRIVATE forbids
    (a_private); no rule's counter moved."""
    e = frames["cases"]["e_egress"]
    assert e["delivered"] and e["moved"] == {}, e


def test_arp_backstop_dlv_nft_20(frames: dict[str, Any]) -> None:
    """DLV-NFT-20: ARP from a `bc*` tap off its bridge is dropped on the arp table's input hook."""
    c = frames["cases"]["off_bridge_arp"]
    assert c["moved"].get("arp-input") == 1, c


def test_host_ssh_only_from_its_own_address_dlv_nft_30(frames: dict[str, Any]) -> None:
    """DLV-NFT-30: tcp/22 the host sends into the tap passes from the host's address on the bridge and is
    dropped from any other source."""
    own, other = frames["cases"]["host_ssh_own"], frames["cases"]["host_ssh_other"]
    assert own["delivered"] and "ssh4" not in own["moved"], own
    assert not other["delivered"] and other["moved"].get("ssh4") == 1, other


def test_a_new_host_address_reloads_the_rules_dlv_nft_30(frames: dict[str, Any]) -> None:
    """DLV-NFT-11, DLV-NFT-30: the host's addresses are read again by the check; one added to the bridge
    makes it load the rules again, with the address in the host set."""
    ch = frames["checks"]
    assert ch["after_host_address"] is False and ch["restored_host_address"] is True
    assert set(ch["host4_after"]) == {"10.0.0.1", "10.0.0.2"}
