"""Memory under a stalled or hostile gateway (issue 16), reported by `bcd bench converge --json`.

- `stalled_gateway_rss_growth_mb` (target <= 30): the real `bcd node` with 30 MB of unacked events in its
  journal, connected through a proxy (bench.stallproxy) that lets each connection's Hello through and then
  stops reading, as a gateway that keeps its connection open but reads nothing: VmRSS after `STALL_S`
  (120 s) minus VmRSS once the stall began. The node reads from the journal only what its send queue
  admits and replaces a connection whose peer does not read for `stall_timeout_s` (60 s), so the growth
  stays bounded whatever the backlog. `stalled_gateway_rss_peak_mb` is the highest sample,
  `stalled_gateway_events_delivered` what reached the gateway within 60 s of the proxy reading again.
- `refused_spec_bytes_per_msg` (target < 20): this process's VmRSS growth per DesiredState after the
  first round, over `SPEC_ROUNDS` rounds of `SPEC_ROUND` messages: stale generations, unsigned specs once
  command roots are known, and specs for another node, through the production `SessionCore`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

import trio

STALL_S = 120.0
BACKLOG_EVENTS = 3000
EVENT_BYTES = 10 * 1024  # 3000 x 10 KiB: 30 MB unacked
SPEC_ROUND = 50_000
SPEC_ROUNDS = 4
TARGETS: dict[str, tuple[str, float]] = {
    "stalled_gateway_rss_growth_mb": ("<=", 30.0),
    "refused_spec_bytes_per_msg": ("<", 20.0),
}


def _rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def stalled_gateway(base: Path, boot_id: str, stall_s: float = STALL_S) -> dict[str, float]:
    from bcd_agent.bench.nodeproc import node_world
    from bcd_agent.bench.stallproxy import StallProxy
    from bcd_agent.journal import EventClass, Journal, NewEvent

    async with node_world(base) as world:
        journal = Journal.open(world.layout.data_dir, boot_id=boot_id)
        try:
            for _ in range(BACKLOG_EVENTS // 100):
                journal.append_events(
                    [
                        NewEvent(EventClass.TRANSITION, "bench.backlog", os.urandom(EVENT_BYTES))
                        for _ in range(100)
                    ]
                )
            journal_id = journal.journal_id
        finally:
            journal.close()
        proxy = StallProxy(base / "stall.sock", world.layout.gateway_socket, stall_after_bytes=16 * 1024)
        await world.nursery.start(proxy.run)
        proc = await world.start_node(gateway=base / "stall.sock")
        await world.session()
        await trio.sleep(5.0)  # the first batches fill the stalled connection
        start = _rss_bytes(proc.pid)
        peak = start
        t0 = trio.current_time()
        while trio.current_time() - t0 < stall_s:
            await trio.sleep(min(5.0, stall_s))
            peak = max(peak, _rss_bytes(proc.pid))
        end = _rss_bytes(proc.pid)
        proxy.resume()

        def delivered() -> int:
            row = world.plane.store.one(
                "SELECT count(*) FROM events WHERE node_id = ? AND journal_id = ?", world.node_id, journal_id
            )
            return int(row[0]) if row is not None else 0

        with trio.move_on_after(60):
            while delivered() < BACKLOG_EVENTS:  # noqa: ASYNC110 - the plane's table is polled
                await trio.sleep(0.5)
        after = _rss_bytes(proc.pid)
        mb = 1024 * 1024
        return {
            "stalled_gateway_rss_growth_mb": (end - start) / mb,
            "stalled_gateway_rss_peak_mb": peak / mb,
            "stalled_gateway_rss_after_resume_mb": after / mb,
            "stalled_gateway_events_delivered": float(delivered()),
            "stalled_gateway_connections": float(proxy.connections),
        }


def refused_spec_bytes_per_msg(base: Path) -> float:
    from bcd_shared import wire
    from bcd_shared.pki import (
        KeyPair,
        TrustBundle,
        issue_leaf,
        issue_node_certificate,
        issue_root,
        sign_trust_bundle,
    )
    from bcd_shared.pki.certs import Role
    from bcd_shared.pki.pins import JoinKeyPin
    from bcd_shared.pki.signing import Purpose

    from bcd_agent.dispatch.clock import OffsetClock
    from bcd_agent.dispatch.trust import BundleTrust
    from bcd_agent.journal import Journal
    from bcd_agent.session import identity as ident
    from bcd_agent.session.core import SessionCore

    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(days=1), now + dt.timedelta(days=30)
    join_key, root_key, worker, ca_key, node_key = (KeyPair.generate() for _ in range(5))
    root = issue_root(root_key, "cmd root", start, end, path_length=0)
    worker_der = issue_leaf(root, root_key, worker.public_key, Role.WORKER, "w", start, end)
    ca = issue_root(ca_key, "node ca", start, end, path_length=0)
    node_cert = issue_node_certificate(ca, ca_key, node_key.public_key, "bench-node", start, end)
    identity = ident.Identity(
        "bench-node", node_key, (node_cert,), str(JoinKeyPin.of_key(join_key.public_key))
    )

    def spec(generation: int, node: str = "bench-node", sign: bool = True) -> wire.GatewayMessage:
        body = bytes(
            wire.DesiredStateBody(
                node_id=node,
                generation=generation,
                spec_hash=f"h{generation}",
                full=wire.NodeSpec(telemetry=wire.TelemetrySection(otlp_endpoint=f"https://o/{generation}")),
            )
        )
        signature = worker.sign(Purpose.DESIRED_STATE, body) if sign else b""
        return wire.GatewayMessage(
            desired_state=wire.DesiredState(body=body, signature=signature, signer_chain=[worker_der])
        )

    class _Rec:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    journal = Journal.open(base, boot_id="bench")
    core = SessionCore(
        journal=journal,
        dispatcher=_Rec(),
        runner=_Rec(),
        trust=BundleTrust(),
        clock=OffsetClock(),
        identity=identity,
        data_dir=base,
        persist_identity=False,
    )
    core.attach(lambda _m: None)
    bundle = sign_trust_bundle(join_key, TrustBundle(version=1, command_roots=(root,)))
    core.handle(
        wire.GatewayMessage(welcome=wire.Welcome(server_time=int(time.time() * 1000), trust_bundle=bundle))
    )
    core.handle(spec(5))
    if journal.applied_generation != 5:
        raise RuntimeError("the bench's first spec was not applied")
    stale, other = spec(3), spec(9, node="other-node")
    unsigned = [spec(10 + i, sign=False) for i in range(64)]
    level = logging.getLogger("bcd.session").level
    logging.getLogger("bcd.session").setLevel(logging.CRITICAL)  # what is measured is what is kept

    def round_() -> None:
        for i in range(SPEC_ROUND // 3):
            core.handle(stale)
            core.handle(unsigned[i % len(unsigned)])
            core.handle(other)
        gc.collect()

    try:
        round_()
        first = _rss_bytes()
        for _ in range(SPEC_ROUNDS - 1):
            round_()
        last = _rss_bytes()
    finally:
        logging.getLogger("bcd.session").setLevel(level)
        journal.close()
    return max(0.0, (last - first) / ((SPEC_ROUNDS - 1) * (SPEC_ROUND // 3) * 3))


def measure(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """The keys above, for `bcd bench converge` (which adds them to its result)."""
    stall_s = float(os.environ.get("BCD_BENCH_STALL_S", STALL_S))  # a shorter stall for a quick look only
    (base / "specs").mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"refused_spec_bytes_per_msg": round(refused_spec_bytes_per_msg(base / "specs"), 3)}
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    stalled = trio.run(stalled_gateway, base / "stall", boot_id, stall_s)
    out.update({k: round(v, 3) for k, v in stalled.items()})
    out["stall_s"] = stall_s
    return out
