"""A command's W3C trace context (`traceparent`) in the lines of its handling (DLV-CMD-15).

The real Dispatcher over the real journal runs commands side by side; their handlers' lines go through
the daemons' own formatters (bcd_shared.logsetup) into a buffer."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from bcd_agent.dispatch.command import CommandEnvelope, UpdateState
from bcd_agent.kinds.testing import EffectHandler, effect_handlers, effect_payload
from bcd_shared import logsetup, tracecontext
from dhelpers import Harness, Pki, make_command, start

TRACE_A = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACE_B = "0af7651916cd43dd8448eb211c80319c"
PARENT = "00f067aa0ba902b7"
log = logging.getLogger("bcd.test.handler")


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """A buffer for the root logger's lines (the test configures the format); the handlers restored after."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    yield buf
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])


# --- parse -------------------------------------------------------------------------------------------


def test_a_version_00_traceparent_is_parsed() -> None:
    ctx = tracecontext.parse(f"00-{TRACE_A}-{PARENT}-01")
    assert ctx == tracecontext.TraceContext(TRACE_A, PARENT, 1)
    assert ctx.sampled
    unsampled = tracecontext.parse(f"00-{TRACE_A}-{PARENT}-00")
    assert unsampled is not None and not unsampled.sampled and unsampled.flags == 0


@pytest.mark.parametrize(
    "value",
    [
        "",
        f"00-{TRACE_A.upper()}-{PARENT}-01",  # upper-case hex is not the format
        f"00-{'0' * 32}-{PARENT}-01",  # an all-zero trace id is invalid
        f"00-{TRACE_A}-{'0' * 16}-01",  # so is an all-zero parent id
        f"ff-{TRACE_A}-{PARENT}-01",  # version ff is forbidden
        f"00-{TRACE_A}-{PARENT}-01-extra",  # version 00 is exactly four fields
        f"00-{TRACE_A}-{PARENT}-01\n",
        f"00-{TRACE_A[:-1]}-{PARENT}-01",
        f"00-{TRACE_A}0-{PARENT}-01",
        f"00-{TRACE_A}-{PARENT[:-1]}-01",
        f"00-{TRACE_A}-{PARENT}-1",
        f"00-{TRACE_A}-{PARENT}-0g",
        f"0-{TRACE_A}-{PARENT}-01",
        f"00_{TRACE_A}_{PARENT}_01",
        f"01-{TRACE_A}-{PARENT}-01x",  # a later version's extra part starts with "-"
        f"01-{TRACE_A}-{PARENT}-01-" + "x" * 460,  # longer than any header
        f" 00-{TRACE_A}-{PARENT}-01",
    ],
)
def test_an_invalid_traceparent_gives_no_context(value: str) -> None:
    assert tracecontext.parse(value) is None


def test_flags_are_hex_and_the_length_limit_is_512() -> None:
    ctx = tracecontext.parse(f"00-{TRACE_A}-{PARENT}-1f")
    assert ctx is not None and ctx.flags == 31 and ctx.sampled
    even = tracecontext.parse(f"00-{TRACE_A}-{PARENT}-0a")
    assert even is not None and even.flags == 10 and not even.sampled
    head = f"01-{TRACE_A}-{PARENT}-01-"
    assert tracecontext.parse(head + "x" * (512 - len(head))) == tracecontext.TraceContext(TRACE_A, PARENT, 1)
    assert tracecontext.parse(head + "x" * (513 - len(head))) is None


def test_a_later_version_is_read_by_its_first_four_fields() -> None:
    assert tracecontext.parse(f"cc-{TRACE_A}-{PARENT}-01") == tracecontext.TraceContext(TRACE_A, PARENT, 1)
    assert tracecontext.parse(f"01-{TRACE_A}-{PARENT}-03-what-follows") == tracecontext.TraceContext(
        TRACE_A, PARENT, 3
    )


# --- the handling's lines ----------------------------------------------------------------------------


async def _run_side_by_side(tmp_path: Path, pki: Pki, cmds: list[CommandEnvelope]) -> None:
    """Run `cmds` at once: each handler logs on entry, from a worker thread, and once all are inside."""
    h = Harness(tmp_path / "data", pki)
    inside = 0
    all_in = trio.Event()

    async def hook(cmd: CommandEnvelope) -> None:
        nonlocal inside
        log.info("entered %s", cmd.id)
        await trio.to_thread.run_sync(log.info, f"thread of {cmd.id}")
        inside += 1
        if inside == len(cmds):
            all_in.set()
        await all_in.wait()  # every handler is in flight before any logs its last line
        log.info("leaving %s", cmd.id)

    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "fx", before_effect=hook))))
        for cmd in cmds:
            d.deliver(cmd)
        with trio.fail_after(30):
            for cmd in cmds:
                done = await h.sink.wait_terminal(cmd.id)
                assert done.state is UpdateState.SUCCEEDED, done
        log.info("after every command")
        n.cancel_scope.cancel()


def _commands(pki: Pki) -> list[CommandEnvelope]:
    # Distinct resources, so the three run at once on the lane's workers.
    return [
        make_command(pki, payload=effect_payload("a", ("r-a",)), traceparent=f"00-{TRACE_A}-{PARENT}-01"),
        make_command(pki, payload=effect_payload("b", ("r-b",)), traceparent=f"00-{TRACE_B}-{PARENT}-00"),
        make_command(
            pki, payload=effect_payload("c", ("r-c",)), traceparent=f"00-{TRACE_A.upper()}-{PARENT}-01"
        ),
    ]


async def test_DLV_CMD_15_each_commands_handling_names_its_own_trace(
    tmp_path: Path, pki: Pki, lines: io.StringIO
) -> None:
    """DLV-CMD-15: every line a handler writes (in its task and in a thread it starts) names its
    command's trace, three commands in flight at once; an invalid traceparent (upper-case hex) names
    none and the command still runs; a line outside any handling names none."""
    buf = lines
    logsetup.configure(logging.INFO, "text", stream=buf)
    a, b, c = _commands(pki)
    await _run_side_by_side(tmp_path, pki, [a, b, c])
    text = buf.getvalue().splitlines()

    def of(cmd: CommandEnvelope) -> list[str]:
        return [line for line in text if cmd.id in line]

    for cmd, trace in ((a, TRACE_A), (b, TRACE_B)):
        mine = [line for line in of(cmd) if "bcd.test.handler" in line]
        assert len(mine) == 3, text  # entered, the thread's, leaving
        assert all(line.endswith(f" trace={trace}") for line in mine), mine
    other = [line for line in of(c) if "bcd.test.handler" in line]
    assert len(other) == 3 and not any("trace=" in line for line in other), other
    outside = [line for line in text if "after every command" in line]
    assert len(outside) == 1 and "trace=" not in outside[0]


async def test_DLV_CMD_15_json_lines_carry_trace_and_parent_ids(
    tmp_path: Path, pki: Pki, lines: io.StringIO
) -> None:
    """DLV-CMD-15: in `--log-format json` the handling's lines carry `trace_id` and `parent_id` fields
    (the message itself unchanged); other lines carry neither."""
    buf = lines
    logsetup.configure(logging.INFO, "json", stream=buf)
    a, b, c = _commands(pki)
    await _run_side_by_side(tmp_path, pki, [a, b, c])
    docs = [json.loads(line) for line in buf.getvalue().splitlines()]
    handler = [d for d in docs if d["logger"] == "bcd.test.handler"]
    for cmd, trace in ((a, TRACE_A), (b, TRACE_B)):
        mine = [d for d in handler if cmd.id in d["msg"]]
        assert len(mine) == 3
        assert all(d["trace_id"] == trace and d["parent_id"] == PARENT for d in mine), mine
        assert all("trace=" not in d["msg"] for d in mine)
    assert all("trace_id" not in d and "parent_id" not in d for d in handler if c.id in d["msg"])
    assert all("trace_id" not in d for d in docs if d["msg"] == "after every command")


def test_DLV_CMD_15_journal_format_names_the_trace_on_the_message_line() -> None:
    """DLV-CMD-15: journald's format puts the trace after the message, on the line that carries it."""
    record = logging.LogRecord("bcd.x", logging.WARNING, __file__, 1, "two\nlines", None, None)
    with tracecontext.current(f"00-{TRACE_B}-{PARENT}-01"):
        inside = logsetup.JournalFormatter().format(record)
    assert inside == f"<4>bcd.x: two\n<4>lines trace={TRACE_B}"
    assert logsetup.JournalFormatter().format(record) == "<4>bcd.x: two\n<4>lines"


def test_the_helpers_strict_form_is_version_00_exactly_and_header_writes_it() -> None:
    """parse_version_00 (what root takes, docs/helper.md "Audit log") is a str of exactly 55 characters in
    version 00's form, ids not all zero; header writes a context in that form whatever version it came in."""
    good = f"00-{TRACE_A}-{PARENT}-0a"
    assert tracecontext.parse_version_00(good) == tracecontext.TraceContext(TRACE_A, PARENT, 10)
    for bad in (
        f"cc-{TRACE_A}-{PARENT}-01",
        f"00-{TRACE_A}-{PARENT}-01-x",
        good + "\n",
        good.upper(),
        f"00-{'0' * 32}-{PARENT}-01",
        f"00-{TRACE_A}-{'0' * 16}-01",
        None,
        55,
        good.encode(),
    ):
        assert tracecontext.parse_version_00(bad) is None, bad
    later = tracecontext.parse(f"cc-{TRACE_A}-{PARENT}-0f-more")
    assert later is not None
    assert tracecontext.header(later) == f"00-{TRACE_A}-{PARENT}-0f"
    assert tracecontext.parse_version_00(tracecontext.header(later)) == later
