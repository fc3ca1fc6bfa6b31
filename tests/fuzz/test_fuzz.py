"""The fuzz targets in CI: every committed seed replays clean, and each target runs under atheris for a
short while (20 s under CI; BCD_FUZZ_SECONDS overrides). The long runs and their exec counts are in
docs/testing.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz import targets

ROOT = Path(__file__).resolve().parents[2]
SECONDS = int(os.environ.get("BCD_FUZZ_SECONDS", "20" if os.environ.get("CI") == "true" else "3"))


@pytest.mark.parametrize("name", sorted(targets.RUNNERS))
def test_every_target_has_a_seed_corpus(name: str) -> None:
    assert len(targets.seeds(name)) >= 2, f"tests/fuzz/corpus/{name} needs seeds (tests/fuzz/make_corpus.py)"


@pytest.mark.parametrize("name", sorted(targets.RUNNERS))
def test_corpus_replays_with_documented_errors_only(name: str) -> None:
    for seed in targets.seeds(name):
        targets.call(name, seed.read_bytes())


@pytest.mark.parametrize("name", sorted(targets.RUNNERS))
def test_fuzz_target_runs_clean(name: str, tmp_path: Path) -> None:
    """A crash (an undocumented exception, or one input over 1 s) fails with the input's path."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/fuzz/run.py"),
            name,
            f"--seconds={SECONDS}",
            f"--artifacts={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS + 120,
        cwd=ROOT,
    )
    crashes = sorted(p.name for p in tmp_path.iterdir())
    assert proc.returncode == 0 and not crashes, (crashes, proc.stderr[-3000:])
    assert "stat::number_of_executed_units" in proc.stderr


def test_the_ulid_of_a_body_with_bad_utf8_is_not_reported() -> None:
    """Found by the command target: a body whose id is not UTF-8 made the lenient id read crash with
    TypeError instead of refusing the command."""
    from bcd_agent.dispatch.command import InvalidCommand
    from bcd_agent.dispatch.wire import envelope_from_wire
    from bcd_shared import wire

    raw = bytes.fromhex(
        "0b1a30314152 5a5136394700000000354641571206 6e6f64652d6122096770752e72657d6565".replace(" ", "")
    )
    with pytest.raises(InvalidCommand) as exc:
        envelope_from_wire(wire.Command(body=raw))
    assert exc.value.command_id == ""
