"""The quorum ledger file: rolling hour of the host clock, persisted across restarts (DLV-QRM-03..05)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from bcd_agent.dispatch.quorum import LEDGER_FILE, WINDOW_S, LedgerCorrupt, QuorumLedger

H0 = 1_800_000_000.0


def test_DLV_QRM_03_rolling_hour_on_the_host_clock(tmp_path: Path) -> None:
    led = QuorumLedger.open(tmp_path)
    assert led.unbatched_admits("c1", H0, allowance=2)
    led.record_unbatched("c1", H0)
    led.record_unbatched("c2", H0 + 600)
    assert not led.unbatched_admits("c3", H0 + 601, allowance=2)
    assert led.unbatched_admits("c1", H0 + 601, allowance=2)  # already counted: the same run again
    assert not led.unbatched_admits("c3", H0 + WINDOW_S - 0.001, allowance=2)
    assert led.unbatched_in_window(H0 + WINDOW_S) == 1  # c1 is exactly an hour old: out of the window
    assert led.unbatched_admits("c3", H0 + WINDOW_S, allowance=2)
    assert not QuorumLedger.open(tmp_path).unbatched_admits("cx", H0, allowance=0)


def test_DLV_QRM_04_count_survives_a_restart(tmp_path: Path) -> None:
    led = QuorumLedger.open(tmp_path)
    led.record_unbatched("c1", H0)
    again = QuorumLedger.open(tmp_path)  # a new process
    assert again.unbatched_in_window(H0 + 10) == 1
    assert not again.unbatched_admits("c2", H0 + 10, allowance=1)
    path = tmp_path / LEDGER_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(tmp_path.glob(f".{LEDGER_FILE}.*"))  # no temporary files left


def test_DLV_QRM_03_clock_going_back_never_grows_the_allowance(tmp_path: Path) -> None:
    led = QuorumLedger.open(tmp_path)
    led.record_unbatched("c1", H0)
    # the host clock is set back two hours: the entry stamped "in the future" still counts
    assert not led.unbatched_admits("c2", H0 - 7200, allowance=1)


def test_DLV_QRM_05_leaf_owner_persisted_and_expired_leaves_pruned(tmp_path: Path) -> None:
    led = QuorumLedger.open(tmp_path)
    led.record_leaf("b1/aa", "c1", H0, H0, expires_at=H0 + 60)
    led.record_leaf("b2/bb", "c2", H0, H0, expires_at=None)
    led.record_leaf("b1/aa", "c1", H0, H0, expires_at=H0 + 60)  # idempotent for its own command
    with pytest.raises(ValueError, match="already admitted command c1"):
        led.record_leaf("b1/aa", "c9", H0, H0, expires_at=None)
    again = QuorumLedger.open(tmp_path)
    assert again.leaf_owner("b1/aa") == "c1" and again.leaf_owner("b2/bb") == "c2"
    # a day after its approval ended, a leaf is forgotten (the approval admits nothing any more)
    again.record_leaf("b3/cc", "c3", H0, H0 + 60 + 86400 + 1, expires_at=None)
    assert again.leaf_owner("b1/aa") is None and again.leaf_owner("b2/bb") == "c2"


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        json.dumps({"version": 2, "unbatched": [], "leaves": {}}).encode(),
        json.dumps({"version": 1, "unbatched": [], "leaves": {}, "extra": 1}).encode(),
        json.dumps({"version": 1, "unbatched": [["x", "c1"]], "leaves": {}}).encode(),
        json.dumps({"version": 1, "unbatched": [], "leaves": {"l": {"command_id": ""}}}).encode(),
    ],
)
def test_corrupt_ledger_is_refused_not_reset(tmp_path: Path, content: bytes) -> None:
    (tmp_path / LEDGER_FILE).write_bytes(content)
    with pytest.raises(LedgerCorrupt, match=LEDGER_FILE):
        QuorumLedger.open(tmp_path)
