"""The committed generated code is exactly what `make proto` produces from proto/bcd/v1."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from bcd_agent.tools import genproto
from testsupport import REPO


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    if shutil.which("protoc-gen-python_betterproto2", path=str(REPO / ".venv" / "bin")) is None:
        pytest.fail(
            "the betterproto2 compiler plugin is missing from .venv/bin (pip install -e './agent[dev]')"
        )
    shared_out, agent_out = tmp_path / "shared", tmp_path / "agent"
    genproto.generate(shared_out, agent_out)
    for generated, committed in ((shared_out, genproto.SHARED_GEN), (agent_out, genproto.AGENT_GEN)):
        fresh, current = _tree(generated), _tree(committed)
        assert sorted(fresh) == sorted(current), f"{committed}: files differ; run `make proto`"
        stale = [name for name in fresh if fresh[name] != current[name]]
        assert stale == [], f"{committed}: {stale} differ from proto/; run `make proto`"


def test_generation_is_deterministic(tmp_path: Path) -> None:
    genproto.generate(tmp_path / "a" / "s", tmp_path / "a" / "g")
    genproto.generate(tmp_path / "b" / "s", tmp_path / "b" / "g")
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
