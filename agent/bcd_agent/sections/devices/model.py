"""The devices section's domain types: frozen values, built once at the edge (`from_wire`).

proto3 cannot tell an unset string from an empty one, so (Q-DEV-ASG-01) a `limits` message whose
fields are all empty or unset is absent: no slice, no admission. Each numeric limit has presence on
the wire (`optional`), and a slice property is set only for a field that is present (and, for the
huge page files, non-zero).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from attrs import field, frozen

if TYPE_CHECKING:
    from bcd_shared import wire

DEVICE_CLASS_GPU = "gpu"
DEVICE_CLASS_MIG = "gpu.mig"
DEVICE_CLASS_SLOT = "gpu.slot"
DEVICE_CLASSES = (DEVICE_CLASS_GPU, DEVICE_CLASS_MIG, DEVICE_CLASS_SLOT)

BINDING_HOLD = "BINDING_HOLD"
BINDING_KUBERNETES = "BINDING_KUBERNETES"

# AllocationFailed reasons, in the order the checks run (DEV-FAIL-07). `invalid-assignment` is
# bcd's own, checked first: an allocation id that cannot name a file or slice, an env line that is
# not KEY=VALUE or overrides bcd's own keys, a cpulist that is not one (docs/devices.md).
REASON_INVALID = "invalid-assignment"
REASON_BINDING = "unsupported-binding"
REASON_UNPRIVILEGED = "node-unprivileged"
REASON_DEVICE = "unsupported-device"
REASON_MISSING = "device-missing"
REASON_OVERLAP = "overlap"
REASON_EXHAUSTED = "resources-exhausted"
REASON_ORDER = (
    REASON_INVALID,
    REASON_BINDING,
    REASON_UNPRIVILEGED,
    REASON_DEVICE,
    REASON_MISSING,
    REASON_OVERLAP,
    REASON_EXHAUSTED,
)


class Binding(enum.Enum):
    HOLD = BINDING_HOLD
    KUBERNETES = BINDING_KUBERNETES


def _class_or_gpu(device_class: str) -> str:
    return device_class or DEVICE_CLASS_GPU


@frozen
class DeviceRef:
    """One atom of an assignment as the spec names it."""

    id: str
    device_class: str = field(default=DEVICE_CLASS_GPU, converter=_class_or_gpu)


@frozen
class Limits:
    cpus: str = ""
    mems: str = ""
    cpu_millis: int | None = None
    memory_bytes: int | None = None
    hugepages_2mi: int | None = None
    hugepages_1gi: int | None = None

    @property
    def empty(self) -> bool:
        return (
            not self.cpus
            and not self.mems
            and all(
                v is None
                for v in (self.cpu_millis, self.memory_bytes, self.hugepages_2mi, self.hugepages_1gi)
            )
        )

    @property
    def needs_admission(self) -> bool:
        """A memory limit or huge pages: admitted against the host (DEV-ADM-01/02)."""
        return bool(self.memory_bytes) or bool(self.hugepages_2mi) or bool(self.hugepages_1gi)


def _limits_or_none(limits: Limits | None) -> Limits | None:
    return None if limits is None or limits.empty else limits


@frozen
class DeviceAssignment:
    allocation_id: str
    reservation_id: str = ""
    # "BINDING_HOLD", "BINDING_KUBERNETES", another enum name, or the number of an unnamed value.
    binding: str = BINDING_HOLD
    devices: tuple[DeviceRef, ...] = ()
    limits: Limits | None = field(default=None, converter=_limits_or_none)
    env: tuple[str, ...] = ()

    @property
    def kubernetes(self) -> bool:
        return self.binding == BINDING_KUBERNETES

    @property
    def sliced(self) -> bool:
        """A hold with limits runs in its own slice, unless it is a Kubernetes hold (DEV-SLICE-01/03)."""
        return self.limits is not None and not self.kubernetes


@frozen
class DevicesSpec:
    """The desired `devices` section at one generation."""

    generation: int
    assignments: tuple[DeviceAssignment, ...] = ()

    def by_allocation(self) -> dict[str, DeviceAssignment]:
        return {a.allocation_id: a for a in self.assignments}


def binding_name(value: int, names: dict[int, str]) -> str:
    return names.get(value, str(value))


def limits_from_wire(msg: wire.DeviceLimits | None) -> Limits | None:
    if msg is None:
        return None
    return Limits(
        cpus=msg.cpus,
        mems=msg.mems,
        cpu_millis=msg.cpu_millis,
        memory_bytes=msg.memory_bytes,
        hugepages_2mi=msg.hugepages_2mi,
        hugepages_1gi=msg.hugepages_1gi,
    )


def assignment_from_wire(msg: wire.DeviceAssignment) -> DeviceAssignment:
    """One wire assignment (already strictly decoded) as the domain type; `instance_id` is not read."""
    from bcd_shared.wire import Binding as WireBinding

    names = {int(b): f"BINDING_{b.name}" for b in WireBinding}
    return DeviceAssignment(
        allocation_id=msg.allocation_id,
        reservation_id=msg.reservation_id,
        binding=binding_name(int(msg.binding), names),
        devices=tuple(DeviceRef(d.id, d.device_class) for d in msg.devices),
        limits=limits_from_wire(msg.limits),
        env=tuple(msg.env),
    )


def spec_from_wire(generation: int, section: wire.DevicesSection | None) -> DevicesSpec:
    if section is None:
        return DevicesSpec(generation=generation)
    return DevicesSpec(
        generation=generation, assignments=tuple(assignment_from_wire(a) for a in section.assignments)
    )


def spec_of(generation: int, assignments: Sequence[DeviceAssignment]) -> DevicesSpec:
    return DevicesSpec(generation=generation, assignments=tuple(assignments))
