"""gpu-sharing: MPS through bcd-mps.service, or plain time slicing (HST-SHARE-*).

Decisions: Q-HST-SHARE-01 the default active thread percentage is floor(100 / replicas), at least 1;
the unit file uses Restart=on-failure, RestartSec=5, ExecStartPre/ExecStopPost with `nvidia-smi -c`;
`timeslice` removes bcd-mps.service exactly as removing the unit does (disable --now, remove the
file, daemon-reload). MPSDown (reason NotRunning) is raised while the service is not active.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from bcd_shared.system import System

from ._base import (
    Fields,
    Issue,
    Plan,
    RemoveFile,
    Run,
    Step,
    UnitCondition,
    WriteFile,
    has_program,
    header,
    service_active,
)
from ._unit import ConfigUnit, UnitContext

NAME = "gpu-sharing"
SERVICE = "bcd-mps.service"
UNIT_FILE = f"/etc/systemd/system/{SERVICE}"
PIPE_DIR = "/run/nvidia-mps"
LOG_DIR = "/var/log/nvidia-mps"


def thread_percentage(replicas: int) -> int:
    return max(1, 100 // replicas)


def service_text(replicas: int) -> bytes:
    pct = thread_percentage(replicas)
    return (
        header(NAME)
        + "[Unit]\n"
        + "Description=NVIDIA MPS control daemon (bcd gpu-sharing unit)\n"
        + "After=nvidia-persistenced.service\n"
        + "\n[Service]\n"
        + "Type=forking\n"
        + f"Environment=CUDA_MPS_PIPE_DIRECTORY={PIPE_DIR}\n"
        + f"Environment=CUDA_MPS_LOG_DIRECTORY={LOG_DIR}\n"
        + "ExecStartPre=/usr/bin/nvidia-smi -c EXCLUSIVE_PROCESS\n"
        + "ExecStart=/usr/bin/nvidia-cuda-mps-control -d\n"
        + "ExecStartPost=/bin/sh -c "
        + f"'echo set_default_active_thread_percentage {pct} | /usr/bin/nvidia-cuda-mps-control'\n"
        + "ExecStop=/bin/sh -c 'echo quit | /usr/bin/nvidia-cuda-mps-control'\n"
        + "ExecStopPost=/usr/bin/nvidia-smi -c DEFAULT\n"
        + "Restart=on-failure\n"
        + "RestartSec=5\n"
        + "\n[Install]\n"
        + "WantedBy=multi-user.target\n"
    ).encode()


@frozen
class SharingSettings:
    mode: str
    replicas: int = 10


@frozen
class SharingObserved:
    mps_control: bool
    unit_file: bytes | None
    active: bool


def _removal(observed: SharingObserved) -> tuple[Step, ...]:
    if observed.unit_file is None:
        return ()
    return (
        Run(("systemctl", "disable", "--now", SERVICE)),
        RemoveFile(UNIT_FILE),
        Run(("systemctl", "daemon-reload")),
    )


class GpuSharing(ConfigUnit[SharingSettings, SharingObserved]):
    name = NAME
    cleans = True

    def decode(self, obj: dict[str, Any]) -> SharingSettings:
        f = Fields(obj)
        mode = f.choice("mode", ("mps", "timeslice"))
        replicas = f.integer("replicas", 1, 48)
        f.done()
        if mode is None:
            from ._base import refuse

            raise refuse("mode: required (mps or timeslice)")
        return SharingSettings(mode, 10 if replicas is None else replicas)

    def observe(self, system: System, settings: SharingSettings | None, ctx: UnitContext) -> SharingObserved:
        unit_file = system.read_bytes(UNIT_FILE)
        mps = settings is not None and settings.mode == "mps"
        return SharingObserved(
            has_program(system, "nvidia-cuda-mps-control") if mps else False,
            unit_file,
            service_active(system, SERVICE) if (mps or unit_file is not None) else False,
        )

    def plan(self, settings: SharingSettings | None, observed: SharingObserved) -> Plan:
        if settings is None or settings.mode == "timeslice":
            return Plan(_removal(observed))  # HST-RMV-13, HST-SHARE-16
        down = (UnitCondition("MPSDown", "NotRunning", f"{SERVICE} is not active: MPS clients fail"),)
        if not observed.mps_control:
            return Plan(
                (),
                (
                    Issue(
                        "retryable",
                        "gpu-sharing: nvidia-cuda-mps-control is not installed yet (driver utilities)",
                    ),
                ),
                down,
            )
        want = service_text(settings.replicas)
        if observed.unit_file != want:
            steps: tuple[Step, ...] = (
                WriteFile(UNIT_FILE, want),
                Run(("systemctl", "daemon-reload")),
                Run(("systemctl", "enable", SERVICE)),
                Run(("systemctl", "restart", SERVICE)),
            )
            return Plan(steps, (), down)
        if not observed.active:
            return Plan((Run(("systemctl", "start", SERVICE)),), (), down)
        return Plan()


UNIT = GpuSharing()
