"""The Dispatcher: delivered commands through the journal, the acceptance checks, lanes and handlers.

    session ─deliver(cmd)─▶ resolve (journal) ─▶ precheck (pure) ─▶ credit / journal room ─▶ accepted
          ◀──── updates ───  ACKED, RUNNING, one terminal outcome (journaled before the credit returns)

A trio service: `await nursery.start(dispatcher.run)` starts the fixed lane workers and the deferral
timer and reports ready; `deliver`, `cancel`, `spec_applied` and `set_upgrade_only` are then called by
the session (synchronously: each call finishes its journal writes before it returns, so two deliveries
of one command never race). No module-level state: everything lives on the instance.

Per delivered command (delivery.md "Duplicates and crash recovery", DLV-REC-03..09):
- resolve: DONE resends the stored result; REATTACH does nothing (the run in flight reports);
  REBOOTED / INTERRUPTED are settled by the journal and reported; NONE and REEXECUTE go on to
- the acceptance checks (dispatch.acceptance): a terminal rejection is journaled and reported; DEFER
  keeps the command in memory (not journaled, no credit) and asks for the spec once per applied
  generation; the command is re-checked on every newer spec and at its `not_after` (STALE_GENERATION);
- BUSY when the lane has no credit or the journal is full (reported, never journaled);
- `accepted` is journaled (durable), the quorum claim recorded, ACKED reported, and the command queued
  on its lane. A worker takes the command's resource locks, re-checks `not_after` (a command that waited
  past it never starts: REJECTED EXPIRED, Q-DLV-CMD-03), runs the handler, journals the outcome, then
  gives the credit back and reports.

Cancel (DLV-CAN-03..07): deferred or queued (or waiting for a resource lock) -> CANCELLED at once, journaled;
in the handler before `begin_effect` -> the handler's `begin_effect` raises and the command is CANCELLED;
after it -> the real outcome. A cancel for a settled command resends its result; for a command never
seen it journals CANCELLED in one write, so a late delivery is answered CANCELLED and never runs
(Q-DLV-CAN-01).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
from collections.abc import Callable, Iterator, Mapping

import trio
from bcd_shared import tracecontext, wire
from bcd_shared.errors import StepError

from bcd_agent.counters import CounterSet
from bcd_agent.dispatch.acceptance import (
    Accept,
    AcceptanceContext,
    Defer,
    LeafClaim,
    Reject,
    UnbatchedClaim,
    precheck,
)
from bcd_agent.dispatch.command import (
    ERR_INTERNAL,
    ERR_SECRET_UNAVAILABLE,
    ERR_SECRET_UNBOUND,
    CommandEnvelope,
    CommandUpdate,
    InvalidCommand,
    RejectReason,
    UpdateState,
    envelope_sha256,
)
from bcd_agent.dispatch.handlers import CommandCancelled, CommandFailed, Handler
from bcd_agent.dispatch.kinds import KINDS, KindSpec, Lane, Role
from bcd_agent.dispatch.lanes import LANES, Credits, LaneConfig, ResourceLocks
from bcd_agent.dispatch.ports import (
    BatchVerifier,
    Clock,
    CommandJournal,
    LedgerStore,
    ResultSigner,
    SecretFetcher,
    SpecRequester,
    TrustView,
    UpdateSink,
)
from bcd_agent.dispatch.results import result_attester, update_from_entry
from bcd_agent.dispatch.wire import envelope_from_wire
from bcd_agent.journal import (
    Action,
    CommandEntry,
    CommandFlags,
    Completion,
    DataDirFull,
    JournalFull,
    NewCommand,
    Outcome,
    StateError,
)

log = logging.getLogger(__name__)

# Deferred commands are held in memory; beyond this many, new ones are answered BUSY.
MAX_DEFERRED = 1000
# ... and beyond this many bytes of them. A deferral comes before the signature check (Q-DLV-ACK-01), so a
# compromised gateway could otherwise park 1000 unsigned commands of 4 MiB each (the message cap) in the
# node's memory with a min_generation no spec reaches.
MAX_DEFERRED_BYTES = 64 * 1024 * 1024
# A lane's outcome that could not be journaled (the data_dir is full) is tried again this often; the
# credit stays taken until it is journaled (DLV-LANE-09).
DISK_RETRY_S = 1.0


class _Phase(enum.Enum):
    QUEUED = "queued"  # accepted, waiting for a worker or a resource lock
    STARTING = "starting"  # in the handler, before its side effect
    EFFECT = "effect"  # the side effect has begun: only the real outcome is reported
    SETTLED = "settled"  # terminal outcome journaled, credit given back


class _Execution:
    """One accepted command on its way through a lane (mutable; owned by the dispatcher)."""

    def __init__(self, cmd: CommandEnvelope, accept: Accept, new: NewCommand) -> None:
        self.cmd = cmd
        self.accept = accept
        self.new = new
        self.phase = _Phase.QUEUED
        self.cancel_reason: str | None = None


class _Pending:
    """A command that passed the checks and holds its credit inside `admitting()`: journaled `accepted`
    with the others of its batch when the batch ends (one transaction, one fsync), then ACKED."""

    def __init__(self, cmd: CommandEnvelope, verdict: Accept, new: NewCommand, host_now: float) -> None:
        self.cmd = cmd
        self.verdict = verdict
        self.new = new
        self.host_now = host_now


class _OutcomeWrite:
    """A worker's outcome waiting for the group write of the outcomes reached in the same tick."""

    def __init__(self, exe: _Execution, completion: Completion) -> None:
        self.exe = exe
        self.completion = completion
        self.done = trio.Event()
        self.error: BaseException | None = None


class _RunContext:
    """What a handler sees of the dispatcher (handlers.RunContext)."""

    def __init__(self, dispatcher: Dispatcher, exe: _Execution) -> None:
        self._d = dispatcher
        self._exe = exe

    @property
    def boot_id(self) -> str:
        return self._d.boot_id

    @property
    def cancel_requested(self) -> bool:
        return self._exe.cancel_reason is not None

    async def begin_effect(self) -> None:
        exe = self._exe
        if exe.phase is _Phase.EFFECT:
            return
        if exe.cancel_reason is not None:
            raise CommandCancelled(exe.cancel_reason)
        # Durable before effect (DLV-JRN-16/17): a self-terminating kind's running{boot_id} is on disk
        # when this returns. Other kinds write no `running`: after a crash their `accepted` resolves as
        # `running` would (REEXECUTE or INTERRUPTED; journal.mark_running), so it would be a write that
        # changes no decision. With [journal] group_commit, `accepted` (written with durable=False) is
        # fsynced now, before the effect, with every other pending commit.
        if exe.new.flags.self_terminating:
            self._d._journal.mark_running(exe.cmd.id)
        self._d._journal.sync()
        exe.phase = _Phase.EFFECT
        self._d._send(UpdateState.RUNNING, exe.cmd.id)
        await trio.lowlevel.checkpoint()

    async def secret(self, ref: str) -> bytes:
        # A secret binds to the workflow step the command executes (DLV-CMD-14): the request names it,
        # and a command that names none asks for nothing (the broker could only release it unbound).
        cmd = self._exe.cmd
        if not cmd.workflow_id or not cmd.step_id:
            raise CommandFailed(
                ERR_SECRET_UNBOUND,
                f"secret {ref}: the command names no workflow step (workflow_id and step_id) to bind it to",
            )
        broker = self._d._secrets
        if broker is None:
            raise CommandFailed(ERR_SECRET_UNAVAILABLE, f"secret {ref}: this agent has no secret broker")
        return await broker.fetch(ref, workflow_id=cmd.workflow_id, step_id=cmd.step_id)


def _held_bytes(cmd: CommandEnvelope) -> int:
    """About what a command held in memory costs: its body, the payload copy, signature and chain."""
    return len(cmd.body_bytes) + len(cmd.payload.value) + len(cmd.signature) + sum(map(len, cmd.signer_chain))


def _digest(cmd: CommandEnvelope) -> bytes:
    return envelope_sha256(cmd.body_bytes, cmd.signature, cmd.signer_chain)


def _new_command(cmd: CommandEnvelope, spec: KindSpec | None) -> NewCommand:
    """The journal's record of a command: table flags when the kind is known, else the body's."""
    if spec is not None:
        flags = CommandFlags(
            retry_safe=spec.retry_safe and cmd.retry_safe,
            self_terminating=spec.self_terminating,
            attested=spec.attested or cmd.attested,
        )
    else:
        flags = CommandFlags(retry_safe=False, self_terminating=cmd.self_terminating, attested=cmd.attested)
    return NewCommand(id=cmd.id, kind=cmd.kind, flags=flags, body=cmd.body_bytes, signature=cmd.signature)


class Dispatcher:
    """Runs delivered commands at most once (see the module docstring)."""

    def __init__(
        self,
        *,
        node_id: str,
        role: Role,
        journal: CommandJournal,
        sink: UpdateSink,
        spec_requester: SpecRequester,
        trust: TrustView,
        batches: BatchVerifier,
        ledger: LedgerStore,
        clock: Clock,
        handlers: Mapping[str, Handler],
        signer: ResultSigner | None = None,
        secrets: SecretFetcher | None = None,
        kinds: Mapping[str, KindSpec] = KINDS,
        lanes: Mapping[Lane, LaneConfig] = LANES,
        applied_generation: int = 0,
        upgrade_only: bool = False,
        max_deferred: int = MAX_DEFERRED,
        max_deferred_bytes: int | None = None,
    ) -> None:
        unknown = sorted(set(handlers) - set(kinds))
        if unknown:
            raise ValueError(f"handlers for kinds missing from the kind table: {unknown}")
        self._node_id = node_id
        self._role = role
        self._journal = journal
        self._sink = sink
        self._spec_requester = spec_requester
        self._trust = trust
        self._batches = batches
        self._ledger = ledger
        self._clock = clock
        self._handlers = dict(handlers)
        self._signer = signer
        self._secrets = secrets
        self._kinds = kinds
        self._lanes = dict(lanes)
        self._applied_generation = applied_generation
        self._upgrade_only = upgrade_only
        self._max_deferred = max_deferred
        self._max_deferred_bytes = MAX_DEFERRED_BYTES if max_deferred_bytes is None else max_deferred_bytes
        self.boot_id = journal.boot_id
        self._credits = {lane: Credits(cfg.credits) for lane, cfg in self._lanes.items()}
        self._locks = ResourceLocks()
        self._inflight: dict[str, _Execution] = {}
        self._deferred: dict[str, CommandEnvelope] = {}
        self._deferred_changed = trio.Event()
        self._spec_requested_at: int | None = None
        self._queues: dict[Lane, trio.MemorySendChannel[_Execution]] = {}
        self._running = False
        # Outcomes per (kind, outcome) since start, for bcd's own metrics (docs/telemetry.md): each new
        # terminal result once (a stored result resent is not counted again), and BUSY answers.
        self.outcomes = CounterSet()
        # Cancels of commands never accepted that RefusalsFull kept out of the journal, since start.
        self.cancels_dropped = 0
        self._started = False
        self._accepting = True
        self._idle = trio.Event()
        self._idle.set()
        # Inside `admitting()`: the commands that passed the checks, journaled together when it ends.
        self._batch_depth = 0
        self._pending: list[_Pending] = []
        self._pending_ids: set[str] = set()
        # The outcomes workers reached in this tick, written together by the first of them.
        self._outcomes: list[_OutcomeWrite] = []
        if signer is not None:
            # Attested results are signed once, as they are journaled, and replayed as stored.
            journal.set_attester(result_attester(signer))

    # --- the service -------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Dispatcher] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the lane workers and the deferral timer; report ready; run until cancelled."""
        if self._running:
            raise RuntimeError("dispatcher already running")
        try:
            async with trio.open_nursery() as nursery:
                for lane, cfg in self._lanes.items():
                    # Credits bound what is queued; the buffer is unbounded so a cancelled command still
                    # in the channel never blocks a new admission.
                    send, receive = trio.open_memory_channel[_Execution](math.inf)
                    self._queues[lane] = send
                    for _ in range(cfg.workers):
                        nursery.start_soon(self._worker, receive)
                nursery.start_soon(self._deferral_timer)
                self._running = True
                self._started = True
                task_status.started(self)
        finally:
            self._running = False

    def stop_accepting(self) -> None:
        """Shutdown's first step: every command delivered from now on is answered BUSY (the gateway
        redelivers it to the next process); commands in flight go on (`drained`)."""
        self._accepting = False

    async def drained(self) -> None:
        """Return once no accepted command is in flight."""
        while self._inflight:
            self._idle = trio.Event()
            await self._idle.wait()

    # --- what the session calls -------------------------------------------------------------------------

    @property
    def applied_generation(self) -> int:
        return self._applied_generation

    def credits_in_use(self, lane: Lane) -> int:
        return self._credits[lane].in_use

    def queue_length(self, lane: Lane) -> int:
        """Commands admitted on `lane` and waiting for a worker (cancelled ones still queued included)."""
        queue = self._queues.get(lane)
        return 0 if queue is None else queue.statistics().current_buffer_used

    @property
    def lanes(self) -> tuple[Lane, ...]:
        return tuple(self._lanes)

    def deferred_ids(self) -> tuple[str, ...]:
        return tuple(self._deferred)

    def in_flight_ids(self) -> tuple[str, ...]:
        return tuple(self._inflight)

    def set_upgrade_only(self, upgrade_only: bool) -> None:
        self._upgrade_only = upgrade_only

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Deliveries inside are accepted together (the session wraps each batch of received messages):
        every command that passes the checks takes its credit at once, and when the block ends their
        `accepted` entries are journaled in one transaction, fsynced once before it returns
        (`Journal.accept_commands`: one write, durable when it returns, DLV-JRN-15), and only then is
        each one's ACKED sent and the command queued on its lane. A crash before that fsync leaves no
        record and no ACKED: the gateway redelivers. Anything that must see those commands in flight
        (a Cancel, an invalid duplicate, a spec) writes the batch first (`flush_admissions`)."""
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            if self._batch_depth == 0:
                self.flush_admissions()

    def flush_admissions(self) -> None:
        """Journal the pending batch's `accepted` entries (one durable transaction), then ACK and queue
        each. A command the journal refused is answered as its entry says (JournalFull: BUSY)."""
        pending, self._pending = self._pending, []
        self._pending_ids = set()
        if not pending:
            return
        try:
            results = self._journal.accept_commands([p.new for p in pending], durable=False)
        except DataDirFull as exc:
            for p in pending:
                self._credits[p.verdict.flags.lane].give_back()
                self._busy(p.cmd, str(exc))
            return
        except BaseException:
            for p in pending:
                self._credits[p.verdict.flags.lane].give_back()
            raise
        for p, result in zip(pending, results, strict=True):
            if isinstance(result, JournalFull):
                self._credits[p.verdict.flags.lane].give_back()
                self._busy(p.cmd, str(result))
            elif isinstance(result, Exception):
                # Journaled meanwhile (an invalid duplicate of the batch was rejected): a duplicate.
                self._credits[p.verdict.flags.lane].give_back()
                log.info("command %s: %s; answered as a duplicate", p.cmd.id, result)
                self._deliver(p.cmd)
            else:
                self._admitted(p.cmd, p.verdict, p.new, p.host_now)

    def deliver(self, cmd: CommandEnvelope) -> None:
        """A command arrived (or was redelivered) from the session."""
        if not self._admitting(cmd):
            return
        held = self._deferred.get(cmd.id)
        if held is not None and self._forged_deferral(held, cmd):
            del self._deferred[cmd.id]  # a body nobody signed held the id: judge this one instead
            self._deferred_changed.set()
        elif held is not None or cmd.id in self._inflight or cmd.id in self._pending_ids:
            return  # still waiting, or the run in flight reports (REATTACH)
        try:
            with tracecontext.current(cmd.traceparent):  # the acceptance's lines name the trace too
                self._deliver(cmd)
        except DataDirFull as exc:
            # Nothing was journaled; the journal logged the state change once (DataDirFull condition).
            self._busy(cmd, str(exc))

    def _forged_deferral(self, held: CommandEnvelope, cmd: CommandEnvelope) -> bool:
        """Another envelope arrived under a deferred command's id, and the deferred one's signature does
        not verify against the command-signing roots. A deferral is judged before the signature
        (Q-DLV-ACK-01), so a gateway could otherwise park a forged body with an unreachable
        min_generation under a signed command's id and have the signed one ignored until that body's
        own not_after. It is dropped without an answer (it had none yet; the id is the other's now)."""
        if _digest(held) == _digest(cmd) or not self._trust.has_command_roots():
            return False
        return not self._verifies(held)

    def _verifies(self, cmd: CommandEnvelope) -> bool:
        try:
            self._trust.verify_command(cmd, self._clock.server_now())
        except Exception:  # any refusal of the verifier
            return False
        return True

    def _admitting(self, cmd: CommandEnvelope) -> bool:
        self._require_running()
        if not self._accepting or not self._running:
            self._busy(cmd, "the node is shutting down")
            return False
        return True

    def _deliver(self, cmd: CommandEnvelope) -> None:
        # NONE also for another envelope under the id of a refusal on the gateway's word alone.
        res = self._journal.resolve(cmd.id, _digest(cmd))
        if res.action is Action.DONE:
            assert res.entry is not None
            self._send_entry(res.entry)
        elif res.action in (Action.REBOOTED, Action.INTERRUPTED):
            self._send_new(self._journal.settle(cmd.id))
        elif res.action is Action.REATTACH:
            log.warning(
                "command %s is journaled by this process but not in flight; nothing to resend", cmd.id
            )
        else:
            self._admit(cmd, reexecute=res.action is Action.REEXECUTE)

    def deliver_wire(self, command: wire.Command) -> None:
        """Convert a delivered wire `Command` once (dispatch.wire) and deliver it; a body that does not
        convert is refused (`refuse_invalid`)."""
        try:
            envelope = envelope_from_wire(command)
        except InvalidCommand as exc:
            digest = envelope_sha256(bytes(command.body), bytes(command.signature), command.signer_chain)
            self.refuse_invalid(exc, digest)
            return
        self.deliver(envelope)

    def refuse_invalid(self, exc: InvalidCommand, digest: bytes = b"") -> None:
        """A body that failed the wire edge's rules: UNSUPPORTED (journaled, so a duplicate gets the same
        answer) when its id could be read; otherwise there is nothing to answer and it is only logged. A
        command already known under that id is answered as any duplicate is. `digest`: the envelope's
        (`envelope_sha256`); with command-signing roots such a refusal (nothing verified it) answers that
        envelope alone, as `_judged_on` says."""
        self._require_running()
        if not self._running or not self._accepting:
            return  # the gateway redelivers it to the next process
        self.flush_admissions()
        if not exc.command_id:
            log.warning("undecodable command dropped: %s", exc)
            return
        cid = exc.command_id
        if cid in self._deferred or cid in self._inflight:
            return
        if not self._trust.has_command_roots():
            digest = b""
        res = self._journal.resolve(cid, digest or None)
        if res.action is Action.NONE:
            new = NewCommand(id=cid, kind="", flags=CommandFlags())
            try:
                entry = self._journal.reject(
                    new,
                    RejectReason.UNSUPPORTED.value,
                    f"invalid body: {exc.field}: {exc.rule}",
                    envelope_sha256=digest,
                )
            except (DataDirFull, JournalFull):
                return  # not journaled: answered when redelivered
            self._send_new(entry)
        elif res.action is Action.DONE:
            assert res.entry is not None
            self._send_entry(res.entry)
        else:
            log.warning("invalid redelivery of journaled command %s ignored: %s", cid, exc)

    def spec_applied(self, generation: int) -> None:
        """A newer spec was applied: re-run the checks of every deferred command, in `seq` order."""
        self._require_running()
        if not self._running:
            return  # stopped: the next process reads the generation from the journal
        self.flush_admissions()
        if generation <= self._applied_generation:
            return
        self._applied_generation = generation
        self._spec_requested_at = None
        waiting = sorted(self._deferred.values(), key=lambda c: c.seq)
        self._deferred.clear()
        for cmd in waiting:
            self.deliver(cmd)
        self._deferred_changed.set()

    def cancel(self, command_id: str, reason: str = "") -> None:
        """`Cancel{command_id, reason}` from the gateway (see the module docstring)."""
        self._require_running()
        if not self._running:
            return  # the gateway repeats the Cancel on the next session (DLV-CAN-02)
        self.flush_admissions()  # a command of this batch is in flight once its accept is written
        # Not journaled (a full data_dir, or RefusalsFull: cancels of commands never accepted fill their
        # bound unacked); the gateway repeats it after a reconnect.
        with contextlib.suppress(DataDirFull, JournalFull):
            self._cancel(command_id, reason)

    def _cancel(self, command_id: str, reason: str) -> None:
        deferred = self._deferred.pop(command_id, None)
        if deferred is not None:
            self._deferred_changed.set()
            try:
                self._cancel_unstarted(_new_command(deferred, self._kinds.get(deferred.kind)), reason)
            except BaseException:
                self._deferred[command_id] = deferred  # not cancelled: it still waits
                raise
            return
        exe = self._inflight.get(command_id)
        if exe is not None:
            if exe.phase is _Phase.QUEUED:
                entry = self._journal.cancel(command_id, reason)
                assert entry is not None
                self._settled(exe)
                self._send_new(entry)
            elif exe.phase is _Phase.STARTING:
                exe.cancel_reason = reason
            else:
                log.info("cancel of %s ignored: its side effect has started", command_id)
            return
        res = self._journal.resolve(command_id)
        if res.action is Action.DONE:
            assert res.entry is not None
            self._send_entry(res.entry)
        elif res.action in (Action.REBOOTED, Action.INTERRUPTED):
            self._send_new(self._journal.settle(command_id))
        elif res.action is Action.NONE:
            self._cancel_unstarted(NewCommand(id=command_id, kind="", flags=CommandFlags()), reason)
        elif res.action is Action.REEXECUTE:
            entry = self._journal.cancel(command_id, reason)
            if entry is not None and entry.state.terminal:
                self._send_new(entry)

    # --- admission ------------------------------------------------------------------------------------

    def _require_running(self) -> None:
        """A dispatcher never started is a wiring bug; one that stopped (shutdown) answers BUSY."""
        if not self._started:
            raise RuntimeError("dispatcher not running: start it with nursery.start(dispatcher.run)")

    def _context(self) -> AcceptanceContext:
        return AcceptanceContext(
            node_id=self._node_id,
            role=self._role,
            upgrade_only=self._upgrade_only,
            applied_generation=self._applied_generation,
            server_now=self._clock.server_now(),
            host_now=self._clock.host_time(),
            kinds=self._kinds,
            supported=frozenset(self._handlers),
            trust=self._trust,
            batches=self._batches,
            ledger=self._ledger,
        )

    def _admit(self, cmd: CommandEnvelope, *, reexecute: bool) -> None:
        ctx = self._context()
        verdict = precheck(cmd, ctx, reexecute=reexecute)
        if isinstance(verdict, Reject):
            new = _new_command(cmd, self._kinds.get(cmd.kind))
            signed, digest = self._judged_on(cmd, verdict)
            try:
                entry = self._journal.reject(
                    new, verdict.reason.value, verdict.message, signed=signed, envelope_sha256=digest
                )
            except JournalFull as exc:  # RefusalsFull: unacked refusals fill their bound
                self._busy(cmd, str(exc))
                return
            if digest and entry.envelope_sha256 not in (b"", digest):
                self._send_entry(entry)  # another envelope's stored refusal: counted when journaled
            else:
                self._send_new(entry)
            return
        if isinstance(verdict, Defer):
            if len(self._deferred) >= self._max_deferred:
                self._busy(cmd, f"{len(self._deferred)} commands already wait for a newer spec")
                return
            held = sum(_held_bytes(c) for c in self._deferred.values())
            if held + _held_bytes(cmd) > self._max_deferred_bytes:
                self._busy(
                    cmd,
                    f"{len(self._deferred)} commands of {held} bytes already wait for a newer spec"
                    f" (at most {self._max_deferred_bytes} bytes)",
                )
                return
            self._deferred[cmd.id] = cmd
            self._deferred_changed.set()
            if self._spec_requested_at != self._applied_generation:
                self._spec_requested_at = self._applied_generation
                self._spec_requester.request_spec_for_min_generation(self._applied_generation)
            return
        lane = verdict.flags.lane
        credits = self._credits[lane]
        if not credits.try_take():
            self._busy(cmd, f"lane {lane.value} has no free credit ({credits.total} in use)")
            return
        new = _new_command(cmd, verdict.spec)
        if self._batch_depth:
            if verdict.claim is None:
                self._pending.append(_Pending(cmd, verdict, new, ctx.host_now))
                self._pending_ids.add(cmd.id)
                return
            # A quorum claim (the unbatched allowance, a batch leaf) is recorded before the next
            # command's checks read the ledger: such a command is never batched.
            self.flush_admissions()
        try:
            # Durable when it returns (with [journal] group_commit: fsynced before its effect, in
            # begin_effect, and before the ACKED leaves, the session syncing before it writes).
            self._journal.accept_command(new, durable=False)
        except JournalFull as exc:
            credits.give_back()
            self._busy(cmd, str(exc))
            return
        except BaseException:
            credits.give_back()
            raise
        self._admitted(cmd, verdict, new, ctx.host_now)

    def _admitted(self, cmd: CommandEnvelope, verdict: Accept, new: NewCommand, host_now: float) -> None:
        """`accepted` is journaled: record the quorum claim, report ACKED, queue it on its lane."""
        lane = verdict.flags.lane
        exe = _Execution(cmd, verdict, new)
        self._inflight[cmd.id] = exe
        try:
            self._record_claim(cmd, verdict, host_now)
        except Exception as exc:
            log.exception("command %s: recording its quorum claim failed", cmd.id)
            self._complete(exe, Outcome.FAILED, code=ERR_INTERNAL, message=f"quorum ledger: {exc}")
            return
        self._send(UpdateState.ACKED, cmd.id)
        self._queues[lane].send_nowait(exe)

    def _judged_on(self, cmd: CommandEnvelope, verdict: Reject) -> tuple[bool, bytes]:
        """(signed, envelope_sha256) for `Journal.reject`: with command-signing roots, a refusal binds the
        id only when the command's signature verifies (the control plane's word); otherwise it answers
        this envelope alone, so a forged body under a signed command's id cannot make the node refuse the
        signed one. The quorum's refusals come after the signature check passed. Without roots nothing is
        signed and every refusal binds, as before."""
        if not self._trust.has_command_roots():
            return False, b""
        reason = verdict.reason
        if reason in (RejectReason.BATCH_UNAPPROVED, RejectReason.UNBATCHED_LIMIT):
            return True, b""
        if reason is not RejectReason.BAD_SIGNATURE and self._verifies(cmd):
            return True, b""
        return False, _digest(cmd)

    def _record_claim(self, cmd: CommandEnvelope, verdict: Accept, host_now: float) -> None:
        claim = verdict.claim
        if isinstance(claim, UnbatchedClaim):
            self._ledger.record_unbatched(cmd.id, host_now)
        elif isinstance(claim, LeafClaim):
            server_now = self._clock.server_now().timestamp()
            self._ledger.record_leaf(
                claim.admission.leaf, cmd.id, host_now, server_now, claim.admission.expires_at
            )

    def _busy(self, cmd: CommandEnvelope, message: str) -> None:
        """Not terminal and never journaled (DLV-ACK-14/15): the gateway redelivers later."""
        self.outcomes.add((self._kind_label(cmd.kind), "busy"))
        self._sink.send(
            CommandUpdate(
                cmd.id, UpdateState.BUSY, self.boot_id, reason=UpdateState.BUSY.value, message=message
            )
        )

    def _cancel_unstarted(self, new: NewCommand, reason: str) -> None:
        """Journal CANCELLED for a command that never got an `accepted` entry (deferred or unseen): one
        journal write (`cancel_new`), so no crash can leave it `accepted` for recovery to call
        `interrupted`. A command journaled meanwhile keeps its entry (a running one its real outcome)."""
        before = self._journal.resolve(new.id).entry
        try:
            entry = self._journal.cancel_new(new, reason)
        except JournalFull as exc:  # RefusalsFull: dropped; the gateway repeats it (DLV-CAN-02)
            self.cancels_dropped += 1
            if self.cancels_dropped % 1000 == 1:  # a flood's worth of lines would say nothing more
                log.warning("cancel of %s not journaled (%d so far): %s", new.id, self.cancels_dropped, exc)
            raise
        if entry.state.terminal:
            if before is not None and before.state.terminal:
                self._send_entry(entry)  # its result was counted when it was journaled
            else:
                self._send_new(entry)

    # --- deferral ---------------------------------------------------------------------------------------

    async def _deferral_timer(self) -> None:
        """At a deferred command's `not_after`, re-check it: still behind is STALE_GENERATION."""
        while True:
            self._deferred_changed = trio.Event()
            now = self._clock.server_now()
            due = sorted(
                (c for c in self._deferred.values() if c.not_after is None or c.not_after <= now),
                key=lambda c: c.seq,
            )
            for cmd in due:
                del self._deferred[cmd.id]
                self.deliver(cmd)
            waits = [(c.not_after - now).total_seconds() for c in self._deferred.values() if c.not_after]
            with trio.move_on_after(max(min(waits), 0.0) if waits else math.inf):
                await self._deferred_changed.wait()

    # --- the lanes ----------------------------------------------------------------------------------------

    async def _worker(self, receive: trio.MemoryReceiveChannel[_Execution]) -> None:
        async for exe in receive:
            if exe.phase is _Phase.SETTLED:
                continue  # cancelled while queued
            await self._execute(exe)
            if not self._inflight:
                self._idle.set()

    async def _durably(self, write: Callable[[], None]) -> None:
        """Run a journal write, again every DISK_RETRY_S while the data_dir is full."""
        while True:
            try:
                write()
                return
            except DataDirFull:
                await trio.sleep(DISK_RETRY_S)

    async def _execute(self, exe: _Execution) -> None:
        # The handling's log lines name the command's W3C trace (DLV-CMD-15, bcd_shared.tracecontext);
        # the worker task's context, so no other command's lines are touched.
        with tracecontext.current(exe.cmd.traceparent):
            await self._execute_traced(exe)

    async def _execute_traced(self, exe: _Execution) -> None:
        cmd = exe.cmd
        handler = self._handlers[cmd.kind]
        try:
            resources = handler.resources(cmd)
        except CommandFailed as exc:
            await self._durably_outcome(exe, Outcome.FAILED, code=exc.code, message=exc.message)
            return
        async with self._locks.hold(resources):
            if exe.phase is _Phase.SETTLED:
                return  # cancelled while waiting for a lock
            now = self._clock.server_now()
            if cmd.not_after is None or now >= cmd.not_after:
                await self._durably(lambda: self._expired(exe))
                return
            exe.phase = _Phase.STARTING
            try:
                body = await handler.run(cmd, _RunContext(self, exe))
            except CommandCancelled as exc:
                reason = exc.reason

                def cancelled() -> None:
                    entry = self._journal.cancel(cmd.id, reason)
                    assert entry is not None
                    self._settled(exe)
                    self._send_new(entry)

                await self._durably(cancelled)
            except CommandFailed as exc:
                await self._durably_outcome(exe, Outcome.FAILED, code=exc.code, message=exc.message)
            except StepError as exc:
                await self._durably_outcome(exe, Outcome.FAILED, code=exc.reason, message=exc.message)
            except Exception as exc:
                log.exception("command %s (%s) failed inside its handler", cmd.id, cmd.kind)
                message = f"{type(exc).__name__}: {exc}"
                await self._durably_outcome(exe, Outcome.FAILED, code=ERR_INTERNAL, message=message)
            else:
                await self._durably_outcome(exe, Outcome.SUCCEEDED, body=body)

    async def _durably_outcome(
        self, exe: _Execution, outcome: Outcome, *, code: str = "", body: bytes = b"", message: str = ""
    ) -> None:
        """`_journal_outcome`, again every DISK_RETRY_S while the data_dir is full."""
        while True:
            try:
                await self._journal_outcome(exe, Completion(exe.cmd.id, outcome, code, body, message))
                return
            except DataDirFull:
                await trio.sleep(DISK_RETRY_S)

    async def _journal_outcome(self, exe: _Execution, completion: Completion) -> None:
        """Journal a worker's real outcome together with those the other workers reach in the same tick:
        the first to arrive lets the others run once (a shielded checkpoint), then writes them all in
        one transaction, fsynced before it returns (`Journal.complete_many`: one write, DLV-JRN-15); only
        then is each credit given back (DLV-LANE-09) and each result reported. Every worker returns once
        its own outcome is durable (or raises what the write raised)."""
        item = _OutcomeWrite(exe, completion)
        self._outcomes.append(item)
        if len(self._outcomes) > 1:
            await item.done.wait()  # the first of this tick writes it
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            batch, self._outcomes = self._outcomes, []
            self._write_outcomes(batch)
        if item.error is not None:
            raise item.error

    def _write_outcomes(self, batch: list[_OutcomeWrite]) -> None:
        try:
            results = self._journal.complete_many([w.completion for w in batch], durable=False)
        except BaseException as exc:  # DataDirFull: each worker retries; anything else ends the node
            for w in batch:
                w.error = exc
                w.done.set()
            return
        for w, result in zip(batch, results, strict=True):
            if isinstance(result, StateError):
                w.error = result
            else:
                self._settled(w.exe)
                self._send_new(result)
            w.done.set()

    def _expired(self, exe: _Execution) -> None:
        entry = self._journal.reject(
            exe.new,
            RejectReason.EXPIRED.value,
            "not_after passed while the command waited for a worker",
        )
        self._settled(exe)
        self._send_new(entry)

    # --- outcomes -----------------------------------------------------------------------------------------

    def _complete(
        self, exe: _Execution, outcome: Outcome, *, code: str = "", body: bytes = b"", message: str = ""
    ) -> None:
        """Journal the real outcome, then give the credit back (DLV-LANE-09), then report it."""
        # Fsynced before the result leaves the node (the session syncs before it writes); a crash before
        # that leaves the entry as a crash during the effect does (REEXECUTE or INTERRUPTED).
        entry = self._journal.complete(
            exe.cmd.id, outcome, code=code, body=body, message=message, durable=False
        )
        self._settled(exe)
        self._send_new(entry)

    def _settled(self, exe: _Execution) -> None:
        exe.phase = _Phase.SETTLED
        self._inflight.pop(exe.cmd.id, None)
        self._credits[exe.accept.flags.lane].give_back()
        if not self._inflight:
            self._idle.set()

    def _send(self, state: UpdateState, command_id: str) -> None:
        self._sink.send(CommandUpdate(command_id, state, self.boot_id))

    def _kind_label(self, kind: str) -> str:
        # A kind outside the table (a rejected command's, from the wire) is not a metric attribute.
        return kind if kind in self._kinds else "unknown"

    def _send_new(self, entry: CommandEntry) -> None:
        """Report a result just journaled, and count it once (docs/telemetry.md)."""
        if entry.result is not None:
            self.outcomes.add((self._kind_label(entry.kind), entry.result.outcome.value))
        self._send_entry(entry)

    def _send_entry(self, entry: CommandEntry, message: str = "") -> None:
        self._sink.send(update_from_entry(entry, self._signer, message))
