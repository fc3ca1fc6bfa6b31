"""Secrets from the control plane: `SecretRequest` out, `SecretResponse` back (delivery.md; host-config.md).

A secret never travels in the spec: the spec names a reference (`secret://...`) and the node asks the
gateway's broker for its value when it needs it. The broker releases it only while the node's current
spec names that reference (for the k8s-join token: in that unit's `tokenRef`, HST-K8S-51).

`SecretRequests` is the node's half, owned by the `SessionCore`:

- `await fetch(ref, workflow_id=..., step_id=..., ...)` waits until the session is welcomed, sends one
  `SecretRequest` with a fresh `request_id`, and waits for the `SecretResponse` echoing it. A connection
  lost before the answer sends the request again on the next session (a new id). The whole wait is
  bounded by `timeout_s` (30 s by default).
- Outcomes: `OK` -> the value bytes; `REFUSED` -> `TerminalError("SecretRefused")` (terminal for the
  asker, session.proto); `UNAVAILABLE`, any other status, or no answer in time ->
  `RetryableError("SecretUnavailable")`, so the section that asked stays PROGRESSING and retries on its
  next pass (DLV-INST-08's rule for every asker).
- A response whose id is not pending (late, after a timeout, or from an earlier session) is dropped.

`SessionTokenSource` is the `bcd_shared.units.TokenSource` the k8s-join unit uses in `bcd node`: it
fetches the token from a worker thread (the runner runs sections there) with workflow `host:k8s-join`
and step `tokenRef` (HST-K8S-50). The token is held in memory only; the unit writes it into the
JoinConfiguration it removes after `kubeadm join` (under the helper the node stages it first, see
`bcd_agent.nodeparts.host`).

Trio only: the core calls `welcomed()`, `detached()` and `deliver()` from the session's task.
"""

from __future__ import annotations

import logging
import secrets as _secrets
from collections import deque
from collections.abc import Callable
from functools import partial

import trio
from attrs import define
from bcd_shared import wire
from bcd_shared.errors import RetryableError, TerminalError

log = logging.getLogger("bcd.session")

SECRET_TIMEOUT_S = 30.0
SENT_KEPT = 64
WORKFLOW_K8S_JOIN = "host:k8s-join"
STEP_TOKEN_REF = "tokenRef"  # noqa: S105 (a workflow step name)

Send = Callable[[wire.NodeMessage], None]


@define
class _Pending:
    done: trio.Event
    response: wire.SecretResponse | None = None


class SecretRequests:
    """Pending SecretRequests of one node (see the module docstring)."""

    def __init__(self, *, timeout_s: float = SECRET_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._send: Send | None = None
        self._welcome = trio.Event()
        self._pending: dict[str, _Pending] = {}
        # The latest requests sent (tests, `bcd status`), bounded: an unavailable broker is asked again on
        # every retry pass for as long as the node runs.
        self.sent: deque[wire.SecretRequest] = deque(maxlen=SENT_KEPT)

    # --- the session's side (SessionCore) -------------------------------------------------------

    def welcomed(self, send: Send) -> None:
        """A session was welcomed: requests may go out on `send`."""
        self._send = send
        self._welcome.set()

    def detached(self) -> None:
        """The connection ended: waiting requests are sent again on the next session."""
        self._send = None
        if self._welcome.is_set():
            self._welcome = trio.Event()
        for pending in self._pending.values():
            pending.done.set()

    def deliver(self, response: wire.SecretResponse) -> bool:
        """A SecretResponse arrived; False when no request with its id is pending (dropped)."""
        pending = self._pending.get(response.request_id)
        if pending is None or pending.response is not None:
            log.info("session: SecretResponse %r dropped: no such request is pending", response.request_id)
            return False
        pending.response = response
        pending.done.set()
        return True

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- the askers' side -----------------------------------------------------------------------

    async def fetch(
        self,
        ref: str,
        *,
        workflow_id: str = "",
        step_id: str = "",
        allocation_id: str = "",
        instance_id: str = "",
        timeout_s: float | None = None,
    ) -> bytes:
        """The secret's value; raises TerminalError (refused) or RetryableError (see the module)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        response: wire.SecretResponse | None = None
        with trio.move_on_after(timeout):
            while response is None:
                await self._welcome.wait()
                send = self._send
                if send is None:
                    await trio.lowlevel.checkpoint()
                    continue
                request = wire.SecretRequest(
                    request_id=_secrets.token_hex(12),
                    ref=ref,
                    allocation_id=allocation_id,
                    workflow_id=workflow_id,
                    step_id=step_id,
                    instance_id=instance_id,
                )
                pending = _Pending(trio.Event())
                self._pending[request.request_id] = pending
                try:
                    send(wire.NodeMessage(secret_request=request))
                    self.sent.append(request)
                    await pending.done.wait()
                finally:
                    del self._pending[request.request_id]
                response = pending.response
        if response is None:
            raise RetryableError("SecretUnavailable", f"{ref}: no SecretResponse within {timeout:g} s")
        status = response.status
        if status == wire.SecretStatus.OK:
            return bytes(response.value)
        why = response.message or getattr(status, "name", str(status))
        if status == wire.SecretStatus.REFUSED:
            raise TerminalError("SecretRefused", f"{ref}: the control plane refused to release it: {why}")
        raise RetryableError("SecretUnavailable", f"{ref}: the control plane could not release it now: {why}")


class SessionTokenSource:
    """k8s-join's TokenSource in `bcd node`: a SecretRequest per fetch, from the runner's worker thread."""

    def __init__(self, requests: SecretRequests, trio_token: trio.lowlevel.TrioToken) -> None:
        self._requests = requests
        self._token = trio_token
        self.fetched: list[str] = []

    def fetch(self, token_ref: str) -> str:
        value = trio.from_thread.run(
            partial(self._requests.fetch, token_ref, workflow_id=WORKFLOW_K8S_JOIN, step_id=STEP_TOKEN_REF),
            trio_token=self._token,
        )
        self.fetched.append(token_ref)
        try:
            return value.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise TerminalError("BadToken", f"k8s-join: the secret {token_ref} is not UTF-8 text") from None

    def consumed(self) -> None:
        """Nothing to forget: the node keeps the token in memory only (the unit removed its file)."""
