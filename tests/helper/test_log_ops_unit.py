"""audit.tail and audit.head called in process over a temporary root (issue 13 item 3, issue 9 item 6;
docs/mutation.md): the bounds word for word, whole lines only, no symlink followed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from bcd_helper.ops.auditops import AuditHead, audit_head
from bcd_helper.ops.base import Failed, HelperContext, Refused
from bcd_helper.ops.logs import DEFAULT_TAIL, MAX_TAIL, AuditTail, audit_tail
from opskit import call, context, make_root


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[HelperContext]:
    c = context(make_root(tmp_path))
    yield c
    c.audit.close()


def log_path(ctx: HelperContext) -> Path:
    return ctx.root / ctx.config.audit_dir.lstrip("/") / "audit.log"


def test_the_tail_is_bounded(ctx: HelperContext) -> None:
    assert AuditTail().max_bytes == DEFAULT_TAIL == 256 * 1024
    for bad in (1023, MAX_TAIL + 1, 0, -1):
        with pytest.raises(Refused) as info:
            audit_tail(call(ctx), AuditTail(bad))
        assert (info.value.reason, info.value.message) == (
            "bad-arguments",
            f"audit.tail: max_bytes must be 1024 to {MAX_TAIL}",
        )
    assert audit_tail(call(ctx), AuditTail(1024))["truncated"] is False
    assert audit_tail(call(ctx), AuditTail(MAX_TAIL))["truncated"] is False


def test_no_log_yet_is_an_empty_tail(ctx: HelperContext) -> None:
    assert audit_tail(call(ctx), AuditTail()) == {"text": "", "size_bytes": 0, "truncated": False}


def test_a_short_log_is_answered_whole(ctx: HelperContext) -> None:
    log_path(ctx).write_bytes(b"one\ntwo\n")
    assert audit_tail(call(ctx), AuditTail(1024)) == {
        "text": "one\ntwo\n",
        "size_bytes": 8,
        "truncated": False,
    }
    log_path(ctx).write_bytes(b"x" * 1024)  # exactly max_bytes: nothing cut
    assert audit_tail(call(ctx), AuditTail(1024))["text"] == "x" * 1024


def test_a_long_log_gives_its_newest_whole_lines(ctx: HelperContext) -> None:
    lines = [b"%04d" % i + b"y" * 95 + b"\n" for i in range(30)]  # 100 bytes each
    log_path(ctx).write_bytes(b"".join(lines))
    got = audit_tail(call(ctx), AuditTail(1050))
    assert got["size_bytes"] == 3000 and got["truncated"] is True
    assert got["text"] == b"".join(lines[-10:]).decode()  # the partial 11th line from the end dropped
    log_path(ctx).write_bytes(b"z" * 5000)  # one line longer than the tail: nothing whole
    assert audit_tail(call(ctx), AuditTail(1024)) == {"text": "", "size_bytes": 5000, "truncated": True}
    log_path(ctx).write_bytes(b"a" * 2000 + b"\n" + "é\n".encode())
    assert audit_tail(call(ctx), AuditTail(1024))["text"] == "é\n"


def test_bad_utf8_is_replaced(ctx: HelperContext) -> None:
    log_path(ctx).write_bytes(b"\xff\n")
    assert audit_tail(call(ctx), AuditTail(1024))["text"] == "\ufffd\n"


def test_a_symlinked_log_is_not_followed(ctx: HelperContext, tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("root's secret\n")
    log_path(ctx).symlink_to(tmp_path / "secret")
    with pytest.raises(Failed) as info:
        audit_tail(call(ctx), AuditTail())
    assert info.value.reason == "audit-tail"
    assert info.value.message.startswith(f"audit.tail: {ctx.config.audit_dir}/audit.log: ")


def test_the_head_is_the_logs_export(ctx: HelperContext) -> None:
    ctx.audit.record(
        peer_pid=1,
        peer_uid=0,
        op="x",
        args={},
        args_sha256="0" * 64,
        decision="accepted",
        reason="",
        message="",
        duration_ms=0.0,
    )
    seq, sha = ctx.audit.head()
    assert audit_head(call(ctx), AuditHead()) == {"seq": seq, "sha256": sha}
    assert ctx.audit._exported == seq


def test_one_byte_past_the_tail_drops_the_partial_line(ctx: HelperContext) -> None:
    log_path(ctx).write_bytes(b"ab\n" + b"c" * 1021 + b"\n")  # 1025 bytes: the tail starts at "b"
    assert audit_tail(call(ctx), AuditTail(1024)) == {
        "text": "c" * 1021 + "\n",
        "size_bytes": 1025,
        "truncated": True,
    }


def test_a_tail_starting_at_a_line_end_keeps_the_next_line(ctx: HelperContext) -> None:
    log_path(ctx).write_bytes(b"z" * 100 + b"\n" + b"q" * 1022 + b"\n")  # the tail starts at the newline
    assert audit_tail(call(ctx), AuditTail(1024))["text"] == "q" * 1022 + "\n"


def test_an_audit_dir_written_with_a_trailing_slash(tmp_path: Path) -> None:
    c = context(
        make_root(tmp_path),
        '[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = 4242\naudit_dir = "/var/log/x/"\n',
    )
    try:
        (c.root / "var/log/x/audit.log").write_bytes(b"line\n")
        assert audit_tail(call(c), AuditTail())["text"] == "line\n"
    finally:
        c.audit.close()


def test_a_tail_takes_four_times_its_bound_from_the_in_flight_budget_first(ctx: HelperContext) -> None:
    """Round 5: audit.tail reserves 4 x max_bytes (the bytes read, their text, the encoded answer) of the
    server's in-flight budget before it reads; with no room it is refused `busy` and reads nothing."""
    log_path(ctx).write_bytes(b"line\n")
    asked: list[int] = []

    def room(n: int) -> bool:
        asked.append(n)
        return True

    c = attrs.evolve(call(ctx), reserve=room)
    assert audit_tail(c, AuditTail(2048))["text"] == "line\n"
    assert asked == [4 * 2048]

    def full(n: int) -> bool:
        asked.append(n)
        return False

    c = attrs.evolve(c, reserve=full)
    with pytest.raises(Refused) as info:
        audit_tail(c, AuditTail(1024))
    assert (info.value.reason, info.value.message) == (
        "busy",
        "audit.tail: the helper holds as many large answers as it may: try again later",
    )
    assert asked == [8192, 4096]
    with pytest.raises(Refused) as bad:  # the bound is checked before anything is reserved
        audit_tail(c, AuditTail(1023))
    assert bad.value.reason == "bad-arguments" and asked == [8192, 4096]
