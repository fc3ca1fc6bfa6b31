"""audit.pending: the counts of requests answered without a line of their own while the audit log is full,
kept on disk so that a killed helper does not lose them (docs/helper.md "Audit log", round 11 row 4).
In process, with a real audit directory; the killed helper itself is
tests/helper/test_hostile_round11.py::test_round11_the_counts_kept_while_the_log_is_full_survive_a_killed_helper."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.ops.base import HelperContext
from bcd_helper.server import (
    MAX_PENDING_REASONS,
    MAX_PENDING_UIDS,
    Guards,
    decode_pending,
    encode_pending,
)
from opskit import context, make_root


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[HelperContext]:
    c = context(make_root(tmp_path))
    yield c
    c.audit.close()


def _pending_path(ctx: HelperContext) -> Path:
    return ctx.root / ctx.config.audit_dir.lstrip("/") / "audit.pending"


def _lines(ctx: HelperContext) -> list[dict[str, Any]]:
    path = ctx.root / ctx.config.audit_dir.lstrip("/") / "audit.log"
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def _full(ctx: HelperContext, full: bool) -> None:
    ctx.audit._held = ctx.audit._keep * 4 if full else 0
    assert ctx.audit.full is full


def test_while_full_the_counts_are_saved_once_per_change_and_read_back_by_the_next_helper(
    ctx: HelperContext,
) -> None:
    guards = Guards(ctx)
    try:
        _full(ctx, True)
        guards.flush()  # nothing counted: no file
        assert not _pending_path(ctx).exists()
        guards.count(4242, "audit-full")
        guards.count(4242, "audit-full")
        guards.count(4243, "bad-request")
        guards.flush()
        path = _pending_path(ctx)
        assert decode_pending(path.read_bytes()) == {4242: {"audit-full": 2}, 4243: {"bad-request": 1}}
        assert path.stat().st_mode & 0o777 == 0o600
        inode = path.stat().st_ino
        guards.flush()  # nothing new: not written again (each save is a new file renamed over)
        assert path.stat().st_ino == inode
        guards.count(4242, "audit-full")
        guards.flush()
        assert path.stat().st_ino != inode
        assert decode_pending(path.read_bytes())[4242] == {"audit-full": 3}
    finally:
        guards._stop.set()  # as a killed helper: no close, nothing written at the end
        guards._thread.join()
    lines = len(_lines(ctx))

    again = Guards(ctx)  # the next helper, on the same log, still full
    try:
        guards_pending = again._pending
        assert guards_pending == {4242: {"audit-full": 3}, 4243: {"bad-request": 1}}
        again.count(4242, "audit-full")
        again.flush()  # still full: the file follows the new count, no line yet
        assert decode_pending(_pending_path(ctx).read_bytes())[4242] == {"audit-full": 4}
        assert len(_lines(ctx)) == lines
        _full(ctx, False)
        again.flush()
        assert not _pending_path(ctx).exists()
        written = {x["peer_uid"]: x for x in _lines(ctx)[lines:]}
        assert written[4242]["op"] == "(suppressed)" and written[4242]["args"] == {
            "count": 4,
            "reasons": {"audit-full": 4},
        }
        assert written[4243]["args"] == {"count": 1, "reasons": {"bad-request": 1}}
    finally:
        again.close()


def test_read_back_counts_written_at_the_first_flush_with_room_remove_the_file(ctx: HelperContext) -> None:
    """The next helper starts with room (the log was exported meanwhile): its first flush writes the
    counts it read back and removes the file, with no save in between."""
    _pending_path(ctx).write_bytes(encode_pending({4242: {"bad-request": 3}}))
    guards = Guards(ctx)
    try:
        _full(ctx, False)
        guards.flush()
        assert not _pending_path(ctx).exists()
        assert _lines(ctx)[-1]["args"] == {"count": 3, "reasons": {"bad-request": 3}}
    finally:
        guards.close()


def test_a_clean_stop_while_full_writes_the_counts_and_removes_the_file(ctx: HelperContext) -> None:
    guards = Guards(ctx)
    _full(ctx, True)
    guards.count(4242, "bad-request")
    guards.flush()
    assert _pending_path(ctx).exists()
    guards.close()
    assert not _pending_path(ctx).exists()
    assert _lines(ctx)[-1]["args"] == {"count": 1, "reasons": {"bad-request": 1}}
    assert Guards(ctx)._pending == {}  # nothing left to read back


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'{"pending": {}}',
        b'{"pending": {}, "v": 2}',
        b'{"pending": {"-1": {"x": 1}}, "v": 1}',
        b'{"pending": {"01": {"x": 1}}, "v": 1}',
        b'{"pending": {"4294967295": {"x": 1}}, "v": 1}',
        b'{"pending": {"1": {}}, "v": 1}',
        b'{"pending": {"1": {"x": 0}}, "v": 1}',
        b'{"pending": {"1": {"x": true}}, "v": 1}',
        b'{"pending": {"1": {"x": 1.0}}, "v": 1}',
        b'{"pending": {"1": {"": 1}}, "v": 1}',
        b'{"pending": {"1": {"x": 9007199254740992}}, "v": 1}',
        b'{"pending": {"1": {"x": 1}}, "v": 1, "more": 1}',
        b" " * (64 * 1024 + 1),
    ],
)
def test_an_unreadable_file_is_said_in_a_line_of_its_own_and_removed(ctx: HelperContext, data: bytes) -> None:
    path = _pending_path(ctx)
    path.write_bytes(data)
    guards = Guards(ctx)
    try:
        assert guards._pending == {} and not path.exists()
        line = _lines(ctx)[-1]
        assert (line["op"], line["peer_uid"], line["peer_pid"]) == ("(suppressed)", 0, 0)
        assert (line["decision"], line["reason"], line["duration_ms"]) == (
            "refused",
            "pending-unreadable",
            0.0,
        )
        assert line["args_sha256"] == hashlib.sha256(data).hexdigest()
        with pytest.raises(ValueError) as exc:
            decode_pending(data)
        assert line["message"] == f"audit.pending of an earlier run not read, its counts lost: {exc.value}"
    finally:
        guards.close()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b" " * (64 * 1024 + 1), "more than 65536 bytes"),
        (b"[1", "not JSON: "),
        (b'{"pending": {}, "v": 2}', 'not {"pending": ..., "v": 1}'),
        (b"[]", 'not {"pending": ..., "v": 1}'),
        (b'{"pending": [], "v": 1}', "pending: an object of at most 64 uids"),
        (
            json.dumps({"pending": {str(u): {"x": 1} for u in range(65)}, "v": 1}).encode(),
            "pending: an object of at most 64 uids",
        ),
        (
            b'{"pending": {"' + b"9" * 30 + b'": {"x": 1}}, "v": 1}',
            "pending: '" + "9" * 20 + "' is not a uid",
        ),
        (b'{"pending": {"4294967295": {"x": 1}}, "v": 1}', "pending: '4294967295' is not a uid"),
        (b'{"pending": {"7": []}, "v": 1}', "pending.7: an object of 1 to 32 reasons"),
        (
            json.dumps({"pending": {"7": {f"r{i}": 1 for i in range(33)}}, "v": 1}).encode(),
            "pending.7: an object of 1 to 32 reasons",
        ),
        (
            json.dumps({"pending": {"7": {"r" * 129: 1}}, "v": 1}).encode(),
            f"pending.7: {'r' * 40!r}: a reason of 1 to 128 characters, a count 1 to 2**53-1",
        ),
        (
            b'{"pending": {"7": {"x": 9007199254740992}}, "v": 1}',
            "pending.7: 'x': a reason of 1 to 128 characters, a count 1 to 2**53-1",
        ),
    ],
)
def test_a_refused_file_is_named_by_its_rule(data: bytes, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        decode_pending(data)
    assert str(exc.value).startswith(message), str(exc.value)
    if not message.endswith(": "):
        assert str(exc.value) == message


def test_the_edges_of_each_rule_are_taken() -> None:
    padded = b'{"pending": {"0": {"x": 1}}, "v": 1}'
    assert decode_pending(padded + b" " * (64 * 1024 - len(padded))) == {0: {"x": 1}}  # 64 KiB exactly
    edges = {
        "pending": {
            **{str(u): {"x": 1} for u in range(63)},
            "4294967294": {"r" * 128: 2**53 - 1, **{f"r{i}": 1000 for i in range(31)}},
        },
        "v": 1,
    }
    kept = decode_pending(json.dumps(edges).encode())
    assert len(kept) == 64 and kept[4294967294]["r" * 128] == 2**53 - 1 and kept[4294967294]["r0"] == 1000


def test_a_symlink_in_place_of_the_file_is_not_followed(ctx: HelperContext, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b'{"pending": {"1": {"x": 1}}, "v": 1}')
    _pending_path(ctx).symlink_to(target)
    guards = Guards(ctx)
    try:
        assert guards._pending == {}
        assert _lines(ctx)[-1]["reason"] == "pending-unreadable" and target.exists()
    finally:
        guards.close()


def test_a_fifo_in_place_of_the_file_neither_blocks_the_start_nor_is_read(ctx: HelperContext) -> None:
    os.mkfifo(_pending_path(ctx), 0o600)
    guards = Guards(ctx)  # opened O_NONBLOCK: a FIFO without a writer would hold the start forever
    try:
        line = _lines(ctx)[-1]
        assert line["reason"] == "pending-unreadable" and not _pending_path(ctx).exists()
        assert line["args_sha256"] == hashlib.sha256(b"(not a regular file)").hexdigest()
    finally:
        guards.close()


def test_a_save_after_a_crash_mid_save_and_a_removal_of_nothing_both_work(ctx: HelperContext) -> None:
    directory = _pending_path(ctx).parent
    (directory / ".audit.pending.tmp").write_bytes(b"half")  # a crash between write and rename
    ctx.audit.save_pending(encode_pending({1: {"x": 1}}))
    assert decode_pending(_pending_path(ctx).read_bytes()) == {1: {"x": 1}}
    assert not (directory / ".audit.pending.tmp").exists()
    ctx.audit.save_pending(None)
    assert not _pending_path(ctx).exists()
    ctx.audit.save_pending(None)  # nothing there: nothing to do, no error
    assert ctx.audit.load_pending() is None


def test_the_file_is_bounded_in_uids_and_reasons_and_keeps_the_totals() -> None:
    pending = {uid: {"bad-request": uid + 1} for uid in range(MAX_PENDING_UIDS + 10)}
    kept = decode_pending(encode_pending(pending))
    assert len(kept) == MAX_PENDING_UIDS
    assert min(kept) == 10  # the uids with the most counts are the ones kept
    # Most counts first (a name last in order), then ties by name; an "(other reasons)" already
    # there (read back from an earlier file) is added to, not replaced.
    many = {f"r{i:02}": 1 for i in reversed(range(MAX_PENDING_REASONS + 5))} | {"zz-most": 100}
    many["(other reasons)"] = 7
    [reasons] = decode_pending(encode_pending({7: many})).values()
    assert len(reasons) == MAX_PENDING_REASONS and reasons["zz-most"] == 100
    assert sum(reasons.values()) == sum(many.values())  # the rest added up, not dropped
    assert [r for r in reasons if r.startswith("r")] == [f"r{i:02}" for i in range(MAX_PENDING_REASONS - 2)]
    assert reasons["(other reasons)"] == 7 + (MAX_PENDING_REASONS + 5) - (MAX_PENDING_REASONS - 2)
    also = {f"r{i:02}": 1 for i in range(MAX_PENDING_REASONS - 1)} | {"(other reasons)": 3}
    assert decode_pending(encode_pending({7: also})) == {7: also}  # 31 and the earlier rest: 32
    for over in (  # one past: 32 entries, never 33 (which the next helper would refuse to read)
        {f"r{i:02}": 1 for i in range(MAX_PENDING_REASONS + 1)},
        {f"r{i:02}": 1 for i in range(MAX_PENDING_REASONS)} | {"(other reasons)": 3},
    ):
        [folded] = decode_pending(encode_pending({7: over})).values()
        assert len(folded) == MAX_PENDING_REASONS and sum(folded.values()) == sum(over.values())
    exactly = {f"r{i:02}": 1 for i in range(MAX_PENDING_REASONS)}
    assert decode_pending(encode_pending({7: exactly})) == {7: exactly}  # 32: all kept, nothing folded
    assert decode_pending(encode_pending({0: {"a": 1}})) == {0: {"a": 1}}
    assert decode_pending(encode_pending({1: {"x" * 200: 5}})) == {1: {"x" * 128: 5}}
