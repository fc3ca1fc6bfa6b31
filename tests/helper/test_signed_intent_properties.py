"""Properties of host.unit's signed-intent checks against a real helper process on a real socket.

For generated signed-intent variations outside the rules (wrong node, older generation, other settings,
a unit the body does not name, a clean of a unit the body names, unknown root, expired worker certificate
on a new body, a replayed older trust bundle, a bundle from another key, a rootless bundle, a flipped
signature bit, a node certificate, another purpose, no signed spec at all), the request is refused for
that reason, audited (one refused line), and the tree under the simulated root is byte-for-byte
unchanged; inside the rules (this node, a generation not older, exactly the body's settings) it is
applied. Example counts come from the hypothesis profile (helperproc: helper-ci runs 1000 per property).
Covers HST-SIGN-01, -06, -08, -14..-16, -18..-20, -24..-26, -28, -29, -31.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_shared.pki import KeyPair, Purpose, Role
from helperproc import HELPER_SETTINGS, HelperProcess, assert_refused, base_config, make_root
from hypothesis import given
from hypothesis import strategies as st
from intentkit import ControlPlane, Signer, host_body, host_unit_doc, intent, intent_state, now, settings

NODE = "node-a"


class World:
    def __init__(self, helper: HelperProcess, cp: ControlPlane, *, pinned: bool) -> None:
        self.helper = helper
        self.cp = cp
        self.pinned = pinned
        self.worker = cp.command.leaf()
        self.expired = cp.command.leaf(
            not_before=now() - dt.timedelta(hours=2), not_after=now() - dt.timedelta(hours=1)
        )
        self.stranger = cp.other.leaf()
        self.node_cert = cp.command.leaf(Role.NODE, NODE)
        self.old_bundle = cp.bundle(1)
        self.bundle = cp.bundle(2)
        self.forged = cp.bundle(7, key=KeyPair.generate())
        self.rootless = cp.bundle(8, roots=())

    def sign(self, signer: Signer, body: bytes, **kw: Any) -> dict[str, Any]:
        if self.pinned and "with_root" not in kw:
            kw["with_root"] = self.cp.command.root if signer is not self.stranger else self.cp.other.root
        return intent(signer, body, **kw)


def _world(root: Path, *, pinned: bool) -> Iterator[World]:
    cp = ControlPlane.build()
    if not pinned:
        cp.write_record(root, NODE, cp.bundle(2))
    h = HelperProcess(root, cp.config_lines(pin_roots=pinned) + base_config())
    try:
        world = World(h, cp, pinned=pinned)
        first = host_body(NODE, 10, {"sysctl": settings(**{"vm.swappiness": 10})})
        answer = h.raw(
            host_unit_doc("sysctl", settings(**{"vm.swappiness": 10}), world.sign(world.worker, first))
        )
        assert answer["ok"] is True, answer
        yield world
    finally:
        h.stop()


@pytest.fixture(scope="module")
def record_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    yield from _world(make_root(tmp_path_factory.mktemp("intent-record")), pinned=False)


@pytest.fixture(scope="module")
def pinned_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    yield from _world(make_root(tmp_path_factory.mktemp("intent-pinned")), pinned=True)


OUTSIDE = (
    "wrong-node",
    "older-generation",
    "other-settings",
    "unit-not-named",
    "clean-of-named-unit",
    "unknown-root",
    "expired-new-body",
    "older-bundle",
    "forged-bundle",
    "rootless-bundle",
    "flipped-signature",
    "node-certificate",
    "other-purpose",
    "unsigned",
)
# The reason each variation is refused with, by mode (pinned roots ignore the bundles the node presents).
REASONS = {
    "wrong-node": "wrong-node",
    "older-generation": "stale-generation",
    "other-settings": "settings-mismatch",
    "unit-not-named": "settings-mismatch",
    "clean-of-named-unit": "clean-refused",
    "unknown-root": "bad-intent",
    "expired-new-body": "bad-intent",
    "older-bundle": "stale-bundle",
    "forged-bundle": "untrusted-bundle",
    "rootless-bundle": "rootless-bundle",
    "flipped-signature": "bad-intent",
    "node-certificate": "bad-intent",
    "other-purpose": "bad-intent",
    "unsigned": "intent-required",
}
PINNED_OUTSIDE = tuple(v for v in OUTSIDE if v not in ("older-bundle", "forged-bundle", "rootless-bundle"))

node_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=24).filter(
    lambda n: n != NODE
)


def _request(world: World, variation: str, draw: Any) -> tuple[dict[str, Any], str | None]:
    """The request document of `variation`, and the refusal reason (None: inside the rules)."""
    current = int(intent_state(world.helper.root)["generation"])
    gen = current + draw["ahead"]
    value = draw["value"]
    s = settings(**{"vm.swappiness": value})
    nonce = f"n{draw['nonce']}"
    body = host_body(NODE, gen, {"sysctl": s}, spec_hash=nonce)
    unit_settings: str | None = s
    signer, kw = world.worker, {}
    if variation == "inside":
        if draw["clean"]:
            body, unit_settings = host_body(NODE, gen, {}, spec_hash=nonce), None
        return host_unit_doc("sysctl", unit_settings, world.sign(signer, body)), None
    if variation == "wrong-node":
        body = host_body(draw["node"], gen, {"sysctl": s}, spec_hash=nonce)
    elif variation == "older-generation":
        body = host_body(NODE, current - min(draw["behind"], current), {"sysctl": s}, spec_hash=nonce)
    elif variation == "other-settings":
        unit_settings = settings(**{"vm.swappiness": (value + draw["behind"]) % 101})
        if unit_settings == s:
            unit_settings = settings(**{"vm.swappiness": value, "vm.overcommit_memory": 1})
    elif variation == "unit-not-named":
        body = host_body(NODE, gen, {"kernel-modules": settings(load=["tun"])}, spec_hash=nonce)
    elif variation == "clean-of-named-unit":
        unit_settings = None
    elif variation == "unknown-root":
        signer = world.stranger
    elif variation == "expired-new-body":
        signer = world.expired
    elif variation == "older-bundle":
        kw["bundle"] = world.old_bundle
    elif variation == "forged-bundle":
        kw["bundle"] = world.forged
    elif variation == "rootless-bundle":
        kw["bundle"] = world.rootless
    elif variation == "flipped-signature":
        kw["flip"] = draw["flip"]
    elif variation == "node-certificate":
        signer = world.node_cert
    elif variation == "other-purpose":
        kw["purpose"] = draw["purpose"]
    elif variation == "unsigned":
        return host_unit_doc("sysctl", s, None), REASONS[variation]
    return host_unit_doc("sysctl", unit_settings, world.sign(signer, body, **kw)), REASONS[variation]


def _check(world: World, doc: dict[str, Any], reason: str | None) -> None:
    h = world.helper
    if reason is None:
        answer = h.raw(doc)
        assert answer["ok"] is True, (doc["args"].get("settings"), answer)
        assert h.last_audit()["decision"] == "accepted"
        return
    assert_refused(h, doc, reason)


draws = st.fixed_dictionaries(
    {
        "ahead": st.integers(0, 3),
        "behind": st.integers(1, 50),
        "value": st.integers(0, 100),
        "nonce": st.integers(0, 2**32),
        "node": node_ids,
        "flip": st.integers(0, 63),
        "clean": st.booleans(),
        "purpose": st.sampled_from([p for p in Purpose if p is not Purpose.DESIRED_STATE]),
    }
)


@HELPER_SETTINGS
@given(variation=st.sampled_from(("inside", *OUTSIDE)), draw=draws)
def test_HST_SIGN_signed_intent_variations_with_roots_from_roots_join_record(
    record_world: World, variation: str, draw: dict[str, Any]
) -> None:
    doc, reason = _request(record_world, variation, draw)
    _check(record_world, doc, reason)


@HELPER_SETTINGS
@given(variation=st.sampled_from(("inside", *PINNED_OUTSIDE, "unpinned-root")), draw=draws)
def test_HST_SIGN_06_signed_intent_variations_with_pinned_roots(
    pinned_world: World, variation: str, draw: dict[str, Any]
) -> None:
    if variation == "unpinned-root":  # a chain that names a root command_root_sha256 does not pin
        current = int(intent_state(pinned_world.helper.root)["generation"])
        s = settings(**{"vm.swappiness": draw["value"]})
        body = host_body(NODE, current + draw["ahead"], {"sysctl": s}, spec_hash=f"n{draw['nonce']}")
        doc = host_unit_doc(
            "sysctl", s, intent(pinned_world.stranger, body, with_root=pinned_world.cp.other.root)
        )
        _check(pinned_world, doc, "bad-intent")
        return
    doc, reason = _request(pinned_world, variation, draw)
    _check(pinned_world, doc, reason)
