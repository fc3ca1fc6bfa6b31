"""The node's own composition of the devices section beside `bcd helper`: holds are root's writes, made by the
helper process, never by the node.

`bcd_agent.node.Node` builds its sections from its config (`[helper] socket` set) exactly as `bcd node` does;
the helper is a real `bcd helper serve` process over the same simulated host. The node process of this test
runs as root and could write the files itself, so only the helper's audit log tells who wrote them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from bcd_agent.config import load_config
from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import DesiredSpec, SectionState
from bcd_agent.node import Node, NodeOptions
from bcd_agent.sections.devices.events import KeyReportSigner, MemorySink
from bcd_agent.sections.devices.model import BINDING_HOLD, DeviceAssignment, DeviceRef, DevicesSpec
from bcd_agent.sections.telemetry.metrics import NodeMetrics
from bcd_simhost.gpus import gpu_uuid
from helper.helperproc import SOCKET, HelperProcess, base_config

G0 = gpu_uuid(0)


@pytest.fixture
def helper(sim_root: Path) -> Iterator[HelperProcess]:
    for p in (sim_root.parent, sim_root):
        os.chmod(p, 0o755)
    proc = HelperProcess(sim_root, base_config())
    yield proc
    proc.stop()


def _devices_section(sim_root: Path, tmp_path: Path, helper_socket: str | None) -> object:
    """The devices section as `Node` composes it for a node with this config on the simulated host."""
    toml = tmp_path / "node.toml"
    text = f'data_dir = "{sim_root / "var/lib/bcd"}"\n[host]\nunits = false\n'
    if helper_socket is not None:
        text += f'[helper]\nsocket = "{helper_socket}"\n'
    toml.write_text(text)
    node = Node(load_config(str(toml)), NodeOptions(root=str(sim_root)))
    node.secrets = SimpleNamespace(fetch=print)  # built by `run`; the telemetry section keeps a reference
    signer = KeyReportSigner.fresh("node-test-1", "boot-test-1")
    sections = node._sections(
        node._system(), MemorySink(), signer, SimpleNamespace(node_id="node-test-1"), None
    )
    [devices] = [s for s in sections if s.name == "devices"]
    return devices


def _converge(section: object, spec: DevicesSpec) -> SectionState:
    ctx = PassContext(DesiredSpec(spec.generation, "h"), 1, frozenset(), 0.0)
    return section.converge(spec, Observation(), ctx).state  # type: ignore[attr-defined, no-any-return]


def test_DEV_UNPRIV_06_node_with_helper_socket_binds_holds_through_the_helper(
    sim_root: Path, tmp_path: Path, helper: HelperProcess
) -> None:
    """DEV-UNPRIV-06 (the helper setup): a node whose config names the helper's socket binds a hold, and the
    hold's CDI spec and env file are written and removed by the helper (its audit log shows file.write and
    file.remove of each kind, accepted, for the allocation), not by the node. Covers DLV-PRIV-01: the
    requests name the kind (`cdi`, `allocation-env`) and the allocation id, never a path."""
    section = _devices_section(sim_root, tmp_path, SOCKET)
    hold = DeviceAssignment("a1", "rsv_a1", BINDING_HOLD, (DeviceRef(G0, "gpu"),), None)
    assert _converge(section, DevicesSpec(1, (hold,))) is SectionState.CONVERGED
    assert (sim_root / "etc/cdi/bcd-a1.json").exists()
    writes = [
        (a["op"], a["args"].get("kind"), a["args"].get("id"), a["decision"])
        for a in helper.audit_lines()
        if a["op"].startswith("file.")
    ]
    assert sorted(writes) == [
        ("file.write", "allocation-env", "a1", "accepted"),
        ("file.write", "cdi", "a1", "accepted"),
    ]
    assert not any("path" in a["args"] for a in helper.audit_lines() if a["op"].startswith("file."))
    assert _converge(section, DevicesSpec(2, ())) is SectionState.CONVERGED
    assert not (sim_root / "etc/cdi/bcd-a1.json").exists()
    removes = [(a["op"], a["args"].get("kind")) for a in helper.audit_lines() if a["op"] == "file.remove"]
    assert sorted(removes) == [("file.remove", "allocation-env"), ("file.remove", "cdi")]


def test_a_node_without_helper_socket_writes_holds_itself(
    sim_root: Path, tmp_path: Path, helper: HelperProcess
) -> None:
    """The contrast that makes the audit meaningful: with no `[helper] socket` (a root node) the same hold is
    bound with the helper running beside it and the helper writes nothing."""
    section = _devices_section(sim_root, tmp_path, None)
    hold = DeviceAssignment("a1", "rsv_a1", BINDING_HOLD, (DeviceRef(G0, "gpu"),), None)
    assert _converge(section, DevicesSpec(1, (hold,))) is SectionState.CONVERGED
    assert (sim_root / "etc/cdi/bcd-a1.json").exists()
    assert [a for a in helper.audit_lines() if a["op"].startswith("file.")] == []


def test_the_node_wires_the_instances_section_to_devices_and_metrics(sim_root: Path, tmp_path: Path) -> None:
    """DLV-ADM-07 needs the node's own wiring, not only the sections': `bcd node` hands the devices section
    the instances section's VFIO map and the memory its running domains hold (it once left the memory at
    the default 0, so holds were admitted as if no VM ran)."""
    toml = tmp_path / "node.toml"
    toml.write_text(f'data_dir = "{sim_root / "var/lib/bcd"}"\n[host]\nunits = false\n')
    node = Node(load_config(str(toml)), NodeOptions(root=str(sim_root)))
    node.secrets = SimpleNamespace(fetch=print)
    node.metrics = NodeMetrics()  # built by `run` before the sections
    signer = KeyReportSigner.fresh("node-test-1", "boot-test-1")
    sections = node._sections(
        node._system(), MemorySink(), signer, SimpleNamespace(node_id="node-test-1"), None
    )
    by_name = {s.name: s for s in sections}
    devices, instances = by_name["devices"], by_name["instances"]
    assert devices.domains_committed_bytes == instances.committed_bytes
    assert devices.vfio is not dict  # the instances' map, not the section's default (none)
    # DLV-BAL-17's metric reads the balloon controller the node gave the section.
    assert node.metrics.balloons() == {}
    instances.balloons = SimpleNamespace(lent={"vm-a": 512 << 20})
    (metric,) = [m for m in node.metrics.collect() if m.name == "bcd.instance.memory.balloon.reclaimed"]
    assert [(p.attributes, p.value) for p in metric.points] == [((("bcd.instance.id", "vm-a"),), 512 << 20)]


async def test_DEV_BUSY_05_07_the_nodes_gpu_reset_and_diag_dcgm_refuse_a_gpu_passed_through_to_a_vm(
    sim_root: Path, tmp_path: Path
) -> None:
    """DEV-BUSY-05 and DEV-BUSY-07 through `bcd node`'s own handlers: a GPU the instances section passes
    through to a VM fails gpu.reset, and diag.dcgm from level 2, `gpu-busy` naming the instance, before
    any effect. The handlers once read the busy state with an empty VFIO map, so only holds and releases
    were refused and the reset went ahead on the VM's GPU."""
    from bcd_agent.dispatch.handlers import CommandFailed
    from bcd_shared import wire
    from bcd_shared.wire.strict import type_url
    from dispatch.dhelpers import EffectCtx, make_command

    g1 = gpu_uuid(1)
    toml = tmp_path / "node.toml"
    toml.write_text(f'data_dir = "{sim_root / "var/lib/bcd"}"\n[host]\nunits = false\n')
    node = Node(load_config(str(toml)), NodeOptions(root=str(sim_root)))
    node.secrets = SimpleNamespace(fetch=print)
    node.metrics = NodeMetrics()
    signer = KeyReportSigner.fresh("node-test-1", "boot-test-1")
    node._sections(node._system(), MemorySink(), signer, SimpleNamespace(node_id="node-test-1"), None)
    node.instances_section.vfio = lambda _desired: {g1: "vm-9"}  # what the instances pass through
    handlers = node._handlers(node._system())
    reset = wire.GpuResetRequest(gpu_uuids=[G0, g1])
    dcgm = wire.DiagDcgmRequest(level=2, gpu_uuids=[g1])
    for kind, request in (("gpu.reset", reset), ("diag.dcgm", dcgm)):
        command = make_command(kind=kind, payload=(type_url(type(request)), bytes(request)))
        ctx = EffectCtx()
        with pytest.raises(CommandFailed) as busy:
            await handlers[kind].run(command, ctx)
        assert (busy.value.code, busy.value.message, ctx.began) == (
            "gpu-busy",
            f"{g1} is passed through to instance vm-9",
            0,
        ), kind
