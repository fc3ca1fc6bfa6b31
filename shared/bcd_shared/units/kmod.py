"""kernel-modules: modules loaded now and at every boot, with their options (HST-MOD-*).

Files: /etc/modules-load.d/bcd.conf (the modules, sorted) and /etc/modprobe.d/bcd.conf (one
`options <module> <options>` line per module with options; removed when there are none). A module
not under /sys/module/<name> (dashes read as underscores) is loaded with `modprobe -- <name>`. A
loaded module whose parameter differs from its option (Y/N and 1/0 compare equal) is reloaded only
when its refcnt is 0; one in use keeps its old options silently until it next loads.

Decisions: Q-HST-MOD-01 the record's keys follow the `load` name rule, option keys inside a value
follow ^[A-Za-z0-9_]{1,64}$, and `options` may name a module `load` does not list (only the
modprobe.d line is written). Q-HST-MOD-02 refused options match with `-` and `_` alike, whatever
their value. Q-HST-MOD-03 reload is `modprobe -r -- <name>` then `modprobe -- <name>`, after the
options file is written. Beyond the seeds, nvidia's profiling restriction only at 1, its registry keys
refused. Q-HST-RMV-02 an empty `load` removes modules-load.d/bcd.conf.
"""

from __future__ import annotations

import re
from typing import Any

from attrs import frozen

from bcd_shared.system import System

from ._base import Fields, Plan, RemoveFile, Run, Step, WriteFile, header, refuse
from ._unit import ConfigUnit, UnitContext

NAME = "kernel-modules"
LOAD_FILE = "/etc/modules-load.d/bcd.conf"
OPTIONS_FILE = "/etc/modprobe.d/bcd.conf"
MODULE_RE = r"^[a-z0-9_-]{1,64}$"
OPTION_VALUE_RE = r"^[A-Za-z0-9_.,:=/ -]*$"
OPTION_KEY_RE = r"^[A-Za-z0-9_]{1,64}$"

# (module, option key) pairs that let a passed-through device reach host memory (a894cd2).
FORBIDDEN_OPTIONS = frozenset(
    {("vfio", "enable_unsafe_noiommu_mode"), ("vfio_iommu_type1", "allow_unsafe_interrupts")}
)
# The same keys are refused under every module name (red team round 8): iommufd has its own
# `allow_unsafe_interrupts`, and modprobe applies an `options` line written for an alias of vfio
# (`char-major-10-196`) when the module is loaded through that alias.
FORBIDDEN_KEYS = frozenset(key for _module, key in FORBIDDEN_OPTIONS)
# nvidia's GPU performance counters open to every user are a side channel between tenants of one host
# (docs/host.md "Refused module options beyond the seeds"): the restriction is accepted only at its
# default, exactly `1` (the driver reads any other text through kstrtouint in base 0, where `0`, `00`,
# `0x0` and `+0` are all 0); the registry keys, which set any of the driver's registry entries
# (`RmProfilingAdminOnly` among them) from one string, are refused whatever their value. Under every
# module name, as the keys above (an alias loads the module with its line).
ONLY_VALUE = {"NVreg_RestrictProfilingToAdminUsers": "1"}
REFUSED_KEYS = frozenset({"NVreg_RegistryDwords", "NVreg_RegistryDwordsPerDevice"})


def sysname(module: str) -> str:
    return module.replace("-", "_")


@frozen
class KernelModulesSettings:
    load: tuple[str, ...] = ()
    options: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = ()  # (module, parsed, raw)


def parse_options(module: str, value: str) -> tuple[tuple[str, str], ...]:
    name = f"options.{module}"
    if len(value) > 256:
        raise refuse(f"{name}: at most 256 characters, not {len(value)}")
    if not re.fullmatch(OPTION_VALUE_RE, value):
        raise refuse(f"{name}: only letters, digits and _.,:=/ - are allowed")
    pairs = []
    for word in value.split():
        key, eq, val = word.partition("=")
        if not eq:
            raise refuse(f"{name}: {word!r} is not key=value")
        if not re.fullmatch(OPTION_KEY_RE, key):
            raise refuse(f"{name}: option key {key!r} does not match {OPTION_KEY_RE}")
        if (sysname(module), sysname(key)) in FORBIDDEN_OPTIONS or sysname(key) in FORBIDDEN_KEYS:
            raise refuse(f"{name}: {key} is refused: it lets a passed-through device reach host memory")
        if sysname(key) in REFUSED_KEYS:
            raise refuse(
                f"{name}: {key} is refused: it sets any of the GPU driver's registry entries, the profiling "
                "restriction among them"
            )
        only = ONLY_VALUE.get(sysname(key))
        if only is not None and val != only:
            raise refuse(
                f"{name}: {key}={val[:32]} is refused: only {key}={only} (GPU performance counters to "
                "administrators only; any other value opens them to every tenant)"
            )
        pairs.append((key, val))
    if not pairs:
        raise refuse(f"{name}: empty options")
    return tuple(pairs)


def load_file(settings: KernelModulesSettings) -> bytes | None:
    if not settings.load:
        return None
    return (header(NAME) + "".join(f"{m}\n" for m in sorted(set(settings.load)))).encode()


def options_file(settings: KernelModulesSettings) -> bytes | None:
    if not settings.options:
        return None
    lines = [
        f"options {sysname(m)} {' '.join(f'{k}={v}' for k, v in pairs)}\n" for m, pairs, _ in settings.options
    ]
    return (header(NAME) + "".join(lines)).encode()


@frozen
class ModuleView:
    loaded: bool
    refcnt: int
    params: tuple[tuple[str, str], ...]


@frozen
class KernelModulesObserved:
    load_file: bytes | None
    options_file: bytes | None
    modules: tuple[tuple[str, ModuleView], ...]


def _same_param(now: str, want: str) -> bool:
    norm = {"Y": "1", "N": "0", "y": "1", "n": "0"}
    return norm.get(now, now) == norm.get(want, want)


class KernelModules(ConfigUnit[KernelModulesSettings, KernelModulesObserved]):
    name = NAME
    cleans = True

    def decode(self, obj: dict[str, Any]) -> KernelModulesSettings:
        f = Fields(obj)
        load = f.string_list("load", max_items=64, pattern=MODULE_RE) or ()
        raw_opts = f.string_map("options", max_items=64) or ()
        f.done()
        options = []
        for module, value in raw_opts:
            if not re.fullmatch(MODULE_RE, module):
                raise refuse(f"options: module name {module!r} does not match {MODULE_RE}")
            options.append((module, parse_options(module, value), value))
        return KernelModulesSettings(tuple(load), tuple(options))

    def observe(
        self, system: System, settings: KernelModulesSettings | None, ctx: UnitContext
    ) -> KernelModulesObserved:
        names = set(settings.load) if settings else set()
        if settings:
            names |= {m for m, _, _ in settings.options}
        views = []
        for m in sorted(names):
            base = f"/sys/module/{sysname(m)}"
            loaded = system.exists(base)
            ref = (system.read_text(f"{base}/refcnt") or "0").strip()
            params = []
            if settings:
                for mod, pairs, _ in settings.options:
                    if mod == m:
                        for k, _v in pairs:
                            now = system.read_text(f"{base}/parameters/{k}")
                            params.append((k, "" if now is None else now.strip()))
            views.append((m, ModuleView(loaded, int(ref) if ref.isdigit() else 0, tuple(params))))
        return KernelModulesObserved(
            system.read_bytes(LOAD_FILE), system.read_bytes(OPTIONS_FILE), tuple(views)
        )

    def plan(self, settings: KernelModulesSettings | None, observed: KernelModulesObserved) -> Plan:
        steps: list[Step] = []
        want_load = load_file(settings) if settings else None
        want_opts = options_file(settings) if settings else None
        for path, want, have in (
            (LOAD_FILE, want_load, observed.load_file),
            (OPTIONS_FILE, want_opts, observed.options_file),
        ):
            if want is None and have is not None:
                steps.append(RemoveFile(path))
            elif want is not None and want != have:
                steps.append(WriteFile(path, want))
        if settings is None:
            return Plan(tuple(steps))
        views = dict(observed.modules)
        wanted_opts = {m: pairs for m, pairs, _ in settings.options}
        for m in sorted(set(settings.load)):
            view = views.get(m)
            if view is None or not view.loaded:
                steps.append(Run(("modprobe", "--", m), message=f"cannot load {m}"))
                continue
            pairs = wanted_opts.get(m, ())
            now = dict(view.params)
            differs = any(not _same_param(now.get(k, ""), v) for k, v in pairs)
            if differs and view.refcnt == 0:
                steps.append(Run(("modprobe", "-r", "--", m), message=f"cannot unload {m}"))
                steps.append(Run(("modprobe", "--", m), message=f"cannot load {m}"))
            # A module in use keeps its options until it next loads; bcd does not report it (HST-MOD-16).
        return Plan(tuple(steps))


UNIT = KernelModules()
