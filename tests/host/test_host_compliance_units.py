"""Catalogue items of the host units that had no test naming them (docs/compliance.md).

Pure plans are checked with constructed observations; everything else on the simulated host
(hostunits_support.make_host), whose tools answer in the formats their modules document.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.host import (
    DirectExecutor,
    HelperAnswer,
    HelperExecutor,
    HostSection,
    converge_host,
)
from bcd_shared.system import DEFAULT_TOOL_TIMEOUT_S, LocalSystem
from bcd_shared.units import REGISTRY, ApplyContext, UnitContext
from bcd_shared.units.distro import Distro
from bcd_shared.units.gpusettings import GpuPower, GpuSettingsObserved, GpuSettingsSettings
from bcd_shared.units.nvidia import driver_packages
from hostunits_support import ALLOWED, FakeTokens, make_host, plan, run


def _executor(system: LocalSystem) -> DirectExecutor:
    return DirectExecutor(system, UnitContext(allowed_clusters=ALLOWED), ApplyContext(tokens=FakeTokens()))


def _gpus(root: Path) -> list[dict[str, Any]]:
    gpus: list[dict[str, Any]] = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())["gpus"]
    return gpus


def _systemd_log(root: Path) -> str:
    log = root / "var/lib/bcd-sim/systemd/log"
    return log.read_text() if log.exists() else ""


# -- gpu-settings (pure plans over what nvidia-smi showed)


def _gpu(index: str, limit: float | None, ecc: str = "Enabled") -> GpuPower:
    return GpuPower(
        index, limit, None if limit is None else 200.0, None if limit is None else 700.0, ecc, ecc
    )


def test_HST_GPUS_03_neither_setting_does_nothing() -> None:
    unit = REGISTRY["gpu-settings"]
    observed = GpuSettingsObserved((_gpu("0", 300.0),))
    assert unit.plan(GpuSettingsSettings(), observed).converged
    assert unit.plan(GpuSettingsSettings(), GpuSettingsObserved(None)).converged  # not even nvidia-smi


def test_HST_GPUS_08_09_within_a_watt_and_no_power_management_left_alone() -> None:
    unit = REGISTRY["gpu-settings"]
    observed = GpuSettingsObserved((_gpu("0", 449.5), _gpu("1", None), _gpu("2", 300.0)))
    p = unit.plan(GpuSettingsSettings(power_limit_watts=450), observed)
    assert [s.describe() for s in p.steps] == ["run nvidia-smi -i 2 -pl 450"]


def test_HST_GPUS_11_ecc_only_where_the_gpu_has_it() -> None:
    unit = REGISTRY["gpu-settings"]
    observed = GpuSettingsObserved((_gpu("0", 300.0, "[N/A]"), _gpu("1", 300.0, "Enabled")))
    p = unit.plan(GpuSettingsSettings(ecc=False), observed)
    assert [s.describe() for s in p.steps] == ["run nvidia-smi -i 1 -e 0"]
    assert [i.kind for i in p.issues] == ["reboot"] and "GPU(s) 1 " in p.issues[0].message
    assert unit.plan(GpuSettingsSettings(ecc=True), observed).converged


def test_HST_GPUS_10_limit_lost_on_reload_set_again(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    assert run(system, "gpu-settings", {"powerLimitWatts": 450}).ok
    state = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())
    for g in state["gpus"]:
        g["power_limit"] = g.get("default_power_limit", 700)  # the driver reloaded: defaults again
    (root / "var/lib/bcd-sim/gpus.json").write_text(json.dumps(state))
    assert not plan(system, "gpu-settings", {"powerLimitWatts": 450}).converged
    assert run(system, "gpu-settings", {"powerLimitWatts": 450}).ok
    assert all(g["power_limit"] == 450 for g in _gpus(root))


# -- mig-layout


def test_HST_MIG_13_mode_set_with_nvidia_smi_where_it_differs(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    p = plan(system, "mig-layout", {"layout": "all-7g.141gb"})
    modes = [s.describe() for s in p.steps if s.describe().startswith("turn MIG mode")]
    assert modes == [f"turn MIG mode on on GPU {i}" for i in range(7)]  # the seed's GPU 7 has MIG on
    assert run(system, "mig-layout", {"layout": "all-7g.141gb"}).ok
    assert all(g["mig_enabled"] for g in _gpus(root))
    assert run(system, "mig-layout", {"layout": "all-disabled"}).ok
    assert not any(g["mig_enabled"] for g in _gpus(root))


def test_HST_MIG_20_other_gpus_repartitioned_in_the_same_pass(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    run(system, "mig-layout", {"layout": "all-7g.141gb"})
    gpus = _gpus(root)
    busy = frozenset({f"{gpus[3]['uuid']}/gi0/ci0"})
    r = run(
        system,
        "mig-layout",
        {"layout": "all-3g.71gb"},
        ctx=UnitContext(busy_gpus=busy, allowed_clusters=ALLOWED),
    )
    assert [i.kind for i in r.issues] == ["retryable"]
    after = _gpus(root)
    assert [m["profile"] for m in after[3]["migs"]] == ["7g.141gb"]  # the busy one waits
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert [m["profile"] for m in after[i]["migs"]] == ["3g.71gb", "3g.71gb"]


# -- nvidia-driver


def test_HST_DRV_03_unset_open_accepts_either_flavor(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    assert run(system, "nvidia-driver", {"branch": "590", "open": True}).ok
    assert plan(system, "nvidia-driver", {"branch": "590"}).converged
    assert not plan(system, "nvidia-driver", {"branch": "590", "open": False}).converged


def test_HST_DRV_08_11_packages_per_family_and_flavor() -> None:
    ubuntu = Distro(id="ubuntu", version_id="24.04", family="ubuntu")
    debian = Distro(id="debian", version_id="12", family="debian")
    assert driver_packages(debian, "580", True) == ("nvidia-open-580",)
    assert driver_packages(debian, "580", False) == ("cuda-drivers-580",)
    # An unset `open` installs the proprietary flavor (the unit passes bool(None)).
    assert driver_packages(ubuntu, "570", bool(None)) == (
        "nvidia-headless-570-server",
        "nvidia-utils-570-server",
    )


def test_HST_DRV_08_unset_open_installs_proprietary_on_the_host(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "etc/os-release").write_text('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="24.04"\n')
    steps = [s.describe() for s in plan(system, "nvidia-driver", {"branch": "570"}).steps]
    assert any("nvidia-headless-570-server" in s and "-open" not in s for s in steps), steps


def test_HST_DRV_09_package_install_fails_retryably(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "etc/os-release").write_text('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="24.04"\n')
    installs = [
        s for s in plan(system, "nvidia-driver", {"branch": "570"}).steps if "install" in s.describe()
    ]
    assert installs and all(getattr(s, "failure", None) == "retryable" for s in installs)


# -- cpu, iommu, hugepages


def test_HST_CPU_14_no_boot_loader_tool_is_retried(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "usr/sbin/update-grub").unlink()
    r = run(system, "cpu", {"isolate": "2-3"})
    assert [i.kind for i in r.issues] == ["retryable"]
    assert "neither update-grub nor grubby" in r.issues[0].message


def test_HST_IOMMU_13_iommu_loads_no_vfio_pci(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    assert not system.exists("/sys/module/vfio_pci")
    p = plan(system, "iommu", {})
    assert not [s for s in p.steps if "modprobe" in s.describe() or "vfio" in s.describe()]
    run(system, "iommu", {})
    assert not system.exists("/sys/module/vfio_pci")


def test_HST_HP_09_1g_pages_at_runtime_first(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    assert run(system, "hugepages", {"pages1g": 4}).ok
    assert (root / "sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages").read_text().strip() == "4"
    assert not system.exists("/etc/default/grub.d/90-bcd-hugepages.cfg")  # no boot reservation needed


def test_HST_HP_17_boot_reservation_kept_in_step(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")
    run(system, "hugepages", {"pages1g": 4})
    assert "hugepages=4" in (system.read_text("/var/lib/bcd-hostconfig/hugepages-1g-boot") or "")
    run(system, "hugepages", {"pages1g": 6})
    assert "hugepages=6" in (system.read_text("/etc/default/grub.d/90-bcd-hugepages.cfg") or "")
    assert "hugepages=6" in (system.read_text("/var/lib/bcd-hostconfig/hugepages-1g-boot") or "")


def test_HST_HP_27_the_2m_mount_is_not_bcds(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    assert run(system, "hugepages", {"pages2m": 64, "pages1g": 2}).ok
    assert not system.exists("/etc/systemd/system/dev-hugepages.mount")
    assert "dev-hugepages.mount" not in _systemd_log(root)


# -- removal leaves the host as it is (HST-RMV)


def test_HST_RMV_02_04_05_08_removal_keeps_driver_pages_layout_governor(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    assert run(system, "nvidia-driver", {"branch": "590", "open": True}).ok
    assert run(system, "hugepages", {"pages2m": 128}).ok
    assert run(system, "mig-layout", {"layout": "all-7g.141gb"}).ok
    assert run(system, "cpu", {"governor": "performance"}).ok
    packages = (root / "var/lib/bcd-sim/packages.json").read_text()
    for name in ("nvidia-driver", "hugepages", "mig-layout", "cpu"):
        assert run(system, name, None).ok
    assert (root / "var/lib/bcd-sim/packages.json").read_text() == packages
    assert system.exists("/sys/module/nvidia")
    assert (root / "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages").read_text().strip() == "128"
    assert all(g["mig_enabled"] and [m["profile"] for m in g["migs"]] == ["7g.141gb"] for g in _gpus(root))
    governor = root / "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"
    assert governor.read_text().strip() == "performance"


def test_HST_RMV_03_06_removal_keeps_toolkit_and_fabric_manager(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    assert system.run(["apt-get", "install", "-y", "containerd"]).ok
    assert run(system, "container-toolkit", {}).ok
    assert run(system, "fabric-manager", {}).ok
    config = system.read_text("/etc/containerd/config.toml")
    packages = (root / "var/lib/bcd-sim/packages.json").read_text()
    assert run(system, "container-toolkit", None).ok and run(system, "fabric-manager", None).ok
    assert system.read_text("/etc/containerd/config.toml") == config
    assert (root / "var/lib/bcd-sim/packages.json").read_text() == packages
    assert system.run(["systemctl", "is-active", "nvidia-fabricmanager.service"]).ok


# -- container-toolkit


def test_HST_CTK_15_17_cdi_waits_for_the_driver_and_leaves_holds(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    assert system.run(["apt-get", "install", "-y", "containerd"]).ok
    hold = root / "etc/cdi/bcd-a-1.json"
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.write_text('{"cdiVersion": "0.6.0", "kind": "bcd.dev/hold", "devices": []}\n')
    shutil.rmtree(root / "sys/module/nvidia")
    r = run(system, "container-toolkit", {})
    assert r.issues and all(i.kind == "retryable" for i in r.issues), r.issues
    (root / "sys/module/nvidia").mkdir()
    assert run(system, "container-toolkit", {}).ok
    assert run(system, "container-toolkit", None).ok
    assert hold.read_text() == '{"cdiVersion": "0.6.0", "kind": "bcd.dev/hold", "devices": []}\n'


# -- the section


def test_HST_LVL_04_changed_setting_applied_next_pass(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    ex = _executor(system)
    converge_host(HostSection((("sysctl", '{"vm.swappiness": 10}'),)), ex)
    out = converge_host(HostSection((("sysctl", '{"vm.swappiness": 20}'),)), ex)
    assert out.state is SectionState.CONVERGED and out.changed
    assert (system.read_text("/proc/sys/vm/swappiness") or "").strip() == "20"


def test_HST_LVL_16_programs_bounded_to_20_minutes(tmp_path: Path) -> None:
    """Covers HST-LVL-16: LocalSystem.run's default bound, and a bound that ends a program."""
    assert DEFAULT_TOOL_TIMEOUT_S == 20 * 60
    assert inspect.signature(LocalSystem.run).parameters["timeout"].default == DEFAULT_TOOL_TIMEOUT_S
    res = LocalSystem().run(["sleep", "5"], timeout=0.2)
    assert not res.ok and res.returncode == 124


def test_HST_SRC_02_ORD_09_only_listed_units_one_action_each(tmp_path: Path) -> None:
    """Covers HST-SRC-02 and HST-ORD-09."""
    _, system = make_host(tmp_path)
    sent: list[str] = []

    def send(name: str, settings: str | None, busy: frozenset[str]) -> HelperAnswer:
        sent.append(name)
        return HelperAnswer(True, "", changed=True)

    ex = HelperExecutor(system, send, UnitContext(allowed_clusters=ALLOWED))
    spec = HostSection((("cpu", '{"governor": "performance"}'), ("sysctl", '{"vm.swappiness": 7}')))
    converge_host(spec, ex)
    assert sent == ["sysctl", "cpu"]  # exactly the listed units, each once, in the fixed order


def test_HST_HLP_14_units_false_sends_nothing(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    sent: list[str] = []

    def send(name: str, settings: str | None, busy: frozenset[str]) -> HelperAnswer:
        sent.append(name)
        return HelperAnswer(True, "")

    ex = HelperExecutor(system, send, UnitContext(allowed_clusters=ALLOWED))
    out = converge_host(HostSection((("sysctl", '{"vm.swappiness": 7}'),)), ex, host_units=False)
    assert out.state is SectionState.UNSUPPORTED and sent == []


def test_HST_STAT_05_15_retryable_failures_and_later_units_converge(tmp_path: Path) -> None:
    """A driver that waits for a reboot, a missing sysctl key and no loaded driver for fabric-manager
    keep the section PROGRESSING; units that do not need the new driver converge in the pass."""
    root, system = make_host(tmp_path)
    (root / "sys/module/nvidia/refcnt").write_text("12\n")  # the driver is in use
    spec = HostSection(
        (
            ("nvidia-driver", '{"branch": "570", "open": true}'),
            ("sysctl", '{"net.bridge.bridge-nf-call-iptables": 0, "vm.swappiness": 4}'),
            ("gpu-sharing", '{"mode": "mps", "replicas": 2}'),
        )
    )
    out = converge_host(spec, _executor(system))
    assert out.state is SectionState.PROGRESSING
    assert [c.type for c in out.conditions if c.type == "RebootRequired"] == ["RebootRequired"]
    assert (system.read_text("/proc/sys/vm/swappiness") or "").strip() == "4"
    assert system.run(["systemctl", "is-active", "bcd-mps.service"]).ok


def test_HST_RBT_01_no_unit_reboots_the_machine(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")
    spec = HostSection(
        (
            ("cpu", '{"isolate": "4-7"}'),
            ("hugepages", '{"pages1g": 2}'),
            ("iommu", "{}"),
            ("gpu-settings", '{"ecc": false}'),
        )
    )
    out = converge_host(spec, _executor(system))
    reboot = [c for c in out.conditions if c.type == "RebootRequired"]
    assert len(reboot) == 1 and reboot[0].reason == "hugepages,cpu,iommu,gpu-settings"
    assert not system.exists("/var/lib/bcd-sim/reboot-requested")
    assert " reboot" not in _systemd_log(root)


def test_HST_DEC_07_SYS_13_helper_decodes_with_the_same_registry() -> None:
    """Covers HST-DEC-07 and HST-SYS-13 (node side; the helper side: tests/helper)."""
    from bcd_helper.ops.hostunit import unit_registry

    assert unit_registry() is REGISTRY  # one decode and validation code for node and helper
    out = converge_host(
        HostSection((("sysctl", '{"kernel.core_pattern": "|/bin/sh"}'),)),
        HelperExecutor(LocalSystem(), lambda *a: HelperAnswer(True, ""), UnitContext()),
    )
    assert out.state is SectionState.FAILED and "kernel.core_pattern is refused" in out.message
