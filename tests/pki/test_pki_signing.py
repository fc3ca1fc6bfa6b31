"""Envelopes: purpose tags, Ed25519 sign/verify and their refusals.

Covers DLV-SIG-01 (purpose `command`), DLV-SIG-13 (the same envelope under `desired-state`).
"""

from __future__ import annotations

import pytest
from bcd_shared.pki import (
    BadSignature,
    Envelope,
    KeyPair,
    MalformedSignature,
    Purpose,
    TruncatedSignature,
    WrongPurpose,
    purpose_tag,
    signed_message,
    verify_signature,
)

BODY = b"\x0a\x1a01JCMDULIDAAAAAAAAAAAAAAAA\x12\x06node-1"


def test_tags_are_prefix_free_and_distinct() -> None:
    tags = [purpose_tag(p) for p in Purpose]
    assert len(set(tags)) == len(tags)
    for a in tags:
        for b in tags:
            assert a == b or not b.startswith(a)
    assert purpose_tag(Purpose.COMMAND) == b"bcd-sig-v1/command\x00"
    assert signed_message(Purpose.DESIRED_STATE, b"xy") == b"bcd-sig-v1/desired-state\x00xy"


def test_DLV_SIG_01_sign_and_verify_round_trip_keeps_exact_bytes() -> None:
    key = KeyPair.generate()
    env = Envelope.seal(key, Purpose.COMMAND, BODY)
    assert len(env.signature) == 64
    assert env.verify(key.public_key, Purpose.COMMAND) is BODY


def test_keypair_from_seed_is_deterministic_and_hides_seed() -> None:
    seed = bytes(range(32))
    a, b = KeyPair(seed), KeyPair(seed)
    assert a.public_key == b.public_key
    assert a.sign(Purpose.COMMAND, BODY) == b.sign(Purpose.COMMAND, BODY)  # Ed25519 is deterministic
    assert seed.hex() not in repr(a)
    with pytest.raises(ValueError, match="32 bytes"):
        KeyPair(b"short")


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


KEY = KeyPair(bytes(32))
OTHER = KeyPair(bytes([1]) * 32)
GOOD = KEY.sign(Purpose.COMMAND, BODY)

# (case, public key, purpose, data, signature, error, text in message)
REFUSALS = [
    ("wrong purpose", KEY.public_key, Purpose.DESIRED_STATE, BODY, GOOD, WrongPurpose, "'command'"),
    (
        "one byte changed in body",
        KEY.public_key,
        Purpose.COMMAND,
        _flip(BODY, 3),
        GOOD,
        BadSignature,
        "command",
    ),
    (
        "one byte changed in signature",
        KEY.public_key,
        Purpose.COMMAND,
        BODY,
        _flip(GOOD, 10),
        BadSignature,
        "does not verify",
    ),
    (
        "last byte of signature",
        KEY.public_key,
        Purpose.COMMAND,
        BODY,
        _flip(GOOD, 63),
        BadSignature,
        "does not verify",
    ),
    ("truncated signature", KEY.public_key, Purpose.COMMAND, BODY, GOOD[:63], TruncatedSignature, "63 bytes"),
    ("empty signature", KEY.public_key, Purpose.COMMAND, BODY, b"", TruncatedSignature, "0 bytes"),
    ("trailing byte", KEY.public_key, Purpose.COMMAND, BODY, GOOD + b"\x00", MalformedSignature, "65 bytes"),
    ("another key", OTHER.public_key, Purpose.COMMAND, BODY, GOOD, BadSignature, "does not verify"),
    ("short public key", KEY.public_key[:31], Purpose.COMMAND, BODY, GOOD, MalformedSignature, "32 bytes"),
    (
        "body with appended byte",
        KEY.public_key,
        Purpose.COMMAND,
        BODY + b"\x00",
        GOOD,
        BadSignature,
        "does not verify",
    ),
]


@pytest.mark.parametrize(
    ("case", "pub", "purpose", "data", "sig", "error", "text"), REFUSALS, ids=[r[0] for r in REFUSALS]
)
def test_DLV_SIG_01_envelope_refusals(
    case: str, pub: bytes, purpose: Purpose, data: bytes, sig: bytes, error: type[Exception], text: str
) -> None:
    verify_signature(KEY.public_key, Purpose.COMMAND, BODY, GOOD)  # the unchanged input verifies
    with pytest.raises(error, match=text) as info:
        verify_signature(pub, purpose, data, sig)
    assert str(info.value).startswith(info.value.rule + ": ")  # type: ignore[attr-defined]


def test_DLV_SIG_13_desired_state_signature_never_verifies_as_command() -> None:
    sig = KEY.sign(Purpose.DESIRED_STATE, BODY)
    verify_signature(KEY.public_key, Purpose.DESIRED_STATE, BODY, sig)
    with pytest.raises(WrongPurpose, match="'desired-state', expected 'command'"):
        verify_signature(KEY.public_key, Purpose.COMMAND, BODY, sig)
