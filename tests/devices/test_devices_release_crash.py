"""A release or bind interrupted by a crash, on the simulated host with the real journal.

The node "crashes" at a chosen point of a pass: the step there raises `Crash` (a BaseException, so no
handler of the applier sees it and nothing after it runs, as when the process dies). A new section,
executor and journal sink are then built over the same host files and the same journal (reopened), and
the section converges. The journal must then hold exactly one AllocationReleased per release and
exactly one AllocationBound per bind (Q-DEV-PASS-04, Q-DEV-EVT-02), whatever the point, each release
before the next bind of its allocation: docs/devices.md, "Releases across a crash" and "Binds across a
crash". The planner and applier are the real ones; only the host's I/O is interrupted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.journal import Journal
from bcd_agent.sections.devices.apply import DirectExecutor
from bcd_agent.sections.devices.events import PlainEvent, SignedReport
from bcd_agent.sections.devices.model import BINDING_HOLD, DeviceAssignment, DeviceRef, DevicesSpec
from bcd_agent.sections.devices.observe import LEDGER_FILE
from bcd_agent.session.events import JournalEventSink, wire_event
from bcd_shared import wire
from bcd_shared.wire.strict import decode
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import DATA_DIR, Host

G0, G1 = gpu_uuid(0), gpu_uuid(1)
BOOT = "boot-test-1"


class Crash(BaseException):
    """The process dies here."""


def hold(alloc: str, gpu: str) -> DeviceAssignment:
    return DeviceAssignment(alloc, f"rsv_{alloc}", BINDING_HOLD, (DeviceRef(gpu, "gpu"),))


class CrashingExecutor(DirectExecutor):
    """The direct executor, dying before the named write or removal of root's files."""

    def __init__(self, host: Host, at: str) -> None:
        super().__init__(host.system)
        self.at = at

    def _maybe(self, point: str) -> None:
        if point == self.at:
            raise Crash(point)

    def write_cdi(self, allocation_id: str, data: bytes) -> None:
        self._maybe(f"write_cdi:{allocation_id}")
        super().write_cdi(allocation_id, data)

    def remove_cdi(self, allocation_id: str) -> None:
        self._maybe(f"remove_cdi:{allocation_id}")
        super().remove_cdi(allocation_id)

    def write_env(self, allocation_id: str, data: bytes) -> None:
        self._maybe(f"write_env:{allocation_id}")
        super().write_env(allocation_id, data)

    def remove_env(self, allocation_id: str) -> None:
        self._maybe(f"remove_env:{allocation_id}")
        super().remove_env(allocation_id)


class CrashingSink:
    """The journal's sink, dying before (`emit-before:<type>`) or after (`emit-after:<type>`) it
    journals an event, or before it forgets keys (`forget`)."""

    def __init__(self, inner: JournalEventSink, at: str) -> None:
        self.inner = inner
        self.at = at

    def emit(self, event: SignedReport | PlainEvent, key: str | None = None) -> None:
        if self.at == f"emit-before:{event.type}":
            raise Crash(self.at)
        self.inner.emit(event, key)
        if self.at == f"emit-after:{event.type}":
            raise Crash(self.at)

    def event_keys(self, prefix: str) -> frozenset[str]:
        return self.inner.event_keys(prefix)

    def forget_keys(self, keys: Collection[str]) -> None:
        if self.at == "forget":
            raise Crash(self.at)
        self.inner.forget_keys(keys)


def crash_on_ledger_write(host: Host, nth: int) -> None:
    """Die at the `nth` write (1-based) of the event ledger in data_dir (the System's write)."""
    system = host.system
    real = system.write_atomic
    seen = [0]

    def write_atomic(path: str, data: bytes, mode: int = 0o644) -> None:
        if path == f"{DATA_DIR}/{LEDGER_FILE}":
            seen[0] += 1
            if seen[0] == nth:
                raise Crash(f"ledger-write:{nth}")
        real(path, data, mode)

    system.write_atomic = write_atomic  # type: ignore[method-assign]

    def restore() -> None:
        system.write_atomic = real  # type: ignore[method-assign]

    host.restore = restore  # type: ignore[attr-defined]


class Node:
    """One node life after another over the same simulated host and journal."""

    def __init__(self, root: Path) -> None:
        self.host = Host(root)
        self.data = root / DATA_DIR.lstrip("/")

    @contextmanager
    def life(self, at: str = "", ledger_write: int = 0) -> Iterator[Host]:
        """A node process: a fresh section over the host, its sink journaling into the journal. `at`:
        the executor's or the sink's crash point; `ledger_write`: die at that ledger write."""
        host = self.host
        with Journal.open(self.data, boot_id=BOOT) as journal:
            sink = JournalEventSink(journal, BOOT)
            host.sink = CrashingSink(sink, at)  # type: ignore[assignment]
            host.restart()
            host.section.executor = CrashingExecutor(host, at)
            if ledger_write:
                crash_on_ledger_write(host, ledger_write)
            try:
                yield host
            finally:
                if ledger_write:
                    host.restore()  # type: ignore[attr-defined]

    def reports(self) -> list[tuple[str, str, int]]:
        """The journaled attested reports: (type, allocation, generation), in journal order."""
        out = []
        with Journal.open(self.data, boot_id=BOOT) as journal:
            for row in journal.unacked_events():
                event = wire_event(row)
                assert event.attested is not None
                body = decode(wire.AttestedReportBody, event.attested.body)
                report: Any = body.allocation_bound or body.allocation_released
                out.append((event.type, report.allocation_id, report.generation))
            keys = journal.event_keys("devices:")
        assert keys == {}, f"journal keys left after the pass: {keys}"
        return out

    def interrupted(self, first: DevicesSpec, spec: DevicesSpec, point: tuple[str, int]) -> None:
        """Converge `first`, die at `point` (the crash point, the ledger write) in a pass of `spec`, then
        converge `spec` in the next life."""
        with self.life() as host:
            converged(host, first)
        with self.life(*point) as host:
            crash(host, spec)
        with self.life() as host:
            converged(host, spec)


def converged(host: Host, spec: DevicesSpec) -> None:
    assert host.run(spec).state is SectionState.CONVERGED
    assert host.section.plan(spec, spec.generation).empty


def crash(host: Host, spec: DevicesSpec) -> None:
    with pytest.raises(Crash):
        host.run(spec)


# (executor/sink crash point, ledger write that dies): every point of a release, in its order.
RELEASE_POINTS: dict[str, tuple[str, int]] = {
    "before its record": ("", 1),
    "before the first removal": ("remove_cdi:a", 0),
    "between the removals": ("remove_env:a", 0),
    "after both, before the event is journaled": ("emit-before:AllocationReleased", 0),
    "after the event is journaled, before the ledger": ("emit-after:AllocationReleased", 0),
    "after the event, at the ledger write": ("", 2),
    "after the ledger, before the keys are forgotten": ("forget", 0),
}


@pytest.mark.parametrize("point", list(RELEASE_POINTS))
def test_Q_DEV_PASS_04_a_release_a_crash_interrupts_is_reported_exactly_once(
    sim_root: Path, point: str
) -> None:
    """A plain release (a on GPU 0 dropped at generation 2, b bound on GPU 0 in the same pass) dies at
    each point of its way; after the restart the node converges, and the journal holds a's
    AllocationReleased exactly once, at generation 2, before b's AllocationBound; no key is left."""
    node = Node(sim_root)
    with node.life() as host:
        converged(host, DevicesSpec(1, (hold("a", G0),)))
    at, nth = RELEASE_POINTS[point]
    moved = DevicesSpec(2, (hold("b", G0),))
    with node.life(at, nth) as host:
        crash(host, moved)
    with node.life() as host:
        converged(host, moved)
        assert not host.path("/etc/cdi/bcd-a.json").exists()
        assert not host.path("/run/bcd/allocations/a.env").exists()
        assert host.path("/run/bcd/allocations/b.env").exists()
    reports = node.reports()
    assert Counter(reports)[("AllocationReleased", "a", 2)] == 1, reports
    assert [r for r in reports if r[0] == "AllocationReleased"] == [("AllocationReleased", "a", 2)]
    assert reports.index(("AllocationReleased", "a", 2)) < reports.index(("AllocationBound", "b", 2))
    assert Counter(reports)[("AllocationBound", "b", 2)] == 1, reports


def test_a_release_interrupted_then_the_allocation_wanted_again_reports_release_then_bind(
    sim_root: Path,
) -> None:
    """A crash between a's removals at generation 2; generation 3 wants a again on the same GPU. The
    release still goes out (once, at 2) before the new AllocationBound (at 3)."""
    node = Node(sim_root)
    with node.life() as host:
        converged(host, DevicesSpec(1, (hold("a", G0),)))
    with node.life("remove_env:a") as host:
        crash(host, DevicesSpec(2, ()))
    with node.life() as host:
        converged(host, DevicesSpec(3, (hold("a", G0),)))
    assert node.reports() == [
        ("AllocationBound", "a", 1),
        ("AllocationReleased", "a", 2),
        ("AllocationBound", "a", 3),
    ]


def test_a_release_interrupted_before_its_removals_is_dropped_when_wanted_again(sim_root: Path) -> None:
    """A crash after the release is recorded, before any removal: the next generation wants a again.
    Nothing was removed, so no AllocationReleased is owed: the record is dropped, the hold kept."""
    node = Node(sim_root)
    with node.life() as host:
        converged(host, DevicesSpec(1, (hold("a", G0),)))
    with node.life("remove_cdi:a") as host:
        crash(host, DevicesSpec(2, ()))
    with node.life() as host:
        converged(host, DevicesSpec(3, (hold("a", G0),)))
    assert node.reports() == [("AllocationBound", "a", 1)]


# (executor/sink crash point, ledger write that dies): every point of a bind, in its order. A bind
# alone writes the ledger once, after its event.
BIND_POINTS: dict[str, tuple[str, int]] = {
    "before the CDI spec": ("write_cdi:b", 0),
    "between the CDI spec and the env file": ("write_env:b", 0),
    "after the files, before the event is journaled": ("emit-before:AllocationBound", 0),
    "after the event is journaled, before the ledger": ("emit-after:AllocationBound", 0),
    "after the event, at the ledger write": ("", 1),
    "after the ledger, before the keys are forgotten": ("forget", 0),
}


@pytest.mark.parametrize("point", list(BIND_POINTS))
def test_Q_DEV_PASS_04_Q_DEV_EVT_02_a_bind_a_crash_interrupts_is_reported_exactly_once(
    sim_root: Path, point: str
) -> None:
    """Q-DEV-PASS-04 / Q-DEV-EVT-02 for a bind: a crash at any point of it (before the files are in
    place: the event is owed; after the event is journaled: its key makes the next pass's owed event
    a no-op) leaves, after the restart, the hold's files in place, exactly one AllocationBound and no
    key remembered."""
    node = Node(sim_root)
    spec = DevicesSpec(1, (hold("b", G1),))
    at, nth = BIND_POINTS[point]
    with node.life(at, nth) as host:
        crash(host, spec)
    with node.life() as host:
        converged(host, spec)
        assert host.path("/etc/cdi/bcd-b.json").exists() and host.path("/run/bcd/allocations/b.env").exists()
    assert node.reports() == [("AllocationBound", "b", 1)]


# The bind of b on a's GPU in the pass that releases a: its ledger writes are the intent's (1) and
# the pass's last (2).
MOVED_BIND_POINTS: dict[str, tuple[str, int]] = {
    **BIND_POINTS,
    "after the event, at the ledger write": ("", 2),
}


@pytest.mark.parametrize("point", list(MOVED_BIND_POINTS))
def test_Q_DEV_EVT_02_a_bind_after_a_release_a_crash_interrupts_is_reported_once_after_the_release(
    sim_root: Path, point: str
) -> None:
    """a on GPU 0 is dropped at generation 2 and b bound on GPU 0 in the same pass; the pass dies at
    each point of b's bind. After the restart: one AllocationReleased of a, then one AllocationBound
    of b, both at 2."""
    node = Node(sim_root)
    node.interrupted(
        DevicesSpec(1, (hold("a", G0),)), DevicesSpec(2, (hold("b", G0),)), MOVED_BIND_POINTS[point]
    )
    assert node.reports() == [
        ("AllocationBound", "a", 1),
        ("AllocationReleased", "a", 2),
        ("AllocationBound", "b", 2),
    ]


# The same allocation moved to another GPU (no atom shared): released and bound again in one pass.
SAME_ALLOCATION_POINTS: dict[str, tuple[str, int]] = {
    **{name: (at.replace(":b", ":a"), nth) for name, (at, nth) in MOVED_BIND_POINTS.items()},
    **{f"release: {name}": point for name, point in RELEASE_POINTS.items()},
}


@pytest.mark.parametrize("point", list(SAME_ALLOCATION_POINTS))
def test_Q_DEV_EVT_02_an_allocation_released_and_bound_again_in_one_pass_reports_each_once_in_order(
    sim_root: Path, point: str
) -> None:
    """a moves from GPU 0 to GPU 1 at generation 2 (no atom shared: released, then bound again as new,
    Q-DEV-PASS-01) and the pass dies at each point of the release or the bind. After the restart the
    journal holds a's AllocationReleased at 2 once, then its AllocationBound at 2 once: the bound key
    (allocation and generation) neither suppresses the new bind nor lets it out twice."""
    node = Node(sim_root)
    node.interrupted(
        DevicesSpec(1, (hold("a", G0),)), DevicesSpec(2, (hold("a", G1),)), SAME_ALLOCATION_POINTS[point]
    )
    assert node.reports() == [
        ("AllocationBound", "a", 1),
        ("AllocationReleased", "a", 2),
        ("AllocationBound", "a", 2),
    ]


# A kept hold that grows (GPU 0 -> GPU 0 and 1) is written over in place: the CDI spec, the env file,
# then AllocationBound at the new generation; no AllocationReleased (Q-DEV-PASS-01).
REBIND_POINTS: dict[str, tuple[str, int]] = {
    "before the CDI spec": ("write_cdi:a", 0),
    "between the CDI spec and the env file": ("write_env:a", 0),
    "after the files, before the event is journaled": ("emit-before:AllocationBound", 0),
    "after the event is journaled, before the ledger": ("emit-after:AllocationBound", 0),
    "after the event, at the ledger write": ("", 1),
    "after the ledger, before the keys are forgotten": ("forget", 0),
}


@pytest.mark.parametrize("point", list(REBIND_POINTS))
def test_Q_DEV_PASS_01_Q_DEV_EVT_02_a_rebind_a_crash_interrupts_is_reported_exactly_once(
    sim_root: Path, point: str
) -> None:
    """The in-place rewrite's AllocationBound carries the new atoms at the new generation, under its own
    key (not the first bind's): after a crash at any point of it, exactly one AllocationBound per
    generation and no AllocationReleased."""
    node = Node(sim_root)
    grown = DevicesSpec(
        2, (DeviceAssignment("a", "rsv_a", BINDING_HOLD, (DeviceRef(G0, "gpu"), DeviceRef(G1, "gpu"))),)
    )
    node.interrupted(DevicesSpec(1, (hold("a", G0),)), grown, REBIND_POINTS[point])
    assert node.reports() == [("AllocationBound", "a", 1), ("AllocationBound", "a", 2)]


def test_Q_DEV_EVT_02_a_bound_event_owed_across_two_crashes_and_a_spec_that_comes_back_is_sent_once(
    sim_root: Path,
) -> None:
    """a's AllocationBound at 1 is journaled and the node dies before the ledger records it; the next
    life (generation 2 drops a) dies after recording the release, before its first removal; generation
    3 wants a again as it was. a's hold at 1 never left the disk, so the bind's key is still
    remembered and the owed AllocationBound at 1 is not journaled again; no AllocationReleased (nothing
    was removed)."""
    node = Node(sim_root)
    with node.life("emit-after:AllocationBound") as host:
        crash(host, DevicesSpec(1, (hold("a", G0),)))
    with node.life("remove_cdi:a") as host:
        crash(host, DevicesSpec(2, ()))
    with node.life() as host:
        converged(host, DevicesSpec(3, (hold("a", G0),)))
    assert node.reports() == [("AllocationBound", "a", 1)]


def test_a_release_whose_removal_fails_stays_recorded_and_is_reported_once_later(sim_root: Path) -> None:
    """Not a crash: the env file's removal fails (a retryable error) and the pass goes on. The section
    is PROGRESSING, the ledger still records the release (the applier keeps the record of a failed
    action and forgets no key of it), and the next pass removes the env file and reports it once."""
    from bcd_agent.sections.devices.observe import read_ledger
    from bcd_shared.errors import RetryableError

    class Failing(DirectExecutor):
        def remove_env(self, allocation_id: str) -> None:
            raise RetryableError("RemoveFailed", f"removing {allocation_id}'s env file: EIO")

    node = Node(sim_root)
    with node.life() as host:
        converged(host, DevicesSpec(1, (hold("a", G0),)))
    with node.life() as host:
        host.section.executor = Failing(host.system)
        out = host.run(DevicesSpec(2, ()))
        assert out.state is SectionState.PROGRESSING and "release:a" in out.message
        assert set(read_ledger(host.system, DATA_DIR).releasing) == {"devices:released:a:2"}
        host.section.executor = DirectExecutor(host.system)
        converged(host, DevicesSpec(2, ()))
        assert read_ledger(host.system, DATA_DIR).releasing == {}
    assert node.reports() == [("AllocationBound", "a", 1), ("AllocationReleased", "a", 2)]


def test_Q_DEV_EVT_02_a_release_that_fails_keeps_the_bind_recorded_when_the_allocation_comes_back(
    sim_root: Path,
) -> None:
    """Not a crash: a's release at 2 fails at its first removal (a retryable error) and the pass goes
    on; its ledger write keeps a's bind at 1 recorded (the hold on disk is still that one). Generation
    3 wants a again as it was: the hold is kept and owes nothing, so AllocationBound at 1 is not sent
    a second time, and no AllocationReleased (nothing was removed)."""
    from bcd_agent.sections.devices.observe import read_ledger
    from bcd_shared.errors import RetryableError

    class Failing(DirectExecutor):
        def remove_cdi(self, allocation_id: str) -> None:
            raise RetryableError("RemoveFailed", f"removing {allocation_id}'s CDI spec: EIO")

    node = Node(sim_root)
    with node.life() as host:
        converged(host, DevicesSpec(1, (hold("a", G0),)))
        host.section.executor = Failing(host.system)
        assert host.run(DevicesSpec(2, ())).state is SectionState.PROGRESSING
        assert dict(read_ledger(host.system, DATA_DIR).bound) == {"a": 1}
        host.section.executor = DirectExecutor(host.system)
        converged(host, DevicesSpec(3, (hold("a", G0),)))
    assert node.reports() == [("AllocationBound", "a", 1)]


def test_a_recorded_release_keeps_its_binding_across_the_crash(sim_root: Path) -> None:
    """A Kubernetes hold whose spec entry becomes a plain hold on another GPU is released (recorded, as
    a plain release is) and bound again (on the same GPU it would be written over in place:
    Q-DEV-PASS-01); a crash between the removals leaves the record, and the AllocationReleased sent
    after the restart still says BINDING_KUBERNETES (read back from the ledger), then the new bind
    says BINDING_HOLD."""
    from bcd_agent.sections.devices.model import BINDING_KUBERNETES

    node = Node(sim_root)
    kube = DeviceAssignment("k", "rsv_k", BINDING_KUBERNETES, (DeviceRef(G0, "gpu"),))
    with node.life() as host:
        converged(host, DevicesSpec(1, (kube,)))
    with node.life("remove_env:k") as host:
        crash(host, DevicesSpec(2, (hold("k", G1),)))
    with node.life() as host:
        converged(host, DevicesSpec(2, (hold("k", G1),)))
    bindings = []
    with Journal.open(node.data, boot_id=BOOT) as journal:
        for row in journal.unacked_events():
            event = wire_event(row)
            assert event.attested is not None
            body = decode(wire.AttestedReportBody, event.attested.body)
            report: Any = body.allocation_bound or body.allocation_released
            bindings.append((event.type, report.generation, report.binding))
    assert bindings == [
        ("AllocationBound", 1, wire.Binding.KUBERNETES),
        ("AllocationReleased", 2, wire.Binding.KUBERNETES),
        ("AllocationBound", 2, wire.Binding.HOLD),
    ]


def test_an_event_the_journal_refused_is_not_recorded_as_sent(sim_root: Path) -> None:
    """Not a crash: the journal refuses the pass's AllocationFailed (full: a retryable error). The
    ledger then records no failure for that generation (so the next pass sends it), while what was
    sent before stays recorded (a's AllocationBound is not sent again)."""
    from bcd_agent.sections.devices.observe import read_ledger
    from bcd_shared.errors import RetryableError

    class Refusing(CrashingSink):
        def emit(self, event: SignedReport | PlainEvent, key: str | None = None) -> None:
            if event.type == "AllocationFailed":
                raise RetryableError("JournalFull", "journal full")
            super().emit(event, key)

    node = Node(sim_root)
    ghost = DeviceAssignment(
        "x", "rsv_x", BINDING_HOLD, (DeviceRef("GPU-00000000-dead-4000-8000-000000000000", "gpu"),)
    )
    with node.life() as host:
        converged(host, DevicesSpec(1, (hold("a", G0),)))
        spec = DevicesSpec(2, (hold("a", G0), ghost))
        host.section.sink = Refusing(host.sink.inner, "")  # type: ignore[attr-defined]
        assert host.run(spec).state is SectionState.FAILED
        ledger = read_ledger(host.system, DATA_DIR)
        assert (dict(ledger.bound), dict(ledger.failed)) == ({"a": 1}, {})
        host.section.sink = host.sink
        assert host.run(spec).state is SectionState.FAILED
        assert dict(read_ledger(host.system, DATA_DIR).failed) == {"x": 2}
        assert host.run(spec).state is SectionState.FAILED
        # Another action failing (a's release: its env file's removal) keeps what was sent recorded.

        class Failing(DirectExecutor):
            def remove_env(self, allocation_id: str) -> None:
                raise RetryableError("RemoveFailed", "EIO")

        host.section.executor = Failing(host.system)
        dropped = DevicesSpec(2, (ghost,))
        assert host.run(dropped).state is SectionState.FAILED
        assert dict(read_ledger(host.system, DATA_DIR).failed) == {"x": 2}
        host.section.executor = DirectExecutor(host.system)
        assert host.run(dropped).state is SectionState.FAILED
    with Journal.open(node.data, boot_id=BOOT) as journal:
        assert [row.type for row in journal.unacked_events()] == [
            "AllocationBound",
            "AllocationFailed",
            "AllocationReleased",
        ]


def test_the_ledger_file_reads_back_what_was_written_and_each_part_alone(sim_root: Path) -> None:
    """encode_ledger writes sorted JSON (bound, failed, and releasing only when a release is under
    way); read_ledger reads each part alone (a file with one of them keeps it, the others empty) and
    the records back as events; a file that does not parse reads as an empty ledger."""
    from bcd_agent.sections.devices.events import ReleasedEvent
    from bcd_agent.sections.devices.observe import encode_ledger, read_ledger
    from bcd_agent.sections.devices.plan import Ledger

    host = Host(sim_root)
    path = host.path(f"{DATA_DIR}/{LEDGER_FILE}")
    path.parent.mkdir(parents=True, exist_ok=True)
    event = ReleasedEvent("k", "rsv_k", 3, (G0, G1), True)
    ledger = Ledger({"b": 1, "a": 2}, {"x": 3}, {"devices:released:k:3": event})
    data = encode_ledger(ledger)
    assert data == (
        b'{"bound": {"a": 2, "b": 1}, "failed": {"x": 3}, "releasing": {"devices:released:k:3": '
        b'{"allocation_id": "k", "device_ids": ["' + G0.encode() + b'", "' + G1.encode() + b'"], '
        b'"generation": 3, "kubernetes": true, "reservation_id": "rsv_k"}}}\n'
    )
    assert encode_ledger(Ledger({"a": 1})) == b'{"bound": {"a": 1}, "failed": {}}\n'
    path.write_bytes(data)
    assert read_ledger(host.system, DATA_DIR) == ledger
    for doc, want in (
        (b'{"bound": {"a": 1}}', Ledger({"a": 1})),
        (b'{"failed": {"x": 2}}', Ledger({}, {"x": 2})),
        (b"{}", Ledger()),
        (b'{"bound": []}', Ledger()),
        (b"not json", Ledger()),
    ):
        path.write_bytes(doc)
        assert read_ledger(host.system, DATA_DIR) == want, doc
