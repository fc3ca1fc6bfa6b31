"""A real unprivileged node against a real `bcd helper serve`: a `useradd --system` account whose programs run
through `setpriv --reuid/--regid` with the system's /usr/bin/python3 (the pyenv interpreter under /root is
not reachable by other users), over a simulated host in /var/tmp that others can traverse.

The client programs (CLIENT below) speak the helper's framing with the standard library only, as a hostile
node would; they print one JSON document on stdout for the test to read.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helperproc import SOCKET, HelperProcess, base_config, make_root
from testsupport import IN_CI, require_tool

SYS_PY = "/usr/bin/python3"

# Shared by every client program: framing, one request on a fresh connection, a ping.
CLIENT = r"""
import json, os, socket, struct, sys, threading, time
def frame(body): return struct.pack('>I', len(body)) + body
def recv_exact(s, n):
    buf = b''
    while len(buf) < n:
        c = s.recv(n - len(buf))
        if not c: return None
        buf += c
    return buf
def answer(s):
    h = recv_exact(s, 4)
    if h is None: return None
    b = recv_exact(s, struct.unpack('>I', h)[0])
    return None if b is None else json.loads(b)
def ask(path, body, timeout=30):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout); s.connect(path); s.sendall(frame(body)); return answer(s)
def req(op, **args): return json.dumps({'op': op, 'args': args}).encode()
"""


class NodeUser:
    """A real system account that stands for the node (removed by `remove`)."""

    def __init__(self) -> None:
        require_tool("useradd")
        require_tool("setpriv")
        if not os.path.exists(SYS_PY):
            if IN_CI:
                pytest.fail(f"{SYS_PY} is missing under CI: .ci/run installs python3")
            pytest.skip(f"{SYS_PY} missing")
        self.name = f"bcdn{secrets.token_hex(3)}"
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", self.name],
            check=True,
            capture_output=True,
        )
        self.uid = int(
            subprocess.run(["id", "-u", self.name], check=True, capture_output=True, text=True).stdout
        )
        self.gid = int(
            subprocess.run(["id", "-g", self.name], check=True, capture_output=True, text=True).stdout
        )

    def python(self, code: str, *args: str) -> list[str]:
        """The argv that runs the system's python3 with `code` and `args` as this user."""
        return [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--init-groups",
            SYS_PY,
            "-c",
            code,
            *args,
        ]

    def argv(self, code: str, *args: str) -> list[str]:
        """`code` after the shared client programs (CLIENT), as this user."""
        return self.python(CLIENT + code, *args)

    def run(self, code: str, *args: str, timeout: float = 120) -> Any:
        """Run `code` as this user; its stdout's last line, decoded as JSON."""
        done = subprocess.run(self.argv(code, *args), capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def popen(self, code: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(code, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def remove(self) -> None:
        subprocess.run(["userdel", self.name], capture_output=True)


class World:
    """A simulated host others can traverse, the node's account, and helpers started over it."""

    def __init__(self, parent: Path, user: NodeUser) -> None:
        self.parent = parent
        self.root = make_root(parent)
        self.user = user
        self.helpers: list[HelperProcess] = []

    def config(self, extra_helper: str = "", top: str = "") -> str:
        return top + base_config(node_uid=self.user.uid, node_gid=self.user.gid, extra=extra_helper)

    def start(self, extra_helper: str = "", top: str = "") -> HelperProcess:
        h = HelperProcess(self.root, self.config(extra_helper, top))
        self.helpers.append(h)
        return h

    @property
    def socket(self) -> str:
        return str(self.root / SOCKET.lstrip("/"))

    def close(self) -> None:
        for h in self.helpers:
            h.stop()


@pytest.fixture
def world() -> Iterator[World]:
    user = NodeUser()
    parent = Path(tempfile.mkdtemp(prefix="bcd-helper-", dir="/var/tmp"))
    w = World(parent, user)
    try:
        yield w
    finally:
        w.close()
        user.remove()
        shutil.rmtree(parent, ignore_errors=True)
