"""The converge runner's contract, with simple in-test sections (the runner is what is tested here).

Time runs on trio's MockClock (`autojump_clock`): a 10-minute drift wait takes no real time, and the
recorded `ctx.now_monotonic` of each call says exactly when a pass ran.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import attrs
import pytest
import trio
import trio.testing
from bcd_agent.converge.runner import DRIFT_INTERVAL_S, MAX_FOLLOW_UP_PASSES, RETRY_INTERVAL_S, ConvergeRunner
from bcd_agent.converge.section import Observation, PartsObserver, PassContext
from bcd_agent.converge.status import StatusCell
from bcd_agent.converge.types import (
    SECTION_FIELD_NUMBERS,
    SECTION_ORDER,
    Condition,
    DesiredSpec,
    NodeStatus,
    SectionOutcome,
    SectionState,
)
from bcd_shared.errors import HelperRefused, RetryableError, TerminalError
from testsupport import REPO

Behaviour = Callable[[object | None, Observation, PassContext], SectionOutcome]


@attrs.define
class Call:
    section: str
    desired: object | None
    observation: Observation
    ctx: PassContext


def converged(name: str, **kw: object) -> Behaviour:
    def behave(desired: object | None, obs: Observation, ctx: PassContext) -> SectionOutcome:
        return SectionOutcome(section=name, state=SectionState.CONVERGED, **kw)  # type: ignore[arg-type]

    return behave


@attrs.define
class FakeSection:
    """An asynchronous section whose behaviour the test sets (and may change between passes)."""

    name: str
    log: list[Call]
    behave: Behaviour | None = None

    def is_empty(self, desired: object | None) -> bool:
        return desired is None

    async def converge(
        self, desired: object | None, observation: Observation, ctx: PassContext
    ) -> SectionOutcome:
        self.log.append(Call(self.name, desired, observation, ctx))
        behave = self.behave or converged(self.name)
        return behave(desired, observation, ctx)


@attrs.define
class World:
    runner: ConvergeRunner
    calls: list[Call]
    sections: dict[str, FakeSection]
    observations: list[Observation]

    def passes(self, section: str = "host") -> list[PassContext]:
        return [c.ctx for c in self.calls if c.section == section]


def make_world(
    names: tuple[str, ...] = SECTION_ORDER, spec: DesiredSpec | None = None, **runner_kw: object
) -> World:
    calls: list[Call] = []
    observations: list[Observation] = []
    sections = {n: FakeSection(n, calls) for n in names}

    async def observe() -> Observation:
        obs = Observation(parts={"n": len(observations)}, taken_monotonic=trio.current_time())
        observations.append(obs)
        return obs

    runner = ConvergeRunner(list(sections.values()), observe, initial_spec=spec, **runner_kw)  # type: ignore[arg-type]
    return World(runner, calls, sections, observations)


def spec(generation: int = 1, **sections: object) -> DesiredSpec:
    return DesiredSpec(generation=generation, spec_hash=f"hash-{generation}", sections=sections)


async def wait_passes(runner: ConvergeRunner, n: int) -> NodeStatus:
    status = runner.status.latest()
    while status is None or status.passes < n:
        status = await runner.status.wait_newer(status.version if status else 0)
    return status


# --- one observation, every section, every pass --------------------------------------------------


async def test_DLV_SPEC_01_every_pass_runs_every_section_in_order_from_one_observation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Covers DLV-SPEC-01 (the order), DLV-SPEC-02 (every section planned and applied every pass)."""
    world = make_world(spec=spec(1, devices=("gpu-0",)))
    async with trio.open_nursery() as nursery:
        await nursery.start(world.runner.run)
        await wait_passes(world.runner, 1)
        world.runner.trigger("test")
        await wait_passes(world.runner, 2)
        nursery.cancel_scope.cancel()
    assert len(world.observations) == 2
    for i in range(2):
        this_pass = [c for c in world.calls if c.ctx.pass_number == i + 1]
        assert tuple(c.section for c in this_pass) == SECTION_ORDER  # empty sections included
        assert all(c.observation is world.observations[i] for c in this_pass)
    assert [c.desired for c in world.calls if c.section == "devices"] == [("gpu-0",), ("gpu-0",)]


async def test_DLV_CONV_17_18_status_has_one_section_status_per_section(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Covers DLV-CONV-17, DLV-CONV-18, DLV-GEN-02: generations, hash, one SectionStatus per section."""
    world = make_world(spec=spec(4))
    status = await world.runner.converge_once()
    assert status.applied_generation == 4
    assert status.observed_generation == 4
    assert status.spec_hash == "hash-4"
    assert [s.section for s in status.sections] == list(SECTION_ORDER)
    assert all(s.state is SectionState.CONVERGED and s.generation == 4 for s in status.sections)


# --- sections without a converger ----------------------------------------------------------------


async def test_DLV_CONV_03_04_05_section_without_converger(autojump_clock: trio.testing.MockClock) -> None:
    """Covers DLV-CONV-03 (empty converges), DLV-CONV-04 (non-empty UNSUPPORTED, terminal) and
    DLV-CONV-05 (SectionUnsupported, reason the field number; the rest still converges)."""
    world = make_world(names=("host", "devices"), spec=spec(3, telemetry={"endpoint": "x"}, site=()))
    status = await world.runner.converge_once()
    by = {s.section: s for s in status.sections}
    assert by["telemetry"].state is SectionState.UNSUPPORTED
    assert by["telemetry"].reason == str(SECTION_FIELD_NUMBERS["telemetry"]) == "5"
    assert by["site"].state is SectionState.CONVERGED  # empty (sized, length 0)
    assert by["instances"].state is SectionState.CONVERGED  # absent
    assert by["host"].state is SectionState.CONVERGED and by["devices"].state is SectionState.CONVERGED
    assert [(c.type, c.reason, c.section) for c in status.conditions] == [
        ("SectionUnsupported", "5", "telemetry")
    ]
    assert status.observed_generation == 3  # UNSUPPORTED is terminal


async def test_DLV_CONV_06_unknown_nodespec_field_is_unsupported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Covers DLV-CONV-06: a section number bcd does not know is UNSUPPORTED (reason: the number)."""
    world = make_world(spec=DesiredSpec(generation=2, spec_hash="h", unknown_fields=(12,)))
    status = await world.runner.converge_once()
    assert status.sections[-1].section == "12"
    assert status.sections[-1].state is SectionState.UNSUPPORTED
    assert status.sections[-1].reason == "12"
    assert [(c.type, c.reason) for c in status.conditions] == [("SectionUnsupported", "12")]
    assert status.observed_generation == 2


async def test_DLV_CONV_12_13_host_managed_externally(autojump_clock: trio.testing.MockClock) -> None:
    """Covers DLV-CONV-12, DLV-CONV-13, HST-HLP-13: `[host] units = false` -> no host converger; a
    host section with units is UNSUPPORTED/HostManagedExternally, raises no condition, and does not
    hold back observed_generation."""
    world = make_world(spec=spec(5, host=("sysctl",)), host_units=False)
    status = await world.runner.converge_once()
    host = status.section("host")
    assert (host.state, host.reason) == (SectionState.UNSUPPORTED, "HostManagedExternally")
    assert status.conditions == ()
    assert status.observed_generation == 5
    assert world.passes("host") == []  # the host converger is never called
    assert len(world.passes("devices")) == 1
    world.runner.set_spec(spec(6))  # an empty host section converges trivially
    status = await world.runner.converge_once()
    assert status.section("host").state is SectionState.CONVERGED


# --- states from errors, observed_generation --------------------------------------------------------


async def test_DLV_CONV_01_02_observed_generation_waits_for_retryable_sections(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Covers DLV-CONV-01, DLV-CONV-02, DLV-GEN-03: PROGRESSING holds observed_generation back
    (never backwards); FAILED (terminal) lets it advance; failures are logged WARN / ERROR."""
    world = make_world(spec=spec(1))
    status = await world.runner.converge_once()
    assert status.observed_generation == 1

    def retry(d: object | None, o: Observation, c: PassContext) -> SectionOutcome:
        raise RetryableError("ToolFailed", "systemctl exited 1: Access denied")

    world.sections["devices"].behave = retry
    world.runner.set_spec(spec(2))
    with caplog.at_level(logging.WARNING, logger="bcd.converge"):
        status = await world.runner.converge_once()
    devices = status.section("devices")
    assert (devices.state, devices.reason, devices.generation) == (SectionState.PROGRESSING, "ToolFailed", 2)
    assert status.applied_generation == 2 and status.observed_generation == 1
    assert any(
        r.levelno == logging.WARNING and "systemctl exited 1" in r.getMessage() for r in caplog.records
    )

    def terminal(d: object | None, o: Observation, c: PassContext) -> SectionOutcome:
        raise TerminalError("overlap", "GPU-1 is assigned to alloc_a")

    world.sections["devices"].behave = terminal
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bcd.converge"):
        status = await world.runner.converge_once()
    assert status.section("devices").state is SectionState.FAILED
    assert status.observed_generation == 2
    assert any(r.levelno == logging.ERROR and "alloc_a" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "error",
    [HelperRefused("refused", "file.write refused"), KeyError("boom"), ValueError("bad")],
    ids=["helper-refused", "key-error", "value-error"],
)
async def test_DLV_CONV_02_helper_refusals_and_unexpected_errors_are_retryable(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    """Covers DLV-CONV-02, DLV-PRIV: a helper refusal and any unexpected exception keep the section
    PROGRESSING and are logged (an unexpected one with its traceback), never swallowed."""
    world = make_world(spec=spec(1))

    def boom(d: object | None, o: Observation, c: PassContext) -> SectionOutcome:
        raise error

    world.sections["access"].behave = boom
    with caplog.at_level(logging.WARNING, logger="bcd.converge"):
        status = await world.runner.converge_once()
    access = status.section("access")
    assert access.state is SectionState.PROGRESSING
    assert status.observed_generation == 0
    if isinstance(error, HelperRefused):
        assert access.message == "helper: file.write refused"
    else:
        assert access.reason == "InternalError"
        assert type(error).__name__ in access.message
        assert any(r.exc_info is not None for r in caplog.records)
    assert caplog.records


async def test_a_section_returning_another_sections_outcome_is_an_internal_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    world = make_world(spec=spec(1))
    world.sections["site"].behave = converged("host")
    status = await world.runner.converge_once()
    assert (status.section("site").state, status.section("site").reason) == (
        SectionState.PROGRESSING,
        "InternalError",
    )


async def test_an_async_section_that_hangs_times_out_as_progressing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[Call] = []

    class Hangs(FakeSection):
        async def converge(
            self, desired: object | None, observation: Observation, ctx: PassContext
        ) -> SectionOutcome:
            await trio.sleep_forever()
            raise AssertionError("unreachable")

    async def observe() -> Observation:
        return Observation()

    runner = ConvergeRunner([Hangs("daemon", calls)], observe, initial_spec=spec(1), section_timeout_s=60)
    status = await runner.converge_once()
    assert (status.section("daemon").state, status.section("daemon").reason) == (
        SectionState.PROGRESSING,
        "Timeout",
    )


# --- when passes run ------------------------------------------------------------------------------


async def test_DLV_CONV_25_passes_at_start_on_retry_and_on_drift(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Covers DLV-CONV-25 and DLV-CONV-02: a pass at start; every 30 s while a section is
    PROGRESSING; then every 10 minutes whatever happened (drift)."""
    world = make_world(spec=spec(1))
    failures = {"left": 2}

    def flaky(d: object | None, o: Observation, c: PassContext) -> SectionOutcome:
        if failures["left"]:
            failures["left"] -= 1
            raise RetryableError("NotReady", "not yet")
        return SectionOutcome(section="instances", state=SectionState.CONVERGED)

    world.sections["instances"].behave = flaky
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(world.runner.run)
        await wait_passes(world.runner, 5)
        nursery.cancel_scope.cancel()
    passes = world.passes()
    times = [round(p.now_monotonic - t0, 3) for p in passes]
    r, d = RETRY_INTERVAL_S, DRIFT_INTERVAL_S
    assert times == [0, r, 2 * r, 2 * r + d, 2 * r + 2 * d]
    assert [p.reasons for p in passes] == [
        {"start"},
        {"retry"},
        {"retry"},
        {"drift"},
        {"drift"},
    ]


async def test_DLV_RCV_new_spec_runs_a_pass_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """A new spec triggers a pass immediately; a generation not above the held one is ignored.
    Without a spec, the runner publishes an empty status and runs no pass."""
    world = make_world()
    async with trio.open_nursery() as nursery:
        await nursery.start(world.runner.run)
        first = world.runner.status.latest()
        assert first is not None and first.applied_generation == 0 and first.sections == ()
        await trio.sleep(3600)
        assert world.calls == []  # nothing to converge, no drift pass either
        t = trio.current_time()
        assert world.runner.set_spec(spec(7))
        status = await wait_passes(world.runner, 1)
        assert status.observed_generation == 7
        assert world.passes()[0].now_monotonic == t and world.passes()[0].reasons == {"spec"}
        assert not world.runner.set_spec(spec(6))
        assert not world.runner.set_spec(spec(7))
        await trio.sleep(1)
        assert len(world.passes()) == 1
        nursery.cancel_scope.cancel()


async def test_trigger_api_runs_a_pass_for_events_of_other_parts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    world = make_world(spec=spec(1))
    async with trio.open_nursery() as nursery:
        await nursery.start(world.runner.run)
        await wait_passes(world.runner, 1)
        await trio.sleep(5)
        world.runner.trigger("kube-reaper-freed-devices")
        await wait_passes(world.runner, 2)
        nursery.cancel_scope.cancel()
    second = world.passes()[1]
    assert second.reasons == {"kube-reaper-freed-devices"}
    assert second.now_monotonic - world.passes()[0].now_monotonic == 5


async def test_a_section_that_changed_the_host_triggers_the_next_pass_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Events of other sections: a pass in which `host` changed the host (a MIG layout made) is
    followed at once by another, so `devices` sees the change; at most MAX_FOLLOW_UP_PASSES in a row."""
    world = make_world(spec=spec(1))
    world.sections["host"].behave = converged("host", changed=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(world.runner.run)
        await wait_passes(world.runner, 1 + MAX_FOLLOW_UP_PASSES)
        await trio.sleep(DRIFT_INTERVAL_S - 1)
        nursery.cancel_scope.cancel()
    passes = world.passes()
    assert [p.reasons for p in passes] == [{"start"}] + [{"changed"}] * MAX_FOLLOW_UP_PASSES
    assert all(p.now_monotonic == passes[0].now_monotonic for p in passes)


# --- conditions and status ------------------------------------------------------------------------


async def test_DLV_CONV_19_conditions_keep_their_first_time_and_report_ages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Covers DLV-CONV-19: ages on the monotonic clock; a condition raised again keeps its since;
    a condition a section stops raising goes; a section that raised keeps its last conditions."""
    world = make_world(spec=spec(1))
    reboot = Condition(type="RebootRequired", reason="hugepages", message="reboot the node")
    world.sections["host"].behave = converged("host", conditions=(reboot,))
    t0 = trio.current_time()
    await world.runner.converge_once()
    await trio.sleep(30)
    status = await world.runner.converge_once()
    assert [c.since_monotonic for c in status.conditions] == [t0]
    assert status.conditions[0].section == "host"
    await trio.sleep(15)
    [report] = status.report_conditions(trio.current_time())
    assert (report.type, report.age_ms) == ("RebootRequired", 45_000)

    def broken(d: object | None, o: Observation, c: PassContext) -> SectionOutcome:
        raise RetryableError("ToolFailed", "nvidia-smi exited 9")

    world.sections["host"].behave = broken
    status = await world.runner.converge_once()
    assert [c.since_monotonic for c in status.conditions] == [t0]

    world.sections["host"].behave = converged("host")
    status = await world.runner.converge_once()
    assert status.conditions == ()
    await trio.sleep(10)
    world.sections["host"].behave = converged("host", conditions=(reboot,))
    status = await world.runner.converge_once()
    assert [c.since_monotonic for c in status.conditions] == [trio.current_time()]


async def test_DLV_CONV_22_status_is_coalesced_latest_wins(autojump_clock: trio.testing.MockClock) -> None:
    """Covers the agent's half of DLV-CONV-22: a reader that falls behind sees only the newest status."""
    world = make_world(spec=spec(1))
    cell = world.runner.status
    for _ in range(5):
        await world.runner.converge_once()
    newest = await cell.wait_newer(0)
    assert newest.passes == 5 and newest is cell.latest()
    got: list[NodeStatus] = []

    async def reader() -> None:
        got.append(await cell.wait_newer(newest.version))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.sleep(1)
        assert got == []
        world.runner.set_spec(spec(2))
        await world.runner.converge_once()
        await world.runner.converge_once()
    assert got[0].version > newest.version


async def test_status_cell_alone() -> None:
    cell = StatusCell()
    assert cell.latest() is None
    s1 = NodeStatus(
        version=1,
        applied_generation=0,
        observed_generation=0,
        spec_hash="",
        sections=(),
        conditions=(),
        passes=0,
        last_pass_monotonic=0.0,
    )
    cell.publish(s1)
    cell.publish(attrs.evolve(s1, version=2))
    assert (await cell.wait_newer(0)).version == 2


# --- observation --------------------------------------------------------------------------------


async def test_a_failed_observation_part_holds_back_only_the_sections_that_read_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def inventory() -> object:
        raise RetryableError("ToolFailed", "nvidia-smi exited 9")

    def holds() -> object:
        return ("alloc_a",)

    def broken() -> object:
        raise OSError("EIO")

    observer = PartsObserver(
        {"inventory": inventory, "holds": holds, "x": broken}, trio.current_time, in_thread=False
    )
    calls: list[Call] = []
    devices = FakeSection("devices", calls)
    access = FakeSection("access", calls)

    def needs_inventory(d: object | None, o: Observation, c: PassContext) -> SectionOutcome:
        o.get("inventory")
        return SectionOutcome(section="devices", state=SectionState.CONVERGED)

    def reads_holds(d: object | None, o: Observation, c: PassContext) -> SectionOutcome:
        assert o.get("holds") == ("alloc_a",)
        assert not o.has("x") and not o.has("inventory") and o.has("holds")
        with pytest.raises(RetryableError, match="OSError: EIO"):
            o.get("x")
        with pytest.raises(RetryableError, match="no part 'nope'"):
            o.get("nope")
        return SectionOutcome(section="access", state=SectionState.CONVERGED)

    devices.behave, access.behave = needs_inventory, reads_holds
    runner = ConvergeRunner([devices, access], observer, initial_spec=spec(1))
    status = await runner.converge_once()
    assert status.section("devices").state is SectionState.PROGRESSING
    assert status.section("devices").message == "nvidia-smi exited 9"
    assert status.section("access").state is SectionState.CONVERGED


async def test_an_observer_that_raises_makes_reading_sections_progressing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[Call] = []
    devices = FakeSection("devices", calls)

    def needs(d: object | None, o: Observation, c: PassContext) -> SectionOutcome:
        o.get("inventory")
        return SectionOutcome(section="devices", state=SectionState.CONVERGED)

    devices.behave = needs

    async def observe() -> Observation:
        raise OSError("disk gone")

    runner = ConvergeRunner([devices], observe, initial_spec=spec(1))
    status = await runner.converge_once()
    assert (status.section("devices").state, status.section("devices").reason) == (
        SectionState.PROGRESSING,
        "ObservationFailed",
    )


async def test_a_synchronous_section_runs_in_a_worker_thread() -> None:
    """A sync converge (files and tools through a System) runs off the trio thread, so a long step
    never stalls the session; the thread-safe trigger works from there too."""
    seen: list[str] = []

    class SyncSection:
        name = "host"

        def __init__(self, runner_box: list[ConvergeRunner]) -> None:
            self.box = runner_box

        def is_empty(self, desired: object | None) -> bool:
            return desired is None

        def converge(
            self, desired: object | None, observation: Observation, ctx: PassContext
        ) -> SectionOutcome:
            seen.append(threading.current_thread().name)
            if ctx.pass_number == 1:
                self.box[0].trigger("from-thread")
            return SectionOutcome(section="host", state=SectionState.CONVERGED)

    async def observe() -> Observation:
        return Observation()

    box: list[ConvergeRunner] = []
    runner = ConvergeRunner([SyncSection(box)], observe, initial_spec=spec(1))
    box.append(runner)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            status = await wait_passes(runner, 2)
            nursery.cancel_scope.cancel()
    assert status.passes >= 2
    assert seen and all(name != threading.main_thread().name for name in seen)


# --- construction and the wire ------------------------------------------------------------------


def test_runner_refuses_bad_section_sets() -> None:
    async def observe() -> Observation:
        return Observation()

    with pytest.raises(ValueError, match="not one of"):
        ConvergeRunner([FakeSection("gpus", [])], observe)
    with pytest.raises(ValueError, match="two convergers"):
        ConvergeRunner([FakeSection("host", []), FakeSection("host", [])], observe)


def test_desired_spec_is_strict() -> None:
    with pytest.raises(ValueError, match="generation"):
        DesiredSpec(generation=0, spec_hash="h")
    with pytest.raises(ValueError, match="unknown section names"):
        DesiredSpec(generation=1, spec_hash="h", sections={"gpus": 1})
    with pytest.raises(ValueError, match="not an unknown NodeSpec field"):
        DesiredSpec(generation=1, spec_hash="h", unknown_fields=(2,))
    d = DesiredSpec(generation=1, spec_hash="h", sections={"host": (1,)})
    with pytest.raises(TypeError):
        d.sections["host"] = 2  # type: ignore[index]


def test_DLV_CONV_05_section_field_numbers_match_the_proto() -> None:
    """SectionUnsupported's reason is NodeSpec's field number: the table must agree with the proto."""
    import re

    protos = sorted((REPO / "proto" / "bcd" / "v1").glob("*.proto"))
    text = "\n".join(p.read_text() for p in protos)
    m = re.search(r"message NodeSpec \{(.*?)\n\}", text, re.S)
    assert m is not None, "proto/bcd/v1 defines NodeSpec"
    fields = {
        name: int(num) for name, num in re.findall(r"^\s*\S+\s+(\w+)\s*=\s*(\d+)\s*;", m.group(1), re.M)
    }
    for section, number in SECTION_FIELD_NUMBERS.items():
        assert fields.get(section) == number, (section, fields)


async def test_conditions_of_other_parts_are_published_at_once_beside_the_sections() -> None:
    """`set_conditions(source, …)` (the XID watcher): published with a new version and no pass, kept
    across passes beside the sections' conditions, replaced whole, gone when set empty; an unchanged
    set publishes nothing."""
    from bcd_agent.converge.types import Condition

    world = make_world(spec=spec(1))
    xid = (Condition("XidError", "GPU-1", "XID 79", since_monotonic=1.0),)
    world.runner.set_conditions("xid", xid)  # before the runner published anything: kept for later
    assert world.runner.status.latest() is None
    status = await world.runner.converge_once()
    assert status.conditions[-1:] == xid
    version = status.version
    world.runner.set_conditions("xid", xid)
    assert world.runner.status.latest().version == version  # type: ignore[union-attr]
    two = (*xid, Condition("XidError", "GPU-2", "XID 48", since_monotonic=2.0))
    world.runner.set_conditions("xid", two)
    latest = world.runner.status.latest()
    assert latest is not None and latest.version == version + 1 and latest.passes == status.passes
    assert [c.reason for c in latest.conditions if c.type == "XidError"] == ["GPU-1", "GPU-2"]
    again = await world.runner.converge_once()
    assert [c.reason for c in again.conditions if c.type == "XidError"] == ["GPU-1", "GPU-2"]
    world.runner.set_conditions("xid", ())
    assert not [c for c in world.runner.status.latest().conditions if c.type == "XidError"]  # type: ignore[union-attr]
