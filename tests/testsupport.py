"""Constants and helpers for the whole suite.

Import as `from testsupport import REPO, REFERENCE, require_tool` (tests/ is on pytest's pythonpath).
Never import these from the conftest module: a conftest.py in a subfolder would shadow the top-level one.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from bcd_agent.session.identity import Identity

REPO = Path(__file__).resolve().parent.parent
# ../shared/ beside the checkout: read-only reference data (seeds, CDI schema, nvidia-smi output).
# BCD_SHARED_MATERIAL names it where the suite runs from a copy (mutation testing's staging tree).
SHARED = Path(os.environ.get("BCD_SHARED_MATERIAL") or REPO.parent / "shared")
REFERENCE = SHARED / "reference"
IN_CI = os.environ.get("CI") == "true"


def require_tool(name: str) -> str:
    """The path of a real tool; skipped locally when missing, a failure under CI=true."""
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is missing under CI: .ci/run must install it")
        pytest.skip(f"{name} not installed")
    return path


def qemu_img_create(path: Path, size: int, *opts: str, fmt: str = "qcow2") -> Path:
    """`qemu-img create` of a test image. A LUKS image's PBKDF benchmark fails now and then on a loaded
    machine ("Unable to get accurate CPU usage": tick-based thread CPU time reads 0 ms): tried again."""
    argv = [require_tool("qemu-img"), "create", "-q", "-f", fmt, *opts, str(path), str(size)]
    for _ in range(4):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode == 0 or "accurate CPU usage" not in done.stderr:
            break
    if done.returncode != 0:
        raise AssertionError(f"{argv}: exit {done.returncode}: {done.stderr}")
    return path


def require_root(why: str) -> None:
    """Root (for `why`); skipped locally without it, a failure under CI=true (CI runs as root)."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail(f"needs root under CI: {why}")
        pytest.skip(f"needs root: {why}")


def require_shared(path: Path) -> Path:
    """A file of ../shared/ (seeds, reference data); skipped locally when missing, a failure under CI."""
    if not path.exists():
        if IN_CI:
            pytest.fail(f"{path} is missing under CI (CI lays ../shared/ beside the checkout)")
        pytest.skip(f"{path} not present beside this checkout")
    return path


def wait_until(
    what: str,
    check: Callable[[], Any],
    timeout: float = 30.0,
    errors: tuple[type[Exception], ...] = (OSError,),
) -> Any:
    """`check()`'s first true result, tried every 0.1 s (`errors` it raises meanwhile count as not yet);
    after `timeout` seconds an AssertionError naming `what` and the last result or error."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except errors as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def systemd_root(tmp_path: Path, programs: Iterable[str] = ()) -> Path:
    """A directory standing for / under `systemd-analyze verify --root`: the system's own units (so targets
    resolve), an empty etc/systemd/system for the units under test, and executable stand-ins for
    `programs` (verify checks that ExecStart's program exists)."""
    root = tmp_path / "root"
    system_units = next(
        p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()
    )
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for prog in programs:
        path = root / prog.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    return root


def systemd_verify(root: Path, unit: str) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` of /etc/systemd/system/`unit` under `root` (a `systemd_root`)."""
    tool = require_tool("systemd-analyze")
    return subprocess.run(
        [tool, "verify", "--man=no", f"--root={root}", f"/etc/systemd/system/{unit}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def node_identity(
    node_id: str, not_before: dt.datetime, not_after: dt.datetime, address: str = ""
) -> Identity:
    """A bcd_agent identity as `bcd join` leaves one: a fresh node key, its certificate valid from
    `not_before` to `not_after` from a throwaway node CA (valid a day longer), and the pin of a join key
    nobody holds."""
    from bcd_agent.session.identity import Identity  # here: the suite's other helpers need no agent
    from bcd_shared.pki import KeyPair, issue_node_certificate, issue_root
    from bcd_shared.pki.pins import JoinKeyPin

    ca_key, node_key = KeyPair.generate(), KeyPair.generate()
    ca = issue_root(ca_key, "node ca", not_before, not_after + dt.timedelta(days=1), path_length=0)
    cert = issue_node_certificate(ca, ca_key, node_key.public_key, node_id, not_before, not_after)
    pin = str(JoinKeyPin.of_key(KeyPair.generate().public_key))
    return Identity(node_id, node_key, (cert,), pin, address=address)
