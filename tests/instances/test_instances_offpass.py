"""The node's off-pass loops for the identity rebind and the balloon controller
(agent/bcd_agent/nodeparts/instances.py): each tick runs in a worker thread, never in trio's thread and
never inside a converge pass, and a success of the rebind triggers a pass."""

from __future__ import annotations

import threading
import time
from typing import Any

import trio
from bcd_agent.nodeparts.instances import balloon_periodically, rebind_periodically


class _Section:
    def __init__(self) -> None:
        self.threads: list[str] = []
        self.desired: list[Any] = []

    def rebind_tick(self, desired: Any) -> list[tuple[str, str]]:
        self.threads.append(threading.current_thread().name)
        self.desired.append(desired)
        time.sleep(0.3)  # a guest that takes its time: trio's loop must stay free meanwhile
        return [("a", "rebound")] if len(self.threads) == 1 else [("a", "the guest did not answer")]

    def balloon_tick(self, desired: Any) -> tuple[Any, ...]:
        self.threads.append(threading.current_thread().name)
        if len(self.threads) == 2:
            raise RuntimeError("a failed tick never ends the loop")
        return ()


def test_the_rebind_runs_off_the_pass_in_a_worker_thread_and_a_success_triggers_a_pass_dlv_reb_04() -> None:
    """DLV-REB-04: the rebind tick runs in a worker thread while trio's loop keeps running (a guest may
    take minutes), with the current spec; a success triggers a pass (so the report carries it)."""
    sec = _Section()
    triggers: list[str] = []
    ticks = 0

    async def main() -> None:
        nonlocal ticks
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rebind_periodically, sec, lambda: "spec", triggers.append, 0.01)
            while len(sec.threads) < 2:
                ticks += 1  # the loop runs while a tick sleeps in its thread
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    main_thread = threading.main_thread().name
    assert sec.threads and all(t != main_thread for t in sec.threads)
    assert sec.desired[0] == "spec" and triggers == ["identity rebound"]
    assert ticks > 10


def test_the_balloon_loop_survives_a_failed_tick_dlv_bal_04() -> None:
    """DLV-BAL-04: the controller ticks over and over in worker threads; a tick that raises is logged
    and the next one runs."""
    sec = _Section()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(balloon_periodically, sec, lambda: None, 0.01)
            for _ in range(1000):
                if len(sec.threads) >= 4:
                    break
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(sec.threads) >= 4 and threading.main_thread().name not in sec.threads
