"""iommu: the IOMMU on, through kernel arguments from the CPU vendor (HST-IOMMU-*).

GenuineIntel gets intel_iommu=on, AuthenticAMD and HygonGenuine amd_iommu=on, a CPU with no
vendor_id (Arm) nothing of its own; `passthrough` (default true) adds iommu=pt. Another vendor is
terminal. The arguments go on the boot loader like cpu's (90-bcd-iommu.cfg or grubby), recorded in
/var/lib/bcd-hostconfig/bootargs/iommu. Until /sys/class/iommu lists an IOMMU the unit waits for a
reboot. Q-HST-IOMMU-01: an Arm host with passthrough false sets no argument and still waits for
/sys/class/iommu, since the unit's purpose is an active IOMMU.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from bcd_shared.system import System

from ._base import Fields, Issue, Plan, Step, read_text_record
from ._unit import ConfigUnit, UnitContext
from .bootargs import BootloaderView, SetBootArgs, dropin_path, observe_bootloader, record_path

NAME = "iommu"
VENDOR_ARGS = {
    "GenuineIntel": "intel_iommu=on",
    "AuthenticAMD": "amd_iommu=on",
    "HygonGenuine": "amd_iommu=on",
}


@frozen
class IommuSettings:
    passthrough: bool = True


@frozen
class IommuObserved:
    vendor: str | None  # None: no vendor_id line
    iommus: tuple[str, ...]
    recorded: str | None
    bootloader: BootloaderView


def vendor_of(cpuinfo: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "vendor_id":
            return value.strip()
    return None


class Iommu(ConfigUnit[IommuSettings, IommuObserved]):
    name = NAME
    cleans = True

    def decode(self, obj: dict[str, Any]) -> IommuSettings:
        f = Fields(obj)
        pt = f.boolean("passthrough")
        f.done()
        return IommuSettings(True if pt is None else pt)

    def observe(self, system: System, settings: IommuSettings | None, ctx: UnitContext) -> IommuObserved:
        return IommuObserved(
            vendor_of(system.read_text("/proc/cpuinfo") or ""),
            tuple(system.listdir("/sys/class/iommu")),
            read_text_record(system, record_path(NAME)),
            observe_bootloader(system),
        )

    def plan(self, settings: IommuSettings | None, observed: IommuObserved) -> Plan:
        previous = observed.recorded or ""
        if settings is None:
            if previous:
                step = SetBootArgs(
                    NAME, dropin_path(NAME), record_path(NAME), previous, "", "", observed.bootloader
                )
                return Plan((step,))
            return Plan()
        words = []
        if observed.vendor is not None:
            if observed.vendor not in VENDOR_ARGS:
                return Plan(
                    (), (Issue("terminal", f"iommu: CPU vendor {observed.vendor} is not one bcd knows"),)
                )
            words.append(VENDOR_ARGS[observed.vendor])
        if settings.passthrough:
            words.append("iommu=pt")
        args = " ".join(words)
        steps: list[Step] = []
        if args != previous:
            steps.append(
                SetBootArgs(
                    NAME, dropin_path(NAME), record_path(NAME), previous, args, args, observed.bootloader
                )
            )
        issues = []
        if not observed.iommus:
            issues.append(
                Issue(
                    "reboot",
                    f"iommu: the IOMMU is on from the next boot ({args}): reboot the node; "
                    "check the firmware enables VT-d or AMD-Vi",
                )
            )
        return Plan(tuple(steps), tuple(issues))


UNIT = Iommu()
