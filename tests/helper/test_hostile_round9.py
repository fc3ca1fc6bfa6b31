"""Red team round 9 (docs/helper.md, "Threat model, round 9"): the node's account, compromised, against the
access path, daemon.swap / daemon.confirm and the audit log, as a real unprivileged client (a forked child
dropped to the node's uid, hostilekit.as_node: SO_PEERCRED sees that uid) against a real `bcd helper serve`
over a simulated host. Each test failed on the code before its fix."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bcd_shared import access as acc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from helperproc import HelperProcess
from hostilekit import as_node
from intentkit import ControlPlane, access_body, access_doc, intent
from realnode import RealNode
from releasekit import LINK, RECORD, old_release_host, staged_swap


def test_round9_a_confirm_of_a_swap_whose_link_never_flipped_is_refused(
    fresh_root: Path, cp: ControlPlane
) -> None:
    """A crash between daemon.swap's `pending` record and its flip of /usr/lib/bcd/bcd leaves the record
    naming the new release while the link still names the old one (the node never restarted onto it).
    The node, still the old release, answered `daemon.confirm healthy` for the new version: root recorded
    it `confirmed` (the installed version, the floor of every later swap, and `already_installed` for
    it again) while the old release kept running, and no rollback ever came. Now the confirmation is
    refused (`not-swapped`, naming the link) and the deadline rolls the record back."""
    h = old_release_host(fresh_root, cp, node_unit=True)
    try:
        new = b"#!/bin/sh\necho bcd 1.1.0\n" + os.urandom(16)
        assert h.raw(staged_swap(cp.command.leaf(), fresh_root, new))["ok"] is True
        assert h.raw({"op": "daemon.confirm", "args": {"version": "1.1.0"}})["ok"] is True
        newer = new + b"1.2.0"
        out = h.raw(staged_swap(cp.command.leaf(), fresh_root, newer, version="1.2.0", generation=2))
        assert out["ok"] is True, out
        h.stop()
        # The crash: the record is `pending` for 1.2.0, the link was never renamed over.
        link = fresh_root / LINK
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


def _ca_key() -> str:
    key = Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()


def test_round9_access_apply_that_fails_part_way_puts_back_what_it_wrote(cp: ControlPlane) -> None:
    """access.apply wrote the CA keys, then the KRL, then the principals, and a failure on the way (here
    the KRL's rename refused by the file system; a full disk, which the node can bring about on a host
    whose /var/lib/bcd and /etc share one file system, does the same to the larger KRL) left the new
    CA trusted under the old KRL: a certificate of the new CA the spec revokes logged in until the next
    apply, which the node need never send. Now root puts back the bytes it found (or removes what it
    created) before it answers the failure: nothing half-applied."""
    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, "node-a", cp.bundle(1)))
    krl = node.root / acc.SSHD_KRL.lstrip("/")
    try:
        worker = cp.command.leaf()
        old_key = _ca_key()
        first = access_body("node-a", 1, ca_keys=(old_key,), principals=("alice@node-a",), serials=(5,))
        node.ok(access_doc(intent(worker, first)))
        before = {p: (node.root / p.lstrip("/")).read_bytes() for p in acc.managed_paths(["alice"])}
        subprocess.run(["chattr", "+i", str(krl)], check=True)
        new_key = _ca_key()
        second = access_body(
            "node-a", 2, ca_keys=(old_key, new_key), principals=("bob@node-a",), serials=(5, 7)
        )
        answer = node.call(access_doc(intent(worker, second)))
        assert (answer["ok"], answer.get("reason")) == (False, "access-write"), answer
        assert acc.SSHD_KRL in answer["message"]
        after = {p: (node.root / p.lstrip("/")).read_bytes() for p in acc.managed_paths(["alice"])}
        assert after == before
        assert not (node.root / acc.principals_path("bob").lstrip("/")).exists()
    finally:
        subprocess.run(["chattr", "-i", str(krl)], check=False)
        node.close()
