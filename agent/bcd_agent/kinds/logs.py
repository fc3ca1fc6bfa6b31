"""`logs.collect` (bulk lane; node, site, ramdisk; retry-safe; 15 minutes; DLV-KIND-20).

Payload `LogsCollectRequest{upload_url, since, units, max_bytes}`: `upload_url` a presigned https URL
(required: the archive is uploaded, as the seeds do for bulk results, `instance.snapshot`'s "hashes it and
uploads it to a presigned https URL"); `since` ms since the epoch (0: this boot); `units` systemd unit
names (empty: bcd's own, `bcd-node.service` and `bcd-helper.service`); `max_bytes` the bound on what the
archive holds (0: 16 MiB; at most 256 MiB). A bad field is `invalid-payload`, naming it. No locks.

The archive, a gzipped tar built in `data_dir/logs/` (the data disk, never a tmpfs; leftovers of an
interrupted run are removed first), holds, in this order of priority within `max_bytes`:
1. `manifest.json`: what was asked (since, units, max_bytes; never the upload URL), when, and what each
   part holds;
2. `bcd/journal-summary.json`: bcd's journal (journal id, node, boot, applied generation, events pending
   and acknowledged, unacknowledged results);
3. `helper/audit.log.tail`: the newest lines of the helper's audit log (the helper's `audit.tail` op
   beside `bcd helper`; read directly as root; otherwise a line saying it cannot be read);
4. `journal/<unit>.log`: `journalctl -u <unit> --since @<s> | -b -o short-iso --no-pager` per unit, the
   remaining budget shared equally, each cut to its newest whole lines.
Every text part is redacted first (`redact`: private key blocks, bearer/basic credentials,
Authorization headers, JWTs, URL userinfo, and the value of any key whose name says token, secret,
password, api key, credential or signature). `truncated` is true when anything was cut.

Then RUNNING, and the upload: one HTTP PUT of the archive (`Content-Type: application/gzip`), TLS
verified, no redirect followed, ending when 2 minutes pass without progress or after 10 minutes in all;
a non-2xx answer fails `upload-failed`, a network error `upload-failed` too (retry-safe: the control plane
may send it again). The archive is removed afterwards. Result `LogsCollectResult{sha256, size_bytes,
truncated}` of the uploaded archive.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import trio
from bcd_shared import wire
from bcd_shared.system import System

from bcd_agent.dispatch.command import CommandEnvelope
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload, RunContext
from bcd_agent.dispatch.payload import decode_request

KIND: Final = "logs.collect"
DEFAULT_UNITS: Final = ("bcd-node.service", "bcd-helper.service")
DEFAULT_MAX: Final = 16 * 1024 * 1024
MAX_BYTES: Final = 256 * 1024 * 1024
MAX_UNITS: Final = 32
AUDIT_TAIL: Final = 256 * 1024
UNIT_RE: Final = re.compile(r"^[A-Za-z0-9:_.@\\-]{1,200}\.(service|socket|timer|mount|slice|scope|target)$")
STALL_S: Final = 120.0
UPLOAD_DEADLINE_S: Final = 600.0
LOGS_DIR: Final = "logs"
_EPOCH: Final = 0

_REDACTED: Final = "[redacted]"
_RULES: Final = (
    (
        re.compile(r"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----.*?(-----END \1PRIVATE KEY-----|\Z)", re.DOTALL),
        "[redacted private key]",
    ),
    (re.compile(r"(?i)\b((?:proxy-)?authorization\s*[:=]\s*)[^\r\n]+"), r"\1" + _REDACTED),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{6,}"), r"\1 " + _REDACTED),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{6,}\.[A-Za-z0-9_-]{6,}\.[A-Za-z0-9_-]{6,}"), "[redacted jwt]"),
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@:]+:[^\s/@]+@"), r"\1" + _REDACTED + "@"),
    (
        re.compile(
            r"(?i)([\w.-]*(?:token|secret|passw(?:or)?d|pwd|api[_-]?key|private[_-]?key|credential|signature)"
            r"[\w.-]*[\"']?\s*[:=]\s*[\"']?)([^\s\"',;&}]+)"
        ),
        r"\1" + _REDACTED,
    ),
)


def redact(text: str) -> str:
    """`text` with every secret shape bcd knows replaced (see the module)."""
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text


def _request(command: CommandEnvelope) -> wire.LogsCollectRequest:
    request = decode_request(command, wire.LogsCollectRequest)
    if not request.upload_url.startswith("https://") or any(c.isspace() for c in request.upload_url):
        raise InvalidPayload("payload.upload_url: must be a presigned https URL")
    if len(request.upload_url) > 8192:
        raise InvalidPayload("payload.upload_url: longer than 8192 characters")
    if request.since < 0:
        raise InvalidPayload("payload.since: must be 0 (this boot) or milliseconds since the epoch")
    if len(request.units) > MAX_UNITS:
        raise InvalidPayload(f"payload.units: at most {MAX_UNITS} units")
    for i, unit in enumerate(request.units):
        if not UNIT_RE.fullmatch(unit):
            raise InvalidPayload(f"payload.units[{i}]: {unit[:80]!r} is not a systemd unit name")
    if request.max_bytes > MAX_BYTES:
        raise InvalidPayload(f"payload.max_bytes: at most {MAX_BYTES}")
    return request


def _tail(data: bytes, limit: int) -> tuple[bytes, bool]:
    """The newest whole lines of `data` within `limit` bytes, and whether anything was cut."""
    if len(data) <= limit:
        return data, False
    cut = data[len(data) - limit :]
    newline = cut.find(b"\n")
    return (cut[newline + 1 :] if newline >= 0 else b""), True


def build_parts(
    system: System,
    request: wire.LogsCollectRequest,
    summary: Mapping[str, object],
    audit: str,
    now: float,
) -> tuple[list[tuple[str, bytes]], bool]:
    """The archive's members (name, bytes), redacted and within the budget; and whether any was cut."""
    budget = request.max_bytes or DEFAULT_MAX
    units = list(request.units) or list(DEFAULT_UNITS)
    since = ["--since", f"@{request.since // 1000}"] if request.since else ["-b"]
    parts: list[tuple[str, bytes]] = []
    truncated = False

    def add(name: str, text: str, share: int) -> None:
        nonlocal budget, truncated
        data, cut = _tail(redact(text).encode(), max(0, min(share, budget)))
        truncated |= cut
        budget -= len(data)
        parts.append((name, data))

    add("bcd/journal-summary.json", json.dumps(dict(summary), sort_keys=True, indent=1) + "\n", budget)
    add("helper/audit.log.tail", audit, budget)
    for n, unit in enumerate(units):
        result = system.run(["journalctl", "-u", unit, *since, "-o", "short-iso", "--no-pager"], timeout=120)
        text = result.stdout.decode(errors="replace")
        if not result.ok:
            text += (
                f"\n[journalctl exit {result.returncode}: {result.stderr.decode(errors='replace')[:500]}]\n"
            )
        add(f"journal/{unit}.log", text, budget // (len(units) - n))
    manifest = {
        "collected_at_ms": int(now * 1000),
        "since_ms": request.since,
        "units": units,
        "max_bytes": request.max_bytes or DEFAULT_MAX,
        "truncated": truncated,
        "parts": {name: len(data) for name, data in parts},
    }
    parts.insert(0, ("manifest.json", (json.dumps(manifest, sort_keys=True, indent=1) + "\n").encode()))
    return parts, truncated


def write_archive(path: Path, parts: Sequence[tuple[str, bytes]]) -> tuple[str, int]:
    """A gzipped tar of `parts` at `path` (fsynced); its SHA-256 and size."""
    import tarfile  # here, not at start: only this kind writes a tar (the idle node's memory)

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in parts:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, _EPOCH
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, blob)
        os.fsync(fd)
    finally:
        os.close(fd)
    return hashlib.sha256(blob).hexdigest(), len(blob)


def upload(url: str, path: Path, size: int, context: ssl.SSLContext | None) -> None:
    """PUT the archive to the presigned URL; CommandFailed `upload-failed` unless a 2xx answers."""
    # Imported here, not at start: urllib.request brings http.client and email (~1 MB that the idle
    # node never uses; docs/benchmarks.md, idle_rss_mb).
    import urllib.error
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None  # a presigned PUT is never redirected: the answer is the 3xx itself

    opener = urllib.request.build_opener(
        NoRedirect(), urllib.request.HTTPSHandler(context=context or ssl.create_default_context())
    )
    start = time.monotonic()
    with path.open("rb") as f:
        request = urllib.request.Request(  # noqa: S310 (https only: checked in _request)
            url,
            data=f,
            method="PUT",
            headers={"Content-Type": "application/gzip", "Content-Length": str(size)},
        )
        try:
            with opener.open(request, timeout=STALL_S) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except (urllib.error.URLError, OSError, ssl.SSLError) as exc:
            raise CommandFailed("upload-failed", f"the upload failed: {exc}") from None
    if time.monotonic() - start > UPLOAD_DEADLINE_S:
        raise CommandFailed("upload-failed", f"the upload took longer than {UPLOAD_DEADLINE_S:g} s")
    if not 200 <= status < 300:
        raise CommandFailed("upload-failed", f"the upload URL answered HTTP {status}")


class LogsCollectHandler:
    def __init__(
        self,
        system: System,
        data_dir: str | Path,
        *,
        journal_summary: Callable[[], Mapping[str, object]],
        audit_tail: Callable[[int], str] | None = None,
        ssl_context: Callable[[], ssl.SSLContext | None] = lambda: None,
    ) -> None:
        self.system = system
        self.dir = Path(data_dir) / LOGS_DIR
        self.journal_summary = journal_summary
        self.audit_tail = audit_tail
        self.ssl_context = ssl_context

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        _request(command)
        return frozenset()

    def _audit(self) -> str:
        if self.audit_tail is None:
            return "[the helper's audit log is not readable by this node: no helper and not root]\n"
        try:
            return self.audit_tail(AUDIT_TAIL)
        except Exception as exc:  # a part that cannot be read is reported in the archive
            return f"[the helper's audit log could not be read: {exc}]\n"

    def _collect(self, command: CommandEnvelope, request: wire.LogsCollectRequest, summary: Any) -> Any:
        self.dir.mkdir(mode=0o700, exist_ok=True)
        for leftover in self.dir.iterdir():  # an interrupted run's archive (one bulk worker: none runs)
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
        parts, truncated = build_parts(self.system, request, summary, self._audit(), time.time())
        path = self.dir / f"{command.id}.tar.gz"
        sha256, size = write_archive(path, parts)
        return path, sha256, size, truncated

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        request = _request(command)
        summary = dict(self.journal_summary())
        await ctx.begin_effect()
        path, sha256, size, truncated = await trio.to_thread.run_sync(
            self._collect, command, request, summary
        )
        try:
            await trio.to_thread.run_sync(upload, request.upload_url, path, size, self.ssl_context())
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return bytes(wire.LogsCollectResult(sha256=sha256, size_bytes=size, truncated=truncated))


def journal_summary(journal: Any) -> dict[str, object]:
    """What `bcd/journal-summary.json` holds, from bcd's journal (bcd_agent.journal.Journal)."""
    stats = journal.event_stats()
    return {
        "journal_id": journal.journal_id,
        "node_id": journal.node_id,
        "boot_id": journal.boot_id,
        "applied_generation": journal.applied_generation,
        "next_event_seq": journal.next_event_seq,
        "acked_event_seq": journal.acked_event_seq,
        "events_pending": stats.count,
        "events_pending_bytes": stats.bytes,
        "unacked_results": len(journal.unacked_results()),
    }
