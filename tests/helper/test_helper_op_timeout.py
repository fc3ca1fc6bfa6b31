"""The helper server applies each op's OPS-table timeout to the call: its deadline and its programs.

The checks go through `Connection.answer`, the function the server's connection loop serves every request
with, over a real HelperContext (root's config, the audit log) on a simulated host. Only the handler of an
op is replaced, in a copy of the table made for the test; the timeouts are the table's own.
"""

from __future__ import annotations

import json
import os
import socket
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from bcd_helper import server
from bcd_helper.audit import AuditLog, init_key
from bcd_helper.config import load_config
from bcd_helper.ops import base, host, hostunit
from bcd_helper.ops.base import Call, HelperContext
from bcd_helper.ops.table import OPS, lock_names
from bcd_shared.system import DEFAULT_TOOL_TIMEOUT_S, CommandResult, LocalSystem
from helperproc import AUDIT_DIR, base_config, make_root, write_config


class Clock:
    """The monotonic clock the call's deadline reads, moved on by the programs the op runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class LongPrograms(LocalSystem):
    """A host whose every program runs until the timeout it is given (a driver build that never ends)."""

    def __init__(self, root: Path, clock: Clock) -> None:
        super().__init__(root)
        self.clock = clock
        self.timeouts: list[float] = []

    def run(
        self, argv: Sequence[str], *, timeout: float = DEFAULT_TOOL_TIMEOUT_S, input: bytes | None = None
    ) -> CommandResult:
        self.timeouts.append(timeout)
        self.clock.now += timeout
        return CommandResult(tuple(argv), -9, b"", b"killed at its timeout")


def _context(root: Path, system: LocalSystem) -> HelperContext:
    write_config(root, base_config())
    config = load_config(root)
    init_key(root, config.audit_dir)
    audit = AuditLog(root, config.audit_dir)
    return HelperContext(root=root, config=config, system=system, audit=audit, lock_names=lock_names())


@pytest.fixture
def peer_socket() -> Iterator[socket.socket]:
    ours, theirs = socket.socketpair()
    yield ours
    ours.close()
    theirs.close()


def _last_audit(root: Path) -> dict[str, Any]:
    lines = (root / AUDIT_DIR.lstrip("/") / "audit.log").read_bytes().splitlines()
    return dict(json.loads(lines[-1]))


def test_HST_HLP_07_host_unit_call_is_bounded_by_the_tables_30_minutes(
    tmp_path: Path, peer_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HST-HLP-07: a host.unit call runs under a 30-minute deadline taken from the OPS table. Programs that
    each run to their timeout get the 20-minute tool cap, then the 10 minutes left of the 30, then none:
    the call fails `timeout` after 30 minutes, not sooner and not later."""
    clock = Clock()
    monkeypatch.setattr(base, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    root = make_root(tmp_path)
    system = LongPrograms(root, clock)
    ctx = _context(root, system)
    seen: list[float] = []

    def build_forever(call: Call, req: Any) -> dict[str, Any]:
        seen.append(call.deadline.remaining())
        while True:
            call.system.run(["/usr/sbin/dkms", "autoinstall"], timeout=3600)

    monkeypatch.setattr(hostunit, "host_unit", build_forever)  # the table looks its handler up by name
    conn = server.Connection(ctx, peer_socket, server.Guards(ctx), uids=(os.getuid(),))
    answer = conn.answer({"op": "host.unit", "args": {"unit": "nvidia-driver"}})

    assert seen == [30 * 60]
    assert system.timeouts == [DEFAULT_TOOL_TIMEOUT_S, 30 * 60 - DEFAULT_TOOL_TIMEOUT_S]
    assert answer["ok"] is False and answer["error"] == "failed" and answer["reason"] == "timeout", answer
    assert "the operation's 1800s ran out before /usr/sbin/dkms" in answer["message"]
    last = _last_audit(root)
    assert (last["op"], last["decision"], last["reason"]) == ("host.unit", "failed", "timeout")


def test_a_short_op_timeout_ends_a_real_program(
    tmp_path: Path, peer_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An op whose table entry allows half a second: the real `sleep 30` it runs on this machine is killed at
    that deadline (exit 124, timed out), where a server ignoring the table would let it finish (exit 0).
    The op is a test-only copy of helper.ping's entry with its own timeout and handler."""
    root = make_root(tmp_path)
    ctx = _context(root, LocalSystem(root))

    def sleeper(call: Call, req: Any) -> dict[str, Any]:
        result = call.system.run(["sleep", "30"])
        return {"returncode": result.returncode, "stderr": result.stderr.decode()}

    table = dict(OPS)
    table["helper.ping"] = attrs.evolve(OPS["helper.ping"], timeout_s=0.5)
    monkeypatch.setattr(server, "OPS", table)
    monkeypatch.setattr(host, "ping", sleeper)
    conn = server.Connection(ctx, peer_socket, server.Guards(ctx), uids=(os.getuid(),))
    answer = conn.answer({"op": "helper.ping", "args": {}})
    assert answer == {"ok": True, "result": {"returncode": 124, "stderr": "sleep: timed out after 0s"}}
