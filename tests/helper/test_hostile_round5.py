"""Round 5 of the red team against the root helper (docs/helper.md, "Threat model, round 5"): the node's
account, compromised, against the ops that got the least attention so far (daemon.*, signed commands,
slices, the shared signed-intent state). Attacks that need the process run as a real client of the node's
uid (a forked child dropped to it: SO_PEERCRED sees that uid) against a real `bcd helper serve` over a
simulated host; the others call the real op in process. Each test of a fix failed on the code before it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_shared import wire
from bcd_shared.pki import Purpose
from helperproc import HelperProcess, base_config, make_root
from hostilekit import NODE_GID, NODE_UID, as_node, refused_as_node, verify_audit, vm_hwm_kib
from intentkit import ControlPlane, Signer, access_body, access_doc, b64, hold_text, intent, intent_state
from releasekit import LINK, NODE_ID, daemon_section, spec_carrier, stage, swap_doc

V20 = b"#!/bin/sh\necho bcd 2.0.0\n"
V21 = b"#!/bin/sh\necho bcd 2.1.0\n"


@pytest.fixture
def release_host(tmp_path: Path, cp: ControlPlane) -> Iterator[tuple[Path, str]]:
    """A simulated host bound to NODE_ID by root's join record (cp's roots), a packaged bcd installed;
    yields the root and the helper's config (tests start and restart the helper themselves)."""
    root = make_root(tmp_path)
    cp.write_record(root, NODE_ID, cp.bundle(2))
    (root / "usr/lib/bcd").mkdir(parents=True, exist_ok=True)
    (root / LINK).write_bytes(b"#!/bin/sh\necho packaged\n")
    (root / LINK).chmod(0o755)
    yield root, cp.config_lines() + base_config(node_uid=NODE_UID, node_gid=NODE_GID)


def _swap(h: HelperProcess, signer: Signer, version: str, data: bytes, generation: int) -> dict[str, Any]:
    section = daemon_section(signer, version, data)
    name = stage(h.root, f"bcd-{version}", data)
    return as_node(h, swap_doc(signer, section, name, spec=spec_carrier(signer, section, generation)))


def test_round5_a_spec_forwarded_to_daemon_swap_sets_the_floor_of_every_signed_op(
    release_host: tuple[Path, str], cp: ControlPlane
) -> None:
    """The node forwards the signed spec of generation 10 to `daemon.swap` only (root swapped in the
    release it names), then hands `access.apply` (or host.unit, the hold writes, libvirt.*, ch.*) the
    generation-5 spec it kept: root's floor for those was helper-intent.json, which daemon.swap never
    wrote, so generation 5 was accepted after 10, also across a helper restart (an access section the
    newer spec revoked applied again). daemon.swap now checks its spec with the same rules and writes
    the same state before its effect: the older spec is `stale-generation` everywhere, and the state
    survives the restart."""
    root, config = release_host
    worker = cp.command.leaf()
    h = HelperProcess(root, config)
    try:
        out = _swap(h, worker, "2.0.0", V20, generation=10)
        assert out["ok"] is True, out
        assert as_node(h, {"op": "daemon.confirm", "args": {"version": "2.0.0"}})["ok"] is True
        assert intent_state(root)["generation"] == 10
    finally:
        h.stop()
    h = HelperProcess(root, config)  # a restart: root's floor must come from its files
    try:
        older = intent(worker, access_body(NODE_ID, 5, empty=True))
        refused_as_node(h, access_doc(older), "stale-generation")
        same = intent(worker, access_body(NODE_ID, 10, empty=True))
        assert as_node(h, access_doc(same))["ok"] is True
        verify_audit(h)
    finally:
        h.stop()


def _upgrade_command(signer: Signer, section: wire.DaemonSection, **fields: Any) -> dict[str, str]:
    """A signed daemon.upgrade command naming `section` for NODE_ID; `fields` override the body's."""
    from bcd_shared.wire.strict import type_url

    request = wire.DaemonUpgradeRequest(
        version=section.version,
        url=section.url,
        sha256=section.sha256,
        signature=section.signature,
        rollback=section.rollback,
    )
    body: dict[str, Any] = {
        "id": "01J0000000000000000000UPG5",
        "node_id": NODE_ID,
        "seq": 1,
        "kind": "daemon.upgrade",
        "payload": wire.ProtoAny(type_url=type_url(wire.DaemonUpgradeRequest), value=bytes(request)),
        "lane": wire.Lane.CONTROL,
        "not_after": int(time.time() * 1000) + 600_000,
        "retry_safe": True,
        "self_terminating": True,
        **fields,
    }
    data = bytes(wire.CommandBody(**body))
    return {"body": b64(data), "signature": b64(signer.key.sign(Purpose.COMMAND, data))}


def test_round5_a_daemon_upgrade_command_for_another_target_node_is_refused(
    release_host: tuple[Path, str], cp: ControlPlane
) -> None:
    """A signed `daemon.upgrade` command sent to this node but targeting another (`target_node_id`, set
    when a node acts on another's behalf): gpu.reset and node.reboot refuse such a command (`wrong-node`,
    check_command), daemon.swap compared `node_id` only and swapped the release in. It is now refused the
    same way, before the artifact is read; the command for this node itself still swaps."""
    root, config = release_host
    worker = cp.command.leaf()
    h = HelperProcess(root, config)
    try:
        section = daemon_section(worker, "2.1.0", V21)
        name = stage(root, "bcd-2.1.0", V21)
        elsewhere = _upgrade_command(worker, section, target_node_id="node-b")
        refused_as_node(h, swap_doc(worker, section, name, command=elsewhere), "wrong-node", "node-b")
        mine = _upgrade_command(worker, section, target_node_id=NODE_ID)
        out = as_node(h, swap_doc(worker, section, name, command=mine))
        assert out["ok"] is True and out["result"]["version"] == "2.1.0", out
        assert (root / LINK).read_bytes() == V21
        verify_audit(h)
    finally:
        h.stop()


def test_round5_the_hold_slices_root_starts_for_the_node_are_bounded(tmp_path: Path) -> None:
    """`slice.apply` is unsigned (a slice only bounds a hold) and started any well-formed
    `bcd-alloc-<id>.slice` the node named: a node naming a new id each time made systemd load a unit and
    the kernel a cgroup for every one, without limit (PID 1's memory; DLV-PRIV's "bounded per peer").
    Root now counts the hold slices already under bcd-alloc.slice itself: past MAX_SLICES a new one is
    refused `too-many-slices` before any systemctl runs; a slice that exists is still applied (its
    limits changed), and one more is taken once a slice is gone."""
    from bcd_helper.ops.slices import MAX_SLICES, SliceApply, slice_apply
    from opskit import call, context, programs, refused

    root = make_root(tmp_path)
    ctx = context(root)
    try:
        parent = root / "sys/fs/cgroup/bcd.slice/bcd-alloc.slice"
        for i in range(MAX_SLICES):
            (parent / f"bcd-alloc-a{i}.slice").mkdir(parents=True)
        (parent / "cgroup.procs").write_text("")  # the kernel's files beside them are not slices
        assert refused(slice_apply, call(ctx), SliceApply("bcd-alloc-new.slice", cpus="0")) == (
            "too-many-slices",
            f"slice.apply: root keeps at most {MAX_SLICES} hold slices under bcd-alloc.slice: "
            "bcd-alloc-new.slice is not one of them",
        )
        assert programs(ctx).runs == []
        slice_apply(call(ctx), SliceApply("bcd-alloc-a7.slice", cpus="0"))
        assert programs(ctx).runs[0] == ("systemctl", "start", "bcd-alloc-a7.slice")
        (parent / "bcd-alloc-a0.slice").rmdir()
        slice_apply(call(ctx), SliceApply("bcd-alloc-new.slice"))
        assert programs(ctx).runs[-1] == ("systemctl", "start", "bcd-alloc-new.slice")
    finally:
        ctx.audit.close()


def _pings(h: HelperProcess, n: int) -> dict[str, int]:
    """`n` pings from the node's uid on one connection; the answers counted by outcome."""
    import json

    from hostilekit import connect_as, frame, read_answer

    sock, _ = connect_as(h, NODE_UID, NODE_GID)
    out: dict[str, int] = {}
    with sock:
        for _ in range(n):
            sock.sendall(frame(json.dumps({"op": "helper.ping", "args": {}}).encode()))
            answer = read_answer(sock)
            assert answer is not None
            key = "ok" if answer["ok"] else answer["reason"]
            out[key] = out.get(key, 0) + 1
    return out


def test_round5_the_node_cannot_rotate_away_a_line_it_read_but_never_reported(tmp_path: Path) -> None:
    """The node makes a request it wants forgotten, reads `audit.head` (which marks every line up to it
    exported) and never reports that head; then it floods pings, which are accepted, so no refusal rate
    limits them: rotation deleted the file holding the line within seconds, before the control plane
    could miss a head. Root now deletes a rotated file only when it was exported *and* its newest line
    is older than `[helper] audit_min_age_s` (default one day): the flood ends in `audit-full` (root still
    served) with the line kept; files past that age go at the next rotation as before."""
    import os

    from bcd_helper.audit import verify_chain
    from helperproc import AUDIT_DIR
    from hostilekit import connect_as, frame, read_answer

    root = make_root(tmp_path)
    h = HelperProcess(root, base_config(extra="audit_max_bytes = 16384\naudit_keep = 2\n"))
    audit = root / AUDIT_DIR.lstrip("/")
    try:
        marked = as_node(h, {"op": "file.remove", "args": {"kind": "round5-marker", "id": "m"}})
        assert marked["reason"] == "bad-kind", marked
        (mark,) = [e for e in h.audit_lines() if e["args"].get("kind") == "round5-marker"]
        assert _pings(h, 150) == {"ok": 150}  # the line's file rotated: every line of it read below
        head = as_node(h, {"op": "audit.head", "args": {}})
        assert head["ok"] is True and head["result"]["seq"] >= mark["seq"]
        counts = _pings(h, 700)
        assert counts.get("audit-full", 0) > 0, counts  # held files reached the cap: the node stops
        kept = b"".join(p.read_bytes() for p in sorted(audit.glob("audit.log*")))
        assert f'"seq":{mark["seq"]},'.encode() in kept
        assert h.raw({"op": "helper.ping", "args": {}})["ok"] is True  # root's socket: still served
        # While the log is full the node's way out, audit.head, is answered but no longer a line each: else
        # a flood of heads would grow files the age rule keeps, without bound.
        before = sorted((p.name, p.stat().st_size) for p in audit.glob("audit.log*"))
        sock, _ = connect_as(h, NODE_UID, NODE_GID)
        with sock:
            for _ in range(300):
                sock.sendall(frame(b'{"op":"audit.head","args":{}}'))
                answer = read_answer(sock)
                assert answer is not None and answer["ok"] is True, answer
        after = sorted((p.name, p.stat().st_size) for p in audit.glob("audit.log*"))
        assert len(after) == len(before)
        assert sum(size for _, size in after) - sum(size for _, size in before) < 4096  # a (suppressed) line
        # A day later (the files' times set back): the exported files go at the node's next head.
        for p in audit.glob("audit.log.*"):
            os.utime(p, (p.stat().st_atime - 2 * 86400, p.stat().st_mtime - 2 * 86400))
        assert as_node(h, {"op": "audit.head", "args": {}})["ok"] is True
        assert len(list(audit.glob("audit.log.*"))) <= 2
        assert _pings(h, 20) == {"ok": 20}
        result = verify_chain(audit)
        assert result.ok, result.problem
    finally:
        h.stop()


def test_round5_an_unbound_helper_takes_no_daemon_upgrade_command(tmp_path: Path, cp: ControlPlane) -> None:
    """`command_root_sha256` pins the roots and no join record (nor any signed spec yet) binds this
    helper to a node: daemon.swap took a signed `daemon.upgrade` command for any node of the control
    plane (another node's canary release, say) where gpu.reset and node.reboot refuse every command
    (`intent-unverifiable`, check_command). It is refused the same way now; a signed spec, which binds
    the node on first use as host.unit's does, still carries a release."""
    from bcd_shared.pki import root_pin

    root = make_root(tmp_path)
    (root / "usr/lib/bcd").mkdir(parents=True, exist_ok=True)
    config = f'command_root_sha256 = "{root_pin(cp.command.root)}"\n' + base_config()
    worker = cp.command.leaf()
    h = HelperProcess(root, config)
    try:
        section = daemon_section(worker, "2.1.0", V21)
        name = stage(root, "bcd-2.1.0", V21)
        doc = swap_doc(worker, section, name, command=_upgrade_command(worker, section, node_id="node-z"))
        doc["args"]["chain"].append(b64(cp.command.root))
        refused_as_node(h, doc, "intent-unverifiable", "bound to no node")
        doc = swap_doc(worker, section, name, spec=spec_carrier(worker, section, 3))
        doc["args"]["chain"].append(b64(cp.command.root))
        out = as_node(h, doc)
        assert out["ok"] is True and out["result"]["version"] == "2.1.0", out
        assert intent_state(root)["node_id"] == NODE_ID
    finally:
        h.stop()


GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"


def _devices_spec(signer: Signer, generation: int, *, limits: dict[str, Any] | None = None) -> dict[str, Any]:
    """The signed spec: allocation a1 holds GPU1 (reservation r1) with one extra env line, and with
    `limits` a sliced hold with those limits."""
    section = wire.DevicesSection(
        assignments=[
            wire.DeviceAssignment(
                allocation_id="a1",
                reservation_id="r1",
                binding=wire.Binding.HOLD,
                devices=[wire.DeviceAtom(id=GPU1, device_class="gpu")],
                env=["SLURM_GRES=gpu:1"] if limits is None else [],
                limits=wire.DeviceLimits(**limits) if limits is not None else None,
            )
        ]
    )
    body = bytes(
        wire.DesiredStateBody(
            node_id=NODE_ID,
            generation=generation,
            spec_hash=f"d{generation}",
            full=wire.NodeSpec(devices=section),
        )
    )
    return intent(signer, body)


def _env_write(lines: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    content = "".join(f"{line}\n" for line in lines)
    return {
        "op": "file.write",
        "args": {"kind": "allocation-env", "id": "a1", "content": content, "intent": spec},
    }


def _hold_write(env: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    content = hold_text("a1", [(GPU1, None)], env, generation=2)  # a1 unsliced: no cgroup-parent
    return {"op": "file.write", "args": {"kind": "cdi", "id": "a1", "content": content, "intent": spec}}


def test_round5_hold_env_is_bound_to_the_signed_assignment(
    release_host: tuple[Path, str], cp: ControlPlane
) -> None:
    """With roots, a hold's files were bound to the signed devices section by allocation and atoms, but
    their env was the node's: `LD_PRELOAD=` (or `BASH_ENV=`, `PATH=`) in /run/bcd/allocations/a1.env,
    which a workload manager reads into the jobs it starts (as root, for a prolog), or
    `NVIDIA_VISIBLE_DEVICES=all` in the CDI hold, which NVIDIA's runtime hook (root) reads to hand a
    container every GPU of the host, were written as the node sent them. Root now takes only the env the
    signed assignment makes: the keys bcd sets itself with the values root derives (BCD_ALLOCATION_ID,
    BCD_CGROUP_PARENT `bcd-alloc-<id>.slice`, BCD_RESERVATION_ID the signed one, CUDA_MPS_PIPE_DIRECTORY
    `/run/nvidia-mps`, NVIDIA_VISIBLE_DEVICES naming only the allocation's own GPUs or MIG devices) and,
    in the env file, the assignment's own signed lines; anything else is `env-outside`, nothing written.
    What the planner writes is taken."""
    root, config = release_host
    worker = cp.command.leaf()
    spec = _devices_spec(worker, 2)
    own = ["BCD_ALLOCATION_ID=a1", "BCD_CGROUP_PARENT=bcd-alloc-a1.slice"]
    visible = f"NVIDIA_VISIBLE_DEVICES={GPU1}"
    h = HelperProcess(root, config)
    try:
        for lines in (
            [*own, "LD_PRELOAD=/var/lib/bcd/x.so"],
            [*own, "BCD_RESERVATION_ID=r9", visible],
            [*own, "BCD_RESERVATION_ID=r1", "NVIDIA_VISIBLE_DEVICES=all"],
            [*own, "BCD_RESERVATION_ID=r1", f"NVIDIA_VISIBLE_DEVICES={GPU1},{GPU2}"],
            ["BCD_ALLOCATION_ID=a1", "BCD_CGROUP_PARENT=bcd-alloc-a2.slice"],
            [*own, "CUDA_MPS_PIPE_DIRECTORY=/tmp/mps"],
            [*own, "SLURM_GRES=gpu:8"],
        ):
            refused_as_node(h, _env_write(lines, spec), "env-outside")
        for env in (
            [*own, "LD_PRELOAD=/var/lib/bcd/x.so"],
            [*own, "NVIDIA_VISIBLE_DEVICES=all"],
            [*own, "NVIDIA_VISIBLE_DEVICES=0,1"],
        ):
            refused_as_node(h, _hold_write(env, spec), "env-outside")
        planned = [*own, "BCD_RESERVATION_ID=r1", visible, "SLURM_GRES=gpu:1"]
        assert as_node(h, _env_write(planned, spec))["ok"] is True
        assert as_node(h, _hold_write([*own, visible], spec))["ok"] is True
        assert (root / "run/bcd/allocations/a1.env").read_text() == "".join(f"{x}\n" for x in planned)
        verify_audit(h)
    finally:
        h.stop()


def test_round5_roots_hold_env_rule_takes_what_the_node_plans() -> None:
    """The env rule above must take every hold the node's devices planner writes (else a signed node
    could bind no hold): whole GPUs, MIG devices (one without a MIG UUID is device-missing), slots with
    MPS, a sliced hold with limits, a Kubernetes hold, an assignment with its own env lines, with and
    without the vendor spec whose common env the planner copies into the CDI hold (as NVIDIA's toolkit
    writes it: NVIDIA_CTK_DEBUG). The keys bcd sets are the planner's RESERVED_ENV_KEYS, and the MPS
    directory is its."""
    import json

    from bcd_agent.inventory.gpus import Gpu, GpuHealth, GpuInventory, MigDevice
    from bcd_agent.sections.devices import plan as planner
    from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, Limits
    from bcd_helper.ops.files import HOLD_ENV_KEYS, MPS_PIPE_DIRECTORY, MigName, _check_signed_env
    from bcd_shared import cdi

    assert HOLD_ENV_KEYS == planner.RESERVED_ENV_KEYS
    assert MPS_PIPE_DIRECTORY == planner.MPS_PIPE_DIRECTORY
    a, b = "GPU-aaaaaaaa-0000-4000-8000-000000000001", "GPU-bbbbbbbb-0000-4000-8000-000000000002"

    def gpu(i: int, uuid: str, migs: tuple[MigDevice, ...] = ()) -> Gpu:
        return Gpu(i, uuid, "NVIDIA H200", f"00000000:{i + 1:02X}:00.0", i, i, 143771, bool(migs), migs,
                   GpuHealth(0, False, False))  # fmt: skip

    migs_ = (MigDevice(1, 0, "MIG-aaaaaaaa-1111-5111-8111-000000000001", "3g.71gb", 0),
             MigDevice(2, 0, None, "1g.18gb", 1))  # fmt: skip
    inventory = GpuInventory((gpu(0, a, migs_), gpu(1, b)), "590.48.01", True)
    vendor_doc = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {"name": n, "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}}
            for i, n in ((0, "0"), (0, a), (1, "1"), (1, b))
        ],
        "containerEdits": {
            "env": ["NVIDIA_CTK_DEBUG=false", "NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl"}],
        },
    }
    vendor = cdi.parse_vendor_spec(json.dumps(vendor_doc).encode())
    vendor_env = vendor.common_edits["env"]

    def migs() -> dict[str, MigName]:  # root's nvidia-smi: the same MIG devices
        return {f"{a}/gi{m.gpu_instance}/ci{m.compute_instance}": MigName(m.uuid, frozenset()) for m in migs_}

    def assignment(binding: str, *devs: tuple[str, str], **kw: Any) -> DeviceAssignment:
        refs = tuple(DeviceRef(d, c) for d, c in devs)
        return DeviceAssignment("al1", "rsv1", binding, refs, kw.get("limits"), kw.get("env", ()))

    cases = [
        assignment("BINDING_HOLD", (a, "gpu"), (b, "gpu")),
        assignment("BINDING_HOLD", (f"{a}/gi1/ci0", "gpu.mig"), (f"{a}/gi2/ci0", "gpu.mig")),
        assignment("BINDING_HOLD", (f"{a}/gi1/ci0", "gpu.mig")),
        assignment("BINDING_HOLD", (b, "gpu"), (f"{a}/gi1/ci0", "gpu.mig")),
        assignment("BINDING_HOLD", (f"{b}/s0", "gpu.slot"), (f"{b}/s1", "gpu.slot")),
        assignment("BINDING_HOLD", (b, "gpu"), limits=Limits(cpus="0-3"), env=("SLURM_GRES=gpu:1", "X=")),
        assignment("BINDING_KUBERNETES", (a, "gpu"), limits=Limits(memory_bytes=1 << 30)),
    ]
    copied = 0
    for obs in (
        planner.Observed(inventory=inventory, mps_dir=True),
        planner.Observed(inventory, vendor=vendor),
    ):
        for asg in cases:
            atoms = planner._atoms_of(asg)
            if any(planner.missing(x, inventory) for x in atoms):
                assert "/gi2/ci0" in asg.devices[1].id  # a MIG device without a UUID: device-missing,
                continue  # no hold file written (round 6: its parent GPU is never named instead)
            doc, lines = planner.hold_files(asg, atoms, 3, obs)
            env = (doc.get("containerEdits") or {}).get("env") or []
            _check_signed_env("cdi", "al1", env, asg, vendor_env if obs.vendor is not None else (), migs)
            _check_signed_env("allocation-env", "al1", list(lines), asg, (), migs)
            copied += "NVIDIA_CTK_DEBUG=false" in env
    assert copied == 5  # the vendor's common env was in every hold but the Kubernetes one


V15 = b"#!/bin/sh\necho bcd 1.5.0\n"


def test_round5_a_daemon_upgrade_command_is_used_once_until_its_not_after(
    release_host: tuple[Path, str], cp: ControlPlane
) -> None:
    """daemon.swap remembered the ids of the last 64 daemon.upgrade commands only (in its release record):
    once 64 newer ones had been used, an older command still before its `not_after` was fresh again.
    Replayed, a signed rollback command (`rollback: true`, naming 1.5.0) took the host back below the
    releases installed since. daemon.swap now also keeps each command id in root's memory of used
    commands (helper-commands.json, as gpu.reset and node.reboot do) until its `not_after`: the replay is
    `command-replayed` however many commands came after."""
    import json

    from releasekit import RECORD

    root, config = release_host
    worker = cp.command.leaf()
    h = HelperProcess(root, config)
    try:
        assert _swap(h, worker, "2.0.0", V20, generation=1)["ok"] is True
        assert as_node(h, {"op": "daemon.confirm", "args": {"version": "2.0.0"}})["ok"] is True
        back = daemon_section(worker, "1.5.0", V15, rollback=True)
        name = stage(root, "bcd-1.5.0", V15)
        rollback = swap_doc(
            worker, back, name, command=_upgrade_command(worker, back, id="01JROLLBACK0000000000000001")
        )
        out = as_node(h, rollback)
        assert out["ok"] is True, out
        assert as_node(h, {"op": "daemon.confirm", "args": {"version": "1.5.0"}})["ok"] is True
        assert _swap(h, worker, "2.1.0", V21, generation=2)["ok"] is True
        assert as_node(h, {"op": "daemon.confirm", "args": {"version": "2.1.0"}})["ok"] is True
        # 64 daemon.upgrade commands later (their ids are all the record keeps):
        record = json.loads((root / RECORD).read_text())
        record["used_commands"] = [f"01JLATER{i:018d}" for i in range(64)]
        (root / RECORD).write_text(json.dumps(record, sort_keys=True, indent=1) + "\n")
        refused_as_node(h, rollback, "command-replayed")
        assert (root / LINK).read_bytes() == V21
    finally:
        h.stop()


def test_round5_a_failed_swap_forgets_its_daemon_upgrade_command(tmp_path: Path) -> None:
    """The memory's `forget` (daemon.swap's swap failed, the previous release still installed) drops that
    command only, so the retry-safe command may come again; other entries stay, replays of them refused."""
    from bcd_helper.ops.base import Refused
    from bcd_helper.usedcommands import UsedCommands

    root = make_root(tmp_path)
    used = UsedCommands(root)
    used.remember("daemon.upgrade", "c1", ("",), 10_000, 1_000)
    used.remember("daemon.upgrade", "c2", ("",), 10_000, 1_000)
    used.remember("node.reboot", "c1", ("",), 10_000, 1_000)
    used.forget("daemon.upgrade", "c1", 2_000)
    used.check("daemon.upgrade", "c1", ("",), 2_000)
    for op, ident in (("daemon.upgrade", "c2"), ("node.reboot", "c1")):
        with pytest.raises(Refused) as info:
            used.check(op, ident, ("",), 2_000)
        assert info.value.reason == "command-replayed"


def test_round5_with_roots_a_hold_slice_takes_only_the_signed_limits(
    release_host: tuple[Path, str], cp: ControlPlane
) -> None:
    """`slice.apply` was unsigned: with command-signing roots the node could set any limits on a live
    hold's slice (`MemoryMax=4096`, `CPUQuota=1%`: the tenant's workload OOM-killed or starved) or lift
    the booked ones (reset `memory_bytes`: the hold outgrows what capacity placed), and start slices for
    allocations the spec does not have. With roots, slice.apply now carries the signed spec like the hold
    writes: without it `intent-required`; a slice of an allocation the devices section does not slice
    `not-in-spec`; limits or resets other than the assignment's own `spec-mismatch`, before any
    systemctl; the signed limits are applied."""
    root, config = release_host
    worker = cp.command.leaf()
    spec = _devices_spec(worker, 2, limits=dict(cpus="0-3", memory_bytes=1 << 30))
    h = HelperProcess(root, config)

    def apply(
        name: str = "bcd-alloc-a1.slice", signed: dict[str, Any] | None = spec, **args: Any
    ) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": name, **args}
        if signed is not None:
            doc["intent"] = signed
        return {"op": "slice.apply", "args": doc}

    try:
        refused_as_node(h, apply(signed=None, cpus="0-3", memory_bytes=1 << 30), "intent-required")
        refused_as_node(h, apply("bcd-alloc-a9.slice", cpus="0-3"), "not-in-spec")
        refused_as_node(h, apply(cpus="0-3", memory_bytes=4096), "spec-mismatch", "memory_bytes")
        refused_as_node(
            h, apply(cpus="0-3", memory_bytes=1 << 30, cpu_millis=10), "spec-mismatch", "cpu_millis"
        )
        refused_as_node(h, apply(cpus="0-3", reset=["memory_bytes"]), "spec-mismatch", "memory_bytes")
        refused_as_node(h, apply(cpus="0-63", memory_bytes=1 << 30), "spec-mismatch", "cpus")
        out = as_node(h, apply(cpus="0-3", memory_bytes=1 << 30, reset=["cpu_millis"]))
        assert out["ok"] is True, out
        assert "MemoryMax=1073741824" in out["result"]["properties"]
        verify_audit(h)
    finally:
        h.stop()


def test_round5_roots_signed_slice_limits_are_what_the_node_sends() -> None:
    """Root compares slice.apply's limits with `signed_limits` of the signed DeviceLimits; the node's
    HelperExecutor derives what it sends from the same wire limits (limits_from_wire, slice_spec). The two
    must agree, zeros and unset fields included, or a signed node could size no slice."""
    from bcd_agent.sections.devices.apply import HelperExecutor
    from bcd_agent.sections.devices.model import limits_from_wire
    from bcd_agent.sections.devices.slices import slice_spec
    from bcd_helper.ops.slices import signed_limits

    sent: list[dict[str, Any]] = []

    class Client:
        def slice_apply(self, name: str, **args: Any) -> object:
            sent.append(args)
            return None

    executor = HelperExecutor(Client(), lambda: {"body": "b"})  # type: ignore[arg-type]
    for limits in (
        wire.DeviceLimits(cpus="0-3", memory_bytes=1 << 30),
        wire.DeviceLimits(mems="0", cpu_millis=250, hugepages_2mi=0),
        wire.DeviceLimits(cpu_millis=0, memory_bytes=0, hugepages_1gi=4),
        wire.DeviceLimits(hugepages_2mi=512, hugepages_1gi=0),
        wire.DeviceLimits(),
    ):
        executor.apply_slice(slice_spec("a1", limits_from_wire(limits)))
        args = sent.pop()
        assert args.pop("intent") == {"body": "b"} and args.pop("reset") == ()
        assert args == signed_limits(limits), limits


def test_round5_answers_the_node_does_not_read_are_bounded_by_the_in_flight_budget(tmp_path: Path) -> None:
    """The in-flight budget bounded the node's request frames only. 64 connections of the node each ask
    `audit.tail` for 1 MiB and never read the answer: each connection's thread held its answer (the frame
    and the text it was encoded from) for the 10 s an answer may take, and the helper went from ~26 MiB to
    ~229 MiB resident, again every 10 s. audit.tail now takes 4 x max_bytes of the same budget before it
    reads (`Call.reserve`), held until its answer is sent, and an answer is sent from its encoded frame
    alone; without room at once the tail is refused `busy`. The helper's peak stays under a generous
    100 MiB (the bench's bomb target), and root is served throughout."""
    from hostilekit import connect_as, frame, read_answer

    root = make_root(tmp_path)
    h = HelperProcess(root, base_config())
    try:
        with socket_to(h) as s:  # root's pings grow the log past 1 MiB
            for _ in range(3600):
                s.sendall(frame(b'{"op":"helper.ping","args":{}}'))
                assert read_answer(s) is not None
        socks = [connect_as(h, NODE_UID, NODE_GID)[0] for _ in range(64)]
        try:
            for sk in socks:
                sk.sendall(frame(b'{"op":"audit.tail","args":{"max_bytes":1048576}}'))  # never read
            time.sleep(3)
            assert h.raw({"op": "helper.ping", "args": {}})["ok"] is True
            assert vm_hwm_kib(h.proc.pid) < 100 * 1024
            answers = [read_answer(sk) for sk in socks]
        finally:
            for sk in socks:
                sk.close()
        reasons = [a["result"]["truncated"] if a["ok"] else a["reason"] for a in answers if a is not None]
        assert reasons.count(True) >= 1 and set(reasons) <= {True, "busy"}, reasons
    finally:
        h.stop()


def socket_to(h: HelperProcess) -> Any:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(h.socket_path)
    return s
