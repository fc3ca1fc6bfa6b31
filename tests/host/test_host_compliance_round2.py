"""Host-config catalogue items that had no test naming them (docs/compliance.md), second round.

Everything runs on the simulated host (hostunits_support.make_host), whose tools answer in the formats
their modules document (bcd_simhost). `Recording` wraps the simulated host's System to see the
programs a unit runs, in order, and to make one of them answer as a misbehaving host would.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.host import (
    DirectExecutor,
    HelperAnswer,
    HelperExecutor,
    HostConverger,
    HostSection,
    converge_host,
)
from bcd_agent.sections.host.wire import from_wire
from bcd_shared import wire
from bcd_shared.system import CommandResult, LocalSystem
from bcd_shared.units import REGISTRY, ApplyContext, UnitContext
from bcd_shared.units.k8s import JOIN_YAML, RECORD, RELEASE_KEY, STAGED_TOKEN
from hostunits_support import ALLOWED, K8S, PIN, SERVER, FakeTokens, make_host, plan, run


class Recording:
    """The simulated host's System, recording each program run (argv, result); `after` may change the
    host after a program ran (a host that answers as a misbehaving one would)."""

    def __init__(self, inner: LocalSystem, after: Callable[[Sequence[str]], None] | None = None) -> None:
        self.inner = inner
        self.after = after
        self.calls: list[tuple[list[str], CommandResult]] = []

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        res = self.inner.run(argv, **kw)
        self.calls.append((list(argv), res))
        if self.after is not None:
            self.after(argv)
        return res

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _executor(system: object) -> DirectExecutor:
    return DirectExecutor(system, UnitContext(allowed_clusters=ALLOWED), ApplyContext(tokens=FakeTokens()))  # type: ignore[arg-type]


def _gpus(root: Path) -> list[dict[str, Any]]:
    gpus: list[dict[str, Any]] = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())["gpus"]
    return gpus


def _set_gpus(root: Path, change: Callable[[list[dict[str, Any]]], None]) -> None:
    path = root / "var/lib/bcd-sim/gpus.json"
    state = json.loads(path.read_text())
    change(state["gpus"])
    path.write_text(json.dumps(state))


# -- the spec and the section


def test_HST_SRC_01_nodespec_host_units_applied_by_the_host_converger(tmp_path: Path) -> None:
    """NodeSpec.host on the wire (unit names, settings as canonical JSON) becomes the section the host
    converger applies."""
    _, system = make_host(tmp_path)
    section = wire.HostSection(
        units=[
            wire.HostUnit(name="sysctl", settings='{"vm.swappiness":13}'),
            wire.HostUnit(name="kernel-modules", settings='{"load":["tun"]}'),
        ]
    )
    desired = from_wire(section)
    assert desired.units == (("sysctl", '{"vm.swappiness":13}'), ("kernel-modules", '{"load":["tun"]}'))
    out = HostConverger(lambda busy: _executor(system)).converge(desired, object(), object())
    assert out.state is SectionState.CONVERGED and out.changed
    assert (system.read_text("/proc/sys/vm/swappiness") or "").strip() == "13"
    assert system.exists("/sys/module/tun")


def test_HST_STAT_09_HP_08_failure_while_applying_recorded_and_the_pass_goes_on(tmp_path: Path) -> None:
    """hugepages fails while it applies (the kernel allocated fewer 2 MiB pages than written: memory
    short, a retryable failure); gpu-settings, after it in the order, still applies."""
    root, system = make_host(tmp_path)
    (root / "var/lib/bcd-sim/hugepages-2m-limit").write_text("100\n")
    spec = HostSection(
        (("hugepages", json.dumps({"pages2m": 512})), ("gpu-settings", json.dumps({"powerLimitWatts": 450})))
    )
    out = converge_host(spec, _executor(system))
    assert out.state is SectionState.PROGRESSING and out.reason == "UnitsFailed"
    assert "holds 100 pages, not 512 (memory fragmented or short)" in out.message, out.message
    assert all(g["power_limit"] == 450 for g in _gpus(root))  # the next unit applied
    r = run(system, "hugepages", {"pages2m": 512})
    assert [i.kind for i in r.issues] == ["retryable"]  # HST-HP-08: read back, short, retried
    (root / "var/lib/bcd-sim/hugepages-2m-limit").unlink()  # memory freed: the next pass converges
    assert converge_host(spec, _executor(system)).state is SectionState.CONVERGED


def test_HST_LVL_01_plan_compares_with_what_the_host_shows_now(tmp_path: Path) -> None:
    """After converging, a change in each source the plans read (a file bcd owns, /proc/sys, /sys, the
    loaded modules, nvidia-smi) makes the next plan non-empty, with no new spec."""
    root, system = make_host(tmp_path)
    units: dict[str, dict[str, Any]] = {
        "kernel-modules": {"load": ["tun"]},
        "sysctl": {"vm.swappiness": 5},
        "hugepages": {"transparent": "never"},
        "gpu-settings": {"powerLimitWatts": 450},
    }
    for name, s in units.items():
        assert run(system, name, s).ok
        assert plan(system, name, s).converged
    (root / "etc/modules-load.d/bcd.conf").unlink()  # a file bcd owns
    assert not plan(system, "kernel-modules", units["kernel-modules"]).converged
    assert run(system, "kernel-modules", units["kernel-modules"]).ok
    system.run(["modprobe", "-r", "--", "tun"])  # the loaded modules
    assert not system.exists("/sys/module/tun")
    assert not plan(system, "kernel-modules", units["kernel-modules"]).converged
    (root / "proc/sys/vm/swappiness").write_text("60\n")  # /proc/sys
    assert not plan(system, "sysctl", units["sysctl"]).converged
    (root / "sys/kernel/mm/transparent_hugepage/enabled").write_text("[always] madvise never\n")  # /sys
    assert not plan(system, "hugepages", units["hugepages"]).converged

    def reset(gpus: list[dict[str, Any]]) -> None:
        gpus[2]["power_limit"] = 700

    _set_gpus(root, reset)  # what nvidia-smi shows
    steps = [s.describe() for s in plan(system, "gpu-settings", units["gpu-settings"]).steps]
    assert steps == ["run nvidia-smi -i 2 -pl 450"]


def test_HST_LVL_17_units_act_only_through_the_system_interface() -> None:
    """Every unit module reads and changes the host only through its `System` argument: none opens
    files, runs programs or touches the file system by itself. The simulated host (a LocalSystem over a
    directory with scripted tools) stands in for the host in every unit test."""
    forbidden = re.compile(
        r"\bimport subprocess\b|\bsubprocess\.|\bos\.(system|popen|remove|unlink|rename|replace|makedirs|"
        r"mkdir|chmod|chown|listdir|scandir|walk|stat)\b|(?<![.\w])open\(|\bPath\(|\bshutil\."
    )
    modules = {inspect.getmodule(type(unit)) for unit in REGISTRY.values()}
    from bcd_shared.units import _base, _unit, bootargs, distro, nvsmi

    for module in [*modules, _base, _unit, bootargs, distro, nvsmi]:
        assert module is not None
        source = inspect.getsource(module)
        hits = [m.group(0) for m in forbidden.finditer(source)]
        assert hits == [], f"{module.__name__}: {hits}"


# -- reboots


REBOOT_UNITS = {"hugepages", "cpu", "iommu", "gpu-settings", "nvidia-driver", "mig-layout"}


def test_HST_RBT_09_exactly_six_units_can_wait_for_a_reboot(tmp_path: Path) -> None:
    """Only the six units' modules raise RebootRequired or plan a `reboot` issue; each of the six does
    on the simulated host."""
    for name, unit in REGISTRY.items():
        module = inspect.getmodule(type(unit))
        shares = any(inspect.getmodule(type(REGISTRY[n])) is module for n in REBOOT_UNITS)
        # fabric-manager shares nvidia.py with nvidia-driver: its own class is what it can do
        source = inspect.getsource(type(unit) if shares and name not in REBOOT_UNITS else module)  # type: ignore[arg-type]
        can = "RebootRequired(" in source or '"reboot"' in source
        assert can == (name in REBOOT_UNITS), name
    root, system = make_host(tmp_path)
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")
    (root / "sys/module/nvidia/refcnt").write_text("3\n")
    waits = {
        "hugepages": {"pages1g": 2},
        "cpu": {"isolate": "2-3"},
        "iommu": {},
        "gpu-settings": {"ecc": False},
        "nvidia-driver": {"branch": "570", "open": True},
    }
    for name, s in waits.items():
        assert "reboot" in [i.kind for i in run(system, name, s).issues], name
    # mig-layout's reboot wait (HST-MIG-15) is tested in test_units_simhost.py
    # (test_HST_MIG_11_14_15_19_21_profile_busy_and_reset).


def test_HST_IOMMU_11_firmware_off_keeps_reporting_reboot_required(tmp_path: Path) -> None:
    """The arguments are set and the machine rebooted, but the firmware keeps VT-d off: no IOMMU shows
    in /sys/class/iommu, so the unit keeps reporting RebootRequired and does nothing else."""
    root, system = make_host(tmp_path)
    spec = HostSection((("iommu", "{}"),))
    first = converge_host(spec, _executor(system))
    assert [c.type for c in first.conditions] == ["RebootRequired"]
    grub = (root / "boot/grub/grub.cfg").read_text()
    assert "intel_iommu=on iommu=pt" in grub
    (root / "proc/cmdline").write_text(grub.split("linux /boot/vmlinuz ", 1)[1])  # the reboot
    for _ in range(2):
        out = converge_host(spec, _executor(system))
        assert out.state is SectionState.PROGRESSING and not out.changed
        assert [(c.type, c.reason) for c in out.conditions] == [("RebootRequired", "iommu")]
        assert "check the firmware enables VT-d or AMD-Vi" in out.conditions[0].message


def _stale_driver(system: LocalSystem) -> Callable[[Sequence[str]], None]:
    """After each `modprobe nvidia` the old driver is what the kernel shows (a module the initramfs
    keeps loading, say)."""
    before = system.read_text("/proc/driver/nvidia/version") or ""

    def after(argv: Sequence[str]) -> None:
        if list(argv[:1]) == ["modprobe"] and "-r" not in argv and system.exists("/proc/driver/nvidia"):
            system.write_atomic("/proc/driver/nvidia/version", before.encode())

    return after


def test_HST_DRV_22_23_driver_still_wrong_after_loading_waits_for_reboot(tmp_path: Path) -> None:
    """Covers HST-DRV-22 and HST-DRV-23: the loaded driver is still not the branch after loading: a
    RebootRequired naming `reboot the node`; the section stays PROGRESSING with the node condition, pass
    after pass (retried), until the machine reboots."""
    _, inner = make_host(tmp_path)
    system = Recording(inner, _stale_driver(inner))
    spec = HostSection((("nvidia-driver", json.dumps({"branch": "570", "open": True})),))
    r = run(system, "nvidia-driver", {"branch": "570", "open": True})
    assert [i.kind for i in r.issues] == ["reboot"]
    assert "the loaded driver is 590.48.01, not branch 570: reboot the node" in r.issues[0].message
    for _ in range(2):
        out = converge_host(spec, _executor(system))
        assert out.state is SectionState.PROGRESSING
        assert [(c.type, c.reason) for c in out.conditions] == [("RebootRequired", "nvidia-driver")]
        assert "reboot the node" in out.conditions[0].message
    # The in-use case (HST-DRV-20) is retried the same way.
    _, other = make_host(tmp_path / "in-use")
    (other.root / "sys/module/nvidia/refcnt").write_text("5\n")
    for _ in range(2):
        out = converge_host(spec, _executor(other))
        assert out.state is SectionState.PROGRESSING
        assert [(c.type, c.reason) for c in out.conditions] == [("RebootRequired", "nvidia-driver")]


# -- hugepages


def test_HST_HP_12_grubby_replaces_the_previous_arguments(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    (root / "usr/sbin/update-grub").unlink()
    (root / "usr/sbin/grubby").write_text("#!/bin/sh\n")
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("0\n")
    rec = Recording(system)
    assert [i.kind for i in run(rec, "hugepages", {"pages1g": 4}).issues] == ["reboot"]
    args = json.loads((root / "var/lib/bcd-sim/grubby-args.json").read_text())
    assert "hugepages=4" in args and "hugepagesz=1G" in args
    rec.calls.clear()
    run(rec, "hugepages", {"pages1g": 6})
    grubby = [argv for argv, _ in rec.calls if argv[0] == "grubby"]
    assert [a[1] for a in grubby] == ["--update-kernel=ALL", "--update-kernel=ALL"]
    assert grubby[0][2].startswith("--remove-args=") and "hugepages=4" in grubby[0][2]
    assert grubby[1][2].startswith("--args=") and "hugepages=6" in grubby[1][2]
    args = json.loads((root / "var/lib/bcd-sim/grubby-args.json").read_text())
    assert "hugepages=6" in args and "hugepages=4" not in args


def test_HST_HP_26_without_systemd_bcd_mounts_itself_after_each_boot(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    import shutil

    shutil.rmtree(root / "run/systemd/system")
    s = {"pages1g": 2}
    mount = "run mount -t hugetlbfs -o pagesize=1G hugetlbfs /dev/hugepages1G"
    assert mount in [st.describe() for st in plan(system, "hugepages", s).steps]
    assert run(system, "hugepages", s).ok
    assert not system.exists("/etc/systemd/system/dev-hugepages1G.mount")
    assert " /dev/hugepages1G hugetlbfs " in (system.read_text("/proc/mounts") or "")
    assert plan(system, "hugepages", s).converged
    mounts = (root / "proc/mounts").read_text()
    (root / "proc/mounts").write_text(
        "".join(line + "\n" for line in mounts.splitlines() if "/dev/hugepages1G" not in line)
    )  # a reboot: the mount is gone
    assert [st.describe() for st in plan(system, "hugepages", s).steps] == [
        "run mkdir -p /dev/hugepages1G",
        mount,
    ]
    assert run(system, "hugepages", s).ok and plan(system, "hugepages", s).converged


def test_HST_HP_30_per_numa_64_pages_fresh_and_long_running(tmp_path: Path) -> None:
    s = {"pages1g": 64, "perNuma": True}
    root, system = make_host(tmp_path / "fresh")
    assert run(system, "hugepages", s).ok
    for node in (0, 1):
        pool = root / f"sys/devices/system/node/node{node}/hugepages/hugepages-1048576kB/nr_hugepages"
        assert pool.read_text().strip() == "64"
    assert (
        " /dev/hugepages1G hugetlbfs " in (system.read_text("/proc/mounts") or "")
        or system.run(["systemctl", "is-active", "--quiet", "dev-hugepages1G.mount"]).ok
    )
    assert plan(system, "hugepages", s).converged
    root, system = make_host(tmp_path / "up-a-while")
    (root / "var/lib/bcd-sim/hugepages-1g-limit").write_text("10\n")  # fragmented memory
    r = run(system, "hugepages", s)
    assert [i.kind for i in r.issues] == ["reboot"]
    assert "hugepages=128" in (root / "boot/grub/grub.cfg").read_text()


# -- mig-layout, gpu-sharing


def test_HST_MIG_12_only_mig_capable_gpus(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)

    def no_mig(gpus: list[dict[str, Any]]) -> None:
        gpus[1]["mig_capable"] = False

    _set_gpus(root, no_mig)
    rows = system.run(
        ["nvidia-smi", "--query-gpu=index,mig.mode.current", "--format=csv,noheader"]
    ).stdout.decode()
    assert rows.splitlines()[1] == "1, [N/A]"
    p = plan(system, "mig-layout", {"layout": "all-7g.141gb"})
    assert not any("GPU 1 " in s.describe() or s.describe().endswith("GPU 1") for s in p.steps)
    assert run(system, "mig-layout", {"layout": "all-7g.141gb"}).ok
    gpus = _gpus(root)
    assert not gpus[1]["mig_enabled"] and not gpus[1].get("migs")
    assert all(g["mig_enabled"] for i, g in enumerate(gpus) if i != 1)
    assert plan(system, "mig-layout", {"layout": "all-7g.141gb"}).converged


def test_HST_MIG_17_compute_instances_destroyed_before_gpu_instances(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    rec = Recording(system)
    assert run(rec, "mig-layout", {"layout": "all-7g.141gb"}).ok
    # A GPU with MIG on and no instances: both destroys answer "Not Found", which counts as done.
    not_found = [
        argv for argv, res in rec.calls if argv[1:2] == ["mig"] and not res.ok and b"Not Found" in res.stderr
    ]
    assert not_found and {a[4] for a in not_found} <= {"-dci", "-dgi"}
    rec.calls.clear()
    assert run(rec, "mig-layout", {"layout": "all-3g.71gb"}).ok
    for index in range(8):
        ops = [argv[4] for argv, _ in rec.calls if argv[1:4] == ["mig", "-i", str(index)]]
        assert ops[:3] == ["-dci", "-dgi", "-cgi"], (index, ops)
    assert all([m["profile"] for m in g["migs"]] == ["3g.71gb", "3g.71gb"] for g in _gpus(root))


def test_HST_SHARE_15_timeslice_does_nothing_with_replicas(tmp_path: Path) -> None:
    root, system = make_host(tmp_path)
    before = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())
    rec = Recording(system)
    for replicas in (4, 16):
        r = run(rec, "gpu-sharing", {"mode": "timeslice", "replicas": replicas})
        assert r.ok and not r.changed
        assert plan(system, "gpu-sharing", {"mode": "timeslice", "replicas": replicas}).converged
    changing = [
        argv for argv, _ in rec.calls if argv[0] == "nvidia-smi" and not argv[1].startswith("--query")
    ]
    assert changing == []
    assert json.loads((root / "var/lib/bcd-sim/gpus.json").read_text()) == before  # default time slicing
    assert not system.exists("/etc/systemd/system/bcd-mps.service")


# -- k8s-join records


def _join(system: object, tokens: FakeTokens | None = None) -> Any:
    ctx = UnitContext(allowed_clusters=ALLOWED, identity_labels=(("bcd.dev/node-id", "n-1"),))
    result = None
    for _ in range(2):
        result = run(system, "k8s-join", K8S, ctx=ctx, tokens=tokens)
    return result


def test_HST_REC_01_06_08_join_records_in_the_state_dir(tmp_path: Path) -> None:
    """The unit's records live under /var/lib/bcd-hostconfig; k8s-join.json (0644) holds the cluster,
    Node name, labels, taints and GPU mode; k8s-release.key holds the pkgs.k8s.io key download."""
    root, system = make_host(tmp_path)
    for path in (RECORD, JOIN_YAML, RELEASE_KEY, STAGED_TOKEN):
        assert path.startswith("/var/lib/bcd-hostconfig/")
    assert _join(system).ok
    record = json.loads(system.read_text(RECORD) or "{}")
    assert record["node"] == "gpu-node-01" and record["taints"] == [["gpu", "true", "NoSchedule"]]
    assert record["cluster"] == SERVER and record["caCertSha256"] == PIN
    assert record["labels"]["team"] == "ml"
    assert (record["gpu"], record["gpuApi"]) == (True, "device-plugin")  # the GPU mode
    assert (root / RECORD.lstrip("/")).stat().st_mode & 0o777 == 0o644
    assert b"PGP PUBLIC KEY BLOCK" in (system.read_bytes(RELEASE_KEY) or b"")  # the curl download


def test_HST_REC_07_join_configuration_0600_only_while_kubeadm_join_runs(tmp_path: Path) -> None:
    root, inner = make_host(tmp_path)
    seen: list[tuple[bool, int]] = []

    class Watch(Recording):
        def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
            if list(argv[:2]) == ["kubeadm", "join"]:
                path = root / JOIN_YAML.lstrip("/")
                seen.append((path.exists(), path.stat().st_mode & 0o777 if path.exists() else 0))
                assert "JoinConfiguration" in path.read_text()
            return super().run(argv, **kw)

    system = Watch(inner)
    assert _join(system).ok
    assert seen == [(True, 0o600)]
    assert not inner.exists(JOIN_YAML)
    # A failed join leaves no configuration behind either.
    _, inner2 = make_host(tmp_path / "bad")
    r = _join(Watch(inner2), FakeTokens("not-a-token"))
    assert r.issues and not inner2.exists(JOIN_YAML)


def test_HST_REC_09_staged_token_written_as_k8s_token_0600() -> None:
    """The node stages the bootstrap token with the helper's file kind `k8s-token` (bcd_agent.nodeparts.host;
    tests/session/test_node_host_parts.py runs the staging); the helper writes that kind at
    k8s/bootstrap-token, mode 0600, and the helper's k8s-join reads it from there."""
    from bcd_agent.nodeparts.host import TOKEN_KIND
    from bcd_helper.ops.files import FILE_KINDS

    kind = FILE_KINDS[TOKEN_KIND]
    assert TOKEN_KIND == "k8s-token"
    assert kind.path("") == STAGED_TOKEN == "/var/lib/bcd-hostconfig/k8s/bootstrap-token"
    assert kind.mode == 0o600


def test_HST_CPU_06_isolate_rules_checked_again_on_the_node(tmp_path: Path) -> None:
    """The node decodes `isolate` itself: a list that breaks the rules fails the unit terminally (the
    section FAILED), whatever the control plane accepted, and nothing is written."""
    _, system = make_host(tmp_path)
    for bad, rule in (("4-2", "runs backwards"), ("8190-8192", "above 8191")):
        out = converge_host(HostSection((("cpu", json.dumps({"isolate": bad})),)), _executor(system))
        assert out.state is SectionState.FAILED and rule in out.message, out.message
        assert out.message.startswith("cpu: ")
    assert not system.exists("/var/lib/bcd-hostconfig/bootargs/cpu")


def test_HST_RMV_14_k8s_join_removal_under_the_helper_is_a_settings_less_host_unit(tmp_path: Path) -> None:
    """On a node bcd joined, k8s-join left out of the spec is cleaned with host.unit and no settings; on
    a node joined by someone else nothing is sent (HST-K8S-67)."""
    _, system = make_host(tmp_path)
    assert _join(system).ok
    sent: list[tuple[str, str | None]] = []

    def send(name: str, settings: str | None, busy: frozenset[str]) -> HelperAnswer:
        sent.append((name, settings))
        return HelperAnswer(True, "", changed=True)

    ex = HelperExecutor(system, send, UnitContext(allowed_clusters=ALLOWED))
    assert converge_host(HostSection(), ex).state is SectionState.CONVERGED
    assert ("k8s-join", None) in sent and all(settings is None for _, settings in sent)
    _, other = make_host(tmp_path / "other")
    other.write_atomic(
        "/etc/kubernetes/kubelet.conf", b"clusters:\n- cluster:\n    server: https://10.0.0.1:6443\n"
    )
    sent.clear()
    converge_host(HostSection(), HelperExecutor(other, send, UnitContext(allowed_clusters=ALLOWED)))
    assert sent == []
