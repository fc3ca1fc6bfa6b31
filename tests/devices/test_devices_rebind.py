"""A kept hold whose atoms change and share one, on the no-helper path: `bcd node` as root (the real
section, applier and DirectExecutor over the simulated host). The planner's exact plans are in
test_devices_plan_passes.py; the same passes through a real helper with roots are
tests/helper/test_hostile_round6.py::test_round6_a_kept_hold_that_grows_or_shrinks_converges_written_over_in_place.
"""

from __future__ import annotations

import json

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.devices.model import BINDING_HOLD, DeviceAssignment, DeviceRef, DevicesSpec
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import Host


def _spec(generation: int, *gpus: str) -> DevicesSpec:
    refs = tuple(DeviceRef(g, "gpu") for g in gpus)
    return DevicesSpec(generation, (DeviceAssignment("a", "rsv_a", BINDING_HOLD, refs),))


def test_Q_DEV_PASS_01_grow_and_shrink_are_written_over_in_place_as_root(host: Host) -> None:
    """Covers Q-DEV-PASS-01 as root: grown from GPU 1 to GPUs 1 and 2, then shrunk back, each pass
    writes the hold and env file over in place (atomic renames; nothing removed), converges, and sends
    one AllocationBound with the new atoms (no AllocationReleased); the pass after plans nothing."""
    g1, g2 = gpu_uuid(0), gpu_uuid(1)
    assert host.run(_spec(1, g1)).state is SectionState.CONVERGED
    for generation, gpus in ((2, (g1, g2)), (3, (g1,))):
        p = host.section.plan(_spec(generation, *gpus), generation)
        assert [a.key for a in p.actions] == ["rebind:a", "ledger"]
        assert host.run(_spec(generation, *gpus)).state is SectionState.CONVERGED
        doc = json.loads(host.path("/etc/cdi/bcd-a.json").read_text())
        assert [d["annotations"]["bcd.dev/device-id"] for d in doc["devices"]] == list(gpus)
        assert doc["annotations"]["bcd.dev/generation"] == str(generation)
        env = host.path("/run/bcd/allocations/a.env").read_text().splitlines()
        assert f"NVIDIA_VISIBLE_DEVICES={','.join(gpus)}" in env
        assert host.section.plan(_spec(generation, *gpus), generation).empty
        last = host.events()[-1]
        assert (type(last).__name__, last.device_ids, last.generation) == ("BoundEvent", gpus, generation)
    assert [type(e).__name__ for e in host.events()] == ["BoundEvent"] * 3


def test_bcd_plan_lists_a_rebind_as_a_bind_and_no_release(host: Host) -> None:
    """`bcd plan`'s `binds` / `releases` (bcd_agent.plan.device_changes): a hold written over in place is
    listed as a bind of its new atoms, and nothing is listed as released."""
    from bcd_agent.plan import device_changes

    g1, g2 = gpu_uuid(0), gpu_uuid(1)
    assert host.run(_spec(1, g1)).state is SectionState.CONVERGED
    assert device_changes(host.section.plan(_spec(2, g1, g2), 2)) == ((f"a: {g1}, {g2}",), ())
