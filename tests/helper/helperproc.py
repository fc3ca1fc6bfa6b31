"""Run a real `bcd helper serve` process over a simulated host, and talk to it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bcd_agent.helperclient import HelperClient
from bcd_simhost.seed import seed
from hypothesis import HealthCheck, settings
from testsupport import require_root, require_tool

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI") == "true"

# Hypothesis profiles: helper-dev (default, small) and helper-ci (1000 examples per property), chosen
# by CI=true or BCD_HYPOTHESIS_PROFILE.
settings.register_profile(
    "helper-ci",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "helper-dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PROFILE = os.environ.get("BCD_HYPOTHESIS_PROFILE") or ("helper-ci" if IN_CI else "helper-dev")
HELPER_SETTINGS = settings.get_profile(PROFILE)
AUDIT_DIR = "/var/log/bcd-helper"
SOCKET = "/run/bcd/helper.sock"


def write_config(root: Path, text: str, mode: int = 0o640) -> Path:
    path = root / "etc/bcd/config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o750)
    path.write_text(text)
    os.chmod(path, mode)
    return path


def base_config(node_uid: int = 4242, node_gid: int = 4242, extra: str = "") -> str:
    return f'[helper]\nsocket = "{SOCKET}"\nnode_uid = {node_uid}\nnode_gid = {node_gid}\n' + extra


def make_root(parent: Path) -> Path:
    root = parent / "host"
    seed(root)
    for p in [parent, root]:
        os.chmod(p, 0o755)
    return root


class HelperProcess:
    def __init__(
        self,
        root: Path,
        config: str | None = None,
        prefix: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        *,
        netns: bool = False,
    ) -> None:
        """`prefix`: run the helper under it; `env`: added to the environment; `netns`: in a network
        namespace of its own (`unshare -n`, BCD_SIM_NETNS=1: the simulated host's `ip` and `nft` are the
        real ones there, see `require_netns` and `in_netns`)."""
        if netns:
            prefix = ("unshare", "-n", *prefix)
            env = {"BCD_SIM_NETNS": "1", **(env or {})}
        self.root = root
        if config is not None:
            write_config(root, config)
        # Set up as an operator would: the audit log's sealing key first, its verification key kept here.
        from bcd_helper.audit import init_key
        from bcd_helper.config import load_config

        self.audit_key: str | None = None
        with contextlib.suppress(Exception):  # a config the helper refuses: the start below says why
            self.audit_key = init_key(root, load_config(root).audit_dir)
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "bcd_helper.cli", "serve", "--root", str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **env} if env else None,
        )
        self.socket_path = str(root / SOCKET.lstrip("/"))
        deadline = time.monotonic() + 60  # a loaded machine imports and starts Python slowly
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                _out, err = self.proc.communicate()
                raise RuntimeError(f"helper exited {self.proc.returncode}: {err.decode()}")
            if os.path.exists(self.socket_path):
                try:
                    HelperClient(self.socket_path).ping()
                    break
                except Exception:
                    pass
            time.sleep(0.02)
        else:
            self.stop()
            raise RuntimeError("helper did not start")
        self.client = HelperClient(self.socket_path)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def in_netns(self, *argv: str) -> bytes:
        """`argv` run in the network namespace of a helper started with `netns` (unshare execs the helper:
        the same pid, in the new namespace); its output."""
        return subprocess.run(
            ["nsenter", "-t", str(self.proc.pid), "-n", *argv], check=True, capture_output=True
        ).stdout

    def raw(self, doc: Any) -> dict[str, Any]:
        """Send a raw request document on a fresh connection; the answer."""
        import json
        import struct

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(self.socket_path)
            body = json.dumps(doc).encode()
            s.sendall(struct.pack(">I", len(body)) + body)
            n = struct.unpack(">I", _recv(s, 4))[0]
            return dict(json.loads(_recv(s, n)))

    def audit_lines(self) -> list[dict[str, Any]]:
        import json

        path = self.root / AUDIT_DIR.lstrip("/") / "audit.log"
        return [json.loads(line) for line in path.read_bytes().split(b"\n") if line]

    def last_audit(self) -> dict[str, Any]:
        """The newest audit entry, read from the end of the log (the log grows over a session)."""
        import json

        path = self.root / AUDIT_DIR.lstrip("/") / "audit.log"
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            data = f.read().rstrip(b"\n")
        return dict(json.loads(data.rsplit(b"\n", 1)[-1]))


def require_netns(*tools: str) -> None:
    """What a helper started with `netns` needs: root (unshare -n), nsenter and `tools`; skipped locally
    without them, a failure under CI."""
    for tool in ("unshare", "nsenter", *tools):
        require_tool(tool)
    require_root("unshare -n")


def assert_refused(h: HelperProcess, doc: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
    """Send `doc`: it must be refused (for `reason` when given), audited as the next line (refused, with
    the answer's reason), and leave the tree under the simulated root unchanged. The answer."""
    before = tree(h.root)
    seq = h.last_audit()["seq"]
    answer = h.raw(doc)
    assert answer["ok"] is False and answer["error"] == "refused", (doc, answer)
    if reason is not None:
        assert answer["reason"] == reason, answer
    last = h.last_audit()
    assert (last["seq"], last["decision"], last["reason"]) == (seq + 1, "refused", answer["reason"])
    assert tree(h.root) == before
    return answer


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}


def tree(root: Path, skip: tuple[str, ...] = (AUDIT_DIR, SOCKET)) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under root: (mode, uid, gid, content digest or link target), minus `skip`."""
    skipped = {str(root / s.lstrip("/")) for s in skip}
    out: dict[str, tuple[int, int, int, str]] = {}

    def walk(d: str) -> Iterator[os.DirEntry[str]]:
        with os.scandir(d) as it:
            for e in it:
                if e.path in skipped:
                    continue
                yield e
                if e.is_dir(follow_symlinks=False):
                    yield from walk(e.path)

    for e in walk(str(root)):
        st = e.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            # Any change to a file's bytes moves its ctime, so a digest is reused only while
            # (inode, size, mtime, ctime) stay the same.
            key = (e.path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            what = _DIGESTS.get(key, "")
            if not what:
                with open(e.path, "rb") as f:
                    what = _DIGESTS[key] = hashlib.sha256(f.read()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            what = os.readlink(e.path)
        else:
            what = ""
        out[os.path.relpath(e.path, root)] = (st.st_mode, st.st_uid, st.st_gid, what)
    return out
