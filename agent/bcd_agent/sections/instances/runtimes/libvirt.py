"""The libvirt-kvm runtime: `virsh -c qemu:///system` and `qemu-img`, files under data_dir/libvirt.

- Listing (DLV-INST-15, DLV-LIBVIRT-17): `virsh list --all` for names and states, `dumpxml` once per
  domain name (cached until bcd defines or undefines it, or the name goes): a domain without bcd's
  metadata is unmanaged, reported and never touched.
- Images (DLV-LIBVIRT-03..05, DLV-IMG-02/03): downloaded once with curl, https only (redirects too), to a
  staging file in `images/`, verified against the SHA-256, a qcow2 checked by its header
  (bcd_shared.images.check_image), made 0644 and renamed to `images/<sha256>.<format>` in a 0700
  directory; a qcow2 base is checked again on every use (runtimes/images.py, shared with cloud-hypervisor).
- Disks (DLV-LIBVIRT-02/06/07/08, DLV-IMG-18/19): `qemu-img create -f qcow2 -u -b BASE -F FMT` (never
  opening the base), a blank qcow2 for an iso install; grown with `qemu-img resize` of the overlay
  alone (`json:` options: driver qcow2, `backing` null; see `overlay_only`) while stopped and
  `virsh blockresize` while running, the current size read from the header; a smaller size fails
  the instance. The overlay is checked (check_overlay) before every start and grow.
- User data (DLV-LIBVIRT-09/10): a NoCloud seed `seed.iso` (volume `cidata`, `user-data` and
  `meta-data` with `instance-id` and `local-hostname`) by genisoimage, else xorriso.
- States (DLV-LIBVIRT-18..21): `start [--paused]`, `suspend`, `resume`; a stop is `shutdown`, then
  `destroy` after `stop_timeout_s` (60); "Cannot allocate memory" on a start is CapacityRefused;
  delete destroys, undefines and removes the directory.
- As root (QFA, DLV-QFA-01..05): directories 0700 root, then `o+x` on each directory from data_dir
  down to the files the domain names and on images/. Under the helper (DLV-HLP-12..14): the node
  owns the files, disks 0660 (read-only ones 0640) and `g+x` on the way; every change goes through
  the helper's `libvirt.*` operations and reads through `virsh -r`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from attrs import frozen
from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.images import ImageRefused, check_image, check_overlay
from bcd_shared.instancenames import (
    image_path,
    images_dir,
    instance_dir,
    libvirt_dir,
    valid_instance_id,
    volumes_dir,
)
from bcd_shared.rebinddisk import REBIND_FILE, attach_args, detach_args, zero_and_remove
from bcd_shared.system import CommandResult, System

from bcd_agent.sections.instances.model import RUNTIME_LIBVIRT, Desired, InstanceSpec
from bcd_agent.sections.instances.runtimes import images
from bcd_agent.sections.instances.runtimes.base import (
    DISK_NAME,
    LIBVIRT_STATE_NAME,
    PAUSED,
    RUNNING,
    STOPPED,
    CapacityRefused,
    Domain,
    DomainFiles,
    ErrNoBalloon,
    Prepared,
    SnapshotMeta,
    SnapshotRefused,
)

if TYPE_CHECKING:
    from bcd_agent.sections.instances.balloon import BalloonReading

log = logging.getLogger("bcd.instances")

SYSTEM_URI = "qemu:///system"
STOP_TIMEOUT_S = 60.0
MAX_VIRTUAL_SIZE = 64 << 40  # a tenant image's virtual size cap: 64 TiB
_STATES = {
    "running": RUNNING,
    "idle": RUNNING,
    "paused": PAUSED,
    "pmsuspended": PAUSED,
    "in shutdown": RUNNING,
    "shut off": STOPPED,
    "crashed": STOPPED,
}


def overlay_only(path: str) -> str:
    """qemu-img's name for the overlay alone: the qcow2 driver stated (never probed) and `backing`
    null, so qemu-img opens no file a header names (the issue's rule; `-f qcow2` would still open the
    backing chain). Used for `resize`."""
    import json

    return "json:" + json.dumps(
        {"driver": "qcow2", "file": {"driver": "file", "filename": path}, "backing": None},
        separators=(",", ":"),
    )


class Virsh(Protocol):
    """How the runtime changes libvirt: directly as root, or through the helper."""

    def read(self, *args: str) -> CommandResult: ...

    def define(self, name: str, xml: bytes, xml_path: str) -> None: ...

    def act(self, verb: str, name: str, *args: str) -> CommandResult: ...


class VirshStates(Protocol):
    """A Virsh that also saves and restores memory state (DirectVirsh, HelperVirsh); kept apart so a
    Virsh without snapshots (a bench's, a test's) still is one."""

    def save(self, name: str, state_path: str) -> None: ...

    def restore(self, name: str, xml: bytes, xml_path: str, state_path: str, paused: bool) -> None: ...


def _describe(result: CommandResult) -> str:
    return result.stderr.decode(errors="replace").strip() or result.stdout.decode(errors="replace").strip()


class DirectVirsh:
    """`virsh -c URI` as root (or on the simulated host)."""

    def __init__(self, system: System, uri: str = SYSTEM_URI) -> None:
        self.system = system
        self.uri = uri

    def read(self, *args: str) -> CommandResult:
        return self.system.run(["virsh", "-c", self.uri, *args], timeout=60)

    def define(self, name: str, xml: bytes, xml_path: str) -> None:
        result = self.system.run(["virsh", "-c", self.uri, "define", "--validate", xml_path], timeout=60)
        if not result.ok:
            raise RetryableError("DefineFailed", f"virsh define {name}: {_describe(result)}")

    def act(self, verb: str, name: str, *args: str) -> CommandResult:
        return self.system.run(["virsh", "-c", self.uri, verb, name, *args], timeout=120)

    def save(self, name: str, state_path: str) -> None:
        result = self.system.run(["virsh", "-c", self.uri, "save", name, state_path], timeout=1800)
        if not result.ok:
            raise RetryableError("SaveFailed", f"virsh save {name}: {_describe(result)}")

    def restore(self, name: str, xml: bytes, xml_path: str, state_path: str, paused: bool) -> None:
        argv = ["virsh", "-c", self.uri, "restore", state_path, "--xml", xml_path]
        result = self.system.run([*argv, *(["--paused"] if paused else [])], timeout=1800)
        if not result.ok:
            raise RetryableError("RestoreFailed", f"virsh restore {name}: {_describe(result)}")


class HelperVirsh:
    """Changes through the helper's libvirt.* operations; reads with `virsh -r` (DLV-HLP-02/12)."""

    def __init__(
        self, system: System, client: Any, uri: str = SYSTEM_URI, intent: Callable[[], Any] = dict
    ) -> None:
        self.system = system
        self.client = client
        self.uri = uri
        self.intent = intent

    def read(self, *args: str) -> CommandResult:
        return self.system.run(["virsh", "-r", "-c", self.uri, *args], timeout=60)

    def _args(self, name: str) -> dict[str, Any]:
        args: dict[str, Any] = {"name": name}
        intent = self.intent()
        if intent:
            args["intent"] = intent
        return args

    def define(self, name: str, xml: bytes, xml_path: str) -> None:
        self.client.call("libvirt.define", {**self._args(name), "xml": xml.decode()})

    def act(self, verb: str, name: str, *args: str) -> CommandResult:
        signed = verb in ("start", "attach-disk", "resume")  # root re-validates these against the spec
        req: dict[str, Any] = self._args(name) if signed else {"name": name}
        if verb == "start":
            req["paused"] = "--paused" in args
        if verb == "blockresize":
            req["target"], req["size_bytes"] = args[0], int(args[1].rstrip("B"))
        if verb == "setmem":
            req["kib"] = int(args[0].rstrip("K"))
        if verb in ("attach-disk", "detach-disk"):
            # Root builds the rebind disk's path, target and serial itself: only the name travels.
            verb = "rebind" if verb == "attach-disk" else "unrebind"
        self.client.call(f"libvirt.{verb.replace('-', '_')}", req)
        return CommandResult(("virsh", verb, name), 0)

    def save(self, name: str, state_path: str) -> None:
        """root saves into the instance's own `save.state` and hands it to the node (libvirt.save)."""
        self.client.call("libvirt.save", self._args(name))

    def restore(self, name: str, xml: bytes, xml_path: str, state_path: str, paused: bool) -> None:
        """root checks the definition and always passes it as --xml (DLV-HLP-08..10)."""
        self.client.call("libvirt.restore", {**self._args(name), "xml": xml.decode(), "paused": paused})


@frozen
class _Known:
    managed: bool
    meta: Mapping[str, str]
    vcpus: int
    memory_bytes: int
    hugepages: int
    gpus: tuple[str, ...]
    volumes: tuple[tuple[str, bool, str], ...] = ()
    balloon: bool = False  # a virtio memballoon (model none: ErrNoBalloon, DLV-BAL-14)


def _parse_domain(xml: bytes) -> _Known:
    # xml.etree is imported on first use: a host that never lists a domain never loads it (idle RSS).
    import xml.etree.ElementTree as ET

    from bcd_agent.sections.instances.runtimes.domainxml import metadata_of

    meta = metadata_of(xml)
    try:
        root = ET.fromstring(xml)  # noqa: S314 (libvirt's own dumpxml output)
    except ET.ParseError:
        return _Known(False, {}, 0, 0, 0, ())
    vcpus = int((root.findtext("vcpu") or "0").strip() or 0)
    mem = root.find("memory")
    unit = mem.get("unit", "KiB") if mem is not None else "KiB"
    mult = {"b": 1, "bytes": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}.get(unit, 1024)
    memory = int((mem.text or "0").strip()) * mult if mem is not None else 0
    page = root.find("memoryBacking/hugepages/page")
    huge = 0
    if root.find("memoryBacking/hugepages") is not None:
        size = int(page.get("size", "2048")) if page is not None else 2048
        huge = size * {"KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}.get(
            page.get("unit", "KiB") if page is not None else "KiB", 1024
        )
    gpus = []
    for a in root.findall("devices/hostdev/source/address"):
        try:
            parts = [int(a.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function")]
        except ValueError:
            continue
        gpus.append("{:04x}:{:02x}:{:02x}.{:x}".format(*parts))
    mb = root.find("devices/memballoon")
    balloon = mb is not None and mb.get("model") == "virtio"
    return _Known(meta is not None, meta or {}, vcpus, memory, huge, tuple(gpus), volumes_of(root), balloon)


def volumes_of(root: Any) -> tuple[tuple[str, bool, str], ...]:
    """The volumes a domain attaches: (volume id, read-only, target) of each disk whose source is a
    `volumes/<id>.raw` (DLV-VOL-21: what a running domain has open)."""
    import re

    out = []
    for disk in root.findall("devices/disk"):
        src = disk.find("source")
        path = src.get("file", "") if src is not None else ""
        m = re.search(r"/volumes/([A-Za-z0-9_-]{1,80})\.raw$", path)
        if m is None:
            continue
        target = disk.find("target")
        out.append(
            (
                m.group(1),
                disk.find("readonly") is not None,
                target.get("dev", "") if target is not None else "",
            )
        )
    return tuple(out)


def parse_list(text: str) -> list[tuple[str, str]]:
    """`virsh list --all`'s table as (name, state) pairs (the state is the last known phrase)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("Id ") or set(line) <= {"-"}:
            continue
        _id, _, rest = line.partition(" ")
        rest = rest.strip()
        for phrase in sorted(_STATES, key=len, reverse=True):
            if rest.endswith(" " + phrase):
                out.append((rest[: -len(phrase)].strip(), phrase))
                break
        else:
            name, _, state = rest.rpartition(" ")
            out.append((name.strip(), state))
    return out


class LibvirtRuntime:
    """See the module docstring."""

    name = RUNTIME_LIBVIRT
    checks_capacity = False

    def __init__(
        self,
        system: System,
        virsh: Virsh,
        data_dir: str,
        *,
        under_helper: bool = False,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        domain_type: str = "kvm",
        cpu_mode: str = "host-passthrough",
        max_virtual_size: int = MAX_VIRTUAL_SIZE,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.system = system
        self.virsh = virsh
        self.data_dir = data_dir.rstrip("/")
        self.under_helper = under_helper
        self.stop_timeout_s = stop_timeout_s
        self.domain_type = domain_type
        self.cpu_mode = cpu_mode
        self.max_virtual_size = max_virtual_size
        self.sleep = sleep
        self._known: dict[str, _Known] = {}
        # (instance, snapshot SHA-256) -> why its restore was refused (kept for this process's life)
        self._refused: dict[tuple[str, str], str] = {}

    # --- paths ------------------------------------------------------------------------------------

    def _dir(self, name: str) -> str:
        return instance_dir(self.data_dir, name)

    def _disk(self, name: str) -> str:
        return f"{self._dir(name)}/disk.qcow2"

    def _real(self, path: str) -> str:
        return str(self.system.host_path(path))

    # --- listing ----------------------------------------------------------------------------------

    def forget(self, name: str) -> None:
        self._known.pop(name, None)

    def list(self) -> tuple[Domain, ...]:
        result = self.virsh.read("list", "--all")
        if not result.ok:
            raise RetryableError("ListFailed", f"virsh list: {_describe(result)}")
        listed = parse_list(result.stdout.decode(errors="replace"))
        names = {n for n, _ in listed}
        for gone in set(self._known) - names:
            del self._known[gone]
        out = []
        instances = str(self.system.host_path(f"{libvirt_dir(self.data_dir)}/instances"))
        for name, state in listed:
            known = self._known.get(name)
            if known is None:
                dump = self.virsh.read("dumpxml", name)
                if not dump.ok:
                    raise RetryableError("ListFailed", f"virsh dumpxml {name}: {_describe(dump)}")
                known = _parse_domain(dump.stdout)
                self._known[name] = known
            disk_bytes = None
            if known.managed:
                with contextlib.suppress(ImageRefused):
                    disk_bytes = self._overlay_size(name, os.path.join(instances, name, "disk.qcow2"))
            out.append(
                Domain(
                    name=name,
                    runtime=self.name,
                    state=_STATES.get(state, STOPPED),
                    managed=known.managed,
                    allocation_id=known.meta.get("allocation", ""),
                    vcpus=known.vcpus,
                    memory_bytes=known.memory_bytes,
                    hugepages=known.hugepages,
                    gpu_addresses=known.gpus,
                    disk_bytes=disk_bytes,
                    definition=known.meta.get("definition", ""),
                    volumes=known.volumes,
                )
            )
        return tuple(out)

    def _overlay_size(self, name: str, real: str | None = None) -> int | None:
        """The overlay's virtual size from its header (DLV-IMG-19); None without an overlay."""
        from bcd_shared.images import parse_header

        try:
            with open(real or self._real(self._disk(name)), "rb") as f:
                data = f.read(1 << 16)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return parse_header(data, self.max_virtual_size).virtual_size

    # --- images -----------------------------------------------------------------------------------

    def _mkdir(self, path: str, mode: int) -> None:
        images.make_dir(self.system, path, mode)

    def ensure_image(self, inst: InstanceSpec) -> str:
        """The verified base image's path, downloading it once (see the module docstring)."""
        assert inst.image is not None
        return images.ensure_image(
            self.system,
            images_dir(self.data_dir),
            inst.image,
            self.max_virtual_size,
            dir_mode=0o700 if not self.under_helper else 0o710,
            describe=_describe,
        )

    # --- create -----------------------------------------------------------------------------------

    def _qemu_img(self, *args: str) -> None:
        result = self.system.run(["qemu-img", *args], timeout=600)
        if not result.ok:
            raise RetryableError("QemuImgFailed", f"qemu-img {args[0]}: {_describe(result)}")

    def _base_size(self, base: str, fmt: str) -> int:
        if fmt == "qcow2":
            return check_image(self._real(base), self.max_virtual_size).virtual_size
        return os.stat(self._real(base)).st_size

    def files(self, inst: InstanceSpec, base: str | None, seed: bool) -> DomainFiles:
        fmt = inst.image.format if inst.image else None
        d = self._dir(inst.id)
        vols = self._volumes(inst)
        if fmt is None:  # a restored snapshot: its flat disk and its seed, no base (DLV-IMG-12)
            return DomainFiles(disk=self._disk(inst.id), seed=f"{d}/seed.iso" if seed else None, volumes=vols)
        if fmt == "iso":
            return DomainFiles(
                disk=self._disk(inst.id),
                install_iso=base,
                seed=f"{d}/seed.iso" if seed else None,
                volumes=vols,
            )
        return DomainFiles(
            disk=self._disk(inst.id),
            base=base,
            base_format=fmt,
            seed=f"{d}/seed.iso" if seed else None,
            volumes=vols,
        )

    def _volumes(self, inst: InstanceSpec) -> tuple[tuple[str, str, bool], ...]:
        """Each attached volume's path and serial, from the store's record (volumes are created before
        any instance is defined, DLV-VOL-08); raw, read-only when asked (DLV-VOL-12/13)."""
        import json

        out = []
        for vid, ro in inst.volumes:
            path = f"{volumes_dir(self.data_dir)}/{vid}.raw"
            record = self.system.read_bytes(f"{volumes_dir(self.data_dir)}/{vid}.json")
            try:
                serial = json.loads(record or b"{}").get("serial", "")
            except ValueError:
                serial = ""
            if not serial or not self.system.exists(path):
                raise RetryableError("VolumeMissing", f"volume {vid} is not in the store yet")
            out.append((path, str(serial), ro))
        return tuple(out)

    def resize_volume(self, name: str, target: str, size_bytes: int) -> None:
        """A grown volume reaches the running or paused guest (DLV-VOL-11): `virsh blockresize`."""
        self._act("blockresize", name, target, f"{size_bytes}B")

    def create(self, inst: InstanceSpec, prepared: Prepared) -> None:
        if inst.image is None and inst.restore_from:
            # A restored instance defined again (its definition digest changed): its files are there.
            self._define_restored(inst, prepared)
            return
        base = self.ensure_image(inst)
        fmt = inst.image.format if inst.image else "qcow2"
        d = self._dir(inst.id)
        self._mkdir(libvirt_dir(self.data_dir), 0o700 if not self.under_helper else 0o710)
        self._mkdir(f"{libvirt_dir(self.data_dir)}/instances", 0o700 if not self.under_helper else 0o710)
        self._mkdir(d, 0o700 if not self.under_helper else 0o710)
        disk = self._disk(inst.id)
        if not self.system.exists(disk):
            if fmt == "iso":
                if inst.disk_bytes <= 0:
                    raise TerminalError(
                        "BadSize", "size.disk_bytes: an iso image installs onto a disk of this size"
                    )
                self._qemu_img("create", "-f", "qcow2", self._real(disk), str(inst.disk_bytes))
            else:
                size = max(inst.disk_bytes, self._base_size(base, fmt))
                self._qemu_img(
                    "create",
                    "-f",
                    "qcow2",
                    "-u",
                    "-b",
                    self._real(base),
                    "-F",
                    fmt,
                    self._real(disk),
                    str(size),
                )
        seed = prepared.user_data is not None or self.system.exists(f"{d}/seed.iso")
        files = self.files(inst, base, seed)
        self.check_overlay(inst)
        if prepared.user_data is not None:
            self._seed(inst, prepared.user_data)
        self._file_access(inst, files)
        from bcd_agent.sections.instances.runtimes.domainxml import build_domain_xml

        xml = build_domain_xml(
            inst, files, prepared.gpu_addresses, domain_type=self.domain_type, cpu_mode=self.cpu_mode
        )
        xml_path = f"{d}/domain.xml"
        self.system.write_atomic(xml_path, xml, 0o600)
        self.forget(inst.id)
        self.virsh.define(inst.id, xml, self._real(xml_path))

    def check_overlay(self, inst: InstanceSpec) -> None:
        """DLV-IMG-11/12/14: the overlay names exactly its base and format (or nothing for an iso)."""
        fmt = inst.image.format if inst.image else None
        base = None if fmt in (None, "iso") else self._real(image_path(self.data_dir, inst.image.sha256, fmt))  # type: ignore[union-attr]
        try:
            check_overlay(
                self._real(self._disk(inst.id)), base, None if base is None else fmt, self.max_virtual_size
            )
        except ImageRefused as exc:
            raise TerminalError("BadDisk", f"disk.qcow2: {exc.message}") from None

    def _seed(self, inst: InstanceSpec, user_data: bytes) -> None:
        d = self._dir(inst.id)
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
        if result.returncode == 127:
            result = self.system.run(
                ["xorriso", "-as", "mkisofs", "-quiet", "-o", out, "-V", "cidata", "-J", "-R", *files],
                timeout=120,
            )
        shutil.rmtree(self._real(stage), ignore_errors=True)
        if not result.ok:
            raise RetryableError("SeedFailed", f"the NoCloud seed: {_describe(result)}")

    def _file_access(self, inst: InstanceSpec, files: DomainFiles) -> None:
        """QEMU reaches its files: `o+x` on the way as root, group access under the helper."""
        paths = [p for p in (files.disk, files.seed, files.install_iso, files.kernel, files.initrd) if p]
        dirs: set[str] = set()
        top = self.data_dir
        volumes = [v[0] for v in files.volumes]  # their directory searchable; the files stay 0600
        for p in [*paths, *([files.base] if files.base else []), *volumes]:
            parent = os.path.dirname(p)
            while parent.startswith(top) and parent not in dirs:
                dirs.add(parent)
                if parent == top:
                    break
                parent = os.path.dirname(parent)
        bit = 0o010 if self.under_helper else 0o001
        for d in sorted(dirs):
            real = self._real(d)
            with contextlib.suppress(FileNotFoundError):
                os.chmod(real, (os.stat(real).st_mode & 0o7777) | bit)
        if self.under_helper:
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(self._real(p), 0o640 if p != files.disk else 0o660)
            # QEMU reaches the node's volumes through the group as it does the disk (read-only ones
            # 0640), for the run: back to 0600 when the domain stops (`_close_volumes`, DLV-VOL-41).
            for path, _serial, ro in files.volumes:
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(self._real(path), 0o640 if ro else 0o660)

    # --- states -----------------------------------------------------------------------------------

    def _act(self, verb: str, name: str, *args: str) -> CommandResult:
        result = self.virsh.act(verb, name, *args)
        if not result.ok:
            text = _describe(result)
            if verb == "start" and "Cannot allocate memory" in text:
                raise CapacityRefused("CapacityRefused", f"libvirt-kvm refused the start: {text}")
            raise RetryableError(f"{verb.capitalize()}Failed", f"virsh {verb} {name}: {text}")
        return result

    def start(self, inst: InstanceSpec, paused: bool) -> None:
        """Before every start the base image and the overlay are checked again (DLV-IMG-03/14): a VMM
        that once ran the disk can have rewritten its header."""
        img = inst.image
        if img is not None and img.format == "qcow2":
            try:
                check_image(
                    self._real(image_path(self.data_dir, img.sha256, img.format)), self.max_virtual_size
                )
            except ImageRefused as exc:
                raise TerminalError("BadImage", f"image {img.sha256[:12]}: {exc.message}") from None
        self.check_overlay(inst)
        # QEMU's way to its files again: the journal puts data_dir back to 0700 whenever bcd starts.
        base = image_path(self.data_dir, img.sha256, img.format) if img is not None else None
        d = self._dir(inst.id)
        seed = self.system.exists(f"{d}/seed.iso")
        self._file_access(inst, self.files(inst, base, seed))
        state = f"{d}/{LIBVIRT_STATE_NAME}"
        if self.system.exists(state):
            # A memory restore's first start (DLV-LIBVIRT-28), or a snapshot's save a crash left
            # before its restore: `virsh restore --xml` of bcd's own domain.xml, never the state's.
            self._restore_state(inst.id, state, paused)
            return
        self._act("start", inst.id, *(["--paused"] if paused else []))

    def suspend(self, name: str) -> None:
        self._act("suspend", name)

    def resume(self, name: str) -> None:
        self._act("resume", name)

    def _state(self, name: str) -> str:
        result = self.virsh.read("domstate", name)
        if not result.ok:
            raise RetryableError("StateFailed", f"virsh domstate {name}: {_describe(result)}")
        return _STATES.get(result.stdout.decode(errors="replace").strip(), STOPPED)

    def stop(self, name: str) -> None:
        """`shutdown`, then `destroy` once `stop_timeout_s` passed with the domain still up."""
        if self._state(name) == STOPPED:
            return
        self._act("shutdown", name)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            if self._state(name) == STOPPED:
                return
            self.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if self._state(name) != STOPPED:
            self._act("destroy", name)
        self._close_volumes(name)

    def delete(self, name: str) -> None:
        if self._state(name) != STOPPED:
            self._act("destroy", name)
        self._act("undefine", name)
        self._close_volumes(name)
        self.forget(name)
        shutil.rmtree(self._real(self._dir(name)), ignore_errors=True)

    def _close_volumes(self, name: str) -> None:
        """Under the helper, a stopped or destroyed domain's volumes go back to 0600 unless another
        running or paused domain still has them open (DLV-VOL-41): QEMU reached them through the node's
        group only for the run."""
        known = self._known.get(name)
        if not self.under_helper or known is None or not known.volumes:
            return
        try:
            domains = self.list()
        except RetryableError as exc:  # kept as they are; the next stop or delete closes them
            log.warning("instances: %s: volumes not closed: %s", name, exc.message)
            return
        still = {v for d in domains if d.name != name and d.state != STOPPED for v, _ro, _t in d.volumes}
        for vid, _ro, _target in known.volumes:
            if vid not in still:
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(self._real(f"{volumes_dir(self.data_dir)}/{vid}.raw"), 0o600)

    def leftovers(self, domains: tuple[Domain, ...]) -> tuple[str, ...]:
        """Instance directories with no domain (a create that failed before its define)."""
        names = {d.name for d in domains}
        return tuple(
            n
            for n in self.system.listdir(f"{libvirt_dir(self.data_dir)}/instances")
            if n not in names and valid_instance_id(n)
        )

    def remove_files(self, name: str) -> None:
        """Remove an instance directory that has no domain (never one a domain names)."""
        if not valid_instance_id(name):
            raise TerminalError("BadName", f"{name!r} is not an instance id")
        shutil.rmtree(self._real(self._dir(name)), ignore_errors=True)

    def grow(self, inst: InstanceSpec, running: bool) -> None:
        """Grow the overlay to `disk_bytes`; a smaller size fails the instance (DLV-LIBVIRT-07/08)."""
        self.check_overlay(inst)
        current = self._overlay_size(inst.id) or 0
        if inst.disk_bytes < current:
            raise TerminalError(
                "DiskShrink",
                f"size.disk_bytes {inst.disk_bytes} is below the disk's {current} bytes: disks only grow",
            )
        if inst.disk_bytes == current:
            return
        if running:
            self._act("blockresize", inst.id, "vda", f"{inst.disk_bytes}B")
        else:
            self._qemu_img("resize", overlay_only(self._real(self._disk(inst.id))), str(inst.disk_bytes))

    # --- snapshots and restores (docs/instances.md "Snapshots and restores") -----------------------

    def _states(self) -> VirshStates:
        if not hasattr(self.virsh, "save") or not hasattr(self.virsh, "restore"):
            raise TerminalError("NoSnapshots", "this libvirt connection saves and restores no memory state")
        return cast(VirshStates, self.virsh)

    def cpu_model(self) -> str:
        from bcd_agent.sections.instances.snapshots import cpu_model

        return cpu_model(self.system)

    def _flat_source(self, inst: InstanceSpec) -> str:
        """The overlay and its base as one `json:` name for `qemu-img convert`: every driver stated and
        the chain ending in `backing: null`, so qemu-img opens no file a header names (the facts: a
        plain `convert` follows a backing or data file named in the header)."""
        import json

        img = inst.image
        backing: dict[str, Any] | None = None
        if img is not None and img.format in ("qcow2", "raw"):
            base = self._real(image_path(self.data_dir, img.sha256, img.format))
            backing = {"driver": img.format, "file": {"driver": "file", "filename": base}}
            if img.format == "qcow2":
                backing["backing"] = None
        opts = {
            "driver": "qcow2",
            "file": {"driver": "file", "filename": self._real(self._disk(inst.id))},
            "backing": backing,
        }
        return "json:" + json.dumps(opts, separators=(",", ":"))

    def snapshot(self, inst: InstanceSpec, include_memory: bool, tar_path: str) -> SnapshotMeta:
        """DLV-LIBVIRT-22..24: a tar of meta.json, the overlay flattened onto its base (`qemu-img
        convert`, `-U` beside a running QEMU), the seed and, with memory, `virsh save`'s state; after a
        save the domain carries on with `virsh restore --xml` of bcd's own domain.xml (paused when it was);
        a disk-only snapshot of a running domain pauses it for the copy (suspend flushes QEMU's caches)."""
        from bcd_agent.sections.instances.snapshots import refuse_memory_snapshot, write_tar

        refuse_memory_snapshot(inst, include_memory)
        name = inst.id
        state = self._state(name)
        if include_memory and state == STOPPED:
            raise SnapshotRefused(
                "SnapshotRefused", f"payload.include_memory: instance {name} is not running: it has no memory"
            )
        self.check_overlay(inst)
        d = self._dir(name)
        meta = SnapshotMeta(self.name, self.cpu_model(), include_memory)
        real_flat = f"{tar_path}.disk"  # tar_path is a real path (the caller's staging file)
        save = f"{d}/{LIBVIRT_STATE_NAME}"
        saved = paused_here = False
        try:
            if include_memory:
                self._states().save(name, self._real(save))
                saved = True
            elif state == RUNNING:
                self._act("suspend", name)
                paused_here = True
            self._qemu_img("convert", "-U", "-O", "qcow2", self._flat_source(inst), real_flat)
            files = [(DISK_NAME, real_flat)]
            if self.system.exists(f"{d}/seed.iso"):
                files.append(("seed.iso", self._real(f"{d}/seed.iso")))
            if saved:
                files.append((LIBVIRT_STATE_NAME, self._real(save)))
            write_tar(tar_path, meta, files)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(real_flat)
            if paused_here:
                self._act("resume", name)
            if saved:
                # The domain carries on from its saved state (paused if it was, or if the spec now wants
                # it paused: root restores a guest running only while the signed spec wants it RUNNING,
                # docs/helper.md round 7): bcd's own definition.
                self._restore_state(name, save, paused=state == PAUSED or inst.desired is Desired.PAUSED)
        return meta

    def _restore_state(self, name: str, state: str, paused: bool) -> None:
        """`virsh restore STATE --xml domain.xml [--paused]` (DLV-LIBVIRT-23/28), then the state goes."""
        xml_path = f"{self._dir(name)}/domain.xml"
        xml = self.system.read_bytes(xml_path)
        if xml is None:
            raise RetryableError("RestoreFailed", f"{name}: no domain.xml to restore the state with")
        self.forget(name)
        self._states().restore(name, xml, self._real(xml_path), self._real(state), paused)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._real(state))

    def restore(self, inst: InstanceSpec, tar_path: str, prepared: Prepared) -> None:
        """DLV-LIBVIRT-25..28, DLV-IMG-15..17: unpack the verified tar into the new instance's directory
        (another runtime, or with memory another CPU model, refused), check its disk (a flat qcow2) and
        leave its seed unprobed, define the domain under the instance's own name and UUID. A memory
        snapshot's state is unpacked with bcd's new definition written into its header
        (snapshots.rewrite_save_header: libvirt 9.0 refuses `restore --xml` under another name or
        UUID), and the first start restores it. A failed check removes the directory."""
        import tarfile

        from bcd_agent.sections.instances import snapshots

        refused = self._refused.get((inst.id, inst.restore_sha256))
        if refused is not None:  # refused once already: not unpacked again every pass
            raise SnapshotRefused("SnapshotRefused", refused)
        try:  # cheap (meta.json only), so checked again on every pass: the spec may change
            snapshots.refuse_memory_restore(inst, snapshots.read_meta(tar_path))
        except (tarfile.TarError, OSError) as exc:
            raise SnapshotRefused("BadSnapshot", f"restore_from: {exc}") from None
        d = self._dir(inst.id)
        real_dir = self._real(d)
        shutil.rmtree(real_dir, ignore_errors=True)  # a failed attempt's files (ours, no domain)
        for parent in (libvirt_dir(self.data_dir), f"{libvirt_dir(self.data_dir)}/instances", d):
            self._mkdir(parent, 0o700 if not self.under_helper else 0o710)
        try:
            files = self.files(inst, None, "seed.iso" in snapshots.member_names(tar_path))
            from bcd_agent.sections.instances.runtimes.domainxml import build_domain_xml

            xml = build_domain_xml(
                inst, files, prepared.gpu_addresses, domain_type=self.domain_type, cpu_mode=self.cpu_mode,
                restored_from=inst.restore_sha256,
            )  # fmt: skip

            def state(src: Any, out: Any) -> None:
                snapshots.rewrite_save_header(src, out, xml)

            snapshots.unpack(
                tar_path, real_dir, self.name, self.cpu_model(), LIBVIRT_STATE_NAME,
                rewrite={LIBVIRT_STATE_NAME: state},
            )  # fmt: skip
            self.check_overlay(inst)
        except (TerminalError, tarfile.TarError) as exc:
            shutil.rmtree(real_dir, ignore_errors=True)
            message = exc.message if isinstance(exc, TerminalError) else f"restore_from: {exc}"
            self._refused[(inst.id, inst.restore_sha256)] = message
            if isinstance(exc, TerminalError):
                raise
            raise SnapshotRefused("BadSnapshot", message) from None
        except OSError as exc:  # the host's trouble (a full disk): tried again on the next pass
            shutil.rmtree(real_dir, ignore_errors=True)
            raise RetryableError("RestoreFailed", f"restore_from: unpacking: {exc}") from None
        self._file_access(inst, files)
        xml_path = f"{d}/domain.xml"
        self.system.write_atomic(xml_path, xml, 0o600)
        self.forget(inst.id)
        self.virsh.define(inst.id, xml, self._real(xml_path))

    def _define_restored(self, inst: InstanceSpec, prepared: Prepared) -> None:
        d = self._dir(inst.id)
        if not self.system.exists(self._disk(inst.id)):
            raise TerminalError("BadDisk", f"{inst.id}: the restored disk is gone")
        self.check_overlay(inst)
        files = self.files(inst, None, self.system.exists(f"{d}/seed.iso"))
        self._file_access(inst, files)
        from bcd_agent.sections.instances.runtimes.domainxml import build_domain_xml

        xml = build_domain_xml(
            inst, files, prepared.gpu_addresses, domain_type=self.domain_type, cpu_mode=self.cpu_mode,
            restored_from=inst.restore_sha256,
        )  # fmt: skip
        xml_path = f"{d}/domain.xml"
        self.system.write_atomic(xml_path, xml, 0o600)
        self.forget(inst.id)
        self.virsh.define(inst.id, xml, self._real(xml_path))

    # --- ballooning (DLV-BAL-12/14) -----------------------------------------------------------------

    def balloon_readings(self) -> dict[str, BalloonReading]:
        """`virsh domstats --balloon` for every domain in one call: bcd's running domains with a virtio
        balloon, each with its balloon (`balloon.maximum - balloon.current`, KiB) and its use
        (`balloon.available - balloon.usable`, when the guest's driver reports them; stats every 10 s,
        set in the definition). A domain without a balloon device is left out: never touched."""
        from bcd_agent.sections.instances.balloon import BalloonReading

        result = self.virsh.read("domstats", "--balloon")
        if not result.ok:
            raise RetryableError("DomstatsFailed", f"virsh domstats --balloon: {_describe(result)}")
        out: dict[str, BalloonReading] = {}
        for name, stats in parse_domstats(result.stdout.decode(errors="replace")).items():
            known = self._known.get(name)
            if known is None or not known.managed or not known.balloon:
                continue
            maximum = stats.get("balloon.maximum", known.memory_bytes // 1024)
            current = stats.get("balloon.current")
            if current is None:
                continue
            used = None
            if "balloon.available" in stats and "balloon.usable" in stats:
                used = max(0, stats["balloon.available"] - stats["balloon.usable"]) * 1024
            out[name] = BalloonReading(max(0, maximum - current) * 1024, used)
        return out

    def set_balloon(self, name: str, balloon_bytes: int) -> None:
        """`virsh setmem NAME <memory - balloon>K --live` (the helper's `libvirt.setmem` under it)."""
        known = self._known.get(name)
        if known is None or not known.managed or not known.balloon:
            raise ErrNoBalloon(name)
        if not 0 <= balloon_bytes < known.memory_bytes:
            raise TerminalError("BadBalloon", f"{name}: a balloon of {balloon_bytes} bytes is outside memory")
        self._act("setmem", name, f"{(known.memory_bytes - balloon_bytes) // 1024}K", "--live")

    # --- identity rebind (DLV-REB-05..12: the runtime's half) ---------------------------------------

    def _rebind_path(self, name: str) -> str:
        return f"{self._dir(name)}/{REBIND_FILE}"

    def rebind_attach(self, name: str, image: bytes) -> None:
        """Write the rebind disk in the instance's directory (0600 as root; 0660 under the helper, so
        QEMU reaches it through the node's group) and hot-add it: `virsh attach-disk NAME PATH vdz
        --targetbus virtio --subdriver raw --serial bc-rebind --live` (the helper's
        `libvirt.rebind`, which builds the same from the name alone)."""
        path = self._rebind_path(name)
        mode = 0o660 if self.under_helper else 0o600
        self.system.write_atomic(path, image, mode)
        os.chmod(self._real(path), mode)
        result = self.virsh.act("attach-disk", name, *attach_args(self._real(path)))
        if not result.ok:
            zero_and_remove(self._real(path))
            raise RetryableError("RebindFailed", f"virsh attach-disk {name}: {_describe(result)}")

    def rebind_answer(self, name: str, size: int = 4096) -> bytes:
        """The last `size` bytes of the rebind disk, where the guest writes its answer."""
        try:
            with open(self._real(self._rebind_path(name)), "rb") as f:
                f.seek(-size, os.SEEK_END)
                return f.read(size)
        except OSError:
            return b""

    def rebind_detach(self, name: str) -> None:
        """`virsh detach-disk NAME vdz --live`, then the file zeroed and deleted either way, so the
        secret never stays on the host (DLV-REB-11/12)."""
        try:
            self.virsh.act("detach-disk", name, *detach_args())
        finally:
            zero_and_remove(self._real(self._rebind_path(name)))


def parse_domstats(text: str) -> dict[str, dict[str, int]]:
    """`virsh domstats` output (`Domain: 'NAME'` then indented `key=value` lines) as integers by
    domain; non-integer values are skipped."""
    out: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in text.splitlines():
        if line.startswith("Domain: "):
            name = line[len("Domain: ") :].strip().strip("'")
            current = out.setdefault(name, {})
            continue
        key, sep, value = line.strip().partition("=")
        if current is not None and sep and value.strip().isdigit():
            current[key] = int(value)
    return out
