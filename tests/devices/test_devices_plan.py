"""The pure planner: failure reasons, conflict and admission messages as tables (no I/O)."""

from __future__ import annotations

import pytest
from bcd_agent.inventory.gpus import Gpu, GpuHealth, GpuInventory, MigDevice
from bcd_agent.inventory.host import HostMemory, HugePool
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec, Limits
from bcd_agent.sections.devices.plan import (
    ADMISSION_UNREADABLE_WARNING,
    UNREADABLE_OWNER,
    Emit,
    Ledger,
    Observed,
    PendingRelease,
    SetAsideReleases,
    WriteReleases,
    plan,
)

A, B = "GPU-aaaaaaaa-0000-4000-8000-000000000001", "GPU-bbbbbbbb-0000-4000-8000-000000000002"
MIG_A = "MIG-aaaaaaaa-1111-5111-8111-000000000001"
GIB = 1 << 30


def inv() -> GpuInventory:
    def g(i: int, u: str, migs: tuple[MigDevice, ...] = ()) -> Gpu:
        return Gpu(
            i,
            u,
            "NVIDIA H200",
            f"00000000:{i + 1:02X}:00.0",
            i,
            i,
            143771,
            bool(migs),
            migs,
            GpuHealth(0, False, False),
        )

    return GpuInventory(
        (g(0, A, (MigDevice(1, 0, MIG_A, "3g.71gb", 0), MigDevice(2, 0, None, "1g.18gb", 1))), g(1, B)),
        "590.48.01",
        True,
    )


def asg(
    alloc: str,
    *devs: str,
    cls: str = "",
    binding: str = "BINDING_HOLD",
    limits: Limits | None = None,
    env: tuple[str, ...] = (),
) -> DeviceAssignment:
    return DeviceAssignment(
        alloc, "r", binding, tuple(DeviceRef(d, cls or _cls(d)) for d in devs), limits, env
    )


def _cls(d: str) -> str:
    return "gpu.mig" if "/gi" in d else "gpu.slot" if "/s" in d else "gpu"


def failures(assignments: list[DeviceAssignment], obs: Observed | None = None) -> list[tuple[str, str, str]]:
    p = plan(DevicesSpec(7, tuple(assignments)), obs or Observed(inventory=inv()))
    return [(f.allocation_id, f.reason, f.message) for f in p.failures]


HOST = HostMemory(
    mem_total_kb=(16 + 8 + 2) * 1024 * 1024,  # 26 GiB, 8 of them huge pages
    hugetlb_kb=8 * 1024 * 1024,
    pools={2048: HugePool(2048, 1024, {0: 512, 1: 512}), 1048576: HugePool(1048576, 6, {0: 2, 1: 4})},
    nodes=(0, 1),
)


@pytest.mark.parametrize(
    ("ident", "assignments", "expected"),
    [
        (
            "DEV-BND-07",
            [asg("a", A, binding="BINDING_INSTANCE")],
            [("a", "unsupported-binding", "binding BINDING_INSTANCE is not supported")],
        ),
        (
            "Q-DEV-BND-02",
            [asg("a", A, binding="9")],
            [("a", "unsupported-binding", "binding 9 is not supported")],
        ),
        (
            "DEV-ATOM-14",
            [asg("a", "vf0", cls="nic.vf")],
            [("a", "unsupported-device", "device class nic.vf cannot be held")],
        ),
        (
            "DEV-ATOM-12",
            [asg("a", "GPU-a/x", cls="gpu.mig")],
            [("a", "unsupported-device", '"GPU-a/x" is not a MIG instance id (<gpu-uuid>/gi<n>/ci<m>)')],
        ),
        (
            "DEV-ATOM-13",
            [asg("a", f"{A}/slot1", cls="gpu.slot")],
            [("a", "unsupported-device", f'"{A}/slot1" is not a GPU slot id (<gpu-uuid>/s<n>)')],
        ),
        (
            "DEV-ATOM-09 DEV-ATOM-11 DEV-ATOM-07 (the slot of a GPU not listed)",
            [asg("a", "GPU-cccc", f"{A}/gi3/ci0", "GPU-dddd/s1")],
            [
                (
                    "a",
                    "device-missing",
                    f"GPU-cccc not present; {A} has no MIG instance gi3/ci0; GPU-dddd not present",
                )
            ],
        ),
        (
            "Q-DEV-ATOM-02",
            [asg("a", f"{A}/gi2/ci0")],
            [("a", "device-missing", f"{A} has no MIG instance gi2/ci0")],
        ),
        ("DEV-CONF-02", [asg("a", A, A)], [("a", "overlap", "a device is listed twice")]),
        ("Q-DEV-CONF-02", [asg("a", A, f"{A}/s0")], [("a", "overlap", "a device is listed twice")]),
        ("DEV-CONF-04 DEV-PASS-19", [asg("a", B), asg("b", B)], [("b", "overlap", f"{B} is assigned to a")]),
        (
            "DEV-CONF-05",
            [asg("a", f"{A}/s1"), asg("b", A)],
            [("b", "overlap", f"{A} has {A}/s1 assigned to a")],
        ),
        ("DEV-CONF-06", [asg("a", A), asg("b", f"{A}/gi1/ci0")], [("b", "overlap", f"{A} is assigned to a")]),
        ("DEV-CONF-07", [asg("a", f"{A}/s1"), asg("b", f"{A}/s2"), asg("c", f"{A}/gi1/ci0")], []),
        (
            "DEV-FAIL-07 order",
            [asg("a", "GPU-cccc", binding="BINDING_NODE")],
            [("a", "unsupported-binding", "binding BINDING_NODE is not supported")],
        ),
        (
            "invalid id",
            [asg("a/../x", A)],
            [("a/../x", "invalid-assignment", "allocation id 'a/../x' must match ^[A-Za-z0-9_]{1,80}$")],
        ),
        (
            "Q-DEV-ASG-02",
            [asg("a", A, env=("NVIDIA_VISIBLE_DEVICES=all",))],
            [("a", "invalid-assignment", "env line for NVIDIA_VISIBLE_DEVICES: bcd sets that key itself")],
        ),
        (
            "DEV-SLICE-17",
            [asg("a", A, limits=Limits(cpus="0-3;rm"))],
            [("a", "invalid-assignment", "limits.cpus: '0-3;rm' is not a cpulist")],
        ),
    ],
)
def test_failure_table(
    ident: str, assignments: list[DeviceAssignment], expected: list[tuple[str, str, str]]
) -> None:
    """Covers DEV-FAIL-01, DEV-FAIL-03..05, DEV-FAIL-07, DEV-CONF-01..07 and the ids in the table, and
    DEV-ASG-05, DEV-ASG-13, DEV-PASS-14 (b after a), DEV-PASS-15 (binding before atoms), DLV-DEV-06,
    DLV-DEV-17 (CONF-05 row), DLV-DEV-18 (CONF-06 row), DLV-DEV-28, DLV-DEV-29 (the nic.vf row)."""
    assert failures(assignments) == expected, ident


def test_DEV_CONF_03_vfio_and_DEV_CONF_08_pending_releases_and_DEV_CONF_09_unreadable() -> None:
    """Covers DEV-CONF-03, DEV-CONF-08, DEV-CONF-09, DEV-CONF-10, DEV-K8S-11, DEV-K8S-16, DLV-DEV-20."""
    vfio = Observed(inventory=inv(), vfio={B: "inst_7"})
    assert failures([asg("a", f"{B}/s0")], vfio) == [
        ("a", "overlap", f"{B} is passed through to instance inst_7")
    ]
    pending = Observed(inventory=inv(), releases=(PendingRelease("k", "r", 3, (f"{A}/gi1/ci0",), 0.0),))
    assert failures([asg("a", A)], pending) == [("a", "overlap", f"{A} has {A}/gi1/ci0 assigned to k")]
    marker = Observed(inventory=inv(), marker=True)
    assert failures([asg("a", f"{B}/s1")], marker) == [
        ("a", "overlap", f"{B} is assigned to {UNREADABLE_OWNER}")
    ]


def test_DEV_K8S_14_unreadable_file_is_set_aside_and_DEV_K8S_17_condition() -> None:
    """Covers DEV-K8S-14, DEV-K8S-15, DEV-K8S-17, DEV-K8S-18."""
    p = plan(DevicesSpec(1, ()), Observed(inventory=inv(), releases_unreadable=True, now=1700000000.0))
    assert p.actions[0].steps == (SetAsideReleases("1700000000"),)
    assert [(c.type, c.reason) for c in p.conditions] == [
        ("KubernetesReleasesUnreadable", "ReleasesFileUnreadable")
    ]
    cleared = plan(DevicesSpec(1, ()), Observed(inventory=inv(), marker=True, kube_unknown_clear=True))
    assert cleared.conditions == () and cleared.actions[0].key == "marker"


def test_DEV_K8S_13_stuck_after_five_minutes_and_DEV_K8S_12_taken_back() -> None:
    """Covers DEV-K8S-08, DEV-K8S-09, DEV-K8S-12, DEV-K8S-13, DEV-PASS-06 (dropped when wanted again)."""
    rel = PendingRelease("k", "r", 3, (A,), 1000.0)
    held = Observed(inventory=inv(), releases=(rel,), pods_holding={"k": True}, now=1000.0 + 301)
    p = plan(DevicesSpec(4, ()), held)
    assert [(c.type, c.reason) for c in p.conditions] == [("KubernetesReleaseStuck", "PodsHoldDevices")]
    assert not any(isinstance(s, Emit) for a in p.actions for s in a.steps)
    free = plan(DevicesSpec(4, ()), Observed(inventory=inv(), releases=(rel,), pods_holding={"k": False}))
    steps = free.actions[0].steps
    assert (
        isinstance(steps[0], Emit) and steps[0].event.allocation_id == "k" and steps[1] == WriteReleases(())
    )
    back = plan(DevicesSpec(4, (asg("k", A, binding="BINDING_KUBERNETES"),)), held)
    assert back.actions[0].steps == (WriteReleases(()),)  # dropped unreported
    assert "bind:k" in [a.key for a in back.actions]


@pytest.mark.parametrize(
    ("ident", "limits", "committed", "message"),
    [
        (
            "DEV-ADM-13",
            Limits(memory_bytes=20 * GIB),
            0,
            "ResourcesExhausted: 20480 MiB of memory needed, 17408 MiB left on this host",
        ),
        (
            "DEV-ADM-05 DEV-ADM-07",
            Limits(memory_bytes=4 * GIB),
            16 * GIB,
            "ResourcesExhausted: 4096 MiB of memory needed, 1024 MiB left on this host",
        ),
        (
            "DEV-ADM-14",
            Limits(hugepages_1gi=8),
            0,
            "ResourcesExhausted: 8 hugepages of 1048576 KiB needed, 6 free",
        ),
        (
            "DEV-ADM-11",
            Limits(mems="0", hugepages_1gi=3),
            0,
            "ResourcesExhausted: 3 hugepages of 1048576 KiB needed, 2 free",
        ),
        (
            "DEV-ADM-12",
            Limits(mems="0-1", hugepages_2mi=1025),
            0,
            "ResourcesExhausted: 1025 hugepages of 2048 KiB needed, 1024 free",
        ),
        ("fits", Limits(mems="1", hugepages_1gi=4, memory_bytes=GIB), 0, None),
    ],
)
def test_admission_table(ident: str, limits: Limits, committed: int, message: str | None) -> None:
    """Covers DEV-ADM-01, DEV-ADM-04, DEV-ADM-10, DEV-FAIL-06, DLV-DEV-43, DLV-DEV-44 and the table's ids."""
    obs = Observed(inventory=inv(), host_memory=HOST, domains_committed_bytes=committed)
    got = failures([asg("h", A, limits=limits)], obs)
    assert got == ([("h", "resources-exhausted", message)] if message else []), ident


def test_DEV_ADM_06_bound_holds_count_against_later_ones_and_DEV_ADM_15_unreadable_meminfo() -> None:
    """Covers DEV-ADM-06 (a Kubernetes hold's memory too), DEV-ADM-09, DEV-ADM-15, DEV-ADM-02,
    DLV-DEV-45/46."""
    obs = Observed(inventory=inv(), host_memory=HOST)
    got = failures(
        [
            asg("k", A, binding="BINDING_KUBERNETES", limits=Limits(memory_bytes=10 * GIB)),
            asg("h", B, limits=Limits(memory_bytes=8 * GIB)),
        ],
        obs,
    )
    assert got == [
        (
            "h",
            "resources-exhausted",
            "ResourcesExhausted: 8192 MiB of memory needed, 7168 MiB left on this host",
        )
    ]
    pages = failures(
        [
            asg("p", f"{A}/s0", limits=Limits(mems="1", hugepages_1gi=3)),
            asg("q", f"{A}/s1", limits=Limits(mems="1", hugepages_1gi=2)),
        ],
        obs,
    )
    assert pages == [
        ("q", "resources-exhausted", "ResourcesExhausted: 2 hugepages of 1048576 KiB needed, 1 free")
    ]
    p = plan(
        DevicesSpec(1, (asg("h", A, limits=Limits(memory_bytes=900 * GIB)),)),
        Observed(inventory=inv(), host_memory=None),
    )
    assert p.failures == () and ADMISSION_UNREADABLE_WARNING in p.warnings
    cpu_only = Observed(inventory=inv(), host_memory=HostMemory(1, 0, {}, ()))
    assert failures([asg("c", A, limits=Limits(cpus="0-3", cpu_millis=4000))], cpu_only) == []


def test_DEV_ADM_16_fakehw_host_is_never_admitted() -> None:
    """Covers DEV-ADM-16."""
    obs = Observed(inventory=inv(), host_memory=HOST, admission=False)
    assert failures([asg("h", A, limits=Limits(memory_bytes=900 * GIB))], obs) == []


def test_ledger_records_failures_so_a_second_plan_is_empty() -> None:
    """Covers DEV-EVT-10 at the planner: the ledger makes the second pass plan nothing."""
    spec = DevicesSpec(2, (asg("a", "GPU-none"),))
    first = plan(spec, Observed(inventory=inv()))
    ledger = next(s for a in first.actions for s in a.steps if type(s).__name__ == "WriteLedger").ledger
    assert ledger == Ledger(bound={}, failed={"a": 2})
    assert plan(spec, Observed(inventory=inv(), ledger=ledger)).empty


def test_DEV_PASS_14_15_new_holds_in_spec_order_and_the_checks_in_their_order() -> None:
    """Covers DEV-PASS-14 (spec order, not the allocation ids' order: `z` is listed first, so `a` is the
    one refused) and DEV-PASS-15 (each check before the next: a hold failing two checks is refused for
    the earlier one)."""
    assert failures([asg("z", B), asg("a", B)]) == [("a", "overlap", f"{B} is assigned to z")]
    tight = Observed(inventory=inv(), host_memory=HOST)
    huge = Limits(memory_bytes=900 * GIB)
    unprivileged = Observed(inventory=inv(), host_memory=HOST, privileged=False)
    # binding before privilege
    assert [f[1] for f in failures([asg("a", "GPU-cccc", binding="BINDING_NODE")], unprivileged)] == [
        "unsupported-binding"
    ]
    # privilege before atoms
    assert [f[1] for f in failures([asg("a", "GPU-cccc")], unprivileged)] == ["node-unprivileged"]
    # atoms before conflicts: b names a missing GPU and a's GPU
    assert failures([asg("a", A), asg("b", A, "GPU-cccc")], tight) == [
        ("b", "device-missing", "GPU-cccc not present")
    ]
    # conflicts before admission: b overlaps a and asks more memory than the host has
    assert failures([asg("a", A), asg("b", A, limits=huge)], tight) == [
        ("b", "overlap", f"{A} is assigned to a")
    ]
    assert [f[1] for f in failures([asg("b", B, limits=huge)], tight)] == ["resources-exhausted"]
