"""`judge`, the pure verdict on a received DesiredState, called directly: each verdict and its reason, what
an Accepted carries, the signed-spec rule, and patches merged over the held spec."""

from __future__ import annotations

import datetime as dt

import pytest
from bcd_agent.journal import StoredSpec
from bcd_agent.session.spec import (
    Accepted,
    BaseMismatch,
    Ignored,
    Refused,
    access_problem,
    check_signature,
    decode_stored,
    judge,
    merge_patch,
)
from bcd_shared import wire
from bcd_shared.pki import (
    ChainCache,
    KeyPair,
    Purpose,
    Role,
    TrustBundle,
    issue_intermediate,
    issue_leaf,
    issue_root,
)

NOW = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)
NODE = "node-a"
ROOT_KEY, CA_KEY, WORKER_KEY = KeyPair(b"\x01" * 32), KeyPair(b"\x02" * 32), KeyPair(b"\x03" * 32)
ROOT = issue_root(ROOT_KEY, "spec root", NOW - DAY, NOW + 365 * DAY)
CA = issue_intermediate(ROOT, ROOT_KEY, CA_KEY.public_key, "spec CA", NOW - DAY, NOW + 30 * DAY)
WORKER = issue_leaf(CA, CA_KEY, WORKER_KEY.public_key, Role.WORKER, "worker-1", NOW - DAY, NOW + DAY)
CHAIN = (WORKER, CA)
TRUST = TrustBundle(version=1, command_roots=(ROOT,))
TELEMETRY = wire.TelemetrySection(otlp_endpoint="https://otel.example:4318", export_interval_ms=15000)
ACCESS = wire.AccessSection(principals=["ops"])


def body(generation: int = 2, node_id: str = NODE, **fields: object) -> bytes:
    return bytes(
        wire.DesiredStateBody(node_id=node_id, generation=generation, spec_hash=f"h{generation}", **fields)
    )  # type: ignore[arg-type]


def envelope(raw: bytes, signed: bool = False, key: KeyPair = WORKER_KEY) -> wire.DesiredState:
    if not signed:
        return wire.DesiredState(body=raw)
    return wire.DesiredState(
        body=raw, signature=key.sign(Purpose.DESIRED_STATE, raw), signer_chain=list(CHAIN)
    )


def held(generation: int = 1, **sections: object) -> StoredSpec:
    raw = body(generation, full=wire.NodeSpec(**sections))  # type: ignore[arg-type]
    return StoredSpec(generation=generation, body=raw, spec_hash=f"h{generation}", signature=b"")


def run(
    env: wire.DesiredState, applied: StoredSpec | None = None, trust: TrustBundle | None = None
) -> object:
    return judge(env, node_id=NODE, applied=applied, trust=trust, now=NOW)


def test_undecodable_body_is_refused_naming_the_field() -> None:
    v = run(wire.DesiredState(body=b"\xff"))
    assert isinstance(v, Refused) and v.reason.startswith("DesiredState.body: ")


def test_other_node_and_old_generations_are_ignored_with_the_reason() -> None:
    assert run(envelope(body(node_id="node-b", full=wire.NodeSpec()))) == Ignored(
        "body for node 'node-b', this node is 'node-a'"
    )
    assert run(envelope(body(1, full=wire.NodeSpec())), held(1)) == Ignored(
        "generation 1 is not above the held generation 1"
    )
    assert run(envelope(body(0, full=wire.NodeSpec()))) == Ignored(
        "generation 0 is not above the held generation 0"
    )
    assert isinstance(run(envelope(body(1, full=wire.NodeSpec()))), Accepted)


def test_a_body_without_full_or_patch_is_refused() -> None:
    assert run(envelope(body(3))) == Refused("generation 3: the body holds neither a full spec nor a patch")


def test_full_spec_accepted_with_exact_bytes_hash_and_signature() -> None:
    raw = body(4, full=wire.NodeSpec(telemetry=TELEMETRY))
    env = envelope(raw, signed=True)
    v = run(env, held(2), TRUST)
    assert isinstance(v, Accepted)
    assert v.stored == StoredSpec(generation=4, body=raw, spec_hash="h4", signature=bytes(env.signature))
    assert (v.body, v.signature, v.signer_chain, v.sets_host) == (raw, bytes(env.signature), CHAIN, True)
    assert v.spec.generation == 4 and v.spec.spec_hash == "h4"
    assert v.spec.sections["telemetry"] == TELEMETRY and v.spec.sections["host"] is None
    assert set(v.spec.sections) == {"host", "devices", "instances", "access", "telemetry", "daemon", "site"}
    assert v.spec.unknown_fields == ()


def test_signed_spec_rule_once_roots_are_known() -> None:
    raw = body(2, full=wire.NodeSpec())
    assert run(envelope(raw), trust=TRUST) == Refused(
        "generation 2: unsigned spec refused: the trust bundle holds command-signing roots"
    )
    forged = wire.DesiredState(
        body=raw, signature=KeyPair(b"\x09" * 32).sign(Purpose.DESIRED_STATE, raw), signer_chain=list(CHAIN)
    )
    v = run(forged, trust=TRUST)
    assert isinstance(v, Refused) and v.reason.startswith(
        "generation 2: spec signature refused: bad-signature: "
    )
    assert isinstance(
        run(envelope(raw), trust=TrustBundle(version=1)), Accepted
    )  # no roots: unsigned is fine
    assert isinstance(run(envelope(raw, signed=True), trust=TRUST), Accepted)


def test_check_signature_uses_the_cache_given() -> None:
    raw = body(2, full=wire.NodeSpec())
    sig = WORKER_KEY.sign(Purpose.DESIRED_STATE, raw)
    cache = ChainCache()
    assert check_signature(raw, sig, CHAIN, TRUST, NOW, cache) is None
    assert check_signature(raw, sig, CHAIN, TRUST, NOW, cache) is None
    assert (cache.misses, cache.hits) == (1, 1)
    env = wire.DesiredState(body=raw, signature=sig, signer_chain=list(CHAIN))
    judge(env, node_id=NODE, applied=None, trust=TRUST, now=NOW, cache=cache)
    assert cache.hits == 2


def test_invalid_access_section_refuses_the_whole_spec() -> None:
    bad = wire.AccessSection(principals=["two words"])
    v = run(envelope(body(2, full=wire.NodeSpec(access=bad))))
    assert isinstance(v, Refused)
    assert v.reason.startswith("generation 2: invalid access section, the whole spec is refused: ")
    v = run(envelope(body(2, patch=wire.NodeSpecPatch(access=bad), base_generation=1)), held(1))
    assert isinstance(v, Refused) and "invalid access section" in v.reason
    assert (
        access_problem(wire.DesiredStateBody(node_id=NODE, generation=2, full=wire.NodeSpec(access=ACCESS)))
        is None
    )
    assert access_problem(wire.DesiredStateBody(node_id=NODE, generation=2)) is None


def test_patch_on_another_base_is_a_base_mismatch() -> None:
    patch = wire.NodeSpecPatch(telemetry=TELEMETRY)
    assert run(envelope(body(3, patch=patch, base_generation=1)), held(2)) == BaseMismatch(1, 2)
    assert run(envelope(body(3, patch=patch, base_generation=0))) == BaseMismatch(0, 0)


def test_patch_merges_set_sections_over_the_held_ones_and_is_stored_unsigned() -> None:
    base = held(1, access=ACCESS, telemetry=wire.TelemetrySection(otlp_endpoint="https://old.example:4318"))
    patch = wire.NodeSpecPatch(telemetry=TELEMETRY)
    raw = body(2, patch=patch, base_generation=1)
    env = envelope(raw, signed=True)
    v = run(env, base, TRUST)
    assert isinstance(v, Accepted)
    assert v.spec.sections["telemetry"] == TELEMETRY and v.spec.sections["access"] == ACCESS
    assert v.sets_host is False
    assert (v.body, v.signature, v.signer_chain) == (raw, bytes(env.signature), CHAIN)
    assert v.stored.signature == b"" and v.stored.generation == 2 and v.stored.spec_hash == "h2"
    merged, unknown = decode_stored(v.stored)
    assert merged == wire.NodeSpec(access=ACCESS, telemetry=TELEMETRY) and unknown == ()
    stored_body = wire.DesiredStateBody().parse(v.stored.body)
    assert (stored_body.node_id, stored_body.generation, stored_body.spec_hash) == (NODE, 2, "h2")
    host_patch = run(
        envelope(body(2, patch=wire.NodeSpecPatch(host=wire.HostSection()), base_generation=1)), base
    )
    assert isinstance(host_patch, Accepted) and host_patch.sets_host is True


def test_merge_patch_empty_section_clears_and_unset_keeps() -> None:
    held_spec = wire.NodeSpec(access=ACCESS, telemetry=TELEMETRY)
    merged = merge_patch(held_spec, wire.NodeSpecPatch(access=wire.AccessSection()))
    assert merged.access == wire.AccessSection() and merged.telemetry == TELEMETRY


def test_a_held_spec_that_cannot_take_a_patch_is_named() -> None:
    broken = StoredSpec(generation=1, body=b"\xff", spec_hash="h1", signature=b"")
    v = run(envelope(body(2, patch=wire.NodeSpecPatch(), base_generation=1)), broken)
    assert isinstance(v, Refused) and v.reason.startswith("generation 2: the held spec cannot take a patch: ")
    patch_only = StoredSpec(
        generation=1, body=body(1, patch=wire.NodeSpecPatch()), spec_hash="h1", signature=b""
    )
    v = run(envelope(body(2, patch=wire.NodeSpecPatch(), base_generation=1)), patch_only)
    assert v == Refused("generation 2: the held spec cannot take a patch: the stored body holds no full spec")
    with pytest.raises(ValueError, match=r"^the stored body holds no full spec$"):
        decode_stored(patch_only)


UNKNOWN_50 = b"\x90\x03\x01"  # NodeSpec field 50 (varint 1): a section this build does not know
UNKNOWN_51 = b"\x98\x03\x01"  # field 51


def test_unknown_sections_are_reported_from_the_full_spec_and_from_patch_and_held_together() -> None:
    head = bytes(wire.DesiredStateBody(node_id=NODE, generation=1, spec_hash="h1"))
    full = head + b"\x22" + bytes([len(UNKNOWN_50)]) + UNKNOWN_50
    v = run(envelope(full))
    assert isinstance(v, Accepted) and v.spec.unknown_fields == (50,)
    applied = StoredSpec(generation=1, body=full, spec_hash="h1", signature=b"")
    head2 = bytes(wire.DesiredStateBody(node_id=NODE, generation=2, spec_hash="h2"))
    patch = head2 + b"\x2a" + bytes([len(UNKNOWN_51)]) + UNKNOWN_51 + b"\x30\x01"  # base_generation 1
    v = run(envelope(patch), applied)
    assert isinstance(v, Accepted)
    assert v.spec.unknown_fields == (50, 51) and v.spec.spec_hash == "h2" and v.spec.generation == 2


def test_a_generation_below_the_floor_is_ignored_the_floor_itself_is_taken() -> None:
    """The floor is the highest generation this node ever applied (identity.json's mirror): after a lost
    journal (no held spec) a gateway's older signed generation is ignored, with the reason; the generation
    at the floor is the current one and is taken again (hostile gateway round 2)."""
    full = wire.NodeSpec()
    below = judge(envelope(body(8, full=full)), node_id=NODE, applied=None, trust=None, now=NOW, floor=9)
    assert below == Ignored(
        "generation 8 is below generation 9, which this node applied before (identity.json): a lost"
        " journal does not take the node back"
    )
    for generation in (9, 10):
        verdict = judge(
            envelope(body(generation, full=full)), node_id=NODE, applied=None, trust=None, now=NOW, floor=9
        )
        assert isinstance(verdict, Accepted) and verdict.stored.generation == generation


def test_the_applied_generation_mark_only_moves_up() -> None:
    from bcd_agent.session import identity as ident

    base = ident.Identity("node-a", WORKER_KEY, (), "pin", applied_generation_mark=9)
    assert ident.with_generation(base, 5) is base and ident.with_generation(base, 9) is base
    assert ident.with_generation(base, 10).applied_generation_mark == 10
