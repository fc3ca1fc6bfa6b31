"""The host units' answers to the catalogue's open questions (docs/host.md "Decisions on open questions").

Each test names the question it pins down (Q-HST-...) and the requirements it touches. Everything runs
on the simulated host (hostunits_support.make_host).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.sections.host import HelperExecutor, HostSection, converge_host
from bcd_agent.sections.host.intent import HelperHostSend, answer_of
from bcd_shared.errors import HelperRefused, StepError
from bcd_shared.units import REGISTRY, UnitContext
from bcd_shared.units.distro import Distro, family_of, install_commands
from bcd_simhost.gpus import gpu_uuid, update_state
from hostunits_support import ALLOWED, make_host, plan, run


def _refusal(unit: str, settings: object) -> str:
    with pytest.raises(StepError) as exc:
        REGISTRY[unit].decode_settings(json.dumps(settings))
    assert exc.value.terminal
    return exc.value.message


# -- kernel-modules


def test_HST_MOD_18_dashes_and_underscores_alike(tmp_path: Path) -> None:
    """Q-HST-MOD-02: module names match with `-` and `_` alike (the refused options, /sys/module, the
    modprobe.d line); a refused option is refused whatever its value; option keys take no dashes."""
    root, system = make_host(tmp_path)
    for module in ("vfio_iommu_type1", "vfio-iommu-type1"):
        for value in ("1", "0"):
            msg = _refusal("kernel-modules", {"options": {module: f"allow_unsafe_interrupts={value}"}})
            assert "allow_unsafe_interrupts is refused" in msg
    assert "option key" in _refusal("kernel-modules", {"options": {"vfio": "enable-unsafe-noiommu-mode=1"}})
    (root / "sys/module/vfio_iommu_type1").mkdir()
    s = {"load": ["vfio-iommu-type1"], "options": {"vfio-iommu-type1": "disable_hugepages=1"}}
    (root / "sys/module/vfio_iommu_type1/parameters").mkdir()
    (root / "sys/module/vfio_iommu_type1/parameters/disable_hugepages").write_text("Y\n")
    (root / "sys/module/vfio_iommu_type1/refcnt").write_text("0\n")
    p = plan(system, "kernel-modules", s)
    assert not [s for s in p.steps if s.describe().startswith("run modprobe")]  # loaded as vfio_iommu_type1
    assert run(system, "kernel-modules", s).ok
    lines = (system.read_text("/etc/modprobe.d/bcd.conf") or "").splitlines()
    assert lines[1:] == ["options vfio_iommu_type1 disable_hugepages=1"]
    assert (system.read_text("/etc/modules-load.d/bcd.conf") or "").splitlines()[1:] == ["vfio-iommu-type1"]


def test_HST_MOD_13_reload_after_the_options_file(tmp_path: Path) -> None:
    """Q-HST-MOD-03: the reload is `modprobe -r -- <name>` then `modprobe -- <name>`, planned after the
    options file is written (modprobe reads /etc/modprobe.d/bcd.conf when it loads)."""
    root, system = make_host(tmp_path)
    (root / "sys/module/kvm_intel/parameters/nested").write_text("0\n")
    s = {"load": ["kvm_intel"], "options": {"kvm_intel": "nested=1"}}
    assert [step.describe() for step in plan(system, "kernel-modules", s).steps] == [
        "write /etc/modules-load.d/bcd.conf",
        "write /etc/modprobe.d/bcd.conf",
        "run modprobe -r -- kvm_intel",
        "run modprobe -- kvm_intel",
    ]
    assert run(system, "kernel-modules", s).ok
    assert (root / "sys/module/kvm_intel/parameters/nested").read_text().strip() == "1"


# -- sysctl


def test_HST_SYS_10_missing_key_still_in_the_drop_in(tmp_path: Path) -> None:
    """Q-HST-SYS-02: a key the kernel lacks is still written to 90-bcd.conf (it applies at the next
    boot once its module loads); the unit retries it meanwhile."""
    _, system = make_host(tmp_path)
    r = run(system, "sysctl", {"net.bridge.bridge-nf-call-iptables": 1, "vm.swappiness": 5})
    assert [i.kind for i in r.issues] == ["retryable"]
    lines = (system.read_text("/etc/sysctl.d/90-bcd.conf") or "").splitlines()
    assert lines[1:] == ["net.bridge.bridge-nf-call-iptables = 1", "vm.swappiness = 5"]


def test_HST_SYS_05_39_numbers_and_hardened_values(tmp_path: Path) -> None:
    """Q-HST-SYS-03: a whole float is written as an integer, another float as Python's repr; hardened
    values compare as integers whatever JSON type carried them; a non-integer hardened value is refused.
    Covers HST-SYS-37: a lowering value is refused with the catalogue's message, a keeping one accepted."""
    s = REGISTRY["sysctl"].decode_settings('{"vm.a": 0.5, "vm.b": 2.0, "vm.c": 1e3}')
    assert s.values == (("vm.a", "0.5"), ("vm.b", "2"), ("vm.c", "1000"))
    for value in ("0", " 0 ", 0, 0.0, False):
        s = REGISTRY["sysctl"].decode_settings(json.dumps({"dev.tty.ldisc_autoload": value}))
        assert s.values == (("dev.tty.ldisc_autoload", "0"),)
    for value in ("0.5", 0.5, "off", True):
        assert "is refused: it would lower the host's defenses" in _refusal(
            "sysctl", {"dev.tty.ldisc_autoload": value}
        )


# -- hugepages


def test_HST_HP_11_update_grub_wins_and_the_drop_in_line(tmp_path: Path) -> None:
    """Q-HST-HP-02: with both tools update-grub is used (grubby is not run); the drop-in appends to
    GRUB_CMDLINE_LINUX like cpu's. (With neither, the failure is retryable: the HP-13 test.)"""
    root, system = make_host(tmp_path)
    (root / "usr/sbin/grubby").write_text("#!/bin/sh\n")
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")
    run(system, "hugepages", {"pages1g": 4})
    dropin = (system.read_text("/etc/default/grub.d/90-bcd-hugepages.cfg") or "").splitlines()
    assert dropin[1:] == ['GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX hugepagesz=1G hugepages=4"']
    assert not (root / "var/lib/bcd-sim/grubby-args.json").exists()


def test_HST_HP_15_reboot_message(tmp_path: Path) -> None:
    """Q-HST-HP-03: the whole reboot message (the 2 MiB shortfall's is in hugepages.Set2MPages)."""
    root, system = make_host(tmp_path)
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("1\n")
    r = run(system, "hugepages", {"pages1g": 4})
    assert [(i.kind, i.message) for i in r.issues] == [
        (
            "reboot",
            "hugepages: 4 pages of 1 GiB could not be allocated now (1 allocated); "
            "the boot loader reserves them from the next boot: reboot the node",
        )
    ]


def test_HST_HP_23_24_zero_pages_keep_the_mount(tmp_path: Path) -> None:
    """Q-HST-HP-04: `pages1g: 0` leaves the dev-hugepages1G.mount unit enabled, started and in place."""
    root, system = make_host(tmp_path)
    assert run(system, "hugepages", {"pages1g": 2}).ok
    before = (root / "var/lib/bcd-sim/systemd/log").read_text()
    r = run(system, "hugepages", {"pages1g": 0})
    assert r.ok and system.exists("/etc/systemd/system/dev-hugepages1G.mount")
    after = (root / "var/lib/bcd-sim/systemd/log").read_text()[len(before) :]
    assert "dev-hugepages1G.mount" not in after  # not disabled, stopped or reloaded
    assert plan(system, "hugepages", {"pages1g": 0}).converged


# -- cpu


def test_HST_CPU_07_18_governor_without_isolate_removes_isolation(tmp_path: Path) -> None:
    """Q-HST-CPU-02: a unit with a governor but no `isolate` removes bcd's earlier isolation arguments;
    a unit without a governor leaves the CPUs' governors alone."""
    root, system = make_host(tmp_path)
    gov = root / "sys/devices/system/cpu/cpu5/cpufreq/scaling_governor"
    gov.write_text("powersave\n")
    run(system, "cpu", {"isolate": "2-3"})
    assert gov.read_text().strip() == "powersave"  # no governor: left alone
    assert system.exists("/etc/default/grub.d/90-bcd-cpu.cfg")
    assert run(system, "cpu", {"governor": "performance"}).ok
    assert not system.exists("/etc/default/grub.d/90-bcd-cpu.cfg")
    assert not system.exists("/var/lib/bcd-hostconfig/bootargs/cpu")
    assert gov.read_text().strip() == "performance"


# -- nvidia-driver


@pytest.mark.parametrize(
    ("os_release", "family"),
    [
        ({"ID": "ubuntu", "ID_LIKE": "debian"}, "ubuntu"),
        ({"ID": "debian"}, "debian"),
        ({"ID": "pop", "ID_LIKE": "ubuntu debian"}, "debian"),
        ({"ID": "rocky", "ID_LIKE": "rhel centos fedora"}, "rhel"),
        ({"ID": "fedora"}, "rhel"),
        ({"ID": "ol", "ID_LIKE": "fedora"}, "rhel"),
        ({"ID": "sles", "ID_LIKE": "suse"}, "suse"),
        ({"ID": "opensuse-leap", "ID_LIKE": "suse opensuse"}, "suse"),
        ({"ID": "alpine"}, "unknown"),
        ({}, "unknown"),
    ],
)
def test_HST_DRV_07_family_from_os_release(os_release: dict[str, str], family: str) -> None:
    """Q-HST-DRV-02: `ID` first, then the words of `ID_LIKE`."""
    assert family_of(os_release) == family


def test_HST_DRV_13_17_suse_branch_checked_on_the_installed_module(tmp_path: Path) -> None:
    """Q-HST-DRV-02: SUSE's package names carry no branch; the module the packages leave is checked
    before anything is unloaded, and another branch is terminal (a reboot would not help)."""
    root, system = make_host(tmp_path)
    (root / "etc/os-release").write_text('ID="sles"\nID_LIKE="suse"\nVERSION_ID="15.6"\n')
    s = {"branch": "570", "open": True}
    assert [step.describe() for step in plan(system, "nvidia-driver", s).steps] == [
        "run zypper --non-interactive install nvidia-open-driver-G06-signed-kmp-default "
        "nvidia-compute-utils-G06",
        "load NVIDIA driver branch 570",
    ]
    loaded_before = (root / "proc/driver/nvidia/version").read_text()
    r = run(system, "nvidia-driver", s)
    [issue] = r.issues
    assert issue.kind == "terminal"
    assert issue.message.startswith("nvidia-driver: the driver packages installed ")
    assert issue.message.endswith(
        "not branch 570 (open); the SUSE packages carry no branch: pin the driver version in the "
        "repository, or ask for branch " + issue.message.split("installed ")[1][:3]
    )
    assert (root / "proc/driver/nvidia/version").read_text() == loaded_before  # nothing unloaded


def test_HST_DRV_01_15_apt_options_and_required_branch() -> None:
    """Q-HST-DRV-03: `--force-confold` travels as `-o Dpkg::Options::=--force-confold`; `branch` is
    required (the in-use message is pinned by the DRV-20 test)."""
    [update, install] = install_commands(Distro("ubuntu", "24.04", "ubuntu"), ("nvidia-open-570",))
    assert update == ("apt-get", "update")
    assert install[install.index("-o") + 1] == "Dpkg::Options::=--force-confold"
    assert _refusal("nvidia-driver", {}) == "branch: required"
    assert _refusal("nvidia-driver", {"open": True}) == "branch: required"


# -- mig-layout


def test_HST_MIG_03_16_19_all_disabled_destroys_first_busy_keeps_mode(tmp_path: Path) -> None:
    """Q-HST-MIG-02: `all-disabled` destroys a GPU's instances before turning MIG off; a GPU a live hold
    uses keeps its mode; instances compare by GPU-instance profile only (not the compute split)."""
    root, system = make_host(tmp_path)
    assert [s.describe() for s in plan(system, "mig-layout", {"layout": "all-disabled"}).steps] == [
        "partition GPU 7 as nothing",
        "turn MIG mode off on GPU 7",
    ]
    busy = UnitContext(busy_gpus=frozenset({f"{gpu_uuid(7)}/gi1/ci0"}), allowed_clusters=ALLOWED)
    p = plan(system, "mig-layout", {"layout": "all-disabled"}, busy)
    assert p.steps == () and [i.kind for i in p.issues] == ["retryable"]
    layout = {"layout": "mixed:3g.71gb+2g.35gb+2x1g.18gb"}  # GPU 7's instances as seeded

    def no_compute_instances(state: dict[str, object]) -> None:
        for m in state["gpus"][7]["migs"]:  # type: ignore[index]
            m["compute_instance"] = None

    update_state(root, no_compute_instances)
    assert not [s for s in plan(system, "mig-layout", layout).steps if s.describe().endswith("GPU 7")]


# -- the section under bcd helper


def test_HST_HLP_02_RBT_07_terminal_only_when_every_issue_is(tmp_path: Path) -> None:
    """Q-HST-HLP-03: the helper's answer carries each issue's kind; the node calls the unit terminal
    only when every issue is, a reboot wait by the phrase `reboot the node`, anything else (a helper
    refusal included) retryable.
    Covers HST-RBT-07."""
    _, system = make_host(tmp_path)
    answers = {
        "cpu": {"issues": [{"kind": "terminal", "message": "cpu: governor x is not offered by cpu0"}]},
        "sysctl": {
            "issues": [
                {"kind": "terminal", "message": "sysctl: bad"},
                {"kind": "retryable", "message": "sysctl: this kernel has no x.y"},
            ]
        },
        "iommu": {"issues": [{"kind": "reboot", "message": "iommu: on from the next boot: reboot the node"}]},
    }
    sent: list[str] = []

    def send(name: str, settings: str | None, busy: frozenset[str]) -> object:
        sent.append(name)
        return answer_of(answers[name])

    ex = HelperExecutor(system, send, UnitContext(allowed_clusters=ALLOWED))  # type: ignore[arg-type]
    settings = {"cpu": '{"governor": "performance"}', "sysctl": '{"vm.swappiness": 7}', "iommu": "{}"}
    kinds = {name: ex.converge(name, text).issues[0].kind for name, text in settings.items()}
    assert kinds == {"cpu": "terminal", "sysctl": "retryable", "iommu": "reboot"}
    assert sent == ["cpu", "sysctl", "iommu"]  # none converged as the node sees it
    assert answer_of({"issues": [], "changed": True}).ok

    class Refusing:
        def host_unit(self, *args: object) -> dict[str, object]:
            raise HelperRefused("settings-mismatch", "host.unit: the signed spec names other settings")

    refused = HelperHostSend(Refusing(), tmp_path)("sysctl", '{"vm.swappiness": 7}', frozenset())
    assert not refused.ok and not refused.terminal and refused.message.startswith("helper: host.unit: ")


def test_HST_HLP_15_units_false_empty_section_converged(tmp_path: Path) -> None:
    """Q-HST-HLP-01: with `[host] units = false` a host section without units is CONVERGED."""
    _, system = make_host(tmp_path)
    ex = HelperExecutor(system, lambda *a: answer_of({}), UnitContext())  # never called
    assert converge_host(HostSection(), ex, host_units=False).state is SectionState.CONVERGED
