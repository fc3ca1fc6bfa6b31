"""Device ownership of a hold (Q-DLV-DEV-01, Q-DEV-BIND-01; docs/devices.md).

"Ownership" is the hold's CDI spec itself: `bcd.dev/allocation-id` on the spec and each device's
`bcd.dev/device-id`, read back on every pass. bcd writes no separate record and changes no device
node's owner or mode.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.devices.model import BINDING_HOLD, DeviceAssignment, DeviceRef, DevicesSpec
from bcd_shared.cdi import parse_hold_spec
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import DATA_DIR, Host

G0, G1 = gpu_uuid(0), gpu_uuid(1)
# What a bind writes: the hold's files, the agent's records, the slice (cgroupfs) and the simulated
# systemd's own bookkeeping. Anything else changing would be a second ownership record.
BIND_WRITES = (
    "etc/cdi/bcd-",
    "run/bcd/allocations/",
    DATA_DIR.lstrip("/"),
    "sys/fs/cgroup/",
    "var/lib/bcd-sim/",
)


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """path -> (mode, uid, gid) of everything under the simulated root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid)
    return out


def test_DLV_DEV_03_ownership_is_the_cdi_spec(host: Host) -> None:
    """Covers DLV-DEV-03, DLV-DEV-10 (Q-DLV-DEV-01, Q-DEV-BIND-01)."""
    before = _tree(host.root)
    a = DeviceAssignment(
        "a1", "rsv_a1", BINDING_HOLD, (DeviceRef(G0, "gpu"), DeviceRef(f"{G1}/s2", "gpu.slot"))
    )
    assert host.run(DevicesSpec(4, (a,))).state is SectionState.CONVERGED
    after = _tree(host.root)
    changed = {p for p in after if before.get(p) != after[p]} | {p for p in before if p not in after}
    assert changed and all(p.startswith(BIND_WRITES) for p in changed), sorted(changed)
    assert "etc/cdi/bcd-a1.json" in changed and "run/bcd/allocations/a1.env" in changed
    # The owner of each device, read back from the spec alone.
    record = parse_hold_spec(host.path("/etc/cdi/bcd-a1.json").read_bytes(), "a1")
    assert (record.allocation_id, record.device_ids, record.generation) == ("a1", (G0, f"{G1}/s2"), 4)
    # A new process sees the same owner: the next spec that gives G0 to another allocation while a1
    # keeps it is refused naming a1, from the files alone.
    host.restart()
    b = DeviceAssignment("b2", "rsv_b2", BINDING_HOLD, (DeviceRef(G0, "gpu"),))
    out = host.run(DevicesSpec(5, (a, b)))
    assert out.state is SectionState.FAILED and out.message == f"b2: {G0} is assigned to a1"
    # Editing the device (name and annotation) moves ownership: the hold is read as holding G1's slot 3
    # instead, so the spec's s2 is bound again (released and re-bound in the same pass).
    path = host.path("/etc/cdi/bcd-a1.json")
    doc = json.loads(path.read_text())
    doc["devices"][1]["name"] = f"{G1}_s3"
    doc["devices"][1]["annotations"]["bcd.dev/device-id"] = f"{G1}/s3"
    path.write_text(json.dumps(doc))
    host.restart()
    keys = [act.key for act in host.section.plan(DevicesSpec(4, (a,)), 4).actions]
    assert keys[:3] == ["release-intent", "release:a1", "bind:a1"]
