"""The node's off-pass loops for the identity rebind and the balloon controller
(agent/bcd_agent/nodeparts/instances.py): each tick runs in a worker thread, never in trio's thread and
never inside a converge pass, and a success of the rebind triggers a pass."""

from __future__ import annotations

import threading
import time
from typing import Any

import trio
import trio.testing
from bcd_agent.nodeparts.instances import balloon_periodically, rebind_periodically


class _Section:
    def __init__(self, due: bool = True) -> None:
        self.threads: list[str] = []
        self.desired: list[Any] = []
        self.due = due
        self.asked = 0

    def rebind_due(self, desired: Any) -> bool:
        self.asked += 1
        return self.due

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


def test_no_worker_thread_runs_while_no_rebind_is_due() -> None:
    """A spec without rebinds (the common case) costs the node no worker thread every 10 s: the loop
    asks rebind_due on trio's thread and goes back to sleep."""
    sec = _Section(due=False)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rebind_periodically, sec, lambda: "spec", lambda _r: None, 0.01)
            while sec.asked < 5:  # noqa: ASYNC110 - the fake's count is polled
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sec.threads == [] and sec.desired == []


def test_a_failing_spec_read_never_ends_the_rebind_loop() -> None:
    """Reading the spec (the node's runner before any spec, a bug) fails: logged, the next tick reads
    again; the node goes on."""
    sec = _Section()
    reads = 0

    def desired() -> Any:
        nonlocal reads
        reads += 1
        raise AttributeError("no spec yet")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rebind_periodically, sec, desired, lambda _r: None, 0.01)
            while reads < 3:  # noqa: ASYNC110 - the count is polled
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sec.threads == [] and sec.asked == 0


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


def test_every_thirty_seconds_the_host_memory_and_stall_are_read_dlv_bal_03() -> None:
    """DLV-BAL-03: the node's balloon loop ticks every 30 s (trio's mock clock), and each tick reads
    /proc/meminfo (MemTotal, MemAvailable) and /proc/pressure/memory (PSI some avg10)."""
    from bcd_agent.sections.instances.balloon import BalloonController, HostPressure
    from bcd_agent.sections.instances.model import InstancesSpec

    class _Proc:
        def __init__(self) -> None:
            self.read: list[str] = []

        def read_text(self, path: str) -> str | None:
            self.read.append(path)
            if path == "/proc/meminfo":
                return "MemTotal: 1000 kB\nMemAvailable: 500 kB\n"
            return "some avg10=12.00 avg60=0.00 avg300=0.00 total=5\n"

    proc = _Proc()
    ctl = BalloonController(proc, {})
    seen: list[tuple[float, HostPressure | None]] = []
    done: list[trio.Event] = []

    class _Sec:
        def balloon_tick(self, desired: Any) -> tuple[Any, ...]:
            now = trio.from_thread.run_sync(trio.current_time)
            seen.append((now, ctl.read_host()))
            if len(seen) == 3:
                trio.from_thread.run_sync(done[0].set)
            return ctl.tick(InstancesSpec(1), [])

    async def main() -> None:
        done.append(trio.Event())
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(balloon_periodically, _Sec(), lambda: None)
            await done[0].wait()  # no timer of this task: the mock clock jumps only to the loop's sleeps
            nursery.cancel_scope.cancel()
        assert [round(t - start, 3) for t, _ in seen[:3]] == [30, 60, 90]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert seen[0][1] == HostPressure(1000 * 1024, 500 * 1024, 12.0)
    assert proc.read[:2] == ["/proc/meminfo", "/proc/pressure/memory"]


def test_the_rules_are_checked_every_five_seconds_outside_any_pass_dlv_nft_23() -> None:
    """DLV-NFT-23: the node's integrity check of its nftables tables runs every 5 s (trio's mock clock),
    in a worker thread; a check that raises does not end the loop (the next one runs 5 s later)."""
    from bcd_agent.sections.instances.network import check_periodically

    seen: list[tuple[float, bool]] = []
    done: list[trio.Event] = []

    class _Network:
        def integrity_check(self) -> None:
            in_main = threading.current_thread() is threading.main_thread()
            # From the trio thread itself (a wrong, inline check) from_thread would raise: read directly.
            now = trio.current_time() if in_main else trio.from_thread.run_sync(trio.current_time)
            seen.append((now, in_main))
            if len(seen) == 3:
                done[0].set() if in_main else trio.from_thread.run_sync(done[0].set)
            if len(seen) == 1:
                raise RuntimeError("nft vanished")

    async def main() -> None:
        done.append(trio.Event())
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(check_periodically, _Network())
            await done[0].wait()
            nursery.cancel_scope.cancel()
        assert [round(t - start, 3) for t, _ in seen] == [5, 10, 15]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert not any(in_main for _, in_main in seen)  # a worker thread, never the node's loop
