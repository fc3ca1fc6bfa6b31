"""Host-config catalogue items that had no test naming them (docs/compliance.md), third round.

Everything runs on the simulated host (a copy of one hostunits_support.make_host seeded), whose tools
answer in the formats their modules document (bcd_simhost): plan, apply, plan again. `Recording` wraps
the simulated host's System to see the programs a unit runs, in order. The passes tests drive the real
host section with the real converge runner on trio's MockClock.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hostunits_support
import trio
import trio.testing
from bcd_agent.converge.runner import DRIFT_INTERVAL_S, RETRY_INTERVAL_S, ConvergeRunner
from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import DesiredSpec, NodeStatus, SectionOutcome, SectionState
from bcd_agent.sections.host import (
    DirectExecutor,
    HelperAnswer,
    HelperExecutor,
    HostConverger,
    HostSection,
    converge_host,
)
from bcd_shared.system import CommandResult, LocalSystem
from bcd_shared.units import STATE_DIR, ApplyContext, UnitContext
from bcd_simhost import sim_system
from hostunits_support import ALLOWED, PIN, SERVER, FakeTokens, plan, run

K8S = {
    "server": SERVER,
    "caCertSha256": PIN,
    "tokenRef": "secret://pool/k8s-token",
    "kubernetesVersion": "1.34.1",
}


_TEMPLATE: list[Path] = []


def make_host(tmp: Path) -> tuple[Path, LocalSystem]:
    """A freshly seeded simulated host: a copy of one seeded for this module (seeding fsyncs every file,
    which a throwaway host does not need; a copy is the same tree)."""
    if not _TEMPLATE:
        template = Path(tempfile.mkdtemp(prefix="bcd-round3-"))
        atexit.register(shutil.rmtree, template, True)
        hostunits_support.make_host(template)
        _TEMPLATE.append(template / "host")
    root = tmp / "host"
    shutil.copytree(_TEMPLATE[0], root, symlinks=True)
    return root, sim_system(root)


class Recording:
    """The simulated host's System, recording each program it runs."""

    def __init__(self, inner: LocalSystem) -> None:
        self.inner = inner
        self.argvs: list[list[str]] = []

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        self.argvs.append(list(argv))
        return self.inner.run(argv, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _executor(system: object) -> DirectExecutor:
    return DirectExecutor(system, UnitContext(allowed_clusters=ALLOWED), ApplyContext(tokens=FakeTokens()))  # type: ignore[arg-type]


def files(root: Path) -> dict[str, str]:
    """Every file and link under root: its content's digest, or the link's target."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "-> " + os.readlink(path)
            else:
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


# -- root's records


def test_HST_REC_02_no_unit_record_in_data_dir(tmp_path: Path) -> None:
    """Every unit that keeps a record (cpu, iommu, hugepages' boot reservation, container-toolkit's
    stamp, k8s-join) keeps it under /var/lib/bcd-hostconfig, and nothing in bcd's data_dir
    (/var/lib/bcd), where the node planted links named like the records, is written or followed."""
    root, system = make_host(tmp_path)
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")  # 1 GiB pages only at boot
    planted = root / "etc/planted"
    planted.mkdir()
    data_dir = root / "var/lib/bcd"
    data_dir.mkdir()
    for name in ("bootargs", "hugepages-1g-boot", "cdi-nvidia.stamp", "k8s-join.json", "k8s"):
        (data_dir / name).symlink_to(f"../../../etc/planted/{name}")  # relative: inside the simulated root
    before = files(root)
    run(system, "cpu", {"isolate": "4-7"})
    run(system, "iommu", {})
    run(system, "hugepages", {"pages1g": 4})
    assert run(system, "container-toolkit", {}).ok
    ctx = UnitContext(allowed_clusters=ALLOWED)
    for _ in range(2):  # packages first, then the join
        run(system, "k8s-join", K8S, ctx=ctx, tokens=FakeTokens())
    after = files(root)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    records = {p for p in changed if p.startswith(STATE_DIR.lstrip("/") + "/")}
    assert {
        "var/lib/bcd-hostconfig/bootargs/cpu",
        "var/lib/bcd-hostconfig/bootargs/iommu",
        "var/lib/bcd-hostconfig/hugepages-1g-boot",
        "var/lib/bcd-hostconfig/cdi-nvidia.stamp",
        "var/lib/bcd-hostconfig/k8s-join.json",
    } <= records
    assert not [p for p in changed if p.startswith("var/lib/bcd/")]
    assert list(planted.iterdir()) == []
    # Under /var/lib only root's records and the simulated host's own state (its packages, systemd) move.
    other = [p for p in changed if p.startswith("var/lib/") and not p.startswith(("var/lib/bcd-sim/",))]
    assert sorted(other) == sorted(records), other


# -- iommu

IOMMU_DROPIN = "/etc/default/grub.d/90-bcd-iommu.cfg"
IOMMU_RECORD = "/var/lib/bcd-hostconfig/bootargs/iommu"


def _vendor(root: Path, vendor: str | None) -> None:
    """/proc/cpuinfo of a host whose CPUs are `vendor`'s (None: an Arm host, no vendor_id line)."""
    lines = [] if vendor is None else [f"vendor_id\t: {vendor}"]
    (root / "proc/cpuinfo").write_text(
        "".join(f"processor\t: {i}\n" + "".join(f"{x}\n" for x in lines) + "\n" for i in range(2))
    )


def _grub_cmdline(system: LocalSystem) -> str:
    """The kernel command line the simulated update-grub generated."""
    cfg = system.read_text("/boot/grub/grub.cfg") or ""
    return cfg.split("linux /boot/vmlinuz ", 1)[1].strip() if "linux /boot/vmlinuz " in cfg else ""


def _grubby(root: Path) -> None:
    """A RHEL-family boot loader: grubby, no update-grub."""
    (root / "usr/sbin/update-grub").unlink()
    (root / "usr/sbin/grubby").write_text("#!/bin/sh\n")


def _grubby_args(root: Path) -> list[str]:
    path = root / "var/lib/bcd-sim/grubby-args.json"
    args: list[str] = json.loads(path.read_text()) if path.exists() else []
    return args


def test_HST_IOMMU_05_amd_and_hygon_get_amd_iommu_on(tmp_path: Path) -> None:
    for vendor in ("AuthenticAMD", "HygonGenuine"):
        root, system = make_host(tmp_path / vendor)
        _vendor(root, vendor)
        run(system, "iommu", {})
        assert _grub_cmdline(system).split()[3:] == ["amd_iommu=on", "iommu=pt"], vendor
        assert run(system, "iommu", {"passthrough": False}).issues[0].kind == "reboot"
        assert _grub_cmdline(system).split()[3:] == ["amd_iommu=on"], vendor
        assert "intel_iommu" not in (system.read_text(IOMMU_RECORD) or "")


def test_HST_IOMMU_06_arm_gets_only_iommu_pt(tmp_path: Path) -> None:
    """A CPU with no vendor_id line is not refused: it gets iommu=pt and nothing of a vendor's."""
    root, system = make_host(tmp_path)
    _vendor(root, None)
    r = run(system, "iommu", {})
    assert [i.kind for i in r.issues] == ["reboot"]
    assert _grub_cmdline(system).split()[3:] == ["iommu=pt"]
    (root / "sys/class/iommu/smmu3.0x0000000009050000").mkdir(parents=True)
    assert plan(system, "iommu", {}).converged


def test_HST_IOMMU_07_another_vendor_is_terminal_and_changes_nothing(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    _vendor(root, "CentaurHauls")
    before = files(root)
    recording = Recording(system)
    r = run(recording, "iommu", {})  # type: ignore[arg-type]
    assert [(i.kind, i.message) for i in r.issues] == [
        ("terminal", "iommu: CPU vendor CentaurHauls is not one bcd knows")
    ]
    assert recording.argvs == [] and files(root) == before


def test_HST_IOMMU_08_on_the_boot_loader_as_for_cpu(tmp_path: Path) -> None:
    """update-grub: the drop-in 90-bcd-iommu.cfg, then update-grub; grubby: --args on every kernel."""
    root, system = make_host(tmp_path / "grub")
    recording = Recording(system)
    run(recording, "iommu", {})  # type: ignore[arg-type]
    assert (system.read_text(IOMMU_DROPIN) or "").splitlines()[-1] == (
        'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX intel_iommu=on iommu=pt"'
    )
    assert recording.argvs == [["update-grub"]]
    assert "intel_iommu=on iommu=pt" in _grub_cmdline(system)
    root, system = make_host(tmp_path / "grubby")
    _grubby(root)
    recording = Recording(system)
    run(recording, "iommu", {})  # type: ignore[arg-type]
    assert recording.argvs == [["grubby", "--update-kernel=ALL", "--args=intel_iommu=on iommu=pt"]]
    assert _grubby_args(root) == ["intel_iommu=on", "iommu=pt"]
    assert not system.exists(IOMMU_DROPIN)


def test_HST_IOMMU_09_recorded_and_unchanged_arguments_plan_no_boot_loader_step(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    run(system, "iommu", {})
    assert (system.read_text(IOMMU_RECORD) or "").splitlines()[-1] == "intel_iommu=on iommu=pt"
    p = plan(system, "iommu", {})
    assert p.steps == () and [i.kind for i in p.issues] == ["reboot"]  # still waiting, nothing to set
    recording = Recording(system)
    run(recording, "iommu", {})  # type: ignore[arg-type]
    assert recording.argvs == []
    changed = plan(system, "iommu", {"passthrough": False})
    assert [s.describe() for s in changed.steps] == [
        "set kernel arguments 'intel_iommu=on' for iommu on the boot loader"
    ]
    # The record, not the drop-in, is what is compared: a record saying otherwise plans the step again.
    (root / IOMMU_RECORD.lstrip("/")).unlink()
    assert len(plan(system, "iommu", {}).steps) == 1


def test_HST_IOMMU_10_waits_for_a_reboot_until_sys_class_iommu_lists_one(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    _vendor(root, "AuthenticAMD")
    expected = (
        "iommu: the IOMMU is on from the next boot (amd_iommu=on iommu=pt): reboot the node; "
        "check the firmware enables VT-d or AMD-Vi"
    )
    r = run(system, "iommu", {})
    assert [(i.kind, i.message) for i in r.issues] == [("reboot", expected)]
    assert [(i.kind, i.message) for i in plan(system, "iommu", {}).issues] == [("reboot", expected)]
    (root / "sys/class/iommu/ivhd0").mkdir(parents=True)
    assert plan(system, "iommu", {}).converged


def test_HST_RMV_12_removing_iommu_takes_its_arguments_off_the_boot_loader(tmp_path: Path) -> None:
    """Leaving the spec removes the drop-in and runs update-grub (or grubby --remove-args), and the
    record; the running kernel keeps its IOMMU until the next boot."""
    root, system = make_host(tmp_path / "grub")
    run(system, "cpu", {"isolate": "4-7"})
    run(system, "iommu", {})
    (root / "sys/class/iommu/dmar0").mkdir(parents=True)
    recording = Recording(system)
    assert run(recording, "iommu", None).changed  # type: ignore[arg-type]
    assert recording.argvs == [["update-grub"]]
    assert not system.exists(IOMMU_DROPIN) and not system.exists(IOMMU_RECORD)
    cmdline = _grub_cmdline(system)
    assert "intel_iommu=on" not in cmdline and "iommu=pt" not in cmdline
    assert "nohz_full=4-7" in cmdline  # cpu's arguments stay
    assert system.exists("/sys/class/iommu/dmar0")
    assert plan(system, "iommu", None).steps == ()
    root, system = make_host(tmp_path / "grubby")
    _grubby(root)
    run(system, "iommu", {})
    run(system, "iommu", None)
    assert _grubby_args(root) == [] and not system.exists(IOMMU_RECORD)


# -- reboots


def _boot(root: Path, system: LocalSystem) -> None:
    """What a reboot does to the simulated host: the kernel runs with the command line update-grub
    generated, isolates the CPUs it names, and turns the IOMMU on when asked."""
    cmdline = _grub_cmdline(system)
    (root / "proc/cmdline").write_text(cmdline + "\n")
    for word in cmdline.split():
        if word.startswith("nohz_full="):
            (root / "sys/devices/system/cpu/isolated").write_text(word.split("=", 1)[1] + "\n")
        if word in ("intel_iommu=on", "amd_iommu=on"):
            (root / "sys/class/iommu/dmar0").mkdir(parents=True, exist_ok=True)


def test_HST_RBT_08_after_the_reboot_the_units_converge_and_the_condition_goes(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    spec = HostSection((("cpu", '{"isolate":"4-7"}'), ("iommu", "{}"), ("sysctl", '{"vm.swappiness":5}')))
    first = converge_host(spec, _executor(system))
    assert first.state is SectionState.PROGRESSING
    (reboot,) = [c for c in first.conditions if c.type == "RebootRequired"]
    assert reboot.reason == "cpu,iommu"
    again = converge_host(spec, _executor(system))  # no reboot yet: still waiting, nothing new to do
    assert again.state is SectionState.PROGRESSING and not again.changed
    assert [c.reason for c in again.conditions if c.type == "RebootRequired"] == ["cpu,iommu"]
    _boot(root, system)
    after = converge_host(spec, _executor(system))
    assert after.state is SectionState.CONVERGED, after.message
    assert [c for c in after.conditions if c.type == "RebootRequired"] == []
    assert not after.changed


# -- container-toolkit

CTK_CONFIG = "/etc/nvidia-container-runtime/config.toml"
ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
MOUNTS_KEY = "accept-nvidia-visible-devices-as-volume-mounts"


def _runtimes(root: Path, system: LocalSystem, *names: str) -> None:
    """Container runtimes installed as their packages lay them down: the binary and its service."""
    if "containerd" in names:
        assert system.run(["apt-get", "install", "-y", "containerd"]).ok
    if "docker" in names:
        (root / "usr/bin/dockerd").write_text("#!/bin/sh\n")
        (root / "lib/systemd/system/docker.service").write_text(
            "[Unit]\nDescription=Docker\n\n[Service]\nExecStart=/usr/bin/dockerd\n\n[Install]\n"
            "WantedBy=multi-user.target\n"
        )


def _toolkit_host(tmp: Path, *runtimes: str) -> tuple[Path, LocalSystem]:
    """A host with the toolkit installed (as its package lays it down) and the given runtimes."""
    root, system = make_host(tmp)
    assert system.run(["apt-get", "install", "-y", "nvidia-container-toolkit"]).ok
    _runtimes(root, system, *runtimes)
    return root, system


def _configures(argvs: list[list[str]]) -> list[list[str]]:
    return [
        a
        for a in argvs
        if a[:3] == ["nvidia-ctk", "runtime", "configure"] or a[:2] == ["systemctl", "restart"]
    ]


def test_HST_CTK_03_each_installed_runtime_is_configured(tmp_path: Path) -> None:
    """containerd (binary containerd) and Docker (binary dockerd) are configured when installed, and
    only then; the configuration each gets is its own file."""
    for installed in ((), ("containerd",), ("docker",), ("containerd", "docker")):
        _, system = _toolkit_host(tmp_path / ("-".join(installed) or "none"), *installed)
        recording = Recording(system)
        assert run(recording, "container-toolkit", {}).ok  # type: ignore[arg-type]
        configured = [a[3] for a in recording.argvs if a[:3] == ["nvidia-ctk", "runtime", "configure"]]
        assert configured == [f"--runtime={r}" for r in installed]
        assert ("nvidia-container-runtime" in (system.read_text("/etc/containerd/config.toml") or "")) == (
            "containerd" in installed
        )
        assert ("nvidia-container-runtime" in (system.read_text("/etc/docker/daemon.json") or "")) == (
            "docker" in installed
        )
        assert plan(system, "container-toolkit", {}).converged


def test_HST_CTK_04_05_configure_then_restart_each_runtime(tmp_path: Path) -> None:
    """nvidia-ctk runtime configure --runtime=<runtime> (with --cdi.enabled when cdi is on), each
    followed by that runtime's restart."""
    _, system = _toolkit_host(tmp_path / "cdi", "containerd", "docker")
    recording = Recording(system)
    run(recording, "container-toolkit", {})  # type: ignore[arg-type]
    assert _configures(recording.argvs) == [
        ["nvidia-ctk", "runtime", "configure", "--runtime=containerd", "--cdi.enabled"],
        ["systemctl", "restart", "containerd.service"],
        ["nvidia-ctk", "runtime", "configure", "--runtime=docker", "--cdi.enabled"],
        ["systemctl", "restart", "docker.service"],
    ]
    _, system = _toolkit_host(tmp_path / "legacy", "containerd", "docker")
    recording = Recording(system)
    run(recording, "container-toolkit", {"cdi": False})  # type: ignore[arg-type]
    assert _configures(recording.argvs) == [
        ["nvidia-ctk", "runtime", "configure", "--runtime=containerd"],
        ["systemctl", "restart", "containerd.service"],
        ["nvidia-ctk", "runtime", "configure", "--runtime=docker"],
        ["systemctl", "restart", "docker.service"],
    ]


def test_HST_CTK_06_a_configured_runtime_is_not_configured_again(tmp_path: Path) -> None:
    """A runtime whose configuration mentions nvidia-container-runtime is left alone, so turning cdi on
    after a legacy start neither reconfigures nor restarts it."""
    _, system = _toolkit_host(tmp_path, "containerd", "docker")
    run(system, "container-toolkit", {"cdi": False})
    containerd = system.read_text("/etc/containerd/config.toml")
    docker = system.read_text("/etc/docker/daemon.json")
    assert "enable_cdi" not in (containerd or "")
    recording = Recording(system)
    assert run(recording, "container-toolkit", {"cdi": True}).ok  # type: ignore[arg-type]
    assert _configures(recording.argvs) == []
    assert system.read_text("/etc/containerd/config.toml") == containerd
    assert system.read_text("/etc/docker/daemon.json") == docker
    # Configured by hand (the operator's own edit naming the runtime): left alone too.
    _, system = _toolkit_host(tmp_path / "hand", "containerd")
    (system.root / "etc/containerd").mkdir(parents=True, exist_ok=True)
    hand = 'version = 2\n# BinaryName = "/usr/bin/nvidia-container-runtime"\n'
    system.write_atomic("/etc/containerd/config.toml", hand.encode())
    recording = Recording(system)
    run(recording, "container-toolkit", {})  # type: ignore[arg-type]
    assert _configures(recording.argvs) == [] and system.read_text("/etc/containerd/config.toml") == hand


def _sets(argvs: list[list[str]]) -> list[list[str]]:
    return [a for a in argvs if a[:2] == ["nvidia-ctk", "config"]]


def test_HST_CTK_07_08_09_cdi_sets_both_keys_false_unless_the_file_says_so_and_restarts_nothing(
    tmp_path: Path,
) -> None:
    """The package's file has one key commented out at its permissive default and the other commented
    out as false: neither counts, both are set; once the file says false, neither is set again; setting
    them restarts no runtime (HST-CTK-09)."""
    _, system = _toolkit_host(tmp_path, "containerd")
    run(system, "container-toolkit", {})  # the runtime configured and restarted once
    # The file as the package ships it (nvidia-container-toolkit 1.17): both keys commented out.
    packaged = f"#{MOUNTS_KEY} = false\n#{ENVVAR_KEY} = true\ndisable-require = false\n"
    system.write_atomic(CTK_CONFIG, packaged.encode())
    recording = Recording(system)
    assert run(recording, "container-toolkit", {}).ok  # type: ignore[arg-type]
    assert _sets(recording.argvs) == [
        ["nvidia-ctk", "config", "--in-place", "--set", f"{ENVVAR_KEY}=false"],
        ["nvidia-ctk", "config", "--in-place", "--set", f"{MOUNTS_KEY}=false"],
    ]
    assert [a for a in recording.argvs if a[0] == "systemctl"] == []  # HST-CTK-09
    text = system.read_text(CTK_CONFIG) or ""
    assert f"\n{ENVVAR_KEY} = false" in "\n" + text and f"\n{MOUNTS_KEY} = false" in "\n" + text
    recording = Recording(system)
    assert run(recording, "container-toolkit", {}).ok  # type: ignore[arg-type]
    assert recording.argvs and _sets(recording.argvs) == []  # the file says so: nothing set
    # Only the one key that is not false is set.
    system.write_atomic(CTK_CONFIG, text.replace(f"{MOUNTS_KEY} = false", f"{MOUNTS_KEY} = true").encode())
    recording = Recording(system)
    run(recording, "container-toolkit", {})  # type: ignore[arg-type]
    assert _sets(recording.argvs) == [["nvidia-ctk", "config", "--in-place", "--set", f"{MOUNTS_KEY}=false"]]
    assert [a for a in recording.argvs if a[0] == "systemctl"] == []


def test_HST_CTK_11_12_cdi_spec_generated_as_json_and_the_old_yaml_removed(tmp_path: Path) -> None:
    root, system = _toolkit_host(tmp_path)
    (root / "etc/cdi/nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    recording = Recording(system)
    assert run(recording, "container-toolkit", {}).ok  # type: ignore[arg-type]
    generate = [a for a in recording.argvs if a[:3] == ["nvidia-ctk", "cdi", "generate"]]
    assert generate == [
        [
            "nvidia-ctk",
            "cdi",
            "generate",
            "--format=json",
            "--device-name-strategy=uuid",
            "--output=/etc/cdi/nvidia.json",
        ]
    ]
    spec = json.loads(system.read_text("/etc/cdi/nvidia.json") or "{}")
    assert spec["kind"] == "nvidia.com/gpu"
    assert not system.exists("/etc/cdi/nvidia.yaml")
    assert plan(system, "container-toolkit", {}).converged


def _stamp_now(system: LocalSystem) -> str:
    """SHA-256 of the loaded driver's version and `nvidia-smi -L`, worked out here from the host."""
    version = (system.read_text("/proc/driver/nvidia/version") or "").split("  ")[1].strip()
    listing = system.run(["nvidia-smi", "-L"]).stdout.decode()
    return hashlib.sha256(f"{version}\n{listing}".encode()).hexdigest()


def test_HST_CTK_13_14_stamp_records_driver_and_devices_and_a_change_regenerates_in_one_pass(
    tmp_path: Path,
) -> None:
    root, system = _toolkit_host(tmp_path)
    stamp = "/var/lib/bcd-hostconfig/cdi-nvidia.stamp"
    run(system, "container-toolkit", {})
    assert (system.read_text(stamp) or "").splitlines()[-1] == _stamp_now(system)
    first = system.read_text("/etc/cdi/nvidia.json")
    # A new MIG layout: the next pass of the unit generates the spec again and records the new stamp.
    run(system, "mig-layout", {"layout": "all-1g.18gb"})
    recording = Recording(system)
    assert run(recording, "container-toolkit", {}).ok  # type: ignore[arg-type]
    assert [a[:3] for a in recording.argvs].count(["nvidia-ctk", "cdi", "generate"]) == 1
    assert (system.read_text(stamp) or "").splitlines()[-1] == _stamp_now(system)
    assert system.read_text("/etc/cdi/nvidia.json") != first and "MIG-" in (
        system.read_text("/etc/cdi/nvidia.json") or ""
    )
    assert plan(system, "container-toolkit", {}).converged
    # A driver update (another version loaded): generated again too.
    path = root / "proc/driver/nvidia/version"
    path.write_text(path.read_text().replace("590.48.01", "590.65.02"))
    recording = Recording(system)
    assert run(recording, "container-toolkit", {}).ok  # type: ignore[arg-type]
    assert [a[:3] for a in recording.argvs].count(["nvidia-ctk", "cdi", "generate"]) == 1
    assert (system.read_text(stamp) or "").splitlines()[-1] == _stamp_now(system)
    assert plan(system, "container-toolkit", {}).converged


# -- hugepages

HP_DROPIN = "/etc/default/grub.d/90-bcd-hugepages.cfg"
HP_RECORD = "/var/lib/bcd-hostconfig/hugepages-1g-boot"
GLOBAL_1G = "sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages"


def _node_1g(n: int) -> str:
    return f"sys/devices/system/node/node{n}/hugepages/hugepages-1048576kB/nr_hugepages"


def test_HST_HP_09_gigantic_pages_tried_at_runtime_first_host_wide_or_per_numa_node(tmp_path: Path) -> None:
    """The count goes to the host's nr_hugepages, or with perNuma to each NUMA node's; when the kernel
    allocates them the boot loader is not touched."""
    root, system = make_host(tmp_path / "host-wide")
    recording = Recording(system)
    r = run(recording, "hugepages", {"pages1g": 4})  # type: ignore[arg-type]
    assert r.ok, r.issues
    assert (root / GLOBAL_1G).read_text().strip() == "4"
    assert ["update-grub"] not in recording.argvs
    assert not system.exists(HP_DROPIN) and not system.exists(HP_RECORD)
    assert plan(system, "hugepages", {"pages1g": 4}).converged
    root, system = make_host(tmp_path / "per-numa")
    global_before = (root / GLOBAL_1G).read_text()
    r = run(system, "hugepages", {"pages1g": 3, "perNuma": True})
    assert r.ok, r.issues
    assert [(root / _node_1g(n)).read_text().strip() for n in (0, 1)] == ["3", "3"]
    assert (root / GLOBAL_1G).read_text() == global_before  # the host-wide file is not written
    assert not system.exists(HP_DROPIN) and not system.exists(HP_RECORD)
    assert plan(system, "hugepages", {"pages1g": 3, "perNuma": True}).converged


def test_HST_HP_18_pages1g_0_removes_an_existing_boot_reservation(tmp_path: Path) -> None:
    root, system = make_host(tmp_path / "grub")
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")  # a long-running host: none at runtime
    assert run(system, "hugepages", {"pages1g": 4}).issues[0].kind == "reboot"
    assert "hugepagesz=1G hugepages=4" in _grub_cmdline(system)
    recording = Recording(system)
    r = run(recording, "hugepages", {"pages1g": 0})  # type: ignore[arg-type]
    assert r.ok and r.changed, r.issues
    assert ["update-grub"] in recording.argvs
    assert not system.exists(HP_DROPIN) and not system.exists(HP_RECORD)
    assert "hugepages=" not in _grub_cmdline(system)
    assert plan(system, "hugepages", {"pages1g": 0}).converged
    root, system = make_host(tmp_path / "grubby")
    _grubby(root)
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")
    run(system, "hugepages", {"pages1g": 2, "perNuma": True})
    assert _grubby_args(root) == ["hugepagesz=1G", "hugepages=4"]  # the host total
    run(system, "hugepages", {"pages1g": 0, "perNuma": True})
    assert _grubby_args(root) == [] and not system.exists(HP_RECORD)


# -- cpu


def test_HST_CPU_16_recorded_isolation_arguments_plan_no_boot_loader_step(tmp_path: Path) -> None:
    """Once the boot loader has the arguments and the record says so, the same list (in any spelling)
    plans no step, even while the CPUs wait for the reboot; another list plans the one step again."""
    _, system = make_host(tmp_path)
    run(system, "cpu", {"isolate": "4-7"})
    assert (system.read_text("/var/lib/bcd-hostconfig/bootargs/cpu") or "").splitlines()[-1] == (
        "isolcpus=managed_irq,domain,4-7 nohz_full=4-7 rcu_nocbs=4-7"
    )
    for spelling in ("4-7", "7,4-6", "4,5,6,7"):
        p = plan(system, "cpu", {"isolate": spelling})
        assert p.steps == () and [i.kind for i in p.issues] == ["reboot"], spelling
    recording = Recording(system)
    run(recording, "cpu", {"isolate": "4-7"})  # type: ignore[arg-type]
    assert recording.argvs == []
    assert [s.describe() for s in plan(system, "cpu", {"isolate": "4-8"}).steps] == [
        "set kernel arguments 'isolcpus=managed_irq,domain,4-8 nohz_full=4-8 rcu_nocbs=4-8' for cpu on "
        "the boot loader"
    ]


# -- what removing a unit leaves


def test_HST_RMV_07_removing_gpu_settings_leaves_power_limits_and_ecc(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    assert run(system, "gpu-settings", {"powerLimitWatts": 450, "ecc": False}).issues[0].kind == "reboot"
    gpus = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())["gpus"]
    assert {(g["power_limit"], g["ecc_pending"]) for g in gpus} == {(450.0, False)}
    recording = Recording(system)
    r = run(recording, "gpu-settings", None)  # type: ignore[arg-type]
    assert r.ok and not r.changed
    assert [a for a in recording.argvs if a[0] == "nvidia-smi" and ("-pl" in a or "-e" in a)] == []
    assert json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())["gpus"] == gpus


# -- level-triggered


def _inode(root: Path, path: str) -> tuple[int, int]:
    st = (root / path.lstrip("/")).stat()
    return st.st_ino, st.st_mtime_ns


def test_HST_LVL_02_a_unit_writes_and_runs_only_what_differs(tmp_path: Path) -> None:
    """One sysctl changed by hand: only that key is set again, the drop-in is not rewritten. One module
    unloaded: only it is loaded. One CPU's governor changed: only that file is written. Nothing differs:
    nothing is written or run."""
    root, system = make_host(tmp_path)
    sysctls = {"vm.swappiness": 10, "vm.max_map_count": 262144, "vm.overcommit_memory": 1}
    run(system, "sysctl", sysctls)
    run(system, "kernel-modules", {"load": ["tun", "vhost_net"]})
    run(system, "cpu", {"governor": "performance"})
    dropin = _inode(root, "/etc/sysctl.d/90-bcd.conf")
    modules = _inode(root, "/etc/modules-load.d/bcd.conf")
    governors = {
        n: _inode(root, f"/sys/devices/system/cpu/cpu{n}/cpufreq/scaling_governor") for n in range(64)
    }
    (root / "proc/sys/vm/swappiness").write_text("60\n")
    shutil.rmtree(root / "sys/module/vhost_net")
    (root / "sys/devices/system/cpu/cpu9/cpufreq/scaling_governor").write_text("powersave\n")
    recording = Recording(system)
    assert run(recording, "sysctl", sysctls).changed  # type: ignore[arg-type]
    assert run(recording, "kernel-modules", {"load": ["tun", "vhost_net"]}).changed  # type: ignore[arg-type]
    cpu = run(recording, "cpu", {"governor": "performance"})  # type: ignore[arg-type]
    assert cpu.steps_done == ("set /sys/devices/system/cpu/cpu9/cpufreq/scaling_governor to performance",)
    governor9 = str(root / "sys/devices/system/cpu/cpu9/cpufreq/scaling_governor")
    assert recording.argvs == [
        ["sysctl", "-w", "vm.swappiness=10"],
        ["modprobe", "--", "vhost_net"],
        ["tee", governor9],  # how the simulated host writes a kernel file
    ]
    assert _inode(root, "/etc/sysctl.d/90-bcd.conf") == dropin
    assert _inode(root, "/etc/modules-load.d/bcd.conf") == modules
    changed = [
        n
        for n in range(64)
        if _inode(root, f"/sys/devices/system/cpu/cpu{n}/cpufreq/scaling_governor") != governors[n]
    ]
    assert changed == [9]
    before = files(root)
    recording = Recording(system)
    for name, settings in (
        ("sysctl", sysctls),
        ("kernel-modules", {"load": ["tun", "vhost_net"]}),
        ("cpu", {"governor": "performance"}),
    ):
        assert not run(recording, name, settings).changed  # type: ignore[arg-type]
    assert files(root) == before
    assert [a for a in recording.argvs if a[:2] == ["sysctl", "-w"] or a[0] in ("modprobe", "tee")] == []


# -- passes: the converge runner driving the real host section over the simulated host
# (trio's MockClock: `autojump_clock` makes the 30-second and 10-minute waits take no real time).


class _OtherSection:
    """Another section (devices, instances) that converges on its own and records each pass it ran in."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.passes: list[int] = []

    def is_empty(self, desired: object | None) -> bool:
        return desired is None

    async def converge(
        self, desired: object | None, observation: Observation, ctx: PassContext
    ) -> SectionOutcome:
        self.passes.append(ctx.pass_number)
        return SectionOutcome(section=self.name, state=SectionState.CONVERGED)


def _runner(
    system: LocalSystem, spec: DesiredSpec, *others: _OtherSection
) -> tuple[ConvergeRunner, list[PassContext]]:
    """A runner with the real host section (units applied in-process) and `others`; the passes it ran."""
    seen: list[PassContext] = []
    host = HostConverger(lambda busy: _executor(system))

    class Watched:
        name = host.name
        is_empty = staticmethod(host.is_empty)

        @staticmethod
        def converge(desired: object | None, observation: object, ctx: PassContext) -> SectionOutcome:
            seen.append(ctx)
            return host.converge(desired, observation, ctx)

    async def observe() -> Observation:
        return Observation(parts={}, taken_monotonic=trio.current_time())

    runner = ConvergeRunner([Watched(), *others], observe, initial_spec=spec, sync_sections_in_thread=False)  # type: ignore[list-item]
    return runner, seen


def _host_spec(generation: int, *units: tuple[str, str], **others: object) -> DesiredSpec:
    return DesiredSpec(
        generation=generation, spec_hash=f"h{generation}", sections={"host": HostSection(units), **others}
    )


async def _until(runner: ConvergeRunner, passes: int) -> NodeStatus:
    status = runner.status.latest()
    while status is None or status.passes < passes:
        status = await runner.status.wait_newer(status.version if status else 0)
    return status


def _state(status: NodeStatus, section: str) -> SectionState:
    return next(s.state for s in status.sections if s.section == section)


async def test_HST_LVL_08_09_a_pass_when_bcd_starts_and_when_a_new_spec_arrives(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The first pass runs at start (and its change is followed at once by one more, for devices); a new
    spec runs a pass when it arrives, not at the next retry or drift pass."""
    root, system = make_host(tmp_path)
    runner, seen = _runner(system, _host_spec(1, ("sysctl", '{"vm.swappiness":13}')))
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        await trio.sleep(7)
        assert seen[0].reasons == {"start"} and seen[0].now_monotonic == t0
        assert all(p.now_monotonic == t0 for p in seen)
        assert (root / "proc/sys/vm/swappiness").read_text().strip() == "13"
        before = len(seen)
        assert runner.set_spec(_host_spec(2, ("sysctl", '{"vm.swappiness":14}')))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert seen[before].reasons == {"spec"} and seen[before].now_monotonic == t0 + 7
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "14"


async def test_HST_LVL_10_a_pass_every_30_seconds_while_the_host_section_is_progressing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A sysctl whose key the kernel does not have yet keeps `host` PROGRESSING: the runner comes back
    every 30 seconds, and the pass after the key appears sets it; converged, it waits for the drift pass."""
    root, system = make_host(tmp_path)
    key = "net.bridge.bridge-nf-call-iptables"
    runner, seen = _runner(system, _host_spec(1, ("sysctl", f'{{"{key}":0}}')))
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        await trio.sleep(2 * RETRY_INTERVAL_S - 1)
        status = runner.status.latest()
        assert status is not None and _state(status, "host") is SectionState.PROGRESSING
        (root / "proc/sys/net/bridge").mkdir(parents=True)  # br_netfilter loaded meanwhile
        (root / "proc/sys/net/bridge/bridge-nf-call-iptables").write_text("1\n")
        await trio.sleep(DRIFT_INTERVAL_S - RETRY_INTERVAL_S)
        status = runner.status.latest()
        assert status is not None and _state(status, "host") is SectionState.CONVERGED
        nursery.cancel_scope.cancel()
    assert (root / "proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() == "0"
    retries = [round(p.now_monotonic - t0, 3) for p in seen if "retry" in p.reasons]
    assert retries == [RETRY_INTERVAL_S, 2 * RETRY_INTERVAL_S]
    assert {round(p.now_monotonic - t0, 3) for p in seen} == {0, RETRY_INTERVAL_S, 2 * RETRY_INTERVAL_S}


async def test_HST_LVL_11_an_event_of_another_section_runs_a_pass_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A finished snapshot download (the instances section's trigger) runs a pass then, not at the next
    drift pass: a sysctl changed by hand meanwhile is set back at the event's time."""
    root, system = make_host(tmp_path)
    runner, seen = _runner(system, _host_spec(1, ("sysctl", '{"vm.swappiness":13}')))
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        await trio.sleep(5)
        before = len(seen)
        (root / "proc/sys/vm/swappiness").write_text("60\n")
        runner.trigger("snapshot-download")
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "13"
    assert seen[before].reasons == {"snapshot-download"} and seen[before].now_monotonic == t0 + 5


async def test_HST_STAT_14_the_host_section_never_holds_back_the_others(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A host section waiting for a reboot, or failed for good, leaves devices and instances to converge
    in the same passes; their state is theirs alone."""
    _, system = make_host(tmp_path)
    devices, instances = _OtherSection("devices"), _OtherSection("instances")
    spec = _host_spec(1, ("cpu", '{"isolate":"4-7"}'), devices=("gpu-0",), instances=("vm-1",))
    runner, _seen = _runner(system, spec, devices, instances)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        status = await _until(runner, 2)
        assert _state(status, "host") is SectionState.PROGRESSING
        assert _state(status, "devices") is SectionState.CONVERGED
        assert _state(status, "instances") is SectionState.CONVERGED
        assert devices.passes == instances.passes == [1, 2]
        assert runner.set_spec(
            _host_spec(2, ("cpu", '{"governor":"turbo"}'), devices=("gpu-0",), instances=("vm-1",))
        )
        status = await _until(runner, 3)
        assert _state(status, "host") is SectionState.FAILED
        assert _state(status, "devices") is SectionState.CONVERGED and devices.passes[-1] == 3
        nursery.cancel_scope.cancel()


# -- under bcd helper


class _NodeView:
    """The unprivileged node's view of the host: it reads (recorded) and may run query programs, and
    must change nothing (a write or removal fails the test)."""

    def __init__(self, inner: LocalSystem) -> None:
        self.inner = inner
        self.reads: list[str] = []

    def read_bytes(self, path: str) -> bytes | None:
        self.reads.append(path)
        return self.inner.read_bytes(path)

    def read_text(self, path: str) -> str | None:
        self.reads.append(path)
        return self.inner.read_text(path)

    def write_atomic(self, path: str, data: bytes, mode: int = 0o644) -> None:
        raise AssertionError(f"the node wrote {path}")

    def remove(self, path: str) -> bool:
        raise AssertionError(f"the node removed {path}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_HST_HLP_01_the_unprivileged_node_plans_every_unit_itself(tmp_path: Path) -> None:
    """Beside the helper the node observes and plans each unit from its own reads of the host, changes
    nothing, and sends root only the units its plan finds not converged (a hand edit included)."""
    root, system = make_host(tmp_path)
    units = (
        ("sysctl", '{"vm.swappiness":13}'),
        ("kernel-modules", '{"load":["tun"]}'),
        ("cpu", '{"governor":"performance"}'),
    )
    for name, settings in units:  # root applied them earlier
        run(system, name, json.loads(settings))
    sent: list[str] = []

    def send(name: str, settings: str | None, busy: frozenset[str]) -> HelperAnswer:
        sent.append(name)
        return HelperAnswer(True, changed=True)

    view = _NodeView(system)
    before = files(root)
    out = converge_host(HostSection(units), HelperExecutor(view, send, UnitContext(allowed_clusters=ALLOWED)))  # type: ignore[arg-type]
    assert out.state is SectionState.CONVERGED and sent == [] and files(root) == before
    for path in ("/proc/sys/vm/swappiness", "/etc/modules-load.d/bcd.conf", "/etc/sysctl.d/90-bcd.conf"):
        assert path in view.reads, path
    assert any(p.endswith("/cpufreq/scaling_governor") for p in view.reads)
    (root / "proc/sys/vm/swappiness").write_text("60\n")  # drift the node sees for itself
    (root / "sys/devices/system/cpu/cpu3/cpufreq/scaling_governor").write_text("powersave\n")
    before = files(root)
    converge_host(HostSection(units), HelperExecutor(view, send, UnitContext(allowed_clusters=ALLOWED)))  # type: ignore[arg-type]
    assert sent == ["sysctl", "cpu"]
    assert files(root) == before  # the node changed nothing itself


# -- what the inventory and admission read of the unit's pools


def test_HST_HP_28_the_inventory_reports_the_configured_pools_host_wide_and_per_numa_node(
    tmp_path: Path,
) -> None:
    from bcd_agent.inventory.handlers import collect_inventory

    def pools(system: LocalSystem) -> dict[tuple[int, int], int]:
        return {(p.page_size_bytes, p.numa_node): p.total for p in collect_inventory(system).hugepages}

    _, system = make_host(tmp_path / "host-wide")
    assert run(system, "hugepages", {"pages2m": 640, "pages1g": 3}).ok
    got = pools(system)
    assert (got[(2 << 20, -1)], got[(1 << 30, -1)]) == (640, 3)
    root, system = make_host(tmp_path / "per-numa")
    assert run(system, "hugepages", {"pages2m": 96, "pages1g": 2, "perNuma": True}).ok
    got = pools(system)
    assert [got[(2 << 20, n)] for n in (0, 1)] == [96, 96]
    assert [got[(1 << 30, n)] for n in (0, 1)] == [2, 2]
    # Host-wide is what the kernel's host file says (the simulated kernel does not add nodes up).
    assert got[(2 << 20, -1)] == int(
        (root / "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages").read_text()
    )
    assert {n for (_, n) in got} == {-1, 0, 1}


def test_HST_CPU_19_the_inventory_reports_the_isolated_cpus(tmp_path: Path) -> None:
    """The isolated CPUs the kernel shows (/sys/devices/system/cpu/isolated), not the ones the spec asks
    for: none until the reboot that applies the cpu unit's arguments, then its list, and the inventory's
    hash moves with it."""
    from bcd_agent.inventory.handlers import collect_inventory, inventory_hash

    root, system = make_host(tmp_path)
    before = collect_inventory(system)
    assert before.isolated_cpus == ""
    run(system, "cpu", {"isolate": "4-7,12"})
    assert collect_inventory(system).isolated_cpus == ""  # waiting for the reboot
    _boot(root, system)
    after = collect_inventory(system)
    assert after.isolated_cpus == "4-7,12"
    assert inventory_hash(after) != inventory_hash(before)
