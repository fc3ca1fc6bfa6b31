"""What a release is, and `bcd release`.

A release artifact is one file: a zipapp (PEP 441) holding the pure-Python wheels of bcd-agent,
bcd-shared and bcd-helper unpacked side by side (with their `.dist-info`, so the release knows its own
version through importlib.metadata), a `__main__.py` that runs `bcd_agent.cli:main`, and the shebang
`#!/usr/bin/python3`. The third-party libraries (trio, grpclib, cryptography, ...) come from the host's
package install, whose versions the release's dist-info pins, or, on a host installed from bcd's
packages, from bcd-node's venv (PACKAGED_VENV), put before the host's site directories. The helper
installs it as `/usr/lib/bcd/releases/<version>/bcd`; `/usr/bin/bcd` points at `/usr/lib/bcd/bcd`.

`bcd release version` prints the running version; `bcd release build --out FILE WHEEL...` builds an
artifact (and prints its SHA-256, the value the control plane signs); `bcd release confirm [--config C]
[--socket S]` (the config's `[helper] socket` by default) confirms the running release to the helper
(what `bcd node` does at its first converge pass; for packaging hooks and tests).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

SHEBANG: Final = b"#!/usr/bin/python3\n"
# bcd-node's package keeps the third-party libraries in its venv, not system-wide (docs/deploy.md).
PACKAGED_VENV: Final = "/opt/bcd/node"
_MAIN: Final = """import os
import sys

# On a host installed from bcd's packages the third-party libraries live in bcd-node's venv: its
# site-packages for this interpreter goes after this archive and the standard library but before the
# host's own site directories, whose older packages (Debian's python3-cryptography) must not shadow the
# venv's; this archive's modules (first on the path) stay the ones that run (docs/daemon.md "Where it
# runs").
_libs = "%s/lib/python%%d.%%d/site-packages" %% sys.version_info[:2]
if os.path.isdir(_libs) and _libs not in sys.path:
    _site = ("site-packages", "dist-packages")
    _at = next((i for i, p in enumerate(sys.path) if i and p.rstrip("/").endswith(_site)), len(sys.path))
    sys.path.insert(_at, _libs)

from bcd_agent.cli import main

sys.exit(main())
"""


def main_source(packaged_venv: str = PACKAGED_VENV) -> str:
    """The archive's __main__.py, finding the packaged venv's libraries under `packaged_venv`."""
    if not packaged_venv.startswith("/") or any(c in packaged_venv for c in '"%\n\\'):
        raise ValueError(
            f"packaged venv {packaged_venv!r}: an absolute path without quotes, backslashes or %"
        )
    return _MAIN % packaged_venv


# Fixed timestamps and order: the same wheels make the same bytes (a reproducible SHA-256).
_EPOCH: Final = (1980, 1, 1, 0, 0, 0)
DEFAULT_HELPER_SOCKET: Final = "/run/bcd/helper.sock"  # bcd-helper.service's (docs/config.md)


def build_release(wheels: Sequence[Path], out: Path, packaged_venv: str = PACKAGED_VENV) -> str:
    """Write the zipapp of `wheels` to `out` (0755); its SHA-256. `packaged_venv`: where bcd-node's
    package keeps its venv (tests point it elsewhere)."""
    entries: dict[str, bytes] = {}
    for wheel in wheels:
        try:
            archive = zipfile.ZipFile(wheel)  # a missing file: OSError, printed as `<file>: <error>`
        except zipfile.BadZipFile:
            raise ValueError(f"{wheel}: not a wheel (not a zip archive)") from None
        with archive as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                name = info.filename
                if name.startswith("/") or ".." in name.split("/"):
                    raise ValueError(f"{wheel.name}: entry {name!r} leaves the archive")
                if name in entries:
                    raise ValueError(f"{wheel.name}: {name} is in two wheels")
                entries[name] = zf.read(info)
    entries["__main__.py"] = main_source(packaged_venv).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, _EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, entries[name])
    data = SHEBANG + buf.getvalue()
    out.write_bytes(data)
    out.chmod(0o755)
    return hashlib.sha256(data).hexdigest()


def artifact_version(path: Path) -> str:
    """The bcd-agent version a release artifact carries (its `.dist-info/METADATA`), read without running
    it. ValueError naming the file when it is not a release."""
    try:
        archive = zipfile.ZipFile(path)  # a zipapp: the shebang before the archive is allowed
    except zipfile.BadZipFile:
        raise ValueError(f"{path}: not a release artifact (not a zip archive)") from None
    with archive as zf:
        names = [n for n in zf.namelist() if n.startswith("bcd_agent-") and n.endswith(".dist-info/METADATA")]
        if len(names) != 1 or "__main__.py" not in zf.namelist():
            raise ValueError(f"{path}: not a release artifact (no __main__.py and bcd_agent's metadata)")
        for line in zf.read(names[0]).decode("utf-8", "replace").splitlines():
            if line.startswith("Version: "):
                return line.removeprefix("Version: ").strip()
    raise ValueError(f"{path}: bcd_agent's metadata names no Version")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("version", help="print the version this bcd runs")
    build = sub.add_parser("build", help="build a release artifact from wheels; prints its SHA-256")
    build.add_argument("--out", required=True, type=Path)
    build.add_argument("wheels", nargs="+", type=Path)
    confirm = sub.add_parser("confirm", help="confirm the running release to bcd helper")
    from bcd_agent.config import add_config_argument

    add_config_argument(confirm)
    confirm.add_argument(
        "--socket", default=None, help="the helper's socket (default: the config's [helper] socket)"
    )
    confirm.add_argument("--unhealthy", action="store_true", help="report unhealthy: root rolls back")


def run(args: argparse.Namespace) -> int:
    from bcd_agent.sections.daemon import running_version

    if args.action == "version":
        print(running_version())
        return 0
    from bcd_shared.subcommands import EX_DATAERR, CliError

    if args.action == "build":
        try:
            digest = build_release(args.wheels, args.out)
        except (ValueError, zipfile.BadZipFile) as exc:  # BadZipFile: a truncated member
            raise CliError(f"build: {exc}", EX_DATAERR) from None
        print(digest)
        return 0
    from bcd_shared.errors import HelperRefused

    from bcd_agent.helperclient import HelperClient

    if args.socket is None:
        # The node's own [helper] socket, as `bcd node` confirms through it; before, always the
        # default path, whatever the config said.
        from bcd_agent.config import config_of

        args.socket = config_of(args).helper.socket or DEFAULT_HELPER_SOCKET
    client = HelperClient(args.socket)
    try:
        answer = client.daemon_confirm(running_version(), healthy=not args.unhealthy)
    except HelperRefused as exc:
        # A refusal is the answer "no" (1); it goes to stderr and names the socket asked.
        print(f"bcd release confirm: {exc.reason}: {exc.message} (socket {args.socket})", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(" ".join(f"{k}={answer[k]}" for k in sorted(answer)))
    return 0
