"""bcd_shared.access, the one renderer of the sshd files (root's helper and the node as root): properties.

Issue 9 item 2 (the sshd parser differential): whatever a spec carries, every text file rendered is
printable ASCII lines, one CA key or principal a line; anything else is refused, never stripped.
"""

from __future__ import annotations

import struct

from bcd_shared import access as acc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from helperproc import HELPER_SETTINGS
from hypothesis import given
from hypothesis import strategies as st

KEY = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).decode()
NODE = "node-a"

texts = st.text(st.characters(codec="utf-8"), max_size=40)
principals = st.one_of(
    texts, texts.map(lambda t: f"{t}@{NODE}"), st.from_regex(r"[a-z]{1,8}@node-[ab]", fullmatch=True)
)
keys = st.one_of(
    st.just(KEY), texts.map(lambda t: f"{KEY} {t}"), texts.map(lambda t: f"ssh-ed25519{t}"), texts
)


@HELPER_SETTINGS
@given(
    ca=st.lists(keys, max_size=3),
    names=st.lists(principals, max_size=6),
    serials=st.lists(st.integers(0, 2**64 - 1), max_size=4),
)
def test_issue9_item2_rendered_sshd_text_is_printable_ascii_or_refused(
    ca: list[str], names: list[str], serials: list[int]
) -> None:
    try:
        out = acc.render(ca, names, serials, NODE)
    except acc.AccessInvalid:
        bad = [v for v in (*ca, *names) if any(not 0x20 <= ord(c) < 0x7F for c in v)]
        bad += [p for p in names if " " in p or not p]
        bad += [s for s in serials if s == 0]  # type: ignore[misc]
        bad += [k for k in ca if not k.startswith(KEY)]
        assert bad, (ca, names, serials)
        return
    for path, data in out.files.items():
        if path == acc.SSHD_KRL:
            continue
        text = data.decode("ascii")
        assert all(0x20 <= ord(c) < 0x7F for c in text.replace("\n", "")), path
        assert text == "" or text.endswith("\n")
    for account in out.accounts:
        lines = out.files[acc.principals_path(account)].decode().splitlines()
        assert all(line == f"{account}@{NODE}" for line in lines)
    if out.files:  # every accepted key is KEY (with or without a comment): one line, comment dropped
        assert out.files[acc.SSHD_CA].decode().splitlines() == ([KEY] if ca else [])
        assert out.dropin == acc.DROPIN_TEXT.encode()


def _krl_sections(krl: bytes) -> list[tuple[bytes, list[int]]]:
    """Each certificate section of a KRL: (its CA key blob, the serials of its one serial list)."""
    at, out = 8 + 4 + 8 * 3 + 4 + 4, []
    while at < len(krl):
        assert krl[at] == 1  # KRL_SECTION_CERTIFICATES
        (length,) = struct.unpack(">I", krl[at + 1 : at + 5])
        body, at = krl[at + 5 : at + 5 + length], at + 5 + length
        (klen,) = struct.unpack(">I", body[:4])
        ca, rest = body[4 : 4 + klen], body[4 + klen :]
        assert rest[:4] == bytes(4) and rest[4] == 0x20  # empty reserved string, CERT_SERIAL_LIST
        (slen,) = struct.unpack(">I", rest[5:9])
        out.append((ca, [v for (v,) in struct.iter_unpack(">Q", rest[9 : 9 + slen])]))
    return out


def test_DLV_ACC_03_every_ca_keys_certificates_are_revoked() -> None:
    """DLV-ACC-03 with two CA keys: the section's revoked serials are revoked under each of them (a
    certificate is revoked by its CA and serial: a KRL naming only the first CA lets the second CA's
    certificate of that serial in), sorted and once each; no serial, no section."""
    other = (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
        .decode()
    )
    files = acc.render([KEY, other], [], [9, 4, 9], "node-a").files
    blobs = [acc.ca_key_line(k, "k")[1] for k in (KEY, other)]
    assert _krl_sections(files[acc.SSHD_KRL]) == [(blobs[0], [4, 9]), (blobs[1], [4, 9])]
    assert _krl_sections(acc.render([KEY, other], [], [], "node-a").files[acc.SSHD_KRL]) == []


def test_DLV_ACC_03_krl_layout() -> None:
    """The KRL is PROTOCOL.krl's: header, then per CA key a certificate section with one serial list."""
    _line, blob = acc.ca_key_line(KEY, "k")
    krl = acc.render_krl([blob], [5, 3, 5])
    assert krl.startswith(acc.KRL_MAGIC)
    header = 8 + 4 + 8 * 3 + 4 + 4
    assert krl[header] == 1  # KRL_SECTION_CERTIFICATES
    (length,) = struct.unpack(">I", krl[header + 1 : header + 5])
    section = krl[header + 5 :]
    assert len(section) == length
    assert section.endswith(bytes([0x20]) + struct.pack(">I", 16) + struct.pack(">QQ", 3, 5))
    assert acc.render_krl([blob], []) == krl[:header]
