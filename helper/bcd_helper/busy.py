"""Root's own view of busy GPUs: live holds in /etc/cdi and compute processes from nvidia-smi.

(host-config.md "Busy GPUs are root's view"; HST-HLP-33..36; delivery.md "gpu.reset and live holds")
- every GPU that a live hold's CDI spec (`/etc/cdi/bcd-*.json`) names, through its devices'
  `bcd.dev/device-id` annotations, with `<uuid>/gi<n>/ci<m>` and `<uuid>/s<n>` reduced to their GPU
  (Q-HST-HLP-02, decided so). A hold file root cannot parse makes every GPU busy (fail closed);
- every GPU an allocation env file's NVIDIA_VISIBLE_DEVICES names (`env_gpus`, round 6b: NVIDIA's legacy
  runtime hook hands it to the allocation's jobs), with or without its CDI hold;
- every GPU with compute processes (`nvidia-smi --query-compute-apps=gpu_uuid,pid --format=csv,noheader`,
  whose format is in ../shared/reference/nvidia-smi/csv/*query-compute-apps*); a `MIG-` UUID there
  makes every GPU busy. A host without nvidia-smi (exit 127) has no compute processes; any other
  failure fails the check (root does not guess).

With `passthrough` (gpu.reset and the `mig-layout` unit; docs/helper.md, "Threat model, round 8"), also
every GPU a VM has or is to have through VFIO (DEV-BUSY-05), from facts root reads itself, never the
node's records; each GPU by its PCI address from root's nvidia-smi (`--query-gpu=uuid,pci.bus_id`):
- bound to vfio-pci, or sharing its IOMMU group with a device bound to vfio-pci (the runtimes hand the
  whole group to the VMM, delivery.md "the GPU's audio function too"): `/sys/bus/pci/devices/<addr>/driver`
  and `iommu_group` under root's `--root`;
- named by a hostdev of a libvirt definition root staged (`STAGE_DIR/<id>.xml`, written by
  `libvirt.define`/`restore` after their checks, removed by `libvirt.undefine`): defined, it is that
  instance's at its next start, as the node's VFIO side counts it. A staged file root cannot parse
  makes every GPU busy.
A GPU already on vfio-pci is not listed by a real nvidia-smi, so it cannot be named by its UUID here;
root never runs a reset for a UUID its nvidia-smi does not list (`unknown GPU`).
The VM starts (libvirt.start/restore, ch.vfio) read the view without `passthrough`: they pass GPUs
through themselves, and their own rules (`group-in-use`, libvirt's) decide between VMs.
"""

from __future__ import annotations

import errno
import os

from attrs import frozen
from bcd_shared.system import System

ALL = "*"
PCI = "/sys/bus/pci/devices"
GROUPS = "/sys/kernel/iommu_groups"
VFIO_DRIVER = "vfio-pci"
STAGE_DIR = "/var/lib/bcd-hostconfig/libvirt"  # bcd_helper.taps.STAGE_DIR: root's staged definitions


class BusyUnknown(Exception):
    """Root could not read what uses the GPUs."""


@frozen
class Busy:
    """GPU UUID -> why it is busy; ALL in `by_gpu` means every GPU."""

    by_gpu: tuple[tuple[str, str], ...]

    def reason(self, gpu: str) -> str | None:
        for uuid, why in self.by_gpu:
            if uuid in (gpu, ALL):
                return why
        return None

    def gpus(self) -> frozenset[str]:
        return frozenset(u for u, _ in self.by_gpu)


def gpu_of(device_id: str) -> str:
    return device_id.split("/", 1)[0]


def hold_gpus(system: System) -> list[tuple[str, str]]:
    from bcd_shared import cdi  # on the first busy check, not at the helper's start

    out: list[tuple[str, str]] = []
    for alloc, path, data in cdi.hold_spec_files(system):
        try:
            hold = cdi.parse_hold_spec(data, alloc)
        except cdi.CdiError:
            out.append((ALL, f"the hold {path} cannot be read"))
            continue
        for dev in hold.device_ids:
            out.append((gpu_of(dev), f"{gpu_of(dev)} is held by {hold.allocation_id}"))
    return out


def env_gpus(system: System) -> list[tuple[str, str]]:
    """Every GPU an allocation env file (`/run/bcd/allocations/<id>.env`) names in NVIDIA_VISIBLE_DEVICES
    (round 6b): a workload manager using NVIDIA's legacy runtime hook hands that GPU to the allocation's
    jobs whether or not its CDI hold is still there. Read as root's `atoms-held` rule reads them
    (bcd_helper.ops.files._env_atoms): a GPU's UUID is that GPU, a MIG UUID its GPU by root's nvidia-smi
    (asked only when one is named), `void`/`none` nothing; a file that does not parse, or a name root
    cannot place (`all`, an index, an unknown MIG UUID), makes every GPU busy (fail closed)."""
    from bcd_shared import cdi

    from bcd_helper.ops.files import _env_atoms, mig_uuid_atoms

    mig_atoms = mig_uuid_atoms(system)
    out: list[tuple[str, str]] = []
    for alloc, path, data in cdi.env_files(system):
        named = _env_atoms(data, alloc, (), mig_atoms)
        if named is None:
            out.append(
                (ALL, f"the env file {path} of allocation {alloc} cannot be read: it may name any GPU")
            )
            continue
        for gpu in sorted({gpu_of(atom) for atom in named}):
            out.append((gpu, f"{gpu} is named by allocation {alloc}'s env file {path}"))
    return out


def compute_gpus(system: System) -> list[tuple[str, str]]:
    result = system.run(
        ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"], timeout=60
    )
    if result.returncode == 127:
        return []
    if not result.ok:
        raise BusyUnknown(f"cannot list compute processes: {result.describe()}")
    out: list[tuple[str, str]] = []
    for line in result.stdout.decode(errors="replace").splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 2 or not fields[0]:
            continue
        uuid, pid = fields[0], fields[1]
        if uuid.startswith("MIG-"):
            out.append((ALL, f"a MIG device ({uuid}) runs compute process {pid}"))
        else:
            out.append((uuid, f"{uuid} runs compute process {pid}"))
    return out


def sysfs_address(bus_id: str) -> str:
    """nvidia-smi's `00000000:18:00.0` as sysfs names it (`0000:18:00.0`)."""
    domain, _, rest = bus_id.strip().partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def gpu_addresses(system: System) -> dict[str, str]:
    """GPU UUID -> PCI address (sysfs form), as root's nvidia-smi lists them; {} without nvidia-smi."""
    result = system.run(["nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"], timeout=60)
    if result.returncode == 127:
        return {}
    if not result.ok:
        raise BusyUnknown(f"cannot list GPUs: {result.describe()}")
    out: dict[str, str] = {}
    for line in result.stdout.decode(errors="replace").splitlines():
        uuid, _, bus = (f.strip() for f in line.partition(","))
        if uuid and bus:
            out[uuid] = sysfs_address(bus)
    return out


def _link_name(system: System, path: str) -> str | None:
    """The last part of a sysfs link's target; None when there is no link. Any other error fails the
    check: root does not take an unreadable binding for a free GPU."""
    try:
        return os.path.basename(os.readlink(system.host_path(path)))
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise BusyUnknown(f"cannot read {path}: {exc.strerror}") from None


def vfio_gpus(system: System, addresses: dict[str, str]) -> list[tuple[str, str]]:
    """Every GPU bound to vfio-pci, or in an IOMMU group with a device bound to it."""
    out: list[tuple[str, str]] = []
    for uuid, addr in sorted(addresses.items()):
        if _link_name(system, f"{PCI}/{addr}/driver") == VFIO_DRIVER:
            out.append((uuid, f"{uuid} ({addr}) is bound to vfio-pci: it is passed through to a VM"))
            continue
        group = _link_name(system, f"{PCI}/{addr}/iommu_group")
        if group is None:  # no IOMMU group: nothing of it can be on vfio-pci
            continue
        for dev in system.listdir(f"{GROUPS}/{group}/devices"):
            if dev != addr and _link_name(system, f"{PCI}/{dev}/driver") == VFIO_DRIVER:
                out.append(
                    (
                        uuid,
                        f"{uuid} ({addr}) shares IOMMU group {group} with {dev}, which is bound to "
                        "vfio-pci: it is passed through to a VM",
                    )
                )
                break
    return out


def staged_gpus(system: System, addresses: dict[str, str]) -> list[tuple[str, str]]:
    """Every GPU a hostdev of a libvirt definition root staged names, as that instance's."""
    import xml.etree.ElementTree as ET  # on the first such check, not at the helper's start

    from bcd_shared.instancenames import valid_instance_id

    by_address = {addr: uuid for uuid, addr in addresses.items()}
    out: list[tuple[str, str]] = []
    for entry in system.listdir(STAGE_DIR):
        name = entry.removesuffix(".xml")
        if not entry.endswith(".xml") or not valid_instance_id(name):
            continue  # a memory snapshot's state file (`<id>.state`), never a definition
        path = f"{STAGE_DIR}/{entry}"
        data = system.read_bytes(path)
        if data is None:
            continue  # undefined since the listing
        try:
            root = ET.fromstring(data)  # noqa: S314 (root's own staged file)
        except ET.ParseError:
            out.append((ALL, f"root's libvirt definition {path} cannot be read: it may name any GPU"))
            continue
        for a in root.findall("devices/hostdev/source/address"):
            try:
                parts = [int(a.get(k, ""), 16) for k in ("domain", "bus", "slot", "function")]
            except ValueError:
                continue  # no PCI address: not a GPU of this host (define's check)
            addr = "{:04x}:{:02x}:{:02x}.{:x}".format(*parts)
            uuid = by_address.get(addr)
            if uuid is not None:
                out.append((uuid, f"{uuid} is passed through to instance {name} ({addr}, root's definition)"))
    return out


def passthrough_gpus(system: System) -> list[tuple[str, str]]:
    """Every GPU a VM has or is to have through VFIO, as root reads it (module docstring)."""
    addresses = gpu_addresses(system)
    return vfio_gpus(system, addresses) + staged_gpus(system, addresses)


def busy_gpus(system: System, *, passthrough: bool = False) -> Busy:
    """Root's view, read now; with `passthrough`, the GPUs VMs have too. Raises BusyUnknown when the
    processes (or with `passthrough`, the GPUs or a driver binding) cannot be read."""
    found = hold_gpus(system) + env_gpus(system) + compute_gpus(system)
    if passthrough:
        found += passthrough_gpus(system)
    return Busy(tuple(found))


def known_gpus(system: System) -> tuple[str, ...] | None:
    """The GPU UUIDs nvidia-smi lists; None when there is no nvidia-smi."""
    result = system.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], timeout=60)
    if result.returncode == 127:
        return None
    if not result.ok:
        raise BusyUnknown(f"cannot list GPUs: {result.describe()}")
    return tuple(line.strip() for line in result.stdout.decode(errors="replace").splitlines() if line.strip())
