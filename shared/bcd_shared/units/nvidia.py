"""nvidia-driver and fabric-manager (HST-DRV-*, HST-FM-*), and what both read of the driver.

Q-HST-DRV-01 answered: the installed module is read from `modinfo nvidia` (`version:` gives the
branch, `license: Dual MIT/GPL` is the open flavor, `NVIDIA` the proprietary one); the loaded driver
from /proc/driver/nvidia/version (`Open Kernel Module` names the open flavor). Q-HST-DRV-02: the
family comes from /etc/os-release (distro.py); the SUSE names carry no branch, so the branch cannot
be checked before installing: it is checked on the module the packages left on disk (`modinfo
nvidia`) before anything is unloaded, and a module of another branch or flavor fails the unit
terminally (a reboot would only load that module again), naming the branch it holds; the loaded
driver is checked again after loading. Q-HST-DRV-03: the in-use message is `driver <loaded> is in
use; reboot the node to load branch <branch>`; `--force-confold` travels as
`-o Dpkg::Options::=--force-confold`; `branch` is required. Q-HST-FM-01: the Debian package is named
after the loaded driver's branch, and a Fabric Manager that stays down after `enable --now` fails the
unit retryably while FabricManagerDown is raised.
"""

from __future__ import annotations

import re
from typing import Any

from attrs import frozen

from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.system import System

from ._base import (
    ApplyContext,
    Fields,
    Issue,
    Plan,
    RebootRequired,
    Run,
    Step,
    UnitCondition,
    check,
    has_program,
    service_active,
)
from ._unit import ConfigUnit, UnitContext
from .distro import Distro, detect, install_commands

DRIVER = "nvidia-driver"
FM = "fabric-manager"
PROC_VERSION = "/proc/driver/nvidia/version"


@frozen
class DriverVersion:
    version: str
    branch: str
    open: bool


def parse_proc_version(text: str | None) -> DriverVersion | None:
    if not text:
        return None
    first = text.splitlines()[0]
    m = re.search(r"\b(\d{3})\.\d+(?:\.\d+)?\b", first)
    if not m:
        return None
    return DriverVersion(m.group(0), m.group(1), "Open Kernel Module" in first)


def parse_modinfo(text: str) -> DriverVersion | None:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    m = re.fullmatch(r"(\d{3})\.\d+(?:\.\d+)?", fields.get("version", ""))
    if not m:
        return None
    return DriverVersion(m.group(0), m.group(1), fields.get("license", "") == "Dual MIT/GPL")


def loaded_driver(system: System) -> DriverVersion | None:
    if not system.exists("/sys/module/nvidia"):
        return None
    return parse_proc_version(system.read_text(PROC_VERSION))


def driver_packages(distro: Distro, branch: str, open_: bool) -> tuple[str, ...] | None:
    """HST-DRV-10..14; None for a distribution bcd has no packages for."""
    if distro.family == "ubuntu":
        flavor = "-open" if open_ else ""
        return (f"nvidia-headless-{branch}-server{flavor}", f"nvidia-utils-{branch}-server")
    if distro.family == "debian":
        return (f"nvidia-open-{branch}",) if open_ else (f"cuda-drivers-{branch}",)
    if distro.family == "rhel":
        return (f"@nvidia-driver:{branch}-open",) if open_ else (f"@nvidia-driver:{branch}-dkms",)
    if distro.family == "suse":
        kmp = "nvidia-open-driver-G06-signed-kmp-default" if open_ else "nvidia-driver-G06-kmp-default"
        return (kmp, "nvidia-compute-utils-G06")
    return None


@frozen
class DriverSettings:
    branch: str
    open: bool | None = None


@frozen
class DriverObserved:
    distro: Distro
    installed: DriverVersion | None
    loaded: DriverVersion | None
    persistenced: bool
    persistenced_active: bool


def _matches(v: DriverVersion | None, s: DriverSettings) -> bool:
    return v is not None and v.branch == s.branch and (s.open is None or v.open == s.open)


@frozen
class LoadDriver:
    """Swap out another loaded driver (if any), load nvidia and nvidia_uvm, check the result."""

    branch: str
    open: bool | None
    loaded: str | None  # the other driver's version, when one is loaded
    family: str = ""  # the distribution family, for the message of a package without the branch

    def describe(self) -> str:
        return f"load NVIDIA driver branch {self.branch}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        # The module the packages left on disk must be the branch (Q-HST-DRV-02): SUSE's package
        # names carry no branch, and loading another one would only ask for a useless reboot.
        res = system.run(["modinfo", "nvidia"])
        on_disk = parse_modinfo(res.stdout.decode(errors="replace")) if res.ok else None
        if on_disk is not None and not _matches(on_disk, DriverSettings(self.branch, self.open)):
            raise TerminalError("DriverBranch", self._wrong_module(on_disk))
        if self.loaded is not None:
            for svc in ("nvidia-fabricmanager.service", "nvidia-persistenced.service", "nvidia-dcgm.service"):
                system.run(["systemctl", "stop", svc])  # a service that is not installed is fine
            for mod in ("nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia"):
                if not system.exists(f"/sys/module/{mod}"):
                    continue
                res = system.run(["modprobe", "-r", "--", mod])
                if not res.ok:
                    raise RebootRequired(
                        f"driver {self.loaded} is in use; reboot the node to load branch {self.branch}"
                    )
        check(system.run(["modprobe", "--", "nvidia"]), message="cannot load nvidia")
        check(system.run(["modprobe", "--", "nvidia_uvm"]), message="cannot load nvidia_uvm")
        now = loaded_driver(system)
        if not _matches(now, DriverSettings(self.branch, self.open)):
            have = now.version if now else "none"
            raise RebootRequired(f"the loaded driver is {have}, not branch {self.branch}: reboot the node")

    def _wrong_module(self, on_disk: DriverVersion) -> str:
        flavor = "open" if on_disk.open else "proprietary"
        want = f"branch {self.branch}" + (
            "" if self.open is None else (" (open)" if self.open else " (proprietary)")
        )
        msg = f"the driver packages installed {on_disk.version} ({flavor}), not {want}"
        if self.family == "suse":
            msg += (
                "; the SUSE packages carry no branch: pin the driver version in the repository, "
                f"or ask for branch {on_disk.branch}"
            )
        return msg


class NvidiaDriver(ConfigUnit[DriverSettings, DriverObserved]):
    name = DRIVER

    def decode(self, obj: dict[str, Any]) -> DriverSettings:
        f = Fields(obj)
        branch = f.string("branch", pattern=r"^[0-9]{3}$")
        open_ = f.boolean("open")
        f.done()
        if branch is None:
            from ._base import refuse

            raise refuse("branch: required")
        return DriverSettings(branch, open_)

    def observe(self, system: System, settings: DriverSettings | None, ctx: UnitContext) -> DriverObserved:
        res = system.run(["modinfo", "nvidia"])
        installed = parse_modinfo(res.stdout.decode(errors="replace")) if res.ok else None
        pers = has_program(system, "nvidia-persistenced")
        return DriverObserved(
            detect(system),
            installed,
            loaded_driver(system),
            pers,
            pers and service_active(system, "nvidia-persistenced.service"),
        )

    def plan(self, settings: DriverSettings | None, observed: DriverObserved) -> Plan:
        if settings is None:
            return Plan()  # HST-RMV-02
        steps: list[Step] = []
        if _matches(observed.loaded, settings):
            if observed.persistenced and not observed.persistenced_active:
                steps.append(Run(("systemctl", "enable", "--now", "nvidia-persistenced.service")))
            return Plan(tuple(steps))
        if not _matches(observed.installed, settings):
            pkgs = driver_packages(observed.distro, settings.branch, bool(settings.open))
            if pkgs is None:
                return Plan(
                    (),
                    (
                        Issue(
                            "terminal",
                            f"bcd has no driver packages for {observed.distro.id or 'this distribution'}",
                        ),
                    ),
                )
            for argv in install_commands(observed.distro, pkgs):
                steps.append(Run(argv, message=f"installing {' '.join(pkgs)}"))
        other = observed.loaded.version if observed.loaded is not None else None
        steps.append(LoadDriver(settings.branch, settings.open, other, observed.distro.family))
        return Plan(tuple(steps))


UNIT_DRIVER = NvidiaDriver()


# ---------------------------------------------------------------------------------------------


@frozen
class FmSettings:
    pass


@frozen
class FmObserved:
    nvswitches: int
    distro: Distro
    loaded: DriverVersion | None
    installed: bool
    active: bool


class FabricManager(ConfigUnit[FmSettings, FmObserved]):
    name = FM

    def decode(self, obj: dict[str, Any]) -> FmSettings:
        Fields(obj).done()
        return FmSettings()

    def observe(self, system: System, settings: FmSettings | None, ctx: UnitContext) -> FmObserved:
        switches = len(system.listdir("/proc/driver/nvidia-nvswitch/devices"))
        if not switches:
            return FmObserved(0, Distro("", "", "unknown"), None, False, False)
        installed = has_program(system, "nv-fabricmanager")
        return FmObserved(
            switches,
            detect(system),
            loaded_driver(system),
            installed,
            installed and service_active(system, "nvidia-fabricmanager.service"),
        )

    def plan(self, settings: FmSettings | None, observed: FmObserved) -> Plan:
        if settings is None or not observed.nvswitches:
            return Plan()  # HST-RMV-06, HST-FM-02
        down = (
            UnitCondition(
                "FabricManagerDown", "NotRunning", "nvidia-fabricmanager is not running on an NVSwitch host"
            ),
        )
        if observed.active:
            return Plan()
        if observed.loaded is None:
            return Plan((), (Issue("retryable", "fabric-manager: no NVIDIA driver is loaded yet"),), down)
        steps: list[Step] = []
        if not observed.installed:
            pkg = (
                f"nvidia-fabricmanager-{observed.loaded.branch}"
                if observed.distro.debian_like
                else "nvidia-fabric-manager"
            )
            cmds = install_commands(observed.distro, (pkg,))
            if not cmds:
                return Plan(
                    (),
                    (Issue("terminal", f"bcd has no Fabric Manager package for {observed.distro.id}"),),
                    down,
                )
            steps.extend(Run(argv, message=f"installing {pkg}") for argv in cmds)
        steps.append(Run(("systemctl", "enable", "--now", "nvidia-fabricmanager.service")))
        return Plan(tuple(steps), (), down)


UNIT_FM = FabricManager()


def require_driver(system: System, unit: str) -> None:
    if loaded_driver(system) is None:
        raise RetryableError("NoDriver", f"{unit}: no NVIDIA driver is loaded yet")
