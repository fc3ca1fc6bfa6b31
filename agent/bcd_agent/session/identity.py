"""`identity.json`: who this node is, beside the journal in data_dir (0600, written atomically, fsynced).

    {"version": 1, "node_id": str, "node_key": b64 seed (Ed25519), "certificate_chain": [b64 DER, leaf first],
     "trust_bundle": null | {"bundle": b64, "signature": b64, "signer_spki": b64},
     "join_pin": "sha256/..." (the JoinService key the join verified), "address": str (where it joined),
     "gateway_ca_pem": null | str (the CA the gateway's TLS certificate chains to),
     "server_time_mark_ms": int (the journal's server time mark, mirrored so a lost journal keeps it),
     "applied_generation_mark": int (the highest spec generation applied, mirrored likewise; optional on
        reading: a file written before it has none, read as 0)}

Read strictly: an unknown or missing key, or a value of the wrong shape, raises IdentityError naming it.
The trust bundle kept here is the newest accepted (forward only: `TrustStore`); the mark only moves forward.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen
from bcd_shared.pki import KeyPair, VerifiedBundle, verify_trust_bundle
from bcd_shared.pki.pins import JoinKeyPin
from bcd_shared.system import atomic_write

IDENTITY_FILE = "identity.json"
TLS_FILE = "tls-client.pem"
_KEYS = {
    "version",
    "node_id",
    "node_key",
    "certificate_chain",
    "trust_bundle",
    "join_pin",
    "address",
    "gateway_ca_pem",
    "server_time_mark_ms",
}
# Keys a file written by an older bcd may lack (read as their default).
_OPTIONAL_KEYS = {"applied_generation_mark"}


class IdentityError(ValueError):
    """identity.json is missing or malformed: names the file and the key."""


@frozen
class SignedBundle:
    bundle: bytes = attrs.field(repr=False)
    signature: bytes = attrs.field(repr=False)
    signer_spki: bytes = attrs.field(repr=False)

    def verify(self, pin: JoinKeyPin) -> VerifiedBundle:
        return verify_trust_bundle(self.bundle, self.signature, self.signer_spki, pin)


@frozen
class Identity:
    node_id: str
    node_key: KeyPair
    certificate_chain: tuple[bytes, ...] = attrs.field(repr=False)
    join_pin: str
    address: str = ""
    trust_bundle: SignedBundle | None = None
    gateway_ca_pem: str | None = None
    server_time_mark_ms: int = 0
    # The highest spec generation this node applied (hostile gateway, round 2): after a lost journal a
    # gateway could otherwise roll the node back to any older signed generation it kept.
    applied_generation_mark: int = 0

    @property
    def pin(self) -> JoinKeyPin:
        return JoinKeyPin.parse(self.join_pin)

    def verified_bundle(self) -> VerifiedBundle | None:
        return None if self.trust_bundle is None else self.trust_bundle.verify(self.pin)

    def to_json(self) -> bytes:
        def b64(b: bytes) -> str:
            return base64.b64encode(b).decode()

        doc: dict[str, Any] = {
            "version": 1,
            "node_id": self.node_id,
            "node_key": b64(self.node_key.seed),
            "certificate_chain": [b64(c) for c in self.certificate_chain],
            "trust_bundle": None
            if self.trust_bundle is None
            else {
                "bundle": b64(self.trust_bundle.bundle),
                "signature": b64(self.trust_bundle.signature),
                "signer_spki": b64(self.trust_bundle.signer_spki),
            },
            "join_pin": self.join_pin,
            "address": self.address,
            "gateway_ca_pem": self.gateway_ca_pem,
            "server_time_mark_ms": self.server_time_mark_ms,
            "applied_generation_mark": self.applied_generation_mark,
        }
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def identity_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / IDENTITY_FILE


def save(data_dir: str | os.PathLike[str], identity: Identity) -> None:
    """Write identity.json atomically, 0600, file and directory fsynced."""
    atomic_write(identity_path(data_dir), identity.to_json(), mode=0o600)


def _b64(value: object, where: str) -> bytes:
    if not isinstance(value, str):
        raise IdentityError(f"{where}: must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise IdentityError(f"{where}: not valid base64") from None


def _str(doc: dict[str, Any], key: str, source: str) -> str:
    value = doc[key]
    if not isinstance(value, str):
        raise IdentityError(f"{source}: {key}: must be a string")
    return value


def load(data_dir: str | os.PathLike[str]) -> Identity:
    """Read identity.json strictly (IdentityError names the key)."""
    path = identity_path(data_dir)
    source = str(path)
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise IdentityError(f"{source}: missing: run `bcd join` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IdentityError(f"{source}: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise IdentityError(f"{source}: must be a JSON object")
    if set(doc) - _OPTIONAL_KEYS != _KEYS:
        extra, missing = sorted(set(doc) - _KEYS - _OPTIONAL_KEYS), sorted(_KEYS - set(doc))
        named = (("unknown keys", extra), ("missing keys", missing))
        parts = [f"{what} {keys}" for what, keys in named if keys]
        raise IdentityError(f"{source}: {', '.join(parts)}")
    if doc["version"] != 1:
        raise IdentityError(f"{source}: version: must be 1")
    node_id = _str(doc, "node_id", source)
    if not node_id:
        raise IdentityError(f"{source}: node_id: must not be empty")
    try:
        key = KeyPair(_b64(doc["node_key"], f"{source}: node_key"))
    except ValueError as exc:
        raise IdentityError(f"{source}: node_key: {exc}") from None
    chain_doc = doc["certificate_chain"]
    if not isinstance(chain_doc, list) or not chain_doc:
        raise IdentityError(f"{source}: certificate_chain: must be a non-empty list")
    chain = tuple(_b64(c, f"{source}: certificate_chain[{i}]") for i, c in enumerate(chain_doc))
    bundle_doc = doc["trust_bundle"]
    bundle: SignedBundle | None = None
    if bundle_doc is not None:
        if not isinstance(bundle_doc, dict) or set(bundle_doc) != {"bundle", "signature", "signer_spki"}:
            raise IdentityError(f"{source}: trust_bundle: must be null or {{bundle, signature, signer_spki}}")
        bundle = SignedBundle(
            *(
                _b64(bundle_doc[k], f"{source}: trust_bundle.{k}")
                for k in ("bundle", "signature", "signer_spki")
            )
        )
    ca = doc["gateway_ca_pem"]
    if ca is not None and not isinstance(ca, str):
        raise IdentityError(f"{source}: gateway_ca_pem: must be null or a PEM string")
    mark = doc["server_time_mark_ms"]
    if isinstance(mark, bool) or not isinstance(mark, int) or mark < 0:
        raise IdentityError(f"{source}: server_time_mark_ms: must be a non-negative integer")
    generation = doc.get("applied_generation_mark", 0)
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise IdentityError(f"{source}: applied_generation_mark: must be a non-negative integer")
    pin = _str(doc, "join_pin", source)
    try:
        JoinKeyPin.parse(pin)
    except ValueError as exc:
        raise IdentityError(f"{source}: join_pin: {exc}") from None
    return Identity(
        node_id=node_id,
        node_key=key,
        certificate_chain=chain,
        join_pin=pin,
        address=_str(doc, "address", source),
        trust_bundle=bundle,
        gateway_ca_pem=ca,
        server_time_mark_ms=mark,
        applied_generation_mark=generation,
    )


def tls_client_pem(identity: Identity) -> bytes:
    """The node's TLS client credentials as one PEM: the node key (Ed25519, PKCS#8) and its chain.

    TLS uses the node key and certificate itself (TLS 1.3 with Ed25519 works with OpenSSL 3). The
    certificate's critical bcd role extension is unknown to OpenSSL, so the gateway verifies node chains
    with bcd's own checker (docs/session.md, "Transport")."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.from_private_bytes(identity.node_key.seed)
    out = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    for der in identity.certificate_chain:
        out += x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)
    return out


def write_tls_client_pem(data_dir: str | os.PathLike[str], identity: Identity) -> Path:
    path = Path(data_dir) / TLS_FILE
    data = tls_client_pem(identity)
    try:
        if path.read_bytes() == data:
            return path
    except FileNotFoundError:
        pass
    atomic_write(path, data, mode=0o600)
    return path


def with_mark(identity: Identity, mark_ms: int) -> Identity:
    return (
        identity
        if mark_ms <= identity.server_time_mark_ms
        else attrs.evolve(identity, server_time_mark_ms=mark_ms)
    )


def with_generation(identity: Identity, generation: int) -> Identity:
    """The identity with its applied generation mark raised to `generation` (it never moves back)."""
    return (
        identity
        if generation <= identity.applied_generation_mark
        else attrs.evolve(identity, applied_generation_mark=generation)
    )


def with_bundle(identity: Identity, bundle: VerifiedBundle) -> Identity:
    return attrs.evolve(
        identity, trust_bundle=SignedBundle(bundle.bundle_bytes, bundle.signature, bundle.signer_spki)
    )
