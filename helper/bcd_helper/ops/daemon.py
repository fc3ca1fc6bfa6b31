"""daemon.swap and daemon.confirm: the privileged half of self-update (DLV-CONV-15/16, DLV-PRIV-10).

The node converges the `daemon` section (or runs `daemon.upgrade`): it downloads the release artifact into
its staging directory (`/var/lib/bcd/staging`) and asks the helper to swap it in. Root then, in this order:
1. checks the arguments: the manifest fields (bcd_shared.release: version, https URL, lowercase SHA-256,
   the rollback flag), the artifact's name (one file name, nothing else), the confirmation timeout
   (1 s to 1 hour), and that exactly one freshness carrier is sent (`spec` or `command`);
2. refuses while another swap waits for its confirmation (`swap-pending`);
3. verifies the release signature: a worker certificate chained to the command-signing roots (the same
   roots as signed intent: root's pins, root's join record, or a trust bundle the node presents; none at
   all is a refusal), purpose `daemon-release`, over the canonical manifest bytes;
4. binds the manifest to freshness (issue 9 item 4; TUF's freeze and replay attacks): either
   - `spec`: the signed DesiredStateBody whose daemon section names exactly this manifest, verified
     under `desired-state` with the same chain, for this node, at a generation not older than the newest
     root accepted (host.unit's intent state) nor than the spec of the last swap; the spec is then root's
     accepted spec: its generation is written to that intent state before the effect, the floor of every
     other signed op too (round 5); or
   - `command`: the signed `daemon.upgrade` Command whose payload names exactly this manifest, for this
     node (root bound to one: else `intent-unverifiable`; and targeting no other), before its
     `not_after` by root's clock, and never used for a swap before (the release record keeps the ids of
     the last 64; root's memory of used commands, helper-commands.json, each until its not_after);
5. keeps releases moving forward: a version older than the one installed is refused (`downgrade`)
   unless the signed manifest is a rollback intent (`rollback: true`) naming it; the installed version
   again is a no-op with the same SHA-256 (`daemon.upgrade` is retry-safe) and `version-reused` with
   another one (one version, one artifact: TUF's mix-and-match); a version with no order is refused;
   the release just rolled back, named again by a spec no newer than the one that named it, is
   `release-failed` (no swap-and-roll-back loop; a newer spec or a new command tries it again);
6. opens the artifact only inside the staging directory: the directories down to it are opened one by
   one relative to the verified fd before them, never through a symlink (those above the node's data
   directory root-only, the data directory and staging directory owned by the node's uid and writable
   by nobody else); the name is looked at with fstatat(AT_SYMLINK_NOFOLLOW) and anything but a regular
   file the node owns with one link is refused before any open (a device node is never opened as
   root); the file is then opened O_PATH|O_NOFOLLOW, checked again on that fd (the same inode), and
   read through /proc/self/fd, so nothing swapped in between is read. At most 256 MiB; its SHA-256
   must be the signed one (`artifact-mismatch`);
7. records the swap (`/var/lib/bcd-hostconfig/daemon-release.json`, state `pending`, with the deadline)
   before any effect, writes the release into its own directory `/usr/lib/bcd/releases/<version>/bcd`
   and flips `/usr/lib/bcd/bcd`, a symlink, to it atomically (a new link renamed over the old, directory
   fsynced: systemd-sysupdate's A/B). The previous release's directory stays; a packaged install's
   regular file is moved into `releases/initial/` at the first swap. A failure on the way flips back;
8. restarts `bcd-node.service` (`systemctl --no-block restart`) so that the node runs the new release
   (also when the node asks for the release already installed: it is not running it);
9. waits for `daemon.confirm` from the new release: `healthy: true` (from the node: only from a process
   that started after the flip, dated by /proc/PID/stat against the flip's recorded tick, and still
   alive after that read, by its pidfd) confirms and
   prunes every release directory but the installed and the previous one; `healthy: false`, or no
   confirmation before the deadline (a timer in the helper, re-armed when the helper starts), rolls
   back: the link is flipped back to the previous release (or removed when there was none), the record
   says `rolled-back`, and `systemctl --no-block restart bcd-node.service` starts the node on the
   previous release. A rollback by the timer is audited as op `daemon.rollback`.
`daemon.upgrade` is self-terminating: the restart ends the process that ran it; the journal runs it
again in the new one (retry-safe), which finds itself running the version and completes it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime as dt
import hashlib
import json
import os
import re
import select
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

from attrs import frozen
from bcd_shared.rootpath import (
    RootPathRefused,
    read_root_only,
    remove_root_only,
    split_host_path,
    verified_dir,
    write_root_only,
)

from bcd_helper.ops.base import RELEASE_STATE, Call, Failed, HelperContext, Refused

DAEMON_DIR: Final = "/usr/lib/bcd"
RELEASES: Final = "releases"  # under DAEMON_DIR: one directory per version
INSTALLED: Final = f"{DAEMON_DIR}/bcd"  # a symlink to releases/<version>/bcd
INITIAL: Final = "initial"  # the directory a packaged install's file moves into at the first swap
STAGING_DIR: Final = "/var/lib/bcd/staging"  # the node's: the only place an artifact is read from
NODE_UNIT: Final = "bcd-node.service"
MAX_ARTIFACT: Final = 256 * 1024 * 1024
DEFAULT_CONFIRM_S: Final = 600
MAX_CONFIRM_S: Final = 3600
MAX_USED_COMMANDS: Final = 64
MAX_INTENT: Final = 1024 * 1024
ARTIFACT_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+~-]{0,127}$")
_STATE_KEYS_V1: Final = frozenset(
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
_STATE_KEYS_V2: Final = _STATE_KEYS_V1 | {"spec_generation", "used_commands"}
# Round 10: when root flipped the link, boot-relative (the boot's id and the clock tick of /proc/PID/stat's
# starttime, field 22), so that a confirming process that started before the flip is refused.
_STATE_KEYS: Final = _STATE_KEYS_V2 | {"flip_boot_id", "flip_tick"}
BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"


@frozen
class SignedCarrier:
    """The signed DesiredStateBody or CommandBody that names the release (base64 of the exact bytes)."""

    body: str
    signature: str


@frozen
class DaemonSwap:
    version: str
    url: str
    sha256: str
    signature: str  # base64 of the worker's daemon-release signature over the manifest
    chain: tuple[str, ...]  # base64 DER, leaf first (the root last when command_root_sha256 pins roots)
    artifact: str  # a file name in the node's staging directory
    trust_bundle: str | None = None  # base64 SignedTrustBundle, as for host.unit
    confirm_timeout_s: int = DEFAULT_CONFIRM_S
    rollback: bool = False
    spec: SignedCarrier | None = None  # the signed spec whose daemon section names the release
    command: SignedCarrier | None = None  # or the signed daemon.upgrade command that names it


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
        if not isinstance(doc, dict) or set(doc) not in (_STATE_KEYS, _STATE_KEYS_V2, _STATE_KEYS_V1):
            raise ValueError(f"keys are not {sorted(_STATE_KEYS)}")
        doc.setdefault("spec_generation", 0)  # a record from before the freshness rules
        doc.setdefault("used_commands", [])
        doc.setdefault("flip_boot_id", "")  # a record from before round 10: no flip time
        doc.setdefault("flip_tick", None)
        if not isinstance(doc["flip_boot_id"], str) or len(doc["flip_boot_id"]) > 64:
            raise ValueError("flip_boot_id must be a boot id")
        if doc["flip_tick"] is not None and (type(doc["flip_tick"]) is not int or doc["flip_tick"] < 0):
            raise ValueError("flip_tick must be a clock tick or null")
        if doc["state"] not in ("pending", "confirmed", "rolled-back"):
            raise ValueError(f"state {doc['state']!r}")
        if type(doc["deadline_ms"]) is not int or type(doc["had_previous"]) is not bool:
            raise ValueError("deadline_ms or had_previous has the wrong type")
        if type(doc["spec_generation"]) is not int or not isinstance(doc["used_commands"], list):
            raise ValueError("spec_generation or used_commands has the wrong type")
        if not all(isinstance(x, str) for x in doc["used_commands"]):
            raise ValueError("used_commands must be strings")
        for key in ("version", "previous_version"):
            if doc[key] and (not isinstance(doc[key], str) or not _version_dir_ok(doc[key])):
                raise ValueError(f"{key} {doc[key]!r} is not a release version")
    except ValueError as exc:
        raise Failed("release-state", f"{RELEASE_STATE} cannot be read: {exc}") from None
    return doc


def _version_dir_ok(version: str) -> bool:
    from bcd_shared.release import VERSION_RE

    return bool(VERSION_RE.fullmatch(version)) and version not in (".", "..")


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


# --- boot-relative time: when root flipped the link, when the confirming process started -------------


def boot_id() -> str:
    """This boot's id ("" when the kernel gives none): boot-relative times of another boot compare with
    nothing of this one."""
    try:
        with open(BOOT_ID, "rb") as f:
            return f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""


def boot_tick() -> int:
    """Now, in the clock ticks of /proc/PID/stat's starttime (CLOCK_BOOTTIME / USER_HZ, truncated)."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // (1_000_000_000 // os.sysconf("SC_CLK_TCK"))


def start_tick(pid: int) -> int | None:
    """When process `pid` started (fork), in clock ticks since boot: /proc/PID/stat field 22, which the
    kernel sets at fork and no process can change; None when there is no such process (or pid 0)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
        # comm (field 2) may hold spaces and parentheses: the fields after its last ")" start at 3.
        return int(raw[raw.rindex(b")") + 1 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _after_the_flips_tick(flip: int) -> None:
    """Return once the tick of the flip has ended: every process forked after this starts at a later tick
    than the one recorded, so the restarted node (and any client after the answer) is never taken for one
    that predates the flip. At most one tick (10 ms at USER_HZ 100)."""
    for _ in range(100):
        if boot_tick() > flip:
            return
        time.sleep(0.002)


# --- the release directories ----------------------------------------------------------------------------


def _dir_name(version: str) -> str:
    return version or INITIAL


def _link_target(version: str) -> str:
    return f"{RELEASES}/{_dir_name(version)}/bcd"


@contextlib.contextmanager
def _daemon_dir(ctx: HelperContext) -> Iterator[int]:
    with verified_dir(ctx.root, split_host_path(DAEMON_DIR), create=True) as fd:
        yield fd


def _installed_link(dfd: int) -> str | None:
    """What /usr/lib/bcd/bcd is: the link's target, "" for a regular file (a packaged install), None
    when absent. Anything else there is refused."""
    try:
        st = os.stat("bcd", dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return os.readlink("bcd", dir_fd=dfd)
    if stat.S_ISREG(st.st_mode):
        return ""
    raise RootPathRefused(INSTALLED, f"{INSTALLED} is neither a release link nor a regular file")


def _flip(dfd: int, target: str | None) -> None:
    """Point /usr/lib/bcd/bcd at `target` atomically (None: remove it), then fsync the directory."""
    if target is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink("bcd", dir_fd=dfd)
    else:
        tmp = f".bcd.{os.urandom(6).hex()}.link"
        os.symlink(target, tmp, dir_fd=dfd)
        try:
            os.rename(tmp, "bcd", src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    os.fsync(dfd)


def _installed_sha256(ctx: HelperContext, dfd: int) -> tuple[str | None, str]:
    """(link target or "" for a packaged file or None, SHA-256 of the installed bytes or "")."""
    link = _installed_link(dfd)
    if link is None:
        return None, ""
    path = INSTALLED if link == "" else f"{DAEMON_DIR}/{link}"
    data = read_root_only(ctx.root, path, MAX_ARTIFACT) if _plain_link(link) else None
    return link, hashlib.sha256(data).hexdigest() if data is not None else ""


def _plain_link(link: str) -> bool:
    parts = link.split("/")
    return link == "" or (
        len(parts) == 3 and parts[0] == RELEASES and parts[2] == "bcd" and _version_dir_ok(parts[1])
    )


def _prune(ctx: HelperContext, keep: set[str]) -> None:
    """Remove every release directory but `keep` (best effort: a leftover costs disk, not safety)."""
    where = (*split_host_path(DAEMON_DIR), RELEASES)
    with contextlib.suppress(RootPathRefused, OSError), verified_dir(ctx.root, where, create=False) as rfd:
        for name in os.listdir(rfd):
            if name in keep or not _version_dir_ok(name):
                continue
            st = os.stat(name, dir_fd=rfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                continue
            vfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
            try:
                for inner in os.listdir(vfd):
                    if not stat.S_ISDIR(os.stat(inner, dir_fd=vfd, follow_symlinks=False).st_mode):
                        os.unlink(inner, dir_fd=vfd)
            finally:
                os.close(vfd)
            os.rmdir(name, dir_fd=rfd)
        os.fsync(rfd)


def roll_back(ctx: HelperContext, doc: dict[str, Any], reason: str) -> dict[str, Any]:
    """Point the link back at the previous release (or remove it), record `rolled-back`, restart the node."""
    with _daemon_dir(ctx) as dfd:
        if doc["had_previous"]:
            target = _link_target(doc["previous_version"])
            if read_root_only(ctx.root, f"{DAEMON_DIR}/{target}", MAX_ARTIFACT) is None:
                raise Failed("rollback", f"{DAEMON_DIR}/{target} is missing: the previous release is gone")
            _flip(dfd, target)
        else:
            _flip(dfd, None)
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


# --- the artifact, read only inside the staging directory ----------------------------------------------


def _b64(value: str, field: str) -> bytes:
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise Refused("bad-arguments", f"daemon.swap: {field} is not base64") from None


_BAD_STAGING = "bad-staging"


def _staging_fd(call: Call) -> int:
    """An O_RDONLY fd of the staging directory, verified from `/` down (see the module, rule 6)."""
    node_uid = call.ctx.config.node_uid
    parts = split_host_path(STAGING_DIR)
    shown = STAGING_DIR
    try:
        with verified_dir(call.ctx.root, parts[:-2], create=False) as top:
            fd = os.dup(top)
        for name in parts[-2:]:
            try:
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            finally:
                os.close(fd)
            fd = nfd
            st = os.fstat(fd)
            if st.st_uid != node_uid or st.st_mode & 0o022:
                os.close(fd)
                raise Refused(
                    _BAD_STAGING,
                    f"daemon.swap: {shown} (and the data directory above it) must be owned by the node "
                    f"(uid {node_uid}) and writable by nobody else",
                )
        return fd
    except RootPathRefused as exc:
        raise Refused(_BAD_STAGING, f"daemon.swap: the staging directory {shown}: {exc}") from None
    except OSError as exc:
        raise Refused(_BAD_STAGING, f"daemon.swap: the staging directory {shown}: {exc.strerror}") from None


def _read_artifact(call: Call, name: str) -> bytes:
    """The artifact's bytes, read only inside the staging directory (see the module, rule 6)."""
    node_uid = call.ctx.config.node_uid
    shown = f"{STAGING_DIR}/{name}"
    sfd = _staging_fd(call)
    try:
        try:
            before = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        except OSError as exc:
            raise Refused("bad-artifact", f"daemon.swap: artifact {shown}: {exc.strerror}") from None
        _check_artifact_stat(before, shown, node_uid)
        try:
            pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
        except OSError as exc:
            raise Refused("bad-artifact", f"daemon.swap: artifact {shown}: {exc.strerror}") from None
    finally:
        os.close(sfd)
    try:
        st = os.fstat(pfd)
        _check_artifact_stat(st, shown, node_uid)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise Refused("bad-artifact", f"daemon.swap: artifact {shown} was replaced while it was checked")
        # The checked inode itself, reopened for reading: no path is resolved again.
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused("bad-artifact", f"daemon.swap: artifact {shown}: {exc.strerror}") from None
    finally:
        os.close(pfd)
    try:
        again = os.fstat(fd)
        if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
            raise Refused("bad-artifact", f"daemon.swap: artifact {shown} was replaced while it was checked")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_ARTIFACT + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_ARTIFACT:
        raise Refused("too-large", f"daemon.swap: artifact {shown} is larger than {MAX_ARTIFACT} bytes")
    return data


def _check_artifact_stat(st: os.stat_result, shown: str, node_uid: int) -> None:
    if not stat.S_ISREG(st.st_mode) or st.st_uid != node_uid or st.st_nlink != 1:
        raise Refused(
            "bad-artifact",
            f"daemon.swap: artifact {shown} must be a regular file owned by the node (uid {node_uid}) "
            "with one link",
        )
    if st.st_size > MAX_ARTIFACT:
        raise Refused("too-large", f"daemon.swap: artifact {shown} is larger than {MAX_ARTIFACT} bytes")


# --- freshness: the signed spec or command that names the release ---------------------------------------


@frozen
class _Manifest:
    version: str
    url: str
    sha256: str
    signature: bytes
    rollback: bool


def _same_release(
    what: str, manifest: _Manifest, version: str, url: str, sha256: str, sig: bytes, rb: bool
) -> None:
    named = (version, url, sha256, sig, rb)
    if named != (manifest.version, manifest.url, manifest.sha256, manifest.signature, manifest.rollback):
        raise Refused(
            "release-not-in-intent",
            f"daemon.swap: the signed {what} names another release ({version[:80]!r}); "
            "the manifest must be exactly the one it names",
        )


def _check_freshness(
    call: Call,
    req: DaemonSwap,
    manifest: _Manifest,
    chain: tuple[bytes, ...],
    roots: Any,
    node_id: str,
    floor_generation: int,
    doc: dict[str, Any] | None,
    now: dt.datetime,
) -> tuple[int, str, int]:
    """Raise Refused unless the manifest is bound to a fresh signed spec or command. Returns the spec's
    generation (0 for a command), the command id ("" for a spec) and its not_after (0 for a spec)."""
    from bcd_shared import wire
    from bcd_shared.pki import PkiError, verify_command, verify_desired_state
    from bcd_shared.wire.strict import WireError, decode, decode_spec_body, unpack_any

    verifier = call.ctx.intent_verifier()
    if (req.spec is None) == (req.command is None):
        raise Refused(
            "freshness-required",
            "daemon.swap: the release must come with exactly one of `spec` (the signed spec whose daemon "
            "section names it) or `command` (the signed daemon.upgrade command that names it)",
        )
    carrier = req.spec if req.spec is not None else req.command
    assert carrier is not None
    what = "spec" if req.spec is not None else "daemon.upgrade command"
    if len(carrier.body) > MAX_INTENT * 2:
        raise Refused("too-large", f"daemon.swap: the signed {what} is larger than {MAX_INTENT} bytes")
    body = _b64(carrier.body, f"{'spec' if req.spec else 'command'}.body")
    signature = _b64(carrier.signature, f"{'spec' if req.spec else 'command'}.signature")
    try:
        if req.spec is not None:
            verify_desired_state(body, signature, chain, roots, now, verifier.chains)
        else:
            verify_command(body, signature, chain, roots, now, verifier.chains)
    except PkiError as exc:
        raise Refused("bad-intent", f"daemon.swap: the signed {what} is refused: {exc}") from None
    if req.spec is not None:
        try:
            spec, _unknown = decode_spec_body(body)
        except WireError as exc:
            raise Refused("bad-intent", f"daemon.swap: the signed spec does not decode: {exc}") from None
        if node_id and spec.node_id != node_id:
            raise Refused("wrong-node", f"daemon.swap: the signed spec is for node {spec.node_id[:80]!r}")
        if spec.generation < floor_generation:
            raise Refused(
                "stale-generation",
                f"daemon.swap: the signed spec's generation {spec.generation} is older than generation "
                f"{floor_generation} already accepted: its release is not fresh",
            )
        section = None
        if spec.full is not None:
            section = spec.full.daemon
        elif spec.patch is not None:
            section = spec.patch.daemon
        if section is None:
            raise Refused(
                "release-not-in-intent",
                f"daemon.swap: the signed spec (generation {spec.generation}) sets no daemon section",
            )
        _same_release(
            "spec",
            manifest,
            section.version,
            section.url,
            section.sha256,
            bytes(section.signature),
            section.rollback,
        )
        return spec.generation, "", 0
    try:
        cmd = decode(wire.CommandBody, body)
        payload = unpack_any(cmd.payload, wire.DaemonUpgradeRequest)
    except WireError as exc:
        raise Refused("bad-intent", f"daemon.swap: the signed command does not decode: {exc}") from None
    if cmd.kind != "daemon.upgrade":
        raise Refused(
            "bad-intent", f"daemon.swap: the signed command is {cmd.kind[:80]!r}, not daemon.upgrade"
        )
    if not node_id:
        # As check_command: a command binds no node (a spec does, on first use), so with none bound yet
        # any node's command would do (round 5).
        raise Refused(
            "intent-unverifiable",
            "daemon.swap: this helper is bound to no node yet (no join record, no signed spec accepted): "
            "a daemon.upgrade command cannot be checked against it",
        )
    if cmd.node_id != node_id:
        raise Refused("wrong-node", f"daemon.swap: the signed command is for node {cmd.node_id[:80]!r}")
    if cmd.target_node_id not in ("", cmd.node_id):
        # A command acting on another node (as check_command refuses for gpu.reset and node.reboot).
        raise Refused(
            "wrong-node",
            f"daemon.swap: the signed command targets node {cmd.target_node_id[:80]!r}, "
            f"not {cmd.node_id[:80]!r}",
        )
    now_ms = int(now.timestamp() * 1000)
    if cmd.not_after <= now_ms:
        raise Refused(
            "expired-intent",
            f"daemon.swap: the signed daemon.upgrade command {cmd.id[:80]} expired (not_after "
            f"{cmd.not_after}, now {now_ms}): its release is not fresh",
        )
    used = doc["used_commands"] if doc is not None else []
    if cmd.id in used or not cmd.id:
        raise Refused(
            "intent-replayed", f"daemon.swap: the daemon.upgrade command {cmd.id[:80]!r} was already used"
        )
    # The record keeps the last 64 ids only; root's memory of used commands keeps each until its not_after
    # (round 5: a rollback command replayed after 64 newer ones went back below them).
    verifier.used.check("daemon.upgrade", cmd.id, ("",), now_ms)
    _same_release(
        "daemon.upgrade command",
        manifest,
        payload.version,
        payload.url,
        payload.sha256,
        bytes(payload.signature),
        payload.rollback,
    )
    return 0, cmd.id, cmd.not_after


def _check_order(manifest: _Manifest, doc: dict[str, Any] | None) -> bool:
    """Raise Refused unless the release moves forward (or is a signed rollback). True: it is the
    installed release already (nothing to do)."""
    from bcd_shared.release import UnorderedVersion, compare_versions, version_key

    try:
        version_key(manifest.version)
    except UnorderedVersion as exc:
        raise Refused("unordered-version", f"daemon.swap: {exc}") from None
    installed = doc["version"] if doc is not None and doc["state"] != "pending" else ""
    if not installed:  # a packaged install or nothing: the first swap sets the floor
        return False
    try:
        order = compare_versions(manifest.version, installed)
    except UnorderedVersion:
        order = 1  # the installed one has no order (only a packaged install): anything ordered is newer
    if order == 0:
        if doc is None or manifest.sha256 != doc["sha256"]:
            raise Refused(
                "version-reused",
                f"daemon.swap: version {manifest.version} is installed with another SHA-256: "
                "one version names one artifact",
            )
        return True
    if order < 0 and not manifest.rollback:
        raise Refused(
            "downgrade",
            f"daemon.swap: {manifest.version} is older than the installed {installed}: releases only move "
            "forward unless a signed rollback intent names the version",
        )
    return False


def _spec_state(call: Call, req: DaemonSwap, now: dt.datetime) -> Any | None:
    """The signed-intent state after a swap's spec (None: nothing to write, or a command carried it).

    A spec the node forwards to daemon.swap is a spec root accepted: its generation becomes the floor of
    every signed op (host.unit, access.apply, the hold writes, libvirt.*, ch.*, nft.apply), as theirs is
    daemon.swap's. Else the node could forward a newer spec here only and hand those ops an older one
    (round 5). The spec passed every rule above; check_spec checks it again with the common rules (the
    same chain and roots, node bound or bound now on first use) and gives the state to write."""
    if req.spec is None:
        return None
    from bcd_helper.ops.hostunit import SignedIntent

    carried = SignedIntent(req.spec.body, req.spec.signature, req.chain, req.trust_bundle)
    return call.ctx.intent_verifier().check_spec("daemon.swap", carried, now).next_state


def daemon_swap(call: Call, req: DaemonSwap) -> dict[str, Any]:
    from bcd_shared.pki import PkiError
    from bcd_shared.release import ArtifactMismatch, ReleaseManifest, check_artifact, verify_release

    try:
        manifest = ReleaseManifest(req.version, req.url, req.sha256, req.rollback)
    except PkiError as exc:
        raise Refused("bad-manifest", f"daemon.swap: {exc}") from None
    if not 1 <= req.confirm_timeout_s <= MAX_CONFIRM_S:
        raise Refused("bad-arguments", f"daemon.swap: confirm_timeout_s must be 1 to {MAX_CONFIRM_S}")
    if not ARTIFACT_NAME_RE.fullmatch(req.artifact):
        # Never a path: nothing outside the staging directory is ever looked at, so the answer says
        # nothing about the rest of the host (no existence oracle).
        raise Refused(
            "bad-artifact",
            f"daemon.swap: artifact must be one file name in {STAGING_DIR} ([A-Za-z0-9._+~-], 1-128, "
            "not starting with a dot), not a path",
        )
    signature = _b64(req.signature, "signature")
    chain = tuple(_b64(c, f"chain[{i}]") for i, c in enumerate(req.chain))
    presented = None if req.trust_bundle is None else _b64(req.trust_bundle, "trust_bundle")
    doc = load_release(call.ctx)
    if doc is not None and doc["state"] == "pending":
        raise Refused(
            "swap-pending", f"daemon.swap: the swap to {doc['version']} still waits for its daemon.confirm"
        )
    verifier = call.ctx.intent_verifier()
    view = verifier.trust("daemon.swap", presented, chain)
    if view.roots is None:
        raise Refused(
            "intent-unverifiable",
            "daemon.swap: no command-signing roots (command_root_sha256, root's join record or a trust "
            "bundle) to verify the release against",
        )
    now = dt.datetime.now(dt.UTC)
    try:
        verify_release(manifest, signature, chain, view.roots, now, verifier.chains)
    except PkiError as exc:
        raise Refused(
            "bad-release-signature", f"daemon.swap: the release signature is refused: {exc}"
        ) from None
    signed = _Manifest(manifest.version, manifest.url, manifest.sha256, signature, manifest.rollback)
    floor = max(view.state.generation, doc["spec_generation"] if doc is not None else 0)
    generation, command_id, not_after = _check_freshness(
        call, req, signed, chain, view.roots, view.state.node_id, floor, doc, now
    )
    if (
        doc is not None
        and doc["state"] == "rolled-back"
        and doc["previous_version"] == manifest.version
        and doc["previous_sha256"] == manifest.sha256
        and not command_id
        and generation <= doc["spec_generation"]
    ):
        # The release that was just rolled back, from the same spec again: it would be swapped in and
        # rolled back every pass. A newer spec, or a new daemon.upgrade command, may try it again.
        raise Refused(
            "release-failed",
            f"daemon.swap: {manifest.version} was rolled back ({doc['reason']}); only a newer spec than "
            f"generation {doc['spec_generation']} or a daemon.upgrade command tries it again",
        )
    next_state = _spec_state(call, req, now)
    if _check_order(signed, doc):
        assert doc is not None
        if next_state is not None:  # durable before effect (the restart)
            verifier.save_state(next_state)
        # The node asks for what is installed, so it is not running it: it restarts onto it.
        return {
            "version": manifest.version,
            "previous_version": doc["previous_version"],
            "path": INSTALLED,
            "already_installed": True,
            "restart": _restart_node(call.ctx),
        }
    artifact = _read_artifact(call, req.artifact)
    try:
        check_artifact(manifest, hashlib.sha256(artifact).hexdigest())
    except ArtifactMismatch as exc:
        raise Refused("artifact-mismatch", f"daemon.swap: {exc}") from None
    if next_state is not None:  # durable before effect: root's one floor for every signed op
        verifier.save_state(next_state)
    if not command_id:
        return _swap_in(call, manifest, artifact, doc, generation, command_id, req.confirm_timeout_s)
    # Durable before effect: a daemon.upgrade command swaps once until its not_after. A swap that fails with
    # the previous release still installed forgets it again: the command is retry-safe.
    now_ms = int(now.timestamp() * 1000)
    verifier.used.remember("daemon.upgrade", command_id, ("",), not_after, now_ms)
    try:
        return _swap_in(call, manifest, artifact, doc, generation, command_id, req.confirm_timeout_s)
    except Failed as exc:
        if exc.reason == "swap":
            verifier.used.forget("daemon.upgrade", command_id, now_ms)
        raise


def _swap_in(
    call: Call,
    manifest: Any,
    artifact: bytes,
    doc: dict[str, Any] | None,
    generation: int,
    command_id: str,
    timeout_s: int,
) -> dict[str, Any]:
    ctx = call.ctx
    try:
        with _daemon_dir(ctx) as dfd:
            link, current_sha = _installed_sha256(ctx, dfd)
    except (RootPathRefused, OSError) as exc:
        raise Failed("swap", f"daemon.swap: {INSTALLED}: {exc}") from None
    known = doc is not None and doc["state"] in ("confirmed", "rolled-back")
    previous_version = doc["version"] if known and doc is not None and link not in (None, "") else ""
    used = [*(doc["used_commands"] if doc is not None else []), *([command_id] if command_id else [])]
    pending = {
        "state": "pending",
        "version": manifest.version,
        "sha256": manifest.sha256,
        "previous_version": previous_version,
        "previous_sha256": current_sha,
        "had_previous": link is not None,
        "deadline_ms": int(time.time() * 1000) + timeout_s * 1000,
        "reason": "",
        "spec_generation": max(generation, doc["spec_generation"] if doc is not None else 0),
        "used_commands": used[-MAX_USED_COMMANDS:],
        "flip_boot_id": boot_id(),
        "flip_tick": None,  # set once the link names the new release (below)
    }
    try:
        _save_release(ctx, pending)  # durable before effect
        if link == "":  # a packaged install: its file becomes the `initial` release
            data = read_root_only(ctx.root, INSTALLED, MAX_ARTIFACT) or b""
            write_root_only(ctx.root, f"{DAEMON_DIR}/{_link_target('')}", data, 0o755)
        write_root_only(ctx.root, f"{DAEMON_DIR}/{_link_target(manifest.version)}", artifact, 0o755)
        with _daemon_dir(ctx) as dfd:
            _flip(dfd, _link_target(manifest.version))
    except (RootPathRefused, OSError) as exc:
        # The flip is the last step and atomic: the link still names the previous release. Only the
        # record moves back (a release directory written on the way is pruned at the next confirm).
        try:
            if doc is None:
                remove_root_only(ctx.root, RELEASE_STATE)
            else:
                _save_release(ctx, doc)
        except (RootPathRefused, OSError) as again:
            raise Failed("swap", f"daemon.swap: {exc}; the record could not be put back: {again}") from None
        raise Failed("swap", f"daemon.swap: {exc}; the previous release stays installed") from None
    # When the flip happened, taken after it (a process that started at or before this tick may run the
    # old release): durable before the answer and the restart. A crash before this leaves flip_tick
    # null, and every confirmation of the swap by the node is then refused (`flip-unrecorded`) until the
    # deadline rolls it back: nothing is confirmed that root cannot date. A failed write rolls back now.
    flip = boot_tick()
    try:
        _save_release(ctx, {**pending, "flip_tick": flip})
    except (RootPathRefused, OSError) as exc:
        arm(ctx, manifest.version, timeout_s)  # whatever the rollback leaves, the deadline rolls back
        try:
            roll_back(ctx, pending, "root could not record the time of its flip")
        except (Failed, RootPathRefused, OSError) as again:
            raise Failed(
                "swap",
                f"daemon.swap: recording the flip's time: {exc}; rolling back: {again} (the deadline "
                "rolls back)",
            ) from None
        raise Failed(
            "swap", f"daemon.swap: recording the flip's time: {exc}; the previous release is installed again"
        ) from None
    _after_the_flips_tick(flip)
    arm(ctx, manifest.version, timeout_s)
    return {
        "version": manifest.version,
        "previous_version": previous_version,
        "path": INSTALLED,
        "confirm_by_ms": pending["deadline_ms"],
        "restart": _restart_node(ctx),  # the node starts again on the new release
    }


def _peer_exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (a zombie or reaped): its pidfd then polls readable."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _peer_gone(call: Call, why: str) -> Refused:
    return Refused(
        "peer-gone",
        f"daemon.confirm: the process that connected (pid {call.peer.pid}) {why}: its pid may be another "
        "process's now, so root cannot date the confirmation; only a live process started after the "
        "flip (the restarted node, on its own connection) may confirm",
    )


def _peer_start_tick(call: Call) -> int | None:
    """The start of the process that connected, pinned (round 11): SO_PEERCRED's pid is the connecting
    process's at connect, but that process may have handed its socket on and exited, and a later
    process may hold the pid now; /proc/PID/stat would then date that one. So root takes a pidfd of the
    connecting process (SO_PEERPIDFD), reads /proc/PID/stat, and only then checks on the pidfd that the
    process has not exited: alive after the read, it held the pid throughout, and the start read is its.
    Exited (or no pidfd to be had for it): `peer-gone`. Where the kernel has no SO_PEERPIDFD (before
    Linux 6.5), and in process (no socket), the pid alone dates the peer, as in round 10."""
    pidfd: int | None = None
    if call.peer_pidfd is not None:
        try:
            pidfd = call.peer_pidfd()
        except OSError as exc:
            raise _peer_gone(call, f"has no pidfd ({os.strerror(exc.errno or 0)})") from None
    try:
        started = start_tick(call.peer.pid)
        if pidfd is not None and _peer_exited(pidfd):
            raise _peer_gone(call, "has exited")
        return started
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _check_peer_started_after_flip(call: Call, doc: dict[str, Any]) -> None:
    """Round 10: a node process that started before root flipped the link cannot be running the new
    release (the restart is `--no-block`, so the old process may still be there to answer). The peer's
    pid is SO_PEERCRED's (taken at connect), pinned by SO_PEERPIDFD (round 11: `peer-gone` when the
    connecting process has exited); its start is /proc/PID/stat's starttime, set by the kernel at fork.
    Refused at or before the flip's tick (one tick may hold both), when either time is unknown,
    and when the record holds no flip time of this boot. Another boot than the flip's started after it:
    every process of it did too."""
    current = boot_id()
    if doc["flip_boot_id"] and current and doc["flip_boot_id"] != current:
        return
    if doc["flip_tick"] is None or not doc["flip_boot_id"] or not current:
        raise Refused(
            "flip-unrecorded",
            f"daemon.confirm: the record of the swap to {doc['version']} holds no time of root's flip of "
            f"{INSTALLED} in this boot (the helper stopped between the flip and its record, or the record "
            "predates round 10): root cannot tell the new release's process from the old one's, so no "
            "process of the node confirms it; the deadline rolls it back and the node may swap again",
        )
    started = _peer_start_tick(call)
    if started is None:
        raise Refused(
            "peer-predates-swap",
            f"daemon.confirm: root cannot read when the confirming process (pid {call.peer.pid}) started "
            "(/proc/PID/stat): only a process started after root's flip may confirm",
        )
    if started <= doc["flip_tick"]:
        hz = os.sysconf("SC_CLK_TCK")
        raise Refused(
            "peer-predates-swap",
            f"daemon.confirm: the confirming process (pid {call.peer.pid}) started {started / hz:.2f} s "
            f"after boot, not after root flipped {INSTALLED} to {doc['version']} "
            f"({doc['flip_tick'] / hz:.2f} s): it cannot be running the new release; only a process "
            "started after the flip (the restarted node) may confirm",
        )


def daemon_confirm(call: Call, req: DaemonConfirm) -> dict[str, Any]:
    doc = load_release(call.ctx)
    if doc is None or doc["state"] != "pending":
        raise Refused("no-pending-swap", "daemon.confirm: no swap waits for a confirmation")
    if doc["version"] != req.version:
        raise Refused(
            "version-mismatch",
            f"daemon.confirm: the pending swap is to {doc['version']}, not {req.version[:80]!r}",
        )
    if req.healthy:
        # Root's own look at the link: a crash between the `pending` record and the flip leaves the old
        # release installed, and a confirmation from it must not make the record say otherwise (round 9).
        # Refused before the timer is cancelled: the deadline still rolls the record back.
        try:
            with _daemon_dir(call.ctx) as dfd:
                link = _installed_link(dfd)
        except (RootPathRefused, OSError) as exc:
            raise Failed("confirm", f"daemon.confirm: {INSTALLED}: {exc}") from None
        if link != _link_target(doc["version"]):
            raise Refused(
                "not-swapped",
                f"daemon.confirm: {INSTALLED} names {str(link)[:200]!r}, not the pending release "
                f"{_link_target(doc['version'])!r}: nothing to confirm (the swap did not complete)",
            )
        if call.peer.uid != 0:
            _check_peer_started_after_flip(call, doc)
    with call.ctx.timer_lock:
        if call.ctx.daemon_timer is not None:
            call.ctx.daemon_timer.cancel()
            call.ctx.daemon_timer = None
    if not req.healthy:
        return roll_back(call.ctx, doc, "the new release reported itself unhealthy")
    _save_release(call.ctx, {**doc, "state": "confirmed"})
    keep = {_dir_name(doc["version"])}
    if doc["had_previous"]:
        keep.add(_dir_name(doc["previous_version"]))
    _prune(call.ctx, keep)
    return {"version": doc["version"], "confirmed": True, "previous_version": doc["previous_version"]}
