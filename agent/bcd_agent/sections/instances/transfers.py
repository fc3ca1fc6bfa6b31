"""Snapshot transfers: the `restore_from` download and the `instance.snapshot` upload, with curl.

Both (DLV-SNAP-02, -14, -16..18): https only, redirects followed only to https (`--proto =https
--proto-redir =https`); TLS verified against the system's CAs or an explicit CA file (`cacert`, for a
private object store and for tests); a transfer ends when a window of `stall_s` (2 minutes) moves less
than `stall_bytes` (1 MiB; curl's `--speed-limit` of stall_bytes/stall_s bytes per second over
`--speed-time`), or after `max_s` (6 hours) in all. curl exits 28 for both; which rule ended it is told
by the elapsed time.

The outcome is a `TransferFailed` with a `code` (Q-DLV-SNAP-01): `transfer-stalled` (DLV-SNAP-17),
`transfer-timeout` (DLV-SNAP-18), `transfer-refused` (a non-https URL or redirect), `transfer-too-large`
(a download over its `max_bytes`: announced by Content-Length, curl refuses it before any byte
(`--max-filesize`); a body without one is measured once it ended, as curl before 8.4 does not stop it
on the way), `transfer-failed` (anything else: DNS, TLS, an HTTP error status).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from typing import Final

from attrs import frozen
from bcd_shared.system import System

STALL_S: Final = 120
STALL_BYTES: Final = 1 << 20
MAX_S: Final = 6 * 3600
CODE_STALLED: Final = "transfer-stalled"
CODE_TIMEOUT: Final = "transfer-timeout"
CODE_REFUSED: Final = "transfer-refused"
CODE_FAILED: Final = "transfer-failed"
CODE_TOO_LARGE: Final = "transfer-too-large"
CURL_FILESIZE_EXCEEDED: Final = 63  # curl's exit status for --max-filesize


class TransferFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@frozen
class TransferRules:
    stall_s: int = STALL_S
    stall_bytes: int = STALL_BYTES
    max_s: int = MAX_S
    cacert: str | None = None  # a CA file to verify against instead of the system's

    def curl_args(self) -> list[str]:
        rate = math.ceil(self.stall_bytes / self.stall_s)
        args = [
            "curl", "--fail", "--silent", "--show-error",
            "--proto", "=https", "--proto-redir", "=https", "--location", "--max-redirs", "5",
            "--speed-limit", str(rate), "--speed-time", str(self.stall_s), "--max-time", str(self.max_s),
        ]  # fmt: skip
        if self.cacert:
            args += ["--cacert", self.cacert]
        return args


def _url_config(url: str) -> bytes:
    """The URL as curl reads it from `--config -`: a presigned URL's signature never shows in argv."""
    return ('url = "' + url.replace("\\", "\\\\").replace('"', '\\"') + '"\n').encode()


def _check_url(url: str, field: str) -> None:
    if not url.startswith("https://") or any(c.isspace() or ord(c) < 32 for c in url) or len(url) > 8192:
        raise TransferFailed(CODE_REFUSED, f"{field}: not an https URL (snapshots travel over https only)")


def _outcome(what: str, returncode: int, stderr: bytes, elapsed: float, rules: TransferRules) -> None:
    if returncode == 0:
        return
    text = stderr.decode(errors="replace").strip()[:300]
    if returncode == 28:
        if elapsed >= rules.max_s - 1:
            raise TransferFailed(CODE_TIMEOUT, f"the {what} did not end within {rules.max_s} s: {text}")
        raise TransferFailed(
            CODE_STALLED,
            f"the {what} moved less than {rules.stall_bytes} bytes in {rules.stall_s} s: {text}",
        )
    if returncode == 1 and "protocol" in text.lower():
        raise TransferFailed(CODE_REFUSED, f"the {what} was redirected off https: {text}")
    raise TransferFailed(CODE_FAILED, f"the {what} failed (curl exit {returncode}): {text}")


def download(
    system: System,
    url: str,
    dest: str,
    rules: TransferRules,
    clock: Callable[[], float] = time.monotonic,
    max_bytes: int | None = None,
) -> str:
    """GET `url` into the real path `dest` (created or truncated); its SHA-256. Over `max_bytes`
    (None: no cap): TransferFailed `transfer-too-large`, `dest` left for the caller to remove."""
    _check_url(url, "restore_from.url")
    start = clock()
    cap = [] if max_bytes is None else ["--max-filesize", str(max_bytes)]
    result = system.run(
        [*rules.curl_args(), *cap, "-o", dest, "--config", "-"],
        timeout=rules.max_s + 60,
        input=_url_config(url),
    )
    if max_bytes is not None and result.returncode == CURL_FILESIZE_EXCEEDED:
        raise TransferFailed(
            CODE_TOO_LARGE, f"restore_from.url: its Content-Length is over the limit of {max_bytes} bytes"
        )
    _outcome("download", result.returncode, result.stderr, clock() - start, rules)
    if max_bytes is not None and (size := os.path.getsize(dest)) > max_bytes:
        raise TransferFailed(
            CODE_TOO_LARGE, f"restore_from.url: {size} bytes downloaded, over the limit of {max_bytes} bytes"
        )
    digest = hashlib.sha256()
    with open(dest, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def upload(
    system: System,
    url: str,
    path: str,
    rules: TransferRules,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """PUT the real file `path` to the presigned `url`; a 2xx answer or TransferFailed."""
    _check_url(url, "payload.upload_url")
    start = clock()
    argv = [*rules.curl_args(), "--upload-file", path, "-H", "Content-Type: application/x-tar"]
    result = system.run(
        [*argv, "-o", "/dev/null", "--config", "-"], timeout=rules.max_s + 60, input=_url_config(url)
    )
    _outcome("upload", result.returncode, result.stderr, clock() - start, rules)
