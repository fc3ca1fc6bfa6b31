"""Red team round 7 (docs/helper.md, "Threat model, round 7"): the node's account, compromised, against
the rules added after round 6b (the resume rule, slice.remove's hold check, kept holds written over in
place, the slice limits, env files in root's busy view, tap names, hold removals, the audit log), as a
real unprivileged client (a forked child dropped to the node's uid, hostilekit.as_node: SO_PEERCRED sees
that uid) against a real `bcd helper serve` over a simulated host with command-signing roots. Each test
failed on the code before its fix; the in-process tests at the end pin the rules' edges."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bcd_shared import wire
from bcd_simhost.libvirt import STATE
from hostilekit import LibvirtVm, SignedHost, as_node, refused_as_node
from intentkit import ControlPlane, devices_spec, hold_text, intent


def _domain_state(root: Path, name: str) -> str:
    return str(json.loads((root / STATE.lstrip("/") / f"{name}.json").read_text())["state"])


def test_round7_a_guest_the_signed_spec_pauses_is_never_started_running(signed_host: SignedHost) -> None:
    """After round 6b `libvirt.resume` runs a paused guest only while the signed spec wants it RUNNING,
    but `libvirt.start` and `libvirt.restore` took any spec that wants it RUNNING or PAUSED, and started
    it running unless the node asked `paused`. A node whose guest the control plane paused destroyed it
    (`libvirt.destroy` takes no spec: stopping is always the node's) and started it again running, or
    saved it (`libvirt.save`) and restored it running: the resume rule bypassed. Now a start or restore
    that is not `paused` needs a spec that wants the instance RUNNING (`instance-not-running`)."""
    h = signed_host.start()
    vm = LibvirtVm(signed_host, "vm8", "a8")
    signed = vm.signed

    def op(name: str, spec: dict[str, Any], **args: Any) -> dict[str, Any]:
        return {"op": name, "args": {"name": "vm8", "intent": spec, **args}}

    answer = as_node(h, op("libvirt.define", signed(1, 1), xml=vm.xml))
    assert answer["ok"] is True, answer
    assert as_node(h, op("libvirt.start", signed(1, 1)))["ok"] is True
    # The control plane pauses it (generation 2); the node suspends it, as asked.
    paused = signed(2, 2)
    assert as_node(h, {"op": "libvirt.suspend", "args": {"name": "vm8"}})["ok"] is True
    refused_as_node(h, op("libvirt.resume", paused), "instance-not-running", "PAUSED")
    # The way around the resume rule: destroy, then start again running.
    assert as_node(h, {"op": "libvirt.destroy", "args": {"name": "vm8"}})["ok"] is True
    refused_as_node(h, op("libvirt.start", paused), "instance-not-running", "root starts it only paused")
    refused_as_node(h, op("libvirt.start", paused, paused=False), "instance-not-running", "PAUSED")
    answer = as_node(h, op("libvirt.start", paused, paused=True))
    assert answer["ok"] is True, answer
    assert _domain_state(signed_host.root, "vm8") == "paused"
    # Or: save it, then restore it running.
    answer = as_node(h, op("libvirt.save", paused))
    assert answer["ok"] is True, answer
    xml = vm.xml
    restore = op("libvirt.restore", paused, xml=xml)
    refused_as_node(h, restore, "instance-not-running", "root starts it only paused")
    answer = as_node(h, op("libvirt.restore", paused, xml=xml, paused=True))
    assert answer["ok"] is True, answer
    assert _domain_state(signed_host.root, "vm8") == "paused"
    # The control plane wants it running again: a start that is not paused is taken.
    assert as_node(h, {"op": "libvirt.destroy", "args": {"name": "vm8"}})["ok"] is True
    answer = as_node(h, op("libvirt.start", signed(3, 1)))
    assert answer["ok"] is True, answer
    assert _domain_state(signed_host.root, "vm8") == "running"


def test_round7_a_generation_a_resume_acted_on_is_the_floor(signed_host: SignedHost) -> None:
    """`libvirt.resume` checked the signed spec but never wrote root's intent state: a generation root
    first saw (and acted on) in a resume did not become the floor, so the older spec was taken again
    afterwards (here by the next resume; any signed op alike). Now the state is written before the
    resume, as every other signed op writes it (`stale-generation`)."""
    h = signed_host.start()
    vm = LibvirtVm(signed_host, "vm9", "a9")
    signed = vm.signed

    define = {"op": "libvirt.define", "args": {"name": "vm9", "xml": vm.xml, "intent": signed(1)}}
    assert as_node(h, define)["ok"] is True
    assert as_node(h, {"op": "libvirt.start", "args": {"name": "vm9", "intent": signed(1)}})["ok"] is True
    suspend = {"op": "libvirt.suspend", "args": {"name": "vm9"}}
    assert as_node(h, suspend)["ok"] is True
    answer = as_node(h, {"op": "libvirt.resume", "args": {"name": "vm9", "intent": signed(6)}})
    assert answer["ok"] is True, answer
    assert as_node(h, suspend)["ok"] is True
    resume = {"op": "libvirt.resume", "args": {"name": "vm9", "intent": signed(5)}}
    refused_as_node(h, resume, "stale-generation", "older than generation 6")


def test_round7_an_instance_runs_only_under_the_runtime_the_signed_spec_gives_it(
    signed_host: SignedHost,
) -> None:
    """Root compared a libvirt definition (or a Cloud Hypervisor record) with the signed spec's instance
    in size, NICs, GPUs and image, never in runtime: an instance the spec runs under cloud-hypervisor was
    defined and started under libvirt too (a second guest of one instance beside the first, its taps of
    the same names: the tap-name rule sees one id, no collision), and one the spec gives libvirt was
    launched by a VMM. Now every libvirt.* and ch.* op checked against the spec needs the spec's runtime
    to be its own (`spec-mismatch`, naming the runtime)."""
    from bcd_shared.chunit import VMM_UID_BASE
    from bcd_simhost.chapi import lay_out_instance
    from hostilekit import NODE_UID, ch_instance

    lay_out_instance(signed_host.root, "vm11", NODE_UID, VMM_UID_BASE + 11)
    h = signed_host.start()
    vm = LibvirtVm(signed_host, "vm10", "a10")

    def vm10(runtime: str) -> wire.InstanceSpec:
        return vm.spec(runtime=runtime)

    ch_spec = signed_host.signed(1, vm10("cloud-hypervisor"), ch_instance("vm11", runtime="libvirt-kvm"))
    define = {"op": "libvirt.define", "args": {"name": "vm10", "xml": vm.xml, "intent": ch_spec}}
    refused_as_node(h, define, "spec-mismatch", "runs it under 'cloud-hypervisor', not libvirt-kvm")
    for op in ("ch.launch", "ch.vfio"):
        launch = {"op": op, "args": {"name": "vm11", "intent": ch_spec}}
        refused_as_node(h, launch, "spec-mismatch", "runs it under 'libvirt-kvm', not cloud-hypervisor")
    # Under the spec's own runtime both are taken.
    right = signed_host.signed(2, vm10("libvirt-kvm"), ch_instance("vm11"))
    answer = as_node(h, {**define, "args": {**define["args"], "intent": right}})
    assert answer["ok"] is True, answer
    answer = as_node(h, {"op": "ch.launch", "args": {"name": "vm11", "intent": right}})
    assert answer["ok"] is True, answer
    assert as_node(h, {"op": "ch.stop", "args": {"name": "vm11"}})["ok"] is True


GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"  # the simulated host's GPU 0


def test_round7_an_env_file_never_names_a_gpu_another_allocations_hold_still_names(cp: ControlPlane) -> None:
    """Round 6 (row 7) refused a CDI hold naming an atom another allocation's hold or env file still
    names, the old tenant's hold the node kept after the spec moved the GPU; the new allocation's **env
    file** was never checked. With w1's CDI hold of GPU1 kept after the spec gave GPU1 to w2, w2's env file
    (`NVIDIA_VISIBLE_DEVICES=<GPU1>`, the legacy runtime hook's way to the GPU for w2's jobs) was written
    beside it: two tenants on one GPU. Now an env file takes the same rule (`atoms-held`, naming the other
    hold); once w1's hold is gone it is written."""
    from realnode import RealNode
    from test_signed_holds import NODE, cdi_doc, env_doc, remove_doc

    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    try:

        def spec(generation: int, owner: str) -> dict[str, Any]:
            assignment = wire.DeviceAssignment(
                allocation_id=owner, reservation_id="r1", binding=wire.Binding(1),
                devices=[wire.DeviceAtom(id=GPU1, device_class="gpu")],
            )  # fmt: skip
            return intent(
                cp.command.leaf(), devices_spec(NODE, generation, wire.DevicesSection([assignment]))
            )

        first = spec(1, "w1")
        node.ok(cdi_doc("w1", hold_text("w1", [(GPU1, None)], ["BCD_ALLOCATION_ID=w1"]), first))
        moved = spec(2, "w2")  # w1 released, GPU1 given to w2; the node keeps w1's hold
        env = env_doc("w2", f"BCD_RESERVATION_ID=r1\nNVIDIA_VISIBLE_DEVICES={GPU1}\n", moved)
        node.refused(env, "atoms-held", "/etc/cdi/bcd-w1.json")
        node.refused(
            cdi_doc("w2", hold_text("w2", [(GPU1, None)], ["BCD_ALLOCATION_ID=w2"]), moved), "atoms-held"
        )
        node.ok(remove_doc("cdi", "w1", moved))
        node.ok(env)
        node.ok(cdi_doc("w2", hold_text("w2", [(GPU1, None)], ["BCD_ALLOCATION_ID=w2"]), moved))
        node.ok(env)  # written over in place: its own hold is not another's
    finally:
        node.close()


# The real helper on the real libvirt (qemu:///system, TCG), as round 4 drives it (its fixtures).
from test_hostile_round4 import Guest, _node_owns, guest, node_wins_the_race, real_libvirt  # noqa: E402, F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from test_guest_boot_real import bridge, helper_socket, workdir  # noqa: E402, F401  (fixtures)


class _Socket:
    """What hostilekit's clients need of a helper: its socket's path."""

    def __init__(self, path: str) -> None:
        self.socket_path = path


def _as_kvm_node(sock: str, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` from a process of the real-host helper's node account (uid 4242, group kvm)."""
    import grp

    from hostilekit import connect_as, frame, read_answer

    s, _ = connect_as(_Socket(sock), 4242, grp.getgrnam("kvm").gr_gid)
    with s:
        s.sendall(frame(json.dumps(doc).encode()))
        answer = read_answer(s)
    assert answer is not None, "the helper closed the connection without an answer"
    return answer


def test_round7_a_running_domain_is_never_undefined_out_of_roots_sight(
    guest: Guest,  # noqa: F811
    helper_socket: tuple[str, Path],  # noqa: F811
) -> None:
    """`libvirt.undefine` ran `virsh undefine` on any domain of bcd's, then dropped root's staged
    definition. Real libvirt undefines a running or paused domain too: it keeps running as a transient
    domain, with its taps, while root's record of it (the staged definition, which the tap-name rule
    reads) is gone, so another instance of the same tap stem could take its live taps (`ch.taps`), and
    root's ops no longer find it once it stops. Now an active domain is refused (`domain-active`), its
    staged definition and its persistence kept; once destroyed it is undefined as before. Real libvirt
    9.0 (TCG); the node's account (uid 4242 here) as the client."""
    from bcd_agent.sections.instances.runtimes.base import Prepared

    sock, home = helper_socket
    home.chmod(0o751)  # the node's account reaches its socket (root-only config and audit stay so)
    name = guest.name
    staged = Path(f"/var/lib/bcd-hostconfig/libvirt/{name}.xml")
    _node_owns(guest.data)
    guest.rt.create(guest.inst, Prepared())
    _node_owns(guest.data)
    answer = _as_kvm_node(sock, {"op": "libvirt.start", "args": {"name": name, "paused": True}})
    assert answer["ok"] is True, answer
    undefine = {"op": "libvirt.undefine", "args": {"name": name}}
    answer = _as_kvm_node(sock, undefine)
    assert (answer["ok"], answer.get("reason")) == (False, "domain-active"), answer
    assert name in answer["message"] and "destroy it first" in answer["message"]
    assert staged.exists()
    info = subprocess.run(
        ["virsh", "-c", "qemu:///system", "dominfo", name], capture_output=True, text=True, check=False
    ).stdout
    assert "Persistent:     yes" in info and "paused" in info, info
    assert _as_kvm_node(sock, {"op": "libvirt.destroy", "args": {"name": name}})["ok"] is True
    answer = _as_kvm_node(sock, undefine)
    assert answer["ok"] is True, answer
    assert not staged.exists()


# --- in process --------------------------------------------------------------------------------------


def test_round7_signed_instance_starts_unpaused_only_what_the_spec_runs_under_its_runtime(
    tmp_path: Path,
) -> None:
    """`IntentVerifier.signed_instance`: `unpaused` (with `starts`) refuses every state but RUNNING
    (`instance-not-running`, naming the state and generation), after `instance-stopped`; `runtime`
    refuses an instance the spec runs under another runtime (`spec-mismatch`), before the state rules."""
    from bcd_helper.ops.base import Refused
    from bcd_helper.ops.hostunit import SignedIntent
    from hostilekit import ch_instance
    from intentkit import ControlPlane, instances_body, intent
    from opskit import context, make_root

    cp = ControlPlane.build()
    root = make_root(tmp_path)
    cp.write_record(root, "node-i", cp.bundle(1))
    ctx = context(root, cp.config_lines())
    try:
        verifier = ctx.intent_verifier()
        worker = cp.command.leaf()
        generation = iter(range(1, 100))

        def check(state: int, runtime: str | None = None, **flags: bool) -> str | None:
            inst = ch_instance("vm1", desired_state=wire.InstanceDesiredState(state))
            spec = intent(worker, instances_body("node-i", next(generation), inst))
            try:
                verifier.signed_instance(
                    "libvirt.start", "vm1", SignedIntent(**spec), runtime=runtime, **flags
                )
            except Refused as exc:
                return f"{exc.reason}: {exc.message}"
            return None

        assert check(1, starts=True, unpaused=True) is None
        assert check(2, starts=True, unpaused=True) == (
            "instance-not-running: libvirt.start: vm1: paused: the signed spec (generation 2) wants it "
            "PAUSED: root starts it only paused"
        )
        assert check(2, starts=True) is None  # paused: taken
        assert (check(3, starts=True, unpaused=True) or "").startswith("instance-stopped: ")
        assert check(2, unpaused=True) is None  # a define or a save: not a start
        assert check(1, "cloud-hypervisor", starts=True) is None
        assert check(1, "libvirt-kvm") == (
            "spec-mismatch: libvirt.start: vm1: the signed spec (generation 7) runs it under "
            "'cloud-hypervisor', not libvirt-kvm"
        )
        assert (check(3, "libvirt-kvm", starts=True) or "").startswith("spec-mismatch: ")
        # the spec's runtime, whatever the node had signed into it, is cut to 40 characters in the refusal
        odd = ch_instance("vm1", runtime="r" * 50)
        try:
            verifier.signed_instance(
                "ch.launch", "vm1", SignedIntent(**intent(worker, instances_body("node-i", 8, odd))),
                runtime="cloud-hypervisor",
            )  # fmt: skip
            raise AssertionError("taken")
        except Refused as exc:
            assert (exc.reason, exc.message) == (
                "spec-mismatch",
                f"ch.launch: vm1: the signed spec (generation 8) runs it under {'r' * 40!r}, not "
                "cloud-hypervisor",
            )
    finally:
        ctx.audit.close()
