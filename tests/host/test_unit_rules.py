"""Table tests of every settings rule of the twelve units (host-config.md; HST-DEC-*, per-unit ids).

Each row: unit, settings JSON text, and a fragment of the terminal message (None: accepted).
"""

from __future__ import annotations

import json

import pytest
from bcd_shared.errors import TerminalError
from bcd_shared.units import REGISTRY, UnitContext, parse_allowed_clusters
from bcd_shared.units.cpu import format_cpulist, parse_cpulist
from bcd_shared.units.mig import Layout, largest_first, parse_layout

PIN = "ab" * 32
K8S = {"server": "https://10.0.0.1:6443", "caCertSha256": PIN, "tokenRef": "secret://k8s/join"}


def k8s(**kw: object) -> str:
    return json.dumps({**K8S, **kw})


ROWS: list[tuple[str, str, str, str | None]] = [
    # HST-DEC-02/03/04: strict decoding, for every unit
    ("HST-DEC-02", "kernel-modules", '{"load": [], "extra": 1}', "extra: unknown field"),
    ("HST-DEC-02", "hugepages", '{"pages2m": 1, "page1g": 2}', "page1g: unknown field"),
    ("HST-DEC-02", "fabric-manager", '{"x": true}', "x: unknown field"),
    ("HST-DEC-02", "container-toolkit", '{"cdi": true, "runtime": "x"}', "runtime: unknown field"),
    ("HST-DEC-03", "sysctl", '{"vm.swappiness": 10} {"x": 1}', "trailing data"),
    ("HST-DEC-03", "gpu-sharing", '{"mode": "mps"}x', "trailing data"),
    ("HST-DEC-04", "iommu", '{"passthrough": "yes"}', "passthrough: must be true or false"),
    ("HST-DEC-04", "cpu", "[1]", "must be a JSON object"),
    ("HST-DEC-04", "sysctl", '{"vm.swappiness": 1, "vm.swappiness": 2}', "appears twice"),
    ("HST-DEC-04", "sysctl", '{"vm.swappiness": NaN}', "not a JSON number"),
    # kernel-modules
    ("HST-MOD-02", "kernel-modules", json.dumps({"load": [f"m{i}" for i in range(65)]}), "at most 64"),
    ("HST-MOD-03", "kernel-modules", '{"load": ["Kvm"]}', "does not match"),
    ("HST-MOD-03", "kernel-modules", json.dumps({"load": ["a" * 65]}), "does not match"),
    ("HST-MOD-03", "kernel-modules", '{"load": ["vfio-pci", "kvm_intel"]}', None),
    (
        "HST-MOD-04",
        "kernel-modules",
        json.dumps({"options": {f"m{i}": "a=1" for i in range(65)}}),
        "at most 64",
    ),
    ("HST-MOD-05", "kernel-modules", '{"options": {"kvm": "a=$(x)"}}', "only letters, digits"),
    ("HST-MOD-06", "kernel-modules", json.dumps({"options": {"kvm": "a=" + "1" * 256}}), "at most 256"),
    ("HST-MOD-07", "kernel-modules", '{"options": {"kvm": "bad-key=1"}}', "option key"),
    ("HST-MOD-07", "kernel-modules", '{"options": {"kvm_intel": "nested=1 ept=Y"}}', None),
    ("HST-MOD-17", "kernel-modules", '{"options": {"vfio": "enable_unsafe_noiommu_mode=1"}}', "refused"),
    (
        "HST-MOD-18",
        "kernel-modules",
        '{"options": {"vfio_iommu_type1": "allow_unsafe_interrupts=1"}}',
        "refused",
    ),
    (
        "HST-MOD-18",
        "kernel-modules",
        '{"options": {"vfio-iommu-type1": "allow_unsafe_interrupts=0"}}',
        "refused",
    ),
    # sysctl
    ("HST-SYS-02", "sysctl", '{"VM.swappiness": 1}', "not a sysctl name"),
    ("HST-SYS-02", "sysctl", '{"swappiness": 1}', "not a sysctl name"),
    ("HST-SYS-02", "sysctl", '{"net.ipv4.conf.all.rp-filter": 1}', None),
    ("HST-SYS-03", "sysctl", json.dumps({"kernel.x": "a" * 4097}), "at most 4096"),
    ("HST-SYS-03", "sysctl", json.dumps({"kernel.x": "a\nb"}), "single line"),
    ("HST-SYS-04", "sysctl", '{"kernel.x": {"a": 1}}', "must be a number, a boolean or a string"),
    ("HST-SYS-04", "sysctl", '{"kernel.x": [1]}', "must be a number, a boolean or a string"),
    ("HST-SYS-14", "sysctl", '{"kernel.core_pattern": "|/bin/sh"}', "kernel.core_pattern is refused"),
    ("HST-SYS-15", "sysctl", '{"kernel.modprobe": "/x"}', "is refused"),
    ("HST-SYS-16", "sysctl", '{"kernel.usermodehelper.bset": "0"}', "is refused"),
    ("HST-SYS-17", "sysctl", '{"kernel.poweroff_cmd": "/x"}', "is refused"),
    ("HST-SYS-18", "sysctl", '{"kernel.hotplug": "/x"}', "is refused"),
    ("HST-SYS-19", "sysctl", '{"fs.binfmt_misc.status": 0}', "is refused"),
    ("HST-SYS-20", "sysctl", '{"fs.suid_dumpable": 2}', "is refused"),
    ("HST-SYS-21", "sysctl", '{"fs.protected_symlinks": 0}', "is refused"),
    ("HST-SYS-22", "sysctl", '{"kernel.randomize_va_space": 0}', "is refused"),
    ("HST-SYS-23", "sysctl", '{"kernel.kptr_restrict": 0}', "is refused"),
    ("HST-SYS-24", "sysctl", '{"kernel.dmesg_restrict": 0}', "is refused"),
    ("HST-SYS-25", "sysctl", '{"kernel.yama.ptrace_scope": 0}', "is refused"),
    ("HST-SYS-26", "sysctl", '{"kernel.kexec_load_disabled": 0}', "is refused"),
    ("HST-SYS-27", "sysctl", '{"kernel.unprivileged_bpf_disabled": 0}', "is refused"),
    ("HST-SYS-28", "sysctl", '{"kernel.perf_event_paranoid": -1}', "is refused"),
    ("HST-SYS-29", "sysctl", '{"kernel.sysrq": 1}', "is refused"),
    ("HST-SYS-30", "sysctl", '{"vm.mmap_min_addr": 0}', "is refused"),
    ("HST-SYS-31", "sysctl", '{"vm.unprivileged_userfaultfd": 1}', "is refused"),
    ("HST-SYS-32", "sysctl", '{"net.core.bpf_jit_harden": 0}', "is refused"),
    ("HST-SYS-33", "sysctl", '{"kernel.modules_disabled": 1}', "cannot be undone"),
    ("HST-SYS-34", "sysctl", '{"user.max_user_namespaces": 0}', "namespaces"),
    ("HST-SYS-35", "sysctl", '{"kernel.unprivileged_userns_clone": 1}', "namespaces"),
    ("HST-SYS-36", "sysctl", '{"kernel.apparmor_restrict_unprivileged_userns": 0}', "namespaces"),
    (
        "HST-SYS-38",
        "sysctl",
        '{"dev.tty.legacy_tiocsti": 1}',
        "dev.tty.legacy_tiocsti = 1 is refused: it would lower",
    ),
    ("HST-SYS-38", "sysctl", '{"dev.tty.legacy_tiocsti": 0}', None),
    ("HST-SYS-39", "sysctl", '{"dev.tty.ldisc_autoload": true}', "dev.tty.ldisc_autoload = 1 is refused"),
    ("HST-SYS-39", "sysctl", '{"dev.tty.ldisc_autoload": false}', None),
    ("HST-SYS-40", "sysctl", '{"kernel.io_uring_disabled": 0}', "kernel.io_uring_disabled = 0 is refused"),
    ("HST-SYS-40", "sysctl", '{"kernel.io_uring_disabled": "2"}', None),
    ("HST-SYS-41", "sysctl", '{"net.ipv4.ip_unprivileged_port_start": 80}', "= 80 is refused"),
    ("HST-SYS-41", "sysctl", '{"net.ipv4.ip_unprivileged_port_start": 1024}', None),
    # hugepages
    ("HST-HP-01", "hugepages", '{"pages2m": 16777217}', "outside 0 to 16777216"),
    ("HST-HP-01", "hugepages", '{"pages2m": 1.5}', "whole number"),
    ("HST-HP-02", "hugepages", '{"pages1g": -1}', "outside"),
    ("HST-HP-03", "hugepages", '{"transparent": "sometimes"}', "not one of always, madvise, never"),
    ("HST-HP-04", "hugepages", '{"perNuma": 1}', "true or false"),
    # cpu
    ("HST-CPU-01", "cpu", '{"governor": "userspace"}', "not one of"),
    ("HST-CPU-02", "cpu", '{"isolate": "4-63,68-127"}', None),
    ("HST-CPU-02", "cpu", '{"isolate": "4-2"}', "runs backwards"),
    ("HST-CPU-02", "cpu", '{"isolate": "a-b"}', "is not a CPU"),
    ("HST-CPU-03", "cpu", json.dumps({"isolate": ",".join(["1"] * 129)}), "at most 256"),
    ("HST-CPU-04", "cpu", '{"isolate": "8190-8192"}', "above 8191"),
    ("HST-CPU-05", "cpu", '{"isolate": "0-3"}', "isolate must not include CPU 0"),
    # iommu
    ("HST-IOMMU-01", "iommu", '{"passthrough": false}', None),
    # nvidia-driver
    ("HST-DRV-01", "nvidia-driver", '{"branch": "58"}', "does not match"),
    ("HST-DRV-01", "nvidia-driver", '{"branch": 580}', "must be a string"),
    ("HST-DRV-01", "nvidia-driver", '{"open": true}', "branch: required"),
    ("HST-DRV-02", "nvidia-driver", '{"branch": "580", "open": "yes"}', "true or false"),
    # fabric-manager
    ("HST-FM-01", "fabric-manager", "{}", None),
    # gpu-settings
    ("HST-GPUS-01", "gpu-settings", '{"powerLimitWatts": 0}', "outside 1 to 10000"),
    ("HST-GPUS-01", "gpu-settings", '{"powerLimitWatts": 10001}', "outside 1 to 10000"),
    ("HST-GPUS-02", "gpu-settings", '{"ecc": "on"}', "true or false"),
    # mig-layout
    ("HST-MIG-01", "mig-layout", '{"from": "node", "layout": ""}', "not one of pool, profile"),
    ("HST-MIG-02", "mig-layout", '{"from": "pool", "layout": ""}', None),
    ("HST-MIG-05", "mig-layout", '{"layout": "mixed:3g.40gb+2x2g.20gb"}', None),
    ("HST-MIG-06", "mig-layout", '{"layout": "mixed:9x1g.10gb"}', "outside 1 to 8"),
    ("HST-MIG-06", "mig-layout", '{"layout": "mixed:0x1g.10gb"}', "outside 1 to 8"),
    ("HST-MIG-07", "mig-layout", '{"layout": "mixed:5x1g.10gb+4x1g.10gb"}', "a layout holds 1 to 8"),
    ("HST-MIG-09", "mig-layout", '{"layout": "all-1g.10gb+me"}', "is not a MIG profile"),
    ("HST-MIG-09", "mig-layout", '{"layout": "mixed:1g.10gb+me"}', "is not [<n>x]"),
    ("HST-MIG-10", "mig-layout", '{"layout": "half"}', "is not all-disabled"),
    # gpu-sharing
    ("HST-SHARE-01", "gpu-sharing", "{}", "mode: required"),
    ("HST-SHARE-01", "gpu-sharing", '{"mode": "mig"}', "not one of mps, timeslice"),
    ("HST-SHARE-02", "gpu-sharing", '{"mode": "mps", "replicas": 49}', "outside 1 to 48"),
    ("HST-SHARE-02", "gpu-sharing", '{"mode": "mps", "replicas": 0}', "outside 1 to 48"),
    # container-toolkit
    ("HST-CTK-01", "container-toolkit", '{"cdi": 1}', "true or false"),
    # k8s-join
    ("HST-K8S-02", "k8s-join", k8s(server="http://10.0.0.1"), "not https://host"),
    ("HST-K8S-03", "k8s-join", k8s(server="https://u:p@10.0.0.1"), "credentials"),
    ("HST-K8S-03", "k8s-join", k8s(server="https://10.0.0.1/api"), "a path, query or fragment"),
    ("HST-K8S-03", "k8s-join", k8s(server="https://10.0.0.1?x=1"), "a path, query or fragment"),
    ("HST-K8S-04", "k8s-join", k8s(caCertSha256="sha256:" + PIN.upper()), None),
    ("HST-K8S-04", "k8s-join", k8s(caCertSha256="abc"), "64 hex digits"),
    ("HST-K8S-05", "k8s-join", k8s(tokenRef="vault://x"), "does not match"),
    ("HST-K8S-06", "k8s-join", k8s(kubernetesVersion="1.34.1"), None),
    ("HST-K8S-06", "k8s-join", k8s(kubernetesVersion="latest"), "does not match"),
    ("HST-K8S-07", "k8s-join", k8s(nodeLabels={f"l{i}": "v" for i in range(65)}), "at most 64"),
    (
        "HST-K8S-08",
        "k8s-join",
        k8s(nodeLabels={"kubernetes.io/role": "x"}),
        "kubernetes.io prefix is refused",
    ),
    ("HST-K8S-08", "k8s-join", k8s(nodeLabels={"node-role.kubernetes.io/gpu": ""}), "kubernetes.io prefix"),
    ("HST-K8S-08", "k8s-join", k8s(nodeLabels={"k8s.io/x": "y"}), "k8s.io prefix is refused"),
    ("HST-K8S-08", "k8s-join", k8s(nodeLabels={"team": "bad value!"}), "not a Kubernetes label value"),
    ("HST-K8S-09", "k8s-join", k8s(taints=["gpu=true:NoSchedule", "spot:PreferNoSchedule"]), None),
    ("HST-K8S-09", "k8s-join", k8s(taints=["gpu=true:Evict"]), "is not key[=value]"),
    ("HST-K8S-10", "k8s-join", k8s(taints=["gpu=a:NoSchedule", "gpu=b:NoSchedule"]), "appears twice"),
    ("HST-K8S-11", "k8s-join", k8s(gpu="no"), "true or false"),
    ("HST-K8S-12", "k8s-join", k8s(gpuApi="both"), "not one of device-plugin, dra"),
    (
        "HST-K8S-13",
        "k8s-join",
        json.dumps({"server": K8S["server"], "tokenRef": "secret://x"}),
        "caCertSha256: required",
    ),
]


@pytest.mark.parametrize(
    ("rid", "unit", "text", "fragment"), ROWS, ids=[f"{r[0]}-{i}" for i, r in enumerate(ROWS)]
)
def test_HST_DEC_settings_rules(rid: str, unit: str, text: str, fragment: str | None) -> None:
    """Covers HST-DEC-02..04 and each unit's settings rules (ids in the row)."""
    if fragment is None:
        REGISTRY[unit].decode_settings(text)
        return
    with pytest.raises(TerminalError) as exc:
        REGISTRY[unit].decode_settings(text)
    assert fragment in exc.value.message


def test_HST_SRC_03_ORD_01_registry_holds_twelve_units_in_order() -> None:
    """Covers HST-ORD-03/04/05/06/07/08: the fixed order puts each unit where the catalogue says."""
    from bcd_shared.units import ORDER

    assert ORDER == (
        "kernel-modules", "sysctl", "hugepages", "cpu", "iommu", "nvidia-driver", "fabric-manager",
        "gpu-settings", "mig-layout", "gpu-sharing", "container-toolkit", "k8s-join",
    )  # fmt: skip
    assert tuple(REGISTRY) == ORDER


def test_HST_SYS_05_06_values_rendered() -> None:
    s = REGISTRY["sysctl"].decode_settings(
        '{"vm.b": true, "vm.a": false, "net.x": "4096  131072\\t6291456", "vm.f": 2.0}'
    )
    assert s.values == (("net.x", "4096 131072 6291456"), ("vm.a", "0"), ("vm.b", "1"), ("vm.f", "2"))


def test_HST_CPU_cpulist_is_a_set() -> None:
    assert parse_cpulist("4-5,7") == parse_cpulist("4,5,7") == frozenset({4, 5, 7})
    assert format_cpulist(frozenset({4, 5, 6, 9, 11, 12})) == "4-6,9,11-12"


def test_HST_MIG_04_05_08_layout_grammar() -> None:
    assert parse_layout("all-disabled") == Layout("disabled")
    assert parse_layout("all-1g.10gb") == Layout("all", (("1g.10gb", 0),))
    assert parse_layout("mixed:3g.40gb+2x2g.20gb") == Layout("mixed", (("3g.40gb", 1), ("2g.20gb", 2)))
    assert largest_first(["1g.10gb", "3g.40gb", "2g.20gb", "1g.20gb"]) == (
        "3g.40gb",
        "2g.20gb",
        "1g.20gb",
        "1g.10gb",
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("https://10.0.0.1:6443#sha256:" + PIN, None),
        ("https://k8s.example.com#sha256:" + PIN + ",https://10.0.0.2:6443#sha256:" + PIN, None),
        ("https://10.0.0.1:6443#" + PIN, "must start with sha256:"),
        ("https://10.0.0.1:6443", "is not https://host"),
        ("http://10.0.0.1#sha256:" + PIN, "not https://host"),
    ],
)
def test_HST_K8S_54_55_allowed_clusters(text: str, error: str | None) -> None:
    if error is None:
        pins = parse_allowed_clusters(text)
        assert all(p.server.startswith("https://") and ":" in p.server[8:] for p in pins)
        return
    with pytest.raises(ValueError, match=error):
        parse_allowed_clusters(text)


def test_HST_K8S_56_58_59_allowed_clusters_checked() -> None:
    unit = REGISTRY["k8s-join"]
    s = unit.decode_settings(json.dumps(K8S))
    with pytest.raises(
        TerminalError, match="joining a Kubernetes cluster needs \\[kubernetes\\] allowed_clusters"
    ):
        unit.validate(s, UnitContext())
    other = parse_allowed_clusters("https://10.0.0.9:6443#sha256:" + PIN)
    with pytest.raises(TerminalError, match="is not in \\[kubernetes\\] allowed_clusters"):
        unit.validate(s, UnitContext(allowed_clusters=other))
    # Port 443 made explicit and the pin's case and prefix normalised on both sides (Q-HST-K8S-03).
    s443 = unit.decode_settings(
        json.dumps({**K8S, "server": "https://k8s.example.com", "caCertSha256": PIN.upper()})
    )
    unit.validate(
        s443,
        UnitContext(allowed_clusters=parse_allowed_clusters(f"https://k8s.example.com:443#sha256:{PIN}")),
    )
