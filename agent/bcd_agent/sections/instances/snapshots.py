"""Snapshot tars, shared by the runtimes (docs/instances.md "Snapshots and restores").

A snapshot is a tar (DLV-LIBVIRT-22, DLV-CH-34) whose first member is `meta.json`
(`{"runtime", "cpuModel", "includeMemory"}`), then the flattened disk `disk.qcow2`, the seed `seed.iso`
when the instance had one and, with memory, the runtime's state (`save.state` for libvirt-kvm, `ch/…`
for cloud-hypervisor). Reading one is strict: only those names, only regular files, each at most once,
`meta.json` first and small; anything else refuses the whole tar (SnapshotRefused, naming the member
and the rule), so a tenant's tar never writes outside the new instance's directory.

Also here:
- `refuse_memory_snapshot`: the up-front refusals of a memory snapshot (DLV-RT-13 GPUs, DLV-RT-14
  read-write volumes); a disk-only snapshot of such an instance still works (DLV-RT-15).
- `check_meta`: a restore's refusals of another runtime (DLV-SNAP-06) or, with memory, another CPU
  model (DLV-SNAP-07).
- `rewrite_save_header`: libvirt's save image with its embedded domain XML replaced, so that a memory
  snapshot restores under a new name and UUID on the real libvirt 9.0 (see the function).
- `cpu_model`: the host's CPU model as `meta.json` records it (`/proc/cpuinfo`'s first `model name`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import IO, TYPE_CHECKING, Final

from bcd_shared.system import System

from bcd_agent.sections.instances.model import InstanceSpec
from bcd_agent.sections.instances.runtimes.base import (
    CH_STATE_DIR,
    DISK_NAME,
    LIBVIRT_STATE_NAME,
    META_NAME,
    SEED_NAME,
    SnapshotMeta,
    SnapshotRefused,
)

if TYPE_CHECKING:  # tarfile is imported where a tar is read or written, not at the node's start
    import tarfile

MAX_META: Final = 4096
CH_MEMBERS: Final = ("ch/config.json", "ch/state.json", "ch/memory-ranges")
MEMBERS: Final = (META_NAME, DISK_NAME, SEED_NAME, LIBVIRT_STATE_NAME, *CH_MEMBERS)
ERR_GPUS: Final = (
    "an instance with passthrough GPUs cannot be snapshotted with its memory; snapshot its disk only"
)
ERR_VOLUMES: Final = (
    "ErrMemorySnapshotWithVolumes: an instance with a read-write volume cannot be snapshotted with its "
    "memory; snapshot its disk only"
)
_CHUNK: Final = 1 << 20


def cpu_model(system: System) -> str:
    """`/proc/cpuinfo`'s first `model name` (vendor, family and model when it has none)."""
    text = system.read_text("/proc/cpuinfo") or ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if fields.get("model name"):
        return fields["model name"]
    return " ".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model"))


def refuse_memory_snapshot(inst: InstanceSpec, include_memory: bool) -> None:
    """DLV-RT-13/14: a memory snapshot of an instance with passthrough GPUs or a read-write volume is
    refused before anything runs; a disk-only one is not (DLV-RT-15)."""
    if not include_memory:
        return
    if inst.gpu_uuids:
        raise SnapshotRefused("SnapshotRefused", f"payload.include_memory: {ERR_GPUS}")
    if any(not ro for _vid, ro in inst.volumes):
        raise SnapshotRefused("SnapshotRefused", f"payload.include_memory: {ERR_VOLUMES}")


def refuse_memory_restore(inst: InstanceSpec, meta: SnapshotMeta) -> None:
    """A memory snapshot resumes a guest that had no passthrough GPU and no writable volume (the
    snapshot refused those): a restore whose spec adds one would hand QEMU's saved state a device it
    never had, so it is refused up front (docs/instances.md)."""
    if meta.include_memory and (inst.gpu_uuids or any(not ro for _vid, ro in inst.volumes)):
        raise SnapshotRefused(
            "SnapshotRefused",
            "restore_from: a memory snapshot restores without passthrough GPUs or read-write volumes "
            "(gpu_uuids, volumes); restore a disk-only snapshot instead",
        )


def meta_bytes(meta: SnapshotMeta) -> bytes:
    doc = {"runtime": meta.runtime, "cpuModel": meta.cpu_model, "includeMemory": meta.include_memory}
    return json.dumps(doc, sort_keys=True).encode() + b"\n"


def parse_meta(data: bytes) -> SnapshotMeta:
    """`meta.json`, strictly: an object of exactly runtime, cpuModel and includeMemory."""
    try:
        doc = json.loads(data)
    except ValueError:
        raise SnapshotRefused("BadSnapshot", "snapshot meta.json: not JSON") from None
    if not isinstance(doc, dict) or set(doc) != {"runtime", "cpuModel", "includeMemory"}:
        raise SnapshotRefused(
            "BadSnapshot", "snapshot meta.json: must hold exactly runtime, cpuModel and includeMemory"
        )
    runtime, model, memory = doc["runtime"], doc["cpuModel"], doc["includeMemory"]
    if not isinstance(runtime, str) or not isinstance(model, str) or not isinstance(memory, bool):
        raise SnapshotRefused(
            "BadSnapshot", "snapshot meta.json: runtime and cpuModel are strings, includeMemory a boolean"
        )
    return SnapshotMeta(runtime, model, memory)


def check_meta(meta: SnapshotMeta, runtime: str, host_cpu_model: str) -> None:
    """DLV-SNAP-06, DLV-RT-12: another runtime's tar is refused; DLV-SNAP-07: with memory, another CPU
    model's."""
    if meta.runtime != runtime:
        raise SnapshotRefused(
            "SnapshotRefused",
            f"restore_from: the snapshot was taken by the {meta.runtime[:40]!r} runtime, "
            f"not {runtime}: a snapshot restores only on the runtime that took it",
        )
    if meta.include_memory and meta.cpu_model != host_cpu_model:
        raise SnapshotRefused(
            "SnapshotRefused",
            f"restore_from: the memory snapshot was taken on CPU model {meta.cpu_model[:120]!r}, this host "
            f"is {host_cpu_model[:120]!r}: a memory snapshot restores only on the same CPU model",
        )


# --- writing ---------------------------------------------------------------------------------------


def write_tar(tar_path: str, meta: SnapshotMeta, files: Iterable[tuple[str, str]]) -> None:
    """A new tar at `tar_path` (created exclusively, fsynced): `meta.json` first, then each (member
    name, real path). Plain ustar/PAX, no compression (the disk is qcow2 already)."""
    import io
    import tarfile

    fd = os.open(tar_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        data = meta_bytes(meta)
        info = tarfile.TarInfo(META_NAME)
        info.size, info.mode = len(data), 0o600
        tar.addfile(info, io.BytesIO(data))
        for name, path in files:
            if name not in MEMBERS:
                raise ValueError(f"{name} is not a snapshot member")
            with open(path, "rb") as f:
                info = tarfile.TarInfo(name)
                info.size, info.mode = os.fstat(f.fileno()).st_size, 0o600
                tar.addfile(info, f)
        tar.close()
        raw.flush()
        os.fsync(raw.fileno())


# --- reading ---------------------------------------------------------------------------------------


def read_meta(tar_path: str) -> SnapshotMeta:
    """The tar's `meta.json` (its first member), strictly."""
    check_headers(tar_path)
    import tarfile

    with tarfile.open(tar_path, mode="r:") as tar:
        return _first_meta(tar)


def _first_meta(tar: tarfile.TarFile) -> SnapshotMeta:
    """The open tar's next member, which must be `meta.json`, parsed strictly."""
    first = tar.next()
    if first is None or first.name != META_NAME or not first.isreg() or first.size > MAX_META:
        raise SnapshotRefused(
            "BadSnapshot", f"snapshot: the first member must be {META_NAME}, a file of at most 4 KiB"
        )
    f = tar.extractfile(first)
    assert f is not None
    return parse_meta(f.read())


MAX_EXTENDED_HEADER: Final = 64 * 1024


def check_headers(tar_path: str) -> None:
    """Walk the first headers of the tar ourselves before `tarfile` does: Python's tarfile reads a PAX
    or GNU long-name header's whole body into memory, so one claiming gigabytes would exhaust bcd.
    Such a header larger than 64 KiB, or a size field that does not parse, refuses the tar."""
    with open(tar_path, "rb") as f:
        for _ in range(2 * len(MEMBERS) + 2):
            block = f.read(512)
            if len(block) < 512 or not block.strip(b"\0"):
                return
            field = block[124:136]
            if field[0] & 0x80:  # base-256 (GNU): only ever a huge size here
                size = int.from_bytes(field[1:], "big")
            else:
                text = field.rstrip(b"\0 ").strip() or b"0"
                try:
                    size = int(text, 8)
                except ValueError:
                    raise SnapshotRefused(
                        "BadSnapshot", "snapshot: a tar header's size is malformed"
                    ) from None
            if block[156:157] in (b"x", b"g", b"L", b"K") and size > MAX_EXTENDED_HEADER:
                raise SnapshotRefused(
                    "BadSnapshot", f"snapshot: an extended tar header of {size} bytes (at most 64 KiB)"
                )
            f.seek(-(-size // 512) * 512, os.SEEK_CUR)


def member_names(tar_path: str) -> tuple[str, ...]:
    """The tar's member names, reading at most one more header than a snapshot can hold (a tar of a
    million members is not listed whole; `unpack` refuses it at its first stranger)."""
    names: list[str] = []
    check_headers(tar_path)
    import tarfile

    with tarfile.open(tar_path, mode="r:") as tar:
        while len(names) <= len(MEMBERS) and (member := tar.next()) is not None:
            names.append(member.name)
    return tuple(names)


def unpack(
    tar_path: str,
    dest: str,
    runtime: str,
    host_cpu_model: str,
    state_name: str | None = None,
    rewrite: Mapping[str, Callable[[IO[bytes], IO[bytes]], None]] | None = None,
) -> tuple[SnapshotMeta, tuple[str, ...]]:
    """Check the tar's meta (check_meta) and unpack its members into the existing directory `dest`:
    each a new file (O_EXCL, O_NOFOLLOW, 0600; `ch/` made here). Returns the meta and the member names
    written. `state_name`, when given, is the one state member this runtime accepts (with memory it must
    be there; without, it must not); `rewrite[name]`, when given, copies that member itself (src, out).
    Anything else is refused, naming the member and the rule."""
    check_headers(tar_path)
    import tarfile

    with tarfile.open(tar_path, mode="r:") as tar:
        meta = _first_meta(tar)
        check_meta(meta, runtime, host_cpu_model)
        seen: list[str] = []
        while (member := tar.next()) is not None:  # (iterating the TarFile would yield meta.json again)
            name = member.name
            if name not in MEMBERS or name == META_NAME:
                raise SnapshotRefused("BadSnapshot", f"snapshot member {name[:120]!r}: not a snapshot file")
            if not member.isreg():
                raise SnapshotRefused("BadSnapshot", f"snapshot member {name!r}: not a regular file")
            if name in seen:
                raise SnapshotRefused("BadSnapshot", f"snapshot member {name!r}: appears twice")
            is_state = name == LIBVIRT_STATE_NAME or name.startswith(CH_STATE_DIR)
            if is_state and (not meta.include_memory or state_name is None or not _accepts(state_name, name)):
                raise SnapshotRefused(
                    "BadSnapshot", f"snapshot member {name!r}: a state this {runtime} snapshot cannot hold"
                )
            src = tar.extractfile(member)
            assert src is not None
            if name.startswith(CH_STATE_DIR):
                os.makedirs(os.path.join(dest, CH_STATE_DIR), mode=0o700, exist_ok=True)
            _copy_new(src, os.path.join(dest, name), member.size, (rewrite or {}).get(name))
            seen.append(name)
    if DISK_NAME not in seen:
        raise SnapshotRefused("BadSnapshot", f"snapshot: no {DISK_NAME}")
    if meta.include_memory and state_name is not None and not any(_accepts(state_name, n) for n in seen):
        raise SnapshotRefused("BadSnapshot", "snapshot: includeMemory is set but the memory state is missing")
    return meta, tuple(seen)


def _accepts(state_name: str, member: str) -> bool:
    return member == state_name or (state_name.endswith("/") and member.startswith(state_name))


def _copy_new(
    src: IO[bytes], path: str, size: int, rewrite: Callable[[IO[bytes], IO[bytes]], None] | None = None
) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        if rewrite is not None:
            rewrite(src, out)
        left = size if rewrite is None else 0
        while left > 0:
            chunk = src.read(min(_CHUNK, left))
            if not chunk:
                raise SnapshotRefused("BadSnapshot", f"snapshot member {os.path.basename(path)!r}: truncated")
            out.write(chunk)
            left -= len(chunk)
        out.flush()
        os.fsync(out.fileno())


# --- libvirt's save image ---------------------------------------------------------------------------

SAVE_MAGIC: Final = b"LibvirtQemudSave"
SAVE_HEADER: Final = struct.Struct("<16s5I56x")  # magic, version, data_len, was_running, compressed,
# cookieOffset, 14 unused words (libvirt 9.0 src/qemu/qemu_saveimage.h, virQEMUSaveHeader; x86: LE)
MAX_SAVE_DATA: Final = 16 << 20


def rewrite_save_header(src: IO[bytes], out: IO[bytes], new_xml: bytes, was_running: bool = True) -> None:
    """Copy a libvirt save image from `src` to `out` with its embedded domain XML replaced by `new_xml`.

    Why: libvirt 9.0 checks the definition given to `virsh restore --xml` against the one embedded in
    the image for ABI stability, and that check includes the name and the UUID ("Target domain name …
    does not match source"); `virDomainSaveImageDefineXML` runs the same check. A memory restore has a
    new name and UUID, so bcd writes its own definition into the image as well: the two then agree, and
    libvirt starts QEMU from the `--xml` definition (root's checked one under the helper) and feeds it
    the saved QEMU stream, which carries no name or UUID. The cookie (libvirt's CPU and slirp notes) is
    kept; `was_running` is set, so `restore` resumes unless asked `--paused`.

    Layout: the 92-byte header, `data_len` bytes of XML, NUL, cookie at `cookieOffset`, NUL padding,
    then QEMU's migration stream, which is copied unchanged."""
    head = src.read(SAVE_HEADER.size)
    if len(head) != SAVE_HEADER.size:
        raise SnapshotRefused("BadSnapshot", "save.state: shorter than libvirt's save header")
    magic, version, data_len, _running, compressed, cookie_offset = SAVE_HEADER.unpack(head)
    if magic != SAVE_MAGIC:
        raise SnapshotRefused("BadSnapshot", "save.state: not a libvirt save image (magic)")
    if version not in (1, 2) or not 0 < data_len <= MAX_SAVE_DATA or cookie_offset > data_len:
        raise SnapshotRefused("BadSnapshot", "save.state: unknown version or a malformed data length")
    data = src.read(data_len)
    if len(data) != data_len:
        raise SnapshotRefused("BadSnapshot", "save.state: truncated in its data")
    cookie = b""
    if version == 2 and cookie_offset:
        cookie = data[cookie_offset:].split(b"\0", 1)[0]
    if b"\0" in new_xml:
        raise ValueError("the domain XML holds a NUL")
    payload = new_xml + b"\0"
    new_offset = len(payload) if cookie else 0
    if cookie:
        payload += cookie + b"\0"
    new_len = max(data_len, -(-len(payload) // 1024) * 1024)
    payload += b"\0" * (new_len - len(payload))
    out.write(SAVE_HEADER.pack(SAVE_MAGIC, version, new_len, int(was_running), compressed, new_offset))
    out.write(payload)
    while chunk := src.read(_CHUNK):
        out.write(chunk)


def embedded_xml(path: str) -> bytes:
    """The domain XML a save image embeds (for tests and diagnostics)."""
    with open(path, "rb") as f:
        head = f.read(SAVE_HEADER.size)
        magic, _version, data_len, _r, _c, cookie_offset = SAVE_HEADER.unpack(head)
        if magic != SAVE_MAGIC:
            raise SnapshotRefused("BadSnapshot", "save.state: not a libvirt save image (magic)")
        data = f.read(min(data_len, MAX_SAVE_DATA))
    return data[: cookie_offset or None].split(b"\0", 1)[0]
