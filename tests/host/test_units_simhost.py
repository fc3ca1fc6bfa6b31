"""Each unit on the simulated host: what it writes and runs, its refusals, and that it converges.

"Converges" everywhere means: apply, then plan again -> no steps and no issues (HST-LVL-03).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bcd_shared.units import HEADER_TEXT, UnitContext
from bcd_simhost.gpus import update_state
from hostunits_support import ALLOWED, K8S, FakeTokens, make_host, plan, run


def _json(root: Path, name: str) -> object:
    return json.loads((root / "var/lib/bcd-sim" / name).read_text())


# -- kernel-modules


def test_HST_MOD_08_09_11_12_files_and_loading(tmp_path: Path) -> None:
    """Covers HST-MOD-01: loaded now (/sys/module), at every boot (modules-load.d), with their options."""
    _, system = make_host(tmp_path)
    r = run(
        system,
        "kernel-modules",
        {"load": ["vhost_net", "tun", "vfio-pci"], "options": {"vfio-pci": "ids=10de:2330"}},
    )
    assert r.ok and r.changed
    load = system.read_text("/etc/modules-load.d/bcd.conf") or ""
    assert load.splitlines()[1:] == ["tun", "vfio-pci", "vhost_net"]
    assert HEADER_TEXT.format(unit="kernel-modules") in load.splitlines()[0]  # HST-LVL-07
    assert "options vfio_pci ids=10de:2330" in (system.read_text("/etc/modprobe.d/bcd.conf") or "")
    assert system.exists("/sys/module/vfio_pci") and system.exists("/sys/module/vhost_net")
    assert plan(
        system,
        "kernel-modules",
        {"load": ["vhost_net", "tun", "vfio-pci"], "options": {"vfio-pci": "ids=10de:2330"}},
    ).converged


def test_HST_MOD_10_options_file_removed_without_options(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    run(system, "kernel-modules", {"load": ["tun"], "options": {"kvm": "a=1"}})
    run(system, "kernel-modules", {"load": ["tun"]})
    assert not system.exists("/etc/modprobe.d/bcd.conf")


def test_HST_MOD_13_14_15_16_reload_only_when_unused(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    settings = {"load": ["kvm_intel"], "options": {"kvm_intel": "nested=1"}}
    (root / "sys/module/kvm_intel/refcnt").write_text("3\n")  # VMs hold it
    r = run(system, "kernel-modules", settings)
    assert r.ok and (root / "sys/module/kvm_intel/parameters/nested").read_text().strip() == "N"
    assert plan(system, "kernel-modules", settings).converged  # HST-MOD-16: no waiting reported
    (root / "sys/module/kvm_intel/refcnt").write_text("0\n")
    (root / "sys/module/kvm_intel/parameters/nested").write_text("0\n")
    p = plan(system, "kernel-modules", settings)
    assert [s.describe() for s in p.steps] == ["run modprobe -r -- kvm_intel", "run modprobe -- kvm_intel"]
    run(system, "kernel-modules", settings)
    assert (root / "sys/module/kvm_intel/parameters/nested").read_text().strip() == "1"
    (root / "sys/module/kvm_intel/parameters/nested").write_text("Y\n")  # Y and 1 compare equal
    assert plan(system, "kernel-modules", settings).converged


def test_HST_RMV_10_kernel_modules_removal(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    run(system, "kernel-modules", {"load": ["tun"], "options": {"tun": "x=1"}})
    run(system, "kernel-modules", None)
    assert not system.exists("/etc/modules-load.d/bcd.conf") and not system.exists("/etc/modprobe.d/bcd.conf")
    assert system.exists("/sys/module/tun")  # loaded modules stay loaded


# -- sysctl


def test_HST_SYS_07_08_drop_in_and_live(tmp_path: Path) -> None:
    """Covers HST-SYS-01: the settings are an object of sysctl name to scalar value."""
    root, system = make_host(tmp_path)
    r = run(system, "sysctl", {"vm.swappiness": 10, "net.ipv4.tcp_rmem": "4096 131072  6291456"})
    assert r.ok
    lines = (system.read_text("/etc/sysctl.d/90-bcd.conf") or "").splitlines()
    assert lines[1:] == ["net.ipv4.tcp_rmem = 4096 131072 6291456", "vm.swappiness = 10"]
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "10"
    # HST-SYS-06: the kernel shows tab-separated values; they compare equal.
    assert "\t" in (root / "proc/sys/net/ipv4/tcp_rmem").read_text()
    assert plan(
        system, "sysctl", {"vm.swappiness": 10, "net.ipv4.tcp_rmem": "4096 131072  6291456"}
    ).converged


def test_HST_SYS_10_11_missing_key_retried_after_the_others(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    r = run(system, "sysctl", {"net.bridge.bridge-nf-call-iptables": 0, "vm.swappiness": 5})
    assert [i.kind for i in r.issues] == ["retryable"]
    assert r.issues[0].message == (
        "sysctl: this kernel has no net.bridge.bridge-nf-call-iptables "
        "(is the module that provides it loaded?)"
    )
    assert (system.read_text("/proc/sys/vm/swappiness") or "").strip() == "5"


def test_HST_SYS_12_refused_key_writes_nothing(tmp_path: Path) -> None:
    from bcd_shared.units import REGISTRY

    _, system = make_host(tmp_path)
    try:
        REGISTRY["sysctl"].decode_settings('{"vm.swappiness": 1, "kernel.core_pattern": "|/x"}')
    except Exception as exc:  # the section turns this into the unit's terminal failure
        assert "kernel.core_pattern is refused" in str(exc)
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")


def test_HST_SYS_09_RMV_09_empty_object_and_removal(tmp_path: Path) -> None:
    """Covers HST-RMV-09: removing sysctl removes the drop-in; the live value stays."""
    _, system = make_host(tmp_path)
    run(system, "sysctl", {"vm.swappiness": 10})
    run(system, "sysctl", {})
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")
    run(system, "sysctl", {"vm.swappiness": 11})
    run(system, "sysctl", None)
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")
    assert (system.read_text("/proc/sys/vm/swappiness") or "").strip() == "11"  # live value stays


def test_HST_ORD_11_modules_before_the_sysctls_they_provide(tmp_path: Path) -> None:
    """Covers HST-ORD-03: modules load before the sysctls they provide."""
    _, system = make_host(tmp_path)
    run(system, "kernel-modules", {"load": ["br_netfilter"]})
    r = run(system, "sysctl", {"net.bridge.bridge-nf-call-iptables": 0})
    assert r.ok and (system.read_text("/proc/sys/net/bridge/bridge-nf-call-iptables") or "").strip() == "0"


# -- hugepages


def test_HST_HP_05_06_07_22_23_25_pages_and_mount(tmp_path: Path) -> None:
    """Covers HST-HP-24 too (daemon-reload and enable after the mount unit is written)."""
    root, system = make_host(tmp_path)
    s = {"pages2m": 512, "pages1g": 8, "transparent": "never", "perNuma": True}
    r = run(system, "hugepages", s)
    assert r.ok, r.issues
    for node in (0, 1):
        assert (
            root / f"sys/devices/system/node/node{node}/hugepages/hugepages-2048kB/nr_hugepages"
        ).read_text().strip() == "512"
        assert (
            root / f"sys/devices/system/node/node{node}/hugepages/hugepages-1048576kB/nr_hugepages"
        ).read_text().strip() == "8"
    assert "[never]" in (root / "sys/kernel/mm/transparent_hugepage/enabled").read_text()
    unit = system.read_text("/etc/systemd/system/dev-hugepages1G.mount") or ""
    for line in (
        "What=hugetlbfs",
        "Options=pagesize=1G",
        "DefaultDependencies=no",
        "Before=sysinit.target",
        "WantedBy=sysinit.target",
    ):
        assert line in unit
    # HST-HP-24/25: the unit written, then loaded, enabled and started, in that order
    log = (root / "var/lib/bcd-sim/systemd/log").read_text().splitlines()
    assert log == ["daemon-reload", "enable dev-hugepages1G.mount", "start dev-hugepages1G.mount"]
    assert plan(system, "hugepages", s).converged


def test_HST_HP_10_11_14_15_16_boot_reservation_and_reboot(tmp_path: Path) -> None:
    """Covers HST-REC-04: hugepages-1g-boot holds the reserved count."""
    root, system = make_host(tmp_path)
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("2\n")  # fragmented memory
    r = run(system, "hugepages", {"pages1g": 20, "perNuma": True})
    assert [i.kind for i in r.issues] == ["reboot"]
    assert "the boot loader reserves them from the next boot: reboot the node" in r.issues[0].message
    dropin = system.read_text("/etc/default/grub.d/90-bcd-hugepages.cfg") or ""
    assert 'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX hugepagesz=1G hugepages=40"' in dropin  # 20 x 2 nodes
    assert "hugepages=40" in (system.read_text("/var/lib/bcd-hostconfig/hugepages-1g-boot") or "")
    assert "hugepages=40" in (root / "boot/grub/grub.cfg").read_text()
    # After the reboot the kernel has the pages: the unit converges (HST-RBT-08).
    (root / "var/lib/bcd-sim/hugepages-1g-limit").unlink()
    for node in (0, 1):
        (root / f"sys/devices/system/node/node{node}/hugepages/hugepages-1048576kB/nr_hugepages").write_text(
            "20\n"
        )
    assert plan(system, "hugepages", {"pages1g": 20, "perNuma": True}).converged
    # HST-HP-18: pages1g 0 removes the reservation.
    run(system, "hugepages", {"pages1g": 0, "perNuma": True})
    assert not system.exists("/etc/default/grub.d/90-bcd-hugepages.cfg")


def test_HST_HP_13_no_boot_loader_fails(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "usr/sbin/update-grub").unlink()
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")
    r = run(system, "hugepages", {"pages1g": 4})
    assert (
        r.issues
        and "neither update-grub nor grubby" in r.issues[0].message
        and r.issues[0].kind == "retryable"
    )


def test_HST_HP_19_20_21_terminal_kernel_lacks(tmp_path: Path) -> None:
    import shutil

    root, system = make_host(tmp_path)
    shutil.rmtree(root / "sys/kernel/mm/hugepages/hugepages-1048576kB")
    (root / "sys/kernel/mm/transparent_hugepage/enabled").unlink()
    r = run(system, "hugepages", {"pages1g": 1, "transparent": "never"})
    assert [i.kind for i in r.issues] == ["terminal", "terminal"]
    assert run(system, "hugepages", {"pages1g": 0}).ok
    shutil.rmtree(root / "sys/devices/system/node")
    r = run(system, "hugepages", {"pages2m": 1, "perNuma": True})
    assert r.issues[0].kind == "terminal" and "no NUMA nodes" in r.issues[0].message


# -- cpu and iommu


def test_HST_CPU_07_11_12_15_17_governor_and_isolation(tmp_path: Path) -> None:
    """Covers HST-CPU-10 (the governor is set live while isolation waits for a reboot) and
    HST-REC-03 (bootargs/cpu)."""
    root, system = make_host(tmp_path)
    r = run(system, "cpu", {"governor": "performance", "isolate": "4-31,36-63"})
    assert [i.kind for i in r.issues] == ["reboot"]
    assert (
        r.issues[0].message
        == 'cpu: CPUs 4-31,36-63 are isolated from the next boot (now: ""): reboot the node'
    )
    assert (
        root / "sys/devices/system/cpu/cpu7/cpufreq/scaling_governor"
    ).read_text().strip() == "performance"
    args = "isolcpus=managed_irq,domain,4-31,36-63 nohz_full=4-31,36-63 rcu_nocbs=4-31,36-63"
    assert f'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX {args}"' in (
        system.read_text("/etc/default/grub.d/90-bcd-cpu.cfg") or ""
    )
    assert args in (system.read_text("/var/lib/bcd-hostconfig/bootargs/cpu") or "")
    p = plan(system, "cpu", {"governor": "performance", "isolate": "4-31,36-63"})
    assert p.steps == ()  # HST-CPU-16: unchanged arguments plan nothing
    (root / "sys/devices/system/cpu/isolated").write_text("4-31,36-63\n")
    assert plan(system, "cpu", {"governor": "performance", "isolate": "4-31,36-63"}).converged


def test_HST_CPU_08_09_governor_not_offered_and_no_cpufreq(tmp_path: Path) -> None:
    import shutil

    root, system = make_host(tmp_path)
    (root / "sys/devices/system/cpu/cpu3/cpufreq/scaling_available_governors").write_text(
        "performance powersave\n"
    )
    r = run(system, "cpu", {"governor": "schedutil"})
    assert (
        r.issues[0].kind == "terminal" and "governor schedutil is not offered by cpu3" in r.issues[0].message
    )
    assert (root / "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").read_text().strip() == "schedutil"
    for d in (root / "sys/devices/system/cpu").glob("cpu*/cpufreq"):
        shutil.rmtree(d)
    assert run(system, "cpu", {"governor": "schedutil"}).ok


def test_HST_CPU_13_grubby_and_RMV_11_removal(tmp_path: Path) -> None:
    """Covers HST-RMV-11: removing cpu takes its arguments out of the boot loader (grubby) and its record."""
    root, system = make_host(tmp_path)
    (root / "usr/sbin/update-grub").unlink()
    (root / "usr/sbin/grubby").write_text("#!/bin/sh\n")
    run(system, "cpu", {"isolate": "2-3"})
    assert _json(root, "grubby-args.json") == [
        "isolcpus=managed_irq,domain,2-3",
        "nohz_full=2-3",
        "rcu_nocbs=2-3",
    ]
    run(system, "cpu", {"isolate": "4"})
    assert _json(root, "grubby-args.json") == ["isolcpus=managed_irq,domain,4", "nohz_full=4", "rcu_nocbs=4"]
    run(system, "cpu", None)
    assert _json(root, "grubby-args.json") == []
    assert not system.exists("/var/lib/bcd-hostconfig/bootargs/cpu")


def test_HST_IOMMU_04_07_vendor_arguments(tmp_path: Path) -> None:
    """Covers HST-IOMMU-02 (passthrough adds iommu=pt), HST-IOMMU-03 (the vendor comes from
    /proc/cpuinfo), HST-REC-03 (bootargs/iommu)."""
    root, system = make_host(tmp_path)
    r = run(system, "iommu", {})
    assert r.issues[0].message == (
        "iommu: the IOMMU is on from the next boot (intel_iommu=on iommu=pt): reboot the node; "
        "check the firmware enables VT-d or AMD-Vi"
    )
    (root / "sys/class/iommu/dmar0").mkdir()
    assert plan(system, "iommu", {}).converged
    cpuinfo = root / "proc/cpuinfo"
    cpuinfo.write_text(cpuinfo.read_text().replace("GenuineIntel", "AuthenticAMD"))
    run(system, "iommu", {"passthrough": False})
    # passthrough false: the vendor's argument alone, no iommu=pt (the test read only that it was there)
    assert (system.read_text("/var/lib/bcd-hostconfig/bootargs/iommu") or "").splitlines()[
        -1
    ] == "amd_iommu=on"
    cpuinfo.write_text(cpuinfo.read_text().replace("AuthenticAMD", "CentaurHauls"))
    assert run(system, "iommu", {}).issues[0].kind == "terminal"
    cpuinfo.write_text("processor : 0\nBogoMIPS : 50.00\n")  # Arm: no vendor_id
    run(system, "iommu", {})
    assert (system.read_text("/var/lib/bcd-hostconfig/bootargs/iommu") or "").splitlines()[-1] == "iommu=pt"
    run(system, "iommu", None)  # HST-RMV-12
    assert not system.exists("/etc/default/grub.d/90-bcd-iommu.cfg")


# -- nvidia-driver and fabric-manager


def test_HST_DRV_04_05_converged_driver_keeps_persistenced(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    r = run(system, "nvidia-driver", {"branch": "590", "open": True})
    assert (
        r.ok
        and "enable --now nvidia-persistenced.service" in (root / "var/lib/bcd-sim/systemd/log").read_text()
    )
    assert plan(system, "nvidia-driver", {"branch": "590"}).converged


def test_HST_DRV_06_10_18_19_21_install_and_swap_on_ubuntu(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "etc/os-release").write_text('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="24.04"\n')
    r = run(system, "nvidia-driver", {"branch": "570", "open": False})
    assert r.ok, r.issues
    db = _json(root, "packages.json")
    assert "nvidia-headless-570-server" in db and "nvidia-utils-570-server" in db  # type: ignore[operator]
    assert "570.148.08" in (root / "proc/driver/nvidia/version").read_text()
    assert plan(system, "nvidia-driver", {"branch": "570", "open": False}).converged


def test_HST_DRV_12_14_rhel_stream_and_unknown_distribution(tmp_path: Path) -> None:
    """Covers HST-DRV-16: the RHEL family installs with `dnf -y install`."""
    root, system = make_host(tmp_path)
    (root / "etc/os-release").write_text('ID="rocky"\nID_LIKE="rhel centos fedora"\nVERSION_ID="9.4"\n')
    p = plan(system, "nvidia-driver", {"branch": "550", "open": True})
    assert p.steps[0].describe() == "run dnf -y install @nvidia-driver:550-open"
    (root / "etc/os-release").write_text("ID=alpine\n")
    r = run(system, "nvidia-driver", {"branch": "550"})
    assert r.issues[0].kind == "terminal" and "no driver packages for alpine" in r.issues[0].message


def test_HST_DRV_20_driver_in_use_waits_for_reboot(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "sys/module/nvidia/refcnt").write_text("12\n")
    r = run(system, "nvidia-driver", {"branch": "570", "open": True})
    assert r.issues[0].kind == "reboot"
    assert (
        r.issues[0].message == "nvidia-driver: driver 590.48.01 is in use; reboot the node to load branch 570"
    )


def test_HST_FM_02_03_04_05_06(tmp_path: Path) -> None:
    import shutil

    root, system = make_host(tmp_path)
    shutil.rmtree(root / "sys/module/nvidia")
    r = run(system, "fabric-manager", {})
    assert r.issues[0].kind == "retryable" and [c.type for c in r.conditions] == ["FabricManagerDown"]
    assert r.conditions[0].reason == "NotRunning"
    (root / "sys/module/nvidia").mkdir()
    r = run(system, "fabric-manager", {})
    assert r.ok and r.conditions == ()
    assert "nvidia-fabricmanager-590" in _json(root, "packages.json")  # type: ignore[operator]
    shutil.rmtree(root / "proc/driver/nvidia-nvswitch")
    assert plan(system, "fabric-manager", {}).converged


# -- gpu-settings and mig-layout


def _gpus(root: Path) -> list[dict[str, Any]]:
    """The one GPU state of the simulated host (gpus.json), which the devices section reads too."""
    gpus: list[dict[str, Any]] = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())["gpus"]
    return gpus


def test_HST_GPUS_05_06_07_power_limit(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    r = run(system, "gpu-settings", {"powerLimitWatts": 800})
    assert (
        r.issues[0].kind == "terminal"
        and r.issues[0].message == "gpu-settings: GPU 0 takes 200 to 700 W, not 800"
    )
    assert run(system, "gpu-settings", {"powerLimitWatts": 450}).ok
    assert all(g["power_limit"] == 450 for g in _gpus(root))
    assert plan(system, "gpu-settings", {"powerLimitWatts": 450}).converged


def test_HST_GPUS_04_12_13_ecc_and_no_driver(tmp_path: Path) -> None:
    import shutil

    root, system = make_host(tmp_path)
    r = run(system, "gpu-settings", {"ecc": False})
    assert r.issues[0].kind == "reboot"
    assert r.issues[0].message.startswith(
        "gpu-settings: the ECC mode of GPU(s) 0,1,2,3,4,5,6,7 changes at their next reset"
    )
    assert plan(system, "gpu-settings", {"ecc": False}).steps == ()
    assert [g["ecc_pending"] for g in _gpus(root)] == [False] * 8
    # The GPU's next reset makes the pending mode current: the unit converges.
    assert system.run(["nvidia-smi", "--gpu-reset", "-i", "0,1,2,3,4,5,6,7"]).ok
    assert run(system, "gpu-settings", {"ecc": False}).ok
    shutil.rmtree(root / "sys/module/nvidia")
    assert run(system, "gpu-settings", {"ecc": False}).issues[0].kind == "retryable"


def test_HST_MIG_04_18_23_all_profile_on_idle_gpus(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    r = run(system, "mig-layout", {"from": "pool", "layout": "all-1g.18gb"})
    assert r.ok, r.issues
    gpus = _gpus(root)
    assert all(g["mig_enabled"] and len(g["migs"]) == 7 for g in gpus)
    assert plan(system, "mig-layout", {"layout": "all-1g.18gb"}).converged


def test_HST_MIG_11_14_15_19_21_profile_busy_and_reset(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    run(system, "mig-layout", {"layout": "mixed:3g.71gb+2x2g.35gb"})
    assert plan(system, "mig-layout", {"layout": "mixed:3g.71gb+2x2g.35gb"}).converged
    r = run(system, "mig-layout", {"layout": "all-2g.20gb"})
    assert r.issues[0].kind == "terminal" and "has no MIG profile 2g.20gb" in r.issues[0].message
    gpus = _gpus(root)
    busy = frozenset({f"{gpus[1]['uuid']}/gi1/ci0", f"{gpus[2]['uuid']}/s3"})
    r = run(
        system,
        "mig-layout",
        {"layout": "all-3g.71gb"},
        ctx=UnitContext(busy_gpus=busy, allowed_clusters=ALLOWED),
    )
    assert (
        r.issues[0].kind == "retryable"
        and "hold allocations; they are repartitioned once those end" in r.issues[0].message
    )
    after = _gpus(root)
    assert [m["profile"] for m in after[0]["migs"]] == ["3g.71gb", "3g.71gb"]
    assert sorted(m["profile"] for m in after[1]["migs"]) == ["2g.35gb", "2g.35gb", "3g.71gb"]

    # A mode change that waits for a reset which fails (processes hold the GPUs): RebootRequired.
    def busy_gpus(state: dict[str, Any]) -> None:
        for g in state["gpus"]:
            g["mig_needs_reset"] = True
            g["processes"] = [{"pid": 4242, "name": "python3", "used_mib": 1024}]

    update_state(root, busy_gpus)
    r = run(system, "mig-layout", {"layout": "all-disabled"})
    assert (
        r.issues[0].kind == "reboot"
        and "waits for a GPU reset, which failed (reboot the node)" in r.issues[0].message
    )
    first = _gpus(root)[0]  # the step stops at the first GPU whose reset failed
    assert first["mig_pending"] is False and first["mig_enabled"] and first["migs"] == []


def test_HST_MIG_reset_applies_a_pending_mode(tmp_path: Path) -> None:
    """HST-MIG mode step: a change that waits for a GPU reset (Ampere) is made effective by
    `nvidia-smi --gpu-reset` when nothing runs on the GPU."""
    root, system = make_host(tmp_path)
    update_state(root, lambda s: [g.update(mig_needs_reset=True) for g in s["gpus"]])
    r = run(system, "mig-layout", {"layout": "all-4g.71gb"})
    assert r.ok, r.issues
    assert all(g["mig_enabled"] and [m["profile"] for m in g["migs"]] == ["4g.71gb"] for g in _gpus(root))
    assert all(g["reset_count"] >= 1 for g in _gpus(root)[:7])


# -- gpu-sharing and container-toolkit


def test_HST_SHARE_04_05_07_to_13_16_mps_and_timeslice(tmp_path: Path) -> None:
    """Covers HST-SHARE-06/08/09/10/11/12/13/16: the unit file's lines, the systemctl calls a new unit
    file gets, a stopped service started again and nothing else (MPSDown NotRunning while down),
    timeslice removing the service."""
    root, system = make_host(tmp_path)
    r = run(system, "gpu-sharing", {"mode": "mps", "replicas": 6})
    assert r.ok and r.conditions == ()
    unit = system.read_text("/etc/systemd/system/bcd-mps.service") or ""
    for line in (
        "Environment=CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
        "Environment=CUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps",
        "ExecStartPre=/usr/bin/nvidia-smi -c EXCLUSIVE_PROCESS",
        "ExecStopPost=/usr/bin/nvidia-smi -c DEFAULT",
        "set_default_active_thread_percentage 16",  # floor(100 / 6), not 17
        "Restart=on-failure",
        "RestartSec=5",
    ):
        assert line in unit
    # HST-SHARE-05: a new unit file is loaded, enabled and (re)started, in that order
    log = (root / "var/lib/bcd-sim/systemd/log").read_text().splitlines()
    assert log == ["daemon-reload", "enable bcd-mps.service", "restart bcd-mps.service"]
    assert plan(system, "gpu-sharing", {"mode": "mps", "replicas": 6}).converged
    system.run(["systemctl", "stop", "bcd-mps.service"])
    p = plan(system, "gpu-sharing", {"mode": "mps", "replicas": 6})
    assert [(c.type, c.reason) for c in p.conditions] == [("MPSDown", "NotRunning")]
    assert [s.describe() for s in p.steps] == ["run systemctl start bcd-mps.service"]
    run(system, "gpu-sharing", {"mode": "timeslice", "replicas": 4})
    assert not system.exists("/etc/systemd/system/bcd-mps.service")
    assert "disable --now bcd-mps.service" in (root / "var/lib/bcd-sim/systemd/log").read_text()


def test_HST_SHARE_03_mps_needs_the_control_daemon(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "usr/bin/nvidia-cuda-mps-control").unlink()
    r = run(system, "gpu-sharing", {"mode": "mps"})
    assert r.issues[0].kind == "retryable" and [c.type for c in r.conditions] == ["MPSDown"]


def test_HST_CTK_02_07_08_14_toolkit_and_cdi(tmp_path: Path) -> None:
    """Covers HST-REC-05: cdi-nvidia.stamp follows what the CDI spec describes. The other HST-CTK ids
    have their own tests (tests/host/test_host_compliance_round3.py, test_host_compliance_units.py)."""
    root, system = make_host(tmp_path)
    assert system.run(["apt-get", "install", "-y", "containerd"]).ok
    assert not system.exists("/usr/bin/nvidia-ctk")
    r = run(system, "container-toolkit", {})
    assert r.ok, r.issues
    assert "nvidia-container-toolkit" in _json(root, "packages.json")  # type: ignore[operator]
    assert system.exists("/usr/bin/nvidia-ctk")
    assert "nvidia-container-runtime" in (system.read_text("/etc/containerd/config.toml") or "")
    cfg = system.read_text("/etc/nvidia-container-runtime/config.toml") or ""
    assert "accept-nvidia-visible-devices-envvar-when-unprivileged = false" in cfg
    assert "accept-nvidia-visible-devices-as-volume-mounts = false" in cfg
    spec = json.loads(system.read_text("/etc/cdi/nvidia.json") or "{}")
    assert spec["kind"] == "nvidia.com/gpu"
    stamp = system.read_text("/var/lib/bcd-hostconfig/cdi-nvidia.stamp") or ""
    assert plan(system, "container-toolkit", {}).converged
    # A new MIG layout changes nvidia-smi -L: the spec is generated again in the same pass (HST-CTK-14).
    run(system, "mig-layout", {"layout": "all-7g.141gb"})
    assert not plan(system, "container-toolkit", {}).converged
    run(system, "container-toolkit", {})
    assert (system.read_text("/var/lib/bcd-hostconfig/cdi-nvidia.stamp") or "") != stamp
    assert "MIG-" in (system.read_text("/etc/cdi/nvidia.json") or "")


def test_HST_CTK_10_16_cdi_false_changes_no_key(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    run(system, "container-toolkit", {"cdi": False})
    cfg = system.read_text("/etc/nvidia-container-runtime/config.toml") or ""
    assert "#accept-nvidia-visible-devices-envvar-when-unprivileged = true" in cfg
    assert plan(system, "container-toolkit", {"cdi": False}).converged


# -- k8s-join


def _join(system: object, tokens: FakeTokens | None = None) -> None:
    for _ in range(2):
        run(
            system,
            "k8s-join",
            K8S,
            ctx=UnitContext(allowed_clusters=ALLOWED, identity_labels=(("bcd.dev/node-id", "n-1"),)),
            tokens=tokens,
        )  # type: ignore[arg-type]


def test_HST_K8S_14_15_17_22_25_26_32_36_45_join_from_a_bare_host(tmp_path: Path) -> None:
    """A join end to end on the simulated host. It names only what it checks word for word; the other
    steps of the join (the keyring, the sysctls, the drop-in, the JoinConfiguration, the record's fields,
    the labels) have their own tests in tests/host/test_k8s_edges.py and test_host_compliance*.py."""
    root, system = make_host(tmp_path)
    tokens = FakeTokens()
    ctx = UnitContext(allowed_clusters=ALLOWED, identity_labels=(("bcd.dev/node-id", "n-1"),))
    r = run(system, "k8s-join", K8S, ctx=ctx, tokens=tokens)
    assert r.issues[0].kind == "retryable" and "next pass" in r.issues[0].message  # HST-K8S-22
    assert (
        "deb [signed-by=/etc/apt/keyrings/bcd-kubernetes.gpg] https://pkgs.k8s.io/core:/stable:/v1.34/deb/ /"
        in (system.read_text("/etc/apt/sources.list.d/bcd-kubernetes.list") or "")
    )
    assert system.exists("/var/lib/bcd-hostconfig/k8s-release.key")
    db = _json(root, "packages.json")
    assert all(db[p]["held"] for p in ("kubeadm", "kubelet", "kubectl"))  # type: ignore[index]
    r = run(system, "k8s-join", K8S, ctx=ctx, tokens=tokens)
    assert r.ok, r.issues
    assert tokens.fetched == ["secret://pool/k8s-token"] and tokens.consumed_count == 1
    assert not system.exists("/var/lib/bcd-hostconfig/k8s-join.yaml")  # HST-K8S-36
    assert "overlay\nbr_netfilter" in (system.read_text("/etc/modules-load.d/90-bcd-k8s.conf") or "")
    assert (system.read_text("/proc/sys/net/ipv4/ip_forward") or "").strip() == "1"
    assert len((system.read_text("/proc/swaps") or "").splitlines()) == 1  # swapoff -a
    assert 'imports = ["/etc/containerd/conf.d/*.toml"]' in (
        system.read_text("/etc/containerd/config.toml") or ""
    )
    node = _json(root, "k8s.json")["nodes"]["gpu-node-01"]  # type: ignore[index]
    assert node["taints"] == [{"key": "gpu", "value": "true", "effect": "NoSchedule"}]
    assert node["labels"]["team"] == "ml" and node["labels"]["bcd.dev/node-id"] == "n-1"
    record = json.loads(system.read_text("/var/lib/bcd-hostconfig/k8s-join.json") or "{}")
    assert record["taints"] == [["gpu", "true", "NoSchedule"]] and record["node"] == "gpu-node-01"
    assert (root / "var/lib/bcd-hostconfig/k8s-join.json").stat().st_mode & 0o777 == 0o644
    assert plan(system, "k8s-join", K8S, ctx).converged


def test_HST_K8S_43_46_47_48_labels_kept_taints_drift(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    ctx = UnitContext(allowed_clusters=ALLOWED, identity_labels=(("bcd.dev/node-id", "n-1"),))
    for _ in range(2):
        run(system, "k8s-join", K8S, ctx=ctx)
    changed = {**K8S, "nodeLabels": {"zone": "a"}, "taints": ["spot:PreferNoSchedule"]}
    r = run(system, "k8s-join", changed, ctx=ctx)
    assert r.ok
    node = _json(root, "k8s.json")["nodes"]["gpu-node-01"]  # type: ignore[index]
    assert "team" not in node["labels"] and node["labels"]["zone"] == "a"
    assert node["labels"]["kubernetes.io/hostname"] == "gpu-node-01"  # not bcd's: kept
    assert node["taints"] == [{"key": "gpu", "value": "true", "effect": "NoSchedule"}]  # never changed by bcd
    assert [(c.type, c.reason) for c in r.conditions] == [("KubernetesTaintsDrift", "NodeRestriction")]
    assert (
        r.conditions[0].message
        == "kubectl taint node gpu-node-01 --overwrite spot:PreferNoSchedule gpu:NoSchedule-"
    )


def test_HST_K8S_40_another_cluster_is_terminal(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    for _ in range(2):
        run(system, "k8s-join", K8S)
    system.write_atomic(
        "/etc/kubernetes/kubelet.conf", b"clusters:\n- cluster:\n    server: https://10.9.9.9:6443\n"
    )
    r = run(system, "k8s-join", K8S)
    assert (
        r.issues[0].kind == "terminal"
        and "reset it by hand (kubeadm reset) to move it" in r.issues[0].message
    )


def test_HST_K8S_27_foreign_imports_terminal(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    run(system, "k8s-join", K8S)
    system.write_atomic("/etc/containerd/config.toml", b'version = 2\nimports = ["/etc/other/*.toml"]\n')
    r = run(system, "k8s-join", K8S)
    assert (
        r.issues[0].kind == "terminal"
        and "imports list without /etc/containerd/conf.d/*.toml" in r.issues[0].message
    )


def test_HST_K8S_20_21_missing_packages_terminal(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    no_version = {k: v for k, v in K8S.items() if k != "kubernetesVersion"}
    assert run(system, "k8s-join", no_version).issues[0].kind == "terminal"
    (root / "etc/os-release").write_text("ID=alpine\n")
    assert "no Kubernetes packages for alpine" in run(system, "k8s-join", K8S).issues[0].message


def test_HST_K8S_61_63_65_66_removal_and_return(tmp_path: Path) -> None:
    """Covers HST-RMV-14 (with the not-joined-by-bcd test below): removal undoes the hold only on a node
    bcd joined; under the helper the clean is a settings-less host.unit
    (tests/host/test_host_compliance_round2.py)."""
    root, system = make_host(tmp_path)
    for _ in range(2):
        run(system, "k8s-join", K8S)
    pods = [
        {
            "metadata": {"namespace": "ml", "name": "train"},
            "spec": {"nodeName": "gpu-node-01"},
            "status": {"phase": "Running"},
        },
        {
            "metadata": {"namespace": "ml", "name": "wait"},
            "spec": {"nodeName": "gpu-node-01"},
            "status": {"phase": "Pending"},
        },
        {
            "metadata": {
                "namespace": "kube-system",
                "name": "ds",
                "ownerReferences": [{"kind": "DaemonSet"}],
            },
            "spec": {"nodeName": "gpu-node-01"},
            "status": {"phase": "Running"},
        },
        {
            "metadata": {
                "namespace": "kube-system",
                "name": "static",
                "annotations": {"kubernetes.io/config.mirror": "x"},
            },
            "spec": {"nodeName": "gpu-node-01"},
            "status": {"phase": "Running"},
        },
        {
            "metadata": {"namespace": "ml", "name": "done"},
            "spec": {"nodeName": "gpu-node-01"},
            "status": {"phase": "Succeeded"},
        },
    ]
    state = _json(root, "k8s.json")
    state["pods"] = pods  # type: ignore[index]
    (root / "var/lib/bcd-sim/k8s.json").write_text(json.dumps(state))
    released = run(system, "k8s-join", None)
    assert released.ok
    assert [c.type for c in released.conditions] == ["KubernetesReleased"]  # HST-K8S-64, in the release pass
    after = _json(root, "k8s.json")
    assert sorted(p["metadata"]["name"] for p in after["pods"]) == ["done", "ds", "static"]  # type: ignore[index]
    assert after["nodes"]["gpu-node-01"]["unschedulable"] is True  # type: ignore[index]
    assert json.loads(system.read_text("/var/lib/bcd-hostconfig/k8s-join.json") or "{}")["released"] is True
    assert system.exists("/etc/kubernetes/kubelet.conf")  # HST-K8S-65: not reset
    assert plan(system, "k8s-join", None).converged
    assert [c.type for c in run(system, "k8s-join", None).conditions] == ["KubernetesReleased"]  # every pass
    assert run(system, "k8s-join", K8S).conditions == ()
    assert _json(root, "k8s.json")["nodes"]["gpu-node-01"]["unschedulable"] is False  # type: ignore[index]


def test_HST_K8S_67_not_joined_by_bcd_changes_nothing(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    system.write_atomic(
        "/etc/kubernetes/kubelet.conf", b"clusters:\n- cluster:\n    server: https://10.0.0.1:6443\n"
    )
    assert plan(system, "k8s-join", None).converged


def test_HST_K8S_52_53_staged_token_for_the_helper(tmp_path: Path) -> None:
    from bcd_shared.units import REGISTRY, ApplyContext, StagedTokenSource, converge_unit

    _, system = make_host(tmp_path)
    unit = REGISTRY["k8s-join"]
    s = unit.decode_settings(json.dumps(K8S))
    actx = ApplyContext(tokens=StagedTokenSource(system))
    ctx = UnitContext(allowed_clusters=ALLOWED)
    converge_unit(unit, s, system, ctx, actx)
    r = converge_unit(unit, s, system, ctx, actx)
    assert r.issues[0].message == "k8s-join: the node has not staged the bootstrap token yet"
    system.write_atomic("/var/lib/bcd-hostconfig/k8s/bootstrap-token", b"abcdef.0123456789abcdef\n", 0o600)
    assert converge_unit(unit, s, system, ctx, actx).ok
    assert not system.exists("/var/lib/bcd-hostconfig/k8s/bootstrap-token")
