"""file.write and file.remove: files root writes for the node, by kind. The helper builds the path.

The node names a kind and an id; the path comes from FILE_KINDS below, never from the node, and the
content is checked against the kind's rule before anything is written. Writes and removals go through
the root-only rule (HST-ROOT-08) and are atomic and durable.

- cdi: /etc/cdi/bcd-<id>.json 0644, id an allocation id; one bcd hold (kind bcd.dev/gpu) for
  exactly that allocation (bcd_shared.cdi.parse_hold_spec, CDI's naming rules), strict JSON (no
  duplicate key, NaN or deep nesting), its env setting no key twice and BCD_ALLOCATION_ID only to
  <id>, no env on a device (one without other edits: exactly its BCD_DEVICE_ marker), and every
  other container edit (hooks, mounts, device nodes, ...) one that root's own vendor spec
  /etc/cdi/nvidia.json carries: the container runtime applies a hold as root, so a hook there would
  be root's code execution;
- allocation-env: /run/bcd/allocations/<id>.env 0644; KEY=VALUE lines, the first
  BCD_ALLOCATION_ID=<id>, no key twice;
- k8s-token: /var/lib/bcd-hostconfig/k8s/bootstrap-token 0600, id ""; one kubeadm bootstrap token;
- sshd-config: /etc/ssh/sshd_config.d/90-bcd.conf 0644, id ""; only bcd's three directives,
  each pointing at bcd's own files;
- sshd-ca: /etc/ssh/bcd/user_ca.pub 0644, id ""; OpenSSH public keys, one per line;
- sshd-principals: /etc/ssh/bcd/principals/<id> 0644, id an account name; one principal a line;
- sshd-krl: /etc/ssh/bcd/revoked.krl 0644, id ""; an OpenSSH KRL (binary, sent base64).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import struct
from collections.abc import Callable
from typing import Any

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, read_root_only, remove_root_only, write_root_only

from bcd_helper.audit import canonical
from bcd_helper.ops.base import Call, Refused, refused_path
from bcd_helper.protocol import strict_loads

MAX_CONTENT = 1024 * 1024
ALLOCATION_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,80}$")
ACCOUNT_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_EMPTY_RE = re.compile(r"^$")
_TOKEN_RE = re.compile(r"^[a-z0-9]{6}\.[a-z0-9]{16}\n?$")
_KEY_TYPES = frozenset(
    {
        "ssh-ed25519",
        "ssh-rsa",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
        "sk-ecdsa-sha2-nistp256@openssh.com",
    }
)
SSHD_DIR = "/etc/ssh/bcd"
SSHD_CA = f"{SSHD_DIR}/user_ca.pub"
SSHD_PRINCIPALS = f"{SSHD_DIR}/principals"
SSHD_KRL = f"{SSHD_DIR}/revoked.krl"
SSHD_DROPIN = "/etc/ssh/sshd_config.d/90-bcd.conf"
SSHD_DIRECTIVES = {
    "TrustedUserCAKeys": SSHD_CA,
    "AuthorizedPrincipalsFile": f"{SSHD_PRINCIPALS}/%u",
    "RevokedKeys": SSHD_KRL,
}
_DIRECTIVES_TEXT = ", ".join(f"{k} {v}" for k, v in SSHD_DIRECTIVES.items())
KRL_MAGIC = b"SSHKRL\n\x00"


@frozen
class FileWrite:
    kind: str
    id: str
    content: str
    encoding: str = "utf-8"


@frozen
class FileRemove:
    kind: str
    id: str


# Besides C0 controls and DEL: C1 controls (NEL among them) and the Unicode line and paragraph
# separators, which str.splitlines() takes as line ends while the files' readers do not.
_LINE_BREAKERS = frozenset(chr(c) for c in range(0x80, 0xA0)) | {"\u2028", "\u2029"}


def _no_controls(text: str, where: str) -> None:
    if any((ord(c) < 0x20 and c != "\n") or ord(c) == 0x7F or c in _LINE_BREAKERS for c in text):
        raise Refused("bad-content", f"{where}: carries a control character")


def _unique_keys(lines: Any, where: str) -> None:
    seen: set[str] = set()
    for line in lines:
        key = str(line).partition("=")[0]
        if key in seen:
            raise Refused("bad-content", f"{where}: {key[:100]!r} is set twice")
        seen.add(key)


def _check_cdi(ident: str, data: bytes) -> None:
    from bcd_shared import cdi  # on the first hold, not at the helper's start

    try:
        doc = strict_loads(data)
    except ValueError as exc:
        raise Refused("bad-content", f"cdi: not strict JSON: {exc}") from None
    try:
        hold = cdi.parse_hold_spec(data, ident)
    except cdi.CdiError as exc:
        raise Refused("bad-content", f"cdi: {exc}") from None
    _unique_keys(hold.env, "cdi: containerEdits.env")
    own = f"BCD_ALLOCATION_ID={ident}"
    if any(e.startswith("BCD_ALLOCATION_ID=") and e != own for e in hold.env):
        raise Refused("bad-content", f"cdi: containerEdits.env: BCD_ALLOCATION_ID must be {ident}")
    for i, dev in enumerate(doc["devices"]):
        env = (dev.get("containerEdits") or {}).get("env")
        if not env:
            continue
        # A device without other edits carries exactly its own marker (cdi.device_marker_env), no more.
        edits = dev.get("containerEdits") or {}
        if set(edits) == {"env"} and env == [cdi.device_marker_env(hold.device_ids[i])]:
            continue
        raise Refused(
            "bad-content",
            f"cdi: devices[{i}].containerEdits.env: a hold's devices carry no env "
            "(only a device without other edits, its own BCD_DEVICE_ marker)",
        )


def _vendor_edits(call: Call) -> frozenset[tuple[str, bytes]]:
    """Every container edit root's vendor spec carries, as (field, canonical JSON of one item): its common
    edits and every device's, env aside. Empty without a vendor spec."""
    from bcd_shared import cdi

    try:
        data = read_root_only(call.ctx.root, cdi.VENDOR_SPEC_PATH, 16 * MAX_CONTENT)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    if data is None:
        return frozenset()
    try:
        vendor = cdi.parse_vendor_spec(data)
    except cdi.CdiError as exc:
        raise Refused("bad-content", f"cdi: root's {cdi.VENDOR_SPEC_PATH}: {exc}") from None
    out: set[tuple[str, bytes]] = set()
    for edits in (vendor.common_edits, *vendor.devices.values()):
        for key, value in edits.items():
            if key != "env":
                out.update((key, canonical(v)) for v in (value if isinstance(value, list) else [value]))
    return frozenset(out)


def _check_cdi_edits(call: Call, _ident: str, data: bytes) -> None:
    """A hold carries only container edits root's vendor spec carries (env aside)."""
    from bcd_shared import cdi

    doc = json.loads(data)  # _check_cdi found it strict JSON
    allowed: frozenset[tuple[str, bytes]] | None = None
    places = [("containerEdits", doc.get("containerEdits") or {})]
    places += [
        (f"devices[{i}].containerEdits", d.get("containerEdits") or {}) for i, d in enumerate(doc["devices"])
    ]
    for where, edits in places:
        for key, value in edits.items():
            if key == "env":
                continue
            if allowed is None:
                allowed = _vendor_edits(call)
            for item in value if isinstance(value, list) else [value]:
                if (key, canonical(item)) not in allowed:
                    raise Refused(
                        "bad-content",
                        f"cdi: {where}.{key}: {canonical(item)[:200].decode()} is not in root's vendor spec "
                        f"{cdi.VENDOR_SPEC_PATH}: a hold carries only the vendor's edits",
                    )


def _check_env(ident: str, data: bytes) -> None:
    from bcd_shared import cdi

    _text(data, "allocation-env")
    try:
        lines = cdi.parse_env_file(data, ident)
    except cdi.CdiError as exc:
        raise Refused("bad-content", f"allocation-env: {exc}") from None
    _unique_keys(lines, "allocation-env")


def _text(data: bytes, kind: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("bad-content", f"{kind}: not UTF-8") from None
    _no_controls(text, kind)
    if text and not text.endswith("\n"):
        raise Refused("bad-content", f"{kind}: must end with a newline")
    return text


def _check_token(_ident: str, data: bytes) -> None:
    if not _TOKEN_RE.fullmatch(data.decode("utf-8", errors="replace")):
        raise Refused("bad-content", "k8s-token: not a kubeadm bootstrap token ([a-z0-9]{6}.[a-z0-9]{16})")


def _check_sshd_config(_ident: str, data: bytes) -> None:
    seen: set[str] = set()
    for n, line in enumerate(_text(data, "sshd-config").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or SSHD_DIRECTIVES.get(parts[0]) != parts[1] or parts[0] in seen:
            raise Refused(
                "bad-content",
                f"sshd-config line {n}: only {_DIRECTIVES_TEXT}, once each",
            )
        seen.add(parts[0])


def _check_public_key(line: str, n: int) -> None:
    parts = line.split(" ", 2)
    if len(parts) < 2 or parts[0] not in _KEY_TYPES:
        raise Refused("bad-content", f"sshd-ca line {n}: not one OpenSSH public key")
    try:
        blob = base64.b64decode(parts[1], validate=True)
        (length,) = struct.unpack(">I", blob[:4])
        inner = blob[4 : 4 + length].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError):
        raise Refused("bad-content", f"sshd-ca line {n}: the key is not valid base64 key data") from None
    if inner != parts[0]:
        raise Refused("bad-content", f"sshd-ca line {n}: the key data is a {inner!r} key, not {parts[0]!r}")


def _check_sshd_ca(_ident: str, data: bytes) -> None:
    lines = [line for line in _text(data, "sshd-ca").splitlines()]
    for n, line in enumerate(lines, start=1):
        if line.strip() and not line.startswith("#"):
            _check_public_key(line, n)


def _check_principals(_ident: str, data: bytes) -> None:
    lines = _text(data, "sshd-principals").splitlines()
    if len(lines) > 1024:
        raise Refused("bad-content", "sshd-principals: at most 1024 principals")
    for n, line in enumerate(lines, start=1):
        if not line or any(c.isspace() for c in line) or len(line) > 256:
            raise Refused(
                "bad-content", f"sshd-principals line {n}: one principal without whitespace, 1-256 chars"
            )


def _check_krl(_ident: str, data: bytes) -> None:
    if not data.startswith(KRL_MAGIC):
        raise Refused("bad-content", "sshd-krl: not an OpenSSH KRL (magic SSHKRL)")


@frozen
class FileKind:
    path: Callable[[str], str]
    id_rule: re.Pattern[str]
    id_text: str
    mode: int
    check: Callable[[str, bytes], None]
    encoding: str = "utf-8"
    host_check: Callable[[Call, str, bytes], None] | None = None  # checks that read root's own files


# kind -> how the helper builds the path and checks the content. One literal table.
FILE_KINDS: dict[str, FileKind] = {
    "cdi": FileKind(
        lambda i: f"/etc/cdi/bcd-{i}.json",
        ALLOCATION_ID_RE,
        "an allocation id ([A-Za-z0-9_]{1,80})",
        0o644,
        _check_cdi,
        host_check=_check_cdi_edits,
    ),
    "allocation-env": FileKind(
        lambda i: f"/run/bcd/allocations/{i}.env",
        ALLOCATION_ID_RE,
        "an allocation id ([A-Za-z0-9_]{1,80})",
        0o644,
        _check_env,
    ),
    "k8s-token": FileKind(
        lambda _i: "/var/lib/bcd-hostconfig/k8s/bootstrap-token", _EMPTY_RE, "empty", 0o600, _check_token
    ),
    "sshd-config": FileKind(lambda _i: SSHD_DROPIN, _EMPTY_RE, "empty", 0o644, _check_sshd_config),
    "sshd-ca": FileKind(lambda _i: SSHD_CA, _EMPTY_RE, "empty", 0o644, _check_sshd_ca),
    "sshd-principals": FileKind(
        lambda i: f"{SSHD_PRINCIPALS}/{i}", ACCOUNT_RE, "an account name", 0o644, _check_principals
    ),
    "sshd-krl": FileKind(lambda _i: SSHD_KRL, _EMPTY_RE, "empty", 0o644, _check_krl, encoding="base64"),
}


def _kind(kind: str, ident: str) -> tuple[FileKind, str]:
    spec = FILE_KINDS.get(kind)
    if spec is None:
        raise Refused(
            "bad-kind", f"file kind {kind!r} is not one the helper writes ({', '.join(FILE_KINDS)})"
        )
    if not spec.id_rule.fullmatch(ident):
        raise Refused("bad-id", f"{kind}: id {ident!r} must be {spec.id_text}")
    return spec, spec.path(ident)


def _content(spec: FileKind, req: FileWrite) -> bytes:
    if req.encoding != spec.encoding:
        raise Refused("bad-content", f"{req.kind}: content must be sent as {spec.encoding}")
    if len(req.content) > 2 * MAX_CONTENT:
        raise Refused("too-large", f"{req.kind}: content larger than {MAX_CONTENT} bytes")
    if spec.encoding == "base64":
        try:
            data = base64.b64decode(req.content, validate=True)
        except binascii.Error:
            raise Refused("bad-content", f"{req.kind}: content is not base64") from None
    else:
        try:
            data = req.content.encode("utf-8")
        except UnicodeEncodeError:
            raise Refused("bad-content", f"{req.kind}: content is not UTF-8") from None
    if len(data) > MAX_CONTENT:
        raise Refused("too-large", f"{req.kind}: content larger than {MAX_CONTENT} bytes")
    return data


def file_write(call: Call, req: FileWrite) -> dict[str, Any]:
    spec, path = _kind(req.kind, req.id)
    data = _content(spec, req)
    spec.check(req.id, data)
    if spec.host_check is not None:
        spec.host_check(call, req.id, data)
    try:
        write_root_only(call.ctx.root, path, data, spec.mode)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    return {"path": path, "bytes": len(data)}


def file_remove(call: Call, req: FileRemove) -> dict[str, Any]:
    _spec, path = _kind(req.kind, req.id)
    try:
        removed = remove_root_only(call.ctx.root, path)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    return {"path": path, "removed": removed}
