"""Download a release into the node's staging directory (blocking; run it in a worker thread).

The node, never root, fetches the URL (https only, TLS verified against the system's CAs or the context
given), streams it into `.<name>.<random>.part` (created O_EXCL|O_NOFOLLOW, 0600) while hashing it,
stops at `max_bytes` (`release-too-large`), fsyncs it, and renames it to `<name>` only when its SHA-256
is the signed one (`artifact-mismatch`, the partial file removed); the directory is fsynced. The staging
directory itself is made 0700 when missing. An existing file of the right digest is kept (no second
download after a crash between the download and the swap).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Final

from bcd_shared.errors import RetryableError, TerminalError

MAX_RELEASE_BYTES: Final = 256 * 1024 * 1024  # the helper's own limit
CHUNK: Final = 1024 * 1024


def staged_sha256(staging: Path, name: str) -> str | None:
    """The SHA-256 of the staged file `name`, None when there is none (or it is not a regular file)."""
    try:
        fd = os.open(staging / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not os.path.isfile(f"/proc/self/fd/{f.fileno()}"):
            return None
        digest = hashlib.sha256()
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_staging(staging: Path) -> None:
    staging.mkdir(mode=0o700, parents=False, exist_ok=True)


def download(
    url: str,
    sha256: str,
    staging: Path,
    name: str,
    *,
    context: ssl.SSLContext | None = None,
    timeout_s: float = 60.0,
    deadline_s: float = 600.0,
    max_bytes: int = MAX_RELEASE_BYTES,
) -> Path:
    """Fetch `url` into `staging/name` when its SHA-256 is `sha256`; the path. RetryableError for the
    network, TerminalError for a release whose bytes are not the signed ones or are too large."""
    if not url.startswith("https://"):
        raise TerminalError("InvalidRelease", f"{url[:80]!r} is not an https URL")
    prepare_staging(staging)
    target = staging / name
    if staged_sha256(staging, name) == sha256:
        return target
    part = f".{name}.{os.urandom(6).hex()}.part"
    ctx = context if context is not None else ssl.create_default_context()
    end = time.monotonic() + deadline_s
    dir_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(
            part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
        )
        try:
            digest = hashlib.sha256()
            size = 0
            try:
                with urllib.request.urlopen(url, timeout=timeout_s, context=ctx) as response:  # noqa: S310 (https only, above)
                    while True:
                        if time.monotonic() > end:
                            raise RetryableError(
                                "DownloadTimeout", f"{url}: not downloaded within {deadline_s:g} s"
                            )
                        chunk = response.read(CHUNK)
                        if not chunk:
                            break
                        size += len(chunk)
                        if size > max_bytes:
                            raise TerminalError("ReleaseTooLarge", f"{url}: larger than {max_bytes} bytes")
                        digest.update(chunk)
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fd, view) :]
            except (urllib.error.URLError, OSError, ssl.SSLError) as exc:
                raise RetryableError("DownloadFailed", f"{url}: {exc}") from None
            os.fsync(fd)
        finally:
            os.close(fd)
        got = digest.hexdigest()
        if got != sha256:
            raise TerminalError(
                "ArtifactMismatch", f"{url}: the download's SHA-256 {got} is not the signed {sha256}"
            )
        os.rename(part, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part, dir_fd=dir_fd)
        os.close(dir_fd)
    return target
