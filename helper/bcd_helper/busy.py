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
"""

from __future__ import annotations

from attrs import frozen
from bcd_shared.system import System

ALL = "*"


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


def busy_gpus(system: System) -> Busy:
    """Root's view, read now. Raises BusyUnknown when the processes cannot be read."""
    return Busy(tuple(hold_gpus(system) + env_gpus(system) + compute_gpus(system)))


def known_gpus(system: System) -> tuple[str, ...] | None:
    """The GPU UUIDs nvidia-smi lists; None when there is no nvidia-smi."""
    result = system.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], timeout=60)
    if result.returncode == 127:
        return None
    if not result.ok:
        raise BusyUnknown(f"cannot list GPUs: {result.describe()}")
    return tuple(line.strip() for line in result.stdout.decode(errors="replace").splitlines() if line.strip())
