"""The quorum ledger at its edges: the hour's boundary for a command already counted, the leaves' grace
day, the leaf limit, and each refusal of a corrupt file naming the file, the place and the rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.dispatch import quorum
from bcd_agent.dispatch.quorum import (
    LEAF_GRACE_S,
    LEDGER_FILE,
    WINDOW_S,
    LedgerCorrupt,
    LedgerFull,
    QuorumLedger,
)

H0 = 1_800_000_000.0
S0 = 1_900_000_000.0


def test_a_command_counted_exactly_an_hour_ago_is_out_of_the_window(tmp_path: Path) -> None:
    led = QuorumLedger.open(tmp_path)
    led.record_unbatched("c1", H0)
    assert not led.unbatched_admits("c1", H0 + WINDOW_S, allowance=0)
    assert led.unbatched_admits("c1", H0 + WINDOW_S - 0.001, allowance=0)
    # Recorded again at that instant it counts anew: the old entry left the window.
    led.record_unbatched("c1", H0 + WINDOW_S)
    assert QuorumLedger.open(tmp_path).unbatched_in_window(H0 + WINDOW_S + 1) == 1


def test_leaves_are_kept_through_their_grace_day_and_forgotten_after(tmp_path: Path) -> None:
    led = QuorumLedger.open(tmp_path)
    led.record_leaf("b/1", "c1", H0, S0, expires_at=S0 + 10)
    led.record_leaf("b/2", "c2", H0, S0 + 10 + 1, expires_at=None)  # one second past the expiry
    assert led.leaf_owner("b/1") == "c1"
    led.record_leaf("b/3", "c3", H0, S0 + 10 + LEAF_GRACE_S, expires_at=None)  # exactly a day past
    assert led.leaf_owner("b/1") is None
    again = QuorumLedger.open(tmp_path)
    assert (again.leaf_owner("b/1"), again.leaf_owner("b/2"), again.leaf_owner("b/3")) == (None, "c2", "c3")


def test_the_leaf_limit_is_the_count_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quorum, "MAX_LEAVES", 2)
    led = QuorumLedger.open(tmp_path)
    led.record_leaf("b/1", "c1", H0, S0, None)
    led.record_leaf("b/2", "c2", H0, S0, None)
    with pytest.raises(LedgerFull) as exc:
        led.record_leaf("b/3", "c3", H0, S0, None)
    assert str(exc.value) == f"{tmp_path / LEDGER_FILE}: 2 batch leaves recorded"
    assert led.leaf_owner("b/3") is None


GOOD_LEAF = {"command_id": "c1", "recorded_at": 1.0, "expires_at": None}


def _doc(**fields: Any) -> dict[str, Any]:
    return {"version": 1, "unbatched": [], "leaves": {}, **fields}


@pytest.mark.parametrize(
    ("doc", "where", "rule"),
    [
        ([], "document", "must be an object with exactly version, unbatched, leaves"),
        (
            {"version": 1, "unbatched": []},
            "document",
            "must be an object with exactly version, unbatched, leaves",
        ),
        (_doc(version=2), "version", "must be 1"),
        (_doc(unbatched={}), "unbatched", "must be a list"),
        (_doc(unbatched=[[1.0]]), "unbatched[0]", "must be [host_time, command_id]"),
        (_doc(unbatched=[[1.0, 7]]), "unbatched[0]", "must be [host_time, command_id]"),
        (_doc(unbatched=["ab"]), "unbatched[0]", "must be [host_time, command_id]"),
        (_doc(unbatched=[[1.0, "c"], [True, "c"]]), "unbatched[1][0]", "must be a number"),
        (_doc(unbatched=[["1", "c"]]), "unbatched[0][0]", "must be a number"),
        (_doc(leaves=[]), "leaves", "must be an object"),
        (_doc(leaves={"b/1": []}), "leaves['b/1']", "must have exactly command_id, recorded_at, expires_at"),
        (
            _doc(leaves={"b/1": {"command_id": "c"}}),
            "leaves['b/1']",
            "must have exactly command_id, recorded_at, expires_at",
        ),
        (
            _doc(leaves={"b/1": {**GOOD_LEAF, "command_id": ""}}),
            "leaves['b/1'].command_id",
            "must be a non-empty string",
        ),
        (
            _doc(leaves={"b/1": {**GOOD_LEAF, "command_id": 5}}),
            "leaves['b/1'].command_id",
            "must be a non-empty string",
        ),
        (
            _doc(leaves={"b/1": {**GOOD_LEAF, "recorded_at": "x"}}),
            "leaves['b/1'].recorded_at",
            "must be a number",
        ),
        (
            _doc(leaves={"b/1": {**GOOD_LEAF, "expires_at": "x"}}),
            "leaves['b/1'].expires_at",
            "must be a number",
        ),
    ],
)
def test_each_corruption_is_refused_naming_the_file_place_and_rule(
    tmp_path: Path, doc: Any, where: str, rule: str
) -> None:
    path = tmp_path / LEDGER_FILE
    path.write_text(json.dumps(doc))
    with pytest.raises(LedgerCorrupt) as exc:
        QuorumLedger.open(tmp_path)
    assert str(exc.value) == f"{path}: {where}: {rule}"


def test_a_valid_file_loads_with_its_times(tmp_path: Path) -> None:
    doc = _doc(
        unbatched=[[H0, "c9"]],
        leaves={"b/1": {"command_id": "c1", "recorded_at": 3, "expires_at": 4}},
    )
    (tmp_path / LEDGER_FILE).write_text(json.dumps(doc))
    led = QuorumLedger.open(tmp_path)
    assert led.unbatched_in_window(H0 + 1) == 1 and led.unbatched_admits("c9", H0 + 1, allowance=0)
    assert led.leaf_owner("b/1") == "c1"
    led.record_leaf("b/2", "c2", H0, 4.0, None)  # rewrites the file: the loaded times come back as read
    saved = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert saved["leaves"]["b/1"] == {"command_id": "c1", "recorded_at": 3.0, "expires_at": 4.0}
