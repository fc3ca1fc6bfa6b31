"""Red team round 9 (docs/helper.md, "Threat model, round 9"): the node's account, compromised, against the
access path, daemon.swap / daemon.confirm and the audit log, as a real unprivileged client (a forked child
dropped to the node's uid, hostilekit.as_node: SO_PEERCRED sees that uid) against a real `bcd helper serve`
over a simulated host. Each test failed on the code before its fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helperproc import HelperProcess, base_config
from hostilekit import as_node
from intentkit import ControlPlane
from releasekit import NODE_ID, NODE_UID, RECORD, staged_swap

INSTALLED = "usr/lib/bcd/bcd"
OLD = b"#!/bin/sh\necho bcd 1.0.0\n"


def _host(root: Path, cp: ControlPlane) -> HelperProcess:
    cp.write_record(root, NODE_ID, cp.bundle(2))
    (root / "usr/lib/bcd").mkdir(parents=True, exist_ok=True)
    (root / INSTALLED).write_bytes(OLD)
    (root / INSTALLED).chmod(0o755)
    unit = root / "etc/systemd/system/bcd-node.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/bcd node\n")
    return HelperProcess(root, cp.config_lines() + base_config(node_uid=NODE_UID, node_gid=NODE_UID))


def test_round9_a_confirm_of_a_swap_whose_link_never_flipped_is_refused(fresh_root: Path, cp: ControlPlane) -> None:
    """A crash between daemon.swap's `pending` record and its flip of /usr/lib/bcd/bcd leaves the record
    naming the new release while the link still names the old one (the node never restarted onto it).
    The node, still the old release, answered `daemon.confirm healthy` for the new version: root recorded
    it `confirmed` (the installed version, the floor of every later swap, and `already_installed` for
    it again) while the old release kept running, and no rollback ever came. Now the confirmation is
    refused (`not-swapped`, naming the link) and the deadline rolls the record back."""
    h = _host(fresh_root, cp)
    try:
        new = b"#!/bin/sh\necho bcd 1.1.0\n" + os.urandom(16)
        assert h.raw(staged_swap(cp.command.leaf(), fresh_root, new))["ok"] is True
        assert h.raw({"op": "daemon.confirm", "args": {"version": "1.1.0"}})["ok"] is True
        newer = new + b"1.2.0"
        out = h.raw(staged_swap(cp.command.leaf(), fresh_root, newer, version="1.2.0", generation=2))
        assert out["ok"] is True, out
        h.stop()
        # The crash: the record is `pending` for 1.2.0, the link was never renamed over.
        link = fresh_root / INSTALLED
        link.unlink()
        link.symlink_to("releases/1.1.0/bcd")
        h = HelperProcess(fresh_root)
        answer = as_node(h, {"op": "daemon.confirm", "args": {"version": "1.2.0", "healthy": True}})
        assert (answer["ok"], answer.get("reason")) == (False, "not-swapped"), answer
        assert "/usr/lib/bcd/bcd" in answer["message"]
        record = json.loads((fresh_root / RECORD).read_text())
        assert (record["state"], record["version"]) == ("pending", "1.2.0")
        assert os.readlink(link) == "releases/1.1.0/bcd"
    finally:
        h.stop()
