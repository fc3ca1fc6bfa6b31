"""file.write and file.remove with command-signing roots, called in process over a temporary root (issue 9
item 8; docs/mutation.md): a hold write carries the signed spec, its allocation must be in the spec's
devices section, a cdi hold's devices must be that allocation's atoms each carrying only its own GPU's
vendor edits (named by UUID, by the index root's nvidia-smi reads, or as a MIG device), the spec-level edits
only the vendor's common ones, and a hold the spec still lists cannot be removed. Every refusal word for
word, the intent state written only when the request is served, and nvidia-smi asked only when a device
carries edits. test_signed_holds.py drives the same rules through a real helper."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.intent import STATE_PATH, IntentState
from bcd_helper.ops.base import HelperContext, Refused
from bcd_helper.ops.files import FileRemove, FileWrite, SignedSpec, file_remove, file_write
from bcd_shared import cdi, wire
from intentkit import ControlPlane, Signer, devices_spec, intent
from opskit import Script, call, context, make_root, programs
from testsupport import SHARED

NODE = "node-a"
GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"
MIG1 = f"{GPU1}/gi1/ci0"
NV0 = {"deviceNodes": [{"path": "/dev/nvidia0"}]}
NV1 = {"deviceNodes": [{"path": "/dev/nvidia1"}]}
SMI_ARGV = ("nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader")
SMI_OUT = f"0, {GPU1}\n1, {GPU2}\n".encode()


def smi(out: bytes = SMI_OUT, rc: int = 0) -> Script:
    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        assert argv == SMI_ARGV
        return rc, out, b""

    return script


def signed_ctx(root: Path, cp: ControlPlane, script: Script | None = None) -> HelperContext:
    """A helper bound to node-a by root's join record, whose bundle names the command-signing root."""
    cp.write_record(root, NODE, cp.bundle(1))
    return context(root, cp.config_lines(), script or smi())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


@pytest.fixture
def ctx(root: Path, cp: ControlPlane) -> Iterator[HelperContext]:
    c = signed_ctx(root, cp)
    yield c
    c.audit.close()


def section(assignments: dict[str, list[str]]) -> wire.DevicesSection:
    return wire.DevicesSection(
        assignments=[
            wire.DeviceAssignment(
                allocation_id=a,
                reservation_id="r1",
                binding=wire.Binding.HOLD,
                devices=[wire.DeviceAtom(id=g, device_class="gpu") for g in atoms],
            )
            for a, atoms in assignments.items()
        ]
    )


def body(generation: int, assignments: dict[str, list[str]] | None, *, patch: bool = False) -> bytes:
    """A DesiredStateBody for node-a; `assignments` None: the spec sets no devices section."""
    devices = None if assignments is None else section(assignments)
    if patch:
        return bytes(
            wire.DesiredStateBody(
                node_id=NODE,
                generation=generation,
                spec_hash=f"p{generation}",
                patch=wire.NodeSpecPatch(devices=devices),
                base_generation=generation - 1,
            )
        )
    return devices_spec(NODE, generation, devices)


def signed(signer: Signer, data: bytes) -> SignedSpec:
    doc = intent(signer, data)
    return SignedSpec(doc["body"], doc["signature"], tuple(doc["chain"]), doc["trust_bundle"])


def hold(
    ident: str, devices: list[tuple[str, dict[str, Any] | None]], common: dict[str, Any] | None = None
) -> str:
    """A hold for `ident` whose devices are (atom id, container edits; None: only its marker)."""
    doc = cdi.build_hold_spec(
        allocation_id=ident,
        reservation_id="r1",
        generation=1,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(atom, edits) for atom, edits in devices],
        env=[f"BCD_ALLOCATION_ID={ident}"],
        vendor=None,
    )
    if common:
        doc["containerEdits"].update(common)
    return cdi.encode_spec(doc).decode()


def vendor(root: Path, devices: dict[str, dict[str, Any]], common: dict[str, Any] | None = None) -> None:
    doc: dict[str, Any] = {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": n, "containerEdits": e} for n, e in devices.items()],
    }
    if common:
        doc["containerEdits"] = common
    (root / "etc/cdi").mkdir(parents=True, exist_ok=True)
    (root / "etc/cdi/nvidia.json").write_text(json.dumps(doc))


def refused(ctx: HelperContext, req: Any) -> tuple[str, str]:
    fn = file_write if isinstance(req, FileWrite) else file_remove
    with pytest.raises(Refused) as info:
        fn(call(ctx), req)
    return info.value.reason, info.value.message


def state(root: Path) -> IntentState | None:
    path = root / STATE_PATH.lstrip("/")
    return IntentState.decode(path.read_bytes()) if path.exists() else None


def generation(root: Path) -> int | None:
    got = state(root)
    return None if got is None else got.generation


def cdi_write(ident: str, content: str, spec: SignedSpec | None) -> FileWrite:
    return FileWrite("cdi", ident, content, intent=spec)


def env_write(ident: str, spec: SignedSpec | None) -> FileWrite:
    return FileWrite("allocation-env", ident, f"BCD_ALLOCATION_ID={ident}\n", intent=spec)


# --- the signed spec and its devices section ----------------------------------------------------------------


def test_with_roots_each_bound_kind_needs_the_signed_spec_named_by_op_and_kind(ctx: HelperContext) -> None:
    for req, op in [
        (cdi_write("a1", hold("a1", [(GPU1, None)]), None), "file.write cdi"),
        (env_write("a1", None), "file.write allocation-env"),
        (FileRemove("cdi", "a1"), "file.remove cdi"),
        (FileRemove("allocation-env", "a1"), "file.remove allocation-env"),
    ]:
        assert refused(ctx, req) == (
            "intent-required",
            f"{op}: a signed spec is required (command-signing roots from join record)",
        )
    # k8s-token is not bound: written without a spec.
    got = file_write(call(ctx), FileWrite("k8s-token", "", "abcdef.0123456789abcdef\n"))
    assert got == {"path": "/var/lib/bcd-hostconfig/k8s/bootstrap-token", "bytes": 24}
    assert state(ctx.root) is None


def test_a_signed_env_file_is_written_and_the_generation_kept(ctx: HelperContext, worker: Signer) -> None:
    spec = signed(worker, body(4, {"a0": [GPU2], "a1": [GPU1]}))
    assert file_write(call(ctx), env_write("a1", spec)) == {
        "path": "/run/bcd/allocations/a1.env",
        "bytes": len("BCD_ALLOCATION_ID=a1\n"),
    }
    assert (ctx.root / "run/bcd/allocations/a1.env").read_bytes() == b"BCD_ALLOCATION_ID=a1\n"
    kept = state(ctx.root)
    assert kept is not None and (kept.generation, kept.node_id, kept.signed) == (4, NODE, True)
    # The same spec again: nothing new to keep, the write still served.
    file_write(call(ctx), env_write("a0", spec))
    assert generation(ctx.root) == 4
    # An older one is stale.
    assert refused(ctx, env_write("a1", signed(worker, body(3, {"a1": [GPU1]})))) == (
        "stale-generation",
        "file.write allocation-env: the signed spec's generation 3 is older than generation 4 "
        "already accepted",
    )


def test_an_allocation_the_spec_does_not_list_is_refused_and_nothing_kept(
    ctx: HelperContext, worker: Signer
) -> None:
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    assert refused(ctx, env_write("a9", spec)) == (
        "not-in-spec",
        "allocation-env: allocation a9 is not in the signed spec's devices section (generation 2)",
    )
    assert refused(ctx, cdi_write("a9", hold("a9", [(GPU1, None)]), spec)) == (
        "not-in-spec",
        "cdi: allocation a9 is not in the signed spec's devices section (generation 2)",
    )
    assert state(ctx.root) is None
    assert not (ctx.root / "run/bcd/allocations/a9.env").exists()
    # A full spec without a devices section lists no allocation.
    assert refused(ctx, env_write("a1", signed(worker, body(3, None)))) == (
        "not-in-spec",
        "allocation-env: allocation a1 is not in the signed spec's devices section (generation 3)",
    )
    assert state(ctx.root) is None


def test_a_patch_must_set_the_devices_section(ctx: HelperContext, worker: Signer) -> None:
    assert refused(ctx, env_write("a1", signed(worker, body(3, None, patch=True)))) == (
        "bad-intent",
        "file.write allocation-env: the signed spec (generation 3) sets no devices section",
    )
    assert refused(ctx, FileRemove("cdi", "a1", signed(worker, body(3, None, patch=True)))) == (
        "bad-intent",
        "file.remove cdi: the signed spec (generation 3) sets no devices section",
    )
    file_write(call(ctx), env_write("a1", signed(worker, body(3, {"a1": [GPU1]}, patch=True))))
    assert generation(ctx.root) == 3
    assert (
        refused(ctx, env_write("a2", signed(worker, body(3, {"a1": [GPU1]}, patch=True))))[0] == "not-in-spec"
    )


def test_a_listed_hold_stays_and_a_released_one_is_removed(ctx: HelperContext, worker: Signer) -> None:
    vendor(ctx.root, {GPU1: NV0})
    listed = signed(worker, body(2, {"a1": [GPU1]}))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, NV0)]), listed))
    file_write(call(ctx), env_write("a1", listed))
    for kind in ("cdi", "allocation-env"):
        assert refused(ctx, FileRemove(kind, "a1", listed)) == (
            "hold-in-spec",
            f"{kind}: allocation a1 is still in the signed spec's devices section (generation 2): "
            "its hold stays",
        )
    assert (ctx.root / "etc/cdi/bcd-a1.json").exists()
    released = signed(worker, body(7, {"a2": [GPU2]}))
    assert refused(ctx, FileRemove("cdi", "a2", released))[0] == "hold-in-spec"
    assert generation(ctx.root) == 2  # a refused removal keeps nothing
    assert file_remove(call(ctx), FileRemove("cdi", "a1", released)) == {
        "path": "/etc/cdi/bcd-a1.json",
        "removed": True,
    }
    assert generation(ctx.root) == 7  # kept by the removal
    assert not (ctx.root / "etc/cdi/bcd-a1.json").exists()
    assert file_remove(call(ctx), FileRemove("allocation-env", "a1", released)) == {
        "path": "/run/bcd/allocations/a1.env",
        "removed": True,
    }
    assert refused(ctx, env_write("a1", listed))[0] == "stale-generation"


def test_a_hold_the_spec_moved_to_other_atoms_may_go_while_the_spec_lists_it(
    ctx: HelperContext, worker: Signer
) -> None:
    """A listed allocation's CDI hold may be removed when none of its atoms is one the spec now gives the
    allocation (the planner's release before the re-bind, Q-DEV-PASS-01); a hold sharing an atom with the
    spec's, a hold root cannot parse, and the env file while its hold is there all stay."""
    vendor(ctx.root, {GPU1: NV0, GPU2: NV0})
    first = signed(worker, body(2, {"a1": [GPU1]}))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, NV0)]), first))
    file_write(call(ctx), env_write("a1", first))
    grown = signed(worker, body(3, {"a1": [GPU1, GPU2]}))
    assert refused(ctx, FileRemove("cdi", "a1", grown))[0] == "hold-in-spec"  # GPU1 stays a1's
    moved = signed(worker, body(4, {"a1": [GPU2]}))
    assert refused(ctx, FileRemove("allocation-env", "a1", moved))[0] == "hold-in-spec"  # its hold is there
    path = ctx.root / "etc/cdi/bcd-a1.json"
    text = path.read_text()
    path.write_text("{")
    assert refused(ctx, FileRemove("cdi", "a1", moved))[0] == "hold-in-spec"  # may hold any atom
    path.write_text(hold("a9", [(GPU1, NV0)]))  # another allocation's hold under a1's name: not a1's
    assert refused(ctx, FileRemove("cdi", "a1", moved))[0] == "hold-in-spec"
    path.write_text(text)
    assert file_remove(call(ctx), FileRemove("cdi", "a1", moved)) == {
        "path": "/etc/cdi/bcd-a1.json",
        "removed": True,
    }
    assert file_remove(call(ctx), FileRemove("allocation-env", "a1", moved))["removed"] is True
    assert generation(ctx.root) == 4
    (ctx.root / "run/bcd/allocations/a1.env").symlink_to("/etc/passwd")
    reason, message = refused(ctx, FileRemove("allocation-env", "a1", moved))
    assert reason == "root-only" and "/run/bcd/allocations/a1.env" in message, message


def test_a_removal_keeps_the_newer_generation_even_when_nothing_is_there(
    ctx: HelperContext, worker: Signer
) -> None:
    released = signed(worker, body(5, {}))
    assert file_remove(call(ctx), FileRemove("cdi", "a1", released)) == {
        "path": "/etc/cdi/bcd-a1.json",
        "removed": False,
    }
    assert generation(ctx.root) == 5


def test_without_roots_a_presented_spec_binds_nothing(root: Path, worker: Signer) -> None:
    """HST-SIGN-33: a spec presented where nothing names roots is not checked: an allocation it does not
    list, or a spec that sets no devices section at all, is written and removed as without one."""
    ctx = context(root, script=smi())
    try:
        other = signed(worker, body(2, {"a1": [GPU1]}))
        nothing = signed(worker, body(2, None, patch=True))
        assert file_write(call(ctx), env_write("a9", other))["bytes"] == len("BCD_ALLOCATION_ID=a9\n")
        file_write(call(ctx), cdi_write("a9", hold("a9", [(GPU2, None)]), nothing))
        assert file_remove(call(ctx), FileRemove("allocation-env", "a9", other))["removed"] is True
        assert file_remove(call(ctx), FileRemove("cdi", "a9", nothing))["removed"] is True
        assert state(root) is None and programs(ctx).runs == []
    finally:
        ctx.audit.close()


# --- a cdi hold's atoms and each device's vendor edits ------------------------------------------------------


def test_a_hold_device_outside_its_allocation_is_refused(ctx: HelperContext, worker: Signer) -> None:
    vendor(ctx.root, {GPU1: NV0, GPU2: NV1})
    spec = signed(worker, body(2, {"a1": [GPU1], "a2": [GPU2]}))
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, NV0), (GPU2, NV1)]), spec)) == (
        "atoms-outside",
        f"cdi: devices[1]: {GPU2!r} is not an atom of allocation a1 in the signed spec",
    )
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU2, None)]), spec)) == (
        "atoms-outside",
        f"cdi: devices[0]: {GPU2!r} is not an atom of allocation a1 in the signed spec",
    )
    assert state(ctx.root) is None and not (ctx.root / "etc/cdi/bcd-a1.json").exists()


def test_a_device_with_only_its_marker_needs_no_vendor_spec_nor_nvidia_smi(
    ctx: HelperContext, worker: Signer
) -> None:
    spec = signed(worker, body(2, {"a1": [GPU1, GPU2]}))
    content = hold("a1", [(GPU1, None), (GPU2, None)])
    assert file_write(call(ctx), cdi_write("a1", content, spec)) == {
        "path": "/etc/cdi/bcd-a1.json",
        "bytes": len(content.encode()),
    }
    assert (ctx.root / "etc/cdi/bcd-a1.json").read_text() == content
    assert programs(ctx).runs == []
    assert generation(ctx.root) == 2


def test_a_device_carries_its_own_gpus_edits_named_by_uuid(ctx: HelperContext, worker: Signer) -> None:
    vendor(ctx.root, {GPU1: NV0, GPU2: NV1})
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    # GPU2's device node is in the vendor spec (so the vendor rule alone would pass it), not GPU1's.
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, NV1)]), spec)) == (
        "atoms-outside",
        'cdi: devices[0].containerEdits.deviceNodes: {"path":"/dev/nvidia1"} is not the vendor\'s edit for '
        f"{GPU1}: a hold device carries only its own GPU's edits",
    )
    assert state(ctx.root) is None
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, NV0)]), spec))
    assert programs(ctx).runs == [SMI_ARGV, SMI_ARGV]  # once per write that checks device edits


def test_a_device_carries_its_own_gpus_edits_named_by_the_index_nvidia_smi_reads(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    # Lines that name no index (after the good ones, so as not to be overwritten) and a byte that is not
    # UTF-8 are passed over.
    out = f"junk\n 0 ,  {GPU1} \n1,{GPU2}\n[N/A], {GPU2}\n2,\n".encode() + b"3, GPU-\xff\n"
    ctx = signed_ctx(root, cp, smi(out))
    vendor(root, {"0": NV0, "1": NV1, "2": {"deviceNodes": [{"path": "/dev/nvidia2"}]}})
    spec = signed(worker, body(2, {"a1": [GPU1], "a2": [GPU2]}))
    file_write(call(ctx, bounded=False), cdi_write("a1", hold("a1", [(GPU1, NV0)]), spec))
    file_write(call(ctx), cdi_write("a2", hold("a2", [(GPU2, NV1)]), spec))
    assert programs(ctx).runs == [SMI_ARGV, SMI_ARGV] and programs(ctx).timeouts[0] == 60
    assert refused(ctx, cdi_write("a2", hold("a2", [(GPU2, NV0)]), spec))[1] == (
        'cdi: devices[0].containerEdits.deviceNodes: {"path":"/dev/nvidia0"} is not the vendor\'s edit for '
        f"{GPU2}: a hold device carries only its own GPU's edits"
    )
    ctx.audit.close()


@pytest.mark.parametrize("rc", [1, 127])
def test_a_failed_nvidia_smi_names_no_index(root: Path, cp: ControlPlane, worker: Signer, rc: int) -> None:
    """Its output is not read when it fails: GPUs are then named by UUID only."""
    ctx = signed_ctx(root, cp, smi(SMI_OUT, rc=rc))
    vendor(root, {"0": NV0})
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, NV0)]), spec))[0] == "atoms-outside"
    ctx.audit.close()


# A real host's nvidia-smi (../shared/reference/nvidia-smi: an A100 with MIG on GPU 0, driver 535.54.03, the
# `-L` and `-q -x` of the same machine): MIG device 0 is GPU instance 3, device 1 is GPU instance 4.
REF = SHARED / "reference/nvidia-smi"
RGPU, RGPU1 = "GPU-513536b6-7d19-9063-b049-1e69664bb298", "GPU-d8594bd4-0fc3-8595-e355-7c98138f3b95"
RMIG0, RMIG1 = f"{RGPU}/gi3/ci0", f"{RGPU}/gi4/ci0"
RMIG0_UUID, RMIG1_UUID = (
    "MIG-ce861fb0-a248-58ce-a9a8-f9adbc22a66a",
    "MIG-a45882f0-9215-5733-a0c1-49286ab31cb5",
)


LISTING = REF / "list/a100-sxm4-80gb_4gpu_mig-on-gpu0_535.54.03_L_telegraf-issue-5812.txt"


def real_smi(qx_rc: int = 0, l_rc: int = 0, listing: bytes | None = None) -> Script:
    """nvidia-smi as root runs it on that host: the index query, `-L` (`l_rc`: its exit; `listing`: other
    output) and `-q -x` (`qx_rc`: its exit)."""
    outputs = {
        SMI_ARGV: (0, f"0, {RGPU}\n1, {RGPU1}\n".encode()),
        ("nvidia-smi", "-L"): (l_rc, listing or LISTING.read_bytes()),
        ("nvidia-smi", "-q", "-x"): (
            qx_rc,
            (REF / "xml/a100-sxm4-80gb_mig-enabled_535.54.03.xml").read_bytes(),
        ),
    }

    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        rc, out = outputs[argv]
        return rc, out if rc == 0 else b"", b""

    return script


def test_a_mig_device_carries_only_its_own_mig_devices_edits(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """A MIG atom takes the vendor's edits of its own MIG device (by `<index>:<n>` or its UUID, mapped from
    the atom's ids by root's `-L` and `-q -x`) only; never another MIG device's on the same GPU (another
    tenant's nvidia-caps), its parent GPU's whole-device entry (round 6) nor another GPU's. Red team round
    5's open item: any `<index>:` or `MIG-` name passed."""
    ctx = signed_ctx(root, cp, real_smi())
    own_i = {"deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap30"}]}
    own_u = {"deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap31"}]}
    next_i = {"deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap39"}]}
    next_u = {"deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap40"}]}
    other = {"deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap300"}]}
    vendor(root, {"0": NV0, "0:0": own_i, RMIG0_UUID: own_u, "0:1": next_i, RMIG1_UUID: next_u, "1:0": other})
    spec = signed(worker, body(2, {"a1": [RMIG0], "a2": [RGPU1]}))
    for edits in (own_i, own_u):
        file_write(call(ctx), cdi_write("a1", hold("a1", [(RMIG0, edits)]), spec))
    for edits in (next_i, next_u, other, NV0):
        path = edits["deviceNodes"][0]["path"]
        assert refused(ctx, cdi_write("a1", hold("a1", [(RMIG0, edits)]), spec)) == (
            "atoms-outside",
            f'cdi: devices[0].containerEdits.deviceNodes: {{"path":"{path}"}} is not the vendor\'s edit for '
            f"{RMIG0}: a MIG hold device carries only its own MIG device's edits (not its GPU's)",
        )
    # A whole GPU's device is not a MIG one: no MIG device's edits are its own.
    for edits in (own_i, own_u, other):
        assert refused(ctx, cdi_write("a2", hold("a2", [(RGPU1, edits)]), spec))[0] == "atoms-outside"
    ctx.audit.close()


def test_a_mig_device_takes_no_mig_edits_when_roots_nvidia_smi_cannot_say_which(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """Fail closed: without `-q -x` (and with today's MIG UUIDs, which carry no ids) root cannot map the
    atom to a MIG device, so no edit passes (not its GPU's either: round 6)."""
    ctx = signed_ctx(root, cp, real_smi(qx_rc=9))
    own = {"deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap30"}]}
    vendor(root, {"0": NV0, "0:0": own, RMIG0_UUID: own})
    spec = signed(worker, body(2, {"a1": [RMIG0]}))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(RMIG0, None)]), spec))  # its marker only
    for edits in (own, NV0):
        assert refused(ctx, cdi_write("a1", hold("a1", [(RMIG0, edits)]), spec))[0] == "atoms-outside"
    ctx.audit.close()


def test_root_runs_nvidia_smi_once_a_hold_and_only_what_it_needs(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """Two MIG atoms with edits: the index query, `-L` and `-q -x` run once each for the hold, each bounded
    at 60 s; a `-L` that fails runs no `-q -x` and no MIG edit passes; a `-L` with a byte that is not
    UTF-8 in a GPU's name still maps its MIG devices."""
    own0 = {"deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap30"}]}
    own1 = {"deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap39"}]}
    ctx = signed_ctx(root, cp, real_smi())
    vendor(root, {"0:0": own0, "0:1": own1})
    spec = signed(worker, body(2, {"a1": [RMIG0, RMIG1]}))
    file_write(call(ctx, bounded=False), cdi_write("a1", hold("a1", [(RMIG0, own0), (RMIG1, own1)]), spec))
    assert programs(ctx).runs == [SMI_ARGV, ("nvidia-smi", "-L"), ("nvidia-smi", "-q", "-x")]
    assert programs(ctx).timeouts == [60, 60, 60]
    ctx.audit.close()

    ctx = signed_ctx(root, cp, real_smi(l_rc=6))
    assert (
        refused(ctx, cdi_write("a1", hold("a1", [(RMIG0, own0), (RMIG1, None)]), spec))[0] == "atoms-outside"
    )
    assert ("nvidia-smi", "-q", "-x") not in programs(ctx).runs
    ctx.audit.close()

    odd = LISTING.read_bytes().replace(b"NVIDIA A100", b"NVIDIA \xe9A100", 1)
    ctx = signed_ctx(root, cp, real_smi(listing=odd))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(RMIG0, own0), (RMIG1, None)]), spec))
    ctx.audit.close()


def test_an_env_file_names_only_its_own_mig_uuid(root: Path, cp: ControlPlane, worker: Signer) -> None:
    """NVIDIA_VISIBLE_DEVICES in a MIG hold's env file: its own atom's MIG UUID (root's `-L` and `-q -x`),
    never the GPU's other MIG device."""
    ctx = signed_ctx(root, cp, real_smi())
    spec = signed(worker, body(2, {"a1": [RMIG0]}))

    def env(visible: str) -> FileWrite:
        text = f"BCD_ALLOCATION_ID=a1\nNVIDIA_VISIBLE_DEVICES={visible}\n"
        return FileWrite("allocation-env", "a1", text, intent=spec)

    file_write(call(ctx), env(RMIG0_UUID))
    assert refused(ctx, env(RMIG1_UUID)) == (
        "env-outside",
        f"allocation-env: env[1] 'NVIDIA_VISIBLE_DEVICES': 'NVIDIA_VISIBLE_DEVICES={RMIG1_UUID}' is not what "
        "the signed spec's assignment of a1 sets",
    )
    ctx.audit.close()


def test_a_vendor_spec_of_one_all_device_gives_its_edits_to_every_gpu(
    ctx: HelperContext, worker: Signer
) -> None:
    """WSL's toolkit names one device, `all`."""
    dxg = {"deviceNodes": [{"path": "/dev/dxg"}]}
    vendor(ctx.root, {"all": dxg})
    spec = signed(worker, body(2, {"a1": [GPU1, GPU2]}))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, dxg), (GPU2, dxg)]), spec))
    # `all` beside named devices is a name like any other.
    vendor(ctx.root, {"all": dxg, GPU2: NV1})
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, dxg), (GPU2, NV1)]), spec))[0] == "atoms-outside"
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, None), (GPU2, NV1)]), spec))


def test_every_edit_of_a_device_is_checked_and_the_first_outside_named(
    ctx: HelperContext, worker: Signer
) -> None:
    long_path = "/dev/" + "x" * 300
    vendor(
        ctx.root, {GPU1: NV0, GPU2: {"deviceNodes": [{"path": long_path}], "mounts": [{"hostPath": "/a"}]}}
    )
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    edits = {"deviceNodes": [{"path": "/dev/nvidia0"}, {"path": long_path}], "mounts": [{"hostPath": "/a"}]}
    item = json.dumps({"path": long_path}, separators=(",", ":"))
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, edits)]), spec)) == (
        "atoms-outside",
        f"cdi: devices[0].containerEdits.deviceNodes: {item[:200]} is not the vendor's edit for {GPU1}: "
        "a hold device carries only its own GPU's edits",
    )
    # A value that is not a list (intelRdt) is one item.
    rdt_a, rdt_b = {"intelRdt": {"closID": "a"}}, {"intelRdt": {"closID": "b"}}
    vendor(ctx.root, {GPU1: rdt_a, GPU2: rdt_b})
    assert refused(ctx, cdi_write("a1", device_edits("a1", GPU1, rdt_b), spec)) == (
        "atoms-outside",
        'cdi: devices[0].containerEdits.intelRdt: {"closID":"b"} is not the vendor\'s edit for '
        f"{GPU1}: a hold device carries only its own GPU's edits",
    )
    file_write(call(ctx), cdi_write("a1", device_edits("a1", GPU1, rdt_a), spec))


def device_edits(ident: str, atom: str, edits: dict[str, Any]) -> str:
    """A hold whose one device's containerEdits are exactly `edits` (build_hold_spec would reshape them)."""
    doc = json.loads(hold(ident, [(atom, None)]))
    doc["devices"][0]["containerEdits"] = edits
    doc["cdiVersion"] = cdi.later_version(doc["cdiVersion"], cdi.required_version(doc))
    return json.dumps(doc)


def test_without_a_vendor_spec_no_device_edit_is_its_gpus(ctx: HelperContext, worker: Signer) -> None:
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, NV0)]), spec)) == (
        "atoms-outside",
        'cdi: devices[0].containerEdits.deviceNodes: {"path":"/dev/nvidia0"} is not the vendor\'s edit for '
        f"{GPU1}: a hold device carries only its own GPU's edits",
    )


def test_a_vendor_spec_that_does_not_parse_or_is_a_symlink_is_named(
    ctx: HelperContext, worker: Signer, tmp_path: Path
) -> None:
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    (ctx.root / "etc/cdi").mkdir(parents=True)
    (ctx.root / "etc/cdi/nvidia.json").write_text('{"devices": []}')
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, NV0)]), spec)) == (
        "bad-content",
        "cdi: root's /etc/cdi/nvidia.json: vendor spec: cdiVersion missing",
    )
    (ctx.root / "etc/cdi/nvidia.json").unlink()
    (tmp_path / "v.json").write_text("{}")
    (ctx.root / "etc/cdi/nvidia.json").symlink_to(tmp_path / "v.json")
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, NV0)]), spec)) == (
        "root-only",
        "/etc/cdi/nvidia.json is not a regular file: bcd will not write as root through it",
    )
    assert state(ctx.root) is None


# --- the spec-level edits -----------------------------------------------------------------------------------


def test_spec_level_edits_are_only_the_vendors_common_ones(ctx: HelperContext, worker: Signer) -> None:
    lib = {"mounts": [{"hostPath": "/usr/lib/libcuda.so", "containerPath": "/usr/lib/libcuda.so"}]}
    hook = {"hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-ctk"}]}
    # The common hook is also one device's edit: the vendor rule alone would pass it at spec level.
    vendor(ctx.root, {GPU1: {**NV0, **hook}}, common=lib)
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, NV0)], common=lib), spec))
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, NV0)], common=hook), spec)) == (
        "atoms-outside",
        'cdi: containerEdits.hooks: {"hookName":"createContainer","path":"/usr/bin/nvidia-ctk"} '
        "is not one of the vendor's common edits",
    )
    # Spec-level edits on a hold whose devices carry none: the vendor spec is read for them alone.
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, None)], common=hook), spec))[0] == "atoms-outside"
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, None)], common=lib), spec))
    assert generation(ctx.root) == 2


def test_spec_level_edits_without_a_vendor_spec_are_refused(ctx: HelperContext, worker: Signer) -> None:
    lib = {"mounts": [{"hostPath": "/usr/lib/libcuda.so", "containerPath": "/usr/lib/libcuda.so"}]}
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, None)], common=lib), spec)) == (
        "atoms-outside",
        'cdi: containerEdits.mounts: {"containerPath":"/usr/lib/libcuda.so",'
        '"hostPath":"/usr/lib/libcuda.so"} is not one of the vendor\'s common edits',
    )


def test_a_presented_spec_is_decoded_even_without_roots(root: Path, worker: Signer) -> None:
    """A spec the node presents turns the check on (no_roots_possible is False): its fields must decode."""
    ctx = context(root, script=smi())
    try:
        good = signed(worker, body(2, {"a1": [GPU1]}))
        bad = SignedSpec(good.body, good.signature, ("not base64!",), None)
        assert refused(ctx, env_write("a1", bad)) == (
            "bad-intent",
            "file.write allocation-env: intent.chain[0] is not base64",
        )
        assert refused(ctx, FileRemove("cdi", "a1", bad)) == (
            "bad-intent",
            "file.remove cdi: intent.chain[0] is not base64",
        )
    finally:
        ctx.audit.close()


def test_a_device_with_only_its_marker_does_not_end_the_check(ctx: HelperContext, worker: Signer) -> None:
    vendor(ctx.root, {GPU1: NV0, GPU2: NV1})
    spec = signed(worker, body(2, {"a1": [GPU1, GPU2]}))
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, None), (GPU2, NV0)]), spec)) == (
        "atoms-outside",
        'cdi: devices[1].containerEdits.deviceNodes: {"path":"/dev/nvidia0"} is not the vendor\'s edit for '
        f"{GPU2}: a hold device carries only its own GPU's edits",
    )


def test_a_spec_level_edit_outside_the_common_ones_is_shown_cut_to_200_bytes(
    ctx: HelperContext, worker: Signer
) -> None:
    long_path = "/usr/lib/" + "x" * 300
    mount = {"hostPath": long_path, "containerPath": long_path}
    vendor(ctx.root, {GPU1: {"mounts": [mount]}})
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    item = json.dumps(mount, separators=(",", ":"), sort_keys=True)
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, None)], common={"mounts": [mount]}), spec)) == (
        "atoms-outside",
        f"cdi: containerEdits.mounts: {item[:200]} is not one of the vendor's common edits",
    )


def test_a_vendor_spec_is_read_up_to_16_mib(ctx: HelperContext, worker: Signer) -> None:
    vendor(ctx.root, {GPU1: NV0})
    path = ctx.root / "etc/cdi/nvidia.json"
    text = path.read_bytes()
    spec = signed(worker, body(2, {"a1": [GPU1]}))
    path.write_bytes(text + b" " * (16 * 1024 * 1024 - len(text)))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, NV0)]), spec))
    path.write_bytes(text + b" " * (16 * 1024 * 1024 - len(text) + 1))
    assert refused(ctx, cdi_write("a1", hold("a1", [(GPU1, NV0)]), spec)) == (
        "root-only",
        f"/etc/cdi/nvidia.json is larger than {16 * 1024 * 1024} bytes",
    )


# --- round 6, row 7: an env file left without its hold --------------------------------------------------


def env_naming(ident: str, visible: str, spec: SignedSpec) -> FileWrite:
    return FileWrite(
        "allocation-env", ident, f"BCD_ALLOCATION_ID={ident}\nNVIDIA_VISIBLE_DEVICES={visible}\n", intent=spec
    )


def test_a_hold_of_a_gpu_another_allocations_env_file_names_waits_for_it(
    ctx: HelperContext, worker: Signer
) -> None:
    """Round 6, row 7 (docs/helper.md): the spec moved GPU1 from a1 to a2, and a1's env file stays without
    its hold (NVIDIA_VISIBLE_DEVICES names GPU1 for the legacy runtime hook): a2's hold of GPU1 is
    `atoms-held` naming a1's env file, a hold of another GPU is not; an env file root cannot parse holds
    every atom. An env file without its hold goes while the spec lists its allocation elsewhere (a hold's
    own does not, nor one naming a GPU the spec gives its allocation), and then a2's hold is written."""
    first = signed(worker, body(2, {"a1": [GPU1]}))
    file_write(call(ctx), env_naming("a1", GPU1, first))
    slots = [f"{GPU1}/s{i}" for i in range(1, 9)]  # their names, joined, pass the message's 300 characters
    moved = signed(worker, body(3, {"a2": [GPU1], "a3": [GPU2], "a5": slots}))
    assert refused(ctx, cdi_write("a2", hold("a2", [(GPU1, None)]), moved)) == (
        "atoms-held",
        f"cdi: {GPU1} of allocation a2 is still named by allocation a1's env file "
        "(/run/bcd/allocations/a1.env): it goes first",
    )
    # Without its hold, a1's env file hands the whole GPU: a slot of it waits too.
    assert refused(ctx, cdi_write("a5", hold("a5", [(a, None) for a in slots]), moved)) == (
        "atoms-held",
        f"cdi: {', '.join(slots)[:300]} of allocation a5 is still named by allocation a1's env file "
        "(/run/bcd/allocations/a1.env): it goes first",
    )
    assert not (ctx.root / "etc/cdi/bcd-a2.json").exists()
    a3 = cdi_write("a3", hold("a3", [(GPU2, None)]), moved)
    file_write(call(ctx), a3)  # another GPU
    file_write(call(ctx), env_naming("a3", GPU2, moved))
    file_write(call(ctx), a3)  # its own env file is not another's
    (ctx.root / "run/bcd/allocations/zz.env").write_bytes(b"NOT=an env file of zz\n")
    assert refused(ctx, a3) == (
        "atoms-held",
        "allocation-env: /run/bcd/allocations/zz.env of allocation zz cannot be read: it may name any GPU",
    )
    (ctx.root / "run/bcd/allocations/zz.env").unlink()
    back = signed(worker, body(4, {"a1": [GPU1], "a2": [GPU1], "a3": [GPU2]}))
    assert refused(ctx, FileRemove("allocation-env", "a3", back))[0] == "hold-in-spec"  # beside its hold
    # a1's env file names GPU1, which the spec gives a1 again: it stays (before 2026-12-02 it went, and GPU1
    # then looked free to root's busy check).
    assert refused(ctx, FileRemove("allocation-env", "a1", back)) == (
        "hold-in-spec",
        "allocation-env: allocation a1 is still in the signed spec's devices section (generation 4): its env "
        "file names a GPU the spec gives it (or cannot be read), so it stays",
    )
    elsewhere = signed(worker, body(5, {"a1": [GPU2], "a2": [GPU1], "a3": [GPU2]}))  # a1 moved off GPU1
    assert file_remove(call(ctx), FileRemove("allocation-env", "a1", elsewhere)) == {
        "path": "/run/bcd/allocations/a1.env",
        "removed": True,
    }
    assert generation(ctx.root) == 5
    file_write(call(ctx), cdi_write("a2", hold("a2", [(GPU1, None)]), elsewhere))


def test_an_env_files_mig_uuid_holds_its_mig_device_and_whole_gpu_only(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """A MIG UUID in another allocation's env file names its MIG device (root's `-L` and `-q -x`): a hold
    of that GPU whole waits for it, a hold of the GPU's other MIG device does not. One root's nvidia-smi
    cannot place holds every atom."""
    ctx = signed_ctx(root, cp, real_smi())
    file_write(call(ctx), env_naming("a1", RMIG0_UUID, signed(worker, body(2, {"a1": [RMIG0]}))))
    spec = signed(worker, body(3, {"a2": [RGPU], "a3": [RMIG1]}))
    assert refused(ctx, cdi_write("a2", hold("a2", [(RGPU, None)]), spec))[1].startswith(
        f"cdi: {RGPU} of allocation a2 is still named by allocation a1's env file"
    )
    file_write(call(ctx), cdi_write("a3", hold("a3", [(RMIG1, None)]), spec))
    ctx.audit.close()
    other = signed_ctx(root, cp, real_smi(l_rc=1))
    assert refused(other, cdi_write("a3", hold("a3", [(RMIG1, None)]), spec)) == (
        "atoms-held",
        "allocation-env: /run/bcd/allocations/a1.env of allocation a1 cannot be read: it may name any GPU",
    )
    other.audit.close()


def test_a_hold_of_an_atom_another_hold_file_names_waits_for_it(ctx: HelperContext, worker: Signer) -> None:
    """Round 6, row 7, the CDI side, in process: a hold naming an atom another allocation's hold file
    names (the same atom, or a whole GPU and any atom of it) is `atoms-held` naming that hold; slots of
    one GPU are different allocations'; the allocation's own hold is not another's; a hold file root
    cannot parse holds every atom."""
    s1, s2 = f"{GPU1}/s1", f"{GPU1}/s2"
    slots = [f"{GPU2}/s{i}" for i in range(1, 9)]  # their names, joined, pass the message's 300 characters
    spec = signed(worker, body(2, {"a1": [s1], "a2": [s2], "a3": [GPU1], "a4": [GPU2], "a7": slots}))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(s1, None)]), spec))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(s1, None)]), spec))  # its own hold again
    visible = FileWrite(
        "allocation-env", "a1", f"BCD_ALLOCATION_ID=a1\nNVIDIA_VISIBLE_DEVICES={GPU1}\n", intent=spec
    )
    file_write(call(ctx), visible)  # a slot's env file names its GPU: with its hold, that slot only
    file_write(call(ctx), cdi_write("a2", hold("a2", [(s2, None)]), spec))  # another slot of the GPU
    assert refused(ctx, cdi_write("a3", hold("a3", [(GPU1, None)]), spec)) == (
        "atoms-held",
        f"cdi: {GPU1} of allocation a3 is still held by a1 (/etc/cdi/bcd-a1.json): its hold goes first",
    )
    (ctx.root / "etc/cdi/bcd-a0.json").write_text("{}")
    assert refused(ctx, cdi_write("a4", hold("a4", [(GPU2, None)]), spec)) == (
        "atoms-held",
        "cdi: the hold /etc/cdi/bcd-a0.json cannot be read: it may hold any atom",
    )
    (ctx.root / "etc/cdi/bcd-a0.json").write_text(hold("a9", [(GPU2, None)]))  # another allocation's id
    assert refused(ctx, cdi_write("a4", hold("a4", [(GPU2, None)]), spec)) == (
        "atoms-held",
        "cdi: the hold /etc/cdi/bcd-a0.json cannot be read: it may hold any atom",
    )
    (ctx.root / "etc/cdi/bcd-a0.json").unlink()
    a4 = cdi_write("a4", hold("a4", [(GPU2, None)]), spec)
    file_write(call(ctx), a4)
    assert refused(ctx, cdi_write("a7", hold("a7", [(a, None) for a in slots]), spec)) == (
        "atoms-held",
        f"cdi: {', '.join(slots)[:300]} of allocation a7 is still held by a4 (/etc/cdi/bcd-a4.json): "
        "its hold goes first",
    )
    # Its own hold is skipped, not the end of the look: a9's, after it, still counts.
    (ctx.root / "etc/cdi/bcd-a9.json").write_text(hold("a9", [(GPU2, None)]))
    assert refused(ctx, a4)[1].endswith("is still held by a9 (/etc/cdi/bcd-a9.json): its hold goes first")


def test_round7_an_env_file_naming_an_atom_another_hold_still_names_waits_for_it(
    ctx: HelperContext, worker: Signer
) -> None:
    """Round 7, row 5 (docs/helper.md), in process: a signed env file takes round 6's `atoms-held` rule
    (its NVIDIA_VISIBLE_DEVICES hands the GPU to the legacy runtime hook as a CDI hold does), its
    refusals naming the env file's kind: another allocation's CDI hold kept after the spec moved the
    GPU, another's env file, a hold root cannot read. The allocation's own hold and env file are not
    another's; once the other hold goes the env file is written."""
    first = signed(worker, body(2, {"a1": [GPU1], "a4": [GPU2]}))
    file_write(call(ctx), cdi_write("a1", hold("a1", [(GPU1, None)]), first))
    file_write(call(ctx), env_naming("a4", GPU2, first))
    moved = signed(worker, body(3, {"a2": [GPU1], "a3": [GPU2]}))  # a1's hold, a4's env file kept
    assert refused(ctx, env_naming("a2", GPU1, moved)) == (
        "atoms-held",
        f"allocation-env: {GPU1} of allocation a2 is still held by a1 (/etc/cdi/bcd-a1.json): its hold "
        "goes first",
    )
    assert not (ctx.root / "run/bcd/allocations/a2.env").exists()
    assert refused(ctx, env_naming("a3", GPU2, moved)) == (
        "atoms-held",
        f"allocation-env: {GPU2} of allocation a3 is still named by allocation a4's env file "
        "(/run/bcd/allocations/a4.env): it goes first",
    )
    assert file_remove(call(ctx), FileRemove("allocation-env", "a4", moved))["removed"] is True
    (ctx.root / "etc/cdi/bcd-a0.json").write_text("{}")
    assert refused(ctx, env_naming("a3", GPU2, moved)) == (
        "atoms-held",
        "allocation-env: the hold /etc/cdi/bcd-a0.json cannot be read: it may hold any atom",
    )
    (ctx.root / "etc/cdi/bcd-a0.json").unlink()
    file_write(call(ctx), cdi_write("a3", hold("a3", [(GPU2, None)]), moved))
    file_write(call(ctx), env_naming("a3", GPU2, moved))  # its own hold and env file are not another's
    file_write(call(ctx), env_naming("a3", GPU2, moved))
    assert file_remove(call(ctx), FileRemove("cdi", "a1", moved))["removed"] is True
    file_write(call(ctx), env_naming("a2", GPU1, moved))
    assert (ctx.root / "run/bcd/allocations/a2.env").read_text().endswith(f"NVIDIA_VISIBLE_DEVICES={GPU1}\n")


def test_an_env_file_of_a_listed_allocation_goes_only_when_it_names_none_of_its_spec_atoms(
    ctx: HelperContext, worker: Signer
) -> None:
    """docs/helper.md "Env files of a listed allocation": with no hold beside it, a listed allocation's env
    file is refused `hold-in-spec` while it names an atom the spec gives the allocation (a GPU's UUID is
    the whole GPU, so a slot of it counts), or root cannot read it; it goes once it names only atoms the
    spec moved the allocation off, or nothing (`void`); a missing one is a no-op, taken."""
    why = "its env file names a GPU the spec gives it (or cannot be read), so it stays"

    def message(alloc: str, gen: int) -> tuple[str, str]:
        return (
            "hold-in-spec",
            f"allocation-env: allocation {alloc} is still in the signed spec's devices section (generation "
            f"{gen}): {why}",
        )

    first = signed(worker, body(2, {"a1": [GPU1], "a2": [GPU2]}))
    file_write(call(ctx), env_naming("a1", GPU1, first))
    file_write(call(ctx), env_naming("a2", GPU2, first))
    assert refused(ctx, FileRemove("allocation-env", "a1", first)) == message("a1", 2)
    slot = signed(worker, body(3, {"a1": [f"{GPU1}/s2"], "a2": [GPU1]}))
    assert refused(ctx, FileRemove("allocation-env", "a1", slot)) == message("a1", 3)
    assert file_remove(call(ctx), FileRemove("allocation-env", "a2", slot))["removed"] is True  # GPU2 only
    (ctx.root / "run/bcd/allocations/a2.env").write_text(
        "BCD_ALLOCATION_ID=a2\nNVIDIA_VISIBLE_DEVICES=void\n"
    )
    assert file_remove(call(ctx), FileRemove("allocation-env", "a2", slot))["removed"] is True  # names none
    assert file_remove(call(ctx), FileRemove("allocation-env", "a2", slot))["removed"] is False  # none there
    (ctx.root / "run/bcd/allocations/a2.env").write_text("BCD_ALLOCATION_ID=a9\n")  # not a2's: any GPU
    assert refused(ctx, FileRemove("allocation-env", "a2", slot)) == message("a2", 3)
    (ctx.root / "run/bcd/allocations/a2.env").write_text("BCD_ALLOCATION_ID=a2\nNVIDIA_VISIBLE_DEVICES=0\n")
    assert refused(ctx, FileRemove("allocation-env", "a2", slot)) == message("a2", 3)  # an index: any GPU
    moved = signed(worker, body(4, {"a1": [GPU2], "a2": [GPU2]}))
    assert file_remove(call(ctx), FileRemove("allocation-env", "a1", moved))["removed"] is True
    assert generation(ctx.root) == 4


def test_a_listed_allocations_env_file_past_the_size_root_writes_stays(
    ctx: HelperContext, worker: Signer
) -> None:
    """The env file is read under the kind's own size limit (64 KiB, what file.write takes): one larger
    is refused `root-only` naming the limit, never read whole, though it names no GPU of the spec; at the
    limit it is read and, naming none, taken."""
    slot = signed(worker, body(3, {"a1": [GPU1], "a2": [GPU1]}))
    path = ctx.root / "run/bcd/allocations/a2.env"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = b"BCD_ALLOCATION_ID=a2\nNVIDIA_VISIBLE_DEVICES=void\nPAD="
    path.write_bytes(head + b"x" * (64 * 1024 - len(head)) + b"\n")  # 64 KiB + 1
    assert refused(ctx, FileRemove("allocation-env", "a2", slot)) == (
        "root-only",
        "/run/bcd/allocations/a2.env is larger than 65536 bytes",
    )
    path.write_bytes(head + b"x" * (64 * 1024 - len(head) - 1) + b"\n")  # exactly 64 KiB
    assert file_remove(call(ctx), FileRemove("allocation-env", "a2", slot))["removed"] is True


def test_a_listed_mig_allocations_env_file_names_its_mig_device_only(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """The MIG side: an env file naming a MIG UUID names that MIG device by root's nvidia-smi: it stays
    while the spec gives the allocation that device (or the whole GPU), and goes once the spec moves the
    allocation to the GPU's other MIG device."""
    ctx = signed_ctx(root, cp, real_smi())
    try:
        first = signed(worker, body(2, {"a1": [RMIG0]}))
        file_write(call(ctx), env_naming("a1", RMIG0_UUID, first))
        assert refused(ctx, FileRemove("allocation-env", "a1", first))[0] == "hold-in-spec"
        whole = signed(worker, body(3, {"a1": [RGPU]}))
        assert refused(ctx, FileRemove("allocation-env", "a1", whole))[0] == "hold-in-spec"
        other = signed(worker, body(4, {"a1": [RMIG1]}))
        assert file_remove(call(ctx), FileRemove("allocation-env", "a1", other))["removed"] is True
    finally:
        ctx.audit.close()
