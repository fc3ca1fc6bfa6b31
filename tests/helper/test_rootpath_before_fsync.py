"""write_root_only's `before_fsync` hook (the helper's audit line goes ahead of a file.write there): called
once, after every refusal, with the data in the temporary file and before its fsync and the rename."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bcd_shared.rootpath import RootPathRefused, write_root_only


def make_root(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    root.mkdir(mode=0o755)
    return root


def test_the_hook_runs_once_with_the_data_written_before_the_fsync_and_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_root(tmp_path)
    (root / "etc/x").mkdir(parents=True)  # made beforehand: only the write's own fsyncs are counted
    events: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    def hook() -> None:
        temps = [p for p in (root / "etc/x").iterdir() if p.name.endswith(".tmp")]
        assert [p.read_bytes() for p in temps] == [b"data"]  # the data is in the temporary file
        assert not (root / "etc/x/f.conf").exists()  # not renamed yet
        events.append("hook")

    write_root_only(root, "/etc/x/f.conf", b"data", 0o644, before_fsync=hook)
    assert events == ["hook", "fsync", "fsync"]  # then the file's fsync and the directory's
    assert (root / "etc/x/f.conf").read_bytes() == b"data"


def test_a_refusal_comes_before_the_hook(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    called: list[int] = []

    def limit(_dfd: int) -> None:
        raise RootPathRefused("/etc/x", "over the limit")

    with pytest.raises(RootPathRefused):
        write_root_only(root, "/etc/x/f.conf", b"data", check=limit, before_fsync=lambda: called.append(1))
    (root / "etc/x/g.conf").mkdir(parents=True)
    with pytest.raises(RootPathRefused, match="not a regular file"):
        write_root_only(root, "/etc/x/g.conf", b"data", before_fsync=lambda: called.append(1))
    assert called == []
