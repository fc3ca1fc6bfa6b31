"""Decoding a command's payload into its kind's request message, strictly (for handlers)."""

from __future__ import annotations

from typing import TypeVar

import betterproto2
from bcd_shared.wire.strict import WireError, decode, type_url

from bcd_agent.dispatch.command import CommandEnvelope
from bcd_agent.dispatch.handlers import InvalidPayload

M = TypeVar("M", bound=betterproto2.Message)


def decode_request(command: CommandEnvelope, cls: type[M]) -> M:
    """The payload as `cls`: the Any's type URL must be `cls`'s and its value must decode strictly;
    otherwise InvalidPayload (FAILED `invalid-payload`) naming the field and the rule."""
    expected = type_url(cls)
    if command.payload.type_url != expected:
        got = command.payload.type_url or "(none)"
        raise InvalidPayload(f"payload: type_url {got} is not {expected} for {command.kind}")
    try:
        return decode(cls, command.payload.value)
    except WireError as exc:
        raise InvalidPayload(f"payload.{exc.path}: {exc.rule}") from None
