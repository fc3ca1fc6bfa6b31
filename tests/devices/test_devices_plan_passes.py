"""The pure planner over whole passes: plan, apply to a fake host (tests/devices/planhost.py), plan again.

Each test states the exact plan a pass makes (action keys, kinds, steps in order, `after`), applies it,
and checks that the next pass plans nothing. The simulated-host tests (test_devices_section.py and the
others with the `host` fixture) run the same passes through the real applier; these run in
microseconds, so mutation testing (docs/mutation.md, "devices plan") can run them for every mutant.
"""

from __future__ import annotations

from typing import Any

import pytest
from attrs import evolve
from bcd_agent.inventory.gpus import Gpu, GpuHealth, GpuInventory, MigDevice
from bcd_agent.inventory.host import HostMemory, HugePool
from bcd_agent.sections.devices.events import BoundEvent, FailedEvent, ReleasedEvent
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec, Limits
from bcd_agent.sections.devices.plan import (
    ADMISSION_UNREADABLE_WARNING,
    UNREADABLE_OWNER,
    Action,
    ApplySlice,
    Emit,
    Failure,
    ForgetEventKeys,
    Ledger,
    PendingRelease,
    PlanCondition,
    RemoveEnv,
    RemoveMarker,
    RemoveSpec,
    SetAsideReleases,
    SliceState,
    StopSlice,
    Taker,
    WriteEnv,
    WriteLedger,
    WriteReleases,
    WriteSpec,
    applied_taker,
    commitments,
    faulted_taker,
    grown_limits,
    needs_host_memory,
    taker,
    with_host_memory,
)
from bcd_agent.sections.devices.slices import slice_spec
from bcd_shared.cdi import VendorSpec
from devices.planhost import PlanHost

A = "GPU-aaaaaaaa-0000-4000-8000-000000000001"
B = "GPU-bbbbbbbb-0000-4000-8000-000000000002"
C = "GPU-cccccccc-0000-4000-8000-000000000003"
D = "GPU-dddddddd-0000-4000-8000-000000000004"
MIG_A = "MIG-aaaaaaaa-1111-5111-8111-000000000001"
GIB = 1 << 30
MIB = 1 << 20
HOLD, KUBE = "BINDING_HOLD", "BINDING_KUBERNETES"


def inventory() -> GpuInventory:
    def gpu(i: int, uuid: str, migs: tuple[MigDevice, ...] = ()) -> Gpu:
        bus = f"00000000:{i + 1:02X}:00.0"
        return Gpu(i, uuid, "NVIDIA H200", bus, i, i, 143771, bool(migs), migs, GpuHealth(0, False, False))

    migs = (MigDevice(1, 0, MIG_A, "3g.71gb", 0), MigDevice(2, 0, None, "1g.18gb", 1))
    return GpuInventory((gpu(0, A, migs), gpu(1, B), gpu(2, C), gpu(3, D)), "590.48.01", True)


def cls(atom: str) -> str:
    return "gpu.mig" if "/gi" in atom else "gpu.slot" if "/s" in atom else "gpu"


def asg(
    alloc: str,
    *atoms: str,
    binding: str = HOLD,
    limits: Limits | None = None,
    env: tuple[str, ...] = (),
    rsv: str | None = None,
) -> DeviceAssignment:
    refs = tuple(DeviceRef(a, cls(a)) for a in atoms)
    return DeviceAssignment(alloc, rsv or f"rsv_{alloc}", binding, refs, limits, env)


def spec(generation: int, *assignments: DeviceAssignment) -> DevicesSpec:
    return DevicesSpec(generation, assignments)


def settled(host: PlanHost, s: DevicesSpec) -> tuple[Action, ...]:
    """One pass applied; the next plans nothing. Returns the applied pass's actions."""
    p = host.step(s)
    again = host.plan(s)
    assert again.empty, again.actions
    return p.actions


def ledger(
    bound: dict[str, int] | None = None, failed: dict[str, int] | None = None, forget: tuple[str, ...] = ()
) -> Action:
    forgets = (ForgetEventKeys(forget),) if forget else ()
    return Action("ledger", "ledger", (WriteLedger(Ledger(bound or {}, failed or {})), *forgets))


def bound(alloc: str, gen: int, *atoms: str, parent: str = "", kube: bool = False, rsv: str = "") -> Emit:
    """An AllocationBound, keyed (exactly once per allocation and generation: Q-DEV-EVT-02)."""
    return Emit(
        BoundEvent(
            alloc,
            rsv or f"rsv_{alloc}",
            gen,
            atoms,
            tuple(f"bcd.dev/gpu={a.replace('/', '_')}" for a in atoms),
            f"/etc/cdi/bcd-{alloc}.json",
            f"/run/bcd/allocations/{alloc}.env",
            parent,
            kube,
        ),
        bkey(alloc, gen),
    )


def released(alloc: str, gen: int, *atoms: str, kube: bool = False) -> Emit:
    return Emit(ReleasedEvent(alloc, f"rsv_{alloc}", gen, atoms, kube), key(alloc, gen))


def key(alloc: str, gen: int) -> str:
    """An AllocationReleased's journal key (once per allocation and generation)."""
    return f"devices:released:{alloc}:{gen}"


def bkey(alloc: str, gen: int) -> str:
    """An AllocationBound's journal key (once per allocation and generation)."""
    return f"devices:bound:{alloc}:{gen}"


def intent(*emits: Emit, bound: dict[str, int] | None = None) -> Action:
    """The release-intent action recording the plain releases `emits` before their removals."""
    releasing = {e.key: e.event for e in emits if e.key is not None and isinstance(e.event, ReleasedEvent)}
    return Action("release-intent", "intent", (WriteLedger(Ledger(bound or {}, {}, releasing)),))


def only_step(actions: tuple[Action, ...], key: str) -> Any:
    (action,) = [a for a in actions if a.key == key]
    return action


LIMITS = Limits(cpus="0-3", mems="0", cpu_millis=1500, memory_bytes=2 * GIB, hugepages_2mi=4)
SLICE = "bcd-alloc-a.slice"


# --- binding ---------------------------------------------------------------------------------------


def test_DEV_SLICE_02_DEV_EVT_06_a_sliced_hold_is_bound_slice_spec_env_then_event() -> None:
    """Covers DEV-SLICE-02 (the slice before the spec names it), DEV-EVT-06 (AllocationBound after
    the slice, spec and env file), DEV-SLICE-22 (the slice named in annotation, env and event),
    DEV-ENV-04's order and DEV-EVT-05's fields, on the plan itself."""
    host = PlanHost(inventory())
    actions = settled(host, spec(3, asg("a", A, limits=LIMITS, env=("TEAM=x",))))
    lines = (
        "BCD_ALLOCATION_ID=a",
        f"BCD_CGROUP_PARENT={SLICE}",
        "BCD_RESERVATION_ID=rsv_a",
        f"NVIDIA_VISIBLE_DEVICES={A}",
        "TEAM=x",
    )
    (bind, led) = actions
    assert led == ledger({"a": 3}, forget=(bkey("a", 3),))
    assert (bind.key, bind.kind, bind.after) == ("bind:a", "bind", frozenset())
    apply_slice, write_spec, write_env, emit = bind.steps
    assert apply_slice == ApplySlice(slice_spec("a", LIMITS))
    assert write_env == WriteEnv("a", lines)
    assert emit == bound("a", 3, A, parent=SLICE)
    assert isinstance(write_spec, WriteSpec) and write_spec.allocation_id == "a"
    assert write_spec.doc == {
        "cdiVersion": "0.6.0",
        "kind": "bcd.dev/gpu",
        "annotations": {
            "bcd.dev/allocation-id": "a",
            "bcd.dev/reservation-id": "rsv_a",
            "bcd.dev/generation": "3",
            "bcd.dev/cgroup-parent": SLICE,
        },
        "devices": [
            {
                "name": A,
                "annotations": {"bcd.dev/device-id": A},
                "containerEdits": {"env": [f"BCD_DEVICE_{A.replace('-', '_')}={A}"]},
            }
        ],
        "containerEdits": {
            "env": ["BCD_ALLOCATION_ID=a", f"BCD_CGROUP_PARENT={SLICE}", f"NVIDIA_VISIBLE_DEVICES={A}"]
        },
    }
    assert host.slices[SLICE].limits is not None and host.kinds() == ["BoundEvent"]
    assert dict(host.plan(spec(3, asg("a", A, limits=LIMITS, env=("TEAM=x",)))).holders) == {"a": (A,)}


def test_DEV_SLICE_04_a_kubernetes_hold_has_no_slice_no_parent_and_bare_devices() -> None:
    """Covers DEV-SLICE-03/04 (no slice, no cgroup parent in spec, env file or event), DEV-CDI-08,
    DEV-CDI-14 (bare devices under a vendor spec), and the MIG instance's UUID in the env file."""
    vendor = VendorSpec("0.7.0", {"deviceNodes": [{"path": "/dev/nvidiactl"}]}, {MIG_A: {"deviceNodes": []}})
    host = PlanHost(inventory(), facts={"vendor": vendor})
    k = asg("k", f"{A}/gi1/ci0", binding=KUBE, limits=Limits(cpus="0-1"))
    (bind, led) = settled(host, spec(2, k))
    assert led == ledger({"k": 2}, forget=(bkey("k", 2),))
    assert bind.steps[0] == WriteSpec("k", host.specs["k"]) and bind.steps[1:] == (
        WriteEnv("k", ("BCD_ALLOCATION_ID=k", "BCD_RESERVATION_ID=rsv_k", f"NVIDIA_VISIBLE_DEVICES={MIG_A}")),
        bound("k", 2, f"{A}/gi1/ci0", kube=True),
    )
    doc = host.specs["k"]
    marker = f"BCD_DEVICE_{A.replace('-', '_')}_gi1_ci0={A}/gi1/ci0"
    assert [d["containerEdits"] for d in doc["devices"]] == [{"env": [marker]}]
    assert doc["cdiVersion"] == "0.6.0" and "containerEdits" in doc
    assert doc["containerEdits"] == {"env": ["BCD_ALLOCATION_ID=k"]}
    assert doc["annotations"]["bcd.dev/binding"] == "kubernetes"
    assert "bcd.dev/cgroup-parent" not in doc["annotations"]
    assert host.slices == {}


def test_DEV_CDI_12_DEV_CDI_16_vendor_edits_and_the_mps_directory_for_a_slot() -> None:
    """Covers DEV-CDI-12 (a slot takes its GPU's edits, by UUID or index), DEV-CDI-16 (the MPS pipe
    directory for a hold with a slot when /run/nvidia-mps exists), DEV-CDI-17 (each GPU once)."""
    edits = {"deviceNodes": [{"path": "/dev/nvidia1"}]}
    vendor = VendorSpec("0.5.0", {}, {"1": edits})
    host = PlanHost(inventory(), facts={"vendor": vendor, "mps_dir": True})
    (bind, _led) = settled(host, spec(1, asg("s", f"{B}/s0", f"{B}/s1")))
    env = ("BCD_ALLOCATION_ID=s", "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps")
    assert bind.steps[1] == WriteEnv("s", (*env, "BCD_RESERVATION_ID=rsv_s", f"NVIDIA_VISIBLE_DEVICES={B}"))
    doc = host.specs["s"]
    assert [d["containerEdits"] for d in doc["devices"]] == [edits, edits]
    assert doc["containerEdits"] == {"env": [*env, f"NVIDIA_VISIBLE_DEVICES={B}"]}
    whole = PlanHost(inventory(), facts={"vendor": vendor, "mps_dir": True})
    settled(whole, spec(1, asg("w", B)))
    assert whole.specs["w"]["containerEdits"] == {
        "env": ["BCD_ALLOCATION_ID=w", f"NVIDIA_VISIBLE_DEVICES={B}"]
    }


# --- releasing -------------------------------------------------------------------------------------


def test_DEV_PASS_07_DEV_PASS_09_a_plain_release_then_its_slice_once_empty() -> None:
    """Covers DEV-PASS-07 (spec and env removed, then AllocationReleased), DEV-PASS-09 (the released
    slice stopped once empty, kept while populated), DEV-PASS-10 (the leftover slice stopped on a later
    pass), Q-DEV-EVT-01 (the release carries the generation that dropped it)."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A, limits=LIMITS)))
    host.slices[SLICE] = evolve(host.slices[SLICE], populated=True)
    actions = settled(host, spec(2))
    assert actions == (
        intent(released("a", 2, A), bound={"a": 1}),
        Action(
            "release:a",
            "release",
            (RemoveSpec("a"), RemoveEnv("a"), released("a", 2, A)),
            frozenset({"release-intent"}),
        ),
        ledger(forget=(key("a", 2),)),
    )
    assert SLICE in host.slices and host.specs == {} and host.envs == {} and host.keys == set()
    host.slices[SLICE] = evolve(host.slices[SLICE], populated=False)
    assert settled(host, spec(3)) == (Action(f"slice:{SLICE}", "slice", (StopSlice(SLICE),)),)
    assert host.stopped == [SLICE]
    # Released while empty: stopped in the same action, after the event.
    settled(host, spec(4, asg("a", A, limits=LIMITS)))
    assert settled(host, spec(5)) == (
        intent(released("a", 5, A), bound={"a": 4}),
        Action(
            "release:a",
            "release",
            (RemoveSpec("a"), RemoveEnv("a"), released("a", 5, A), StopSlice(SLICE)),
            frozenset({"release-intent"}),
        ),
        ledger(forget=(key("a", 5),)),
    )


def test_a_kept_hold_whose_limits_go_stops_its_slice_after_the_hold_is_written_without_it() -> None:
    """Q-DEV-PASS-01: the spec keeps `a` on the same GPU and drops its limits. Its files are written over
    without the slice first (keep), and the now-unwanted slice is stopped after them and only if that
    write did not fail (root refuses to stop a slice a hold file still names); the next pass plans
    nothing. Limits back: the slice is started before the files name it again."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A, limits=LIMITS)))
    actions = settled(host, spec(2, asg("a", A)))
    keys = [a.key for a in actions]
    assert keys.index("keep:a") < keys.index(f"slice:{SLICE}")
    stop = actions[keys.index(f"slice:{SLICE}")]
    assert stop.steps == (StopSlice(SLICE),) and "keep:a" in stop.after
    assert SLICE not in host.slices and host.stopped == [SLICE]
    assert "bcd.dev/cgroup-parent" not in host.specs["a"].get("annotations", {})
    settled(host, spec(3, asg("a", A, limits=LIMITS)))
    assert SLICE in host.slices
    assert host.specs["a"]["annotations"]["bcd.dev/cgroup-parent"] == SLICE


def test_DEV_PASS_10_leftover_slices_only_unwanted_unreleased_and_empty() -> None:
    """Covers DEV-PASS-10: of the slices on the host, a wanted hold's is kept, a populated one is kept,
    every other empty one is stopped, in name order."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A, limits=LIMITS)))
    for name, populated in (
        ("bcd-alloc-z.slice", False),
        ("bcd-alloc-y.slice", False),
        ("bcd-alloc-p.slice", True),
    ):
        host.slices[name] = SliceState(name, populated)
    assert settled(host, spec(1, asg("a", A, limits=LIMITS))) == (
        Action("slice:bcd-alloc-y.slice", "slice", (StopSlice("bcd-alloc-y.slice"),)),
        Action("slice:bcd-alloc-z.slice", "slice", (StopSlice("bcd-alloc-z.slice"),)),
    )
    assert sorted(host.slices) == ["bcd-alloc-a.slice", "bcd-alloc-p.slice"]


def test_DEV_K8S_02_DEV_K8S_08_a_kubernetes_release_recorded_withdrawn_then_reported() -> None:
    """Covers DEV-K8S-02 (recorded first, with device ids, generation and time), DEV-K8S-03, DEV-K8S-08
    (reported only once no pod holds a device), DEV-K8S-09 (the record dropped when reported),
    DEV-K8S-11 (its devices stay claimed), DEV-K8S-13 (stuck after more than 5 minutes)."""
    host = PlanHost(inventory(), facts={"now": 1000.0, "pods_holding": {"k": True}})
    settled(host, spec(1, asg("k", A, f"{B}/s0", binding=KUBE)))
    pending = PendingRelease("k", "rsv_k", 2, (A, f"{B}/s0"), 1000.0)
    withdraw = Action(
        "release:k", "kube-release", (WriteReleases((pending,)), RemoveSpec("k"), RemoveEnv("k"))
    )
    first = host.step(spec(2, asg("n", B)))
    assert first.actions[0] == withdraw
    assert [(f.allocation_id, f.reason, f.message) for f in first.failures] == [
        ("n", "overlap", f"{B} has {B}/s0 assigned to k")
    ]
    assert host.ledger == Ledger({"k": 1}, {"n": 2})  # bound kept while the release is pending
    assert host.plan(spec(2, asg("n", B))).empty
    host.facts["now"] = 1300.0  # exactly 5 minutes: not yet stuck
    assert host.plan(spec(2)).conditions == ()
    host.facts["now"] = 1301.9
    stuck = host.plan(spec(2))
    assert stuck.conditions == (
        PlanCondition(
            "KubernetesReleaseStuck", "PodsHoldDevices", "k: a pod still holds its devices after 301 s"
        ),
    )
    assert stuck.actions == (ledger({"k": 1}),)  # n no longer wanted: its failure is forgotten
    host.step(spec(2))
    host.facts["pods_holding"] = {"k": False}
    assert settled(host, spec(3)) == (
        Action("kube-reported", "releases", (released("k", 2, A, f"{B}/s0", kube=True), WriteReleases(()))),
        ledger(forget=(key("k", 2),)),
    )
    assert host.releases == () and host.kinds() == ["BoundEvent", "FailedEvent", "ReleasedEvent"]


def test_DEV_K8S_08_a_kubernetes_release_no_pod_holds_is_reported_in_the_same_pass() -> None:
    """Covers DEV-K8S-02 (recorded before anything is removed) and DEV-K8S-08/09 when no pod holds the
    devices already: record, withdraw, report, drop the record, in that order, in one action."""
    host = PlanHost(inventory(), facts={"now": 50.0, "pods_holding": {"k": False, "old": True}})
    host.releases = (PendingRelease("old", "rsv_old", 1, (C,), 40.0),)
    settled(host, spec(1, asg("k", A, binding=KUBE)))
    pending = PendingRelease("k", "rsv_k", 2, (A,), 50.0)
    old = host.releases[0]
    assert settled(host, spec(2)) == (
        Action(
            "release:k",
            "kube-release",
            (
                WriteReleases((old, pending)),
                RemoveSpec("k"),
                RemoveEnv("k"),
                released("k", 2, A, kube=True),
                WriteReleases((old,)),
            ),
        ),
        ledger(forget=(key("k", 2),)),
    )


def test_DEV_K8S_12_taken_back_release_dropped_unreported_and_bound_again() -> None:
    """Covers DEV-K8S-12 and Q-DEV-K8S-02: a spec that wants the allocation again drops its pending
    release unreported (others kept), and binds it as a new hold (a second AllocationBound)."""
    other = PendingRelease("o", "rsv_o", 1, (C,), 0.0)
    host = PlanHost(inventory(), facts={"pods_holding": {"k": True, "o": True}})
    host.releases = (PendingRelease("k", "rsv_k", 1, (A,), 0.0), other)
    host.ledger = Ledger({"k": 1, "o": 1})
    actions = settled(host, spec(2, asg("k", A, binding=KUBE)))
    assert actions[0] == Action("kube-reported", "releases", (WriteReleases((other,)),))
    assert actions[1].key == "bind:k" and actions[1].steps[-1] == bound("k", 2, A, kube=True)
    assert actions[2:] == (ledger({"k": 2, "o": 1}, forget=(bkey("k", 2),)),)
    assert host.kinds() == ["BoundEvent"]


def test_DEV_K8S_14_to_18_unreadable_releases_marker_claims_every_gpu_until_cleared() -> None:
    """Covers DEV-K8S-14 (set aside, suffix the time), DEV-K8S-15 (the marker), DEV-K8S-16 (every GPU
    claimed), DEV-K8S-17 (the condition while the marker exists), DEV-K8S-18 (removed once the kube
    side knows of no unknown holder, and the GPUs then free in the same pass)."""
    host = PlanHost(inventory(), facts={"now": 1700000000.9})
    host.releases_unreadable = True
    condition = PlanCondition(
        "KubernetesReleasesUnreadable",
        "ReleasesFileUnreadable",
        "releasing.json could not be read; every GPU counts as claimed until the marker goes",
    )
    p = host.step(spec(1, asg("a", f"{C}/s0")))
    assert p.actions == (
        Action("releases-unreadable", "releases", (SetAsideReleases("1700000000"),)),
        Action(
            "failures",
            "report",
            (
                Emit(
                    FailedEvent(
                        "a", "rsv_a", 1, "overlap", f"{C} is assigned to {UNREADABLE_OWNER}", (f"{C}/s0",)
                    )
                ),
            ),
        ),
        ledger(failed={"a": 1}),
    )
    assert p.conditions == (condition,) and host.marker
    assert host.plan(spec(1, asg("a", f"{C}/s0"))).conditions == (condition,)
    host.facts["kube_unknown_clear"] = True
    cleared = settled(host, spec(1, asg("a", f"{C}/s0")))
    assert cleared[0] == Action("marker", "releases", (RemoveMarker(),))
    assert cleared[1].key == "bind:a" and not host.marker
    # Unreadable again in the same pass the kube side is clear: the marker stays.
    host.releases_unreadable = True
    again = host.step(spec(1, asg("a", f"{C}/s0")))
    assert [a.key for a in again.actions] == ["releases-unreadable"] and again.conditions == (condition,)


def test_DEV_PASS_18_a_gpu_moved_between_allocations_binds_after_its_release() -> None:
    """Covers DEV-PASS-18 (releases before binds, in one pass), the bind waiting on the release of the
    hold whose GPU it takes (`after`), and Q-DEV-PASS-01 (a kept hold whose atoms change is released
    and bound again in the same pass)."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A), asg("b", B), asg("c", C)))
    actions = settled(host, spec(2, asg("d", f"{A}/s0"), asg("b", C), asg("c", f"{B}/s1", binding=KUBE)))
    keys = [(a.key, a.kind, sorted(a.after)) for a in actions]
    assert keys == [
        ("release-intent", "intent", []),
        ("release:a", "release", ["release-intent"]),
        ("release:b", "release", ["release-intent"]),
        ("release:c", "release", ["release-intent"]),
        ("bind:d", "bind", ["release:a"]),
        ("bind:b", "bind", ["release:b", "release:c"]),
        ("bind:c", "bind", ["release:b", "release:c"]),
        ("ledger", "ledger", []),
    ]
    assert only_step(actions, "release:b").steps == (RemoveSpec("b"), RemoveEnv("b"), released("b", 2, B))
    assert host.ledger == Ledger({"b": 2, "c": 2, "d": 2}, {})
    assert [type(e).__name__ for e in host.events[3:]] == ["ReleasedEvent"] * 3 + ["BoundEvent"] * 3


def test_Q_DEV_PASS_01_a_kubernetes_hold_whose_binding_changes_is_written_over_in_place() -> None:
    """Covers Q-DEV-PASS-01 for the binding: a wanted hold whose binding changed (its atoms the same) is
    written over in place (no removal, no pending Kubernetes release since the allocation is still
    wanted, no AllocationReleased), then AllocationBound at the new generation."""
    host = PlanHost(inventory(), facts={"pods_holding": {"k": True}})
    settled(host, spec(1, asg("k", A, binding=KUBE)))
    actions = settled(host, spec(2, asg("k", A)))
    assert [(a.key, a.kind) for a in actions] == [("rebind:k", "rebind"), ("ledger", "ledger")]
    assert [type(st).__name__ for st in actions[0].steps] == ["WriteSpec", "WriteEnv", "Emit"]
    assert actions[0].steps[-1] == bound("k", 2, A)
    assert host.releases == () and host.kinds() == ["BoundEvent", "BoundEvent"]
    assert "bcd.dev/binding" not in host.specs["k"]["annotations"]


def test_an_orphan_env_file_left_by_a_crash_goes_before_the_gpu_is_bound_again() -> None:
    """A crash between a release's two removals leaves the env file without its CDI spec (it names the
    released GPU for NVIDIA's legacy hook, and root refuses another hold of that GPU while it is there:
    docs/helper.md round 6, row 7). The next pass removes it before any bind, the bind of its GPU waits
    for that removal (`after`), and the pass after plans nothing. The release's AllocationReleased,
    recorded before the removals, goes out after the env file's removal, once."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A), asg("c", C)))
    s2 = spec(2, asg("b", A), asg("c", C))
    crashed = host.plan(s2)
    assert [a.key for a in crashed.actions[:2]] == ["release-intent", "release:a"]
    host.apply(crashed.actions[0].steps[0])
    host.apply(crashed.actions[1].steps[0])  # the crash: the spec removed, the env file left
    assert "a" not in host.specs and "a" in host.envs and host.plan(s2).holders.get("a") is None
    actions = settled(host, s2)
    assert [(a.key, a.kind, sorted(a.after)) for a in actions][:2] == [
        ("release-done:a", "release", []),
        ("bind:b", "bind", ["release-done:a"]),
    ]
    assert actions[0].steps == (RemoveEnv("a"), released("a", 2, A))
    assert sorted(host.envs) == ["b", "c"] and sorted(host.specs) == ["b", "c"]
    assert host.kinds()[-2:] == ["ReleasedEvent", "BoundEvent"] and host.ledger.releasing == {}
    # A bind of another GPU does not wait for it.
    host.envs["z"] = ("BCD_ALLOCATION_ID=z", "NVIDIA_VISIBLE_DEVICES=" + B)
    actions = settled(host, spec(3, asg("b", A), asg("c", C), asg("d", D)))
    assert [(a.key, sorted(a.after)) for a in actions][:2] == [("release-env:z", []), ("bind:d", [])]


def test_an_orphan_env_file_of_an_allocation_bound_in_the_pass_is_rewritten_not_removed() -> None:
    """An env file without a CDI spec whose allocation this pass binds is left to the bind, which writes
    it after the spec; one whose allocation is wanted but not bound (its checks failed) is removed: an
    env file is never without its hold after a pass."""
    host = PlanHost(inventory())
    host.envs["a"] = ("BCD_ALLOCATION_ID=a", "NVIDIA_VISIBLE_DEVICES=" + B)
    host.envs["x"] = ("BCD_ALLOCATION_ID=x", "NVIDIA_VISIBLE_DEVICES=" + C)
    actions = settled(host, spec(1, asg("a", A), asg("x", "GPU-0000")))
    assert [(a.key, a.kind) for a in actions] == [
        ("release-env:x", "release"),
        ("bind:a", "bind"),
        ("failures", "report"),
        ("ledger", "ledger"),
    ]
    assert host.envs == {"a": host.envs["a"]} and host.envs["a"][-1] == "NVIDIA_VISIBLE_DEVICES=" + A


def test_an_orphan_env_file_naming_an_unknown_device_or_unreadable_holds_every_bind_back() -> None:
    """An orphan env file root or the node cannot read, or one naming a device the inventory does not
    list, may name any GPU: every bind of the pass waits for its removal. A MIG device's UUID names
    its parent GPU."""
    host = PlanHost(inventory())
    p = host.plan(spec(1, asg("b", B), asg("c", C)))
    assert all(not a.after for a in p.actions)
    host.envs["u"] = ("BCD_ALLOCATION_ID=u", "NVIDIA_VISIBLE_DEVICES=GPU-gone")
    host.envs["m"] = ("BCD_ALLOCATION_ID=m", f"NVIDIA_VISIBLE_DEVICES={MIG_A}")
    actions = settled(host, spec(1, asg("a", A), asg("b", B)))
    assert [(a.key, sorted(a.after)) for a in actions][:4] == [
        ("release-env:m", []),
        ("release-env:u", []),
        ("bind:a", ["release-env:m", "release-env:u"]),
        ("bind:b", ["release-env:u"]),
    ]
    host1 = PlanHost(inventory())
    host1.envs["e"] = ("BCD_ALLOCATION_ID=e", "NVIDIA_VISIBLE_DEVICES=")  # names no GPU
    host1.envs["f"] = ("BCD_ALLOCATION_ID=f", f"NVIDIA_VISIBLE_DEVICES={B},{C}")
    host1.envs["g"] = ("BCD_ALLOCATION_ID=g", f"NVIDIA_VISIBLE_DEVICES={B}=x")  # no GPU's name: any
    actions = settled(host1, spec(1, asg("a", A), asg("c", C)))
    assert [(a.key, sorted(a.after)) for a in actions][:5] == [
        ("release-env:e", []),
        ("release-env:f", []),
        ("release-env:g", []),
        ("bind:a", ["release-env:g"]),
        ("bind:c", ["release-env:f", "release-env:g"]),
    ]
    host2 = PlanHost(inventory())
    host2.envs["n"] = None  # observed as unreadable
    actions = settled(host2, spec(1, asg("c", C)))
    assert [(a.key, sorted(a.after)) for a in actions][:2] == [
        ("release-env:n", []),
        ("bind:c", ["release-env:n"]),
    ]


def test_an_orphan_env_file_naming_a_gpu_the_spec_gives_its_allocation_stays_for_its_bind() -> None:
    """With command-signing roots root refuses removing the env file of an allocation the spec lists while
    it names an atom the spec gives it (`hold-in-spec`, docs/helper.md "Env files of a listed
    allocation"), so the planner plans no such removal: x is wanted on A, which h holds (x fails
    `overlap`), and x's orphan env file naming A stays; y's naming C, which y is not given, goes; so does
    z's, whose allocation the spec does not list. A MIG UUID is read as its MIG atom: m's naming MIG_A stays
    while m is given that MIG device, w's naming it goes while w is given A's other one."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("h", A)))
    host.envs["x"] = ("BCD_ALLOCATION_ID=x", "NVIDIA_VISIBLE_DEVICES=" + A)
    host.envs["y"] = ("BCD_ALLOCATION_ID=y", "NVIDIA_VISIBLE_DEVICES=" + C)
    host.envs["z"] = ("BCD_ALLOCATION_ID=z", "NVIDIA_VISIBLE_DEVICES=" + A)
    p = host.plan(spec(2, asg("h", A), asg("x", A), asg("y", "GPU-0000")))
    assert [a.key for a in p.actions if a.key.startswith("release")] == ["release-env:y", "release-env:z"]
    host2 = PlanHost(inventory())
    host2.envs["m"] = ("BCD_ALLOCATION_ID=m", "NVIDIA_VISIBLE_DEVICES=" + MIG_A)
    host2.envs["w"] = ("BCD_ALLOCATION_ID=w", "NVIDIA_VISIBLE_DEVICES=" + MIG_A)
    p2 = host2.plan(spec(1, asg("m", f"{A}/gi1/ci0", "GPU-0000"), asg("w", f"{A}/gi2/ci0", "GPU-0000")))
    assert [a.key for a in p2.actions if a.key.startswith("release")] == ["release-env:w"]


def test_a_slot_moved_to_another_slot_of_its_gpu_keeps_its_env_file_for_the_bind() -> None:
    """A slot moved to another slot of the same GPU shares no atom with it: the old hold is released and
    the new bound in one pass (Q-DEV-PASS-01). The old env file names the GPU, which the new slot is on, so
    root would refuse its removal (`hold-in-spec`): the release removes the CDI spec only, and the bind
    writes the env file over. A slot moved to another GPU removes both, as before."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", f"{B}/s0")))
    actions = settled(host, spec(2, asg("a", f"{B}/s1")))
    release = next(a for a in actions if a.key == "release:a")
    assert release.steps == (RemoveSpec("a"), released("a", 2, f"{B}/s0"))
    assert host.envs["a"][-1] == "NVIDIA_VISIBLE_DEVICES=" + B and sorted(host.specs) == ["a"]
    actions = settled(host, spec(3, asg("a", f"{C}/s0")))
    release = next(a for a in actions if a.key == "release:a")
    assert release.steps == (RemoveSpec("a"), RemoveEnv("a"), released("a", 3, f"{B}/s1"))


def test_Q_DEV_PASS_02_an_unparseable_spec_is_removed_unless_wanted() -> None:
    """Covers Q-DEV-PASS-02 (docs/devices.md): a bcd-<id>.json that does not parse is removed with a
    warning when its allocation is not wanted, and left alone while it is."""
    host = PlanHost(inventory(), unparseable=["z", "w"])
    p = host.step(spec(1, asg("w", A)))
    assert p.actions[0] == Action("release:z", "release", (RemoveSpec("z"), RemoveEnv("z")))
    assert p.warnings == ("/etc/cdi/bcd-z.json did not parse; removed (its allocation is not wanted)",)
    assert host.unparseable == ["w"]


# --- keeping ---------------------------------------------------------------------------------------


def test_DEV_PASS_12_13_a_kept_hold_gets_its_slice_env_and_bound_event_back() -> None:
    """Covers DEV-PASS-11 (kept), DEV-PASS-12 (a missing slice created again), DEV-PASS-13 (a missing
    env file rewritten), Q-DEV-PASS-04 (an owed AllocationBound sent, at the bind generation)."""
    host = PlanHost(inventory())
    want = asg("a", A, limits=LIMITS)
    settled(host, spec(1, want))
    lines = host.envs["a"]
    del host.slices[SLICE]
    del host.envs["a"]
    assert settled(host, spec(4, want)) == (
        Action("keep:a", "keep", (ApplySlice(slice_spec("a", LIMITS)), WriteEnv("a", lines))),
    )
    host.ledger = Ledger()
    assert settled(host, spec(5, want)) == (
        Action("keep:a", "keep", (bound("a", 1, A, parent=SLICE),)),
        ledger({"a": 1}, forget=(bkey("a", 1),)),
    )


def test_Q_DEV_PASS_01_a_kept_hold_takes_new_env_reservation_and_limits() -> None:
    """Covers Q-DEV-PASS-01 (docs/devices.md): a kept hold's changed env lines and reservation are
    rewritten (the generation annotation stays the bind generation), and its running slice gets the
    new limits with the properties no longer set reset."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A, limits=LIMITS)))
    first_doc = host.specs["a"]
    assert settled(host, spec(2, asg("a", A, limits=LIMITS, env=("X=1",)))) == (
        Action("keep:a", "keep", (WriteEnv("a", (*host.envs["a"][:4], "X=1")),)),
    )
    assert host.specs["a"] == first_doc
    actions = settled(host, spec(3, asg("a", A, limits=LIMITS, rsv="rsv_new")))
    (keep,) = actions
    assert [type(s).__name__ for s in keep.steps] == ["WriteSpec", "WriteEnv"]
    assert host.specs["a"]["annotations"]["bcd.dev/reservation-id"] == "rsv_new"
    assert host.specs["a"]["annotations"]["bcd.dev/generation"] == "1"
    assert "BCD_RESERVATION_ID=rsv_new" in host.envs["a"]
    smaller = Limits(cpus="0-1", memory_bytes=GIB)
    (keep,) = settled(host, spec(4, asg("a", A, limits=smaller, rsv="rsv_new")))
    new_slice = slice_spec("a", smaller)
    reset = ("AllowedMemoryNodes", "CPUQuota", "hugetlb.2MB", "hugetlb.1GB")
    assert keep.steps == (ApplySlice(new_slice, reset),)


def test_DEV_ASG_12_a_kept_hold_whose_devices_left_the_inventory_keeps_its_files() -> None:
    """A kept hold whose atoms the inventory no longer lists is kept as it is (DEV-ASG-12): nothing is
    rewritten, and a missing env file is reported as a warning instead of written wrong."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", f"{A}/gi1/ci0")))
    host.inventory = GpuInventory((), "590.48.01", True)
    assert host.plan(spec(2, asg("a", f"{A}/gi1/ci0"))).empty
    del host.envs["a"]
    p = host.plan(spec(2, asg("a", f"{A}/gi1/ci0")))
    assert p.actions == () and p.warnings == (
        "a: its devices are not in the inventory; env file not rewritten",
    )
    assert dict(p.holders) == {"a": (f"{A}/gi1/ci0",)}


# --- failures --------------------------------------------------------------------------------------


def test_DEV_EVT_10_DEV_FAIL_13_failed_once_per_generation_and_again_at_the_next() -> None:
    """Covers DEV-EVT-10 (once per allocation and generation), DEV-FAIL-13 (a later generation reports
    it again), DEV-FAIL-11 (the passing holds of the pass bound anyway), DEV-EVT-09's fields."""
    host = PlanHost(inventory())
    s2 = spec(2, asg("a", A), asg("x", "GPU-0000", f"{B}/s0"))
    failed = Emit(
        FailedEvent("x", "rsv_x", 2, "device-missing", "GPU-0000 not present", ("GPU-0000", f"{B}/s0"))
    )
    actions = settled(host, s2)
    assert [a.key for a in actions] == ["bind:a", "failures", "ledger"]
    assert actions[1] == Action("failures", "report", (failed,))
    assert actions[2] == ledger({"a": 2}, {"x": 2}, (bkey("a", 2),))
    p3 = host.step(spec(3, asg("a", A), asg("x", "GPU-0000", f"{B}/s0")))
    assert [a.key for a in p3.actions] == ["failures", "ledger"]
    assert host.ledger == Ledger({"a": 2}, {"x": 3})
    # Dropped from the spec: its failure is forgotten.
    assert settled(host, spec(4, asg("a", A))) == (ledger({"a": 2}),)


def test_DEV_FAIL_02_an_unprivileged_node_refuses_every_new_hold_after_the_binding_check() -> None:
    """Covers DEV-FAIL-02 (the message), DEV-UNPRIV-03, and DEV-FAIL-07's order around it."""
    host = PlanHost(inventory(), facts={"privileged": False})
    p = host.step(spec(1, asg("a", A), asg("b", B, binding="BINDING_NODE"), asg("c", "GPU-zz/x")))
    message = (
        "bcd node runs without root and without [helper]: it cannot write /etc/cdi or create hold slices "
        "(run bcd node as root, or under bcd helper)"
    )
    assert p.failures == (
        Failure("a", "node-unprivileged", message),
        Failure("b", "unsupported-binding", "binding BINDING_NODE is not supported"),
        Failure("c", "node-unprivileged", message),
    )
    assert host.specs == {} and host.slices == {}


def test_DEV_ASG_13_a_duplicate_entry_of_a_held_allocation_fails_without_an_event() -> None:
    """A later entry of an allocation its first entry holds fails the section (its message names it)
    but sends no AllocationFailed; the first entry is bound (kept on later passes)."""
    host = PlanHost(inventory())
    s = spec(1, asg("a", A), asg("a", B))
    p = host.step(s)
    assert p.failures == (Failure("a", "invalid-assignment", "allocation a is listed twice"),)
    assert [a.key for a in p.actions] == ["bind:a", "ledger"] and host.ledger == Ledger({"a": 1}, {})
    again = host.plan(s)
    assert again.empty and again.failures == p.failures


def test_invalid_assignment_env_line_reserved_key_and_mems() -> None:
    """invalid-assignment (docs/devices.md): an env line that is not KEY=VALUE, a reserved key, a bad
    mems cpulist; only the first problem is named."""
    host = PlanHost(inventory())
    p = host.step(
        spec(
            1,
            asg("e", A, env=("OK=1", "no equals")),
            asg("r", B, env=("OK=1", "BCD_CGROUP_PARENT=x")),
            asg("m", C, limits=Limits(cpus="0", mems="0-1;x")),
        )
    )
    assert [(f.allocation_id, f.reason) for f in p.failures] == [
        ("e", "invalid-assignment"),
        ("r", "invalid-assignment"),
        ("m", "invalid-assignment"),
    ]
    assert p.failures[1].message == "env line for BCD_CGROUP_PARENT: bcd sets that key itself"
    assert p.failures[2].message == "limits.mems: '0-1;x' is not a cpulist"
    assert "no equals" in p.failures[0].message


# --- admission -------------------------------------------------------------------------------------


HOST = HostMemory(
    mem_total_kb=(16 + 8 + 2) * 1024 * 1024,  # 26 GiB, 8 of them huge pages: 17 GiB normal available
    hugetlb_kb=8 * 1024 * 1024,
    pools={2048: HugePool(2048, 1024, {0: 512, 1: 512}), 1048576: HugePool(1048576, 6, {0: 2, 1: 4})},
    nodes=(0, 1),
)


def test_DEV_ADM_06_kept_holds_count_against_new_ones_with_their_faulted_pages() -> None:
    """Covers DEV-ADM-06 (kept holds' memory, a Kubernetes hold's too), DEV-ADM-09 (their huge pages
    less what the slice faulted in, on their nodes)."""
    host = PlanHost(inventory(), facts={"host_memory": HOST})
    settled(
        host,
        spec(
            1,
            asg("a", A, limits=Limits(mems="1", memory_bytes=8 * GIB, hugepages_1gi=3)),
            asg("k", B, binding=KUBE, limits=Limits(memory_bytes=4 * GIB)),
        ),
    )
    # a has faulted in 2 of its 3 pages (the kernel's free count already lost them): 1 more to take.
    host.slices[SLICE] = evolve(host.slices[SLICE], hugetlb_current={1048576: 2 * GIB})
    keep = (
        asg("a", A, limits=Limits(mems="1", memory_bytes=8 * GIB, hugepages_1gi=3)),
        asg("k", B, binding=KUBE, limits=Limits(memory_bytes=4 * GIB)),
    )
    p = host.plan(spec(2, *keep, asg("n", C, limits=Limits(memory_bytes=5 * GIB + 1))))
    assert p.failures == (
        Failure(
            "n",
            "resources-exhausted",
            "ResourcesExhausted: 5121 MiB of memory needed, 5120 MiB left on this host",
        ),
    )
    fits = host.plan(spec(2, *keep, asg("n", C, limits=Limits(mems="1", hugepages_1gi=3))))
    assert fits.failures == ()
    over = host.plan(spec(2, *keep, asg("n", C, limits=Limits(mems="1", hugepages_1gi=4))))
    assert over.failures == (
        Failure("n", "resources-exhausted", "ResourcesExhausted: 4 hugepages of 1048576 KiB needed, 3 free"),
    )


def test_DEV_ADM_10_a_kept_hold_grows_into_its_own_booking_or_is_refused_and_kept() -> None:
    """Covers DEV-ADM-10/13 and DEV-FAIL-06 for a kept hold's changed limits (Q-DEV-PASS-01): the
    growth is admitted with the hold's own booking counted as freed; refused, the slice, spec and env
    file stay as they are, one AllocationFailed per generation, and the hold stays bound."""
    host = PlanHost(inventory(), facts={"host_memory": HOST})
    settled(
        host,
        spec(
            1,
            asg("a", A, limits=Limits(memory_bytes=8 * GIB)),
            asg("b", B, limits=Limits(memory_bytes=4 * GIB)),
        ),
    )
    grown = spec(
        2, asg("a", A, limits=Limits(memory_bytes=13 * GIB)), asg("b", B, limits=Limits(memory_bytes=4 * GIB))
    )
    (keep,) = settled(host, grown)
    assert keep.steps == (ApplySlice(slice_spec("a", Limits(memory_bytes=13 * GIB))),)
    too_big = Limits(cpus="0-7", memory_bytes=14 * GIB)
    refused = spec(
        3, asg("a", A, limits=too_big, env=("X=1",)), asg("b", B, limits=Limits(memory_bytes=4 * GIB))
    )
    before = (dict(host.specs), dict(host.envs), dict(host.slices))
    message = "ResourcesExhausted: 14336 MiB of memory needed, 13312 MiB left on this host"
    p = host.step(refused)
    assert p.failures == (Failure("a", "resources-exhausted", message),)
    assert p.actions == (
        Action(
            "failures",
            "report",
            (Emit(FailedEvent("a", "rsv_a", 3, "resources-exhausted", message, (A,))),),
        ),
        ledger({"a": 1, "b": 1}, {"a": 3}),
    )
    assert (host.specs, host.envs, host.slices) == before
    assert dict(p.holders) == {"a": (A,), "b": (B,)}
    again = host.plan(refused)
    assert again.empty and again.failures == p.failures
    # b goes: a's growth fits now; its failure is forgotten once it holds its new limits.
    final = settled(host, spec(4, asg("a", A, limits=too_big, env=("X=1",))))
    assert [a.key for a in final] == ["release-intent", "release:b", "keep:a", "ledger"]
    assert host.ledger == Ledger({"a": 1}, {})


def test_DEV_ADM_15_unreadable_host_memory_binds_and_grows_without_admission() -> None:
    """Covers DEV-ADM-15 (warned once per pass, for new and kept holds) and DEV-ADM-16 (a fakehw host:
    no admission and no warning)."""
    host = PlanHost(inventory(), facts={"host_memory": None})
    p = host.step(
        spec(
            1,
            asg("a", A, limits=Limits(memory_bytes=900 * GIB)),
            asg("b", B, limits=Limits(memory_bytes=900 * GIB)),
        )
    )
    assert p.failures == () and p.warnings == (ADMISSION_UNREADABLE_WARNING,)
    grow = spec(
        2,
        asg("a", A, limits=Limits(memory_bytes=901 * GIB)),
        asg("b", B, limits=Limits(memory_bytes=901 * GIB)),
    )
    g = host.step(grow)
    assert g.failures == () and g.warnings == (ADMISSION_UNREADABLE_WARNING,)
    assert [a.key for a in g.actions] == ["keep:a", "keep:b"]
    fake = PlanHost(inventory(), facts={"host_memory": None, "admission": False})
    f = fake.step(spec(1, asg("a", A, limits=Limits(memory_bytes=900 * GIB))))
    assert f.failures == () and f.warnings == ()
    f2 = fake.step(spec(2, asg("a", A, limits=Limits(memory_bytes=901 * GIB))))
    assert f2.warnings == () and [a.key for a in f2.actions] == ["keep:a"]


# --- the admission helpers, as tables ----------------------------------------------------------------

PAGE_2M, PAGE_1G = 2 * MIB, GIB


def running(current: dict[int, int] | None = None, **limits: str) -> SliceState:
    """A running slice whose cgroup files enforce `limits` (applied_limits' normal form)."""
    return SliceState(SLICE, True, current or {}, limits)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (running(), Taker(0, {}, ())),
        (SliceState(SLICE, True), Taker(0, {}, ())),  # limits not read
        (
            running(MemoryMax=str(3 * GIB), AllowedMemoryNodes="0-1", **{"hugetlb.2MB": str(10 * PAGE_2M)}),
            Taker(3 * GIB, {2048: 10}, (0, 1)),
        ),
        (
            running({1048576: 2 * PAGE_1G}, **{"hugetlb.1GB": str(5 * PAGE_1G), "hugetlb.2MB": "0"}),
            Taker(0, {1048576: 3}, ()),
        ),
        (running({2048: 7 * PAGE_2M}, **{"hugetlb.2MB": str(4 * PAGE_2M)}), Taker(0, {2048: 0}, ())),
        (running(MemoryMax="infinity", **{"hugetlb.1GB": "max"}), Taker(0, {}, ())),
        (running({2048: 2 * PAGE_2M + 1}, **{"hugetlb.2MB": str(5 * PAGE_2M)}), Taker(0, {2048: 2}, ())),
    ],
)
def test_DEV_ADM_09_applied_taker_books_what_the_running_slice_enforces(
    state: SliceState, expected: Taker
) -> None:
    """Covers DEV-ADM-09 for a running slice before a change: its MemoryMax, and its huge page limits
    less what it faulted in (never below 0), on its memory nodes."""
    assert applied_taker(state) == expected


def test_DEV_ADM_09_faulted_taker_and_taker_count_faulted_pages() -> None:
    """Covers DEV-ADM-09: what a slice has faulted in per size (unknown sizes ignored), and a bound
    hold's remaining pages (its limit less what it faulted in)."""
    st = running({2048: 3 * PAGE_2M + 1, 1048576: PAGE_1G, 64: 5}, AllowedMemoryNodes="1")
    assert faulted_taker(st) == Taker(0, {2048: 3, 1048576: 1}, (1,))
    assert faulted_taker(SliceState(SLICE, True, {2048: PAGE_2M})) == Taker(0, {2048: 1}, ())
    want = asg("a", A, limits=Limits(mems="0,1", memory_bytes=GIB, hugepages_2mi=5, hugepages_1gi=4))
    assert taker(want, st) == Taker(GIB, {2048: 2, 1048576: 3}, (0, 1))
    assert taker(want, None) == Taker(GIB, {2048: 5, 1048576: 4}, (0, 1))
    over = running({2048: 9 * PAGE_2M})
    assert taker(asg("a", A, limits=Limits(hugepages_2mi=5)), over) == Taker(0, {2048: 0}, ())
    assert taker(asg("a", A, limits=Limits(cpus="0")), None) == Taker(0, {}, ())
    assert taker(asg("a", A), None) == Taker(0, {}, ())
    assert taker(asg("a", A, limits=Limits(mems="0-x", hugepages_1gi=1)), None) == Taker(0, {1048576: 1}, ())


@pytest.mark.parametrize(
    ("limits", "applied", "expected"),
    [
        # Nothing grows: the same, or smaller.
        (Limits(memory_bytes=4 * GIB), {"MemoryMax": str(4 * GIB)}, None),
        (Limits(memory_bytes=4 * GIB + 100), {"MemoryMax": str(4 * GIB)}, None),  # same 4 KiB page
        (
            Limits(memory_bytes=GIB, hugepages_2mi=2),
            {"MemoryMax": str(2 * GIB), "hugetlb.2MB": str(2 * PAGE_2M)},
            None,
        ),
        (Limits(cpus="0-7"), {"AllowedCPUs": "0-3"}, None),
        # Memory grows (over an unlimited or unreadable MemoryMax too).
        (
            Limits(memory_bytes=4 * GIB + 4096),
            {"MemoryMax": str(4 * GIB)},
            Limits(memory_bytes=4 * GIB + 4096),
        ),
        (Limits(cpus="1", memory_bytes=4096), {}, Limits(memory_bytes=4096)),
        (Limits(memory_bytes=4096), {"MemoryMax": "infinity"}, Limits(memory_bytes=4096)),
        # Huge pages grow, one size; the other keeps its booking.
        (
            Limits(memory_bytes=GIB, hugepages_2mi=3, hugepages_1gi=1),
            {"MemoryMax": str(GIB), "hugetlb.2MB": str(2 * PAGE_2M), "hugetlb.1GB": str(PAGE_1G)},
            Limits(hugepages_2mi=3),
        ),
        (
            Limits(hugepages_2mi=1, hugepages_1gi=2),
            {"hugetlb.2MB": str(PAGE_2M), "hugetlb.1GB": str(PAGE_1G)},
            Limits(hugepages_1gi=2),
        ),
        (Limits(hugepages_1gi=1), {"hugetlb.1GB": "max"}, Limits(hugepages_1gi=1)),
        # The memory nodes move: every booked size must fit on the new ones.
        (
            Limits(mems="1", hugepages_2mi=2, hugepages_1gi=1),
            {"AllowedMemoryNodes": "0", "hugetlb.2MB": str(2 * PAGE_2M), "hugetlb.1GB": str(PAGE_1G)},
            Limits(mems="1", hugepages_2mi=2, hugepages_1gi=1),
        ),
        (Limits(mems="1", memory_bytes=GIB), {"AllowedMemoryNodes": "0", "MemoryMax": str(GIB)}, None),
        (
            Limits(mems="0", hugepages_2mi=2),
            {"AllowedMemoryNodes": "0", "hugetlb.2MB": str(2 * PAGE_2M)},
            None,
        ),
    ],
)
def test_DEV_ADM_10_grown_limits_are_only_what_needs_more_of_the_host(
    limits: Limits, applied: dict[str, str], expected: Limits | None
) -> None:
    """Covers DEV-ADM-10/11 for a kept hold's new limits: only the quantities that grow are admitted."""
    assert grown_limits(limits, running(**applied)) == expected


def test_needs_host_memory_only_when_a_hold_needs_admission() -> None:
    """The observer's decision to read meminfo in a pass: a new hold (or one bound again) with memory or
    huge pages, or a kept hold whose running slice gets other limits; cpus or cpu_millis alone never."""
    host = PlanHost(inventory())
    settled(
        host, spec(1, asg("a", A, limits=Limits(memory_bytes=GIB)), asg("k", B, binding=KUBE, limits=LIMITS))
    )
    holds, slices = host.observed().holds, host.observed().slices
    kept = (asg("a", A, limits=Limits(memory_bytes=GIB)), asg("k", B, binding=KUBE, limits=LIMITS))
    assert not needs_host_memory(spec(2, *kept), holds, slices)
    assert not needs_host_memory(spec(2, *kept), holds)
    assert not needs_host_memory(
        spec(2, *kept, asg("c", C, limits=Limits(cpus="0", cpu_millis=100))), holds, slices
    )
    assert not needs_host_memory(spec(2, *kept, asg("c", C)), holds, slices)
    assert needs_host_memory(spec(2, asg("c", C, limits=Limits(hugepages_2mi=1)), *kept), holds, slices)
    assert needs_host_memory(spec(2, asg("c", C, limits=Limits(hugepages_1gi=1))), holds, slices)
    assert needs_host_memory(spec(2, asg("x", C), asg("c", C, limits=Limits(hugepages_1gi=1))), holds, slices)
    # A hold bound again (its atoms or binding changed) is a new hold.
    assert needs_host_memory(spec(2, asg("a", C, limits=Limits(memory_bytes=GIB))), holds, slices)
    assert needs_host_memory(
        spec(2, asg("a", A, binding=KUBE, limits=Limits(memory_bytes=GIB))), holds, slices
    )
    # A kept hold whose running slice is to get other limits; not when the slices were not read.
    grows = asg("a", A, limits=Limits(memory_bytes=2 * GIB))
    assert needs_host_memory(spec(2, grows), holds, slices)
    assert not needs_host_memory(spec(2, grows), holds)
    assert not needs_host_memory(spec(2, grows), holds, {SLICE: SliceState(SLICE, True)})  # limits unread
    assert not needs_host_memory(spec(2, grows), holds, {})  # no slice running: created as it is wanted


def test_DEV_ADM_06_DEV_ADM_17_commitments_are_what_each_bound_hold_was_promised() -> None:
    """Covers DEV-ADM-17 (and DEV-ADM-06): what VM starts count, per bound hold in allocation order and
    then per leftover slice. A running slice books what it enforces (less the pages it faulted in); a
    Kubernetes hold (no slice) what its assignment booked; a hold whose slice limits were not read its
    assignment less what the slice faulted in; a slice whose hold is gone what it enforces until it is
    stopped. Nothing for a hold that books no memory or pages, nor for a leftover slice not read."""
    host = PlanHost(inventory())
    a = asg("a", A, limits=Limits(mems="0", memory_bytes=2 * GIB, hugepages_2mi=4))
    c = asg("c", C, limits=Limits(cpus="0"))
    k = asg("k", B, binding=KUBE, limits=Limits(memory_bytes=3 * GIB, hugepages_1gi=1))
    settled(host, spec(1, a, c, k))
    obs = host.observed()
    holds, slices = obs.holds, dict(obs.slices)
    assert sorted(holds) == ["a", "c", "k"] and sorted(slices) == [SLICE, "bcd-alloc-c.slice"]
    booked_k = Taker(3 * GIB, {1048576: 1}, ())
    assert commitments(holds, slices, (a, c, k)) == (Taker(2 * GIB, {2048: 4}, (0,)), booked_k)
    assert commitments(holds, slices) == (Taker(2 * GIB, {2048: 4}, (0,)),)  # k's booking unknown
    # a's slice has faulted in 3 of its 4 pages: the kernel's free counts no longer have them.
    slices[SLICE] = evolve(slices[SLICE], hugetlb_current={2048: 3 * PAGE_2M})
    left_a = Taker(2 * GIB, {2048: 1}, (0,))
    assert commitments(holds, slices, (a, c, k)) == (left_a, booked_k)
    # a's slice limits were not read: its assignment counts, less what the slice faulted in.
    slices[SLICE] = evolve(slices[SLICE], limits=None)
    assert commitments(holds, slices, (a, c, k)) == (left_a, booked_k)
    assert commitments(holds, slices) == ()
    # Leftover slices (their holds gone): counted after the holds while they run, in name order.
    slices["bcd-alloc-z.slice"] = running(MemoryMax=str(GIB), AllowedMemoryNodes="1")
    slices["bcd-alloc-y.slice"] = SliceState("bcd-alloc-y.slice", True)  # limits not read
    slices["bcd-alloc-x.slice"] = running({2048: PAGE_2M}, **{"hugetlb.2MB": str(3 * PAGE_2M)})
    leftovers = (Taker(0, {2048: 2}, ()), Taker(GIB, {}, (1,)))
    assert commitments(holds, slices, (a, c, k)) == (left_a, booked_k, *leftovers)
    assert commitments({}, slices) == leftovers


def test_with_host_memory_sets_only_the_host() -> None:
    obs = PlanHost(inventory()).observed()
    assert with_host_memory(obs, HOST) == evolve(obs, host_memory=HOST)
    assert with_host_memory(obs, None).host_memory is None


def test_Q_DEV_PASS_01_a_held_allocation_whose_entry_became_unsupported_keeps_its_hold_and_is_refused() -> (
    None
):
    """A hold is kept only for the same supported binding and the same well-formed atoms: an entry now
    naming the same id with a class that cannot be held, or an unsupported binding, is refused
    (DEV-FAIL-03, DEV-FAIL-01); its old hold shares the atom, so it stays as it is (never removed while
    the spec lists the allocation: root would refuse that `hold-in-spec`), as a refused limit change
    does (Q-DEV-ADM-04). One AllocationFailed per generation."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A), asg("b", B)))
    before = dict(host.specs)
    bad_class = DeviceAssignment("a", "rsv_a", HOLD, (DeviceRef(A, "nic.vf"),))
    s2 = spec(2, bad_class, asg("b", B, binding="BINDING_INSTANCE"))
    actions = settled(host, s2)
    assert [a.key for a in actions] == ["failures", "ledger"]
    assert [(f.allocation_id, f.reason) for f in host.plan(s2).failures] == [
        ("a", "unsupported-device"),
        ("b", "unsupported-binding"),
    ]
    assert host.specs == before and host.ledger == Ledger({"a": 1, "b": 1}, {"a": 2, "b": 2})
    assert host.plan(s2).holders == {"a": (A,), "b": (B,)}


# --- the survivors of the first mutation runs (docs/mutation.md, "devices plan") ----------------------


def test_DEV_CDI_18_DEV_CDI_04_a_plain_hold_takes_the_vendor_common_edits_and_later_version() -> None:
    """Covers DEV-CDI-18 (the vendor's common edits on a plain hold, none on a Kubernetes hold) and
    DEV-CDI-04 (the vendor's later cdiVersion on a plain hold only)."""
    nodes = [{"path": "/dev/nvidiactl"}]
    vendor = VendorSpec("0.8.0", {"deviceNodes": nodes}, {})
    host = PlanHost(inventory(), facts={"vendor": vendor})
    settled(host, spec(1, asg("p", A), asg("k", B, binding=KUBE)))
    assert host.specs["p"]["cdiVersion"] == "0.8.0"
    assert host.specs["p"]["containerEdits"] == {
        "env": ["BCD_ALLOCATION_ID=p", f"NVIDIA_VISIBLE_DEVICES={A}"],
        "deviceNodes": nodes,
    }
    assert host.specs["k"]["cdiVersion"] == "0.6.0"
    assert host.specs["k"]["containerEdits"] == {"env": ["BCD_ALLOCATION_ID=k"]}


def test_DEV_CONF_04_a_slot_or_gpu_held_by_a_kept_hold_is_refused_naming_its_holder() -> None:
    """Covers DEV-CONF-04 (the same slot twice, in one pass and against a kept hold) and DEV-FAIL-05's
    message naming the holder; several conflicts are all named, joined by `; ` (Q-DEV-CONF-03)."""
    host = PlanHost(inventory())
    p = host.step(spec(1, asg("a", f"{A}/s1"), asg("b", f"{A}/s1"), asg("c", B)))
    assert p.failures == (Failure("b", "overlap", f"{A}/s1 is assigned to a"),)
    p2 = host.step(spec(2, asg("a", f"{A}/s1"), asg("c", B), asg("d", f"{A}/s1", B, C)))
    assert p2.failures == (Failure("d", "overlap", f"{A}/s1 is assigned to a; {B} is assigned to c"),)


def test_DEV_FAIL_03_every_unsupported_device_is_named() -> None:
    """Covers DEV-FAIL-03: each malformed atom's message, joined by `; ` (a repeated one once)."""
    host = PlanHost(inventory())
    bad = DeviceAssignment(
        "a",
        "rsv_a",
        HOLD,
        (DeviceRef("GPU-a/x", "gpu.mig"), DeviceRef("vf0", "nic.vf"), DeviceRef("vf1", "nic.vf")),
    )
    p = host.step(spec(1, bad))
    assert p.failures == (
        Failure(
            "a",
            "unsupported-device",
            '"GPU-a/x" is not a MIG instance id (<gpu-uuid>/gi<n>/ci<m>); device class nic.vf cannot be held',
        ),
    )


def test_Q_DEV_ASG_02_a_reserved_key_is_refused_whatever_its_value_holds() -> None:
    """Covers Q-DEV-ASG-02 (docs/devices.md): the key is what precedes the first `=`."""
    p = PlanHost(inventory()).step(spec(1, asg("a", A, env=("BCD_ALLOCATION_ID=x=y",))))
    assert p.failures == (
        Failure("a", "invalid-assignment", "env line for BCD_ALLOCATION_ID: bcd sets that key itself"),
    )


def test_DEV_K8S_07_a_kubernetes_hold_nobody_answered_for_is_held() -> None:
    """Covers DEV-K8S-07 at the planner: a released Kubernetes hold (and a pending release) the kube
    side said nothing about counts as held: recorded, not reported."""
    host = PlanHost(inventory(), facts={"now": 5.0})
    settled(host, spec(1, asg("k", A, binding=KUBE)))
    pending = PendingRelease("k", "rsv_k", 2, (A,), 5.0)
    assert settled(host, spec(2)) == (
        Action("release:k", "kube-release", (WriteReleases((pending,)), RemoveSpec("k"), RemoveEnv("k"))),
    )
    assert host.releases == (pending,) and host.kinds() == ["BoundEvent"]


def test_DEV_K8S_09_each_pending_release_is_reported_or_kept_on_its_own() -> None:
    """Covers DEV-K8S-08/09 for several pending releases: the freed ones reported, the held ones kept
    in the rewritten file, in their order."""
    r1 = PendingRelease("r1", "rsv_r1", 1, (A,), 0.0)
    r2 = PendingRelease("r2", "rsv_r2", 1, (B,), 0.0)
    r3 = PendingRelease("r3", "rsv_r3", 1, (C,), 0.0)
    host = PlanHost(inventory(), facts={"pods_holding": {"r1": False, "r2": True, "r3": False}})
    host.releases = (r1, r2, r3)
    assert settled(host, spec(2)) == (
        Action(
            "kube-reported",
            "releases",
            (released("r1", 1, A, kube=True), released("r3", 1, C, kube=True), WriteReleases((r2,))),
        ),
        ledger(forget=(key("r1", 1), key("r3", 1))),
    )


def test_a_hold_the_ledger_forgot_is_still_released() -> None:
    """A hold whose AllocationBound the ledger does not record (a lost ledger) is released like any
    other: plain, and Kubernetes with no pod holding it."""
    host = PlanHost(inventory(), facts={"pods_holding": {"k": False}})
    settled(host, spec(1, asg("a", A), asg("k", B, binding=KUBE)))
    host.ledger = Ledger()
    actions = settled(host, spec(2))
    assert [a.key for a in actions] == ["release-intent", "release:a", "release:k", "ledger"]
    assert host.kinds()[-2:] == ["ReleasedEvent", "ReleasedEvent"]


def test_holders_and_failures_reported_after_a_duplicate() -> None:
    """Plan.holders names each hold standing after the pass with its atoms (new binds too); a failure
    after a duplicate entry (which sends no event) is still reported."""
    host = PlanHost(inventory())
    p = host.step(spec(1, asg("a", A, f"{B}/s0"), asg("a", C), asg("x", "GPU-0000")))
    assert dict(p.holders) == {"a": (A, f"{B}/s0")}
    assert [f.allocation_id for f in p.failures] == ["a", "x"]
    assert host.kinds() == ["BoundEvent", "FailedEvent"] and host.ledger == Ledger({"a": 1}, {"x": 1})


POOLS = HostMemory(
    mem_total_kb=(16 + 8 + 2) * 1024 * 1024,  # 17 GiB normal memory available
    hugetlb_kb=8 * 1024 * 1024,
    pools={2048: HugePool(2048, 1024, {0: 512, 1: 512}), 1048576: HugePool(1048576, 6, {0: 2, 1: 4})},
    nodes=(0, 1),
)


@pytest.mark.parametrize(
    ("bound_first", "new", "message"),
    [
        # Host-wide: a bound hold's pages (no mems) count; a size it does not book counts 0.
        (Limits(hugepages_2mi=1000), Limits(hugepages_2mi=25), "25 hugepages of 2048 KiB needed, 24 free"),
        (Limits(hugepages_2mi=1000), Limits(hugepages_2mi=24, hugepages_1gi=6), None),
        # On nodes: a hold on other nodes does not count there; one on the same nodes with another size
        # counts 0 there.
        (Limits(mems="0", hugepages_1gi=2), Limits(mems="1", hugepages_1gi=4), None),
        (Limits(mems="1", hugepages_2mi=1), Limits(mems="1", hugepages_1gi=4), None),
        (
            Limits(mems="1", hugepages_1gi=1),
            Limits(mems="1", hugepages_1gi=4),
            "4 hugepages of 1048576 KiB needed, 3 free",
        ),
        # A node the pool does not list has no free pages.
        (Limits(cpus="0"), Limits(mems="0,2", hugepages_1gi=3), "3 hugepages of 1048576 KiB needed, 2 free"),
    ],
)
def test_DEV_ADM_09_DEV_ADM_11_huge_pages_of_bound_holds_count_host_wide_and_on_their_nodes(
    bound_first: Limits, new: Limits, message: str | None
) -> None:
    """Covers DEV-ADM-09 (bound holds' pages, on their mems nodes), DEV-ADM-11 (the new hold's pages
    on its nodes, or host-wide without mems), DEV-ADM-14's message."""
    host = PlanHost(inventory(), facts={"host_memory": POOLS})
    p = host.step(spec(1, asg("a", A, limits=bound_first), asg("n", B, limits=new)))
    expected = (Failure("n", "resources-exhausted", f"ResourcesExhausted: {message}"),) if message else ()
    assert p.failures == expected


def test_DEV_ADM_14_a_size_the_host_has_no_pool_for_has_none_free() -> None:
    """Covers DEV-ADM-14's message when the host has no pool of that size (0 free, never negative)."""
    no_1g = HostMemory(26 * 1024 * 1024, 2 * 1024 * 1024, {2048: HugePool(2048, 1024, {0: 1024})}, (0,))
    p = PlanHost(inventory(), facts={"host_memory": no_1g}).step(
        spec(1, asg("n", A, limits=Limits(hugepages_1gi=1)))
    )
    assert p.failures == (
        Failure("n", "resources-exhausted", "ResourcesExhausted: 1 hugepages of 1048576 KiB needed, 0 free"),
    )


def grow_host(pools: dict[int, HugePool]) -> PlanHost:
    return PlanHost(
        inventory(), facts={"host_memory": HostMemory(26 * 1024 * 1024, 8 * 1024 * 1024, pools, (0, 1))}
    )


def test_DEV_ADM_10_a_kept_hold_grows_into_the_huge_pages_its_slice_faulted_in() -> None:
    """Covers DEV-ADM-09/10 for a kept hold's growing huge pages: the pages its slice has faulted in
    (gone from the kernel's free counts) count as free again, host-wide and on its nodes when they are
    among the new ones; a size it faulted nothing of gets no credit."""
    # 6 pages of 1 GiB: 2 on node 0, 4 on node 1; a holds 2 on node 1, both faulted in.
    host = grow_host({1048576: HugePool(1048576, 4, {0: 2, 1: 2}), 2048: HugePool(2048, 10, {0: 5, 1: 5})})
    settled(host, spec(1, asg("a", A, limits=Limits(mems="1", hugepages_1gi=2))))
    host.slices[SLICE] = evolve(host.slices[SLICE], hugetlb_current={1048576: 2 * GIB})
    fits = asg("a", A, limits=Limits(mems="1", hugepages_1gi=4))
    assert host.plan(spec(2, fits)).failures == ()
    too_many = asg("a", A, limits=Limits(mems="1", hugepages_1gi=5))
    assert host.plan(spec(2, too_many)).failures == (
        Failure("a", "resources-exhausted", "ResourcesExhausted: 5 hugepages of 1048576 KiB needed, 4 free"),
    )
    # Moved to node 0: the credit counts host-wide only.
    moved = asg("a", A, limits=Limits(mems="0", hugepages_1gi=3))
    assert host.plan(spec(2, moved)).failures == (
        Failure("a", "resources-exhausted", "ResourcesExhausted: 3 hugepages of 1048576 KiB needed, 2 free"),
    )
    # 2 MiB pages it never faulted: no credit (10 free, 11 needed).
    more = asg("a", A, limits=Limits(mems="1", hugepages_1gi=2, hugepages_2mi=11))
    assert host.plan(spec(2, more)).failures == (
        Failure("a", "resources-exhausted", "ResourcesExhausted: 11 hugepages of 2048 KiB needed, 5 free"),
    )
    exact = asg("a", A, limits=Limits(mems="1", hugepages_1gi=2, hugepages_2mi=5))
    assert host.plan(spec(2, exact)).failures == ()


def test_DEV_ADM_10_a_kept_hold_is_admitted_for_what_grows_only() -> None:
    """Covers DEV-ADM-10 for a kept hold: growing huge pages does not admit its unchanged memory
    again (10 GiB booked, 9 GiB left beside b and the domains started since: it would not fit as new)."""
    host = PlanHost(inventory(), facts={"host_memory": POOLS})
    first = (
        asg("a", A, limits=Limits(memory_bytes=10 * GIB)),
        asg("b", B, limits=Limits(memory_bytes=7 * GIB)),
    )
    settled(host, spec(1, *first))
    host.facts["domains_committed_bytes"] = GIB
    grown = asg("a", A, limits=Limits(memory_bytes=10 * GIB, hugepages_2mi=4))
    (keep,) = settled(host, spec(2, grown, first[1]))
    assert keep.key == "keep:a" and isinstance(keep.steps[0], ApplySlice)


def test_DEV_ADM_06_new_holds_count_kept_holds_after_their_limit_changes() -> None:
    """Covers DEV-ADM-06/09 in a pass where kept holds change limits: a new hold is admitted against a
    refused hold's old booking, an admitted one's new booking (its new page limit less what its slice
    faulted in), and every refused change is refused on its own."""
    host = PlanHost(inventory(), facts={"host_memory": POOLS})
    first = (
        asg("a", A, limits=Limits(memory_bytes=4 * GIB)),
        asg("b", B, limits=Limits(hugepages_2mi=100)),
        asg("c", C, limits=Limits(memory_bytes=4 * GIB)),
    )
    settled(host, spec(1, *first))
    host.slices["bcd-alloc-b.slice"] = evolve(
        host.slices["bcd-alloc-b.slice"], hugetlb_current={2048: 50 * PAGE_2M}
    )
    # The kernel's free count lost b's 50 faulted pages: 974 free.
    host.facts["host_memory"] = evolve(
        POOLS, pools={**POOLS.pools, 2048: HugePool(2048, 974, {0: 487, 1: 487})}
    )
    changed = (
        asg("a", A, limits=Limits(memory_bytes=14 * GIB)),  # refused: 13 GiB left with a's own 4
        asg("b", B, limits=Limits(hugepages_2mi=200)),  # admitted: books 150 more
        asg("c", C, limits=Limits(memory_bytes=14 * GIB)),  # refused too
    )
    n_fits = asg("n", D, limits=Limits(memory_bytes=9 * GIB, hugepages_2mi=824))
    p = host.plan(spec(2, *changed, n_fits))
    assert [(f.allocation_id, f.reason) for f in p.failures] == [
        ("a", "resources-exhausted"),
        ("c", "resources-exhausted"),
    ]
    assert [a.key for a in p.actions] == ["keep:b", "bind:n", "failures", "ledger"]
    n_over = asg("n", D, limits=Limits(hugepages_2mi=825))
    assert host.plan(spec(2, *changed, n_over)).failures[-1] == Failure(
        "n", "resources-exhausted", "ResourcesExhausted: 825 hugepages of 2048 KiB needed, 824 free"
    )
    n_mem = asg("n", D, limits=Limits(memory_bytes=9 * GIB + 4096))
    assert host.plan(spec(2, *changed, n_mem)).failures[-1] == Failure(
        "n",
        "resources-exhausted",
        "ResourcesExhausted: 9217 MiB of memory needed, 9216 MiB left on this host",
    )


def test_a_kept_hold_whose_slice_limits_were_not_read_is_not_admitted_again() -> None:
    """A kept hold whose running slice's limits could not be read (a fakehw record that does not parse
    reads as populated, limits unknown) is neither changed nor admitted again, even on a host that has
    since filled up (10 GiB booked, 9 GiB left beside b and the domains)."""
    host = PlanHost(inventory(), facts={"host_memory": POOLS})
    holds = (
        asg("a", A, limits=Limits(memory_bytes=10 * GIB)),
        asg("b", B, limits=Limits(memory_bytes=7 * GIB)),
    )
    settled(host, spec(1, *holds))
    host.slices[SLICE] = SliceState(SLICE, True)
    host.facts["domains_committed_bytes"] = GIB
    p = host.plan(spec(2, *holds))
    assert p.empty and p.failures == ()


# --- a kept hold whose atoms change and share one: written over in place (Q-DEV-PASS-01) -----------


def visible(lines: Any) -> set[str]:
    from bcd_shared import cdi

    return set(cdi.visible_device_names(tuple(lines)))


def crash_safe(host: PlanHost, s: DevicesSpec, key: str) -> None:
    """Apply `key`'s steps one by one on copies of `host`: after every prefix (a crash there), the env
    file names no device its CDI hold does not (root's busy check reads the hold, NVIDIA's legacy hook
    the env file), and the pass after converges."""
    from copy import deepcopy

    steps = only_step(host.plan(s).actions, key).steps
    for n in range(len(steps) + 1):
        crashed = deepcopy(host)
        for st in steps[:n]:
            crashed.apply(st)
        alloc = key.split(":", 1)[1]
        doc_env = crashed.specs[alloc]["containerEdits"]["env"]
        held = visible(doc_env)
        if A in held:
            held.add(MIG_A)  # a whole GPU covers its MIG devices
        assert visible(crashed.envs[alloc]) <= held, (n, steps[:n])
        settled(crashed, s)
        assert crashed.plan(s).empty


def test_Q_DEV_PASS_01_a_grown_hold_is_written_over_in_place_hold_first() -> None:
    """Covers Q-DEV-PASS-01: a hold grown from GPU A to A and B shares A: no release, the CDI hold is
    written over first (its atoms then cover what the old env file names), then the env file, then one
    AllocationBound with both atoms at the new generation; the pass after plans nothing, and a crash
    between any two steps converges too."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A)))
    s2 = spec(2, asg("a", A, B))
    crash_safe(host, s2, "rebind:a")
    actions = settled(host, s2)
    assert [(a.key, a.kind, a.after) for a in actions] == [
        ("rebind:a", "rebind", frozenset()),
        ("ledger", "ledger", frozenset()),
    ]
    steps = actions[0].steps
    assert [type(st).__name__ for st in steps] == ["WriteSpec", "WriteEnv", "Emit"]
    assert steps[0] == WriteSpec("a", host.specs["a"]) and steps[-1] == bound("a", 2, A, B)
    assert host.specs["a"]["annotations"]["bcd.dev/generation"] == "2"
    assert host.envs["a"][-1] == f"NVIDIA_VISIBLE_DEVICES={A},{B}"
    assert host.kinds() == ["BoundEvent", "BoundEvent"] and host.ledger == Ledger({"a": 2}, {})


def test_Q_DEV_PASS_01_a_shrunk_hold_is_written_over_in_place_env_file_first() -> None:
    """Covers Q-DEV-PASS-01: shrunk from A and B to A, the env file goes first (it then names only A,
    which the old hold still covers), then the hold; no AllocationReleased (the allocation never stopped
    holding A); a new hold of B in the same pass, listed before it, binds B after it."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A, B)))
    s2 = spec(2, asg("n", B), asg("a", A))
    crash_safe(host, s2, "rebind:a")
    actions = settled(host, s2)
    assert [(a.key, sorted(a.after)) for a in actions] == [
        ("rebind:a", []),
        ("bind:n", ["rebind:a"]),
        ("ledger", []),
    ]
    assert [type(st).__name__ for st in actions[0].steps] == ["WriteEnv", "WriteSpec", "Emit"]
    assert actions[0].steps[-1] == bound("a", 2, A)
    assert host.envs["a"][-1] == f"NVIDIA_VISIBLE_DEVICES={A}"
    assert host.kinds() == ["BoundEvent", "BoundEvent", "BoundEvent"]
    assert host.ledger == Ledger({"a": 2, "n": 2}, {})


def test_Q_DEV_PASS_01_a_hold_that_drops_and_gains_writes_the_shared_atoms_env_first() -> None:
    """Covers Q-DEV-PASS-01: A and B to A and C: the env file first names A only (the atoms both holds
    share), then the hold, then the env file with A and C, so no instant has it name B without a hold
    or C before the hold; a MIG UUID under a whole GPU alike."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A, B)))
    s2 = spec(2, asg("a", A, C))
    crash_safe(host, s2, "rebind:a")
    steps = settled(host, s2)[0].steps
    assert [type(st).__name__ for st in steps] == ["WriteEnv", "WriteSpec", "WriteEnv", "Emit"]
    assert steps[0].lines[-1] == f"NVIDIA_VISIBLE_DEVICES={A}"
    assert steps[2].lines[-1] == f"NVIDIA_VISIBLE_DEVICES={A},{C}"
    mig = f"{A}/gi1/ci0"
    s3 = spec(3, asg("a", mig, D))
    crash_safe(host, s3, "rebind:a")
    steps = settled(host, s3)[0].steps
    assert [type(st).__name__ for st in steps] == ["WriteEnv", "WriteSpec", "WriteEnv", "Emit"]
    assert steps[0].lines[-1] == f"NVIDIA_VISIBLE_DEVICES={MIG_A}"


def test_Q_DEV_PASS_01_DEV_CONF_03_a_hold_grown_into_another_allocations_gpu_is_refused_and_kept() -> None:
    """Covers DEV-CONF-03 for a changed hold: grown into B, which allocation o holds, it is refused
    `overlap` naming o (checked as a new hold), and its old hold stays exactly as it was (its files,
    its ledger entry); one AllocationFailed at that generation. Once the spec releases o, the next
    generation writes it over in place after o's release."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A), asg("o", B)))
    before = (dict(host.specs), dict(host.envs))
    s2 = spec(2, asg("a", A, B), asg("o", B))
    actions = settled(host, s2)
    assert [a.key for a in actions] == ["failures", "ledger"]
    assert actions[0].steps == (
        Emit(FailedEvent("a", "rsv_a", 2, "overlap", f"{B} is assigned to o", (A, B))),
    )
    assert (host.specs, host.envs) == before and host.ledger == Ledger({"a": 1, "o": 1}, {"a": 2})
    actions = settled(host, spec(3, asg("a", A, B)))
    assert [(a.key, sorted(a.after)) for a in actions][:3] == [
        ("release-intent", []),
        ("release:o", ["release-intent"]),
        ("rebind:a", ["release:o"]),
    ]
    assert host.ledger == Ledger({"a": 3}, {})


def test_Q_DEV_PASS_01_two_changed_holds_that_swap_a_gpu_converge_in_one_pass() -> None:
    """Covers Q-DEV-PASS-01: b (C to C and B), listed first, takes the B that a (A and B to A) drops:
    refused on the first try (a still holds B), it is checked again once a passes, and its rebind
    waits for a's. Nothing fails."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A, B), asg("b", C)))
    actions = settled(host, spec(2, asg("b", C, B), asg("a", A)))
    assert [(a.key, sorted(a.after)) for a in actions] == [
        ("rebind:a", []),
        ("rebind:b", ["rebind:a"]),
        ("ledger", []),
    ]
    assert "FailedEvent" not in host.kinds()


def test_Q_DEV_PASS_01_a_sliced_hold_whose_atoms_and_limits_change_gets_its_slice_first() -> None:
    """Covers Q-DEV-PASS-01 with a slice: grown from A to A and B while its limits change, the running
    slice gets the new ones (the dropped properties reset) before the hold is written over; the slice
    is never stopped."""
    host = PlanHost(inventory(), facts={"admission": False})
    settled(host, spec(1, asg("a", A, limits=LIMITS)))
    new = Limits(cpus="0-1", cpu_millis=1000)
    actions = settled(host, spec(2, asg("a", A, B, limits=new)))
    steps = actions[0].steps
    assert [type(st).__name__ for st in steps] == ["ApplySlice", "WriteSpec", "WriteEnv", "Emit"]
    assert steps[0].slice == slice_spec("a", new) and "MemoryMax" in steps[0].reset
    assert host.stopped == [] and steps[-1] == bound("a", 2, A, B, parent=SLICE)


def test_Q_DEV_PASS_04_a_crash_after_a_rebinds_files_sends_its_bound_event_again() -> None:
    """Covers Q-DEV-PASS-04 for a rebind: the files written over and the crash before the event and the
    ledger: the next pass sees the hold kept at the new generation while the ledger has the old one,
    and owes AllocationBound (under the rebind's key)."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A)))
    s2 = spec(2, asg("a", A, B))
    for st in only_step(host.plan(s2).actions, "rebind:a").steps:
        if not isinstance(st, Emit):
            host.apply(st)
    actions = settled(host, s2)
    assert actions[0] == Action("keep:a", "keep", (bound("a", 2, A, B),))


def test_Q_DEV_PASS_01_a_changed_hold_is_admitted_as_new_and_its_booking_counts_after_it() -> None:
    """Covers Q-DEV-PASS-01 with DEV-ADM-04/06: a grown hold's new limits are admitted as a new hold's
    (against the domains' committed memory and the kept holds' bookings), and then count against the
    new holds after it; a refused changed hold keeps its running slice's booking (counted too); with
    host memory unreadable the rebind goes ahead with the warning."""
    mem = lambda gib: Limits(memory_bytes=gib * GIB)  # noqa: E731
    host = PlanHost(inventory(), facts={"host_memory": HOST, "domains_committed_bytes": 2 * GIB})
    settled(host, spec(1, asg("a", A, limits=mem(4)), asg("k", B, limits=mem(4))))
    # 17 GiB normal memory, 2 committed, k's 4: a's 10 fit, n's 2 then do not (1 GiB left).
    p = host.step(
        spec(2, asg("a", A, C, limits=mem(10)), asg("k", B, limits=mem(4)), asg("n", D, limits=mem(2)))
    )
    assert [a.key for a in p.actions][:1] == ["rebind:a"]
    assert p.failures == (
        Failure(
            "n",
            "resources-exhausted",
            "ResourcesExhausted: 2048 MiB of memory needed, 1024 MiB left on this host",
        ),
    )
    refused = PlanHost(inventory(), facts={"host_memory": HOST})
    settled(refused, spec(1, asg("a", A, limits=mem(4)), asg("o", B)))
    # a grows into o's B: refused, its slice keeps 4 GiB, which n (14 GiB of 17) then does not fit beside.
    p = refused.step(spec(2, asg("a", A, B, limits=mem(4)), asg("o", B), asg("n", D, limits=mem(14))))
    assert [(f.allocation_id, f.reason) for f in p.failures] == [
        ("a", "overlap"),
        ("n", "resources-exhausted"),
    ]
    assert (
        p.failures[1].message == "ResourcesExhausted: 14336 MiB of memory needed, 13312 MiB left on this host"
    )
    unread = PlanHost(inventory(), facts={"host_memory": HOST})
    settled(unread, spec(1, asg("a", A, limits=mem(4))))
    unread.facts["host_memory"] = None
    p = unread.step(spec(2, asg("a", A, B, limits=mem(40))))
    assert [a.key for a in p.actions][:1] == ["rebind:a"] and p.warnings == (ADMISSION_UNREADABLE_WARNING,)


def test_Q_DEV_PASS_01_atoms_share_by_roots_rule_a_whole_gpu_and_its_parts() -> None:
    """Covers Q-DEV-PASS-01's "share an atom" (root's `_overlaps`): a slot and its whole GPU share (in
    place, either way), two slots of one GPU do not (released and bound again)."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", f"{C}/s0")))
    assert [a.key for a in settled(host, spec(2, asg("a", C)))][:1] == ["rebind:a"]
    assert [a.key for a in settled(host, spec(3, asg("a", f"{C}/s1")))][:1] == ["rebind:a"]
    keys = [a.key for a in settled(host, spec(4, asg("a", f"{C}/s0")))]
    assert keys[:3] == ["release-intent", "release:a", "bind:a"]
    assert host.kinds()[-2:] == ["ReleasedEvent", "BoundEvent"]


def test_Q_DEV_PASS_01_a_rebind_claims_its_new_atoms_and_frees_only_its_own_old_ones() -> None:
    """Covers Q-DEV-PASS-01 with DEV-CONF-03/04/05: after a is written over (C's slot s0 kept, B
    gained), another allocation's slot of C stays claimed by it (a new hold of that slot, or of all of
    C, is refused naming o), B is a's (a new hold of it names a), a's dropped D is free to a new hold
    that waits for the rebind, and the plan's holders name a's new atoms."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", f"{C}/s0", D), asg("o", f"{C}/s1")))
    s2 = spec(
        2,
        asg("a", f"{C}/s0", B),
        asg("o", f"{C}/s1"),
        asg("n1", f"{C}/s1"),
        asg("n2", C),
        asg("n3", B),
        asg("n4", D),
    )
    p = host.step(s2)
    assert [(f.allocation_id, f.message) for f in p.failures] == [
        ("n1", f"{C}/s1 is assigned to o"),
        ("n2", f"{C} has {C}/s1 assigned to o"),  # the first part of C another holds
        ("n3", f"{B} is assigned to a"),
    ]
    assert [(a.key, sorted(a.after)) for a in p.actions][:2] == [("rebind:a", []), ("bind:n4", ["rebind:a"])]
    assert p.holders == {"a": (f"{C}/s0", B), "o": (f"{C}/s1",), "n4": (D,)}


def test_Q_DEV_PASS_01_a_rebind_waits_only_for_what_frees_its_gpus() -> None:
    """Covers Q-DEV-PASS-01's ordering (`Action.after`): a rebind or bind waits for a rebind only when
    that one's old hold was on one of its GPUs (a dropped slot's GPU too), never for its own orphan
    env file's removal (there is none: a bind rewrites it); a changed hold listed twice is written once
    and its second entry fails `invalid-assignment`."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A, f"{C}/s0"), asg("b", B)))
    host.envs["n"] = ("BCD_ALLOCATION_ID=n", f"NVIDIA_VISIBLE_DEVICES={C}")  # n's, left without its hold
    p = host.step(spec(2, asg("a", A), asg("b", B, D), asg("a", A, B), asg("n", f"{C}/s0")))
    assert [(a.key, sorted(a.after)) for a in p.actions][:3] == [
        ("rebind:a", []),
        ("rebind:b", []),
        ("bind:n", ["rebind:a"]),
    ]
    assert [(f.allocation_id, f.reason) for f in p.failures] == [("a", "invalid-assignment")]


def test_Q_DEV_PASS_01_a_hold_that_becomes_sliced_starts_its_slice_before_it_names_it() -> None:
    """Covers Q-DEV-PASS-01 with DEV-SLICE: a plain hold grown into a sliced one starts its slice first
    (root writes a sliced hold only once its slice runs)."""
    host = PlanHost(inventory(), facts={"admission": False})
    settled(host, spec(1, asg("a", A)))
    new = Limits(cpus="0-1", cpu_millis=1000)
    steps = settled(host, spec(2, asg("a", A, B, limits=new)))[0].steps
    assert steps[0] == ApplySlice(slice_spec("a", new))
    assert [type(st).__name__ for st in steps[1:]] == ["WriteSpec", "WriteEnv", "Emit"]


# --- releases across a crash (docs/devices.md, "Releases across a crash") ----------------------------


def crash_after(host: PlanHost, p: Any, steps: int) -> None:
    """Apply the first `steps` steps of plan `p`, in order, then stop (the process died there)."""
    flat = [s for a in p.actions for s in a.steps]
    for s in flat[:steps]:
        host.apply(s)


def test_Q_DEV_PASS_04_a_plain_release_is_reported_once_whatever_step_a_crash_stops_it_at() -> None:
    """The release of a (its GPU moved to b) is recorded in the ledger before its removals, and its
    event is keyed in the journal. Stopped after any number of the pass's steps, the next pass
    (settled) leaves exactly one AllocationReleased of a at generation 2, before b's AllocationBound,
    a's files gone, no release recorded and no key remembered."""
    s2 = spec(2, asg("b", A))
    first = PlanHost(inventory())
    settled(first, spec(1, asg("a", A)))
    total = len([s for a in first.plan(s2).actions for s in a.steps])
    assert total == 9  # intent; spec, env, event; slice-less bind: spec, env, event; ledger, keys
    for n in range(total + 1):
        host = PlanHost(inventory())
        settled(host, spec(1, asg("a", A)))
        crash_after(host, host.plan(s2), n)
        settled(host, s2)
        events = [e for e in host.events if isinstance(e, ReleasedEvent)]
        assert events == [ReleasedEvent("a", "rsv_a", 2, (A,), False)], n
        kinds = [(type(e).__name__, e.allocation_id) for e in host.events]
        assert kinds.index(("ReleasedEvent", "a")) < kinds.index(("BoundEvent", "b")), n
        assert "a" not in host.specs and "a" not in host.envs, n
        assert host.ledger.releasing == {} and host.keys == set(), n


def test_a_release_recorded_but_not_begun_is_dropped_when_its_hold_is_wanted_again() -> None:
    """The intent is written, then a crash before the spec's removal: the hold on disk is the one
    the record released, so nothing was removed and nothing is owed; generation 3 wants a again,
    and the record is dropped without an event."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A)))
    crash_after(host, host.plan(spec(2)), 1)
    assert set(host.ledger.releasing) == {key("a", 2)}
    actions = settled(host, spec(3, asg("a", A)))
    assert actions == (ledger({"a": 1}),)
    assert host.kinds() == ["BoundEvent"] and host.ledger.releasing == {}


def test_a_release_finished_before_a_new_bind_of_the_allocation_is_not_sent_again() -> None:
    """a's release at 2 (GPU A) finished by the pass at 3 that binds a on GPU B, which stops after
    the bind (the ledger not yet written): the hold on disk is not the one released, so the record
    is finished again, but its key makes the event a no-op; the AllocationReleased stays single and
    before the bind's AllocationBound. The ledger never recorded the AllocationBound, so the kept hold
    owes it, after the release (`after`); its key, remembered since the crash, makes it a no-op too
    (Q-DEV-EVT-02), and the ledger's write forgets both keys."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A)))
    crash_after(host, host.plan(spec(2)), 2)  # intent, spec removed
    p3 = host.plan(spec(3, asg("a", B)))
    assert [(a.key, sorted(a.after)) for a in p3.actions][:2] == [
        ("release-done:a", []),
        ("bind:a", ["release-done:a"]),
    ]
    assert p3.actions[0].steps == (released("a", 2, A),)  # a's env file is left to the bind
    crash_after(host, p3, 4)  # the event, the bind's spec, env, event; not the ledger
    assert host.specs["a"] and host.ledger.releasing
    again = settled(host, spec(3, asg("a", B)))
    assert [(a.key, sorted(a.after)) for a in again] == [
        ("release-done:a", []),
        ("keep:a", ["release-done:a"]),
        ("ledger", []),
    ]
    assert again[1].steps == (bound("a", 3, B),)
    assert again[2] == ledger({"a": 3}, forget=(bkey("a", 3), key("a", 2)))
    assert [(type(e).__name__, e.generation) for e in host.events] == [
        ("BoundEvent", 1),
        ("ReleasedEvent", 2),
        ("BoundEvent", 3),
    ]
    assert host.keys == set()


def test_a_kubernetes_release_reported_then_stopped_before_its_record_goes_is_not_reported_twice() -> None:
    """DEV-K8S-08's report is keyed too: journaled, then a crash before releasing.json drops the
    pending release; the next pass reports it again, which journals nothing."""
    host = PlanHost(inventory(), facts={"pods_holding": {"k": True}})
    settled(host, spec(1, asg("k", A, binding=KUBE)))
    host.step(spec(2))
    host.facts["pods_holding"] = {"k": False}
    crash_after(host, host.plan(spec(2)), 1)  # the event, not WriteReleases
    assert len(host.releases) == 1 and host.keys == {key("k", 2)}
    settled(host, spec(2))
    assert host.kinds() == ["BoundEvent", "ReleasedEvent"] and host.keys == set()


def test_a_key_left_by_a_crash_after_the_ledger_is_forgotten_by_the_next_pass() -> None:
    """A key the journal remembers for no release under way (a crash between the ledger's write
    and the keys' removal) is forgotten first thing in the next pass; a key a recorded release or a
    pending Kubernetes release still needs is kept."""
    host = PlanHost(inventory(), facts={"pods_holding": {"k": True}})
    settled(host, spec(1, asg("k", A, binding=KUBE)))
    host.step(spec(2))
    host.keys |= {key("z", 1), key("k", 2)}
    actions = settled(host, spec(2))
    assert actions == (Action("forget-keys", "keys", (ForgetEventKeys((key("z", 1),)),)),)
    assert host.keys == {key("k", 2)}
    # First thing, before anything the pass emits.
    host.keys.add(key("y", 1))
    actions = settled(host, spec(3, asg("b", B)))
    assert [a.key for a in actions] == ["forget-keys", "bind:b", "ledger"]


def test_each_recorded_release_is_settled_on_its_own() -> None:
    """Two recorded releases: a's hold is still on disk as released (dropped, then released afresh),
    b's spec is gone (finished: its env file removed, its event sent); the first being dropped does
    not stop the look at the next. One AllocationReleased each."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A), asg("b", B)))
    p2 = host.plan(spec(2))
    assert p2.actions[0].key == "release-intent" and p2.actions[2].key == "release:b"
    host.apply(p2.actions[0].steps[0])  # both recorded
    host.apply(p2.actions[2].steps[0])  # b's spec removed; then the crash
    actions = settled(host, spec(2))
    assert [(a.key, sorted(a.after)) for a in actions][:3] == [
        ("release-intent", []),
        ("release-done:b", []),
        ("release:a", ["release-intent"]),
    ]
    assert actions[1].steps == (RemoveEnv("b"), released("b", 2, B))
    assert sorted((e.allocation_id, e.generation) for e in host.events if isinstance(e, ReleasedEvent)) == [
        ("a", 2),
        ("b", 2),
    ]


def test_a_hold_bound_again_after_an_unfinished_release_is_released_after_it() -> None:
    """c's release at 2 stops after its spec's removal; 3 binds c on D (the old release finished first)
    and stops before its ledger; 4 moves c to B. The old record is kept beside the new one in the
    intent's ledger, the new release and the new bind both wait for the old release's action, and
    the bind for the new release too. Every release of c is sent once, each before the next bind."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("c", C)))
    crash_after(host, host.plan(spec(2)), 2)
    p3 = host.plan(spec(3, asg("c", D)))
    assert [a.key for a in p3.actions] == ["release-done:c", "bind:c", "ledger"]
    crash_after(host, p3, 4)  # the old event; the bind's spec, env and event; not the ledger
    p4 = host.plan(spec(4, asg("c", B)))
    got = {a.key: a for a in p4.actions}
    intent_ledger = got["release-intent"].steps[0].ledger
    assert set(intent_ledger.releasing) == {key("c", 2), key("c", 4)}
    assert got["release:c"].after == frozenset({"release-intent", "release-done:c"})
    assert got["bind:c"].after == frozenset({"release:c", "release-done:c"})
    settled(host, spec(4, asg("c", B)))
    order = [(type(e).__name__, e.generation) for e in host.events]
    assert order == [
        ("BoundEvent", 1),
        ("ReleasedEvent", 2),
        ("BoundEvent", 3),
        ("ReleasedEvent", 4),
        ("BoundEvent", 4),
    ]
    assert host.ledger.releasing == {} and host.keys == set()


# --- AllocationBound across a crash (Q-DEV-EVT-02) -----------------------------------------------------


def two_gpus(alloc: str) -> DeviceAssignment:
    return asg(alloc, A, B)


BIND_CRASHES: dict[str, tuple[tuple[DeviceAssignment, ...], DevicesSpec, list[tuple[str, str, int]]]] = {
    # name: (what generation 1 holds, generation 2, every report after it, in order)
    "a bind": ((), spec(2, asg("b", B)), [("BoundEvent", "b", 2)]),
    "a bind on a released GPU": (
        (asg("a", A),),
        spec(2, asg("b", A)),
        [("BoundEvent", "a", 1), ("ReleasedEvent", "a", 2), ("BoundEvent", "b", 2)],
    ),
    "the same allocation moved": (
        (asg("a", A),),
        spec(2, asg("a", B)),
        [("BoundEvent", "a", 1), ("ReleasedEvent", "a", 2), ("BoundEvent", "a", 2)],
    ),
    "a rebind": ((asg("a", A),), spec(2, two_gpus("a")), [("BoundEvent", "a", 1), ("BoundEvent", "a", 2)]),
}


@pytest.mark.parametrize("case", list(BIND_CRASHES))
def test_Q_DEV_EVT_02_an_allocation_bound_is_reported_once_whatever_step_a_crash_stops_it_at(
    case: str,
) -> None:
    """Q-DEV-EVT-02 / Q-DEV-PASS-04 for AllocationBound: every AllocationBound is keyed by allocation and
    generation. Stopped after any number of the pass's steps (the event journaled, the ledger not
    yet written included), the next pass (settled) leaves each report exactly once, each release
    before the next bind of its allocation, and no key remembered. A rebind's key (the new
    generation) is not its first bind's."""
    held, s2, reports = BIND_CRASHES[case]
    first = PlanHost(inventory())
    settled(first, spec(1, *held))
    total = len([s for a in first.plan(s2).actions for s in a.steps])
    for n in range(total + 1):
        host = PlanHost(inventory())
        settled(host, spec(1, *held))
        crash_after(host, host.plan(s2), n)
        settled(host, s2)
        assert [(type(e).__name__, e.allocation_id, e.generation) for e in host.events] == reports, n
        assert host.keys == set() and host.ledger.releasing == {}, n


def test_Q_DEV_EVT_02_a_bound_key_is_kept_while_its_hold_stands_unrecorded_and_dropped_with_it() -> None:
    """a's AllocationBound at 1 is journaled and the ledger never records it. While a's hold at 1 stands
    unrecorded its key is kept (a pass that neither keeps it nor removes it, here one that refuses its
    new atoms, forgets nothing); a pass that removes the hold forgets the key in the release itself
    (after the removals); a rebind forgets it once the new hold is written, before its own event."""
    for how in ("release", "rebind"):
        host = PlanHost(inventory())
        settled(host, spec(1, asg("o", B)))
        crash_after(host, host.plan(spec(1, asg("o", B), asg("a", A))), 3)  # spec, env, event
        assert host.keys == {bkey("a", 1)} and host.ledger.bound == {"o": 1}
        refused = settled(host, spec(2, asg("a", A, B), asg("o", B)))  # grown into o's GPU: refused
        assert [a.key for a in refused] == ["failures", "ledger"] and host.keys == {bkey("a", 1)}
        if how == "release":
            actions = settled(host, spec(3, asg("o", B)))
            assert only_step(actions, "release:a").steps == (
                RemoveSpec("a"),
                RemoveEnv("a"),
                released("a", 3, A),
                ForgetEventKeys((bkey("a", 1),)),
            )
        else:
            actions = settled(host, spec(3, asg("a", A, C), asg("o", B)))
            steps = only_step(actions, "rebind:a").steps
            assert steps[-2:] == (ForgetEventKeys((bkey("a", 1),)), bound("a", 3, A, C))
        assert host.keys == set()
        assert [
            (type(e).__name__, e.allocation_id, e.generation) for e in host.events if e.allocation_id == "a"
        ] == [
            ("BoundEvent", "a", 1),
            ("FailedEvent", "a", 2),
            ("ReleasedEvent" if how == "release" else "BoundEvent", "a", 3),
        ]


def test_Q_DEV_EVT_02_a_bound_key_whose_hold_is_gone_does_not_hold_back_a_new_bind() -> None:
    """A key remembered for a hold no longer on disk (its files lost after the crash that left the key)
    is stale: forgotten first thing, and the bind under the same key waits for that, so the new bind's
    AllocationBound is journaled, not taken for a re-send."""
    host = PlanHost(inventory())
    crash_after(host, host.plan(spec(1, asg("a", A))), 3)  # spec, env, event; not the ledger
    assert host.keys == {bkey("a", 1)}
    host.specs.clear()
    host.envs.clear()
    actions = settled(host, spec(1, asg("a", A)))
    assert [(a.key, sorted(a.after)) for a in actions] == [
        ("forget-keys", []),
        ("bind:a", ["forget-keys"]),
        ("ledger", []),
    ]
    assert actions[0].steps == (ForgetEventKeys((bkey("a", 1),)),)
    assert host.kinds() == ["BoundEvent", "BoundEvent"] and host.keys == set()


@pytest.mark.parametrize("how", ["bind", "rebind"])
def test_Q_DEV_EVT_02_a_bind_or_rebind_under_a_stale_key_waits_for_it_and_for_its_gpus(how: str) -> None:
    """A bound key the journal remembers for no hold on disk at its generation (stale, however it was
    left: here a's key at 2 while a holds nothing, or its hold at 1) is forgotten first thing; a bind
    or a rebind under that key waits for the forgetting as well as for the release of the hold on its
    GPU (o's, on B), so its AllocationBound is journaled, once, after o's AllocationReleased."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("o", B), *((asg("a", A),) if how == "rebind" else ())))
    host.keys.add(bkey("a", 2))
    s2 = spec(2, asg("a", A, B))  # o released, B given to a
    actions = host.plan(s2).actions
    assert [(x.key, sorted(x.after)) for x in actions] == [
        ("forget-keys", []),
        ("release-intent", []),
        ("release:o", ["release-intent"]),
        (f"{how}:a", ["forget-keys", "release:o"]),
        ("ledger", []),
    ]
    assert actions[0].steps == (ForgetEventKeys((bkey("a", 2),)),)
    assert only_step(actions, f"{how}:a").steps[-1] == bound("a", 2, A, B)
    settled(host, s2)
    assert [(type(e).__name__, e.allocation_id, e.generation) for e in host.events][-2:] == [
        ("ReleasedEvent", "o", 2),
        ("BoundEvent", "a", 2),
    ]
    assert host.keys == set()


def test_Q_DEV_EVT_02_a_rebind_of_an_allocation_whose_release_is_unfinished_waits_for_it() -> None:
    """a's release at 2 stopped once its spec was removed; the pass at 3 journaled its AllocationReleased
    and wrote a's new hold on B, then stopped too, the ledger still recording the release. At 4 a grows
    to B and C: its hold is written over in place, and that rebind waits for the release to be finished
    (`release-done:a`: a's AllocationReleased before its AllocationBound). Each report is sent once."""
    host = PlanHost(inventory())
    settled(host, spec(1, asg("a", A)))
    crash_after(host, host.plan(spec(2)), 2)  # the release's intent, a's spec removed
    crash_after(host, host.plan(spec(3, asg("a", B))), 3)  # a's AllocationReleased, a's new spec and env
    s4 = spec(4, asg("a", B, C))
    actions = host.plan(s4).actions
    assert [(x.key, sorted(x.after)) for x in actions] == [
        ("release-done:a", []),
        ("rebind:a", ["release-done:a"]),
        ("ledger", []),
    ]
    settled(host, s4)
    assert [(type(e).__name__, e.allocation_id, e.generation) for e in host.events] == [
        ("BoundEvent", "a", 1),
        ("ReleasedEvent", "a", 2),
        ("BoundEvent", "a", 4),
    ]
    assert host.keys == set()
