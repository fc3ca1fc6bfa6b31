"""`bcd bench converge --json`: the converge targets (issue 3; docs/sim.md).

- `noop_pass_ms` (target <= 20): one converge pass with nothing to do, in process: the production
  ConvergeRunner with the host section (its units, DirectExecutor) and the devices section
  (DirectExecutor) on a simulated host converged to examples/gpu-node.json (host units and holds), the
  inventory read through the fake nvidia-smi as `bcd node` reads it. Median of `PASSES` passes after the
  passes that applied the spec. The example grows with the sections; so does this bench.
- `spec_to_observed_ms` (target <= 500): the real `bcd node` process beside the development control plane
  on a simulated host (the `bcd sim` set-up): from `apply_spec` of a new generation (the same spec with
  one env line more) to the control plane storing the StatusReport whose observed_generation is that
  generation. Median of `SPECS` specs.
- `idle_rss_mb` (target <= 60): VmRSS of that `bcd node` process, idle after the specs converged.
- `start_to_hello_ms` (target <= 1000): from spawning `bcd node` to the control plane holding the
  node's session (its Hello received and answered).
- `idle_rss_mb_with_telemetry` (target <= 60): the same process after a spec that adds a non-empty
  telemetry section (an OTLP/HTTP receiver on loopback in this process, a 1 s interval, resource
  attributes and a headers secret through a SecretRequest), once `TELEMETRY_EXPORTS` exports arrived,
  idle; `telemetry_exports` counts what the receiver got.
- `export_ms` (informational): one export of every metric in process: NodeMetrics over a real journal,
  8 GPUs' holds, every kind's outcomes and every helper op's calls, encoded and POSTed to a loopback
  receiver (`post_otlp`, the production client). Median of `EXPORTS`; `export_bytes` is one body's size.
- `stalled_gateway_rss_growth_mb` (target <= 30) and `refused_spec_bytes_per_msg` (target < 20): memory
  under a gateway that stops reading for 120 s, and under refused/ignored specs (bench.reliab).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

PASSES = 30
SPECS = 5
EXPORTS = 20
TELEMETRY_EXPORTS = 3
TARGETS: dict[str, tuple[str, float]] = {
    "noop_pass_ms": ("<=", 20.0),
    "spec_to_observed_ms": ("<=", 500.0),
    "idle_rss_mb": ("<=", 60.0),
    "start_to_hello_ms": ("<=", 1000.0),
    "idle_rss_mb_with_telemetry": ("<=", 60.0),
    # issue 16's memory keys, measured by bench.reliab
    "stalled_gateway_rss_growth_mb": ("<=", 30.0),
    "refused_spec_bytes_per_msg": ("<", 20.0),
}
HEADERS_REF = "secret://bench/otlp-headers"


def _example() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "examples" / "gpu-node.json"
        if candidate.exists():
            return candidate
    raise FileNotFoundError("examples/gpu-node.json (run the bench from a checkout)")


async def noop_pass_ms(root: Path) -> float:
    from bcd_shared.units import ApplyContext, UnitContext
    from bcd_simhost import sim_system
    from bcd_simhost.seed import seed

    from bcd_agent.converge.runner import ConvergeRunner
    from bcd_agent.converge.section import PartsObserver
    from bcd_agent.inventory.gpus import collect_gpus
    from bcd_agent.nodeparts.host import NodeHostSection
    from bcd_agent.plan import desired_from_nodespec, load_spec_file
    from bcd_agent.sections.devices.apply import DirectExecutor
    from bcd_agent.sections.devices.events import KeyReportSigner, MemorySink
    from bcd_agent.sections.devices.section import DevicesSection
    from bcd_agent.sections.host import DirectExecutor as HostExecutor

    seed(root)
    system = sim_system(root)
    # The sections bcd node runs on this spec: host (its units) and devices (its holds).
    host = NodeHostSection(
        lambda uctx: HostExecutor(system, uctx, ApplyContext()), lambda _observation: UnitContext()
    )
    devices = DevicesSection(
        system, DirectExecutor(system), MemorySink(), KeyReportSigner.fresh("bench", "bench"), "/var/lib/bcd"
    )
    observer = PartsObserver({"inventory": lambda: collect_gpus(system)}, clock=trio.current_time)
    spec = desired_from_nodespec(load_spec_file(_example()), 1)
    runner = ConvergeRunner([host, devices], observer, initial_spec=spec)
    first = await runner.converge_once(frozenset({"spec"}))
    while any(s.state.value == "PROGRESSING" for s in first.sections):  # host changes trigger a follow-up
        first = await runner.converge_once(frozenset({"event"}))
    assert first.observed_generation == 1, first
    settled = [s.state.value for s in first.sections if s.section in ("host", "devices")]
    assert settled == ["CONVERGED", "CONVERGED"], first
    samples = []
    for _ in range(PASSES):
        t0 = time.perf_counter()
        status = await runner.converge_once(frozenset({"drift"}))
        samples.append((time.perf_counter() - t0) * 1000)
        if any(s.state.value == "PROGRESSING" for s in status.sections):
            raise RuntimeError(f"a no-op pass found work: {status.sections}")
    return statistics.median(samples)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def node_numbers(root: Path) -> dict[str, float]:
    from bcd_shared import wire

    from bcd_agent.bench.nodeproc import joined_plane
    from bcd_agent.devplane.otlp import OtlpReceiver
    from bcd_agent.plan import load_spec_file
    from bcd_agent.sim import Child, Layout, bcd_argv, prepare, supervise

    layout = Layout(root)
    prepare(layout, helper=False, node_uid=None)
    spec = load_spec_file(_example())
    out: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        plane, node_id = await joined_plane(layout, nursery)
        plane.apply_spec(node_id, spec)
        argv = bcd_argv("node", "--config", str(layout.node_config), "--root", str(root))
        child = Child("bcd node", tuple(argv), layout.log_dir / "node.log")
        t0 = time.perf_counter()
        proc: trio.Process = await nursery.start(supervise, child)
        while node_id not in plane.sessions:  # noqa: ASYNC110 - the plane's session table is polled
            await trio.sleep(0.002)
        out["start_to_hello_ms"] = (time.perf_counter() - t0) * 1000
        await _observed(plane, node_id, 1)
        samples = []
        for i in range(SPECS):
            assignments = spec.devices.assignments if spec.devices else []
            assignments[0].env = [*assignments[0].env, f"BENCH={i}"]
            t0 = time.perf_counter()
            generation = plane.apply_spec(node_id, spec)
            await _observed(plane, node_id, generation)
            samples.append((time.perf_counter() - t0) * 1000)
        out["spec_to_observed_ms"] = statistics.median(samples)
        await trio.sleep(2.0)  # idle
        out["idle_rss_mb"] = _rss_mb(proc.pid)
        # The same node with a non-empty telemetry section exporting to a receiver here.
        receiver = OtlpReceiver(keep=4)
        await nursery.start(receiver.run)
        plane.put_secret(HEADERS_REF, b"authorization=Bearer%20bench")
        spec.telemetry = wire.TelemetrySection(
            otlp_endpoint=receiver.url,
            export_interval_ms=1000,
            resource_attributes={"deployment.environment": "bench", "bcd.pool": "bench"},
            headers_secret_ref=HEADERS_REF,
        )
        generation = plane.apply_spec(node_id, spec)
        await _observed(plane, node_id, generation)
        with trio.fail_after(30):
            while receiver.count < TELEMETRY_EXPORTS:  # noqa: ASYNC110 - the receiver's count is polled
                await trio.sleep(0.05)
        await trio.sleep(2.0)  # idle, exporting
        out["idle_rss_mb_with_telemetry"] = _rss_mb(proc.pid)
        out["telemetry_exports"] = receiver.count
        nursery.cancel_scope.cancel()
    return out


async def export_numbers(base: Path) -> dict[str, float]:
    from types import SimpleNamespace

    from bcd_agent.converge.status import StatusCell
    from bcd_agent.converge.types import SECTION_ORDER, NodeStatus, SectionState, SectionStatus
    from bcd_agent.counters import CounterSet
    from bcd_agent.devplane.otlp import OtlpReceiver
    from bcd_agent.dispatch.kinds import KINDS, Lane
    from bcd_agent.helperclient import OP_TIMEOUT_S, HelperCallStats
    from bcd_agent.journal import Journal
    from bcd_agent.sections.telemetry.exporter import Exporter, post_otlp
    from bcd_agent.sections.telemetry.metrics import NodeMetrics, holds_per_gpu
    from bcd_agent.sections.telemetry.plan import ExportConfig

    metrics = NodeMetrics()
    base.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - set-up, before anything is timed
    journal = Journal.open(base / "journal", boot_id="bench")
    metrics.journal = journal
    outcomes = CounterSet()
    for kind in KINDS:
        for outcome in ("succeeded", "failed", "rejected"):
            outcomes.add((kind, outcome), 3)
    metrics.dispatcher = SimpleNamespace(lanes=tuple(Lane), queue_length=lambda _lane: 1, outcomes=outcomes)
    status = StatusCell()
    sections = tuple(SectionStatus(name, SectionState.CONVERGED, 1) for name in SECTION_ORDER)
    status.publish(NodeStatus(1, 1, 1, "h", sections, (), 1, 0.0))
    metrics.status = status
    gpus = tuple(f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(8))
    held = {f"alloc_{i}_{s}": (f"{g}/s{s}",) for i, g in enumerate(gpus) for s in range(4)}
    metrics.holds = lambda: holds_per_gpu(gpus, held)
    helper = HelperCallStats()
    for op in OP_TIMEOUT_S:
        helper.called(op)
        helper.refused(op, "refused")
    metrics.helper = helper
    for _ in range(50):
        metrics.record_pass(0.003)
    exporter = Exporter(metrics, scope_version="bench")
    receiver = OtlpReceiver(keep=2)
    samples = []
    size = 0
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(receiver.run)
            resource = (("service.name", "bcd"), ("deployment.environment", "bench"))
            exporter.configure(
                ExportConfig(receiver.url + "/v1/metrics", 60.0, resource, (("x-api-key", "k"),))
            )
            for _ in range(EXPORTS):
                t0 = time.perf_counter()
                body = exporter.encode()
                await post_otlp(receiver.url + "/v1/metrics", body, (("x-api-key", "k"),), 10.0)
                samples.append((time.perf_counter() - t0) * 1000)
                size = len(body)
            nursery.cancel_scope.cancel()
    finally:
        journal.close()
    if receiver.count != EXPORTS:
        raise RuntimeError(f"the receiver got {receiver.count} of {EXPORTS} exports")
    return {"export_ms": statistics.median(samples), "export_bytes": float(size)}


async def _observed(plane: Any, node_id: str, generation: int) -> None:
    with trio.fail_after(30):
        while True:
            row = plane.store.one("SELECT observed_generation FROM nodes WHERE node_id = ?", node_id)
            if row is not None and int(row[0]) >= generation:
                return
            await trio.sleep(0.002)


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    with tempfile.TemporaryDirectory(prefix="bcd-bench-converge-") as tmp:
        base = Path(args.data_dir) if args.data_dir else Path(tmp)
        noop = trio.run(noop_pass_ms, base / "inproc")
        numbers = trio.run(node_numbers, base / "node")
        numbers.update(trio.run(export_numbers, base / "export"))
        # Issue 16's memory keys (stalled gateway, refused specs): their own module, merged here.
        from bcd_agent.bench import reliab

        extras = reliab.measure(args, base / "reliab")
    result: dict[str, float | int | str] = {"noop_pass_ms": round(noop, 3)}
    result.update({k: round(v, 3) for k, v in numbers.items()})
    result["export_bytes"] = int(result["export_bytes"])
    result["telemetry_exports"] = int(result["telemetry_exports"])
    result.update(extras)
    result["passes"] = PASSES
    result["specs"] = SPECS
    return result
