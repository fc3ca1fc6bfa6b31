"""Round 6's findings left open, closed (docs/helper.md, "Threat model, round 6", rows 9 to 13): the node's
account, compromised, against a real `bcd helper serve` over a simulated host, as a real unprivileged client
(a `useradd` account through `setpriv`, realnode.RealNode, or a forked child dropped to the node's uid,
hostilekit.as_node: SO_PEERCRED sees that uid), with root's join record (command-signing roots) unless the
test says otherwise. Each test failed on the code before its fix. The tests on `signed_node` share one helper
and run in file order (the signed generations grow from test to test); the in-process tests at the end pin
the rules' edges."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_shared import cdi, wire
from bcd_shared.system import CommandResult
from bcd_simhost import sim_system
from hostilekit import NODE_GID, NODE_UID, SignedHost, as_node, ch_instance, refused_as_node, vm_hwm_kib
from intentkit import ControlPlane, devices_spec, hold_text, intent
from realnode import RealNode
from test_signed_holds import NODE, cdi_doc, env_doc

GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"  # the simulated host's GPU 0 (/dev/nvidia0)
GPU2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"
GIB = 1 << 30


@pytest.fixture(scope="module")
def signed_node(cp: ControlPlane) -> Iterator[RealNode]:
    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    yield node
    node.close()


def _assignment(
    ident: str, gpus: list[str], limits: wire.DeviceLimits | None = None, binding: int = 1
) -> wire.DeviceAssignment:
    return wire.DeviceAssignment(
        allocation_id=ident,
        reservation_id="r1",
        binding=wire.Binding(binding),
        devices=[wire.DeviceAtom(id=g, device_class="gpu") for g in gpus],
        limits=limits,
    )


def _spec(cp: ControlPlane, generation: int, *assignments: wire.DeviceAssignment) -> dict[str, Any]:
    body = devices_spec(NODE, generation, wire.DevicesSection(assignments=list(assignments)))
    return intent(cp.command.leaf(), body)


def _sliced_hold(ident: str, gpu: str) -> str:
    parent = f"bcd-alloc-{ident}.slice"
    env = [f"BCD_ALLOCATION_ID={ident}", f"BCD_CGROUP_PARENT={parent}"]
    return hold_text(ident, [(gpu, None)], env, cgroup_parent=parent)


def _slice_apply(name: str, spec: dict[str, Any], **limits: Any) -> dict[str, Any]:
    return {"op": "slice.apply", "args": {"name": name, **limits, "intent": spec}}


def test_round6b_a_sliced_hold_is_written_only_into_a_slice_enforcing_its_signed_limits(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """Round 6 (row 6) wrote a signed sliced hold once root saw its slice's cgroup, whatever limits the
    slice enforced: a slice systemd made for a job a workload manager placed under that parent (no limits
    at all), one whose files were changed since, or one still at an older spec's limits after the spec
    changed them (the node withholding the newer `slice.apply`) all took the hold. Now root reads the
    slice's cgroup files itself and compares them with the signed assignment's limits, as the node's
    planner does (bcd_shared.slicelimits): `slice-limits`, naming the limit and the file."""
    name = "bcd-alloc-s1.slice"
    system = sim_system(signed_node.root)
    cgroup = signed_node.root / f"sys/fs/cgroup/bcd.slice/bcd-alloc.slice/{name}"
    limits = wire.DeviceLimits(cpu_millis=1500, memory_bytes=GIB)
    spec = _spec(cp, 10, _assignment("s1", [GPU1], limits))
    hold = cdi_doc("s1", _sliced_hold("s1", GPU1), spec)
    env = env_doc(
        "s1", f"BCD_CGROUP_PARENT={name}\nBCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES={GPU1}\n", spec
    )
    # The slice systemd makes for a job placed under a parent that is not there: no limits.
    assert system.run(["systemctl", "start", name]).ok
    signed_node.refused(hold, "slice-limits", "limits.cpu_millis")
    signed_node.refused(env, "slice-limits", "cpu.max")
    signed_node.ok(_slice_apply(name, spec, cpu_millis=1500, memory_bytes=GIB))
    signed_node.ok(hold)
    signed_node.ok(env)
    # Its memory limit lifted since (by any path but slice.apply): the hold is not written again.
    (cgroup / "memory.max").write_text("max\n")
    signed_node.refused(hold, "slice-limits", "limits.memory_bytes")
    signed_node.ok(_slice_apply(name, spec, cpu_millis=1500, memory_bytes=GIB))
    # The spec doubles the memory; the node rewrites the hold under it but keeps the old slice.
    newer = _spec(cp, 11, _assignment("s1", [GPU1], wire.DeviceLimits(cpu_millis=1500, memory_bytes=2 * GIB)))
    signed_node.refused(cdi_doc("s1", _sliced_hold("s1", GPU1), newer), "slice-limits", "memory.max")
    signed_node.ok(_slice_apply(name, newer, cpu_millis=1500, memory_bytes=2 * GIB))
    signed_node.ok(cdi_doc("s1", _sliced_hold("s1", GPU1), newer))
    # A limit the slice enforces and the spec does not set is not the assignment's either.
    (cgroup / "cpuset.cpus").write_text("0-1\n")
    signed_node.refused(cdi_doc("s1", _sliced_hold("s1", GPU1), newer), "slice-limits", "limits.cpus")
    released = _spec(cp, 12)  # the next tests' GPUs free
    for kind in ("cdi", "allocation-env"):
        signed_node.ok({"op": "file.remove", "args": {"kind": kind, "id": "s1", "intent": released}})


def _kube_hold(ident: str, gpu: str, edits: dict[str, Any] | None, env: list[str]) -> str:
    doc = cdi.build_hold_spec(
        allocation_id=ident,
        reservation_id="r1",
        generation=1,
        kubernetes=True,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(gpu, None)],
        env=env,
        vendor=None,
    )
    if edits is not None:
        doc["devices"][0]["containerEdits"] = edits
    return cdi.encode_spec(doc).decode()


def test_round6b_a_kubernetes_hold_is_bare_so_a_pod_gets_only_its_own_device(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """The seeds' Kubernetes binding: the hold's CDI spec carries no NVIDIA_VISIBLE_DEVICES and no vendor
    edits, since a pod may get only part of the hold and the device plugin sets its own. Root took a
    Kubernetes hold with `NVIDIA_VISIBLE_DEVICES=<its GPUs>` in the spec-level env (which every pod
    given any one of the hold's devices gets: NVIDIA's hook then hands it all of them) and with the
    vendor's device edits. Now a Kubernetes hold is bare: `env-outside`, `atoms-outside`. Its env file
    still names its GPUs (the seeds), and what the planner writes is taken."""
    spec = _spec(cp, 20, _assignment("k1", [GPU1, GPU2], binding=2))
    own = ["BCD_ALLOCATION_ID=k1"]
    visible = f"NVIDIA_VISIBLE_DEVICES={GPU1},{GPU2}"

    def hold(edits: dict[str, Any] | None, env: list[str]) -> dict[str, Any]:
        doc = json.loads(_kube_hold("k1", GPU1, edits, env))
        doc["devices"].append(json.loads(_kube_hold("k1", GPU2, None, env))["devices"][0])
        doc["annotations"]["bcd.dev/reservation-id"] = "r1"
        return cdi_doc("k1", json.dumps(doc), spec)

    signed_node.refused(hold(None, [*own, visible]), "env-outside", "Kubernetes")
    signed_node.refused(hold(None, [*own, f"NVIDIA_VISIBLE_DEVICES={GPU1}"]), "env-outside", "Kubernetes")
    nodes = {"deviceNodes": [{"path": "/dev/nvidia0"}]}  # GPU1's own vendor edit: taken for a plain hold
    signed_node.refused(hold(nodes, own), "atoms-outside", "Kubernetes")
    signed_node.ok(hold(None, own))
    signed_node.ok(env_doc("k1", f"BCD_RESERVATION_ID=r1\n{visible}\n", spec))
    released = _spec(cp, 21)
    for kind in ("cdi", "allocation-env"):
        signed_node.ok({"op": "file.remove", "args": {"kind": kind, "id": "k1", "intent": released}})


def test_round6b_a_gpu_an_env_file_names_is_busy_for_a_reset(signed_node: RealNode, cp: ControlPlane) -> None:
    """Root's busy check for gpu.reset read the CDI hold files only. The spec at generation 30 gives GPU2
    to e1; the node writes e1's env file (`NVIDIA_VISIBLE_DEVICES=<GPU2>`, through which NVIDIA's legacy
    runtime hook hands GPU2 to e1's jobs) and no CDI hold, then resets GPU2 with a signed command: reset
    under e1's running jobs. Now the env file makes GPU2 busy (`gpu-busy`, naming it); once it goes the
    same command resets the GPU (a refusal remembers nothing)."""
    from test_signed_commands import command, reset

    worker = cp.command.leaf()
    spec = _spec(cp, 30, _assignment("e1", [GPU2]))
    signed_node.ok(env_doc("e1", f"BCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES={GPU2}\n", spec))
    assert not (signed_node.root / "etc/cdi/bcd-e1.json").exists()
    signed = command(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU2]))
    signed_node.refused(reset([GPU2], signed), "gpu-busy", "e1's env file")
    released = _spec(cp, 31)
    signed_node.ok({"op": "file.remove", "args": {"kind": "allocation-env", "id": "e1", "intent": released}})
    assert signed_node.ok(reset([GPU2], signed))["gpus"][0]["reset"] is True


def _many_assignments(n: int) -> bytes:
    """A DesiredStateBody of `n` empty device assignments (two bytes each on the wire), never signed."""

    def varint(v: int) -> bytes:
        out = b""
        while v > 0x7F:
            out += bytes([(v & 0x7F) | 0x80])
            v >>= 7
        return out + bytes([v])

    assignments = b"\x0a\x00" * n
    devices = b"\x12" + varint(len(assignments)) + assignments
    return b"\x0a\x01n\x10\x01" + b"\x22" + varint(len(devices)) + devices


def test_round6b_an_unsigned_access_spec_is_field_bounded_before_it_is_decoded(tmp_path: Path) -> None:
    """Round 6 (row 4) refused an unsigned access spec before decoding it, unless root's config sets
    `[helper] unsigned_access = true` (development only): there the node's unverified body was still
    decoded whole, 1.4 M empty assignments (2.7 MiB, one 4 MiB frame) ~340 MiB resident for one request.
    Now the strict walk counts the fields before anything is built and refuses past 65,536 (`bad-intent`,
    "fields"): the helper's peak stays under the bench's 100 MiB bomb target. A small unsigned spec is
    still applied there."""
    from helperproc import HelperProcess, base_config, make_root
    from hostilekit import verify_audit
    from intentkit import access_body, access_doc, unsigned

    h = HelperProcess(make_root(tmp_path), base_config(NODE_UID, NODE_GID, extra="unsigned_access = true\n"))
    try:
        body = base64.b64encode(_many_assignments(1_400_000)).decode()
        doc = {"op": "access.apply", "args": {"intent": {"body": body, "signature": ""}}}
        refused_as_node(h, doc, "bad-intent", "more than 65536 fields")
        assert vm_hwm_kib(h.proc.pid) < 100 * 1024
        answer = as_node(h, access_doc(unsigned(access_body("node-x", 1, empty=True))))
        assert answer["ok"] is True, answer
        verify_audit(h)
    finally:
        h.stop()


def test_round6b_an_instance_the_signed_spec_stops_is_never_started(signed_host: SignedHost) -> None:
    """Root refused starting only an instance the signed spec wants DELETED: one it wants STOPPED (or
    leaves UNSPECIFIED) was launched on the node's word, so a node could bring back a VM the control plane
    had stopped (after a reboot, or after a stop) with its GPUs. Now `ch.launch` and `ch.vfio` (and
    `libvirt.start`, `libvirt.restore`) need the latest signed spec to want the instance RUNNING or
    PAUSED (`instance-stopped`); a define of a STOPPED one is still taken."""
    from bcd_shared.chunit import VMM_UID_BASE
    from bcd_simhost.chapi import lay_out_instance

    lay_out_instance(signed_host.root, "vm6", NODE_UID, VMM_UID_BASE + 6)
    h = signed_host.start()

    def op(name: str, generation: int, state: int) -> dict[str, Any]:
        spec = signed_host.signed(
            generation, ch_instance("vm6", desired_state=wire.InstanceDesiredState(state))
        )
        return {"op": name, "args": {"name": "vm6", "intent": spec}}

    refused_as_node(h, op("ch.launch", 1, 3), "instance-stopped", "STOPPED")
    refused_as_node(h, op("ch.launch", 1, 0), "instance-stopped", "UNSPECIFIED")
    refused_as_node(h, op("ch.vfio", 1, 3), "instance-stopped", "STOPPED")
    refused_as_node(h, op("ch.launch", 1, 4), "not-in-spec")  # DELETED, as before
    for generation, state in ((2, 1), (3, 2)):  # RUNNING, PAUSED (started paused)
        answer = as_node(h, op("ch.launch", generation, state))
        assert answer["ok"] is True, answer
        assert as_node(h, {"op": "ch.stop", "args": {"name": "vm6"}})["ok"] is True
    refused_as_node(h, op("ch.launch", 4, 3), "instance-stopped")  # the spec stopped it again


def test_round6b_a_libvirt_instance_the_signed_spec_stops_is_never_started(signed_host: SignedHost) -> None:
    """The same for libvirt: the node defines vm7 under a spec that wants it STOPPED (taken: a stopped
    instance keeps its definition), then `libvirt.start` under that spec is `instance-stopped`; under one
    that wants it RUNNING it starts."""
    from hostilekit import LibvirtVm

    h = signed_host.start()
    vm = LibvirtVm(signed_host, "vm7", "a7")
    signed = vm.signed

    define = {
        "op": "libvirt.define",
        "args": {"name": "vm7", "xml": vm.xml, "intent": signed(1, 3)},
    }
    answer = as_node(h, define)
    assert answer["ok"] is True, answer
    refused_as_node(
        h, {"op": "libvirt.start", "args": {"name": "vm7", "intent": signed(1, 3)}}, "instance-stopped"
    )
    answer = as_node(h, {"op": "libvirt.start", "args": {"name": "vm7", "intent": signed(2, 1)}})
    assert answer["ok"] is True, answer
    # A guest the control plane pauses stays paused: `libvirt.resume` needs a spec that wants it RUNNING
    # (the spec's own word, never the node's; found after round 6b).
    assert as_node(h, {"op": "libvirt.suspend", "args": {"name": "vm7"}})["ok"] is True
    resume = {"op": "libvirt.resume", "args": {"name": "vm7"}}
    answer = as_node(h, resume)
    assert answer["ok"] is False and answer["reason"] != "instance-not-running", answer  # no spec: refused
    for generation, state, name in ((3, 2, "PAUSED"), (4, 3, "STOPPED")):
        refused_as_node(
            h,
            {**resume, "args": {"name": "vm7", "intent": signed(generation, state)}},
            "instance-not-running",
            name,
        )
    answer = as_node(h, {**resume, "args": {"name": "vm7", "intent": signed(5, 1)}})
    assert answer["ok"] is True, answer


# --- in process --------------------------------------------------------------------------------------


class FakeHost:
    """Files by host path and nvidia-smi answers: what root's checks read through `call.system`."""

    def __init__(self, files: dict[str, str], runs: dict[tuple[str, ...], bytes] | None = None) -> None:
        self.files = files
        self.runs = runs or {}
        self.ran: list[tuple[str, ...]] = []

    def read_text(self, path: str) -> str | None:
        return self.files.get(path)

    def read_bytes(self, path: str) -> bytes | None:
        text = self.files.get(path)
        return None if text is None else text.encode()

    def listdir(self, directory: str) -> list[str]:
        prefix = directory + "/"
        return sorted(
            {p[len(prefix) :] for p in self.files if p.startswith(prefix) and "/" not in p[len(prefix) :]}
        )

    def run(self, argv: list[str], timeout: float | None = None) -> CommandResult:
        self.ran.append(tuple(argv))
        out = self.runs.get(tuple(argv))
        return CommandResult(tuple(argv), 0 if out is not None else 1, out or b"", b"")


class FakeCall:
    def __init__(self, host: FakeHost) -> None:
        self.system = host


CG = "/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/bcd-alloc-s1.slice"


def _slice_files(files: dict[str, str] | None = None) -> dict[str, str]:
    """A started slice's cgroup files (the kernel's defaults), `files` (name -> content) over them."""
    base = {
        "cgroup.events": "populated 0\nfrozen 0\n",
        "cpuset.cpus": "\n",
        "cpuset.mems": "\n",
        "cpu.max": "max 100000\n",
        "memory.max": "max\n",
        "memory.high": "max\n",
        "hugetlb.2MB.max": "max\n",
        "hugetlb.1GB.max": "max\n",
        **(files or {}),
    }
    return {f"{CG}/{k}": v for k, v in base.items()}


def _check_slice(files: dict[str, str], limits: wire.DeviceLimits, binding: int = 1) -> str | None:
    """The refusal reason and message of root's slice check for allocation s1, or None when it passes."""
    from bcd_helper.ops.base import Refused
    from bcd_helper.ops.files import _check_slice_started

    try:
        _check_slice_started(FakeCall(FakeHost(files)), "s1", _assignment("s1", [GPU1], limits, binding))  # type: ignore[arg-type]
    except Refused as exc:
        return f"{exc.reason}: {exc.message}"
    return None


def test_round6b_the_slice_check_compares_every_limit_in_the_planners_normal_form() -> None:
    """Each signed limit against the file the kernel shows it in, as the node's planner reads them: a
    cpulist in any order, memory rounded down to the page, the quota as systemd's percent; a limit the
    spec does not set must be the kernel's default; a Kubernetes or unsliced hold is not checked."""
    full = wire.DeviceLimits(
        cpus="3,0-2", mems="0", cpu_millis=1505, memory_bytes=GIB + 100, hugepages_2mi=4, hugepages_1gi=None
    )
    ok = _slice_files(
        {
            "cpuset.cpus": "0-3\n",
            "cpuset.mems": "0\n",
            "cpu.max": "151000 100000\n",
            "memory.max": f"{GIB}\n",
            "memory.high": f"{(GIB + 100) * 9 // 10 // 4096 * 4096}\n",
            "hugetlb.2MB.max": f"{4 * 2 * 1024 * 1024}\n",
            "hugetlb.1GB.max": "0\n",
        }
    )
    assert _check_slice(ok, full) is None
    for name, value, field in (
        ("cpuset.cpus", "0-4\n", "cpus"),
        ("cpuset.cpus", "\n", "cpus"),
        ("cpuset.mems", "0-1\n", "mems"),
        ("cpu.max", "max 100000\n", "cpu_millis"),
        ("cpu.max", "150000 100000\n", "cpu_millis"),
        ("memory.max", "max\n", "memory_bytes"),
        ("memory.high", f"{GIB}\n", "memory_bytes"),
        ("hugetlb.2MB.max", "max\n", "hugepages_2mi"),
        ("hugetlb.1GB.max", "max\n", "hugepages_1gi"),
    ):
        got = _check_slice({**ok, f"{CG}/{name}": value}, full)
        assert got is not None and got.startswith("slice-limits: ") and f"limits.{field} " in got, (name, got)
        assert f"its cgroup's {name} says" in got, got
    # Only the memory limit signed: every other file at the kernel's default.
    memory = wire.DeviceLimits(memory_bytes=GIB)
    only = _slice_files({"memory.max": f"{GIB}\n", "memory.high": f"{GIB * 9 // 10 // 4096 * 4096}\n"})
    assert _check_slice(only, memory) is None
    got = _check_slice({**only, f"{CG}/cpu.max": "50000 100000\n"}, memory)
    assert (
        got is not None and "limits.cpu_millis makes CPUQuota 'unset', its cgroup's cpu.max says '50%'" in got
    )
    # No slice at all: slice-missing, as in round 6; a Kubernetes hold or one without limits: no slice.
    assert (_check_slice({}, memory) or "").startswith("slice-missing: ")
    assert _check_slice({}, memory, binding=2) is None
    assert _check_slice({}, None) is None  # type: ignore[arg-type]


def test_round6b_slicelimits_is_the_planners_normal_form() -> None:
    """The agent's slices module takes the normal form from bcd_shared.slicelimits (root's), so the two
    never disagree on what a slice enforces; first_difference names the first key that differs."""
    from bcd_agent.sections.devices import slices as agent
    from bcd_agent.sections.devices.model import Limits
    from bcd_shared import slicelimits

    assert agent.applied_limits is slicelimits.applied_limits
    spec = agent.slice_spec("a", Limits(cpus="1,0", cpu_millis=1, memory_bytes=5000, hugepages_1gi=1))
    assert spec.properties == (
        ("AllowedCPUs", "1,0"),
        ("CPUQuota", "1%"),
        ("MemoryMax", "5000"),
        ("MemoryHigh", "4500"),
    )
    assert spec.hugetlb_max == ((2048, 0), (1048576, GIB))
    wanted = agent.wanted_limits(spec)
    assert wanted == {
        "AllowedCPUs": "0-1",
        "CPUQuota": "1%",
        "MemoryMax": "4096",
        "MemoryHigh": "4096",
        "hugetlb.2MB": "0",
        "hugetlb.1GB": str(GIB),
    }
    assert slicelimits.first_difference(wanted, dict(wanted)) is None
    assert slicelimits.first_difference(wanted, {**wanted, "MemoryHigh": "0"}) == "MemoryHigh"
    assert slicelimits.first_difference(wanted, {k: v for k, v in wanted.items() if k != "hugetlb.1GB"}) == (
        "hugetlb.1GB"
    )
    assert slicelimits.first_difference({}, {"AllowedMemoryNodes": "0"}) == "AllowedMemoryNodes"


ENV = "/run/bcd/allocations"
L_ARGV = ("nvidia-smi", "-L")
QX_ARGV = ("nvidia-smi", "-q", "-x")


def test_round6b_env_gpus_reads_env_files_as_the_atoms_held_rule_does() -> None:
    """Root's busy view of env files (`busy.env_gpus`): each GPU UUID an env file names is busy, naming
    the file; `void`/`none` nothing; a file that does not parse, `all`, an index or a MIG UUID root's
    nvidia-smi does not list: every GPU; nvidia-smi is asked only for a MIG UUID."""
    from bcd_helper.busy import ALL, Busy, env_gpus

    def busy(*lines: str, alloc: str = "e1", runs: dict[tuple[str, ...], bytes] | None = None) -> Busy:
        text = f"BCD_ALLOCATION_ID={alloc}\n" + "".join(line + "\n" for line in lines)
        host = FakeHost({f"{ENV}/e1.env": text}, runs)
        out = Busy(tuple(env_gpus(host)))  # type: ignore[arg-type]
        if not any("MIG-" in line for line in lines):
            assert host.ran == []
        return out

    got = busy(f"NVIDIA_VISIBLE_DEVICES={GPU1},{GPU2}")
    assert got.reason(GPU1) == f"{GPU1} is named by allocation e1's env file {ENV}/e1.env"
    assert got.reason(GPU2) is not None and got.gpus() == {GPU1, GPU2}
    assert busy("NVIDIA_VISIBLE_DEVICES=void").gpus() == frozenset()
    assert busy("X=1").gpus() == frozenset()
    for value in ("all", "0", f"{GPU1},all", "MIG-unknown"):
        got = busy(f"NVIDIA_VISIBLE_DEVICES={value}")
        assert got.gpus() == {ALL}, value
        assert "cannot be read" in (got.reason(GPU2) or "")
    assert busy(f"NVIDIA_VISIBLE_DEVICES={GPU1}", alloc="other").gpus() == {ALL}  # not its own file
    assert Busy(tuple(env_gpus(FakeHost({})))).gpus() == frozenset()  # type: ignore[arg-type]


def test_round6b_busy_gpus_counts_env_files_beside_holds() -> None:
    """`busy_gpus`, what gpu.reset, libvirt.start/restore, ch.vfio and mig-layout read, counts a GPU an
    env file names, with or without its CDI hold."""
    from bcd_helper.busy import busy_gpus

    host = FakeHost(
        {f"{ENV}/e1.env": f"BCD_ALLOCATION_ID=e1\nNVIDIA_VISIBLE_DEVICES={GPU2}\n"},
        {("nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"): b""},
    )
    got = busy_gpus(host)  # type: ignore[arg-type]
    assert got.gpus() == {GPU2} and "e1's env file" in (got.reason(GPU2) or "")
    assert got.reason(GPU1) is None


def test_round6b_signed_instance_starts_only_what_the_spec_runs(tmp_path: Path, cp: ControlPlane) -> None:
    """`IntentVerifier.signed_instance(starts=True)`: RUNNING and PAUSED pass; STOPPED and UNSPECIFIED are
    `instance-stopped`, naming the state and the generation; DELETED stays `not-in-spec`; without
    `starts` (a define, a save) a STOPPED instance passes."""
    from bcd_helper.ops.base import Refused
    from intentkit import instances_body
    from opskit import context, make_root

    root = make_root(tmp_path)
    cp.write_record(root, "node-i", cp.bundle(1))
    ctx = context(root, cp.config_lines())
    try:
        verifier = ctx.intent_verifier()
        worker = cp.command.leaf()

        def check(state: int, starts: bool = True) -> str | None:
            from bcd_helper.ops.hostunit import SignedIntent

            inst = ch_instance("vm1", desired_state=wire.InstanceDesiredState(state))
            spec = intent(worker, instances_body("node-i", 5, inst))
            try:
                got, _state = verifier.signed_instance(
                    "ch.launch", "vm1", SignedIntent(**spec), starts=starts
                )
            except Refused as exc:
                return f"{exc.reason}: {exc.message}"
            assert got is not None and got.id == "vm1"
            return None

        assert check(1) is None and check(2) is None
        assert check(3) == (
            "instance-stopped: ch.launch: vm1: the signed spec (generation 5) wants it STOPPED: root starts "
            "only an instance it wants RUNNING or PAUSED"
        )
        assert (check(0) or "").startswith("instance-stopped: ") and "UNSPECIFIED" in (check(0) or "")
        assert (check(4) or "").startswith("not-in-spec: ")
        assert "wants it 9: root starts" in (check(9) or "")  # a state this build does not know: its number
        assert check(3, starts=False) is None and check(0, starts=False) is None
    finally:
        ctx.audit.close()


def test_signed_instance_resumes_only_what_the_spec_wants_running(tmp_path: Path, cp: ControlPlane) -> None:
    """`IntentVerifier.signed_instance(resumes=True)` (libvirt.resume): RUNNING passes; PAUSED, STOPPED and
    UNSPECIFIED are `instance-not-running`, naming the state and the generation; DELETED stays
    `not-in-spec`."""
    from bcd_helper.ops.base import Refused
    from bcd_helper.ops.hostunit import SignedIntent
    from intentkit import instances_body
    from opskit import context, make_root

    root = make_root(tmp_path)
    cp.write_record(root, "node-i", cp.bundle(1))
    ctx = context(root, cp.config_lines())
    try:
        verifier = ctx.intent_verifier()
        worker = cp.command.leaf()

        def check(generation: int, state: int) -> str | None:
            inst = ch_instance("vm1", desired_state=wire.InstanceDesiredState(state))
            spec = intent(worker, instances_body("node-i", generation, inst))
            try:
                verifier.signed_instance("libvirt.resume", "vm1", SignedIntent(**spec), resumes=True)
            except Refused as exc:
                return f"{exc.reason}: {exc.message}"
            return None

        assert check(5, 1) is None
        assert check(6, 2) == (
            "instance-not-running: libvirt.resume: vm1: the signed spec (generation 6) wants it PAUSED: root "
            "resumes only an instance it wants RUNNING"
        )
        assert "wants it STOPPED" in (check(7, 3) or "") and "wants it UNSPECIFIED" in (check(8, 0) or "")
        assert (check(9, 4) or "").startswith("not-in-spec: ")
        assert "wants it 9: root resumes" in (check(10, 9) or "")  # a state this build does not know
    finally:
        ctx.audit.close()


def test_round6b_the_strict_walk_counts_fields_before_building() -> None:
    """`decode_with_unknown(max_fields=N)`: the fields of the whole tree (submessages' own fields, each
    element of a packed run) are counted before anything is built; N fields pass, N + 1 are refused
    naming the bound; without a bound nothing is counted."""
    from bcd_shared.wire.strict import WireError, decode_spec_body

    body = _many_assignments(10)  # node_id, generation, full, devices, 10 assignments: 14 fields
    assert len(decode_spec_body(body, max_fields=14)[0].full.devices.assignments) == 10
    with pytest.raises(WireError, match="more than 13 fields"):
        decode_spec_body(body, max_fields=13)
    assert len(decode_spec_body(_many_assignments(100_000))[0].full.devices.assignments) == 100_000
    # A packed run: each element counted (one a byte at most: three serials of one byte each, one tag).
    from bcd_shared.wire.strict import decode_with_unknown

    packed = bytes(wire.AccessSection(revoked_serials=[1, 2, 3]))
    assert decode_with_unknown(wire.AccessSection, packed, max_fields=4)[0].revoked_serials == [1, 2, 3]
    with pytest.raises(WireError, match="more than 3 fields"):
        decode_with_unknown(wire.AccessSection, packed, max_fields=3)
    # Inside a submessage the refusal names it: node_id, generation, full, access, the run's tag, 3 serials.
    nested = bytes(
        wire.DesiredStateBody(
            node_id="n",
            generation=1,
            full=wire.NodeSpec(access=wire.AccessSection(revoked_serials=[1, 2, 3])),
        )
    )
    assert decode_spec_body(nested, max_fields=8)[0].full.access.revoked_serials == [1, 2, 3]
    with pytest.raises(WireError) as info:
        decode_spec_body(nested, max_fields=7)
    assert str(info.value) == "full.access: more than 7 fields"


def test_round6b_the_kubernetes_rule_in_process() -> None:
    """`_check_atoms` and `_check_signed_env` on a Kubernetes assignment: a device edit or a spec-level
    edit other than env is `atoms-outside`, `NVIDIA_VISIBLE_DEVICES` in the CDI hold `env-outside` (each
    message naming the rule), before root's vendor spec or nvidia-smi is read; the env file may name the
    GPUs; a plain hold's own GPU is still taken in both."""
    from bcd_helper.ops.base import Refused
    from bcd_helper.ops.files import KUBE_BARE, _check_atoms, _check_signed_env

    kube = _assignment("k1", [GPU1], binding=2)
    plain = _assignment("k1", [GPU1])

    def refusal(fn: Any, *args: Any) -> str | None:
        try:
            fn(*args)
        except Refused as exc:
            return f"{exc.reason}: {exc.message}"
        return None

    host = FakeHost({})
    call = FakeCall(host)
    bare = json.loads(_kube_hold("k1", GPU1, None, ["BCD_ALLOCATION_ID=k1"]))
    assert refusal(_check_atoms, call, "k1", bare, kube) is None
    nodes = json.loads(_kube_hold("k1", GPU1, {"deviceNodes": [{"path": "/dev/nvidia0"}]}, []))
    assert (
        refusal(_check_atoms, call, "k1", nodes, kube)
        == f"atoms-outside: cdi: devices[0].containerEdits: {KUBE_BARE}"
    )
    hooked = dict(bare, containerEdits={"env": ["BCD_ALLOCATION_ID=k1"], "mounts": [{"hostPath": "/x"}]})
    assert (
        refusal(_check_atoms, call, "k1", hooked, kube) == f"atoms-outside: cdi: containerEdits: {KUBE_BARE}"
    )
    assert host.ran == []  # refused before root's vendor spec or nvidia-smi
    env = ["BCD_ALLOCATION_ID=k1", f"NVIDIA_VISIBLE_DEVICES={GPU1}"]
    assert refusal(_check_signed_env, "cdi", "k1", env, kube) == (
        f"env-outside: cdi: env[1] NVIDIA_VISIBLE_DEVICES: {KUBE_BARE}"
    )
    assert refusal(_check_signed_env, "allocation-env", "k1", env, kube) is None
    assert refusal(_check_signed_env, "cdi", "k1", env, plain) is None
    assert refusal(_check_signed_env, "cdi", "k1", env[:1], kube) is None
    assert refusal(_check_signed_env, "cdi", "k1", [*env[:1], "NVIDIA_VISIBLE_DEVICES="], kube) is not None


# --- file.write in process (what mutation runs reach: docs/mutation.md, "Round 6b") ---------------------


def _signed_file_ctx(tmp_path: Path, cp: ControlPlane, script: Any = None) -> Any:
    from opskit import make_root
    from test_files_signed_unit import signed_ctx

    return signed_ctx(make_root(tmp_path), cp, script)


def _signed(cp: ControlPlane, generation: int, *assignments: wire.DeviceAssignment) -> Any:
    from test_files_signed_unit import signed

    return signed(
        cp.command.leaf(), devices_spec(NODE, generation, wire.DevicesSection(assignments=list(assignments)))
    )


def _write_refusal(ctx: Any, req: Any) -> tuple[str, str] | None:
    from bcd_helper.ops.base import Refused
    from bcd_helper.ops.files import file_write
    from opskit import call

    try:
        file_write(call(ctx), req)
    except Refused as exc:
        return exc.reason, exc.message
    return None


def test_round6b_file_write_checks_a_sliced_holds_slice_word_for_word(
    tmp_path: Path, cp: ControlPlane
) -> None:
    """A signed sliced hold (its CDI spec, its env file) through `file_write` in process: no slice is
    `slice-missing`, a slice not enforcing the signed memory limit `slice-limits`, each message word for
    word (the value the cgroup file shows cut to 100 characters); the slice root's limits make: written."""
    from bcd_helper.ops.files import FileWrite

    ctx = _signed_file_ctx(tmp_path, cp)
    try:
        spec = _signed(cp, 5, _assignment("s1", [GPU1], wire.DeviceLimits(memory_bytes=GIB)))
        doc = json.loads(_sliced_hold("s1", GPU1))
        doc["annotations"]["bcd.dev/reservation-id"] = "r1"
        hold = FileWrite("cdi", "s1", json.dumps(doc), intent=spec)
        env = FileWrite(
            "allocation-env",
            "s1",
            "BCD_ALLOCATION_ID=s1\nBCD_CGROUP_PARENT=bcd-alloc-s1.slice\n",
            intent=spec,
        )
        missing = (
            "slice-missing",
            "allocation s1 is a sliced hold: its slice bcd-alloc-s1.slice must be started with the signed "
            "limits (slice.apply) before the hold names it",
        )
        assert _write_refusal(ctx, hold) == missing
        assert _write_refusal(ctx, env) == missing
        cg = ctx.root / CG.lstrip("/")
        cg.mkdir(parents=True)
        for name, text in _slice_files().items():
            (ctx.root / name.lstrip("/")).write_text(text)
        unlimited = (
            "slice-limits",
            "allocation s1: its slice bcd-alloc-s1.slice does not enforce the signed limits: "
            "limits.memory_bytes makes MemoryMax '1073741824', its cgroup's memory.max says 'unset' "
            "(slice.apply with the signed limits first)",
        )
        assert _write_refusal(ctx, hold) == unlimited
        assert _write_refusal(ctx, env) == unlimited
        (cg / "memory.max").write_text(f"{GIB}\n")
        (cg / "memory.high").write_text(f"{GIB * 9 // 10 // 4096 * 4096}\n")
        (cg / "cpu.max").write_text("x" * 150 + " y\n")  # a value root cannot read: shown cut
        got = _write_refusal(ctx, hold)
        assert got is not None and got[1].endswith(
            f"cpu.max says {'x' * 100!r} (slice.apply with the signed limits first)"
        )
        (cg / "cpu.max").write_text("max 100000\n")
        assert _write_refusal(ctx, hold) is None
        assert _write_refusal(ctx, env) is None
    finally:
        ctx.audit.close()


def test_round6b_file_write_takes_the_vendor_env_for_a_plain_hold_only(
    tmp_path: Path, cp: ControlPlane
) -> None:
    """The vendor spec's common env is a plain hold's (the planner copies it), never a Kubernetes hold's
    (bare): the same line written or refused `env-outside`."""
    from bcd_helper.ops.files import FileWrite
    from test_files_signed_unit import vendor

    ctx = _signed_file_ctx(tmp_path, cp)
    try:
        vendor(ctx.root, {GPU1: {"deviceNodes": [{"path": "/dev/nvidia0"}]}}, {"env": ["NVIDIA_CTK=1"]})

        def write(ident: str, binding: int) -> tuple[str, str] | None:
            spec = _signed(cp, 6 + binding, _assignment(ident, [GPU1], binding=binding))
            maker = _kube_hold if binding == 2 else lambda i, g, e, env: hold_text(i, [(g, e)], env)
            doc = json.loads(maker(ident, GPU1, None, [f"BCD_ALLOCATION_ID={ident}", "NVIDIA_CTK=1"]))
            doc["annotations"]["bcd.dev/reservation-id"] = "r1"
            return _write_refusal(ctx, FileWrite("cdi", ident, json.dumps(doc), intent=spec))

        assert write("p1", 1) is None
        (ctx.root / "etc/cdi/bcd-p1.json").unlink()  # GPU1 free again
        got = write("k2", 2)
        assert got is not None and got[0] == "env-outside" and "NVIDIA_CTK=1" in got[1], got
    finally:
        ctx.audit.close()


def test_round6b_atoms_missing_word_for_word(tmp_path: Path, cp: ControlPlane) -> None:
    """Round 6 row 2's rule in process (it had only the real-helper test): the atoms missing, cut to 400
    characters, or one listed twice; a slot atom takes its own GPU's vendor edits."""
    from bcd_helper.ops.files import FileWrite
    from test_files_signed_unit import smi, vendor

    ctx = _signed_file_ctx(tmp_path, cp, smi())
    try:
        nv0 = {"deviceNodes": [{"path": "/dev/nvidia0"}]}
        vendor(ctx.root, {GPU1: nv0})
        many = [f"GPU-00000000-0000-4000-8000-0000000000{i:02d}" for i in range(12)]

        def write(ident: str, atoms: list[str], devices: list[tuple[str, Any]]) -> tuple[str, str] | None:
            spec = _signed(cp, 9, _assignment(ident, atoms))
            doc = json.loads(hold_text(ident, devices, [f"BCD_ALLOCATION_ID={ident}"]))
            doc["annotations"]["bcd.dev/reservation-id"] = "r1"
            return _write_refusal(ctx, FileWrite("cdi", ident, json.dumps(doc), intent=spec))

        head = "cdi: devices: a signed hold carries each atom of allocation m1 exactly once"
        assert write("m1", [GPU1, GPU2], [(GPU1, None)]) == ("atoms-missing", f"{head}; {GPU2} missing")
        # An atom listed twice never gets here: its CDI device name repeats, `bad-content` when parsed.
        assert write("m1", [GPU1, GPU2], [(GPU1, None), (GPU1, None), (GPU2, None)]) == (
            "bad-content",
            f"cdi: devices[1].name {GPU1!r}: listed twice",
        )
        got = write("m1", [GPU1, *many], [(GPU1, None)])
        assert got == ("atoms-missing", f"{head}; {', '.join(many)[:400]} missing")
        assert write("m2", [f"{GPU1}/s1"], [(f"{GPU1}/s1", nv0)]) is None
    finally:
        ctx.audit.close()


def test_round6b_an_unsigned_access_body_is_decoded_within_the_field_bound(tmp_path: Path) -> None:
    """In process: with `unsigned_access`, a body of exactly 65,536 fields decodes (and is applied), one
    more is `bad-intent` naming the bound, before anything is built."""
    from bcd_helper.intent import MAX_UNSIGNED_FIELDS
    from intentkit import unsigned
    from opskit import make_root
    from test_access_unit import refused, sshd, unsigned_ctx

    assert MAX_UNSIGNED_FIELDS == 65536
    root = make_root(tmp_path)
    ctx = unsigned_ctx(root, sshd())
    try:
        # node_id, generation, full, devices: 4 fields, then the assignments.
        reason, message = refused(ctx, unsigned(_many_assignments(MAX_UNSIGNED_FIELDS - 3)))
        assert (reason, message) == (
            "bad-intent",
            "access.apply: the spec does not decode: full.devices: more than 65536 fields",
        )
        from bcd_helper.ops.access import access_apply
        from opskit import call
        from test_access_unit import req

        got = access_apply(
            call(ctx, bounded=False), req(unsigned(_many_assignments(MAX_UNSIGNED_FIELDS - 4)))
        )
        assert got["signed"] is False
    finally:
        ctx.audit.close()


APPS = ("nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader")
L_OUT = (
    f"GPU 0: NVIDIA A100-SXM4-80GB (UUID: {GPU1})\n  MIG 3g.40gb     Device  0: (UUID: MIG-aaaa)\n".encode()
)


def test_round6b_busy_reads_a_mig_uuid_and_goes_on_past_an_unreadable_env_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A MIG UUID an env file names is its GPU by root's nvidia-smi (`files.mig_names`, asked once for all
    the files); an env file naming what root cannot place makes every GPU busy, and the files after it are
    still read."""
    import bcd_helper.ops.files as files_mod
    from bcd_helper.busy import ALL, env_gpus

    asked: list[object] = []

    def mig_names(system: Any) -> dict[str, Any]:
        asked.append(system)
        return {f"{GPU1}/gi1/ci0": files_mod.MigName("MIG-aaaa", frozenset({"MIG-aaaa", "0:0"}))}

    monkeypatch.setattr(files_mod, "mig_names", mig_names)
    host = FakeHost(
        {
            f"{ENV}/a.env": "BCD_ALLOCATION_ID=a\nNVIDIA_VISIBLE_DEVICES=all\n",
            f"{ENV}/b.env": f"BCD_ALLOCATION_ID=b\nNVIDIA_VISIBLE_DEVICES={GPU2}\n",
            f"{ENV}/c.env": "BCD_ALLOCATION_ID=c\nNVIDIA_VISIBLE_DEVICES=MIG-aaaa\n",
            f"{ENV}/d.env": "BCD_ALLOCATION_ID=d\nNVIDIA_VISIBLE_DEVICES=MIG-aaaa\n",
        }
    )
    got = env_gpus(host)  # type: ignore[arg-type]
    assert [g for g, _ in got] == [ALL, GPU2, GPU1, GPU1]
    assert got[2][1] == f"{GPU1} is named by allocation c's env file {ENV}/c.env"
    assert asked == [host]


def test_round6b_hold_and_compute_gpus_in_process() -> None:
    """The rest of root's busy view, read as before round 6b: a hold's atoms reduced to their GPU (a slot,
    a MIG device), an unreadable hold every GPU and the holds after it still read; compute processes by
    GPU, a MIG one every GPU, short lines skipped; nvidia-smi absent (127) none, failing BusyUnknown; the
    known GPUs nvidia-smi lists."""
    from bcd_helper.busy import ALL, BusyUnknown, busy_gpus, compute_gpus, gpu_of, hold_gpus, known_gpus

    assert gpu_of(f"{GPU1}/gi1/ci0") == GPU1 and gpu_of(f"{GPU1}/s2") == GPU1 and gpu_of(GPU1) == GPU1
    bad = "/etc/cdi/bcd-a.json"
    files = {
        bad: "{",
        "/etc/cdi/bcd-b.json": hold_text(
            "b", [(f"{GPU2}/s1", None), (f"{GPU1}/gi1/ci0", None)], ["BCD_ALLOCATION_ID=b"]
        ),
    }
    got = hold_gpus(FakeHost(files))  # type: ignore[arg-type]
    assert got == [
        (ALL, f"the hold {bad} cannot be read"),
        (GPU2, f"{GPU2} is held by b"),
        (GPU1, f"{GPU1} is held by b"),
    ]
    # A hold file whose content is another allocation's is not read as that one's: every GPU.
    other = {"/etc/cdi/bcd-c.json": files["/etc/cdi/bcd-b.json"]}
    assert hold_gpus(FakeHost(other)) == [(ALL, "the hold /etc/cdi/bcd-c.json cannot be read")]  # type: ignore[arg-type]
    out = f"{GPU1}, 101\n, 7\nMIG-x, 9\nonly\n{GPU2},\n".encode() + b"\xff\n"  # not UTF-8: replaced
    host = FakeHost({}, {APPS: out})
    assert compute_gpus(host) == [  # type: ignore[arg-type]
        (GPU1, f"{GPU1} runs compute process 101"),
        (ALL, "a MIG device (MIG-x) runs compute process 9"),
        (GPU2, f"{GPU2} runs compute process "),
    ]

    class Absent(FakeHost):
        def run(self, argv: list[str], timeout: float | None = None) -> CommandResult:
            assert timeout == 60
            return CommandResult(tuple(argv), 127, b"", b"")

    assert compute_gpus(Absent({})) == [] and known_gpus(Absent({})) is None  # type: ignore[arg-type]
    with pytest.raises(BusyUnknown, match=r"^cannot list compute processes: "):
        compute_gpus(FakeHost({}))  # type: ignore[arg-type]
    with pytest.raises(BusyUnknown, match=r"^cannot list GPUs: "):
        known_gpus(FakeHost({}))  # type: ignore[arg-type]
    listing = FakeHost(
        {},
        {
            ("nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"): f" {GPU1} \n\n{GPU2}\n".encode()
            + b"\xff\n"
        },
    )
    assert known_gpus(listing) == (GPU1, GPU2, "\ufffd")  # type: ignore[arg-type]
    both = FakeHost(files, {APPS: b""})
    assert busy_gpus(both).gpus() == {ALL, GPU1, GPU2}  # type: ignore[arg-type]


def test_round6b_the_normal_forms_edges() -> None:
    """bcd_shared.slicelimits at its edges, now that root's check rests on it: cpulists merged only when
    adjacent (`0,2` is not `0-2`), either cpulist property canonical, an empty cpulist empty; the kernel's
    files: none is no limit, a value bcd cannot read kept as it is (never an error), cpu.max's period 0 or
    1, memory rounded down to the page."""
    from bcd_shared.slicelimits import applied_limits, canonical_cpulist, wanted_limits

    assert canonical_cpulist("") == "" and canonical_cpulist("  ") == ""
    assert canonical_cpulist("0,2") == "0,2" and canonical_cpulist("2,0,1") == "0-2"
    assert canonical_cpulist("3-1") is None and canonical_cpulist("a") is None
    assert wanted_limits([("AllowedMemoryNodes", "1,0"), ("AllowedCPUs", "3,2")], []) == {
        "AllowedMemoryNodes": "0-1",
        "AllowedCPUs": "2-3",
    }
    assert applied_limits({}) == {}
    assert applied_limits({"cpuset.cpus": "3,0-2\n", "cpuset.mems": "x\n"}) == {
        "AllowedCPUs": "0-3",
        "AllowedMemoryNodes": "x",
    }
    for text, quota in (
        ("a b", "a b"),
        ("a b c", "a b c"),
        ("x 100000", "x 100000"),
        ("5 0", "5 0"),
        ("5 1", "500%"),
        ("150000 100000", "150%"),
    ):
        assert applied_limits({"cpu.max": text}) == {"CPUQuota": quota}, text
    assert applied_limits({"memory.max": "4097\n", "memory.high": "abc\n"}) == {
        "MemoryMax": "4096",
        "MemoryHigh": "abc",
    }
