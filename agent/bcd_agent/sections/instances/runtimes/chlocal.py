"""cloud-hypervisor's root-only steps when `bcd node` itself runs as root, without `bcd helper`
(docs/instances.md "cloud-hypervisor as root"): the same `call(op, args)` the runtime sends to the
helper's ch.* ops, done in process. What differs from the helper's (DLV-CHU-09/10, DLV-CHU-14):

- the instance's files are chowned to the VMM's uid at launch (no ACL entries: root owns the node's
  side), and so are its read-write volumes (0600); a read-only volume gets a POSIX ACL entry `r` for
  the VMM's user; `ch.stop` hands the volumes back to root (the ACL entry removed);
- `ch.vfio` chowns each GPU's `/dev/vfio/<group>` to the VMM's uid (0600) after binding the group's
  endpoints to vfio-pci (bridges stay on pcieport); `ch.stop` gives exactly the groups the stopped
  unit's user owned back to root, and `ch.unvfio` returns the devices to their host drivers;
- the unit's UMask is 0077, and the VMM binary is the first `cloud-hypervisor` on PATH.

The record is the node's own (`vm.json`), decoded strictly; there is no second party to re-check it
against. Taps are created owned by root (the node opens them and hands the fds to the VMM).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Callable
from typing import Any

from bcd_shared import posixacl
from bcd_shared.chrecord import MAX_BYTES as MAX_RECORD
from bcd_shared.chrecord import CHRecord, RecordError, parse_record
from bcd_shared.chunit import (
    CHLaunch,
    account_add_argv,
    ch_images_dir,
    ch_instance_dir,
    run_argv,
    unit_name,
    valid_vmm_uid,
    vmm_user_name,
)
from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.instancenames import MAX_NICS, tap_name, valid_instance_id, volumes_dir
from bcd_shared.system import System

PCI = "/sys/bus/pci/devices"
GROUPS = "/sys/kernel/iommu_groups"
VFIO_DRIVER = "vfio-pci"
BRIDGE_CLASS = "0x0604"
RECORD = "vm.json"


class LocalChOps:
    """The ch.* steps as root, in process; `as_root` tells the runtime to chown what it adds later
    (the rebind disk, the snapshot directory) to the VMM's user."""

    as_root = True

    def __init__(
        self, system: System, data_dir: str, which: Callable[[str], str | None] = shutil.which
    ) -> None:
        self.system = system
        self.data_dir = data_dir.rstrip("/")
        self.which = which

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        name = str(args.get("name", ""))
        if not valid_instance_id(name):
            raise TerminalError("BadName", f"{op}: {name[:80]!r} is not an instance id")
        steps: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {
            "ch.taps": self.taps,
            "ch.untaps": self.untaps,
            "ch.launch": self.launch,
            "ch.stop": self.stop,
            "ch.vfio": self.vfio,
            "ch.unvfio": self.unvfio,
        }
        step = steps.get(op)
        if step is None:
            raise TerminalError("UnknownOp", f"{op}: not a ch.* step")
        return step(name, args)

    # -- helpers ---------------------------------------------------------------------------------

    def _run(self, argv: list[str], what: str, timeout: float = 60) -> str:
        result = self.system.run(argv, timeout=timeout)
        if not result.ok:
            raise RetryableError("ChStepFailed", f"{what}: {result.describe()}")
        return result.stdout.decode(errors="replace")

    def _record(self, name: str) -> CHRecord:
        """vm.json, read only as root's own regular file: the directory is the VMM's user's, who
        could otherwise plant a record naming other GPUs or volumes."""
        path = self._real(f"{ch_instance_dir(self.data_dir, name)}/{RECORD}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RetryableError("NoRecord", f"{name}: no vm.json") from None
        except OSError as exc:
            raise RetryableError(
                "BadRecord", f"{name}/vm.json: {exc.strerror} (root's file, no symlink)"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise RetryableError("BadRecord", f"{name}/vm.json: not root's own regular file")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(MAX_RECORD + 1)
        finally:
            os.close(fd)
        try:
            return parse_record(data)
        except RecordError as exc:
            raise RetryableError("BadRecord", f"{name}/vm.json: {exc}") from None

    def _real(self, path: str) -> str:
        return str(self.system.host_path(path))

    # -- taps ------------------------------------------------------------------------------------

    def _link(self, dev: str) -> dict[str, Any] | None:
        result = self.system.run(["ip", "-j", "-d", "link", "show", "dev", dev], timeout=30)
        if not result.ok:
            text = result.describe()
            if "does not exist" in text or "Cannot find device" in text:
                return None
            raise RetryableError("ChStepFailed", f"ip link show {dev}: {text}")
        try:
            links = json.loads(result.stdout)
        except ValueError:
            raise RetryableError("ChStepFailed", f"ip -j link show {dev}: not JSON") from None
        return links[0] if isinstance(links, list) and links and isinstance(links[0], dict) else None

    @staticmethod
    def _is_tap(link: dict[str, Any]) -> bool:
        info = link.get("linkinfo") or {}
        return info.get("info_kind") == "tun" and (info.get("info_data") or {}).get("type") == "tap"

    def taps(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        bridges = [str(b) for b in args.get("bridges", [])]
        if not 1 <= len(bridges) <= MAX_NICS:
            raise TerminalError("BadNic", f"ch.taps: 1 to {MAX_NICS} NICs")
        taps = [tap_name(name, i) for i in range(len(bridges))]
        for tap in taps:
            link = self._link(tap)
            if link is not None and not self._is_tap(link):
                raise TerminalError("NotATap", f"{tap} exists and is not a tap: it is never touched")
            if link is None:
                self._run(["ip", "tuntap", "add", "dev", tap, "mode", "tap"], f"ip tuntap add {tap}")
        for tap, br in zip(taps, bridges, strict=True):
            self._run(["ip", "link", "set", "dev", tap, "master", br, "up"], f"ip link set {tap} master {br}")
        return {"name": name, "taps": taps}

    def untaps(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        deleted = []
        for i in range(MAX_NICS):
            tap = tap_name(name, i)
            link = self._link(tap)
            if link is None or not self._is_tap(link):
                continue
            self._run(["ip", "link", "delete", "dev", tap], f"ip link delete {tap}")
            deleted.append(tap)
        return {"name": name, "deleted": deleted}

    # -- launch and stop -------------------------------------------------------------------------

    def _ensure_account(self, uid: int) -> None:
        passwd = self.system.read_text("/etc/passwd") or ""
        for line in passwd.splitlines():
            fields = line.split(":")
            if fields[2:3] == [str(uid)]:
                if fields[0] != vmm_user_name(uid):
                    raise TerminalError("ForeignAccount", f"uid {uid} is {fields[0][:32]!r}, not bcd's")
                return
        for argv in account_add_argv(uid):
            result = self.system.run(argv, timeout=60)
            if not result.ok and "already exists" not in result.describe():
                raise RetryableError("ChStepFailed", f"{argv[0]} {vmm_user_name(uid)}: {result.describe()}")

    def _chown_instance(self, rec: CHRecord) -> None:
        """DLV-CHU-09: the instance's files (not vm.json, which stays root's) to the VMM's uid, the
        directory to its group; nothing followed through a symlink."""
        d = self._real(ch_instance_dir(self.data_dir, rec.name))
        # root's, group the VMM's, sticky (1770): the VMM creates its sockets here, but never
        # renames or removes root's vm.json.
        os.chown(d, 0, rec.uid, follow_symlinks=False)
        os.chmod(d, 0o1770)  # noqa: S103 (the group is the VMM's own, one per instance)
        for entry in os.scandir(d):
            if entry.name == RECORD or entry.is_symlink():
                continue
            os.chown(entry.path, rec.uid, rec.uid, follow_symlinks=False)

    def _volumes(self, rec: CHRecord, grant: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Read-write volumes to the VMM's uid (0600) at launch and back to root at stop; a read-only
        one gets (then loses) an ACL entry `r` for the VMM's user."""
        rw: list[str] = []
        ro: list[str] = []
        for vol in rec.volumes:
            path = f"{volumes_dir(self.data_dir)}/{vol.name}"
            (ro if vol.read_only else rw).append(path)
            try:
                fd = os.open(self._real(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                if grant:
                    raise RetryableError("VolumeMissing", f"volume {path}: {exc.strerror}") from None
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise TerminalError("BadVolume", f"volume {path} is not a regular file")
                if vol.read_only:
                    if grant:
                        self._ro_grant(fd, rec.uid)
                    else:
                        self._ro_release(fd, rec, vol.name)
                else:
                    os.fchown(fd, rec.uid if grant else 0, rec.uid if grant else 0)
                    os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
        return tuple(rw), tuple(ro)

    def _kvm_gid(self) -> int:
        for line in (self.system.read_text("/etc/group") or "").splitlines():
            fields = line.split(":")
            if fields[0] == "kvm" and len(fields) > 2 and fields[2].isdigit():
                return int(fields[2])
        raise RetryableError("NoKvmGroup", "no group kvm: a read-only volume without ACLs needs it")

    def _ro_grant(self, fd: int, uid: int) -> None:
        """DLV-VOL-38: an ACL entry `r` for the VMM's user; DLV-VOL-40: on a filesystem without ACLs,
        group kvm and 0640 instead."""
        try:
            posixacl.set_user(fd, uid, 0o4)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            os.fchown(fd, 0, self._kvm_gid())
            os.fchmod(fd, 0o640)

    def _ro_release(self, fd: int, rec: CHRecord, volume: str) -> None:
        """The stopped VMM's entry goes; the last reader gone, the volume is root's 0600 with no ACL
        (DLV-VOL-39). Without ACLs, group kvm's 0640 is reverted once no other running instance of
        the runtime was given the volume (DLV-VOL-40)."""
        try:
            posixacl.remove_user(fd, rec.uid)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            if not self._others_reading(rec.name, volume):
                os.fchown(fd, 0, 0)
                os.fchmod(fd, 0o600)
            return
        try:
            entries = posixacl.parse(os.getxattr(fd, posixacl.ACCESS))
        except OSError:
            entries = []
        if not any(tag in (posixacl.USER, posixacl.GROUP) for tag, _p, _i in entries):
            with contextlib.suppress(OSError):
                os.removexattr(fd, posixacl.ACCESS)
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o600)

    def _others_reading(self, name: str, volume: str) -> bool:
        """Whether another running VMM unit's instance has `volume` read-only in its record."""
        out = self._run(
            ["systemctl", "list-units", "--type=service", "--plain", "--no-legend", "--no-pager", "bcd-ch-*"],
            "systemctl list-units",
        )
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 3 or fields[2] != "active" or not fields[0].endswith(".service"):
                continue
            other = fields[0].removeprefix("bcd-ch-").removesuffix(".service")
            if other == name or not valid_instance_id(other):
                continue
            with contextlib.suppress(RetryableError):
                if any(v.name == volume and v.read_only for v in self._record(other).volumes):
                    return True
        return False

    def launch(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        rec = self._record(name)
        binary = self.which("cloud-hypervisor")
        if binary is None:
            raise RetryableError("NoVmm", "no cloud-hypervisor on PATH")
        try:
            st = os.stat(self._real(binary))
        except OSError as exc:
            raise RetryableError("NoVmm", f"{binary}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            # As the helper's root_binary: a VMM binary someone else could rewrite is never run.
            raise TerminalError(
                "UnsafeVmm", f"{binary} must be a regular file root owns and only root can write"
            )
        base = None
        if not rec.restored and rec.image_sha256 is not None:
            base = f"{ch_images_dir(self.data_dir)}/{rec.image_sha256}.{rec.image_format}"
        self._ensure_account(rec.uid)
        self._chown_instance(rec)
        rw, ro = self._volumes(rec, grant=True)
        launch = CHLaunch(
            instance_id=name,
            uid=rec.uid,
            data_dir=self.data_dir,
            binary=binary,
            vcpus=rec.vcpus,
            memory_bytes=rec.memory_bytes,
            base_image=base,
            volumes_rw=rw,
            volumes_ro=ro,
            vfio=bool(rec.gpus),
            hugepages=rec.hugepages,
            restored_memory=rec.restored,
            under_helper=False,
            cpus=rec.cpus,
            mems=rec.mems,
        )
        self._run(run_argv(launch), f"systemd-run {launch.unit}", timeout=120)
        return {"name": name, "unit": launch.unit, "uid": rec.uid, "binary": binary}

    def stop(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        unit = unit_name(name)
        result = self.system.run(["systemctl", "stop", unit], timeout=120)
        if not result.ok and "not loaded" not in result.describe():
            raise RetryableError("StopFailed", f"systemctl stop {unit}: {result.describe()}")
        state = self.system.run(["systemctl", "show", "-p", "ActiveState", "--value", unit], timeout=30)
        active = state.stdout.decode(errors="replace").strip() if state.ok else "unknown"
        groups: list[str] = []
        with contextlib.suppress(RetryableError):
            rec = self._record(name)
            if active in ("inactive", "failed"):
                groups = self.give_back_owned(rec.uid)  # DLV-CHU-10
                self._volumes(rec, grant=False)
        return {"name": name, "unit": unit, "state": active, "groups": groups}

    # -- VFIO ------------------------------------------------------------------------------------

    def _driver(self, addr: str) -> str:
        try:
            return os.path.basename(os.readlink(self._real(f"{PCI}/{addr}/driver")))
        except OSError:
            return ""

    def _write(self, path: str, value: str) -> None:
        result = self.system.run(["tee", self._real(path)], input=value.encode(), timeout=60)
        if not result.ok:
            raise RetryableError("VfioFailed", f"writing {value!r} to {path}: {result.describe()}")

    def _is_bridge(self, dev: str) -> bool:
        return (self.system.read_text(f"{PCI}/{dev}/class") or "").strip().startswith(BRIDGE_CLASS)

    def _groups(self, rec: CHRecord) -> dict[str, list[str]]:
        """Each GPU's IOMMU group and its devices; a group holding a device that is neither a function
        of one of the record's GPUs nor a PCI bridge is refused (VFIO takes whole groups)."""
        slots = {g.rsplit(".", 1)[0] for g in rec.gpus}
        out: dict[str, list[str]] = {}
        for gpu in rec.gpus:
            try:
                group = os.path.basename(os.readlink(self._real(f"{PCI}/{gpu}/iommu_group")))
            except OSError:
                raise TerminalError("NoIommu", f"{gpu} has no IOMMU group (is the IOMMU on?)") from None
            devices = sorted(self.system.listdir(f"{GROUPS}/{group}/devices"))
            for dev in devices:
                if dev.rsplit(".", 1)[0] not in slots and not self._is_bridge(dev):
                    raise TerminalError(
                        "ForeignDevice", f"IOMMU group {group} of {gpu} holds {dev}, which is not the GPU's"
                    )
            out[group] = devices
        return out

    def vfio(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        """DLV-CH-18..20, DLV-CHU-09: every endpoint of each GPU's group bound to vfio-pci and checked,
        bridges left on pcieport, and /dev/vfio/<group> chowned to the VMM's uid (0600)."""
        rec = self._record(name)
        groups = self._groups(rec)
        for group, devices in groups.items():
            for dev in devices:
                if self._is_bridge(dev) or self._driver(dev) == VFIO_DRIVER:
                    continue
                self._write(f"{PCI}/{dev}/driver_override", VFIO_DRIVER)
                if self._driver(dev):
                    self._write(f"{PCI}/{dev}/driver/unbind", dev)
                self._write("/sys/bus/pci/drivers_probe", dev)
                if self._driver(dev) != VFIO_DRIVER:
                    with contextlib.suppress(RetryableError):
                        self._write(f"{PCI}/{dev}/driver_override", "\n")
                        self._write("/sys/bus/pci/drivers_probe", dev)
                    raise RetryableError(
                        "VfioFailed", f"{dev} did not move to vfio-pci (is the vfio-pci module loaded?)"
                    )
            node = self._real(f"/dev/vfio/{group}")
            os.chown(node, rec.uid, rec.uid, follow_symlinks=False)
            os.chmod(node, 0o600, follow_symlinks=False)
        return {"name": name, "groups": sorted(groups)}

    def give_back_owned(self, uid: int) -> list[str]:
        """Exactly the /dev/vfio groups `uid` owns go back to root (DLV-CHU-10)."""
        if not valid_vmm_uid(uid):
            return []
        out = []
        for group in self.system.listdir("/dev/vfio"):
            node = self._real(f"/dev/vfio/{group}")
            if group.isdigit() and os.stat(node, follow_symlinks=False).st_uid == uid:
                os.chown(node, 0, 0, follow_symlinks=False)
                os.chmod(node, 0o600, follow_symlinks=False)
                out.append(group)
        return sorted(out)

    def unvfio(self, name: str, args: dict[str, Any]) -> dict[str, Any]:
        """At delete: the record's groups back to root and their devices to their host drivers."""
        rec = self._record(name)
        groups = self._groups(rec) if rec.gpus else {}
        for group, devices in groups.items():
            with contextlib.suppress(FileNotFoundError):
                os.chown(self._real(f"/dev/vfio/{group}"), 0, 0, follow_symlinks=False)
            for dev in devices:
                if self._driver(dev) != VFIO_DRIVER:
                    continue
                self._write(f"{PCI}/{dev}/driver/unbind", dev)
                self._write(f"{PCI}/{dev}/driver_override", "\n")
                self._write("/sys/bus/pci/drivers_probe", dev)
        return {"name": name, "groups": sorted(groups)}
