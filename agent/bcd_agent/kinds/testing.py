"""Test kinds: prove the dispatch machinery end to end (tests, crash drivers and `bcd sim` only).

Their rows are `TEST_KINDS` (merge with dispatch.kinds.KINDS: `{**KINDS, **TEST_KINDS}`); they are never in
the production table, so a real control plane can never run them.

Payload: `type.googleapis.com/bcd.test.Effect` whose value is a JSON object, checked strictly:
    {"token": str, "resources": [str, ...]}            (both optional; no other keys)
Effect: one line `<command id> <token> <boot id>\\n` appended to the effect log, fsynced before the handler
returns, so a test can count how often a side effect really happened across crashes (the handlers that
reach their effect in the same scheduler tick share that fsync: `_GroupFsync`). Result: the JSON
`{"token": token}`. `test.reboot` is self-terminating: its effect is the same line, then the injected
`terminate` callable (a test's os._exit, or a simulated reboot).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import trio

from bcd_agent.dispatch.command import CommandEnvelope
from bcd_agent.dispatch.handlers import InvalidPayload, RunContext
from bcd_agent.dispatch.kinds import KindSpec, Lane, Role

EFFECT_TYPE_URL = "type.googleapis.com/bcd.test.Effect"
_ALL = frozenset(Role)

TEST_KINDS: Mapping[str, KindSpec] = {
    k.name: k
    for k in (
        KindSpec("test.echo", Lane.CONTROL, _ALL, retry_safe=True, timeout_s=60),
        KindSpec("test.effect", Lane.CONTROL, _ALL, timeout_s=60),
        KindSpec("test.attested", Lane.CONTROL, _ALL, attested=True, timeout_s=60),
        KindSpec("test.retry", Lane.CONTROL, _ALL, retry_safe=True, timeout_s=60),
        KindSpec("test.destructive", Lane.CONTROL, _ALL, destructive=True, timeout_s=60),
        KindSpec("test.provision", Lane.PROVISION, _ALL, timeout_s=60),
        KindSpec("test.bulk", Lane.BULK, _ALL, timeout_s=60),
        KindSpec("test.reboot", Lane.CONTROL, _ALL, retry_safe=True, self_terminating=True, timeout_s=60),
    )
}


def effect_payload(token: str = "", resources: tuple[str, ...] = ()) -> tuple[str, bytes]:
    """(type_url, value) of a test payload."""
    doc: dict[str, object] = {"token": token, "resources": list(resources)}
    return EFFECT_TYPE_URL, json.dumps(doc, sort_keys=True).encode()


def parse_effect(command: CommandEnvelope) -> tuple[str, frozenset[str]]:
    if command.payload.type_url != EFFECT_TYPE_URL:
        raise InvalidPayload(
            f"payload: type_url {command.payload.type_url or '(none)'} is not {EFFECT_TYPE_URL}"
        )
    try:
        doc = json.loads(command.payload.value or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidPayload(f"payload: not JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) - {"token", "resources"}:
        raise InvalidPayload("payload: must be an object with only token and resources")
    token = doc.get("token", "")
    resources = doc.get("resources", [])
    if not isinstance(token, str):
        raise InvalidPayload("payload.token: must be a string")
    if not isinstance(resources, list) or not all(isinstance(r, str) and r for r in resources):
        raise InvalidPayload("payload.resources: must be a list of non-empty strings")
    return token, frozenset(resources)


def append_effect(log: Path, line: str) -> None:
    """Append one line and fsync it: the effect happened once this returns."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class _GroupFsync:
    """Lines appended by the handlers that reach their effect in the same scheduler tick share one fsync:
    each handler writes its line, the first of them lets the others run once (a shielded checkpoint) and
    fsyncs the file for all, and every handler returns only once its line is on disk, exactly as with
    `append_effect` (a process killed after the write keeps the line: it is in the page cache)."""

    def __init__(self, log: Path) -> None:
        self._log = log
        self._waiting: list[tuple[trio.Event, list[BaseException]]] = []

    async def append(self, line: str) -> None:
        fd = os.open(self._log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        done = trio.Event()
        error: list[BaseException] = []
        self._waiting.append((done, error))
        if len(self._waiting) > 1:
            await done.wait()
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            batch, self._waiting = self._waiting, []
            failure: list[BaseException] = []
            try:
                fd = os.open(self._log, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                failure.append(exc)
            for event, errors in batch:
                errors.extend(failure)
                event.set()
        if error:
            raise error[0]


Hook = Callable[[CommandEnvelope], Awaitable[None]]


class EffectHandler:
    """The handler of every test kind. `before_effect` / `during_effect` let a test block or count: the
    first runs before `begin_effect` (cancel still wins there), the second after it (the real outcome wins).
    `terminate` is called after the effect of a self-terminating kind."""

    def __init__(
        self,
        effect_log: Path,
        *,
        before_effect: Hook | None = None,
        during_effect: Hook | None = None,
        terminate: Callable[[], None] | None = None,
    ) -> None:
        self._log = effect_log
        self._before = before_effect
        self._during = during_effect
        self._terminate = terminate
        self._group = _GroupFsync(effect_log)

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        return parse_effect(command)[1]

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        token, _ = parse_effect(command)
        if self._before is not None:
            await self._before(command)
        await ctx.begin_effect()
        if self._during is not None:
            await self._during(command)
        await self._group.append(f"{command.id} {token} {ctx.boot_id}\n")
        if command.self_terminating and self._terminate is not None:
            self._terminate()
        return json.dumps({"token": token}).encode()


def effect_handlers(handler: EffectHandler) -> dict[str, EffectHandler]:
    """Every test kind served by one handler."""
    return dict.fromkeys(TEST_KINDS, handler)
