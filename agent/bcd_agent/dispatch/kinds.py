"""The command kinds bcd knows: one literal table (delivery.md, "Kinds by lane" and "Timeouts").

A row is the kind's lane, the agent roles that may run it, its flags and the control plane's timeout
for it (the CommandSweeper of the development control plane reads `timeout_for`). The table says what a
kind *is*; whether this agent can run it is a separate question answered by the handlers registered on
the dispatcher (dispatch.handlers). A kind that is in the table but has no handler on this agent, or is
outside the agent's role, is `UNSUPPORTED`.

Decisions (docs/dispatch.md):
- Q-DLV-KIND-01: `daemon.upgrade` is control lane, roles node and site, retry-safe and self-terminating
  (installing a verified version again is harmless; the swap ends the process), not destructive, 15 min.
- Q-DLV-KIND-02: `driver.invoke` is destructive as the table says, so the quorum governs it.
- Q-DLV-TMO-01: `instance.snapshot` gets 6 hours (a snapshot transfer may run that long), `driver.invoke`
  1 hour like the other provisioning kinds, `daemon.upgrade` the 15-minute default.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from attrs import frozen


class Lane(enum.Enum):
    CONTROL = "control"
    PROVISION = "provision"
    BULK = "bulk"


class Role(enum.Enum):
    """The agent's role: a GPU/VM node, a site agent (BMCs, boot server), or the provisioning ramdisk."""

    NODE = "node"
    SITE = "site"
    RAMDISK = "ramdisk"


MINUTE = 60.0
HOUR = 60 * MINUTE

# An unregistered kind gets 15 minutes (DLV-TMO-06).
DEFAULT_TIMEOUT_S = 15 * MINUTE

# The one kind allowed while the session is upgrade-only (DLV-ACK-06).
UPGRADE_KIND = "daemon.upgrade"


@frozen
class KindSpec:
    """What a kind is: lane, roles, flags and the control plane's timeout after `not_after`."""

    name: str
    lane: Lane
    roles: frozenset[Role]
    retry_safe: bool = False
    attested: bool = False
    destructive: bool = False
    self_terminating: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S


def _k(
    name: str,
    lane: Lane,
    roles: str,
    flags: str,
    timeout_min: float,
) -> KindSpec:
    """A table row: roles and flags as space-separated words, so the table reads like the seed's."""
    words = set(flags.split())
    known = {"retry-safe", "attested", "destructive", "self-terminating"}
    if words - known:
        raise ValueError(f"kind {name}: unknown flags {sorted(words - known)}")
    return KindSpec(
        name=name,
        lane=lane,
        roles=frozenset(Role(r) for r in roles.split()),
        retry_safe="retry-safe" in words,
        attested="attested" in words,
        destructive="destructive" in words,
        self_terminating="self-terminating" in words,
        timeout_s=timeout_min * MINUTE,
    )


C, P, B = Lane.CONTROL, Lane.PROVISION, Lane.BULK

# kind -> spec. The seeds' "Kinds by lane" table with the "Timeouts" paragraph, plus daemon.upgrade.
# (name, lane, roles, flags, timeout in minutes)
KINDS: Mapping[str, KindSpec] = {
    k.name: k
    for k in (
        _k("inventory.refresh", C, "node site ramdisk", "retry-safe", 2),
        _k("diag.nvml", C, "node ramdisk", "retry-safe attested", 2),
        _k("gpu.reset", C, "node", "attested destructive", 5),
        _k("node.reboot", C, "node site", "retry-safe self-terminating destructive", 15),
        _k("bmc.query", C, "site", "retry-safe", 2),
        _k("bmc.boot", C, "site", "retry-safe destructive", 2),
        _k("bmc.power", C, "site", "destructive", 5),
        _k("bmc.firmware", C, "site", "destructive", 60),
        _k("bmc.storage", C, "site", "destructive", 60),
        _k("bmc.rotate", C, "site", "attested destructive", 5),
        _k("site.httpProxy", C, "site", "destructive", 1),
        _k("boot.prepareRamdisk", C, "site", "retry-safe", 2),
        _k("boot.cleanUp", C, "site", "retry-safe", 2),
        _k("boot.kexec", C, "ramdisk", "self-terminating", 15),
        _k("disk.wipe", P, "ramdisk", "attested destructive", 6 * 60),
        _k("deploy.image", P, "ramdisk", "destructive", 60),
        _k("diag.dcgm", P, "ramdisk node", "retry-safe attested", 60),
        _k("driver.invoke", P, "node site ramdisk", "destructive", 60),
        _k("logs.collect", B, "node site ramdisk", "retry-safe", 15),
        _k("instance.snapshot", B, "node", "", 6 * 60),
        _k(UPGRADE_KIND, C, "node site", "retry-safe self-terminating", 15),
    )
}


# Why a kind of the table has no handler in this build, where there is more to say than "no handler"
# (the UNSUPPORTED message; docs/open-questions.md).
NOT_BUILT: Mapping[str, str] = {
    "driver.invoke": (
        "bcd hosts no driver plugins: the seeds define no plugin interface, payload or result for "
        "driver.invoke, so it is refused before anything runs (docs/open-questions.md Q-BCD-DRV-01)"
    ),
}


def timeout_for(kind: str, table: Mapping[str, KindSpec] = KINDS) -> float:
    """Seconds after `not_after` the control plane's sweeper waits before failing a command `timeout`."""
    spec = table.get(kind)
    return spec.timeout_s if spec is not None else DEFAULT_TIMEOUT_S
