"""Volumes under the helper: the node's store, a domain attaching one defined through root's
`libvirt.define` (its default-deny check and host re-check accept a raw volume under data_dir/volumes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.instances.model import InstancesSpec, Nic
from bcd_agent.sections.instances.volumes import GIB, VolumeSpec, VolumeStore
from bcd_simhost import sim_system
from helperproc import HelperProcess, base_config, make_root

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from instkit import converge, helper_section, vm

DATA = "/var/lib/bcd"


def test_a_volume_attached_through_root_dlv_vol_13(tmp_path: Path) -> None:
    """DLV-VOL-13, DLV-PRIV-05: root defines the domain with the raw volume (read-write 0660, read-only
    0640 for QEMU's group); a volume the check refuses would fail the define."""
    root = make_root(tmp_path)
    proc = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    try:
        system = sim_system(root)
        sec, _rt = helper_section(
            system, proc.client, volumes=VolumeStore(str(system.host_path(f"{DATA}/volumes")))
        )
        inst = vm(
            "v",
            nics=(Nic("br0", "52:54:00:00:02:01", ("10.0.2.1/24",)),),
            volumes=(("rw", False), ("ro", True)),
        )
        spec = InstancesSpec(1, (inst,), (VolumeSpec("rw", "rw-1", GIB), VolumeSpec("ro", "ro-1", GIB)))
        out = converge(sec, spec)
        assert out.state is SectionState.CONVERGED, out.message
        vols = root / DATA.lstrip("/") / "volumes"
        assert (os.stat(vols / "rw.raw").st_mode & 0o777, os.stat(vols / "ro.raw").st_mode & 0o777) == (
            0o660,
            0o640,
        )
        ops = [e["op"] for e in proc.audit_lines() if e["decision"] == "accepted"]
        assert "libvirt.define" in ops and "libvirt.start" in ops
    finally:
        proc.stop()
