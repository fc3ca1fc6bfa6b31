"""gpu-settings: each GPU's power limit and ECC mode, read and set with nvidia-smi (HST-GPUS-*).

Q-HST-GPUS-01 answered: the node enforces provision's rule too (a whole number from 1 to 10,000),
then each GPU's own range; GPUs are named by their index, in `-i` and in messages, listed
comma-separated.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from bcd_shared.system import System

from ._base import Fields, Issue, Plan, Run, Step
from ._unit import ConfigUnit, UnitContext
from .nvsmi import GPU_QUERY, number, query

NAME = "gpu-settings"


@frozen
class GpuSettingsSettings:
    power_limit_watts: int | None = None
    ecc: bool | None = None


@frozen
class GpuPower:
    index: str
    limit: float | None  # None: [N/A], no power management
    min: float | None
    max: float | None
    ecc_current: str
    ecc_pending: str


@frozen
class GpuSettingsObserved:
    gpus: tuple[GpuPower, ...] | None  # None: nvidia-smi does not answer


class GpuSettings(ConfigUnit[GpuSettingsSettings, GpuSettingsObserved]):
    name = NAME

    def decode(self, obj: dict[str, Any]) -> GpuSettingsSettings:
        f = Fields(obj)
        s = GpuSettingsSettings(f.integer("powerLimitWatts", 1, 10_000), f.boolean("ecc"))
        f.done()
        return s

    def observe(
        self, system: System, settings: GpuSettingsSettings | None, ctx: UnitContext
    ) -> GpuSettingsObserved:
        if settings is None or (settings.power_limit_watts is None and settings.ecc is None):
            return GpuSettingsObserved(())
        rows = query(system, GPU_QUERY)
        if rows is None:
            return GpuSettingsObserved(None)
        gpus = []
        # power.management is deprecated on recent drivers (reference CSV, 590.48.01): a GPU
        # without power management shows power.limit as [N/A].
        for idx, _uuid, limit, lo, hi, ecc_cur, ecc_pend in rows:
            gpus.append(
                GpuPower(
                    idx,
                    number(limit),
                    number(lo),
                    number(hi),
                    ecc_cur,
                    ecc_pend,
                )
            )
        return GpuSettingsObserved(tuple(gpus))

    def plan(self, settings: GpuSettingsSettings | None, observed: GpuSettingsObserved) -> Plan:
        if settings is None or (settings.power_limit_watts is None and settings.ecc is None):
            return Plan()  # HST-RMV-07, HST-GPUS-03
        if observed.gpus is None:
            return Plan(
                (),
                (Issue("retryable", "gpu-settings: nvidia-smi does not answer yet (is the driver loaded?)"),),
            )
        steps: list[Step] = []
        issues: list[Issue] = []
        want = settings.power_limit_watts
        if want is not None:
            for g in observed.gpus:
                if g.limit is None or g.min is None or g.max is None:
                    continue  # HST-GPUS-09
                if not g.min <= want <= g.max:
                    return Plan(
                        (), (Issue("terminal", f"GPU {g.index} takes {g.min:g} to {g.max:g} W, not {want}"),)
                    )
                if abs(g.limit - want) >= 1:
                    steps.append(
                        Run(
                            ("nvidia-smi", "-i", g.index, "-pl", str(want)),
                            message=f"setting GPU {g.index}'s power limit",
                        )
                    )
        if settings.ecc is not None:
            mode = "Enabled" if settings.ecc else "Disabled"
            waiting = []
            for g in observed.gpus:
                if g.ecc_current not in ("Enabled", "Disabled"):
                    continue  # HST-GPUS-11: no ECC
                if g.ecc_pending != mode:
                    steps.append(Run(("nvidia-smi", "-i", g.index, "-e", "1" if settings.ecc else "0")))
                if g.ecc_current != mode:
                    waiting.append(g.index)
            if waiting:
                issues.append(
                    Issue(
                        "reboot",
                        f"gpu-settings: the ECC mode of GPU(s) {','.join(waiting)} changes at their "
                        "next reset: reboot the node",
                    )
                )
        return Plan(tuple(steps), tuple(issues))


UNIT = GpuSettings()
