"""Trust bundles: the command-signing roots, node roots and quorum settings a node trusts, signed by the
JoinService key, rotating forward only.

Wire: `SignedTrustBundle{bundle, signature, signer_spki}` (proto/bcd/v1/join.proto). `bundle` is the
serialized `TrustBundle`, exactly as signed under purpose `trust-bundle`; `signer_spki` is the JoinService
key's DER SubjectPublicKeyInfo, whose SHA-256 must equal root's `join_signing_key_pin`
(HST-SIGN-09, HST-SIGN-16).
`verify_trust_bundle` checks the pin on the exact spki bytes received, the signature over the exact bundle
bytes, then decodes strictly into the frozen `TrustBundle`.

`TrustStore` is the pure forward-only rule (HST-SIGN-10, HST-SIGN-15): a newer version is accepted, an older
one is a rollback and refused, the same version is accepted only with the same bytes (a replay of the newest
bundle), never with different ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import attrs
from cryptography.hazmat.primitives.asymmetric import ed25519

from bcd_shared.pki._wire import decode
from bcd_shared.pki.chain import Roots
from bcd_shared.pki.errors import (
    ConflictingTrustBundle,
    MalformedCertificate,
    MalformedTrustBundle,
    PkiError,
    StaleTrustBundle,
    UntrustedBundleSigner,
)
from bcd_shared.pki.pins import ED25519_SPKI_PREFIX, JoinKeyPin, spki_der
from bcd_shared.pki.signing import PUBLIC_KEY_LENGTH, KeyPair, Purpose, verify_signature
from bcd_shared.wire import ApproverKey as WireApproverKey
from bcd_shared.wire import SignedTrustBundle as WireSignedTrustBundle
from bcd_shared.wire import TrustBundle as WireTrustBundle

MAX_ROOTS = 16
MAX_APPROVERS = 64
MAX_KEY_ID = 128


@attrs.frozen
class Approver:
    key_id: str
    public_key: bytes = attrs.field(repr=False)


@attrs.frozen
class TrustBundle:
    """A decoded, validated trust bundle (the domain type; the wire's TrustBundle stops at the edge)."""

    version: int
    command_roots: tuple[bytes, ...] = ()  # DER; empty: commands and specs go unsigned
    node_roots: tuple[bytes, ...] = ()  # DER; the CAs of node certificates (attested results)
    approvers: tuple[Approver, ...] = ()  # empty: no quorum
    approvals_required: int = 0
    unbatched_destructive_per_hour: int = 0
    issued_at_ms: int = 0

    def __attrs_post_init__(self) -> None:
        _validate(self)

    @property
    def has_command_roots(self) -> bool:
        """From the first bundle with roots on, every command and spec must be signed (DLV-SIG-05, -16)."""
        return bool(self.command_roots)

    @property
    def has_quorum(self) -> bool:
        return bool(self.approvers)

    def command_root_set(self) -> Roots:
        return Roots.from_ders(self.command_roots)

    def node_root_set(self) -> Roots:
        return Roots.from_ders(self.node_roots)

    def to_wire(self) -> WireTrustBundle:
        return WireTrustBundle(
            version=self.version,
            command_roots=list(self.command_roots),
            node_roots=list(self.node_roots),
            approver_keys=[WireApproverKey(key_id=a.key_id, public_key=a.public_key) for a in self.approvers],
            approvals_required=self.approvals_required,
            unbatched_destructive_per_hour=self.unbatched_destructive_per_hour,
            issued_at=self.issued_at_ms,
        )

    def encode(self) -> bytes:
        """Bytes to sign, for the issuer (the development JoinService). Verifiers keep the bytes received."""
        return bytes(self.to_wire())

    @classmethod
    def from_wire(cls, message: WireTrustBundle) -> TrustBundle:
        try:
            return cls(
                version=message.version,
                command_roots=tuple(message.command_roots),
                node_roots=tuple(message.node_roots),
                approvers=tuple(Approver(a.key_id, a.public_key) for a in message.approver_keys),
                approvals_required=message.approvals_required,
                unbatched_destructive_per_hour=message.unbatched_destructive_per_hour,
                issued_at_ms=message.issued_at,
            )
        except MalformedCertificate as e:
            raise MalformedTrustBundle(str(e)) from None

    @classmethod
    def decode(cls, data: bytes) -> TrustBundle:
        """Strictly decode the exact TrustBundle bytes (unknown fields refused)."""
        return cls.from_wire(decode(WireTrustBundle, data, "trust bundle", MalformedTrustBundle))


def _check_roots(ders: Iterable[bytes], field: str) -> None:
    seen: set[bytes] = set()
    for index, der in enumerate(ders):
        if der in seen:
            raise MalformedTrustBundle(f"{field}[{index}]: duplicate root")
        seen.add(der)
        try:
            Roots.from_ders([der])
        except PkiError as e:
            raise MalformedTrustBundle(f"{field}[{index}]: {e}") from None


def _validate(bundle: TrustBundle) -> None:
    if bundle.version < 1:
        raise MalformedTrustBundle(f"version: must be at least 1, got {bundle.version}")
    for field in ("command_roots", "node_roots"):
        ders: tuple[bytes, ...] = getattr(bundle, field)
        if len(ders) > MAX_ROOTS:
            raise MalformedTrustBundle(f"{field}: {len(ders)} roots, at most {MAX_ROOTS}")
        _check_roots(ders, field)
    if len(bundle.approvers) > MAX_APPROVERS:
        raise MalformedTrustBundle(f"approver_keys: {len(bundle.approvers)} keys, at most {MAX_APPROVERS}")
    ids: set[str] = set()
    for index, approver in enumerate(bundle.approvers):
        if not approver.key_id or len(approver.key_id) > MAX_KEY_ID or not approver.key_id.isprintable():
            raise MalformedTrustBundle(
                f"approver_keys[{index}].key_id: must be 1-{MAX_KEY_ID} printable chars"
            )
        if approver.key_id in ids:
            raise MalformedTrustBundle(f"approver_keys[{index}].key_id: duplicate {approver.key_id!r}")
        ids.add(approver.key_id)
        if len(approver.public_key) != PUBLIC_KEY_LENGTH:
            raise MalformedTrustBundle(
                f"approver_keys[{index}].public_key: {len(approver.public_key)} bytes, Ed25519 is 32"
            )
    distinct = len({a.public_key for a in bundle.approvers})
    if bundle.approvers and not 1 <= bundle.approvals_required <= distinct:
        raise MalformedTrustBundle(
            f"approvals_required: {bundle.approvals_required} with {distinct} distinct approver key(s); "
            f"must be 1 to {distinct}"
        )
    if not bundle.approvers and bundle.approvals_required != 0:
        raise MalformedTrustBundle("approvals_required: set without approver_keys")
    if bundle.unbatched_destructive_per_hour < 0:
        raise MalformedTrustBundle("unbatched_destructive_per_hour: must not be negative")


@attrs.frozen
class VerifiedBundle:
    """A trust bundle whose signature and signer pin checked out, with the exact bytes it came from."""

    bundle: TrustBundle
    bundle_bytes: bytes = attrs.field(repr=False)
    signature: bytes = attrs.field(repr=False)
    signer_spki: bytes = attrs.field(repr=False)

    @property
    def version(self) -> int:
        return self.bundle.version

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.bundle_bytes).hexdigest()

    def to_wire(self) -> WireSignedTrustBundle:
        """The SignedTrustBundle to relay: the exact bytes received, never re-encoded."""
        return WireSignedTrustBundle(
            bundle=self.bundle_bytes, signature=self.signature, signer_spki=self.signer_spki
        )


def _raw_key_of_spki(spki: bytes, error: type[PkiError]) -> bytes:
    if len(spki) == len(ED25519_SPKI_PREFIX) + PUBLIC_KEY_LENGTH and spki.startswith(ED25519_SPKI_PREFIX):
        return spki[len(ED25519_SPKI_PREFIX) :]  # the canonical encoding (spki_der): nothing to refuse
    # Anything else is refused; cryptography's reading says why (imported only here: docs/benchmarks.md).
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_der_public_key(spki)
    except (ValueError, TypeError) as e:
        raise error(f"signer_spki: not a DER SubjectPublicKeyInfo ({e})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise error("signer_spki: not an Ed25519 key")
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if spki_der(raw) != spki:
        raise error("signer_spki: not the canonical DER encoding")
    return raw


def verify_trust_bundle(
    bundle_bytes: bytes, signature: bytes, signer_spki: bytes, join_pin: JoinKeyPin
) -> VerifiedBundle:
    """Verify a SignedTrustBundle's parts against root's `join_signing_key_pin` and decode the bundle."""
    if hashlib.sha256(signer_spki).digest() != join_pin.digest:
        raise UntrustedBundleSigner(f"signer key is not the pinned JoinService key ({join_pin})")
    public_key = _raw_key_of_spki(signer_spki, UntrustedBundleSigner)
    verify_signature(public_key, Purpose.TRUST_BUNDLE, bundle_bytes, signature)
    return VerifiedBundle(TrustBundle.decode(bundle_bytes), bundle_bytes, signature, signer_spki)


def verify_signed_trust_bundle(data: bytes, join_pin: JoinKeyPin) -> VerifiedBundle:
    """Verify the exact bytes of a serialized SignedTrustBundle."""
    message = decode(WireSignedTrustBundle, data, "signed trust bundle", MalformedTrustBundle)
    return verify_trust_bundle(message.bundle, message.signature, message.signer_spki, join_pin)


def sign_trust_bundle(join_key: KeyPair, bundle: TrustBundle) -> WireSignedTrustBundle:
    """The issuer's side (the development JoinService): encode once, sign those bytes."""
    data = bundle.encode()
    return WireSignedTrustBundle(
        bundle=data,
        signature=join_key.sign(Purpose.TRUST_BUNDLE, data),
        signer_spki=spki_der(join_key.public_key),
    )


@attrs.frozen
class TrustStore:
    """The newest accepted bundle's version and digest. Pure: `accept` returns the next store or raises."""

    version: int = 0
    sha256: str = ""

    def accept(self, bundle: VerifiedBundle) -> TrustStore:
        """The store after accepting `bundle`; raises StaleTrustBundle or ConflictingTrustBundle."""
        if bundle.version < self.version:
            raise StaleTrustBundle(
                f"trust bundle version {bundle.version} is older than version {self.version} already accepted"
            )
        if bundle.version == self.version:
            if bundle.sha256 != self.sha256:
                raise ConflictingTrustBundle(
                    f"trust bundle version {bundle.version} has other bytes than the one already accepted"
                )
            return self
        return TrustStore(bundle.version, bundle.sha256)

    def is_newer(self, bundle: VerifiedBundle) -> bool:
        """Whether accepting `bundle` would move the store forward (it raises on a rollback or conflict)."""
        return self.accept(bundle) != self
