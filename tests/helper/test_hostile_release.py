"""Issue 9 item 4, downgrade by replay: a hostile node (a real process of the node's uid, connected to a
real `bcd helper serve`) replays the control plane's earlier signed releases, stale specs and used
commands, and names files outside its staging directory. Each attempt is refused, audited as one refused
line, and changes nothing; a signed rollback intent naming the version is the one way back.

Covers DLV-PRIV-10 (the helper's half of self-update) and DLV-CONV-16 (the helper verifies the release).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helperproc import HelperProcess, base_config, tree
from hostilekit import NODE_GID, NODE_UID, as_node, verify_audit
from intentkit import ControlPlane, Signer
from releasekit import (
    LINK,
    NODE_ID,
    RECORD,
    STAGING,
    command_carrier,
    daemon_section,
    spec_carrier,
    stage,
    swap_doc,
)

V15 = b"#!/bin/sh\necho bcd 1.5.0\n"
V20 = b"#!/bin/sh\necho bcd 2.0.0\n"
V21 = b"#!/bin/sh\necho bcd 2.1.0\n"


@pytest.fixture
def host(tmp_path: Path, cp: ControlPlane) -> Iterator[HelperProcess]:
    from helperproc import make_root

    root = make_root(tmp_path)
    cp.write_record(root, NODE_ID, cp.bundle(2))
    (root / "usr/lib/bcd").mkdir(parents=True, exist_ok=True)
    (root / LINK).write_bytes(b"#!/bin/sh\necho packaged\n")
    (root / LINK).chmod(0o755)
    stage(root, "placeholder", b"")
    h = HelperProcess(root, cp.config_lines() + base_config(node_uid=NODE_UID, node_gid=NODE_GID))
    yield h
    h.stop()


def refused_as_node(h: HelperProcess, doc: dict[str, Any], reason: str) -> dict[str, Any]:
    before = tree(h.root)
    seq = h.last_audit()["seq"]
    answer = as_node(h, doc)
    assert (answer["ok"], answer.get("reason")) == (False, reason), answer
    last = h.last_audit()
    assert (last["seq"], last["op"], last["decision"], last["reason"], last["peer_uid"]) == (
        seq + 1,
        "daemon.swap",
        "refused",
        reason,
        NODE_UID,
    ), last
    assert tree(h.root) == before
    assert verify_audit(h)
    return answer


def install(h: HelperProcess, signer: Signer, version: str, data: bytes, generation: int) -> None:
    """The control plane's spec at `generation` names `version`: the node swaps it in and confirms."""
    section = daemon_section(signer, version, data)
    name = stage(h.root, f"bcd-{version}", data)
    out = as_node(h, swap_doc(signer, section, name, spec=spec_carrier(signer, section, generation)))
    assert out["ok"] is True, out
    assert as_node(h, {"op": "daemon.confirm", "args": {"version": version}})["ok"] is True
    assert (h.root / LINK).read_bytes() == data


def test_DLV_PRIV_10_a_replayed_older_release_is_refused_and_a_signed_rollback_names_the_way_back(
    host: HelperProcess, cp: ControlPlane
) -> None:
    worker = cp.command.leaf()
    old = daemon_section(worker, "1.5.0", V15)  # the control plane's earlier, validly signed release
    name = stage(host.root, "bcd-1.5.0", V15)
    install(host, worker, "2.0.0", V20, generation=5)
    # The old release in the old spec that named it: not fresh.
    refused_as_node(host, swap_doc(worker, old, name, spec=spec_carrier(worker, old, 3)), "stale-generation")
    # The old release, even in a fresh spec: releases only move forward.
    refused_as_node(host, swap_doc(worker, old, name, spec=spec_carrier(worker, old, 6)), "downgrade")
    # ... and in a fresh, unused daemon.upgrade command.
    refused_as_node(host, swap_doc(worker, old, name, command=command_carrier(worker, old)), "downgrade")
    # The same version with other bytes: one version, one artifact.
    other = daemon_section(worker, "2.0.0", V20 + b"#")
    other_name = stage(host.root, "bcd-2.0.0-other", V20 + b"#")
    refused_as_node(
        host, swap_doc(worker, other, other_name, spec=spec_carrier(worker, other, 6)), "version-reused"
    )
    # The rollback flag is signed: setting it on the forward manifest breaks the release signature.
    doc = swap_doc(worker, old, name, spec=spec_carrier(worker, old, 6))
    doc["args"]["rollback"] = True
    refused_as_node(host, doc, "bad-release-signature")
    # A signed rollback intent that names 1.5.0, in a fresh spec: accepted.
    back = daemon_section(worker, "1.5.0", V15, rollback=True)
    out = as_node(host, swap_doc(worker, back, name, spec=spec_carrier(worker, back, 7)))
    assert out["ok"] is True and out["result"]["version"] == "1.5.0", out
    assert as_node(host, {"op": "daemon.confirm", "args": {"version": "1.5.0"}})["ok"] is True
    assert (host.root / LINK).read_bytes() == V15
    # Forward again at generation 8; the rollback intent of generation 7 replayed is stale now.
    install(host, worker, "2.1.0", V21, generation=8)
    refused_as_node(
        host, swap_doc(worker, back, name, spec=spec_carrier(worker, back, 7)), "stale-generation"
    )
    assert json.loads((host.root / RECORD).read_text())["spec_generation"] == 8


def test_DLV_PRIV_10_a_release_command_is_fresh_only_before_not_after_and_only_once(
    host: HelperProcess, cp: ControlPlane
) -> None:
    worker = cp.command.leaf()
    install(host, worker, "2.0.0", V20, generation=1)
    back = daemon_section(worker, "1.5.0", V15, rollback=True)
    name = stage(host.root, "bcd-1.5.0", V15)
    expired = command_carrier(worker, back, not_after_ms=int(time.time() * 1000) - 1000)
    refused_as_node(host, swap_doc(worker, back, name, command=expired), "expired-intent")
    elsewhere = command_carrier(worker, back, node="node-b")
    refused_as_node(host, swap_doc(worker, back, name, command=elsewhere), "wrong-node")
    reboot = command_carrier(worker, back, kind="node.reboot")
    refused_as_node(host, swap_doc(worker, back, name, command=reboot), "bad-intent")
    stranger = command_carrier(cp.other.leaf(), back)
    refused_as_node(host, swap_doc(worker, back, name, command=stranger), "bad-intent")
    forward = daemon_section(worker, "2.1.0", V21)
    names_other = command_carrier(worker, forward, command_id="01J0000000000000000000UPG9")
    refused_as_node(host, swap_doc(worker, back, name, command=names_other), "release-not-in-intent")
    refused_as_node(host, swap_doc(worker, back, name), "freshness-required")
    command = command_carrier(worker, back)
    assert as_node(host, swap_doc(worker, back, name, command=command))["ok"] is True
    assert as_node(host, {"op": "daemon.confirm", "args": {"version": "1.5.0"}})["ok"] is True
    install(host, worker, "2.1.0", V21, generation=2)
    # The rollback command, still before its not_after, replayed: used once already.
    refused_as_node(host, swap_doc(worker, back, name, command=command), "intent-replayed")
    assert (host.root / LINK).read_bytes() == V21


def test_DLV_PRIV_10_no_existence_oracle_outside_the_staging_directory(
    host: HelperProcess, cp: ControlPlane
) -> None:
    """The answer for root's key and for a missing file is the same: no path outside the staging
    directory is ever looked at."""
    worker = cp.command.leaf()
    key = host.root / "root/.ssh/id_ed25519"
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\n")
    key.chmod(0o600)
    section = daemon_section(worker, "2.0.0", V20)
    answers = []
    for path in ("/root/.ssh/id_ed25519", "/root/.ssh/id_missing", "../../../root/.ssh/id_ed25519"):
        doc = swap_doc(worker, section, path, spec=spec_carrier(worker, section, 1))
        answer = refused_as_node(host, doc, "bad-artifact")
        answers.append((answer["reason"], answer["message"]))
    assert len(set(answers)) == 1, answers


IN_OPEN = 0x20
IN_NONBLOCK = 0o4000


def _opens(watch_dir: Path, action: Any) -> list[str]:
    """Names under `watch_dir` opened (inotify IN_OPEN) while `action` runs."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(IN_NONBLOCK)
    assert fd >= 0
    try:
        assert libc.inotify_add_watch(fd, str(watch_dir).encode(), IN_OPEN) >= 0
        action()
        time.sleep(0.05)
        names: list[str] = []
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return names
        pos = 0
        while pos < len(data):
            _wd, _mask, _cookie, length = struct.unpack_from("iIII", data, pos)
            names.append(data[pos + 16 : pos + 16 + length].rstrip(b"\0").decode())
            pos += 16 + length
        return names
    finally:
        os.close(fd)


def test_DLV_PRIV_10_a_device_node_or_link_in_the_staging_directory_is_never_opened_as_root(
    host: HelperProcess, cp: ControlPlane
) -> None:
    worker = cp.command.leaf()
    staging = host.root / STAGING
    os.mknod(staging / "null", 0o600 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
    os.chown(staging / "null", NODE_UID, NODE_GID)
    os.mkfifo(staging / "fifo")
    os.chown(staging / "fifo", NODE_UID, NODE_GID)
    (staging / "key-link").symlink_to("/root/.ssh/id_ed25519")
    os.lchown(staging / "key-link", NODE_UID, NODE_GID)
    os.link(host.root / "etc/bcd/config.toml", staging / "hardlink")  # root's file, linked in
    section = daemon_section(worker, "2.0.0", V20)
    # The watch sees an open of the device node (so an empty list below means: not opened).
    assert "null" in _opens(staging, lambda: os.close(os.open(staging / "null", os.O_RDONLY)))
    for name in ("null", "fifo", "key-link", "hardlink"):
        doc = swap_doc(worker, section, name, spec=spec_carrier(worker, section, 1))
        opened = _opens(staging, lambda doc=doc: refused_as_node(host, doc, "bad-artifact"))
        assert name not in opened, (name, opened)
    # A staging directory another uid could write is refused before anything in it is looked at.
    good = stage(host.root, "bcd-2.0.0", V20)
    staging.chmod(0o777)
    try:
        refused_as_node(
            host, swap_doc(worker, section, good, spec=spec_carrier(worker, section, 1)), "bad-staging"
        )
    finally:
        staging.chmod(0o700)
    # The data directory swapped for a symlink to root's directory: refused, never followed.
    data_dir = host.root / "var/lib/bcd"
    data_dir.rename(host.root / "var/lib/bcd.real")
    data_dir.symlink_to("bcd.real")
    try:
        refused_as_node(
            host, swap_doc(worker, section, good, spec=spec_carrier(worker, section, 1)), "bad-staging"
        )
    finally:
        data_dir.unlink()
        (host.root / "var/lib/bcd.real").rename(data_dir)


def test_DLV_CONV_16_the_spec_must_name_this_release_for_this_node(
    host: HelperProcess, cp: ControlPlane
) -> None:
    worker = cp.command.leaf()
    section = daemon_section(worker, "2.0.0", V20)
    name = stage(host.root, "bcd-2.0.0", V20)
    other = daemon_section(worker, "2.1.0", V21)
    cases = [
        (spec_carrier(worker, other, 1), "release-not-in-intent"),
        (spec_carrier(worker, None, 1), "release-not-in-intent"),
        (spec_carrier(worker, section, 1, node="node-b"), "wrong-node"),
        (spec_carrier(cp.other.leaf(), section, 1), "bad-intent"),
        ({"body": spec_carrier(worker, section, 1)["body"], "signature": "AAAA"}, "bad-intent"),
    ]
    for spec, reason in cases:
        refused_as_node(host, swap_doc(worker, section, name, spec=spec), reason)
    doc = swap_doc(worker, section, name, spec=spec_carrier(worker, section, 1))
    doc["args"]["command"] = command_carrier(worker, section)
    refused_as_node(host, doc, "freshness-required")
    assert as_node(host, swap_doc(worker, section, name, spec=spec_carrier(worker, section, 1)))["ok"] is True


def test_an_unordered_version_is_refused(host: HelperProcess, cp: ControlPlane) -> None:
    worker = cp.command.leaf()
    section = daemon_section(worker, "nightly", V20)
    name = stage(host.root, "bcd-nightly", V20)
    refused_as_node(
        host, swap_doc(worker, section, name, spec=spec_carrier(worker, section, 1)), "unordered-version"
    )
