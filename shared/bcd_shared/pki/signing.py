"""Purposes, keys and the signature envelope (Ed25519 through pynacl).

An envelope signs `purpose_tag(purpose) || data`, where data is the exact bytes received or sent (an encoded
CommandBody, DesiredStateBody, TrustBundle, ...). Tags are prefix-free (`bcd-sig-v1/` NAME NUL, and no name
contains NUL), so a signature made under one purpose never verifies under another. Bytes are never
re-encoded: every function here takes and returns `bytes`.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs
import nacl.exceptions
import nacl.signing

from bcd_shared.pki.errors import BadSignature, MalformedSignature, TruncatedSignature, WrongPurpose

SIGNATURE_LENGTH: Final = 64
PUBLIC_KEY_LENGTH: Final = 32
SEED_LENGTH: Final = 32
TAG_PREFIX: Final = b"bcd-sig-v1/"


class Purpose(enum.Enum):
    """What a signature is for. The value is the name inside the tag."""

    COMMAND = "command"  # Command.signature over the CommandBody bytes (worker key)
    DESIRED_STATE = "desired-state"  # DesiredState signature over the DesiredStateBody bytes (worker key)
    COMMAND_RESULT = "command-result"  # CommandUpdate.node_sig over the CommandAttestation bytes (node key)
    ATTESTED_REPORT = "attested-report"  # AttestedReport over its body bytes (node key)
    TRUST_BUNDLE = "trust-bundle"  # SignedTrustBundle over the TrustBundle bytes (JoinService key)
    JOIN_RESPONSE = "join-response"  # JoinResponse.body, the JoinResponseBody bytes (JoinService key)
    BATCH_APPROVAL = "batch-approval"  # BatchApproval: an approver over the BatchScope bytes (approver key)
    DAEMON_RELEASE = "daemon-release"  # a self-update release over its manifest bytes (release key)


def purpose_tag(purpose: Purpose) -> bytes:
    """The domain-separation prefix of a purpose: b"bcd-sig-v1/" + name + b"\\x00"."""
    return TAG_PREFIX + purpose.value.encode("ascii") + b"\x00"


def signed_message(purpose: Purpose, data: bytes) -> bytes:
    """The exact bytes an Ed25519 signature of `purpose` covers."""
    return purpose_tag(purpose) + data


def check_public_key(public_key: bytes) -> None:
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_LENGTH:
        got = len(public_key) if isinstance(public_key, bytes) else type(public_key).__name__
        raise MalformedSignature(f"an Ed25519 public key is {PUBLIC_KEY_LENGTH} bytes, got {got}")


def check_signature_shape(signature: bytes) -> None:
    if not isinstance(signature, bytes):
        raise MalformedSignature(f"signature must be bytes, got {type(signature).__name__}")
    if len(signature) < SIGNATURE_LENGTH:
        raise TruncatedSignature(f"signature is {len(signature)} bytes, an Ed25519 signature is 64")
    if len(signature) > SIGNATURE_LENGTH:
        raise MalformedSignature(f"signature is {len(signature)} bytes, an Ed25519 signature is 64")


def _verifies(public_key: bytes, message: bytes, signature: bytes) -> bool:
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError):
        return False
    return True


def verify_signature(public_key: bytes, purpose: Purpose, data: bytes, signature: bytes) -> None:
    """Raise unless `signature` is `public_key`'s signature of `data` under `purpose`.

    A shape error raises TruncatedSignature or MalformedSignature. A signature that verifies under another
    purpose raises WrongPurpose naming both (this costs one verify per purpose, on the failure path only);
    anything else raises BadSignature.
    """
    check_public_key(public_key)
    check_signature_shape(signature)
    if _verifies(public_key, signed_message(purpose, data), signature):
        return
    for other in Purpose:
        if other is not purpose and _verifies(public_key, signed_message(other, data), signature):
            raise WrongPurpose(f"signature is for purpose {other.value!r}, expected {purpose.value!r}")
    raise BadSignature(f"signature under purpose {purpose.value!r} does not verify")


@attrs.frozen
class KeyPair:
    """An Ed25519 key pair held as its 32-byte seed. `repr` never shows the seed."""

    seed: bytes = attrs.field(repr=False)
    public_key: bytes = attrs.field(init=False)
    _signer: nacl.signing.SigningKey = attrs.field(init=False, repr=False, eq=False)

    @seed.validator
    def _check_seed(self, _attr: attrs.Attribute[bytes], value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != SEED_LENGTH:
            raise ValueError(f"an Ed25519 seed is {SEED_LENGTH} bytes")

    def __attrs_post_init__(self) -> None:
        signer = nacl.signing.SigningKey(self.seed)
        object.__setattr__(self, "_signer", signer)
        object.__setattr__(self, "public_key", bytes(signer.verify_key))

    @classmethod
    def generate(cls) -> KeyPair:
        return cls(bytes(nacl.signing.SigningKey.generate()))

    def sign(self, purpose: Purpose, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `purpose_tag(purpose) || data`."""
        return bytes(self._signer.sign(signed_message(purpose, data)).signature)


@attrs.frozen
class Envelope:
    """Exact payload bytes and a detached signature, as they travel (`bytes payload; bytes signature`)."""

    payload: bytes
    signature: bytes

    @classmethod
    def seal(cls, key: KeyPair, purpose: Purpose, payload: bytes) -> Envelope:
        return cls(payload, key.sign(purpose, payload))

    def verify(self, public_key: bytes, purpose: Purpose) -> bytes:
        """Verify with a known key; return the payload bytes, unchanged."""
        verify_signature(public_key, purpose, self.payload, self.signature)
        return self.payload
