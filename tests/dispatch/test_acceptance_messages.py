"""The acceptance refusals' messages word for word, the flags an Accept carries, and the quorum inputs the
check passes on (the command's own id to the ledger, the server time to the batch verifier)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import attrs
import pytest
from bcd_agent.dispatch.acceptance import (
    Accept,
    AcceptanceContext,
    EffectiveFlags,
    LeafClaim,
    Reject,
    UnbatchedClaim,
    precheck,
)
from bcd_agent.dispatch.command import CommandEnvelope, RejectReason
from bcd_agent.dispatch.kinds import Lane, Role
from bcd_agent.dispatch.quorum import QuorumLedger
from bcd_agent.dispatch.trust import BundleTrust
from bcd_shared import wire
from bcd_shared.pki import TrustBundle, approve, build_batch
from dhelpers import ALL_KINDS, NODE, T0, Pki, leaf_for, make_command, ulid

NOW = T0 + dt.timedelta(minutes=1)


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


@pytest.fixture
def ledger(tmp_path: Path) -> QuorumLedger:
    return QuorumLedger.open(tmp_path)


def ctx(
    ledger: QuorumLedger, bundle: TrustBundle | None, role: Role = Role.NODE, trust: object = None
) -> AcceptanceContext:
    bt = BundleTrust(bundle)
    return AcceptanceContext(
        node_id=NODE,
        role=role,
        upgrade_only=False,
        applied_generation=5,
        server_now=NOW,
        host_now=NOW.timestamp(),
        kinds=ALL_KINDS,
        supported=frozenset(ALL_KINDS),
        trust=bt if trust is None else trust,  # type: ignore[arg-type]
        batches=bt,
        ledger=ledger,
    )


def _reject(verdict: object) -> Reject:
    assert isinstance(verdict, Reject), verdict
    return verdict


def test_unsupported_messages_name_the_roles_lane_and_termination(pki: Pki, ledger: QuorumLedger) -> None:
    c = ctx(ledger, pki.bundle())
    v = _reject(precheck(make_command(pki, kind="diag.nvml"), ctx(ledger, pki.bundle(), role=Role.SITE)))
    assert v.message == "kind diag.nvml runs on node, ramdisk, not on a site agent"
    v = _reject(precheck(make_command(pki, kind="test.effect", lane=Lane.BULK), c))
    assert v.message == "kind test.effect runs on lane control, the body says bulk"
    no_lane = attrs.evolve(make_command(pki, kind="test.effect"), lane=None)
    assert (
        _reject(precheck(no_lane, c)).message == "kind test.effect runs on lane control, the body says none"
    )
    v = _reject(precheck(make_command(pki, kind="test.effect", self_terminating=True), c))
    assert v.message == "kind test.effect is not self-terminating, the body says self_terminating=True"
    v = _reject(precheck(make_command(pki, kind="test.reboot", self_terminating=False), c))
    assert v.message == "kind test.reboot is self-terminating, the body says self_terminating=False"


def test_expiry_and_signature_messages(pki: Pki, ledger: QuorumLedger) -> None:
    c = ctx(ledger, pki.bundle())
    v = _reject(precheck(make_command(pki, not_after=None), c))
    assert (v.reason, v.message) == (RejectReason.EXPIRED, "command has no not_after")
    v = _reject(precheck(make_command(pki, sign="none"), c))
    assert v.message == "command is unsigned and command-signing roots are set"


class SilentRefusal:
    """A trust view whose verifier refuses with an exception that has no text."""

    def has_command_roots(self) -> bool:
        return True

    def verify_command(self, command: CommandEnvelope, now: dt.datetime) -> None:
        raise LookupError()


def test_a_verifier_refusal_without_text_is_named_by_its_type(pki: Pki, ledger: QuorumLedger) -> None:
    v = _reject(precheck(make_command(pki), ctx(ledger, pki.bundle(), trust=SilentRefusal())))
    assert (v.reason, v.message) == (RejectReason.BAD_SIGNATURE, "LookupError")


def test_accept_carries_the_tables_flags(pki: Pki, ledger: QuorumLedger) -> None:
    v = precheck(make_command(pki, kind="test.reboot"), ctx(ledger, pki.bundle()))
    assert isinstance(v, Accept)
    assert v.flags == EffectiveFlags(
        lane=Lane.CONTROL, retry_safe=True, attested=False, self_terminating=True, destructive=False
    )
    v = precheck(make_command(pki, kind="test.destructive"), ctx(ledger, pki.bundle()))
    assert isinstance(v, Accept)
    assert (v.flags.destructive, v.flags.self_terminating) == (True, False)


def test_unbatched_allowance_message_and_a_counted_command_passing_again(
    pki: Pki, ledger: QuorumLedger
) -> None:
    """A destructive command already counted in the hour (redelivered, or re-executed after a restart) is
    admitted again with the allowance used up: the ledger is asked about this command's own id."""
    c = ctx(ledger, pki.bundle(approvers=3, allowance=1))
    cmd = make_command(pki, kind="test.destructive")
    v = precheck(cmd, c)
    assert isinstance(v, Accept) and v.claim == UnbatchedClaim()
    ledger.record_unbatched(cmd.id, NOW.timestamp())
    again = precheck(cmd, c)
    assert isinstance(again, Accept) and again.claim == UnbatchedClaim()
    v2 = _reject(precheck(make_command(pki, kind="test.destructive"), c))
    assert (v2.reason, v2.message) == (
        RejectReason.UNBATCHED_LIMIT,
        "destructive test.destructive without a batch: the hourly allowance of unbatched destructive "
        "commands is used up",
    )


def test_batch_approval_is_checked_at_server_time(pki: Pki, ledger: QuorumLedger) -> None:
    """An approval with an expiry: accepted before it at the context's server time, refused after it."""
    c = ctx(ledger, pki.bundle(approvers=3, required=2))
    cid = ulid()
    end_ms = int((NOW + dt.timedelta(minutes=5)).timestamp() * 1000)
    batch = build_batch("b-t", [leaf_for(cid, "test.destructive")], "timed", not_after_ms=end_ms)
    sigs = [approve(pki.approvers[i], f"approver-{i}", batch.scope) for i in (0, 1)]
    pair = (wire.BatchApproval(scope=batch.scope, signatures=sigs), batch.proof(0))
    cmd = make_command(pki, id=cid, kind="test.destructive", batch_id="b-t", batch=pair)
    v = precheck(cmd, c)
    assert isinstance(v, Accept) and isinstance(v.claim, LeafClaim)
    assert v.claim.admission.expires_at == end_ms / 1000
    late = attrs.evolve(c, server_now=NOW + dt.timedelta(minutes=6))
    cmd_late = make_command(
        pki,
        id=cid,
        kind="test.destructive",
        batch_id="b-t",
        batch=pair,
        not_after=T0 + dt.timedelta(minutes=30),
    )
    v = _reject(precheck(cmd_late, late))
    assert v.reason is RejectReason.BATCH_UNAPPROVED and "scope-expired" in v.message
