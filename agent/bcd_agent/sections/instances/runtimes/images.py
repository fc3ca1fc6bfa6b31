"""Tenant base images, one implementation for libvirt-kvm and cloud-hypervisor (DLV-LIBVIRT-03..05,
DLV-IMG-02/03, DLV-CH-05).

An image is downloaded once with curl, https only (redirects too), to a staging file
`.<sha256>.<format>.part` in the runtime's images directory, verified against the SHA-256, a qcow2
checked by its header (bcd_shared.images.check_image), made 0644 and renamed to
`<sha256>.<format>`; the staging file never outlives the attempt. A qcow2 base is checked again on
every use. What differs between the runtimes is a parameter: the directory, its mode, and how a
failed curl is described.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable

from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.images import ImageRefused, check_image
from bcd_shared.system import CommandResult, System

from bcd_agent.sections.instances.model import Image

# curl gives up on a stalled transfer (under 8 KiB/s for 2 minutes) and on one past 6 hours.
CURL_MAX_TIME_S = 21600


def make_dir(system: System, path: str, mode: int) -> None:
    """`path` (and its parents) made, and `path` set to `mode` whatever the umask."""
    real = system.host_path(path)
    real.mkdir(parents=True, exist_ok=True)
    os.chmod(real, mode)


def ensure_image(
    system: System,
    images: str,
    img: Image,
    max_virtual_size: int,
    *,
    dir_mode: int,
    describe: Callable[[CommandResult], str],
) -> str:
    """The verified base image's path, `images/<sha256>.<format>`, downloaded once into `images`
    (made with `dir_mode`); a qcow2 checked again on every call. `describe` words a failed curl."""
    path = f"{images}/{img.sha256}.{img.format}"
    make_dir(system, images, dir_mode)
    if not system.exists(path):
        download(system, images, img, max_virtual_size, describe)
    if img.format == "qcow2":
        try:
            check_image(str(system.host_path(path)), max_virtual_size)
        except ImageRefused as exc:
            raise TerminalError("BadImage", f"image {img.sha256[:12]}: {exc.message}") from None
    return path


def download(
    system: System,
    images: str,
    img: Image,
    max_virtual_size: int,
    describe: Callable[[CommandResult], str],
) -> None:
    """`img` into `images/<sha256>.<format>`, visible only once verified (see the module docstring)."""
    url = img.url
    if not url.startswith("https://"):
        raise TerminalError("BadImage", f"image {url[:200]!r}: https only")
    real = str(system.host_path(f"{images}/.{img.sha256}.{img.format}.part"))
    argv = [
        "curl", "--fail", "--silent", "--show-error", "--location",
        "--proto", "=https", "--proto-redir", "=https",
        "--speed-limit", "8738", "--speed-time", "120", "--max-time", str(CURL_MAX_TIME_S),
        "-o", real, url,
    ]  # fmt: skip
    result = system.run(argv, timeout=CURL_MAX_TIME_S + 100)
    try:
        if not result.ok:
            raise RetryableError("DownloadFailed", f"image {url[:200]}: {describe(result)}")
        digest = hashlib.sha256()
        with open(real, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != img.sha256:
            raise TerminalError(
                "BadImage", f"image {url[:200]}: SHA-256 {digest.hexdigest()} is not {img.sha256}"
            )
        if img.format == "qcow2":
            try:
                check_image(real, max_virtual_size)
            except ImageRefused as exc:
                raise TerminalError("BadImage", f"image {url[:200]}: {exc.message}") from None
        os.chmod(real, 0o644)
        os.replace(real, str(system.host_path(f"{images}/{img.sha256}.{img.format}")))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(real)
