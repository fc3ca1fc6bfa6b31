"""`bcd bench session --json`: the session's end-to-end targets (issue 16; docs/benchmarks.md).

- `commands_per_s` (target >= 500): the real `bcd node --test-kinds` process beside the development
  control plane (this process) on a simulated host: `COMMANDS` test.echo commands (retry-safe, no work
  beyond the test kinds' effect log: a line fsynced before the handler returns, the lines of one tick
  sharing the fsync) enqueued at once, from the first dispatch to the control plane holding every
  terminal result, with the journal's default durability (every write fsynced before it returns,
  DLV-JRN-15; a received batch's accepts and a tick's outcomes are one write each, docs/journal.md).
  The plane sends within the lanes' credits (8 on control); `busy_answers` counts the node's BUSY
  answers (0: the credits were respected on both sides). The machine's state is reported beside it, as
  the rate depends on it: `load_avg_1m` at the start, `fsync_ms` (one append + fsync in the data
  directory's file system, median of 20) and the CPU each process spent per command
  (`node_cpu_ms_per_command`, `plane_cpu_ms_per_command`).
- `oversized_refused_ms` (target <= 100): a gateway that, after its Welcome, announces a 100 MB message
  in the gRPC prefix and starts sending it; from writing the prefix to the node's session ending with the
  protocol error (its size cap, 4 MiB, checked on the prefix). Median of `OVERSIZED_RUNS`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

COMMANDS = 1000
WARMUP = 50
OVERSIZED_RUNS = 5
TARGETS: dict[str, tuple[str, float]] = {
    "commands_per_s": (">=", 500.0),
    "oversized_refused_ms": ("<=", 100.0),
}
_TERMINAL = ("succeeded", "failed", "rejected", "cancelled", "expired")


async def _until_terminal(plane: Any, node_id: str, count: int, within: float) -> None:
    """Poll (through the plane's (node_id, state) index, every 20 ms: the poll is the plane's CPU too)."""
    marks = ", ".join(f"'{s}'" for s in _TERMINAL)
    sql = f"SELECT count(*) FROM commands WHERE node_id = ? AND state IN ({marks})"  # noqa: S608 - constant
    with trio.fail_after(within):
        while int(plane.store.one(sql, node_id)[0]) < count:  # noqa: ASYNC110 - the plane's table is polled
            await trio.sleep(0.02)


async def commands_per_s(base: Path, extra_config: str = "") -> dict[str, float]:
    from bcd_shared import wire

    from bcd_agent.bench.nodeproc import node_world
    from bcd_agent.kinds.testing import effect_payload

    async with node_world(base) as world:
        await world.start_node(extra_config=extra_config)
        await world.session()
        url, value = effect_payload("bench")
        payload = wire.ProtoAny(type_url=url, value=value)
        for _ in range(WARMUP):
            world.plane.enqueue(world.node_id, "test.echo", payload)
        world.plane.poke()
        await _until_terminal(world.plane, world.node_id, WARMUP, 120)
        for _ in range(COMMANDS):
            world.plane.enqueue(world.node_id, "test.echo", payload)
        pid = world.node_pid
        node_cpu0, plane_cpu0 = _cpu_s(pid), time.process_time()
        t0 = time.perf_counter()
        world.plane.poke()
        await _until_terminal(world.plane, world.node_id, WARMUP + COMMANDS, 600)
        elapsed = time.perf_counter() - t0
        node_cpu, plane_cpu = _cpu_s(pid) - node_cpu0, time.process_time() - plane_cpu0
        busy = world.plane.store.one("SELECT count(*) FROM updates WHERE state = 'busy'")
        succeeded = world.plane.store.one("SELECT count(*) FROM commands WHERE state = 'succeeded'")
    return {
        "commands_per_s": COMMANDS / elapsed,
        "busy_answers": float(busy[0]) if busy else 0.0,
        "commands_succeeded": float(succeeded[0]) if succeeded else 0.0,
        "node_cpu_ms_per_command": node_cpu * 1000 / COMMANDS,
        "plane_cpu_ms_per_command": plane_cpu * 1000 / COMMANDS,
    }


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (/proc/PID/stat)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fsync_ms(directory: Path, count: int = 20) -> float:
    """Median ms of one small append + fsync in `directory` (what each durable write waits for)."""
    import os

    path = directory / "fsync-probe"
    samples: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            os.write(fd, b"x" * 100)
            os.fsync(fd)
            samples.append((time.perf_counter() - t0) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(samples)


async def oversized_refused_ms(base: Path) -> float:
    """Median ms from the oversized prefix leaving the gateway to the node's session failing on it."""
    import grpclib.const
    import trio_asyncio
    from bcd_shared import wire
    from bcd_shared.pki import KeyPair
    from bcd_shared.pki.pins import JoinKeyPin
    from grpclib.server import Server

    from bcd_agent.dispatch.clock import OffsetClock
    from bcd_agent.dispatch.trust import BundleTrust
    from bcd_agent.journal import Journal
    from bcd_agent.session import identity as ident
    from bcd_agent.session.backoff import Backoff
    from bcd_agent.session.core import SessionCore
    from bcd_agent.session.service import Session
    from bcd_agent.session.transport import Endpoint, StrictCodec, open_loop
    from bcd_agent.wire import SESSION_STREAM_PATH

    sent_at: list[float] = []

    class Oversized:
        def __mapping__(self) -> dict[str, grpclib.const.Handler]:
            return {
                SESSION_STREAM_PATH: grpclib.const.Handler(
                    self._session,
                    grpclib.const.Cardinality.STREAM_STREAM,
                    wire.NodeMessage,
                    wire.GatewayMessage,
                )
            }

        async def _session(self, stream: Any) -> None:
            await stream.recv_message()
            welcome = wire.Welcome(server_time=int(time.time() * 1000), session_epoch=1)
            await stream.send_message(wire.GatewayMessage(welcome=welcome))
            await asyncio.sleep(0.05)
            sent_at.append(time.perf_counter())
            await stream._stream.send_data(struct.pack(">?I", False, 100 * 1024 * 1024))
            chunk = b"\0" * (256 * 1024)
            try:
                for _ in range(400):
                    await stream._stream.send_data(chunk)
            except Exception:  # noqa: S110 - the node reset the stream: what is measured
                pass
            await asyncio.sleep(30)

    class _Rec:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    node_key = KeyPair.generate()
    identity = ident.Identity(
        "bench-node", node_key, (b"",), str(JoinKeyPin.of_key(KeyPair.generate().public_key))
    )
    samples: list[float] = []
    sock = base / "gw.sock"
    async with open_loop():
        server = Server([Oversized()], codec=StrictCodec())

        async def start() -> None:
            await server.start(path=str(sock))

        async def stop() -> None:
            server.close()

        await trio_asyncio.aio_as_trio(start)()
        try:
            journal = Journal.open(base / "data", boot_id="bench")
            core = SessionCore(
                journal=journal,
                dispatcher=_Rec(),
                runner=_Rec(),
                trust=BundleTrust(),
                clock=OffsetClock(),
                identity=identity,
                data_dir=base / "data",
                persist_identity=False,
                monotonic=trio.current_time,
            )
            session = Session(core, Endpoint(unix_path=str(sock)), backoff=Backoff(initial_s=0.05, max_s=0.1))
            async with trio.open_nursery() as nursery:
                await nursery.start(session.run)
                for run in range(OVERSIZED_RUNS):
                    with trio.fail_after(60):
                        while len(session.failures) <= run:  # noqa: ASYNC110 - polls the session's record
                            await trio.sleep(0.0005)
                    failed_at = time.perf_counter()
                    if "exceeds" not in session.failures[run]:
                        raise RuntimeError(f"the session ended otherwise: {session.failures[run]}")
                    samples.append((failed_at - sent_at[run]) * 1000)
                nursery.cancel_scope.cancel()
            journal.close()
        finally:
            with trio.CancelScope(shield=True):
                await trio_asyncio.aio_as_trio(stop)()
    return statistics.median(samples)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bcd-bench-session-") as tmp:
        base = Path(args.data_dir) if args.data_dir else Path(tmp)
        (base / "oversized").mkdir(parents=True, exist_ok=True)
        oversized = trio.run(oversized_refused_ms, base / "oversized")
        load = float(Path("/proc/loadavg").read_text().split()[0])
        probe = fsync_ms(base)
        rate = trio.run(commands_per_s, base / "rate")
        # The same stream with [journal] group_commit on: the opt-in deferred fsync (docs/journal.md),
        # informational.
        grouped = trio.run(commands_per_s, base / "rate-group", "\n[journal]\ngroup_commit = true\n")
    result: dict[str, Any] = {k: round(v, 3) for k, v in rate.items()}
    result["commands_per_s_group_commit"] = round(grouped["commands_per_s"], 3)
    result["load_avg_1m"] = load
    result["fsync_ms"] = round(probe, 3)
    result["oversized_refused_ms"] = round(oversized, 3)
    result["commands"] = COMMANDS
    return result


def _meets(value: float, op: str, target: float) -> bool:
    return {
        "<=": value <= target,
        ">=": value >= target,
        "<": value < target,
        ">": value > target,
    }[op]
