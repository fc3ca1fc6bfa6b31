"""Lanes, credits, workers and per-resource locks (delivery.md "Lanes, credits and workers").

| Lane      | Credits | Workers |
| --------- | ------- | ------- |
| control   | 8       | 4       |
| provision | 4       | 2       |
| bulk      | 2       | 1       |

Credits bound the commands admitted on a lane at once, running or waiting for a worker (DLV-LANE-05); a
command takes its credit when it passes the acceptance checks and gives it back only after its result is
journaled (DLV-LANE-09). Each lane has a fixed pool of worker tasks reading one memory channel whose
buffer is the lane's credits, so admission never blocks and no task is started per command (DLV-LANE-07).
`ResourceLocks` keeps two lanes from acting on the same GPU, disk or allocation at once (DLV-LANE-08):
a command takes all its locks in sorted order (no deadlock between two multi-resource commands).

Q-DLV-LANE-01: bcd uses the gateway's numbers. Credits are the daemon process's, not the session's: a
command admitted in one session keeps its credit across a reconnect until its result is journaled, and
the gateway's own count is rebuilt from the unsettled commands it redelivers (BUSY answers the excess).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager

import trio
from attrs import frozen

from bcd_agent.dispatch.kinds import Lane


@frozen
class LaneConfig:
    credits: int
    workers: int


LANES: Mapping[Lane, LaneConfig] = {
    Lane.CONTROL: LaneConfig(credits=8, workers=4),
    Lane.PROVISION: LaneConfig(credits=4, workers=2),
    Lane.BULK: LaneConfig(credits=2, workers=1),
}


class Credits:
    """A lane's admission counter. Taking never waits: no credit means BUSY."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a lane needs at least one credit")
        self.total = total
        self.in_use = 0

    def try_take(self) -> bool:
        if self.in_use >= self.total:
            return False
        self.in_use += 1
        return True

    def give_back(self) -> None:
        if self.in_use <= 0:
            raise RuntimeError("credit given back that was never taken")
        self.in_use -= 1


class ResourceLocks:
    """Named locks created on first use and forgotten when nobody holds or waits for them."""

    def __init__(self) -> None:
        self._locks: dict[str, trio.Lock] = {}
        self._users: dict[str, int] = {}

    def held(self) -> frozenset[str]:
        return frozenset(name for name, lock in self._locks.items() if lock.locked())

    @asynccontextmanager
    async def hold(self, names: Iterable[str]) -> AsyncIterator[None]:
        ordered = sorted(set(names))
        for name in ordered:
            self._users[name] = self._users.get(name, 0) + 1
            self._locks.setdefault(name, trio.Lock())
        taken: list[str] = []
        try:
            for name in ordered:
                await self._locks[name].acquire()
                taken.append(name)
            yield
        finally:
            for name in reversed(taken):
                self._locks[name].release()
            for name in ordered:
                self._users[name] -= 1
                if self._users[name] == 0:
                    del self._users[name]
                    del self._locks[name]
