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
TARGETS = {
    "noop_pass_ms": 20.0,
    "spec_to_observed_ms": 500.0,
    "idle_rss_mb": 60.0,
    "start_to_hello_ms": 1000.0,
}


def _example() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "examples" / "gpu-node.json"
        if candidate.exists():
            return candidate
    raise FileNotFoundError("examples/gpu-node.json (run the bench from a checkout)")


async def noop_pass_ms(root: Path) -> float:
    from bcd_shared.simhost import sim_system
    from bcd_shared.simhost.seed import seed
    from bcd_shared.units import ApplyContext, UnitContext

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
    from bcd_agent.devplane.plane import DevPlane
    from bcd_agent.plan import load_spec_file
    from bcd_agent.sim import Child, Layout, bcd_argv, prepare, run_once, supervise

    layout = Layout(root)
    prepare(layout, helper=False, node_uid=None)
    spec = load_spec_file(_example())
    out: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        plane = DevPlane(layout.plane_dir, listen=None, unix_socket=layout.gateway_socket)
        await nursery.start(plane.run)
        token = plane.issue_token()
        await run_once(
            bcd_argv("join", f"--token={token}", "--address", f"unix:{layout.gateway_socket}",
                     "--config", str(layout.node_config)),
            layout.log_dir / "join.log",
        )  # fmt: skip
        node_id = plane.default_node()
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
        nursery.cancel_scope.cancel()
    return out


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
        # Issue 16's memory keys (stalled gateway, refused specs): their own module, merged here.
        from bcd_agent.bench import reliab

        extras = reliab.measure(args, base / "reliab")
    result: dict[str, float | int | str] = {"noop_pass_ms": round(noop, 3)}
    result.update({k: round(v, 3) for k, v in numbers.items()})
    for key, target in TARGETS.items():
        result[f"{key}_target"] = target
    result.update(extras)
    result["passes"] = PASSES
    result["specs"] = SPECS
    return result
