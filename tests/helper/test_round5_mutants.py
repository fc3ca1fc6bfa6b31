"""Round 5's changes to the helper (docs/helper.md "Threat model, round 5") called in process, written for the
mutants of the changed functions that survived the module's unit tests (docs/mutation.md, "Round 5 changes
(helper)"): the hold slices' bound and signed limits, the hold env rule, daemon.swap's command rules and
its spec as root's floor, the rotated-file age rule and audit.head while the log is full."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.intent import STATE_PATH, IntentState
from bcd_helper.ops.base import Failed, HelperContext, Refused
from bcd_helper.ops.files import SignedSpec
from bcd_helper.ops.slices import ALLOC_PARENT, MAX_SLICES, SliceApply, signed_limits, slice_apply
from bcd_shared import wire
from intentkit import ControlPlane, Signer, devices_spec, hold_text, intent
from opskit import call, context, make_root, programs

NODE = "node-a"
GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"
ALLOC = ALLOC_PARENT.lstrip("/")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


@pytest.fixture
def plain(root: Path) -> Iterator[HelperContext]:
    """A helper without command-signing roots."""
    c = context(root)
    yield c
    c.audit.close()


@pytest.fixture
def signed_ctx(root: Path, cp: ControlPlane) -> Iterator[HelperContext]:
    """A helper bound to node-a by root's join record, whose bundle names the command-signing root."""
    cp.write_record(root, NODE, cp.bundle(1))
    c = context(root, cp.config_lines())
    yield c
    c.audit.close()


def signed(signer: Signer, data: bytes) -> SignedSpec:
    doc = intent(signer, data)
    return SignedSpec(doc["body"], doc["signature"], tuple(doc["chain"]), doc["trust_bundle"])


def devices_body(generation: int, *assignments: wire.DeviceAssignment) -> bytes:
    return devices_spec(NODE, generation, wire.DevicesSection(assignments=list(assignments)))


def assignment(
    ident: str,
    *atoms: str,
    binding: wire.Binding = wire.Binding.HOLD,
    limits: wire.DeviceLimits | None = None,
    env: tuple[str, ...] = (),
    reservation: str = "r1",
) -> wire.DeviceAssignment:
    return wire.DeviceAssignment(
        allocation_id=ident,
        reservation_id=reservation,
        binding=binding,
        devices=[wire.DeviceAtom(id=a, device_class="gpu.mig" if "/gi" in a else "gpu") for a in atoms],
        limits=limits,
        env=list(env),
    )


def generation(root: Path) -> int | None:
    path = root / STATE_PATH.lstrip("/")
    return IntentState.decode(path.read_bytes()).generation if path.exists() else None


def refused(fn: Any, *args: Any) -> tuple[str, str]:
    with pytest.raises(Refused) as info:
        fn(*args)
    return info.value.reason, info.value.message


# --- slices: the bound on hold slices (check_slice_count) ---------------------------------------------------


def _slices(root: Path, count: int, *extra: str) -> None:
    """`count` hold slices under bcd-alloc.slice as the kernel lists them, and `extra` entries beside."""
    parent = root / ALLOC
    parent.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (parent / f"bcd-alloc-s{i}.slice").mkdir()
    for name in extra:
        (parent / name).mkdir()


def test_no_hold_slice_yet_starts_one_and_makes_no_cgroup_directory(plain: HelperContext, root: Path) -> None:
    got = slice_apply(call(plain), SliceApply("bcd-alloc-a1.slice"))
    assert got["name"] == "bcd-alloc-a1.slice"
    assert programs(plain).runs == [("systemctl", "start", "bcd-alloc-a1.slice")]
    assert not (root / "sys").exists()  # bcd-alloc.slice is read, never created, by the count


def test_the_hold_slice_bound_counts_only_hold_slices_and_refuses_the_1025th(
    plain: HelperContext, root: Path
) -> None:
    # Entries that are not hold slices do not count (cgroup files, other units, a name past 80 characters).
    _slices(root, MAX_SLICES - 1, "cgroup.procs", "bcd-alloc-x.scope", "bcd-alloc-" + "y" * 81 + ".slice")
    slice_apply(call(plain), SliceApply("bcd-alloc-a1.slice"))  # the 1024th
    (root / ALLOC / "bcd-alloc-a1.slice").mkdir()
    assert refused(slice_apply, call(plain), SliceApply("bcd-alloc-a2.slice")) == (
        "too-many-slices",
        f"slice.apply: root keeps at most {MAX_SLICES} hold slices under bcd-alloc.slice: "
        "bcd-alloc-a2.slice is not one of them",
    )
    # One that is there already is applied again.
    slice_apply(call(plain), SliceApply("bcd-alloc-a1.slice"))
    assert programs(plain).runs == [("systemctl", "start", "bcd-alloc-a1.slice")] * 2


def test_a_symlinked_hold_slice_parent_is_refused(plain: HelperContext, root: Path, tmp_path: Path) -> None:
    (root / ALLOC).parent.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / ALLOC).symlink_to(tmp_path / "elsewhere")
    reason, message = refused(slice_apply, call(plain), SliceApply("bcd-alloc-a1.slice"))
    assert reason == "root-only" and "bcd-alloc.slice" in message, message
    assert programs(plain).runs == []


# --- slices: signed limits (signed_limits, check_signed_slice) ----------------------------------------------


def test_signed_limits_map_empty_and_zero_to_no_limit_and_keep_huge_pages() -> None:
    assert signed_limits(wire.DeviceLimits(cpus="", mems="", cpu_millis=0, memory_bytes=0)) == {
        "cpus": None,
        "mems": None,
        "cpu_millis": None,
        "memory_bytes": None,
        "hugepages_2mi": None,
        "hugepages_1gi": None,
    }
    limits = wire.DeviceLimits(
        cpus="0-3", mems="1", cpu_millis=250, memory_bytes=1 << 30, hugepages_2mi=0, hugepages_1gi=4
    )
    assert signed_limits(limits) == {
        "cpus": "0-3",
        "mems": "1",
        "cpu_millis": 250,
        "memory_bytes": 1 << 30,
        "hugepages_2mi": 0,
        "hugepages_1gi": 4,
    }


def _cgroup_files(root: Path) -> None:
    """The cgroup files slice.apply writes for huge pages (the kernel's, never created by root)."""
    cg = root / ALLOC / "bcd-alloc-a1.slice"
    cg.mkdir(parents=True)
    for parent in (cg.parent.parent.parent, cg.parent.parent, cg.parent):
        (parent / "cgroup.subtree_control").write_bytes(b"")
    for name in ("hugetlb.2MB.max", "hugetlb.1GB.max"):
        (cg / name).write_bytes(b"max")


def _slice_spec(worker: Signer, gen: int = 3) -> SignedSpec:
    return signed(
        worker,
        devices_body(
            gen,
            assignment(
                "a1", GPU1, limits=wire.DeviceLimits(cpus="0-3", memory_bytes=1 << 30, hugepages_2mi=0)
            ),
            assignment("a2", GPU2),
            assignment("a3", GPU2, binding=wire.Binding.KUBERNETES, limits=wire.DeviceLimits(cpus="4")),
        ),
    )


def test_a_signed_slice_is_applied_with_its_own_limits_and_the_generation_kept(
    signed_ctx: HelperContext, root: Path, worker: Signer
) -> None:
    _cgroup_files(root)
    req = SliceApply(
        "bcd-alloc-a1.slice", cpus="0-3", memory_bytes=1 << 30, hugepages_2mi=0, intent=_slice_spec(worker)
    )
    got = slice_apply(call(signed_ctx), req)
    assert got["properties"] == ["AllowedCPUs=0-3", "MemoryMax=1073741824", "MemoryHigh=966367641"]
    assert programs(signed_ctx).runs[0] == ("systemctl", "start", "bcd-alloc-a1.slice")
    assert (root / ALLOC / "bcd-alloc-a1.slice/hugetlb.2MB.max").read_bytes() == b"0"
    assert generation(root) == 3


def test_a_signed_slice_is_kept_before_systemctl_runs(root: Path, cp: ControlPlane, worker: Signer) -> None:
    """Durable before effect: the spec's generation is root's floor even when systemctl then fails."""
    cp.write_record(root, NODE, cp.bundle(1))
    ctx = context(root, cp.config_lines(), lambda argv: (1, b"", b"no"))
    try:
        req = SliceApply(
            "bcd-alloc-a1.slice",
            cpus="0-3",
            memory_bytes=1 << 30,
            hugepages_2mi=0,
            intent=_slice_spec(worker),
        )
        with pytest.raises(Failed):
            slice_apply(call(ctx), req)
        assert generation(root) == 3
    finally:
        ctx.audit.close()


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("bcd-alloc-a2.slice", {}),  # held, but not sliced: no limits
        ("bcd-alloc-a3.slice", {"cpus": "4"}),  # sliced, but a Kubernetes hold
        ("bcd-alloc-a9.slice", {}),  # not in the spec
    ],
)
def test_a_slice_of_no_sliced_hold_of_the_spec_is_refused_by_its_allocation_id(
    signed_ctx: HelperContext, root: Path, worker: Signer, name: str, args: dict[str, Any]
) -> None:
    ident = name[len("bcd-alloc-") : -len(".slice")]
    req = SliceApply(name, intent=_slice_spec(worker), **args)
    assert refused(slice_apply, call(signed_ctx), req) == (
        "not-in-spec",
        f"slice.apply: allocation {ident} is not a sliced hold of the signed spec's devices section "
        "(generation 3)",
    )
    assert programs(signed_ctx).runs == [] and generation(root) is None


@pytest.mark.parametrize(
    ("args", "field", "sent", "value"),
    [
        ({"cpus": "0-63", "memory_bytes": 1 << 30, "hugepages_2mi": 0}, "cpus", "'0-63'", "'0-3'"),
        ({"memory_bytes": 1 << 30, "hugepages_2mi": 0}, "cpus", "None", "'0-3'"),
        ({"cpus": "0-3", "mems": "0", "memory_bytes": 1 << 30, "hugepages_2mi": 0}, "mems", "'0'", "None"),
        (
            {"cpus": "0-3", "cpu_millis": 10, "memory_bytes": 1 << 30, "hugepages_2mi": 0},
            "cpu_millis",
            "10",
            "None",
        ),
        ({"cpus": "0-3", "memory_bytes": 4096, "hugepages_2mi": 0}, "memory_bytes", "4096", "1073741824"),
        ({"cpus": "0-3", "memory_bytes": 1 << 30}, "hugepages_2mi", "None", "0"),
        (
            {"cpus": "0-3", "memory_bytes": 1 << 30, "hugepages_2mi": 0, "hugepages_1gi": 1},
            "hugepages_1gi",
            "1",
            "None",
        ),
    ],
)
def test_limits_other_than_the_assignments_own_are_refused_word_for_word(
    signed_ctx: HelperContext,
    root: Path,
    worker: Signer,
    args: dict[str, Any],
    field: str,
    sent: str,
    value: str,
) -> None:
    req = SliceApply("bcd-alloc-a1.slice", intent=_slice_spec(worker), **args)
    assert refused(slice_apply, call(signed_ctx), req) == (
        "spec-mismatch",
        f"slice.apply: {field} {sent} is not the signed spec's {value} for a1 (generation 3)",
    )
    assert programs(signed_ctx).runs == [] and generation(root) is None


def test_without_roots_a_presented_spec_binds_no_slice(
    plain: HelperContext, root: Path, worker: Signer
) -> None:
    req = SliceApply("bcd-alloc-a9.slice", cpus="0-63", intent=_slice_spec(worker))
    assert slice_apply(call(plain), req)["properties"] == ["AllowedCPUs=0-63"]
    assert generation(root) is None


# --- files: a hold's env from the signed assignment (_visible_ok, _check_signed_env, file_write) ------------

MIG1 = f"{GPU1}/gi1/ci0"
MIG2 = f"{GPU1}/gi2/ci0"
MIG_UUID1 = "MIG-aaaaaaaa-1111-5111-8111-000000000001"
MIG_UUID2 = "MIG-aaaaaaaa-1111-5111-8111-000000000002"
MIG_UUID3 = "MIG-aaaaaaaa-1111-5111-8111-000000000003"


@pytest.mark.parametrize(
    ("atoms", "value", "ok"),
    [
        ((GPU1,), GPU1, True),
        ((GPU1,), "", True),  # names no GPU: the runtime hook hands none
        ((GPU1, GPU2), f"{GPU1},{GPU2}", True),
        ((GPU1,), f"{GPU1},{GPU2}", False),  # another GPU of the host
        ((GPU1, GPU2), f"{GPU1},{GPU1}", False),  # one named twice
        ((GPU1,), "all", False),
        ((GPU1,), "0", False),
        ((GPU1,), MIG_UUID1, False),  # a MIG device, but the hold has whole GPUs only
        ((MIG1,), MIG_UUID1, True),
        ((MIG1,), GPU1, False),  # a MIG atom's parent GPU, whole (round 6: the planner never names it)
        ((MIG1, f"{GPU1}/s1"), GPU1, True),  # a slot of the GPU names its parent
        ((MIG1,), GPU2, False),
        ((MIG1, MIG2), f"{MIG_UUID1},{MIG_UUID2}", True),
        ((MIG1, MIG2), f"{MIG_UUID1},{MIG_UUID2},{MIG_UUID3}", False),  # more than the hold's atoms
        ((GPU2, MIG1), f"{GPU2},{MIG_UUID1}", True),
        ((MIG1,), MIG_UUID2, False),  # another MIG device of the same GPU (another tenant's)
        ((MIG1,), MIG_UUID3, False),  # a MIG device root's nvidia-smi gives no atom of this hold
        ((MIG1, GPU2), f"{GPU2},{MIG_UUID2}", False),
        ((f"{GPU1}/gi9/ci0",), MIG_UUID1, False),  # an atom root's nvidia-smi does not list: no UUID
        ((MIG1,), "MIG-GPU-x/1/0", False),
    ],
)
def test_nvidia_visible_devices_names_only_the_holds_own_gpus_or_mig_devices(
    atoms: tuple[str, ...], value: str, ok: bool
) -> None:
    """A MIG UUID passes only where root's nvidia-smi maps one of the hold's own MIG atoms to it (red team
    round 5's open item: any `MIG-` UUID passed)."""
    from bcd_helper.ops.files import MigName, _visible_ok

    asked: list[int] = []

    def migs() -> dict[str, MigName]:
        asked.append(1)
        return {
            MIG1: MigName(MIG_UUID1, frozenset({"0:0", MIG_UUID1})),
            MIG2: MigName(MIG_UUID2, frozenset({"0:1", MIG_UUID2})),
            f"{GPU2}/gi1/ci0": MigName(None, frozenset({"1:0"})),
        }

    assert _visible_ok(value, assignment("a1", *atoms), migs) is ok
    if all(item in {a.split("/")[0] for a in atoms if "/gi" not in a} for item in value.split(",") if item):
        assert not asked  # the hold's GPUs only: root runs no nvidia-smi


def test_mig_uuids_fail_closed_without_roots_map() -> None:
    """Without root's map (nvidia-smi did not answer, or the default), no MIG UUID is taken."""
    from bcd_helper.ops.files import _check_signed_env, _visible_ok

    assert _visible_ok(MIG_UUID1, assignment("a1", MIG1), dict) is False
    with pytest.raises(Refused) as info:
        _check_signed_env(
            "allocation-env", "a1", [f"NVIDIA_VISIBLE_DEVICES={MIG_UUID1}"], assignment("a1", MIG1)
        )
    assert info.value.reason == "env-outside"


def test_each_env_key_bcd_sets_takes_only_the_value_root_derives() -> None:
    from bcd_helper.ops.files import _check_signed_env

    asg = assignment("a1", GPU1, reservation="r7", env=("SLURM_GRES=gpu:1", "BCD_ALLOCATION_ID=a2"))
    good = [
        "BCD_ALLOCATION_ID=a1",
        "BCD_CGROUP_PARENT=bcd-alloc-a1.slice",
        "BCD_RESERVATION_ID=r7",
        "CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps",
        f"NVIDIA_VISIBLE_DEVICES={GPU1}",
    ]
    for kind in ("allocation-env", "cdi"):
        _check_signed_env(kind, "a1", good, asg)
    _check_signed_env("allocation-env", "a1", [*good, "SLURM_GRES=gpu:1"], asg)
    for line in (
        "BCD_ALLOCATION_ID=a2",  # signed as an env line, but a key bcd sets: root's value only
        "BCD_CGROUP_PARENT=bcd-alloc-a2.slice",
        "BCD_RESERVATION_ID=r1",
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/mps",
        "NVIDIA_VISIBLE_DEVICES=all",
        "SLURM_GRES=gpu:8",
        "SLURM_GRES",
    ):
        key = line.partition("=")[0]
        with pytest.raises(Refused) as info:
            _check_signed_env("allocation-env", "a1", [good[0], line], asg)
        assert (info.value.reason, info.value.message) == (
            "env-outside",
            f"allocation-env: env[1] {key!r}: {line!r} is not what the signed spec's assignment of a1 sets",
        )
    # A CDI hold carries no signed env lines of its own: the assignment's are the env file's.
    with pytest.raises(Refused) as info:
        _check_signed_env("cdi", "a1", ["SLURM_GRES=gpu:1"], asg)
    assert info.value.message == (
        "cdi: env[0] 'SLURM_GRES': 'SLURM_GRES=gpu:1' is not what the signed spec's assignment of a1 sets"
    )


def test_an_env_line_outside_is_shown_cut() -> None:
    from bcd_helper.ops.files import _check_signed_env

    line = "K" * 150 + "=" + "v" * 100
    with pytest.raises(Refused) as info:
        _check_signed_env("allocation-env", "a1", [line], assignment("a1", GPU1))
    assert info.value.message == (
        f"allocation-env: env[0] {'K' * 100!r}: {line[:200]!r} is not what the signed spec's assignment of "
        "a1 sets"
    )


def _hold(env: list[str]) -> str:
    return hold_text("a1", [(GPU1, None)], env, generation=2)  # unsliced (no limits): no cgroup parent


def test_a_signed_hold_write_checks_the_env_it_carries(
    signed_ctx: HelperContext, root: Path, worker: Signer
) -> None:
    from bcd_helper.ops.files import FileWrite, file_write

    spec = signed(worker, devices_body(2, assignment("a1", GPU1, env=("SLURM_GRES=gpu:1",))))
    outside = [
        FileWrite("cdi", "a1", _hold(["BCD_ALLOCATION_ID=a1", "LD_PRELOAD=/x.so"]), intent=spec),
        FileWrite("allocation-env", "a1", "BCD_ALLOCATION_ID=a1\nLD_PRELOAD=/x.so\n", intent=spec),
    ]
    for req in outside:
        assert refused(file_write, call(signed_ctx), req) == (
            "env-outside",
            f"{req.kind}: env[1] 'LD_PRELOAD': 'LD_PRELOAD=/x.so' is not what the signed spec's assignment "
            "of a1 sets",
        )
    assert generation(root) is None and not (root / "run/bcd").exists()
    # A hold without spec-level edits (no containerEdits at all) and the planned env file are written.
    file_write(call(signed_ctx), FileWrite("cdi", "a1", _hold([]), intent=spec))
    env = "BCD_ALLOCATION_ID=a1\nSLURM_GRES=gpu:1\n"
    file_write(call(signed_ctx), FileWrite("allocation-env", "a1", env, intent=spec))
    assert (root / "run/bcd/allocations/a1.env").read_text() == env
    assert generation(root) == 2


def test_with_roots_a_slice_needs_the_signed_spec_named_by_op_and_kind(
    signed_ctx: HelperContext, root: Path, worker: Signer
) -> None:
    assert refused(slice_apply, call(signed_ctx), SliceApply("bcd-alloc-a1.slice", cpus="0-3")) == (
        "intent-required",
        "slice.apply slice: a signed spec is required (command-signing roots from join record)",
    )
    assert programs(signed_ctx).runs == [] and generation(root) is None


# --- daemon.swap: the command rules, root's memory of used commands, the spec as root's floor ---------------

OLD = b"#!/bin/sh\necho bcd 1.0.0\n"
NEW = b"#!/bin/sh\necho bcd 1.1.0\n"
DAEMON_HELPER = '[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = 4242\nnode_gid = 4242\n'
UPG = "01J0000000000000000000UPG7"


def _daemon_ctx(root: Path, config: str) -> HelperContext:
    (root / "usr/lib/bcd").mkdir(parents=True, exist_ok=True)
    (root / "usr/lib/bcd/bcd").write_bytes(OLD)
    (root / "usr/lib/bcd/bcd").chmod(0o755)
    return context(root, config + DAEMON_HELPER)


@pytest.fixture
def dctx(root: Path, cp: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> Iterator[HelperContext]:
    """A host bound to node-a by root's join record, a packaged bcd installed."""
    monkeypatch.chdir(root.parent)
    cp.write_record(root, NODE, cp.bundle(2))
    c = _daemon_ctx(root, cp.config_lines())
    yield c
    _close(c)


def _close(c: HelperContext) -> None:
    with c.timer_lock:
        if c.daemon_timer is not None:
            c.daemon_timer.cancel()
    c.audit.close()


def _command(signer: Signer, not_after_ms: int, **fields: Any) -> dict[str, str]:
    """A signed daemon.upgrade command for 1.1.0 (NEW); `fields` override the CommandBody's."""
    import time

    from bcd_shared.pki import Purpose
    from bcd_shared.wire.strict import type_url
    from intentkit import b64
    from releasekit import daemon_section

    section = daemon_section(signer, "1.1.0", NEW)
    request = wire.DaemonUpgradeRequest(
        version=section.version, url=section.url, sha256=section.sha256, signature=section.signature
    )
    body: dict[str, Any] = {
        "id": UPG,
        "node_id": NODE,
        "seq": 1,
        "kind": "daemon.upgrade",
        "payload": wire.ProtoAny(type_url=type_url(wire.DaemonUpgradeRequest), value=bytes(request)),
        "lane": wire.Lane.CONTROL,
        "not_after": not_after_ms or int(time.time() * 1000) + 600_000,
        "retry_safe": True,
        "self_terminating": True,
        **fields,
    }
    data = bytes(wire.CommandBody(**body))
    return {"body": b64(data), "signature": b64(signer.key.sign(Purpose.COMMAND, data))}


def _command_swap(signer: Signer, root: Path, command: dict[str, str]) -> dict[str, Any]:
    from releasekit import staged_swap

    args = dict(staged_swap(signer, root, NEW)["args"])
    del args["spec"]
    args["command"] = command
    return args


def _swap(ctx: HelperContext, args: dict[str, Any]) -> dict[str, Any]:
    from bcd_helper.ops.daemon import DaemonSwap, daemon_swap
    from bcd_helper.protocol import structure

    return daemon_swap(call(ctx, bounded=False), structure(args, DaemonSwap))


def _confirm(ctx: HelperContext) -> None:
    from bcd_helper.ops.daemon import DaemonConfirm, daemon_confirm

    # As root (in process the peer is pid 1, which started before the flip: a node's confirmation from
    # it is refused since round 10; root's is not dated).
    daemon_confirm(call(ctx, uid=0), DaemonConfirm("1.1.0", True))


def _used(root: Path) -> list[dict[str, Any]]:
    import json

    path = root / "var/lib/bcd-hostconfig/helper-commands.json"
    return list(json.loads(path.read_text())["used"]) if path.exists() else []


def _seed_used(root: Path, *used: dict[str, Any]) -> None:
    import json

    path = root / "var/lib/bcd-hostconfig/helper-commands.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": 1, "used": list(used)}))
    path.chmod(0o600)


def _forget_record_ids(root: Path) -> None:
    """The release record's last 64 ids all newer commands' (what 64 later swaps leave)."""
    import json

    from releasekit import RECORD

    doc = json.loads((root / RECORD).read_text())
    doc["used_commands"] = [f"01JLATER{i:018d}" for i in range(64)]
    (root / RECORD).write_text(json.dumps(doc))


def test_a_command_swap_is_remembered_until_its_not_after_and_a_replay_refused(
    dctx: HelperContext, root: Path, worker: Signer
) -> None:
    import time

    now_ms = int(time.time() * 1000)
    not_after = now_ms + 300_000
    reboot = {"id": "c1", "op": "node.reboot", "target": "", "not_after_ms": now_ms + 600_000}
    expired = {"id": "c0", "op": "gpu.reset", "target": "g", "not_after_ms": now_ms - 60_000}
    _seed_used(root, expired, reboot)
    command = _command(worker, not_after)
    assert _swap(dctx, _command_swap(worker, root, command))["version"] == "1.1.0"
    # Remembered with its not_after, by root's clock in ms (what expired is dropped, what is valid kept).
    assert _used(root) == [
        reboot,
        {"id": UPG, "op": "daemon.upgrade", "target": "", "not_after_ms": not_after},
    ]
    assert generation(root) is None  # a command carries no spec: root's intent state is not written
    _confirm(dctx)
    _forget_record_ids(root)
    assert refused(_swap, dctx, _command_swap(worker, root, command)) == (
        "command-replayed",
        f"daemon.upgrade: root acted on the signed command {UPG!r} already: a command is acted on once "
        "(root remembers it until its not_after)",
    )


def test_a_swap_that_fails_forgets_its_command_so_it_may_come_again(
    dctx: HelperContext, root: Path, worker: Signer
) -> None:
    import time

    now_ms = int(time.time() * 1000)
    reboot = {"id": "c1", "op": "node.reboot", "target": "", "not_after_ms": now_ms + 600_000}
    _seed_used(root, {"id": "c0", "op": "gpu.reset", "target": "g", "not_after_ms": now_ms - 60_000}, reboot)
    releases = root / "usr/lib/bcd/releases"
    releases.symlink_to("/tmp")
    command = _command(worker, 0)
    with pytest.raises(Failed) as info:
        _swap(dctx, _command_swap(worker, root, command))
    assert info.value.reason == "swap"
    assert _used(root) == [reboot]  # the command forgotten, the other kept
    releases.unlink()
    assert _swap(dctx, _command_swap(worker, root, command))["version"] == "1.1.0"
    assert [u["id"] for u in _used(root)] == ["c1", UPG]


def test_a_command_targeting_another_node_is_refused(dctx: HelperContext, root: Path, worker: Signer) -> None:
    far = "n" * 100
    assert refused(_swap, dctx, _command_swap(worker, root, _command(worker, 0, target_node_id=far))) == (
        "wrong-node",
        f"daemon.swap: the signed command targets node {far[:80]!r}, not {NODE!r}",
    )
    assert _used(root) == []
    # Its own node as the target is taken.
    got = _swap(dctx, _command_swap(worker, root, _command(worker, 0, target_node_id=NODE)))
    assert got["version"] == "1.1.0"


def test_an_unbound_helper_takes_no_command_but_a_spec(root: Path, cp: ControlPlane, worker: Signer) -> None:
    from intentkit import b64
    from releasekit import daemon_section, spec_carrier, staged_swap

    config = cp.config_lines(pin_roots=True).split("\n", 1)[1]  # pinned roots, no join record
    c = _daemon_ctx(root, config)
    try:
        args = _command_swap(worker, root, _command(worker, 0, node_id="node-z"))
        args["chain"] = [*args["chain"], b64(cp.command.root)]
        assert refused(_swap, c, args) == (
            "intent-unverifiable",
            "daemon.swap: this helper is bound to no node yet (no join record, no signed spec accepted): "
            "a daemon.upgrade command cannot be checked against it",
        )
        assert _used(root) == []
        args = dict(staged_swap(worker, root, NEW)["args"])
        args["chain"] = [*args["chain"], b64(cp.command.root)]
        args["spec"] = spec_carrier(worker, daemon_section(worker, "1.1.0", NEW), 3)
        assert _swap(c, args)["version"] == "1.1.0"
        # The spec bound the node and its generation is root's floor.
        state = IntentState.decode((root / STATE_PATH.lstrip("/")).read_bytes())
        assert (state.generation, state.node_id) == (3, NODE)
    finally:
        _close(c)


def test_a_swaps_spec_is_roots_floor_also_when_it_only_restarts_the_node(
    dctx: HelperContext, root: Path, worker: Signer
) -> None:
    from releasekit import daemon_section, spec_carrier, staged_swap

    assert _swap(dctx, dict(staged_swap(worker, root, NEW, generation=4)["args"]))["version"] == "1.1.0"
    assert generation(root) == 4
    _confirm(dctx)
    # The installed release again, by a newer spec: a restart onto it, and the newer floor kept.
    args = dict(staged_swap(worker, root, NEW, generation=4)["args"])
    args["spec"] = spec_carrier(worker, daemon_section(worker, "1.1.0", NEW), 6)
    got = _swap(dctx, args)
    assert got["version"] == "1.1.0" and got["restart"] is not None
    assert generation(root) == 6


# --- audit: the rotated files' age rule (AuditLog.export, _deletable, _prune) -------------------------------

AUDIT_DIR = "/var/log/bcd-helper"


def _log(root: Path, **kw: Any) -> Any:
    from bcd_helper.audit import AuditLog

    return AuditLog(root, AUDIT_DIR, syslog=False, max_bytes=600, **kw)


def _write(log: Any, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        log.record(
            peer_pid=100 + i,
            peer_uid=4242,
            op="file.write",
            args={"i": i},
            args_sha256="0" * 64,
            decision="accepted",
            reason="",
            message=f"m{i}",
            duration_ms=1.0,
        )


def _rotated(root: Path) -> list[int]:
    d = root / AUDIT_DIR.lstrip("/")
    return sorted(int(p.name.rsplit(".", 1)[1]) for p in d.glob("audit.log.*"))


def _age(root: Path, number: int, seconds: float) -> None:
    import os
    import time

    path = root / AUDIT_DIR.lstrip("/") / f"audit.log.{number}"
    at = time.time() - seconds
    os.utime(path, (at, at))


def test_an_exported_rotated_file_younger_than_min_age_is_kept_and_goes_once_old(root: Path) -> None:
    log = _log(root, keep=1, min_age_s=3600.0)
    try:
        _write(log, 12)
        held = _rotated(root)
        assert len(held) > 2
        seq = log.head()[0]
        assert log.export()["seq"] == seq
        assert _rotated(root) == held and log.head()[0] == seq  # all too young: no rotation, no anchor
        # The oldest just old enough (to the second), the others young: one rotation deletes it only.
        _age(root, held[-1], 3601)
        log.export()
        assert log.head()[0] == seq + 1  # the anchor
        assert _rotated(root) == [1, *(n + 1 for n in held[:-1])]  # the current file rotated, the oldest gone
    finally:
        log.close()


def test_only_the_oldest_rotated_file_decides_a_rotation(root: Path) -> None:
    log = _log(root, keep=1, min_age_s=3600.0)
    try:
        _write(log, 12)
        held = _rotated(root)
        _age(root, held[0], 7200)  # the newest rotated file old, the oldest young
        seq = log.head()[0]
        log.export()
        assert log.head()[0] == seq and _rotated(root) == held
    finally:
        log.close()


def test_the_age_rule_reads_the_clock_against_the_files_mtime(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from bcd_helper import audit

    log = _log(root, keep=1, min_age_s=100.0)
    try:
        _write(log, 6)
        log.export()  # every line read (the rotation it may make leaves the same files' lines exported)
        oldest = _rotated(root)[-1]
        mtime = os.stat(root / AUDIT_DIR.lstrip("/") / f"audit.log.{oldest}").st_mtime
        clock: list[float] = [mtime + 100.0]
        monkeypatch.setattr(audit, "time", type("T", (), {"time": staticmethod(lambda: clock[0])}))
        assert log._deletable(oldest) is True  # exactly min_age_s old
        clock[0] = mtime + 99.5
        assert log._deletable(oldest) is False
        log._min_age = 0.5  # a fraction of a second is an age too
        clock[0] = mtime + 0.25
        assert log._deletable(oldest) is False
        log._min_age = 0.0  # no age rule: a clock stepped back does not keep the file
        clock[0] = mtime - 10.0
        assert log._deletable(oldest) is True
        assert log._deletable(oldest + 1) is False  # no such file: nothing to delete
    finally:
        log.close()


# --- server: audit.head while the audit log is full (Connection.answer, Guards.flush) -----------------------


@pytest.fixture
def served(plain: HelperContext) -> Iterator[tuple[Any, Any, Any]]:
    """(guards, the node's connection, root's connection) over socket pairs, on `plain`'s audit log."""
    import socket

    from bcd_helper.ops.base import Peer
    from bcd_helper.server import Connection, Guards

    guards = Guards(plain)
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    node = Connection(plain, b, guards)
    node.peer = Peer(node.peer.pid, 4242, 4242)
    root_conn = Connection(plain, d, guards)
    assert root_conn.peer.uid == 0
    try:
        yield guards, node, root_conn
    finally:
        guards.close()
        for s in (a, b, c, d):
            s.close()


def _audit_lines(ctx: HelperContext) -> list[dict[str, Any]]:
    import json

    path = ctx.root / ctx.config.audit_dir.lstrip("/") / "audit.log"
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def test_while_the_log_is_full_the_nodes_audit_head_is_answered_and_counted_not_audited(
    plain: HelperContext, served: tuple[Any, Any, Any]
) -> None:
    guards, node, root_conn = served
    plain.audit._held = plain.audit._keep * 4
    assert plain.audit.full
    before = len(_audit_lines(plain))
    seq, sha = plain.audit.head()
    for _ in range(3):
        assert node.answer({"op": "audit.head", "args": {}}) == {
            "ok": True,
            "result": {"seq": seq, "sha256": sha},
        }
    assert len(_audit_lines(plain)) == before
    assert guards._pending == {4242: {"audit.head (log full)": 3}}
    # Root is never counted: its audit.head gets its line.
    assert root_conn.answer({"op": "audit.head", "args": {}})["ok"] is True
    assert _audit_lines(plain)[-1]["op"] == "audit.head" and guards._pending == {
        4242: {"audit.head (log full)": 3}
    }
    node.answer({"op": "helper.ping", "args": {}})  # refused audit-full, counted too
    # While the log is full the counts wait (round 11): a line a second would outgrow the bound.
    lines = len(_audit_lines(plain))
    guards.flush()
    assert len(_audit_lines(plain)) == lines and guards._pending == {
        4242: {"audit-full": 1, "audit.head (log full)": 3}
    }
    guards.flush(force=True)  # as when the helper stops
    assert guards._pending == {}
    line = _audit_lines(plain)[-1]
    assert (line["op"], line["peer_uid"], line["args"]) == (
        "(suppressed)",
        4242,
        {"count": 4, "reasons": {"audit-full": 1, "audit.head (log full)": 3}},
    )
    # Not all of them refusals: the line says requests.
    assert line["message"] == "4 requests of uid 4242 answered without a line of their own"


def test_the_nodes_audit_head_has_its_line_while_the_log_is_not_full(
    plain: HelperContext, served: tuple[Any, Any, Any]
) -> None:
    guards, node, _ = served
    assert not plain.audit.full
    assert node.answer({"op": "audit.head", "args": {}})["ok"] is True
    last = _audit_lines(plain)[-1]
    assert (last["op"], last["peer_uid"], last["decision"]) == ("audit.head", 4242, "accepted")
    assert guards._pending == {}


# --- usedcommands: forget ----------------------------------------------------------------------------------


def test_forget_drops_what_expired_at_now_and_keeps_the_file_roots_alone(root: Path) -> None:
    import os

    from bcd_helper.usedcommands import UsedCommands

    used = UsedCommands(root)
    used.remember("daemon.upgrade", "c1", ("",), 10_000, 1_000)
    used.remember("node.reboot", "c2", ("",), 5_000, 1_000)
    used.forget("daemon.upgrade", "c1", 5_000)  # c2's not_after is now: expired too
    assert _used(root) == []
    path = root / "var/lib/bcd-hostconfig/helper-commands.json"
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_forget_names_the_op_when_the_memory_cannot_be_read_or_written(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bcd_helper import usedcommands
    from bcd_helper.usedcommands import USED_PATH, UsedCommands
    from bcd_shared.rootpath import RootPathRefused

    used = UsedCommands(root)
    used.remember("daemon.upgrade", "c1", ("",), 10_000, 1_000)

    def refuse(where: Path, path: str, data: bytes, mode: int) -> None:
        raise RootPathRefused(path, f"{path}: refused for the test")

    monkeypatch.setattr(usedcommands, "write_root_only", refuse)
    with pytest.raises(Failed) as info:
        used.forget("daemon.upgrade", "c1", 2_000)
    assert (info.value.reason, info.value.message) == (
        "command-memory",
        f"daemon.upgrade: {USED_PATH}: {USED_PATH}: refused for the test",
    )
    monkeypatch.undo()
    (root / USED_PATH.lstrip("/")).write_text("{")
    with pytest.raises(Failed) as info:
        used.forget("daemon.upgrade", "c1", 2_000)
    assert info.value.reason == "command-memory"
    assert info.value.message.startswith(
        f"daemon.upgrade: root's memory of used commands {USED_PATH} cannot be"
    )


def test_an_answer_reserves_node_bytes_of_the_in_flight_budget_and_root_none(tmp_path: Path) -> None:
    """Connection.reserve_answer (Call.reserve, round 5): a node's large answer takes its bytes from the
    process-wide budget at once or not at all, and holds them on the connection until its answer is
    sent; root's answers are not counted."""
    import socket

    from bcd_helper.server import Connection, Guards, Peer

    ctx = context(make_root(tmp_path))
    guards = Guards(ctx)
    a, b = socket.socketpair()
    try:
        c = Connection(ctx, b, guards)
        budget = guards.budget
        total = budget.total
        c.peer = Peer(1, 0, 0)
        assert c.reserve_answer(total + 1) is True
        assert (budget.used, c.reserved) == (0, 0)
        c.peer = Peer(1, 4242, 4242)
        assert c.reserve_answer(1000) is True
        assert (budget.used, c.reserved) == (1000, 1000)
        assert c.reserve_answer(total - 1000) is True
        assert (budget.used, c.reserved) == (total, total)
        assert c.reserve_answer(1) is False  # no room now: refused at once, nothing taken
        assert (budget.used, c.reserved) == (total, total)
    finally:
        a.close()
        b.close()
        guards.close()
        ctx.audit.close()
