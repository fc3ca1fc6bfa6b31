"""The `access` section's sshd files: validated and rendered in one place, for root and the node alike.

delivery.md "Break-glass SSH and tunnel keys" (DLV-ACC-01..12) and docs/access.md. Pure: a section (its
CA keys, principals and revoked serials) and the node's id in, the exact bytes of every file out, so a
node running as root and the root helper rendering from a signed spec produce the same bytes. The node
never sends sshd text to root: root renders these files itself from the signed spec.

Files (Q-DLV-ACC-02, decided in docs/access.md):
- `/etc/ssh/bcd/user_ca.pub` 0644: one `<type> <base64>` line per CA key (comments dropped);
- `/etc/ssh/bcd/principals/<account>` 0644: the principals `<account>@<node>` of this node for that
  account, one a line, sorted;
- `/etc/ssh/bcd/revoked.krl` 0644: an OpenSSH KRL (PROTOCOL.krl) revoking the serials under every CA key;
- `/etc/ssh/sshd_config.d/90-bcd.conf` 0644: TrustedUserCAKeys, AuthorizedPrincipalsFile and RevokedKeys
  pointing at those files.
An empty section renders no file at all (DLV-ACC-06).

Rules (refuse, never strip; DLV-ACC-09..11, issue 9 item 2): every CA key and principal is printable
ASCII only (a control character or any non-ASCII byte makes the section invalid: sshd's parser and
Python's differ on Unicode whitespace), a CA key is exactly one OpenSSH public key whose key data names
its own type, a principal carries no whitespace. Principals of another node, and principals not of the
`<account>@<node>` form with a valid account name, are skipped (Q-DLV-ACC-01). Serial 0 is refused
(OpenSSH's KRL loader refuses it, and sshd would then refuse every certificate).
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from attrs import frozen

SSHD_DIR: Final = "/etc/ssh/bcd"
SSHD_CA: Final = f"{SSHD_DIR}/user_ca.pub"
SSHD_PRINCIPALS: Final = f"{SSHD_DIR}/principals"
SSHD_KRL: Final = f"{SSHD_DIR}/revoked.krl"
SSHD_DROPIN: Final = "/etc/ssh/sshd_config.d/90-bcd.conf"
FILE_MODE: Final = 0o644
MAX_CA_KEYS: Final = 64
MAX_PRINCIPALS: Final = 4096
MAX_SERIALS: Final = 65536
MAX_KEY_LINE: Final = 16 * 1024
MAX_PRINCIPAL: Final = 256
ACCOUNT_RE: Final = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
KEY_TYPES: Final = frozenset(
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
KRL_MAGIC: Final = b"SSHKRL\n\x00"
_KRL_FORMAT_VERSION = 1
_KRL_SECTION_CERTIFICATES = 1
_KRL_SECTION_CERT_SERIAL_LIST = 0x20
DROPIN_TEXT: Final = (
    "# Written by bcd from the access section of the node's signed spec; do not edit.\n"
    f"TrustedUserCAKeys {SSHD_CA}\n"
    f"AuthorizedPrincipalsFile {SSHD_PRINCIPALS}/%u\n"
    f"RevokedKeys {SSHD_KRL}\n"
)


class AccessInvalid(ValueError):
    """The section breaks a rule (DLV-ACC-09..11): nothing of it is applied. The message names the field."""


@frozen
class AccessFiles:
    """The rendered files: host path -> exact bytes (all 0644). Empty for an empty section."""

    files: Mapping[str, bytes]
    accounts: tuple[str, ...]  # the accounts with a principals file, sorted
    skipped: tuple[str, ...]  # principals not this node's (Q-DLV-ACC-01), in spec order

    @property
    def dropin(self) -> bytes | None:
        return self.files.get(SSHD_DROPIN)


def principals_path(account: str) -> str:
    return f"{SSHD_PRINCIPALS}/{account}"


def _printable_ascii(text: str, where: str) -> None:
    for c in text:
        if not 0x20 <= ord(c) < 0x7F:
            what = (
                "a control character" if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 else "a non-ASCII character"
            )
            raise AccessInvalid(
                f"{where}: carries {what} (U+{ord(c):04X}); sshd files are printable ASCII only"
            )


def ca_key_line(key: str, where: str) -> tuple[str, bytes]:
    """The canonical `<type> <base64>` of one CA key, and its key blob (DLV-ACC-09/10)."""
    if len(key) > MAX_KEY_LINE:
        raise AccessInvalid(f"{where}: longer than {MAX_KEY_LINE} characters")
    _printable_ascii(key, where)
    parts = key.split(" ")
    if len(parts) < 2 or parts[0] not in KEY_TYPES or "" in parts[:2]:
        raise AccessInvalid(f"{where}: not exactly one OpenSSH public key (<type> <base64> [comment])")
    try:
        blob = base64.b64decode(parts[1], validate=True)
        (length,) = struct.unpack(">I", blob[:4])
        inner = blob[4 : 4 + length].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError):
        raise AccessInvalid(f"{where}: the key data is not base64 OpenSSH key data") from None
    if inner != parts[0] or len(blob) < 4 + length + 4:
        raise AccessInvalid(f"{where}: the key data is a {inner!r} key, not {parts[0]!r}")
    return f"{parts[0]} {parts[1]}", blob


def check_principal(principal: str, where: str) -> None:
    """DLV-ACC-09/11: no control character, no non-ASCII, no whitespace; 1..256 characters."""
    _printable_ascii(principal, where)
    if not principal or len(principal) > MAX_PRINCIPAL or " " in principal:
        raise AccessInvalid(f"{where}: a principal is 1-{MAX_PRINCIPAL} characters without whitespace")


def own_account(principal: str, node_id: str) -> str | None:
    """The account of a principal `<account>@<node_id>` of this node, else None (Q-DLV-ACC-01)."""
    account, at, node = principal.partition("@")
    if not at or node != node_id or not ACCOUNT_RE.fullmatch(account):
        return None
    return account


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def render_krl(ca_blobs: Sequence[bytes], serials: Iterable[int]) -> bytes:
    """An OpenSSH KRL revoking `serials` under each CA key (PROTOCOL.krl sections 1 and 2.1). Version,
    date and comment are fixed, so the bytes depend on the keys and serials only."""
    header = (
        KRL_MAGIC
        + struct.pack(">IQQQ", _KRL_FORMAT_VERSION, 0, 0, 0)
        + _string(b"")  # reserved
        + _string(b"")  # comment
    )
    wanted = sorted(set(serials))
    if not wanted:
        return header
    serial_list = b"".join(struct.pack(">Q", s) for s in wanted)
    out = [header]
    for blob in ca_blobs:
        section = _string(blob) + _string(b"") + bytes([_KRL_SECTION_CERT_SERIAL_LIST]) + _string(serial_list)
        out.append(bytes([_KRL_SECTION_CERTIFICATES]) + _string(section))
    return b"".join(out)


def validate(ca_keys: Sequence[str], principals: Sequence[str], revoked_serials: Sequence[int]) -> None:
    """Every rule of the section (DLV-ACC-09..11), whatever the node id; raises AccessInvalid."""
    render(ca_keys, principals, revoked_serials, node_id="")


def render(
    ca_keys: Sequence[str],
    principals: Sequence[str],
    revoked_serials: Sequence[int],
    node_id: str,
) -> AccessFiles:
    """The files of an access section for node `node_id` (see the module). Raises AccessInvalid."""
    if len(ca_keys) > MAX_CA_KEYS:
        raise AccessInvalid(f"access.ssh_ca_keys: {len(ca_keys)} keys, at most {MAX_CA_KEYS}")
    if len(principals) > MAX_PRINCIPALS:
        raise AccessInvalid(f"access.principals: {len(principals)} principals, at most {MAX_PRINCIPALS}")
    if len(revoked_serials) > MAX_SERIALS:
        raise AccessInvalid(f"access.revoked_serials: {len(revoked_serials)} serials, at most {MAX_SERIALS}")
    lines: list[str] = []
    blobs: list[bytes] = []
    for i, key in enumerate(ca_keys):
        line, blob = ca_key_line(key, f"access.ssh_ca_keys[{i}]")
        if line not in lines:
            lines.append(line)
            blobs.append(blob)
    by_account: dict[str, set[str]] = {}
    skipped: list[str] = []
    for i, principal in enumerate(principals):
        check_principal(principal, f"access.principals[{i}]")
        account = own_account(principal, node_id)
        if account is None:
            skipped.append(principal)
        else:
            by_account.setdefault(account, set()).add(principal)
    for i, serial in enumerate(revoked_serials):
        if not 0 < serial < 2**64:
            raise AccessInvalid(
                f"access.revoked_serials[{i}]: {serial} is not a certificate serial (1..2^64-1)"
            )
    if not lines and not by_account and not revoked_serials:
        return AccessFiles({}, (), tuple(skipped))
    files: dict[str, bytes] = {
        SSHD_CA: "".join(f"{line}\n" for line in lines).encode("ascii"),
        SSHD_KRL: render_krl(blobs, revoked_serials),
    }
    for account, names in sorted(by_account.items()):
        files[principals_path(account)] = "".join(f"{p}\n" for p in sorted(names)).encode("ascii")
    files[SSHD_DROPIN] = DROPIN_TEXT.encode("ascii")
    return AccessFiles(files, tuple(sorted(by_account)), tuple(skipped))


# --- the plan: pure, shared by root's helper and the node as root ----------------------------------------


@frozen
class Write:
    path: str
    data: bytes


@frozen
class Remove:
    path: str


@frozen
class Reload:
    """Reload sshd: the drop-in changed (DLV-ACC-05)."""


Step = Write | Remove | Reload


@frozen
class Observed:
    """bcd's sshd files as found: host path -> bytes (the drop-in, CA keys, KRL, principals/<account>)."""

    files: Mapping[str, bytes]


def managed_paths(principal_accounts: Iterable[str]) -> tuple[str, ...]:
    """Every path the section owns, given the accounts whose principals file exists."""
    return (SSHD_DROPIN, SSHD_CA, SSHD_KRL, *(principals_path(a) for a in sorted(principal_accounts)))


def plan(desired: AccessFiles, observed: Observed) -> tuple[Step, ...]:
    """The steps from `observed` to `desired`. Files first, the drop-in that points sshd at them last;
    for an empty section the drop-in goes first (DLV-ACC-06). Reload only when the drop-in changed."""
    have = observed.files
    dropin_changed = have.get(SSHD_DROPIN) != desired.dropin
    steps: list[Step] = []
    stale = sorted(p for p in have if p not in desired.files)
    if desired.dropin is None:
        if SSHD_DROPIN in have:
            steps.append(Remove(SSHD_DROPIN))
        steps += [Remove(p) for p in stale if p != SSHD_DROPIN]
    else:
        steps += [
            Write(p, data) for p, data in desired.files.items() if p != SSHD_DROPIN and have.get(p) != data
        ]
        steps += [Remove(p) for p in stale]
        if dropin_changed:
            steps.append(Write(SSHD_DROPIN, desired.dropin))
    if dropin_changed:
        steps.append(Reload())
    return tuple(steps)
