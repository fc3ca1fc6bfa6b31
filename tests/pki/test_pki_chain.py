"""Chain verification to the command-signing roots: every refusal, by table, and the cache.

Covers DLV-SIG-01 (a worker key chaining to the command-signing roots), DLV-SIG-05 (unknown-key or invalid
signatures refused), DLV-SIG-13/15 (desired state verified the same way), HST-SIGN-06 (pinned roots decide),
HST-SIGN-18 (a worker-role certificate that chains to those roots, for a desired state).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import pytest
from bcd_shared.pki import (
    BadCertificateSignature,
    BadSignature,
    CertificateExpired,
    CertificateNotYetValid,
    ChainCache,
    ChainTooLong,
    KeyPair,
    KeyUsageNotAllowed,
    LeafIsCA,
    MalformedCertificate,
    NotACA,
    NotIssuedBy,
    PathLengthExceeded,
    PkiError,
    Purpose,
    Role,
    Roots,
    TruncatedSignature,
    UnknownRoot,
    UnpinnedRoot,
    WrongPurpose,
    WrongRole,
    issue_certificate,
    issue_intermediate,
    issue_leaf,
    issue_node_certificate,
    issue_root,
    parse_certificate,
    root_pin,
    verify_chain,
    verify_command,
    verify_desired_state,
)
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from pkifixture import DAY, HOUR, NOW, Hierarchy, Signer, shared_hierarchy, shared_node, shared_worker


@pytest.fixture(name="hierarchy")
def _hierarchy_fixture() -> Hierarchy:
    return shared_hierarchy()


@pytest.fixture(name="worker")
def _worker_fixture() -> Signer:
    return shared_worker()


@pytest.fixture(name="node_signer")
def _node_signer_fixture() -> Signer:
    return shared_node()


BODY = b"command body bytes \x00\x01\x02"


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


def _flip_in(der: bytes, needle: bytes) -> bytes:
    index = der.index(needle)
    return _flip(der, index)


def test_DLV_SIG_01_worker_chain_verifies_command(hierarchy: Hierarchy, worker: Signer) -> None:
    sig = worker.key.sign(Purpose.COMMAND, BODY)
    signer = verify_command(BODY, sig, worker.chain, hierarchy.roots, NOW)
    assert signer.role is Role.WORKER
    assert signer.name == "worker-1"
    assert signer.public_key == worker.key.public_key
    assert signer.root_pin == root_pin(hierarchy.root)
    assert signer.valid_until == NOW + 4 * HOUR  # the leaf is the shortest-lived
    # The chain may also carry the root itself at its end.
    verify_command(BODY, sig, (*worker.chain, hierarchy.root), hierarchy.roots, NOW)


def test_HST_SIGN_18_desired_state_needs_worker_role(
    hierarchy: Hierarchy, worker: Signer, node_signer: Signer
) -> None:
    sig = worker.key.sign(Purpose.DESIRED_STATE, BODY)
    assert verify_desired_state(BODY, sig, worker.chain, hierarchy.roots, NOW).role is Role.WORKER
    node_sig = node_signer.key.sign(Purpose.DESIRED_STATE, BODY)
    with pytest.raises(WrongRole, match="role 'node'; purpose 'desired-state' needs role 'worker'"):
        verify_desired_state(BODY, node_sig, node_signer.chain, hierarchy.roots, NOW)


def test_leaf_issued_directly_by_root(hierarchy: Hierarchy) -> None:
    key = KeyPair.generate()
    leaf = issue_leaf(
        hierarchy.root, hierarchy.root_key, key.public_key, Role.NODE, "node-7", NOW - DAY, NOW + DAY
    )
    signer = verify_chain([leaf], hierarchy.roots, Purpose.ATTESTED_REPORT, NOW)
    assert (signer.role, signer.name) == (Role.NODE, "node-7")


def test_node_certificate_csr_less(hierarchy: Hierarchy) -> None:
    node_key = KeyPair.generate()
    der = issue_node_certificate(
        hierarchy.intermediate, hierarchy.ca_key, node_key.public_key, "node-42", NOW, NOW + 30 * DAY
    )
    info = parse_certificate(der)
    assert (info.role, info.name, info.public_key) == (Role.NODE, "node-42", node_key.public_key)
    verify_chain([der, hierarchy.intermediate], hierarchy.roots, Purpose.COMMAND_RESULT, NOW)


# --- the refusal table ----------------------------------------------------------------------------

Case = Callable[[Hierarchy, Signer], tuple[list[bytes], Roots, Purpose]]


def _wrong_role(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return list(h.leaf(Role.APPROVER).chain), h.roots, Purpose.COMMAND


def _odd_leaf(h: Hierarchy, common_name: str, **flags: Any) -> tuple[list[bytes], Roots, Purpose]:
    """A leaf that h's intermediate issued with these flags (valid from a day before NOW to a day after)."""
    leaf = issue_certificate(
        subject_public_key=KeyPair.generate().public_key,
        common_name=common_name,
        issuer_key=h.ca_key,
        issuer_der=h.intermediate,
        not_before=NOW - DAY,
        not_after=NOW + DAY,
        **flags,
    )
    return [leaf, h.intermediate], h.roots, Purpose.COMMAND


def _no_role(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return _odd_leaf(h, "plain", ca=False, digital_signature=True)


def _expired_leaf(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return (
        list(h.leaf(Role.WORKER, not_before=NOW - DAY, not_after=NOW - HOUR).chain),
        h.roots,
        Purpose.COMMAND,
    )


def _not_yet_valid_leaf(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return (
        list(h.leaf(Role.WORKER, not_before=NOW + HOUR, not_after=NOW + DAY).chain),
        h.roots,
        Purpose.COMMAND,
    )


def _expired_intermediate(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    ca_key = KeyPair.generate()
    inter = issue_intermediate(h.root, h.root_key, ca_key.public_key, "old CA", NOW - 30 * DAY, NOW - DAY)
    leaf = issue_leaf(inter, ca_key, KeyPair.generate().public_key, Role.WORKER, "w", NOW - HOUR, NOW + HOUR)
    return [leaf, inter], h.roots, Purpose.COMMAND


def _expired_root(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    root_key = KeyPair.generate()
    root = issue_root(root_key, "short root", NOW - 10 * DAY, NOW - DAY)
    leaf = issue_leaf(root, root_key, KeyPair.generate().public_key, Role.WORKER, "w", NOW - HOUR, NOW + HOUR)
    return [leaf], Roots.from_ders([root]), Purpose.COMMAND


def _unknown_root(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    other = Hierarchy.build("other")
    return list(other.leaf(Role.WORKER).chain), h.roots, Purpose.COMMAND


def _no_roots(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return list(w.chain), Roots(()), Purpose.COMMAND


def _same_name_other_root(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    impostor = Hierarchy.build("command-signing")  # same names, other keys
    return list(impostor.leaf(Role.WORKER).chain), h.roots, Purpose.COMMAND


def _byte_in_leaf_name(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [_flip_in(w.chain[0], b"worker-1"), w.chain[1]], h.roots, Purpose.COMMAND


def _byte_in_leaf_signature(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    leaf = w.chain[0]
    return [_flip(leaf, len(leaf) - 5), w.chain[1]], h.roots, Purpose.COMMAND


def _byte_in_leaf_key(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [_flip_in(w.chain[0], w.key.public_key), w.chain[1]], h.roots, Purpose.COMMAND


def _byte_in_der_structure(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [_flip(w.chain[0], 1), w.chain[1]], h.roots, Purpose.COMMAND


def _trailing_byte(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [w.chain[0] + b"\x00", w.chain[1]], h.roots, Purpose.COMMAND


def _path_length(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    root_key, k1, k2 = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    root = issue_root(root_key, "r0", NOW - DAY, NOW + DAY, path_length=0)
    i1 = issue_intermediate(root, root_key, k1.public_key, "i1", NOW - DAY, NOW + DAY, path_length=None)
    leaf = issue_leaf(i1, k1, k2.public_key, Role.WORKER, "w", NOW - DAY, NOW + DAY)
    return [leaf, i1], Roots.from_ders([root]), Purpose.COMMAND


def _path_length_intermediate(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    k1, k2, k3 = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    # h's intermediate has path length 0, so it may not issue another CA that issues the leaf.
    i2 = issue_intermediate(
        h.intermediate, h.ca_key, k1.public_key, "i2", NOW - DAY, NOW + DAY, path_length=None
    )
    leaf = issue_leaf(i2, k1, k3.public_key, Role.WORKER, "w", NOW - DAY, NOW + DAY)
    del k2
    return [leaf, i2, h.intermediate], h.roots, Purpose.COMMAND


def _under_odd_intermediate(
    h: Hierarchy,
    common_name: str,
    *,
    ca: bool | None,
    key_cert_sign: bool = False,
    digital_signature: bool = False,
) -> tuple[list[bytes], Roots, Purpose]:
    """A worker leaf under an intermediate that h's root issued with these CA flags."""
    k1 = KeyPair.generate()
    inter = issue_certificate(
        subject_public_key=k1.public_key,
        common_name=common_name,
        issuer_key=h.root_key,
        issuer_der=h.root,
        not_before=NOW - DAY,
        not_after=NOW + DAY,
        ca=ca,
        key_cert_sign=key_cert_sign,
        digital_signature=digital_signature,
    )
    leaf = issue_leaf(inter, k1, KeyPair.generate().public_key, Role.WORKER, "w", NOW - DAY, NOW + DAY)
    return [leaf, inter], h.roots, Purpose.COMMAND


def _intermediate_not_ca(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return _under_odd_intermediate(h, "not a ca", ca=False, key_cert_sign=True)


def _intermediate_without_constraints(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return _under_odd_intermediate(h, "no constraints", ca=None, key_cert_sign=True)


def _intermediate_without_cert_sign(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return _under_odd_intermediate(h, "no certsign", ca=True, digital_signature=True)


def _leaf_is_ca(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return _odd_leaf(
        h, "ca leaf", ca=True, path_length=0, key_cert_sign=True, digital_signature=True, role=Role.WORKER
    )


def _leaf_without_digital_signature(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return _odd_leaf(h, "no ds", ca=False, role=Role.WORKER)


def _root_alone(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [h.root], h.roots, Purpose.COMMAND


def _reversed_chain(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [w.chain[1], w.chain[0]], h.roots, Purpose.COMMAND


def _missing_intermediate(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [w.chain[0]], h.roots, Purpose.COMMAND


def _wrong_parent(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    leaf = issue_leaf(
        h.root, h.root_key, KeyPair.generate().public_key, Role.WORKER, "w", NOW - DAY, NOW + DAY
    )
    return [leaf, h.intermediate], h.roots, Purpose.COMMAND


def _empty_chain(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [], h.roots, Purpose.COMMAND


def _too_long(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    return [w.chain[0]] + [w.chain[1]] * 8, h.roots, Purpose.COMMAND


def _unknown_critical_extension(h: Hierarchy, w: Signer) -> tuple[list[bytes], Roots, Purpose]:
    ca = parse_certificate(h.intermediate).cert
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "ext")]))
        .issuer_name(ca.subject)
        .public_key(ed25519.Ed25519PrivateKey.generate().public_key())
        .serial_number(5)
        .not_valid_before(NOW - DAY)
        .not_valid_after(NOW + DAY)
        .add_extension(
            x509.UnrecognizedExtension(x509.ObjectIdentifier("1.2.3.4"), b"\x05\x00"), critical=True
        )
        .sign(ed25519.Ed25519PrivateKey.from_private_bytes(h.ca_key.seed), None)
    )
    return [cert.public_bytes(serialization.Encoding.DER), h.intermediate], h.roots, Purpose.COMMAND


CASES: list[tuple[str, Case, type[PkiError], str]] = [
    ("wrong role", _wrong_role, WrongRole, "role 'approver'; purpose 'command' needs role 'worker'"),
    ("no role", _no_role, WrongRole, "no bcd role"),
    ("expired leaf", _expired_leaf, CertificateExpired, "'worker-1' expired at"),
    ("not-yet-valid leaf", _not_yet_valid_leaf, CertificateNotYetValid, "'worker-1' is valid from"),
    ("expired intermediate", _expired_intermediate, CertificateExpired, "'old CA' expired"),
    ("expired root", _expired_root, CertificateExpired, "'short root' expired"),
    ("unknown root", _unknown_root, UnknownRoot, "no trusted root issued"),
    ("no roots at all", _no_roots, UnknownRoot, "no command-signing roots"),
    ("same names, other keys", _same_name_other_root, UnknownRoot, "no trusted root issued"),
    ("byte changed in leaf name", _byte_in_leaf_name, BadCertificateSignature, "does not verify"),
    ("byte changed in leaf signature", _byte_in_leaf_signature, BadCertificateSignature, "does not verify"),
    ("byte changed in leaf key", _byte_in_leaf_key, BadCertificateSignature, "does not verify"),
    ("byte changed in DER structure", _byte_in_der_structure, MalformedCertificate, "not a DER"),
    ("trailing byte after certificate", _trailing_byte, MalformedCertificate, "not a DER"),
    ("root path length exceeded", _path_length, PathLengthExceeded, "'r0' allows 0"),
    ("intermediate path length exceeded", _path_length_intermediate, PathLengthExceeded, "CA' allows 0"),
    ("intermediate is not a CA", _intermediate_not_ca, NotACA, "'not a ca' issues certificates"),
    ("intermediate lacks BasicConstraints", _intermediate_without_constraints, NotACA, "'no constraints'"),
    ("CA lacks keyCertSign", _intermediate_without_cert_sign, KeyUsageNotAllowed, "keyCertSign"),
    ("leaf is a CA", _leaf_is_ca, LeafIsCA, "'ca leaf' is a CA"),
    ("leaf lacks digitalSignature", _leaf_without_digital_signature, KeyUsageNotAllowed, "digitalSignature"),
    ("root alone", _root_alone, LeafIsCA, "is a root"),
    ("chain in reverse order", _reversed_chain, UnknownRoot, "no trusted root issued"),
    ("intermediate missing", _missing_intermediate, UnknownRoot, "no trusted root issued"),
    ("issued by another parent", _wrong_parent, NotIssuedBy, "is not issued by"),
    ("empty chain", _empty_chain, ChainTooLong, "0 certificates"),
    ("chain too long", _too_long, ChainTooLong, "9 certificates"),
    (
        "unknown critical extension",
        _unknown_critical_extension,
        MalformedCertificate,
        "critical extension 1.2.3.4",
    ),
]


@pytest.mark.parametrize(("case", "build", "error", "text"), CASES, ids=[c[0] for c in CASES])
def test_DLV_SIG_05_chain_refusals(
    case: str, build: Case, error: type[PkiError], text: str, hierarchy: Hierarchy, worker: Signer
) -> None:
    """Covers DLV-SIG-05: an unknown-key or invalid signer chain is refused, naming the rule."""
    chain, roots, purpose = build(hierarchy, worker)
    with pytest.raises(error) as info:
        verify_chain(chain, roots, purpose, NOW)
    assert text in str(info.value)
    assert str(info.value).startswith(info.value.rule + ": ")


def test_byte_changed_in_intermediate_is_a_bad_signature(hierarchy: Hierarchy, worker: Signer) -> None:
    chain = [worker.chain[0], _flip_in(worker.chain[1], b"command-signing CA")]
    # The flipped CN no longer matches the leaf's issuer name, or the signature breaks: either names the rule.
    with pytest.raises((NotIssuedBy, BadCertificateSignature, UnknownRoot)):
        verify_chain(chain, hierarchy.roots, Purpose.COMMAND, NOW)


def test_validity_bounds_are_inclusive(hierarchy: Hierarchy) -> None:
    signer = hierarchy.leaf(Role.WORKER, not_before=NOW, not_after=NOW + HOUR)
    verify_chain(signer.chain, hierarchy.roots, Purpose.COMMAND, NOW)
    verify_chain(signer.chain, hierarchy.roots, Purpose.COMMAND, NOW + HOUR)
    with pytest.raises(CertificateExpired):
        verify_chain(
            signer.chain, hierarchy.roots, Purpose.COMMAND, NOW + HOUR + datetime.timedelta(seconds=1)
        )
    with pytest.raises(CertificateNotYetValid):
        verify_chain(signer.chain, hierarchy.roots, Purpose.COMMAND, NOW - datetime.timedelta(seconds=1))


def test_naive_time_is_refused(hierarchy: Hierarchy, worker: Signer) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        verify_chain(worker.chain, hierarchy.roots, Purpose.COMMAND, NOW.replace(tzinfo=None))


# --- signatures over the body, through the chain --------------------------------------------------

SIG_CASES = [
    ("one byte changed in body", lambda b, s: (_flip(b, 0), s), BadSignature),
    ("one byte changed in signature", lambda b, s: (b, _flip(s, 0)), BadSignature),
    ("truncated signature", lambda b, s: (b, s[:-1]), TruncatedSignature),
]


@pytest.mark.parametrize(("case", "mutate", "error"), SIG_CASES, ids=[c[0] for c in SIG_CASES])
def test_DLV_SIG_05_command_signature_refusals(
    case: str,
    mutate: Callable[[bytes, bytes], tuple[bytes, bytes]],
    error: type[PkiError],
    hierarchy: Hierarchy,
    worker: Signer,
) -> None:
    body, sig = mutate(BODY, worker.key.sign(Purpose.COMMAND, BODY))
    with pytest.raises(error):
        verify_command(body, sig, worker.chain, hierarchy.roots, NOW)


def test_DLV_SIG_05_signature_of_another_key_with_a_valid_chain(hierarchy: Hierarchy, worker: Signer) -> None:
    sig = KeyPair.generate().sign(Purpose.COMMAND, BODY)
    with pytest.raises(BadSignature):
        verify_command(BODY, sig, worker.chain, hierarchy.roots, NOW)


def test_DLV_SIG_13_spec_signature_is_not_a_command_signature(hierarchy: Hierarchy, worker: Signer) -> None:
    sig = worker.key.sign(Purpose.DESIRED_STATE, BODY)
    with pytest.raises(WrongPurpose):
        verify_command(BODY, sig, worker.chain, hierarchy.roots, NOW)


# --- pinned roots (the helper's command_root_sha256) ----------------------------------------------


def test_HST_SIGN_06_pinned_roots_decide(hierarchy: Hierarchy, worker: Signer) -> None:
    roots = Roots.pinned([hierarchy.root], [root_pin(hierarchy.root)])
    sig = worker.key.sign(Purpose.DESIRED_STATE, BODY)
    verify_desired_state(BODY, sig, worker.chain, roots, NOW)
    other = Hierarchy.build("other")
    with pytest.raises(UnpinnedRoot, match="is not pinned"):
        Roots.pinned([hierarchy.root, other.root], [root_pin(hierarchy.root)])


# --- the cache ------------------------------------------------------------------------------------


def test_cache_answers_like_verify_chain(hierarchy: Hierarchy) -> None:
    cache = ChainCache(max_entries=2)
    signer = hierarchy.leaf(Role.WORKER, not_before=NOW - HOUR, not_after=NOW + HOUR)
    first = cache.verify(signer.chain, hierarchy.roots, Purpose.COMMAND, NOW)
    assert cache.verify(signer.chain, hierarchy.roots, Purpose.COMMAND, NOW + HOUR) == first
    assert (cache.hits, cache.misses) == (1, 1)
    # Outside the window the cache re-verifies, and the refusal is the same as without it.
    with pytest.raises(CertificateExpired):
        cache.verify(signer.chain, hierarchy.roots, Purpose.COMMAND, NOW + 2 * HOUR)
    # Another purpose is another key: the role check runs again.
    with pytest.raises(WrongRole):
        cache.verify(signer.chain, hierarchy.roots, Purpose.ATTESTED_REPORT, NOW)
    # Other roots: another key too.
    with pytest.raises(UnknownRoot):
        cache.verify(signer.chain, Hierarchy.build("x").roots, Purpose.COMMAND, NOW)
    # Bounded.
    for _ in range(3):
        cache.verify(hierarchy.leaf(Role.WORKER).chain, hierarchy.roots, Purpose.COMMAND, NOW)
    assert len(cache._entries) == 2


def test_cache_through_verify_command(hierarchy: Hierarchy, worker: Signer) -> None:
    cache = ChainCache()
    sig = worker.key.sign(Purpose.COMMAND, BODY)
    for _ in range(3):
        verify_command(BODY, sig, worker.chain, hierarchy.roots, NOW, cache)
    assert (cache.hits, cache.misses) == (2, 1)
    with pytest.raises(BadSignature):  # a cached chain never skips the signature check
        verify_command(BODY + b"!", sig, worker.chain, hierarchy.roots, NOW, cache)
