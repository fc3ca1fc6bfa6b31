"""The status sink: a cell holding the newest NodeStatus, latest wins.

The runner publishes after every pass; the session (or `bcd status --watch`) reads the newest with
`latest()` or waits for one newer than what it sent with `wait_newer(version)`. A slow reader never
holds the runner back and never sees a stale report queued behind a newer one: intermediate
statuses are simply overwritten (coalesced).
"""

from __future__ import annotations

import trio

from bcd_agent.converge.types import NodeStatus


class StatusCell:
    def __init__(self) -> None:
        self._latest: NodeStatus | None = None
        self._changed = trio.Event()

    def publish(self, status: NodeStatus) -> None:
        self._latest = status
        self._changed.set()
        self._changed = trio.Event()

    def latest(self) -> NodeStatus | None:
        return self._latest

    async def wait_newer(self, version: int = 0) -> NodeStatus:
        """The newest status whose version is above `version`, waiting for one if needed."""
        while self._latest is None or self._latest.version <= version:
            await self._changed.wait()
        return self._latest
