"""The acceptance checks as a pure function: every reason, and the seeds' order (DLV-ACK-03..18)."""

from __future__ import annotations

import datetime as dt
import itertools
from pathlib import Path

import pytest
from bcd_agent.dispatch.acceptance import (
    Accept,
    AcceptanceContext,
    Defer,
    LeafClaim,
    Reject,
    UnbatchedClaim,
    precheck,
)
from bcd_agent.dispatch.command import CommandEnvelope, RejectReason
from bcd_agent.dispatch.kinds import KINDS, UPGRADE_KIND, Lane, Role
from bcd_agent.dispatch.quorum import QuorumLedger
from bcd_agent.dispatch.trust import BundleTrust
from bcd_agent.kinds.testing import TEST_KINDS
from bcd_shared.pki import TrustBundle
from dhelpers import ALL_KINDS, NODE, T0, Pki, approved_batch, leaf_for, make_command, ulid

NOW = T0 + dt.timedelta(minutes=1)
HOST_NOW = NOW.timestamp()


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


def ctx(
    ledger: QuorumLedger,
    bundle: TrustBundle | None = None,
    *,
    role: Role = Role.NODE,
    upgrade_only: bool = False,
    applied_generation: int = 5,
    now: dt.datetime = NOW,
    supported: frozenset[str] | None = None,
) -> AcceptanceContext:
    trust = BundleTrust(bundle)
    return AcceptanceContext(
        node_id=NODE,
        role=role,
        upgrade_only=upgrade_only,
        applied_generation=applied_generation,
        server_now=now,
        host_now=now.timestamp(),
        kinds=ALL_KINDS,
        supported=frozenset(ALL_KINDS) if supported is None else supported,
        trust=trust,
        batches=trust,
        ledger=ledger,
    )


@pytest.fixture
def ledger(tmp_path: Path) -> QuorumLedger:
    return QuorumLedger.open(tmp_path)


def reason(verdict: Accept | Defer | Reject) -> RejectReason | str:
    if isinstance(verdict, Reject):
        return verdict.reason
    return type(verdict).__name__


# --- each reason ----------------------------------------------------------------------------------


def test_DLV_ACK_03_another_node_is_unsupported(pki: Pki, ledger: QuorumLedger) -> None:
    v = precheck(make_command(pki, node_id="node-b"), ctx(ledger, pki.bundle()))
    assert isinstance(v, Reject) and v.reason is RejectReason.UNSUPPORTED
    assert "node-b" in v.message


def test_DLV_ACK_04_unknown_kind_is_unsupported(pki: Pki, ledger: QuorumLedger) -> None:
    v = precheck(make_command(pki, kind="gpu.melt", lane=Lane.CONTROL), ctx(ledger, pki.bundle()))
    assert isinstance(v, Reject) and v.reason is RejectReason.UNSUPPORTED and "unknown kind" in v.message


def test_DLV_ACK_05_DLV_KIND_01_kind_outside_role_is_unsupported(pki: Pki, ledger: QuorumLedger) -> None:
    """bmc.query is site-only: refused on a node agent, accepted on a site agent."""
    cmd = make_command(pki, kind="bmc.query")
    v = precheck(cmd, ctx(ledger, pki.bundle(), role=Role.NODE))
    assert isinstance(v, Reject) and v.reason is RejectReason.UNSUPPORTED and "site" in v.message
    assert isinstance(precheck(cmd, ctx(ledger, pki.bundle(), role=Role.SITE)), Accept)
    # gpu.reset is node-only
    v = precheck(make_command(pki, kind="gpu.reset"), ctx(ledger, pki.bundle(), role=Role.RAMDISK))
    assert isinstance(v, Reject) and v.reason is RejectReason.UNSUPPORTED


def test_DLV_KIND_01_kind_without_handler_here_is_unsupported(pki: Pki, ledger: QuorumLedger) -> None:
    v = precheck(
        make_command(pki, kind="diag.nvml"), ctx(ledger, pki.bundle(), supported=frozenset(TEST_KINDS))
    )
    assert isinstance(v, Reject) and v.reason is RejectReason.UNSUPPORTED and "no handler" in v.message


def test_DLV_ACK_06_upgrade_only_session_refuses_all_but_daemon_upgrade(
    pki: Pki, ledger: QuorumLedger
) -> None:
    c = ctx(ledger, pki.bundle(), upgrade_only=True)
    v = precheck(make_command(pki, kind="inventory.refresh"), c)
    assert isinstance(v, Reject) and v.reason is RejectReason.UNSUPPORTED and "upgrade-only" in v.message
    assert isinstance(precheck(make_command(pki, kind=UPGRADE_KIND), c), Accept)


def test_Q_DLV_CMD_01_body_flags_contradicting_the_table(pki: Pki, ledger: QuorumLedger) -> None:
    """Lane and self-termination must agree with bcd's table; retry-safe is the AND, attested the OR."""
    c = ctx(ledger, pki.bundle())
    v = precheck(make_command(pki, kind="test.effect", lane=Lane.BULK), c)
    assert isinstance(v, Reject) and v.reason is RejectReason.UNSUPPORTED and "lane" in v.message
    v = precheck(make_command(pki, kind="test.effect", self_terminating=True), c)
    assert isinstance(v, Reject) and v.reason is RejectReason.UNSUPPORTED and "self-terminating" in v.message
    v = precheck(make_command(pki, kind="test.echo", retry_safe=False, attested=True), c)
    assert isinstance(v, Accept)
    assert v.flags.retry_safe is False and v.flags.attested is True
    v = precheck(make_command(pki, kind="test.effect", retry_safe=True), c)
    assert isinstance(v, Accept) and v.flags.retry_safe is False


def test_DLV_ACK_07_min_generation_above_applied_defers(pki: Pki, ledger: QuorumLedger) -> None:
    v = precheck(make_command(pki, min_generation=6), ctx(ledger, pki.bundle(), applied_generation=5))
    assert v == Defer(6)
    assert isinstance(precheck(make_command(pki, min_generation=5), ctx(ledger, pki.bundle())), Accept)


def test_DLV_ACK_09_still_behind_at_not_after_is_stale_generation(pki: Pki, ledger: QuorumLedger) -> None:
    cmd = make_command(pki, min_generation=6, not_after=NOW)
    v = precheck(cmd, ctx(ledger, pki.bundle(), now=NOW))
    assert isinstance(v, Reject) and v.reason is RejectReason.STALE_GENERATION
    # the same command just before not_after waits
    assert isinstance(precheck(cmd, ctx(ledger, pki.bundle(), now=NOW - dt.timedelta(milliseconds=1))), Defer)


def test_DLV_ACK_10_past_not_after_in_server_time_is_expired(pki: Pki, ledger: QuorumLedger) -> None:
    cmd = make_command(pki, not_after=NOW)
    v = precheck(cmd, ctx(ledger, pki.bundle(), now=NOW))
    assert isinstance(v, Reject) and v.reason is RejectReason.EXPIRED
    assert isinstance(
        precheck(cmd, ctx(ledger, pki.bundle(), now=NOW - dt.timedelta(milliseconds=1))), Accept
    )


def test_DLV_ACK_11_missing_not_after_is_expired(pki: Pki, ledger: QuorumLedger) -> None:
    v = precheck(make_command(pki, not_after=None), ctx(ledger, pki.bundle()))
    assert isinstance(v, Reject) and v.reason is RejectReason.EXPIRED and "no not_after" in v.message
    # A missing not_after cannot be waited for: a command behind on generation is EXPIRED, not deferred.
    v = precheck(make_command(pki, not_after=None, min_generation=9), ctx(ledger, pki.bundle()))
    assert isinstance(v, Reject) and v.reason is RejectReason.EXPIRED


@pytest.mark.parametrize("sign", ["none", "other", "tamper"])
@pytest.mark.parametrize("kind", ["inventory.refresh", "test.echo", "gpu.reset"])
def test_DLV_ACK_12_DLV_SIG_05_bad_signature_on_any_kind(
    pki: Pki, ledger: QuorumLedger, sign: str, kind: str
) -> None:
    """Missing, unknown-key and invalid signatures, on harmless and destructive kinds alike."""
    v = precheck(make_command(pki, kind=kind, sign=sign), ctx(ledger, pki.bundle()))
    assert isinstance(v, Reject) and v.reason is RejectReason.BAD_SIGNATURE, v


def test_DLV_SIG_04_no_roots_no_signature_required(pki: Pki, ledger: QuorumLedger) -> None:
    for bundle in (None, pki.bundle(roots=False)):
        assert isinstance(precheck(make_command(pki, sign="none"), ctx(ledger, bundle)), Accept)
    assert isinstance(precheck(make_command(pki, sign="worker"), ctx(ledger, pki.bundle())), Accept)


def test_DLV_SIG_03_signature_requirement_ignores_body_flags(pki: Pki, ledger: QuorumLedger) -> None:
    """No body field turns the check off: unsigned is refused whatever retry_safe/attested/batch say."""
    for extra in ({"retry_safe": True}, {"attested": True}, {"batch_id": "b1"}, {"min_generation": 0}):
        v = precheck(make_command(pki, kind="test.echo", sign="none", **extra), ctx(ledger, pki.bundle()))
        assert isinstance(v, Reject) and v.reason is RejectReason.BAD_SIGNATURE


def test_DLV_QRM_02_unbatched_destructive_beyond_allowance(pki: Pki, ledger: QuorumLedger) -> None:
    c0 = ctx(ledger, pki.bundle(approvers=3, allowance=0))
    v = precheck(make_command(pki, kind="test.destructive"), c0)
    assert isinstance(v, Reject) and v.reason is RejectReason.UNBATCHED_LIMIT
    c1 = ctx(ledger, pki.bundle(approvers=3, allowance=1))
    v = precheck(make_command(pki, kind="test.destructive"), c1)
    assert isinstance(v, Accept) and v.claim == UnbatchedClaim()
    # non-destructive kinds are outside the quorum; without approver keys there is no quorum at all
    v = precheck(make_command(pki, kind="test.effect"), c0)
    assert isinstance(v, Accept) and v.claim is None
    v = precheck(make_command(pki, kind="gpu.reset"), ctx(ledger, pki.bundle(approvers=0)))
    assert isinstance(v, Accept) and v.claim is None


def test_DLV_QRM_01_batched_destructive_needs_distinct_approvers(pki: Pki, ledger: QuorumLedger) -> None:
    c = ctx(ledger, pki.bundle(approvers=3, required=2))
    cid = ulid()
    leaves = [leaf_for(ulid(), "test.destructive"), leaf_for(cid, "test.destructive")]
    ok = approved_batch(pki, "b1", leaves, 1, signers=(0, 2))
    v = precheck(make_command(pki, id=cid, kind="test.destructive", batch_id="b1", batch=ok), c)
    assert isinstance(v, Accept) and isinstance(v.claim, LeafClaim)
    assert v.claim.admission.leaf.startswith("b1/")
    # the same approver twice counts once: 1 of 2
    twice = approved_batch(pki, "b1", leaves, 1, signers=(0, 0))
    v = precheck(make_command(pki, id=cid, kind="test.destructive", batch_id="b1", batch=twice), c)
    assert isinstance(v, Reject) and v.reason is RejectReason.BATCH_UNAPPROVED and "1 distinct" in v.message
    # a batch_id without any approval
    v = precheck(make_command(pki, id=cid, kind="test.destructive", batch_id="b1"), c)
    assert isinstance(v, Reject) and v.reason is RejectReason.BATCH_UNAPPROVED


def test_DLV_QRM_01_scope_proof_for_another_subject_or_kind_is_refused(
    pki: Pki, ledger: QuorumLedger
) -> None:
    c = ctx(ledger, pki.bundle(approvers=3, required=2))
    cid = ulid()
    for leaf in (leaf_for(cid, "gpu.reset"), leaf_for(cid, "test.destructive", subject="node-b")):
        batch = approved_batch(pki, "b2", [leaf], 0)
        v = precheck(make_command(pki, id=cid, kind="test.destructive", batch_id="b2", batch=batch), c)
        assert isinstance(v, Reject) and v.reason is RejectReason.BATCH_UNAPPROVED
        assert "subject, kind" in v.message
    # target_node_id is the subject when set
    batch = approved_batch(pki, "b3", [leaf_for(cid, "test.destructive", subject="machine-9")], 0)
    cmd = make_command(
        pki, id=cid, kind="test.destructive", batch_id="b3", batch=batch, target_node_id="machine-9"
    )
    assert isinstance(precheck(cmd, c), Accept)


def test_DLV_QRM_05_a_used_leaf_admits_nothing_else(pki: Pki, ledger: QuorumLedger) -> None:
    c = ctx(ledger, pki.bundle(approvers=3, required=2))
    cid = ulid()
    batch = approved_batch(pki, "b4", [leaf_for(cid, "test.destructive")], 0)
    cmd = make_command(pki, id=cid, kind="test.destructive", batch_id="b4", batch=batch)
    v = precheck(cmd, c)
    assert isinstance(v, Accept) and isinstance(v.claim, LeafClaim)
    ledger.record_leaf(v.claim.admission.leaf, cid, HOST_NOW, NOW.timestamp(), v.claim.admission.expires_at)
    # the same leaf again: refused on a fresh delivery (even under the same id: a lost journal) ...
    v2 = precheck(cmd, c)
    assert (
        isinstance(v2, Reject)
        and v2.reason is RejectReason.BATCH_UNAPPROVED
        and "already admitted" in v2.message
    )
    # ... but the journal's re-execution of that same retry-safe command passes
    assert isinstance(precheck(cmd, c, reexecute=True), Accept)


def test_DLV_CMD_16_batch_id_names_the_batch_and_empty_means_unbatched(
    pki: Pki, ledger: QuorumLedger
) -> None:
    """The body's batch_id must be the batch the approval is for; an empty one makes the command
    unbatched, counted against the hourly allowance whatever approval travels beside it."""
    cid = ulid()
    batch = approved_batch(pki, "b-7", [leaf_for(cid, "test.destructive")], 0)
    c = ctx(ledger, pki.bundle(approvers=3, required=2, allowance=0))
    v = precheck(make_command(pki, id=cid, kind="test.destructive", batch_id="b-7", batch=batch), c)
    assert (
        isinstance(v, Accept) and isinstance(v.claim, LeafClaim) and v.claim.admission.leaf.startswith("b-7/")
    )
    v = precheck(make_command(pki, id=cid, kind="test.destructive", batch_id="b-8", batch=batch), c)
    assert isinstance(v, Reject) and v.reason is RejectReason.BATCH_UNAPPROVED
    assert "'b-7'" in v.message and "'b-8'" in v.message
    v = precheck(make_command(pki, id=cid, kind="test.destructive", batch_id="", batch=batch), c)
    assert isinstance(v, Reject) and v.reason is RejectReason.UNBATCHED_LIMIT
    one = ctx(ledger, pki.bundle(approvers=3, required=2, allowance=1))
    v = precheck(make_command(pki, id=cid, kind="test.destructive", batch_id="", batch=batch), one)
    assert isinstance(v, Accept) and v.claim == UnbatchedClaim()


# --- the order ------------------------------------------------------------------------------------

# One fault per check, in the seeds' order; the first present must decide.
FAULTS = ("wrong_node", "unknown_kind", "behind", "expired", "bad_signature", "unbatched")
EXPECTED = {
    "wrong_node": RejectReason.UNSUPPORTED,
    "unknown_kind": RejectReason.UNSUPPORTED,
    "behind": "Defer",
    "expired": RejectReason.EXPIRED,
    "bad_signature": RejectReason.BAD_SIGNATURE,
    "unbatched": RejectReason.UNBATCHED_LIMIT,
}


def _faulty(pki: Pki, faults: set[str]) -> CommandEnvelope:
    return make_command(
        pki,
        node_id="node-z" if "wrong_node" in faults else NODE,
        kind="no.such.kind" if "unknown_kind" in faults else "test.destructive",
        lane=Lane.CONTROL,
        min_generation=99 if "behind" in faults else 0,
        not_after=NOW - dt.timedelta(seconds=1) if "expired" in faults else NOW + dt.timedelta(minutes=5),
        sign="other" if "bad_signature" in faults else "worker",
    )


@pytest.mark.parametrize(
    "faults",
    [set(c) for n in range(len(FAULTS) + 1) for c in itertools.combinations(FAULTS, n)],
    ids=lambda f: "+".join(sorted(f)) or "none",
)
def test_DLV_ACK_02_checks_run_in_the_seeds_order(pki: Pki, ledger: QuorumLedger, faults: set[str]) -> None:
    """Every combination of faults: the first in the seeds' order decides (Q-DLV-ACK-01: kept as written;
    DLV-QRM-06: the quorum after the signature).
    `behind` together with `expired` is STALE_GENERATION (the deferral's deadline has passed)."""
    allowance = 0 if "unbatched" in faults else 1
    v = precheck(_faulty(pki, faults), ctx(ledger, pki.bundle(approvers=3, allowance=allowance)))
    first = next((f for f in FAULTS if f in faults), None)
    if first is None:
        assert isinstance(v, Accept)
    elif first == "behind" and "expired" in faults:
        assert reason(v) is RejectReason.STALE_GENERATION
    else:
        assert reason(v) == EXPECTED[first]


def test_Q_DLV_ACK_01_bad_signature_behind_generation_is_deferred_then_refused(
    pki: Pki, ledger: QuorumLedger
) -> None:
    """The seed's order defers before judging the signature; once the spec arrives it is BAD_SIGNATURE."""
    cmd = make_command(pki, min_generation=6, sign="other")
    assert precheck(cmd, ctx(ledger, pki.bundle(), applied_generation=5)) == Defer(6)
    v = precheck(cmd, ctx(ledger, pki.bundle(), applied_generation=6))
    assert isinstance(v, Reject) and v.reason is RejectReason.BAD_SIGNATURE


def test_the_table_and_handlers_agree_with_production_kinds() -> None:
    """Test kinds never leak into the production table."""
    assert not set(TEST_KINDS) & set(KINDS)
    assert all(k.startswith("test.") for k in TEST_KINDS)
