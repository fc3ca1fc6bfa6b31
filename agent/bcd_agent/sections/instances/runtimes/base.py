"""The runtime interface the instances section drives, and what a runtime reports.

A runtime lists its domains (managed or not) and acts on bcd's own ones. Every method raises a
StepError: RetryableError when the host or a tool failed (the next pass retries), TerminalError when
the spec can never work here (a bad image, a shrink: the instance's ERROR), `CapacityRefused` when the
runtime refused a start for lack of memory (DLV-LIBVIRT-20: an ERROR; or, for a runtime that checks
capacity itself, a ResourcesExhausted wait).
"""

from __future__ import annotations

from typing import Protocol

from attrs import frozen
from bcd_shared.errors import TerminalError

from bcd_agent.sections.instances.model import InstanceSpec

RUNNING = "running"
PAUSED = "paused"
STOPPED = "stopped"


class CapacityRefused(TerminalError):
    """The runtime refused a start for lack of memory ("Cannot allocate memory")."""


class ErrNoBalloon(TerminalError):
    """The guest was defined without a balloon device: the balloon controller never touches it
    (DLV-BAL-14; every runtime's `set_balloon` raises it)."""

    def __init__(self, name: str) -> None:
        super().__init__("ErrNoBalloon", f"{name} has no balloon device")


@frozen
class Domain:
    """One domain a runtime holds."""

    name: str
    runtime: str
    state: str  # RUNNING | PAUSED | STOPPED (libvirt's other states are reported as stopped)
    managed: bool
    allocation_id: str = ""
    vcpus: int = 0
    memory_bytes: int = 0
    hugepages: int = 0
    gpu_addresses: tuple[str, ...] = ()
    disk_bytes: int | None = None  # the overlay's virtual size from its header, when read
    definition: str = ""  # bcd's metadata: the digest of what the definition was built from
    volumes: tuple[tuple[str, bool, str], ...] = ()  # (volume id, read-only, target) it attaches


@frozen
class DomainFiles:
    disk: str  # the overlay (or the blank disk of an iso install)
    base: str | None = None  # the base image the overlay names
    base_format: str | None = None
    seed: str | None = None  # the NoCloud seed iso
    install_iso: str | None = None  # an iso image booted from a cdrom
    kernel: str | None = None  # direct kernel boot (test guests)
    initrd: str | None = None
    cmdline: str | None = None
    volumes: tuple[tuple[str, str, bool], ...] = ()  # (path, serial, read-only), as vdb onward


@frozen
class Prepared:
    """What `create` needs besides the spec: GPU addresses and the fetched user data."""

    gpu_addresses: tuple[str, ...] = ()
    user_data: bytes | None = None


class Runtime(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def checks_capacity(self) -> bool: ...

    def list(self) -> tuple[Domain, ...]: ...

    def create(self, inst: InstanceSpec, prepared: Prepared) -> None: ...

    def start(self, inst: InstanceSpec, paused: bool) -> None: ...

    def suspend(self, name: str) -> None: ...

    def resume(self, name: str) -> None: ...

    def stop(self, name: str) -> None: ...

    def delete(self, name: str) -> None: ...

    def grow(self, inst: InstanceSpec, running: bool) -> None: ...

    def leftovers(self, domains: tuple[Domain, ...]) -> tuple[str, ...]: ...

    def remove_files(self, name: str) -> None: ...


# --- snapshots and restores (docs/instances.md "Snapshots and restores") ----------------------------

META_NAME = "meta.json"  # the tar's first member: SnapshotMeta as JSON
DISK_NAME = "disk.qcow2"  # the overlay flattened onto its base: one flat qcow2
SEED_NAME = "seed.iso"  # the NoCloud seed, when the instance had one
LIBVIRT_STATE_NAME = "save.state"  # libvirt-kvm: `virsh save`'s state (memory snapshots only)
CH_STATE_DIR = "ch/"  # cloud-hypervisor: its own snapshot (config.json, state.json, memory-ranges)


@frozen
class SnapshotMeta:
    """`meta.json`: which runtime took the snapshot, on which CPU model, with or without memory
    (DLV-LIBVIRT-22, DLV-CH-34). A restore refuses another runtime (DLV-SNAP-06, DLV-RT-12) and, with
    memory, another CPU model (DLV-SNAP-07)."""

    runtime: str
    cpu_model: str
    include_memory: bool


class SnapshotRefused(TerminalError):
    """A snapshot or restore the rules refuse (another runtime or CPU model, GPUs or read-write volumes
    with memory, a malformed tar): the command fails, or the restored instance is ERROR."""


class Snapshotting(Protocol):
    """What a runtime that takes snapshots adds to `Runtime` (plugin runtimes take none, DLV-RT-09).

    - `snapshot(inst, include_memory, tar_path)`: capture the instance's disk (flattened) and, with
      `include_memory`, its memory state, into a new tar at `tar_path` (a staging file under
      data_dir/snapshots, DLV-SNAP-13; the caller hashes and uploads it and removes it after). The
      domain carries on in the state it was in. Refusals (SnapshotRefused) before anything runs:
      memory with passthrough GPUs (DLV-RT-13) or a read-write volume (DLV-RT-14).
    - `restore(inst, tar_path, prepared)`: what `create` does for an instance with `restore_from`:
      unpack the verified tar into the new instance's directory, refusing another runtime or (with
      memory) another CPU model, check its disk and seed (DLV-IMG-15..17; a failed check removes the
      directory), and define the domain under the instance's own identity. A memory snapshot's first
      `start` then resumes the saved state instead of booting.
    - `cpu_model()`: this host's CPU model as `meta.json` records it.
    """

    def snapshot(self, inst: InstanceSpec, include_memory: bool, tar_path: str) -> SnapshotMeta: ...

    def restore(self, inst: InstanceSpec, tar_path: str, prepared: Prepared) -> None: ...

    def cpu_model(self) -> str: ...
