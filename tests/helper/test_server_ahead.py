"""file.write's audit line written ahead of its effect (docs/helper.md "Audit log"): a real `Connection`
over a socket pair, the real file.write handler and audit log, in process.

The line is handed to the connection's worker thread once every check has passed and before anything is
written, so its fsync overlaps the file's; the answer waits for both. What is checked here: the line is
written while the file is being written (not after), exactly one line per accepted write, a refusal
before the effect writes no `accepted` line, an effect that fails after its line is a second line naming
it, a line that cannot be written gets no answer, one worker per connection, ended with it; the line's
duration is the time from the request's start to the hand-over (not to the worker's write); closing a
worker whose line hangs waits a bounded 5 s, and the worker, a daemon thread, never keeps the helper's
process from exiting."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from bcd_helper import server
from bcd_helper.audit import AuditLog, verify_chain
from bcd_helper.config import parse_config
from bcd_helper.ops.base import HelperContext
from bcd_helper.ops.table import LOCK_ORDER
from bcd_helper.protocol import encode_frame, read_frame
from bcd_helper.server import Connection, Guards, _Worker
from bcd_shared import cdi

DIR = "/var/log/bcd-helper"
ALLOC = "a_1"
GPU = "GPU-5f1c2a90-0000-4000-8000-000000000001"


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[HelperContext]:
    root = tmp_path / "host"
    root.mkdir(mode=0o755)
    config = parse_config(b'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = 4242\n')
    from bcd_shared.system import LocalSystem

    audit = AuditLog(root, DIR, syslog=False)
    c = HelperContext(root=root, config=config, system=LocalSystem(root), audit=audit, lock_names=LOCK_ORDER)
    yield c
    audit.close()


@pytest.fixture
def conn(ctx: HelperContext) -> Iterator[Connection]:
    guards = Guards(ctx)
    a, b = socket.socketpair()
    with a, b:
        c = Connection(ctx, b, guards)
        yield c
        if c._worker is not None:
            c._worker.close()
    guards.close()


def hold(ident: str = ALLOC) -> str:
    doc = cdi.build_hold_spec(
        allocation_id=ident,
        reservation_id="r1",
        generation=1,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(GPU)],
        env=[f"BCD_ALLOCATION_ID={ident}"],
        vendor=None,
    )
    return cdi.encode_spec(doc).decode()


def write(ident: str = ALLOC, content: str | None = None) -> dict[str, Any]:
    return {"op": "file.write", "args": {"kind": "cdi", "id": ident, "content": content or hold(ident)}}


def lines(ctx: HelperContext) -> list[dict[str, Any]]:
    path = ctx.root / DIR.lstrip("/") / "audit.log"
    return [json.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def target(ctx: HelperContext, ident: str = ALLOC) -> Path:
    return ctx.root / "etc/cdi" / f"bcd-{ident}.json"


def ahead_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "audit-ahead")


def test_the_line_is_written_while_the_file_is_being_written_and_once(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename waits (up to 10 s) for the audit line to be appended: it is, since the line goes ahead of
    the write instead of after the answer is decided. One `accepted` line, and the chain verifies."""
    appended = threading.Event()
    record = ctx.audit.record

    def recording(**kw: Any) -> str:
        digest = record(**kw)
        appended.set()
        return digest

    monkeypatch.setattr(ctx.audit, "record", recording)
    real_rename = os.rename
    seen: list[bool] = []

    def rename(*a: Any, **kw: Any) -> None:
        seen.append(appended.wait(10))
        real_rename(*a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    got = conn.answer(write())
    assert got == {"ok": True, "result": {"path": f"/etc/cdi/bcd-{ALLOC}.json", "bytes": len(hold())}}
    assert seen == [True]
    assert target(ctx).read_text() == hold()
    monkeypatch.undo()
    assert conn.answer(write())["ok"] is True
    entries = lines(ctx)
    assert [(e["op"], e["decision"], e["args"]["id"]) for e in entries] == [
        ("file.write", "accepted", ALLOC),
        ("file.write", "accepted", ALLOC),
    ]
    # the line is the request's own: no reason or message, and the time from its start to the line
    assert [(e["reason"], e["message"]) for e in entries] == [("", ""), ("", "")]
    assert all(0 <= e["duration_ms"] < 10_000 for e in entries), entries
    assert verify_chain(ctx.root / DIR.lstrip("/")).ok


def test_a_refusal_before_the_effect_writes_no_accepted_line(ctx: HelperContext, conn: Connection) -> None:
    got = conn.answer(write(content=hold("other")))
    assert got["ok"] is False and got["reason"] == "bad-content"
    assert [(e["decision"], e["reason"]) for e in lines(ctx)] == [("refused", "bad-content")]
    assert not lines(ctx)[0]["message"].startswith("after its accepted line")
    assert conn._worker is None  # nothing went ahead: no worker started
    assert not target(ctx).exists()


def test_the_kinds_limits_refuse_before_the_line_goes_ahead(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bcd_helper.ops import files

    monkeypatch.setitem(
        files.LIMITS,
        "cdi",
        files.LIMITS["cdi"].__class__("/etc/cdi", files.LIMITS["cdi"].pattern, 0, 1 << 20, 1 << 20),
    )
    got = conn.answer(write())
    assert got["ok"] is False and got["reason"] == "too-many-files"
    assert [(e["decision"], e["reason"]) for e in lines(ctx)] == [("refused", "too-many-files")]
    assert conn._worker is None


def test_an_effect_failing_after_its_line_is_a_second_line_naming_it(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rename(*_a: Any, **_kw: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "rename", rename)
    got = conn.answer(write())
    assert got["ok"] is False and (got["error"], got["reason"]) == ("failed", "internal")
    assert "EIO" in got["message"] or "Input/output error" in got["message"]
    entries = lines(ctx)
    assert [(e["decision"], e["reason"]) for e in entries] == [("accepted", ""), ("failed", "internal")]
    assert entries[1]["message"].startswith(
        "after its accepted line, the effect did not complete: file.write"
    )
    assert entries[0]["args_sha256"] == entries[1]["args_sha256"]
    assert not target(ctx).exists()
    monkeypatch.undo()
    assert verify_chain(ctx.root / DIR.lstrip("/")).ok


def test_a_line_that_cannot_be_written_gets_no_answer(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**_kw: Any) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ctx.audit, "record", broken)
    with pytest.raises(OSError, match="No space left"):
        conn.answer(write())


def test_a_line_that_cannot_be_written_gets_no_answer_even_when_the_log_recovers_at_once(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The accepted line failing is what ends the request, not a second audit failure: with the log
    writable again for the outcome line, there is still no answer and no `failed` line."""
    record = ctx.audit.record
    calls: list[str] = []

    def once_broken(**kw: Any) -> str:
        calls.append(kw["decision"])
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return record(**kw)

    monkeypatch.setattr(ctx.audit, "record", once_broken)
    with pytest.raises(OSError, match="No space left"):
        conn.answer(write())
    assert calls == ["accepted"]
    assert lines(ctx) == []


def test_one_worker_per_connection_ended_with_it(ctx: HelperContext) -> None:
    before = ahead_threads()
    guards = Guards(ctx)
    a, b = socket.socketpair()
    try:
        c = Connection(ctx, b, guards)
        done = threading.Thread(target=c.serve)
        done.start()
        for _ in range(5):
            a.sendall(encode_frame(write()))
            assert read_frame(a)["ok"] is True
        assert ahead_threads() == before + 1
        a.shutdown(socket.SHUT_WR)
        done.join(10)
        assert not done.is_alive()
        assert ahead_threads() == before
    finally:
        a.close()
        b.close()
        guards.close()
    assert [e["decision"] for e in lines(ctx)] == ["accepted"] * 5


def test_the_accepted_lines_duration_is_taken_when_the_line_is_handed_over(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's clock is the test's: 0.125 s pass between the request's start and the line's
    hand-over to the worker, then 3 s before the worker writes it. The line says 125.0 ms: the duration
    in milliseconds up to the hand-over, not the time the worker took to get to it."""
    now = [100.0]
    monkeypatch.setattr(server, "time", SimpleNamespace(monotonic=lambda: now[0]))
    start, submit = server._Ahead.start, _Worker.submit

    def starting(self: server._Ahead) -> None:
        now[0] += 0.125  # the op's checks took 125 ms
        start(self)

    def submitting(self: _Worker, job: Any) -> None:
        now[0] += 3.0  # the worker gets to the line 3 s later
        submit(self, job)

    monkeypatch.setattr(server._Ahead, "start", starting)
    monkeypatch.setattr(_Worker, "submit", submitting)
    assert conn.answer(write())["ok"] is True
    assert [(e["decision"], e["duration_ms"]) for e in lines(ctx)] == [("accepted", 125.0)]


def test_closing_a_worker_whose_line_hangs_returns_after_its_5_s_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A line stuck in its write (a hung disk) does not hold the connection's end forever: `close` joins
    the worker for 5 s at most and returns with the job still blocked; the thread ends once the job
    does. The join is recorded (and cut short) rather than waited out. The thread left behind is a
    daemon."""
    w = _Worker()
    started, release = threading.Event(), threading.Event()

    def hanging() -> None:
        started.set()
        release.wait(30)

    w.submit(hanging)
    thread, joins = w._thread, []
    real_join = thread.join

    def join(timeout: float | None = None) -> None:
        joins.append(timeout)
        real_join(0.05)

    monkeypatch.setattr(thread, "join", join)
    try:
        assert started.wait(10)
        w.close()
        assert joins == [5]
        assert thread.is_alive()  # close returned; the job still hangs
        # left behind as a daemon thread, which lets the process exit (the child process below shows
        # it; mutation testing sees only what runs in this process)
        assert thread.daemon
    finally:
        release.set()
    real_join(10)
    assert not thread.is_alive()


def test_a_worker_whose_line_hangs_does_not_keep_the_process_from_exiting() -> None:
    """The helper exiting (its main thread done) with a connection's worker stuck in an audit write: a
    child Python opens a worker, hands it a job that never returns and ends. The worker is a daemon
    thread, so the child exits; a non-daemon worker would hold it at interpreter shutdown forever."""
    code = (
        "import threading\n"
        "from bcd_helper import server\n"
        "w = server._Worker()\n"
        "started = threading.Event()\n"
        "w.submit(lambda: (started.set(), threading.Event().wait()))\n"
        "assert started.wait(10)\n"
        "print(server.__file__, flush=True)\n"
    )
    # the child imports the same bcd_helper as this process (under mutation testing, the mutated one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child did not exit with its worker open: {exc.stdout!r}")
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, server.__file__, "")


def test_DLV_CMD_15_the_line_written_ahead_carries_the_requests_trace(
    ctx: HelperContext, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DLV-CMD-15: the `accepted` line a file.write writes ahead of its effect carries the trace id and
    parent id the request sent, and so does the second line of an effect that fails after it."""
    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    doc = {**write(), "trace": f"00-{trace}-{parent}-01"}
    assert conn.answer(doc)["ok"] is True
    e = lines(ctx)[-1]
    assert (e["op"], e["decision"], e["trace_id"], e["parent_id"]) == (
        "file.write",
        "accepted",
        trace,
        parent,
    )
    assert conn.answer(write())["ok"] is True
    assert "trace_id" not in lines(ctx)[-1]

    def rename(*_a: Any, **_kw: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "rename", rename)
    assert conn.answer(doc)["ok"] is False
    monkeypatch.undo()
    accepted, failed = lines(ctx)[-2:]
    assert [(e["decision"], e["trace_id"], e["parent_id"]) for e in (accepted, failed)] == [
        ("accepted", trace, parent),
        ("failed", trace, parent),
    ]
    assert verify_chain(ctx.root / DIR.lstrip("/")).ok
