"""Which live instance owns a tap name, as root sees it (docs/helper.md, "Tap names").

A tap is `tap_stem(id)` + the NIC index (bcd_shared.instancenames): 44 bits of the id's hash, so two
instance ids can share every tap name (`vm-1762438` and `vm-3742940` do). Without this rule the second
one's `ch.taps` kept the first one's live tap and moved it to its own bridge, its `ch.untaps` deleted
it, and a libvirt domain of the second one was defined to open it. Root therefore refuses a
second live instance of a stem (`tap-collision`, naming both ids), from its own records only:
- libvirt: the definitions root staged (`STAGE_DIR/<id>.xml`, one per defined domain, removed by
  `libvirt.undefine`);
- cloud-hypervisor: `CLAIMS_DIR/<stem>`, the id of the instance whose taps `ch.taps` made (0600,
  written before the first tap, removed by that instance's `ch.untaps`).
`ch.taps` takes the libvirt lock too, so a define and a `ch.taps` of one stem never pass together.
"""

from __future__ import annotations

import os

from bcd_shared.errors import RetryableError
from bcd_shared.instancenames import tap_collision, tap_stem, valid_instance_id
from bcd_shared.rootpath import RootPathRefused

from bcd_helper.ops.base import Call, Refused

STAGE_DIR = "/var/lib/bcd-hostconfig/libvirt"  # libvirt.STAGE_DIR (its staged definitions)
CLAIMS_DIR = "/var/lib/bcd-hostconfig/taps"


def _claim_path(name: str) -> str:
    return f"{CLAIMS_DIR}/{tap_stem(name)}"


def owner(call: Call, name: str) -> str | None:
    """Another live instance whose taps have `name`'s names, or None."""
    stem = tap_stem(name)
    claimed = call.system.read_bytes(_claim_path(name))
    if claimed is not None:
        other = claimed.decode(errors="replace").strip()
        if other != name:
            return other
    try:
        staged = os.listdir(call.system.host_path(STAGE_DIR))
    except FileNotFoundError:
        return None
    for entry in sorted(staged):
        other = entry.removesuffix(".xml")
        if entry.endswith(".xml") and other != name and valid_instance_id(other) and tap_stem(other) == stem:
            return other
    return None


def refuse_collision(call: Call, op: str, name: str) -> None:
    """Refused `tap-collision` when another live instance owns `name`'s tap names."""
    other = owner(call, name)
    if other is not None:
        raise Refused("tap-collision", f"{op}: {tap_collision(name, other)}")


def claim(call: Call, name: str) -> None:
    """Record `name` as its stem's cloud-hypervisor owner (after `refuse_collision` passed)."""
    try:
        call.system.write_atomic(_claim_path(name), name.encode() + b"\n", 0o600)
    except (RootPathRefused, RetryableError) as exc:
        raise Refused("root-only", str(exc)) from None


def release(call: Call, name: str) -> None:
    """Drop `name`'s claim (never another instance's)."""
    claimed = call.system.read_bytes(_claim_path(name))
    if claimed is not None and claimed.decode(errors="replace").strip() == name:
        call.system.remove(_claim_path(name))
