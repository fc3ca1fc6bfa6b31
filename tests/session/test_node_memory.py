"""`bcd node`'s use of glibc malloc (agent/bcd_agent/nodeparts/memory.py; docs/benchmarks.md, idle_rss_mb):
one arena, and the free heap start-up leaves behind handed back once the first converge pass ran."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from bcd_agent.converge.status import StatusCell
from bcd_agent.converge.types import NodeStatus
from bcd_agent.node import STARTUP_PASS_WAIT_S, Node
from bcd_agent.nodeparts import memory


class _Libc:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def mallopt(self, *args: int) -> int:
        self.calls.append(("mallopt", args))
        return 1

    def malloc_trim(self, *args: int) -> int:
        self.calls.append(("malloc_trim", args))
        return 1


def test_the_arena_cap_and_the_trim_call_glibc_and_are_no_ops_without_it() -> None:
    libc = _Libc()
    assert memory.limit_arenas(libc=libc) and memory.release_free_heap(libc=libc)
    assert libc.calls == [("mallopt", (-8, 1)), ("malloc_trim", (0,))]  # M_ARENA_MAX from malloc.h
    assert not memory.limit_arenas(libc=object()) and not memory.release_free_heap(libc=object())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_trim_gives_the_free_heap_back_to_the_system() -> None:
    """A heap with many freed chunks below a live one (what importing leaves): glibc keeps them
    resident; release_free_heap returns them (RSS falls by most of what was freed)."""
    script = textwrap.dedent(
        """
        from bcd_agent.nodeparts import memory

        def rss_kb():
            with open("/proc/self/status") as f:
                return int(next(l for l in f if l.startswith("VmRSS")).split()[1])

        memory.limit_arenas()
        kept = []
        chunks = [bytearray(2000) for _ in range(20000)]  # ~40 MB of malloc chunks (over pymalloc's 512)
        kept.append(bytearray(2000))  # a live chunk above them: the heap's top cannot shrink
        del chunks
        before = rss_kb()
        memory.release_free_heap()
        print(before - rss_kb())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 20_000, out  # kB given back of the ~40 MB freed


def _status(version: int, passes: int) -> NodeStatus:
    return NodeStatus(version, 1, 0, "h", (), (), passes, 0.0)


def test_the_node_trims_once_the_first_pass_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not before Hello and the first inventory read, not at the runner's first (pass-less) status: at
    the first status of a pass."""
    trims: list[float] = []
    monkeypatch.setattr(memory, "release_free_heap", lambda: trims.append(trio.current_time()))
    inventory_read = trio.Event()

    async def main() -> None:
        async def first_inventory() -> None:
            inventory_read.set()

        node: Any = SimpleNamespace(status=StatusCell(), _first_inventory=first_inventory)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Node._start_tail, node)
            await inventory_read.wait()
            node.status.publish(_status(1, 0))
            await trio.sleep(5)
            assert trims == []
            node.status.publish(_status(2, 1))
            await trio.sleep(1)
            assert trims == [5.0]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_without_a_spec_the_node_trims_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[float] = []
    monkeypatch.setattr(memory, "release_free_heap", lambda: trims.append(trio.current_time()))

    async def main() -> None:
        async def first_inventory() -> None:
            pass

        node: Any = SimpleNamespace(status=StatusCell(), _first_inventory=first_inventory)
        await Node._start_tail(node)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert trims == [STARTUP_PASS_WAIT_S]
