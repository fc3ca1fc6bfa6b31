"""`driver.invoke` is refused on every agent with a precise reason, before anything runs: bcd hosts no
driver plugins (docs/open-questions.md Q-BCD-DRV-01). Covers DLV-KIND-01 (a kind without a handler on this
agent is UNSUPPORTED)."""

from __future__ import annotations

from pathlib import Path

from bcd_agent.dispatch.acceptance import Reject, precheck
from bcd_agent.dispatch.command import RejectReason
from bcd_agent.dispatch.kinds import KINDS, Role
from bcd_agent.dispatch.quorum import QuorumLedger
from dispatch.dhelpers import Pki, make_command
from dispatch.test_acceptance import ctx


def test_DLV_KIND_01_driver_invoke_is_unsupported_naming_why(tmp_path: Path) -> None:
    pki = Pki.build()
    ledger = QuorumLedger.open(tmp_path)
    supported = frozenset(KINDS) - {"driver.invoke"}
    for role in (Role.NODE, Role.SITE, Role.RAMDISK):
        verdict = precheck(
            make_command(pki, kind="driver.invoke"), ctx(ledger, pki.bundle(), role=role, supported=supported)
        )
        assert isinstance(verdict, Reject) and verdict.reason is RejectReason.UNSUPPORTED
        assert verdict.message.startswith("kind driver.invoke: bcd hosts no driver plugins"), verdict.message
        assert "Q-BCD-DRV-01" in verdict.message
    other = precheck(
        make_command(pki, kind="diag.nvml"), ctx(ledger, pki.bundle(), supported=frozenset({"driver.invoke"}))
    )
    assert isinstance(other, Reject) and other.message == "kind diag.nvml has no handler on this agent"
