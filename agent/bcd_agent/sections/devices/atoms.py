"""Atoms: a spec's device entries resolved against the inventory (pure).

| class      | id                      | parent GPU   | NVIDIA_VISIBLE_DEVICES name |
| gpu        | GPU-…                   | itself       | the GPU's UUID              |
| gpu.mig    | GPU-…/gi<N>/ci<M>       | GPU-…        | the MIG device's MIG-… UUID |
| gpu.slot   | GPU-…/s<N>              | GPU-…        | the parent GPU's UUID       |

Grammar (Q-DEV-ATOM-01): the GPU part is `GPU-` followed by hex digits and dashes; N and M are
decimal without leading zeros. A malformed id is `unsupported-device`; a GPU the inventory does not
list, or a MIG instance it lacks (or lists without a UUID from `-L`, Q-DEV-ATOM-02), is
`device-missing`.
"""

from __future__ import annotations

import re

from attrs import frozen

from bcd_agent.inventory.gpus import Gpu, GpuInventory
from bcd_agent.sections.devices.model import (
    DEVICE_CLASS_GPU,
    DEVICE_CLASS_MIG,
    DEVICE_CLASS_SLOT,
    REASON_DEVICE,
    DeviceRef,
)

_NUM = r"(0|[1-9][0-9]{0,8})"
_GPU = r"GPU-[0-9A-Fa-f][0-9A-Fa-f-]*"
MIG_ID_RE = re.compile(rf"^(?P<gpu>{_GPU})/gi{_NUM}/ci{_NUM}$")
SLOT_ID_RE = re.compile(rf"^(?P<gpu>{_GPU})/s{_NUM}$")


@frozen
class Atom:
    """A parsed atom: its id, class and parent GPU (and MIG ids / slot number)."""

    id: str
    device_class: str
    gpu: str
    gpu_instance: int = -1
    compute_instance: int = -1
    slot: int = -1

    @property
    def whole(self) -> bool:
        return self.device_class == DEVICE_CLASS_GPU


@frozen
class Refusal:
    reason: str
    message: str


def parse_atom(ref: DeviceRef) -> Atom | Refusal:
    cls = ref.device_class
    if cls == DEVICE_CLASS_GPU:
        return Atom(ref.id, cls, ref.id)
    if cls == DEVICE_CLASS_MIG:
        m = MIG_ID_RE.fullmatch(ref.id)
        if m is None:
            return Refusal(REASON_DEVICE, f'"{ref.id}" is not a MIG instance id (<gpu-uuid>/gi<n>/ci<m>)')
        return Atom(ref.id, cls, m["gpu"], int(m[2]), int(m[3]))
    if cls == DEVICE_CLASS_SLOT:
        m = SLOT_ID_RE.fullmatch(ref.id)
        if m is None:
            return Refusal(REASON_DEVICE, f'"{ref.id}" is not a GPU slot id (<gpu-uuid>/s<n>)')
        return Atom(ref.id, cls, m["gpu"], slot=int(m[2]))
    return Refusal(REASON_DEVICE, f"device class {cls} cannot be held")


def atom_from_id(atom_id: str) -> Atom:
    """An atom read back from a hold's `bcd.dev/device-id` (its class follows from the id's shape)."""
    if (m := MIG_ID_RE.fullmatch(atom_id)) is not None:
        return Atom(atom_id, DEVICE_CLASS_MIG, m["gpu"], int(m[2]), int(m[3]))
    if (m := SLOT_ID_RE.fullmatch(atom_id)) is not None:
        return Atom(atom_id, DEVICE_CLASS_SLOT, m["gpu"], slot=int(m[2]))
    return Atom(atom_id, DEVICE_CLASS_GPU, atom_id)


def missing(atom: Atom, inventory: GpuInventory) -> str | None:
    """The device-missing message for `atom`, or None when the inventory has it."""
    gpu = inventory.gpu(atom.gpu)
    if gpu is None:
        return f"{atom.gpu} not present"
    if atom.device_class == DEVICE_CLASS_MIG:
        mig = gpu.mig(atom.gpu_instance, atom.compute_instance)
        if mig is None or mig.uuid is None:
            return f"{atom.gpu} has no MIG instance gi{atom.gpu_instance}/ci{atom.compute_instance}"
    return None


def visible_name(atom: Atom, gpu: Gpu) -> str:
    """What NVIDIA_VISIBLE_DEVICES names for `atom`: the MIG UUID, or the (parent) GPU's UUID."""
    if atom.device_class == DEVICE_CLASS_MIG:
        mig = gpu.mig(atom.gpu_instance, atom.compute_instance)
        if mig is not None and mig.uuid is not None:
            return mig.uuid
    return gpu.uuid


def vendor_names(atom: Atom, gpu: Gpu) -> tuple[str, ...]:
    """The names NVIDIA's CDI spec may give the device `atom` stands for (uuid and index strategies)."""
    if atom.device_class == DEVICE_CLASS_MIG:
        mig = gpu.mig(atom.gpu_instance, atom.compute_instance)
        if mig is None:
            return ()
        names = [f"{gpu.index}:{mig.index}"]
        if mig.uuid:
            names.insert(0, mig.uuid)
        return tuple(names)
    return (gpu.uuid, str(gpu.index))


def visible_devices(atoms: tuple[Atom, ...], inventory: GpuInventory) -> str:
    """Each GPU once (however many of its slots), each MIG device's UUID; atom order, `,`-joined."""
    seen: list[str] = []
    for a in atoms:
        gpu = inventory.gpu(a.gpu)
        name = visible_name(a, gpu) if gpu is not None else a.gpu
        if name not in seen:
            seen.append(name)
    return ",".join(seen)
