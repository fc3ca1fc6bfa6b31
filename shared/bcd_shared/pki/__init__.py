"""bcd's pki: purposes and signature envelopes, certificates and chain checks, pins, trust bundles,
attested results and the destructive-batch quorum. Pure: no clock reads, no I/O, no module-level state.

Layout (each module opens with its rules; docs/pki.md has the byte layouts):
- signing: Purpose, purpose_tag, KeyPair, Envelope, verify_signature (Ed25519 via pynacl)
- certs: Role, the role extension, parse_certificate, issue_root / issue_intermediate / issue_leaf /
  issue_node_certificate
- chain: Roots, verify_chain, ChainCache, verify_signed, VerifiedSigner
- pins: root_pin, parse_root_pins, JoinKeyPin
- verify: verify_command, verify_desired_state
- errors: PkiError and one subclass per rule
"""

from __future__ import annotations

from bcd_shared.pki.certs import (
    ROLE_FOR_PURPOSE,
    ROLE_OID,
    CertInfo,
    Role,
    issue_certificate,
    issue_intermediate,
    issue_leaf,
    issue_node_certificate,
    issue_root,
    parse_certificate,
    public_key_of,
    role_for,
)
from bcd_shared.pki.chain import (
    MAX_CHAIN_LENGTH,
    ChainCache,
    Roots,
    VerifiedSigner,
    verify_chain,
    verify_signed,
)
from bcd_shared.pki.errors import (
    BadCertificateSignature,
    BadPin,
    BadSignature,
    CertificateExpired,
    CertificateNotYetValid,
    ChainTooLong,
    KeyUsageNotAllowed,
    LeafIsCA,
    MalformedCertificate,
    MalformedSignature,
    NotACA,
    NotIssuedBy,
    PathLengthExceeded,
    PkiError,
    TruncatedSignature,
    UnknownRoot,
    UnpinnedRoot,
    WrongPurpose,
    WrongRole,
)
from bcd_shared.pki.pins import JoinKeyPin, parse_root_pins, root_pin
from bcd_shared.pki.signing import Envelope, KeyPair, Purpose, purpose_tag, signed_message, verify_signature
from bcd_shared.pki.verify import verify_command, verify_desired_state

__all__ = [
    "MAX_CHAIN_LENGTH",
    "ROLE_FOR_PURPOSE",
    "ROLE_OID",
    "BadCertificateSignature",
    "BadPin",
    "BadSignature",
    "CertInfo",
    "CertificateExpired",
    "CertificateNotYetValid",
    "ChainCache",
    "ChainTooLong",
    "Envelope",
    "JoinKeyPin",
    "KeyPair",
    "KeyUsageNotAllowed",
    "LeafIsCA",
    "MalformedCertificate",
    "MalformedSignature",
    "NotACA",
    "NotIssuedBy",
    "PathLengthExceeded",
    "PkiError",
    "Purpose",
    "Role",
    "Roots",
    "TruncatedSignature",
    "UnknownRoot",
    "UnpinnedRoot",
    "VerifiedSigner",
    "WrongPurpose",
    "WrongRole",
    "issue_certificate",
    "issue_intermediate",
    "issue_leaf",
    "issue_node_certificate",
    "issue_root",
    "parse_certificate",
    "parse_root_pins",
    "public_key_of",
    "purpose_tag",
    "role_for",
    "root_pin",
    "signed_message",
    "verify_chain",
    "verify_command",
    "verify_desired_state",
    "verify_signature",
    "verify_signed",
]
