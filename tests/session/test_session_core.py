"""SessionCore driven message by message against a real journal and real pki (no transport)."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.dispatch.clock import OffsetClock
from bcd_agent.dispatch.trust import BundleTrust
from bcd_agent.journal import (
    CommandFlags,
    EventClass,
    Journal,
    NewCommand,
    NewEvent,
    Outcome,
    WelcomeRefused,
)
from bcd_agent.session import identity as ident
from bcd_agent.session.backoff import Backoff
from bcd_agent.session.core import ProtocolViolation, SessionCore
from bcd_shared import wire
from bcd_shared.pki import (
    KeyPair,
    TrustBundle,
    issue_leaf,
    issue_node_certificate,
    issue_root,
    sign_trust_bundle,
)
from bcd_shared.pki.certs import Role
from bcd_shared.pki.pins import JoinKeyPin
from bcd_shared.pki.signing import Purpose

NODE = "node-1"
NOW = dt.datetime.now(dt.UTC)


class Pki:
    def __init__(self) -> None:
        start, end = NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=30)
        self.join = KeyPair.generate()
        self.root_key = KeyPair.generate()
        self.root = issue_root(self.root_key, "cmd root", start, end, path_length=0)
        self.worker = KeyPair.generate()
        self.worker_der = issue_leaf(
            self.root, self.root_key, self.worker.public_key, Role.WORKER, "w", start, end
        )
        self.ca_key = KeyPair.generate()
        self.ca = issue_root(self.ca_key, "node ca", start, end, path_length=0)
        self.node_key = KeyPair.generate()
        self.node_cert = issue_node_certificate(
            self.ca, self.ca_key, self.node_key.public_key, NODE, start, end
        )

    def bundle(self, version: int = 1, roots: bool = True) -> wire.SignedTrustBundle:
        return sign_trust_bundle(
            self.join, TrustBundle(version=version, command_roots=(self.root,) if roots else ())
        )

    def identity(self) -> ident.Identity:
        return ident.Identity(
            NODE, self.node_key, (self.node_cert,), str(JoinKeyPin.of_key(self.join.public_key))
        )

    def spec(
        self,
        generation: int,
        *,
        node: str = NODE,
        sign: bool = True,
        key: KeyPair | None = None,
        full: wire.NodeSpec | None = None,
        patch: wire.NodeSpecPatch | None = None,
        base: int = 0,
        spec_hash: str = "",
    ) -> wire.DesiredState:
        if patch is None and full is None:
            full = wire.NodeSpec(telemetry=wire.TelemetrySection(otlp_endpoint=f"https://o/{generation}"))
        body = bytes(
            wire.DesiredStateBody(
                node_id=node,
                generation=generation,
                spec_hash=spec_hash or f"opaque-{generation}",
                full=full,
                patch=patch,
                base_generation=base,
            )
        )
        signature = (key or self.worker).sign(Purpose.DESIRED_STATE, body) if sign else b""
        return wire.DesiredState(body=body, signature=signature, signer_chain=[self.worker_der])


class Recorder:
    """Records what the core asks of the dispatcher and the runner (their own tests cover them)."""

    def __init__(self) -> None:
        self.specs: list[Any] = []
        self.applied: list[int] = []
        self.cancels: list[str] = []
        self.delivered: list[str] = []
        self.upgrade_only: list[bool] = []

    def set_spec(self, spec: Any) -> bool:
        self.specs.append(spec)
        return True

    def spec_applied(self, generation: int) -> None:
        self.applied.append(generation)

    def cancel(self, command_id: str, reason: str = "") -> None:
        self.cancels.append(command_id)

    def deliver(self, cmd: Any) -> None:
        self.delivered.append(cmd.id)

    def set_upgrade_only(self, value: bool) -> None:
        self.upgrade_only.append(value)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def pki() -> Pki:
    return Pki()


def make(
    tmp_path: Path, pki: Pki, *, journal: Journal | None = None
) -> tuple[SessionCore, list[wire.NodeMessage], Recorder, Clock]:
    journal = journal or Journal.open(tmp_path / "data", boot_id="boot-1")
    rec = Recorder()
    mono = Clock()
    core = SessionCore(
        journal=journal,
        dispatcher=rec,
        runner=rec,
        trust=BundleTrust(),
        clock=OffsetClock(),
        identity=pki.identity(),
        data_dir=tmp_path / "data",
        monotonic=mono,
        persist_identity=False,
    )
    out: list[wire.NodeMessage] = []
    return core, out, rec, mono


def welcome(
    server_ms: int | None = None, bundle: wire.SignedTrustBundle | None = None
) -> wire.GatewayMessage:
    ms = int(time.time() * 1000) if server_ms is None else server_ms
    return wire.GatewayMessage(welcome=wire.Welcome(server_time=ms, session_epoch=7, trust_bundle=bundle))


def spec_requests(out: list[wire.NodeMessage]) -> list[tuple[int, wire.SpecRequestReason]]:
    return [
        (m.spec_request.have_generation, m.spec_request.reason) for m in out if m.spec_request is not None
    ]


def connect(core: SessionCore, out: list[wire.NodeMessage], **kw: Any) -> wire.Hello:
    hello = core.attach(out.append).hello
    assert hello is not None
    core.handle(welcome(**kw))
    return hello


def test_DLV_RCV_08_no_spec_on_a_new_journal_asks_with_NO_SPEC(tmp_path: Path, pki: Pki) -> None:
    """Covers DLV-RCV-04: bcd sends SpecRequest{have_generation, reason}."""
    core, out, _rec, _ = make(tmp_path, pki)
    hello = connect(core, out)
    assert hello.applied_generation == 0 and hello.node_id == NODE and hello.boot_id == "boot-1"
    assert spec_requests(out) == [(0, wire.SpecRequestReason.NO_SPEC)]


def test_DLV_RCV_19_15_spec_stored_exactly_and_hash_echoed(tmp_path: Path, pki: Pki) -> None:
    core, out, rec, _ = make(tmp_path, pki)
    connect(core, out)
    # Fields in an order betterproto2 never writes: spec_hash first, then the rest.
    body = bytes(wire.DesiredStateBody(spec_hash="not-a-hash:Z")) + bytes(
        wire.DesiredStateBody(node_id=NODE, generation=3, full=wire.NodeSpec(devices=wire.DevicesSection()))
    )
    envelope = wire.DesiredState(body=body, signature=b"", signer_chain=[])
    core.handle(wire.GatewayMessage(desired_state=envelope))
    stored = core.journal.load_spec()
    assert stored is not None and stored.body == body and stored.spec_hash == "not-a-hash:Z"
    assert [s.generation for s in rec.specs] == [3] and rec.applied == [3]
    core.detach()
    hello = core.attach(out.append).hello
    assert hello is not None and hello.applied_spec_hash == "not-a-hash:Z" and hello.applied_generation == 3


def test_DLV_RCV_13_14_bodies_for_another_node_or_not_newer_are_ignored(tmp_path: Path, pki: Pki) -> None:
    core, out, rec, _ = make(tmp_path, pki)
    connect(core, out)
    core.handle(wire.GatewayMessage(desired_state=pki.spec(2, sign=False)))
    core.handle(wire.GatewayMessage(desired_state=pki.spec(5, node="node-2", sign=False)))
    core.handle(wire.GatewayMessage(desired_state=pki.spec(2, sign=False)))
    core.handle(wire.GatewayMessage(desired_state=pki.spec(1, sign=False)))
    assert [s.generation for s in rec.specs] == [2]
    assert core.journal.applied_generation == 2
    assert len(core.state.ignored_specs) == 3


def test_DLV_RCV_06_patch_on_another_base_is_not_applied_and_requests_the_spec(
    tmp_path: Path, pki: Pki
) -> None:
    core, out, rec, _ = make(tmp_path, pki)
    connect(core, out)
    core.handle(wire.GatewayMessage(desired_state=pki.spec(1, sign=False)))
    out.clear()
    patch = wire.NodeSpecPatch(devices=wire.DevicesSection())
    core.handle(wire.GatewayMessage(desired_state=pki.spec(3, patch=patch, base=2, sign=False)))
    assert spec_requests(out) == [(1, wire.SpecRequestReason.PATCH_BASE_MISMATCH)]
    assert core.journal.applied_generation == 1 and len(rec.specs) == 1


def test_DLV_RCV_10_11_12_patch_on_its_base_replaces_clears_and_keeps(tmp_path: Path, pki: Pki) -> None:
    core, out, rec, _ = make(tmp_path, pki)
    connect(core, out)
    full = wire.NodeSpec(
        telemetry=wire.TelemetrySection(otlp_endpoint="https://a"),
        devices=wire.DevicesSection(assignments=[wire.DeviceAssignment(allocation_id="a")]),
        access=wire.AccessSection(principals=["root@node-1"]),
    )
    core.handle(wire.GatewayMessage(desired_state=pki.spec(1, full=full, sign=False)))
    patch = wire.NodeSpecPatch(
        telemetry=wire.TelemetrySection(otlp_endpoint="https://b"), devices=wire.DevicesSection()
    )
    core.handle(wire.GatewayMessage(desired_state=pki.spec(2, patch=patch, base=1, sign=False)))
    spec = rec.specs[-1]
    assert spec.generation == 2
    assert spec.payload("telemetry").otlp_endpoint == "https://b"  # replaced
    assert spec.payload("devices").assignments == []  # cleared
    assert spec.payload("access").principals == ["root@node-1"]  # kept


def test_DLV_SIG_16_signed_spec_rule_once_roots_are_known(tmp_path: Path, pki: Pki) -> None:
    core, out, rec, _ = make(tmp_path, pki)
    connect(core, out, bundle=pki.bundle())
    core.handle(wire.GatewayMessage(desired_state=pki.spec(1, sign=False)))
    core.handle(wire.GatewayMessage(desired_state=pki.spec(2, key=KeyPair.generate())))
    assert rec.specs == [] and core.journal.applied_generation == 0
    assert len(core.state.refused_specs) == 2
    core.handle(wire.GatewayMessage(desired_state=pki.spec(3)))
    assert [s.generation for s in rec.specs] == [3]


def test_DLV_SIG_15_a_present_spec_signature_is_verified_not_just_seen(tmp_path: Path, pki: Pki) -> None:
    """The signature is checked over the exact body bytes, under purpose `desired-state`, by a key the
    chain binds: a signature of the trusted worker over other bytes, or under the `command` purpose,
    is present and well-formed and still refused; the right one is applied."""
    core, out, rec, _ = make(tmp_path, pki)
    connect(core, out, bundle=pki.bundle())
    other = pki.spec(1)
    moved = pki.spec(2)
    moved.signature = other.signature  # the worker's signature, of generation 1's body
    core.handle(wire.GatewayMessage(desired_state=moved))
    as_command = pki.spec(3)
    as_command.signature = pki.worker.sign(Purpose.COMMAND, bytes(as_command.body))
    core.handle(wire.GatewayMessage(desired_state=as_command))
    no_chain = pki.spec(4)
    no_chain.signer_chain = []
    core.handle(wire.GatewayMessage(desired_state=no_chain))
    assert rec.specs == [] and core.journal.applied_generation == 0
    assert len(core.state.refused_specs) == 3
    core.handle(wire.GatewayMessage(desired_state=pki.spec(5)))
    assert [s.generation for s in rec.specs] == [5]
    stored = core.journal.load_spec()
    assert stored is not None and stored.signature == pki.spec(5).signature


def test_signed_spec_rule_not_enforced_without_roots(tmp_path: Path, pki: Pki) -> None:
    core, out, rec, _ = make(tmp_path, pki)
    connect(core, out, bundle=pki.bundle(roots=False))
    core.handle(wire.GatewayMessage(desired_state=pki.spec(1, sign=False)))
    assert [s.generation for s in rec.specs] == [1]


def test_DLV_JRN_13_welcome_more_than_5_minutes_before_the_mark_is_refused(tmp_path: Path, pki: Pki) -> None:
    core, out, _rec, _ = make(tmp_path, pki)
    mark_ms = int(time.time() * 1000)
    core.journal.observe_server_time(mark_ms / 1000)
    core.attach(out.append)
    with pytest.raises(WelcomeRefused):
        core.handle(welcome(mark_ms - 301_000))
    assert not core.state.welcomed
    core.detach()
    core.attach(out.append)
    core.handle(welcome(mark_ms - 299_000))
    assert core.state.welcomed


def test_messages_before_welcome_end_the_connection(tmp_path: Path, pki: Pki) -> None:
    core, out, _rec, _ = make(tmp_path, pki)
    core.attach(out.append)
    with pytest.raises(ProtocolViolation):
        core.handle(wire.GatewayMessage(ack=wire.Ack(command_ids=["x"])))


def test_trust_bundle_is_forward_only(tmp_path: Path, pki: Pki) -> None:
    core, out, _rec, _ = make(tmp_path, pki)
    connect(core, out, bundle=pki.bundle(version=2, roots=False))
    core.handle(wire.GatewayMessage(trust_bundle=pki.bundle(version=1, roots=True)))
    assert (
        core.trust.bundle is not None
        and core.trust.bundle.version == 2
        and not core.trust.has_command_roots()
    )
    core.handle(wire.GatewayMessage(trust_bundle=pki.bundle(version=3, roots=True)))
    assert core.trust.bundle.version == 3 and core.trust.has_command_roots()


def _done_command(journal: Journal, cid: str) -> None:
    journal.accept_command(NewCommand(id=cid, kind="test.effect", flags=CommandFlags()))
    journal.complete(cid, Outcome.SUCCEEDED, body=b"result")


def test_DLV_RES_08_results_replayed_until_acked(tmp_path: Path, pki: Pki) -> None:
    core, out, _rec, mono = make(tmp_path, pki)
    cid = "01HZZZZZZZZZZZZZZZZZZZZZZZ"
    _done_command(core.journal, cid)
    hello = connect(core, out)
    assert [u.command_id for u in hello.unacked_results] == [cid]
    assert hello.unacked_results[0].state == wire.CommandState.SUCCEEDED
    out.clear()
    assert not core.resend_due()  # not yet due
    mono.t += 11
    assert core.resend_due()
    assert [m.command_update.command_id for m in out if m.command_update] == [cid]
    core.handle(wire.GatewayMessage(ack=wire.Ack(command_ids=[cid, "unknown-id"])))
    out.clear()
    mono.t += 11
    core.resend_due()
    assert [m for m in out if m.command_update] == []
    core.detach()
    assert core.attach(out.append).hello.unacked_results == []  # type: ignore[union-attr]


def test_a_replay_waits_only_before_the_interval_and_the_welcome_and_keeps_the_outboxs_reserve(
    tmp_path: Path, pki: Pki
) -> None:
    """Results are replayed once resend_interval_s (10 s) has passed, at exactly 10 s too, and never
    before the Welcome; each while the outbox has at least its reserve free (EVENT_RESERVE_BYTES), so
    at exactly the reserve it is sent and a byte under it waits."""
    from bcd_agent.session.outbox import EVENT_RESERVE_BYTES

    core, out, _rec, mono = make(tmp_path, pki)
    cid = "01HZZZZZZZZZZZZZZZZZZZZZZZ"
    _done_command(core.journal, cid)
    room = [EVENT_RESERVE_BYTES]
    core.attach(out.append, room=lambda: room[0])
    mono.t += 60
    assert not core.resend_due()  # not welcomed yet
    core.handle(welcome())
    out.clear()
    mono.t += 10
    assert core.resend_due()
    assert [m.command_update.command_id for m in out if m.command_update] == [cid]
    out.clear()
    room[0] = EVENT_RESERVE_BYTES - 1
    mono.t += 10
    assert core.resend_due()
    assert [m for m in out if m.command_update] == []


def test_hello_is_the_journals_and_the_nodes_own_and_each_session_is_counted(
    tmp_path: Path, pki: Pki
) -> None:
    """Hello names the node, its boot, journal, incarnation, version, role, capabilities, runtimes, the
    last session epoch and the last event written; each attach starts an unwelcomed, connected session
    and counts it; each Welcome is counted and its epoch kept; a second Welcome on one session ends it; a
    refused Welcome's reason is kept for `bcd status`."""
    journal = Journal.open(tmp_path / "data", boot_id="boot-1")
    journal.append_events([NewEvent(EventClass.TRANSITION, "t", b"p")] * 3)
    journal.set_last_epoch(5)
    rec = Recorder()
    core = SessionCore(
        journal=journal,
        dispatcher=rec,
        runner=rec,
        trust=BundleTrust(),
        clock=OffsetClock(),
        identity=pki.identity(),
        data_dir=tmp_path / "data",
        monotonic=Clock(),
        persist_identity=False,
        role=wire.Role.NODE,
        version="9.9.9",
        capabilities=("cap-a", "cap-b"),
        runtimes=("libvirt",),
    )
    hello = core.attach([].append).hello
    assert hello is not None
    assert (
        hello.node_id,
        hello.boot_id,
        hello.journal_id,
        hello.incarnation,
        hello.version,
        hello.role,
        hello.capabilities,
        hello.runtimes,
        hello.applied_spec_hash,
        hello.last_session_epoch,
        hello.last_event_seq,
    ) == (
        core.node_id,
        "boot-1",
        journal.journal_id,
        journal.incarnation,
        "9.9.9",
        wire.Role.NODE,
        ["cap-a", "cap-b"],
        ["libvirt"],
        "",
        5,
        3,
    )
    assert journal.journal_id and journal.incarnation
    st = core.state
    assert (st.connected, st.welcomed, st.connections, st.hello_sent_monotonic) == (True, False, 1, 1000.0)
    core.handle(welcome())
    assert (st.welcomed, st.welcomes, st.epoch, journal.last_epoch) == (True, 1, 7, 7)  # the epoch kept
    with pytest.raises(ProtocolViolation, match=r"^a second Welcome on one session$"):
        core.handle(welcome())
    core.detach()
    core.attach([].append)
    assert (st.connected, st.welcomed, st.connections) == (True, False, 2)
    mark_ms = int(journal.server_time_mark * 1000)
    with pytest.raises(WelcomeRefused) as refused:
        core.handle(welcome(mark_ms - 301_000))
    assert st.last_refusal == str(refused.value) and "before the server time mark" in st.last_refusal
    core.handle(welcome())
    assert (st.welcomed, st.welcomes) == (True, 2)
    journal.close()


def test_DLV_EVT_03_04_events_sent_in_batches_and_replayed_until_acked(tmp_path: Path, pki: Pki) -> None:
    core, out, _rec, mono = make(tmp_path, pki)
    for i in range(3):
        core.journal.append_event(EventClass.RESULT, "T", bytes(wire.Event(type="T", payload=bytes([i]))))
    connect(core, out)
    batches = [m.event_batch for m in out if m.event_batch is not None]
    assert [e.seq for b in batches for e in b.events] == [1, 2, 3]
    assert batches[0].journal_id == core.journal.journal_id
    core.handle(wire.GatewayMessage(ack=wire.Ack(journal_id="another-journal", event_seq=3)))
    core.handle(wire.GatewayMessage(ack=wire.Ack(journal_id=core.journal.journal_id, event_seq=2)))
    out.clear()
    mono.t += 11
    core.resend_due()
    assert [e.seq for m in out if m.event_batch for e in m.event_batch.events] == [3]


def test_DLV_CAN_02_cancel_handled_once_per_session(tmp_path: Path, pki: Pki) -> None:
    core, out, rec, _ = make(tmp_path, pki)
    connect(core, out)
    cancel = wire.GatewayMessage(cancel=wire.Cancel(command_id="c1", reason="r"))
    core.handle(cancel)
    core.handle(cancel)
    assert rec.cancels == ["c1"]
    core.detach()
    connect(core, out)
    core.handle(cancel)
    assert rec.cancels == ["c1", "c1"]


def test_DLV_RCV_07_min_generation_request_waits_for_the_welcome(tmp_path: Path, pki: Pki) -> None:
    core, out, _rec, _ = make(tmp_path, pki)
    connect(core, out)
    core.handle(wire.GatewayMessage(desired_state=pki.spec(1, sign=False)))
    core.detach()
    core.request_spec_for_min_generation(1)  # offline: remembered until the next Welcome
    out.clear()
    connect(core, out)
    assert spec_requests(out) == [(1, wire.SpecRequestReason.MIN_GENERATION)]
    core.request_spec_for_min_generation(1)  # online: at once
    assert spec_requests(out)[-1] == (1, wire.SpecRequestReason.MIN_GENERATION)
    core.detach()
    out.clear()
    connect(core, out)
    assert spec_requests(out) == []  # the remembered request went with that Welcome, once


def test_unusable_stored_spec_is_discarded_when_roots_are_known(tmp_path: Path, pki: Pki) -> None:
    core, out, _rec, _ = make(tmp_path, pki)
    connect(core, out)
    core.handle(wire.GatewayMessage(desired_state=pki.spec(1, sign=False)))
    assert core.load_spec() is not None
    core.trust.set_bundle(TrustBundle(version=1, command_roots=(pki.root,)))
    assert core.load_spec() is None and core.journal.needs_spec


@pytest.mark.parametrize("attempt", range(0, 40))
def test_backoff_is_capped_and_jittered(attempt: int) -> None:
    b = Backoff(initial_s=0.5, max_s=30.0, jitter=0.5)
    top = min(30.0, 0.5 * 2**attempt)
    assert b.delay(attempt, 0.0) == pytest.approx(top)
    assert b.delay(attempt, 1.0) == pytest.approx(top / 2)
    assert 0 < b.delay(attempt, 0.37) <= 30.0


def test_HST_SIGN_02_03_04_every_full_spec_is_kept_for_the_helper_a_patch_only_when_it_sets_host(
    tmp_path: Path, pki: Pki
) -> None:
    """A full spec decides the host section (unset meaning empty, so the helper may clean the units it no
    longer names); a patch that does not set `host` keeps the earlier body."""
    from bcd_agent.sections.host.intent import read_host_intent

    core, out, _, _ = make(tmp_path, pki)
    connect(core, out)
    units = wire.HostSection(units=[wire.HostUnit(name="sysctl", settings='{"vm.swappiness":10}')])
    first = pki.spec(1, full=wire.NodeSpec(host=units))
    core.handle(wire.GatewayMessage(desired_state=first))
    kept = read_host_intent(tmp_path / "data")
    assert kept is not None and kept.generation == 1 and kept.body == bytes(first.body)
    assert (tmp_path / "data" / "host-intent.json").stat().st_mode & 0o777 == 0o600
    second = pki.spec(2, full=wire.NodeSpec(devices=wire.DevicesSection()))  # host unset: empty
    core.handle(wire.GatewayMessage(desired_state=second))
    kept = read_host_intent(tmp_path / "data")
    assert kept is not None and kept.generation == 2 and kept.body == bytes(second.body)
    assert kept.signature == bytes(second.signature) and kept.signer_chain == (pki.worker_der,)
    third = pki.spec(3, patch=wire.NodeSpecPatch(devices=wire.DevicesSection()), base=2)
    core.handle(wire.GatewayMessage(desired_state=third))
    assert core.journal.applied_generation == 3
    kept = read_host_intent(tmp_path / "data")
    assert kept is not None and kept.generation == 2  # HST-SIGN-03


# --- identity.json: the trust bundle and the server time mark (DLV-JRN-07, DLV-JRN-14) ------------------


def _persisting(data: Path, pki: Pki, identity: ident.Identity | None = None) -> SessionCore:
    """A core that writes identity.json (as `bcd node` does), on its own journal in `data`."""
    if identity is None:
        identity = pki.identity()
        ident.save(data, identity)
    rec = Recorder()
    return SessionCore(
        journal=Journal.open(data, boot_id="boot-1"),
        dispatcher=rec,
        runner=rec,
        trust=BundleTrust(),
        clock=OffsetClock(),
        identity=identity,
        data_dir=data,
        monotonic=Clock(),
    )


def test_DLV_JRN_07_identity_json_keeps_the_chain_and_the_newest_trust_bundle(
    tmp_path: Path, pki: Pki
) -> None:
    """The certificate chain and the command-signing trust bundle live in identity.json beside the journal:
    a bundle accepted at Welcome (and a newer one later) is written there, and a node started again from
    that file enforces signatures from the first message, before any Welcome brings a bundle."""
    data = tmp_path / "data"
    core = _persisting(data, pki)
    first, newer = pki.bundle(version=2, roots=True), pki.bundle(version=5, roots=True)
    connect(core, [], bundle=first)
    stored = ident.load(data)
    assert stored.certificate_chain == (pki.node_cert,) and stored.node_key.seed == pki.node_key.seed
    assert stored.trust_bundle is not None and stored.trust_bundle.bundle == bytes(first.bundle)
    core.handle(wire.GatewayMessage(trust_bundle=newer))
    core.handle(wire.GatewayMessage(trust_bundle=first))  # older: ignored, the file keeps version 5
    stored = ident.load(data)
    assert stored.trust_bundle is not None
    assert (stored.trust_bundle.bundle, stored.trust_bundle.signature) == (
        bytes(newer.bundle),
        bytes(newer.signature),
    )
    core.journal.close()
    # Started again: the roots come from identity.json alone.
    again = _persisting(data, pki, identity=ident.load(data))
    assert (
        again.trust.bundle is not None and again.trust.bundle.version == 5 and again.trust.has_command_roots()
    )
    again.journal.close()


def test_DLV_JRN_11_14_the_mark_is_mirrored_and_a_lost_journal_does_not_reset_it(
    tmp_path: Path, pki: Pki
) -> None:
    """The mark is the server time of the Welcome, then of each later heartbeat (DLV-JRN-11), and
    identity.json mirrors it so a lost journal does not reset it (DLV-JRN-14)."""
    data = tmp_path / "data"
    core = _persisting(data, pki)
    mark_ms = int(time.time() * 1000)
    connect(core, [], server_ms=mark_ms)
    assert ident.load(data).server_time_mark_ms == mark_ms  # mirrored at every Welcome
    # Heartbeats move the journal's mark at once and the mirror once it moved a minute.
    core.handle(wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=mark_ms + 30_000)))
    assert core.journal.server_time_mark == (mark_ms + 30_000) / 1000
    assert ident.load(data).server_time_mark_ms == mark_ms
    later_ms = mark_ms + 90_000
    core.handle(wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=later_ms)))
    assert ident.load(data).server_time_mark_ms == later_ms
    core.journal.close()
    # The journal is lost (moved away, as a corrupt one is moved aside); identity.json stays.
    for f in data.glob("journal.db*"):
        f.rename(tmp_path / f.name)
    fresh = _persisting(data, pki, identity=ident.load(data))
    assert fresh.journal.report.created
    assert fresh.journal.server_time_mark == later_ms / 1000  # fed back from identity.json
    fresh.attach([].append)
    with pytest.raises(WelcomeRefused):  # a gateway more than 5 minutes behind the old mark
        fresh.handle(welcome(later_ms - 301_000))
    fresh.detach()
    fresh.attach([].append)
    fresh.handle(welcome(later_ms - 299_000))
    assert fresh.state.welcomed
    # The mark never moves back: the older Welcome did not lower the mirrored one.
    assert ident.load(data).server_time_mark_ms == later_ms
    fresh.journal.close()


def test_DLV_JRN_14_every_welcome_mirrors_the_mark_even_a_step_under_a_minute(
    tmp_path: Path, pki: Pki
) -> None:
    """Heartbeats mirror the mark into identity.json only once it moved a minute; a Welcome mirrors it
    whatever the step, so a mark a heartbeat moved 30 s is in identity.json after the next Welcome."""
    data = tmp_path / "data"
    core = _persisting(data, pki)
    mark_ms = int(time.time() * 1000)
    connect(core, [], server_ms=mark_ms)
    core.handle(wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=mark_ms + 30_000)))
    assert ident.load(data).server_time_mark_ms == mark_ms  # 30 s: not yet
    core.detach()
    core.attach([].append)
    core.handle(welcome(mark_ms))
    assert ident.load(data).server_time_mark_ms == mark_ms + 30_000
    core.journal.close()


def test_DLV_JRN_12_the_mark_never_moves_back(tmp_path: Path, pki: Pki) -> None:
    """An older heartbeat, an older (but admitted) Welcome and an older mirror in identity.json at start
    all leave the mark where it is; the node's heartbeat reports the highest time seen."""
    data = tmp_path / "data"
    core = _persisting(data, pki)
    mark_ms = int(time.time() * 1000)
    connect(core, [], server_ms=mark_ms)
    high_ms = mark_ms + 120_000
    core.handle(wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=high_ms)))
    core.handle(wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=mark_ms + 10_000)))
    assert core.journal.server_time_mark == high_ms / 1000
    core.detach()
    core.attach([].append)
    core.handle(welcome(high_ms - 60_000))  # a minute behind: admitted, and the mark stays
    assert core.state.welcomed and core.journal.server_time_mark == high_ms / 1000
    sent = core.heartbeat().heartbeat
    assert sent is not None and sent.server_time_mark == high_ms
    core.journal.close()
    # identity.json mirrors an older mark than the journal's: the journal keeps its own.
    ident.save(data, ident.with_mark(pki.identity(), mark_ms))
    again = _persisting(data, pki, identity=ident.load(data))
    assert again.journal.server_time_mark == high_ms / 1000
    again.journal.close()


class BatchingRecorder(Recorder):
    """A dispatcher that records when the session opens and closes its admission batch."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        self.log.append("enter")
        try:
            yield
        finally:
            self.log.append("exit")  # the batch's accepts are written here, even when a message raised

    def cancel(self, command_id: str, reason: str = "") -> None:
        self.log.append(command_id)


def test_a_received_batch_is_handled_inside_one_admission_batch(tmp_path: Path, pki: Pki) -> None:
    """The messages that arrived together reach the dispatcher inside one `admitting()`, so their
    commands' accepts are journaled in one durable transaction; a message that ends the connection
    still closes the batch (what was admitted is journaled and answered)."""
    core, out, _, _ = make(tmp_path, pki)
    rec = BatchingRecorder()
    core.dispatcher = rec
    connect(core, out)
    batch = [wire.GatewayMessage(cancel=wire.Cancel(command_id=c, reason="r")) for c in ("a", "b", "c")]
    core.handle_batch(batch)
    assert rec.log == ["enter", "a", "b", "c", "exit"]
    with pytest.raises(ProtocolViolation):
        core.handle_batch([wire.GatewayMessage(cancel=wire.Cancel(command_id="d", reason="r")), welcome()])
    assert rec.log[5:] == ["enter", "d", "exit"]
