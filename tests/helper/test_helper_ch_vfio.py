"""ch.vfio, ch.unvfio and ch.stop's hand-back of VFIO groups, on the simulated host: a sysfs shaped like
the kernel's (bcd_simhost.pcisim: devices, IOMMU groups, drivers; the simulated `tee` binds as the
kernel does for driver_override, unbind and drivers_probe), the simulated nvidia-smi's GPUs, and a
real helper process. Root decides who holds a group from /dev/vfio itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_shared.chunit import VMM_UID_BASE
from bcd_simhost.chapi import lay_out_instance
from bcd_simhost.gpus import update_state
from bcd_simhost.pcisim import lay_out_pci
from helperproc import HelperProcess, assert_refused, base_config, make_root

GPU = "0000:18:00.0"  # the simulated nvidia-smi's GPU 0 (bus 0x18)
AUDIO = "0000:18:00.1"
BRIDGE = "0000:17:00.0"
GPU1 = "0000:2a:00.0"  # GPU 1, sharing its group with a NIC
NIC = "0000:2b:00.0"
UID1, UID2 = VMM_UID_BASE + 1, VMM_UID_BASE + 2


@pytest.fixture(scope="module")
def vf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelperProcess]:
    root = make_root(tmp_path_factory.mktemp("chvfio"))
    lay_out_pci(
        root,
        [
            (GPU, "0x030200", 10, "nvidia"),
            (AUDIO, "0x040300", 10, "snd_hda_intel"),
            (BRIDGE, "0x060400", 10, "pcieport"),
            (GPU1, "0x030200", 11, "nvidia"),
            (NIC, "0x020000", 11, "ixgbe"),
        ],
    )
    lay_out_instance(root, "vm1", 4242, UID1, gpus=(GPU,))
    lay_out_instance(root, "vm2", 4242, UID2, gpus=(GPU,))
    lay_out_instance(root, "vm3", 4242, VMM_UID_BASE + 3, gpus=(GPU1,))
    proc = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    yield proc
    proc.stop()


def _driver(h: HelperProcess, addr: str) -> str:
    return os.path.basename(os.readlink(h.root / f"sys/bus/pci/devices/{addr}/driver"))


def _node(h: HelperProcess, group: str) -> os.stat_result:
    return os.stat(h.root / f"dev/vfio/{group}")


def test_vfio_binds_the_group_and_hands_the_node_dlv_chh_12_dlv_ch_19(vf: HelperProcess) -> None:
    """DLV-CHH-12, DLV-CHH-11, DLV-CH-18, DLV-CH-19: every endpoint of the GPU's group (its audio
    function too) moves to vfio-pci, the bridge stays on pcieport, /dev/vfio/10 is the VMM user's 0600;
    then, with that VMM's unit running, another instance cannot take the group (DLV-CHH-10) nor can
    ch.unvfio give it back (DLV-CHH-13); ch.stop gives back exactly its groups (DLV-CHH-14, DLV-CHH-15,
    DLV-CH-22)
    and ch.unvfio returns the devices to their host drivers."""
    h = vf
    answer = h.raw({"op": "ch.vfio", "args": {"name": "vm1"}})
    assert answer["ok"] is True and answer["result"]["groups"] == ["10"], answer
    assert (_driver(h, GPU), _driver(h, AUDIO), _driver(h, BRIDGE)) == ("vfio-pci", "vfio-pci", "pcieport")
    st = _node(h, "10")
    assert (st.st_uid, st.st_mode & 0o777) == (UID1, 0o600)
    assert h.raw({"op": "ch.launch", "args": {"name": "vm1"}})["ok"] is True
    try:
        assert_refused(h, {"op": "ch.vfio", "args": {"name": "vm2"}}, "group-in-use")
        assert_refused(h, {"op": "ch.unvfio", "args": {"name": "vm1"}}, "group-in-use")
    finally:
        stopped = h.raw({"op": "ch.stop", "args": {"name": "vm1"}})
    assert stopped["ok"] is True and stopped["result"]["groups"] == ["10"], stopped
    assert _node(h, "10").st_uid == 0
    answer = h.raw({"op": "ch.unvfio", "args": {"name": "vm1"}})
    assert answer["ok"] is True, answer
    assert (_driver(h, GPU), _driver(h, AUDIO), _driver(h, BRIDGE)) == ("nvidia", "snd_hda_intel", "pcieport")


def test_a_group_with_a_foreign_device_is_refused_dlv_chh_11(vf: HelperProcess) -> None:
    """DLV-CHH-11: GPU 1 shares its IOMMU group with a NIC: refused, nothing bound."""
    assert_refused(vf, {"op": "ch.vfio", "args": {"name": "vm3"}}, "foreign-device")
    assert _driver(vf, GPU1) == "nvidia" and _driver(vf, NIC) == "ixgbe"


def test_a_gpu_with_compute_processes_is_refused_dlv_chh_09(vf: HelperProcess) -> None:
    """DLV-CHH-09: root's own busy view (nvidia-smi's compute processes) refuses the GPU."""
    update_state(
        vf.root, lambda s: s["gpus"][0]["processes"].append({"pid": 777, "name": "x", "used_mib": 1})
    )
    try:
        answer = assert_refused(vf, {"op": "ch.vfio", "args": {"name": "vm1"}}, "gpu-busy")
        assert "compute process 777" in answer["message"]
    finally:
        update_state(vf.root, lambda s: s["gpus"][0]["processes"].clear())


def test_a_group_node_root_did_not_hand_out_is_judged_by_its_owner(vf: HelperProcess) -> None:
    """DLV-CHH-15: the node's vm.json cannot claim a group: root reads /dev/vfio's owner. A group node
    owned by a uid no running unit has is free to take."""
    h = vf
    node = h.root / "dev/vfio/10"
    node.parent.mkdir(parents=True, exist_ok=True)
    if not node.exists():
        node.write_bytes(b"")
    os.chown(node, UID2 + 100, UID2 + 100)  # a stopped VMM's leftover
    answer = h.raw({"op": "ch.vfio", "args": {"name": "vm2"}})
    assert answer["ok"] is True, answer
    assert _node(h, "10").st_uid == UID2
    assert h.raw({"op": "ch.unvfio", "args": {"name": "vm2"}})["ok"] is True
    assert _driver(h, GPU) == "nvidia"


def test_no_vfio_pci_module_fails_the_bind_dlv_ch_20(tmp_path: Path) -> None:
    """DLV-CH-20: without vfio-pci loaded the devices do not move: the op fails, naming the module."""
    root = make_root(tmp_path)
    lay_out_pci(root, [(GPU, "0x030200", 10, "nvidia")], vfio=False)
    lay_out_instance(root, "vm1", 4242, UID1, gpus=(GPU,))
    h = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    try:
        answer = h.raw({"op": "ch.vfio", "args": {"name": "vm1"}})
        assert answer["ok"] is False and "vfio-pci" in answer["message"], answer
        # the device went back to its host driver, its override cleared
        assert _driver(h, GPU) == "nvidia"
        assert (root / f"sys/bus/pci/devices/{GPU}/driver_override").read_text().strip() == ""
    finally:
        h.stop()
