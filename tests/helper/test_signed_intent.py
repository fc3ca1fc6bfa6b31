"""host.unit's signed-intent rules through a real helper process over a simulated host.

Each test starts a helper whose root config and join record put it in one of the seeds' cases
(host-config.md "Signed specs"): roots pinned by command_root_sha256, roots from root's join record, roots
from a bundle the node presents, or none. Refusals are checked for their reason, their audit line and
an unchanged tree; the properties over generated variations are in test_signed_intent_properties.py.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from bcd_shared.pki import Purpose, Role
from helperproc import HelperProcess, assert_refused, base_config
from intentkit import ControlPlane, host_body, host_unit_doc, intent, intent_state, now, settings

DROPIN = "etc/sysctl.d/90-bcd.conf"
S10 = settings(**{"vm.swappiness": 10})


def _start(root: Path, cp: ControlPlane, *, pin_roots: bool = False, pin: bool = True) -> HelperProcess:
    return HelperProcess(root, (cp.config_lines(pin_roots=pin_roots) if pin else "") + base_config())


def _ok(h: HelperProcess, doc: dict[str, Any]) -> dict[str, Any]:
    answer = h.raw(doc)
    assert answer["ok"] is True, answer
    return dict(answer["result"])


def test_HST_SIGN_06_18_19_24_25_pinned_roots(fresh_root: Path, cp: ControlPlane) -> None:
    """command_root_sha256 decides alone: the request names its root (the chain's last certificate), which
    must be pinned; worker role; this node; generation; exact settings. Covers HST-SIGN-14 (a root that is
    not pinned is refused; the record and bundle sources are the next tests)."""
    worker = cp.command.leaf()
    h = _start(fresh_root, cp, pin_roots=True)
    try:
        body = host_body("node-a", 5, {"sysctl": S10})
        assert_refused(h, host_unit_doc("sysctl", S10, None), "intent-required")
        assert_refused(h, host_unit_doc("sysctl", S10, intent(worker, body)), "intent-unverifiable")
        stranger = cp.other.leaf()
        unpinned = assert_refused(
            h, host_unit_doc("sysctl", S10, intent(stranger, body, with_root=cp.other.root)), "bad-intent"
        )
        assert unpinned["message"].endswith("is not pinned"), unpinned  # refused for the pin, not the chain
        node_cert = cp.command.leaf(Role.NODE, "node-a")
        answer = assert_refused(
            h, host_unit_doc("sysctl", S10, intent(node_cert, body, with_root=cp.command.root)), "bad-intent"
        )
        assert "wrong-role" in answer["message"]
        ok = _ok(h, host_unit_doc("sysctl", S10, intent(worker, body, with_root=cp.command.root)))
        assert ok["changed"] is True and "vm.swappiness = 10" in (fresh_root / DROPIN).read_text()
        state = intent_state(fresh_root)
        assert (state["node_id"], state["node_source"], state["generation"]) == (
            "node-a",
            "first-signed-spec",
            5,
        )
        other_node = host_body("node-b", 6, {"sysctl": S10})
        assert_refused(
            h,
            host_unit_doc("sysctl", S10, intent(worker, other_node, with_root=cp.command.root)),
            "wrong-node",
        )
        older = host_body("node-a", 4, {"sysctl": S10})
        assert_refused(
            h,
            host_unit_doc("sysctl", S10, intent(worker, older, with_root=cp.command.root)),
            "stale-generation",
        )
        s11 = settings(**{"vm.swappiness": 11})
        assert_refused(
            h,
            host_unit_doc("sysctl", s11, intent(worker, body, with_root=cp.command.root)),
            "settings-mismatch",
        )
        # The same generation is accepted (HST-SIGN-24); settings compared as sent (Q-HST-SIGN-03).
        assert (
            _ok(h, host_unit_doc("sysctl", S10, intent(worker, body, with_root=cp.command.root)))["changed"]
            is False
        )
    finally:
        h.stop()


def test_HST_SIGN_07_08_20_26_28_roots_and_node_from_roots_join_record(
    fresh_root: Path, cp: ControlPlane
) -> None:
    """Covers HST-SIGN-27: helper-intent.json records the newest bundle version and that specs are signed."""
    cp.write_record(fresh_root, "node-a", cp.bundle(2))
    worker = cp.command.leaf()
    h = _start(fresh_root, cp)
    try:
        body = host_body("node-a", 3, {"sysctl": S10})
        # Mandatory from the first request, whatever the node sends (HST-SIGN-08).
        assert_refused(h, host_unit_doc("sysctl", S10, None), "intent-required")
        assert_refused(
            h,
            host_unit_doc("sysctl", S10, intent(worker, host_body("node-b", 3, {"sysctl": S10}))),
            "wrong-node",
        )
        assert _ok(h, host_unit_doc("sysctl", S10, intent(worker, body)))["changed"] is True
        state = intent_state(fresh_root)
        assert (state["node_id"], state["node_source"], state["bundle_version"], state["signed"]) == (
            "node-a",
            "record",
            2,
            True,
        )
        # A clean only for a unit the body no longer names (HST-SIGN-26).
        assert_refused(h, host_unit_doc("sysctl", None, intent(worker, body)), "clean-refused")
        cleaned = host_body("node-a", 4, {})
        assert _ok(h, host_unit_doc("sysctl", None, intent(worker, cleaned)))["changed"] is True
        assert not (fresh_root / DROPIN).exists()
        # A patch that sets host is a signed body too; one that sets no host section is refused.
        patch = host_body("node-a", 5, {"sysctl": S10}, patch=True)
        assert _ok(h, host_unit_doc("sysctl", S10, intent(worker, patch)))["changed"] is True
        assert_refused(
            h,
            host_unit_doc("sysctl", S10, intent(worker, host_body("node-a", 6, None, patch=True))),
            "bad-intent",
        )
        # A full spec without a host section decides it too: no units, so a clean is allowed.
        no_host = host_body("node-a", 6, None)
        assert_refused(h, host_unit_doc("sysctl", S10, intent(worker, no_host)), "settings-mismatch")
        assert _ok(h, host_unit_doc("sysctl", None, intent(worker, no_host)))["changed"] is True
        # Signed under another purpose: refused.
        answer = assert_refused(
            h, host_unit_doc("sysctl", S10, intent(worker, patch, purpose=Purpose.COMMAND)), "bad-intent"
        )
        assert "wrong-purpose" in answer["message"]
    finally:
        h.stop()


def test_HST_SIGN_09_10_15_16_17_29_bundles_rotate_forward_only(fresh_root: Path, cp: ControlPlane) -> None:
    """Roots from the record's bundle v2; a presented v3 rotates to a new root; v2 again is a rollback;
    leaving v3 out does not bring v2's roots back; a bundle from another key and a rootless one are
    refused."""
    cp.write_record(fresh_root, "node-a", cp.bundle(2))
    worker = cp.command.leaf()
    stranger = cp.other.leaf()  # the rotated-to root's worker
    v3 = cp.bundle(3, roots=(cp.other.root,))
    h = _start(fresh_root, cp)
    try:
        body = host_body("node-a", 3, {"sysctl": S10})
        assert_refused(h, host_unit_doc("sysctl", S10, intent(stranger, body)), "bad-intent")  # unknown root
        assert _ok(h, host_unit_doc("sysctl", S10, intent(stranger, body, bundle=v3)))["changed"] is True
        assert intent_state(fresh_root)["bundle_version"] == 3
        assert_refused(
            h, host_unit_doc("sysctl", S10, intent(worker, body, bundle=cp.bundle(2))), "stale-bundle"
        )
        assert_refused(h, host_unit_doc("sysctl", S10, intent(worker, body)), "bundle-required")
        assert_refused(h, host_unit_doc("sysctl", S10, intent(stranger, body)), "bundle-required")
        from bcd_shared.pki import KeyPair

        forged = cp.bundle(9, roots=(cp.other.root,), key=KeyPair.generate())
        assert_refused(
            h, host_unit_doc("sysctl", S10, intent(stranger, body, bundle=forged)), "untrusted-bundle"
        )
        assert_refused(
            h,
            host_unit_doc("sysctl", S10, intent(stranger, body, bundle=cp.bundle(4, roots=()))),
            "rootless-bundle",
        )
        # A replay of the newest bundle is fine.
        assert _ok(h, host_unit_doc("sysctl", S10, intent(stranger, body, bundle=v3)))["changed"] is False
    finally:
        h.stop()


def test_HST_SIGN_21_record_not_signed_by_the_pinned_key_refuses_everything(
    fresh_root: Path, cp: ControlPlane
) -> None:
    from bcd_shared.pki import KeyPair

    record = cp.join_response("node-a", cp.bundle(1), key=KeyPair.generate())
    path = fresh_root / "var/lib/bcd-hostconfig/join-response.pb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(record)
    path.chmod(0o600)
    h = _start(fresh_root, cp)
    try:
        worker = cp.command.leaf()
        body = host_body("node-a", 1, {"sysctl": S10})
        for doc in (host_unit_doc("sysctl", S10, intent(worker, body)), host_unit_doc("sysctl", None, None)):
            answer = assert_refused(h, doc, "join-record")
            assert "untrusted-join-signer" in answer["message"]
    finally:
        h.stop()


def test_HST_SIGN_22_rejoin_as_another_node_moves_the_binding(fresh_root: Path, cp: ControlPlane) -> None:
    cp.write_record(fresh_root, "node-a", cp.bundle(2))
    worker = cp.command.leaf()
    h = _start(fresh_root, cp)
    try:
        assert _ok(h, host_unit_doc("sysctl", S10, intent(worker, host_body("node-a", 50, {"sysctl": S10}))))
        cp.write_record(fresh_root, "node-z", cp.bundle(2))
        assert_refused(
            h,
            host_unit_doc("sysctl", S10, intent(worker, host_body("node-a", 51, {"sysctl": S10}))),
            "wrong-node",
        )
        # Generations start over for the new node.
        assert _ok(h, host_unit_doc("sysctl", S10, intent(worker, host_body("node-z", 1, {"sysctl": S10}))))
        state = intent_state(fresh_root)
        assert (state["node_id"], state["generation"]) == ("node-z", 1)
    finally:
        h.stop()


def test_HST_SIGN_23_28_33_no_roots_then_trust_on_first_use(fresh_root: Path, cp: ControlPlane) -> None:
    """No pins at all: unsigned units apply (HST-SIGN-33). With the JoinService key pinned but no record
    yet, an unsigned unit is refused (issue 9 item 9), the first bundle with roots turns signed intent on
    for good, and the first signed spec fixes the node (trust on first use)."""
    worker = cp.command.leaf()
    h = _start(fresh_root, cp, pin=False)
    try:
        assert _ok(h, host_unit_doc("sysctl", S10, None))["changed"] is True
        assert intent_state(fresh_root) == {}
    finally:
        h.stop()
    h = _start(fresh_root, cp)
    try:
        assert_refused(
            h, host_unit_doc("sysctl", settings(**{"vm.swappiness": 11}), None), "join-record-required"
        )
        body = host_body("node-t", 7, {"sysctl": S10})
        assert _ok(h, host_unit_doc("sysctl", S10, intent(worker, body, bundle=cp.bundle(1))))
        state = intent_state(fresh_root)
        assert (state["node_id"], state["node_source"], state["signed"]) == (
            "node-t",
            "first-signed-spec",
            True,
        )
        assert_refused(h, host_unit_doc("sysctl", S10, None), "bundle-required")
        other = host_body("node-u", 8, {"sysctl": S10})
        assert_refused(
            h, host_unit_doc("sysctl", S10, intent(worker, other, bundle=cp.bundle(1))), "wrong-node"
        )
    finally:
        h.stop()


def test_HST_SIGN_30_31_verified_body_outlives_its_worker_certificate(
    fresh_root: Path, cp: ControlPlane
) -> None:
    cp.write_record(fresh_root, "node-a", cp.bundle(2))
    # Long enough for a helper start and a first call on a loaded machine; then wait out exactly its expiry.
    expires = now() + dt.timedelta(seconds=8)
    short = cp.command.leaf(not_after=expires)
    h = _start(fresh_root, cp)
    try:
        body = host_body("node-a", 3, {"sysctl": S10})
        assert _ok(h, host_unit_doc("sysctl", S10, intent(short, body)))["changed"] is True
        time.sleep(max(0.0, (expires - now()).total_seconds()) + 1.0)
        # The body it already verified stays good (HST-SIGN-30)...
        assert _ok(h, host_unit_doc("sysctl", S10, intent(short, body)))["changed"] is False
        # ...also after the helper restarts (the digest is in root's state)...
        h.stop()
        h = _start(fresh_root, cp)
        assert _ok(h, host_unit_doc("sysctl", S10, intent(short, body)))["changed"] is False
        # ...but a new body needs a currently valid signature (HST-SIGN-31).
        new = host_body("node-a", 4, {"sysctl": S10})
        answer = assert_refused(h, host_unit_doc("sysctl", S10, intent(short, new)), "bad-intent")
        assert "expired" in answer["message"]
        assert _ok(h, host_unit_doc("sysctl", S10, intent(cp.command.leaf(), new)))
        # The old body is now older than the newest generation, and no longer remembered as verified.
        assert_refused(h, host_unit_doc("sysctl", S10, intent(cp.command.leaf(), body)), "stale-generation")
        assert_refused(h, host_unit_doc("sysctl", S10, intent(short, body)), "bad-intent")
    finally:
        h.stop()


def test_HST_REC_10_state_file_is_root_only_json(fresh_root: Path, cp: ControlPlane) -> None:
    """Covers HST-REC-10 (helper-intent.json names the node served and the newest signed host section
    accepted: its generation and the body's SHA-256) and HST-REC-11 (root's join record
    join-response.pb is mode 0600)."""
    cp.write_record(fresh_root, "node-a", cp.bundle(2))
    h = _start(fresh_root, cp)
    bodies = [host_body("node-a", g, {"sysctl": S10}) for g in (3, 4)]
    try:
        for body in bodies:
            _ok(h, host_unit_doc("sysctl", S10, intent(cp.command.leaf(), body)))
    finally:
        h.stop()
    path = fresh_root / "var/lib/bcd-hostconfig/helper-intent.json"
    st = path.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, 0)
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["node_id"], doc["generation"]) == (1, "node-a", 4)
    assert doc["verified"][-1]["generation"] == 4
    assert doc["verified"][-1]["sha256"] == hashlib.sha256(bodies[1]).hexdigest()
    record = fresh_root / "var/lib/bcd-hostconfig/join-response.pb"
    assert record.stat().st_mode & 0o777 == 0o600


def test_HST_SIGN_01_a_unit_applies_only_as_the_signed_spec_asks(fresh_root: Path, cp: ControlPlane) -> None:
    """With command-signing roots, root applies a unit only when a spec the control plane signed asks for
    exactly those settings: the signed settings apply; other settings, a unit the spec does not name, a
    spec with a broken signature, or none at all are refused and write nothing."""
    worker = cp.command.leaf()
    h = _start(fresh_root, cp, pin_roots=True)
    try:
        body = host_body("node-a", 3, {"sysctl": S10})
        signed = intent(worker, body, with_root=cp.command.root)
        assert not (fresh_root / DROPIN).exists()
        assert_refused(h, host_unit_doc("sysctl", S10, None), "intent-required")
        broken = intent(worker, body, with_root=cp.command.root, flip=5)
        assert_refused(h, host_unit_doc("sysctl", S10, broken), "bad-intent")
        assert_refused(
            h, host_unit_doc("sysctl", settings(**{"vm.swappiness": 60}), signed), "settings-mismatch"
        )
        assert_refused(h, host_unit_doc("kernel-modules", '{"load":["tun"]}', signed), "settings-mismatch")
        assert not (fresh_root / DROPIN).exists()
        ok = _ok(h, host_unit_doc("sysctl", S10, signed))
        assert ok["changed"] is True and "vm.swappiness = 10" in (fresh_root / DROPIN).read_text()
    finally:
        h.stop()
