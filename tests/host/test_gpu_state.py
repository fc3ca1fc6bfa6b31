"""One GPU state on the simulated host: the host units (gpu-settings, mig-layout) and the devices
section act on the same GPUs through the plain `sim_system` (gpus.json, one fake nvidia-smi).

Covers HST-MIG-14/15 (a GPU a live hold uses is left alone; one already at the layout needs
nothing), HST-MIG-18/23 with the devices side (instances the unit made are in `nvidia-smi -L`, in
the devices inventory, bindable, and shown with their holder by `bcd status`), DEV-ATOM-10 /
Q-DEV-PASS-03 across the two sections, and the realistic `mig -lgip` layout of the host fake.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bcd_agent.inventory.gpus import collect_gpus
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec, Limits
from bcd_agent.status import read_holders
from bcd_shared.units import UnitContext
from bcd_simhost.gpus import gpu_uuid
from devices.devhost import Host
from hostunits_support import ALLOWED, make_host, plan, run
from testsupport import REFERENCE, REPO, require_shared

G0, G7 = gpu_uuid(0), gpu_uuid(7)
LAYOUT = {"layout": "mixed:3g.71gb+2x2g.35gb"}


def _mig_hold(alloc: str, device: str) -> DeviceAssignment:
    return DeviceAssignment(alloc, f"rsv_{alloc}", "BINDING_HOLD", (DeviceRef(device, "gpu.mig"),))


def test_mig_layout_instances_are_the_devices_sections_atoms(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    host = Host(root)
    spec = DevicesSpec(1, (_mig_hold("m1", f"{G0}/gi2/ci0"),))
    assert host.run(spec).message == f"m1: {G0} has no MIG instance gi2/ci0"

    assert run(system, "mig-layout", LAYOUT).ok
    listed = system.run(["nvidia-smi", "-L"]).stdout.decode().splitlines()
    gpu0 = collect_gpus(system).gpus[0]
    assert listed[1:4] == [
        f"  MIG {m.profile:<12}Device {n:>2}: (UUID: {m.uuid})" for n, m in enumerate(gpu0.migs)
    ]
    assert [(m.key, m.profile) for m in gpu0.migs] == [
        ("gi1/ci0", "3g.71gb"),
        ("gi2/ci0", "2g.35gb"),
        ("gi3/ci0", "2g.35gb"),
    ]
    # The same generation binds on a later pass once the unit made the instance (Q-DEV-PASS-03).
    assert host.run(spec).message == ""
    env = host.path("/run/bcd/allocations/m1.env").read_text()
    assert f"NVIDIA_VISIBLE_DEVICES={gpu0.migs[1].uuid}" in env
    rows = {r.device: r for r in read_holders(system).rows}
    assert rows[f"{G0}/gi2/ci0"].holder == "m1" and rows[f"{G0}/gi2/ci0"].detail == "2g.35gb"
    assert rows[f"{G0}/gi1/ci0"].holder == ""

    # The hold makes GPU 0 busy: at the layout it needs nothing; a new layout leaves it alone.
    busy = UnitContext(busy_gpus=frozenset({f"{G0}/gi2/ci0"}), allowed_clusters=ALLOWED)
    assert plan(system, "mig-layout", LAYOUT, ctx=busy).converged
    r = run(system, "mig-layout", {"layout": "all-1g.18gb"}, ctx=busy)
    assert r.issues[0].kind == "retryable" and f"{G0} hold allocations" in r.issues[0].message
    assert [m.key for m in collect_gpus(system).gpus[0].migs] == ["gi1/ci0", "gi2/ci0", "gi3/ci0"]
    assert len(collect_gpus(system).gpus[1].migs) == 7
    assert host.run(spec).message == ""  # the hold stands


def test_gpu_settings_and_devices_read_the_same_gpus(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    before = collect_gpus(system)
    assert run(system, "gpu-settings", {"powerLimitWatts": 600}).ok
    out = system.run(["nvidia-smi", "-i", G7, "--query-gpu=uuid,power.limit", "--format=csv"]).stdout.decode()
    assert out.splitlines() == ["uuid, power.limit [W]", f"{G7}, 600.00 W"]
    after = collect_gpus(system)
    assert [g.uuid for g in after.gpus] == [g.uuid for g in before.gpus]
    assert [m.key for m in after.gpus[7].migs] == ["gi1/ci0", "gi2/ci0", "gi3/ci0", "gi4/ci0"]
    state = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())
    assert not (root / "var/lib/bcd-sim/gpu-host.json").exists()
    assert {g["power_limit"] for g in state["gpus"]} == {600.0}


def test_lgip_has_the_580_driver_layout(tmp_path: Path) -> None:
    """The `mig -lgip` table of the fake lines up column for column with the A100 capture of driver
    580 (mig/a100-sxm4-40gb_580.126.09_mig-session_ssup2-blog.txt), and Free/Total follows the
    instances in place."""
    _, system = make_host(tmp_path)
    ours = system.run(["nvidia-smi", "mig", "-i", "7", "-lgip"]).stdout.decode().splitlines()
    capture = REFERENCE / "nvidia-smi/mig/a100-sxm4-40gb_580.126.09_mig-session_ssup2-blog.txt"
    ref = require_shared(capture).read_text()
    real = ref.split("$ nvidia-smi mig -i 0 -lgip\n")[1].splitlines()
    assert ours[:5] == real[:5]
    for mine, theirs in zip(ours[5:8], real[5:8], strict=True):
        assert len(mine) == len(theirs)
        assert [i for i, c in enumerate(mine) if c == "|"] == [i for i, c in enumerate(theirs) if c == "|"]
    assert ours[5].split()[:6] == ["|", "7", "MIG", "1g.18gb", "19", "0/7"]  # GPU 7 is full
    assert ours[-3].split()[3:6] == ["7g.141gb", "0", "0/1"]


def test_bcd_sim_runs_gpu_settings_and_mig_layout_on_the_devices_gpus(tmp_path: Path) -> None:
    """`bcd sim` with examples/gpu-node.json's MIG hold plus gpu-settings and mig-layout units and a
    hold on an instance only the layout makes: the units act on the GPUs the devices section holds
    (GPU 7, already at the layout and held, needs nothing), and the new instance is bound by the
    node's follow-up pass (the host section's change triggers it)."""
    spec = json.loads((REPO / "examples/gpu-node.json").read_text())
    spec["host"]["units"] += [
        {"name": "gpu-settings", "settings": json.dumps({"powerLimitWatts": 600})},
        {"name": "mig-layout", "settings": json.dumps({"layout": "mixed:3g.71gb+2g.35gb+2x1g.18gb"})},
    ]
    mig_hold = {
        "allocationId": "alloc_mig_0003",
        "reservationId": "resv-mig-0003",
        "binding": "BINDING_HOLD",
        "devices": [{"id": f"{G0}/gi2/ci0", "deviceClass": "gpu.mig"}],
    }
    spec["devices"]["assignments"] = [spec["devices"]["assignments"][1], mig_hold]
    spec_file = tmp_path / "gpu-mig.json"
    spec_file.write_text(json.dumps(spec))
    root = tmp_path / "host"
    res = subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", "sim", "--spec", str(spec_file), "--root", str(root),
         "--once", "--json", "--timeout", "30"],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    doc = json.loads(res.stdout)
    host = next(s for s in doc["sections"] if s["section"] == "host")
    assert host["state"] == "CONVERGED", host
    from bcd_simhost import sim_system

    system = sim_system(root)
    state = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())
    assert {g["power_limit"] for g in state["gpus"]} == {600.0}
    assert [sorted(m["profile"] for m in g["migs"]) for g in state["gpus"]] == [
        ["1g.18gb", "1g.18gb", "2g.35gb", "3g.71gb"]
    ] * 8
    assert (root / "etc/cdi/bcd-alloc_infer_0002.json").exists()
    assert (root / "etc/cdi/bcd-alloc_mig_0003.json").exists()
    rows = {r.device: r.holder for r in read_holders(system).rows}
    assert rows[f"{G0}/gi2/ci0"] == "alloc_mig_0003" and rows[f"{G7}/gi1/ci0"] == "alloc_infer_0002"


def test_HST_SHARE_mps_service_sets_compute_mode_and_pipe_directory(tmp_path: Path) -> None:
    """gpu-sharing's bcd-mps.service on the simulated host: its ExecStartPre/ExecStopPost
    `nvidia-smi -c` change the GPUs' compute mode in the one GPU state, and the MPS pipe directory the
    devices section looks for exists while the service runs (slot holds then get
    CUDA_MPS_PIPE_DIRECTORY, DEV-CDI-16)."""
    root, system = make_host(tmp_path)
    assert run(system, "gpu-sharing", {"mode": "mps", "replicas": 4}).ok
    modes = system.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"]).stdout.decode()
    assert modes.split() == ["Exclusive_Process"] * 8
    assert (root / "run/nvidia-mps").is_dir()
    host = Host(root)
    slot = DeviceAssignment("s1", "rsv_s1", "BINDING_HOLD", (DeviceRef(f"{G0}/s0", "gpu.slot"),))
    host.run(DevicesSpec(1, (slot,)))
    assert "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps" in host.path("/run/bcd/allocations/s1.env").read_text()
    assert run(system, "gpu-sharing", {"mode": "timeslice"}).ok
    modes = system.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"]).stdout.decode()
    assert modes.split() == ["Default"] * 8 and not (root / "run/nvidia-mps").exists()


def test_HST_MIG_22_a_hold_on_an_instance_the_layout_has_not_made_is_device_missing(tmp_path: Path) -> None:
    """The devices converger fails a hold on a MIG instance mig-layout has not created with
    `device-missing`, pass after pass, and binds the same hold once the unit made the instance."""
    root, system = make_host(tmp_path)
    host = Host(root)
    spec = DevicesSpec(1, (_mig_hold("m1", f"{G0}/gi3/ci0"),))
    for _ in range(2):
        host.run(spec)
    fails = [(f.allocation_id, f.reason) for f in host.events("FailedEvent")]  # type: ignore[attr-defined]
    assert fails and set(fails) == {("m1", "device-missing")}
    assert not host.path("/etc/cdi/bcd-m1.json").exists()
    assert run(system, "mig-layout", LAYOUT).ok
    assert host.run(spec).message == ""
    assert host.path("/etc/cdi/bcd-m1.json").exists()
    assert [e.allocation_id for e in host.events("BoundEvent")] == ["m1"]  # type: ignore[attr-defined]


def test_HST_SHARE_14_a_slot_hold_gets_the_mps_pipe_directory_only_while_it_exists(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    host = Host(root)
    assert run(system, "gpu-sharing", {"mode": "timeslice", "replicas": 4}).ok
    assert not (root / "run/nvidia-mps").exists()
    s1 = DeviceAssignment("s1", "rsv_s1", "BINDING_HOLD", (DeviceRef(f"{G0}/s0", "gpu.slot"),))
    assert host.run(DevicesSpec(1, (s1,))).message == ""
    assert "CUDA_MPS_PIPE_DIRECTORY" not in host.path("/run/bcd/allocations/s1.env").read_text()
    assert run(system, "gpu-sharing", {"mode": "mps", "replicas": 4}).ok
    assert (root / "run/nvidia-mps").is_dir()
    s2 = DeviceAssignment("s2", "rsv_s2", "BINDING_HOLD", (DeviceRef(f"{G7}/s1", "gpu.slot"),))
    assert host.run(DevicesSpec(2, (s1, s2))).message == ""
    env = host.path("/run/bcd/allocations/s2.env").read_text()
    assert "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps" in env.splitlines()
    cdi_env = json.loads(host.path("/etc/cdi/bcd-s2.json").read_text())["containerEdits"]["env"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps" in cdi_env
    # A whole-GPU hold is no MPS client: it never gets the variable.
    g = DeviceAssignment("g1", "rsv_g1", "BINDING_HOLD", (DeviceRef(gpu_uuid(3), "gpu"),))
    assert host.run(DevicesSpec(3, (s1, s2, g))).message == ""
    assert "CUDA_MPS_PIPE_DIRECTORY" not in host.path("/run/bcd/allocations/g1.env").read_text()


def _kernel_frees(root: Path, size_kb: int) -> None:
    """What the kernel does that the simulated host's files do not: a pool's free count follows the
    count the unit set (nothing uses the pages yet), host-wide as the nodes' sum."""
    total = 0
    for node in (0, 1):
        d = root / f"sys/devices/system/node/node{node}/hugepages/hugepages-{size_kb}kB"
        n = int((d / "nr_hugepages").read_text())
        (d / "free_hugepages").write_text(f"{n}\n")
        total += n
    d = root / f"sys/kernel/mm/hugepages/hugepages-{size_kb}kB"
    (d / "nr_hugepages").write_text(f"{total}\n")
    (d / "free_hugepages").write_text(f"{total}\n")


def test_HST_HP_29_hold_admission_checks_free_pages_against_the_units_pools(tmp_path: Path) -> None:
    """The devices converger's admission reads the pools the hugepages unit configured: holds that fit
    the unit's 1 GiB pages on node 1 bind, one more is refused, and raising the unit's count lets it
    bind. (An instance start's check of the same pools is tests/instances' huge-page admission test.)"""
    root, system = make_host(tmp_path)
    host = Host(root)
    assert run(system, "hugepages", {"pages1g": 3, "perNuma": True}).ok
    _kernel_frees(root, 1048576)

    def paged(alloc: str, gpu: str, pages: int) -> DeviceAssignment:
        limits = Limits(mems="1", hugepages_1gi=pages)
        return DeviceAssignment(alloc, f"rsv_{alloc}", "BINDING_HOLD", (DeviceRef(gpu, "gpu"),), limits)

    a, b = paged("a", G0, 2), paged("b", G7, 2)
    assert host.run(DevicesSpec(1, (a,))).message == ""
    out = host.run(DevicesSpec(2, (a, b)))
    assert out.message == "b: ResourcesExhausted: 2 hugepages of 1048576 KiB needed, 1 free"
    assert run(system, "hugepages", {"pages1g": 4, "perNuma": True}).ok
    _kernel_frees(root, 1048576)
    assert host.run(DevicesSpec(3, (a, b))).message == ""
