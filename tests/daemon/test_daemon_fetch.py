"""The node's release download (agent/bcd_agent/sections/daemon/fetch.py) against a real HTTPS server:
kept only with the signed SHA-256, bounded in size, https only, and not downloaded twice."""

from __future__ import annotations

import functools
import hashlib
import http.server
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.sections.daemon.fetch import download, staged_sha256
from bcd_shared.errors import RetryableError, TerminalError
from tlskit import https_server, make_tls

RELEASE = b"#!/usr/bin/python3\n" + bytes(range(256)) * 64


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, ssl.SSLContext, list[str]]]:
    ca, cert, key = make_tls(tmp_path)
    www = tmp_path / "www"
    www.mkdir()
    (www / "bcd").write_bytes(RELEASE)
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            super().do_GET()

        def log_message(self, *args: Any) -> None:
            pass

    with https_server(functools.partial(Handler, directory=str(www)), cert, key) as base:
        yield base, ssl.create_default_context(cafile=str(ca)), hits


def test_download_keeps_only_the_signed_bytes(
    tmp_path: Path, served: tuple[str, ssl.SSLContext, list[str]]
) -> None:
    base, ctx, hits = served
    staging = tmp_path / "staging"
    digest = hashlib.sha256(RELEASE).hexdigest()
    path = download(f"{base}/bcd", digest, staging, "bcd-1.0.0", context=ctx)
    assert path.read_bytes() == RELEASE and (staging.stat().st_mode & 0o777) == 0o700
    assert staged_sha256(staging, "bcd-1.0.0") == digest
    download(f"{base}/bcd", digest, staging, "bcd-1.0.0", context=ctx)
    assert hits == ["/bcd"]  # the staged file is the signed one: not downloaded again
    with pytest.raises(TerminalError) as mismatch:
        download(f"{base}/bcd", "0" * 64, staging, "bcd-2.0.0", context=ctx)
    assert mismatch.value.reason == "ArtifactMismatch"
    with pytest.raises(TerminalError) as large:
        download(f"{base}/bcd", digest, staging, "bcd-3.0.0", context=ctx, max_bytes=1000)
    assert large.value.reason == "ReleaseTooLarge"
    with pytest.raises(RetryableError):
        download(f"{base}/missing", digest, staging, "bcd-4.0.0", context=ctx)
    with pytest.raises(RetryableError):  # not trusted: the system CAs do not know the test CA
        download(f"{base}/bcd", digest, staging, "bcd-5.0.0", context=ssl.create_default_context())
    with pytest.raises(TerminalError):
        download(f"http://{base[8:]}/bcd", digest, staging, "bcd-6.0.0", context=ctx)
    assert sorted(p.name for p in staging.iterdir()) == ["bcd-1.0.0"]  # nothing partial is left
