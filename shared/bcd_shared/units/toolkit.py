"""container-toolkit: the NVIDIA container toolkit, runtimes configured with it, the CDI spec (HST-CTK-*).

Decisions: Q-HST-CTK-01 the spec is written with `--output=/etc/cdi/nvidia.json`; the stamp is the
SHA-256 of `<driver version>\\n<nvidia-smi -L output>`; the toolkit installs with the family's
package manager and a distribution without one is terminal, as for the driver. The stamp file is a
header line and the hex digest.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from attrs import frozen

from bcd_shared.system import System

from ._base import (
    STATE_DIR,
    ApplyContext,
    Fields,
    Issue,
    Plan,
    RemoveFile,
    Run,
    Step,
    WriteFile,
    has_program,
    read_text_record,
    text_record,
)
from ._unit import ConfigUnit, UnitContext
from .distro import Distro, detect, install_commands
from .nvidia import loaded_driver

NAME = "container-toolkit"
CTK_CONFIG = "/etc/nvidia-container-runtime/config.toml"
STAMP = f"{STATE_DIR}/cdi-nvidia.stamp"
CDI_JSON = "/etc/cdi/nvidia.json"
CDI_YAML = "/etc/cdi/nvidia.yaml"
RUNTIMES = (
    ("containerd", "containerd", "/etc/containerd/config.toml"),
    ("docker", "dockerd", "/etc/docker/daemon.json"),
)
CDI_KEYS = (
    "accept-nvidia-visible-devices-envvar-when-unprivileged",
    "accept-nvidia-visible-devices-as-volume-mounts",
)


def key_is_false(config: str, key: str) -> bool:
    """True when an uncommented `key = false` line is present (HST-CTK-07)."""
    return re.search(rf"(?m)^\s*{re.escape(key)}\s*=\s*false\s*$", config) is not None


def stamp_of(driver_version: str, smi_list: str) -> str:
    return hashlib.sha256(f"{driver_version}\n{smi_list}".encode()).hexdigest()


@frozen
class ToolkitSettings:
    cdi: bool = True


@frozen
class ToolkitObserved:
    distro: Distro
    ctk: bool
    unconfigured: tuple[str, ...]  # runtimes installed whose config does not mention the runtime
    ctk_config: str
    stamp_now: str | None  # None: no driver loaded
    stamp_recorded: str | None
    cdi_json: bool
    cdi_yaml: bool


@frozen
class GenerateCdi:
    stamp: str

    def describe(self) -> str:
        return f"generate {CDI_JSON}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        Run(
            (
                "nvidia-ctk",
                "cdi",
                "generate",
                "--format=json",
                "--device-name-strategy=uuid",
                f"--output={CDI_JSON}",
            ),
            message="generating the NVIDIA CDI spec",
        ).apply(system, actx)
        WriteFile(STAMP, text_record(NAME, self.stamp)).apply(system, actx)


class ContainerToolkit(ConfigUnit[ToolkitSettings, ToolkitObserved]):
    name = NAME

    def decode(self, obj: dict[str, Any]) -> ToolkitSettings:
        f = Fields(obj)
        cdi = f.boolean("cdi")
        f.done()
        return ToolkitSettings(True if cdi is None else cdi)

    def observe(self, system: System, settings: ToolkitSettings | None, ctx: UnitContext) -> ToolkitObserved:
        if settings is None:
            return ToolkitObserved(Distro("", "", "unknown"), False, (), "", None, None, False, False)
        unconfigured = []
        for runtime, binary, config in RUNTIMES:
            if has_program(system, binary) and "nvidia-container-runtime" not in (
                system.read_text(config) or ""
            ):
                unconfigured.append(runtime)
        stamp_now = None
        drv = loaded_driver(system)
        if drv is not None and settings.cdi:
            res = system.run(["nvidia-smi", "-L"])
            if res.ok:
                stamp_now = stamp_of(drv.version, res.stdout.decode(errors="replace"))
        return ToolkitObserved(
            detect(system),
            has_program(system, "nvidia-ctk"),
            tuple(unconfigured),
            system.read_text(CTK_CONFIG) or "",
            stamp_now,
            read_text_record(system, STAMP),
            system.exists(CDI_JSON),
            system.exists(CDI_YAML),
        )

    def plan(self, settings: ToolkitSettings | None, observed: ToolkitObserved) -> Plan:
        if settings is None:
            return Plan()  # HST-RMV-03
        if not observed.ctk:
            cmds = install_commands(observed.distro, ("nvidia-container-toolkit",))
            if not cmds:
                return Plan(
                    (), (Issue("terminal", f"bcd has no container toolkit package for {observed.distro.id}"),)
                )
            return Plan(tuple(Run(a, message="installing nvidia-container-toolkit") for a in cmds))
        steps: list[Step] = []
        for runtime in observed.unconfigured:
            argv = ["nvidia-ctk", "runtime", "configure", f"--runtime={runtime}"]
            if settings.cdi:
                argv.append("--cdi.enabled")
            steps.append(Run(tuple(argv), message=f"configuring {runtime}"))
            steps.append(Run(("systemctl", "restart", f"{runtime}.service")))
        issues = []
        if settings.cdi:
            for key in CDI_KEYS:
                if not key_is_false(observed.ctk_config, key):
                    steps.append(Run(("nvidia-ctk", "config", "--in-place", "--set", f"{key}=false")))
            if observed.stamp_now is None:
                issues.append(
                    Issue("retryable", "container-toolkit: no NVIDIA driver is loaded yet to describe in CDI")
                )
            elif observed.stamp_now != observed.stamp_recorded or not observed.cdi_json:
                steps.append(GenerateCdi(observed.stamp_now))
            if observed.cdi_yaml:
                steps.append(RemoveFile(CDI_YAML))
        return Plan(tuple(steps), tuple(issues))


UNIT = ContainerToolkit()
