"""Persistent volumes (seeds/delivery.md "Persistent volumes", DLV-VOL): the store and the pure planner.

The store (`VolumeStore`, over `data_dir/volumes/`, Q-DLV-VOL-01): each volume is a sparse raw file
`<id>.raw` (0600) with its record `<id>.json` (`{"id", "serial", "size_bytes"}`) beside it. Raw: its
format is fixed and never probed (no tool is run on it: no `qemu-img` at all, and a VMM opens it as
`raw`), it has no header a guest could rewrite into something a tool would follow, and it grows by
truncation. Created with O_EXCL then `ftruncate`, record written durably (fsync of file and directory)
after the file exists, so a crash leaves at worst a file without a record, which the next pass
adopts at the spec's size (its record is written again) or destroys when unlisted.

Never overcommitted (DLV-VOL-28..30): a new volume or a growth must fit in the filesystem's `statfs`
Bavail less a reserve (5% of the filesystem, at least 2 GiB) less every volume's unwritten space
(size less the blocks it holds). Destroyed (DLV-VOL-25): the blocks punched out
(`fallocate(PUNCH_HOLE | KEEP_SIZE)`), the file synced, then both files unlinked.

The planner (`plan_volumes`, pure) orders: creates and growths before any instance is defined
(DLV-VOL-08/09); a shrink refused and the size kept (DLV-VOL-10); each instance's attachments checked
in spec order (a volume the section does not list, a refused volume, one writer: a writer beside
another holder, or any holder beside a writer, refused; the first in spec order keeps it,
DLV-VOL-17..19), against the volumes the running and paused domains have open (DLV-VOL-21/22);
destroys of volumes no longer listed and no domain has open, after the pass (DLV-VOL-25/26).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence

from attrs import field, frozen

VOLUME_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,80}$")
SERIAL_RE = re.compile(r"^[a-z0-9-]{1,20}$")
SECTOR = 512
GIB = 1 << 30
MIB = 1 << 20
RESERVE_MIN = 2 * GIB
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


@frozen
class VolumeSpec:
    id: str
    serial: str
    size_bytes: int


@frozen
class Volume:
    """A volume the store holds: its record and how many bytes its file really takes."""

    id: str
    serial: str
    size_bytes: int
    allocated_bytes: int

    @property
    def unwritten_bytes(self) -> int:
        return max(0, self.size_bytes - self.allocated_bytes)


@frozen
class Space:
    """The store's filesystem (statfs) and what its volumes promise: StatusReport.volume_storage."""

    total_bytes: int
    available_bytes: int
    reserved_bytes: int
    committed_bytes: int
    outstanding_bytes: int

    @property
    def promisable_bytes(self) -> int:
        return max(0, self.available_bytes - self.reserved_bytes - self.outstanding_bytes)


def check_volume(v: VolumeSpec) -> str | None:
    """The first rule `v` breaks (DLV-VOL-05..07), or None."""
    if not VOLUME_ID_RE.fullmatch(v.id):
        return f"volume id {v.id[:90]!r} must be 1 to 80 of [A-Za-z0-9_-]"
    if not SERIAL_RE.fullmatch(v.serial):
        return f"volume {v.id}: serial {v.serial[:30]!r} must be 1 to 20 of [a-z0-9-]"
    if v.size_bytes <= 0 or v.size_bytes % SECTOR:
        return f"volume {v.id}: size_bytes {v.size_bytes} must be a positive multiple of 512"
    return None


def reserve_for(total_bytes: int) -> int:
    """Kept from volumes: 5% of the filesystem, at least 2 GiB (DLV-VOL-34)."""
    return max(total_bytes // 20, RESERVE_MIN)


def shrink(vid: str, size: int, current: int) -> str:
    return f"volume {vid}: size_bytes {size} is below its {current} (volumes never shrink)"


def refusal(vid: str, needed: int, space: Space) -> str:
    """DLV-VOL-30's message."""
    return (
        f"volume {vid}: {needed // MIB} MiB needed, {space.promisable_bytes // MIB} MiB can still be "
        f"promised to volumes on this host ({space.available_bytes // MIB} MiB free, "
        f"{space.reserved_bytes // MIB} MiB reserved, {space.outstanding_bytes // MIB} MiB promised to "
        "volumes' unwritten space)"
    )


# --- the store ------------------------------------------------------------------------------------


class VolumeStore:
    """`data_dir/volumes/` on a real filesystem (`directory` is the real path)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def exists(self) -> bool:
        return os.path.isdir(self.directory)

    def ensure(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)

    def raw(self, vid: str) -> str:
        return os.path.join(self.directory, f"{vid}.raw")

    def _record(self, vid: str) -> str:
        return os.path.join(self.directory, f"{vid}.json")

    def list(self) -> dict[str, Volume]:
        out: dict[str, Volume] = {}
        if not self.exists():
            return out
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(".raw") or not VOLUME_ID_RE.fullmatch(name[:-4]):
                continue
            vid = name[:-4]
            try:
                st = os.stat(self.raw(vid), follow_symlinks=False)
            except FileNotFoundError:
                continue
            serial = ""
            try:
                with open(self._record(vid), "rb") as f:
                    doc = json.loads(f.read(4096))
                if isinstance(doc, dict) and isinstance(doc.get("serial"), str):
                    serial = doc["serial"]
            except (OSError, ValueError):
                pass  # a file without a record: a crash between the two; adopted or destroyed
            out[vid] = Volume(vid, serial, st.st_size, st.st_blocks * 512)
        return out

    def space(self, volumes: Iterable[Volume] | None = None) -> Space:
        vols = list(self.list().values() if volumes is None else volumes)
        st = os.statvfs(self.directory if self.exists() else os.path.dirname(self.directory.rstrip("/")))
        total = st.f_blocks * st.f_frsize
        return Space(
            total_bytes=total,
            available_bytes=st.f_bavail * st.f_frsize,
            reserved_bytes=reserve_for(total),
            committed_bytes=sum(v.size_bytes for v in vols),
            outstanding_bytes=sum(v.unwritten_bytes for v in vols),
        )

    def _fits(self, vid: str, needed: int) -> None:
        space = self.space()
        if needed > space.promisable_bytes:
            raise VolumeRefused(refusal(vid, needed, space))

    def _write_record(self, v: VolumeSpec) -> None:
        data = json.dumps(
            {"id": v.id, "serial": v.serial, "size_bytes": v.size_bytes}, sort_keys=True
        ).encode()
        tmp = self._record(v.id) + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._record(v.id))
        self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def create(self, v: VolumeSpec) -> None:
        """A new sparse volume of `v.size_bytes` (VolumeRefused when it does not fit)."""
        self.ensure()
        self._fits(v.id, v.size_bytes)
        fd = os.open(self.raw(v.id), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, v.size_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._write_record(v)

    def adopt(self, v: VolumeSpec, current: Volume) -> None:
        """A file whose record is missing or names another serial: its record written again."""
        if current.serial != v.serial:
            self._write_record(VolumeSpec(v.id, v.serial, current.size_bytes))

    def grow(self, v: VolumeSpec, current: Volume) -> None:
        """Truncate up to `v.size_bytes`; never down (VolumeRefused)."""
        if v.size_bytes < current.size_bytes:
            raise VolumeRefused(shrink(v.id, v.size_bytes, current.size_bytes))
        if v.size_bytes == current.size_bytes:
            return
        self._fits(v.id, v.size_bytes - current.size_bytes)
        fd = os.open(self.raw(v.id), os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, v.size_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._write_record(v)

    def destroy(self, vid: str) -> None:
        """Punch every block out, then unlink the file and its record."""
        path = self.raw(vid)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                size = os.fstat(fd).st_size
                if size:
                    punch_hole(fd, 0, size)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._record(vid))
        self._sync_dir()


class VolumeRefused(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE): the blocks are freed, the size kept (the stdlib has no binding)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err or errno.EIO, f"fallocate(PUNCH_HOLE): {os.strerror(err or errno.EIO)}")


# --- the planner (pure) ---------------------------------------------------------------------------


def _promise(vid: str, needed: int, space: Space | None, promised: int) -> str | None:
    """Why `needed` more bytes cannot be promised after `promised` earlier in the pass, or None."""
    if space is None:
        return None
    now = Space(
        space.total_bytes,
        space.available_bytes,
        space.reserved_bytes,
        space.committed_bytes + promised,
        space.outstanding_bytes + promised,
    )
    return refusal(vid, needed, now) if needed > now.promisable_bytes else None


@frozen
class VolumeStep:
    kind: str  # create | grow | adopt | destroy
    volume: VolumeSpec


@frozen
class VolumePlan:
    before: tuple[VolumeStep, ...] = ()  # creates, adoptions and growths: before any instance is defined
    after: tuple[VolumeStep, ...] = ()  # destroys: after the pass
    errors: Mapping[str, str] = field(factory=dict)  # instance id -> why it cannot attach its volumes
    refused: Mapping[str, str] = field(factory=dict)  # volume id -> why it keeps its size / is not made
    resize: tuple[tuple[str, str, int], ...] = ()  # (instance, volume, new size): live resizes
    # Instances whose running domain holds a volume another holder earlier in spec order has open
    # (a second writer, or a writer beside readers): stopped, so it lets go (DLV-VOL-24).
    let_go: Mapping[str, str] = field(factory=dict)  # instance -> why


def plan_volumes(
    volumes: Sequence[VolumeSpec],
    attachments: Sequence[tuple[str, tuple[tuple[str, bool], ...], bool]],
    held: Mapping[str, tuple[tuple[str, bool], ...]],
    stored: Mapping[str, Volume],
    space: Space | None,
) -> VolumePlan:
    """`attachments`: (instance, its (volume, read_only) in order, whether it is to run or be paused) in
    spec order; `held`: instance -> the volumes its running or paused domain has open (instances the
    pass stops or deletes already left out, DLV-VOL-20/21). Pure."""
    before: list[VolumeStep] = []
    refused: dict[str, str] = {}
    listed: dict[str, VolumeSpec] = {}
    promised = 0  # what this pass's creates and growths promise, in spec order
    for v in volumes:
        problem = check_volume(v)
        if problem is None and v.id in listed:
            problem = f"volume {v.id} is listed twice"
        if problem is not None:
            refused[v.id] = problem
            continue
        listed[v.id] = v
        cur = stored.get(v.id)
        if cur is None:
            problem = _promise(v.id, v.size_bytes, space, promised)
            if problem is not None:
                refused[v.id] = problem
                continue
            promised += v.size_bytes
            before.append(VolumeStep("create", v))
            continue
        if cur.serial != v.serial:
            before.append(VolumeStep("adopt", v))
        if v.size_bytes < cur.size_bytes:
            refused[v.id] = shrink(v.id, v.size_bytes, cur.size_bytes)
        elif v.size_bytes > cur.size_bytes:
            needed = v.size_bytes - cur.size_bytes
            problem = _promise(v.id, needed, space, promised)
            if problem is not None:
                refused[v.id] = problem
                continue
            promised += needed
            before.append(VolumeStep("grow", v))
    errors: dict[str, str] = {}
    resize: list[tuple[str, str, int]] = []
    writers: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    let_go: dict[str, str] = {}
    order = {inst: i for i, (inst, _vols, _up) in enumerate(attachments)}
    # Holders in spec order (domains the spec no longer attaches volumes to last): one that holds a
    # volume an earlier holder has open in a way that excludes it lets go (DLV-VOL-24).
    for inst in sorted(held, key=lambda i: (order.get(i, len(order)), i)):
        clash = None
        for vid, ro in held[inst]:
            w = writers.get(vid)
            if w is not None:
                clash = f"volume {vid} is open for writing by instance {w}"
            elif not ro and readers.get(vid):
                clash = f"volume {vid} is open by instance {readers[vid][0]}: a writer needs it alone"
            if clash:
                break
        if clash is not None:
            let_go[inst] = f"{clash}: stopped so that it lets go (the first in spec order keeps it)"
            continue
        for vid, ro in held[inst]:
            if ro:
                readers.setdefault(vid, []).append(inst)
            else:
                writers.setdefault(vid, inst)
    held = {k: v for k, v in held.items() if k not in let_go}
    grown = {s.volume.id: s.volume.size_bytes for s in before if s.kind == "grow"}
    for inst, held_vols in held.items():
        for vid, _ro in held_vols:
            if vid in grown:
                resize.append((inst, vid, grown[vid]))
    for inst, vols, up in attachments:
        problem = None
        for vid, _ro in vols:
            if vid not in listed:
                problem = f"volume {vid} is not a volume of this host's section"
            elif vid in refused:
                problem = refused[vid]
            if problem:
                break
        if problem is None and up:
            mine = dict(held.get(inst, ()))
            for vid, ro in vols:
                if vid in mine and mine[vid] == ro:
                    continue
                w = writers.get(vid)
                if w is not None and w != inst:
                    problem = f"volume {vid} is open for writing by instance {w}"
                elif not ro and any(r != inst for r in readers.get(vid, [])):
                    other = next(r for r in readers[vid] if r != inst)
                    problem = f"volume {vid} is open by instance {other}: a writer needs it alone"
                if problem:
                    break
            if problem is None:
                for vid, ro in vols:  # this instance holds them from here on (spec order: first wins)
                    if ro:
                        readers.setdefault(vid, []).append(inst)
                    else:
                        writers.setdefault(vid, inst)
        if problem is not None:
            errors[inst] = problem
    for inst, why in let_go.items():
        errors[inst] = why
    in_use = {vid for vols in held.values() for vid, _ in vols}
    in_use |= {vid for _inst, vols, _up in attachments for vid, _ in vols}
    after = tuple(
        VolumeStep("destroy", VolumeSpec(vid, cur.serial, cur.size_bytes))
        for vid, cur in sorted(stored.items())
        if vid not in listed and vid not in in_use and vid not in refused
    )
    return VolumePlan(tuple(before), after, errors, refused, tuple(resize), let_go)
