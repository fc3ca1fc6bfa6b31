"""Tap names that collide, through a real helper: a process of the node's uid (hostilekit.as_node) asks
a real `bcd helper serve` running in a network namespace of its own, whose `ip` and `nft` are the real
programs there (BCD_SIM_NETNS=1), with unsigned requests.

A tap is `bc` + 11 hex digits of the instance id's SHA-256 + the NIC index (instancenames.tap_name):
44 bits, and `vm-1762438` and `vm-3742940` share every tap name. Before root checked, the second one's
`ch.taps` found the first one's live tap, kept it ("an existing tap is kept") and enslaved it to the
second one's bridge: the first instance's NIC on another network; its `ch.untaps` deleted it; and
`nft.apply` took both NICs' guards for one tap. docs/helper.md, "Tap names".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_shared.instancenames import tap_name
from helperproc import HelperProcess, base_config, make_root, require_netns
from hostilekit import as_node, refused_as_node

TWIN_A, TWIN_B = "vm-1762438", "vm-3742940"
TAP = tap_name(TWIN_A, 0)
RULE = "tap names hash the instance id into 15 characters (IFNAMSIZ)"


@pytest.fixture
def h(tmp_path: Path) -> Iterator[HelperProcess]:
    require_netns("ip", "nft")
    helper = HelperProcess(
        make_root(tmp_path), base_config(extra='instance_bridges = "br0,br1"\n'), netns=True
    )
    try:
        for br in ("br0", "br1"):
            helper.in_netns("ip", "link", "add", br, "type", "bridge")
        yield helper
    finally:
        helper.stop()


def link(h: HelperProcess, dev: str) -> dict[str, Any] | None:
    links = json.loads(h.in_netns("ip", "-j", "link", "show"))
    return next((x for x in links if x["ifname"] == dev), None)


def taps(name: str, *bridges: str) -> dict[str, Any]:
    return {"op": "ch.taps", "args": {"name": name, "bridges": list(bridges)}}


def untaps(name: str) -> dict[str, Any]:
    return {"op": "ch.untaps", "args": {"name": name}}


@pytest.mark.realhost
def test_a_second_instance_whose_tap_names_collide_never_takes_the_live_ones_tap(h: HelperProcess) -> None:
    """The ids collide for real. vm-1762438's tap is made on br0; vm-3742940's `ch.taps` on br1 is
    refused `tap-collision` naming both ids and the rule, and the tap stays on br0; its `ch.untaps`
    deletes nothing. Once vm-1762438's `ch.untaps` deleted its tap, vm-3742940 may have the names, and
    vm-1762438 is refused in turn."""
    assert tap_name(TWIN_B, 0) == TAP
    answer = as_node(h, taps(TWIN_A, "br0"))
    assert answer["ok"] and answer["result"]["created"] == [TAP], answer
    first = link(h, TAP)
    assert first is not None and first["master"] == "br0"
    refused = refused_as_node(h, taps(TWIN_B, "br1"), "tap-collision", f"are instance {TWIN_A}'s too")
    assert TWIN_B in refused["message"] and RULE in refused["message"]
    assert link(h, TAP) == first  # same interface (index), same bridge
    answer = as_node(h, untaps(TWIN_B))
    assert answer["ok"] and answer["result"]["deleted"] == [], answer
    assert link(h, TAP) == first
    # The live one goes: the names are free for the other.
    assert as_node(h, untaps(TWIN_A))["result"]["deleted"] == [TAP]
    assert link(h, TAP) is None
    answer = as_node(h, taps(TWIN_B, "br1"))
    assert answer["ok"] and answer["result"]["created"] == [TAP], answer
    assert link(h, TAP)["master"] == "br1"  # type: ignore[index]
    refused_as_node(h, taps(TWIN_A, "br0"), "tap-collision", f"are instance {TWIN_B}'s too")


@pytest.mark.realhost
def test_a_cloud_hypervisor_instance_never_takes_the_tap_names_of_a_defined_libvirt_domain(
    h: HelperProcess,
) -> None:
    """Root's staged definition of vm-1762438 (a libvirt domain root defined; libvirt makes its taps at
    start) owns the names too: vm-3742940's `ch.taps` is refused and makes no interface."""
    stage = h.root / "var/lib/bcd-hostconfig/libvirt"
    stage.mkdir(parents=True, exist_ok=True)
    (stage / f"{TWIN_A}.xml").write_bytes(b"<domain/>")
    os.chmod(stage / f"{TWIN_A}.xml", 0o600)
    refused_as_node(h, taps(TWIN_B, "br1"), "tap-collision", f"are instance {TWIN_A}'s too")
    assert link(h, TAP) is None


@pytest.mark.realhost
def test_one_network_policy_never_guards_two_instances_on_one_tap(h: HelperProcess) -> None:
    """nft.apply with a NIC of each twin: their guards would share tap `TAP` (each instance allowed the
    other's MAC and addresses), so the policy is refused naming the field, both ids and the rule."""
    a = {"instance": TWIN_A, "index": 0, "bridge": "br0", "mac": "52:54:00:00:00:01",
         "addresses": ["10.0.0.5/24"], "policy": "PRIVATE", "ssh_from_host_only": False}  # fmt: skip
    b = {**a, "instance": TWIN_B, "bridge": "br1", "mac": "52:54:00:00:00:02", "addresses": ["10.1.0.6/24"]}
    answer = refused_as_node(
        h, {"op": "nft.apply", "args": {"nics": [a, b]}}, "bad-policy", "nics[1].instance"
    )
    assert (
        f"instance {TWIN_B}'s taps" in answer["message"]
        and f"are instance {TWIN_A}'s too" in answer["message"]
    )
    assert RULE in answer["message"]
