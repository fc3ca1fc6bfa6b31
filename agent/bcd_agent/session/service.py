"""`Session`: the trio service that keeps one node's session up (`await nursery.start(session.run)`).

Each connection: open the stream, send Hello, then run together until one of them ends:
- the receiver: each GatewayMessage into `SessionCore.handle` (a WelcomeRefused or ProtocolViolation
  ends the connection); the transport refuses a message over the size cap before reading its body and
  one whose body stops arriving (transport.FrameRefused: a protocol error);
- the sender: the outbox (session.outbox: serialized messages, bytes counted, a ceiling) onto the
  stream, in order. A message the gateway has not taken within `stall_timeout_s` means the peer stopped
  reading: the connection is dropped and a new one made (OutboxFull, the queue at its ceiling, too);
- the ticker: heartbeats every `heartbeat_s` (and soon after `heartbeat_soon`: the inventory hash
  changed), the status report when the runner published a newer one (coalesced latest-wins, at most one
  per `status_interval_s`, but at once when it moves the applied or observed generation), new events
  (read from the journal only while the outbox has room), and the replay of unacked results and events
  (`SessionCore.resend_due`).

Every connection that ends is logged in one line that says why (`describe_failure`): the refused Welcome
with both times, the TLS or certificate error, the protocol error, the gateway closing the stream.

Between connections: capped exponential backoff with jitter (`Backoff`), reset once a Welcome arrived.
The runner and the dispatcher keep running while offline, so the last spec stays enforced (DLV-RCV-20).
"""

from __future__ import annotations

import logging
import math
import random
import ssl
import time
from collections.abc import Callable

import trio

from bcd_agent.journal import JournalIOError
from bcd_agent.journal import WelcomeRefused as WelcomeRefusedError
from bcd_agent.session.backoff import Backoff
from bcd_agent.session.core import ProtocolViolation, SessionCore
from bcd_agent.session.outbox import EVENT_RESERVE_BYTES, MAX_OUTBOX_BYTES, Outbox, OutboxFull
from bcd_agent.session.transport import (
    Endpoint,
    FrameRefused,
    StreamLimits,
    describe_transport_error,
    open_loop,
    open_stream,
)

log = logging.getLogger("bcd.session")

HEARTBEAT_S = 30.0
STATUS_INTERVAL_S = 1.0
TICK_S = 0.25
# A message the gateway has not taken within this long: the peer is not reading; reconnect.
STALL_TIMEOUT_S = 60.0
# The sender writes the queued messages together, up to this many bytes per write.
SEND_BATCH_BYTES = 256 * 1024


class PeerStalled(Exception):
    """The gateway stopped reading the stream."""


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for inner in exc.exceptions:
            out.extend(_leaves(inner))
        return out
    return [exc]


def describe_failure(exc: BaseException) -> str:
    """One line naming why a connection ended (the cause inside any ExceptionGroup of the nurseries)."""
    leaves = [e for e in _leaves(exc) if not isinstance(e, trio.Cancelled)] or [exc]
    return "; ".join(_describe_one(e) for e in leaves)


def _describe_one(exc: BaseException) -> str:
    if isinstance(exc, WelcomeRefusedError):
        return f"Welcome refused: {exc}"
    if isinstance(exc, ProtocolViolation | FrameRefused):
        return f"protocol error: {exc}"
    if isinstance(exc, OutboxFull | PeerStalled):
        return f"peer not reading: {exc}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the gateway's certificate was refused: {exc.verify_message} ({exc.reason})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error: {exc.reason or exc}"
    grpc = describe_transport_error(exc)
    if grpc is not None:
        return grpc
    if isinstance(exc, ConnectionError | OSError):
        return f"connection failed: {type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


class Session:
    def __init__(
        self,
        core: SessionCore,
        endpoint: Endpoint,
        *,
        backoff: Backoff | None = None,
        draw: Callable[[], float] = random.random,
        heartbeat_s: float = HEARTBEAT_S,
        status_interval_s: float = STATUS_INTERVAL_S,
        wall: Callable[[], float] = time.time,
        on_link_change: Callable[[], None] | None = None,
        limits: StreamLimits | None = None,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        max_outbox_bytes: int = MAX_OUTBOX_BYTES,
    ) -> None:
        self.core = core
        self.endpoint = endpoint
        self.backoff = backoff or Backoff()
        self._draw = draw
        self.heartbeat_s = heartbeat_s
        self.status_interval_s = status_interval_s
        self._wake = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self.delays: list[float] = []  # backoff delays taken (tests, `bcd status`)
        self.hello_sent = trio.Event()
        self._heartbeat_due = False
        # Liveness for `bcd status` (wall times; docs/operations.md): "connected" from the Welcome until
        # the connection ends, "disconnected" otherwise, since the last change (the process start at
        # first). Failed attempts while disconnected do not move `link_since`.
        self._wall = wall
        self._on_link_change = on_link_change
        self.link = "disconnected"
        self.link_since = wall()
        self.link_error = ""  # why the last connection ended or failed
        self.retry_at: float | None = None  # wall time of the next attempt, while waiting for it
        self.last_heartbeat_at: float | None = None
        self.attempts = 0  # connection attempts that failed since the link was last up
        self._failure: tuple[int, str] | None = None  # (level, why) of the attempt that just ended
        self.limits = limits or StreamLimits()
        self.stall_timeout_s = stall_timeout_s
        self.max_outbox_bytes = max_outbox_bytes
        self.outbox: Outbox | None = None  # the current connection's (tests, benches)
        self.outbox_peak_bytes = 0  # the highest any connection's outbox reached
        self.failures: list[str] = []  # the last few one-line causes (tests, `bcd status`)

    def _set_link(self, state: str) -> None:
        if state != self.link:
            self.link = state
            self.link_since = self._wall()
            if self._on_link_change is not None:
                self._on_link_change()

    @property
    def state(self):  # type: ignore[no-untyped-def]
        return self.core.state

    def events_changed(self) -> None:
        """Wake the ticker (new events journaled). Safe from any thread once `run` started."""
        if trio.lowlevel.in_trio_run() or self._token is None:
            self._wake.set()
        else:
            trio.from_thread.run_sync(self._wake.set, trio_token=self._token)

    def heartbeat_soon(self) -> None:
        """Send a heartbeat at the next tick (the inventory hash changed). Safe from any thread."""
        self._heartbeat_due = True
        self.events_changed()

    async def run(self, *, task_status: trio.TaskStatus[Session] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with open_loop():
            task_status.started(self)
            attempt = 0
            while True:
                welcomed_before = self.core.state.welcomes
                self.retry_at = None
                try:
                    await self._connect_once()
                    self._failed("the gateway ended the stream", logging.INFO)
                except trio.Cancelled:
                    raise
                except BaseExceptionGroup as group:
                    # The nurseries' groups: log the cause inside; a group of Cancelled only is ours.
                    leaves = _leaves(group)
                    if not any(isinstance(e, Exception) for e in leaves) or any(
                        isinstance(e, JournalIOError) for e in leaves
                    ):
                        raise
                    self._failed(self._why(group), self._level(group), describe_failure(group))
                except JournalIOError:
                    raise  # the journal's storage failed: the node ends (bcd node prints one line)
                except Exception as exc:
                    self._failed(self._why(exc), self._level(exc), describe_failure(exc))
                finally:
                    self.core.detach()
                    self._set_link("disconnected")
                    if self.outbox is not None:
                        self.outbox_peak_bytes = max(self.outbox_peak_bytes, self.outbox.peak_bytes)
                    self.outbox = None
                if self.core.state.welcomes > welcomed_before:
                    attempt = 0
                    self.attempts = 0
                else:
                    self.attempts += 1
                delay = self.backoff.delay(attempt, self._draw())
                attempt += 1
                self._log_failure(delay)
                self.delays.append(delay)
                self.retry_at = self._wall() + delay
                if self._on_link_change is not None:
                    self._on_link_change()  # the next attempt's time, for `bcd status`
                await trio.sleep(delay)

    def _why(self, exc: BaseException) -> str:
        return f"connection to {self.endpoint.describe()} ended: {describe_failure(exc)}"

    @staticmethod
    def _level(exc: BaseException) -> int:
        leaves = _leaves(exc)
        if any(isinstance(e, WelcomeRefusedError | ProtocolViolation | FrameRefused) for e in leaves):
            return logging.ERROR
        return logging.WARNING

    def _failed(self, why: str, level: int, brief: str = "") -> None:
        self._failure = (level, why)  # logged once the next attempt's time is known
        self.failures = [*self.failures[-9:], why]
        # `bcd status` shows the last one after "disconnected from ENDPOINT": without the endpoint again.
        self.link_error = brief or why

    def _log_failure(self, delay: float) -> None:
        """The failure, when the next attempt is, and, once attempts keep failing, where to look."""
        if self._failure is None:
            return
        level, why = self._failure
        self._failure = None
        if self.attempts == 0:  # the session had reached Welcome: a reconnect, not a failing address
            log.log(level, "session: %s; reconnecting in %.1f s", why, delay)
            return
        log.log(
            level,
            "session: %s; attempt %d failed, the next in %.1f s%s",
            why,
            self.attempts,
            delay,
            # Once, and again every 100: a node that never connects says where to look.
            " (`bcd doctor` checks the control plane's address, socket and certificate)"
            if self.attempts % 100 == 3
            else "",
        )

    async def _connect_once(self) -> None:
        outbox = Outbox(self.max_outbox_bytes)
        self.outbox = outbox
        async with open_stream(self.endpoint, self.limits) as stream:
            hello = self.core.attach(outbox.put, room=outbox.room)
            self.core.journal.sync()  # what Hello reports is durable first (journal.sync)
            with trio.move_on_after(self.stall_timeout_s) as scope:
                await stream.send(hello)
            if scope.cancelled_caught:
                raise PeerStalled(f"the Hello was not taken within {self.stall_timeout_s:g} s")
            self.hello_sent.set()
            async with trio.open_nursery() as nursery:

                async def welcome_deadline() -> None:
                    await trio.sleep(self.stall_timeout_s)
                    if not self.core.state.welcomed:
                        raise PeerStalled(f"no Welcome within {self.stall_timeout_s:g} s of the Hello")

                async def receiver() -> None:
                    while True:
                        messages = await stream.recv_batch()
                        if messages is None:
                            break
                        # One batch: its commands' accepts are journaled in one durable transaction.
                        self.core.handle_batch(messages)
                        if any(
                            m.welcome is not None or (m.ack is not None and m.ack.journal_id)
                            for m in messages
                        ):
                            # What the ticker acts on: the Welcome (events, status) and event acks
                            # (room for events); a command's updates go out through the outbox.
                            self._wake.set()
                    nursery.cancel_scope.cancel()

                async def sender() -> None:
                    while True:
                        batch = await outbox.batch(SEND_BATCH_BYTES)
                        # Nothing reaches the gateway before the journal writes it reports are durable:
                        # one fsync for the accepts and outcomes of everything in this batch.
                        self.core.journal.sync()
                        with trio.move_on_after(self.stall_timeout_s) as scope:
                            await stream.send_many(batch)
                        if scope.cancelled_caught:
                            size = sum(len(m) for m in batch)
                            raise PeerStalled(
                                f"{size} bytes ({len(batch)} messages) not taken within"
                                f" {self.stall_timeout_s:g} s ({outbox.bytes} bytes,"
                                f" {len(outbox)} messages queued)"
                            )
                        outbox.sent(len(batch))
                        if self.core.events_throttled and outbox.room() > EVENT_RESERVE_BYTES:
                            self._wake.set()  # room again: the ticker reads more events

                nursery.start_soon(receiver)
                nursery.start_soon(sender)
                nursery.start_soon(welcome_deadline)
                nursery.start_soon(self._ticker)

    async def _ticker(self) -> None:
        core = self.core
        last_heartbeat = -math.inf
        last_status = -math.inf
        sent_generations: tuple[int, int] = (-1, -1)
        while True:
            now = trio.current_time()
            if core.state.welcomed:
                if self.link != "connected":
                    self._set_link("connected")
                    self.link_error = ""
                if self._heartbeat_due or now - last_heartbeat >= self.heartbeat_s:
                    self._heartbeat_due = False
                    core._out(core.heartbeat())
                    last_heartbeat = now
                    self.last_heartbeat_at = self._wall()
                status = core.status.latest() if core.status is not None else None
                # Coalesced (at most one per status_interval_s), except that a report moving the applied
                # or observed generation goes at once: the gateway coalesces too (DLV-CONV-22), and
                # spec-to-observed latency is what a caller waits on.
                if status is not None and (
                    now - last_status >= self.status_interval_s
                    or (status.applied_generation, status.observed_generation) != sent_generations
                    or core.conditions_changed
                ):
                    message = core.status_message(status)
                    if message is not None:
                        core._out(message)
                        last_status = now
                        sent_generations = (status.applied_generation, status.observed_generation)
                core.pump_events()
                core.resend_due()
            self._wake = trio.Event()
            with trio.move_on_after(TICK_S if core.status is None else self.status_interval_s / 2):
                if core.status is not None:
                    async with trio.open_nursery() as n:

                        async def status_waiter() -> None:
                            assert core.status is not None
                            latest = core.status.latest()
                            await core.status.wait_newer(latest.version if latest is not None else 0)
                            n.cancel_scope.cancel()

                        async def wake_waiter() -> None:
                            await self._wake.wait()
                            n.cancel_scope.cancel()

                        n.start_soon(status_waiter)
                        n.start_soon(wake_waiter)
                else:
                    await self._wake.wait()
