"""The pki package's refusals, word for word, and the edges of its limits (docs/mutation.md).

Every refusal names the rule, the field and the values (docs/pki.md): the messages are checked exactly, so a
refusal that loses its field name or its detail fails here. Limits are tried at the limit and one past it.
The issuance helpers (the development control plane's) are checked for the certificates they make.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import pytest
from bcd_shared.pki import (
    AttestationMismatch,
    BadCertificateSignature,
    BadPin,
    BadScopeProof,
    ChainCache,
    ChainTooLong,
    JoinKeyPin,
    KeyPair,
    MalformedAttestation,
    MalformedCertificate,
    MalformedJoinResponse,
    MalformedQuorumInput,
    MalformedSignature,
    MalformedTrustBundle,
    Purpose,
    QuorumNotMet,
    Role,
    Roots,
    ScopeExpired,
    TrustBundle,
    UnknownRoot,
    UntrustedBundleSigner,
    UntrustedJoinSigner,
    WrongRole,
    admit_batched_command,
    approve,
    build_batch,
    inclusion_path,
    issue_intermediate,
    issue_leaf,
    issue_root,
    merkle_root,
    sign_join_response,
    sign_trust_bundle,
    verify_batch_approval,
    verify_chain,
    verify_command,
    verify_command_result,
    verify_desired_state,
    verify_inclusion,
    verify_join_response,
    verify_report,
    verify_scope_proof,
    verify_signature,
    verify_signed_trust_bundle,
)
from bcd_shared.pki.bundle import MAX_APPROVERS, MAX_KEY_ID, MAX_ROOTS, Approver, verify_trust_bundle
from bcd_shared.pki.certs import ROLE_OID, issue_certificate, parse_certificate, public_key_of, role_for
from bcd_shared.pki.chain import MAX_CHAIN_LENGTH, chain_digest, verify_signed
from bcd_shared.pki.pins import check_root_pin, parse_root_pins, spki_der
from bcd_shared.pki.quorum import decode_scope, leaf_hash
from bcd_shared.pki.signing import check_public_key, check_signature_shape
from bcd_shared.wire import (
    BatchApproval,
    BatchLeaf,
    BatchProof,
    BatchScope,
    CommandAttestation,
    CommandState,
    JoinResponse,
    JoinResponseBody,
)
from bcd_shared.wire import SignedTrustBundle as WireSignedTrustBundle
from bcd_shared.wire import TrustBundle as WireTrustBundle
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID
from pkifixture import DAY, HOUR, NOW, Hierarchy, shared_hierarchy

JOIN = KeyPair(bytes([21]) * 32)
PIN = JoinKeyPin.of_key(JOIN.public_key)
K1, K2, K3 = (KeyPair(bytes([i]) * 32) for i in (31, 32, 33))
APPROVERS = (
    Approver("alice", K1.public_key),
    Approver("bob", K2.public_key),
    Approver("carol", K3.public_key),
)


def _message(exc: pytest.ExceptionInfo[Any]) -> str:
    return str(exc.value)


# --- pins -----------------------------------------------------------------------------------------------


def test_root_pin_rules_and_their_messages() -> None:
    good = "ab" * 32
    assert check_root_pin(good) == good
    with pytest.raises(BadPin) as exc:
        check_root_pin("AB" * 32, "command_root_sha256[0]")
    assert exc.value.message == f"command_root_sha256[0]: {'AB' * 32!r} must be lowercase hex"
    with pytest.raises(BadPin) as exc:
        check_root_pin("ab" * 31)
    assert exc.value.message == f"pin: {'ab' * 31!r} is not 64 hex digits (a SHA-256 of the root's DER)"
    with pytest.raises(BadPin) as exc:
        check_root_pin("g" * 64)
    assert "is not 64 hex digits" in exc.value.message
    with pytest.raises(BadPin) as exc:
        parse_root_pins(5)  # type: ignore[arg-type]
    assert exc.value.message == "command_root_sha256: must be a string, got int"


def test_join_pin_parse_names_its_field_and_prints_back() -> None:
    with pytest.raises(BadPin) as exc:
        JoinKeyPin.parse(5)  # type: ignore[arg-type]
    assert exc.value.message == "join_signing_key_pin: must be a string, got int"
    with pytest.raises(BadPin) as exc:
        JoinKeyPin.parse("sha256/short")
    assert exc.value.message.startswith("join_signing_key_pin: ")
    assert str(JoinKeyPin.parse(str(PIN))) == str(PIN)
    assert JoinKeyPin.parse(str(PIN)) == PIN and str(PIN).startswith("sha256/") and len(str(PIN)) == 51


# --- signatures -----------------------------------------------------------------------------------------


def test_signature_shape_messages_name_the_type_or_length() -> None:
    with pytest.raises(MalformedSignature) as exc:
        check_signature_shape("sig")  # type: ignore[arg-type]
    assert exc.value.message == "signature must be bytes, got str"
    with pytest.raises(MalformedSignature) as exc:
        check_public_key(b"\x01" * 31)
    assert exc.value.message == "an Ed25519 public key is 32 bytes, got 31"
    with pytest.raises(MalformedSignature) as exc:
        check_public_key("k" * 32)  # type: ignore[arg-type]
    assert exc.value.message == "an Ed25519 public key is 32 bytes, got str"
    assert (
        _message_of(lambda: check_public_key(b""))
        == "malformed-signature: an Ed25519 public key is 32 bytes, got 0"
    )


def _message_of(call: Any) -> str:
    try:
        call()
    except Exception as exc:
        return str(exc)
    raise AssertionError("no refusal")


# --- certificates ---------------------------------------------------------------------------------------


def _cert_with_role_value(value: bytes, common_name: str = "odd-leaf") -> bytes:
    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(NOW - DAY)
        .not_valid_after(NOW + DAY)
        .add_extension(x509.UnrecognizedExtension(ROLE_OID, value), critical=True)
        .sign(key, None)
    )
    return cert.public_bytes(serialization.Encoding.DER)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"", "'odd-leaf': role extension is not one DER UTF8String"),
        (b"\x0c", "'odd-leaf': role extension is not one DER UTF8String"),
        (b"\x13\x06worker", "'odd-leaf': role extension is not one DER UTF8String"),  # PrintableString
        (b"\x0c\x05worker", "'odd-leaf': role extension is not one DER UTF8String"),  # length disagrees
        (b"\x0c\x80" + b"a" * 128, "'odd-leaf': role extension is not one DER UTF8String"),  # long form
        (b"\x0c\x00", "'odd-leaf': unknown role b''"),
        (b"\x0c\x7f" + b"a" * 127, f"'odd-leaf': unknown role {b'a' * 127!r}"),
        (b"\x0c\x02\xc3\xa9", "'odd-leaf': unknown role b'\\xc3\\xa9'"),
        (b"\x0c\x05admin", "'odd-leaf': unknown role b'admin'"),
    ],
)
def test_role_extension_must_be_one_short_utf8string_naming_a_role(value: bytes, message: str) -> None:
    with pytest.raises(MalformedCertificate) as exc:
        parse_certificate(_cert_with_role_value(value))
    assert exc.value.message == message


def test_role_extension_of_each_role_parses() -> None:
    for role in Role:
        value = b"\x0c" + bytes([len(role.value)]) + role.value.encode()
        assert parse_certificate(_cert_with_role_value(value)).role is role


def test_parse_certificate_refusals_name_the_certificate() -> None:
    for bad in (b"", "der", None):
        with pytest.raises(MalformedCertificate) as exc:
            parse_certificate(bad)  # type: ignore[arg-type]
        assert exc.value.message == "certificate must be non-empty DER bytes"

    ec_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ecdsa-root")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .serial_number(1)
        .not_valid_before(NOW - DAY)
        .not_valid_after(NOW + DAY)
    )

    ecdsa = builder.public_key(ec_key.public_key()).sign(ec_key, hashes.SHA256())
    with pytest.raises(MalformedCertificate) as exc:
        parse_certificate(ecdsa.public_bytes(serialization.Encoding.DER))
    assert exc.value.message == "'ecdsa-root': signature algorithm is not Ed25519"
    ed_signer = ed25519.Ed25519PrivateKey.generate()
    ec_subject = builder.public_key(ec_key.public_key()).sign(ed_signer, None)
    with pytest.raises(MalformedCertificate) as exc:
        parse_certificate(ec_subject.public_bytes(serialization.Encoding.DER))
    assert exc.value.message == "'ecdsa-root': public key is not Ed25519"


def test_parsed_certificate_keeps_the_exact_der_and_a_bytes_common_name_is_decoded() -> None:
    h = shared_hierarchy()
    info = parse_certificate(h.root)
    assert info.der == h.root and info.sha256 == hashlib.sha256(h.root).hexdigest()
    assert info.name == "command-signing root"


def test_issued_certificates_have_exactly_the_constraints_and_usages_asked() -> None:
    root_key, ca_key, leaf_key = KeyPair(b"\x41" * 32), KeyPair(b"\x42" * 32), KeyPair(b"\x43" * 32)
    root = x509.load_der_x509_certificate(issue_root(root_key, "r", NOW - DAY, NOW + DAY))
    inter_der = issue_intermediate(
        root.public_bytes(serialization.Encoding.DER), root_key, ca_key.public_key, "i", NOW - DAY, NOW + DAY
    )
    inter = x509.load_der_x509_certificate(inter_der)
    leaf = x509.load_der_x509_certificate(
        issue_leaf(
            inter_der, ca_key, leaf_key.public_key, Role.WORKER, "w", NOW - HOUR, NOW + HOUR, serial=77
        )
    )
    for cert, ca, path_length in ((root, True, 1), (inter, True, 0), (leaf, False, None)):
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
        assert bc.critical and bc.value.ca is ca and bc.value.path_length == path_length
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
        assert ku.critical
        v = ku.value
        assert (v.digital_signature, v.key_cert_sign, v.crl_sign) == (not ca, ca, ca)
        assert not (v.content_commitment or v.key_encipherment or v.data_encipherment or v.key_agreement)
    role = leaf.extensions.get_extension_for_oid(ROLE_OID)
    assert role.critical and role.value.value == b"\x0c\x06worker"
    assert leaf.serial_number == 77
    assert 1 <= root.serial_number <= 1 << 63 and 1 <= inter.serial_number <= 1 << 63
    explicit = x509.load_der_x509_certificate(
        issue_intermediate(
            root.public_bytes(serialization.Encoding.DER),
            root_key,
            ca_key.public_key,
            "i2",
            NOW,
            NOW + DAY,
            3,
        )
    )
    assert explicit.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 3
    plain = x509.load_der_x509_certificate(
        issue_certificate(
            subject_public_key=leaf_key.public_key,
            common_name="plain",
            issuer_key=leaf_key,
            issuer_der=None,
            not_before=NOW,
            not_after=NOW + DAY,
            ca=None,
        )
    )
    oids = {e.oid for e in plain.extensions}
    assert x509.BasicConstraints.oid not in oids and x509.KeyUsage.oid not in oids


def test_issuance_refuses_naive_times_and_short_keys_by_name() -> None:
    key = KeyPair(b"\x44" * 32)
    naive = datetime.datetime(2026, 1, 1)
    with pytest.raises(ValueError, match=r"^not_before must be timezone-aware$"):
        issue_root(key, "r", naive, NOW)
    with pytest.raises(ValueError, match=r"^not_after must be timezone-aware$"):
        issue_root(key, "r", NOW, naive)
    with pytest.raises(ValueError, match=r"^an Ed25519 public key is 32 bytes$"):
        issue_leaf(shared_hierarchy().intermediate, key, b"\x00" * 31, Role.WORKER, "w", NOW, NOW + DAY)


def test_role_for_a_purpose_no_role_signs_says_so() -> None:
    with pytest.raises(WrongRole) as exc:
        role_for(Purpose.DAEMON_RELEASE)
    assert exc.value.message == (
        "no certificate role signs purpose 'daemon-release'; verify it against a pinned key"
    )


# --- chains ---------------------------------------------------------------------------------------------


def test_chain_length_limit_is_inclusive() -> None:
    h = shared_hierarchy()
    worker = h.leaf(Role.WORKER)
    with pytest.raises(ChainTooLong) as exc:
        verify_chain([worker.chain[0]] * (MAX_CHAIN_LENGTH + 1), h.roots, Purpose.COMMAND, NOW)
    assert (
        exc.value.message
        == f"chain has {MAX_CHAIN_LENGTH + 1} certificates, expected 1 to {MAX_CHAIN_LENGTH}"
    )
    # Exactly MAX_CHAIN_LENGTH is a shape the length rule allows: what refuses it is the next rule.
    with pytest.raises(Exception) as exc2:
        verify_chain([worker.chain[0]] * MAX_CHAIN_LENGTH, h.roots, Purpose.COMMAND, NOW)
    assert not isinstance(exc2.value, ChainTooLong)
    with pytest.raises(ValueError, match=r"^now must be timezone-aware$"):
        verify_chain(list(worker.chain), h.roots, Purpose.COMMAND, NOW.replace(tzinfo=None))


def test_chain_with_root_included_or_not_checks_every_link() -> None:
    """Both forms of a chain verify; a chain that includes the root but whose intermediate another key
    signed is refused at that link (the link next to the root is checked too)."""
    h = shared_hierarchy()
    worker = h.leaf(Role.WORKER)
    assert verify_chain(list(worker.chain), h.roots, Purpose.COMMAND, NOW).name == "worker-1"
    assert verify_chain([*worker.chain, h.root], h.roots, Purpose.COMMAND, NOW).name == "worker-1"
    other = Hierarchy.build()  # another root key with the same names
    forged_inter = issue_intermediate(
        other.root, other.root_key, h.ca_key.public_key, "command-signing CA", NOW - DAY, NOW + DAY
    )

    with pytest.raises(BadCertificateSignature):
        verify_chain([worker.chain[0], forged_inter, h.root], h.roots, Purpose.COMMAND, NOW)


def test_chain_without_root_still_checks_the_roots_shape() -> None:
    """A root with an unknown critical extension is refused also when the chain leaves it out."""
    root_key, ca_key = KeyPair(b"\x51" * 32), KeyPair(b"\x52" * 32)
    rk = ed25519.Ed25519PrivateKey.from_private_bytes(root_key.seed)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "odd root")])
    root = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(rk.public_key())
        .serial_number(5)
        .not_valid_before(NOW - DAY)
        .not_valid_after(NOW + DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(
            x509.UnrecognizedExtension(x509.ObjectIdentifier("1.2.3.4.5"), b"\x05\x00"), critical=True
        )
        .sign(rk, None)
        .public_bytes(serialization.Encoding.DER)
    )
    inter = issue_intermediate(root, root_key, ca_key.public_key, "ca", NOW - DAY, NOW + DAY)
    leaf = issue_leaf(
        inter, ca_key, KeyPair(b"\x53" * 32).public_key, Role.WORKER, "w", NOW - HOUR, NOW + HOUR
    )
    with pytest.raises(MalformedCertificate) as exc:
        verify_chain([leaf, inter], Roots.from_ders([root]), Purpose.COMMAND, NOW)
    assert exc.value.message == "'odd root': unsupported critical extension 1.2.3.4.5"


def test_anchor_search_tries_every_root_with_the_issuers_name() -> None:
    """Two roots share a subject name; the chain's issuer is the second: the first's failed signature check
    must not end the search."""
    h = shared_hierarchy()
    decoy = Hierarchy.build()  # same subject name "command-signing root", another key
    worker = h.leaf(Role.WORKER)
    roots = Roots.from_ders([decoy.root, h.root])
    assert (
        verify_chain(list(worker.chain), roots, Purpose.COMMAND, NOW).root_pin
        == hashlib.sha256(h.root).hexdigest()
    )

    with pytest.raises(UnknownRoot) as exc:
        verify_chain(list(worker.chain), Roots.from_ders([decoy.root]), Purpose.COMMAND, NOW)
    assert exc.value.message == (
        "chain ends at 'command-signing CA' (issuer 'CN=command-signing root'), which no trusted root issued"
    )


def test_chain_digest_frames_each_certificate_with_its_length() -> None:
    assert chain_digest([b"ab", b"c"]) == hashlib.sha256(b"\x00\x00\x00\x02ab\x00\x00\x00\x01c").digest()
    assert chain_digest([b"ab", b"c"]) != chain_digest([b"a", b"bc"])


def test_roots_fingerprint_is_the_sorted_pins_concatenated() -> None:
    h, other = shared_hierarchy(), Hierarchy.build()
    pins = sorted(hashlib.sha256(d).hexdigest() for d in (h.root, other.root))
    want = hashlib.sha256("".join(pins).encode()).hexdigest()
    assert Roots.from_ders([h.root, other.root]).fingerprint == want
    assert Roots.from_ders([other.root, h.root]).fingerprint == want


def test_chain_cache_hits_inside_the_window_counts_misses_and_evicts_the_oldest() -> None:
    h = shared_hierarchy()
    a, b = h.leaf(Role.WORKER, "a"), h.leaf(Role.WORKER, "b")
    cache = ChainCache(max_entries=1)
    signer = cache.verify(list(a.chain), h.roots, Purpose.COMMAND, NOW)
    # At the first instant of the window the cached verdict is used.
    assert cache.verify(list(a.chain), h.roots, Purpose.COMMAND, signer.valid_from) == signer
    assert (cache.hits, cache.misses) == (1, 1)
    cache.verify(list(b.chain), h.roots, Purpose.COMMAND, NOW)  # evicts a (the least recently used)
    assert (cache.hits, cache.misses) == (1, 2)
    cache.verify(list(b.chain), h.roots, Purpose.COMMAND, NOW)
    assert (cache.hits, cache.misses) == (2, 2)
    cache.verify(list(a.chain), h.roots, Purpose.COMMAND, NOW)
    assert (cache.hits, cache.misses) == (2, 3)


# --- trust bundles and the join record ------------------------------------------------------------------


def test_wire_decoders_name_what_they_decode() -> None:
    cases: list[tuple[Any, type[Exception], str]] = [
        (lambda: TrustBundle.decode("x"), MalformedTrustBundle, "trust bundle: expected bytes, got str"),
        (lambda: TrustBundle.decode(b"\xff"), MalformedTrustBundle, "trust bundle: "),
        (lambda: verify_join_response(b"\xff", PIN), MalformedJoinResponse, "join response: "),
        (lambda: decode_scope(b"\xff"), MalformedQuorumInput, "batch scope: "),
        (
            lambda: verify_signed_trust_bundle(b"\xff", PIN),
            MalformedTrustBundle,
            "signed trust bundle: ",
        ),
    ]
    for call, kind, prefix in cases:
        with pytest.raises(kind) as exc:
            call()
        assert exc.value.message.startswith(prefix), (prefix, exc.value.message)  # type: ignore[attr-defined]


def test_join_body_and_node_id_refusals() -> None:
    bad_body = bytes(
        JoinResponse(
            body=b"\xff",
            signature=JOIN.sign(Purpose.JOIN_RESPONSE, b"\xff"),
            signer_spki=spki_der(JOIN.public_key),
        )
    )
    with pytest.raises(MalformedJoinResponse) as exc:
        verify_join_response(bad_body, PIN)
    assert exc.value.message.startswith("join response body: ")
    with pytest.raises(MalformedJoinResponse) as exc:
        verify_join_response(sign_join_response(JOIN, JoinResponseBody(node_id="", issued_at=5)), PIN)
    assert exc.value.message == "node_id: empty"
    joined = verify_join_response(sign_join_response(JOIN, JoinResponseBody(node_id="n1", issued_at=5)), PIN)
    assert joined.trust_bundle is None and joined.issued_at_ms == 5
    assert joined.body_bytes == bytes(JoinResponseBody(node_id="n1", issued_at=5))


def test_signer_spki_must_be_canonical_ed25519() -> None:
    ec_spki = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    # (A non-canonical encoding of an Ed25519 key never gets past cryptography's DER parser, which refuses
    # long-form lengths, NULL parameters and trailing bytes itself: the canonical-encoding check after it is
    # a second line, recorded as unreachable in docs/mutation.md.)
    # An X25519 key's SPKI has the Ed25519 one's length (44 bytes) and another OID; the Ed25519 prefix
    # with a key of 31 or 33 bytes is no SPKI at all: none of them takes the canonical form's fast path.
    x_spki = bytes.fromhex("302a300506032b656e032100") + b"\x09" * 32
    prefix = bytes.fromhex("302a300506032b6570032100")
    for spki, message in (
        (b"\x30\x00", None),
        (ec_spki, "signer_spki: not an Ed25519 key"),
        (x_spki, "signer_spki: not an Ed25519 key"),
        (prefix + b"\x09" * 31, None),
        (prefix + b"\x09" * 33, None),
    ):
        pin = JoinKeyPin(hashlib.sha256(spki).digest())
        with pytest.raises(UntrustedBundleSigner) as exc:
            verify_trust_bundle(b"", b"\x00" * 64, spki, pin)
        if message is None:
            assert exc.value.message.startswith("signer_spki: not a DER SubjectPublicKeyInfo (")
        else:
            assert exc.value.message == message
        signed_join = bytes(JoinResponse(body=b"", signature=b"\x00" * 64, signer_spki=spki))
        with pytest.raises(UntrustedJoinSigner):
            verify_join_response(signed_join, pin)


def test_bundle_limits_are_inclusive_and_named() -> None:
    keys = [KeyPair(i.to_bytes(2, "big") * 16) for i in range(MAX_APPROVERS + 1)]
    at_limit = tuple(Approver(f"k{i}", k.public_key) for i, k in enumerate(keys[:MAX_APPROVERS]))
    assert len(TrustBundle(version=1, approvers=at_limit, approvals_required=1).approvers) == MAX_APPROVERS
    over = (*at_limit, Approver("one-more", keys[-1].public_key))
    with pytest.raises(MalformedTrustBundle) as exc:
        TrustBundle(version=1, approvers=over, approvals_required=1)
    assert exc.value.message == f"approver_keys: {MAX_APPROVERS + 1} keys, at most {MAX_APPROVERS}"
    assert TrustBundle(
        version=1, approvers=(Approver("x" * MAX_KEY_ID, K1.public_key),), approvals_required=1
    )
    for key_id in ("x" * (MAX_KEY_ID + 1), "tab\there", ""):
        with pytest.raises(MalformedTrustBundle) as exc:
            TrustBundle(version=1, approvers=(Approver(key_id, K1.public_key),), approvals_required=1)
        assert exc.value.message == f"approver_keys[0].key_id: must be 1-{MAX_KEY_ID} printable chars"
    roots = [Hierarchy.build(f"r{i}").root for i in range(MAX_ROOTS + 1)]
    assert len(TrustBundle(version=1, command_roots=tuple(roots[:MAX_ROOTS])).command_roots) == MAX_ROOTS
    with pytest.raises(MalformedTrustBundle) as exc:
        TrustBundle(version=1, node_roots=tuple(roots))
    assert exc.value.message == f"node_roots: {MAX_ROOTS + 1} roots, at most {MAX_ROOTS}"


def test_bundle_approvals_required_and_rate_rules() -> None:
    assert TrustBundle(version=1, approvers=APPROVERS, approvals_required=1).approvals_required == 1
    with pytest.raises(MalformedTrustBundle) as exc:
        TrustBundle(version=1, approvals_required=1)
    assert exc.value.message == "approvals_required: set without approver_keys"
    with pytest.raises(MalformedTrustBundle) as exc:
        TrustBundle(version=1, unbatched_destructive_per_hour=-1)
    assert exc.value.message == "unbatched_destructive_per_hour: must not be negative"


def test_bundle_round_trips_node_roots_through_the_wire() -> None:
    h = shared_hierarchy()
    bundle = TrustBundle(version=3, command_roots=(h.root,), node_roots=(h.root,), issued_at_ms=9)
    again = TrustBundle.decode(bundle.encode())
    assert again == bundle and again.node_roots == (h.root,)
    assert again.node_root_set().pins == frozenset({hashlib.sha256(h.root).hexdigest()})
    signed = sign_trust_bundle(JOIN, bundle)
    assert isinstance(signed, WireSignedTrustBundle)

    assert verify_signed_trust_bundle(bytes(signed), PIN).bundle.node_roots == (h.root,)
    with pytest.raises(MalformedTrustBundle) as exc:
        TrustBundle.decode(bytes(WireTrustBundle(version=1, node_roots=[b"\x30\x03\x02\x01\x00"])))
    assert exc.value.message.startswith("node_roots[0]: ")
    assert "not a DER X.509 certificate" in exc.value.message


# --- attestations ---------------------------------------------------------------------------------------


def test_attestation_decoders_name_what_they_decode() -> None:
    node = KeyPair(b"\x61" * 32)

    bad = b"\xff"
    with pytest.raises(MalformedAttestation) as exc:
        verify_command_result(
            bad,
            node.sign(Purpose.COMMAND_RESULT, bad),
            node.public_key,
            command_id="c",
            state=CommandState.SUCCEEDED,
            result=b"",
            node_id="n",
        )
    assert exc.value.message.startswith("command attestation: ")
    with pytest.raises(MalformedAttestation) as exc:
        verify_report(bad, node.sign(Purpose.ATTESTED_REPORT, bad), node.public_key, "n")
    assert exc.value.message.startswith("attested report body: ")


def test_attestation_mismatch_shows_text_fields_as_text() -> None:

    node = KeyPair(b"\x62" * 32)
    body = bytes(
        CommandAttestation(
            command_id="c1",
            state=CommandState.SUCCEEDED,
            result_sha256=hashlib.sha256(b"").digest(),
            node_id="n",
        )
    )
    with pytest.raises(AttestationMismatch) as exc:
        verify_command_result(
            body,
            node.sign(Purpose.COMMAND_RESULT, body),
            node.public_key,
            command_id="c2",
            state=CommandState.SUCCEEDED,
            result=b"",
            node_id="n",
        )
    assert exc.value.message == "command_id: attestation says 'c1', the update says 'c2'"


# --- quorum ---------------------------------------------------------------------------------------------


def _leaves(n: int) -> list[BatchLeaf]:
    return [
        BatchLeaf(
            subject="node-1",
            kind="gpu.reset",
            payload_sha256=hashlib.sha256(b"%d" % i).digest(),
            command_id=f"c{i}",
        )
        for i in range(n)
    ]


def test_build_batch_scope_holds_the_tree_and_the_fields_given() -> None:
    leaves = _leaves(3)
    batch = build_batch("b-1", leaves, description="rack 7", not_after_ms=1234)
    assert batch.leaves == tuple(bytes(leaf) for leaf in leaves)
    scope = decode_scope(batch.scope)
    assert (scope.batch_id, scope.leaf_count, scope.description, scope.not_after) == (
        "b-1",
        3,
        "rack 7",
        1234,
    )
    assert scope.merkle_root == merkle_root(batch.leaves)
    plain = decode_scope(build_batch("b-2", leaves[:1]).scope)
    assert (plain.description, plain.not_after, plain.leaf_count) == ("", 0, 1)


def _scope(**fields: Any) -> bytes:
    base: dict[str, Any] = {"batch_id": "b", "merkle_root": b"\x00" * 32, "leaf_count": 1}
    return bytes(BatchScope(**{**base, **fields}))


def test_scope_field_rules_are_named_and_inclusive() -> None:
    assert decode_scope(_scope(leaf_count=1)).leaf_count == 1
    assert decode_scope(_scope(leaf_count=1 << 20)).leaf_count == 1 << 20
    for fields, message in (
        ({"batch_id": ""}, "batch scope: batch_id is empty"),
        ({"merkle_root": b"\x00" * 31}, "batch scope: merkle_root is 31 bytes, expected 32"),
        ({"leaf_count": 0}, f"batch scope: leaf_count 0 outside 1..{1 << 20}"),
        ({"leaf_count": (1 << 20) + 1}, f"batch scope: leaf_count {(1 << 20) + 1} outside 1..{1 << 20}"),
    ):
        with pytest.raises(MalformedQuorumInput) as exc:
            decode_scope(_scope(**fields))
        assert exc.value.message == message


def test_tree_input_limits_are_named() -> None:
    with pytest.raises(MalformedQuorumInput) as exc:
        merkle_root([])
    assert exc.value.message == f"a batch has 1 to {1 << 20} leaves, got 0"
    with pytest.raises(MalformedQuorumInput) as exc:
        inclusion_path([b"a", b"b"], 2)
    assert exc.value.message == "leaf index 2 outside a batch of 2"
    assert inclusion_path([b"a", b"b"], 1) == [leaf_hash(b"a")]


def test_inclusion_proofs_of_every_leaf_of_odd_trees_verify_and_wrong_ones_say_why() -> None:
    for n in (1, 2, 3, 5, 6, 7, 11):
        leaves = [b"leaf-%d" % i for i in range(n)]
        root = merkle_root(leaves)
        for i in range(n):
            path = inclusion_path(leaves, i)
            verify_inclusion(leaves[i], i, path, n, root)
            with pytest.raises(BadScopeProof) as exc:
                verify_inclusion(leaves[i], i, [*path, b"\x00" * 32], n, root)
            assert exc.value.message == "path is longer than the tree is deep"
            if path:
                with pytest.raises(BadScopeProof) as exc:
                    verify_inclusion(leaves[i], i, path[:-1], n, root)
                assert exc.value.message == "path is shorter than the tree is deep"
            with pytest.raises(BadScopeProof) as exc:
                verify_inclusion(b"other", i, path, n, root)
            assert exc.value.message == "the proof does not lead to the approved Merkle root"
    with pytest.raises(BadScopeProof) as exc:
        verify_inclusion(b"a", 0, [b"\x00" * 32] * 21, 1 << 20, b"\x00" * 32)
    assert exc.value.message == "path must be at most 20 hashes of 32 bytes"
    leaves = [b"%d" % i for i in range(1 << 20 >> 10)]  # a 1024-leaf tree: a path of 10
    verify_inclusion(leaves[777], 777, inclusion_path(leaves, 777), len(leaves), merkle_root(leaves))


def test_a_full_depth_path_of_twenty_is_allowed() -> None:
    """MAX_PATH hashes is the depth of a tree of MAX_LEAVES: allowed (it fails only on the root here)."""
    with pytest.raises(BadScopeProof) as exc:
        verify_inclusion(b"a", 0, [b"\x00" * 32] * 20, 1 << 20, b"\x00" * 32)
    assert exc.value.message == "the proof does not lead to the approved Merkle root"


def test_approval_counting_continues_past_uncounted_signatures_and_says_what_was_not_counted() -> None:
    batch = build_batch("b-9", _leaves(2), not_after_ms=int(NOW.timestamp() * 1000))
    good = {a.key_id: approve(k, a.key_id, batch.scope) for a, k in zip(APPROVERS, (K1, K2, K3), strict=True)}
    sigs = [
        ("mallory", b"\x00" * 64),
        ("alice", good["alice"].signature),
        ("alice", good["alice"].signature),
        ("bob", good["carol"].signature),
        ("carol", good["carol"].signature),
    ]
    # At the exact not_after instant the approval still holds.
    approved = verify_batch_approval(batch.scope, sigs, APPROVERS, 2, NOW)
    assert approved.approved_by == frozenset({"alice", "carol"}) and approved.not_after_ms == int(
        NOW.timestamp() * 1000
    )
    with pytest.raises(QuorumNotMet) as exc:
        verify_batch_approval(batch.scope, sigs, APPROVERS, 3, NOW)
    assert exc.value.message == (
        "batch 'b-9': 2 distinct approver key(s) signed, 3 required; not counted: unknown key id 'mallory', "
        "'alice' repeats the key of 'alice', 'bob': bad-signature"
    )
    with pytest.raises(QuorumNotMet) as exc:
        verify_batch_approval(batch.scope, [], APPROVERS, 1, NOW)
    assert exc.value.message == "batch 'b-9': 0 distinct approver key(s) signed, 1 required"
    with pytest.raises(ScopeExpired):
        verify_batch_approval(batch.scope, sigs, APPROVERS, 2, NOW + datetime.timedelta(milliseconds=1))
    assert verify_batch_approval(batch.scope, sigs[1:2], APPROVERS, 1, NOW).approved_by == frozenset(
        {"alice"}
    )
    with pytest.raises(ValueError, match=r"^a quorum needs at least one approval$"):
        verify_batch_approval(batch.scope, sigs, APPROVERS, 0, NOW)
    with pytest.raises(ValueError, match=r"^now must be timezone-aware$"):
        verify_batch_approval(batch.scope, sigs, APPROVERS, 1, NOW.replace(tzinfo=None))


def test_scope_proof_leaf_must_decode() -> None:
    leaves = [b"\xff", b"\x0a\x01x"]
    approved = verify_batch_approval(
        bytes(BatchScope(batch_id="raw", merkle_root=merkle_root(leaves), leaf_count=2)),
        [
            (
                "alice",
                K1.sign(
                    Purpose.BATCH_APPROVAL,
                    bytes(BatchScope(batch_id="raw", merkle_root=merkle_root(leaves), leaf_count=2)),
                ),
            )
        ],
        APPROVERS,
        1,
        NOW,
    )
    with pytest.raises(MalformedQuorumInput) as exc:
        verify_scope_proof(
            approved,
            leaves[0],
            0,
            inclusion_path(leaves, 0),
            command_id="c",
            subject="s",
            kind="k",
            payload_sha256=b"",
        )
    assert exc.value.message.startswith("batch leaf: ")


def test_admit_without_quorum_keys_is_a_programming_error_named() -> None:

    with pytest.raises(
        ValueError, match=r"^the trust bundle has no approver keys; the quorum does not apply$"
    ):
        admit_batched_command(
            BatchApproval(),
            BatchProof(),
            TrustBundle(version=1),
            NOW,
            batch_id="b",
            command_id="c",
            subject="s",
            kind="k",
            payload=b"",
        )


def test_verify_signature_purpose_tag_is_the_ascii_purpose() -> None:
    key = KeyPair(b"\x71" * 32)
    sig = key.sign(Purpose.COMMAND, b"data")
    import nacl.signing

    nacl.signing.VerifyKey(key.public_key).verify(b"bcd-sig-v1/command\x00data", sig)
    verify_signature(key.public_key, Purpose.COMMAND, b"data", sig)


def test_mixed_case_pin_is_refused_as_not_lowercase() -> None:
    with pytest.raises(BadPin) as exc:
        check_root_pin("aB" * 32)
    assert exc.value.message.endswith("must be lowercase hex")


def test_public_key_of_a_certificate_is_its_raw_key() -> None:
    h = shared_hierarchy()
    assert public_key_of(h.root) == h.root_key.public_key


def test_verifiers_use_the_cache_they_are_given() -> None:
    h = shared_hierarchy()
    worker = h.leaf(Role.WORKER)
    cache = ChainCache()
    for verify, purpose in ((verify_desired_state, Purpose.DESIRED_STATE), (verify_command, Purpose.COMMAND)):
        sig = worker.key.sign(purpose, b"body")
        verify(b"body", sig, list(worker.chain), h.roots, NOW, cache)
        verify(b"body", sig, list(worker.chain), h.roots, NOW, cache)
    assert (cache.misses, cache.hits) == (2, 2)


def test_verify_signed_checks_the_chain_for_the_chain_purpose() -> None:
    """A release signature (no certificate role signs it) verified with a worker chain checked as `command`:
    the chain's role is taken from chain_purpose, the signature's tag from purpose."""
    h = shared_hierarchy()
    worker = h.leaf(Role.WORKER)
    sig = worker.key.sign(Purpose.DAEMON_RELEASE, b"manifest")
    signer = verify_signed(
        Purpose.DAEMON_RELEASE,
        b"manifest",
        sig,
        list(worker.chain),
        h.roots,
        NOW,
        chain_purpose=Purpose.COMMAND,
    )
    assert signer.role is Role.WORKER
    with pytest.raises(WrongRole):
        verify_signed(Purpose.DAEMON_RELEASE, b"manifest", sig, list(worker.chain), h.roots, NOW)


def test_random_serials_are_positive_63_bit() -> None:
    key = KeyPair(b"\x45" * 32)
    for _ in range(24):
        serial = x509.load_der_x509_certificate(issue_root(key, "r", NOW, NOW + DAY)).serial_number
        assert 1 <= serial <= 1 << 63


def test_a_non_ca_certificate_carries_no_path_length() -> None:
    key = KeyPair(b"\x46" * 32)
    der = issue_certificate(
        subject_public_key=key.public_key,
        common_name="leafish",
        issuer_key=key,
        issuer_der=None,
        not_before=NOW,
        not_after=NOW + DAY,
        ca=False,
        path_length=2,
    )
    bc = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(x509.BasicConstraints)
    assert (bc.value.ca, bc.value.path_length) == (False, None)


def test_a_certificate_with_a_duplicated_extension_is_refused_by_name() -> None:
    """The DER of a real certificate whose AuthorityKeyIdentifier OID is rewritten to the
    SubjectKeyIdentifier's (same length): two extensions with one OID, which X.509 forbids."""
    der = shared_hierarchy().intermediate
    aki, ski = b"\x06\x03\x55\x1d\x23", b"\x06\x03\x55\x1d\x0e"
    assert der.count(aki) == 1
    with pytest.raises(MalformedCertificate) as exc:
        parse_certificate(der.replace(aki, ski))
    assert exc.value.message.startswith("'command-signing CA': bad extensions (")


def test_the_leaf_limit_of_a_tree_is_inclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    from bcd_shared.pki import quorum

    monkeypatch.setattr(quorum, "MAX_LEAVES", 4)
    assert merkle_root([b"a", b"b", b"c", b"d"]) == merkle_root([b"a", b"b", b"c", b"d"])
    with pytest.raises(MalformedQuorumInput) as exc:
        merkle_root([b"a", b"b", b"c", b"d", b"e"])
    assert exc.value.message == "a batch has 1 to 4 leaves, got 5"
