"""The node's half of the session, without the transport (no asyncio, no grpclib; trio only for nothing).

`SessionCore` turns GatewayMessages into journal writes, dispatcher calls and runner inputs, and produces
NodeMessages through the `send` callable the transport attaches for the life of one connection. Every
method is synchronous and finishes its durable writes before it returns, so it can be driven message by
message in tests (tests/session) exactly as the transport drives it.

Per connection (`attach` ... `detach`):
- `attach(send)` returns the Hello (node id, boot id, journal id, incarnation, applied generation and hash,
  capabilities, runtimes, every unacked terminal result, last epoch and event seq). Nothing else is sent
  before the Welcome.
- Welcome: refused (WelcomeRefused, the connection ends and backs off) when its server_time is more than
  5 minutes before the journal's server time mark (DLV-JRN-13); otherwise the mark moves forward (and is
  mirrored into identity.json), the server-time offset is set (DLV-ACK-10), the epoch journaled, a newer
  trust bundle accepted (forward only: an older version is logged and ignored), then SpecRequest NO_SPEC
  when the journal holds no usable spec (DLV-RCV-08) and every unacked event is sent.
- DesiredState: `spec.judge`; an accepted spec is stored in the journal (exact bytes, hash, signature;
  DLV-RCV-19) *before* the runner gets it, then the dispatcher re-checks deferred commands.
- Command: strict conversion (dispatch.wire) then `Dispatcher.deliver` (journal Resolve + acceptance).
- Cancel: handled once per session per command id (DLV-CAN-02 says the gateway repeats it after every
  reconnect; repeats within a session are dropped), through `Dispatcher.cancel`.
- Ack: results and events acknowledged in the journal; they stop being replayed (DLV-RES-08, DLV-EVT-04).
- Replay: `resend_due(now)` resends every unacked terminal result and every unacked event once
  `resend_interval_s` passed without an ack; a reconnect replays results in Hello and events after Welcome.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
from attrs import define, field
from bcd_shared import wire
from bcd_shared.pki import TrustStore, VerifiedBundle
from bcd_shared.pki.chain import ChainCache
from bcd_shared.pki.errors import PkiError
from bcd_shared.system import atomic_write
from bcd_shared.wire.strict import WireError

from bcd_agent.converge.status import StatusCell
from bcd_agent.converge.types import DesiredSpec, NodeStatus
from bcd_agent.dispatch.clock import OffsetClock
from bcd_agent.dispatch.command import CommandUpdate, InvalidCommand, RejectReason, envelope_sha256
from bcd_agent.dispatch.ports import ResultSigner
from bcd_agent.dispatch.results import update_from_entry
from bcd_agent.dispatch.trust import BundleTrust
from bcd_agent.dispatch.wire import envelope_from_wire, update_to_wire
from bcd_agent.journal import (
    WELCOME_SLACK_S,
    Action,
    CommandFlags,
    DataDirFull,
    Journal,
    JournalFull,
    NewCommand,
    WelcomeRefused,
)
from bcd_agent.session import identity as ident
from bcd_agent.session import spec as specmod
from bcd_agent.session.conditions import DATA_DIR_FULL, JOURNAL_TAIL_LOST, NodeConditions
from bcd_agent.session.events import wire_event
from bcd_agent.session.secrets import SecretRequests
from bcd_agent.session.status import status_report

log = logging.getLogger("bcd.session")

RESEND_INTERVAL_S = 10.0
EVENT_BATCH = 256
HOST_INTENT_FILE = "host-intent.json"
# The identity file mirrors the mark at Welcome and when it moved this far since the last mirror.
MARK_MIRROR_STEP_MS = 60_000
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# The highest event seq ever sent, per journal_id, outside the journal (it survives a lost WAL tail).
EVENT_MARK_FILE = "event-mark.json"
# What the session remembers of refused or ignored specs, spec requests and cancels: bounded, so a
# gateway that sends them by the hundred thousand does not grow the node (counters count the rest).
RECENT = 16
MAX_CANCELS_SEEN = 10_000
# A repeated refusal is logged at most once per this many seconds (with the count since).
REPEAT_LOG_S = 60.0
# Hello carries unacked results up to this many bytes; the rest follow the Welcome as CommandUpdates
# (flow-controlled like the replay). Without a bound, results a compromised gateway never acks (a flood
# of refused commands, each journaled by DLV-ACK-17) grow the Hello past any gateway's 4 MiB message
# cap, and no honest gateway could take the Hello that would let it ack them.
HELLO_RESULTS_MAX_BYTES = 1024 * 1024
# A replay (Hello, after the Welcome, every resend interval) reads at most this many results from the
# journal, oldest first: never all of a flood's refusals into memory at once. 1 MiB of Hello holds fewer
# (a result is at least ~60 bytes), and the outbox's room stops a replay well before.
REPLAY_MAX_ROWS = 20_000
# The server time mark moves at most this far ahead of the host clock. A gateway's server_time further
# ahead (a compromised one sending the year 2100) would otherwise lift the mark for good, and every later
# Welcome from an honest gateway would be refused by DLV-JRN-13 (journal and identity.json both keep it).
# A minute under the Welcome slack, so a Welcome within a minute of the host clock is never refused.
MAX_SERVER_LEAD_S = WELCOME_SLACK_S - 60.0

Send = Callable[[wire.NodeMessage], None]


class ProtocolViolation(Exception):
    """The gateway broke the session's order (e.g. no Welcome first): the connection ends."""


class EventsRestarted(ProtocolViolation):
    """The gateway acked event seqs this journal never issued (its tail was lost): the journal now has
    a new journal_id, and the connection is replaced so the next Hello carries it."""


class DispatcherLike:  # the subset of dispatch.Dispatcher the session calls (documentation only)
    pass


class RunnerLike:
    pass


@define
class SessionState:
    """What the session knows of the current connection (read by tests, `bcd status`, benches)."""

    connected: bool = False
    welcomed: bool = False
    epoch: int = 0
    connections: int = 0
    welcomes: int = 0
    last_refusal: str = ""
    cancels_seen: set[str] = field(factory=set)  # this session's, at most MAX_CANCELS_SEEN
    # The last RECENT of each (bounded); the counters count them all.
    spec_requests: deque[tuple[int, str]] = field(factory=lambda: deque(maxlen=RECENT))
    ignored_specs: deque[str] = field(factory=lambda: deque(maxlen=RECENT))
    refused_specs: deque[str] = field(factory=lambda: deque(maxlen=RECENT))
    ignored_count: int = 0
    refused_count: int = 0
    hello_sent_monotonic: float | None = None
    journal_restarts: int = 0


class _RepeatLog:
    """Logs a repeated message once, then at most once per REPEAT_LOG_S with how many were not logged."""

    def __init__(self, level: int) -> None:
        self.level = level
        self._last = -float("inf")
        self._skipped = 0

    def log(self, now: float, fmt: str, *args: object) -> None:
        if now - self._last < REPEAT_LOG_S:
            self._skipped += 1
            return
        if self._skipped:
            log.log(self.level, fmt + " (%d more like it since the last)", *args, self._skipped)
        else:
            log.log(self.level, fmt, *args)
        self._last = now
        self._skipped = 0


class SessionCore:
    def __init__(
        self,
        *,
        journal: Journal,
        dispatcher: object,
        runner: object,
        trust: BundleTrust,
        clock: OffsetClock,
        identity: ident.Identity,
        data_dir: str | Path,
        status: StatusCell | None = None,
        signer: ResultSigner | None = None,
        role: wire.Role = wire.Role.NODE,
        version: str = "",
        capabilities: Sequence[str] = (),
        runtimes: Sequence[str] = (),
        inventory_hashes: Callable[[], Mapping[str, str]] = dict,
        monotonic: Callable[[], float] = time.monotonic,
        resend_interval_s: float = RESEND_INTERVAL_S,
        persist_identity: bool = True,
        secrets: SecretRequests | None = None,
        conditions: NodeConditions | None = None,
        event_mark: bool = True,
    ) -> None:
        self.journal = journal
        self.dispatcher = dispatcher
        self.runner = runner
        self.trust = trust
        self.clock = clock
        self.identity = identity
        self.data_dir = Path(data_dir)
        self.status = status
        self.signer = signer
        self.role = role
        self.version = version
        self.capabilities = tuple(capabilities)
        self.runtimes = tuple(runtimes)
        self.inventory_hashes = inventory_hashes
        self.monotonic = monotonic
        self.resend_interval_s = resend_interval_s
        self.persist_identity = persist_identity
        self.secrets = secrets if secrets is not None else SecretRequests()
        self.state = SessionState()
        self._send: Send | None = None
        self._chain_cache = ChainCache()
        self._trust_store = TrustStore()
        self._sent_event_seq = 0
        self._last_resend = 0.0
        self._sent_status_version = 0
        self._pending_min_generation: int | None = None
        self._mirrored_mark_ms = identity.server_time_mark_ms
        self._room: Callable[[], int] | None = None
        self.events_throttled = False  # events wait for room in the outbox
        self.conditions = conditions if conditions is not None else NodeConditions()
        self._sent_conditions_version = 0
        self._event_mark = event_mark
        self._mark_seq = 0
        # The mark covers every seq sent under this journal_id: read at start for it, or the journal is
        # new (nothing sent yet). Then an Ack above the mark is a lie, not a lost tail (round 2).
        self._mark_complete = False
        self._spec_retry = False
        self._batching = False  # inside handle_batch: result acks ride with the batch's transaction
        self._refused_log = _RepeatLog(logging.ERROR)
        self._ignored_log = _RepeatLog(logging.DEBUG)
        self._lead_log = _RepeatLog(logging.WARNING)
        self._results_after_welcome = False
        journal.on_space_change = self._space_changed
        if not journal.space_ok:
            self._space_changed(False, "")
        self._check_event_mark()
        bundle = identity.verified_bundle()
        if bundle is not None:
            self._trust_store = self._trust_store.accept(bundle)
            trust.set_bundle(bundle.bundle)
        # The mirrored mark survives a lost journal (seeds: "The journal").
        if identity.server_time_mark_ms / 1000 > journal.server_time_mark:
            journal.observe_server_time(identity.server_time_mark_ms / 1000)

    # --- start-up ---------------------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def load_spec(self) -> DesiredSpec | None:
        """The journal's stored spec, if usable: it decodes strictly, and once command-signing roots are
        known it carries a signature (it was verified before it was stored; DLV-RCV-20). An unusable one
        is discarded, so the session asks for the spec with NO_SPEC (DLV-RCV-08)."""
        stored = self.journal.load_spec()
        if stored is None:
            return None
        why = ""
        try:
            full, unknown = specmod.decode_stored(stored)
        except (WireError, ValueError) as exc:
            why = f"it does not decode: {exc}"
        else:
            if self.trust.has_command_roots() and not stored.signature:
                why = "it is unsigned and the trust bundle holds command-signing roots"
        if why:
            log.warning("session: the stored spec (generation %d) is not usable: %s", stored.generation, why)
            self.journal.discard_spec()
            return None
        return specmod.desired_spec(stored.generation, stored.spec_hash, full, unknown)

    # --- connection -------------------------------------------------------------------------------

    def attach(self, send: Send, room: Callable[[], int] | None = None) -> wire.NodeMessage:
        """A new connection: reset the per-session state and return the Hello to send first. `room` is
        the outbox's free bytes: events are read from the journal only while it is above the reserve."""
        self._send = send
        self._room = room
        self.events_throttled = False
        st = self.state
        st.connected = True
        st.welcomed = False
        st.cancels_seen = set()
        st.connections += 1
        self._sent_event_seq = self.journal.acked_event_seq
        self._sent_status_version = 0
        self._sent_conditions_version = -1
        self._last_resend = self.monotonic()
        stored = self.journal.load_spec()
        results, self._results_after_welcome = self._hello_results()
        hello = wire.Hello(
            node_id=self.node_id,
            boot_id=self.journal.boot_id,
            journal_id=self.journal.journal_id,
            incarnation=self.journal.incarnation,
            applied_generation=self.journal.applied_generation,
            capabilities=list(self.capabilities),
            runtimes=list(self.runtimes),
            unacked_results=results,
            version=self.version,
            role=self.role,
            applied_spec_hash=stored.spec_hash if stored is not None else "",
            last_session_epoch=self.journal.last_epoch,
            last_event_seq=self.journal.next_event_seq - 1,
        )
        st.hello_sent_monotonic = self.monotonic()
        return wire.NodeMessage(hello=hello)

    def _hello_results(self) -> tuple[list[wire.CommandUpdate], bool]:
        """The unacked results for Hello, oldest first, up to HELLO_RESULTS_MAX_BYTES; True when some
        were left for after the Welcome."""
        results: list[wire.CommandUpdate] = []
        size = 0
        entries = self.journal.unacked_results(limit=REPLAY_MAX_ROWS)
        for entry in entries:
            update = self._result_update(entry)
            size += len(bytes(update)) + 8  # the field's tag and length prefix
            if size > HELLO_RESULTS_MAX_BYTES:
                return results, True
            results.append(update)
        return results, len(entries) == REPLAY_MAX_ROWS  # more may wait behind the rows read

    def detach(self) -> None:
        self._send = None
        self._room = None
        self.secrets.detached()
        self.state.connected = False
        self.state.welcomed = False

    def _out(self, message: wire.NodeMessage) -> None:
        if self._send is not None:
            self._send(message)

    # --- inbound ----------------------------------------------------------------------------------

    def handle_batch(self, messages: Sequence[wire.GatewayMessage]) -> None:
        """Messages that arrived together, in order, with the dispatcher's `admitting()` around them: the
        commands among them that pass the checks are journaled `accepted` in one transaction, fsynced
        once, before any of their ACKED is queued (one fsync per batch instead of one per command); the
        batch's result acks are written with the next such transaction (`Journal.ack_results(defer=True)`:
        no fsync of their own; `resend_due` writes those still kept)."""
        # Looked up on the class: a stand-in dispatcher (benches, tests) without batches has none.
        admitting = getattr(type(self.dispatcher), "admitting", None)
        self._batching = True
        try:
            with admitting(self.dispatcher) if admitting is not None else contextlib.nullcontext():
                for message in messages:
                    self.handle(message)
        finally:
            self._batching = False

    def handle(self, message: wire.GatewayMessage) -> None:
        """One GatewayMessage. Raises WelcomeRefused or ProtocolViolation to end the connection."""
        which, value = _which(message)
        if not self.state.welcomed and which != "welcome":
            raise ProtocolViolation(f"the gateway sent {which or 'an empty message'} before Welcome")
        try:
            self._handle(which, value)
        except DataDirFull:
            # Nothing was written; the journal logged the state change once and the condition is up.
            # Whatever this message asked is asked again (acks and heartbeats recur, commands were
            # answered BUSY by the dispatcher, a spec is requested again when space returns).
            if which == "desired_state":
                self._spec_retry = True

    def _handle(self, which: str, value: object) -> None:
        if which == "welcome":
            assert isinstance(value, wire.Welcome)
            self._welcome(value)
        elif which == "heartbeat":
            assert isinstance(value, wire.GatewayHeartbeat)
            self._observe_time(value.server_time)
        elif which == "desired_state":
            assert isinstance(value, wire.DesiredState)
            self.desired_state(value)
        elif which == "command":
            assert isinstance(value, wire.Command)
            self._command(value)
        elif which == "cancel":
            assert isinstance(value, wire.Cancel)
            self._cancel(value)
        elif which == "ack":
            assert isinstance(value, wire.Ack)
            self._ack(value)
        elif which == "trust_bundle":
            assert isinstance(value, wire.SignedTrustBundle)
            self._trust_bundle(value)
        elif which == "secret_response":
            assert isinstance(value, wire.SecretResponse)
            self.secrets.deliver(value)
        else:
            raise ProtocolViolation("the gateway sent an empty GatewayMessage")

    def _welcome(self, welcome: wire.Welcome) -> None:
        if self.state.welcomed:
            raise ProtocolViolation("a second Welcome on one session")
        try:
            self.journal.check_welcome(welcome.server_time / 1000, self._mark_ceiling(welcome.server_time))
        except WelcomeRefused as exc:
            self.state.last_refusal = str(exc)
            raise
        except DataDirFull:
            pass  # the Welcome passed the check; only moving the mark forward failed
        self.clock.set_offset(welcome.server_time / 1000 - self.clock.host_time())
        self._mirror_mark(force=True)
        if welcome.session_epoch != self.journal.last_epoch:
            with contextlib.suppress(DataDirFull):  # informational; written again at the next Welcome
                self.journal.set_last_epoch(welcome.session_epoch)
        if welcome.trust_bundle is not None:
            self._trust_bundle(welcome.trust_bundle)
        self.dispatcher.set_upgrade_only(welcome.upgrade_only)  # type: ignore[attr-defined]
        st = self.state
        st.welcomed = True
        st.welcomes += 1
        st.epoch = welcome.session_epoch
        if self.journal.needs_spec:
            self._spec_request(wire.SpecRequestReason.NO_SPEC)
        elif self._pending_min_generation is not None:
            self._spec_request(wire.SpecRequestReason.MIN_GENERATION)
        self._pending_min_generation = None
        self.pump_events()
        if self._results_after_welcome:
            self._results_after_welcome = False
            self._replay_results()
        self.secrets.welcomed(self._out)

    def _observe_time(self, server_time_ms: int) -> None:
        self.journal.observe_server_time(server_time_ms / 1000, self._mark_ceiling(server_time_ms))
        self._mirror_mark()

    def _mark_ceiling(self, server_time_ms: int) -> float:
        """How far this server time may move the mark: MAX_SERVER_LEAD_S past the host clock."""
        ceiling = self.clock.host_time() + MAX_SERVER_LEAD_S
        if server_time_ms / 1000 > ceiling:
            self._lead_log.log(
                self.monotonic(),
                "session: server_time %d ms leads the host clock by %.0f s (more than %.0f s): the server"
                " time mark moves only to the host clock + %.0f s",
                server_time_ms,
                server_time_ms / 1000 - self.clock.host_time(),
                MAX_SERVER_LEAD_S,
                MAX_SERVER_LEAD_S,
            )
        return ceiling

    def _mirror_mark(self, force: bool = False) -> None:
        mark_ms = int(self.journal.server_time_mark * 1000)
        if mark_ms <= self._mirrored_mark_ms:
            return
        if force or mark_ms - self._mirrored_mark_ms >= MARK_MIRROR_STEP_MS:
            self._save_identity(ident.with_mark(self.identity, mark_ms))
            self._mirrored_mark_ms = mark_ms

    def _save_identity(self, identity: ident.Identity) -> None:
        self.identity = identity
        if self.persist_identity:
            try:
                ident.save(self.data_dir, identity)
            except OSError as exc:  # ENOSPC: kept in memory, written at the next change
                log.warning("session: identity.json not written: %s", exc)

    def _trust_bundle(self, signed: wire.SignedTrustBundle) -> None:
        try:
            bundle = ident.SignedBundle(
                bytes(signed.bundle), bytes(signed.signature), bytes(signed.signer_spki)
            ).verify(self.identity.pin)
            store = self._trust_store.accept(bundle)
        except PkiError as exc:
            log.warning("session: trust bundle refused: %s", exc)
            return
        if store == self._trust_store:
            return
        self._accept_bundle(store, bundle)

    def _accept_bundle(self, store: TrustStore, bundle: VerifiedBundle) -> None:
        self._save_identity(ident.with_bundle(self.identity, bundle))
        self._trust_store = store
        self.trust.set_bundle(bundle.bundle)
        log.info("session: trust bundle version %d accepted", bundle.version)

    def desired_state(self, envelope: wire.DesiredState) -> specmod.Verdict:
        verdict = specmod.judge(
            envelope,
            node_id=self.node_id,
            applied=self.journal.load_spec(),
            trust=self.trust.bundle,
            now=self.clock.server_now(),
            cache=self._chain_cache,
            floor=self.identity.applied_generation_mark,
        )
        if isinstance(verdict, specmod.Ignored):
            self._ignored_log.log(self.monotonic(), "session: spec ignored: %s", verdict.reason)
            self.state.ignored_specs.append(verdict.reason)
            self.state.ignored_count += 1
        elif isinstance(verdict, specmod.Refused):
            self._refused_log.log(self.monotonic(), "session: spec refused, not applied: %s", verdict.reason)
            self.state.refused_specs.append(verdict.reason)
            self.state.refused_count += 1
        elif isinstance(verdict, specmod.BaseMismatch):
            log.info(
                "session: patch base %d is not the applied generation %d: asking for the full spec",
                verdict.base_generation,
                verdict.applied_generation,
            )
            self._spec_request(wire.SpecRequestReason.PATCH_BASE_MISMATCH)
        else:
            # Durable before effect: the journal holds the spec before the runner acts on it.
            self.journal.store_spec(verdict.stored)
            # Mirrored like the server time mark: a lost journal must not reopen older generations.
            raised = ident.with_generation(self.identity, verdict.stored.generation)
            if raised is not self.identity:
                self._save_identity(raised)
            if verdict.sets_host:
                self._write_host_intent(verdict)
            self.runner.set_spec(verdict.spec)  # type: ignore[attr-defined]
            self.dispatcher.spec_applied(verdict.stored.generation)  # type: ignore[attr-defined]
            log.info("session: spec generation %d applied", verdict.stored.generation)
        return verdict

    def _write_host_intent(self, verdict: specmod.Accepted) -> None:
        """data_dir/host-intent.json (0600): the signed body that last set the host section, as received."""

        def b64(b: bytes) -> str:
            import base64

            return base64.b64encode(b).decode()

        doc = {
            "generation": verdict.stored.generation,
            "body": b64(verdict.body),
            "signature": b64(verdict.signature),
            "signer_chain": [b64(c) for c in verdict.signer_chain],
        }
        atomic_write(self.data_dir / HOST_INTENT_FILE, json.dumps(doc, sort_keys=True).encode(), mode=0o600)

    def _command(self, command: wire.Command) -> None:
        try:
            envelope = envelope_from_wire(command)
        except InvalidCommand as exc:
            flush = getattr(type(self.dispatcher), "flush_admissions", None)
            if flush is not None:
                flush(self.dispatcher)  # a valid command of this batch under the same id is journaled first
            self._refuse_invalid(exc, command)
            return
        self.dispatcher.deliver(envelope)  # type: ignore[attr-defined]

    def _refuse_invalid(self, exc: InvalidCommand, command: wire.Command) -> None:
        log.warning("session: command refused: %s", exc)
        if not exc.command_id:
            return  # nothing to report against; the gateway's sweeper times it out
        # With command-signing roots nothing verified this envelope: its refusal answers it alone, so a
        # body that does not even convert cannot take a signed command's id (Dispatcher._judged_on).
        digest = b""
        if self.trust.has_command_roots():
            digest = envelope_sha256(bytes(command.body), bytes(command.signature), command.signer_chain)
        res = self.journal.resolve(exc.command_id, digest or None)
        if res.action is Action.NONE:
            try:
                entry = self.journal.reject(
                    NewCommand(id=exc.command_id, kind="", flags=CommandFlags()),
                    RejectReason.UNSUPPORTED.value,
                    envelope_sha256=digest,
                )
            except JournalFull:  # RefusalsFull: not journaled, answered when redelivered
                return
        elif res.action is Action.DONE and res.entry is not None:
            entry = res.entry
        else:
            return
        self.send_update(update_from_entry(entry, self.signer, f"{exc.field}: {exc.rule}"))

    def _cancel(self, cancel: wire.Cancel) -> None:
        seen = self.state.cancels_seen
        if cancel.command_id in seen:
            return  # once per session (DLV-CAN-02)
        if len(seen) >= MAX_CANCELS_SEEN:
            seen.clear()  # bounded: a repeat after this is handled again, which is harmless
        seen.add(cancel.command_id)
        self.dispatcher.cancel(cancel.command_id, cancel.reason)  # type: ignore[attr-defined]

    def _ack(self, ack: wire.Ack) -> None:
        if ack.command_ids:
            self.journal.ack_results(ack.command_ids, defer=self._batching)
        if ack.journal_id:
            issued = self.journal.next_event_seq - 1
            if ack.journal_id == self.journal.journal_id and ack.event_seq > issued:
                if self._mark_complete and ack.event_seq > self._mark_seq:
                    # Never sent (the mark is written before a seq leaves): a gateway's lie, not a lost
                    # tail. Believed, it would give the journal a new journal_id, and the next honest
                    # gateway would fail the node's in-flight commands `journal-lost` (DLV-REC-16).
                    raise ProtocolViolation(
                        f"the gateway acked event seq {ack.event_seq} of journal {ack.journal_id}, above the"
                        f" highest this node sent ({self._mark_seq}): ignored, the connection ends"
                    )
                self._restart_events(
                    f"the gateway acked event seq {ack.event_seq} of journal {ack.journal_id}, above the"
                    f" highest this journal holds ({issued}): the journal lost its tail"
                )
                raise EventsRestarted(
                    f"journal {ack.journal_id} lost events the gateway holds; events restarted under"
                    f" journal {self.journal.journal_id}"
                )
            self.journal.ack_events(ack.journal_id, ack.event_seq)
            self._sent_event_seq = max(self._sent_event_seq, self.journal.acked_event_seq)

    # --- a lost journal tail (seeds: "Events"; issue 16) --------------------------------------------

    def _mark_path(self) -> Path:
        return self.data_dir / EVENT_MARK_FILE

    def _check_event_mark(self) -> None:
        """At start: the event mark says this journal_id sent seqs the journal no longer holds."""
        if not self._event_mark:
            return
        # A journal created by this open has sent nothing under its journal_id.
        self._mark_complete = self.journal.report.created
        try:
            doc = json.loads(self._mark_path().read_text())
            mark_id, mark_seq = str(doc["journal_id"]), int(doc["sent_seq"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("session: %s unreadable, ignored: %s", EVENT_MARK_FILE, exc)
            return
        if mark_id != self.journal.journal_id:
            return
        self._mark_seq = mark_seq
        self._mark_complete = True
        if mark_seq >= self.journal.next_event_seq:
            self._restart_events(
                f"event seq {mark_seq} of journal {mark_id} was sent to the gateway, but the journal's next"
                f" seq is {self.journal.next_event_seq}: the journal lost its tail"
            )

    def _restart_events(self, why: str) -> None:
        """Never reuse a seq the gateway may hold: a new journal_id, the `JournalTailLost` condition."""
        old = self.journal.journal_id
        new = self.journal.restart_events()
        self.state.journal_restarts += 1
        self._sent_event_seq = 0
        self._mark_seq = 0
        self._mark_complete = self._event_mark  # nothing sent under the new journal_id yet
        log.error("session: %s; events continue under the new journal_id %s (was %s)", why, new, old)
        self.conditions.raise_(JOURNAL_TAIL_LOST, "EventSeqAhead", why, self.monotonic())

    def _note_sent(self, top_seq: int) -> bool:
        """Durable before sent: the mark covers every seq about to go out (one small fsynced file per
        batch that passes it). False when it could not be written (the batch waits)."""
        if not self._event_mark or top_seq <= self._mark_seq:
            return True
        doc = {"journal_id": self.journal.journal_id, "sent_seq": top_seq}
        try:
            atomic_write(self._mark_path(), json.dumps(doc).encode(), mode=0o600)
        except OSError as exc:
            log.warning("session: %s not written, events wait: %s", EVENT_MARK_FILE, exc)
            return False
        self._mark_seq = top_seq
        return True

    # --- a full data_dir ------------------------------------------------------------------------

    def _space_changed(self, ok: bool, message: str) -> None:
        if ok:
            self.conditions.clear(DATA_DIR_FULL)
            if self._spec_retry and self.state.welcomed:
                self._spec_retry = False
                reason = wire.SpecRequestReason.NO_SPEC if self.journal.needs_spec else None
                self._spec_request(reason or wire.SpecRequestReason.MIN_GENERATION)
        else:
            self.conditions.raise_(
                DATA_DIR_FULL, "NoSpace", f"{message}; new commands are answered BUSY", self.monotonic()
            )

    # --- outbound ---------------------------------------------------------------------------------

    def _spec_request(self, reason: wire.SpecRequestReason) -> None:
        have = self.journal.applied_generation
        self.state.spec_requests.append((have, reason.name))
        self._out(wire.NodeMessage(spec_request=wire.SpecRequest(have_generation=have, reason=reason)))

    def request_spec_for_min_generation(self, have_generation: int) -> None:
        """dispatch's SpecRequester: a command's min_generation is above the applied one (DLV-RCV-07)."""
        if self.state.welcomed:
            self._spec_request(wire.SpecRequestReason.MIN_GENERATION)
        else:
            self._pending_min_generation = have_generation

    def send(self, update: CommandUpdate) -> None:
        """dispatch's UpdateSink."""
        self.send_update(update)

    def send_update(self, update: CommandUpdate) -> None:
        # Offline, progress is dropped and terminal results wait in the journal for the next Hello.
        if self.state.welcomed:
            self._out(wire.NodeMessage(command_update=update_to_wire(update)))

    def _result_update(self, entry: object) -> wire.CommandUpdate:
        return update_to_wire(update_from_entry(entry, self.signer))  # type: ignore[arg-type]

    def pump_events(self) -> int:
        """Send the journaled events not yet sent on this session, in batches. Returns how many."""
        if not self.state.welcomed:
            return 0
        sent = 0
        self.events_throttled = False
        while True:
            budget = self._event_budget()
            if budget <= 0:
                self.events_throttled = True
                return sent
            events = self.journal.unacked_events(
                after_seq=self._sent_event_seq, limit=EVENT_BATCH, max_bytes=budget
            )
            if not events:
                return sent
            batch = wire.EventBatch(
                journal_id=self.journal.journal_id, events=[wire_event(e) for e in events]
            )
            if not self._note_sent(events[-1].seq):
                return sent
            self._out(wire.NodeMessage(event_batch=batch))
            self._sent_event_seq = events[-1].seq
            sent += len(events)

    def _event_budget(self) -> int:
        """Bytes of events the outbox admits now (flow control: read only what can be sent)."""
        from bcd_agent.session.outbox import EVENT_RESERVE_BYTES

        if self._room is None:
            return EVENT_BATCH * 1024 * 1024
        return self._room() - EVENT_RESERVE_BYTES

    def resend_due(self) -> bool:
        """Replay every unacked terminal result and event when `resend_interval_s` passed (DLV-RES-08)."""
        if not self.state.welcomed:
            return False
        now = self.monotonic()
        if now - self._last_resend < self.resend_interval_s:
            return False
        self._last_resend = now
        self.journal.flush_acks()  # the acks kept since the last write (none are replayed meanwhile)
        self._replay_results()
        self._sent_event_seq = self.journal.acked_event_seq
        self.pump_events()
        return True

    def _replay_results(self) -> None:
        """Every unacked result as a CommandUpdate, while the outbox has more than its reserve free."""
        from bcd_agent.session.outbox import EVENT_RESERVE_BYTES

        for entry in self.journal.unacked_results(limit=REPLAY_MAX_ROWS):
            if self._room is not None and self._room() < EVENT_RESERVE_BYTES:
                break  # the rest at the next interval; the gateway is slow to read
            self._out(wire.NodeMessage(command_update=self._result_update(entry)))

    def heartbeat(self) -> wire.NodeMessage:
        return wire.NodeMessage(
            heartbeat=wire.NodeHeartbeat(
                server_time_mark=int(self.journal.server_time_mark * 1000),
                applied_generation=self.journal.applied_generation,
                inventory_hashes=dict(self.inventory_hashes()),
            )
        )

    def status_message(self, status: NodeStatus) -> wire.NodeMessage | None:
        """The StatusReport of `status` unless it was already sent on this session (coalesced)."""
        if (
            status.version <= self._sent_status_version
            and self.conditions.version == self._sent_conditions_version
        ):
            return None
        self._sent_status_version = status.version
        self._sent_conditions_version = self.conditions.version
        extra = self.conditions.active()
        if extra:
            status = attrs.evolve(status, conditions=(*status.conditions, *extra))
        return wire.NodeMessage(status=status_report(status, self.monotonic()))

    @property
    def conditions_changed(self) -> bool:
        """A node condition changed since the last StatusReport (send one at once)."""
        return self.conditions.version != self._sent_conditions_version


def _which(message: wire.GatewayMessage) -> tuple[str, object]:
    for name in (
        "welcome",
        "heartbeat",
        "desired_state",
        "command",
        "cancel",
        "ack",
        "secret_response",
        "trust_bundle",
    ):
        value = getattr(message, name, None)
        if value is not None:
            return name, value
    return "", None
