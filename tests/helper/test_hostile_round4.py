"""The gaps round 3 left open (docs/helper.md, "Threat model, round 3", "Found and not closed"), closed and
tried as the hostile node: a real unprivileged account (SO_PEERCRED sees the node's uid) against a real
`bcd helper serve` over a simulated host. Each test failed on the code before its fix."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bcd_shared.chunit import VMM_UID_BASE as VMM_UID
from bcd_simhost import sim_system
from helperproc import HelperProcess, base_config, make_root
from hostilekit import NODE_UID
from test_hostile_round3 import _as_node, _refused_as_node


def _by_bus(root: Path) -> dict[str, str]:
    """The simulated nvidia-smi's GPUs: sysfs address -> UUID."""
    out = sim_system(root).run(["nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"])
    return {
        b.strip()[-12:].lower(): u.strip()
        for u, b in (x.split(",") for x in out.stdout.decode().splitlines())
    }


def test_round4_ch_vfio_hands_over_only_the_signed_specs_gpus() -> None:
    """With command-signing roots, `ch.vfio` took only the instance's name: root bound whatever GPUs the
    node's vm.json named to vfio-pci and handed their /dev/vfio groups to its VMM uid, whatever the
    signed spec said. It now takes the signed spec as ch.launch does: without one `intent-required`; a
    spec that gives the instance another GPU `spec-mismatch`, one that does not name it `not-in-spec`,
    an older generation `stale-generation`; each before any driver or group is touched. The spec's own
    GPU is bound and handed over."""
    from bcd_shared import wire
    from bcd_simhost.chapi import CH_BASE_SHA256, lay_out_instance
    from bcd_simhost.pcisim import lay_out_pci
    from intentkit import ControlPlane, intent

    gpu0, gpu1 = "0000:18:00.0", "0000:2a:00.0"
    cp = ControlPlane.build()
    parent = Path(tempfile.mkdtemp(prefix="bcd-r4-", dir="/var/tmp"))
    root = make_root(parent)
    cp.write_record(root, "node-r4", cp.bundle(1))
    lay_out_pci(root, [(gpu0, "0x030200", 10, "nvidia"), (gpu1, "0x030200", 11, "nvidia")])
    uid = VMM_UID + 5
    lay_out_instance(root, "vm5", NODE_UID, uid, gpus=(gpu1,))
    h = HelperProcess(root, cp.config_lines() + base_config(extra='instance_bridges = "br0"\n'))
    by_bus = _by_bus(root)

    def vfio(generation: int, gpu: str, name: str = "vm5") -> dict[str, Any]:
        inst = wire.InstanceSpec(
            id=name, allocation_id=f"alloc-{name}", runtime="cloud-hypervisor",
            desired_state=wire.InstanceDesiredState(1),
            size=wire.InstanceSize(vcpus=2, memory_bytes=1 << 30, disk_bytes=10 << 30),
            image=wire.ImageRef(url="https://x.invalid/x.qcow2", sha256=CH_BASE_SHA256, format="qcow2"),
            nics=[wire.Nic(bridge="br0", mac="52:54:00:00:00:01")], gpu_uuids=[gpu],
        )  # fmt: skip
        full = wire.NodeSpec(instances=wire.InstancesSection(instances=[inst]))
        body = wire.DesiredStateBody(node_id="node-r4", generation=generation, spec_hash="h", full=full)
        return {"op": "ch.vfio", "args": {"name": "vm5", "intent": intent(cp.command.leaf(), bytes(body))}}

    def untouched() -> None:
        drivers = [
            os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{g}/driver")) for g in (gpu0, gpu1)
        ]
        assert drivers == ["nvidia", "nvidia"]
        for g in ("10", "11"):  # the simulated kernel makes the node at the bind; root's until handed over
            assert not (root / f"dev/vfio/{g}").exists() or os.stat(root / f"dev/vfio/{g}").st_uid == 0

    try:
        _refused_as_node(h, {"op": "ch.vfio", "args": {"name": "vm5"}}, "intent-required")
        untouched()
        _refused_as_node(h, vfio(2, by_bus[gpu0]), "spec-mismatch", "GPUs")
        untouched()
        _refused_as_node(h, vfio(2, by_bus[gpu1], name="vm6"), "not-in-spec")
        answer = _as_node(h, vfio(2, by_bus[gpu1]))
        assert answer["ok"] is True and answer["result"]["groups"] == ["11"], answer
        assert os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{gpu1}/driver")) == "vfio-pci"
        assert os.stat(root / "dev/vfio/11").st_uid == uid
        assert os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{gpu0}/driver")) == "nvidia"
        assert _as_node(h, {"op": "ch.unvfio", "args": {"name": "vm5"}})["ok"] is True
        untouched()
        _refused_as_node(h, vfio(1, by_bus[gpu1]), "stale-generation")  # generation 2 was accepted
        untouched()
    finally:
        h.stop()
        shutil.rmtree(parent, ignore_errors=True)
