"""`bcd bench host`: a no-op pass of the host section with all twelve units converged.

Seeds a simulated GPU host, converges a spec naming all twelve units (passes until nothing changes,
with the reboots the cpu and iommu units wait for simulated by writing what the kernel shows after
one), then times passes that find nothing to do. Target: noop_pass_ms <= 30 (median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bcd_shared.units import ApplyContext, UnitContext, parse_allowed_clusters

from bcd_agent.sections.host import DirectExecutor, HostSection, converge_host

TARGETS: dict[str, tuple[str, float]] = {"noop_pass_ms": ("<=", 30.0)}
PIN = "ab" * 32
SPEC = {
    "kernel-modules": {"load": ["vhost_net", "tun", "vfio-pci"], "options": {"kvm_intel": "nested=1"}},
    "sysctl": {"vm.swappiness": 10, "net.core.somaxconn": 8192},
    "hugepages": {"pages2m": 1024, "pages1g": 8, "transparent": "madvise", "perNuma": True},
    "cpu": {"governor": "performance", "isolate": "4-31,36-63"},
    "iommu": {"passthrough": True},
    "nvidia-driver": {"branch": "580", "open": True},
    "fabric-manager": {},
    "gpu-settings": {"powerLimitWatts": 600, "ecc": True},
    "mig-layout": {"from": "pool", "layout": "all-1g.18gb"},
    "gpu-sharing": {"mode": "timeslice", "replicas": 4},
    "container-toolkit": {"cdi": True},
    "k8s-join": {
        "server": "https://10.0.0.1:6443",
        "caCertSha256": PIN,
        "tokenRef": "secret://pool/k8s",
        "kubernetesVersion": "1.34.1",
        "nodeLabels": {"team": "ml"},
        "taints": ["gpu=true:NoSchedule"],
    },
}


class _Token:
    def fetch(self, token_ref: str) -> str:
        return "abcdef.0123456789abcdef"

    def consumed(self) -> None:
        return None


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    from bcd_simhost.hostsim import host_sim_system
    from bcd_simhost.seed import seed

    base = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="bcd-bench-host-"))
    root = base / "host"
    seed(root)
    system = host_sim_system(root)
    section = HostSection(
        tuple((n, json.dumps(s, sort_keys=True, separators=(",", ":"))) for n, s in SPEC.items())
    )
    executor = DirectExecutor(
        system,
        UnitContext(allowed_clusters=parse_allowed_clusters(f"https://10.0.0.1:6443#sha256:{PIN}")),
        ApplyContext(tokens=_Token()),
    )
    t0 = time.perf_counter()
    first = converge_host(section, executor)
    first_ms = (time.perf_counter() - t0) * 1000
    # The reboot the cpu and iommu units wait for: the kernel now shows the isolation and an IOMMU.
    system.write_atomic("/sys/devices/system/cpu/isolated", b"4-31,36-63\n")
    (root / "sys/class/iommu/dmar0").mkdir(parents=True, exist_ok=True)
    settle = 0
    out = first
    while settle < 5:
        settle += 1
        out = converge_host(section, executor)
        if not out.changed and out.state.value == "CONVERGED":
            break
    times = []
    for _ in range(30):
        t = time.perf_counter()
        out = converge_host(section, executor)
        times.append((time.perf_counter() - t) * 1000)
        if out.changed or out.state.value != "CONVERGED":
            raise RuntimeError(f"the no-op pass was not a no-op: {out.state.value} {out.message}")
    noop = statistics.median(times)
    return {
        "units": len(SPEC),
        "first_pass_ms": round(first_ms, 2),
        "settle_passes": settle,
        "noop_pass_ms": round(noop, 2),
        "noop_pass_p95_ms": round(sorted(times)[int(len(times) * 0.95) - 1], 2),
    }
