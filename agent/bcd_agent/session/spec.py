"""A received DesiredState, judged once (pure: no I/O, no trio, the time is a parameter).

`judge(envelope, ...)` returns one verdict:

- `Ignored`: a body for another node (DLV-RCV-13), a generation not above the one held (DLV-RCV-14), or
  one below `floor`, the highest generation this node ever applied (identity.json's mirror: after a lost
  journal no spec is held, and a gateway could otherwise roll the node back to any older signed
  generation it kept; the generation at the floor itself is the current one and is taken again).
  Nothing is stored or applied; the reason is logged at debug level.
- `Refused`: the body does not decode strictly, has neither `full` nor `patch`, or fails the signed-spec
  rule: once the trust bundle holds command-signing roots every spec must carry a valid `desired-state`
  signature chained to them (the 'always' rule, DLV-SIG-16). Logged and not applied.
- `BaseMismatch`: a patch whose `base_generation` is not the applied generation (DLV-RCV-06): the
  session answers `SpecRequest{PATCH_BASE_MISMATCH}` and applies nothing.
- `Accepted`: what to store (`StoredSpec`: the exact body bytes received, the `spec_hash` as received,
  never recomputed (DLV-RCV-15), the signature bytes) and the `DesiredSpec` the converge runner gets.

Patches (Q-DLV-RCV-01, decided: bcd applies them): each section the patch sets replaces the held one
wholesale, an empty one clears it, unset ones are kept (DLV-RCV-10..12). The journal holds only full
specs, so an applied patch is stored as the merged full body bcd encoded itself, *without a signature*:
after a restart, with command-signing roots known, that stored spec is not usable and the session asks for
the full spec (NO_SPEC). The gateway sends full specs only (DLV-RCV-16), so this path is for conformance.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from attrs import frozen
from bcd_shared import wire
from bcd_shared.pki import TrustBundle
from bcd_shared.pki.chain import ChainCache
from bcd_shared.pki.errors import PkiError
from bcd_shared.pki.verify import verify_desired_state
from bcd_shared.wire.strict import WireError, decode_spec_body

from bcd_agent.converge.types import SECTION_ORDER, DesiredSpec
from bcd_agent.journal import StoredSpec


@frozen
class Ignored:
    reason: str


@frozen
class Refused:
    reason: str


@frozen
class BaseMismatch:
    base_generation: int
    applied_generation: int


@frozen
class Accepted:
    stored: StoredSpec
    spec: DesiredSpec
    # The body set the host section (every full spec, `host` unset meaning empty, or a patch setting
    # `host`): the helper's host.unit needs these exact bytes with their signature (seeds/host-config.md
    # "Signed specs"); a clean is allowed only under a body that no longer names the unit.
    sets_host: bool
    # The DesiredState as received (exact bytes), for the host intent record.
    body: bytes = b""
    signature: bytes = b""
    signer_chain: tuple[bytes, ...] = ()


Verdict = Ignored | Refused | BaseMismatch | Accepted


def desired_spec(generation: int, spec_hash: str, spec: wire.NodeSpec, unknown: Sequence[int]) -> DesiredSpec:
    """The runner's DesiredSpec of a NodeSpec: each section's wire message (or None when unset)."""
    return DesiredSpec(
        generation=generation,
        spec_hash=spec_hash,
        sections={name: getattr(spec, name, None) for name in SECTION_ORDER},
        unknown_fields=tuple(unknown),
    )


def merge_patch(held: wire.NodeSpec, patch: wire.NodeSpecPatch) -> wire.NodeSpec:
    """A patch over the held spec: set sections replace wholesale (empty clears), unset ones stay."""
    merged = wire.NodeSpec()
    for name in SECTION_ORDER:
        value = getattr(patch, name, None)
        if value is None:
            value = getattr(held, name, None)
        setattr(merged, name, value)
    return merged


def decode_stored(stored: StoredSpec) -> tuple[wire.NodeSpec, tuple[int, ...]]:
    """The NodeSpec of a stored full body (raises WireError or ValueError when it is not usable)."""
    body, unknown = decode_spec_body(stored.body)
    if body.full is None:
        raise ValueError("the stored body holds no full spec")
    return body.full, unknown


def check_signature(
    body: bytes,
    signature: bytes,
    chain: Sequence[bytes],
    trust: TrustBundle | None,
    now: dt.datetime,
    cache: ChainCache | None = None,
) -> str | None:
    """None when the signed-spec rule admits the body, else the reason it is refused."""
    if trust is None or not trust.has_command_roots:
        return None  # no command-signing roots yet: specs go unsigned (v0.1)
    if not signature:
        return "unsigned spec refused: the trust bundle holds command-signing roots"
    try:
        verify_desired_state(body, signature, chain, trust.command_root_set(), now, cache)
    except PkiError as exc:
        return f"spec signature refused: {exc}"
    return None


def access_problem(body: wire.DesiredStateBody) -> str | None:
    """DLV-ACC-09..11: a CA key or principal that could add a line to sshd's files (a control character,
    any non-ASCII character, a principal with whitespace, a CA key that is not exactly one OpenSSH key)
    makes the whole spec invalid, signed or not; None when the access section passes (or is unset)."""
    from bcd_shared import access

    section = body.full.access if body.full is not None else (body.patch.access if body.patch else None)
    if section is None:
        return None
    try:
        access.validate(list(section.ssh_ca_keys), list(section.principals), list(section.revoked_serials))
    except access.AccessInvalid as exc:
        return f"invalid access section, the whole spec is refused: {exc}"
    return None


def judge(
    envelope: wire.DesiredState,
    *,
    node_id: str,
    applied: StoredSpec | None,
    trust: TrustBundle | None,
    now: dt.datetime,
    cache: ChainCache | None = None,
    floor: int = 0,
) -> Verdict:
    """Judge a received DesiredState (see the module docstring)."""
    raw = bytes(envelope.body)
    signature = bytes(envelope.signature)
    chain = tuple(bytes(c) for c in envelope.signer_chain)
    try:
        body, unknown = decode_spec_body(raw)
    except WireError as exc:
        return Refused(f"DesiredState.body: {exc}")
    if body.node_id != node_id:
        return Ignored(f"body for node {body.node_id!r}, this node is {node_id!r}")
    held_generation = applied.generation if applied is not None else 0
    if body.generation <= held_generation:
        return Ignored(f"generation {body.generation} is not above the held generation {held_generation}")
    if body.generation < floor:
        return Ignored(
            f"generation {body.generation} is below generation {floor}, which this node applied before"
            " (identity.json): a lost journal does not take the node back"
        )
    if body.full is None and body.patch is None:
        return Refused(f"generation {body.generation}: the body holds neither a full spec nor a patch")
    why = check_signature(raw, signature, chain, trust, now, cache)
    if why is not None:
        return Refused(f"generation {body.generation}: {why}")
    why = access_problem(body)
    if why is not None:
        return Refused(f"generation {body.generation}: {why}")
    if body.full is not None:
        stored = StoredSpec(
            generation=body.generation, body=raw, spec_hash=body.spec_hash, signature=signature
        )
        spec = desired_spec(body.generation, body.spec_hash, body.full, unknown)
        return Accepted(
            stored,
            spec,
            sets_host=True,  # a full spec decides the host section, unset meaning empty (cleans)
            body=raw,
            signature=signature,
            signer_chain=chain,
        )
    patch = body.patch
    assert patch is not None
    if applied is None or body.base_generation != held_generation:
        return BaseMismatch(body.base_generation, held_generation)
    try:
        held, held_unknown = decode_stored(applied)
    except (WireError, ValueError) as exc:
        return Refused(f"generation {body.generation}: the held spec cannot take a patch: {exc}")
    merged = merge_patch(held, patch)
    merged_body = wire.DesiredStateBody(
        node_id=body.node_id, generation=body.generation, spec_hash=body.spec_hash, full=merged
    )
    stored = StoredSpec(
        generation=body.generation, body=bytes(merged_body), spec_hash=body.spec_hash, signature=b""
    )
    all_unknown = tuple(sorted(set(unknown) | set(held_unknown)))
    spec = desired_spec(body.generation, body.spec_hash, merged, all_unknown)
    return Accepted(
        stored, spec, sets_host=patch.host is not None, body=raw, signature=signature, signer_chain=chain
    )
