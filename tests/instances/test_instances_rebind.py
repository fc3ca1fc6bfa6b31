"""Identity rebind (DLV-REB): the bundle's checks, the disk's layout, the pure planner, and the whole flow
through the section over libvirt-kvm on the simulated host, whose virsh plays a compliant guest (it reads
the tar and writes its answer) or, with `<name>.silent`, a guest that never answers."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.converge.types import NodeStatus
from bcd_agent.sections.instances.model import Desired
from bcd_agent.sections.instances.plan import UserData
from bcd_agent.sections.instances.rebind import (
    MAX_TRIES,
    RETRY_MS,
    Attempt,
    BundleRefused,
    RebindBundle,
    Rebinder,
    RebindState,
    answered,
    parse_rebind,
    plan_rebinds,
    rebind_image,
    state_from_json,
)
from bcd_agent.sections.instances.runtimes.base import Domain
from bcd_agent.session.status import status_report
from bcd_shared.rebinddisk import ANSWER_SIZE, REBIND_SIZE
from bcd_simhost.libvirt import STATE
from instkit import DATA_DIR, FixedUserData, converge, section, sim_host, spec, vm
from rebindkit import bundle, host_identity

NONCE = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def identity() -> tuple[str, str]:
    return host_identity()


def test_bundle_checks_accept_the_seed_shape_and_refuse_every_other_dlv_reb_03(
    identity: tuple[str, str],
) -> None:
    """DLV-REB-03: version 1, an account name, principal lines, and a PEM host key with an OpenSSH
    certificate line, or neither; each refusal names its field."""
    key, cert = identity
    good = {"v": 1, "account": "tenant", "principals": ["a", "b"], "hostKey": key, "hostCertificate": cert}
    got = parse_rebind(json.dumps(good).encode())
    assert got.account == "tenant" and got.principals == ("a", "b") and got.host_key == key
    assert parse_rebind(b'{"v":1,"account":"t","principals":"x\\ny\\n"}').principals == ("x", "y")
    bad: list[tuple[object, str]] = [
        ({**good, "v": 2}, "v must be 1"),
        ({**good, "v": True}, "v must be 1"),
        ({**good, "account": "Root;rm"}, "account"),
        ({**good, "principals": []}, "principals"),
        ({**good, "principals": ["a b"]}, "principal"),
        ({**good, "principals": ["a,b"]}, "principal"),
        ({k: v for k, v in good.items() if k != "hostCertificate"}, "together"),
        (
            {**good, "hostKey": "-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n"},
            "hostKey",
        ),
        ({**good, "hostCertificate": cert.replace("-cert-v01@openssh.com", "")}, "hostCertificate"),
        ({**good, "extra": 1}, "unknown field 'extra'"),
        ([1], "not a JSON object"),
    ]
    for doc, why in bad:
        with pytest.raises(BundleRefused, match=why):
            parse_rebind(json.dumps(doc).encode())
    with pytest.raises(BundleRefused, match="twice"):
        parse_rebind(b'{"v":1,"v":1,"account":"t","principals":["a"]}')
    with pytest.raises(BundleRefused, match="not JSON"):
        parse_rebind(b"\xff")


def test_the_disk_is_one_mib_a_tar_then_the_answer_area_dlv_reb_05_06(identity: tuple[str, str]) -> None:
    """DLV-REB-05, DLV-REB-06: exactly 1 MiB; at offset 0 a tar of nonce, account, principals, host_key
    (0600) and host_key-cert.pub; the last 4 KiB zero, kept for the answer; without a key only three."""
    key, cert = identity
    b = parse_rebind(json.dumps({"v": 1, "account": "t", "principals": ["p1"], "hostKey": key,
                                 "hostCertificate": cert}).encode())  # fmt: skip
    img = rebind_image(b, NONCE)
    assert len(img) == REBIND_SIZE == 1 << 20 and img[-ANSWER_SIZE:] == b"\0" * ANSWER_SIZE
    with tarfile.open(fileobj=io.BytesIO(img[:-ANSWER_SIZE])) as tar:
        names = tar.getnames()
        assert names == ["nonce", "account", "principals", "host_key", "host_key-cert.pub"]
        assert tar.getmember("host_key").mode == 0o600
        read = {n: tar.extractfile(n).read() for n in names}  # type: ignore[union-attr]
    assert read["nonce"] == NONCE.encode() + b"\n" and read["principals"] == b"p1\n"
    assert read["host_key"].decode() == key and read["host_key-cert.pub"].decode() == cert
    with pytest.raises(BundleRefused, match="does not fit"):
        rebind_image(RebindBundle("t", ("p" * 1000,) * 1100), NONCE)
    plain = rebind_image(parse_rebind(b'{"v":1,"account":"t","principals":["p"]}'), NONCE)
    with tarfile.open(fileobj=io.BytesIO(plain[:-ANSWER_SIZE])) as tar:
        assert tar.getnames() == ["nonce", "account", "principals"]
    assert answered(b"BCREBOUND " + NONCE.encode() + b"\n" + b"\0" * 100, NONCE)
    assert not answered(b"BCREBOUND " + NONCE.encode() + b"x", NONCE)
    assert not answered(b"\0" * 10 + b"BCREBOUND " + NONCE.encode() + b"\n", NONCE)
    assert not answered(b"BCREBOUND 00000000000000000000000000000000\n", NONCE)


def _dom(name: str, state: str = "running") -> Domain:
    return Domain(name, "libvirt-kvm", state, True)


def test_plan_rebinds_who_when_and_pruning_dlv_reb_15_16_17() -> None:
    """DLV-REB-15, DLV-REB-16, DLV-REB-17: only running instances with a reference not yet installed;
    after a silent guest, again only once 5 minutes passed and at most 3 tries per reference; a final
    attempt (refused or malformed bundle) never again; a new reference starts over; instances no spec
    names are pruned from the state."""
    s = spec(vm("a", identity_rebind_ref="r1"), vm("b"), vm("c", identity_rebind_ref="r1"))
    doms = [_dom("a"), _dom("b"), _dom("c", "paused")]
    jobs, _ = plan_rebinds(s, doms, RebindState(), 0, frozenset({"libvirt-kvm"}))
    assert [j.instance_id for j in jobs] == ["a"]
    assert plan_rebinds(s, doms, RebindState(), 0, frozenset())[0] == ()  # a runtime that cannot rebind
    done = RebindState({"a": "r1"})
    assert plan_rebinds(s, doms, done, 0, frozenset({"libvirt-kvm"}))[0] == ()
    tried = RebindState(attempts={"a": Attempt("r1", 1, RETRY_MS)})
    assert plan_rebinds(s, doms, tried, RETRY_MS - 1, frozenset({"libvirt-kvm"}))[0] == ()
    assert len(plan_rebinds(s, doms, tried, RETRY_MS, frozenset({"libvirt-kvm"}))[0]) == 1
    spent = RebindState(attempts={"a": Attempt("r1", MAX_TRIES, 0)})
    assert plan_rebinds(s, doms, spent, 10**12, frozenset({"libvirt-kvm"}))[0] == ()
    final = RebindState(attempts={"a": Attempt("r1", 1, 0, final=True)})
    assert plan_rebinds(s, doms, final, 10**12, frozenset({"libvirt-kvm"}))[0] == ()
    stopping = spec(vm("a", identity_rebind_ref="r1", desired=Desired.STOPPED))
    assert plan_rebinds(stopping, doms, RebindState(), 0, frozenset({"libvirt-kvm"}))[0] == ()
    s2 = spec(vm("a", identity_rebind_ref="r2"))
    assert len(plan_rebinds(s2, doms, final, 0, frozenset({"libvirt-kvm"}))[0]) == 1
    _jobs, pruned = plan_rebinds(spec(vm("b")), doms, RebindState({"a": "r1"}, {"a": Attempt("r1")}), 0,
                                 frozenset({"libvirt-kvm"}))  # fmt: skip
    assert pruned == RebindState()


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _setup(tmp_path: Path, answers: dict[str, UserData], **kw: Any) -> tuple[Any, Any, Any, _Clock]:
    system = sim_host(tmp_path)
    source = FixedUserData(answers)
    sec, rt = section(system, user_data=source)
    clock = _Clock()
    sec.rebinder = Rebinder(system, DATA_DIR, sec.runtimes, source, wait_s=0.0, clock=clock,
                            sleep=lambda _s: None, **kw)  # fmt: skip
    return sec, rt, system, clock


def test_rebind_runs_whole_then_plans_nothing_and_survives_a_restart_dlv_reb_02_07_09_11_12_13_14(
    tmp_path: Path, identity: tuple[str, str]
) -> None:
    """DLV-REB-01, DLV-REB-02, DLV-REB-07, DLV-REB-09, DLV-REB-11, DLV-REB-12, DLV-REB-13, DLV-REB-14,
    DLV-REB-21: the
    bundle is fetched bound to the allocation, the disk hot-added (`attach-disk … vdz … --serial
    bc-rebind --live`), the (simulated, compliant) guest answers, the disk is detached and its file
    gone; the reference is recorded in instances-rebound.json and reported as identity_rebound_ref, also
    by a new Rebinder (a restart); planning again runs nothing."""
    key, cert = identity
    data = json.dumps({"v": 1, "account": "t", "principals": ["p"], "hostKey": key, "hostCertificate": cert})
    sec, rt, system, _clock = _setup(tmp_path, {"a": UserData(data=data.encode())})
    argvs: list[tuple[str, ...]] = []
    real_act = rt.virsh.act

    def act(verb: str, name: str, *args: str) -> Any:
        argvs.append((verb, name, *args))
        return real_act(verb, name, *args)

    rt.virsh.act = act
    desired = spec(vm("a", identity_rebind_ref="ref-1"))
    converge(sec, desired)
    assert sec.rebind_tick(desired) == [("a", "rebound")]
    assert sec.user_data.asked[-1] == ("a", "alloc_a", "ref-1")
    attach = next(a for a in argvs if a[0] == "attach-disk")
    assert attach[3:] == ("vdz", "--targetbus", "virtio", "--driver", "qemu", "--subdriver", "raw",
                          "--serial", "bc-rebind", "--live")  # fmt: skip
    assert ("detach-disk", "a", "vdz", "--live") in argvs
    assert not Path(attach[2]).exists()
    assert not (system.host_path(STATE) / "a.attached").exists()
    recorded = json.loads(system.host_path(f"{DATA_DIR}/instances-rebound.json").read_text())
    assert recorded["rebound"] == {"a": "ref-1"}
    assert sec.rebind_tick(desired) == []  # plan again: nothing
    converge(sec, desired)
    (rep,) = sec.last_report.instances
    assert rep.identity_rebound_ref == "ref-1"
    wire_report = status_report(NodeStatus(1, 1, 1, "h", (), (), 1, 0.0, instances=sec.last_report), 0.0)
    assert wire_report.instances[0].identity_rebound_ref == "ref-1"
    again = Rebinder(system, DATA_DIR, sec.runtimes, sec.user_data)
    assert again.rebound() == {"a": "ref-1"}
    sec.rebinder = again
    converge(sec, desired)
    assert sec.last_report.instances[0].identity_rebound_ref == "ref-1"
    converge(sec, spec(vm("a", identity_rebind_ref="ref-2")))  # a new reference: not reported until done
    assert sec.last_report.instances[0].identity_rebound_ref == ""


def test_a_silent_guest_is_tried_three_times_five_minutes_apart_nothing_reported_dlv_reb_10_16_18(
    tmp_path: Path,
) -> None:
    """DLV-REB-10, DLV-REB-12, DLV-REB-16, DLV-REB-18: a guest that never answers: after the wait the disk
    is detached and its file zeroed (a descriptor opened on it sees only zeros) and deleted; tried again
    only after 5 minutes, at most 3 times; nothing is reported."""
    sec, rt, system, clock = _setup(tmp_path, {"a": UserData(data=bundle(with_key=False))})
    desired = spec(vm("a", identity_rebind_ref="ref-1"))
    converge(sec, desired)
    (system.host_path(STATE) / "a.silent").write_text("")
    seen: list[bytes] = []
    real_detach = rt.rebind_detach

    def detach(name: str) -> None:
        path = system.host_path(f"{DATA_DIR}/libvirt/instances/{name}/rebind.img")
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 512, 0)[:5] == b"nonce"  # the tar was there
            real_detach(name)
            seen.append(os.pread(fd, REBIND_SIZE, 0))
        finally:
            os.close(fd)
        assert not path.exists()

    rt.rebind_detach = detach
    assert sec.rebind_tick(desired) == [("a", "the guest did not answer")]
    assert seen[-1] == b"\0" * REBIND_SIZE
    assert sec.rebind_tick(desired) == []  # not before 5 minutes
    clock.t += RETRY_MS / 1000
    assert sec.rebind_tick(desired) == [("a", "the guest did not answer")]
    clock.t += RETRY_MS / 1000
    assert sec.rebind_tick(desired) == [("a", "the guest did not answer")]
    clock.t += 10 * RETRY_MS / 1000
    assert sec.rebind_tick(desired) == []  # 3 tries spent
    assert len(seen) == 3
    converge(sec, desired)
    assert sec.last_report.instances[0].identity_rebound_ref == ""
    state = state_from_json(system.host_path(f"{DATA_DIR}/instances-rebound.json").read_bytes())
    assert state.rebound == {} and state.attempts["a"].tries == 3


def test_refused_or_malformed_bundles_are_not_retried_and_pruned_later_dlv_reb_15_17(tmp_path: Path) -> None:
    """DLV-REB-15, DLV-REB-17: a bundle the control plane refuses, or a malformed one, is never asked for
    again under that reference (no disk is attached); a broker that does not answer is asked again; an
    instance no spec names is pruned from instances-rebound.json."""
    sec, _rt, system, clock = _setup(
        tmp_path,
        {
            "a": UserData(refused="PermissionDenied: not released"),
            "b": UserData(data=b'{"v":2,"account":"t","principals":["p"]}'),
            "c": UserData(unavailable="the broker did not answer"),
        },
    )
    desired = spec(*(vm(n, identity_rebind_ref=f"ref-{n}") for n in "abc"))
    converge(sec, desired)
    out = dict(sec.rebind_tick(desired))
    assert (
        out["a"].startswith("refused")
        and out["b"].startswith("malformed")
        and out["c"].startswith("unavailable")
    )
    assert not list(system.host_path(STATE).glob("*.attached"))
    for _ in range(MAX_TRIES + 1):  # an unanswered SecretRequest is not a try
        clock.t += 31
        assert [i for i, _ in sec.rebind_tick(desired)] == ["c"]
    sec.user_data.answers["c"] = UserData(data=bundle(with_key=False))
    clock.t += 31
    assert sec.rebind_tick(desired) == [("c", "rebound")]
    converge(sec, spec(vm("c", identity_rebind_ref="ref-c"), vm("a", desired=Desired.DELETED), generation=2))
    sec.rebind_tick(spec(vm("c", identity_rebind_ref="ref-c")))
    state = state_from_json(system.host_path(f"{DATA_DIR}/instances-rebound.json").read_bytes())
    assert state.attempts == {} and state.rebound == {"c": "ref-c"}  # a's and b's final attempts pruned


def test_a_failed_attach_counts_as_a_try_and_leaves_no_file(tmp_path: Path) -> None:
    """A hot-add libvirt refuses (here: a target already taken) is a try like a silent guest: retried
    after 5 minutes, and the disk's file is zeroed and gone at once."""
    sec, _rt, system, clock = _setup(tmp_path, {"a": UserData(data=bundle(with_key=False))})
    desired = spec(vm("a", identity_rebind_ref="ref-1"))
    converge(sec, desired)
    (system.host_path(STATE) / "a.attached").write_text("someone else's vdz\n")
    (outcome,) = sec.rebind_tick(desired)
    assert outcome[1].startswith("attach failed") and "already exists" in outcome[1]
    assert not system.host_path(f"{DATA_DIR}/libvirt/instances/a/rebind.img").exists()
    assert sec.rebinder.state.attempts["a"].tries == 1
    assert sec.rebind_tick(desired) == []
    clock.t += RETRY_MS / 1000
    (system.host_path(STATE) / "a.attached").unlink()
    assert sec.rebind_tick(desired) == [("a", "rebound")]


class _PluginRuntime:
    """A bcx runtime plugin's shape (list, apply, remove over Invoke): no rebind methods."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("rebind"):
            raise AttributeError(name)
        return lambda *a, **k: self.calls.append(name)


class _RebindRecorder:
    def __init__(self) -> None:
        self.attached: list[str] = []

    def rebind_attach(self, name: str, image: bytes) -> None:
        self.attached.append(name)

    def rebind_answer(self, name: str, size: int = 4096) -> bytes:
        return b""

    def rebind_detach(self, name: str) -> None:
        pass


def test_a_plugin_runtime_is_never_rebound_nor_reported_dlv_reb_20(tmp_path: Path) -> None:
    """DLV-REB-20: an instance of a runtime without the rebind methods (a bcx plugin's shape) carrying
    `identity_rebind_ref` gets no rebind job, no bundle is fetched for it, nothing is called on the
    plugin, and no `identity_rebound_ref` is recorded for it; a libvirt-kvm instance beside it is
    rebound (a compliant guest here)."""
    plugin = _PluginRuntime()
    kvm = _RebindRecorder()
    source = FixedUserData({"k1": UserData(data=b'{"v":1,"account":"t","principals":["p"]}')})
    rb = Rebinder(
        sim_host(tmp_path), DATA_DIR, {"libvirt-kvm": kvm, "bcx:sandbox": plugin}, source,
        wait_s=0.0, clock=lambda: 1000.0, sleep=lambda _s: None,
    )  # fmt: skip
    assert rb.rebinders == frozenset({"libvirt-kvm"})
    s = spec(vm("p1", runtime="bcx:sandbox", identity_rebind_ref="r1"), vm("k1", identity_rebind_ref="r1"))
    doms = [Domain("p1", "bcx:sandbox", "running", True), Domain("k1", "libvirt-kvm", "running", True)]
    jobs, _ = plan_rebinds(s, doms, RebindState(), 0, rb.rebinders)
    assert [j.instance_id for j in jobs] == ["k1"]
    outcomes = dict(rb.tick(s, doms))
    assert list(outcomes) == ["k1"] and kvm.attached == ["k1"]
    assert [a[0] for a in source.asked] == ["k1"]
    assert plugin.calls == []
    assert "p1" not in rb.rebound() and "p1" not in rb.state.attempts


def test_a_tick_is_due_only_for_a_rebind_ref_or_kept_state(tmp_path: Path) -> None:
    """The node's 10 s loop asks rebind_due on trio's thread before it starts a worker thread: due for
    an instance with an identity_rebind_ref (the model's or the wire's spec) or while rebind state is
    kept (a tick prunes it); not for a spec without rebinds, nor without a rebinder."""
    from bcd_shared import wire

    sec, _rt, _system, _clock = _setup(tmp_path, {"a": UserData(refused="PermissionDenied: no")})
    assert not sec.rebind_due(None)
    assert not sec.rebind_due(spec(vm("a"), vm("b")))
    assert not sec.rebind_due(wire.InstancesSection(instances=[wire.InstanceSpec(id="a")]))
    assert sec.rebind_due(
        wire.InstancesSection(instances=[wire.InstanceSpec(id="a", identity_rebind_ref="r")])
    )
    desired = spec(vm("a", identity_rebind_ref="ref-a"))
    assert sec.rebind_due(desired)
    converge(sec, desired)
    assert [i for i, _ in sec.rebind_tick(desired)] == ["a"]  # refused: a final attempt is kept
    assert sec.rebind_due(spec(vm("b")))  # the next tick prunes a's attempt
    sec.rebind_tick(spec(vm("b")))
    assert not sec.rebind_due(spec(vm("b")))
    sec.rebinder = None
    assert not sec.rebind_due(desired)


def test_the_guest_gets_two_minutes_then_five_minutes_pass_before_the_next_try_dlv_reb_10_16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DLV-REB-10, DLV-REB-16 with the Rebinder's own defaults, on fake clocks (the other tests pass
    wait_s=0 and step the clock by the module's RETRY_MS, so a 1-minute wait or retry passed them): a
    silent guest is polled until exactly 120 s after the attach, then detached; the next try comes at
    exactly 300 s after that, not half a second before."""
    from types import SimpleNamespace

    from bcd_agent.sections.instances import rebind as rb

    mono = [500.0]
    monkeypatch.setattr(rb, "time", SimpleNamespace(monotonic=lambda: mono[0]))
    system = sim_host(tmp_path)
    source = FixedUserData({"a": UserData(data=bundle(with_key=False))})
    sec, rt = section(system, user_data=source)
    clock = _Clock()

    def sleep(s: float) -> None:
        mono[0] += s
        clock.t += s

    sec.rebinder = Rebinder(system, DATA_DIR, sec.runtimes, source, clock=clock, sleep=sleep)
    desired = spec(vm("a", identity_rebind_ref="ref-1"))
    converge(sec, desired)
    (system.host_path(STATE) / "a.silent").write_text("")
    detached: list[float] = []
    real_detach = rt.rebind_detach

    def detach(name: str) -> None:
        detached.append(mono[0])
        real_detach(name)

    rt.rebind_detach = detach
    assert sec.rebind_tick(desired) == [("a", "the guest did not answer")]
    assert detached == [620.0]  # 500 + 120 s of polling
    clock.t += 299.5  # the retry time is counted from the attempt's end (the clock read then)
    assert sec.rebind_tick(desired) == []
    clock.t += 0.5
    assert sec.rebind_tick(desired) == [("a", "the guest did not answer")]
