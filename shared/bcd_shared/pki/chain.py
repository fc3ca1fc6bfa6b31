"""Hand-written chain verification for Ed25519 certificates (cryptography's verifier refuses Ed25519).

`verify_chain(chain, roots, purpose, now)` takes the signer's chain as DER bytes, leaf first, optionally
ending with the root itself, and checks, in this order:
1. shape: 1..MAX_CHAIN_LENGTH certificates, each canonical DER of an Ed25519 key signed with Ed25519, no
   critical extension bcd does not know;
2. the anchor: the last certificate is a root of `roots` (by the SHA-256 of its DER), or is issued by one;
   else UnknownRoot;
3. every link: `verify_directly_issued_by` (issuer name, then signature) from the anchor down;
4. every issuer: BasicConstraints CA=true (NotACA), keyUsage keyCertSign (KeyUsageNotAllowed), and its path
   length covers the intermediate CAs below it (PathLengthExceeded);
5. every certificate, the anchor included: notBefore <= now <= notAfter (CertificateNotYetValid,
   CertificateExpired); `now` is a parameter, nothing here reads a clock;
6. the leaf: not a CA (LeafIsCA), keyUsage digitalSignature, and its role signs `purpose` (WrongRole).

Everything but step 5 is independent of time, so `ChainCache` keeps verified chains keyed by the chain's DER
digest, the purpose and the root set, with the window in which every certificate is valid; a hit inside
that window skips parsing and all signature checks.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
from collections.abc import Iterable, Sequence
from typing import Final, TypeVar

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from bcd_shared.pki.certs import ROLE_OID, CertInfo, Role, parse_certificate, role_for
from bcd_shared.pki.errors import (
    BadCertificateSignature,
    CertificateExpired,
    CertificateNotYetValid,
    ChainTooLong,
    KeyUsageNotAllowed,
    LeafIsCA,
    MalformedCertificate,
    NotACA,
    NotIssuedBy,
    PathLengthExceeded,
    UnknownRoot,
    UnpinnedRoot,
    WrongRole,
)
from bcd_shared.pki.signing import Purpose, check_signature_shape, verify_signature

MAX_CHAIN_LENGTH: Final = 8
_KNOWN_CRITICAL: Final = frozenset({x509.BasicConstraints.oid, x509.KeyUsage.oid, ROLE_OID})

_E = TypeVar("_E", bound=x509.ExtensionType)


@attrs.frozen
class Roots:
    """A set of trusted root certificates, by pin (SHA-256 hex of DER)."""

    certs: tuple[CertInfo, ...]
    by_pin: dict[str, CertInfo] = attrs.field(init=False, eq=False, repr=False)
    fingerprint: str = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "by_pin", {c.sha256: c for c in self.certs})
        digest = hashlib.sha256("".join(sorted(self.by_pin)).encode("ascii")).hexdigest()
        object.__setattr__(self, "fingerprint", digest)

    @classmethod
    def from_ders(cls, ders: Iterable[bytes]) -> Roots:
        """Roots taken as given (from a verified trust bundle)."""
        return cls(tuple(parse_certificate(d) for d in ders))

    @classmethod
    def pinned(cls, ders: Iterable[bytes], pins: Iterable[str]) -> Roots:
        """Roots a request names, each of which must be pinned (`command_root_sha256`, HST-SIGN-06)."""
        allowed = frozenset(pins)
        infos = tuple(parse_certificate(d) for d in ders)
        for info in infos:
            if info.sha256 not in allowed:
                raise UnpinnedRoot(f"root {info.name!r} (sha256 {info.sha256}) is not pinned")
        return cls(infos)

    @property
    def pins(self) -> frozenset[str]:
        return frozenset(self.by_pin)

    def __bool__(self) -> bool:
        return bool(self.certs)


@attrs.frozen
class VerifiedSigner:
    """The outcome of a verified chain: who may sign what, and for how long the verdict holds."""

    public_key: bytes = attrs.field(repr=False)
    role: Role
    name: str  # the leaf's CN: the worker's or node's id
    root_pin: str
    valid_from: datetime.datetime  # the latest notBefore in the chain
    valid_until: datetime.datetime  # the earliest notAfter in the chain


def _ext(info: CertInfo, kind: type[_E]) -> _E | None:
    try:
        return info.cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        return None
    except (ValueError, x509.DuplicateExtension) as e:
        raise MalformedCertificate(f"{info.name!r}: bad extensions ({e})") from None


def _check_shape(info: CertInfo) -> None:
    try:
        extensions = info.cert.extensions
    except (ValueError, x509.DuplicateExtension) as e:
        raise MalformedCertificate(f"{info.name!r}: bad extensions ({e})") from None
    for ext in extensions:
        if ext.critical and ext.oid not in _KNOWN_CRITICAL:
            raise MalformedCertificate(
                f"{info.name!r}: unsupported critical extension {ext.oid.dotted_string}"
            )


def _check_link(child: CertInfo, parent: CertInfo) -> None:
    try:
        child.cert.verify_directly_issued_by(parent.cert)
    except InvalidSignature:
        raise BadCertificateSignature(
            f"{child.name!r}: signature does not verify with {parent.name!r}'s key"
        ) from None
    except (ValueError, TypeError) as e:
        raise NotIssuedBy(f"{child.name!r} is not issued by {parent.name!r} ({e})") from None


def _check_issuer(issuer: CertInfo, cas_below: int) -> None:
    constraints = _ext(issuer, x509.BasicConstraints)
    if constraints is None or not constraints.ca:
        raise NotACA(f"{issuer.name!r} issues certificates but is not a CA (BasicConstraints CA=true)")
    usage = _ext(issuer, x509.KeyUsage)
    if usage is None or not usage.key_cert_sign:
        raise KeyUsageNotAllowed(f"CA {issuer.name!r} lacks keyUsage keyCertSign")
    if constraints.path_length is not None and cas_below > constraints.path_length:
        raise PathLengthExceeded(
            f"CA {issuer.name!r} allows {constraints.path_length} intermediate CA(s) below it, "
            f"the chain has {cas_below}"
        )


def _check_validity(info: CertInfo, now: datetime.datetime) -> None:
    not_before = info.cert.not_valid_before_utc
    not_after = info.cert.not_valid_after_utc
    if now < not_before:
        raise CertificateNotYetValid(
            f"{info.name!r} is valid from {not_before.isoformat()}, now is {now.isoformat()}"
        )
    if now > not_after:
        raise CertificateExpired(
            f"{info.name!r} expired at {not_after.isoformat()}, now is {now.isoformat()}"
        )


def _check_leaf(leaf: CertInfo, purpose: Purpose) -> Role:
    constraints = _ext(leaf, x509.BasicConstraints)
    if constraints is not None and constraints.ca:
        raise LeafIsCA(f"{leaf.name!r} is a CA certificate; only leaf certificates sign {purpose.value!r}")
    usage = _ext(leaf, x509.KeyUsage)
    if usage is None or not usage.digital_signature:
        raise KeyUsageNotAllowed(f"leaf {leaf.name!r} lacks keyUsage digitalSignature")
    want = role_for(purpose)
    if leaf.role is None:
        raise WrongRole(
            f"leaf {leaf.name!r} has no bcd role; purpose {purpose.value!r} needs role {want.value!r}"
        )
    if leaf.role is not want:
        raise WrongRole(
            f"leaf {leaf.name!r} has role {leaf.role.value!r}; "
            f"purpose {purpose.value!r} needs role {want.value!r}"
        )
    return want


def _find_anchor(last: CertInfo, roots: Roots) -> tuple[CertInfo, bool]:
    """The root the chain ends at, and whether the chain itself includes it."""
    if last.sha256 in roots.by_pin:
        return roots.by_pin[last.sha256], True
    candidates = [r for r in roots.certs if r.cert.subject == last.cert.issuer]
    for root in candidates:
        try:
            last.cert.verify_directly_issued_by(root.cert)
        except (InvalidSignature, ValueError, TypeError):
            continue
        return root, False
    issuer = last.cert.issuer.rfc4514_string()
    if not roots:
        raise UnknownRoot(f"no command-signing roots to chain {last.name!r} to")
    raise UnknownRoot(f"chain ends at {last.name!r} (issuer {issuer!r}), which no trusted root issued")


def verify_chain(
    chain: Sequence[bytes], roots: Roots, purpose: Purpose, now: datetime.datetime
) -> VerifiedSigner:
    """Verify the signer's chain (DER, leaf first) for `purpose` at time `now`; see the module docstring."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    if not 1 <= len(chain) <= MAX_CHAIN_LENGTH:
        raise ChainTooLong(f"chain has {len(chain)} certificates, expected 1 to {MAX_CHAIN_LENGTH}")
    infos = [parse_certificate(der) for der in chain]
    for info in infos:
        _check_shape(info)
    anchor, included = _find_anchor(infos[-1], roots)
    full = [*infos] if included else [*infos, anchor]
    if not included:
        _check_shape(anchor)
    if len(full) == 1:
        raise LeafIsCA(f"{anchor.name!r} is a root; only leaf certificates sign {purpose.value!r}")
    for index in range(len(full) - 1, 0, -1):
        _check_link(full[index - 1], full[index])
    for index in range(1, len(full)):
        _check_issuer(full[index], cas_below=index - 1)
    for info in full:
        _check_validity(info, now)
    role = _check_leaf(full[0], purpose)
    return VerifiedSigner(
        public_key=full[0].public_key,
        role=role,
        name=full[0].name,
        root_pin=anchor.sha256,
        valid_from=max(i.cert.not_valid_before_utc for i in full),
        valid_until=min(i.cert.not_valid_after_utc for i in full),
    )


def chain_digest(chain: Sequence[bytes]) -> bytes:
    """SHA-256 over the chain's DER certificates, each prefixed with its 4-byte big-endian length."""
    h = hashlib.sha256()
    for der in chain:
        h.update(len(der).to_bytes(4, "big"))
        h.update(der)
    return h.digest()


@attrs.define
class ChainCache:
    """Verified chains, bounded LRU; one per verifier object (no module-level state).

    A hit needs the same chain bytes, purpose and root set, and `now` inside the chain's validity window,
    so it answers exactly what `verify_chain` would. Refusals are not cached.
    """

    max_entries: int = 1024
    _entries: collections.OrderedDict[tuple[bytes, Purpose, str], VerifiedSigner] = attrs.field(
        factory=collections.OrderedDict, init=False, repr=False
    )
    hits: int = attrs.field(default=0, init=False)
    misses: int = attrs.field(default=0, init=False)

    def verify(
        self, chain: Sequence[bytes], roots: Roots, purpose: Purpose, now: datetime.datetime
    ) -> VerifiedSigner:
        key = (chain_digest(chain), purpose, roots.fingerprint)
        found = self._entries.get(key)
        if found is not None and found.valid_from <= now <= found.valid_until:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        signer = verify_chain(chain, roots, purpose, now)
        self._entries[key] = signer
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return signer


def verify_signed(
    purpose: Purpose,
    data: bytes,
    signature: bytes,
    signer_chain: Sequence[bytes],
    roots: Roots,
    now: datetime.datetime,
    cache: ChainCache | None = None,
    *,
    chain_purpose: Purpose | None = None,
) -> VerifiedSigner:
    """Verify `signature` over `purpose_tag || data` by the leaf of a chain to `roots`; return the signer.

    The chain is checked for `chain_purpose` (the signer's role), `purpose` itself when not given.
    """
    check_signature_shape(signature)
    for_chain = purpose if chain_purpose is None else chain_purpose
    signer = (
        cache.verify(signer_chain, roots, for_chain, now)
        if cache is not None
        else verify_chain(signer_chain, roots, for_chain, now)
    )
    verify_signature(signer.public_key, purpose, data, signature)
    return signer
