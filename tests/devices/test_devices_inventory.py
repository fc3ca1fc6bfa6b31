"""Inventory parsers against real nvidia-smi output (../shared/reference, read in place) and the
project's own fixtures (tests/fixtures/nvidia-smi); the simulated nvidia-smi against both."""

from __future__ import annotations

from pathlib import Path

import pytest
from bcd_agent.inventory.gpus import build_inventory, collect_gpus, sysfs_pci_address
from bcd_agent.inventory.handlers import collect_inventory, diag_nvml, hello_capabilities, inventory_hash
from bcd_agent.inventory.host import parse_meminfo, read_host_memory
from bcd_shared import nvsmi
from bcd_simhost import sim_system
from bcd_simhost.gpus import gpu_uuid, update_state
from devices.devhost import IN_CI, REFERENCE, REPO

NV = REFERENCE / "nvidia-smi"
OWN = REPO / "tests" / "fixtures" / "nvidia-smi"
PREFIX = "hgx-h200-8gpu_mig-on-gpu7_590.48.01"


def ref(rel: str) -> str:
    path = NV / rel
    if not path.exists():
        if IN_CI:
            pytest.fail(f"{path} missing under CI")
        pytest.skip("reference data not present")
    return path.read_text()


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (NV / "list").glob("*.txt")) if (NV / "list").exists() else []
)
def test_parse_list_every_reference_capture(name: str) -> None:
    """Covers DEV-ATOM-05 input: every real `-L` capture parses, MIG UUIDs included."""
    gpus = nvsmi.parse_list(ref(f"list/{name}"))
    assert gpus and all(g.uuid.startswith("GPU-") for g in gpus)
    assert all(m.uuid.startswith("MIG-") for g in gpus for m in g.migs)


def test_parse_list_h200_sub_profiles() -> None:
    [g] = nvsmi.parse_list(ref("list/h200_mig_590.48.01_L.txt"))
    assert [(m.index, m.profile) for m in g.migs] == [
        (0, "1c.3g.71gb"),
        (1, "2c.3g.71gb"),
        (2, "2g.35gb"),
        (3, "1g.18gb"),
        (4, "1g.18gb"),
    ]


@pytest.mark.parametrize(
    "name",
    [
        "h100-80gb-hbm3_mig_590.48.01_query-gpu_idle.csv",
        "h100-80gb-hbm3_590.48.01_query-gpu_idle.csv",
        "h200_mig_590.48.01_query-gpu_idle.csv",
    ],
)
def test_query_gpu_reference_with_header(name: str) -> None:
    [q] = nvsmi.queried_gpus(nvsmi.parse_csv(ref(f"csv/{name}")))
    assert q.uuid == "GPU-00000000-0000-0000-0000-000000000000" and q.driver_version == "590.48.01"
    assert q.memory_mib in (81559, 143771) and q.ecc_uncorrected_volatile == 0
    if "mig" in name:
        assert q.mig_enabled and q.remap_pending is None  # [N/A] under MIG
    else:
        assert not q.mig_enabled and q.remap_pending is False and q.remap_failure is False


def test_compute_apps_reference() -> None:
    apps = nvsmi.compute_apps(
        nvsmi.parse_csv(ref("csv/h100-80gb-hbm3_590.48.01_query-compute-apps_load.csv"))
    )
    assert [a.pid for a in apps] == [11327, 11328, 11345]
    assert (
        nvsmi.compute_apps(
            nvsmi.parse_csv(ref("csv/h100-80gb-hbm3_mig_590.48.01_query-compute-apps_idle.csv"))
        )
        == ()
    )


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (NV / "xml").glob("*.xml")) if (NV / "xml").exists() else []
)
def test_parse_qx_every_reference_capture(name: str) -> None:
    """Covers DEV-BUSY-11: ECC and row remapping from `-q -x` across DTD v11..v13."""
    log = nvsmi.parse_qx(ref(f"xml/{name}"))
    assert log.gpus
    for g in log.gpus:
        assert g.uuid.startswith("GPU-")
        if g.mig_enabled:
            assert g.migs and g.remap_pending is None
    if name.startswith("8x-h100"):
        assert len(log.gpus) == 8 and all(
            g.remap_pending is False and g.ecc_uncorrected_volatile == 0 for g in log.gpus
        )
    if name.startswith("a100-sxm4-80gb_mig"):
        assert [(m.index, m.gpu_instance, m.compute_instance) for m in log.gpus[0].migs] == [
            (0, 3, 0),
            (1, 4, 0),
            (2, 5, 0),
            (3, 6, 0),
        ]


def test_reference_mig_a100_joins_list_and_qx() -> None:
    """A MIG device's `MIG-` UUID is joined to its gi/ci through the device index (DEV-ATOM-04/05)."""
    listed = nvsmi.parse_list(ref("list/a100-sxm4-80gb_4gpu_mig-on-gpu0_535.54.03_L_telegraf-issue-5812.txt"))
    qx = nvsmi.parse_qx(ref("xml/a100-sxm4-80gb_mig-enabled_535.54.03.xml"))
    inv = build_inventory(listed[:1], (), qx, {})
    g = inv.gpus[0]
    assert g.mig(3, 0) is not None and g.mig(3, 0).uuid == "MIG-ce861fb0-a248-58ce-a9a8-f9adbc22a66a"  # type: ignore[union-attr]
    assert g.mig(6, 0).uuid == "MIG-930574a9-d43a-5d2b-95da-3e68384c8d6b"  # type: ignore[union-attr]


def test_join_migs_matches_list_and_qx_through_the_device_index() -> None:
    """`join_migs` (the node's inventory and root's MIG hold check): each `-q -x` MIG device with the
    profile and UUID `-L` gives its index; a device `-L` does not list keeps no UUID; without `-q -x`, old
    drivers' `MIG-GPU-<uuid>/<gi>/<ci>` names (nvsmi's format notes) carry the ids and newer names are
    left out."""
    listed = nvsmi.parse_list(ref("list/a100-sxm4-80gb_4gpu_mig-on-gpu0_535.54.03_L_telegraf-issue-5812.txt"))
    qx = {g.uuid: g for g in nvsmi.parse_qx(ref("xml/a100-sxm4-80gb_mig-enabled_535.54.03.xml")).gpus}
    gpu = listed[0]
    assert nvsmi.join_migs(gpu, qx[gpu.uuid])[:2] == (
        nvsmi.MigRef(3, 0, 0, "MIG-ce861fb0-a248-58ce-a9a8-f9adbc22a66a", "1g.20gb"),
        nvsmi.MigRef(4, 0, 1, "MIG-a45882f0-9215-5733-a0c1-49286ab31cb5", "1g.20gb"),
    )
    unlisted = nvsmi.ListedGpu(gpu.index, gpu.name, gpu.uuid, gpu.migs[1:])
    assert nvsmi.join_migs(unlisted, qx[gpu.uuid])[0] == nvsmi.MigRef(3, 0, 0, None, "")
    assert nvsmi.join_migs(gpu, None) == ()
    old = nvsmi.parse_list(
        "GPU 0: A100-SXM4-40GB (UUID: GPU-5f1c2a90-0000-4000-8000-000000000001)\n"
        "  MIG 3g.20gb Device 0: (UUID: MIG-GPU-5f1c2a90-0000-4000-8000-000000000001/1/0)\n"
        "  MIG 1g.5gb  Device 1: (UUID: MIG-GPU-5f1c2a90-0000-4000-8000-000000000001/7/2)\n"
        "  MIG 1g.5gb  Device 2: (UUID: MIG-GPU-5f1c2a90-0000-4000-8000-000000000001/x/2)\n"
    )[0]
    assert nvsmi.join_migs(old, None) == (
        nvsmi.MigRef(1, 0, 0, "MIG-GPU-5f1c2a90-0000-4000-8000-000000000001/1/0", "3g.20gb"),
        nvsmi.MigRef(7, 2, 1, "MIG-GPU-5f1c2a90-0000-4000-8000-000000000001/7/2", "1g.5gb"),
    )


def test_lgi_lci_reference_tables() -> None:
    text = ref("mig/a100-sxm4-40gb_580.126.09_mig-session_ssup2-blog.txt")
    lgi = nvsmi.parse_lgi(text.split("$ nvidia-smi mig -i 0 -lgi\n")[1].split("$")[0])
    assert [(r.profile, r.profile_id, r.instance, r.placement) for r in lgi] == [
        ("1g.5gb", 19, 9, "6:1"),
        ("2g.10gb", 14, 3, "4:2"),
        ("4g.20gb", 5, 2, "0:4"),
    ]
    lci = nvsmi.parse_lci(text.split("$ nvidia-smi mig -i 0 -lci\n")[1].split("$")[0])
    assert [(r.gpu_instance, r.instance) for r in lci] == [(9, 0), (3, 0), (3, 1), (2, 0)]


def test_own_fixtures_build_the_inventory() -> None:
    """The project's own fixtures, with a hand-edited unhealthy GPU (DEV-BUSY-10)."""
    listed = nvsmi.parse_list((OWN / f"{PREFIX}_L.txt").read_text())
    queried = nvsmi.queried_gpus(
        nvsmi.parse_csv((OWN / f"{PREFIX}_query-gpu_noheader.csv").read_text(), nvsmi.QUERY_GPU_FIELDS)
    )
    qx = nvsmi.parse_qx((OWN / f"{PREFIX}_q-x.xml").read_text())
    inv = build_inventory(listed, queried, qx, {q.bus_id: (0 if q.index < 4 else 1) for q in queried})
    assert len(inv.gpus) == 8 and [g.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.health.healthy for g in inv.gpus] == [True, True, False, True, True, True, True, True]
    assert inv.gpus[2].health.ecc_uncorrected_volatile == 3 and inv.gpus[2].health.remap_pending is True
    assert [m.key for m in inv.gpus[7].migs] == ["gi1/ci0", "gi2/ci0", "gi3/ci0", "gi4/ci0"]
    assert nvsmi.parse_lgi((OWN / f"{PREFIX}_mig-lgi.txt").read_text())[0].profile == "3g.71gb"
    assert len(nvsmi.parse_lci((OWN / f"{PREFIX}_mig-lci.txt").read_text())) == 4


def test_fake_nvidia_smi_prints_the_reference_formats(sim_root: Path) -> None:
    """The simulated tool's -L and mig -lgi lines have the real column layout."""
    system = sim_system(sim_root)
    out = system.run(["nvidia-smi", "-L"]).stdout.decode().splitlines()
    real_mig = ref("list/h100-80gb-hbm3_mig_590.48.01_L.txt").splitlines()[1]
    assert out[8][: real_mig.index("Device")] == "  MIG 3g.71gb     " and real_mig.startswith(
        "  MIG 3g.40gb     Device  0:"
    )
    lgi = system.run(["nvidia-smi", "mig", "-lgi"]).stdout.decode().splitlines()
    ssup2 = ref("mig/a100-sxm4-40gb_580.126.09_mig-session_ssup2-blog.txt").splitlines()
    assert lgi[:5] == ssup2[ssup2.index("$ nvidia-smi mig -i 0 -lgi") + 1 :][:5]
    assert len(lgi[5]) == len("|   0  MIG 1g.5gb            19        9          6:1     |")
    bad = system.run(["nvidia-smi", "--query-gpu=uuid,bogus", "--format=csv"])
    assert bad.returncode == 2 and b'Field "bogus" is not a valid field to query.' in bad.stderr


def test_collect_on_the_simulated_host_and_hash(sim_root: Path) -> None:
    """Covers the inventory.refresh core: GPUs, NUMA, hugepages, meminfo; the hash follows the facts."""
    system = sim_system(sim_root)
    inv = collect_gpus(system)
    assert inv.nvml and len(inv.gpus) == 8 and inv.errors == ()
    assert sysfs_pci_address(inv.gpus[0].bus_id) == "0000:18:00.0"
    wire_inv = collect_inventory(system, inv)
    assert wire_inv.mem_total_bytes == 512 * 1024**3 and len(wire_inv.numa_nodes) == 2
    assert {(p.page_size_bytes, p.numa_node) for p in wire_inv.hugepages} >= {(2 * 1024**2, -1), (1024**3, 1)}
    h1 = inventory_hash(wire_inv)
    assert h1 == inventory_hash(collect_inventory(system))
    update_state(sim_root, lambda s: s["gpus"][3].update(remap_pending=True))
    assert inventory_hash(collect_inventory(system)) != h1
    health = {g.uuid: g for g in diag_nvml(system).gpus}
    assert not health[gpu_uuid(3)].healthy and health[gpu_uuid(3)].message == "a row remap is pending"
    assert hello_capabilities(inv, privileged=True) == ("cdi", "devices.limits", "binding.kubernetes", "nvml")
    assert hello_capabilities(inv, privileged=False) == ("nvml",)


def test_host_memory_readers(sim_root: Path) -> None:
    system = sim_system(sim_root)
    host = read_host_memory(system)
    assert host is not None and host.nodes == (0, 1)
    assert host.pools[1048576].free == 32 and host.pools[1048576].per_node_free == {0: 16, 1: 16}
    assert host.normal_available_bytes == (512 * 1024**3) - (8192 * 2 * 1024**2 + 32 * 1024**3) - 1024**3
    (sim_root / "proc" / "meminfo").unlink()
    assert read_host_memory(system) is None
    assert parse_meminfo("MemTotal:       1024 kB\nHugePages_Total:     4\n") == {
        "MemTotal": 1024,
        "HugePages_Total": 4,
    }


def test_no_nvidia_smi_means_no_gpus(tmp_path: Path) -> None:
    """DEV-BUSY-11: without nvidia-smi the inventory has no GPUs (and no nvml; the Hello side of that is
    tests/session/test_node_real_devices.py)."""
    from bcd_shared.system import LocalSystem

    inv = collect_gpus(LocalSystem(tmp_path, tools={"true": lambda s, a, i: None}))  # type: ignore[dict-item,arg-type,return-value]
    assert inv.gpus == () and not inv.nvml
