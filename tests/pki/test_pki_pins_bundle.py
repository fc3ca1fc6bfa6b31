"""Pins and trust bundles.

Covers HST-SIGN-05 (command_root_sha256 syntax), HST-SIGN-13 (malformed pins refused, naming the rule),
HST-SIGN-09/16 (a bundle is checked against the pinned JoinService key), HST-SIGN-10/15 (forward-only
versions, rollback refused), DLV-SIG-04/05 (`has_command_roots` decides whether signatures are enforced).
"""

from __future__ import annotations

import hashlib

import pytest
from bcd_shared.pki import (
    Approver,
    BadPin,
    BadSignature,
    ConflictingTrustBundle,
    JoinKeyPin,
    KeyPair,
    MalformedSignature,
    MalformedTrustBundle,
    Purpose,
    StaleTrustBundle,
    TrustBundle,
    TrustStore,
    UntrustedBundleSigner,
    VerifiedBundle,
    WrongPurpose,
    parse_root_pins,
    root_pin,
    sign_trust_bundle,
    spki_der,
    verify_signed_trust_bundle,
    verify_trust_bundle,
)
from bcd_shared.wire import SignedTrustBundle as WireSignedTrustBundle
from bcd_shared.wire import TrustBundle as WireTrustBundle
from pkifixture import Hierarchy, shared_hierarchy


@pytest.fixture(name="hierarchy")
def _hierarchy_fixture() -> Hierarchy:
    return shared_hierarchy()


A = "a" * 64
B = "0123456789abcdef" * 4

# --- root pins ------------------------------------------------------------------------------------


def test_HST_SIGN_05_root_pin_is_sha256_hex_of_der(hierarchy: Hierarchy) -> None:
    assert root_pin(hierarchy.root) == hashlib.sha256(hierarchy.root).hexdigest()
    assert parse_root_pins(f"{A},{B}") == (A, B)
    assert parse_root_pins(f"{A} , {B}") == (A, B)
    assert parse_root_pins(",".join(f"{i:064x}" for i in range(16)))[15] == f"{15:064x}"


PIN_REFUSALS = [
    ("empty", "", "is empty"),
    ("uppercase", A.upper(), "must be lowercase hex"),
    ("short", A[:63], "not 64 hex digits"),
    ("long", A + "a", "not 64 hex digits"),
    ("not hex", "g" * 64, "not 64 hex digits"),
    ("empty entry", f"{A},,{B}", "entry 2 is empty"),
    ("trailing comma", f"{A},", "entry 2 is empty"),
    ("duplicate", f"{A},{A}", "entry 2 repeats"),
    ("seventeen", ",".join(f"{i:064x}" for i in range(17)), "17 entries, at most 16"),
    ("sha256/ prefix", "sha256/" + A, "not 64 hex digits"),
    ("tab inside", f"{A},\t{B}", "not 64 hex digits"),
]


@pytest.mark.parametrize(("case", "text", "message"), PIN_REFUSALS, ids=[c[0] for c in PIN_REFUSALS])
def test_HST_SIGN_13_malformed_root_pins(case: str, text: str, message: str) -> None:
    with pytest.raises(BadPin, match=message) as info:
        parse_root_pins(text)
    assert str(info.value).startswith("bad-pin: command_root_sha256")


def test_HST_SIGN_13_join_key_pin_round_trip_and_refusals() -> None:
    key = KeyPair.generate()
    pin = JoinKeyPin.of_key(key.public_key)
    text = str(pin)
    assert text.startswith("sha256/") and len(text) == 51
    assert JoinKeyPin.parse(text) == pin
    assert pin.matches(key.public_key)
    assert not pin.matches(KeyPair.generate().public_key)
    assert pin.digest == hashlib.sha256(spki_der(key.public_key)).digest()
    for bad, message in [
        ("", "must start with 'sha256/'"),
        ("sha1/" + text[7:], "must start with 'sha256/'"),
        ("sha256/" + text[7:-1], "44 characters"),
        ("sha256/" + "!" * 43 + "=", "44 characters"),
        ("sha256/" + hashlib.sha256(b"x").hexdigest(), "44 characters"),
        ("sha256/" + text[7:-2] + "B=", "non-canonical"),
    ]:
        with pytest.raises(BadPin, match=message):
            JoinKeyPin.parse(bad)


# --- trust bundles --------------------------------------------------------------------------------

JOIN_KEY = KeyPair(bytes([7]) * 32)
PIN = JoinKeyPin.of_key(JOIN_KEY.public_key)


def _bundle(hierarchy: Hierarchy, version: int, **kw: object) -> TrustBundle:
    return TrustBundle(version=version, command_roots=(hierarchy.root,), issued_at_ms=1_700_000_000_000, **kw)  # type: ignore[arg-type]


def _verify(signed: WireSignedTrustBundle) -> VerifiedBundle:
    return verify_trust_bundle(signed.bundle, signed.signature, signed.signer_spki, PIN)


def test_HST_SIGN_09_bundle_signed_by_pinned_key_round_trip(hierarchy: Hierarchy) -> None:
    approvers = (Approver("a1", KeyPair.generate().public_key), Approver("a2", KeyPair.generate().public_key))
    bundle = _bundle(
        hierarchy, 3, approvers=approvers, approvals_required=2, unbatched_destructive_per_hour=1
    )
    signed = sign_trust_bundle(JOIN_KEY, bundle)
    verified = verify_signed_trust_bundle(bytes(signed), PIN)
    assert verified.bundle == bundle
    assert verified.bundle_bytes == signed.bundle  # the exact bytes, kept for relaying and hashing
    assert verified.to_wire() == signed
    assert verified.bundle.has_command_roots and verified.bundle.has_quorum
    assert verified.bundle.command_root_set().pins == {root_pin(hierarchy.root)}


def test_DLV_SIG_04_bundle_without_roots_enforces_nothing() -> None:
    bundle = TrustBundle(version=1)
    assert not bundle.has_command_roots
    assert not bundle.command_root_set()


def test_HST_SIGN_16_bundle_from_another_key_is_refused(hierarchy: Hierarchy) -> None:
    signed = sign_trust_bundle(KeyPair.generate(), _bundle(hierarchy, 1))
    with pytest.raises(UntrustedBundleSigner, match="not the pinned JoinService key"):
        _verify(signed)
    # Claiming the pinned key's spki does not help: the signature is then wrong.
    forged = WireSignedTrustBundle(
        bundle=signed.bundle, signature=signed.signature, signer_spki=spki_der(JOIN_KEY.public_key)
    )
    with pytest.raises(BadSignature):
        _verify(forged)


def test_bundle_tampering_is_refused(hierarchy: Hierarchy) -> None:
    signed = sign_trust_bundle(JOIN_KEY, _bundle(hierarchy, 2))
    flipped = signed.bundle[:1] + bytes([signed.bundle[1] ^ 1]) + signed.bundle[2:]
    with pytest.raises(BadSignature):
        verify_trust_bundle(flipped, signed.signature, signed.signer_spki, PIN)
    with pytest.raises(WrongPurpose, match="'command'"):
        verify_trust_bundle(
            signed.bundle, JOIN_KEY.sign(Purpose.COMMAND, signed.bundle), signed.signer_spki, PIN
        )


def _signed_raw(data: bytes) -> bytes:
    return bytes(
        WireSignedTrustBundle(
            bundle=data,
            signature=JOIN_KEY.sign(Purpose.TRUST_BUNDLE, data),
            signer_spki=spki_der(JOIN_KEY.public_key),
        )
    )


def test_malformed_bundles_are_refused_even_when_signed(hierarchy: Hierarchy) -> None:
    good = bytes(WireTrustBundle(version=1, command_roots=[hierarchy.root]))
    cases = [
        (good + b"\x78\x01", "unknown field"),  # field 15, varint
        (good + b"\x12", "command_roots: truncated"),
        (good + b"\x08\x02", "version: singular field appears more than once"),
        (bytes(WireTrustBundle(version=0)), "version: must be at least 1"),
        (bytes(WireTrustBundle(version=1, command_roots=[b"junk"])), r"command_roots\[0\]"),
        (bytes(WireTrustBundle(version=1, command_roots=[hierarchy.root, hierarchy.root])), "duplicate root"),
        (bytes(WireTrustBundle(version=1, approvals_required=1)), "set without approver_keys"),
    ]
    for data, message in cases:
        with pytest.raises(MalformedTrustBundle, match=message):
            verify_signed_trust_bundle(_signed_raw(data), PIN)


def test_quorum_settings_are_validated() -> None:
    k = KeyPair.generate().public_key
    with pytest.raises(MalformedTrustBundle, match="must be 1 to 1"):
        TrustBundle(version=1, approvers=(Approver("a", k), Approver("b", k)), approvals_required=2)
    with pytest.raises(MalformedTrustBundle, match="duplicate 'a'"):
        TrustBundle(
            version=1,
            approvers=(Approver("a", k), Approver("a", KeyPair.generate().public_key)),
            approvals_required=1,
        )
    with pytest.raises(MalformedTrustBundle, match="Ed25519 is 32"):
        TrustBundle(version=1, approvers=(Approver("a", k[:31]),), approvals_required=1)
    with pytest.raises(MalformedTrustBundle, match="must be 1 to 1"):
        TrustBundle(version=1, approvers=(Approver("a", k),), approvals_required=0)


def test_HST_SIGN_10_HST_SIGN_15_trust_store_moves_forward_only(hierarchy: Hierarchy) -> None:
    v3 = _verify(sign_trust_bundle(JOIN_KEY, _bundle(hierarchy, 3)))
    v5 = _verify(sign_trust_bundle(JOIN_KEY, _bundle(hierarchy, 5)))
    v5_other = _verify(sign_trust_bundle(JOIN_KEY, _bundle(hierarchy, 5, unbatched_destructive_per_hour=9)))
    store = TrustStore()
    store = store.accept(v3)
    store = store.accept(v5)
    assert store.version == 5
    assert store.accept(v5) == store  # a replay of the newest: no change
    assert not store.is_newer(v5)
    with pytest.raises(StaleTrustBundle, match="version 3 is older than version 5 already accepted"):
        store.accept(v3)
    with pytest.raises(ConflictingTrustBundle, match="version 5 has other bytes"):
        store.accept(v5_other)
    assert TrustStore().is_newer(v3)


def test_spki_der_is_cryptographys_encoding_and_reads_back() -> None:
    """spki_der builds the RFC 8410 encoding itself (no cryptography `serialization` import on the node's
    path): byte for byte what cryptography writes, and a bundle's signer_spki reads back to the key."""
    from bcd_shared.pki.bundle import _raw_key_of_spki
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    for _ in range(8):
        key = ed25519.Ed25519PrivateKey.generate().public_key()
        raw = key.public_bytes_raw()
        expected = key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        assert spki_der(raw) == expected
        assert _raw_key_of_spki(expected, UntrustedBundleSigner) == raw
    with pytest.raises(MalformedSignature, match="32 bytes, got 31"):
        spki_der(b"\x01" * 31)
