"""`from_wire`: NodeSpec.host (the wire's `HostSection`) as the section's domain `HostSection`.

The conversion is total and keeps what the spec says, in wire order: each `HostUnit` becomes the pair
(name, settings JSON text as received). The wire's settings are already canonical JSON (the writer's
rule), and the units decode them again strictly when they run, so nothing is re-encoded here. A name
this bcd does not know, or one named twice, is kept: the section reports it (a terminal failure of that
unit, or UnitNamedTwice) instead of the conversion hiding it.

`is_empty` answers the runner's question on either form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bcd_shared import wire

if TYPE_CHECKING:
    from bcd_agent.sections.host import HostSection


def from_wire(section: wire.HostSection | None) -> HostSection:
    """The domain HostSection of NodeSpec.host (None, an unset section, is the empty section)."""
    from bcd_agent.sections.host import HostSection

    if section is None:
        return HostSection()
    return HostSection.of([(unit.name, unit.settings) for unit in section.units])


def payload_units(payload: object | None) -> int:
    """How many units a host payload lists (wire or domain form); 0 for None."""
    if payload is None:
        return 0
    if isinstance(payload, wire.HostSection):
        return len(payload.units)
    units = getattr(payload, "units", None)
    if units is None:
        raise TypeError(f"host payload {type(payload).__name__} is neither wire.HostSection nor HostSection")
    return len(units)


def is_empty(payload: object | None) -> bool:
    return payload_units(payload) == 0
