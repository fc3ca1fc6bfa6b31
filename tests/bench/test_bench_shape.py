"""Every bench prints one shape, `--check` fails on a missed target, `bcd bench all` prints one table.

Fake bench modules stand in for the real ones (nothing is timed here: targets are judged from a bench's
output, never asserted in tests); the real modules are checked for a well-formed TARGETS table whose keys
docs/benchmarks.md documents.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from bcd_agent import bench
from testsupport import REPO


def _fake(monkeypatch: pytest.MonkeyPatch, name: str, targets: dict[str, Any], measure: Any) -> None:
    module = types.ModuleType(f"bcd_agent.bench.{name}")
    module.TARGETS = targets  # type: ignore[attr-defined]
    module.measure = measure  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(bench.BENCHES, name, name)


def _args(name: str, *, check: bool = False, json_out: bool = True) -> argparse.Namespace:
    return argparse.Namespace(name=name, check=check, json=json_out, data_dir=None)


def test_the_shape_names_the_bench_its_targets_and_whether_they_were_met() -> None:
    targets = {"a_ms": ("<=", 20.0), "rate": (">=", 0.5), "lt": ("<", 1.0), "gt": (">", 1.0)}
    out = bench.result("x", targets, {"a_ms": 20.0, "rate": 0.5, "lt": 0.99, "gt": 2, "extra": "fact"})
    assert out == {
        "bench": "x",
        "targets": {"a_ms": ["<=", 20.0], "rate": [">=", 0.5], "lt": ["<", 1.0], "gt": [">", 1.0]},
        "met": True,
        "missed": [],
        "a_ms": 20.0,
        "rate": 0.5,
        "lt": 0.99,
        "gt": 2,
        "extra": "fact",
    }
    out = bench.result("x", targets, {"a_ms": 20.1, "rate": 0.49, "lt": 1.0, "gt": 1.0})
    assert out["met"] is False and out["missed"] == ["a_ms", "rate", "lt", "gt"]


@pytest.mark.parametrize("value", [None, "12", True, math.nan])
def test_a_target_not_measured_as_a_number_is_missed(value: object) -> None:
    measured = {} if value is None else {"a_ms": value}
    out = bench.result("x", {"a_ms": ("<=", 20.0)}, measured)
    assert out["met"] is False and out["missed"] == ["a_ms"]


@pytest.mark.parametrize(
    "targets",
    [{"a": ("=<", 1.0)}, {"a": ("<=",)}, {"a": ("<=", "1")}, {"a": ("<=", True)}, {"a": ["<=", 1.0]}],
)
def test_a_malformed_targets_table_is_refused(targets: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="TARGETS"):
        bench.result("x", targets, {"a": 1.0})


def test_measured_keys_may_not_shadow_the_shape() -> None:
    with pytest.raises(ValueError, match="reserved"):
        bench.result("x", {}, {"met": 1})
    with pytest.raises(ValueError, match="reserved"):
        bench.result("x", {}, {"bench": "y"})
    assert bench.result("x", {}, {"bench": "x", "n": 1}) == {
        "bench": "x",
        "targets": {},
        "met": True,
        "missed": [],
        "n": 1,
    }


def test_check_exits_1_on_a_missed_target_and_0_without_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake(monkeypatch, "fake_slow", {"pass_ms": ("<=", 20.0)}, lambda _args: {"pass_ms": 25.0})
    assert bench.run(_args("fake_slow", check=True)) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["bench"] == "fake_slow" and printed["met"] is False and printed["missed"] == ["pass_ms"]
    assert printed["targets"] == {"pass_ms": ["<=", 20.0]} and printed["pass_ms"] == 25.0
    assert bench.run(_args("fake_slow")) == 0
    _fake(monkeypatch, "fake_fast", {"pass_ms": ("<=", 20.0)}, lambda _args: {"pass_ms": 5.0})
    assert bench.run(_args("fake_fast", check=True)) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["met"] is True


def test_a_bench_that_raises_is_reported_in_the_shape_as_missed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(_args: argparse.Namespace) -> dict[str, float]:
        raise RuntimeError("the helper exited 1")

    _fake(monkeypatch, "fake_broken", {"rate": (">=", 1.0)}, broken)
    assert bench.run(_args("fake_broken", check=True)) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["error"] == "RuntimeError: the helper exited 1" and printed["missed"] == ["rate"]


def test_bench_all_runs_every_bench_and_prints_one_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "BENCHES", {})
    _fake(monkeypatch, "fake_a", {"pass_ms": ("<=", 20.0)}, lambda _args: {"pass_ms": 3.5, "n": 4})
    _fake(
        monkeypatch,
        "fake_b",
        {"rate": (">=", 100.0), "rss_mb": ("<=", 60.0)},
        lambda _a: {"rate": 50, "rss_mb": 40.0},
    )
    _fake(monkeypatch, "fake_c", {}, lambda _args: {"verify_per_s": 1000})
    assert bench.run(_args("all", check=True, json_out=False)) == 1
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out]
    assert rows[0] == ["bench", "key", "target", "measured"]
    assert ["fake_a", "pass_ms", "<=", "20", "3.5", "ok"] in rows
    assert ["fake_b", "rate", ">=", "100", "50", "MISSED"] in rows
    assert ["fake_b", "rss_mb", "<=", "60", "40", "ok"] in rows
    assert ["fake_c", "(no", "targets)", "ok"] in rows
    assert out[-1] == "2 of 3 benches met every target"
    assert bench.run(_args("all", check=False, json_out=False)) == 0
    capsys.readouterr()
    # --json: one object per bench, each in the shape.
    assert bench.run(_args("all", check=True, json_out=True)) == 1
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(o["bench"], o["met"]) for o in objects] == [
        ("fake_a", True),
        ("fake_b", False),
        ("fake_c", True),
    ]


def test_every_real_bench_has_a_well_formed_targets_table_documented_in_benchmarks_md() -> None:
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    for name, module_name in bench.BENCHES.items():
        module = importlib.import_module(f"bcd_agent.bench.{module_name}")
        targets = module.TARGETS
        bench.check_targets(targets)
        assert f"`{name}`" in doc, name
        for key in targets:
            assert f"`{key}`" in doc, f"docs/benchmarks.md does not document {name}'s target {key}"


def test_the_makefile_runs_every_bench() -> None:
    makefile = Path(REPO / "Makefile").read_text()
    assert "bcd bench all" in makefile


async def test_the_converge_benchs_export_measure_posts_every_export_to_its_receiver(tmp_path: Path) -> None:
    """`export_ms` (not judged here): the in-process export path runs end to end."""
    from bcd_agent.bench.converge import export_numbers

    numbers = await export_numbers(tmp_path / "export")
    assert numbers["export_ms"] > 0 and numbers["export_bytes"] > 1000
