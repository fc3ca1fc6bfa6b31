"""A tiny sd_notify client (stdlib only; the node and the root helper both use it): READY=1, WATCHDOG=1,
STATUS=..., STOPPING=1.

bcd-node.service is `Type=notify` with `WatchdogSec=`: systemd waits for READY=1 and restarts the
node when WATCHDOG=1 stops arriving. Outside systemd ($NOTIFY_SOCKET unset) every call is a no-op
that returns False. The socket is a datagram Unix socket, a path or an abstract name ("@name").
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_s = _watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1 (half of WatchdogSec), or None when no watchdog is set."""
        return None if self._watchdog_s is None else self._watchdog_s / 2

    def notify(self, *assignments: str) -> bool:
        """Send `KEY=value` lines in one datagram; False when not under systemd or it could not be sent."""
        if self._address is None:
            return False
        for a in assignments:
            if "=" not in a or "\n" in a:
                raise ValueError(f"sd_notify assignment must be KEY=value on one line, got {a!r}")
        # As sd_notify(3): a notification that cannot be sent is reported (False), never raised, so a
        # daemon's start or stop never fails on it (a socket gone, systemd restarting).
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall("\n".join(assignments).encode())
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")


def _address(value: str) -> str | None:
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # systemd also allows vsock addresses; bcd is never run that way


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (the watchdog is per main PID)
    return int(usec) / 1_000_000
