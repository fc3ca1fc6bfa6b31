"""`bcd bench journal` runs and reports its numbers (the targets are judged from its output, not here)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from bcd_agent.bench import BENCHES
from bcd_agent.bench import journal as bench


def test_bench_journal_reports_all_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert BENCHES["journal"] == "journal"
    monkeypatch.setattr(bench, "ROUNDS", 1)
    monkeypatch.setattr(bench, "ROUND_S", 0.02)
    monkeypatch.setattr(bench, "EVENTS_S", 0.05)
    out = bench.measure(argparse.Namespace(data_dir=str(tmp_path)))
    for key in ("raw_fsync_per_s", "accepts_per_s", "events_per_s", "accept_ratio"):
        assert isinstance(out[key], float) and out[key] > 0
    assert (out["data_dir"], out["data_dir_from"]) == (str(tmp_path), "argument")
    assert list(tmp_path.iterdir()) == []  # its work directory is removed


def test_bench_journal_measures_on_the_configured_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --data-dir the bench runs on config.toml's data_dir (the disk the journal lives on)."""
    monkeypatch.setattr(bench, "ROUNDS", 1)
    monkeypatch.setattr(bench, "ROUND_S", 0.02)
    monkeypatch.setattr(bench, "EVENTS_S", 0.05)
    data = tmp_path / "var-lib-bcd"
    data.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(f'data_dir = "{data}"\n')
    monkeypatch.setenv("BCD_CONFIG", str(config))
    out = bench.measure(argparse.Namespace(data_dir=None))
    assert (out["data_dir"], out["data_dir_from"]) == (str(data), "config")
    assert list(data.iterdir()) == []
    config.write_text(f'data_dir = "{tmp_path / "absent"}"\n')
    out = bench.measure(argparse.Namespace(data_dir=None))
    assert out["data_dir_from"] == "temporary"
