"""Convergence as a property: for any spec and whatever host the previous example left (reboots and
unmanaged domains included), one pass reaches the spec and a second plan has no steps."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_agent.sections.instances.model import Desired
from bcd_agent.sections.instances.section import InstancesSection
from bcd_shared.system import LocalSystem, atomic_write
from bcd_simhost.libvirt import STATE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from instkit import GIB, converge, section, sim_host, spec, vm

IN_CI = os.environ.get("CI") == "true"
SETTINGS = settings(
    max_examples=60 if IN_CI else 15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_generations = itertools.count(1)

instance = st.tuples(
    st.sampled_from(list(Desired)[:4]),  # RUNNING, PAUSED, STOPPED, DELETED
    st.sampled_from([1 * GIB, 2 * GIB]),
    st.sampled_from([10 * GIB, 20 * GIB, 30 * GIB]),
)
specs = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), instance, max_size=4)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSystem, InstancesSection]]:
    system = sim_host(tmp_path_factory.mktemp("prop"))
    sec, _ = section(system)
    yield system, sec


def _unmanaged(system: LocalSystem, name: str, state: str) -> None:
    d = system.host_path(STATE)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(
        d / f"{name}.xml", f"<domain type='kvm'><name>{name}</name><memory>1024</memory></domain>".encode()
    )
    atomic_write(d / f"{name}.json", json.dumps({"state": state, "boot_id": system.boot_id()}).encode())


@SETTINGS
@given(wanted=specs, reboot=st.booleans(), leak=st.sampled_from([None, "running", "shut off"]))
def test_one_pass_reaches_any_spec_and_the_next_plans_nothing(
    world: tuple[LocalSystem, InstancesSection],
    wanted: dict[str, tuple[Desired, int, int]],
    reboot: bool,
    leak: str | None,
) -> None:
    system, sec = world
    if reboot:
        system.host_path("/proc/sys/kernel/random/boot_id").write_text(os.urandom(16).hex() + "\n")
    if leak is not None:
        _unmanaged(system, "leak", leak)
    leak_before = system.read_bytes(f"{STATE}/leak.json")
    desired = spec(
        *(vm(i, desired=d, memory_bytes=m, disk_bytes=disk) for i, (d, m, disk) in sorted(wanted.items())),
        generation=next(_generations),
    )
    converge(sec, desired)
    again = sec.plan(desired, desired.generation)
    assert again.steps == (), again.steps
    reported = {r.instance_id: r for r in sec.last_report.instances}
    for name, (d, _m, _disk) in wanted.items():
        if d is Desired.DELETED:
            assert name not in reported or not reported[name].managed
            continue
        r = reported[name]
        if r.state == "ERROR":
            assert "disks only grow" in r.message  # the only failure these specs can cause
            continue
        assert r.state == d.value, (name, r)
    for name, r in reported.items():
        if r.managed:
            assert name in wanted and wanted[name][0] is not Desired.DELETED
    assert system.read_bytes(f"{STATE}/leak.json") == leak_before  # never touched
    assert not Path(system.host_path("/var/lib/bcd/libvirt/instances/leak")).exists()
