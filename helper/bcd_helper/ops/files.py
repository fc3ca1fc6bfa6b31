"""file.write and file.remove: files root writes for the node, by kind. The helper builds the path.

The node names a kind and an id; the path comes from FILE_KINDS below, never from the node, and the
content is checked against the kind's rule before anything is written. Writes and removals go through
the root-only rule (HST-ROOT-08) and are atomic and durable.

- cdi: /etc/cdi/bcd-<id>.json 0644, id an allocation id; one bcd hold (kind bcd.dev/gpu) for
  exactly that allocation (bcd_shared.cdi.parse_hold_spec, CDI's naming rules), strict JSON (no
  duplicate key, NaN or deep nesting), its env setting no key twice and BCD_ALLOCATION_ID only to
  <id>, no env on a device (one without other edits: exactly its BCD_DEVICE_ marker), and every
  other container edit (hooks, mounts, device nodes, ...) one that root's own vendor spec
  /etc/cdi/nvidia.json carries: the container runtime applies a hold as root, so a hook there would
  be root's code execution;
- allocation-env: /run/bcd/allocations/<id>.env 0644; KEY=VALUE lines, the first
  BCD_ALLOCATION_ID=<id>, no key twice;
- k8s-token: /var/lib/bcd-hostconfig/k8s/bootstrap-token 0600, id ""; one kubeadm bootstrap token.

Limits (issue 9 item 8): per kind, at most MAX_FILES files and MAX_TOTAL bytes in the kind's directory
(counting the new content in place of the file it replaces): cdi 1024 files, 32 MiB; allocation-env 1024
files, 8 MiB, each env file at most 64 KiB (`too-many-files`, `too-large`).

Signed devices section (issue 9 item 8): where command-signing roots exist (bcd_helper.intent), a write or
removal of kind cdi or allocation-env carries `intent`, the signed spec the node keeps (as for host.unit),
re-validated the same way (chain, node, generation never older). Its devices section (a full spec decides
it; a patch must set it) must list the allocation for a write (`not-in-spec`); a cdi hold's devices must
each be one of that allocation's atoms (`bcd.dev/device-id`), each device's container edits must be the
vendor's edits for that atom's own GPU (named in root's /etc/cdi/nvidia.json by the GPU's UUID or its index
as root's nvidia-smi reads it; a MIG atom also by its own MIG device's `<index>:<n>` or MIG UUID, which
root maps from the atom's GPU and compute instance ids with `nvidia-smi -L` and `-q -x`: never another
MIG device's, on this GPU or another), and the spec-level edits only the vendor's common ones
(`atoms-outside`). Their env is the assignment's (round 5, `env-outside`): the keys bcd sets carry the
values root derives (BCD_ALLOCATION_ID, BCD_CGROUP_PARENT `bcd-alloc-<id>.slice`, the signed
BCD_RESERVATION_ID, CUDA_MPS_PIPE_DIRECTORY `/run/nvidia-mps`, NVIDIA_VISIBLE_DEVICES naming only the
allocation's GPUs, or the MIG UUIDs root's nvidia-smi gives its MIG atoms), an env file's other lines are
the assignment's signed `env` lines and a hold's the common env of root's vendor spec: no `LD_PRELOAD=`
for a workload manager, no `NVIDIA_VISIBLE_DEVICES=all` for NVIDIA's runtime hook. A removal is refused
while the spec still lists the allocation (`hold-in-spec`): a node cannot pull a live hold's file and
then reset its GPU. Excepted: a CDI hold none of whose atoms the spec still gives the allocation (a moved
allocation's old hold), and an env file with no CDI hold file beside it that names none of the atoms
the spec gives the allocation (a moved allocation's old env file; docs/helper.md "Env files of a listed
allocation": until 2026-12-02 any env file without its hold could go). Since round 6 (docs/helper.md):
a MIG atom takes only its own MIG device's edits and UUID, never its parent GPU's; a hold carries each
atom of its allocation once (`atoms-missing`) and none another allocation's hold file or env file names
(`atoms-held`; since round 7 an env file too, whose NVIDIA_VISIBLE_DEVICES the legacy
hook reads); its annotations are the assignment's (`annotations-outside`); a sliced hold's files
are written only once its slice is started (`slice-missing`) and, since round 6b, enforcing the signed limits
(`slice-limits`); a Kubernetes hold's CDI spec is bare, no vendor edits and no NVIDIA_VISIBLE_DEVICES
(round 6b). Without roots nothing is bound (HST-SIGN-33). Every hold's JSON is value-counted before it is
decoded (MAX_HOLD_VALUES).

There are no sshd kinds: the node never sends sshd text. Root renders the access section's files itself
from the signed spec (access.apply, bcd_helper.ops.access; issue 9 item 1).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from typing import Any

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, read_root_only, remove_root_only, write_root_only
from bcd_shared.system import System

from bcd_helper.audit import canonical
from bcd_helper.ops.base import Call, Refused, no_roots_possible, refused_path
from bcd_helper.protocol import MAX_VALUES, strict_loads

MAX_CONTENT = 1024 * 1024
# A hold's JSON values, counted on its bytes before decoding (round 6: the frame's own count sees the
# content as one string, and 1 MiB of `{},` decodes to ~55 MiB). NVIDIA's whole spec for a DGX A100 with
# MIG has ~16,000; a hold carries part of it.
MAX_HOLD_VALUES = 4 * MAX_VALUES
ALLOCATION_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,80}$")
_EMPTY_RE = re.compile(r"^$")
_TOKEN_RE = re.compile(r"^[a-z0-9]{6}\.[a-z0-9]{16}\n?$")


@frozen
class SignedSpec:
    """The signed DesiredState body the node keeps, as for host.unit (base64)."""

    body: str
    signature: str
    chain: tuple[str, ...] = ()
    trust_bundle: str | None = None


@frozen
class FileWrite:
    kind: str
    id: str
    content: str
    encoding: str = "utf-8"
    intent: SignedSpec | None = None


@frozen
class FileRemove:
    kind: str
    id: str
    intent: SignedSpec | None = None


@frozen
class KindLimit:
    """How many files of a kind, and how many bytes in all, root keeps in its directory."""

    directory: str
    pattern: re.Pattern[str]
    max_files: int
    max_total: int
    max_file: int


LIMITS: dict[str, KindLimit] = {
    "cdi": KindLimit(
        "/etc/cdi", re.compile(r"^bcd-[A-Za-z0-9_]{1,80}\.json$"), 1024, 32 * 1024 * 1024, 1024 * 1024
    ),
    "allocation-env": KindLimit(
        "/run/bcd/allocations", re.compile(r"^[A-Za-z0-9_]{1,80}\.env$"), 1024, 8 * 1024 * 1024, 64 * 1024
    ),
}
BOUND_KINDS = frozenset({"cdi", "allocation-env"})


# Besides C0 controls and DEL: C1 controls (NEL among them) and the Unicode line and paragraph
# separators, which str.splitlines() takes as line ends while the files' readers do not.
_LINE_BREAKERS = frozenset(chr(c) for c in range(0x80, 0xA0)) | {"\u2028", "\u2029"}


def _no_controls(text: str, where: str) -> None:
    if any((ord(c) < 0x20 and c != "\n") or ord(c) == 0x7F or c in _LINE_BREAKERS for c in text):
        raise Refused("bad-content", f"{where}: carries a control character")


def _unique_keys(lines: Any, where: str) -> None:
    seen: set[str] = set()
    for line in lines:
        key = str(line).partition("=")[0]
        if key in seen:
            raise Refused("bad-content", f"{where}: {key[:100]!r} is set twice")
        seen.add(key)


def _check_cdi(ident: str, data: bytes) -> Any:
    """The hold's checks; returns the strictly decoded document (the later checks read it, not the bytes
    again)."""
    from bcd_shared import cdi  # on the first hold, not at the helper's start
    from bcd_shared.strictjson import value_bound

    if value_bound(data) > MAX_HOLD_VALUES:
        raise Refused(
            "bad-content", f"cdi: more than {MAX_HOLD_VALUES} JSON values (arrays, objects, members)"
        )
    try:
        doc = strict_loads(data)
    except ValueError as exc:
        raise Refused("bad-content", f"cdi: not strict JSON: {exc}") from None
    try:
        hold = cdi.parse_hold_doc(doc, ident)
    except cdi.CdiError as exc:
        raise Refused("bad-content", f"cdi: {exc}") from None
    _unique_keys(hold.env, "cdi: containerEdits.env")
    own = f"BCD_ALLOCATION_ID={ident}"
    if any(e.startswith("BCD_ALLOCATION_ID=") and e != own for e in hold.env):
        raise Refused("bad-content", f"cdi: containerEdits.env: BCD_ALLOCATION_ID must be {ident}")
    for i, dev in enumerate(doc["devices"]):
        env = (dev.get("containerEdits") or {}).get("env")
        if not env:
            continue
        # A device without other edits carries exactly its own marker (cdi.device_marker_env), no more.
        edits = dev.get("containerEdits") or {}
        if set(edits) == {"env"} and env == [cdi.device_marker_env(hold.device_ids[i])]:
            continue
        raise Refused(
            "bad-content",
            f"cdi: devices[{i}].containerEdits.env: a hold's devices carry no env "
            "(only a device without other edits, its own BCD_DEVICE_ marker)",
        )
    return doc


def _vendor_edits(call: Call) -> frozenset[tuple[str, bytes]]:
    """Every container edit root's vendor spec carries, as (field, canonical JSON of one item): its common
    edits and every device's, env aside. Empty without a vendor spec."""
    from bcd_shared import cdi

    try:
        data = read_root_only(call.ctx.root, cdi.VENDOR_SPEC_PATH, 16 * MAX_CONTENT)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    if data is None:
        return frozenset()
    try:
        vendor = cdi.parse_vendor_spec(data)
    except cdi.CdiError as exc:
        raise Refused("bad-content", f"cdi: root's {cdi.VENDOR_SPEC_PATH}: {exc}") from None
    out: set[tuple[str, bytes]] = set()
    for edits in (vendor.common_edits, *vendor.devices.values()):
        for key, value in edits.items():
            if key != "env":
                out.update((key, canonical(v)) for v in (value if isinstance(value, list) else [value]))
    return frozenset(out)


def _check_cdi_edits(call: Call, _ident: str, doc: Any) -> None:
    """A hold carries only container edits root's vendor spec carries (env aside). `doc`: the hold as
    _check_cdi decoded it."""
    from bcd_shared import cdi

    allowed: frozenset[tuple[str, bytes]] | None = None
    places = [("containerEdits", doc.get("containerEdits") or {})]
    places += [
        (f"devices[{i}].containerEdits", d.get("containerEdits") or {}) for i, d in enumerate(doc["devices"])
    ]
    for where, edits in places:
        for key, value in edits.items():
            if key == "env":
                continue
            if allowed is None:
                allowed = _vendor_edits(call)
            for item in value if isinstance(value, list) else [value]:
                if (key, canonical(item)) not in allowed:
                    raise Refused(
                        "bad-content",
                        f"cdi: {where}.{key}: {canonical(item)[:200].decode()} is not in root's vendor spec "
                        f"{cdi.VENDOR_SPEC_PATH}: a hold carries only the vendor's edits",
                    )


def _check_env(ident: str, data: bytes) -> None:
    from bcd_shared import cdi

    _text(data, "allocation-env")
    try:
        lines = cdi.parse_env_file(data, ident)
    except cdi.CdiError as exc:
        raise Refused("bad-content", f"allocation-env: {exc}") from None
    _unique_keys(lines, "allocation-env")


def _text(data: bytes, kind: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("bad-content", f"{kind}: not UTF-8") from None
    _no_controls(text, kind)
    if text and not text.endswith("\n"):
        raise Refused("bad-content", f"{kind}: must end with a newline")
    return text


def _check_token(_ident: str, data: bytes) -> None:
    if not _TOKEN_RE.fullmatch(data.decode("utf-8", errors="replace")):
        raise Refused("bad-content", "k8s-token: not a kubeadm bootstrap token ([a-z0-9]{6}.[a-z0-9]{16})")


@frozen
class FileKind:
    path: Callable[[str], str]
    id_rule: re.Pattern[str]
    id_text: str
    mode: int
    check: Callable[[str, bytes], Any]  # returns what it decoded (cdi: the hold), for host_check
    encoding: str = "utf-8"
    host_check: Callable[[Call, str, Any], None] | None = None  # checks that read root's own files


# kind -> how the helper builds the path and checks the content. One literal table.
FILE_KINDS: dict[str, FileKind] = {
    "cdi": FileKind(
        lambda i: f"/etc/cdi/bcd-{i}.json",
        ALLOCATION_ID_RE,
        "an allocation id ([A-Za-z0-9_]{1,80})",
        0o644,
        _check_cdi,
        host_check=_check_cdi_edits,
    ),
    "allocation-env": FileKind(
        lambda i: f"/run/bcd/allocations/{i}.env",
        ALLOCATION_ID_RE,
        "an allocation id ([A-Za-z0-9_]{1,80})",
        0o644,
        _check_env,
    ),
    "k8s-token": FileKind(
        lambda _i: "/var/lib/bcd-hostconfig/k8s/bootstrap-token", _EMPTY_RE, "empty", 0o600, _check_token
    ),
}


def _kind(kind: str, ident: str) -> tuple[FileKind, str]:
    spec = FILE_KINDS.get(kind)
    if spec is None:
        raise Refused(
            "bad-kind", f"file kind {kind!r} is not one the helper writes ({', '.join(FILE_KINDS)})"
        )
    if not spec.id_rule.fullmatch(ident):
        raise Refused("bad-id", f"{kind}: id {ident!r} must be {spec.id_text}")
    return spec, spec.path(ident)


def _content(spec: FileKind, req: FileWrite) -> bytes:
    if req.encoding != spec.encoding:
        raise Refused("bad-content", f"{req.kind}: content must be sent as {spec.encoding}")
    if len(req.content) > 2 * MAX_CONTENT:
        raise Refused("too-large", f"{req.kind}: content larger than {MAX_CONTENT} bytes")
    if spec.encoding == "base64":
        try:
            data = base64.b64decode(req.content, validate=True)
        except binascii.Error:
            raise Refused("bad-content", f"{req.kind}: content is not base64") from None
    else:
        try:
            data = req.content.encode("utf-8")
        except UnicodeEncodeError:
            raise Refused("bad-content", f"{req.kind}: content is not UTF-8") from None
    if len(data) > MAX_CONTENT:
        raise Refused("too-large", f"{req.kind}: content larger than {MAX_CONTENT} bytes")
    return data


def _limits(kind: str, path: str, size: int) -> Callable[[int], None] | None:
    """The kind's limits: a file too large is refused here; the count and total are checked by the
    returned function, given the fd of the kind's directory that the write has verified (one walk)."""
    import os

    limit = LIMITS.get(kind)
    if limit is None:
        return None
    if size > limit.max_file:
        raise Refused("too-large", f"{kind}: content larger than {limit.max_file} bytes")
    directory, own = path.rsplit("/", 1)
    if directory != limit.directory:  # the write's directory is the one counted
        raise AssertionError(f"{kind}: {path} is not in {limit.directory}")

    def check(dfd: int) -> None:
        count, total = 1, size
        for name in os.listdir(dfd):
            if name == own or not limit.pattern.fullmatch(name):
                continue
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            count += 1
            total += st.st_size
        if count > limit.max_files:
            raise Refused(
                "too-many-files", f"{kind}: root keeps at most {limit.max_files} files in {limit.directory}"
            )
        if total > limit.max_total:
            raise Refused(
                "too-many-files",
                f"{kind}: root keeps at most {limit.max_total} bytes in all in {limit.directory}",
            )

    return check


def _signed_assignment(
    call: Call, op: str, kind: str, ident: str, intent: SignedSpec | None
) -> tuple[Any, Any]:
    """With roots: (the spec's assignment for `ident` or None, the next intent state); (None, None) and
    nothing checked without roots."""
    if no_roots_possible(call.ctx, intent):
        return None, None
    checked = call.ctx.intent_verifier().check_spec(f"{op} {kind}", intent)
    if not checked.roots:
        return None, None
    decoded = checked.decoded
    assert decoded is not None  # verified against the roots
    if decoded.full is not None:
        section = decoded.full.devices
    elif decoded.patch is not None and decoded.patch.devices is not None:
        section = decoded.patch.devices
    else:
        raise Refused(
            "bad-intent",
            f"{op} {kind}: the signed spec (generation {decoded.generation}) sets no devices section",
        )
    assignments = [
        a for a in (section.assignments if section is not None else []) if a.allocation_id == ident
    ]
    return (assignments[0] if assignments else None), (checked.next_state, decoded.generation)


def _vendor_devices(call: Call) -> Any:
    from bcd_shared import cdi

    try:
        data = read_root_only(call.ctx.root, cdi.VENDOR_SPEC_PATH, 16 * MAX_CONTENT)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    if data is None:
        return None
    try:
        return cdi.parse_vendor_spec(data)
    except cdi.CdiError as exc:
        raise Refused("bad-content", f"cdi: root's {cdi.VENDOR_SPEC_PATH}: {exc}") from None


def _gpu_indexes(call: Call) -> dict[str, str]:
    """GPU UUID -> index, as root's nvidia-smi lists them (empty without nvidia-smi)."""
    result = call.system.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], timeout=60)
    out: dict[str, str] = {}
    if result.ok:
        for line in result.stdout.decode(errors="replace").splitlines():
            index, _, uuid = (p.strip() for p in line.partition(","))
            if index.isdigit() and uuid:
                out[uuid] = index
    return out


@frozen
class MigName:
    uuid: str | None  # MIG-…, None when -L gave none
    names: frozenset[str]  # the vendor CDI spec's names for it: `<gpu index>:<n>` and the UUID


def _mig_names(call: Call) -> dict[str, MigName]:
    return mig_names(call.system)


def mig_uuid_atoms(system: System) -> Callable[[], dict[str, str]]:
    """MIG UUID -> its atom by root's nvidia-smi (`mig_names`), asked on the first call only: an env file
    naming no MIG UUID runs no nvidia-smi."""
    memo: list[dict[str, str]] = []

    def get() -> dict[str, str]:
        if not memo:
            memo.append({m.uuid: atom for atom, m in mig_names(system).items() if m.uuid})
        return memo[0]

    return get


def mig_names(system: System) -> dict[str, MigName]:
    """MIG atom (`<gpu uuid>/gi<G>/ci<C>`) -> its MIG device as root's nvidia-smi lists it (`-L` and
    `-q -x`, joined as the node's inventory joins them). Empty when either does not answer or parse: no
    MIG atom then carries MIG edits or UUIDs (fail closed)."""
    from bcd_shared import nvsmi

    listing = system.run(["nvidia-smi", "-L"], timeout=60)
    qx_run = system.run(["nvidia-smi", "-q", "-x"], timeout=60) if listing.ok else None
    if qx_run is None or not qx_run.ok:
        return {}
    try:
        listed = nvsmi.parse_list(listing.stdout.decode(errors="replace"))
        qx = {g.uuid: g for g in nvsmi.parse_qx(qx_run.stdout).gpus}
    except nvsmi.NvsmiParseError:
        return {}
    out: dict[str, MigName] = {}
    for gpu in listed:
        for mig in nvsmi.join_migs(gpu, qx.get(gpu.uuid)):
            names = {f"{gpu.index}:{mig.index}"} | ({mig.uuid} if mig.uuid else set())
            atom = f"{gpu.uuid}/gi{mig.gpu_instance}/ci{mig.compute_instance}"
            out[atom] = MigName(mig.uuid, frozenset(names))
    return out


def _edit_items(edits: Any) -> set[tuple[str, bytes]]:
    out: set[tuple[str, bytes]] = set()
    for key, value in (edits or {}).items():
        if key != "env":
            out.update((key, canonical(v)) for v in (value if isinstance(value, list) else [value]))
    return out


def _check_atoms(call: Call, ident: str, doc: Any, assignment: Any) -> None:
    """A signed hold carries only its allocation's atoms, each with its own GPU's vendor edits. `doc`: the
    hold as _check_cdi decoded it."""
    atoms = {a.id for a in assignment.devices}
    kube = _kubernetes(assignment)
    vendor = None
    indexes: dict[str, str] | None = None
    migs: dict[str, MigName] | None = None
    for i, dev in enumerate(doc["devices"]):
        atom = dev["annotations"]["bcd.dev/device-id"]  # parse_hold_spec checked it is there
        if atom not in atoms:
            raise Refused(
                "atoms-outside",
                f"cdi: devices[{i}]: {atom!r} is not an atom of allocation {ident} in the signed spec",
            )
        edits = _edit_items(dev.get("containerEdits"))
        if not edits:
            continue
        if kube:
            raise Refused("atoms-outside", f"cdi: devices[{i}].containerEdits: {KUBE_BARE}")
        if vendor is None:
            vendor = _vendor_devices(call)
            indexes = _gpu_indexes(call)
        assert indexes is not None
        gpu = atom.split("/")[0]
        names: set[str] = set()
        if "/gi" in atom:
            # Its own MIG device only, never its parent GPU's whole-device entry (the GPU's other MIG
            # devices are other tenants'; the planner's vendor_names names the MIG device alone: round 6).
            migs = _mig_names(call) if migs is None else migs
            mig = migs.get(atom)
            names |= mig.names if mig is not None else set()
        else:
            names.add(gpu)
            index = indexes.get(gpu)
            if index is not None:
                names.add(index)
        allowed: set[tuple[str, bytes]] = set()
        for name, vedits in vendor.devices.items() if vendor is not None else []:
            if name in names or set(vendor.devices) == {"all"}:
                allowed |= _edit_items(vedits)
        outside = edits - allowed
        if outside:
            key, item = sorted(outside)[0]
            raise Refused(
                "atoms-outside",
                f"cdi: devices[{i}].containerEdits.{key}: {item[:200].decode()} is not the vendor's edit for "
                + (
                    f"{atom}: a MIG hold device carries only its own MIG device's edits (not its GPU's)"
                    if "/gi" in atom
                    else f"{gpu}: a hold device carries only its own GPU's edits"
                ),
            )
    held = [dev["annotations"]["bcd.dev/device-id"] for dev in doc["devices"]]
    missing = sorted(atoms - set(held))
    if missing or len(set(held)) != len(held):
        # Root's busy check (gpu.reset) reads the hold files: a hold leaving out an atom the spec gives
        # the allocation would make that GPU look free (round 6). The planner writes each atom once.
        raise Refused(
            "atoms-missing",
            f"cdi: devices: a signed hold carries each atom of allocation {ident} exactly once"
            + (f"; {', '.join(missing)[:400]} missing" if missing else "; one is listed twice"),
        )
    common = _edit_items(doc.get("containerEdits"))
    if common and kube:
        raise Refused("atoms-outside", f"cdi: containerEdits: {KUBE_BARE}")
    if common:
        vendor = vendor if vendor is not None else _vendor_devices(call)
        outside = common - (_edit_items(vendor.common_edits) if vendor is not None else set())
        if outside:
            key, item = sorted(outside)[0]
            raise Refused(
                "atoms-outside",
                f"cdi: containerEdits.{key}: {item[:200].decode()} is not one of the vendor's common edits",
            )


# A Kubernetes hold's CDI spec is bare (the seeds' Kubernetes binding; cdi.build_hold_spec): a pod may get
# only part of the hold, the device plugin sets what each pod gets, and the spec-level edits reach every
# pod given any of the hold's devices (round 6b).
KUBE_BARE = (
    "a Kubernetes hold carries no vendor edits and no NVIDIA_VISIBLE_DEVICES: a pod the device plugin "
    "gives one of its devices would get the others through them"
)


def _kubernetes(assignment: Any) -> bool:
    from bcd_shared import wire

    return bool(assignment.binding == wire.Binding.KUBERNETES)


def _sliced(assignment: Any) -> bool:
    """The planner's DeviceAssignment.sliced: limits, and not a Kubernetes hold (the kubelet's cgroups)."""
    return assignment.limits is not None and not _kubernetes(assignment)


def _slice_of(ident: str) -> str:
    return f"bcd-alloc-{ident}.slice"


def _check_annotations(ident: str, doc: Any, assignment: Any) -> None:
    """A signed hold's annotations are what the planner writes for the assignment (round 6): the slice
    (`bcd.dev/cgroup-parent`, where a workload manager places the workload) only for a sliced hold and
    only its own, `bcd.dev/binding: kubernetes` (what the device plugins advertise) only for a Kubernetes
    hold, the signed reservation id, and no other key; a device's only its atom id. `doc`: the hold as
    _check_cdi decoded it (allocation id and generation checked there)."""
    from bcd_shared import cdi

    want: dict[str, str | None] = {
        cdi.ANN_RESERVATION: assignment.reservation_id,
        cdi.ANN_CGROUP_PARENT: _slice_of(ident) if _sliced(assignment) else None,
        cdi.ANN_BINDING: "kubernetes" if _kubernetes(assignment) else None,
    }
    got = dict(doc.get("annotations") or {})
    for key in sorted(set(got) - {cdi.ANN_ALLOCATION, cdi.ANN_GENERATION} | set(want)):
        if got.get(key) != want.get(key):
            raise Refused(
                "annotations-outside",
                f"cdi: annotations.{key[:100]}: {str(got.get(key))[:100]!r} is not what the signed spec's "
                f"assignment of {ident} makes ({want.get(key)!r})",
            )
    for i, dev in enumerate(doc["devices"]):
        extra = sorted(set(dev.get("annotations") or {}) - {cdi.ANN_DEVICE_ID})
        if extra:
            raise Refused(
                "annotations-outside",
                f"cdi: devices[{i}].annotations.{extra[0][:100]}: a hold device carries only its atom id",
            )


def _overlaps(a: str, b: str) -> bool:
    """Two atoms that cannot be two allocations' at once: the same atom, or a whole GPU and any atom of
    it (MIG devices and slots of one GPU are different allocations' by design)."""
    ga, gb = a.split("/")[0], b.split("/")[0]
    return a == b or (ga == gb and (a == ga or b == gb))


def _check_not_held(call: Call, ident: str, assignment: Any, kind: str = "cdi") -> None:
    """A signed hold names no atom another allocation's hold file or env file still names (round 6): the
    node cannot remove a hold the spec lists, but nothing makes it remove one the spec released, so a
    moved atom's old hold would stay beside the new one (the old tenant keeping its CDI device, or, by
    its env file's NVIDIA_VISIBLE_DEVICES, the GPU through NVIDIA's legacy runtime hook). Root's own
    view of /etc/cdi and /run/bcd/allocations, as the busy check reads them; a file root cannot parse
    holds every atom (fail closed). The node's planner removes both before it binds (an env file left
    without its hold too: docs/devices.md "Orphan env files"). The allocation's own hold and env file
    are not counted: the planner writes a changed hold that shares an atom over them in place
    (Q-DEV-PASS-01), and `atoms-missing` keeps that from leaving out an atom the spec gives. The env file
    (`kind` allocation-env) takes the same rule (round 7): its NVIDIA_VISIBLE_DEVICES hands the GPUs to the
    allocation's jobs through NVIDIA's legacy runtime hook as the CDI hold does through CDI."""
    from bcd_shared import cdi

    atoms = [a.id for a in assignment.devices]
    holds: dict[str, tuple[str, ...]] = {}
    for alloc, path, data in cdi.hold_spec_files(call.system):
        if alloc == ident:
            continue
        try:
            held = holds[alloc] = cdi.parse_hold_spec(data, alloc).device_ids
        except cdi.CdiError:
            raise Refused(
                "atoms-held", f"{kind}: the hold {path} cannot be read: it may hold any atom"
            ) from None
        both = sorted({a for a in atoms for h in held if _overlaps(a, h)})
        if both:
            raise Refused(
                "atoms-held",
                f"{kind}: {', '.join(both)[:300]} of allocation {ident} is still held by {alloc} ({path}): "
                "its hold goes first",
            )
    mig_atoms = mig_uuid_atoms(call.system)
    for alloc, path, data in cdi.env_files(call.system):
        if alloc == ident:
            continue
        named = _env_atoms(data, alloc, holds.get(alloc, ()), mig_atoms)
        if named is None:
            raise Refused(
                "atoms-held",
                f"allocation-env: {path} of allocation {alloc} cannot be read: it may name any GPU",
            )
        both = sorted({a for a in atoms for h in named if _overlaps(a, h)})
        if both:
            raise Refused(
                "atoms-held",
                f"{kind}: {', '.join(both)[:300]} of allocation {ident} is still named by allocation "
                f"{alloc}'s env file ({path}): it goes first",
            )


# NVIDIA_VISIBLE_DEVICES values that name no GPU (NVIDIA's container toolkit).
NO_GPU_NAMES = frozenset({"void", "none"})


def _env_atoms(
    data: bytes, alloc: str, held: tuple[str, ...], mig_atoms: Callable[[], dict[str, str]]
) -> set[str] | None:
    """The atoms an env file's NVIDIA_VISIBLE_DEVICES names, for the `atoms-held` rule; None for any
    atom (a file that does not parse, or a name root cannot place: `all`, an index, a MIG UUID root's
    nvidia-smi does not list). A GPU's UUID names the slots of it the allocation's own hold file holds
    (the planner names a slot's GPU; slots of one GPU are different allocations'), else the whole GPU:
    an env file without its hold hands its tenant the whole GPU. A MIG UUID names its MIG atom."""
    from bcd_shared import cdi

    try:
        lines = cdi.parse_env_file(data, alloc)
    except cdi.CdiError:
        return None
    out: set[str] = set()
    for name in cdi.visible_device_names(lines):
        if name in NO_GPU_NAMES:
            continue
        if name.startswith("GPU-"):
            slots = {h for h in held if h.startswith(name + "/s")}
            out |= slots if slots and name not in held else {name}
        elif name.startswith("MIG-") and name in mig_atoms():
            out.add(mig_atoms()[name])
        else:
            return None
    return out


def _check_slice_started(call: Call, ident: str, assignment: Any) -> None:
    """A sliced hold names its slice only once root sees it started (round 6) and enforcing the signed
    limits (round 6b): slice.apply takes only the signed limits, but the slice a hold names may have been
    made otherwise (a workload manager placing a job under a parent that is not there makes systemd create
    it without any) or kept at an older spec's limits. Root reads the slice's cgroup files itself and
    compares them with the signed assignment's limits in the node planner's normal form
    (bcd_shared.slicelimits): each limit the spec sets, and none it does not. slice.remove leaves the slice
    while the hold exists (bcd_helper.ops.slices)."""
    from bcd_shared import slicelimits

    from bcd_helper.ops.slices import populated, signed_limits, slice_cgroup

    if not _sliced(assignment):
        return
    name = _slice_of(ident)
    if populated(call, name) is None:
        raise Refused(
            "slice-missing",
            f"allocation {ident} is a sliced hold: its slice {name} must be started with the signed "
            "limits (slice.apply) before the hold names it",
        )
    wanted = slicelimits.wanted_limits(*slicelimits.limit_properties(**signed_limits(assignment.limits)))
    cgroup = slice_cgroup(name)
    files = {
        f: text
        for f in slicelimits.LIMIT_FILES
        if (text := call.system.read_text(f"{cgroup}/{f}")) is not None
    }
    applied = slicelimits.applied_limits(files)
    key = slicelimits.first_difference(wanted, applied)
    if key is not None:
        field, file = slicelimits.LIMIT_FIELDS[key]
        raise Refused(
            "slice-limits",
            f"allocation {ident}: its slice {name} does not enforce the signed limits: limits.{field} "
            f"makes {key} {wanted.get(key, 'unset')!r}, its cgroup's {file} says "
            f"{applied.get(key, 'unset')[:100]!r} (slice.apply with the signed limits first)",
        )


# The env keys bcd sets itself in a hold's files (the agent's devices planner, RESERVED_ENV_KEYS there), and
# the MPS pipe directory it names.
HOLD_ENV_KEYS = frozenset(
    {
        "BCD_ALLOCATION_ID",
        "BCD_CGROUP_PARENT",
        "BCD_RESERVATION_ID",
        "CUDA_MPS_PIPE_DIRECTORY",
        "NVIDIA_VISIBLE_DEVICES",
    }
)
MPS_PIPE_DIRECTORY = "/run/nvidia-mps"


def _visible_ok(value: str, assignment: Any, migs: Callable[[], dict[str, MigName]]) -> bool:
    """NVIDIA_VISIBLE_DEVICES names only the allocation's own GPUs (by UUID; a MIG atom's parent is not
    one), or the MIG UUIDs of its own MIG atoms (root's nvidia-smi maps them, `migs`), each once (the
    planner's `visible_devices`): never `all`, an index, another GPU or another MIG device."""
    atoms = [a.id for a in assignment.devices]
    # A MIG atom's parent GPU is not the allocation's (round 6): only whole-GPU and slot atoms name a GPU.
    gpus = {a.split("/")[0] for a in atoms if "/gi" not in a}
    items = value.split(",") if value else []
    if len(set(items)) != len(items) or len(items) > len(atoms):
        return False
    mine: set[str | None] = set()
    if any(i not in gpus for i in items) and any("/gi" in a for a in atoms):
        known = migs()
        mine = {known[a].uuid for a in atoms if a in known}
    return all(i in gpus or (i.startswith("MIG-") and i in mine) for i in items)


def _check_signed_env(
    kind: str,
    ident: str,
    lines: Any,
    assignment: Any,
    vendor_env: Any = (),
    migs: Callable[[], dict[str, MigName]] = dict,
) -> None:
    """With roots: a hold's env is what the signed assignment makes (round 5). The keys bcd sets carry
    the values root derives, whoever names them (the node refuses an assignment env line with such a
    key, docs/devices.md Q-DEV-ASG-02, so a signed one is not taken either); any other line must be one
    of the assignment's own signed env lines (the env file) or of root's vendor spec's common env (a
    CDI hold: build_hold_spec copies those). Anything else is `env-outside`. `migs` maps MIG atoms to
    root's MIG devices (asked only when NVIDIA_VISIBLE_DEVICES names something other than a held GPU)."""
    derived = {
        "BCD_ALLOCATION_ID": ident,
        "BCD_CGROUP_PARENT": _slice_of(ident),
        "BCD_RESERVATION_ID": assignment.reservation_id,
        "CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_DIRECTORY,
    }
    taken = set(assignment.env) if kind == "allocation-env" else set(vendor_env)
    bare = kind == "cdi" and _kubernetes(assignment)  # its env file still names its GPUs (the seeds)
    for i, line in enumerate(lines):
        key, _, value = str(line).partition("=")
        if key == "NVIDIA_VISIBLE_DEVICES" and bare:
            raise Refused("env-outside", f"{kind}: env[{i}] {key}: {KUBE_BARE}")
        if key == "NVIDIA_VISIBLE_DEVICES":
            ok = _visible_ok(value, assignment, migs)
        elif key in HOLD_ENV_KEYS:
            ok = value == derived[key]
        else:
            ok = line in taken
        if not ok:
            raise Refused(
                "env-outside",
                f"{kind}: env[{i}] {key[:100]!r}: {str(line)[:200]!r} is not what the signed spec's "
                f"assignment of {ident} sets",
            )


def file_write(call: Call, req: FileWrite) -> dict[str, Any]:
    spec, path = _kind(req.kind, req.id)
    data = _content(spec, req)
    decoded = spec.check(req.id, data)
    limits = _limits(req.kind, path, len(data))
    next_state = None
    if req.kind in BOUND_KINDS:
        assignment, signed = _signed_assignment(call, "file.write", req.kind, req.id, req.intent)
        if signed is not None:
            next_state, generation = signed
            if assignment is None:
                raise Refused(
                    "not-in-spec",
                    f"{req.kind}: allocation {req.id} is not in the signed spec's devices section "
                    f"(generation {generation})",
                )
            vendor_env: Any = ()
            if req.kind == "cdi":
                _check_annotations(req.id, decoded, assignment)
                _check_atoms(call, req.id, decoded, assignment)
                _check_not_held(call, req.id, assignment)
                _check_slice_started(call, req.id, assignment)
                env = (decoded.get("containerEdits") or {}).get("env") or []
                if env and not _kubernetes(assignment):  # no vendor env in a Kubernetes hold either
                    vendor = _vendor_devices(call)
                    vendor_env = (vendor.common_edits.get("env") or ()) if vendor is not None else ()
            else:
                env = data.decode().splitlines()  # _check_env took it as UTF-8 lines
                _check_not_held(call, req.id, assignment, req.kind)  # its GPUs, for the legacy hook
                _check_slice_started(call, req.id, assignment)  # a workload manager reads its parent
            _check_signed_env(req.kind, req.id, env, assignment, vendor_env, lambda: _mig_names(call))
    if spec.host_check is not None:
        spec.host_check(call, req.id, decoded)
    if next_state is not None:  # durable before effect
        call.ctx.intent_verifier().save_state(next_state)
    ahead = call.ahead
    started = False

    def go_ahead() -> None:
        """Called by write_root_only after every refusal (the rule's walk, the target, the kind's limits)
        and once the temporary file holds the data, before its fsync and the rename: the audit line goes
        ahead of the effect, its fsync overlapping the file's (docs/helper.md "Audit log")."""
        nonlocal started
        if ahead is not None:
            ahead.start()
            started = True

    try:
        write_root_only(call.ctx.root, path, data, spec.mode, check=limits, before_fsync=go_ahead)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    finally:
        if started:
            assert ahead is not None
            ahead.wait()  # the line durable (or its error raised) before any answer
    return {"path": path, "bytes": len(data)}


def _released_env(call: Call, kind: str, ident: str, assignment: Any) -> bool:
    """An env file whose removal frees nothing the signed spec gives its allocation, so it is taken while the
    spec lists the allocation: no CDI hold file beside it in root's view, and none of the atoms its
    NVIDIA_VISIBLE_DEVICES names (read as `atoms-held` reads another's: a GPU's UUID the whole GPU, since no
    hold names its slots; a MIG UUID its MIG device) is one the spec gives the allocation, or overlaps one.
    That is the env file a moved allocation's release leaves (Q-DEV-PASS-01: the planner removes the old
    hold, then its env file, then binds the new), or a crash between those two removals. Root's busy check
    reads env files (round 6b), so an env file naming the spec's GPUs keeps them busy while jobs started
    under it may run; before 2026-12-02 one without its hold could go whatever it named, and the GPU then
    looked free to a reset (docs/helper.md "Env files of a listed allocation"). A file root cannot read
    may name any GPU: it stays. A missing one is a no-op, taken."""
    from bcd_shared import cdi

    if kind != "allocation-env" or call.system.exists(cdi.cdi_spec_path(ident)):
        return False
    try:  # under the root-only rule, as the removal itself: a symlink there is refused, never read
        data = read_root_only(call.ctx.root, cdi.env_file_path(ident), LIMITS["allocation-env"].max_file)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    if data is None:
        return True
    named = _env_atoms(data, ident, (), mig_uuid_atoms(call.system))
    if named is None:
        return False
    return not any(_overlaps(a.id, n) for a in assignment.devices for n in named)


def _moved_hold(call: Call, kind: str, ident: str, assignment: Any) -> bool:
    """A CDI hold none of whose atoms the signed spec still gives its allocation: the spec moved the
    allocation to other atoms, and the planner releases the old hold before it binds the new one
    (Q-DEV-PASS-01). Its removal frees nothing the spec gives the allocation, so it is taken while the
    spec lists the allocation. A hold sharing any atom with the spec's stays (its removal would make a
    GPU the allocation still has look free to the busy check: the bind writes over it instead); a hold
    root cannot parse stays (it may hold any atom)."""
    from bcd_shared import cdi

    if kind != "cdi":
        return False
    data = call.system.read_bytes(cdi.cdi_spec_path(ident))
    if data is None:
        return False  # nothing there: the removal is a no-op either way, refused as before
    try:
        held = cdi.parse_hold_spec(data, ident).device_ids
    except cdi.CdiError:
        return False
    return not any(_overlaps(a.id, h) for a in assignment.devices for h in held)


def file_remove(call: Call, req: FileRemove) -> dict[str, Any]:
    _spec, path = _kind(req.kind, req.id)
    if req.kind in BOUND_KINDS:
        assignment, signed = _signed_assignment(call, "file.remove", req.kind, req.id, req.intent)
        if signed is not None:
            next_state, generation = signed
            if (
                assignment is not None
                and not _released_env(call, req.kind, req.id, assignment)
                and not _moved_hold(call, req.kind, req.id, assignment)
            ):
                from bcd_shared import cdi

                why = "its hold stays"
                if req.kind == "allocation-env" and not call.system.exists(cdi.cdi_spec_path(req.id)):
                    why = "its env file names a GPU the spec gives it (or cannot be read), so it stays"
                raise Refused(
                    "hold-in-spec",
                    f"{req.kind}: allocation {req.id} is still in the signed spec's devices section "
                    f"(generation {generation}): {why}",
                )
            if next_state is not None:
                call.ctx.intent_verifier().save_state(next_state)
    try:
        removed = remove_root_only(call.ctx.root, path)
    except RootPathRefused as exc:
        raise refused_path(exc) from None
    return {"path": path, "removed": removed}
