"""Helpers for the instances tests: a simulated host with the libvirt-kvm runtime over fake virsh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import DesiredSpec
from bcd_agent.sections.instances.model import Image, InstanceSpec, InstancesSpec, Nic, Placement
from bcd_agent.sections.instances.plan import UserData
from bcd_agent.sections.instances.runtimes.libvirt import DirectVirsh, HelperVirsh, LibvirtRuntime
from bcd_agent.sections.instances.section import InstancesSection
from bcd_shared.system import LocalSystem
from bcd_simhost import sim_system
from bcd_simhost.libvirt import IMAGE_SHA256
from bcd_simhost.seed import seed

DATA_DIR = "/var/lib/bcd"
IMAGE = Image("https://images.sim.bcd/debian-12.qcow2", IMAGE_SHA256, "qcow2")
GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GIB = 1 << 30


class FixedUserData:
    def __init__(self, answers: dict[str, UserData] | None = None) -> None:
        self.answers = answers or {}
        self.asked: list[tuple[str, str, str]] = []

    def fetch(self, instance_id: str, allocation_id: str, ref: str) -> UserData:
        self.asked.append((instance_id, allocation_id, ref))
        return self.answers.get(instance_id, UserData(data=b"#cloud-config\n"))


def sim_host(tmp: Path) -> LocalSystem:
    root = tmp / "host"
    seed(root)
    return sim_system(root)


def section(system: LocalSystem, user_data: Any = None, **kw: Any) -> tuple[InstancesSection, LibvirtRuntime]:
    rt = LibvirtRuntime(
        system, DirectVirsh(system), DATA_DIR, stop_timeout_s=0.0, sleep=lambda _s: None, **kw
    )
    return InstancesSection(system, [rt], DATA_DIR, user_data=user_data or FixedUserData()), rt


def helper_section(system: LocalSystem, client: Any, **kw: Any) -> tuple[InstancesSection, LibvirtRuntime]:
    """As `section`, the runtime under a real helper: every libvirt change through `client`'s libvirt.*
    ops; `kw` go to the section (volumes=...)."""
    rt = LibvirtRuntime(
        system,
        HelperVirsh(system, client),
        DATA_DIR,
        under_helper=True,
        stop_timeout_s=0.0,
        sleep=lambda _s: None,
    )
    return InstancesSection(system, [rt], DATA_DIR, user_data=FixedUserData(), **kw), rt


def vm(ident: str, **kw: Any) -> InstanceSpec:
    base: dict[str, Any] = {
        "id": ident,
        "allocation_id": f"alloc_{ident}",
        "vcpus": 2,
        "memory_bytes": 2 * GIB,
        "disk_bytes": 10 * GIB,
        "image": IMAGE,
        "nics": (Nic("br0", "52:54:00:00:00:01", ("10.0.0.5/24",)),),
    }
    base.update(kw)
    return InstanceSpec(**base)


def spec(*instances: InstanceSpec, generation: int = 1) -> InstancesSpec:
    return InstancesSpec(generation, tuple(instances))


def ctx(generation: int = 1) -> PassContext:
    return PassContext(DesiredSpec(generation, "h"), 1, frozenset({"test"}), 0.0)


def converge(sec: InstancesSection, desired: InstancesSpec) -> Any:
    return sec.converge(desired, Observation(), ctx(desired.generation))


__all__ = ["GPU0", "Placement", "converge", "ctx", "helper_section", "section", "sim_host", "spec", "vm"]
