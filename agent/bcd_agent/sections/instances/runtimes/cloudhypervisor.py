"""The cloud-hypervisor runtime (docs/instances.md "cloud-hypervisor").

One VMM per instance in its confined unit (bcd_shared.chunit), started by `ch.launch` and driven over
its API socket (chapi.CHApi). `priv` does the root-only `ch.*` steps: the helper client (root reads
`vm.json` itself; the node owns the files under `data_dir/cloud-hypervisor` and root grants the VMM's
user ACL entries for the run), or, for a node running as root, chlocal.LocalChOps (chowns instead).

- Record (DLV-CH-26/27/28): `instances/<id>/vm.json` (bcd_shared.chrecord); `list` reports only
  directories with one, the state from `vm.info` (no answer on the socket: stopped).
- Create: an iso is refused (DLV-CH-08); an existing directory without vm.json is not bcd's and is
  refused (DLV-CH-28); a new instance is built in a staging directory renamed into place once its
  record is written; the base image downloaded once into `images/` (https only,
  SHA-256, header check), a qcow2 overlay naming it by the path the VMM sees (`qemu-img create -u`), the
  NoCloud seed, a VMM uid from bcd's range not used by another record, and the VM configuration:
  firmware (DLV-CH-04), `boot_vcpus` = `max_vcpus` = vCPUs (DLV-CH-24), disks with an explicit
  `image_type` and `backing_files` only on the overlay (DLV-CH-06/07), the serial port on
  `serial.sock` (DLV-CH-42), no NICs (DLV-CHU-05).
- Start: base and overlay checked again; `ch.taps`, `ch.launch`, then `vm.create`, one `vm.add-net`
  per NIC with the tap's fd (opened here, TUNSETIFF, sent by SCM_RIGHTS; DLV-CHH-08, DLV-CHU-06),
  `vm.boot`, and `vm.pause` for a paused start (DLV-CH-29). A failed NIC attach stops the VMM: no VM
  without its NICs (DLV-CH-14).
- Stop (DLV-CH-30/31): the ACPI power button, up to `stop_timeout_s` (60) for the guest to go, then
  `vm.shutdown`, `vmm.shutdown` and `ch.stop`, which must answer inactive or failed; the taps are
  deleted (`ch.untaps`, DLV-CH-16). Delete stops first, then removes the directory (DLV-CH-33).
- Grow (DLV-CH-09): `qemu-img resize` while stopped, `vm.resize-disk` while running; never smaller.
- Balloon: `set_balloon` is `vm.resize` with `desired_balloon` (only for a VM with a balloon device).
- Volumes: Raw disks `vol<i>` of the volume store with their serial, read-only when attached so;
  `resize_volume` is `vm.resize-disk`. Root binds them into the unit and grants the VMM's user its
  ACL entries for the run.
- Snapshots (DLV-CH-34/35; base.Snapshotting, snapshots.py): `snapshot(inst, include_memory,
  tar_path)` pauses a running VM, has the VMM write its own snapshot (`vm.snapshot`) into `snapshot/`
  of the instance's directory, flattens the overlay (`qemu-img convert`, every layer stated), writes
  the tar and resumes. `restore(inst, tar_path, prepared)` defines a new instance from a downloaded
  tar (DLV-CH-36/37, DLV-CH-25): refusals, the flat-disk check, the configuration rebuilt from
  allowlists (`restored_config`); its first start is `vm.restore` with `net_fds`, then `vm.resume`.
- Console (DLV-CH-42): `console(name)` connects to `serial.sock`.

- GPUs (DLV-CH-17/18/23): VFIO devices from `/sys/bus/pci/devices/<addr>/`; `ch.vfio` before the
  launch, `ch.stop` gives the groups back to root, `ch.unvfio` at delete returns them to their drivers.

The section wires snapshots, restores, the identity rebind's flow (`rebind_attach`, `rebind_answer`,
`rebind_detach`), the balloon controller (`set_balloon`, `balloon_readings`) and console tunnels.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import struct
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from attrs import evolve, frozen
from bcd_shared.chrecord import MAX_BYTES as RECORD_MAX
from bcd_shared.chrecord import CHNic, CHRecord, CHVolume, RecordError, encode_record, parse_record
from bcd_shared.chunit import FIRMWARE, VMM_UID_BASE, VMM_UID_COUNT, ch_dir, ch_images_dir, ch_instance_dir
from bcd_shared.errors import HelperRefused, RetryableError, StepError, TerminalError
from bcd_shared.images import MAX_READ, ImageRefused, check_image, check_overlay, parse_header
from bcd_shared.instancenames import valid_instance_id, volumes_dir
from bcd_shared.rebinddisk import zero_and_remove
from bcd_shared.system import CommandResult, System

from bcd_agent.sections.instances.model import RUNTIME_CH, InstanceSpec
from bcd_agent.sections.instances.runtimes import images
from bcd_agent.sections.instances.runtimes.base import (
    CH_STATE_DIR,
    PAUSED,
    RUNNING,
    STOPPED,
    CapacityRefused,
    Domain,
    ErrNoBalloon,
    Prepared,
    Runtime,
    SnapshotMeta,
    SnapshotRefused,
    Snapshotting,
)
from bcd_agent.sections.instances.runtimes.chapi import CHApi, CHApiError

log = logging.getLogger("bcd.instances")

STOP_TIMEOUT_S = 60.0
SOCKET_WAIT_S = 10.0
MAX_VIRTUAL_SIZE = 64 << 40
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
_STATES = {"Running": RUNNING, "Paused": PAUSED, "Created": STOPPED, "Shutdown": STOPPED}
# A snapshot (DLV-CH-34; snapshots.py writes and reads the tar): meta.json, the flattened overlay,
# the seed and, with memory, the VMM's own snapshot under ch/. Restored, the VMM's files are moved to
# the top of the instance's directory: the source of vm.restore, and where root's ACL entries for the
# VMM's user reach them under the helper (entries are granted on the directory's own files).
MEMORY_FILES = ("config.json", "state.json", "memory-ranges")
SNAPSHOT_WORK = "snapshot"  # in the instance's directory: where the VMM writes its snapshot
MAX_CONFIG = 1 << 20
MAX_STATE = 256 << 20
MAX_SEED = 64 << 20


def open_tap(name: str) -> int:
    """Attach to the persistent tap `name` (the node's, created by ch.taps); its fd (DLV-CHU-04)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
    except OSError:
        os.close(fd)
        raise
    return fd


def vm_config(
    inst: InstanceSpec,
    rec_dir: str,
    base: str | None,
    seed: bool,
    gpus: tuple[str, ...] = (),
    volumes: tuple[CHVolume, ...] = (),
    data_dir: str = "/var/lib/bcd",
) -> dict[str, Any]:
    """The `vm.create` body (VmConfig of the v51 API): no NICs, no tap names; GPUs as VFIO devices
    from their sysfs directories (DLV-CH-17); volumes as raw disks `vol<i>` with their serial,
    read-only when attached so (DLV-VOL-12/13). `base` None: a restored, flat disk (no
    `backing_files`, DLV-CH-07)."""
    disks: list[dict[str, Any]] = [
        {
            "id": "disk0",
            "path": f"{rec_dir}/disk.qcow2",
            "image_type": "Qcow2",
            "backing_files": base is not None,
        }
    ]
    if seed:
        disks.append({"id": "seed", "path": f"{rec_dir}/seed.iso", "image_type": "Raw", "readonly": True})
    for i, vol in enumerate(volumes):
        disks.append(
            {
                "id": f"vol{i}",
                "path": f"{volumes_dir(data_dir)}/{vol.name}",
                "image_type": "Raw",
                "readonly": vol.read_only,
                "serial": vol.serial,
            }
        )
    memory: dict[str, Any] = {"size": inst.memory_bytes, "shared": False}
    if inst.hugepages:
        memory.update(hugepages=True, hugepage_size=inst.hugepages)
    from bcd_agent.sections.instances.placement import cpu_placement

    cpus: dict[str, Any] = {"boot_vcpus": inst.vcpus, "max_vcpus": inst.vcpus}
    placed = cpu_placement(inst)
    if placed is not None:
        # DLV-PLC-11 (as libvirt-kvm's vcpupin or cpuset): one host CPU per vCPU when the placement
        # names exactly as many, else every vCPU floats over the whole set.
        cpus["affinity"] = [
            {"vcpu": i, "host_cpus": [placed.cpus[i]] if placed.pinned else list(placed.cpus)}
            for i in range(inst.vcpus)
        ]
    config: dict[str, Any] = {
        "payload": {"firmware": FIRMWARE},
        "cpus": cpus,
        "memory": memory,
        "disks": disks,
        "serial": {"mode": "Socket", "socket": f"{rec_dir}/serial.sock"},
        "console": {"mode": "Off"},
        "rng": {"src": "/dev/urandom"},
    }
    if inst.placement is not None and inst.placement.balloon:
        config["balloon"] = {"size": 0, "free_page_reporting": True}
    if gpus:
        config["devices"] = [
            {"id": f"gpu{i}", "path": f"/sys/bus/pci/devices/{a}/"} for i, a in enumerate(gpus)
        ]
    return config


def stated_chain(disk: str, base: str | None, base_format: str | None) -> str:
    """qemu-img's name for bcd's overlay with its base: a json: name stating each layer's driver and
    file, the base's own backing null (none for a flat disk), so no name in a header is followed
    (instances-facts: `convert --image-opts … backing=null` opened no such file)."""
    layer: dict[str, Any] = {"driver": "qcow2", "file": {"driver": "file", "filename": disk}, "backing": None}
    if base is not None and base_format is not None:
        backing: dict[str, Any] = {"driver": base_format, "file": {"driver": "file", "filename": base}}
        if base_format == "qcow2":
            backing["backing"] = None
        layer["backing"] = backing
    return "json:" + json.dumps(layer, separators=(",", ":"))


@frozen
class Pinned:
    """An open file of an instance's directory: its descriptor, its /proc/<pid>/fd/<n> name (that very
    inode, for tools), and its path as shown in messages."""

    fd: int
    path: str
    shown: str


@frozen
class CHBalloonReading:
    """One guest's balloon as the controller reads it (the fields of balloon.BalloonReading)."""

    balloon_bytes: int
    used_bytes: int | None = None


class CloudHypervisorRuntime:
    """See the module docstring. `priv` is the helper client (its `call(op, args)`)."""

    name = RUNTIME_CH
    checks_capacity = False

    def __init__(
        self,
        system: System,
        priv: Any,
        data_dir: str,
        *,
        intent: Callable[[], Any] = dict,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        socket_wait_s: float = SOCKET_WAIT_S,
        max_virtual_size: int = MAX_VIRTUAL_SIZE,
        tap_opener: Callable[[str], int] = open_tap,
        sleep: Callable[[float], None] = time.sleep,
        owner: int | None = None,
    ) -> None:
        self.system = system
        self.priv = priv
        self.data_dir = data_dir.rstrip("/")
        self.intent = intent
        self.stop_timeout_s = stop_timeout_s
        self.socket_wait_s = socket_wait_s
        self.max_virtual_size = max_virtual_size
        self.tap_opener = tap_opener
        self.sleep = sleep
        self.owner = os.geteuid() if owner is None else owner  # who owns bcd's own files (vm.json)

    # -- paths -----------------------------------------------------------------------------------

    def _dir(self, name: str) -> str:
        return ch_instance_dir(self.data_dir, name)

    def _real(self, path: str) -> str:
        return str(self.system.host_path(path))

    def api(self, name: str, timeout_s: float = 30.0) -> CHApi:
        return CHApi(self._real(f"{self._dir(name)}/api.sock"), timeout_s=timeout_s)

    @contextlib.contextmanager
    def _pinned(self, path: str, write: bool = False, dir_fd: int | None = None) -> Iterator[Pinned]:
        """A file of an instance's directory, where the VMM's user may rename and replace entries
        (its ACL entry on the directory; as root it owns it): opened once without following a
        symlink, a regular file, checked through its descriptor and named to tools as
        /proc/<pid>/fd/<n>, that very inode, so a swap between the check and the use changes
        nothing. With `dir_fd`, `path` is a name in that open directory."""
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path if dir_fd is not None else self._real(path), flags, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise RetryableError("NoFile", f"{path}: missing") from None
            raise TerminalError("BadDisk", f"{path}: {exc.strerror} (a regular file, no symlink)") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TerminalError("BadDisk", f"{path}: not a regular file")
            yield Pinned(fd, f"/proc/{os.getpid()}/fd/{fd}", path)
        finally:
            os.close(fd)

    def _read_own(self, path: str, limit: int) -> bytes | None:
        """A file bcd wrote (vm.json): read without following a symlink, and only as the node's own
        regular file; the VMM's user could otherwise plant one of its own. None when missing."""
        try:
            fd = os.open(self._real(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RetryableError(
                "BadRecord", f"{path}: {exc.strerror} (the node's file, no symlink)"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != self.owner:
                raise RetryableError("BadRecord", f"{path}: not the node's own regular file")
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(limit)
        finally:
            os.close(fd)

    def record(self, name: str) -> CHRecord | None:
        data = self._read_own(f"{self._dir(name)}/vm.json", RECORD_MAX + 1)
        if data is None:
            return None
        try:
            return parse_record(data)
        except RecordError as exc:
            raise RetryableError("BadRecord", f"{name}/vm.json: {exc}") from None

    def _to_vmm(self, path: str, rec: CHRecord) -> None:
        """As root (no helper), what bcd adds to a running VMM's directory is chowned to the VMM's
        user (DLV-CHU-09, DLV-REB-08); under the helper the inherited ACL entries give it access."""
        if getattr(self.priv, "as_root", False):
            os.chown(self._real(path), rec.uid, rec.uid, follow_symlinks=False)

    def _call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.priv.call(op, args)
        return out

    def _signed(self, name: str) -> dict[str, Any]:
        args: dict[str, Any] = {"name": name}
        intent = self.intent()
        if intent:
            args["intent"] = intent
        return args

    # -- listing ---------------------------------------------------------------------------------

    def _state(self, name: str) -> str:
        try:
            return _STATES.get(str(self.api(name, timeout_s=5).info()["state"]), STOPPED)
        except CHApiError as exc:
            if exc.status == 0:  # no VMM on the socket
                return STOPPED
            raise RetryableError("StateFailed", f"{name}: {exc}") from None

    def list(self) -> tuple[Domain, ...]:
        out = []
        for name in self.system.listdir(f"{ch_dir(self.data_dir)}/instances"):
            if not valid_instance_id(name):
                continue  # a create's staging directory
            rec = self.record(name)
            if rec is None:
                continue  # not bcd's: never touched (DLV-CH-28)
            size = None
            with (
                contextlib.suppress(ImageRefused, StepError),
                self._pinned(f"{self._dir(name)}/disk.qcow2") as p,
            ):
                size = parse_header(os.pread(p.fd, MAX_READ, 0), self.max_virtual_size).virtual_size
            out.append(
                Domain(
                    name=name,
                    runtime=self.name,
                    state=self._state(name),
                    managed=True,
                    allocation_id=rec.allocation_id,
                    vcpus=rec.vcpus,
                    memory_bytes=rec.memory_bytes,
                    hugepages=int(rec.config.get("memory", {}).get("hugepage_size", 0) or 0),
                    gpu_addresses=rec.gpus,
                    disk_bytes=size,
                    definition=rec.definition,
                    volumes=tuple(
                        (v.name.removesuffix(".raw"), v.read_only, f"vol{i}")
                        for i, v in enumerate(rec.volumes)
                    ),
                )
            )
        return tuple(out)

    # -- images and create -----------------------------------------------------------------------

    def _mkdir(self, path: str, mode: int) -> None:
        images.make_dir(self.system, path, mode)

    def ensure_image(self, inst: InstanceSpec) -> str:
        """As libvirt-kvm's (DLV-CH-05; runtimes/images.py), into `cloud-hypervisor/images`."""
        assert inst.image is not None
        return images.ensure_image(
            self.system,
            ch_images_dir(self.data_dir),
            inst.image,
            self.max_virtual_size,
            dir_mode=0o700,
            describe=CommandResult.describe,
        )

    def _free_uid(self, name: str) -> int:
        used = set()
        for other in self.system.listdir(f"{ch_dir(self.data_dir)}/instances"):
            if other == name:
                continue
            with contextlib.suppress(RetryableError):
                rec = self.record(other)
                if rec is not None:
                    used.add(rec.uid)
        for uid in range(VMM_UID_BASE, VMM_UID_BASE + VMM_UID_COUNT):
            if uid not in used:
                return uid
        raise RetryableError("NoVmmUid", "every VMM uid of bcd's range is in use")

    def _seed(self, inst: InstanceSpec, user_data: bytes, d: str) -> None:
        stage = f"{d}/seed"
        self._mkdir(stage, 0o700)
        self.system.write_atomic(f"{stage}/user-data", user_data, 0o600)
        meta = f"instance-id: {inst.id}\nlocal-hostname: {inst.id}\n".encode()
        self.system.write_atomic(f"{stage}/meta-data", meta, 0o600)
        out = self._real(f"{d}/seed.iso")
        files = [self._real(f"{stage}/user-data"), self._real(f"{stage}/meta-data")]
        result = self.system.run(
            ["genisoimage", "-quiet", "-output", out, "-volid", "cidata", "-joliet", "-rock", *files],
            timeout=120,
        )
        shutil.rmtree(self._real(stage), ignore_errors=True)
        if not result.ok:
            raise RetryableError("SeedFailed", f"the NoCloud seed: {result.describe()}")

    def _check_create(self, inst: InstanceSpec, prepared: Prepared) -> None:
        if len(prepared.gpu_addresses) != len(inst.gpu_uuids):
            raise TerminalError("NoGpuAddress", "a GPU without a PCI address in the inventory")
        for i, nic in enumerate(inst.nics):
            if not nic.bridge:
                raise TerminalError("BadNic", f"nics[{i}]: a NIC without a network")

    def _workdir(self, name: str) -> tuple[str, bool]:
        """Where a create builds the instance's files: the directory itself when its record exists
        (a definition changed), else a staging directory renamed into place once `vm.json` is in it,
        so a crash mid-create never leaves a directory without a record that bcd would have to
        call its own. An existing directory without `vm.json` is not bcd's: never defined over
        (DLV-CH-28)."""
        for d in (ch_dir(self.data_dir), f"{ch_dir(self.data_dir)}/instances"):
            self._mkdir(d, 0o711)
        final = self._dir(name)
        if self.system.exists(final):
            if self.record(name) is None:
                raise TerminalError(
                    "NotBcds",
                    f"{final} exists without a vm.json: it is not bcd's and is never defined over",
                )
            return final, False
        # Staging directories a crashed create left (bcd's own: never an instance id); creates run
        # one at a time, so none is in use now.
        for n in self.system.listdir(f"{ch_dir(self.data_dir)}/instances"):
            if n.startswith(".") and n.endswith(".new"):
                self._remove_tree(f"{ch_dir(self.data_dir)}/instances/{n}")
        stage = self._stage(name)
        # Sticky (1700): the VMM's user, which root's ACL entry lets create its sockets here, can
        # never rename or remove the node's files (vm.json, the disks, the seed, the rebind disk).
        self._mkdir(stage, 0o1700)
        return stage, True

    def _stage(self, name: str) -> str:
        # Never an instance id (a leading dot): list() and the helper never take it for one.
        return f"{ch_dir(self.data_dir)}/instances/.{name}.new"

    def _commit(self, name: str, work: str, staged: bool, rec: CHRecord) -> None:
        try:
            data = encode_record(rec)
            parse_record(data)  # what root will read
        except RecordError as exc:
            raise TerminalError("BadSpec", f"vm.json: {exc}") from None
        self.system.write_atomic(f"{work}/vm.json", data, 0o600)
        if staged:
            os.rename(self._real(work), self._real(self._dir(name)))
            fd = os.open(self._real(f"{ch_dir(self.data_dir)}/instances"), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def create(self, inst: InstanceSpec, prepared: Prepared) -> None:
        img = inst.image
        if inst.restore_from:
            # A restored instance defined again (its definition changed while it was stopped): its
            # record is brought up to date, its files kept; a new one comes from its tar (restore).
            if self.record(inst.id) is None:
                raise TerminalError("RestoreFrom", "a restore is created by restore() from its snapshot")
            self.restore(inst, "", prepared)
            return
        if img is None:
            raise TerminalError("NoImage", "cloud-hypervisor needs an image")
        if img.format == "iso":
            raise TerminalError("BadImage", "cloud-hypervisor boots disk images, not an iso")
        self._check_create(inst, prepared)
        volumes = self._volumes(inst)
        base = self.ensure_image(inst)
        work, staged = self._workdir(inst.id)
        d = self._dir(inst.id)
        with self._unstaged_on_failure(work, staged):
            disk = f"{work}/disk.qcow2"
            if not self.system.exists(disk):
                size = max(inst.disk_bytes, self._base_size(base, img.format))
                # The overlay names its base by the path the VMM sees (bound read-only into its unit).
                result = self.system.run(
                    ["qemu-img", "create", "-f", "qcow2", "-u", "-b", base, "-F", img.format,
                     self._real(disk), str(size)],
                    timeout=600,
                )  # fmt: skip
                if not result.ok:
                    raise RetryableError("QemuImgFailed", f"qemu-img create: {result.describe()}")
                os.chmod(self._real(disk), 0o600)
            self._check_overlay_at(disk, inst)
            if prepared.user_data is not None:
                self._seed(inst, prepared.user_data, work)
            seed = self.system.exists(f"{work}/seed.iso")
            config = vm_config(inst, d, base, seed, prepared.gpu_addresses, volumes, self.data_dir)
            self._write_record(inst, prepared, work, staged, config, seed, volumes, unvfio_dropped=True)

    @contextlib.contextmanager
    def _unstaged_on_failure(self, work: str, staged: bool) -> Iterator[None]:
        """A create or restore that fails removes the staging directory it made (an existing
        instance's directory is kept as it was)."""
        try:
            yield
        except BaseException:
            if staged:
                shutil.rmtree(self._real(work), ignore_errors=True)
            raise

    def _write_record(
        self,
        inst: InstanceSpec,
        prepared: Prepared,
        work: str,
        staged: bool,
        config: dict[str, Any],
        seed: bool,
        volumes: tuple[CHVolume, ...],
        *,
        restored: bool = False,
        unvfio_dropped: bool = False,
    ) -> None:
        """The end of a create or restore: the record written into `work` (the staged directory then
        renamed into place), keeping an existing instance's uid. `unvfio_dropped` (create): a GPU the
        spec dropped goes back to its host driver first."""
        old = None if staged else self.record(inst.id)
        if unvfio_dropped and old is not None and set(old.gpus) - set(prepared.gpu_addresses):
            # DLV-CH-23: a GPU the spec dropped goes back to its host driver while the record
            # still names it (a definition changes only while the VM is stopped).
            self._call("ch.unvfio", {"name": inst.id})
        rec = self._new_record(inst, prepared, config, seed, volumes, restored=restored)
        if old is not None:
            rec = evolve(rec, uid=old.uid)
        self._commit(inst.id, work, staged, rec)

    def _new_record(
        self,
        inst: InstanceSpec,
        prepared: Prepared,
        config: dict[str, Any],
        seed: bool,
        volumes: tuple[CHVolume, ...],
        restored: bool = False,
    ) -> CHRecord:
        from bcd_agent.sections.instances.model import definition_digest

        img = inst.image
        return CHRecord(
            name=inst.id,
            allocation_id=inst.allocation_id,
            uid=self._free_uid(inst.id),
            vcpus=inst.vcpus,
            memory_bytes=inst.memory_bytes,
            image_sha256=None if restored or img is None else img.sha256,
            image_format=None if restored or img is None else img.format,
            seed=seed,
            nics=tuple(CHNic(n.mac, n.bridge) for n in inst.nics),
            gpus=tuple(prepared.gpu_addresses),
            volumes=volumes,
            hugepages=bool(inst.hugepages),
            cpus=inst.placement.cpus if inst.placement is not None else "",
            mems=inst.placement.mems if inst.placement is not None else "",
            restored=restored,
            config=config,
            definition=definition_digest(inst, tuple(prepared.gpu_addresses)),
        )

    def _volumes(self, inst: InstanceSpec) -> tuple[CHVolume, ...]:
        """Each attached volume as the record names it: the store's `<id>.raw` and the serial of its
        record (volumes are created before any instance is defined, DLV-VOL-08). Root grants the VMM's
        user its ACL entry, read-write or read-only, for the run (DLV-CHH-04)."""
        out = []
        store = volumes_dir(self.data_dir)
        for vid, ro in inst.volumes:
            record = self.system.read_bytes(f"{store}/{vid}.json")
            try:
                serial = json.loads(record or b"{}").get("serial", "")
            except ValueError:
                serial = ""
            if not serial or not self.system.exists(f"{store}/{vid}.raw"):
                raise RetryableError("VolumeMissing", f"volume {vid} is not in the store yet")
            out.append(CHVolume(f"{vid}.raw", ro, str(serial)))
        return tuple(out)

    def resize_volume(self, name: str, target: str, size_bytes: int) -> None:
        """A grown volume reaches the running or paused guest (DLV-VOL-11): the store truncated the
        file already; `vm.resize-disk` tells the guest."""
        try:
            self.api(name).resize_disk(target, size_bytes)
        except CHApiError as exc:
            raise RetryableError("GrowFailed", f"{name}: volume {target}: {exc}") from None

    def _base_size(self, base: str, fmt: str) -> int:
        if fmt == "qcow2":
            return check_image(self._real(base), self.max_virtual_size).virtual_size
        return os.stat(self._real(base)).st_size

    def check_overlay(self, inst: InstanceSpec) -> None:
        """bcd's overlay must name exactly its base (or nothing, for a restored disk): checked before
        every start, snapshot and resize."""
        rec = self.record(inst.id)
        self._check_overlay_at(
            f"{self._dir(inst.id)}/disk.qcow2", None if rec is not None and rec.restored else inst
        )

    def _check_overlay_at(self, disk: str, inst: InstanceSpec | None) -> None:
        img = inst.image if inst is not None else None
        base = f"{ch_images_dir(self.data_dir)}/{img.sha256}.{img.format}" if img is not None else None
        with self._pinned(disk) as p:
            self._overlay(p, base, img.format if img else None)

    def _overlay(self, disk: Pinned, base: str | None, base_format: str | None) -> int:
        """bcd's overlay, read through its descriptor: the header checks, and it names exactly `base`
        in `base_format` (nothing for a flat, restored disk); its virtual size (as
        bcd_shared.images.check_overlay, which opens by path)."""
        try:
            info = parse_header(os.pread(disk.fd, MAX_READ, 0), self.max_virtual_size, disk.shown)
        except ImageRefused as exc:
            raise TerminalError("BadDisk", f"disk.qcow2: {exc.message}") from None
        if base is None and info.backing_file is not None:
            raise TerminalError("BadDisk", f"{disk.shown}: names a backing file; a flat disk must name none")
        if base is not None and (info.backing_file != base or info.backing_format != base_format):
            raise TerminalError(
                "BadDisk",
                f"{disk.shown}: names backing file {str(info.backing_file)[:200]!r} "
                f"({info.backing_format}), not bcd's base {base!r} ({base_format})",
            )
        return info.virtual_size

    # -- states ----------------------------------------------------------------------------------

    def _wait_socket(self, name: str) -> CHApi:
        api = self.api(name)
        deadline = time.monotonic() + self.socket_wait_s
        while True:
            try:
                api.ping()
                return api
            except CHApiError:
                if time.monotonic() > deadline:
                    raise RetryableError(
                        "VmmFailed", f"{name}: the VMM's API socket did not answer"
                    ) from None
                self.sleep(0.05)

    def start(self, inst: InstanceSpec, paused: bool) -> None:
        rec = self.record(inst.id)
        if rec is None:
            raise RetryableError("NoRecord", f"{inst.id}: no vm.json (create first)")
        img = inst.image
        if not rec.restored and img is not None and img.format == "qcow2":
            try:
                check_image(
                    self._real(f"{ch_images_dir(self.data_dir)}/{img.sha256}.qcow2"), self.max_virtual_size
                )
            except ImageRefused as exc:
                raise TerminalError("BadImage", f"image {img.sha256[:12]}: {exc.message}") from None
        self.check_overlay(inst)
        d = self._dir(inst.id)
        memory = rec.restored and self.system.exists(f"{d}/{MEMORY_FILES[1]}")
        taps: list[str] = []
        if rec.nics:
            taps = list(
                self._call("ch.taps", {**self._signed(inst.id), "bridges": [n.bridge for n in rec.nics]})[
                    "taps"
                ]
            )
        if rec.gpus:  # DLV-CH-18: the groups bound to vfio-pci and handed to the VMM's user first
            self._call("ch.vfio", self._signed(inst.id))
        self._call("ch.launch", self._signed(inst.id))
        try:
            api = self._wait_socket(inst.id)
            if memory:
                # A memory restore's first start (DLV-CH-38): vm.restore from bcd's rebuilt
                # config.json with each NIC's tap fd as net_fds (DLV-CHU-07), then vm.resume. The
                # memory state goes once the VMM read it (the default restore mode copies it).
                fds: list[int] = []
                try:
                    for tap in taps:
                        fds.append(self.tap_opener(tap))
                    api.restore(d, [(f"net{i}", fd) for i, fd in enumerate(fds)])
                finally:
                    for fd in fds:
                        os.close(fd)
                if not paused:
                    api.resume()
                self._drop_memory_state(inst.id)
                return
            api.create(rec.config)
            for i, (nic, tap) in enumerate(zip(rec.nics, taps, strict=True)):
                fd = self.tap_opener(tap)
                try:
                    api.add_net({"id": f"net{i}", "mac": nic.mac}, fd)
                finally:
                    os.close(fd)
            api.boot()
            if paused:
                api.pause()
        except (CHApiError, OSError, RetryableError) as exc:
            # No VM without its NICs (DLV-CH-14): the VMM is stopped again.
            with contextlib.suppress(Exception):
                self._call("ch.stop", {"name": inst.id})
            text = str(exc)
            if "Cannot allocate memory" in text:
                raise CapacityRefused(
                    "CapacityRefused", f"cloud-hypervisor refused the start: {text}"
                ) from None
            raise RetryableError("StartFailed", f"{inst.id}: {text}") from None

    def suspend(self, name: str) -> None:
        self._api_step(name, "pause")

    def resume(self, name: str) -> None:
        self._api_step(name, "resume")

    def _api_step(self, name: str, verb: str) -> None:
        try:
            getattr(self.api(name), verb)()
        except CHApiError as exc:
            raise RetryableError(f"{verb.capitalize()}Failed", f"{name}: {exc}") from None

    def stop(self, name: str) -> None:
        """The power button, `stop_timeout_s` for the guest, then vm.shutdown, vmm.shutdown and the
        unit's stop, which must leave it inactive or failed (DLV-CH-30/31); the taps go (DLV-CH-16)."""
        api = self.api(name, timeout_s=10)
        if self._state(name) == RUNNING:
            with contextlib.suppress(CHApiError):
                api.power_button()
            deadline = time.monotonic() + self.stop_timeout_s
            while time.monotonic() < deadline and self._state(name) == RUNNING:
                self.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        for step in (api.shutdown, api.vmm_shutdown):
            with contextlib.suppress(CHApiError):
                step()
        state = str(self._call("ch.stop", {"name": name}).get("state", ""))
        if state not in ("inactive", "failed"):
            raise RetryableError(
                "StopFailed", f"{name}: the VMM's unit is still {state or 'unknown'} after its stop"
            )
        rec = self.record(name)
        if rec is not None and rec.nics:
            self._call("ch.untaps", {"name": name})

    def delete(self, name: str) -> None:
        """Stop first, never removing the directory of a VMM still running (DLV-CH-33); the record's
        GPUs go back to their host drivers (DLV-CH-23)."""
        self.stop(name)
        rec = self.record(name)
        if rec is not None and rec.gpus:
            self._call("ch.unvfio", {"name": name})
        shutil.rmtree(self._real(self._dir(name)), ignore_errors=True)

    def leftovers(self, domains: tuple[Domain, ...]) -> tuple[str, ...]:
        """None: a directory without vm.json is not bcd's and is never removed (DLV-CH-28), even one a
        create that failed before its record left behind."""
        return ()

    def remove_files(self, name: str) -> None:
        raise TerminalError("NotBcds", f"{name}: cloud-hypervisor removes only directories with a vm.json")

    def grow(self, inst: InstanceSpec, running: bool) -> None:
        rec = self.record(inst.id)
        if rec is None:
            raise RetryableError("NoRecord", f"{inst.id}: no vm.json (create first)")
        with self._pinned(f"{self._dir(inst.id)}/disk.qcow2", write=not running) as disk:
            current = self._check_record_disk(rec, disk)
            self._grow(inst, running, disk, current)

    def _grow(self, inst: InstanceSpec, running: bool, disk: Pinned, current: int) -> None:
        if inst.disk_bytes < current:
            raise TerminalError(
                "DiskShrink",
                f"size.disk_bytes {inst.disk_bytes} is below the disk's {current} bytes: disks only grow",
            )
        if inst.disk_bytes == current:
            return
        if running:
            try:
                self.api(inst.id).resize_disk("disk0", inst.disk_bytes)
            except CHApiError as exc:
                raise RetryableError("GrowFailed", f"{inst.id}: {exc}") from None
            return
        from bcd_agent.sections.instances.runtimes.libvirt import overlay_only

        # The overlay alone (qcow2 stated, backing null): qemu-img opens no file a header names, and
        # the file is the one checked (pinned).
        result = self.system.run(
            ["qemu-img", "resize", overlay_only(disk.path), str(inst.disk_bytes)], timeout=600
        )
        if not result.ok:
            raise RetryableError("QemuImgFailed", f"qemu-img resize: {result.describe()}")

    # -- identity rebind (DLV-REB-05..12, the runtime's half; the section's flow is not built) -----

    REBIND_ID = "rebind"
    REBIND_SERIAL = "bc-rebind"

    def rebind_attach(self, name: str, image: bytes) -> str:
        """Write the rebind disk into the instance's directory (0660: the VMM user's inherited ACL
        entry is effective, the node keeps owning it) and hot-add it with serial `bc-rebind`."""
        path = f"{self._dir(name)}/rebind.img"
        self.system.write_atomic(path, image, 0o660)
        rec = self.record(name)
        if rec is not None:
            self._to_vmm(path, rec)
        disk = {"id": self.REBIND_ID, "path": path, "image_type": "Raw", "serial": self.REBIND_SERIAL}
        try:
            return str(self.api(name).add_disk(disk).get("id", self.REBIND_ID))
        except CHApiError as exc:
            zero_and_remove(self._real(path))
            raise RetryableError("RebindFailed", f"{name}: vm.add-disk: {exc}") from None

    def rebind_answer(self, name: str, size: int = 4096) -> bytes:
        """The last `size` bytes of the rebind disk, where the guest writes its answer."""
        try:
            with self._pinned(f"{self._dir(name)}/rebind.img") as p:
                return os.pread(p.fd, size, max(0, os.fstat(p.fd).st_size - size))
        except StepError:
            return b""

    def rebind_detach(self, name: str) -> None:
        """Remove the disk from the VM (vm.remove-device) and zero and delete its file either way, so
        the secret never stays on the host (DLV-REB-11/12)."""
        path = f"{self._dir(name)}/rebind.img"
        try:
            with contextlib.suppress(CHApiError):
                self.api(name).remove_device(self.REBIND_ID)
        finally:
            zero_and_remove(self._real(path))

    # -- snapshots and restores (DLV-CH-25, DLV-CH-34..41, DLV-CHU-07/08, DLV-BAL-15) -------------
    # The runtime's half of DLV-SNAP-01..13: `snapshot` writes the tar into a staging file the
    # section names (under data_dir/snapshots), `restore` builds a new instance from a downloaded,
    # verified tar; the section does the transfers, hashes and retries.

    def cpu_model(self) -> str:
        """The host CPU's model as meta.json records it, which a memory snapshot must match."""
        from bcd_agent.sections.instances.snapshots import cpu_model

        return cpu_model(self.system)

    def _base_of(self, rec: CHRecord) -> str | None:
        if rec.restored or rec.image_sha256 is None:
            return None
        return f"{ch_images_dir(self.data_dir)}/{rec.image_sha256}.{rec.image_format}"

    def _check_record_disk(self, rec: CHRecord, disk: Pinned) -> int:
        """The pinned overlay `disk` names exactly the record's base (nothing for a restored disk);
        its virtual size."""
        base = self._base_of(rec)
        return self._overlay(disk, base, None if base is None else rec.image_format)

    def _flatten(self, rec: CHRecord, out: str) -> None:
        """The overlay, checked and pinned, flattened onto its base into `out` (a real path outside
        the instance's directory) with `qemu-img convert`, every layer's driver and file stated
        (stated_chain): qemu-img opens no file a header names, nor one swapped in after the check."""
        base = self._base_of(rec)
        with self._pinned(f"{self._dir(rec.name)}/disk.qcow2") as disk:
            self._check_record_disk(rec, disk)
            src = stated_chain(disk.path, None if base is None else self._real(base), rec.image_format)
            result = self.system.run(["qemu-img", "convert", "-O", "qcow2", src, out], timeout=6 * 3600)
        if not result.ok:
            raise RetryableError("QemuImgFailed", f"qemu-img convert: {result.describe()}")

    def snapshot(self, inst: InstanceSpec, include_memory: bool, tar_path: str) -> SnapshotMeta:
        """Write instance `inst`'s snapshot to the new tar `tar_path` (a real path: the section's
        staging file; DLV-CH-34): meta.json, the overlay flattened, the seed and, with memory, the
        VMM's `vm.snapshot` of the paused VM under ch/. A running VM is paused for it and resumed
        after, whatever happened (DLV-CH-35). Memory needs a running or paused VM, and is refused
        with GPUs or a read-write volume before anything runs (DLV-RT-13/14)."""
        from bcd_agent.sections.instances.snapshots import refuse_memory_snapshot, write_tar

        name = inst.id
        refuse_memory_snapshot(inst, include_memory)
        rec = self.record(name)
        if rec is None:
            raise TerminalError("NotBcds", f"{name}: no vm.json: not a cloud-hypervisor instance of bcd's")
        with self._pinned(f"{self._dir(name)}/disk.qcow2") as disk:
            self._check_record_disk(rec, disk)
        state = self._state(name)
        if include_memory and state == STOPPED:
            raise SnapshotRefused("NotRunning", f"{name}: a memory snapshot needs a running or paused VM")
        d = self._dir(name)
        work = f"{d}/{SNAPSHOT_WORK}"
        api = self.api(name, timeout_s=600)
        paused_here = False
        meta = SnapshotMeta(self.name, self.cpu_model(), include_memory)
        flat = f"{tar_path}.disk"
        work_fd = self._fresh_dir(work)
        try:
            self._to_vmm(work, rec)
            if state == RUNNING:
                api.pause()
                paused_here = True
            if include_memory:
                api.snapshot(work)
            # The flat disk is written beside the tar, never into a directory the VMM's user can
            # plant a symlink in; the VMM's files and the seed are read pinned (no symlink followed).
            self._flatten(rec, flat)
            with contextlib.ExitStack() as stack:
                files = [("disk.qcow2", flat)]
                if rec.seed:
                    files.append(("seed.iso", stack.enter_context(self._pinned(f"{d}/seed.iso")).path))
                if include_memory:
                    files += [
                        (f"{CH_STATE_DIR}{n}", stack.enter_context(self._pinned(n, dir_fd=work_fd)).path)
                        for n in MEMORY_FILES
                    ]
                write_tar(tar_path, meta, files)
        except CHApiError as exc:
            raise RetryableError("SnapshotFailed", f"{name}: {exc}") from None
        finally:
            try:
                if paused_here:
                    api.resume()
            finally:
                os.close(work_fd)
                self._remove_tree(work)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(flat)
        return meta

    def _remove_tree(self, path: str) -> None:
        """A directory the VMM's user may have replaced by a symlink: the link goes, never its target."""
        real = self._real(path)
        if os.path.islink(real):
            os.unlink(real)
        else:
            shutil.rmtree(real, ignore_errors=True)

    def _fresh_dir(self, path: str) -> int:
        """A new, empty directory for the VMM to write into (0770: under the helper it inherits the
        VMM user's default ACL entry, whose effective rights the mode's group bits bound), open: what
        is read back is read through this descriptor, whatever the VMM's user renames after."""
        self._remove_tree(path)
        real = self._real(path)
        os.mkdir(real, 0o770)
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.fchmod(fd, 0o770)  # the umask never narrows it
        return fd

    def _member_limit(self, name: str, inst: InstanceSpec) -> int:
        return {
            f"{CH_STATE_DIR}config.json": MAX_CONFIG,
            f"{CH_STATE_DIR}state.json": MAX_STATE,
            f"{CH_STATE_DIR}memory-ranges": inst.memory_bytes + (1 << 20),
            "seed.iso": MAX_SEED,
        }.get(name, self.max_virtual_size + self.max_virtual_size // 64 + (1 << 30))

    def _check_sizes(self, tar_path: str, inst: InstanceSpec) -> None:
        """Each member within its bound before anything is written (the headers only; their extended
        headers bounded first, snapshots.check_headers)."""
        import tarfile

        from bcd_agent.sections.instances.snapshots import MEMBERS, check_headers

        check_headers(tar_path)
        try:
            with tarfile.open(tar_path, mode="r:") as tar:
                # At most one header more than a snapshot holds: unpack refuses any stranger.
                for _ in range(len(MEMBERS) + 1):
                    m = tar.next()
                    if m is None:
                        break
                    if m.size > self._member_limit(m.name, inst):
                        raise SnapshotRefused(
                            "BadSnapshot", f"snapshot member {m.name[:120]!r}: too large ({m.size} bytes)"
                        )
        except (tarfile.TarError, EOFError) as exc:
            raise SnapshotRefused("BadSnapshot", f"the snapshot is not a readable tar: {exc}") from None

    def restore(self, inst: InstanceSpec, tar_path: str, prepared: Prepared) -> None:
        """Define instance `inst` from the downloaded and verified snapshot tar `tar_path` (a real
        path) instead of an image (DLV-CH-36): unpacked into the new directory (snapshots.unpack:
        strict names, regular files, each once), refused when taken by another runtime or, with
        memory, on another CPU model (DLV-CH-25); its disk must be a flat qcow2, its seed is attached
        raw, never probed (DLV-LIBVIRT-27). A memory snapshot's config.json must have exactly the
        instance's vCPUs and memory (DLV-CH-37) and is rebuilt from allowlists (DLV-CH-38..41),
        keeping bcd's balloon (DLV-BAL-15). Any refusal removes the new directory. An instance
        already restored (its vm.json exists) only has its record brought up to date."""
        import tarfile

        from bcd_agent.sections.instances.snapshots import read_meta, refuse_memory_restore, unpack

        self._check_create(inst, prepared)
        volumes = self._volumes(inst)
        work, staged = self._workdir(inst.id)
        d = self._dir(inst.id)
        with self._unstaged_on_failure(work, staged):
            memory = False
            if staged:
                self._check_sizes(tar_path, inst)
                # A memory snapshot resumes a guest without passthrough GPUs or writable volumes.
                refuse_memory_restore(inst, read_meta(tar_path))
                try:
                    meta, _names = unpack(
                        tar_path, self._real(work), self.name, self.cpu_model(), CH_STATE_DIR
                    )
                except (tarfile.TarError, EOFError) as exc:
                    raise SnapshotRefused(
                        "BadSnapshot", f"the snapshot is not a readable tar: {exc}"
                    ) from None
                memory = meta.include_memory
                if memory:
                    for n in MEMORY_FILES:
                        os.rename(self._real(f"{work}/{CH_STATE_DIR}{n}"), self._real(f"{work}/{n}"))
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(self._real(f"{work}/{CH_STATE_DIR}"))
                try:
                    check_overlay(self._real(f"{work}/disk.qcow2"), None, None, self.max_virtual_size)
                except ImageRefused as exc:
                    raise SnapshotRefused("BadSnapshot", f"the snapshot's disk: {exc.message}") from None
            seed = self.system.exists(f"{work}/seed.iso")
            fresh = vm_config(inst, d, None, seed, prepared.gpu_addresses, volumes, self.data_dir)
            if memory:
                try:
                    saved = json.loads(self.system.read_bytes(f"{work}/config.json") or b"")
                except ValueError:
                    raise SnapshotRefused("BadSnapshot", "the snapshot's config.json is not JSON") from None
                check_snapshot_config(saved, inst.vcpus, inst.memory_bytes)
                nics = [(f"net{i}", n.mac) for i, n in enumerate(inst.nics)]
                rebuilt = restored_config(saved, fresh, nics)
                self.system.write_atomic(
                    f"{work}/config.json", json.dumps(rebuilt, sort_keys=True).encode(), 0o600
                )
            self._write_record(inst, prepared, work, staged, fresh, seed, volumes, restored=True)

    def _drop_memory_state(self, name: str) -> None:
        """After a memory restore's first start: its state files go (later starts boot the disk)."""
        for n in MEMORY_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._real(f"{self._dir(name)}/{n}"))

    def console(self, name: str, timeout_s: float = 5.0) -> socket.socket:
        """The instance's console (DLV-CH-42): a connection to the serial port's Unix socket
        `instances/<id>/serial.sock`, where the VMM serves the guest's serial line (config `serial`
        mode Socket). The caller relays it (a console tunnel) and closes it. Under the helper the
        node reaches the socket through its default ACL entry on the directory."""
        if self.record(name) is None:
            raise TerminalError("NotBcds", f"{name}: no vm.json: not a cloud-hypervisor instance of bcd's")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(self._real(f"{self._dir(name)}/serial.sock"))
        except OSError as exc:
            sock.close()
            raise RetryableError(
                "NoConsole", f"{name}: no serial console ({exc.strerror}; is it running?)"
            ) from None
        sock.settimeout(None)
        return sock

    def set_balloon(self, name: str, balloon_bytes: int) -> None:
        """The balloon through `vm.resize` `desired_balloon` (a VM without a balloon device is not
        touched)."""
        rec = self.record(name)
        if rec is None or "balloon" not in rec.config:
            raise ErrNoBalloon(name)
        if not 0 <= balloon_bytes <= rec.memory_bytes:
            raise TerminalError(
                "BadBalloon", f"{name}: a balloon of {balloon_bytes} bytes is outside its memory"
            )
        try:
            self.api(name).resize_balloon(balloon_bytes)
        except CHApiError as exc:
            raise RetryableError("BalloonFailed", f"{name}: {exc}") from None

    def balloon_readings(self) -> dict[str, CHBalloonReading]:
        """The balloon controller's reading (DLV-BAL-13): for each of bcd's running VMs defined with a
        balloon device, the balloon's size from `vm.info`; a VM without one is left out, never
        touched (DLV-BAL-14). cloud-hypervisor's API reports no guest use, so `used_bytes` is None
        and the controller takes nothing from such a guest (DLV-BAL-11); free page reporting
        still hands its free pages back."""
        out: dict[str, CHBalloonReading] = {}
        for name in self.system.listdir(f"{ch_dir(self.data_dir)}/instances"):
            if not valid_instance_id(name):
                continue
            try:
                rec = self.record(name)
            except RetryableError:
                continue
            if rec is None or "balloon" not in rec.config:
                continue
            try:
                info = self.api(name, timeout_s=5).info()
            except CHApiError:
                continue  # no VMM: not running
            balloon = info.get("config", {}).get("balloon")
            if info.get("state") != "Running" or not isinstance(balloon, dict):
                continue
            out[name] = CHBalloonReading(int(balloon.get("size", 0)), None)
        return out

    def balloon_bytes(self, name: str) -> int | None:
        try:
            info = self.api(name, timeout_s=5).info()
        except CHApiError:
            return None
        balloon = info.get("config", {}).get("balloon")
        return int(balloon.get("size", 0)) if isinstance(balloon, dict) else None


def vmm_version(path: str) -> str | None:
    """`cloud-hypervisor --version`'s answer, or None."""
    import subprocess

    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def helper_has_ch_ops(helper: Any) -> bool:
    """Whether the helper serves ch.*: a nameless ch.stop is refused for its name, never run; a helper
    without the op answers `unknown-op`."""
    try:
        helper.call("ch.stop", {"name": ""})
    except HelperRefused as exc:
        return exc.reason == "bad-name"
    return False


def ch_available(
    which: Callable[[str], str | None],
    kvm: bool,
    helper: Any,
    version_of: Callable[[str], str | None],
) -> str | None:
    """Why this host does not run cloud-hypervisor, or None when it does: its binary on PATH at the
    minimum version (Q-DLV-CHU-02: an older one is not run), /dev/kvm, and a helper serving ch.* (or
    bcd node as root, whose `LocalChOps` does those steps itself). Hello advertises it only then."""
    from bcd_agent.sections.instances.runtimes.chapi import MIN_VERSION, parse_version

    binary = which("cloud-hypervisor")
    if binary is None:
        return "no cloud-hypervisor on PATH"
    version = parse_version(version_of(binary) or "")
    if version is None or version < MIN_VERSION:
        return f"cloud-hypervisor {version or '(no version)'} is older than v{MIN_VERSION[0]}"
    if not kvm:
        return "no /dev/kvm"
    if getattr(helper, "as_root", False):
        return None  # bcd node as root: the ch.* steps run in process (chlocal.LocalChOps)
    if helper is None or not helper_has_ch_ops(helper):
        return "no helper serving ch.*"
    return None


# A memory snapshot's configuration, rebuilt before its first start (DLV-CH-38..41): from the saved
# `config.json` only these keys of `cpus`, `memory` and `platform`; everything else comes from bcd.
RESTORE_CPUS = ("boot_vcpus", "max_vcpus", "topology", "max_phys_bits", "kvm_hyperv")
RESTORE_MEMORY = ("size", "mergeable", "hotplug_method", "hotplug_size", "hotplugged_size", "shared", "thp")
RESTORE_PLATFORM = ("num_pci_segments", "serial_number", "uuid")
# bcd's own: the payload, disks, serial, console, rng, devices and the balloon (a memory-restored VM
# keeps bcd's balloon, never the tenant's) come from the fresh configuration; NICs by id and MAC only.
BCD_SUPPLIED = ("payload", "disks", "serial", "console", "rng", "devices", "balloon")


def check_snapshot_config(saved: Any, vcpus: int, memory_bytes: int) -> None:
    """DLV-CH-37: a memory snapshot restores only with exactly the instance's vCPUs and memory."""
    if not isinstance(saved, dict):
        raise TerminalError("BadSnapshot", "the snapshot's config.json is not an object")
    cpus, memory = saved.get("cpus"), saved.get("memory")
    if not isinstance(cpus, dict) or not isinstance(memory, dict):
        raise TerminalError("BadSnapshot", "the snapshot's config.json has no cpus or memory")
    if cpus.get("boot_vcpus") != vcpus or cpus.get("max_vcpus") != vcpus:
        raise TerminalError("BadSnapshot", f"the snapshot's vCPUs are not the instance's {vcpus}")
    if memory.get("size") != memory_bytes:
        raise TerminalError(
            "BadSnapshot", f"the snapshot's memory is not the instance's {memory_bytes} bytes"
        )


def restored_config(
    saved: dict[str, Any], fresh: dict[str, Any], nics: list[tuple[str, str]]
) -> dict[str, Any]:
    """The configuration a memory restore starts from (DLV-CH-38..41, DLV-CHU-08, DLV-CHU-29): the
    saved `cpus`, `memory` and `platform` through their allowlists (no CPU affinity, no memory zones,
    no huge pages), bcd's payload, disks, serial, console, rng, devices and balloon, and the NICs as
    (id, MAC) with no tap name (their fds come as `net_fds`). Nothing else of the snapshot's."""

    def allowed(key: str, keys: tuple[str, ...]) -> dict[str, Any]:
        part = saved.get(key)
        return {k: part[k] for k in keys if k in part} if isinstance(part, dict) else {}

    out: dict[str, Any] = {"cpus": allowed("cpus", RESTORE_CPUS), "memory": allowed("memory", RESTORE_MEMORY)}
    affinity = fresh.get("cpus", {}).get("affinity")
    if affinity is not None:
        out["cpus"]["affinity"] = affinity  # bcd's pinning from the spec, never the snapshot's (DLV-PLC-16)
    platform = allowed("platform", RESTORE_PLATFORM)
    if platform:
        out["platform"] = platform
    for key in BCD_SUPPLIED:
        if key in fresh:
            out[key] = fresh[key]
    if nics:
        out["net"] = [{"id": nid, "mac": mac} for nid, mac in nics]
    return out


if TYPE_CHECKING:

    def _conforms(rt: CloudHypervisorRuntime) -> tuple[Runtime, Snapshotting]:
        """mypy checks the runtime against the section's interfaces (base.Runtime, Snapshotting)."""
        return rt, rt
