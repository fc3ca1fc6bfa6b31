"""A real `bcd node` process beside the development control plane (in this process), for the benches that
measure the node end to end (`bcd bench session`, the stalled-gateway part of `bcd bench converge`).

`node_world(base)` prepares a `bcd sim`-like layout (simulated host, no helper), starts the devplane on a
Unix socket, joins, and yields a `NodeWorld` whose `start_node()` spawns `bcd node --test-kinds` on the
plane's socket (or on `gateway`, another socket, e.g. a stalling proxy).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from bcd_agent.devplane.plane import DevPlane
    from bcd_agent.sim import Layout


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class NodeWorld:
    def __init__(self, base: Path, nursery: trio.Nursery, plane: Any, layout: Any, node_id: str) -> None:
        self.base = base
        self.nursery = nursery
        self.plane = plane
        self.layout = layout
        self.node_id = node_id
        self.node_pid = 0  # the last `start_node`'s process

    def write_config(self, gateway: Path, extra: str = "") -> Path:
        config = self.base / "node-bench.toml"
        config.write_text(
            f'data_dir = "{self.layout.data_dir}"\n\n[control_plane]\nunix_socket = "{gateway}"\n{extra}'
        )
        return config

    async def start_node(self, gateway: Path | None = None, extra_config: str = "") -> trio.Process:
        """`bcd node --test-kinds` until the world ends (SIGTERM, then SIGKILL after 10 s: sim.watch). Not
        through `bcd_agent.sim.supervise`: its PR_SET_PDEATHSIG is tied to the spawning thread, which
        trio's thread cache ends after a while, killing a long-running child."""
        from bcd_agent.sim import bcd_argv

        config = self.write_config(gateway or self.layout.gateway_socket, extra_config)
        argv = bcd_argv("node", "--config", str(config), "--root", str(self.layout.root), "--test-kinds")
        proc: trio.Process = await self.nursery.start(_child, argv, self.layout.log_dir / "node.log")
        self.node_pid = proc.pid
        return proc

    async def session(self, within: float = 30) -> None:
        with trio.fail_after(within):
            while self.node_id not in self.plane.sessions:  # noqa: ASYNC110 - the plane's table is polled
                await trio.sleep(0.01)


async def _child(
    argv: list[str], log: Path, *, task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED
) -> None:
    from bcd_agent.sim import watch

    with log.open("ab") as out:
        proc = await trio.lowlevel.open_process(argv, stdout=out, stderr=out)
        await watch(proc, 10, task_status)


async def joined_plane(layout: Layout, nursery: trio.Nursery) -> tuple[DevPlane, str]:
    """The development plane on `layout`'s gateway socket, run in `nursery`, and `bcd join` done
    against it with the layout's node config: the plane and the joined node's id."""
    from bcd_agent.devplane.plane import DevPlane
    from bcd_agent.sim import bcd_argv, run_once

    plane = DevPlane(layout.plane_dir, listen=None, unix_socket=layout.gateway_socket)
    await nursery.start(plane.run)
    token = plane.issue_token()
    await run_once(
        bcd_argv("join", f"--token={token}", "--address", f"unix:{layout.gateway_socket}",
                 "--config", str(layout.node_config)),
        layout.log_dir / "join.log",
    )  # fmt: skip
    return plane, plane.default_node()


@asynccontextmanager
async def node_world(base: Path) -> AsyncIterator[NodeWorld]:
    from bcd_agent.sim import Layout, prepare

    layout = Layout(base)
    prepare(layout, helper=False, node_uid=None)
    async with trio.open_nursery() as nursery:
        plane, node_id = await joined_plane(layout, nursery)
        yield NodeWorld(base, nursery, plane, layout, node_id)
        nursery.cancel_scope.cancel()
