"""ch.*: the cloud-hypervisor runtime's root-only steps for an unprivileged node (DLV-CHH-01..24).

Every request names an instance by id (bcd_shared.instancenames: the domain-name pattern, DLV-CHH-23);
the server audits it with that name. Rules:
- `ch.taps`: root creates exactly `tap_name(id, i)` for each NIC, a tap owned by the node's uid and
  gid (the node opens it and hands the fd to the VMM), on the NIC's bridge, which must be one of
  `[helper] instance_bridges`. An existing interface of that name is kept when it is a tap and
  refused when it is anything else (DLV-CHH-05/06). `ch.untaps` deletes only those names, and only
  taps (DLV-CHH-07). Tap names hash the id (44 bits; ids collide): an instance whose names another
  live instance's taps have (root's claim of a cloud-hypervisor instance, or a libvirt domain root
  defined) is refused `tap-collision` naming both, and its `ch.untaps` deletes nothing
  (bcd_helper.taps; docs/helper.md, "Tap names").
- `ch.launch`: root reads `vm.json` itself (bcd_shared.chrecord) and checks, with no symlink followed:
  the instance directory, `vm.json`, the disk and the seed are the node's (its uid) and regular;
  nothing in the directory is a symlink; the base image is `images/<64 hex>.<format>` and passes
  the header check, and the overlay names exactly it; volumes are files of the volume store; GPUs are
  this host's; the VMM uid is in bcd's range, no other running `bcd-ch-*` unit's, and holds no
  /dev/vfio group but its GPUs'; vCPUs and memory within bounds (DLV-CHH-16..20). With
  command-signing roots, the record is compared with the signed spec's instance (vCPUs, memory, NICs,
  GPUs by UUID, image). Then, under the `ch` lock, root
  creates the VMM's account when missing, grants its ACL entries (the instance directory with a
  default entry so what the VMM creates inherits it, every file in it, each volume read-write or
  read-only) through descriptors it opened itself (bcd_shared.posixacl), and starts the unit
  `bcd_shared.chunit` builds with root's own `cloud-hypervisor` binary and UMask 0007 (DLV-CHH-21,
  DLV-CHH-02..04). The base image and the volumes are bound from root's hard links of the inodes it
  opened and checked, in `<data_dir>-ch-binds/<id>/` (root 0700; bcd_helper.chbinds), never by the
  node's paths, which systemd would resolve again after the checks (round 11); the volumes' ACL
  entries go on those inodes. No command line of the node's reaches root.
- `ch.stop`: stops the unit, answers its state, removes the VMM user's ACL entries from the instance
  directory, its files, the record's volumes and the inodes of root's links, removes those links,
  and gives back to root exactly the /dev/vfio groups the stopped unit's user owned (DLV-CHH-14,
  DLV-CHH-04).
- `ch.vfio`: the record's GPUs, only this host's, none root sees holding work (a live hold, compute
  processes); each one's IOMMU group may hold only the record's GPUs, functions of this host's GPUs and
  PCI bridges (the whole group goes to the VMM), and its /dev/vfio node must not be a running VMM
  unit's user's (root reads the owner itself); the record's uid must be no other running unit's. Every
  endpoint is bound to vfio-pci (driver_override, unbind, drivers_probe; bridges stay), checked, and
  /dev/vfio/<group> given to the VMM's user, 0600 (DLV-CHH-09..12, DLV-CHH-15). With command-signing
  roots the request carries the signed spec, re-validated as for `ch.launch`, and the record's GPUs
  must be exactly its instance's (by UUID). `ch.unvfio` gives the groups back to root and their
  drivers, never a group a running unit's user holds (DLV-CHH-13).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import stat
from pathlib import Path
from typing import Any

from attrs import evolve, frozen
from bcd_shared import posixacl
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
from bcd_shared.images import ImageRefused, check_image, check_overlay
from bcd_shared.instancenames import BRIDGE_RE, MAX_NICS, tap_name, valid_instance_id, volumes_dir

from bcd_helper import chbinds
from bcd_helper import taps as tapnames
from bcd_helper.ops.base import Call, Failed, Refused
from bcd_helper.ops.hostunit import SignedIntent

# Root's own VMM binary: the first of these that is a regular file root owns and only root can write.
CH_BINARIES = ("/usr/local/bin/cloud-hypervisor", "/usr/bin/cloud-hypervisor")
MAX_VIRTUAL_SIZE = 64 << 40
DISK = "disk.qcow2"
SEED = "seed.iso"
RECORD = "vm.json"
RECORD_MAX = 1 << 20  # bcd_shared.chrecord.MAX_BYTES
# Entries root scans (and grants ACL entries on) in an instance directory: the node's runtime leaves a
# handful (vm.json, the disk, the seed, the VMM's sockets); a bound keeps root's time under the locks
# bounded whatever the node puts there.
MAX_ENTRIES = 256
# VMM accounts root creates and keeps (the node reuses the lowest free uid, one per instance it runs):
# a node naming a new uid at every launch would otherwise fill /etc/passwd and /etc/group.
MAX_VMM_ACCOUNTS = 1024


@frozen
class ChTaps:
    name: str
    bridges: tuple[str, ...]
    intent: SignedIntent | None = None


@frozen
class ChName:
    name: str


@frozen
class ChLaunch:
    name: str
    intent: SignedIntent | None = None


def _name(op: str, name: str) -> str:
    if not valid_instance_id(name):
        raise Refused("bad-name", f"{op}: {name[:80]!r} is not an instance id")
    return name


def _err(result: Any) -> str:
    text: str = (
        result.stderr.decode(errors="replace").strip() or result.stdout.decode(errors="replace").strip()
    )
    return text[:500]


# -- taps ----------------------------------------------------------------------------------------


def _link(call: Call, dev: str) -> dict[str, Any] | None:
    """Root's view of interface `dev` (`ip -j -d link show`), or None when there is none."""
    result = call.system.run(["ip", "-j", "-d", "link", "show", "dev", dev], timeout=30)
    if not result.ok:
        err = _err(result)
        if "does not exist" in err or "Cannot find device" in err:
            return None
        raise Failed("ip", f"ip link show {dev}: {err}")
    try:
        links = json.loads(result.stdout)
    except ValueError:
        raise Failed("ip", f"ip -j link show {dev}: not JSON") from None
    return links[0] if isinstance(links, list) and links and isinstance(links[0], dict) else None


def _is_tap(link: dict[str, Any]) -> bool:
    info = link.get("linkinfo") or {}
    data = info.get("info_data") or {}
    return info.get("info_kind") == "tun" and data.get("type") == "tap"


def _signed_nics(
    call: Call,
    op: str,
    name: str,
    intent: SignedIntent | None,
    bridges: list[str] | None,
    check: Any = None,
    *,
    starts: bool = False,
) -> None:
    """With roots: the signed spec's instance (`starts`: wanted RUNNING or PAUSED, round 6b); its NICs'
    bridges must be `bridges`, and `check(inst)` passes; root's intent state is saved only after every
    check passed (a refusal changes nothing)."""
    verifier = call.ctx.intent_verifier()
    inst, state = verifier.signed_instance(op, name, intent, starts=starts, runtime="cloud-hypervisor")
    if inst is not None and bridges is not None and [n.bridge for n in inst.nics] != bridges:
        raise Refused("spec-mismatch", f"{op}: {name}: the bridges differ from the signed spec's NICs")
    if inst is not None and check is not None:
        check(inst)
    if state is not None:
        verifier.save_state(state)


def _with_roots(call: Call, intent: SignedIntent | None) -> bool:
    from bcd_helper.ops.base import no_roots_possible

    return not no_roots_possible(call.ctx, intent)


def ch_taps(call: Call, req: ChTaps) -> dict[str, Any]:
    op = "ch.taps"
    name = _name(op, req.name)
    allowed = call.ctx.config.instance_bridges
    if not 1 <= len(req.bridges) <= MAX_NICS:
        raise Refused("bad-arguments", f"{op}: 1 to {MAX_NICS} NICs")
    for i, br in enumerate(req.bridges):
        if not BRIDGE_RE.fullmatch(br) or br not in allowed:
            raise Refused(
                "bridge-not-allowed",
                f"{op}: NIC {i}: bridge {br[:20]!r} is not in [helper] instance_bridges "
                f"({', '.join(allowed) or 'none configured: every instance tap is refused'})",
            )
    if _with_roots(call, req.intent):
        _signed_nics(call, op, name, req.intent, list(req.bridges))
    # Another live instance whose taps have these names: never its tap (docs/helper.md, "Tap names").
    tapnames.refuse_collision(call, op, name)
    taps = [tap_name(name, i) for i in range(len(req.bridges))]
    existing = {t: _link(call, t) for t in taps}
    for tap, link in existing.items():
        if link is not None and not _is_tap(link):
            raise Refused("not-a-tap", f"{op}: {tap} exists and is not a tap: it is never touched")
    tapnames.claim(call, name)
    created: list[str] = []
    try:
        _make_taps(call, taps, req.bridges, existing, created)
    except Failed:
        # Nothing half-applied: the taps this call created go again (best effort; the failure is answered).
        for tap in created:
            with contextlib.suppress(Failed):
                call.system.run(["ip", "link", "delete", "dev", tap], timeout=30)
        if all(link is None for link in existing.values()):
            tapnames.release(call, name)
        raise
    return {"name": name, "taps": taps, "created": created}


def _make_taps(
    call: Call, taps: list[str], bridges: tuple[str, ...], existing: dict[str, Any], created: list[str]
) -> None:
    cfg = call.ctx.config
    for tap, br in zip(taps, bridges, strict=True):
        if existing[tap] is None:
            result = call.system.run(
                [
                    "ip",
                    "tuntap",
                    "add",
                    "dev",
                    tap,
                    "mode",
                    "tap",
                    "user",
                    str(cfg.node_uid),
                    "group",
                    str(cfg.node_gid),
                ],
                timeout=30,
            )
            if not result.ok:
                raise Failed("ip", f"ip tuntap add {tap}: {_err(result)}")
            created.append(tap)
        result = call.system.run(["ip", "link", "set", "dev", tap, "master", br, "up"], timeout=30)
        if not result.ok:
            raise Failed("ip", f"ip link set {tap} master {br}: {_err(result)}")


def ch_untaps(call: Call, req: ChName) -> dict[str, Any]:
    op = "ch.untaps"
    name = _name(op, req.name)
    deleted: list[str] = []
    if tapnames.owner(call, name) is not None:
        return {"name": name, "deleted": deleted}  # its names are another live instance's taps
    for i in range(MAX_NICS):
        tap = tap_name(name, i)
        link = _link(call, tap)
        if link is None or not _is_tap(link):
            continue  # never an interface that is not bcd's tap
        result = call.system.run(["ip", "link", "delete", "dev", tap], timeout=30)
        if not result.ok:
            raise Failed("ip", f"ip link delete {tap}: {_err(result)}")
        deleted.append(tap)
    tapnames.release(call, name)
    return {"name": name, "deleted": deleted}


# -- the record, read and checked as root --------------------------------------------------------

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_dir_chain(base: Path, parts: list[str], op: str) -> int:
    """Open `base/parts...` as directories without following a symlink at any step."""
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:  # the node's data_dir missing: named, not an internal failure (round 6)
        raise Refused("bad-layout", f"{op}: the node's data_dir: {exc.strerror}") from None
    try:
        for part in parts:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as exc:
        os.close(fd)
        raise Refused(
            "bad-layout", f"{op}: {'/'.join(parts)}: {exc.strerror} (a directory, no symlink)"
        ) from None
    return fd


def _entries(dfd: int, op: str, inst: str) -> list[os.DirEntry[str]]:
    """The directory's entries, refused past MAX_ENTRIES before any is acted on."""
    with os.scandir(dfd) as it:
        entries = list(itertools.islice(it, MAX_ENTRIES + 1))
    if len(entries) > MAX_ENTRIES:
        raise Refused("bad-layout", f"{op}: {inst} holds more than {MAX_ENTRIES} entries")
    return entries


def _open_node_file(dir_fd: int, name: str, op: str, uid: int, shown: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        raise Refused("bad-layout", f"{op}: {shown}: {exc.strerror} (a regular file, no symlink)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
        os.close(fd)
        raise Refused("bad-layout", f"{op}: {shown} must be a regular file the node owns")
    return fd, st


@frozen
class Checked:
    record: CHRecord
    instance_dir: str  # host path as the VMM sees it (unit properties)
    base_image: str | None
    volumes_rw: tuple[str, ...]
    volumes_ro: tuple[str, ...]


def _read_record(call: Call, op: str, name: str) -> Checked:
    cfg = call.ctx.config
    data_dir = cfg.data_dir
    inst = ch_instance_dir(data_dir, name)
    rel = inst[len(data_dir) + 1 :].split("/")
    dfd = _open_dir_chain(call.system.host_path(data_dir), rel, op)
    try:
        st = os.fstat(dfd)
        if st.st_uid != cfg.node_uid:
            raise Refused("bad-layout", f"{op}: {inst} must be the node's directory")
        for entry in _entries(dfd, op, inst):
            if entry.is_symlink():
                raise Refused(
                    "symlink", f"{op}: {inst}/{entry.name} is a symlink: none may be in the directory"
                )
        rfd, _rst = _open_node_file(dfd, RECORD, op, cfg.node_uid, f"{inst}/{RECORD}")
        try:
            with os.fdopen(os.dup(rfd), "rb") as f:
                data = f.read(RECORD_MAX + 1)  # bounded whatever the node wrote
        finally:
            os.close(rfd)
        try:
            rec = parse_record(data)
        except RecordError as exc:
            raise Refused("bad-record", f"{op}: {exc}") from None
        if rec.name != name:
            raise Refused("bad-record", f"{op}: vm.json names {rec.name!r}, not {name!r}")
        disk_fd, _ = _open_node_file(dfd, DISK, op, cfg.node_uid, f"{inst}/{DISK}")
        os.close(disk_fd)
        if rec.seed:
            seed_fd, _ = _open_node_file(dfd, SEED, op, cfg.node_uid, f"{inst}/{SEED}")
            os.close(seed_fd)
    finally:
        os.close(dfd)
    base = None
    disk = str(call.system.host_path(f"{inst}/{DISK}"))
    if rec.restored:
        # A restored disk is flat: it names no backing file, and its VMM gets backing_files off
        # (DLV-CH-07); no base image is bound into its unit.
        try:
            check_overlay(disk, None, None, MAX_VIRTUAL_SIZE)
        except ImageRefused as exc:
            raise Refused(f"image-{exc.reason}", f"{op}: {exc.message}") from None
    elif rec.image_sha256 is not None:
        base = f"{ch_images_dir(data_dir)}/{rec.image_sha256}.{rec.image_format}"
        real = call.system.host_path(base)
        _no_link_on_the_way(call, op, base, "bad-image")
        try:
            bst = os.lstat(real)
        except OSError:
            raise Refused("bad-image", f"{op}: base image {base} is missing") from None
        if not stat.S_ISREG(bst.st_mode):
            raise Refused("bad-image", f"{op}: base image {base} must be a regular file")
        try:
            if rec.image_format == "qcow2":
                check_image(str(real), MAX_VIRTUAL_SIZE)
            # the overlay names the base by the path the VMM sees, which is the host path
            check_overlay(disk, base, rec.image_format, MAX_VIRTUAL_SIZE)
        except ImageRefused as exc:
            raise Refused(f"image-{exc.reason}", f"{op}: {exc.message}") from None
    else:
        raise Refused("bad-record", f"{op}: a disk without a base image must be a restored one")
    rw: list[str] = []
    ro: list[str] = []
    store = volumes_dir(data_dir)
    for vol in rec.volumes:
        path = f"{store}/{vol.name}"
        _no_link_on_the_way(call, op, path, "bad-volume")
        try:
            vst = os.lstat(call.system.host_path(path))
        except OSError:
            raise Refused("bad-volume", f"{op}: volume {path} is missing") from None
        if not stat.S_ISREG(vst.st_mode) or vst.st_uid != cfg.node_uid:
            raise Refused(
                "bad-volume", f"{op}: volume {path} must be a regular file of the node's volume store"
            )
        (ro if vol.read_only else rw).append(path)
    if rec.gpus:
        from bcd_helper.ops.libvirt import host_gpus

        ours = host_gpus(call)
        foreign = [g for g in rec.gpus if g not in ours]
        if foreign:
            raise Refused("not-this-hosts-gpu", f"{op}: {', '.join(foreign)} is not a GPU of this host")
    return Checked(rec, inst, base, tuple(rw), tuple(ro))


def _no_link_on_the_way(call: Call, op: str, path: str, reason: str) -> None:
    """No directory between data_dir and `path` is a symlink (each lstat'ed): the unit binds `path`, which
    systemd resolves as root, so a linked `images` or `volumes` directory of the node's would bind a file
    of a directory only root enters (red team round 8; the libvirt ops' host_check rule)."""
    data_dir = call.ctx.config.data_dir.rstrip("/")
    cur = call.system.host_path(data_dir or "/")
    for part in path[len(data_dir) + 1 :].split("/")[:-1]:
        cur = cur / part
        try:
            link = stat.S_ISLNK(os.lstat(cur).st_mode)
        except OSError:
            return  # missing: the caller's own lstat names it
        if link:
            raise Refused(reason, f"{op}: {path}: a symlink on the way ({part}): none may be from data_dir")


def _running_units(call: Call) -> dict[str, int]:
    """Root's view: each active bcd-ch-* unit and the uid it runs as."""
    result = call.system.run(
        ["systemctl", "list-units", "--type=service", "--plain", "--no-legend", "--no-pager", "bcd-ch-*"],
        timeout=30,
    )
    if not result.ok:
        raise Failed("systemctl", f"systemctl list-units: {_err(result)}")
    out: dict[str, int] = {}
    for line in result.stdout.decode(errors="replace").splitlines():
        fields = line.split()
        if (
            len(fields) < 3
            or not fields[0].startswith("bcd-ch-")
            or fields[2] not in ("active", "activating")
        ):
            continue
        show = call.system.run(["systemctl", "show", "-p", "User", "--value", fields[0]], timeout=30)
        user = show.stdout.decode(errors="replace").strip() if show.ok else ""
        out[fields[0]] = int(user) if user.isdigit() else -1
    return out


def _signed_record(call: Call, op: str, name: str, intent: SignedIntent | None, rec: CHRecord) -> None:
    def check(inst: Any) -> None:
        size = inst.size
        mismatch = []
        if size is None or rec.vcpus != size.vcpus:
            mismatch.append("vCPUs")
        if size is None or rec.memory_bytes != size.memory_bytes:
            mismatch.append("memory")
        if [(n.bridge, n.mac) for n in rec.nics] != [(n.bridge, n.mac) for n in inst.nics]:
            mismatch.append("NICs")
        from bcd_helper.ops.libvirt import gpu_uuids_at, spec_placement

        if len(rec.gpus) != len(inst.gpu_uuids) or gpu_uuids_at(call, rec.gpus) != sorted(inst.gpu_uuids):
            mismatch.append("GPUs")  # the spec's GPUs by UUID, not just as many
        image = inst.image.sha256 if inst.image is not None else None
        if not rec.restored and rec.image_sha256 != image:
            mismatch.append("image")
        got, want = _record_placement(rec), spec_placement(inst)
        # huge pages as on or off, no balloon: the VMM config's, which the node drives over the API
        if (
            got is None
            or want is None
            or got != evolve(want, hugepage_bytes=int(want.hugepage_bytes > 0), balloon=False)
        ):
            mismatch.append("placement")  # the unit's AllowedCPUs / AllowedMemoryNodes (round 8)
        if mismatch:
            raise Refused(
                "spec-mismatch",
                f"{op}: {name}: vm.json differs from the signed spec in {', '.join(mismatch)}",
            )
        from bcd_helper.ops.nft import require_loaded

        require_loaded(call, op, inst)  # the guest runs only behind its signed rules

    _signed_nics(call, op, name, intent, None, check, starts=True)


def _record_placement(rec: CHRecord) -> Any:
    """vm.json's placement in domaincheck's normal form (huge pages 1 or 0, no balloon: the VMM config's
    huge page size and balloon are the node's, over the API); None: a cpulist that is not one."""
    from bcd_shared.domaincheck import Placed, cpu_set

    try:
        return Placed(
            cpu_set(rec.cpus) if rec.cpus else None,
            cpu_set(rec.mems) if rec.mems else None,
            int(rec.hugepages),
        )
    except ValueError:
        return None


def _uid_not_in_use(op: str, unit: str, uid: int, running: dict[str, int]) -> None:
    """One VMM user per instance (DLV-CHH-19): a uid another running unit has is refused."""
    others = [u for u, u_uid in running.items() if u_uid == uid and u != unit]
    if others:
        raise Refused("uid-in-use", f"{op}: uid {uid} is {others[0]}'s: one VMM user per instance")


def _holds_only_its_groups(call: Call, op: str, rec: CHRecord) -> None:
    """The VMM's user holds no /dev/vfio group but its record's GPUs': ch.vfio of another record naming
    the same uid could have given it one, whose GPU the node would then attach to this guest over the
    VMM's API socket (with roots: a GPU the signed spec gives another instance)."""
    owned = [g for g in call.system.listdir("/dev/vfio") if g.isdigit() and _vfio_owner(call, g) == rec.uid]
    if not owned:
        return
    mine = {_group_of(call, op, gpu) for gpu in rec.gpus}
    for group in owned:
        if group not in mine:
            raise Refused(
                "uid-in-use",
                f"{op}: uid {rec.uid} holds /dev/vfio/{group}, the group of no GPU of vm.json "
                "(ch.stop or ch.unvfio of the instance it was given to gives it back)",
            )


def root_binary(call: Call) -> str:
    """Root's own cloud-hypervisor: regular, root's, writable by no one else (host path)."""
    for path in CH_BINARIES:
        try:
            st = os.stat(call.system.host_path(path))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022 and st.st_mode & 0o111:
            return path
    raise Failed("no-vmm", f"no cloud-hypervisor binary root owns in {' or '.join(CH_BINARIES)}")


def _has_account(call: Call, uid: int) -> bool:
    passwd = call.system.read_text("/etc/passwd") or ""
    return any(line.split(":")[2:3] == [str(uid)] for line in passwd.splitlines())


def _not_foreign(call: Call, op: str, uid: int) -> str:
    """Refuse a uid of the range that an account other than bcd's `bcd-vmm-<n>` has; /etc/passwd."""
    passwd = call.system.read_text("/etc/passwd") or ""
    for line in passwd.splitlines():
        fields = line.split(":")
        if fields[2:3] == [str(uid)] and fields[0] != vmm_user_name(uid):
            raise Refused("foreign-account", f"{op}: uid {uid} is the account {fields[0][:32]!r}, not bcd's")
    return passwd


def _ensure_account(call: Call, op: str, uid: int) -> None:
    """systemd 252 refuses User= without a passwd entry (217/USER): root creates the account. A uid
    of the range held by an account that is not bcd's (`bcd-vmm-<n>`) is refused: a VMM never runs as
    someone else."""
    passwd = _not_foreign(call, op, uid)
    if _has_account(call, uid):
        return
    ours = sum(1 for line in passwd.splitlines() if line.startswith("bcd-vmm-"))
    if ours >= MAX_VMM_ACCOUNTS:
        raise Refused(
            "too-many-accounts", f"{op}: {ours} VMM accounts exist, at most {MAX_VMM_ACCOUNTS}: reuse a uid"
        )
    for argv in account_add_argv(uid):
        result = call.system.run(argv, timeout=60)
        if not result.ok and "already exists" not in _err(result):
            raise Failed("account", f"{argv[0]} {vmm_user_name(uid)}: {_err(result)}")


# -- ACLs ------------------------------------------------------------------------------------------


def _acl_instance(
    call: Call, checked: Checked, uid: int, grant: bool, volumes: dict[str, str] | None = None
) -> None:
    cfg = call.ctx.config
    inst = checked.instance_dir
    rel = inst[len(cfg.data_dir) + 1 :].split("/")
    dfd = _open_dir_chain(call.system.host_path(cfg.data_dir), rel, "acl")
    try:
        if os.fstat(dfd).st_uid != cfg.node_uid:
            raise Refused("bad-layout", f"{inst} must be the node's directory")
        entries = _entries(dfd, "acl", inst)
        if grant:
            posixacl.set_user(dfd, uid, 0o7, default=True)
            # What the VMM creates there (api.sock, serial.sock) stays reachable by the node, which
            # drives the VMM over its API socket (DLV-CHH-22): a default entry for the node's uid.
            posixacl.set_user(dfd, cfg.node_uid, 0o7, default=True, access=False)
        else:
            posixacl.remove_user(dfd, uid)
        for entry in entries:
            if entry.name == RECORD:
                continue  # the record is the node's and root's: the VMM never needs it
            try:
                fd = os.open(entry.name, os.O_RDONLY | _NOFOLLOW, dir_fd=dfd)
            except OSError:
                continue  # a socket or a vanished file: nothing to grant
            try:
                st = os.fstat(fd)
                if st.st_uid != cfg.node_uid or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    continue
                if grant:
                    posixacl.set_user(fd, uid, 0o7 if stat.S_ISDIR(st.st_mode) else 0o6, default=True)
                else:
                    posixacl.remove_user(fd, uid)
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    vols = [(p, 0o6) for p in checked.volumes_rw] + [(p, 0o4) for p in checked.volumes_ro]
    if volumes is not None:  # root's links of the checked inodes (chbinds), never the node's path
        vols = [(volumes[p], perms) for p, perms in vols]
    _acl_volumes(call, vols, uid, grant)


def _acl_volumes(call: Call, vols: list[tuple[str, int]], uid: int, grant: bool) -> None:
    cfg = call.ctx.config
    for path, perms in vols:
        try:
            fd = os.open(call.system.host_path(path), os.O_RDONLY | _NOFOLLOW)
        except OSError as exc:
            if grant:
                raise Failed("acl", f"{path}: {exc.strerror}") from None
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != cfg.node_uid:
                raise Refused("bad-volume", f"volume {path} must be a regular file of the node's")
            if grant:
                posixacl.set_user(fd, uid, perms)
            else:
                posixacl.remove_user(fd, uid)
        finally:
            os.close(fd)


# -- launch and stop -----------------------------------------------------------------------------


def ch_launch(call: Call, req: ChLaunch) -> dict[str, Any]:
    op = "ch.launch"
    name = _name(op, req.name)
    checked = _read_record(call, op, name)
    rec = checked.record
    if not valid_vmm_uid(rec.uid):  # parse_record checks it; kept next to its use
        raise Refused("bad-record", f"{op}: uid outside bcd's VMM range")
    if _with_roots(call, req.intent):
        _signed_record(call, op, name, req.intent, rec)
    unit = unit_name(name)
    running = _running_units(call)
    if unit in running:
        raise Refused("running", f"{op}: {unit} is already running")
    _uid_not_in_use(op, unit, rec.uid, running)
    _holds_only_its_groups(call, op, rec)
    binary = root_binary(call)
    # systemd binds root's hard links of the inodes checked, never the node's paths (round 11)
    sources = _link_sources(call, op, name, checked)
    try:
        launch = CHLaunch(
            instance_id=name,
            uid=rec.uid,
            data_dir=call.ctx.config.data_dir,
            binary=binary,
            vcpus=rec.vcpus,
            memory_bytes=rec.memory_bytes,
            base_image=checked.base_image,
            volumes_rw=checked.volumes_rw,
            volumes_ro=checked.volumes_ro,
            vfio=bool(rec.gpus),
            hugepages=rec.hugepages,
            restored_memory=rec.restored,
            under_helper=True,
            cpus=rec.cpus,
            mems=rec.mems,
            bind_sources=tuple(sources.items()),
        )
        _ensure_account(call, op, rec.uid)
        try:
            _acl_instance(call, checked, rec.uid, grant=True, volumes=sources)
        except OSError as exc:
            raise Failed("acl", f"{op}: granting the VMM user's ACL entries: {exc.strerror}") from None
        result = call.system.run(run_argv(launch), timeout=120)
        if not result.ok:
            # No VMM runs: the VMM user's entries go again, so a failed launch leaves nothing granted.
            with contextlib.suppress(Refused, OSError):
                _acl_instance(call, checked, rec.uid, grant=False, volumes=sources)
            raise Failed("systemd-run", f"{op}: systemd-run {unit}: {_err(result)}")
    except BaseException:
        with contextlib.suppress(Refused, OSError):
            chbinds.remove(call, name)
        raise
    return {"name": name, "unit": unit, "uid": rec.uid, "binary": binary}


def _link_sources(call: Call, op: str, name: str, checked: Checked) -> dict[str, str]:
    """The base image and each volume linked from the inode root opened and checked (a regular file
    the node owns) into root's directory for the instance (bcd_helper.chbinds); the base image's
    header checked again on that link, the inode the unit binds. {the node's path: the link}."""
    node_uid = call.ctx.config.node_uid

    def owned(reason: str, what: str) -> Any:
        def check(st: os.stat_result) -> None:
            if st.st_uid != node_uid:
                raise Refused(reason, f"{op}: {what} must be a regular file the node owns")

        return check

    sources: list[chbinds.Source] = []
    base = checked.base_image
    if base is not None:
        check = owned("bad-image", f"base image {base}")
        sources.append(chbinds.Source(base, chbinds.IMAGE, "bad-image", check))
    seen = {base}
    for path in (*checked.volumes_rw, *checked.volumes_ro):
        if path not in seen:
            seen.add(path)
            link = chbinds.VOLUME_PREFIX + path.rsplit("/", 1)[1]
            sources.append(chbinds.Source(path, link, "bad-volume", owned("bad-volume", f"volume {path}")))
    made = chbinds.link(call, op, name, sources)
    if base is not None and checked.record.image_format == "qcow2":
        try:
            check_image(str(call.system.host_path(made[base])), MAX_VIRTUAL_SIZE)
        except ImageRefused as exc:
            with contextlib.suppress(Refused, OSError):
                chbinds.remove(call, name)
            raise Refused(f"image-{exc.reason}", f"{op}: {exc.message}") from None
    return made


def ch_stop(call: Call, req: ChName) -> dict[str, Any]:
    op = "ch.stop"
    name = _name(op, req.name)
    unit = unit_name(name)
    show = call.system.run(["systemctl", "show", "-p", "User", "--value", unit], timeout=30)
    user = show.stdout.decode(errors="replace").strip() if show.ok else ""
    result = call.system.run(["systemctl", "stop", unit], timeout=120)
    if not result.ok and "not loaded" not in _err(result):
        raise Failed("systemctl", f"{op}: systemctl stop {unit}: {_err(result)}")
    state = call.system.run(["systemctl", "show", "-p", "ActiveState", "--value", unit], timeout=30)
    active = state.stdout.decode(errors="replace").strip() if state.ok else "unknown"
    uid = int(user) if user.isdigit() and valid_vmm_uid(int(user)) else None
    if uid is None:  # a unit that ran no VMM user of bcd's (or is gone): the record names the uid
        try:
            uid = _read_record(call, op, name).record.uid
        except Refused:
            uid = None
    groups: list[str] = []
    if uid is not None and active in ("inactive", "failed"):
        # The uid may be the record's (the node's word): a uid a running unit has keeps its groups.
        if uid not in _running_uids(call):
            groups = give_back_owned(call, op, uid)
        # a directory already removed has no entries left to remove
        with contextlib.suppress(Refused, OSError):
            _acl_instance(call, _read_record(call, op, name), uid, grant=False)
        # the inodes the unit had bound (root's links), whatever the record names now; then the links
        with contextlib.suppress(Refused, OSError):
            linked = chbinds.links(call, name)
            vols = [(p, 0) for p in linked if p.rsplit("/", 1)[1].startswith(chbinds.VOLUME_PREFIX)]
            _acl_volumes(call, vols, uid, grant=False)
    if active in ("inactive", "failed"):
        # the unit's links go with it, whether or not a uid or record is left (a later stop retries)
        with contextlib.suppress(Refused, OSError):
            chbinds.remove(call, name)
    return {"name": name, "unit": unit, "state": active, "groups": groups}


# -- VFIO ------------------------------------------------------------------------------------------
# Root reads the PCI topology from sysfs and who holds a group from /dev/vfio itself (DLV-CHH-15);
# sysfs is written with `tee` (argv, no shell), one value per write, as the kernel wants it.

PCI = "/sys/bus/pci/devices"
GROUPS = "/sys/kernel/iommu_groups"
VFIO_DRIVER = "vfio-pci"
BRIDGE_CLASS = "0x0604"


def _sysfs_read(call: Call, path: str) -> str:
    return (call.system.read_text(path) or "").strip()


def _driver(call: Call, addr: str) -> str:
    try:
        return os.path.basename(os.readlink(call.system.host_path(f"{PCI}/{addr}/driver")))
    except OSError:
        return ""


def _group_of(call: Call, op: str, addr: str) -> str:
    try:
        group = os.path.basename(os.readlink(call.system.host_path(f"{PCI}/{addr}/iommu_group")))
    except OSError:
        raise Failed("no-iommu", f"{op}: {addr} has no IOMMU group (is the IOMMU on?)") from None
    if not group.isdigit():
        raise Failed("no-iommu", f"{op}: {addr}: unreadable IOMMU group {group[:20]!r}")
    return group


def _sysfs_write(call: Call, op: str, path: str, value: str) -> None:
    result = call.system.run(["tee", str(call.system.host_path(path))], input=value.encode(), timeout=60)
    if not result.ok:
        raise Failed("sysfs", f"{op}: writing {value!r} to {path}: {_err(result)}")


def _vfio_owner(call: Call, group: str) -> int | None:
    try:
        return os.stat(call.system.host_path(f"/dev/vfio/{group}")).st_uid
    except OSError:
        return None


def _groups_for(call: Call, op: str, gpus: tuple[str, ...], taking: bool = False) -> dict[str, list[str]]:
    """Each GPU's IOMMU group and its devices; refused when a device is neither one of this host's GPUs,
    a function of one, nor a PCI bridge (DLV-CHH-11). `taking` (ch.vfio): a GPU of this host in a group
    must be one of `gpus`, since the whole group goes to the VMM."""
    from bcd_helper.ops.libvirt import host_gpus

    ours = host_gpus(call)
    slots = {g.rsplit(".", 1)[0] for g in ours}
    out: dict[str, list[str]] = {}
    for gpu in gpus:
        if gpu not in ours:
            raise Refused("not-this-hosts-gpu", f"{op}: {gpu} is not a GPU of this host")
        group = _group_of(call, op, gpu)
        devices = sorted(call.system.listdir(f"{GROUPS}/{group}/devices"))
        for dev in devices:
            bridge = _sysfs_read(call, f"{PCI}/{dev}/class").startswith(BRIDGE_CLASS)
            if dev not in ours and dev.rsplit(".", 1)[0] not in slots and not bridge:
                raise Refused(
                    "foreign-device",
                    f"{op}: IOMMU group {group} of {gpu} holds {dev}, which is not a GPU of this host, "
                    "a function of one or a PCI bridge",
                )
            if taking and dev in ours and dev not in gpus:
                raise Refused(
                    "gpu-not-in-record",
                    f"{op}: IOMMU group {group} of {gpu} holds the GPU {dev}, which vm.json does not name: "
                    "the whole group goes to the VMM",
                )
        out[group] = devices
    return out


def _busy_gpus(call: Call, op: str, gpus: tuple[str, ...]) -> None:
    """DLV-CHH-09: only GPUs root does not see holding work (a live hold, compute processes)."""
    from bcd_helper.busy import BusyUnknown, busy_gpus

    result = call.system.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id,uuid", "--format=csv,noheader"], timeout=60
    )
    by_addr: dict[str, str] = {}
    if result.ok:
        for line in result.stdout.decode(errors="replace").splitlines():
            bus, _, uuid = (f.strip() for f in line.partition(","))
            domain, _, rest = bus.partition(":")
            by_addr[f"{domain[-4:]}:{rest}".lower()] = uuid
    try:
        busy = busy_gpus(call.system)
    except BusyUnknown as exc:
        raise Failed("gpu-busy-unknown", f"{op}: {exc}") from None
    for gpu in gpus:
        why = busy.reason(by_addr.get(gpu, "?"))
        if why is not None:
            raise Refused("gpu-busy", f"{op}: {gpu}: {why}")


def _unit_users(units: dict[str, int]) -> set[int]:
    """The users running bcd-ch-* units run as. Never root (0), as an unreadable User= (-1) is none: a
    VMM never runs as root, and a /dev/vfio group root owns was given back, held by no VMM's user
    (DLV-CHH-15), whatever a unit running as root (never ch.launch's) may be."""
    return {uid for uid in units.values() if uid > 0}


def _running_uids(call: Call) -> set[int]:
    return _unit_users(_running_units(call))


def _signed_gpus(call: Call, op: str, name: str, intent: SignedIntent | None, rec: CHRecord) -> None:
    """With roots: the record's GPUs must be exactly the signed spec's instance's, by UUID (root's
    nvidia-smi), before any driver or group is touched."""

    def check(inst: Any) -> None:
        from bcd_helper.ops.libvirt import gpu_uuids_at

        if len(rec.gpus) != len(inst.gpu_uuids) or gpu_uuids_at(call, rec.gpus) != sorted(inst.gpu_uuids):
            raise Refused(
                "spec-mismatch",
                f"{op}: {name}: vm.json's GPUs differ from the signed spec's: only the GPUs the spec's "
                "instance holds go to its VMM",
            )

    _signed_nics(call, op, name, intent, None, check, starts=True)


def ch_vfio(call: Call, req: ChLaunch) -> dict[str, Any]:
    """Bind the record's GPUs' IOMMU groups to vfio-pci and give /dev/vfio/<group> to the VMM's user.
    With roots, the record's GPUs must be the signed spec's instance's (as for ch.launch)."""
    op = "ch.vfio"
    name = _name(op, req.name)
    rec = _read_record(call, op, name).record
    if _with_roots(call, req.intent):
        _signed_gpus(call, op, name, req.intent, rec)
    if not rec.gpus:
        return {"name": name, "groups": []}
    _not_foreign(call, op, rec.uid)  # the groups go to that uid: a VMM's, never someone else's
    _busy_gpus(call, op, rec.gpus)
    groups = _groups_for(call, op, rec.gpus, taking=True)
    units = _running_units(call)
    # the groups go to that uid: never while another instance's VMM runs as it
    _uid_not_in_use(op, unit_name(name), rec.uid, units)
    running = _unit_users(units)
    for group in groups:
        owner = _vfio_owner(call, group)
        if owner is not None and owner != rec.uid and owner in running:
            raise Refused(
                "group-in-use", f"{op}: /dev/vfio/{group} is held by a running VMM's user ({owner})"
            )
    for group, devices in groups.items():
        for dev in devices:
            if _sysfs_read(call, f"{PCI}/{dev}/class").startswith(BRIDGE_CLASS):
                continue  # bridges stay on pcieport (DLV-CH-19)
            if _driver(call, dev) == VFIO_DRIVER:
                continue
            _sysfs_write(call, op, f"{PCI}/{dev}/driver_override", VFIO_DRIVER)
            if _driver(call, dev):
                _sysfs_write(call, op, f"{PCI}/{dev}/driver/unbind", dev)
            _sysfs_write(call, op, "/sys/bus/pci/drivers_probe", dev)
            if _driver(call, dev) != VFIO_DRIVER:
                _unbind_failed(call, op, dev)
                raise Failed("vfio", f"{op}: {dev} did not move to vfio-pci (is the vfio-pci module loaded?)")
        _own_vfio_node(call, op, group, rec.uid)
    return {"name": name, "groups": sorted(groups)}


def _own_vfio_node(call: Call, op: str, group: str, uid: int, *, missing_ok: bool = False) -> None:
    """/dev/vfio/<group> made uid's, 0600, on the node itself: opened O_PATH|O_NOFOLLOW (no open of the
    group, which would claim it) and changed through /proc/self/fd, so a symlink there is refused by
    name rather than followed, or failing as Linux's lchmod does (NotImplementedError: `internal`)."""
    node = call.system.host_path(f"/dev/vfio/{group}")
    try:
        fd = os.open(node, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_ok:
            return
        raise Failed("vfio", f"{op}: /dev/vfio/{group}: No such file or directory") from None
    except OSError as exc:
        raise Failed("vfio", f"{op}: /dev/vfio/{group}: {exc.strerror}") from None
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise Failed("vfio", f"{op}: /dev/vfio/{group} is a symlink, not the group's device node")
        os.chown(f"/proc/self/fd/{fd}", uid, uid)
        os.chmod(f"/proc/self/fd/{fd}", 0o600)
    except OSError as exc:
        raise Failed("vfio", f"{op}: /dev/vfio/{group}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _unbind_failed(call: Call, op: str, dev: str) -> None:
    """A device that did not reach vfio-pci goes back to its host driver: the override cleared and the
    device probed again (best effort: the failure is what the answer reports)."""
    with contextlib.suppress(Failed):
        _sysfs_write(call, op, f"{PCI}/{dev}/driver_override", "\n")
        _sysfs_write(call, op, "/sys/bus/pci/drivers_probe", dev)


def _give_back(call: Call, op: str, group: str, devices: list[str]) -> None:
    _own_vfio_node(call, op, group, 0, missing_ok=True)
    for dev in devices:
        if _driver(call, dev) != VFIO_DRIVER:
            continue
        _sysfs_write(call, op, f"{PCI}/{dev}/driver/unbind", dev)
        _sysfs_write(call, op, f"{PCI}/{dev}/driver_override", "\n")
        _sysfs_write(call, op, "/sys/bus/pci/drivers_probe", dev)


def ch_unvfio(call: Call, req: ChName) -> dict[str, Any]:
    """Give the record's GPUs' groups back to root and their host drivers; never a group a running
    VMM unit's user holds (DLV-CHH-13)."""
    op = "ch.unvfio"
    name = _name(op, req.name)
    rec = _read_record(call, op, name).record
    groups = _groups_for(call, op, rec.gpus) if rec.gpus else {}
    running = _running_uids(call)
    for group in groups:
        owner = _vfio_owner(call, group)
        if owner is not None and owner in running:
            raise Refused(
                "group-in-use", f"{op}: /dev/vfio/{group} is held by a running VMM's user ({owner})"
            )
    for group, devices in groups.items():
        _give_back(call, op, group, devices)
    return {"name": name, "groups": sorted(groups)}


def give_back_owned(call: Call, op: str, uid: int) -> list[str]:
    """After a unit stopped: exactly the /dev/vfio groups its user owns go back to root (DLV-CHH-14)."""
    out = []
    for group in call.system.listdir("/dev/vfio"):
        if group.isdigit() and _vfio_owner(call, group) == uid:
            _own_vfio_node(call, op, group, 0)
            out.append(group)
    return sorted(out)
