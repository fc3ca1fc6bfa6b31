# ruff: noqa: E501  (tool output and fixture lines are kept whole)
"""Seed what the host-config units read on the simulated host (a SEEDERS row).

A Debian 12 GPU host: the GPUs of gpus.py (eight H200) on NVSwitches with the open driver 590.48.01
installed and loaded (the version nvidia-smi reports comes from the loaded driver),
an Intel CPU without the IOMMU on, acpi-cpufreq governors on every CPU, transparent huge pages
`madvise`, a swap partition, systemd as PID 1 (/run/systemd/system), update-grub, a host name,
and a few /proc/sys keys with the kernel's defaults. Idempotent: existing files are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

from bcd_shared.system import atomic_write

from .kmodtools import proc_version
from .seed import CPUS_PER_NODE, NUMA_NODES

SYSCTL_DEFAULTS = {
    "vm/swappiness": "60",
    "vm/max_map_count": "65530",
    "vm/overcommit_memory": "0",
    "net/ipv4/ip_forward": "0",
    "net/core/somaxconn": "4096",
    "net/ipv4/tcp_rmem": "4096\t131072\t6291456",
    "net/ipv4/ip_unprivileged_port_start": "1024",
    "kernel/pid_max": "4194304",
    "kernel/io_uring_disabled": "0",
    "dev/tty/legacy_tiocsti": "1",
    "dev/tty/ldisc_autoload": "1",
    "kernel/hostname": "gpu-node-01",
}
DRIVER = {"branch": "590", "version": "590.48.01", "open": True}  # the GPUs' driver (gpus.py)


def _put(root: Path, path: str, text: str, mode: int = 0o644) -> None:
    target = root / path.lstrip("/")
    if not target.exists():
        atomic_write(target, text.encode(), mode)


def seed_host(root: Path) -> None:
    root = Path(root)
    existing = root / "proc/driver/nvidia/version"
    driver = dict(DRIVER)
    if existing.exists():  # keep what another seeder says is loaded
        import re

        m = re.search(r"\b((\d{3})\.\d+(?:\.\d+)?)\b", existing.read_text().splitlines()[0])
        if m:
            driver = {
                "branch": m.group(2),
                "version": m.group(1),
                "open": "Open Kernel" in existing.read_text(),
            }
    for d in (
        "run/systemd/system",
        "etc/default/grub.d",
        "etc/modules-load.d",
        "etc/modprobe.d",
        "etc/sysctl.d",
        "sys/class/iommu",
    ):
        (root / d).mkdir(parents=True, exist_ok=True)
    _put(root, "/etc/hostname", "gpu-node-01\n")
    _put(root, "/usr/sbin/update-grub", "#!/bin/sh\n# simulated\n", 0o755)
    cpus = NUMA_NODES * CPUS_PER_NODE
    _put(
        root,
        "/proc/cpuinfo",
        "".join(
            f"processor\t: {i}\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n\n"
            for i in range(cpus)
        ),
    )
    for i in range(cpus):
        base = f"/sys/devices/system/cpu/cpu{i}/cpufreq"
        _put(root, f"{base}/scaling_governor", "schedutil\n")
        _put(
            root,
            f"{base}/scaling_available_governors",
            "conservative ondemand userspace powersave performance schedutil\n",
        )
    _put(root, "/sys/devices/system/cpu/isolated", "\n")
    _put(root, "/sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n")
    _put(
        root,
        "/proc/swaps",
        "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n/dev/sda2                               partition\t8388604\t\t0\t\t-2\n",
    )
    _put(
        root,
        "/proc/mounts",
        "/dev/sda1 / ext4 rw,relatime 0 0\nhugetlbfs /dev/hugepages hugetlbfs rw,relatime,pagesize=2M 0 0\n",
    )
    for key, value in SYSCTL_DEFAULTS.items():
        _put(root, f"/proc/sys/{key}", value + "\n")
    for mod, params in (("kvm", {}), ("kvm_intel", {"nested": "N"})):
        _put(root, f"/sys/module/{mod}/refcnt", "0\n")
        for k, v in params.items():
            _put(root, f"/sys/module/{mod}/parameters/{k}", v + "\n")
    sim = "/var/lib/bcd-sim"
    _put(root, f"{sim}/driver.json", json.dumps({"installed": driver, "loaded": driver}, indent=2) + "\n")
    _put(
        root,
        f"{sim}/packages.json",
        json.dumps(
            {f"nvidia-headless-{driver['branch']}-server-open": {"version": driver["version"], "held": False}}
        )
        + "\n",
    )
    _put(root, "/sys/module/nvidia/refcnt", "0\n")
    _put(root, "/sys/module/nvidia/version", str(driver["version"]) + "\n")
    _put(root, "/proc/driver/nvidia/version", proc_version(driver))
    for n in range(4):
        _put(
            root, f"/proc/driver/nvidia-nvswitch/devices/0000:0{5 + n}:00.0/information", "Binary: nvswitch\n"
        )
    _put(root, "/usr/bin/nvidia-persistenced", "#!/bin/sh\n# simulated\n", 0o755)
    _put(root, "/usr/bin/nvidia-cuda-mps-control", "#!/bin/sh\n# simulated\n", 0o755)
    _put(
        root,
        "/lib/systemd/system/nvidia-persistenced.service",
        "[Service]\nExecStart=/usr/bin/nvidia-persistenced\n\n[Install]\nWantedBy=multi-user.target\n",
    )
