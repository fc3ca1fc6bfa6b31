"""`logs.collect` on the simulated host: bcd's unit logs (the simulated journalctl), the helper's audit tail
and the journal summary gathered into a gzipped tar, secrets redacted, bounded by max_bytes, and uploaded
with a PUT to a real HTTPS server (the presigned-URL way the seeds give bulk results).

Covers DLV-KIND-20 (logs.collect runs on the node role: a handler bcd node registers)."""

from __future__ import annotations

import hashlib
import http.server
import io
import ssl
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload
from bcd_agent.kinds.logs import LogsCollectHandler, redact
from bcd_shared import wire
from bcd_shared.wire.strict import type_url
from bcd_simhost import sim_system
from dispatch.dhelpers import EffectCtx, make_command
from tlskit import https_server, make_tls

SECRETS = (
    "hunter2-password-value",
    "s3cr3t-token-value",
    "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJub2RlLWEifQ.c2lnbmF0dXJlLWJ5dGVz",
    "AKIAEXAMPLEKEYVALUE",
    "MHcCAQEEIBm3d4b4S3Qprivatekeybytes",
    "Zm9vOmJhcg-basic-cred",
)
NODE_LOG = """2026-12-01T10:00:00+0000 host bcd[100]: node: started, version 1.0.0
2026-12-01T10:00:01+0000 host bcd[100]: session: connected with Authorization: Bearer s3cr3t-token-value
2026-12-01T10:00:02+0000 host bcd[100]: secrets: fetched {"password": "hunter2-password-value"}
2026-12-01T10:00:03+0000 host bcd[100]: tk eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJub2RlLWEifQ.c2lnbmF0dXJlLWJ5dGVz
2026-12-01T12:00:00+0000 host bcd[100]: upload to https://user:pw@x.example/p?X-Amz-Credential=AKIAEXAMPLEKEYVALUE
2026-12-01T12:00:01+0000 host bcd[100]: -----BEGIN EC PRIVATE KEY-----
MHcCAQEEIBm3d4b4S3Qprivatekeybytes
-----END EC PRIVATE KEY-----
2026-12-01T12:00:02+0000 host bcd[100]: proxy auth Basic Zm9vOmJhcg-basic-cred
"""
HELPER_LOG = "2026-12-01T11:00:00+0000 host bcd-helper[90]: helper: serving /run/bcd/helper.sock\n"
AUDIT = (
    '{"seq":1,"op":"file.write","decision":"accepted"}\n{"seq":2,"op":"helper.ping","decision":"accepted"}\n'
)


class Receiver:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.status = 200


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path, Receiver]]:
    """An HTTPS server taking PUTs: (base URL, CA file, what it received)."""
    ca, cert, key = make_tls(tmp_path)
    got = Receiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            got.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(got.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with https_server(Handler, cert, key) as base:
        yield base, ca, got


def _host(root: Path) -> None:
    journal = root / "var/lib/bcd-sim/journal"
    journal.mkdir(parents=True, exist_ok=True)
    (journal / "bcd-node.service.log").write_text(NODE_LOG)
    (journal / "bcd-helper.service.log").write_text(HELPER_LOG)
    (root / "var/lib/bcd").mkdir(parents=True, exist_ok=True)


def _handler(root: Path, ca: Path, audit: Any = lambda n: AUDIT) -> LogsCollectHandler:
    return LogsCollectHandler(
        sim_system(root),
        root / "var/lib/bcd",
        journal_summary=lambda: {"journal_id": "j-1", "applied_generation": 7, "events_pending": 2},
        audit_tail=audit,
        ssl_context=lambda: ssl.create_default_context(cafile=str(ca)),
    )


def _command(url: str, **kw: Any) -> Any:
    request = wire.LogsCollectRequest(upload_url=url, **kw)
    return make_command(kind="logs.collect", payload=(type_url(wire.LogsCollectRequest), bytes(request)))


def _members(blob: bytes) -> dict[str, str]:
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}  # type: ignore[union-attr]


async def test_DLV_KIND_20_collects_redacts_and_uploads(
    sim_root: Path, server: tuple[str, Path, Receiver]
) -> None:
    base, ca, got = server
    _host(sim_root)
    url = f"{base}/bucket/logs.tar.gz?X-Amz-Signature=presigned-sig-value"
    with trio.fail_after(30):
        out = await _handler(sim_root, ca).run(_command(url), EffectCtx())
    result = wire.LogsCollectResult.parse(out)
    [blob] = got.bodies
    assert (result.sha256, result.size_bytes, result.truncated) == (
        hashlib.sha256(blob).hexdigest(),
        len(blob),
        False,
    )
    members = _members(blob)
    assert list(members) == [
        "manifest.json",
        "bcd/journal-summary.json",
        "helper/audit.log.tail",
        "journal/bcd-node.service.log",
        "journal/bcd-helper.service.log",
    ]
    everything = "".join(members.values())
    for secret in (*SECRETS, "presigned-sig-value", "user:pw"):
        assert secret not in everything, secret
    assert "bucket/logs.tar.gz" not in everything  # the upload URL is never in the archive
    assert "node: started, version 1.0.0" in members["journal/bcd-node.service.log"]
    assert "[redacted private key]" in members["journal/bcd-node.service.log"]
    assert '"applied_generation": 7' in members["bcd/journal-summary.json"]
    assert members["helper/audit.log.tail"] == AUDIT
    assert members["journal/bcd-helper.service.log"] == HELPER_LOG
    assert list((sim_root / "var/lib/bcd/logs").iterdir()) == []  # the archive is removed after the upload


async def test_since_and_max_bytes_bound_what_is_collected(
    sim_root: Path, server: tuple[str, Path, Receiver]
) -> None:
    base, ca, got = server
    _host(sim_root)
    since_ms = 1796119200000  # 2026-12-01T11:00:00Z: only the later node lines
    command = _command(f"{base}/a", since=since_ms, units=["bcd-node.service"], max_bytes=400)
    with trio.fail_after(30):
        result = wire.LogsCollectResult.parse(await _handler(sim_root, ca).run(command, EffectCtx()))
    members = _members(got.bodies[-1])
    assert result.truncated is True
    assert sum(len(v.encode()) for k, v in members.items() if k != "manifest.json") <= 400
    assert "version 1.0.0" not in members["journal/bcd-node.service.log"]
    assert '"truncated": true' in members["manifest.json"]


async def test_an_upload_refused_fails_and_a_bad_payload_is_invalid(
    sim_root: Path, server: tuple[str, Path, Receiver]
) -> None:
    base, ca, got = server
    _host(sim_root)
    got.status = 403
    handler = _handler(sim_root, ca, audit=None)
    with pytest.raises(CommandFailed) as info:
        await handler.run(_command(f"{base}/a"), EffectCtx())
    assert (info.value.code, info.value.message) == ("upload-failed", "the upload URL answered HTTP 403")
    for bad, field in [
        ({"upload_url": "http://x/y"}, "payload.upload_url"),
        ({"upload_url": "https://x/y", "units": ["../../etc/passwd"]}, "payload.units[0]"),
        ({"upload_url": "https://x/y", "max_bytes": 1 << 40}, "payload.max_bytes"),
        ({"upload_url": "https://x/y", "since": -1}, "payload.since"),
    ]:
        request = wire.LogsCollectRequest(**bad)
        command = make_command(
            kind="logs.collect", payload=(type_url(wire.LogsCollectRequest), bytes(request))
        )
        with pytest.raises(InvalidPayload) as invalid:
            handler.resources(command)
        assert invalid.value.message.startswith(field)


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("Authorization: Bearer abcdef123456", "Authorization: [redacted]"),
        ("token=abc123 next", "token=[redacted] next"),
        ('{"client_secret": "xyz"}', '{"client_secret": "[redacted]"}'),
        ("https://u:p@host/x", "https://[redacted]@host/x"),
        ("nothing secret here: gpu 0 ok", "nothing secret here: gpu 0 ok"),
    ],
)
def test_redact(text: str, kept: str) -> None:
    assert redact(text) == kept
