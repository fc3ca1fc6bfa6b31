"""The acceptance checks: a pure function from a command and the node's state to a verdict.

The seeds' order (delivery.md "Acceptance checks", DLV-ACK-03..14), first refusal wins:

1. UNSUPPORTED      another node; upgrade-only session and not `daemon.upgrade`; unknown kind; a kind
                    outside this agent's role or without a handler here; a body whose lane or
                    self-terminating flag contradicts bcd's kind table (Q-DLV-CMD-01).
2. min_generation   above the applied generation: DEFER (the dispatcher sends SpecRequest MIN_GENERATION);
                    already at or past `not_after`: STALE_GENERATION. A body without `not_after` cannot
                    wait for anything and falls through to 3.
3. EXPIRED          no `not_after`, or server time (host clock through the Welcome offset) at or past it.
4. BAD_SIGNATURE    the trust bundle holds command-signing roots and the signature is missing, by an
                    unknown key or invalid, whatever the kind. Never decided by a body flag (DLV-SIG-03).
5. BATCH_UNAPPROVED approver keys present, destructive kind with a `batch_id`, and the approval / scope
                    proof does not admit `(subject, kind)`, or its leaf already admitted another command.
   UNBATCHED_LIMIT  approver keys present, destructive kind without `batch_id`, and the rolling hour of
                    the host clock already holds `unbatched_destructive_per_hour` such commands.
6. BUSY             (not here) no lane credit or a full journal; the dispatcher decides it after this
                    function, so a bad signature is refused even when the lane has no credit (DLV-ACK-18).

No I/O, no clock, no trio: everything comes in through `AcceptanceContext`. The verdict `Accept` carries
the flags the dispatcher runs with and the quorum claim it must persist before journaling `accepted`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from attrs import frozen

from bcd_agent.dispatch.command import CommandEnvelope, RejectReason
from bcd_agent.dispatch.kinds import NOT_BUILT, UPGRADE_KIND, KindSpec, Lane, Role
from bcd_agent.dispatch.ports import BatchAdmission, BatchVerifier, LedgerView, TrustView


@frozen
class AcceptanceContext:
    node_id: str
    role: Role
    upgrade_only: bool
    applied_generation: int
    server_now: dt.datetime
    host_now: float
    kinds: Mapping[str, KindSpec]
    supported: frozenset[str]  # kinds with a handler on this agent
    trust: TrustView
    batches: BatchVerifier
    ledger: LedgerView


@frozen
class EffectiveFlags:
    """What the dispatcher runs with: lane and self-termination from the table (they must agree with the
    body), retry-safe only when both say so, attested when either does, destructive from the table."""

    lane: Lane
    retry_safe: bool
    attested: bool
    self_terminating: bool
    destructive: bool


@frozen
class UnbatchedClaim:
    """Persist: one more destructive command without a batch in this hour."""


@frozen
class LeafClaim:
    """Persist: this batch leaf admitted this command."""

    admission: BatchAdmission


QuorumClaim = UnbatchedClaim | LeafClaim


@frozen
class Accept:
    spec: KindSpec
    flags: EffectiveFlags
    claim: QuorumClaim | None = None


@frozen
class Defer:
    """Wait for a spec at `min_generation` (re-checked on every newer spec and at `not_after`)."""

    min_generation: int


@frozen
class Reject:
    reason: RejectReason
    message: str


Verdict = Accept | Defer | Reject


def _unsupported(message: str) -> Reject:
    return Reject(RejectReason.UNSUPPORTED, message)


def _check_supported(cmd: CommandEnvelope, ctx: AcceptanceContext) -> Reject | KindSpec:
    if cmd.node_id != ctx.node_id:
        return _unsupported(f"command is for node {cmd.node_id!r}, this is {ctx.node_id!r}")
    if ctx.upgrade_only and cmd.kind != UPGRADE_KIND:
        return _unsupported(f"session is upgrade-only: only {UPGRADE_KIND} runs, not {cmd.kind!r}")
    spec = ctx.kinds.get(cmd.kind)
    if spec is None:
        return _unsupported(f"unknown kind {cmd.kind!r}")
    if ctx.role not in spec.roles:
        roles = ", ".join(sorted(r.value for r in spec.roles))
        return _unsupported(f"kind {cmd.kind} runs on {roles}, not on a {ctx.role.value} agent")
    if cmd.kind not in ctx.supported:
        why = NOT_BUILT.get(cmd.kind)
        return _unsupported(
            f"kind {cmd.kind}: {why}" if why else f"kind {cmd.kind} has no handler on this agent"
        )
    if cmd.lane is not spec.lane:
        got = cmd.lane.value if cmd.lane is not None else "none"
        return _unsupported(f"kind {cmd.kind} runs on lane {spec.lane.value}, the body says {got}")
    if cmd.self_terminating != spec.self_terminating:
        return _unsupported(
            f"kind {cmd.kind} is {'' if spec.self_terminating else 'not '}self-terminating, the body says "
            f"self_terminating={cmd.self_terminating}"
        )
    return spec


def _expired(cmd: CommandEnvelope, now: dt.datetime) -> bool:
    return cmd.not_after is None or now >= cmd.not_after


def _check_quorum(
    cmd: CommandEnvelope, spec: KindSpec, ctx: AcceptanceContext, reexecute: bool
) -> Reject | QuorumClaim | None:
    if not spec.destructive or not ctx.batches.has_approvers():
        return None
    if not cmd.batch_id:
        if ctx.ledger.unbatched_admits(cmd.id, ctx.host_now, ctx.batches.unbatched_allowance()):
            return UnbatchedClaim()
        return Reject(
            RejectReason.UNBATCHED_LIMIT,
            f"destructive {cmd.kind} without a batch: the hourly allowance of unbatched destructive "
            "commands is used up",
        )
    try:
        admission = ctx.batches.admit(cmd, ctx.server_now)
    except Exception as exc:  # the verifier's refusal, whatever its type, is the reason's message
        return Reject(RejectReason.BATCH_UNAPPROVED, f"batch {cmd.batch_id}: {exc}")
    owner = ctx.ledger.leaf_owner(admission.leaf)
    # A leaf admits one run of one command: only the re-execution of that same, retry-safe command after
    # a crash (the journal's REEXECUTE) passes again; a fresh delivery of a used leaf, even under the same
    # id (a lost or replaced journal), is refused.
    if owner is not None and not (reexecute and owner == cmd.id):
        return Reject(
            RejectReason.BATCH_UNAPPROVED,
            f"batch {cmd.batch_id}: leaf {admission.leaf} already admitted command {owner}",
        )
    return LeafClaim(admission)


def precheck(cmd: CommandEnvelope, ctx: AcceptanceContext, *, reexecute: bool = False) -> Verdict:
    """Run checks 1-5 in the seeds' order; the first refusal wins (see the module docstring).

    `reexecute`: the journal found the command left `accepted`/`running` by an earlier process and it is
    retry-safe (DLV-REC-08); the checks run again, and its own batch leaf may admit it again."""
    spec = _check_supported(cmd, ctx)
    if isinstance(spec, Reject):
        return spec
    if cmd.min_generation > ctx.applied_generation and cmd.not_after is not None:
        if ctx.server_now >= cmd.not_after:
            return Reject(
                RejectReason.STALE_GENERATION,
                f"needs generation {cmd.min_generation}, applied is {ctx.applied_generation} at not_after",
            )
        return Defer(cmd.min_generation)
    if _expired(cmd, ctx.server_now):
        if cmd.not_after is None:
            return Reject(RejectReason.EXPIRED, "command has no not_after")
        return Reject(
            RejectReason.EXPIRED,
            f"not_after {cmd.not_after.isoformat()} is past (server time {ctx.server_now.isoformat()})",
        )
    if ctx.trust.has_command_roots():
        if not cmd.signature:
            return Reject(RejectReason.BAD_SIGNATURE, "command is unsigned and command-signing roots are set")
        try:
            ctx.trust.verify_command(cmd, ctx.server_now)
        except Exception as exc:  # any refusal of the verifier is BAD_SIGNATURE, with its text
            return Reject(RejectReason.BAD_SIGNATURE, str(exc) or type(exc).__name__)
    claim = _check_quorum(cmd, spec, ctx, reexecute)
    if isinstance(claim, Reject):
        return claim
    flags = EffectiveFlags(
        lane=spec.lane,
        retry_safe=spec.retry_safe and cmd.retry_safe,
        attested=spec.attested or cmd.attested,
        self_terminating=spec.self_terminating,
        destructive=spec.destructive,
    )
    return Accept(spec, flags, claim)
