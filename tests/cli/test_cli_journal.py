"""`bcd journal`: a read-only view of the journal (meta, spec, commands, unacked results and events),
safe beside a running node that holds the data_dir lock. Covers DLV-JRN-01 (the journal's parts) as
the operator sees them."""

from __future__ import annotations

from pathlib import Path

from bcd_agent.journal import (
    CommandFlags,
    EventClass,
    Journal,
    NewCommand,
    Outcome,
    StoredSpec,
)
from clisupport import bcd, bcd_json


def _fill(j: Journal) -> None:
    j.set_node_id("node-7")
    j.store_spec(StoredSpec(4, b"\x0a\x02\x0a\x00", "sha256:abc", b"sig"))
    j.accept_command(
        NewCommand("01J0000000000000000000000A", "inventory.refresh", CommandFlags(retry_safe=True))
    )
    j.accept_command(
        NewCommand("01J0000000000000000000000B", "node.reboot", CommandFlags(self_terminating=True))
    )
    j.complete("01J0000000000000000000000A", Outcome.SUCCEEDED, body=b"result")
    j.append_event(EventClass.TRANSITION, "AllocationBound", b"bound")
    j.append_event(EventClass.RESULT, "AllocationFailed", b"failed")
    j.append_event(EventClass.METRIC, "GpuTemperature", b"t")
    j.ack_events(j.journal_id, 1)


def test_journal_json_while_the_node_holds_it(tmp_path: Path) -> None:
    with Journal.open(tmp_path, boot_id="boot-1") as j:
        _fill(j)
        before = (tmp_path / "journal.db").stat().st_mtime_ns
        rc, doc = bcd_json("journal", "--data-dir", str(tmp_path))
        assert rc == 0
        assert doc["snapshot"] is True  # the node's EXCLUSIVE lock: read from a private copy
        assert doc["meta"]["journal_id"] == j.journal_id
        assert doc["meta"]["node_id"] == "node-7"
        assert doc["meta"]["applied_generation"] == 4
        assert doc["meta"]["next_event_seq"] == 4 and doc["meta"]["acked_event_seq"] == 1
        assert doc["spec"]["generation"] == 4 and doc["spec"]["spec_hash"] == "sha256:abc"
        assert doc["spec"]["signed"] is True and doc["spec"]["size"] == 4
        states = {c["id"]: (c["state"], c["outcome"]) for c in doc["commands"]}
        assert states == {
            "01J0000000000000000000000A": ("done", "succeeded"),
            "01J0000000000000000000000B": ("accepted", None),
        }
        assert doc["unacked_results"] == ["01J0000000000000000000000A"]
        assert [(e["seq"], e["type"], e["class"]) for e in doc["unacked_events"]] == [
            (2, "AllocationFailed", "result"),
            (3, "GpuTemperature", "metric"),
        ]
        # Nothing was written: the node's journal is untouched and still works.
        assert (tmp_path / "journal.db").stat().st_mtime_ns == before
        j.append_event(EventClass.TRANSITION, "AllocationReleased", b"r")
    text = bcd("journal", "--data-dir", str(tmp_path))
    assert text.returncode == 0
    assert "snapshot" not in text.stdout.splitlines()[0]  # the node closed it: read in place
    assert "spec      generation 4, hash sha256:abc, 4 bytes (signed)" in text.stdout
    assert "UNACKED EVENTS (3)" in text.stdout
    assert "AllocationReleased" in text.stdout
    assert "UNACKED" in text.stdout.split("01J0000000000000000000000A")[1].splitlines()[0]


def test_journal_missing_is_an_error(tmp_path: Path) -> None:
    res = bcd("journal", "--data-dir", str(tmp_path))
    assert res.returncode == 66  # EX_NOINPUT
    assert "no journal here" in res.stderr


def test_journal_not_bcd(tmp_path: Path) -> None:
    (tmp_path / "journal.db").write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    res = bcd("journal", "--data-dir", str(tmp_path))
    assert res.returncode == 65  # EX_DATAERR
    assert "journal.db" in res.stderr
