"""Devices requirements the other files exercise without naming: a hold without limits, the class
default, extra env lines, the /etc/cdi/bcd-*.json listing, and holds kept across passes."""

from __future__ import annotations

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.devices.model import BINDING_HOLD, DeviceAssignment, DeviceRef, DevicesSpec
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import Host, systemctl_calls

G0, G2 = gpu_uuid(0), gpu_uuid(2)


def test_DEV_ASG_07_09_10_hold_without_limits_default_class_and_extra_env(host: Host) -> None:
    """Covers DEV-ASG-07, DEV-ASG-09, DEV-ASG-10, DEV-SLICE-05, DLV-DEV-41: an empty device_class is a
    `gpu`; no limits means no slice, no systemctl call and no cgroup parent; each env entry is one more
    line of the env file, after bcd's own lines and in the assignment's order (DEV-ENV-04)."""
    a = DeviceAssignment("a1", "r1", BINDING_HOLD, (DeviceRef(G0, ""),), None, ("X=1", "FOO=bar"))
    assert host.run(DevicesSpec(1, (a,))).state is SectionState.CONVERGED
    assert systemctl_calls(host.root) == []
    lines = host.path("/run/bcd/allocations/a1.env").read_text().splitlines()
    assert lines == [
        "BCD_ALLOCATION_ID=a1",
        "BCD_RESERVATION_ID=r1",
        f"NVIDIA_VISIBLE_DEVICES={G0}",
        "X=1",
        "FOO=bar",
    ]
    assert not any(line.startswith("BCD_CGROUP_PARENT=") for line in lines)
    spec = host.path("/etc/cdi/bcd-a1.json").read_text()
    assert "bcd.dev/cgroup-parent" not in spec and "BCD_CGROUP_PARENT" not in spec
    [bound] = host.events("BoundEvent")
    assert bound.cgroup_parent == ""  # type: ignore[attr-defined]


def test_DEV_SEE_02_cdi_dir_lists_exactly_the_live_holds(host: Host) -> None:
    """Covers DEV-SEE-02, DEV-SEE-03: /etc/cdi/bcd-*.json and /run/bcd/allocations/ follow the live
    holds as they come and go."""

    def listed() -> tuple[list[str], list[str]]:
        cdi = sorted(p.name for p in host.path("/etc/cdi").glob("bcd-*.json"))
        env = sorted(p.name for p in host.path("/run/bcd/allocations").iterdir())
        return cdi, env

    h = [DeviceAssignment(f"a{i}", "r", BINDING_HOLD, (DeviceRef(g, "gpu"),)) for i, g in ((1, G0), (2, G2))]
    host.run(DevicesSpec(1, tuple(h)))
    assert listed() == (["bcd-a1.json", "bcd-a2.json"], ["a1.env", "a2.env"])
    host.run(DevicesSpec(2, (h[1],)))
    assert listed() == (["bcd-a2.json"], ["a2.env"])
    host.run(DevicesSpec(3, ()))
    assert listed() == ([], [])


def test_DEV_ASG_12_holds_are_kept_until_the_spec_drops_them(host: Host) -> None:
    """Covers DEV-ASG-12, DLV-DEV-08, DEV-PASS-01: pass after pass (drift passes, a restarted agent) on
    the same spec, bcd releases nothing and re-sends nothing; only a spec without the hold releases it."""
    spec = DevicesSpec(1, (DeviceAssignment("a1", "r", BINDING_HOLD, (DeviceRef(G0, "gpu"),)),))
    for _ in range(3):
        assert host.run(spec).state is SectionState.CONVERGED
    host.restart()
    host.run(spec)
    assert [type(e).__name__ for e in host.events()] == ["BoundEvent"]
    assert host.path("/etc/cdi/bcd-a1.json").exists()
    host.run(DevicesSpec(2, ()))
    assert [type(e).__name__ for e in host.events()] == ["BoundEvent", "ReleasedEvent"]
