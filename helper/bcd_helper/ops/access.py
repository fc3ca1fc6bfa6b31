"""access.apply: root renders and writes the sshd files of the access section from a signed spec.

delivery.md "Break-glass SSH and tunnel keys" (DLV-ACC-01..06, DLV-PRIV-07), issue 9 items 1 and 2. The node
never sends sshd text: it sends the signed DesiredState body it keeps (as for host.unit), root checks it
with the same rules (chain to the command-signing roots, signature, node id, generation never older;
bcd_helper.intent.check_spec), takes the spec's access section (a full spec decides it, unset meaning
empty; a patch must set it), and renders the files itself with bcd_shared.access (the one renderer the
node as root uses too). Rules on top of the renderer's:
- with no command-signing roots the request is refused (`access-unsigned`) unless root's config sets
  `[helper] unsigned_access = true` (development only): then the body is decoded strictly, unverified;
- an account whose uid is 0 gets no principals file unless root's config sets `[helper] root_principals
  = true` (`root-principal`); root reads the account's uid itself (the passwd database on a real host,
  the simulated root's /etc/passwd under --root);
- root's intent state is written before any file (durable before effect); files are written CA keys,
  KRL, principals, then the drop-in (which points sshd at the others), stale principals files removed;
  an empty section removes the drop-in first, then the rest (DLV-ACC-06); a write or removal that fails
  part way puts back every file already changed as root found it (`access-write`, round 9);
- sshd is reloaded only when the drop-in changed (DLV-ACC-05): `systemctl reload` of whichever of
  ssh.service / sshd.service is active; none active, nothing to reload (sshd reads the files at start).
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import Any

from attrs import frozen
from bcd_shared.rootpath import (
    RootPathRefused,
    read_root_only,
    remove_root_only,
    split_host_path,
    verified_dir,
    write_root_only,
)

from bcd_helper.ops.base import Call, Failed, Refused, refused_path
from bcd_helper.ops.hostunit import SignedIntent

OP = "access.apply"
SSHD_UNITS = ("ssh.service", "sshd.service")
MAX_FILE = 4 * 1024 * 1024


@frozen
class AccessApply:
    intent: SignedIntent | None = None


def _section(decoded: Any) -> Any | None:
    """The spec's access section (None: empty), or Refused for a patch that does not set it."""
    if decoded.full is not None:
        return decoded.full.access
    if decoded.patch is not None and decoded.patch.access is not None:
        return decoded.patch.access
    raise Refused("bad-intent", f"{OP}: the spec (generation {decoded.generation}) sets no access section")


def uid_of(root: Path, account: str) -> int | None:
    """The account's uid as root sees it (None: no such account)."""
    if root == Path("/"):
        try:
            return pwd.getpwnam(account).pw_uid
        except KeyError:
            return None
    try:
        data = read_root_only(root, "/etc/passwd", MAX_FILE)
    except RootPathRefused:
        return None
    for line in (data or b"").decode("utf-8", "replace").splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[0] == account and fields[2].isdigit():
            return int(fields[2])
    return None


def _existing_principals(root: Path) -> list[str]:
    """The principals files root finds (names that are account names), read from a verified fd."""
    from bcd_shared import access as acc

    try:
        with verified_dir(root, split_host_path(acc.SSHD_PRINCIPALS), create=False) as dfd:
            names = os.listdir(dfd)
    except FileNotFoundError:
        return []
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    return sorted(n for n in names if acc.ACCOUNT_RE.fullmatch(n))


def _read(root: Path, path: str) -> bytes | None:
    try:
        return read_root_only(root, path, MAX_FILE)
    except RootPathRefused as exc:
        raise refused_path(exc) from None


def _reload_sshd(call: Call) -> str:
    for unit in SSHD_UNITS:
        if call.system.run(["systemctl", "is-active", "--quiet", unit], timeout=30).ok:
            result = call.system.run(["systemctl", "reload", unit], timeout=60)
            if not result.ok:
                raise Failed("sshd-reload", f"{OP}: systemctl reload {unit}: {result.describe()}")
            return unit
    return ""


def _put_back(root: Path, observed: Any, paths: list[str]) -> None:
    """Nothing half-applied (round 9): a write that fails part way puts back the bytes root found (or
    removes what it created), newest first, so the new CA keys never stand beside the old KRL. Best
    effort: a path that cannot be put back either is left as it is (the failure is answered anyway)."""
    from bcd_shared import access as acc

    for path in reversed(paths):
        data = observed.files.get(path)
        try:
            if data is None:
                remove_root_only(root, path)
            else:
                write_root_only(root, path, data, acc.FILE_MODE)
        except (RootPathRefused, OSError):
            continue


def access_apply(call: Call, req: AccessApply) -> dict[str, Any]:
    from bcd_shared import access as acc  # on the first access.apply, not at the helper's start

    config = call.ctx.config
    verifier = call.ctx.intent_verifier()
    # The node's unverified body is decoded only where root's config takes unsigned specs: a refusal
    # comes before any decoding (round 6: 2.7 MiB of empty assignments decoded to ~340 MiB in root).
    checked = verifier.check_spec(OP, req.intent, decode_unverified=config.unsigned_access)
    if not checked.roots:
        if not config.unsigned_access:
            raise Refused(
                "access-unsigned",
                f"{OP}: no command-signing roots to verify the access section against: root renders sshd "
                "files only from a signed spec ([helper] unsigned_access = true allows unsigned specs, "
                "for development only)",
            )
        if checked.decoded is None:
            raise Refused("intent-required", f"{OP}: the spec is required: root renders the files from it")
    decoded = checked.decoded
    assert decoded is not None  # check_spec decodes whenever roots verified it or the body was sent
    section = _section(decoded)
    try:
        rendered = acc.render(
            list(section.ssh_ca_keys) if section else [],
            list(section.principals) if section else [],
            list(section.revoked_serials) if section else [],
            decoded.node_id,
        )
    except acc.AccessInvalid as exc:
        raise Refused("invalid-access", f"{OP}: generation {decoded.generation}: {exc}") from None
    if not config.root_principals:
        for account in rendered.accounts:
            if uid_of(call.ctx.root, account) == 0:
                raise Refused(
                    "root-principal",
                    f"{OP}: account {account!r} has uid 0: no principals file for it unless root's config "
                    "sets [helper] root_principals = true",
                )
    observed = acc.Observed(
        {
            path: data
            for path in acc.managed_paths(_existing_principals(call.ctx.root))
            if (data := _read(call.ctx.root, path)) is not None
        }
    )
    steps = acc.plan(rendered, observed)
    if checked.next_state is not None:  # durable before effect: root's intent state, then the files
        verifier.save_state(checked.next_state)
    written: list[str] = []
    removed: list[str] = []
    reloaded = ""
    try:
        for step in steps:
            if isinstance(step, acc.Write):
                try:
                    write_root_only(call.ctx.root, step.path, step.data, acc.FILE_MODE)
                except RootPathRefused as exc:
                    _put_back(call.ctx.root, observed, [*written, *removed, step.path])
                    raise refused_path(exc) from None
                except OSError as exc:
                    _put_back(call.ctx.root, observed, [*written, *removed, step.path])
                    raise Failed(
                        "access-write",
                        f"{OP}: {step.path}: {exc}; the files written before it were put back",
                    ) from None
                written.append(step.path)
            elif isinstance(step, acc.Remove):
                try:
                    if remove_root_only(call.ctx.root, step.path):
                        removed.append(step.path)
                except RootPathRefused as exc:
                    _put_back(call.ctx.root, observed, [*written, *removed])
                    raise refused_path(exc) from None
                except OSError as exc:
                    _put_back(call.ctx.root, observed, [*written, *removed])
                    raise Failed(
                        "access-write",
                        f"{OP}: removing {step.path}: {exc}; the files written before it were put back",
                    ) from None
            else:
                try:
                    reloaded = _reload_sshd(call)
                except Failed:
                    # sshd did not take the new drop-in: take it away again, so the next request sees the
                    # drop-in change and reloads again (a reload happens only on a change, DLV-ACC-05).
                    if rendered.dropin is not None:
                        remove_root_only(call.ctx.root, acc.SSHD_DROPIN)
                    raise
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    return {
        "generation": decoded.generation,
        "signed": checked.roots,
        "written": written,
        "removed": removed,
        "accounts": list(rendered.accounts),
        "skipped_principals": len(rendered.skipped),
        "reloaded": reloaded,
    }
