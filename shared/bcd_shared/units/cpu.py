"""cpu: the frequency governor and CPUs isolated from the scheduler (HST-CPU-*).

The governor is written to every cpu<N>/cpufreq/scaling_governor that differs; a CPU whose
scaling_available_governors lacks it fails the unit terminally; a host without cpufreq converges.
`isolate` becomes `isolcpus=managed_irq,domain,<list> nohz_full=<list> rcu_nocbs=<list>` on the boot
loader, recorded in /var/lib/bcd-hostconfig/bootargs/cpu; until /sys/devices/system/cpu/isolated
shows the list the unit waits for a reboot.

Decisions: Q-HST-CPU-01 the list is compared as a set of CPUs (`4-5` equals `4,5`); accepted forms
are `N` and `A-B` (A <= B) joined by commas, no strides; CPU 0 is refused with `isolate must not
include CPU 0 (it keeps the host's housekeeping)`. The boot arguments carry the canonical list.
Q-HST-CPU-02 a unit without `isolate` (or with an empty one) removes earlier isolation arguments;
an unset governor is left alone.
"""

from __future__ import annotations

import re
from typing import Any

from attrs import frozen

from bcd_shared.system import System

from ._base import Fields, Issue, Plan, Step, WriteKernel, read_text_record, refuse
from ._unit import ConfigUnit, UnitContext
from .bootargs import BootloaderView, SetBootArgs, dropin_path, observe_bootloader, record_path

NAME = "cpu"
GOVERNORS = ("performance", "schedutil", "ondemand", "powersave")
MAX_CPU = 8191


def parse_cpulist(text: str, *, field: str = "isolate") -> frozenset[int]:
    """A kernel cpulist (`4-63,68-127`) as a set; refuses anything else (HST-CPU-02..05)."""
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", part)
        if not m:
            raise refuse(f"{field}: {part!r} is not a CPU or a range of CPUs")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if lo > hi:
            raise refuse(f"{field}: {part!r} runs backwards")
        if hi > MAX_CPU:
            raise refuse(f"{field}: CPU {hi} is above {MAX_CPU}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpulist(cpus: frozenset[int]) -> str:
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def isolation_args(cpus: frozenset[int]) -> str:
    if not cpus:
        return ""
    lst = format_cpulist(cpus)
    return f"isolcpus=managed_irq,domain,{lst} nohz_full={lst} rcu_nocbs={lst}"


@frozen
class CpuSettings:
    governor: str | None = None
    isolate: frozenset[int] = frozenset()


@frozen
class CpuView:
    name: str
    governor: str
    available: tuple[str, ...]


@frozen
class CpuObserved:
    cpus: tuple[CpuView, ...]
    isolated: frozenset[int]
    isolated_text: str
    recorded: str | None
    bootloader: BootloaderView


class Cpu(ConfigUnit[CpuSettings, CpuObserved]):
    name = NAME
    cleans = True

    def decode(self, obj: dict[str, Any]) -> CpuSettings:
        f = Fields(obj)
        governor = f.choice("governor", GOVERNORS)
        isolate = f.string("isolate", max_len=256)
        f.done()
        cpus = parse_cpulist(isolate or "")
        if 0 in cpus:
            raise refuse("isolate must not include CPU 0 (it keeps the host's housekeeping)")
        return CpuSettings(governor, cpus)

    def observe(self, system: System, settings: CpuSettings | None, ctx: UnitContext) -> CpuObserved:
        views = []
        if settings is not None and settings.governor is not None:
            for entry in system.listdir("/sys/devices/system/cpu"):
                if not re.fullmatch(r"cpu\d+", entry):
                    continue
                base = f"/sys/devices/system/cpu/{entry}/cpufreq"
                gov = system.read_text(f"{base}/scaling_governor")
                if gov is None:
                    continue
                avail = (system.read_text(f"{base}/scaling_available_governors") or "").split()
                views.append(CpuView(entry, gov.strip(), tuple(avail)))
        iso_text = (system.read_text("/sys/devices/system/cpu/isolated") or "").strip()
        try:
            iso = parse_cpulist(iso_text)
        except Exception:  # a kernel file we cannot read as a cpulist counts as nothing isolated
            iso = frozenset()
        return CpuObserved(
            tuple(sorted(views, key=lambda v: int(v.name[3:]))),
            iso,
            iso_text,
            read_text_record(system, record_path(NAME)),
            observe_bootloader(system),
        )

    def plan(self, settings: CpuSettings | None, observed: CpuObserved) -> Plan:
        steps: list[Step] = []
        issues: list[Issue] = []
        cpus = settings.isolate if settings else frozenset()
        args = isolation_args(cpus)
        previous = observed.recorded or ""
        if settings is not None and settings.governor is not None:
            lacking = [v.name for v in observed.cpus if settings.governor not in v.available]
            if lacking:
                offered = " ".join(observed.cpus[0].available) if observed.cpus else ""
                return Plan(
                    (),
                    (
                        Issue(
                            "terminal",
                            f"cpu: governor {settings.governor} is not offered by {lacking[0]} "
                            f"(it offers: {offered or 'none'})",
                        ),
                    ),
                )
            for v in observed.cpus:
                if v.governor != settings.governor:
                    steps.append(
                        WriteKernel(
                            f"/sys/devices/system/cpu/{v.name}/cpufreq/scaling_governor", settings.governor
                        )
                    )
        if args != previous:
            steps.append(
                SetBootArgs(
                    NAME, dropin_path(NAME), record_path(NAME), previous, args, args, observed.bootloader
                )
            )
        if cpus and observed.isolated != cpus:
            issues.append(
                Issue(
                    "reboot",
                    f"cpu: CPUs {format_cpulist(cpus)} are isolated from the next boot "
                    f'(now: "{observed.isolated_text}"): '
                    "reboot the node",
                )
            )
        return Plan(tuple(steps), tuple(issues))


UNIT = Cpu()
