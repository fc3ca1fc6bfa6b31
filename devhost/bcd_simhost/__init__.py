"""The simulated host: a directory that stands for `/`, and fake programs that act on it.

`seed(root)` lays out a realistic GPU host (see seed.py); `sim_system(root)` returns a
`LocalSystem` rooted there whose programs are the fakes named in TOOLS. Each fake is a function
`(system, argv, stdin) -> CommandResult` in its own module; the table below names them so that a
fake is imported only when used. State that a real tool keeps in the kernel or a daemon (GPU
resets, loaded modules, running services) is kept under `<root>/var/lib/bcd-sim/` so that a person
can open the directory and see it.

Used by `bcd sim`, the benches and most tests; never by production code paths on a real host.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

from bcd_shared.system import CommandResult, FakeTool, LocalSystem

# program name -> "module:function" (modules under bcd_simhost). One literal table.
TOOLS: dict[str, str] = {
    "systemctl": "systemctl:systemctl",
    "nvidia-smi": "nvidia_smi:main",
    "modprobe": "kmodtools:modprobe",  # host-config units
    "modinfo": "kmodtools:modinfo",  # host-config units
    "sysctl": "hosttools:sysctl",  # host-config units
    "tee": "hosttools:tee",  # host-config units
    "env": "hosttools:env",  # host-config units
    "update-grub": "hosttools:update_grub",  # host-config units
    "grubby": "hosttools:grubby",  # host-config units
    "mount": "hosttools:mount",  # host-config units
    "swapoff": "hosttools:swapoff",  # host-config units
    "curl": "hosttools:curl",  # host-config units
    "gpg": "hosttools:gpg",  # host-config units
    "mkdir": "hosttools:mkdir",  # host-config units
    "containerd": "hosttools:containerd",  # host-config units
    "nvidia-ctk": "hosttools:nvidia_ctk",  # host-config units
    "apt-get": "pkg:apt_get",  # host-config units
    "apt-mark": "pkg:apt_mark",  # host-config units
    "dnf": "pkg:dnf",  # host-config units
    "zypper": "pkg:zypper",  # host-config units
    "kubeadm": "kube:kubeadm",  # host-config units
    "kubectl": "kube:kubectl",  # host-config units
    "dcgmi": "dcgmi:dcgmi",  # diag.dcgm
    "journalctl": "journalctl:journalctl",  # logs.collect
    "virsh": "libvirt:virsh",  # instances (libvirt-kvm)
    "qemu-img": "libvirt:qemu_img",  # instances
    "genisoimage": "libvirt:genisoimage",  # instances (NoCloud seed)
    "nft": "netns:nft",  # instances' network policy: real, only in a private namespace
    "ip": "netns:ip",  # the host's addresses on the instance bridges (ditto)
    "systemd-run": "chtools:systemd_run",  # instances (cloud-hypervisor's VMM unit)
    "useradd": "chtools:useradd",  # instances (cloud-hypervisor's VMM accounts)
    "groupadd": "chtools:groupadd",
    "userdel": "chtools:userdel",
    "groupdel": "chtools:groupdel",
}

SIM_STATE_DIR = "/var/lib/bcd-sim"


def _load(spec: str) -> FakeTool:
    module, _, func = spec.partition(":")
    tool: FakeTool = getattr(importlib.import_module(f"bcd_simhost.{module}"), func)
    return tool


class _LazyTool:
    def __init__(self, spec: str) -> None:
        self._spec = spec
        self._fn: FakeTool | None = None

    def __call__(self, system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
        if self._fn is None:
            self._fn = _load(self._spec)
        return self._fn(system, argv, stdin)


def sim_system(root: Path) -> LocalSystem:
    """A `System` over the simulated host at `root` (seed it first with `seed`)."""
    return LocalSystem(root=Path(root), tools={name: _LazyTool(spec) for name, spec in TOOLS.items()})
