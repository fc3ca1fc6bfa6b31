"""Devices requirements no other test names: the order of a bind's writes and its event, the slice name
and path, that bcd never moves processes, AllocationFailed's form, events journaled before they are
sent, the log levels, the binding kinds, slots, `instance_id`, and the helper path (a real
`bcd helper serve` process): file kinds, `helper: ...` errors that are retried, gpu.reset."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.helperclient import HelperClient
from bcd_agent.journal import Journal
from bcd_agent.nodeparts.kinds import GpuResetHandler
from bcd_agent.sections.devices import busy
from bcd_agent.sections.devices.apply import DirectExecutor, HelperExecutor
from bcd_agent.sections.devices.events import MemorySink, PlainEvent, SignedReport
from bcd_agent.sections.devices.model import (
    BINDING_HOLD,
    BINDING_KUBERNETES,
    DeviceAssignment,
    DeviceRef,
    DevicesSpec,
    Limits,
    spec_from_wire,
)
from bcd_agent.sections.devices.plan import ApplySlice, Emit, WriteEnv, WriteSpec
from bcd_agent.sections.devices.slices import SLICE_NAME_RE, check_slice_name, slice_cgroup, slice_name
from bcd_agent.session.events import JournalEventSink, wire_event
from bcd_shared import wire
from bcd_shared.errors import RetryableError
from bcd_shared.wire.strict import decode
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import Host, systemctl_calls
from helper.helperproc import SOCKET, HelperProcess, base_config

G0, G1, G2 = gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)
GHOST = "GPU-00000000-dead-4000-8000-000000000000"


def hold(alloc: str, gpu: str, binding: str = BINDING_HOLD, limits: Limits | None = None) -> DeviceAssignment:
    return DeviceAssignment(alloc, f"rsv_{alloc}", binding, (DeviceRef(gpu, "gpu"),), limits)


class RecordingExecutor(DirectExecutor):
    """The direct executor, logging each of root's writes (and the sink's emits, via `calls`)."""

    def __init__(self, host: Host, calls: list[str]) -> None:
        super().__init__(host.system)
        self.calls = calls

    def write_cdi(self, allocation_id: str, data: bytes) -> None:
        super().write_cdi(allocation_id, data)
        self.calls.append(f"spec {allocation_id}")

    def write_env(self, allocation_id: str, data: bytes) -> None:
        super().write_env(allocation_id, data)
        self.calls.append(f"env {allocation_id}")

    def apply_slice(self, spec, reset=()):  # type: ignore[no-untyped-def]
        super().apply_slice(spec, reset)
        self.calls.append(f"slice {spec.name}")


def test_DEV_SLICE_02_EVT_06_slice_then_spec_then_env_then_bound(host: Host) -> None:
    """Covers DEV-SLICE-02 (the slice exists before the CDI spec names it) and DEV-EVT-06 (AllocationBound
    goes out once the slice, spec and env file are written): in the plan and in what the pass does."""
    spec = DevicesSpec(1, (hold("a1", G0, limits=Limits(cpus="0-1")),))
    [bind] = [a for a in host.section.plan(spec, 1).actions if a.kind == "bind"]
    assert [type(s) for s in bind.steps] == [ApplySlice, WriteSpec, WriteEnv, Emit]

    calls: list[str] = []
    host.section.executor = RecordingExecutor(host, calls)
    slice_dir = host.path(slice_cgroup(slice_name("a1")))

    class Sink(MemorySink):
        def emit(self, event: SignedReport | PlainEvent, key: str | None = None) -> None:
            assert (
                host.path("/etc/cdi/bcd-a1.json").exists()
                and host.path("/run/bcd/allocations/a1.env").exists()
            )
            assert slice_dir.is_dir()
            calls.append(f"emit {event.type}")

    host.section.sink = Sink()
    assert host.run(spec).state is SectionState.CONVERGED
    assert calls == ["slice bcd-alloc-a1.slice", "spec a1", "env a1", "emit AllocationBound"]


def test_DEV_SLICE_07_08_slice_name_rule_and_cgroup_path(host: Host) -> None:
    """Covers DEV-SLICE-07 (a name outside `^bcd-alloc-[A-Za-z0-9_]{1,80}\\.slice$` is refused: the hold
    fails before anything is written) and DEV-SLICE-08 (the cgroup path under bcd.slice/bcd-alloc.slice)."""
    assert SLICE_NAME_RE.pattern == r"^bcd-alloc-[A-Za-z0-9_]{1,80}\.slice$"
    assert check_slice_name("bcd-alloc-a_1.slice") is None
    for bad in ("bcd-alloc-a-1.slice", "bcd-alloc-.slice", "bcd-alloc-" + "a" * 81 + ".slice", "x.slice"):
        assert check_slice_name(bad) is not None
    assert slice_cgroup(slice_name("a1")) == "/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-a1.slice"
    long_id = "a" * 81  # its slice name would not match: refused (by the id rule first) before any write
    out = host.run(DevicesSpec(1, (hold(long_id, G0, limits=Limits(cpus="0")),)))
    assert out.state is SectionState.FAILED and "must match" in out.message
    assert systemctl_calls(host.root) == [] and not host.path(f"/etc/cdi/bcd-{long_id}.json").exists()
    host.run(DevicesSpec(2, (hold("a1", G0, limits=Limits(cpus="0")),)))
    assert host.path("/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-a1.slice/cpuset.cpus").exists()


def test_DEV_SLICE_21_DLV_DEV_38_bcd_never_moves_processes(host: Host) -> None:
    """Covers DEV-SLICE-21, DLV-DEV-38: binding, keeping and releasing a sliced hold never writes a
    process into or out of the slice: its cgroup.procs keeps what the workload manager put there, and the
    only systemctl calls are start, set-property and (empty slice) stop."""
    spec = DevicesSpec(1, (hold("a1", G0, limits=Limits(cpus="0-1")),))
    host.run(spec)
    procs = host.path(f"{slice_cgroup(slice_name('a1'))}/cgroup.procs")
    procs.write_text("4242\n")  # the workload manager placed a process there
    host.path(f"{slice_cgroup(slice_name('a1'))}/cgroup.events").write_text("populated 1\nfrozen 0\n")
    host.run(spec)
    host.run(DevicesSpec(2, ()))
    assert procs.read_text() == "4242\n"
    assert {c.split()[0] for c in systemctl_calls(host.root)} <= {"start", "set-property", "stop"}
    assert not any("--pid" in c or "attach" in c for c in systemctl_calls(host.root))
    assert not host.path("/var/lib/bcd-sim/killed-workloads").exists()


def test_DEV_EVT_02_09_allocation_failed_is_plain_with_its_fields(host: Host) -> None:
    """Covers DEV-EVT-02 (AllocationFailed is a plain, unsigned event) and DEV-EVT-09 (it carries
    allocation_id, generation, reason and message)."""
    out = host.run(DevicesSpec(7, (hold("a9", GHOST),)))
    assert out.state is SectionState.FAILED
    [failed] = [e for e in host.sink.events if e.type == "AllocationFailed"]
    assert isinstance(failed, PlainEvent) and not hasattr(failed, "signature")
    msg = decode(wire.AllocationFailed, failed.payload)
    assert msg.allocation_id == "a9" and msg.generation == 7 and msg.reservation_id == "rsv_a9"
    assert msg.reason and msg.message and GHOST in msg.message


def test_DEV_EVT_03_allocation_events_are_journaled_and_replayed_until_acked(
    host: Host, tmp_path: Path
) -> None:
    """Covers DEV-EVT-03: with the node's journal as the sink, AllocationBound, AllocationFailed and
    AllocationReleased are in the journal when the pass returns (before any session sends them), stay
    there across a reopen, and go only when acknowledged."""
    data = tmp_path / "journal"
    with Journal.open(data, boot_id="b1") as journal:
        host.section.sink = JournalEventSink(journal, "b1")
        host.run(DevicesSpec(1, (hold("a1", G0), hold("a2", GHOST))))
        host.run(DevicesSpec(2, ()))
        journal_id = journal.journal_id
    with Journal.open(data, boot_id="b2") as journal:
        rows = journal.unacked_events()
        assert sorted(r.type for r in rows) == ["AllocationBound", "AllocationFailed", "AllocationReleased"]
        bound = wire_event(next(r for r in rows if r.type == "AllocationBound"))
        assert bound.attested is not None and bound.attested.signature  # the signed report, as journaled
        journal.ack_events(journal_id, rows[0].seq)
        assert len(journal.unacked_events()) == 2
        journal.ack_events(journal_id, rows[-1].seq)
        assert journal.unacked_events() == []


def test_DEV_FAIL_14_warn_while_retrying_error_when_failed(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """Covers DEV-FAIL-14: a retryable write failure is logged at WARNING (PROGRESSING), a refused hold
    at ERROR (FAILED)."""

    class Failing(DirectExecutor):
        def write_cdi(self, allocation_id: str, data: bytes) -> None:
            raise RetryableError("WriteFailed", "writing /etc/cdi: disk full")

    host.section.executor = Failing(host.system)
    with caplog.at_level(logging.INFO, logger="bcd.devices"):
        assert host.run(DevicesSpec(1, (hold("a1", G0),))).state is SectionState.PROGRESSING
    assert [r.levelno for r in caplog.records if "disk full" in r.getMessage()][-1] == logging.WARNING
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)
    caplog.clear()
    host.section.executor = DirectExecutor(host.system)
    with caplog.at_level(logging.INFO, logger="bcd.devices"):
        assert host.run(DevicesSpec(2, (hold("a2", GHOST),))).state is SectionState.FAILED
    assert any(r.levelno == logging.ERROR and "a2: " in r.getMessage() for r in caplog.records)


def test_DEV_BND_01_02_08_hold_and_kubernetes_are_bound_alike(host: Host) -> None:
    """Covers DEV-BND-01 (BINDING_HOLD and BINDING_KUBERNETES are checked and bound the same way: the same
    refusal, spec, env file and AllocationBound), DEV-BND-02 (a hold's spec carries NVIDIA's device edits
    from the vendor spec, so `bcd.dev/gpu=<device-name>` is all a container needs) and the node's half
    of the device plugins' lookup (a Kubernetes hold's spec carries `bcd.dev/binding: kubernetes`, a
    plain hold's does not)."""
    out = host.run(DevicesSpec(1, (hold("h0", GHOST), hold("k0", GHOST, BINDING_KUBERNETES))))
    msgs = dict(part.split(": ", 1) for part in out.message.split("; "))
    assert msgs["h0"] == msgs["k0"]  # refused by the same check, in the same words

    host.run(DevicesSpec(2, (hold("h1", G0), hold("k1", G1, BINDING_KUBERNETES))))
    h = json.loads(host.path("/etc/cdi/bcd-h1.json").read_text())
    k = json.loads(host.path("/etc/cdi/bcd-k1.json").read_text())
    assert h["kind"] == k["kind"] == "bcd.dev/gpu"
    assert [d["name"] for d in h["devices"]] == [G0] and [d["name"] for d in k["devices"]] == [G1]
    assert "bcd.dev/binding" not in h["annotations"] and k["annotations"]["bcd.dev/binding"] == "kubernetes"
    for alloc, gpu in (("h1", G0), ("k1", G1)):
        env = host.path(f"/run/bcd/allocations/{alloc}.env").read_text().splitlines()
        assert f"BCD_ALLOCATION_ID={alloc}" in env and f"NVIDIA_VISIBLE_DEVICES={gpu}" in env
    bound = {e.allocation_id: e for e in host.events("BoundEvent")}  # type: ignore[attr-defined]
    assert bound["h1"].kubernetes is False and bound["k1"].kubernetes is True  # type: ignore[attr-defined]

    vendor = json.loads(host.path("/etc/cdi/nvidia.json").read_text())
    vendor_dev = next(d for d in vendor["devices"] if d["name"] in ("0", G0))
    assert h["devices"][0]["containerEdits"]["deviceNodes"] == vendor_dev["containerEdits"]["deviceNodes"]
    assert h["containerEdits"]["deviceNodes"] == vendor["containerEdits"]["deviceNodes"]
    assert f"NVIDIA_VISIBLE_DEVICES={G0}" in h["containerEdits"]["env"]


def test_DEV_ATOM_08_a_slot_grants_the_whole_gpu(host: Host) -> None:
    """Covers DEV-ATOM-08: a slot is bookkeeping only: the slot hold's device is the whole GPU as the
    driver sees it (its device nodes, NVIDIA_VISIBLE_DEVICES the GPU's UUID), no per-slot partition."""
    slot = DeviceAssignment("s1", "r", BINDING_HOLD, (DeviceRef(f"{G2}/s1", "gpu.slot"),))
    whole = DeviceAssignment("w1", "r", BINDING_HOLD, (DeviceRef(G0, "gpu"),))
    out = host.run(DevicesSpec(1, (slot, whole)))
    assert out.state is SectionState.CONVERGED, out.message
    env = host.path("/run/bcd/allocations/s1.env").read_text().splitlines()
    assert f"NVIDIA_VISIBLE_DEVICES={G2}" in env
    s = json.loads(host.path("/etc/cdi/bcd-s1.json").read_text())
    w = json.loads(host.path("/etc/cdi/bcd-w1.json").read_text())
    nodes = [n["path"] for n in s["devices"][0]["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidia2" in nodes
    assert len(w["devices"][0]["containerEdits"]["deviceNodes"]) == len(nodes)  # as much as a whole GPU


def test_DEV_ASG_11_instance_id_is_not_read() -> None:
    """Covers DEV-ASG-11: an assignment's `instance_id` (for BINDING_INSTANCE) does not reach the hold."""
    base = wire.DeviceAssignment(
        allocation_id="a1", reservation_id="r", binding=wire.Binding.HOLD, devices=[wire.DeviceAtom(id=G0)]
    )
    other = wire.DeviceAssignment(
        allocation_id="a1",
        reservation_id="r",
        binding=wire.Binding.HOLD,
        devices=[wire.DeviceAtom(id=G0)],
        instance_id="inst_1",
    )
    one = spec_from_wire(1, wire.DevicesSection(assignments=[base]))
    two = spec_from_wire(1, wire.DevicesSection(assignments=[other]))
    assert one == two


# --- the helper path --------------------------------------------------------------------------------


@pytest.fixture
def helper_host(sim_root: Path) -> Iterator[tuple[Host, list[HelperProcess]]]:
    """An unprivileged node's devices section beside a real `bcd helper serve` on the same simulated
    host (the list holds the running helper; a test may stop and start it again)."""
    for p in (sim_root.parent, sim_root):
        os.chmod(p, 0o755)
    procs = [HelperProcess(sim_root, base_config())]
    try:
        host = Host(sim_root)
        host.section.executor = HelperExecutor(HelperClient(procs[0].socket_path))
        yield host, procs
    finally:
        for proc in procs:
            proc.stop()


def test_DEV_BIND_05_holds_go_through_the_helper(
    helper_host: tuple[Host, list[HelperProcess]],
) -> None:
    """Covers DEV-BIND-05 (file.write of kind cdi / allocation-env with the allocation id, file.remove of
    the same kinds). The executor is wired by hand here; that `bcd node` itself wires it beside the helper
    is tested in test_devices_node_helper.py."""
    host, [helper] = helper_host
    assert host.run(DevicesSpec(1, (hold("a1", G0),))).state is SectionState.CONVERGED
    assert host.path("/etc/cdi/bcd-a1.json").exists() and host.path("/run/bcd/allocations/a1.env").exists()
    assert host.run(DevicesSpec(2, ())).state is SectionState.CONVERGED
    assert not host.path("/etc/cdi/bcd-a1.json").exists()
    ops = [(a["op"], a["args"].get("kind"), a["args"].get("id"), a["decision"]) for a in helper.audit_lines()]
    ops = [o for o in ops if o[0].startswith("file.")]
    assert sorted(ops) == sorted(
        [
            ("file.write", "cdi", "a1", "accepted"),
            ("file.write", "allocation-env", "a1", "accepted"),
            ("file.remove", "cdi", "a1", "accepted"),
            ("file.remove", "allocation-env", "a1", "accepted"),
        ]
    )
    assert [type(e).__name__ for e in host.events()] == ["BoundEvent", "ReleasedEvent"]


def test_DEV_BIND_07_DLV_PRIV_05_06_helper_error_is_retried(
    helper_host: tuple[Host, list[HelperProcess]],
) -> None:
    """Covers DEV-BIND-07, DLV-PRIV-05, DLV-PRIV-06 and DEV-BIND-03's section half: with the helper
    gone, the bind's write is an error of that action reported as `helper: ...`; the section stays
    PROGRESSING (the runner retries it in 30 s), nothing is reported; a later pass, the helper back,
    binds it."""
    host, procs = helper_host
    procs[0].stop()
    sock = host.path(SOCKET)
    if sock.exists():
        sock.unlink()
    out = host.run(DevicesSpec(1, (hold("a1", G0),)))
    assert out.state is SectionState.PROGRESSING and out.reason == "HoldWriteFailed"
    assert out.message.startswith("bind:a1: helper: ")
    assert host.events() == []
    procs.append(HelperProcess(host.root))
    out = host.run(DevicesSpec(1, (hold("a1", G0),)))
    assert out.state is SectionState.CONVERGED, out.message
    assert [type(e).__name__ for e in host.events()] == ["BoundEvent"]


def test_DEV_BUSY_14_gpu_reset_goes_through_the_helper(helper_host: tuple[Host, list[HelperProcess]]) -> None:
    """Covers DEV-BUSY-14: beside `bcd helper`, the gpu.reset handler's reset is the helper's gpu.reset
    op (the helper audits it), and the reset core reports it reset."""
    host, [helper] = helper_host
    handler = GpuResetHandler(host.system, "/var/lib/bcd", helper=HelperClient(helper.socket_path))
    state = busy.read_busy(host.system, "/var/lib/bcd", {})
    result = busy.gpu_reset(host.system, [G0], state, handler._helper_reset)
    assert [(g.gpu_uuid, g.reset) for g in result.gpus] == [(G0, True)]
    resets = [a for a in helper.audit_lines() if a["op"] == "gpu.reset"]
    assert len(resets) == 1 and resets[0]["decision"] == "accepted"
