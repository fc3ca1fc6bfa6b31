"""The development control plane's key material, made once and kept in `DIR/keys.json` (0600).

| Key | Signs / is | Certificate |
| --- | --- | --- |
| node CA | node certificates (role node) and the gateway's TLS certificate | self-signed root, 10 years |
| command root | the worker certificate | self-signed root (the trust bundle's `command_roots`) |
| worker | specs (`desired-state`) and commands (`command`) | leaf of role worker under the command root |
| JoinService | JoinResponses and trust bundles | none: nodes pin its SPKI (`join_signing_key_pin`) |
| approvers a1..a3 | batch scopes (`batch-approval`) | none: listed in the trust bundle, 2 of 3 required |

The TLS certificate names `localhost`, `127.0.0.1` and `::1`; it carries no bcd role, so OpenSSL accepts it.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
from pathlib import Path

from attrs import frozen
from bcd_shared.pki import Approver, KeyPair, TrustBundle, issue_leaf, issue_root, sign_trust_bundle
from bcd_shared.pki.certs import Role
from bcd_shared.pki.pins import JoinKeyPin
from bcd_shared.system import atomic_write
from bcd_shared.wire import SignedTrustBundle

KEYS_FILE = "keys.json"
APPROVERS_REQUIRED = 2
_NAMES = ("node_ca", "command_root", "worker", "join", "tls", "a1", "a2", "a3")


@frozen
class Keys:
    seeds: dict[str, bytes]
    node_ca_der: bytes
    command_root_der: bytes
    worker_der: bytes
    tls_cert_pem: bytes
    created_ms: int

    def key(self, name: str) -> KeyPair:
        return KeyPair(self.seeds[name])

    @property
    def join_pin(self) -> JoinKeyPin:
        return JoinKeyPin.of_key(self.key("join").public_key)

    @property
    def approvers(self) -> tuple[Approver, ...]:
        return tuple(Approver(n, self.key(n).public_key) for n in ("a1", "a2", "a3"))

    def trust_bundle(self) -> TrustBundle:
        return TrustBundle(
            version=1,
            command_roots=(self.command_root_der,),
            node_roots=(self.node_ca_der,),
            approvers=self.approvers,
            approvals_required=APPROVERS_REQUIRED,
            unbatched_destructive_per_hour=0,
            issued_at_ms=self.created_ms,
        )

    def signed_trust_bundle(self) -> SignedTrustBundle:
        # Ed25519 and a deterministic encoding of this fixed bundle: the same bytes every time.
        return sign_trust_bundle(self.key("join"), self.trust_bundle())

    def ca_pem(self) -> bytes:
        return _pem(self.node_ca_der)

    def tls_key_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519

        key = ed25519.Ed25519PrivateKey.from_private_bytes(self.seeds["tls"])
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def _pem(der: bytes) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


def _tls_cert(ca: KeyPair, tls: KeyPair, not_before: dt.datetime, not_after: dt.datetime) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    builder = (
        x509.CertificateBuilder()
        .subject_name(name("bcd devplane gateway"))
        .issuer_name(name("bcd devplane node CA"))
        .public_key(ed25519.Ed25519PrivateKey.from_private_bytes(tls.seed).public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        )
    )
    cert = builder.sign(ed25519.Ed25519PrivateKey.from_private_bytes(ca.seed), None)
    return cert.public_bytes(serialization.Encoding.PEM)


def create(now: dt.datetime) -> Keys:
    seeds = {n: KeyPair.generate().seed for n in _NAMES}
    start, end = now - dt.timedelta(days=1), now + dt.timedelta(days=3650)
    ca = KeyPair(seeds["node_ca"])
    root = KeyPair(seeds["command_root"])
    node_ca_der = issue_root(ca, "bcd devplane node CA", start, end, path_length=0)
    root_der = issue_root(root, "bcd devplane command root", start, end, path_length=0)
    worker_der = issue_leaf(
        root_der, root, KeyPair(seeds["worker"]).public_key, Role.WORKER, "devplane-worker", start, end
    )
    return Keys(
        seeds=seeds,
        node_ca_der=node_ca_der,
        command_root_der=root_der,
        worker_der=worker_der,
        tls_cert_pem=_tls_cert(ca, KeyPair(seeds["tls"]), start, end),
        created_ms=int(now.timestamp() * 1000),
    )


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def load_or_create(directory: Path, now: dt.datetime) -> Keys:
    path = directory / KEYS_FILE
    if path.exists():
        doc = json.loads(path.read_text())
        return Keys(
            seeds={k: base64.b64decode(v) for k, v in doc["seeds"].items()},
            node_ca_der=base64.b64decode(doc["node_ca_der"]),
            command_root_der=base64.b64decode(doc["command_root_der"]),
            worker_der=base64.b64decode(doc["worker_der"]),
            tls_cert_pem=doc["tls_cert_pem"].encode(),
            created_ms=int(doc["created_ms"]),
        )
    keys = create(now)
    doc = {
        "seeds": {k: _b64(v) for k, v in keys.seeds.items()},
        "node_ca_der": _b64(keys.node_ca_der),
        "command_root_der": _b64(keys.command_root_der),
        "worker_der": _b64(keys.worker_der),
        "tls_cert_pem": keys.tls_cert_pem.decode(),
        "created_ms": keys.created_ms,
    }
    atomic_write(path, json.dumps(doc, indent=1).encode(), mode=0o600)
    return keys
