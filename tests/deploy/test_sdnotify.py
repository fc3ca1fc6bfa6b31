"""The sd_notify client against a real datagram socket (what systemd listens on)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from bcd_shared.sdnotify import Notifier


def _listen(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_ready_watchdog_status_and_stopping_reach_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with _listen(path) as server:
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(os.getpid())})
        assert n.enabled and n.watchdog_interval_s == 10.0
        assert n.ready("converging generation 3")
        assert server.recv(4096) == b"READY=1\nSTATUS=converging generation 3"
        assert n.watchdog()
        assert server.recv(4096) == b"WATCHDOG=1"
        assert n.status("idle") and server.recv(4096) == b"STATUS=idle"
        assert n.stopping() and server.recv(4096) == b"STOPPING=1"


def test_abstract_socket() -> None:
    name = f"bcd-test-notify-{os.getpid()}"
    with _listen("\0" + name) as server:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert server.recv(4096) == b"READY=1"


def test_outside_systemd_every_call_is_a_no_op() -> None:
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval_s is None
    assert n.ready() is False and n.watchdog() is False


def test_watchdog_for_another_pid_or_zero_is_ignored() -> None:
    assert (
        Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval_s
        is None
    )
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "0"}).watchdog_interval_s is None


def test_a_bad_assignment_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with _listen(path):
        n = Notifier({"NOTIFY_SOCKET": path})
        with pytest.raises(ValueError, match="KEY=value"):
            n.notify("READY=1\nMAINPID=1")
        with pytest.raises(ValueError, match="KEY=value"):
            n.notify("READY")


def test_a_socket_that_is_gone_is_false_not_an_error(tmp_path: Path) -> None:
    """systemd restarted, or a test's listener went away: the daemon's start or stop goes on."""
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.enabled
    assert notifier.stopping() is False
    assert notifier.ready("x") is False
