"""daemon.swap and daemon.confirm called in process over a temporary root whose programs are recorded
(DLV-PRIV-10; docs/mutation.md): each refusal word for word and in its order, the release record root
keeps (its strict reading, its exact fields before any effect and after a confirmation or a rollback),
the release directories and the link, the node's restart, the confirmation timer and its audited
rollback. The real helper is driven in test_daemon_swap.py and test_hostile_release.py."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from bcd_helper.ops import daemon
from bcd_helper.ops.base import RELEASE_STATE, Failed, HelperContext, Refused
from bcd_helper.ops.daemon import (
    DaemonConfirm,
    DaemonSwap,
    daemon_confirm,
    daemon_swap,
    load_release,
)
from bcd_helper.ops.hostunit import SignedIntent
from bcd_helper.protocol import structure
from bcd_shared import wire
from intentkit import ControlPlane, Signer, b64, host_body, intent
from opskit import call, context, make_root, programs
from releasekit import (
    LINK,
    NODE_ID,
    NODE_UID,
    RECORD,
    STAGING,
    command_carrier,
    daemon_section,
    spec_carrier,
    stage,
    staged_swap,
    swap_doc,
)

HELPER = f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE_UID}\nnode_gid = {NODE_UID}\n'
OLD = b"#!/bin/sh\necho bcd 1.0.0\n"
NEW = b"#!/bin/sh\necho bcd 1.1.0\n"
RESTART = ("systemctl", "--no-block", "restart", "bcd-node.service")
RELEASES = "usr/lib/bcd/releases"


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # A fresh working directory: a path root resolved against the cwd instead of its verified fd finds
    # nothing there (nor what an earlier test left).
    monkeypatch.chdir(tmp_path)
    return make_root(tmp_path)


@pytest.fixture(autouse=True)
def _a_restarted_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process calls' peer (pid 1) stands for the restarted node: a process that started after
    root's flip (round 10 dates it; test_hostile_round10.py tests the rule)."""
    monkeypatch.setattr(daemon, "start_tick", lambda _pid: daemon.boot_tick() + 10**9)


@pytest.fixture
def ctx(root: Path, cp: ControlPlane) -> Iterator[HelperContext]:
    """A host with a packaged install (a regular file) and root's join record naming the roots."""
    cp.write_record(root, NODE_ID, cp.bundle(2))
    (root / "usr/lib/bcd").mkdir(parents=True)
    (root / LINK).write_bytes(OLD)
    (root / LINK).chmod(0o755)
    c = context(root, cp.config_lines() + HELPER)
    yield c
    with c.timer_lock:
        if c.daemon_timer is not None:
            c.daemon_timer.cancel()
    c.audit.close()


def doc_for(signer: Signer, root: Path, *, data: bytes = NEW, **kw: Any) -> dict[str, Any]:
    return staged_swap(signer, root, data, **kw)["args"]


def swap(ctx: HelperContext, args: dict[str, Any]) -> dict[str, Any]:
    return daemon_swap(call(ctx, bounded=False), structure(args, DaemonSwap))


def confirm(ctx: HelperContext, version: str, healthy: bool = True) -> dict[str, Any]:
    return daemon_confirm(call(ctx), DaemonConfirm(version, healthy))


def refused(ctx: HelperContext, args: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(Refused) as info:
        swap(ctx, args)
    return info.value.reason, info.value.message


def record(root: Path) -> dict[str, Any]:
    return dict(json.loads((root / RECORD).read_text()))


def write_record(root: Path, **fields: Any) -> dict[str, Any]:
    doc = {
        "state": "confirmed",
        "version": "1.1.0",
        "sha256": hashlib.sha256(NEW).hexdigest(),
        "previous_version": "",
        "previous_sha256": hashlib.sha256(OLD).hexdigest(),
        "had_previous": True,
        "deadline_ms": 0,
        "reason": "",
        "spec_generation": 1,
        "used_commands": [],
        "flip_boot_id": "",
        "flip_tick": None,
        **fields,
    }
    path = root / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return doc


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def audit(ctx: HelperContext) -> list[dict[str, Any]]:
    path = ctx.root / ctx.config.audit_dir.lstrip("/") / "audit.log"
    return [json.loads(line) for line in path.read_bytes().splitlines() if line]


# --- the release record ----------------------------------------------------------------------------------


def test_no_record_is_none_and_an_old_record_gets_the_new_fields(ctx: HelperContext, root: Path) -> None:
    assert load_release(ctx) is None
    old = write_record(root)
    del old["spec_generation"], old["used_commands"], old["flip_boot_id"], old["flip_tick"]
    (root / RECORD).write_text(json.dumps(old))
    expected = {**old, "spec_generation": 0, "used_commands": [], "flip_boot_id": "", "flip_tick": None}
    assert load_release(ctx) == expected


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            {"extra": 1},
            "keys are not ['deadline_ms', 'flip_boot_id', 'flip_tick', 'had_previous', 'previous_sha256', "
            "'previous_version', 'reason', 'sha256', 'spec_generation', 'state', 'used_commands', 'version']",
        ),
        ({"state": "swapping"}, "state 'swapping'"),
        ({"deadline_ms": "1"}, "deadline_ms or had_previous has the wrong type"),
        ({"deadline_ms": True}, "deadline_ms or had_previous has the wrong type"),
        ({"had_previous": 1}, "deadline_ms or had_previous has the wrong type"),
        ({"spec_generation": 1.0}, "spec_generation or used_commands has the wrong type"),
        ({"used_commands": "x"}, "spec_generation or used_commands has the wrong type"),
        ({"used_commands": ["a", 1]}, "used_commands must be strings"),
        ({"version": "../x"}, "version '../x' is not a release version"),
        ({"version": ".."}, "version '..' is not a release version"),
        ({"version": 7}, "version 7 is not a release version"),
        ({"previous_version": "a/b"}, "previous_version 'a/b' is not a release version"),
    ],
)
def test_a_record_that_breaks_a_rule_cannot_be_read(
    ctx: HelperContext, root: Path, change: dict[str, Any], why: str
) -> None:
    write_record(root, **change)
    with pytest.raises(Failed) as info:
        load_release(ctx)
    assert (info.value.reason, info.value.message) == (
        "release-state",
        f"{RELEASE_STATE} cannot be read: {why}",
    )


def test_a_record_that_is_not_json_or_not_an_object_cannot_be_read(ctx: HelperContext, root: Path) -> None:
    write_record(root)
    (root / RECORD).write_text("[]")
    with pytest.raises(Failed) as info:
        load_release(ctx)
    assert info.value.message.startswith(f"{RELEASE_STATE} cannot be read: keys are not ")
    (root / RECORD).write_text("{")
    with pytest.raises(Failed) as info:
        load_release(ctx)
    assert info.value.message.startswith(f"{RELEASE_STATE} cannot be read: Expecting property name")


def test_a_record_behind_a_symlink_is_refused(ctx: HelperContext, root: Path) -> None:
    write_record(root)
    (root / RECORD).rename(root / "elsewhere.json")
    (root / RECORD).symlink_to(root / "elsewhere.json")
    with pytest.raises(Failed) as info:
        load_release(ctx)
    assert info.value.reason == "release-state"
    assert info.value.message.startswith(f"{RELEASE_STATE}: {RELEASE_STATE} is not a regular file")


def test_empty_versions_are_allowed_in_a_record(ctx: HelperContext, root: Path) -> None:
    doc = write_record(root, version="", previous_version="")
    assert load_release(ctx) == doc


# --- arguments --------------------------------------------------------------------------------------------


def test_the_arguments_are_checked_first_in_order(ctx: HelperContext, root: Path, worker: Signer) -> None:
    good = doc_for(worker, root)
    cases = [
        (
            {"url": "http://releases.example.com/bcd"},
            "bad-manifest",
            "daemon.swap: bad-release-manifest: url: ",
        ),
        ({"confirm_timeout_s": 0}, "bad-arguments", "daemon.swap: confirm_timeout_s must be 1 to 3600"),
        ({"confirm_timeout_s": 3601}, "bad-arguments", "daemon.swap: confirm_timeout_s must be 1 to 3600"),
        ({"artifact": "../bcd"}, "bad-artifact", "daemon.swap: artifact must be one file name in "),
        ({"artifact": ".bcd"}, "bad-artifact", "daemon.swap: artifact must be one file name in "),
        ({"artifact": "b" * 129}, "bad-artifact", "daemon.swap: artifact must be one file name in "),
        ({"artifact": "bcd\n"}, "bad-artifact", "daemon.swap: artifact must be one file name in "),
        ({"signature": "!!"}, "bad-arguments", "daemon.swap: signature is not base64"),
        ({"signature": "é"}, "bad-arguments", "daemon.swap: signature is not base64"),
        ({"chain": [good["chain"][0], "a"]}, "bad-arguments", "daemon.swap: chain[1] is not base64"),
        ({"trust_bundle": "x y"}, "bad-arguments", "daemon.swap: trust_bundle is not base64"),
    ]
    for change, reason, start in cases:
        got = refused(ctx, {**good, **change})
        assert got[0] == reason and got[1].startswith(start), (change, got)
    assert refused(ctx, {**good, "artifact": "../bcd"})[1] == (
        "daemon.swap: artifact must be one file name in /var/lib/bcd/staging ([A-Za-z0-9._+~-], 1-128, not "
        "starting with a dot), not a path"
    )
    assert programs(ctx).runs == [] and not (root / RECORD).exists()


def test_the_confirmation_timeout_may_be_1_s_to_an_hour_and_the_name_128(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    name = "b" * 128
    args = doc_for(worker, root, timeout=3600)
    stage(root, name, NEW)
    got = swap(ctx, {**args, "artifact": name})
    assert got["confirm_by_ms"] - int(time.time() * 1000) > 3590_000
    assert ctx.daemon_timer is not None and ctx.daemon_timer.interval == 3600
    confirm(ctx, "1.1.0")
    got = swap(ctx, doc_for(worker, root, version="1.2.0", data=NEW + b"2", timeout=1, generation=2))
    assert ctx.daemon_timer.interval == 1  # type: ignore[union-attr]


def test_a_swap_waits_for_the_previous_ones_confirmation(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    write_record(root, state="pending", version="1.0.5")
    assert refused(ctx, doc_for(worker, root)) == (
        "swap-pending",
        "daemon.swap: the swap to 1.0.5 still waits for its daemon.confirm",
    )


def test_without_roots_no_release_is_verified(root: Path, worker: Signer) -> None:
    c = context(root, HELPER)
    try:
        assert refused(c, doc_for(worker, root)) == (
            "intent-unverifiable",
            "daemon.swap: no command-signing roots (command_root_sha256, root's join record or a trust "
            "bundle) to verify the release against",
        )
    finally:
        c.audit.close()


def test_a_bundle_the_node_presents_names_the_roots(root: Path, cp: ControlPlane, worker: Signer) -> None:
    (root / "usr/lib/bcd").mkdir(parents=True)
    c = context(root, cp.config_lines() + HELPER)
    try:
        args = doc_for(worker, root)
        assert refused(c, args)[0] == "join-record-required"
        got = swap(c, {**args, "trust_bundle": b64(cp.bundle(1))})
        assert got["version"] == "1.1.0" and record(root)["had_previous"] is False
    finally:
        with c.timer_lock:
            if c.daemon_timer is not None:
                c.daemon_timer.cancel()
        c.audit.close()


def test_a_release_signed_by_another_hierarchy_is_refused(
    ctx: HelperContext, root: Path, cp: ControlPlane
) -> None:
    reason, message = refused(ctx, doc_for(cp.other.leaf(), root))
    assert reason == "bad-release-signature"
    assert message.startswith("daemon.swap: the release signature is refused: ")


# --- freshness ------------------------------------------------------------------------------------------


def test_exactly_one_freshness_carrier(ctx: HelperContext, root: Path, worker: Signer) -> None:
    args = doc_for(worker, root)
    section = daemon_section(worker, "1.1.0", NEW)
    message = (
        "daemon.swap: the release must come with exactly one of `spec` (the signed spec whose daemon section "
        "names it) or `command` (the signed daemon.upgrade command that names it)"
    )
    assert refused(ctx, {k: v for k, v in args.items() if k != "spec"}) == ("freshness-required", message)
    both = {**args, "command": command_carrier(worker, section)}
    assert refused(ctx, both) == ("freshness-required", message)


def test_a_carrier_past_its_size_or_not_base64_is_refused(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    args = doc_for(worker, root)
    section = daemon_section(worker, "1.1.0", NEW)
    big = {"body": "A" * (2 * daemon.MAX_INTENT + 4), "signature": ""}
    assert refused(ctx, {**args, "spec": big}) == (
        "too-large",
        "daemon.swap: the signed spec is larger than 1048576 bytes",
    )
    command = {**args, "command": big}
    del command["spec"]
    assert refused(ctx, command) == (
        "too-large",
        "daemon.swap: the signed daemon.upgrade command is larger than 1048576 bytes",
    )
    # At the limit: read, and refused only by its signature.
    edge = {"body": "A" * (2 * daemon.MAX_INTENT), "signature": ""}
    reason, message = refused(ctx, {**args, "spec": edge})
    assert reason == "bad-intent" and message.startswith("daemon.swap: the signed spec is refused: ")
    carrier = spec_carrier(worker, section, 1)
    assert (
        refused(ctx, {**args, "spec": {**carrier, "body": "!"}})[1] == "daemon.swap: spec.body is not base64"
    )
    assert refused(ctx, {**args, "spec": {**carrier, "signature": "!"}})[1] == (
        "daemon.swap: spec.signature is not base64"
    )
    cmd = command_carrier(worker, section)
    assert refused(ctx, {**command, "command": {**cmd, "body": "!"}})[1] == (
        "daemon.swap: command.body is not base64"
    )
    assert refused(ctx, {**command, "command": {**cmd, "signature": "!"}})[1] == (
        "daemon.swap: command.signature is not base64"
    )


def test_the_spec_must_be_signed_for_this_node_and_fresh(
    ctx: HelperContext, root: Path, worker: Signer, cp: ControlPlane
) -> None:
    section = daemon_section(worker, "1.1.0", NEW)
    args = doc_for(worker, root)
    reason, message = refused(ctx, {**args, "spec": spec_carrier(cp.other.leaf(), section, 1)})
    assert reason == "bad-intent" and message.startswith("daemon.swap: the signed spec is refused: ")
    assert refused(ctx, {**args, "spec": spec_carrier(worker, section, 1, node="node-b")}) == (
        "wrong-node",
        "daemon.swap: the signed spec is for node 'node-b'",
    )
    # The generation floor: the last swap's spec (here 5).
    write_record(root, spec_generation=5, version="1.0.9", sha256=sha(b"x"))
    assert refused(ctx, {**args, "spec": spec_carrier(worker, section, 4)}) == (
        "stale-generation",
        "daemon.swap: the signed spec's generation 4 is older than generation 5 already accepted: its "
        "release is not fresh",
    )
    got = swap(ctx, {**args, "spec": spec_carrier(worker, section, 5)})
    assert got["version"] == "1.1.0" and record(root)["spec_generation"] == 5


def test_the_spec_generation_floor_is_also_roots_intent_state(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    """A host.unit or access.apply spec at generation 7 was accepted: a spec of 6 is not fresh."""
    state = root / "var/lib/bcd-hostconfig/helper-intent.json"
    verifier = ctx.intent_verifier()
    signed = structure(intent(worker, host_body(NODE_ID, 7, None)), SignedIntent)
    checked = verifier.check_spec("host.unit", signed)
    assert checked.next_state is not None
    verifier.save_state(checked.next_state)
    assert json.loads(state.read_text())["generation"] == 7
    section = daemon_section(worker, "1.1.0", NEW)
    args = doc_for(worker, root)
    assert refused(ctx, {**args, "spec": spec_carrier(worker, section, 6)})[0] == "stale-generation"
    assert swap(ctx, {**args, "spec": spec_carrier(worker, section, 7)})["version"] == "1.1.0"


def spec_with(
    signer: Signer, generation: int, *, patch: bool, section: wire.DaemonSection | None
) -> dict[str, str]:
    from bcd_shared.pki import Purpose

    if patch:
        body = bytes(
            wire.DesiredStateBody(
                node_id=NODE_ID,
                generation=generation,
                spec_hash=f"p{generation}",
                patch=wire.NodeSpecPatch(daemon=section),
                base_generation=generation - 1,
            )
        )
    else:
        body = bytes(
            wire.DesiredStateBody(
                node_id=NODE_ID, generation=generation, spec_hash=f"h{generation}", full=wire.NodeSpec()
            )
        )
    return {"body": b64(body), "signature": b64(signer.key.sign(Purpose.DESIRED_STATE, body))}


def test_the_spec_must_name_exactly_this_release(ctx: HelperContext, root: Path, worker: Signer) -> None:
    args = doc_for(worker, root)
    section = daemon_section(worker, "1.1.0", NEW)
    for spec in (
        spec_with(worker, 2, patch=False, section=None),
        spec_with(worker, 2, patch=True, section=None),
    ):
        assert refused(ctx, {**args, "spec": spec}) == (
            "release-not-in-intent",
            "daemon.swap: the signed spec (generation 2) sets no daemon section",
        )
    other_signature = daemon_section(ControlPlane.build().command.leaf(), "1.1.0", NEW).signature
    for change in (
        {"version": "1.1.1"},
        {"url": "https://releases.example.com/other"},
        {"sha256": "0" * 64},
        {"signature": other_signature},
        {"rollback": True},
    ):
        fields = {
            "version": section.version,
            "url": section.url,
            "sha256": section.sha256,
            "signature": section.signature,
            "rollback": section.rollback,
            **change,
        }
        named = wire.DaemonSection(**fields)
        got = refused(ctx, {**args, "spec": spec_carrier(worker, named, 2)})
        shown = change.get("version", "1.1.0")
        assert got == (
            "release-not-in-intent",
            f"daemon.swap: the signed spec names another release ({shown!r}); the manifest must be exactly "
            "the one it names",
        ), change
    # A patch that sets the section names it too.
    assert (
        swap(ctx, {**args, "spec": spec_with(worker, 2, patch=True, section=section)})["version"] == "1.1.0"
    )


def command_args(worker: Signer, root: Path, **carrier: Any) -> dict[str, Any]:
    args = doc_for(worker, root)
    del args["spec"]
    args["command"] = command_carrier(worker, daemon_section(worker, "1.1.0", NEW), **carrier)
    return args


def test_the_daemon_upgrade_command_binds_the_release(ctx: HelperContext, root: Path, worker: Signer) -> None:
    now_ms = int(time.time() * 1000)
    bad = command_args(worker, root, kind="node.reboot")
    assert refused(ctx, bad) == (
        "bad-intent",
        "daemon.swap: the signed command is 'node.reboot', not daemon.upgrade",
    )
    assert refused(ctx, command_args(worker, root, node="node-b")) == (
        "wrong-node",
        "daemon.swap: the signed command is for node 'node-b'",
    )
    reason, message = refused(ctx, command_args(worker, root, not_after_ms=now_ms - 1))
    assert reason == "expired-intent" and message.startswith(
        "daemon.swap: the signed daemon.upgrade command 01J0000000000000000000UPG1 expired (not_after "
        f"{now_ms - 1}, now "
    )
    assert message.endswith("): its release is not fresh")
    assert refused(ctx, command_args(worker, root, command_id="")) == (
        "intent-replayed",
        "daemon.swap: the daemon.upgrade command '' was already used",
    )
    write_record(root, version="1.0.9", sha256=sha(b"x"), used_commands=["01J0000000000000000000UPG1"])
    assert refused(ctx, command_args(worker, root)) == (
        "intent-replayed",
        "daemon.swap: the daemon.upgrade command '01J0000000000000000000UPG1' was already used",
    )
    got = swap(ctx, command_args(worker, root, command_id="01J0000000000000000000UPG2"))
    assert got["version"] == "1.1.0"
    assert (record(root)["used_commands"], record(root)["spec_generation"]) == (
        ["01J0000000000000000000UPG1", "01J0000000000000000000UPG2"],
        1,
    )


def test_a_command_signed_for_another_purpose_or_payload_is_refused(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    from bcd_shared.pki import Purpose
    from bcd_shared.wire.strict import type_url

    args = command_args(worker, root)
    as_spec = {**args["command"]}
    body = base64.b64decode(as_spec["body"])
    as_spec["signature"] = b64(worker.key.sign(Purpose.DESIRED_STATE, body))
    reason, message = refused(ctx, {**args, "command": as_spec})
    assert reason == "bad-intent" and message.startswith(
        "daemon.swap: the signed daemon.upgrade command is refused: "
    )
    wrong = bytes(
        wire.CommandBody(
            id="01J0000000000000000000UPG3",
            node_id=NODE_ID,
            seq=1,
            kind="daemon.upgrade",
            payload=wire.ProtoAny(type_url=type_url(wire.NodeRebootRequest), value=b""),
            lane=wire.Lane.CONTROL,
            not_after=int(time.time() * 1000) + 60_000,
        )
    )
    carrier = {"body": b64(wrong), "signature": b64(worker.key.sign(Purpose.COMMAND, wrong))}
    reason, message = refused(ctx, {**args, "command": carrier})
    assert reason == "bad-intent" and message.startswith("daemon.swap: the signed command does not decode: ")


def test_the_command_must_name_exactly_this_release(ctx: HelperContext, root: Path, worker: Signer) -> None:
    args = doc_for(worker, root)
    del args["spec"]
    other = daemon_section(worker, "1.2.0", NEW)
    args["command"] = command_carrier(worker, other)
    assert refused(ctx, args) == (
        "release-not-in-intent",
        "daemon.swap: the signed daemon.upgrade command names another release ('1.2.0'); the manifest must "
        "be exactly the one it names",
    )


# --- order ----------------------------------------------------------------------------------------------


def test_releases_only_move_forward_unless_a_signed_rollback_names_one(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    write_record(root, version="1.2.0", sha256=sha(b"1.2.0"), spec_generation=1)
    assert refused(ctx, doc_for(worker, root, generation=2)) == (
        "downgrade",
        "daemon.swap: 1.1.0 is older than the installed 1.2.0: releases only move forward unless a signed "
        "rollback intent names the version",
    )
    got = swap(ctx, doc_for(worker, root, generation=2, rollback=True))
    assert got["version"] == "1.1.0" and record(root)["state"] == "pending"


def test_the_installed_version_again_is_a_restart_and_another_artifact_for_it_is_refused(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    write_record(root, previous_version="1.0.0")
    got = swap(ctx, doc_for(worker, root, generation=2))
    assert got == {
        "version": "1.1.0",
        "previous_version": "1.0.0",
        "path": "/usr/lib/bcd/bcd",
        "already_installed": True,
        "restart": "restarted bcd-node.service",
    }
    assert programs(ctx).runs == [RESTART] and programs(ctx).timeouts == [60]
    assert refused(ctx, doc_for(worker, root, data=NEW + b"other", generation=2)) == (
        "version-reused",
        "daemon.swap: version 1.1.0 is installed with another SHA-256: one version names one artifact",
    )


def test_a_version_with_no_order_is_refused_and_an_installed_one_is_older_than_any(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    assert refused(ctx, doc_for(worker, root, version="nightly")) == (
        "unordered-version",
        "daemon.swap: unordered-version: version 'nightly' has no release order (N(.N)* with an optional "
        "aN, bN, rcN, .postN or .devN suffix)",
    )
    write_record(root, version="nightly", sha256=sha(NEW))
    assert swap(ctx, doc_for(worker, root, generation=2))["version"] == "1.1.0"


def test_a_pending_or_missing_record_sets_no_floor(ctx: HelperContext, root: Path) -> None:
    manifest = daemon._Manifest("0.1.0", "u", sha(NEW), b"", False)
    assert daemon._check_order(manifest, None) is False
    pending = write_record(root, state="pending", version="9.0.0")
    assert daemon._check_order(manifest, pending) is False
    none_installed = write_record(root, version="")
    assert daemon._check_order(manifest, none_installed) is False


def test_a_release_just_rolled_back_is_not_tried_again_by_the_same_spec(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    write_record(
        root,
        state="rolled-back",
        version="1.0.0",
        sha256=sha(OLD),
        previous_version="1.1.0",
        previous_sha256=sha(NEW),
        spec_generation=3,
        reason="not confirmed before its deadline",
    )
    assert refused(ctx, doc_for(worker, root, generation=3)) == (
        "release-failed",
        "daemon.swap: 1.1.0 was rolled back (not confirmed before its deadline); only a newer spec than "
        "generation 3 or a daemon.upgrade command tries it again",
    )
    # Another artifact under another version, a newer spec, or a command try again.
    assert swap(ctx, doc_for(worker, root, generation=4))["version"] == "1.1.0"


def test_a_rolled_back_release_comes_back_by_command(ctx: HelperContext, root: Path, worker: Signer) -> None:
    write_record(
        root,
        state="rolled-back",
        version="1.0.0",
        sha256=sha(OLD),
        previous_version="1.1.0",
        previous_sha256=sha(NEW),
        spec_generation=3,
    )
    assert swap(ctx, command_args(worker, root))["version"] == "1.1.0"


def test_only_the_same_release_rolled_back_is_release_failed(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    base = {
        "state": "rolled-back",
        "version": "1.0.0",
        "sha256": sha(OLD),
        "previous_version": "1.1.0",
        "previous_sha256": sha(NEW),
        "spec_generation": 3,
    }
    for change in ({"state": "confirmed"}, {"previous_version": "1.0.9"}, {"previous_sha256": sha(b"y")}):
        write_record(root, **{**base, **change})
        assert swap(ctx, doc_for(worker, root, generation=3))["version"] == "1.1.0", change
        (root / RECORD).unlink()
        if ctx.daemon_timer is not None:
            ctx.daemon_timer.cancel()


# --- the artifact ---------------------------------------------------------------------------------------


def test_the_artifact_must_match_the_signed_sha256(ctx: HelperContext, root: Path, worker: Signer) -> None:
    args = doc_for(worker, root)
    stage(root, args["artifact"], b"tampered")
    reason, message = refused(ctx, args)
    assert (
        reason == "artifact-mismatch" and message.startswith("daemon.swap: ") and sha(b"tampered") in message
    )
    assert not (root / RECORD).exists() and (root / LINK).read_bytes() == OLD


@pytest.mark.parametrize("kind", ["root-owned", "symlink", "hardlink", "fifo", "directory"])
def test_an_artifact_that_is_not_a_plain_file_of_the_node_is_never_opened(
    ctx: HelperContext, root: Path, worker: Signer, kind: str
) -> None:
    args = doc_for(worker, root)
    path = root / STAGING / args["artifact"]
    if kind == "root-owned":
        os.chown(path, 0, 0)
    elif kind == "symlink":
        path.rename(path.with_name("real"))
        path.symlink_to("real")
        os.lchown(path, NODE_UID, NODE_UID)
    elif kind == "hardlink":
        os.link(path, path.with_name("second"))
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
        os.chown(path, NODE_UID, NODE_UID)
    else:
        path.unlink()
        path.mkdir()
        os.chown(path, NODE_UID, NODE_UID)
    assert refused(ctx, args) == (
        "bad-artifact",
        f"daemon.swap: artifact /{STAGING}/{args['artifact']} must be a regular file owned by the node "
        f"(uid {NODE_UID}) with one link",
    )


def test_a_missing_or_oversized_artifact_is_refused(ctx: HelperContext, root: Path, worker: Signer) -> None:
    args = doc_for(worker, root)
    path = root / STAGING / args["artifact"]
    path.unlink()
    assert refused(ctx, args) == (
        "bad-artifact",
        f"daemon.swap: artifact /{STAGING}/bcd-1.1.0: No such file or directory",
    )
    with path.open("wb") as f:
        f.truncate(daemon.MAX_ARTIFACT + 1)  # sparse: nothing is read
    os.chown(path, NODE_UID, NODE_UID)
    assert refused(ctx, args) == (
        "too-large",
        f"daemon.swap: artifact /{STAGING}/bcd-1.1.0 is larger than {daemon.MAX_ARTIFACT} bytes",
    )


@pytest.mark.parametrize("where", ["var/lib/bcd", STAGING])
@pytest.mark.parametrize("how", ["owner", "group-writable", "other-writable"])
def test_the_staging_directory_and_the_one_above_are_the_nodes_alone(
    ctx: HelperContext, root: Path, worker: Signer, where: str, how: str
) -> None:
    args = doc_for(worker, root)
    d = root / where
    if how == "owner":
        os.chown(d, NODE_UID + 1, NODE_UID)
    else:
        d.chmod(0o720 if how == "group-writable" else 0o702)
    assert refused(ctx, args) == (
        "bad-staging",
        f"daemon.swap: /{STAGING} (and the data directory above it) must be owned by the node (uid "
        f"{NODE_UID}) and writable by nobody else",
    )


def test_a_staging_directory_missing_or_behind_a_symlink_is_refused(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    args = doc_for(worker, root)
    (root / STAGING / args["artifact"]).unlink()
    (root / STAGING).rmdir()
    assert refused(ctx, args) == (
        "bad-staging",
        f"daemon.swap: the staging directory /{STAGING}: No such file or directory",
    )
    (root / STAGING).symlink_to("/tmp")
    assert refused(ctx, args) == (
        "bad-staging",
        f"daemon.swap: the staging directory /{STAGING}: Not a directory",
    )


# --- the swap -------------------------------------------------------------------------------------------


def test_DLV_PRIV_10_a_packaged_install_becomes_the_initial_release(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    before = int(time.time() * 1000)
    got = swap(ctx, doc_for(worker, root, generation=4, timeout=90))
    after = int(time.time() * 1000)
    assert got == {
        "version": "1.1.0",
        "previous_version": "",
        "path": "/usr/lib/bcd/bcd",
        "confirm_by_ms": got["confirm_by_ms"],
        "restart": "restarted bcd-node.service",
    }
    assert before + 90_000 <= got["confirm_by_ms"] <= after + 90_000
    assert os.readlink(root / LINK) == "releases/1.1.0/bcd"
    for name, data in (("1.1.0", NEW), ("initial", OLD)):
        st = (root / RELEASES / name / "bcd").stat()
        assert ((root / RELEASES / name / "bcd").read_bytes(), st.st_mode & 0o7777, st.st_uid) == (
            data,
            0o755,
            0,
        )
    assert record(root) == {
        "state": "pending",
        "version": "1.1.0",
        "sha256": sha(NEW),
        "previous_version": "",
        "previous_sha256": sha(OLD),
        "had_previous": True,
        "deadline_ms": got["confirm_by_ms"],
        "reason": "",
        "spec_generation": 4,
        "used_commands": [],
        "flip_boot_id": daemon.boot_id(),
        "flip_tick": record(root)["flip_tick"],
    }
    # The flip's tick, taken after it, had ended when the answer came (round 10).
    assert 0 < record(root)["flip_tick"] < daemon.boot_tick()
    text = (root / RECORD).read_text()
    assert text == json.dumps(record(root), sort_keys=True, indent=1) + "\n"
    assert (root / RECORD).stat().st_mode & 0o777 == 0o600
    assert programs(ctx).runs == [RESTART]
    timer = ctx.daemon_timer
    assert (
        isinstance(timer, threading.Timer)
        and timer.daemon
        and timer.is_alive()
        and not timer.finished.is_set()
        and timer.interval == 90
    )
    assert timer.args == (ctx, "1.1.0")
    # Confirmed: the timer is stopped, the record says so, both releases are kept.
    assert confirm(ctx, "1.1.0") == {"version": "1.1.0", "confirmed": True, "previous_version": ""}
    assert ctx.daemon_timer is None and timer.finished.is_set()
    assert record(root)["state"] == "confirmed"
    assert sorted(os.listdir(root / RELEASES)) == ["1.1.0", "initial"]


def test_a_host_without_an_install_gets_its_first_release(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    (root / LINK).unlink()
    got = swap(ctx, doc_for(worker, root))
    assert got["previous_version"] == ""
    rec = record(root)
    assert (rec["had_previous"], rec["previous_sha256"], rec["previous_version"]) == (False, "", "")
    assert os.listdir(root / RELEASES) == ["1.1.0"]
    # Unhealthy: the link is removed, there is nothing to go back to.
    got = confirm(ctx, "1.1.0", healthy=False)
    assert got == {
        "version": "",
        "failed_version": "1.1.0",
        "rolled_back": True,
        "restart": "restarted bcd-node.service",
    }
    assert not os.path.lexists(root / LINK)


def test_DLV_PRIV_10_forward_swaps_keep_the_installed_and_the_previous_release(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    swap(ctx, doc_for(worker, root))
    confirm(ctx, "1.1.0")
    (root / RELEASES / "notes.txt").write_text("not a release\n")
    (root / RELEASES / ".hidden").mkdir()
    got = swap(ctx, doc_for(worker, root, version="1.2.0", data=NEW + b"2", generation=2))
    assert got["previous_version"] == "1.1.0"
    rec = record(root)
    assert (rec["previous_version"], rec["previous_sha256"], rec["had_previous"]) == ("1.1.0", sha(NEW), True)
    assert confirm(ctx, "1.2.0") == {"version": "1.2.0", "confirmed": True, "previous_version": "1.1.0"}
    assert sorted(os.listdir(root / RELEASES)) == [".hidden", "1.1.0", "1.2.0", "notes.txt"]
    swap(ctx, doc_for(worker, root, version="1.3.0", data=NEW + b"3", generation=3))
    confirm(ctx, "1.3.0")
    assert sorted(os.listdir(root / RELEASES)) == [".hidden", "1.2.0", "1.3.0", "notes.txt"]
    assert (root / LINK).read_bytes() == NEW + b"3"


def test_an_installed_path_that_is_neither_link_nor_file_fails_the_swap(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    (root / LINK).unlink()
    (root / LINK).mkdir()
    with pytest.raises(Failed) as info:
        swap(ctx, doc_for(worker, root))
    assert (info.value.reason, info.value.message) == (
        "swap",
        "daemon.swap: /usr/lib/bcd/bcd: /usr/lib/bcd/bcd is neither a release link nor a regular file",
    )
    assert not (root / RECORD).exists()


def test_a_link_outside_the_releases_is_not_read(ctx: HelperContext, root: Path, worker: Signer) -> None:
    (root / LINK).unlink()
    (root / LINK).symlink_to("/etc/passwd")
    swap(ctx, doc_for(worker, root))
    assert record(root)["previous_sha256"] == "" and record(root)["had_previous"] is True


@pytest.mark.parametrize(
    ("link", "plain"),
    [
        ("", True),
        ("releases/1.0.0/bcd", True),
        ("releases/initial/bcd", True),
        ("releases/1.0.0/x", False),
        ("other/1.0.0/bcd", False),
        ("releases/../bcd", False),
        ("releases/./bcd", False),
        ("releases/1.0.0/bcd/x", False),
        ("releases/bcd", False),
        ("/etc/passwd", False),
    ],
)
def test_only_a_link_into_a_release_directory_is_followed(link: str, plain: bool) -> None:
    assert daemon._plain_link(link) is plain


def test_a_failed_write_puts_the_record_back(ctx: HelperContext, root: Path, worker: Signer) -> None:
    (root / RELEASES).parent.mkdir(parents=True, exist_ok=True)
    (root / RELEASES).symlink_to("/tmp")
    with pytest.raises(Failed) as info:
        swap(ctx, doc_for(worker, root))
    assert info.value.reason == "swap"
    assert info.value.message.startswith("daemon.swap: /usr/lib/bcd/releases")
    assert info.value.message.endswith("; the previous release stays installed")
    assert not (root / RECORD).exists() and (root / LINK).read_bytes() == OLD
    # With a record before, that record is put back as it was.
    doc = write_record(root, version="1.0.5", sha256=sha(b"x"), used_commands=["c1"])
    with pytest.raises(Failed):
        swap(ctx, doc_for(worker, root))
    assert record(root) == doc
    assert ctx.daemon_timer is None and programs(ctx).runs == []


def test_a_record_that_cannot_be_put_back_is_said(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bcd_shared.rootpath import RootPathRefused

    (root / RELEASES).parent.mkdir(parents=True, exist_ok=True)
    (root / RELEASES).symlink_to("/tmp")

    def refuse(where: Path, path: str) -> bool:
        raise RootPathRefused(path, f"{path}: refused for the test")

    monkeypatch.setattr(daemon, "remove_root_only", refuse)
    with pytest.raises(Failed) as info:
        swap(ctx, doc_for(worker, root))
    assert info.value.reason == "swap"
    assert info.value.message.endswith(
        f"; the record could not be put back: {RELEASE_STATE}: refused for the test"
    )


# --- confirm, roll back, the timer --------------------------------------------------------------------------


def test_confirm_needs_the_pending_swap(ctx: HelperContext, root: Path) -> None:
    for state in (None, "confirmed", "rolled-back"):
        if state is not None:
            write_record(root, state=state)
        with pytest.raises(Refused) as info:
            confirm(ctx, "1.1.0")
        assert (info.value.reason, info.value.message) == (
            "no-pending-swap",
            "daemon.confirm: no swap waits for a confirmation",
        )
    write_record(root, state="pending")
    with pytest.raises(Refused) as info:
        confirm(ctx, "9.9.9\n")
    assert (info.value.reason, info.value.message) == (
        "version-mismatch",
        "daemon.confirm: the pending swap is to 1.1.0, not '9.9.9\\n'",
    )


def test_DLV_PRIV_10_an_unhealthy_release_rolls_back(ctx: HelperContext, root: Path, worker: Signer) -> None:
    swap(ctx, doc_for(worker, root, generation=2))
    timer = ctx.daemon_timer
    programs(ctx).runs.clear()
    got = confirm(ctx, "1.1.0", healthy=False)
    assert got == {
        "version": "",
        "failed_version": "1.1.0",
        "rolled_back": True,
        "restart": "restarted bcd-node.service",
    }
    assert ctx.daemon_timer is None and timer is not None and timer.finished.is_set()
    assert os.readlink(root / LINK) == "releases/initial/bcd" and (root / LINK).read_bytes() == OLD
    rec = record(root)
    assert rec == {
        "state": "rolled-back",
        "version": "",
        "sha256": sha(OLD),
        "previous_version": "1.1.0",
        "previous_sha256": sha(NEW),
        "had_previous": True,
        "deadline_ms": rec["deadline_ms"],
        "reason": "the new release reported itself unhealthy",
        "spec_generation": 2,
        "used_commands": [],
        "flip_boot_id": daemon.boot_id(),
        "flip_tick": rec["flip_tick"],
    }
    assert programs(ctx).runs == [RESTART]


def test_a_rollback_to_a_release_that_is_gone_fails(ctx: HelperContext, root: Path, worker: Signer) -> None:
    swap(ctx, doc_for(worker, root))
    (root / RELEASES / "initial/bcd").unlink()
    with pytest.raises(Failed) as info:
        confirm(ctx, "1.1.0", healthy=False)
    assert (info.value.reason, info.value.message) == (
        "rollback",
        "/usr/lib/bcd/releases/initial/bcd is missing: the previous release is gone",
    )
    assert os.readlink(root / LINK) == "releases/1.1.0/bcd" and record(root)["state"] == "pending"


def test_a_failed_restart_is_reported_not_raised(ctx: HelperContext, root: Path) -> None:
    programs(ctx).script = lambda argv: (5, b"", b"Failed to restart bcd-node.service: Unit not found.\n" * 9)
    got = daemon._restart_node(ctx)
    err = ("Failed to restart bcd-node.service: Unit not found.\n" * 9)[:200]
    assert got == f"systemctl restart bcd-node.service: exit 5: {err}"

    def missing(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        raise FileNotFoundError(2, "No such file or directory", "systemctl")

    programs(ctx).script = missing
    assert daemon._restart_node(ctx) == "systemctl: [Errno 2] No such file or directory: 'systemctl'"


def test_the_timer_rolls_back_an_unconfirmed_swap_and_audits_it(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap(ctx, doc_for(worker, root))
    assert ctx.daemon_timer is not None
    ctx.daemon_timer.cancel()
    rec = record(root)
    (root / RECORD).write_text(json.dumps({**rec, "deadline_ms": int(time.time() * 1000) - 1}))
    ticks = iter((100.0, 100.25))
    monkeypatch.setattr(daemon, "time", SimpleNamespace(monotonic=lambda: next(ticks), time=time.time))
    daemon._expire(ctx, "1.1.0")
    monkeypatch.undo()
    assert record(root)["state"] == "rolled-back"
    assert record(root)["reason"] == "not confirmed before its deadline"
    last = audit(ctx)[-1]
    result = {
        "version": "",
        "failed_version": "1.1.0",
        "rolled_back": True,
        "restart": "restarted bcd-node.service",
    }
    assert (last["op"], last["decision"], last["reason"], last["peer_uid"], last["peer_pid"]) == (
        "daemon.rollback",
        "accepted",
        "confirm-timeout",
        0,
        os.getpid(),
    )
    assert last["args"] == {"version": "1.1.0"}
    assert last["args_sha256"] == sha(b"1.1.0")
    assert last["message"] == json.dumps(result, sort_keys=True)
    assert last["duration_ms"] == 250.0


def test_the_timer_leaves_what_is_not_its_swap(ctx: HelperContext, root: Path) -> None:
    n = len(audit(ctx)) if (root / ctx.config.audit_dir.lstrip("/") / "audit.log").exists() else 0
    daemon._expire(ctx, "1.1.0")  # no record
    write_record(root, state="confirmed")
    daemon._expire(ctx, "1.1.0")
    write_record(root, state="pending", version="1.2.0", deadline_ms=0)
    daemon._expire(ctx, "1.1.0")
    assert record(root)["state"] == "pending"
    path = root / ctx.config.audit_dir.lstrip("/") / "audit.log"
    assert (len(audit(ctx)) if path.exists() else 0) == n


def test_the_timer_rearms_for_a_deadline_not_yet_reached(ctx: HelperContext, root: Path) -> None:
    write_record(root, state="pending", deadline_ms=int(time.time() * 1000) + 3_000_000)
    daemon._expire(ctx, "1.1.0")
    timer = ctx.daemon_timer
    assert timer is not None and 2999 < timer.interval <= 3000 and timer.args == (ctx, "1.1.0")
    assert record(root)["state"] == "pending"


def test_a_rollback_the_timer_cannot_make_is_audited_as_failed(ctx: HelperContext, root: Path) -> None:
    write_record(root, state="pending", deadline_ms=1, previous_version="")
    (root / RELEASES).mkdir(parents=True)
    daemon._expire(ctx, "1.1.0")
    last = audit(ctx)[-1]
    assert (last["op"], last["decision"], last["reason"], last["message"]) == (
        "daemon.rollback",
        "failed",
        "rollback",
        "/usr/lib/bcd/releases/initial/bcd is missing: the previous release is gone",
    )
    (root / RECORD).write_text("{")
    daemon._expire(ctx, "1.1.0")
    last = audit(ctx)[-1]
    assert (last["decision"], last["reason"]) == ("failed", "rollback")
    assert last["message"].startswith(f"{RELEASE_STATE} cannot be read: ")


def test_arm_replaces_the_timer_and_resume_rearms_a_pending_swap(ctx: HelperContext, root: Path) -> None:
    daemon.arm(ctx, "1.1.0", 100)
    first = ctx.daemon_timer
    daemon.arm(ctx, "1.1.0", -5)  # a deadline already past: at once
    assert first is not None and first.finished.is_set()
    second = ctx.daemon_timer
    assert second is not None and second.interval == 0.0 and second.daemon
    second.cancel()
    ctx.daemon_timer = None
    daemon.resume(ctx)
    assert ctx.daemon_timer is None  # no record
    write_record(root, state="confirmed")
    daemon.resume(ctx)
    assert ctx.daemon_timer is None
    write_record(root, state="pending", deadline_ms=int(time.time() * 1000) + 2_000_000)
    daemon.resume(ctx)
    timer = ctx.daemon_timer
    assert timer is not None and 1999 < timer.interval <= 2000 and timer.args == (ctx, "1.1.0")


# --- edges ------------------------------------------------------------------------------------------------


def test_a_record_past_64_kib_cannot_be_read(ctx: HelperContext, root: Path) -> None:
    doc = write_record(root)
    text = json.dumps(doc)
    (root / RECORD).write_text(text + " " * (64 * 1024 - len(text)))
    assert load_release(ctx) == doc
    (root / RECORD).write_text(text + " " * (64 * 1024 + 1 - len(text)))
    with pytest.raises(Failed) as info:
        load_release(ctx)
    assert (info.value.reason, info.value.message) == (
        "release-state",
        f"{RELEASE_STATE}: {RELEASE_STATE} is larger than 65536 bytes",
    )


def test_an_artifact_at_the_size_limit_is_read_and_one_byte_more_is_not(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon, "MAX_ARTIFACT", len(NEW))
    args = doc_for(worker, root)
    assert swap(ctx, args)["version"] == "1.1.0"
    confirm(ctx, "1.1.0")
    bigger = NEW + b"+"
    args = doc_for(worker, root, version="1.2.0", data=bigger, generation=2)
    assert refused(ctx, args) == (
        "too-large",
        f"daemon.swap: artifact /{STAGING}/bcd-1.2.0 is larger than {len(NEW)} bytes",
    )


def test_long_names_in_refusals_are_cut_to_80_characters(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    args = doc_for(worker, root)
    section = daemon_section(worker, "1.1.0", NEW)
    long_node = "n" * 100
    assert refused(ctx, {**args, "spec": spec_carrier(worker, section, 1, node=long_node)})[1] == (
        f"daemon.swap: the signed spec is for node {'n' * 80!r}"
    )
    named = wire.DaemonSection(
        version="9" * 100, url=section.url, sha256=section.sha256, signature=section.signature
    )
    assert refused(ctx, {**args, "spec": spec_carrier(worker, named, 1)})[1].startswith(
        f"daemon.swap: the signed spec names another release ({'9' * 80!r});"
    )
    assert refused(ctx, command_args(worker, root, node=long_node))[1] == (
        f"daemon.swap: the signed command is for node {'n' * 80!r}"
    )
    assert refused(ctx, command_args(worker, root, kind="k" * 100))[1] == (
        f"daemon.swap: the signed command is {'k' * 80!r}, not daemon.upgrade"
    )
    long_id = "i" * 100
    write_record(root, version="1.0.9", sha256=sha(b"x"), used_commands=[long_id])
    assert refused(ctx, command_args(worker, root, command_id=long_id))[1] == (
        f"daemon.swap: the daemon.upgrade command {'i' * 80!r} was already used"
    )
    with pytest.raises(Refused) as info:
        confirm(ctx, "v" * 100)
    assert info.value.message.startswith("daemon.confirm: no swap")
    write_record(root, state="pending")
    with pytest.raises(Refused) as info:
        confirm(ctx, "v" * 100)
    assert info.value.message == f"daemon.confirm: the pending swap is to 1.1.0, not {'v' * 80!r}"


class _Frozen(dt.datetime):
    at: dt.datetime

    @classmethod
    def now(cls, tz: dt.tzinfo | None = None) -> _Frozen:  # type: ignore[override]
        return cls.fromtimestamp(cls.at.timestamp(), tz)


def test_a_command_expires_at_its_not_after(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = dt.datetime.fromtimestamp(int(time.time()), dt.UTC)
    _Frozen.at = at
    monkeypatch.setattr(daemon, "dt", SimpleNamespace(datetime=_Frozen, UTC=dt.UTC))
    now_ms = int(at.timestamp() * 1000)
    assert refused(ctx, command_args(worker, root, not_after_ms=now_ms)) == (
        "expired-intent",
        f"daemon.swap: the signed daemon.upgrade command 01J0000000000000000000UPG1 expired (not_after "
        f"{now_ms}, now {now_ms}): its release is not fresh",
    )
    assert swap(ctx, command_args(worker, root, not_after_ms=now_ms + 1))["version"] == "1.1.0"


def test_root_keeps_the_last_64_command_ids(ctx: HelperContext, root: Path, worker: Signer) -> None:
    used = [f"01J{i:023d}" for i in range(64)]
    write_record(root, version="1.0.9", sha256=sha(b"x"), used_commands=used)
    swap(ctx, command_args(worker, root, command_id="01JNEW0000000000000000000X"))
    assert record(root)["used_commands"] == [*used[1:], "01JNEW0000000000000000000X"]


def test_without_a_join_record_pinned_roots_bind_no_node(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """command_root_sha256 pins the roots and no join record binds a node: a spec for any node is
    accepted (the chain carries its root)."""
    (root / "usr/lib/bcd").mkdir(parents=True)
    config = cp.config_lines(pin_roots=True).split("\n", 1)[1]
    c = context(root, config + HELPER)
    try:
        args = doc_for(worker, root)
        section = daemon_section(worker, "1.1.0", NEW)
        args["chain"] = [*args["chain"], b64(cp.command.root)]
        args["spec"] = spec_carrier(worker, section, 1, node="node-z")
        assert swap(c, args)["version"] == "1.1.0"
    finally:
        with c.timer_lock:
            if c.daemon_timer is not None:
                c.daemon_timer.cancel()
        c.audit.close()


def test_after_a_rollback_the_next_swap_names_the_release_it_replaces(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    swap(ctx, doc_for(worker, root))
    confirm(ctx, "1.1.0")
    swap(ctx, doc_for(worker, root, version="1.2.0", data=NEW + b"2", generation=2))
    confirm(ctx, "1.2.0", healthy=False)
    assert os.readlink(root / LINK) == "releases/1.1.0/bcd" and record(root)["version"] == "1.1.0"
    got = swap(ctx, doc_for(worker, root, version="1.2.1", data=NEW + b"21", generation=3))
    assert got["previous_version"] == "1.1.0" and record(root)["previous_sha256"] == sha(NEW)


def test_a_first_release_confirmed_prunes_every_other_directory(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    (root / LINK).unlink()
    stale = root / RELEASES / "0.9.0"
    stale.mkdir(parents=True)
    (stale / "bcd").write_bytes(b"old")
    (stale / "bcd.sig").write_bytes(b"sig")
    swap(ctx, doc_for(worker, root))
    assert sorted(os.listdir(root / RELEASES)) == ["0.9.0", "1.1.0"]
    confirm(ctx, "1.1.0")
    assert os.listdir(root / RELEASES) == ["1.1.0"]


def test_a_restart_error_that_is_not_utf8_is_still_reported(ctx: HelperContext) -> None:
    programs(ctx).script = lambda argv: (1, b"", b"\xff bad unit")
    assert daemon._restart_node(ctx) == "systemctl restart bcd-node.service: exit 1: \ufffd bad unit"


@pytest.mark.parametrize("swapped", ["symlink", "other-file"])
def test_an_artifact_swapped_after_its_check_is_refused(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch, swapped: str
) -> None:
    """The node swaps the artifact between root's look at its name and root's open: a symlink is opened
    as itself (O_PATH|O_NOFOLLOW) and refused, another file is seen to be another inode."""
    args = doc_for(worker, root)
    path = root / STAGING / args["artifact"]
    other = stage(root, "other", NEW)
    real_stat = os.stat
    raced: list[str] = []

    def racing(name: Any, *a: Any, **kw: Any) -> os.stat_result:
        st = real_stat(name, *a, **kw)
        if name == args["artifact"] and "dir_fd" in kw and not raced:
            raced.append(name)
            path.unlink()
            if swapped == "symlink":
                path.symlink_to(other)
                os.lchown(path, NODE_UID, NODE_UID)
            else:
                os.rename(root / STAGING / other, path)
        return st

    monkeypatch.setattr(daemon.os, "stat", racing)
    got = refused(ctx, args)
    monkeypatch.undo()
    assert raced == [args["artifact"]]
    shown = f"/{STAGING}/{args['artifact']}"
    if swapped == "symlink":
        assert got == (
            "bad-artifact",
            f"daemon.swap: artifact {shown} must be a regular file owned by the node (uid {NODE_UID}) with "
            "one link",
        )
    else:
        assert got == ("bad-artifact", f"daemon.swap: artifact {shown} was replaced while it was checked")
    assert not (root / RECORD).exists()


def test_an_artifact_that_vanishes_after_its_check_is_refused(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = doc_for(worker, root)
    path = root / STAGING / args["artifact"]
    real_stat = os.stat

    def racing(name: Any, *a: Any, **kw: Any) -> os.stat_result:
        st = real_stat(name, *a, **kw)
        if name == args["artifact"] and "dir_fd" in kw and path.exists():
            path.unlink()
        return st

    monkeypatch.setattr(daemon.os, "stat", racing)
    got = refused(ctx, args)
    monkeypatch.undo()
    assert got == (
        "bad-artifact",
        f"daemon.swap: artifact /{STAGING}/{args['artifact']}: No such file or directory",
    )


def test_an_artifact_that_grows_after_its_check_is_refused(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon, "MAX_ARTIFACT", len(NEW))
    args = doc_for(worker, root)
    path = root / STAGING / args["artifact"]
    real_open = os.open

    def racing(name: Any, *a: Any, **kw: Any) -> int:
        if isinstance(name, str) and name.startswith("/proc/self/fd/"):
            with path.open("ab") as f:
                f.write(b"+")
        return real_open(name, *a, **kw)

    monkeypatch.setattr(daemon.os, "open", racing)
    got = refused(ctx, args)
    monkeypatch.undo()
    assert got == (
        "too-large",
        f"daemon.swap: artifact /{STAGING}/{args['artifact']} is larger than {len(NEW)} bytes",
    )


def test_a_dangling_symlink_is_refused_as_not_a_file_and_never_followed(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    """Root looks at the name itself: the answer says nothing about what the link names (no existence
    oracle for root's files)."""
    args = doc_for(worker, root)
    path = root / STAGING / args["artifact"]
    path.unlink()
    path.symlink_to("/root/no-such-file")
    os.lchown(path, NODE_UID, NODE_UID)
    assert refused(ctx, args) == (
        "bad-artifact",
        f"daemon.swap: artifact /{STAGING}/{args['artifact']} must be a regular file owned by the node "
        f"(uid {NODE_UID}) with one link",
    )


def test_a_signed_spec_that_does_not_decode_is_refused(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    from bcd_shared.pki import Purpose

    args = doc_for(worker, root)
    body = b"\xff\xff\xff"
    carrier = {"body": b64(body), "signature": b64(worker.key.sign(Purpose.DESIRED_STATE, body))}
    reason, message = refused(ctx, {**args, "spec": carrier})
    assert reason == "bad-intent" and message.startswith("daemon.swap: the signed spec does not decode: ")
    # Neither a full spec nor a patch: no daemon section.
    empty = bytes(wire.DesiredStateBody(node_id=NODE_ID, generation=2, spec_hash="e"))
    carrier = {"body": b64(empty), "signature": b64(worker.key.sign(Purpose.DESIRED_STATE, empty))}
    assert refused(ctx, {**args, "spec": carrier}) == (
        "release-not-in-intent",
        "daemon.swap: the signed spec (generation 2) sets no daemon section",
    )


def test_a_long_expired_command_id_is_cut(ctx: HelperContext, root: Path, worker: Signer) -> None:
    long_id = "i" * 100
    reason, message = refused(ctx, command_args(worker, root, command_id=long_id, not_after_ms=1))
    assert reason == "expired-intent"
    assert message.startswith(
        f"daemon.swap: the signed daemon.upgrade command {'i' * 80} expired (not_after 1, "
    )


def test_a_first_swap_by_command_or_by_a_spec_of_generation_0_keeps_generation_0(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    swap(ctx, command_args(worker, root))
    assert record(root)["spec_generation"] == 0
    (root / RECORD).unlink()
    assert swap(ctx, doc_for(worker, root, generation=0))["version"] == "1.1.0"
    assert record(root)["spec_generation"] == 0


def test_roots_refusals_name_the_op(root: Path, cp: ControlPlane, worker: Signer) -> None:
    c = context(root, cp.config_lines() + HELPER)
    try:
        reason, message = refused(c, doc_for(worker, root))
        assert reason == "join-record-required" and message.startswith("daemon.swap: ")
    finally:
        c.audit.close()


def test_a_packaged_file_over_a_known_record_has_no_previous_version(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    """A package reinstall put a regular file back over the link: the record's version is not what runs."""
    write_record(root, version="1.0.5", sha256=sha(b"x"))
    assert swap(ctx, doc_for(worker, root, generation=2))["previous_version"] == ""
    assert record(root)["previous_version"] == ""


def test_a_large_packaged_binary_is_kept_and_rolled_back_to(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    """Releases up to 256 MiB: a 65 MiB packaged file (past read_root_only's 64 MiB default) is read
    whole, kept as `initial` and rolled back to."""
    size = 65 * 1024 * 1024
    with (root / LINK).open("r+b") as f:
        f.truncate(size)
    swap(ctx, doc_for(worker, root))
    assert record(root)["previous_sha256"] == hashlib.sha256(OLD + bytes(size - len(OLD))).hexdigest()
    assert (root / RELEASES / "initial/bcd").stat().st_size == size
    assert confirm(ctx, "1.1.0", healthy=False)["rolled_back"] is True
    assert os.readlink(root / LINK) == "releases/initial/bcd"


def test_rolling_back_to_nothing_when_the_link_is_already_gone(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    (root / LINK).unlink()
    swap(ctx, doc_for(worker, root))
    (root / LINK).unlink()
    assert confirm(ctx, "1.1.0", healthy=False)["version"] == ""
    assert not os.path.lexists(root / LINK) and record(root)["state"] == "rolled-back"


def test_a_link_that_cannot_be_replaced_leaves_no_temporary(
    ctx: HelperContext, root: Path, worker: Signer
) -> None:
    swap(ctx, doc_for(worker, root))
    (root / LINK).unlink()
    (root / LINK).mkdir()
    (root / LINK / "x").write_bytes(b"x")
    with pytest.raises(IsADirectoryError):
        confirm(ctx, "1.1.0", healthy=False)
    assert sorted(os.listdir(root / "usr/lib/bcd")) == ["bcd", "releases"]
    assert os.listdir(root) == [] or all(not n.startswith(".bcd.") for n in os.listdir(root.parent))


def sorted_listdir(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.listdir in name order, so that what prune meets first is known."""
    real = os.listdir
    monkeypatch.setattr(daemon.os, "listdir", lambda p=".": sorted(real(p)))


def test_prune_skips_what_is_not_a_stale_release_and_goes_on(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap(ctx, doc_for(worker, root))
    releases = root / RELEASES
    (releases / ".hidden").mkdir()
    (releases / "0.8.0").symlink_to("/tmp")  # named as a version, but a link: never entered
    (releases / "0.8.5").write_bytes(b"not a directory")
    stale = releases / "0.9.0"
    stale.mkdir()
    (stale / "bcd").write_bytes(b"old")
    (stale / "lib").symlink_to("/usr")  # a link inside: removed as a link, its target untouched
    sorted_listdir(monkeypatch)
    confirm(ctx, "1.1.0")
    monkeypatch.undo()
    assert sorted(os.listdir(releases)) == [".hidden", "0.8.0", "0.8.5", "1.1.0", "initial"]
    assert os.path.isdir("/usr/bin")


def test_prune_is_best_effort(ctx: HelperContext, root: Path, worker: Signer) -> None:
    """A directory inside a stale release, or a releases directory that is a symlink: the confirmation
    stands, what was not pruned stays."""
    swap(ctx, doc_for(worker, root))
    stale = root / RELEASES / "0.9.0" / "lib"
    stale.mkdir(parents=True)
    assert confirm(ctx, "1.1.0")["confirmed"] is True
    assert (root / RELEASES / "0.9.0/lib").is_dir()
    swap(ctx, doc_for(worker, root, version="1.2.0", data=NEW + b"2", generation=2))
    (root / RELEASES).rename(root / "usr/lib/bcd/kept")
    (root / RELEASES).symlink_to("kept")
    assert confirm(ctx, "1.2.0")["confirmed"] is True
    assert (root / RELEASES).is_symlink()
    (root / RELEASES).unlink()
    (root / "usr/lib/bcd/kept").rename(root / RELEASES)
    swap(ctx, doc_for(worker, root, version="1.3.0", data=NEW + b"3", generation=3))
    shutil.rmtree(root / RELEASES)
    assert confirm(ctx, "1.3.0")["confirmed"] is True
    assert not os.path.lexists(root / RELEASES)  # never made again by the prune


class _Clock:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def time(self) -> float:
        return self.ms / 1000

    def monotonic(self) -> float:
        return 0.0


@pytest.mark.parametrize(("left_ms", "rolled_back"), [(0, True), (1, False), (1001, False)])
def test_the_timer_rolls_back_at_the_deadline_to_the_millisecond(
    ctx: HelperContext,
    root: Path,
    worker: Signer,
    monkeypatch: pytest.MonkeyPatch,
    left_ms: int,
    rolled_back: bool,
) -> None:
    swap(ctx, doc_for(worker, root))
    assert ctx.daemon_timer is not None
    ctx.daemon_timer.cancel()
    deadline = record(root)["deadline_ms"]
    monkeypatch.setattr(daemon, "time", _Clock(deadline - left_ms))
    daemon._expire(ctx, "1.1.0")
    monkeypatch.undo()
    assert (record(root)["state"] == "rolled-back") is rolled_back
    if not rolled_back:
        timer = ctx.daemon_timer
        assert timer is not None and timer.interval == left_ms / 1000


def test_the_armed_timer_rolls_back_when_it_fires(ctx: HelperContext, root: Path, worker: Signer) -> None:
    swap(ctx, doc_for(worker, root))
    rec = record(root)
    (root / RECORD).write_text(json.dumps({**rec, "deadline_ms": 0}))
    daemon.arm(ctx, "1.1.0", 0)
    timer = ctx.daemon_timer
    assert timer is not None
    timer.join(30)
    assert record(root)["state"] == "rolled-back" and audit(ctx)[-1]["op"] == "daemon.rollback"


def test_no_staging_tree_is_made_while_it_is_looked_for(root: Path, cp: ControlPlane, worker: Signer) -> None:
    """Pinned roots, no join record: no /var/lib yet. The refusal makes no directory."""
    (root / "usr/lib/bcd").mkdir(parents=True)
    c = context(root, cp.config_lines(pin_roots=True).split("\n", 1)[1] + HELPER)
    try:
        section = daemon_section(worker, "1.1.0", NEW)
        args = swap_doc(worker, section, "bcd-1.1.0", spec=spec_carrier(worker, section, 1))["args"]
        args["chain"] = [*args["chain"], b64(cp.command.root)]
        assert refused(c, args) == (
            "bad-staging",
            f"daemon.swap: the staging directory /{STAGING}: openat2 'lib': No such file or directory",
        )
        assert not (root / "var/lib").exists()
    finally:
        c.audit.close()


def test_the_timers_audited_message_is_cut_to_2000_characters(ctx: HelperContext, root: Path) -> None:
    write_record(root, state="pending", version="v" * 3000)
    daemon._expire(ctx, "1.1.0")
    last = audit(ctx)[-1]
    assert (last["op"], last["decision"], last["reason"]) == ("daemon.rollback", "failed", "rollback")
    assert last["message"] == f"{RELEASE_STATE} cannot be read: version {'v' * 3000!r}"[:2000]


def test_a_flip_whose_time_cannot_be_recorded_is_rolled_back_at_once(
    ctx: HelperContext, root: Path, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 10: the record of the flip's time (what a node's confirmation is dated against) is written
    after the flip. Were it lost, the node could never confirm the release it then runs, until the
    deadline rolled it back; so a failed write flips back at once and the swap is answered `failed`."""
    real = daemon._save_release
    saves: list[dict[str, Any]] = []

    def second_fails(c: HelperContext, doc: dict[str, Any]) -> None:
        saves.append(doc)
        if len(saves) == 2:
            raise OSError(28, "No space left on device")
        real(c, doc)

    monkeypatch.setattr(daemon, "_save_release", second_fails)
    with pytest.raises(Failed) as info:
        swap(ctx, doc_for(worker, root))
    assert info.value.reason == "swap"
    assert info.value.message == (
        "daemon.swap: recording the flip's time: [Errno 28] No space left on device; the previous release "
        "is installed again"
    )
    assert saves[1]["flip_tick"] is not None and saves[0]["flip_tick"] is None
    assert os.readlink(root / LINK) == "releases/initial/bcd" and (root / LINK).read_bytes() == OLD
    rec = record(root)
    assert (rec["state"], rec["reason"]) == ("rolled-back", "root could not record the time of its flip")
    assert programs(ctx).runs == [RESTART]
    if ctx.daemon_timer is not None:
        ctx.daemon_timer.cancel()
