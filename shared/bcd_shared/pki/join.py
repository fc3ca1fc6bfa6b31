"""Join records: the JoinService-signed JoinResponse, re-verified against root's `join_signing_key_pin`.

Wire: `JoinResponse{body, signature, signer_spki}`; `body` is the serialized JoinResponseBody exactly as
signed under purpose `join-response`; the helper keeps the whole JoinResponse as root's join record
(HST-SIGN-20, HST-SIGN-21) and takes the node id and, when present, the trust bundle from it. The embedded
SignedTrustBundle must verify against the same pin.
"""

from __future__ import annotations

import hashlib

import attrs

from bcd_shared.pki._wire import decode
from bcd_shared.pki.bundle import VerifiedBundle, _raw_key_of_spki, verify_trust_bundle
from bcd_shared.pki.errors import MalformedJoinResponse, UntrustedJoinSigner
from bcd_shared.pki.pins import JoinKeyPin, spki_der
from bcd_shared.pki.signing import KeyPair, Purpose, verify_signature
from bcd_shared.wire import JoinResponse as WireJoinResponse
from bcd_shared.wire import JoinResponseBody as WireJoinResponseBody


@attrs.frozen
class VerifiedJoin:
    node_id: str
    certificate_chain: tuple[bytes, ...] = attrs.field(repr=False)
    trust_bundle: VerifiedBundle | None
    issued_at_ms: int
    body_bytes: bytes = attrs.field(repr=False)


def verify_join_response(data: bytes, join_pin: JoinKeyPin) -> VerifiedJoin:
    """Verify the exact bytes of a serialized JoinResponse (root's join record) against the pin."""
    message = decode(WireJoinResponse, data, "join response", MalformedJoinResponse)
    if hashlib.sha256(message.signer_spki).digest() != join_pin.digest:
        raise UntrustedJoinSigner(f"join response signer is not the pinned JoinService key ({join_pin})")
    public_key = _raw_key_of_spki(message.signer_spki, UntrustedJoinSigner)
    verify_signature(public_key, Purpose.JOIN_RESPONSE, message.body, message.signature)
    body = decode(WireJoinResponseBody, message.body, "join response body", MalformedJoinResponse)
    if not body.node_id:
        raise MalformedJoinResponse("node_id: empty")
    bundle: VerifiedBundle | None = None
    if body.trust_bundle is not None:
        signed = body.trust_bundle
        bundle = verify_trust_bundle(signed.bundle, signed.signature, signed.signer_spki, join_pin)
    return VerifiedJoin(body.node_id, tuple(body.certificate_chain), bundle, body.issued_at, message.body)


def sign_join_response(join_key: KeyPair, body: WireJoinResponseBody) -> bytes:
    """The issuer's side: encode the body once, sign it, return the serialized JoinResponse."""
    data = bytes(body)
    return bytes(
        WireJoinResponse(
            body=data,
            signature=join_key.sign(Purpose.JOIN_RESPONSE, data),
            signer_spki=spki_der(join_key.public_key),
        )
    )
