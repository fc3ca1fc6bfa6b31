"""`bcd join --token T --address HOST:PORT|unix:/PATH`: become a node of a control plane (docs/session.md).

1. Generate the node key (Ed25519) and a PKCS#10 request signed by it.
2. Call the JoinService (TLS, server-authenticated with `--ca-file` or `[control_plane] ca_file`; or a
   Unix socket). The JoinResponse is verified: signed under `join-response` by the JoinService key, which
   must match `join_signing_key_pin` when config.toml sets one (else the key is pinned on first use and
   recorded in identity.json); the certificate names the node id and holds our key; the trust bundle
   verifies against the same pin.
3. As root with `[helper] socket` set, write root's join record `/var/lib/bcd-hostconfig/join-response.pb`
   (the JoinResponse bytes exactly as received, 0600) before the identity (seeds/host-config.md); with
   `--root DIR` (a simulated host) under DIR, never on the real host.
4. Write `identity.json` (0600) beside the journal, the server time mark mirrored from `issued_at`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import trio

from bcd_agent.config import Config

log = logging.getLogger("bcd.join")

JOIN_RECORD = "/var/lib/bcd-hostconfig/join-response.pb"


class JoinError(Exception):
    pass


def _csr(key: Any, node_id_hint: str) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    private = ed25519.Ed25519PrivateKey.from_private_bytes(key.seed)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id_hint or "bcd-node")]))
        .sign(private, None)
    )
    return csr.public_bytes(serialization.Encoding.DER)


async def join(
    config: Config,
    *,
    token: str,
    address: str,
    ca_file: str | None = None,
    root: str = "/",
    hostname: str | None = None,
    node_id: str = "",
) -> Any:
    """Join and write the identity; returns it (session.identity.Identity)."""
    from bcd_shared import wire
    from bcd_shared.pki import KeyPair, parse_certificate, verify_join_response
    from bcd_shared.pki.errors import PkiError
    from bcd_shared.pki.pins import JoinKeyPin
    from bcd_shared.system import atomic_write

    from bcd_agent.session import identity as ident
    from bcd_agent.session.transport import Endpoint, join_call

    if ident.identity_path(config.data_dir).exists():
        raise JoinError(f"{ident.identity_path(config.data_dir)} exists: this node already joined")
    ca_path = ca_file or config.control_plane.ca_file
    ca_pem = Path(ca_path).read_text() if ca_path else None  # noqa: ASYNC240 (one small file at start)
    endpoint = Endpoint.parse(address, ca_pem=ca_pem, server_name=config.control_plane.server_name)
    key = KeyPair.generate()
    request = wire.JoinRequest(
        token=token,
        node_public_key=key.public_key,
        csr=_csr(key, node_id),
        hostname=hostname or socket.gethostname(),
        role=wire.Role.NODE,
        version="0.1.0",
        node_id=node_id,
    )
    data = await join_call(endpoint, request)  # the JoinResponse exactly as received (strictly checked)
    response = wire.JoinResponse.parse(data)
    pin = config.join_signing_key_pin
    if pin is None:
        from bcd_shared.pki.bundle import _raw_key_of_spki
        from bcd_shared.pki.errors import UntrustedJoinSigner

        pin = JoinKeyPin.of_key(_raw_key_of_spki(bytes(response.signer_spki), UntrustedJoinSigner))
        log.warning(
            "join: no join_signing_key_pin configured; pinning the JoinService key %s on first use", pin
        )
    try:
        verified = verify_join_response(data, pin)
        leaf = parse_certificate(verified.certificate_chain[0])
    except (PkiError, IndexError) as exc:
        raise JoinError(f"join response refused: {exc}") from None
    if leaf.public_key != key.public_key or leaf.name != verified.node_id:
        raise JoinError("join response refused: the certificate is not for this node's key and id")
    if os.geteuid() == 0 and config.helper.socket is not None:
        # Root's join record, under the directory standing for / (a simulated host's, with --root).
        atomic_write(Path(root) / JOIN_RECORD.lstrip("/"), data, mode=0o600)
    bundle = verified.trust_bundle
    identity = ident.Identity(
        node_id=verified.node_id,
        node_key=key,
        certificate_chain=verified.certificate_chain,
        join_pin=str(pin),
        address=address,
        trust_bundle=None
        if bundle is None
        else ident.SignedBundle(bundle.bundle_bytes, bundle.signature, bundle.signer_spki),
        gateway_ca_pem=ca_pem,
        server_time_mark_ms=max(0, verified.issued_at_ms),
    )
    os.makedirs(config.data_dir, mode=0o700, exist_ok=True)
    ident.save(config.data_dir, identity)
    return identity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_agent.config import add_config_argument

    add_config_argument(parser)
    parser.add_argument("--token", required=True, help="the one-time join token")
    parser.add_argument("--address", required=True, help="the JoinService: HOST:PORT (TLS) or unix:/PATH")
    parser.add_argument(
        "--ca-file", default=None, help="PEM of the CA the control plane's TLS certificate has"
    )
    parser.add_argument("--node-id", default="", help="keep this node id (a re-join)")
    parser.add_argument(
        "--root",
        default="/",
        help="the directory standing for / (a simulated host): root's join record goes there",
    )


def run(args: argparse.Namespace) -> int:
    from bcd_agent.config import ConfigError, default_config_path, load_config

    try:
        config = load_config(args.config or default_config_path())
    except ConfigError as exc:
        print(f"bcd join: {exc}", file=sys.stderr)
        return 2
    try:
        identity = trio.run(
            lambda: join(
                config,
                token=args.token,
                address=args.address,
                ca_file=args.ca_file,
                node_id=args.node_id,
                root=args.root,
            )
        )
    except JoinError as exc:
        print(f"bcd join: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"bcd join: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(identity.node_id)
    return 0
