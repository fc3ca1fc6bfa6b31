"""`Session`: the trio service that keeps one node's session up (`await nursery.start(session.run)`).

Each connection: open the stream, send Hello, then run together until one of them ends:
- the receiver: each GatewayMessage into `SessionCore.handle` (a WelcomeRefused or ProtocolViolation
  ends the connection);
- the sender: the outbox (a memory channel the core's `send` feeds) onto the stream, in order;
- the ticker: heartbeats every `heartbeat_s` (and soon after `heartbeat_soon`: the inventory hash
  changed), the status report when the runner published a newer one (coalesced latest-wins, at most one
  per `status_interval_s`, but at once when it moves the applied or observed generation), new events,
  and the replay of unacked results and events (`SessionCore.resend_due`).

Between connections: capped exponential backoff with jitter (`Backoff`), reset once a Welcome arrived.
The runner and the dispatcher keep running while offline, so the last spec stays enforced (DLV-RCV-20).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable

import trio
from bcd_shared import wire

from bcd_agent.journal import WelcomeRefused as WelcomeRefusedError
from bcd_agent.session.backoff import Backoff
from bcd_agent.session.core import ProtocolViolation, SessionCore
from bcd_agent.session.transport import Endpoint, open_loop, open_stream

log = logging.getLogger("bcd.session")

HEARTBEAT_S = 30.0
STATUS_INTERVAL_S = 1.0
TICK_S = 0.25


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
                    log.info("session: the gateway ended the stream")
                    self.link_error = "the gateway ended the stream"
                except (WelcomeRefusedError, ProtocolViolation) as exc:
                    log.error("session: %s", exc)
                    self.link_error = str(exc)
                except trio.Cancelled:
                    raise
                except Exception as exc:
                    log.warning(
                        "session: connection to %s failed: %s: %s",
                        self.endpoint.describe(),
                        type(exc).__name__,
                        exc,
                    )
                    leaf: BaseException = exc
                    while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
                        leaf = leaf.exceptions[0]
                    self.link_error = f"{type(leaf).__name__}: {leaf}"
                finally:
                    self.core.detach()
                    self._set_link("disconnected")
                if self.core.state.welcomes > welcomed_before:
                    attempt = 0
                    self.attempts = 0
                else:
                    self.attempts += 1
                delay = self.backoff.delay(attempt, self._draw())
                attempt += 1
                self.delays.append(delay)
                self.retry_at = self._wall() + delay
                if self._on_link_change is not None:
                    self._on_link_change()  # the next attempt's time, for `bcd status`
                await trio.sleep(delay)

    async def _connect_once(self) -> None:
        send, receive = trio.open_memory_channel[wire.NodeMessage](math.inf)
        async with open_stream(self.endpoint) as stream:
            hello = self.core.attach(send.send_nowait)
            await stream.send(hello)
            self.hello_sent.set()
            async with trio.open_nursery() as nursery:

                async def receiver() -> None:
                    while True:
                        message = await stream.recv()
                        if message is None:
                            break
                        self.core.handle(message)
                        self._wake.set()
                    nursery.cancel_scope.cancel()

                async def sender() -> None:
                    async for message in receive:
                        await stream.send(message)

                nursery.start_soon(receiver)
                nursery.start_soon(sender)
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
