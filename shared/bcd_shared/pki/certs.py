"""The certificate profile: Ed25519 X.509 certificates that carry a bcd role, and how to issue them.

Profile (docs/pki.md has the full table):
- every certificate holds an Ed25519 key and is signed with Ed25519; the subject is one CN;
- a CA has BasicConstraints CA=true (critical, with an optional path length) and keyUsage keyCertSign
  (critical); a root is self-issued and self-signed;
- a leaf has BasicConstraints CA=false, keyUsage digitalSignature (critical), and the bcd role extension:
  OID ROLE_OID (a UUID OID, 2.25.<uuid>, critical), whose value is the DER UTF8String of the role name
  ("worker", "node", "approver", "join"). The leaf's CN is the signer's id (the node id for a node).

Issuance is CSR-less: the issuer signs a certificate for a public key it was given (the JoinService issues a
node certificate for the key in the join request). Functions take and return DER `bytes`.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import secrets
from typing import Final

import attrs
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID, SignatureAlgorithmOID

from bcd_shared.pki.errors import MalformedCertificate, WrongRole
from bcd_shared.pki.signing import PUBLIC_KEY_LENGTH, KeyPair, Purpose

ROLE_OID: Final = x509.ObjectIdentifier("2.25.21332920296249117805162420951823904924")
_UTF8STRING_TAG: Final = 0x0C


class Role(enum.Enum):
    """What a leaf certificate's key may sign."""

    WORKER = "worker"  # commands and desired state (the control plane's worker key)
    NODE = "node"  # command results and attested reports (a node's own key)
    APPROVER = "approver"  # destructive-batch approvals
    JOIN = "join"  # join responses and trust bundles (the JoinService key)


# Which role signs each purpose. A purpose missing here is never verified through a certificate chain
# (a daemon release is checked against a pinned key).
ROLE_FOR_PURPOSE: Final[dict[Purpose, Role]] = {
    Purpose.COMMAND: Role.WORKER,
    Purpose.DESIRED_STATE: Role.WORKER,
    Purpose.COMMAND_RESULT: Role.NODE,
    Purpose.ATTESTED_REPORT: Role.NODE,
    Purpose.TRUST_BUNDLE: Role.JOIN,
    Purpose.JOIN_RESPONSE: Role.JOIN,
    Purpose.BATCH_APPROVAL: Role.APPROVER,
}


def role_for(purpose: Purpose) -> Role:
    role = ROLE_FOR_PURPOSE.get(purpose)
    if role is None:
        raise WrongRole(
            f"no certificate role signs purpose {purpose.value!r}; verify it against a pinned key"
        )
    return role


def _encode_role(role: Role) -> bytes:
    name = role.value.encode("ascii")
    return bytes([_UTF8STRING_TAG, len(name)]) + name


def _decode_role(value: bytes, where: str) -> Role:
    if len(value) < 2 or value[0] != _UTF8STRING_TAG or value[1] != len(value) - 2 or value[1] > 127:
        raise MalformedCertificate(f"{where}: role extension is not one DER UTF8String")
    name = value[2:]
    try:
        return Role(name.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise MalformedCertificate(f"{where}: unknown role {name!r}") from None


@attrs.frozen
class CertInfo:
    """A parsed certificate with what the chain checks need. `der` is the exact bytes received."""

    der: bytes = attrs.field(repr=False)
    cert: x509.Certificate = attrs.field(repr=False, eq=False)
    sha256: str  # lowercase hex of SHA-256(der): the pin
    name: str  # the subject CN, for messages and as the signer's id
    public_key: bytes = attrs.field(repr=False)  # raw 32-byte Ed25519
    role: Role | None  # the bcd role extension, if present


def _common_name(name: x509.Name) -> str:
    cns = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1:
        return name.rfc4514_string()
    value = cns[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def parse_certificate(der: bytes) -> CertInfo:
    """Parse one DER certificate strictly: no trailing bytes, an Ed25519 key, signed with Ed25519."""
    if not isinstance(der, bytes) or not der:
        raise MalformedCertificate("certificate must be non-empty DER bytes")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as e:
        raise MalformedCertificate(f"not a DER X.509 certificate ({e})") from None
    name = _common_name(cert.subject)
    if cert.signature_algorithm_oid != SignatureAlgorithmOID.ED25519:
        raise MalformedCertificate(f"{name!r}: signature algorithm is not Ed25519")
    key = cert.public_key()
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise MalformedCertificate(f"{name!r}: public key is not Ed25519")
    role: Role | None = None
    try:
        ext = cert.extensions.get_extension_for_oid(ROLE_OID)
    except x509.ExtensionNotFound:
        pass
    except (ValueError, x509.DuplicateExtension) as e:  # malformed or duplicate extensions (the latter
        # is not a ValueError: uncaught, a hostile certificate escaped as an unexpected exception type)
        raise MalformedCertificate(f"{name!r}: bad extensions ({e})") from None
    else:
        assert isinstance(ext.value, x509.UnrecognizedExtension)
        role = _decode_role(ext.value.value, repr(name))
    raw = key.public_bytes_raw()
    return CertInfo(der, cert, hashlib.sha256(der).hexdigest(), name, raw, role)


def public_key_of(der: bytes) -> bytes:
    """The raw Ed25519 public key of a certificate."""
    return parse_certificate(der).public_key


# --- issuance ---------------------------------------------------------------------------------------


def _crypto_key(key: KeyPair) -> ed25519.Ed25519PrivateKey:
    return ed25519.Ed25519PrivateKey.from_private_bytes(key.seed)


def _public(public_key: bytes) -> ed25519.Ed25519PublicKey:
    if len(public_key) != PUBLIC_KEY_LENGTH:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_LENGTH} bytes")
    return ed25519.Ed25519PublicKey.from_public_bytes(public_key)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _check_time(value: datetime.datetime, what: str) -> None:
    if value.tzinfo is None:
        raise ValueError(f"{what} must be timezone-aware")


def issue_certificate(
    *,
    subject_public_key: bytes,
    common_name: str,
    issuer_key: KeyPair,
    issuer_der: bytes | None,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    ca: bool | None,
    path_length: int | None = None,
    key_cert_sign: bool = False,
    digital_signature: bool = False,
    role: Role | None = None,
    serial: int | None = None,
) -> bytes:
    """The general builder behind the helpers below; tests use it to build certificates that break a rule.

    `issuer_der` None makes a self-issued certificate signed by `issuer_key`. `ca` None leaves
    BasicConstraints out; `key_cert_sign` and `digital_signature` both False leave keyUsage out.
    """
    _check_time(not_before, "not_before")
    _check_time(not_after, "not_after")
    issuer_name = _name(common_name) if issuer_der is None else parse_certificate(issuer_der).cert.subject
    issuer_public = _crypto_key(issuer_key).public_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer_name)
        .public_key(_public(subject_public_key))
        .serial_number(serial if serial is not None else secrets.randbits(63) + 1)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(_public(subject_public_key)), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_public), critical=False)
    )
    if ca is not None:
        builder = builder.add_extension(
            x509.BasicConstraints(ca=ca, path_length=path_length if ca else None), critical=True
        )
    if key_cert_sign or digital_signature:
        usage = x509.KeyUsage(
            digital_signature=digital_signature,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=key_cert_sign,
            crl_sign=key_cert_sign,
            encipher_only=False,
            decipher_only=False,
        )
        builder = builder.add_extension(usage, critical=True)
    if role is not None:
        builder = builder.add_extension(
            x509.UnrecognizedExtension(ROLE_OID, _encode_role(role)), critical=True
        )
    from cryptography.hazmat.primitives import serialization  # issuing only, not on the node's path

    cert = builder.sign(_crypto_key(issuer_key), None)
    return cert.public_bytes(serialization.Encoding.DER)


def issue_root(
    key: KeyPair,
    common_name: str,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    path_length: int | None = 1,
) -> bytes:
    """A self-signed root CA (a command-signing root, or the JoinService's node CA)."""
    return issue_certificate(
        subject_public_key=key.public_key,
        common_name=common_name,
        issuer_key=key,
        issuer_der=None,
        not_before=not_before,
        not_after=not_after,
        ca=True,
        path_length=path_length,
        key_cert_sign=True,
    )


def issue_intermediate(
    issuer_der: bytes,
    issuer_key: KeyPair,
    public_key: bytes,
    common_name: str,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    path_length: int | None = 0,
) -> bytes:
    """An intermediate CA under `issuer_der`."""
    return issue_certificate(
        subject_public_key=public_key,
        common_name=common_name,
        issuer_key=issuer_key,
        issuer_der=issuer_der,
        not_before=not_before,
        not_after=not_after,
        ca=True,
        path_length=path_length,
        key_cert_sign=True,
    )


def issue_leaf(
    issuer_der: bytes,
    issuer_key: KeyPair,
    public_key: bytes,
    role: Role,
    subject_id: str,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    serial: int | None = None,
) -> bytes:
    """A leaf certificate of `role` for `public_key`, CN `subject_id` (CSR-less)."""
    return issue_certificate(
        subject_public_key=public_key,
        common_name=subject_id,
        issuer_key=issuer_key,
        issuer_der=issuer_der,
        not_before=not_before,
        not_after=not_after,
        ca=False,
        digital_signature=True,
        role=role,
        serial=serial,
    )


def issue_node_certificate(
    issuer_der: bytes,
    issuer_key: KeyPair,
    node_public_key: bytes,
    node_id: str,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
) -> bytes:
    """The JoinService's CSR-less issuance: a node-role certificate for the key a join request carried."""
    return issue_leaf(issuer_der, issuer_key, node_public_key, Role.NODE, node_id, not_before, not_after)
