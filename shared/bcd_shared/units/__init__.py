"""The twelve host config units (host-config.md), shared by `bcd node` and `bcd helper`.

Layout: _base.py (plans, steps, issues, strict decoding, the file header), _unit.py (the
ConfigUnit interface, UnitContext and `converge_unit`, the one-unit runner both sides use),
distro.py (os-release families and package argv), bootargs.py (boot loader arguments), then one
module per unit. Nothing here imports the agent, the helper, trio or grpclib.

Entry points for callers (the agent's host section, the helper's `host.unit` op):

    unit = REGISTRY[name]                       # KeyError: not a unit this bcd knows
    settings = unit.decode_settings(json_text)  # TerminalError on any fault (strict)
    unit.validate(settings, ctx)                # root's allowlist for k8s-join
    observed = unit.observe(system, settings, ctx)
    plan = unit.plan(settings, observed)        # pure; settings None plans the clean-up
    unit.apply(system, plan, actx)
    result = converge_unit(unit, settings, system, ctx, actx)   # all of the above, never raises
    result = clean(name, system, ctx, actx)                     # a unit that left the spec
"""

from __future__ import annotations

import re
from typing import Any

from ._base import (
    HEADER_TEXT,
    REBOOT_PHRASE,
    STATE_DIR,
    ApplyContext,
    Issue,
    Plan,
    RebootRequired,
    Step,
    TokenSource,
    UnitCondition,
    header,
)
from ._unit import ClusterPin, ConfigUnit, UnitContext, UnitResult, converge_unit
from .cpu import UNIT as CPU
from .gpusettings import UNIT as GPU_SETTINGS
from .hugepages import UNIT as HUGEPAGES
from .iommu import UNIT as IOMMU
from .k8s import UNIT as K8S_JOIN
from .k8s import StagedTokenSource, parse_allowed_clusters
from .kmod import UNIT as KERNEL_MODULES
from .mig import UNIT as MIG_LAYOUT
from .nvidia import UNIT_DRIVER as NVIDIA_DRIVER
from .nvidia import UNIT_FM as FABRIC_MANAGER
from .rootonly import RootOnlySystem, acting_as_root, for_root, root_guard
from .sharing import UNIT as GPU_SHARING
from .sysctl import UNIT as SYSCTL
from .toolkit import UNIT as CONTAINER_TOOLKIT

# The fixed order (HST-ORD-01), whatever order the spec lists the units in.
ORDER: tuple[str, ...] = (
    "kernel-modules",
    "sysctl",
    "hugepages",
    "cpu",
    "iommu",
    "nvidia-driver",
    "fabric-manager",
    "gpu-settings",
    "mig-layout",
    "gpu-sharing",
    "container-toolkit",
    "k8s-join",
)

REGISTRY: dict[str, ConfigUnit[Any, Any]] = {
    u.name: u
    for u in (
        KERNEL_MODULES,
        SYSCTL,
        HUGEPAGES,
        CPU,
        IOMMU,
        NVIDIA_DRIVER,
        FABRIC_MANAGER,
        GPU_SETTINGS,
        MIG_LAYOUT,
        GPU_SHARING,
        CONTAINER_TOOLKIT,
        K8S_JOIN,
    )
}
assert tuple(REGISTRY) == ORDER

UNIT_NAME_RE = r"^[a-z0-9-]{1,64}$"


def valid_unit_name(name: str) -> bool:
    """The helper's `host.unit` name rule (HST-HLP-04)."""
    return re.fullmatch(UNIT_NAME_RE, name) is not None


def clean(name: str, system: Any, ctx: UnitContext, actx: ApplyContext) -> UnitResult:
    """Clean up after a unit that left the spec (a no-op plan for units that do not clean)."""
    return converge_unit(REGISTRY[name], None, system, ctx, actx)


__all__ = [
    "HEADER_TEXT",
    "ORDER",
    "REBOOT_PHRASE",
    "REGISTRY",
    "STATE_DIR",
    "ApplyContext",
    "ClusterPin",
    "ConfigUnit",
    "Issue",
    "Plan",
    "RebootRequired",
    "RootOnlySystem",
    "StagedTokenSource",
    "Step",
    "TokenSource",
    "UnitCondition",
    "UnitContext",
    "UnitResult",
    "acting_as_root",
    "clean",
    "converge_unit",
    "for_root",
    "header",
    "parse_allowed_clusters",
    "root_guard",
    "valid_unit_name",
]
