"""The host section: order, status table, conditions, removal, drift.

Covers HST-ORD, HST-STAT, HST-COND, HST-RBT and HST-LVL items named per test.
"""

from __future__ import annotations

import json
from pathlib import Path

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.host import (
    DirectExecutor,
    HelperAnswer,
    HelperExecutor,
    HostConverger,
    HostSection,
    converge_host,
    cut_utf8,
)
from bcd_shared.units import ApplyContext, UnitContext
from hostunits_support import ALLOWED, FakeTokens, make_host


def section(**units: object) -> HostSection:
    return HostSection(tuple((n.replace("_", "-"), json.dumps(s)) for n, s in units.items()))


def executor(system: object) -> DirectExecutor:
    return DirectExecutor(system, UnitContext(allowed_clusters=ALLOWED), ApplyContext(tokens=FakeTokens()))  # type: ignore[arg-type]


def test_HST_STAT_reboot_terminal_and_success_reported_per_the_status_table(tmp_path: Path) -> None:
    """Covers HST-STAT-03/07/08/10/11/12, HST-RBT-02..05, HST-COND-02: two units wait for a reboot,
    one fails terminally, one succeeds; PROGRESSING with one RebootRequired naming both waiting units,
    comma-separated, and carrying both their errors."""
    _, system = make_host(tmp_path)
    spec = section(
        cpu={"isolate": "8-15"},
        iommu={},
        gpu_settings={"powerLimitWatts": 9000},
        sysctl={"vm.swappiness": 7},
    )
    out = converge_host(spec, executor(system))
    assert out.state is SectionState.PROGRESSING
    cpu = 'cpu: CPUs 8-15 are isolated from the next boot (now: ""): reboot the node'
    iommu = (
        "iommu: the IOMMU is on from the next boot (intel_iommu=on iommu=pt): reboot the node; "
        "check the firmware enables VT-d or AMD-Vi"
    )
    assert out.message == f"{cpu}; {iommu}; gpu-settings: GPU 0 takes 200 to 700 W, not 9000"
    reboot = [c for c in out.conditions if c.type == "RebootRequired"]
    assert len(reboot) == 1 and reboot[0].reason == "cpu,iommu" and reboot[0].section == "host"
    assert reboot[0].message == f"{cpu}; {iommu}"
    assert (system.read_text("/proc/sys/vm/swappiness") or "").strip() == "7"  # the good unit converged
    assert out.changed


def test_HST_STAT_04_06_all_terminal_is_failed(tmp_path: Path) -> None:
    """Covers HST-DEC-06: an unknown unit name is that unit's terminal failure, reported by the section;
    HST-DEC-01: the node's section decodes each unit's settings itself, strictly (a field it does not
    know is refused, whatever the control plane accepted); HST-DEC-05: a unit whose settings fail
    applies nothing, not even its good keys."""
    _, system = make_host(tmp_path)
    swappiness = system.read_text("/proc/sys/vm/swappiness")
    pages = system.read_text("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
    out = converge_host(
        HostSection(
            (
                ("sysctl", '{"vm.swappiness": 7, "kernel.core_pattern": "x"}'),
                ("gpu-magic", "{}"),
                ("cpu", '{"governor": "x"}'),
                ("hugepages", '{"pages2m": 4, "pages2M": 4}'),  # a field the control plane may not know
            )
        ),
        executor(system),
    )
    assert out.state is SectionState.FAILED
    assert out.message.split("; ") == [
        "sysctl: kernel.core_pattern is refused: it names or controls a program the kernel runs as root",
        "hugepages: pages2M: unknown field",
        "cpu: governor: 'x' is not one of performance, schedutil, ondemand, powersave",
        "gpu-magic: not a config unit this bcd knows",
    ]
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")  # nothing half applied
    assert system.read_text("/proc/sys/vm/swappiness") == swappiness
    assert system.read_text("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages") == pages != "4\n"


def test_HST_STAT_13_unit_named_twice_fails_the_section(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    out = converge_host(HostSection((("sysctl", '{"vm.swappiness": 1}'), ("sysctl", "{}"))), executor(system))
    assert out.state is SectionState.FAILED and out.reason == "UnitNamedTwice"
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")


def test_HST_ORD_01_02_10_11_fixed_order_replanned_per_unit(tmp_path: Path) -> None:
    """sysctl listed before kernel-modules still runs after it and finds net.bridge.* in the same pass.

    Covers HST-ORD-03 and HST-STAT-02 (every unit converged: CONVERGED)."""
    _, system = make_host(tmp_path)
    spec = HostSection(
        (
            ("sysctl", '{"net.bridge.bridge-nf-call-iptables": 0}'),
            ("kernel-modules", '{"load": ["br_netfilter"]}'),
        )
    )
    out = converge_host(spec, executor(system))
    assert out.state is SectionState.CONVERGED, out.message
    assert (system.read_text("/proc/sys/net/bridge/bridge-nf-call-iptables") or "").strip() == "0"


def test_HST_COND_01_fabric_manager_and_mps_conditions(tmp_path: Path) -> None:
    import shutil

    root, system = make_host(tmp_path)
    shutil.rmtree(root / "sys/module/nvidia")
    (root / "usr/bin/nvidia-cuda-mps-control").unlink()
    out = converge_host(section(fabric_manager={}, gpu_sharing={"mode": "mps"}), executor(system))
    assert out.state is SectionState.PROGRESSING
    assert sorted((c.type, c.reason) for c in out.conditions) == [
        ("FabricManagerDown", "NotRunning"),
        ("MPSDown", "NotRunning"),
    ]


def test_HST_LVL_12_drift_repaired_without_a_new_spec(tmp_path: Path) -> None:
    """A sysctl changed by hand, a deleted drop-in, a stopped service: the next pass repairs them.

    Covers HST-LVL-05 (a hand-changed sysctl set back) and HST-LVL-06 (a deleted drop-in written again)."""
    root, system = make_host(tmp_path)
    spec = section(sysctl={"vm.swappiness": 3}, kernel_modules={"load": ["tun"]}, gpu_sharing={"mode": "mps"})
    assert converge_host(spec, executor(system)).state is SectionState.CONVERGED
    noop = converge_host(spec, executor(system))
    assert noop.state is SectionState.CONVERGED and not noop.changed  # HST-LVL-03
    (root / "proc/sys/vm/swappiness").write_text("60\n")
    (root / "etc/modules-load.d/bcd.conf").unlink()
    system.run(["systemctl", "stop", "bcd-mps.service"])
    out = converge_host(spec, executor(system))
    assert out.state is SectionState.CONVERGED and out.changed
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "3"
    assert system.exists("/etc/modules-load.d/bcd.conf")
    assert system.run(["systemctl", "is-active", "bcd-mps.service"]).ok


def test_HST_RMV_01_13_removal_is_level_triggered(tmp_path: Path) -> None:
    _, system = make_host(tmp_path)
    converge_host(
        section(
            sysctl={"vm.swappiness": 3}, gpu_sharing={"mode": "mps"}, gpu_settings={"powerLimitWatts": 300}
        ),
        executor(system),
    )
    out = converge_host(HostSection(), executor(system))
    assert out.state is SectionState.CONVERGED
    assert not system.exists("/etc/sysctl.d/90-bcd.conf") and not system.exists(
        "/etc/systemd/system/bcd-mps.service"
    )
    rows = system.run(
        ["nvidia-smi", "--query-gpu=power.limit", "--format=csv,noheader,nounits"]
    ).stdout.decode()
    assert set(rows.split()) == {"300.00"}  # HST-RMV-07: power limits stay


def test_HST_HLP_15_units_false_is_unsupported(tmp_path: Path) -> None:
    """Covers HST-HLP-17: the UNSUPPORTED state carries no condition (no SectionUnsupported)."""
    _, system = make_host(tmp_path)
    out = converge_host(section(sysctl={"vm.swappiness": 3}), executor(system), host_units=False)
    assert (
        out.state is SectionState.UNSUPPORTED
        and out.reason == "HostManagedExternally"
        and out.conditions == ()
    )
    assert not system.exists("/etc/sysctl.d/90-bcd.conf")
    assert converge_host(HostSection(), executor(system), host_units=False).state is SectionState.CONVERGED


def test_HST_HLP_02_RBT_07_helper_executor_sends_only_what_differs(tmp_path: Path) -> None:
    """Covers HST-RBT-07: the helper's text answer with `reboot the node` becomes RebootRequired."""
    _, system = make_host(tmp_path)
    sent: list[tuple[str, str | None]] = []

    def send(name: str, settings: str | None, busy: frozenset[str]) -> HelperAnswer:
        sent.append((name, settings))
        if name == "cpu":
            return HelperAnswer(
                False, 'cpu: CPUs 2 are isolated from the next boot (now: ""): reboot the node'
            )
        return HelperAnswer(False, "sysctl: kernel.core_pattern is refused", terminal=True)

    ex = HelperExecutor(system, send, UnitContext(allowed_clusters=ALLOWED))
    out = converge_host(section(cpu={"isolate": "2"}, kernel_modules={"load": []}), ex)
    assert [n for n, _ in sent] == ["cpu"]  # kernel-modules is converged as the node sees it
    assert out.state is SectionState.PROGRESSING
    assert [c.type for c in out.conditions] == ["RebootRequired"]


class NodeView:
    """The simulated host as the unprivileged node reads it: root's records directory,
    /var/lib/bcd-hostconfig (root:root 0700 on an installed host), refuses it."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def read_bytes(self, path: str) -> bytes | None:
        if path.startswith("/var/lib/bcd-hostconfig/"):
            raise PermissionError(13, "Permission denied", path)
        return self.inner.read_bytes(path)  # type: ignore[attr-defined, no-any-return]

    def read_text(self, path: str) -> str | None:
        data = self.read_bytes(path)
        return None if data is None else data.decode()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_helper_executor_lets_root_plan_what_the_node_cannot_read(tmp_path: Path) -> None:
    """Seen on the packages under a real systemd: the node's read of root's bootargs record (to clean the
    absent `cpu` unit) raised PermissionError and the whole host section stuck at InternalError. Now
    root plans those units; the one the node can read and finds converged is not sent."""
    _, system = make_host(tmp_path)
    assert executor(system).converge("sysctl", json.dumps({"vm.swappiness": 9})).issues == ()
    sent: list[str] = []

    def send(name: str, settings: str | None, busy: frozenset[str]) -> HelperAnswer:
        sent.append(name)
        return HelperAnswer(True, "")

    ex = HelperExecutor(NodeView(system), send, UnitContext(allowed_clusters=ALLOWED))
    out = converge_host(section(sysctl={"vm.swappiness": 9}), ex)
    assert out.state is SectionState.CONVERGED, out
    assert "cpu" in sent and "iommu" in sent and "sysctl" not in sent


def test_HST_RBT_06_message_cut_on_a_utf8_boundary() -> None:
    text = "é" * 600
    cut = cut_utf8(text)
    assert len(cut.encode()) <= 1024 and cut == "é" * 512


def test_HST_converger_for_the_runner(tmp_path: Path) -> None:
    """Covers HST-STAT-01: the converger reports the one section `host`."""
    _, system = make_host(tmp_path)
    conv = HostConverger(lambda busy: executor(system))
    assert conv.is_empty(None) and conv.is_empty(HostSection())
    out = conv.converge(section(sysctl={"vm.swappiness": 9}), object(), object())
    assert out.section == "host" and out.state is SectionState.CONVERGED and out.changed
