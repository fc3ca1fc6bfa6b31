"""A hostile node against host.unit on a real helper process with pinned command-signing roots: settings that
two JSON parsers would read differently, a unit the signed body names twice, a signed body replayed for
another unit, an older generation after a newer one, a clean of a unit still named, and settings nested
past any parser's recursion.

The node holds a real signed body (it received it) but cannot sign one: every attack reuses bytes the control
plane signed, or asks for something they do not say. Each refusal: the reason, one refused audit line, the
tree (root's intent state included) byte-for-byte unchanged. Covers HST-SIGN-24/25/26, Q-HST-SIGN-03.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_shared import wire
from helperproc import HelperProcess, assert_refused, base_config
from hostilekit import assert_still_serving, verify_audit
from intentkit import ControlPlane, Signer, host_body, host_unit_doc, intent, intent_state, settings

NODE = "node-a"
S10 = settings(**{"vm.swappiness": 10})


@pytest.fixture
def pinned(fresh_root: Path, cp: ControlPlane) -> Iterator[tuple[HelperProcess, Signer]]:
    """A helper whose roots are pinned, bound to NODE at generation 5 by one accepted request."""
    h = HelperProcess(fresh_root, cp.config_lines(pin_roots=True) + base_config())
    worker = cp.command.leaf()
    try:
        doc = host_unit_doc("sysctl", S10, _signed(cp, worker, host_body(NODE, 5, {"sysctl": S10})))
        assert h.raw(doc)["ok"] is True
        assert intent_state(fresh_root)["generation"] == 5
        yield h, worker
        assert_still_serving(h)
        verify_audit(h)
    finally:
        h.stop()


def _signed(cp: ControlPlane, worker: Signer, body: bytes) -> dict[str, Any]:
    return intent(worker, body, with_root=cp.command.root)


def _body(generation: int, units: list[tuple[str, str]]) -> bytes:
    """A full spec naming `units` in this order (a unit may appear twice, which host_body cannot say)."""
    host = wire.HostSection(units=[wire.HostUnit(name=n, settings=s) for n, s in units])
    return bytes(
        wire.DesiredStateBody(
            node_id=NODE, generation=generation, spec_hash=f"h{generation}", full=wire.NodeSpec(host=host)
        )
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"vm.swappiness":10,"vm.swappiness":99}', "twice"),  # first-wins reads 10, last-wins 99
        ('{"vm.swappiness\\u0000":10}', ""),  # a NUL inside a key: C parsers stop at it
        ('{"vm.swappiness":NaN}', ""),
        ('{"vm.swappiness":10}{"vm.swappiness":99}', "trailing"),
        ("[" * 5000 + "]" * 5000, ""),  # past any recursive parser's depth
    ],
    ids=["duplicate-key", "nul-in-key", "nan", "two-documents", "nested-5000"],
)
def test_signed_settings_that_parsers_read_differently_are_refused(
    pinned: tuple[HelperProcess, Signer], cp: ControlPlane, text: str, why: str
) -> None:
    """Even signed byte for byte by the control plane, settings whose meaning depends on the JSON parser
    are refused by the unit's strict decoder, before root's intent state is written."""
    h, worker = pinned
    doc = host_unit_doc("sysctl", text, _signed(cp, worker, _body(6, [("sysctl", text)])))
    answer = assert_refused(h, doc, "invalid-settings")
    assert why in answer["message"]
    assert intent_state(h.root)["generation"] == 5


def test_settings_compared_as_text_not_as_json(
    pinned: tuple[HelperProcess, Signer], cp: ControlPlane
) -> None:
    """JSON-equal settings written differently (spacing, an escaped letter, key order) are not the signed
    ones: the comparison is exact text (Q-HST-SIGN-03), so no second parser decides what was signed."""
    h, worker = pinned
    two = settings(**{"vm.swappiness": 10, "vm.overcommit_memory": 1})
    signed = _signed(cp, worker, _body(6, [("sysctl", two)]))
    for variant in (
        '{"vm.overcommit_memory": 1, "vm.swappiness": 10}',
        '{"vm.overcommit_memory":1,"\\u0076m.swappiness":10}',
        '{"vm.swappiness":10,"vm.overcommit_memory":1}',
        two + " ",
    ):
        assert json.loads(variant) == json.loads(two)
        assert_refused(h, host_unit_doc("sysctl", variant, signed), "settings-mismatch")


def test_unit_named_twice_is_refused_whatever_the_settings(
    pinned: tuple[HelperProcess, Signer], cp: ControlPlane
) -> None:
    h, worker = pinned
    s99 = settings(**{"vm.swappiness": 99})
    for units in ([("sysctl", S10), ("sysctl", S10)], [("sysctl", S10), ("sysctl", s99)]):
        signed = _signed(cp, worker, _body(6, units))
        for unit_settings in (S10, s99):
            answer = assert_refused(h, host_unit_doc("sysctl", unit_settings, signed), "settings-mismatch")
            assert "twice" in answer["message"] or "other settings" in answer["message"]
        assert_refused(h, host_unit_doc("sysctl", None, signed), "clean-refused")


def test_signed_body_replayed_for_another_unit_is_refused(
    pinned: tuple[HelperProcess, Signer], cp: ControlPlane
) -> None:
    """The accepted body names sysctl only: replaying it (signature and all) to apply another unit, with
    sysctl's settings or with its own, is refused; replaying it to clean sysctl is refused too."""
    h, worker = pinned
    replay = _signed(cp, worker, host_body(NODE, 5, {"sysctl": S10}))
    assert_refused(h, host_unit_doc("hugepages", S10, replay), "settings-mismatch")
    assert_refused(h, host_unit_doc("kernel-modules", '{"load":["vfio_pci"]}', replay), "settings-mismatch")
    assert_refused(h, host_unit_doc("sysctl", None, replay), "clean-refused")
    # The same bytes under another node's name would need a new signature: a flipped byte is refused.
    tampered = dict(replay)
    tampered["body"] = _signed(cp, worker, host_body("node-b", 5, {"sysctl": S10}))["body"]
    assert_refused(h, host_unit_doc("sysctl", S10, tampered), "bad-intent")


def test_older_generation_after_a_newer_one_is_refused(
    pinned: tuple[HelperProcess, Signer], cp: ControlPlane
) -> None:
    h, worker = pinned
    s20 = settings(**{"vm.swappiness": 20})
    newer = _signed(cp, worker, host_body(NODE, 9, {"sysctl": s20}))
    assert h.raw(host_unit_doc("sysctl", s20, newer))["ok"] is True
    for generation in (8, 5, 0):
        older = _signed(cp, worker, host_body(NODE, generation, {"sysctl": S10}))
        assert_refused(h, host_unit_doc("sysctl", S10, older), "stale-generation")
        # An older body that no longer names the unit cannot clean it either.
        gone = _signed(cp, worker, host_body(NODE, generation, {}))
        assert_refused(h, host_unit_doc("sysctl", None, gone), "stale-generation")
    assert intent_state(h.root)["generation"] == 9
