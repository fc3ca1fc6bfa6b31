"""W3C trace context (https://www.w3.org/TR/trace-context/): a command's `traceparent`, parsed.

A command's signed body carries `traceparent` (delivery.md "Command", DLV-CMD-15). bcd exports no
traces of its own, so it propagates the context the one way an operator can use it: every log line
written while a command's handler runs names the trace (`trace=<trace-id>` in text and journal lines,
`trace_id` and `parent_id` in JSON), so the control plane's trace leads to the node's lines and back.

The field is tracing metadata, not an instruction: a value that is not a valid `traceparent` is ignored
(the W3C rule for a receiver), never a reason to refuse a signed command.

The node hands the current context on to root: its helper client sends it with each request as a
version-00 `traceparent` (`header`), and the helper, which decodes strictly, takes only that exact form
(`parse_version_00`) and records the ids in the request's audit lines (docs/helper.md "Audit log").

The current context lives in a `contextvars.ContextVar`: each trio task (and each thread trio starts
for it) reads its own, so a handler's context never leaks into another command's lines. The variable
holds no state between commands: the dispatcher sets it for a handler's run and resets it after.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator

from attrs import frozen

# version "-" trace-id "-" parent-id "-" trace-flags, lower-case hex (trace-context §3.2.2).
_VERSION_00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})\Z")
# A later version keeps these four fields first and may append "-" and more (§3.2.4.1).
_FUTURE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:-.*)?\Z", re.DOTALL)
MAX_LENGTH = 512  # far beyond any version's header; a longer value is not parsed at all


@frozen
class TraceContext:
    trace_id: str  # 32 lower-case hex digits, not all zero
    parent_id: str  # 16 lower-case hex digits, not all zero: the span that sent the command
    flags: int  # trace-flags; bit 0 is "sampled"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def parse(value: str) -> TraceContext | None:
    """The trace context of a `traceparent` header value, or None when it is absent or invalid."""
    if not value or len(value) > MAX_LENGTH:
        return None
    match = _VERSION_00.match(value)
    if match is not None:
        trace_id, parent_id, flags = match.groups()
    else:
        future = _FUTURE.match(value)
        # Version ff is forbidden; version 00 must be exactly its four fields (matched above).
        if future is None or future.group(1) in ("00", "ff"):
            return None
        _, trace_id, parent_id, flags = future.groups()
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return TraceContext(trace_id, parent_id, int(flags, 16))


VERSION_00_LENGTH = 55  # "00-" + 32 + "-" + 16 + "-" + 2


def parse_version_00(value: object) -> TraceContext | None:
    """`value`'s context when it is exactly a valid version-00 `traceparent` (a str of 55 characters,
    lower-case hex, neither id all zeros), else None: the strict form the helper takes, and the only one
    `header` writes."""
    if type(value) is not str or len(value) != VERSION_00_LENGTH or not value.startswith("00-"):
        return None
    return parse(value)  # a 55-character "00-" value is taken only in version 00's exact form


def header(ctx: TraceContext) -> str:
    """`ctx` as a version-00 `traceparent`: what bcd sends on, whatever version it received (a later
    version is read by its first four fields, and a sender writes the version it speaks)."""
    return f"00-{ctx.trace_id}-{ctx.parent_id}-{ctx.flags:02x}"


CURRENT: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar("bcd_trace", default=None)


@contextlib.contextmanager
def current(value: str) -> Iterator[TraceContext | None]:
    """Make `value`'s trace context the current one for the block (None when it is invalid)."""
    ctx = parse(value)
    token = CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        CURRENT.reset(token)
