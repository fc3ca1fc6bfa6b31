"""Root's signed-intent checks (bcd_helper.intent) called in process, each refusal's reason and message
checked word for word, and the state each accepted request leaves.

test_signed_intent*.py drive the same rules through a real `bcd helper serve` (which mutation testing
cannot see into); these call `IntentVerifier` directly over a temporary root, so they are fast and each
rule's edge is checked here (docs/mutation.md)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.config import parse_config
from bcd_helper.intent import (
    MAX_CACHED_BUNDLES,
    MAX_STATE,
    MAX_VERIFIED,
    STATE_PATH,
    IntentState,
    IntentVerifier,
    Verified,
)
from bcd_helper.ops.base import Failed, Refused
from bcd_helper.ops.hostunit import SignedIntent
from bcd_shared import wire
from bcd_shared.joinrecord import JOIN_RECORD
from bcd_shared.pki import KeyPair, Purpose, root_pin
from bcd_shared.rootpath import write_root_only
from intentkit import HOUR, ControlPlane, Signer, b64, host_body, intent, settings

NODE = "node-a"
UNIT = "sysctl"
S1 = settings(values={"vm.swappiness": "10"})
S2 = settings(values={"vm.swappiness": "20"})


def verifier(root: Path, top: str = "") -> IntentVerifier:
    text = top + '[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = 4242\nnode_gid = 4242\n'
    return IntentVerifier(root, parse_config(text.encode()))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "host"
    r.mkdir(mode=0o755)
    return r


def signed(signer: Signer, body: bytes, **kw: Any) -> SignedIntent:
    doc = intent(signer, body, **kw)
    return SignedIntent(doc["body"], doc["signature"], tuple(doc["chain"]), doc["trust_bundle"])


def refusal(call: Any, *args: Any, **kw: Any) -> tuple[str, str]:
    with pytest.raises(Refused) as info:
        call(*args, **kw)
    return info.value.reason, info.value.message


def state_on_disk(root: Path) -> IntentState:
    return IntentState.decode((root / STATE_PATH.lstrip("/")).read_bytes())


def record(cp: ControlPlane, root: Path, node: str = NODE, bundle_version: int | None = 1) -> None:
    cp.write_record(root, node, None if bundle_version is None else cp.bundle(bundle_version))


# --- the state file's codec -----------------------------------------------------------------------------


STATE = IntentState(
    record_sha256="ab" * 32,
    node_id=NODE,
    node_source="record",
    generation=7,
    bundle_version=2,
    bundle_sha256="cd" * 32,
    signed=True,
    verified=(Verified("ef" * 32, 7, 1_700_000_000_123),),
)


def test_the_state_is_sorted_indented_json_with_its_format() -> None:
    doc = {
        "bundle_sha256": "cd" * 32,
        "bundle_version": 2,
        "format": 1,
        "generation": 7,
        "node_id": NODE,
        "node_source": "record",
        "record_sha256": "ab" * 32,
        "signed": True,
        "verified": [{"generation": 7, "sha256": "ef" * 32, "verified_at_ms": 1_700_000_000_123}],
    }
    assert STATE.encode() == (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()
    assert IntentState.decode(STATE.encode()) == STATE
    assert IntentState.decode(IntentState().encode()) == IntentState()


def _doc(**changes: Any) -> bytes:
    doc = json.loads(STATE.encode())
    doc.update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"[]", "not a JSON object"),
        (_doc(format=2), "format 2 is not 1"),
        (_doc(format="1"), "format '1' is not 1"),
        (_doc(record_sha256=1), "record_sha256: expected str"),
        (_doc(node_id=None), "node_id: expected str"),
        (_doc(node_source=[]), "node_source: expected str"),
        (_doc(generation=True), "generation: expected int"),
        (_doc(generation="7"), "generation: expected int"),
        (_doc(bundle_version=1.0), "bundle_version: expected int"),
        (_doc(bundle_sha256=0), "bundle_sha256: expected str"),
        (_doc(signed=1), "signed: expected bool"),
        (_doc(verified={}), "verified: expected list"),
        (_doc(verified=[1]), "verified[0]: expected {sha256, generation, verified_at_ms}"),
        (
            _doc(verified=[{"sha256": "a", "generation": 1, "verified_at_ms": 2, "x": 0}]),
            "verified[0]: expected {sha256, generation, verified_at_ms}",
        ),
        (
            _doc(verified=[{"sha256": "a", "generation": 1}]),
            "verified[0]: expected {sha256, generation, verified_at_ms}",
        ),
        (
            _doc(
                verified=[
                    {"sha256": "a", "generation": 1, "verified_at_ms": 2},
                    {"sha256": 1, "generation": 1, "verified_at_ms": 2},
                ]
            ),
            "verified[1]: expected {sha256, generation, verified_at_ms}",
        ),
        (
            _doc(verified=[{"sha256": "a", "generation": "1", "verified_at_ms": 2}]),
            "verified[0]: expected {sha256, generation, verified_at_ms}",
        ),
        (
            _doc(verified=[{"sha256": "a", "generation": 1, "verified_at_ms": 2.5}]),
            "verified[0]: expected {sha256, generation, verified_at_ms}",
        ),
    ],
)
def test_a_state_outside_its_shape_is_refused_naming_the_field(data: bytes, message: str) -> None:
    with pytest.raises(ValueError) as info:
        IntentState.decode(data)
    assert str(info.value) == message


def test_a_state_with_other_keys_names_both_sets() -> None:
    doc = json.loads(STATE.encode())
    del doc["signed"]
    doc["extra"] = 1
    want = sorted([*(k for k in doc if k != "extra"), "signed"])
    with pytest.raises(ValueError) as info:
        IntentState.decode(json.dumps(doc).encode())
    assert str(info.value) == f"keys {sorted(doc)} are not {want}"


# --- root's files ---------------------------------------------------------------------------------------


def test_no_state_file_is_the_empty_state_and_a_bad_one_fails_naming_it(root: Path) -> None:
    v = verifier(root)
    assert v.load_state("host.unit") == IntentState()
    write_root_only(root, STATE_PATH, b'{"format": 1}', 0o600)
    with pytest.raises(Failed) as info:
        v.load_state("host.unit")
    assert info.value.reason == "intent-state"
    assert info.value.message.startswith(f"host.unit: {STATE_PATH} cannot be read: keys ['format'] are not [")
    write_root_only(root, STATE_PATH, b"x" * (MAX_STATE + 1), 0o600)
    with pytest.raises(Failed) as info:
        v.load_state("access.apply")
    assert (info.value.reason, info.value.message) == (
        "intent-state",
        f"access.apply: {STATE_PATH}: {STATE_PATH} is larger than {MAX_STATE} bytes",
    )
    write_root_only(root, STATE_PATH, STATE.encode(), 0o600)
    assert v.load_state("x") == STATE


def test_a_state_file_at_the_size_limit_is_read(root: Path) -> None:
    data = STATE.encode()
    write_root_only(root, STATE_PATH, data[:-1] + b" " * (MAX_STATE - len(data)) + b"\n", 0o600)
    assert verifier(root).load_state("x") == STATE


def test_the_state_is_written_0600_and_never_moves_the_generation_back(root: Path) -> None:
    v = verifier(root)
    v.save_state(STATE)
    path = root / STATE_PATH.lstrip("/")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert path.read_bytes() == STATE.encode()
    older = IntentState(record_sha256=STATE.record_sha256, node_id="other", generation=6)
    v.save_state(older)
    assert state_on_disk(root) == STATE  # the newer accepted generation wins
    same = IntentState(record_sha256=STATE.record_sha256, node_id="same-generation", generation=7)
    v.save_state(same)
    assert state_on_disk(root) == same
    rejoined = IntentState(record_sha256="11" * 32, node_id="rejoined", generation=1)
    v.save_state(rejoined)  # a new record starts the generations over
    assert state_on_disk(root) == rejoined


# --- the join record and presented bundles ---------------------------------------------------------------


def test_no_record_is_none_and_a_record_without_a_pin_is_unverifiable(root: Path, cp: ControlPlane) -> None:
    assert verifier(root).join_record("host.unit") is None
    record(cp, root)
    assert refusal(verifier(root).join_record, "host.unit") == (
        "intent-unverifiable",
        f"host.unit: root's join record {JOIN_RECORD} cannot be verified: "
        "root's config.toml has no join_signing_key_pin",
    )


def test_a_record_the_pinned_key_did_not_sign_is_refused(root: Path, cp: ControlPlane) -> None:
    other = ControlPlane.build()
    write_root_only(root, JOIN_RECORD, other.join_response(NODE, other.bundle(1)), 0o600)
    reason, message = refusal(verifier(root, cp.config_lines()).join_record, "gpu.reset")
    assert reason == "join-record"
    assert message.startswith(f"gpu.reset: root's join record {JOIN_RECORD} is refused (")
    assert message.endswith("): no host change is applied")


def test_a_record_is_verified_once_per_content(root: Path, cp: ControlPlane) -> None:
    record(cp, root)
    v = verifier(root, cp.config_lines())
    first = v.join_record("x")
    assert first is not None and first.node_id == NODE
    assert v.join_record("x") is first
    record(cp, root, "node-b")
    second = v.join_record("x")
    assert second is not None and second.node_id == "node-b"


def test_a_record_root_cannot_trust_is_refused(root: Path, cp: ControlPlane) -> None:
    record(cp, root)
    path = root / JOIN_RECORD.lstrip("/")
    path.rename(path.with_name("elsewhere"))
    path.symlink_to("elsewhere")
    assert refusal(verifier(root, cp.config_lines()).join_record, "x") == (
        "join-record",
        f"x: root's join record {JOIN_RECORD}: {JOIN_RECORD} is not a regular file: "
        "bcd will not write as root through it",
    )


def test_a_presented_bundle_is_verified_against_the_pin(root: Path, cp: ControlPlane) -> None:
    bad = cp.bundle(1, key=KeyPair.generate())
    reason, message = refusal(verifier(root, cp.config_lines()).trust, "host.unit", bad, ())
    assert reason == "untrusted-bundle"
    assert message.startswith("host.unit: the presented trust bundle is refused: ")
    assert refusal(verifier(root).trust, "host.unit", cp.bundle(1), ()) == (
        "intent-unverifiable",
        "host.unit: the presented trust bundle cannot be verified: "
        "root's config.toml has no join_signing_key_pin",
    )


def test_verified_bundles_are_cached_up_to_the_bound(root: Path, cp: ControlPlane) -> None:
    v = verifier(root, cp.config_lines())
    bundles = [cp.bundle(n) for n in range(1, MAX_CACHED_BUNDLES + 2)]
    for b in bundles[:MAX_CACHED_BUNDLES]:
        v._bundle(b, "x")
    first = hashlib.sha256(bundles[0]).hexdigest()
    assert len(v._bundles) == MAX_CACHED_BUNDLES and first in v._bundles
    cached = v._bundles[first]
    assert v._bundle(bundles[0], "x") is cached
    v._bundle(bundles[-1], "x")
    assert len(v._bundles) == MAX_CACHED_BUNDLES
    assert first not in v._bundles  # the oldest goes first
    assert hashlib.sha256(bundles[-1]).hexdigest() in v._bundles


# --- where the roots come from --------------------------------------------------------------------------


def test_nothing_names_roots_nothing_is_checked(root: Path) -> None:
    view = verifier(root).trust("host.unit", None, ())
    assert (view.roots, view.state, view.source) == (None, IntentState(), "none")


def test_a_pin_without_a_record_refuses_a_request_without_roots(root: Path, cp: ControlPlane) -> None:
    assert refusal(verifier(root, cp.config_lines()).trust, "host.unit", None, ()) == (
        "join-record-required",
        "host.unit: root's config.toml pins the JoinService key (join_signing_key_pin) but root's join "
        f"record {JOIN_RECORD} does not exist yet: nothing is applied until `bcd join` writes it",
    )


def test_the_record_binds_the_node_and_its_bundle_gives_the_roots(root: Path, cp: ControlPlane) -> None:
    record(cp, root, bundle_version=3)
    v = verifier(root, cp.config_lines())
    view = v.trust("host.unit", None, ())
    verified = v.join_record("x")
    assert verified is not None and verified.trust_bundle is not None
    assert view.source == "join record"
    assert view.roots is not None and view.roots.pins == {root_pin(cp.command.root)}
    assert view.state == IntentState(
        record_sha256=hashlib.sha256(verified.body_bytes).hexdigest(),
        node_id=NODE,
        node_source="record",
        bundle_version=3,
        bundle_sha256=verified.trust_bundle.sha256,
        signed=True,
    )


def test_a_record_without_a_bundle_binds_the_node_and_names_no_roots(root: Path, cp: ControlPlane) -> None:
    record(cp, root, bundle_version=None)
    v = verifier(root, cp.config_lines())
    view = v.trust("host.unit", None, ())
    assert view.roots is None and view.source == "none"
    assert (view.state.node_id, view.state.node_source, view.state.bundle_version) == (NODE, "record", 0)
    assert (view.state.bundle_sha256, view.state.signed) == ("", False)
    assert view.state.record_sha256 != ""


def test_a_record_with_a_rootless_bundle_is_not_signed(root: Path, cp: ControlPlane) -> None:
    cp.write_record(root, NODE, cp.bundle(2, roots=()))
    view = verifier(root, cp.config_lines()).trust("host.unit", None, ())
    assert view.roots is None and view.state.bundle_version == 2 and view.state.signed is False


def test_a_known_record_keeps_the_state(root: Path, cp: ControlPlane) -> None:
    record(cp, root)
    v = verifier(root, cp.config_lines())
    bound = v.trust("x", None, ()).state
    later = IntentState(
        record_sha256=bound.record_sha256,
        node_id=NODE,
        node_source="record",
        generation=9,
        bundle_version=1,
        bundle_sha256=bound.bundle_sha256,
        signed=True,
    )
    assert v.trust("x", None, (), later).state == later


def test_a_helper_bound_to_a_record_refuses_once_it_is_gone(root: Path, cp: ControlPlane) -> None:
    v = verifier(root, cp.config_lines())
    assert refusal(v.trust, "host.unit", None, (), IntentState(record_sha256="ab" * 32)) == (
        "join-record",
        f"host.unit: root's join record {JOIN_RECORD} is gone, but this helper was bound to it",
    )


def test_a_newer_presented_bundle_moves_the_version_and_an_older_one_is_stale(
    root: Path, cp: ControlPlane
) -> None:
    record(cp, root, bundle_version=2)
    v = verifier(root, cp.config_lines())
    newer = cp.bundle(3)
    view = v.trust("host.unit", newer, ())
    assert view.source == "trust bundle" and view.state.bundle_version == 3
    assert view.state.bundle_sha256 == v._bundle(newer, "x").sha256 and view.state.signed is True
    reason, message = refusal(v.trust, "host.unit", cp.bundle(1), ())
    assert reason == "stale-bundle"
    assert message.startswith("host.unit: the presented trust bundle is refused: ")
    # once a presented bundle moved the version past the record's, it must be presented
    assert refusal(v.trust, "host.unit", None, (), view.state) == (
        "bundle-required",
        "host.unit: trust bundle version 3 rotated the command-signing roots: the node must present it",
    )
    at_record = v.trust("host.unit", None, (), attrs_evolve(view.state, bundle_version=2))
    assert at_record.source == "join record"


def attrs_evolve(state: IntentState, **changes: Any) -> IntentState:
    import attrs

    return attrs.evolve(state, **changes)


def test_a_presented_bundle_without_a_record_gives_the_roots(root: Path, cp: ControlPlane) -> None:
    view = verifier(root, cp.config_lines()).trust("host.unit", cp.bundle(1), ())
    assert view.source == "trust bundle" and view.roots is not None
    assert (view.state.bundle_version, view.state.signed, view.state.node_id) == (1, True, "")


def test_once_signed_a_rootless_or_absent_bundle_is_refused(root: Path, cp: ControlPlane) -> None:
    v = verifier(root, cp.config_lines())
    signed_state = IntentState(bundle_version=1, signed=True)
    assert refusal(v.trust, "host.unit", cp.bundle(2, roots=()), (), signed_state) == (
        "rootless-bundle",
        "host.unit: the presented trust bundle has no command-signing roots, "
        "and this node's specs are signed",
    )
    assert refusal(v.trust, "access.apply", None, (), IntentState(signed=True)) == (
        "intent-required",
        "access.apply: this node's specs are signed: a signed spec is required",
    )
    # not signed yet: a rootless bundle names no roots, and the pin without a record refuses
    reason, _ = refusal(v.trust, "host.unit", cp.bundle(2, roots=()), (), IntentState(bundle_version=1))
    assert reason == "join-record-required"


def test_pinned_command_roots_decide_alone(root: Path, cp: ControlPlane, worker: Signer) -> None:
    record(cp, root, bundle_version=1)
    v = verifier(root, cp.config_lines(pin_roots=True))
    assert refusal(v.trust, "host.unit", None, ()) == (
        "intent-required",
        "host.unit: command_root_sha256 pins the roots: a signed spec is required",
    )
    assert refusal(v.trust, "host.unit", None, worker.chain) == (
        "intent-unverifiable",
        "host.unit: command_root_sha256 pins the roots: the signed spec's chain must end with its root",
    )
    assert refusal(v.trust, "host.unit", None, (b"not a certificate",)) == (
        "intent-unverifiable",
        "host.unit: command_root_sha256 pins the roots: the signed spec's chain must end with its root",
    )
    reason, message = refusal(v.trust, "host.unit", None, (*worker.chain, cp.other.root))
    assert reason == "bad-intent"
    assert message.startswith("host.unit: the signed spec is refused: ")
    view = v.trust("host.unit", cp.bundle(9, roots=()), (*worker.chain, cp.command.root))
    assert view.source == "command_root_sha256" and view.roots is not None
    assert view.roots.pins == {root_pin(cp.command.root)}
    assert view.state.signed is True and view.state.bundle_version == 1  # presented bundles are ignored
    assert root_pin(cp.command.root) in v.config.command_root_sha256


# --- a signed spec --------------------------------------------------------------------------------------


def with_record(cp: ControlPlane, root: Path, top: str = "") -> IntentVerifier:
    record(cp, root)
    return verifier(root, cp.config_lines() + top)


def test_without_roots_the_body_is_decoded_unverified_only_when_asked(root: Path, worker: Signer) -> None:
    v = verifier(root)
    body = host_body(NODE, 4, {UNIT: S1})
    got = v.check_spec("access.apply", signed(worker, body), decode_unverified=True)
    assert got.roots is False and got.source == "none" and got.next_state is None
    assert got.decoded is not None and (got.decoded.node_id, got.decoded.generation) == (NODE, 4)
    assert v.check_spec("access.apply", signed(worker, body)).decoded is None
    assert v.check_spec("access.apply", None, decode_unverified=True).decoded is None
    bad = SignedIntent(b64(b"\xff\xff\xff"), "", ())
    reason, message = refusal(v.check_spec, "access.apply", bad, decode_unverified=True)
    assert reason == "bad-intent"
    assert message.startswith("access.apply: the spec does not decode: ")


def test_without_roots_a_record_binding_is_the_state_to_write(root: Path, cp: ControlPlane) -> None:
    record(cp, root, bundle_version=None)
    got = verifier(root, cp.config_lines()).check_spec("host.unit", None)
    assert got.roots is False and got.next_state is not None and got.next_state.node_id == NODE


# Each field of an `intent` argument that is base64, made not to be, and the name a refusal gives it.
NOT_BASE64 = pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"body": "%%%"}, "body"),
        ({"signature": "é"}, "signature"),
        ({"chain": ("AAAA", "A")}, "chain[1]"),
        ({"trust_bundle": "A="}, "trust_bundle"),
    ],
)


@NOT_BASE64
def test_a_field_that_is_not_base64_is_named(
    root: Path, cp: ControlPlane, worker: Signer, changes: dict[str, Any], field: str
) -> None:
    import attrs

    v = with_record(cp, root)
    good = signed(worker, host_body(NODE, 1, {UNIT: S1}))
    assert refusal(v.check_spec, "host.unit", attrs.evolve(good, **changes)) == (
        "bad-intent",
        f"host.unit: intent.{field} is not base64",
    )


def test_with_roots_a_spec_is_required(root: Path, cp: ControlPlane) -> None:
    assert refusal(with_record(cp, root).check_spec, "host.unit", None) == (
        "intent-required",
        "host.unit: a signed spec is required (command-signing roots from join record)",
    )


def test_a_spec_that_does_not_verify_or_decode_is_refused(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = with_record(cp, root)
    body = host_body(NODE, 1, {UNIT: S1})
    reason, message = refusal(v.check_spec, "host.unit", signed(worker, body, flip=3))
    assert reason == "bad-intent" and message.startswith("host.unit: the signed spec is refused: ")
    reason, message = refusal(v.check_spec, "host.unit", signed(cp.other.leaf(), body))
    assert reason == "bad-intent" and message.startswith("host.unit: the signed spec is refused: ")
    garbage = signed(worker, b"\xff\xff\xff")
    reason, message = refusal(v.check_spec, "host.unit", garbage)
    assert reason == "bad-intent" and message.startswith("host.unit: the signed spec does not decode: ")


def test_an_accepted_spec_moves_the_state(root: Path, cp: ControlPlane, worker: Signer) -> None:
    v = with_record(cp, root)
    t = dt.datetime.now(dt.UTC).replace(microsecond=0)
    body = host_body(NODE, 5, {UNIT: S1})
    got = v.check_spec("host.unit", signed(worker, body), t)
    assert got.roots is True and got.source == "join record" and got.decoded is not None
    base = v.trust("x", None, ()).state
    assert got.next_state == attrs_evolve(
        base,
        generation=5,
        verified=(Verified(hashlib.sha256(body).hexdigest(), 5, int(t.timestamp() * 1000)),),
        signed=True,
    )
    assert got.next_state.node_source == "record"


def test_the_same_spec_again_writes_nothing(root: Path, cp: ControlPlane, worker: Signer) -> None:
    v = with_record(cp, root)
    body = signed(worker, host_body(NODE, 5, {UNIT: S1}))
    first = v.check_spec("host.unit", body)
    assert first.next_state is not None
    v.save_state(first.next_state)
    assert v.check_spec("host.unit", body).next_state is None


def test_bodies_of_one_generation_are_remembered_up_to_the_bound(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = with_record(cp, root)
    t = dt.datetime.now(dt.UTC)
    digests = []
    for i in range(MAX_VERIFIED + 2):
        body = host_body(NODE, 5, {UNIT: S1}, spec_hash=f"s{i}")
        digests.append(hashlib.sha256(body).hexdigest())
        got = v.check_spec("host.unit", signed(worker, body), t + dt.timedelta(seconds=i))
        assert got.next_state is not None
        v.save_state(got.next_state)
    kept = state_on_disk(root).verified
    assert [k.sha256 for k in kept] == digests[-MAX_VERIFIED:]
    assert [k.verified_at_ms for k in kept][-1] == int(
        (t + dt.timedelta(seconds=MAX_VERIFIED + 1)).timestamp() * 1000
    )
    newer = v.check_spec("host.unit", signed(worker, host_body(NODE, 6, {UNIT: S1})), t)
    assert newer.next_state is not None and len(newer.next_state.verified) == 1
    assert newer.next_state.verified[0].generation == 6


def test_a_known_body_is_checked_at_the_time_it_was_first_verified(root: Path, cp: ControlPlane) -> None:
    """HST-SIGN-30/31: a body verified at the newest generation stays good after its signer expires; a
    new body of that generation, or the same body at a newer generation, is checked now."""
    v = with_record(cp, root)
    t = dt.datetime.now(dt.UTC)
    short = cp.command.leaf(not_after=t + HOUR)
    body = host_body(NODE, 5, {UNIT: S1})
    got = v.check_spec("host.unit", signed(short, body), t)
    assert got.next_state is not None
    v.save_state(got.next_state)
    later = t + 2 * HOUR
    again = v.check_spec("host.unit", signed(short, body), later)
    assert again.roots is True and again.next_state is None
    other = host_body(NODE, 5, {UNIT: S2})
    reason, _ = refusal(v.check_spec, "host.unit", signed(short, other), later)
    assert reason == "bad-intent"
    v.save_state(
        attrs_evolve(
            state_on_disk(root),
            generation=5,
            verified=(
                Verified(hashlib.sha256(body).hexdigest(), 4, got.next_state.verified[0].verified_at_ms),
            ),
        )
    )
    reason, _ = refusal(v.check_spec, "host.unit", signed(short, body), later)
    assert reason == "bad-intent"  # remembered at another generation: checked now


def test_a_spec_for_another_node_is_refused_naming_the_binding(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = with_record(cp, root)
    assert refusal(v.check_spec, "host.unit", signed(worker, host_body("node-b", 5, {UNIT: S1}))) == (
        "wrong-node",
        f"host.unit: the signed spec is for node 'node-b'; this helper serves {NODE!r} (root's join record)",
    )


def test_without_a_record_the_first_signed_spec_binds_the_node(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = verifier(root, cp.config_lines())
    bundle = cp.bundle(1)
    first = v.check_spec("host.unit", signed(worker, host_body("node-c", 2, {UNIT: S1}), bundle=bundle))
    assert first.source == "trust bundle" and first.next_state is not None
    assert (first.next_state.node_id, first.next_state.node_source) == ("node-c", "first-signed-spec")
    v.save_state(first.next_state)
    other = signed(worker, host_body(NODE, 3, {UNIT: S1}), bundle=bundle)
    assert refusal(v.check_spec, "host.unit", other) == (
        "wrong-node",
        "host.unit: the signed spec is for node 'node-a'; this helper serves 'node-c' "
        "(the first signed spec accepted)",
    )
    again = v.check_spec("host.unit", signed(worker, host_body("node-c", 3, {UNIT: S1}), bundle=bundle))
    assert again.next_state is not None and again.next_state.node_source == "first-signed-spec"


def test_an_older_generation_is_refused_and_the_same_one_passes(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = with_record(cp, root)
    got = v.check_spec("host.unit", signed(worker, host_body(NODE, 5, {UNIT: S1})))
    assert got.next_state is not None
    v.save_state(got.next_state)
    assert refusal(v.check_spec, "host.unit", signed(worker, host_body(NODE, 4, {UNIT: S1}))) == (
        "stale-generation",
        "host.unit: the signed spec's generation 4 is older than generation 5 already accepted",
    )
    same = v.check_spec("host.unit", signed(worker, host_body(NODE, 5, {UNIT: S2})))
    assert same.next_state is not None and same.next_state.generation == 5
    assert len(same.next_state.verified) == 2


# --- host.unit ------------------------------------------------------------------------------------------


def test_host_unit_settings_must_be_exactly_the_signed_ones(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """HST-SIGN-25: the unit named once with byte-identical settings; anything else is named."""
    v = with_record(cp, root)
    ok = v.check_host_unit(UNIT, S1, signed(worker, host_body(NODE, 5, {UNIT: S1, "kmod": S2})))
    assert ok is not None and ok.generation == 5

    def mismatch(unit_settings: str, body: bytes, what: str) -> None:
        assert refusal(v.check_host_unit, UNIT, unit_settings, signed(worker, body)) == (
            "settings-mismatch",
            f"host.unit: {UNIT}: the signed spec (generation 5) {what}: the settings must be exactly the "
            "signed ones",
        )

    mismatch(S2, host_body(NODE, 5, {UNIT: S1}), "gives other settings")
    mismatch(S1 + " ", host_body(NODE, 5, {UNIT: S1}), "gives other settings")
    mismatch(S1, host_body(NODE, 5, {"kmod": S1}), "does not name it")
    twice = bytes(
        wire.DesiredStateBody(
            node_id=NODE,
            generation=5,
            spec_hash="t",
            full=wire.NodeSpec(
                host=wire.HostSection(
                    units=[wire.HostUnit(name=UNIT, settings=S1), wire.HostUnit(name=UNIT, settings=S1)]
                )
            ),
        )
    )
    mismatch(S1, twice, "names it twice")


def test_host_unit_clean_only_for_a_unit_the_spec_no_longer_names(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """HST-SIGN-26."""
    v = with_record(cp, root)
    assert refusal(v.check_host_unit, UNIT, None, signed(worker, host_body(NODE, 5, {UNIT: S1}))) == (
        "clean-refused",
        f"host.unit: {UNIT}: the signed spec (generation 5) still names it: a clean is allowed only for "
        "a unit the spec no longer names",
    )
    assert v.check_host_unit(UNIT, None, signed(worker, host_body(NODE, 5, {"kmod": S1}))) is not None
    # a full spec without a host section has no units: every clean passes, every set is refused
    assert v.check_host_unit(UNIT, None, signed(worker, host_body(NODE, 6, None))) is not None
    reason, _ = refusal(v.check_host_unit, UNIT, S1, signed(worker, host_body(NODE, 6, None)))
    assert reason == "settings-mismatch"


def test_host_unit_a_patch_speaks_only_when_it_sets_the_host_section(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = with_record(cp, root)
    assert refusal(v.check_host_unit, UNIT, None, signed(worker, host_body(NODE, 5, None, patch=True))) == (
        "bad-intent",
        "host.unit: the signed spec (generation 5) sets no host section",
    )
    ok = v.check_host_unit(UNIT, S1, signed(worker, host_body(NODE, 5, {UNIT: S1}, patch=True)))
    assert ok is not None and ok.generation == 5
    reason, _ = refusal(
        v.check_host_unit, UNIT, S2, signed(worker, host_body(NODE, 5, {UNIT: S1}, patch=True))
    )
    assert reason == "settings-mismatch"


def test_host_unit_without_roots_returns_the_binding_only(root: Path, cp: ControlPlane) -> None:
    assert verifier(root).check_host_unit(UNIT, S1, None) is None
    record(cp, root, bundle_version=None)
    got = verifier(root, cp.config_lines()).check_host_unit(UNIT, S1, None)
    assert got is not None and got.node_id == NODE and got.signed is False


# --- libvirt.* / ch.*: the signed instance -------------------------------------------------------------


def instance_body(node: str, generation: int, instances: dict[str, int], *, patch: bool = False) -> bytes:
    section = wire.InstancesSection(
        instances=[
            wire.InstanceSpec(id=i, runtime="libvirt-kvm", desired_state=wire.InstanceDesiredState(s))
            for i, s in instances.items()
        ]
    )
    if patch:
        return bytes(
            wire.DesiredStateBody(
                node_id=node,
                generation=generation,
                spec_hash="p",
                patch=wire.NodeSpecPatch(instances=section),
                base_generation=generation - 1,
            )
        )
    return bytes(
        wire.DesiredStateBody(
            node_id=node, generation=generation, spec_hash="i", full=wire.NodeSpec(instances=section)
        )
    )


def test_signed_instance_without_roots_checks_nothing(root: Path, cp: ControlPlane) -> None:
    assert verifier(root).signed_instance("libvirt.define", "vm-1", None) == (None, None)
    record(cp, root, bundle_version=None)
    inst, state = verifier(root, cp.config_lines()).signed_instance("libvirt.define", "vm-1", None)
    assert inst is None and state is not None and state.node_id == NODE


def test_signed_instance_returns_the_named_instance_and_the_state(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = with_record(cp, root)
    t = dt.datetime.now(dt.UTC).replace(microsecond=0)
    body = instance_body(NODE, 5, {"vm-1": 1, "vm-2": 3})
    inst, state = v.signed_instance("libvirt.define", "vm-2", signed(worker, body), t)
    assert inst is not None and inst.id == "vm-2" and int(inst.desired_state) == 3
    base = v.trust("x", None, ()).state
    assert state == attrs_evolve(
        base,
        generation=5,
        verified=(Verified(hashlib.sha256(body).hexdigest(), 5, int(t.timestamp() * 1000)),),
    )
    v.save_state(state)
    again, same = v.signed_instance("libvirt.define", "vm-1", signed(worker, body), t + 2 * HOUR * 0)
    assert again is not None and again.id == "vm-1" and same is None
    patched, _ = v.signed_instance(
        "ch.start", "vm-3", signed(worker, instance_body(NODE, 6, {"vm-3": 1}, patch=True))
    )
    assert patched is not None and patched.id == "vm-3"


def test_signed_instance_refusals(root: Path, cp: ControlPlane, worker: Signer) -> None:
    v = with_record(cp, root)
    op = "libvirt.define"
    assert refusal(v.signed_instance, op, "vm-1", None) == (
        "intent-required",
        "libvirt.define: a signed spec is required (command-signing roots from join record)",
    )
    reason, message = refusal(
        v.signed_instance, op, "vm-1", signed(worker, instance_body(NODE, 5, {"vm-1": 1}), flip=1)
    )
    assert reason == "bad-intent" and message.startswith("libvirt.define: the signed spec is refused: ")
    reason, message = refusal(v.signed_instance, op, "vm-1", signed(worker, b"\xff\xff"))
    assert reason == "bad-intent" and message.startswith("libvirt.define: the signed spec does not decode: ")
    assert refusal(
        v.signed_instance, op, "vm-1", signed(worker, instance_body("node-b", 5, {"vm-1": 1}))
    ) == (
        "wrong-node",
        "libvirt.define: the signed spec is for node 'node-b'; "
        "this helper serves 'node-a' (root's join record)",
    )
    for instances in [{"vm-2": 1}, {"vm-1": 4}, {}]:
        assert refusal(v.signed_instance, op, "vm-1", signed(worker, instance_body(NODE, 5, instances))) == (
            "not-in-spec",
            "libvirt.define: vm-1: the signed spec (generation 5) does not name it as an instance to run",
        )
    twice = instance_body(NODE, 5, {"vm-1": 1}).replace(b"", b"")
    body = bytes(
        wire.DesiredStateBody(
            node_id=NODE,
            generation=5,
            spec_hash="t",
            full=wire.NodeSpec(
                instances=wire.InstancesSection(
                    instances=[wire.InstanceSpec(id="vm-1", desired_state=wire.InstanceDesiredState(1))] * 2
                )
            ),
        )
    )
    assert twice and refusal(v.signed_instance, op, "vm-1", signed(worker, body))[0] == "not-in-spec"
    no_section = bytes(wire.DesiredStateBody(node_id=NODE, generation=5, spec_hash="n", full=wire.NodeSpec()))
    assert refusal(v.signed_instance, op, "vm-1", signed(worker, no_section))[0] == "not-in-spec"
    _, state = v.signed_instance(op, "vm-1", signed(worker, instance_body(NODE, 5, {"vm-1": 1})))
    assert state is not None
    v.save_state(state)
    assert refusal(v.signed_instance, op, "vm-1", signed(worker, instance_body(NODE, 4, {"vm-1": 1}))) == (
        "stale-generation",
        "libvirt.define: the signed spec's generation 4 is older than generation 5 already accepted",
    )
    _, more = v.signed_instance(op, "vm-1", signed(worker, instance_body(NODE, 5, {"vm-1": 1, "vm-9": 1})))
    assert more is not None and len(more.verified) == 2 and more.generation == 5


def test_signed_instance_binds_the_first_signed_spec_without_a_record(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = verifier(root, cp.config_lines())
    body = instance_body("node-c", 2, {"vm-1": 1})
    _, state = v.signed_instance("ch.start", "vm-1", signed(worker, body, bundle=cp.bundle(1)))
    assert state is not None and (state.node_id, state.node_source, state.signed) == (
        "node-c",
        "first-signed-spec",
        True,
    )


# --- signed commands ------------------------------------------------------------------------------------


def command(
    signer: Signer,
    kind: str = "gpu.reset",
    *,
    node: str = NODE,
    target: str = "",
    not_after: dt.datetime | None = None,
    flip: bool = False,
    body: bytes | None = None,
) -> Any:
    from bcd_helper.ops.host import SignedCommand

    if body is None:
        body = bytes(
            wire.CommandBody(
                id="01J00000000000000000000000",
                node_id=node,
                seq=1,
                kind=kind,
                lane=wire.Lane.CONTROL,
                not_after=int(
                    (not_after or dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)).timestamp() * 1000
                ),
                target_node_id=target,
            )
        )
    signature = bytearray(signer.key.sign(Purpose.COMMAND, body))
    if flip:
        signature[0] ^= 1
    return SignedCommand(b64(body), b64(bytes(signature)), tuple(b64(c) for c in signer.chain), None)


def test_a_command_without_roots_is_not_checked(root: Path, worker: Signer) -> None:
    assert verifier(root).check_command("gpu.reset", None) is None
    assert verifier(root).check_command("gpu.reset", command(worker)) is None


def test_a_signed_command_is_checked_for_kind_node_and_time(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = with_record(cp, root)
    op = "gpu.reset"
    t = dt.datetime.now(dt.UTC)
    decoded = v.check_command(op, command(worker), t)
    assert decoded is not None and decoded.kind == op and decoded.node_id == NODE
    assert v.check_command(op, command(worker, target=NODE), t) is not None
    assert refusal(v.check_command, op, None) == (
        "command-required",
        "gpu.reset: the signed command is required (command-signing roots from join record)",
    )
    reason, message = refusal(v.check_command, op, command(worker, flip=True))
    assert reason == "bad-command" and message.startswith("gpu.reset: the signed command is refused: ")
    reason, message = refusal(v.check_command, op, command(worker, body=b"\xff\xff"))
    assert reason == "bad-command" and message.startswith("gpu.reset: the signed command does not decode: ")
    assert refusal(v.check_command, op, command(worker, "node.reboot")) == (
        "command-mismatch",
        "gpu.reset: the signed command is a 'node.reboot', not 'gpu.reset'",
    )
    assert refusal(v.check_command, op, command(worker, node="node-b")) == (
        "wrong-node",
        "gpu.reset: the signed command is for node 'node-b'; this helper serves 'node-a'",
    )
    assert refusal(v.check_command, op, command(worker, target="node-c")) == (
        "wrong-node",
        "gpu.reset: the signed command is for node 'node-c'; this helper serves 'node-a'",
    )
    end = t + dt.timedelta(minutes=1)
    end_ms = int(end.timestamp() * 1000)
    assert v.check_command(op, command(worker, not_after=end), end - dt.timedelta(milliseconds=1)) is not None
    assert refusal(v.check_command, op, command(worker, not_after=end), end) == (
        "command-expired",
        f"gpu.reset: the signed command's not_after ({end_ms} ms) has passed (or is absent)",
    )


def test_a_command_is_refused_before_the_helper_is_bound_to_a_node(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    import attrs

    v = verifier(root, cp.config_lines())
    signed_command = attrs.evolve(command(worker, "node.reboot"), trust_bundle=b64(cp.bundle(1)))
    assert refusal(v.check_command, "node.reboot", attrs.evolve(signed_command)) == (
        "intent-unverifiable",
        "node.reboot: this helper is bound to no node yet (no join record, no signed spec accepted)",
    )
    bad = attrs.evolve(signed_command, trust_bundle="%")
    assert refusal(v.check_command, "node.reboot", bad) == (
        "bad-intent",
        "node.reboot: intent.command.trust_bundle is not base64",
    )
    assert refusal(v.check_command, "node.reboot", attrs.evolve(signed_command, chain=("A",))) == (
        "bad-intent",
        "node.reboot: intent.command.chain[0] is not base64",
    )
    assert refusal(v.check_command, "node.reboot", attrs.evolve(signed_command, body="@")) == (
        "bad-intent",
        "node.reboot: intent.command.body is not base64",
    )


# --- daemon.swap ----------------------------------------------------------------------------------------


def test_a_release_needs_roots(root: Path, cp: ControlPlane) -> None:
    assert refusal(verifier(root).release_roots, "daemon.swap", None, ()) == (
        "intent-unverifiable",
        "daemon.swap: no command-signing roots (command_root_sha256, root's join record or a trust bundle) "
        "to verify the release against",
    )
    roots = with_record(cp, root).release_roots("daemon.swap", None, ())
    assert roots.pins == {root_pin(cp.command.root)}


# --- every entry point passes its op, its chain and its presented bundle on -------------------------------


@NOT_BASE64
def test_signed_instance_names_a_field_that_is_not_base64(
    root: Path, cp: ControlPlane, worker: Signer, changes: dict[str, Any], field: str
) -> None:
    import attrs

    v = with_record(cp, root)
    good = signed(worker, instance_body(NODE, 1, {"vm-1": 1}))
    assert refusal(v.signed_instance, "ch.start", "vm-1", attrs.evolve(good, **changes)) == (
        "bad-intent",
        f"ch.start: intent.{field} is not base64",
    )


def test_the_op_is_named_in_refusals_from_the_roots_and_the_state(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = verifier(root, cp.config_lines())
    body = instance_body(NODE, 1, {"vm-1": 1})
    want = (
        "join-record-required",
        "{op}: root's config.toml pins the JoinService key (join_signing_key_pin) but root's join "
        f"record {JOIN_RECORD} does not exist yet: nothing is applied until `bcd join` writes it",
    )
    got = refusal(v.signed_instance, "libvirt.define", "vm-1", None)
    assert got == (want[0], want[1].format(op="libvirt.define"))
    assert refusal(v.check_command, "gpu.reset", None) == (want[0], want[1].format(op="gpu.reset"))
    assert refusal(v.release_roots, "daemon.swap", None, ()) == (want[0], want[1].format(op="daemon.swap"))
    assert refusal(v.check_host_unit, UNIT, S1, None) == (want[0], want[1].format(op="host.unit"))
    write_root_only(root, STATE_PATH, b"[]", 0o600)
    with pytest.raises(Failed) as info:
        v.signed_instance("libvirt.define", "vm-1", signed(worker, body))
    assert info.value.message == f"libvirt.define: {STATE_PATH} cannot be read: not a JSON object"


def test_pinned_roots_work_for_every_entry_point(root: Path, cp: ControlPlane, worker: Signer) -> None:
    record(cp, root)
    v = verifier(root, cp.config_lines(pin_roots=True))
    inst, state = v.signed_instance(
        "libvirt.define",
        "vm-1",
        signed(worker, instance_body(NODE, 3, {"vm-1": 1}), with_root=cp.command.root),
    )
    assert inst is not None and state is not None and state.generation == 3
    cmd = command(worker)
    pinned_cmd = type(cmd)(cmd.body, cmd.signature, (*cmd.chain, b64(cp.command.root)), None)
    assert v.check_command("gpu.reset", pinned_cmd) is not None
    assert v.release_roots("daemon.swap", None, (*worker.chain, cp.command.root)).pins == {
        root_pin(cp.command.root)
    }
    ok = v.check_host_unit(
        UNIT, S1, signed(worker, host_body(NODE, 3, {UNIT: S1}), with_root=cp.command.root)
    )
    assert ok is not None


def test_a_release_takes_the_roots_of_a_presented_bundle(root: Path, cp: ControlPlane) -> None:
    v = verifier(root, cp.config_lines())
    assert v.release_roots("daemon.swap", cp.bundle(1), ()).pins == {root_pin(cp.command.root)}


def test_signed_instance_checks_a_known_body_at_its_first_verification(root: Path, cp: ControlPlane) -> None:
    """HST-SIGN-30 for libvirt.* and ch.*: the signer may have expired since."""
    v = with_record(cp, root)
    t = dt.datetime.now(dt.UTC)
    short = cp.command.leaf(not_after=t + HOUR)
    body = instance_body(NODE, 5, {"vm-1": 1})
    _, state = v.signed_instance("ch.start", "vm-1", signed(short, body), t)
    assert state is not None
    v.save_state(state)
    inst, again = v.signed_instance("ch.start", "vm-1", signed(short, body), t + 2 * HOUR)
    assert inst is not None and again is None
    other = instance_body(NODE, 5, {"vm-1": 1, "vm-2": 1})
    assert (
        refusal(v.signed_instance, "ch.start", "vm-1", signed(short, other), t + 2 * HOUR)[0] == "bad-intent"
    )


def test_host_unit_checks_at_the_time_given(root: Path, cp: ControlPlane) -> None:
    v = with_record(cp, root)
    t = dt.datetime.now(dt.UTC)
    short = cp.command.leaf(not_after=t + HOUR)
    body = host_body(NODE, 5, {UNIT: S1})
    assert v.check_host_unit(UNIT, S1, signed(short, body), t) is not None
    reason, message = refusal(v.check_host_unit, UNIT, S1, signed(short, body), t + 2 * HOUR)
    assert reason == "bad-intent" and message.startswith("host.unit: the signed spec is refused: ")
    assert refusal(v.check_host_unit, UNIT, S1, None) == (
        "intent-required",
        "host.unit: a signed spec is required (command-signing roots from join record)",
    )


def test_a_command_field_that_is_not_base64_is_named(root: Path, cp: ControlPlane, worker: Signer) -> None:
    import attrs

    v = with_record(cp, root)
    assert refusal(v.check_command, "gpu.reset", attrs.evolve(command(worker), signature="é")) == (
        "bad-intent",
        "gpu.reset: intent.command.signature is not base64",
    )


def test_a_join_record_larger_than_a_mebibyte_is_refused(root: Path, cp: ControlPlane) -> None:
    v = verifier(root, cp.config_lines())
    write_root_only(root, JOIN_RECORD, b"x" * (1024 * 1024 + 1), 0o600)
    assert refusal(v.join_record, "host.unit") == (
        "join-record",
        f"host.unit: root's join record {JOIN_RECORD}: {JOIN_RECORD} is larger than 1048576 bytes",
    )
    write_root_only(root, JOIN_RECORD, b"x" * (1024 * 1024), 0o600)  # at the limit: read, then not verified
    reason, message = refusal(v.trust, "host.unit", None, ())
    assert reason == "join-record" and message.startswith(
        f"host.unit: root's join record {JOIN_RECORD} is refused ("
    )


def test_a_state_that_cannot_be_read_is_named_with_the_op(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = verifier(root)
    write_root_only(root, STATE_PATH, b"{", 0o600)
    for call, op in [
        (lambda: v.trust("host.unit", None, ()), "host.unit"),
        (lambda: v.check_host_unit(UNIT, S1, None), "host.unit"),
        (lambda: v.save_state(IntentState()), "intent"),
    ]:
        with pytest.raises(Failed) as info:
            call()
        assert info.value.reason == "intent-state"
        assert info.value.message.startswith(f"{op}: {STATE_PATH} cannot be read: ")


def test_without_roots_an_unverified_body_that_is_not_base64_is_named(root: Path) -> None:
    bad = SignedIntent("%%%", "", ())
    assert refusal(verifier(root).check_spec, "access.apply", bad, decode_unverified=True) == (
        "bad-intent",
        "access.apply: intent.body is not base64",
    )


def test_a_record_with_roots_refuses_a_newer_rootless_bundle(root: Path, cp: ControlPlane) -> None:
    """The record's bundle named roots: signed intent is on, so a presented bundle that drops them is
    refused even before any state was written."""
    record(cp, root, bundle_version=1)
    v = verifier(root, cp.config_lines())
    assert refusal(v.trust, "host.unit", cp.bundle(2, roots=()), ()) == (
        "rootless-bundle",
        "host.unit: the presented trust bundle has no command-signing roots, "
        "and this node's specs are signed",
    )


def test_pinned_roots_turn_signed_intent_on(root: Path, cp: ControlPlane, worker: Signer) -> None:
    v = verifier(root, cp.config_lines(pin_roots=True))
    view = v.trust("host.unit", None, (*worker.chain, cp.command.root))
    assert view.state.signed is True and view.state.record_sha256 == ""


def test_a_rotated_bundle_version_without_a_record_must_be_presented(root: Path, cp: ControlPlane) -> None:
    v = verifier(root, cp.config_lines())
    assert refusal(v.trust, "host.unit", None, (), IntentState(bundle_version=1, signed=True)) == (
        "bundle-required",
        "host.unit: trust bundle version 1 rotated the command-signing roots: the node must present it",
    )


def test_signed_instance_remembers_a_second_body_of_the_same_generation(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    v = with_record(cp, root)
    t = dt.datetime.now(dt.UTC).replace(microsecond=0)
    first = instance_body(NODE, 5, {"vm-1": 1})
    _, state = v.signed_instance("ch.start", "vm-1", signed(worker, first), t)
    assert state is not None
    v.save_state(state)
    second = instance_body(NODE, 5, {"vm-1": 1, "vm-2": 1})
    later = t + dt.timedelta(seconds=3)
    _, more = v.signed_instance("ch.start", "vm-1", signed(worker, second), later)
    assert more is not None
    assert more.verified == (
        Verified(hashlib.sha256(first).hexdigest(), 5, int(t.timestamp() * 1000)),
        Verified(hashlib.sha256(second).hexdigest(), 5, int(later.timestamp() * 1000)),
    )
