"""daemon.swap and daemon.confirm: the privileged half of self-update (DLV-CONV-15/16, DLV-PRIV-10).

The node converges the `daemon` section (or runs `daemon.upgrade`): it downloads the release artifact into
its own data directory and asks the helper to swap it in. Root then, in this order:
1. checks the arguments: the manifest fields (bcd_shared.release: version, https URL, lowercase SHA-256),
   the artifact's host path, the confirmation timeout (1 s to 1 hour);
2. refuses while another swap waits for its confirmation (`swap-pending`);
3. verifies the release signature: a worker certificate chained to the command-signing roots (the same
   roots as signed intent: root's pins, root's join record, or a trust bundle the node presents; none at
   all is a refusal), purpose `daemon-release`, over the canonical manifest bytes;
4. reads the artifact itself: a regular file (never through a final symlink) that the node's uid owns
   (so root never reads a file the node could not), at most 256 MiB, and checks its SHA-256 against the
   signed one (`artifact-mismatch`);
5. records the swap (`/var/lib/bcd-hostconfig/daemon-release.json`, state `pending`, with the deadline)
   before any effect, keeps the installed release as `/usr/lib/bcd/bcd.previous`, and replaces
   `/usr/lib/bcd/bcd` atomically (root-only rule: temporary file, fsync, rename, directory fsync);
   a failure on the way restores the previous release;
6. waits for `daemon.confirm` from the new release: `healthy: true` confirms (the previous release stays
   as `bcd.previous` for a manual rollback); `healthy: false`, or no confirmation before the deadline
   (a timer in the helper, re-armed when the helper starts), rolls back: the previous release is put
   back (or the new one removed when there was none), the record says `rolled-back`, and
   `systemctl --no-block restart bcd-node.service` starts the node on the previous release. A rollback
   by the timer is audited as op `daemon.rollback`.
The node ends its own process after a swap (`daemon.upgrade` is self-terminating); systemd starts it
again from the new release.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import json
import os
import stat
import threading
import time
from typing import Any, Final

from attrs import frozen
from bcd_shared.rootpath import (
    RootPathRefused,
    read_root_only,
    remove_root_only,
    split_host_path,
    write_root_only,
)

from bcd_helper.ops.base import Call, Failed, HelperContext, Refused

DAEMON_DIR: Final = "/usr/lib/bcd"
INSTALLED: Final = f"{DAEMON_DIR}/bcd"
PREVIOUS: Final = f"{DAEMON_DIR}/bcd.previous"
RELEASE_STATE: Final = "/var/lib/bcd-hostconfig/daemon-release.json"
NODE_UNIT: Final = "bcd-node.service"
MAX_ARTIFACT: Final = 256 * 1024 * 1024
DEFAULT_CONFIRM_S: Final = 600
MAX_CONFIRM_S: Final = 3600
_STATE_KEYS: Final = frozenset(
    {
        "state",
        "version",
        "sha256",
        "previous_version",
        "previous_sha256",
        "had_previous",
        "deadline_ms",
        "reason",
    }
)


@frozen
class DaemonSwap:
    version: str
    url: str
    sha256: str
    signature: str  # base64 of the worker's daemon-release signature over the manifest
    chain: tuple[str, ...]  # base64 DER, leaf first (the root last when command_root_sha256 pins roots)
    artifact: str  # host path of the downloaded artifact, a file the node owns
    trust_bundle: str | None = None  # base64 SignedTrustBundle, as for host.unit
    confirm_timeout_s: int = DEFAULT_CONFIRM_S


@frozen
class DaemonConfirm:
    version: str
    healthy: bool = True


# --- root's release record ------------------------------------------------------------------------------


def load_release(ctx: HelperContext) -> dict[str, Any] | None:
    """daemon-release.json, strictly; None when no swap was ever made. Failed when it is unreadable."""
    try:
        data = read_root_only(ctx.root, RELEASE_STATE, 64 * 1024)
    except RootPathRefused as exc:
        raise Failed("release-state", f"{RELEASE_STATE}: {exc}") from None
    if data is None:
        return None
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or set(doc) != _STATE_KEYS:
            raise ValueError(f"keys are not {sorted(_STATE_KEYS)}")
        if doc["state"] not in ("pending", "confirmed", "rolled-back"):
            raise ValueError(f"state {doc['state']!r}")
        if type(doc["deadline_ms"]) is not int or type(doc["had_previous"]) is not bool:
            raise ValueError("deadline_ms or had_previous has the wrong type")
    except ValueError as exc:
        raise Failed("release-state", f"{RELEASE_STATE} cannot be read: {exc}") from None
    return doc


def _save_release(ctx: HelperContext, doc: dict[str, Any]) -> None:
    data = (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()
    write_root_only(ctx.root, RELEASE_STATE, data, 0o600)


def _restart_node(ctx: HelperContext) -> str:
    """Best effort: the node restarts on the release now installed. Returns what happened."""
    try:
        out = ctx.system.run(["systemctl", "--no-block", "restart", NODE_UNIT], timeout=60)
    except OSError as exc:
        return f"systemctl: {exc}"
    if out.returncode != 0:
        err = out.stderr.decode(errors="replace")[:200]
        return f"systemctl restart {NODE_UNIT}: exit {out.returncode}: {err}"
    return f"restarted {NODE_UNIT}"


def roll_back(ctx: HelperContext, doc: dict[str, Any], reason: str) -> dict[str, Any]:
    """Put the previous release back (or remove the new one), record `rolled-back`, restart the node."""
    if doc["had_previous"]:
        previous = read_root_only(ctx.root, PREVIOUS, MAX_ARTIFACT)
        if previous is None:
            raise Failed("rollback", f"{PREVIOUS} is missing: the previous release cannot be put back")
        write_root_only(ctx.root, INSTALLED, previous, 0o755)
    else:
        remove_root_only(ctx.root, INSTALLED)
    after = {
        **doc,
        "state": "rolled-back",
        "version": doc["previous_version"],
        "sha256": doc["previous_sha256"],
        "previous_version": doc["version"],
        "previous_sha256": doc["sha256"],
        "reason": reason,
    }
    _save_release(ctx, after)
    restart = _restart_node(ctx)
    return {
        "version": after["version"],
        "failed_version": doc["version"],
        "rolled_back": True,
        "restart": restart,
    }


# --- the confirmation timer -------------------------------------------------------------------------------


def _expire(ctx: HelperContext, version: str) -> None:
    """The timer: roll back a swap still pending at its deadline (audited as daemon.rollback)."""
    t0 = time.monotonic()
    lock = ctx.locks["system"]
    with lock:
        try:
            doc = load_release(ctx)
            if doc is None or doc["state"] != "pending" or doc["version"] != version:
                return
            left_ms = doc["deadline_ms"] - int(time.time() * 1000)
            if left_ms > 0:  # re-armed by a later swap of the same version: not yet
                arm(ctx, version, left_ms / 1000)
                return
            result = roll_back(ctx, doc, "not confirmed before its deadline")
            decision, why, message = "accepted", "confirm-timeout", json.dumps(result, sort_keys=True)
        except (Failed, RootPathRefused, OSError) as exc:
            decision, why, message = "failed", "rollback", str(exc)
        ctx.audit.record(
            peer_pid=os.getpid(),
            peer_uid=0,
            op="daemon.rollback",
            args={"version": version},
            args_sha256=hashlib.sha256(version.encode()).hexdigest(),
            decision=decision,
            reason=why,
            message=message[:2000],
            duration_ms=(time.monotonic() - t0) * 1000,
        )


def arm(ctx: HelperContext, version: str, delay_s: float) -> None:
    """(Re)arm the helper's one confirmation timer."""
    with ctx.timer_lock:
        if ctx.daemon_timer is not None:
            ctx.daemon_timer.cancel()
        timer = threading.Timer(max(delay_s, 0.0), _expire, args=(ctx, version))
        timer.daemon = True
        ctx.daemon_timer = timer
        timer.start()


def resume(ctx: HelperContext) -> None:
    """At start: a swap still pending gets its timer back (a deadline already past rolls back at once)."""
    doc = load_release(ctx)
    if doc is not None and doc["state"] == "pending":
        arm(ctx, doc["version"], (doc["deadline_ms"] - int(time.time() * 1000)) / 1000)


# --- the operations ------------------------------------------------------------------------------------


def _b64(value: str, field: str) -> bytes:
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise Refused("bad-arguments", f"daemon.swap: {field} is not base64") from None


def _read_artifact(call: Call, path: str) -> bytes:
    """The artifact's bytes: a regular file the node's uid owns, opened without following a final link."""
    try:
        split_host_path(path)
    except RootPathRefused as exc:
        raise Refused("bad-artifact", f"daemon.swap: artifact: {exc}") from None
    real = call.system.host_path(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused("bad-artifact", f"daemon.swap: artifact {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        node_uid = call.ctx.config.node_uid
        if not stat.S_ISREG(st.st_mode) or st.st_uid != node_uid:
            raise Refused(
                "bad-artifact",
                f"daemon.swap: artifact {path} must be a regular file owned by the node (uid {node_uid})",
            )
        if st.st_size > MAX_ARTIFACT:
            raise Refused("too-large", f"daemon.swap: artifact {path} is larger than {MAX_ARTIFACT} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_ARTIFACT + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_ARTIFACT:
        raise Refused("too-large", f"daemon.swap: artifact {path} is larger than {MAX_ARTIFACT} bytes")
    return data


def daemon_swap(call: Call, req: DaemonSwap) -> dict[str, Any]:
    from bcd_shared.pki import PkiError
    from bcd_shared.release import ArtifactMismatch, ReleaseManifest, check_artifact, verify_release

    try:
        manifest = ReleaseManifest(req.version, req.url, req.sha256)
    except PkiError as exc:
        raise Refused("bad-manifest", f"daemon.swap: {exc}") from None
    if not 1 <= req.confirm_timeout_s <= MAX_CONFIRM_S:
        raise Refused("bad-arguments", f"daemon.swap: confirm_timeout_s must be 1 to {MAX_CONFIRM_S}")
    signature = _b64(req.signature, "signature")
    chain = tuple(_b64(c, f"chain[{i}]") for i, c in enumerate(req.chain))
    presented = None if req.trust_bundle is None else _b64(req.trust_bundle, "trust_bundle")
    doc = load_release(call.ctx)
    if doc is not None and doc["state"] == "pending":
        raise Refused(
            "swap-pending", f"daemon.swap: the swap to {doc['version']} still waits for its daemon.confirm"
        )
    verifier = call.ctx.intent_verifier()
    roots = verifier.release_roots("daemon.swap", presented, chain)
    try:
        verify_release(manifest, signature, chain, roots, dt.datetime.now(dt.UTC), verifier.chains)
    except PkiError as exc:
        raise Refused(
            "bad-release-signature", f"daemon.swap: the release signature is refused: {exc}"
        ) from None
    artifact = _read_artifact(call, req.artifact)
    try:
        check_artifact(manifest, hashlib.sha256(artifact).hexdigest())
    except ArtifactMismatch as exc:
        raise Refused("artifact-mismatch", f"daemon.swap: {exc}") from None
    current = read_root_only(call.ctx.root, INSTALLED, MAX_ARTIFACT)
    confirmed = doc is not None and doc["state"] in ("confirmed", "rolled-back")
    pending = {
        "state": "pending",
        "version": manifest.version,
        "sha256": manifest.sha256,
        "previous_version": doc["version"] if confirmed and doc is not None else "",
        "previous_sha256": hashlib.sha256(current).hexdigest() if current is not None else "",
        "had_previous": current is not None,
        "deadline_ms": int(time.time() * 1000) + req.confirm_timeout_s * 1000,
        "reason": "",
    }
    try:
        _save_release(call.ctx, pending)  # durable before effect
        if current is not None:
            write_root_only(call.ctx.root, PREVIOUS, current, 0o755)
        write_root_only(call.ctx.root, INSTALLED, artifact, 0o755)
    except (RootPathRefused, OSError) as exc:
        try:
            roll_back(call.ctx, pending, f"the swap failed: {exc}")
        except (Failed, RootPathRefused, OSError) as again:
            raise Failed("swap", f"daemon.swap: {exc}; the rollback failed too: {again}") from None
        raise Failed("swap", f"daemon.swap: {exc}; the previous release is back") from None
    arm(call.ctx, manifest.version, req.confirm_timeout_s)
    return {
        "version": manifest.version,
        "previous_version": pending["previous_version"],
        "path": INSTALLED,
        "confirm_by_ms": pending["deadline_ms"],
    }


def daemon_confirm(call: Call, req: DaemonConfirm) -> dict[str, Any]:
    doc = load_release(call.ctx)
    if doc is None or doc["state"] != "pending":
        raise Refused("no-pending-swap", "daemon.confirm: no swap waits for a confirmation")
    if doc["version"] != req.version:
        raise Refused(
            "version-mismatch",
            f"daemon.confirm: the pending swap is to {doc['version']}, not {req.version[:80]!r}",
        )
    with call.ctx.timer_lock:
        if call.ctx.daemon_timer is not None:
            call.ctx.daemon_timer.cancel()
            call.ctx.daemon_timer = None
    if not req.healthy:
        return roll_back(call.ctx, doc, "the new release reported itself unhealthy")
    _save_release(call.ctx, {**doc, "state": "confirmed"})
    return {"version": doc["version"], "confirmed": True, "previous_version": doc["previous_version"]}
