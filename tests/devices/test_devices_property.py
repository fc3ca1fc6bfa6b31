"""A property of the whole section: random sequences of specs over the simulated GPU host.

Atoms: whole GPUs, MIG instances (some missing), slots, malformed ids, other classes; bindings HOLD,
KUBERNETES and unsupported ones; limits (cpus/cpu_millis: no admission); VMs holding GPUs; the kube
side sometimes holding released devices. After every pass: no atom is held twice, a whole GPU and a
part of it are never held by different allocations, every wanted hold that passed its checks has its
files and its AllocationBound, every refused one has exactly one AllocationFailed for that generation
with the first failing reason (an independent model computes it), and a second pass plans nothing. A
changed hold that shares an atom with its new entry is checked first and written over in place, or kept
as it was when refused (Q-DEV-PASS-01).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bcd_agent.sections.devices import observe
from bcd_agent.sections.devices.kube import PodDevices
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec, Limits
from bcd_simhost.gpus import gpu_uuid
from bcd_simhost.seed import seed
from devices.cdicheck import assert_host_cdi_valid
from devices.devhost import DATA_DIR, Host
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

G0, G1, G7 = gpu_uuid(0), gpu_uuid(1), gpu_uuid(7)
ATOMS = [
    (G0, "gpu"),
    (G1, "gpu"),
    (G7, "gpu"),
    ("GPU-99999999-0000-4000-8000-000000000000", "gpu"),
    (f"{G7}/gi1/ci0", "gpu.mig"),
    (f"{G7}/gi2/ci0", "gpu.mig"),
    (f"{G7}/gi6/ci0", "gpu.mig"),
    (f"{G0}/s0", "gpu.slot"),
    (f"{G0}/s1", "gpu.slot"),
    (f"{G1}/s0", "gpu.slot"),
    (f"{G7}/s0", "gpu.slot"),
    ("GPU-x/y", "gpu.slot"),
    ("eth0vf1", "nic.vf"),
]
MISSING = {"GPU-99999999-0000-4000-8000-000000000000", f"{G7}/gi6/ci0"}

assignment = st.builds(
    lambda alloc, binding, atoms, limited, env: DeviceAssignment(
        alloc,
        f"rsv_{alloc}",
        binding,
        tuple(DeviceRef(i, c) for i, c in atoms),
        Limits(cpus="0-3", cpu_millis=2000) if limited else None,
        env,
    ),
    st.sampled_from([f"a{i}" for i in range(6)]),
    st.sampled_from(["BINDING_HOLD"] * 4 + ["BINDING_KUBERNETES"] * 2 + ["BINDING_INSTANCE"]),
    st.lists(st.sampled_from(ATOMS), min_size=1, max_size=3),
    st.booleans(),
    st.sampled_from([(), ("FOO=bar",)]),
)
passes = st.lists(
    st.tuples(
        st.lists(assignment, max_size=5),
        st.sampled_from([{}, {G1: "vm-1"}, {G7: "vm-2"}]),
        st.booleans(),  # the kube side holds nothing (releases can be reported)
    ),
    min_size=1,
    max_size=4,
)


class Pods:
    def __init__(self) -> None:
        self.free = False

    def list(self) -> tuple[PodDevices, ...]:
        if self.free:
            return ()
        return (PodDevices("p", "ns", "c", "bcd.dev/gpu", tuple(a for a, _ in ATOMS)),)


def gpu_of(i: str) -> str:
    return i.split("/")[0]


def expected_reason(
    a: DeviceAssignment, claims: dict[str, str], vfio: dict[str, str], seen: set[str]
) -> str | None:
    """An independent model of the checks, in their order (DEV-FAIL-07)."""
    if a.allocation_id in seen:
        return "invalid-assignment"
    if a.binding not in ("BINDING_HOLD", "BINDING_KUBERNETES"):
        return "unsupported-binding"
    if any(c == "nic.vf" or i == "GPU-x/y" for i, c in ((d.id, d.device_class) for d in a.devices)):
        return "unsupported-device"
    if any(d.id in MISSING for d in a.devices):
        return "device-missing"
    ids = [d.id for d in a.devices]
    wholes = {d.id for d in a.devices if d.device_class == "gpu"}
    if len(set(ids)) != len(ids) or any(
        d.device_class != "gpu" and gpu_of(d.id) in wholes for d in a.devices
    ):
        return "overlap"
    for d in a.devices:
        g = gpu_of(d.id)
        if g in vfio:
            return "overlap"
        if d.device_class == "gpu":
            if any(gpu_of(k) == g and o != a.allocation_id for k, o in claims.items()):
                return "overlap"
        elif (
            claims.get(d.id, a.allocation_id) != a.allocation_id
            or claims.get(g, a.allocation_id) != a.allocation_id
        ):
            return "overlap"
    return None


def overlap(a: str, b: str) -> bool:
    """Root's rule for two atoms one allocation cannot give up without the other."""
    return a == b or (gpu_of(a) == gpu_of(b) and (a == gpu_of(a) or b == gpu_of(b)))


def check_invariants(
    host: Host,
    spec: DevicesSpec,
    vfio: dict[str, str],
    pods_free: bool,
    before_holds: dict[str, tuple[str, tuple[str, ...]]],
    before_releases: dict[str, tuple[str, ...]],
) -> None:
    holds, bad = observe.read_holds(host.system)
    assert bad == ()
    releases, unreadable = observe.read_releases(host.system, DATA_DIR)
    assert not unreadable
    owners: dict[str, str] = {}
    for alloc, h in holds.items():
        for i in h.record.device_ids:
            assert i not in owners, f"{i} held by {owners.get(i)} and {alloc}"
            owners[i] = alloc
    for r in releases:
        for i in r.device_ids:
            assert i not in owners or owners[i] == r.allocation_id
            owners.setdefault(i, r.allocation_id)
    for i, o in owners.items():
        if "/" not in i:  # a whole GPU: no part of it held by someone else
            assert all(o2 == o for i2, o2 in owners.items() if gpu_of(i2) == i), owners
    # The model: kept holds, then pending releases, then new holds in order.
    wanted = {}
    for a in spec.assignments:
        wanted.setdefault(a.allocation_id, a)
    claims: dict[str, str] = {}
    kept = set()
    for alloc, (binding, ids) in before_holds.items():
        w = wanted.get(alloc)
        if w is not None and w.binding == binding and tuple(d.id for d in w.devices) == ids:
            kept.add(alloc)
            claims.update({i: alloc for i in ids})
    for alloc, ids in before_releases.items():
        if alloc not in wanted and not pods_free:
            claims.update({i: alloc for i in ids})
    for alloc, (binding, ids) in before_holds.items():
        if binding == "BINDING_KUBERNETES" and alloc not in wanted and not pods_free:
            claims.update({i: alloc for i in ids})  # withdrawn in this pass, pods still hold it
    for alloc, h in holds.items():
        if h.record.kubernetes is False and alloc not in wanted:
            raise AssertionError(f"{alloc} is held but not wanted")
    fails = [e for e in host.events("FailedEvent") if e.generation == spec.generation]  # type: ignore[attr-defined]
    bound = {e.allocation_id for e in host.events("BoundEvent")}  # type: ignore[attr-defined]
    # Changed holds sharing an atom with their new entry (Q-DEV-PASS-01): claimed with their old atoms,
    # checked first (again while another passes); one that passes holds its new atoms, one that fails
    # keeps its old hold and has its AllocationFailed.
    changed = {
        alloc: ids
        for alloc, (_binding, ids) in before_holds.items()
        if alloc in wanted
        and alloc not in kept
        and any(overlap(d.id, i) for d in wanted[alloc].devices for i in ids)
    }
    for alloc, ids in changed.items():
        claims.update({i: alloc for i in ids})
    todo = [
        wanted[alloc]
        for alloc in dict.fromkeys(a.allocation_id for a in spec.assignments)
        if alloc in changed
    ]
    while todo:
        left = [a for a in todo if expected_reason(a, claims, vfio, set()) is not None]
        for a in todo:
            if a not in left:
                for k in [k for k, o in claims.items() if o == a.allocation_id]:
                    del claims[k]
                claims.update({d.id: a.allocation_id for d in a.devices})
                assert holds[a.allocation_id].record.device_ids == tuple(d.id for d in a.devices)
                assert a.allocation_id in bound
                assert not [f for f in fails if f.allocation_id == a.allocation_id]  # type: ignore[attr-defined]
        if len(left) == len(todo):
            break
        todo = left
    for a in todo:
        reason = expected_reason(a, claims, vfio, set())
        assert holds[a.allocation_id].record.device_ids == changed[a.allocation_id]  # kept as it was
        mine = [f for f in fails if f.allocation_id == a.allocation_id]  # type: ignore[attr-defined]
        assert len(mine) == 1 and mine[0].reason == reason, (a, reason, mine)  # type: ignore[attr-defined]
    seen: set[str] = set()
    for a in spec.assignments:
        if a.allocation_id in (kept | set(changed)) and a.allocation_id not in seen:
            seen.add(a.allocation_id)
            assert a.allocation_id in holds
            continue
        duplicate = a.allocation_id in seen
        reason = expected_reason(a, claims, vfio, seen)
        seen.add(a.allocation_id)
        if duplicate:
            continue  # a later entry of the same allocation: the first one decides
        mine = [f for f in fails if f.allocation_id == a.allocation_id]  # type: ignore[attr-defined]
        if reason is None:
            assert mine == [], (a, mine)
            assert a.allocation_id in holds and a.allocation_id in bound
            assert host.path(f"/run/bcd/allocations/{a.allocation_id}.env").exists()
            claims.update({d.id: a.allocation_id for d in a.devices})
        elif a.allocation_id not in holds:
            assert len(mine) == 1 and mine[0].reason == reason, (a, reason, mine)  # type: ignore[attr-defined]
    assert_host_cdi_valid(host.root)


@settings(
    max_examples=int(os.environ.get("BCD_HYPOTHESIS_EXAMPLES", "30")),
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(passes)
def test_DEV_property_random_spec_sequences(
    seq: list[tuple[list[DeviceAssignment], dict[str, str], bool]],
) -> None:
    """Covers DEV-CONF-07, DEV-PASS-05, DEV-PASS-19, DEV-FAIL-07, DEV-EVT-10, DEV-K8S-08, DEV-K8S-11,
    DLV-DEV-19."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "host"
        seed(root)
        pods = Pods()
        vfio_now: dict[str, str] = {}
        host = Host(root, pod_resources=pods, vfio=lambda: vfio_now)
        for gen, (assignments, vfio, free) in enumerate(seq, start=1):
            vfio_now.clear()
            vfio_now.update(vfio)
            pods.free = free
            holds, _ = observe.read_holds(host.system)
            before = {
                a: ("BINDING_KUBERNETES" if h.record.kubernetes else "BINDING_HOLD", h.record.device_ids)
                for a, h in holds.items()
            }
            rel = {r.allocation_id: r.device_ids for r in observe.read_releases(host.system, DATA_DIR)[0]}
            spec = DevicesSpec(gen, tuple(assignments))
            host.run(spec)
            check_invariants(host, spec, vfio, free, before, rel)
            again = host.section.plan(spec, gen)
            assert again.empty, again.actions
