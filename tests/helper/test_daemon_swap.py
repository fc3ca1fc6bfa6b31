"""daemon.swap and daemon.confirm through a real helper over a temporary simulated root: a signed release
verified (SHA-256, worker signature chained to the command roots) and swapped in atomically, the previous
release kept, confirmed, or rolled back when unhealthy, unconfirmed in time (also across a helper
restart) or refused. Covers DLV-CONV-16, DLV-PRIV-10 (the helper's half of self-update)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from helperproc import HelperProcess, base_config, tree
from intentkit import ControlPlane, Signer, b64
from releasekit import NODE_ID, NODE_UID, RECORD, stage, staged_swap

INSTALLED = "usr/lib/bcd/bcd"
OLD = b"#!/bin/sh\necho bcd 1.0.0\n"
NEW = b"#!/bin/sh\necho bcd 1.1.0\n" + os.urandom(64)


def _host(root: Path, cp: ControlPlane, *, record: bool = True) -> HelperProcess:
    if record:
        cp.write_record(root, NODE_ID, cp.bundle(2))
    (root / "usr/lib/bcd").mkdir(parents=True, exist_ok=True)
    (root / INSTALLED).write_bytes(OLD)  # a packaged install: a regular file
    (root / INSTALLED).chmod(0o755)
    unit = root / "etc/systemd/system/bcd-node.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/bcd node\n")
    return HelperProcess(root, cp.config_lines() + base_config(node_uid=NODE_UID, node_gid=NODE_UID))


def _swap(signer: Signer, root: Path, *, data: bytes = NEW, **kw: Any) -> dict[str, Any]:
    return staged_swap(signer, root, data, **kw)


def _with(doc: dict[str, Any], **args: Any) -> dict[str, Any]:
    """The request with some arguments replaced after signing."""
    return {"op": doc["op"], "args": {**doc["args"], **args}}


def _state(root: Path) -> dict[str, Any]:
    return dict(json.loads((root / RECORD).read_text()))


def test_DLV_CONV_16_swap_verifies_swaps_keeps_previous_and_confirms(
    fresh_root: Path, cp: ControlPlane
) -> None:
    h = _host(fresh_root, cp)
    try:
        out = h.raw(_swap(cp.command.leaf(), fresh_root))
        assert out["ok"] is True, out
        assert out["result"]["version"] == "1.1.0" and out["result"]["path"] == "/usr/lib/bcd/bcd"
        # A release directory per version; the packaged file kept as the `initial` release.
        assert os.readlink(fresh_root / INSTALLED) == "releases/1.1.0/bcd"
        assert (fresh_root / INSTALLED).read_bytes() == NEW
        assert (fresh_root / "usr/lib/bcd/releases/initial/bcd").read_bytes() == OLD
        st = (fresh_root / "usr/lib/bcd/releases/1.1.0/bcd").stat()
        assert (st.st_mode & 0o777, st.st_uid) == (0o755, 0)
        assert _state(fresh_root)["state"] == "pending"
        # A second swap waits for the first one's confirmation.
        again = h.raw(_swap(cp.command.leaf(), fresh_root, version="1.2.0", generation=2))
        assert again["reason"] == "swap-pending"
        wrong = h.raw({"op": "daemon.confirm", "args": {"version": "9.9.9"}})
        assert wrong["reason"] == "version-mismatch"
        ok = h.raw({"op": "daemon.confirm", "args": {"version": "1.1.0"}})
        assert ok["ok"] is True and ok["result"]["confirmed"] is True
        assert _state(fresh_root)["state"] == "confirmed"
        assert (fresh_root / INSTALLED).read_bytes() == NEW
        assert h.raw({"op": "daemon.confirm", "args": {"version": "1.1.0"}})["reason"] == "no-pending-swap"
        assert h.last_audit()["op"] == "daemon.confirm"
        # The same release again is a no-op (daemon.upgrade is retry-safe).
        same = h.raw(_swap(cp.command.leaf(), fresh_root, generation=2))
        assert same["ok"] is True and same["result"]["already_installed"] is True, same
        # Two forward swaps later, only the installed and the previous release directories are kept.
        for n, version in enumerate(("1.2.0", "1.3.0"), start=3):
            data = NEW + version.encode()
            assert h.raw(_swap(cp.command.leaf(), fresh_root, version=version, data=data, generation=n))["ok"]
            assert h.raw({"op": "daemon.confirm", "args": {"version": version}})["ok"]
        assert sorted(os.listdir(fresh_root / "usr/lib/bcd/releases")) == ["1.2.0", "1.3.0"]
        assert (fresh_root / INSTALLED).read_bytes() == NEW + b"1.3.0"
    finally:
        h.stop()


def test_DLV_PRIV_10_refusals_change_nothing(fresh_root: Path, cp: ControlPlane) -> None:
    h = _host(fresh_root, cp)
    worker = cp.command.leaf()
    root_owned = stage(fresh_root, "root-owned", NEW, uid=0)
    link = fresh_root / "var/lib/bcd/staging/link"
    stage(fresh_root, "bcd-1.1.0", NEW)
    link.symlink_to("bcd-1.1.0")
    os.lchown(link, NODE_UID, NODE_UID)
    tampered = stage(fresh_root, "tampered", b"tampered")
    good = _swap(worker, fresh_root)
    cases = [
        (_with(good, artifact=tampered), "artifact-mismatch"),
        (_with(good, sha256="0" * 64), "bad-release-signature"),
        (_swap(cp.other.leaf(), fresh_root), "bad-release-signature"),
        (_with(_swap(worker, fresh_root, version="2.0.0"), version="1.1.0"), "bad-release-signature"),
        (_with(good, artifact=root_owned), "bad-artifact"),
        (_with(good, artifact="link"), "bad-artifact"),
        (_with(good, artifact="missing"), "bad-artifact"),
        (_with(good, artifact="../../../etc/shadow"), "bad-artifact"),
        (_with(good, artifact="/var/lib/bcd/staging/bcd-1.1.0"), "bad-artifact"),
        (_with(good, url="http://releases.example.com/bcd"), "bad-manifest"),
        (_with(good, version="../1"), "bad-manifest"),
        (_with(good, sha256="A" * 64), "bad-manifest"),
        (_swap(worker, fresh_root, timeout=0), "bad-arguments"),
    ]
    try:
        before = tree(fresh_root)
        for doc, reason in cases:
            seq = h.last_audit()["seq"]
            answer = h.raw(doc)
            assert (answer["ok"], answer.get("reason")) == (False, reason), (doc["args"], answer)
            last = h.last_audit()
            assert (last["seq"], last["op"], last["decision"], last["reason"]) == (
                seq + 1,
                "daemon.swap",
                "refused",
                reason,
            )
            assert tree(fresh_root) == before
    finally:
        h.stop()


def test_daemon_swap_needs_command_roots(fresh_root: Path, cp: ControlPlane) -> None:
    h = _host(fresh_root, cp, record=False)
    try:
        answer = h.raw(_swap(cp.command.leaf(), fresh_root))
        assert answer["reason"] == "join-record-required"  # a pin without a record: closed (issue 9 item 9)
        # A bundle the node presents, signed by the pinned JoinService key, names them.
        doc = _swap(cp.command.leaf(), fresh_root)
        doc["args"]["trust_bundle"] = b64(cp.bundle(1))
        assert h.raw(doc)["ok"] is True
    finally:
        h.stop()


def test_DLV_PRIV_10_unhealthy_release_rolls_back(fresh_root: Path, cp: ControlPlane) -> None:
    h = _host(fresh_root, cp)
    try:
        assert h.raw(_swap(cp.command.leaf(), fresh_root))["ok"] is True
        out = h.raw({"op": "daemon.confirm", "args": {"version": "1.1.0", "healthy": False}})
        assert out["ok"] is True and out["result"]["rolled_back"] is True, out
        assert os.readlink(fresh_root / INSTALLED) == "releases/initial/bcd"
        assert (fresh_root / INSTALLED).read_bytes() == OLD
        state = _state(fresh_root)
        assert (state["state"], state["previous_version"]) == ("rolled-back", "1.1.0")
        log = (fresh_root / "var/lib/bcd-sim/systemd/log").read_text()
        assert "restart bcd-node.service" in log
    finally:
        h.stop()


def test_DLV_PRIV_10_unconfirmed_release_rolls_back_on_time_and_across_a_restart(
    fresh_root: Path, cp: ControlPlane
) -> None:
    h = _host(fresh_root, cp)
    try:
        assert h.raw(_swap(cp.command.leaf(), fresh_root, timeout=1))["ok"] is True
        deadline = time.monotonic() + 10
        while _state(fresh_root)["state"] == "pending" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(fresh_root)["state"] == "rolled-back"
        assert (fresh_root / INSTALLED).read_bytes() == OLD
        rollbacks: list[tuple[str, str]] = []
        while not rollbacks and time.monotonic() < deadline:  # audited right after the record
            rollbacks = [(x["op"], x["reason"]) for x in h.audit_lines() if x["op"] == "daemon.rollback"]
            time.sleep(0.05)
        assert rollbacks == [("daemon.rollback", "confirm-timeout")]
        # A swap pending when the helper stops is rolled back by the next helper once its deadline passed.
        assert h.raw(_swap(cp.command.leaf(), fresh_root, timeout=1, generation=2))["ok"] is True
        h.stop()
        time.sleep(1.2)
        h = HelperProcess(fresh_root)
        deadline = time.monotonic() + 10
        while _state(fresh_root)["state"] == "pending" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(fresh_root)["state"] == "rolled-back"
        assert (fresh_root / INSTALLED).read_bytes() == OLD
    finally:
        h.stop()
