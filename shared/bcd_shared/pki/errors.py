"""Typed refusals of the pki package.

Every check that fails raises a `PkiError` subclass. `rule` is a short, stable, machine-readable code
(the agent maps any PkiError on a command to `BAD_SIGNATURE`, on a batch to `BATCH_UNAPPROVED`); the
message is for people and names the rule, the certificate or field, and the values involved.
"""

from __future__ import annotations


class PkiError(Exception):
    """Base: a signature, certificate, pin, trust bundle or quorum check refused its input."""

    rule: str = "pki"

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.rule}: {message}")
        self.message = message


# --- signatures -------------------------------------------------------------------------------------


class BadSignature(PkiError):
    """The signature does not verify over `purpose tag || bytes` with the signer's key."""

    rule = "bad-signature"


class TruncatedSignature(PkiError):
    """The signature is shorter than an Ed25519 signature (64 bytes)."""

    rule = "truncated-signature"


class MalformedSignature(PkiError):
    """The signature is longer than 64 bytes, or the public key is not a 32-byte Ed25519 key."""

    rule = "malformed-signature"


class WrongPurpose(PkiError):
    """The signature is valid, but under another purpose than the one the verifier asked for."""

    rule = "wrong-purpose"


# --- certificates and chains ------------------------------------------------------------------------


class MalformedCertificate(PkiError):
    """Not a canonical DER X.509 certificate of an Ed25519 key, or a bcd extension is malformed."""

    rule = "malformed-certificate"


class WrongRole(PkiError):
    """The leaf certificate's role does not sign this purpose."""

    rule = "wrong-role"


class CertificateExpired(PkiError):
    """`now` is after a certificate's notAfter."""

    rule = "expired"


class CertificateNotYetValid(PkiError):
    """`now` is before a certificate's notBefore."""

    rule = "not-yet-valid"


class UnknownRoot(PkiError):
    """The chain does not end at a root whose DER SHA-256 is pinned or in the trust bundle."""

    rule = "unknown-root"


class NotIssuedBy(PkiError):
    """A certificate's issuer name is not its parent's subject."""

    rule = "not-issued-by"


class BadCertificateSignature(PkiError):
    """A certificate's signature does not verify with its parent's key."""

    rule = "bad-certificate-signature"


class NotACA(PkiError):
    """A certificate that issues another one lacks BasicConstraints CA=true."""

    rule = "not-a-ca"


class LeafIsCA(PkiError):
    """The signing (leaf) certificate is a CA; CA keys never sign intent or results."""

    rule = "leaf-is-ca"


class KeyUsageNotAllowed(PkiError):
    """keyUsage is missing, or lacks keyCertSign (CA) or digitalSignature (leaf)."""

    rule = "key-usage"


class PathLengthExceeded(PkiError):
    """More intermediate CAs sit below a CA than its BasicConstraints path length allows."""

    rule = "path-length-exceeded"


class ChainTooLong(PkiError):
    """The presented chain is empty or longer than MAX_CHAIN_LENGTH."""

    rule = "chain-length"


# --- pins -------------------------------------------------------------------------------------------


class BadPin(PkiError):
    """A pin or pin list (`command_root_sha256`, `join_signing_key_pin`) is malformed."""

    rule = "bad-pin"


class UnpinnedRoot(UnknownRoot):
    """A root named by the request is not in the pinned set (`command_root_sha256`)."""

    rule = "unpinned-root"


# --- trust bundles ----------------------------------------------------------------------------------


class MalformedTrustBundle(PkiError):
    """The trust bundle's bytes do not decode strictly, or a value breaks a rule."""

    rule = "malformed-bundle"


class UntrustedBundleSigner(PkiError):
    """The trust bundle's signer key is not the pinned JoinService key."""

    rule = "untrusted-bundle-signer"


class StaleTrustBundle(PkiError):
    """The trust bundle's version is older than the newest one already accepted (a rollback)."""

    rule = "stale-bundle"


class ConflictingTrustBundle(PkiError):
    """Same version as the newest accepted bundle, different bytes."""

    rule = "bundle-conflict"


# --- the destructive-batch quorum -------------------------------------------------------------------


class MalformedQuorumInput(PkiError):
    """A batch scope, approval or proof is malformed (lengths, counts, encodings)."""

    rule = "malformed-quorum"


class QuorumNotMet(PkiError):
    """Fewer distinct approver keys signed the scope than the threshold asks."""

    rule = "quorum-not-met"


class BadScopeProof(PkiError):
    """The inclusion proof does not lead to the approved scope's Merkle root."""

    rule = "bad-scope-proof"


class ScopeMismatch(PkiError):
    """The proven leaf is for another (subject, kind) or payload than this command."""

    rule = "scope-mismatch"


class ScopeExpired(PkiError):
    """The approved batch scope's not_after has passed."""

    rule = "scope-expired"


# --- join records and attested results --------------------------------------------------------------


class MalformedJoinResponse(PkiError):
    """The JoinResponse or its body does not decode strictly, or a value breaks a rule."""

    rule = "malformed-join-response"


class UntrustedJoinSigner(PkiError):
    """The JoinResponse's signer key is not the pinned JoinService key."""

    rule = "untrusted-join-signer"


class MalformedAttestation(PkiError):
    """An attestation or attested report body does not decode strictly."""

    rule = "malformed-attestation"


class AttestationMismatch(PkiError):
    """The signed attestation or report names another command, state, result, node or boot."""

    rule = "attestation-mismatch"
