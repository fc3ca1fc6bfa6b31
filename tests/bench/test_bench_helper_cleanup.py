"""`bcd bench helper` on its way out: every helper it started is killed and reaped, error or not, and none
holds the bench's stdout (a pipe a child keeps open leaves `bcd bench helper --json | ...` waiting).

A real run over a temporary simulated host, cut short by an error after the helpers started. Nothing is
timed here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the helper bench runs as root")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: the helper's socket path must fit in sockaddr_un (pytest's tmp_path does not)."""
    path = Path(tempfile.mkdtemp(prefix="bcdb-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_error_after_the_helpers_started_leaves_none_running(
    monkeypatch: pytest.MonkeyPatch, short_dir: Path
) -> None:
    from bcd_agent.bench import helper as bench_helper

    started: list[tuple[subprocess.Popen[bytes], dict[str, Any]]] = []
    real_popen = subprocess.Popen

    def spy(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        started.append((proc, kwargs))
        return proc

    def broken(*_args: Any) -> tuple[float, float]:
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(subprocess, "Popen", spy)
    monkeypatch.setattr(bench_helper, "STARTS", 1)
    monkeypatch.setattr(bench_helper, "_paired_rates", broken)
    with pytest.raises(RuntimeError, match="the disk went away"):
        bench_helper.measure(argparse.Namespace(data_dir=str(short_dir)))
    serves = [(p, kw) for p, kw in started if "serve" in p.args]
    assert len(serves) == 2  # the first, unmeasured start and the one measured
    for proc, kwargs in serves:
        assert proc.returncode is not None, proc.args  # killed and reaped
        assert kwargs.get("stdin") == subprocess.DEVNULL and kwargs.get("stdout") == subprocess.DEVNULL
        assert kwargs.get("stderr") not in (None, subprocess.PIPE)  # a file of the bench's own
    assert list(short_dir.iterdir()) == []  # the simulated host is gone too
