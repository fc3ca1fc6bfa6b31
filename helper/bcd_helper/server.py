"""The helper's socket servers: peer check, framing, strict decoding, dispatch through OPS, audit.

- Two Unix stream sockets: the node's (mode 0660, root:<node group>) and root's own (mode 0600, root;
  `[helper] root_socket`), each with its own accept thread and listen backlog, so that no flood of the
  node's connects can keep root out (issue 9 item 7). Their directory is checked root-only.
- Every connection: SO_PEERCRED is read once; the node's socket serves root and the configured node
  uid, root's socket only root; anyone else is refused (audited) and the connection closed.
- Reads go through recvmsg with room for ancillary data: any SCM_RIGHTS descriptor that arrives is
  closed at once, the request refused and the connection closed (the helper hands descriptors
  out, never takes them in). Truncated ancillary data is treated the same way.
- Frames: 4-byte big-endian length, at most MAX_FRAME; a larger one closes the connection. Once a
  frame's first byte has arrived, the whole frame must arrive within FRAME_TIMEOUT_S (however slowly
  it trickles), and an answer must be taken within FRAME_TIMEOUT_S; else the connection is closed
  (a slow-loris client holds one thread for seconds, not for the 15-minute idle timeout). A usual
  answer is one write(2) on the socket, whose descriptor is non-blocking once it has a timeout; what
  does not fit goes through sendall under FRAME_TIMEOUT_S. The timeout is set only when it changes
  (each settimeout is a syscall), so a connection between requests costs none.
- Memory (issue 9 item 3): a frame's body is read only once its cost (frame_cost: its bytes three
  times over, for the buffer, the decoded text and the decoded strings, plus VALUE_COST per value it
  may hold) fits the process-wide in-flight budget (BUDGET bytes, shared by all the node's
  connections; root's own frames are not counted). A frame that cannot get it within its deadline is
  refused `busy`. The body is read into one buffer of its announced size, and a frame holding more
  than MAX_VALUES values is refused before it is decoded (protocol.count_values). An op whose answer
  may be large (audit.tail) takes its share of the same budget through `Call.reserve` before it builds
  it, held until the answer is sent (round 5); an answer is sent from its encoded frame alone.
- At most MAX_CONNECTIONS connections of non-root peers at once (each is a thread): one more is
  answered `busy` without blocking (a non-blocking send, no audit write on the accept thread: the
  refusal is counted and the count audited by the flusher thread) and closed.
- Audit lines are bounded (issue 9 item 5): a shown argument whose JSON is longer than MAX_SHOWN
  bytes, integers beyond 64 bits included, is recorded as its size and SHA-256 (args_sha256 pins the
  whole request anyway: the SHA-256 of the frame's body exactly as received, never re-encoded), and
  messages are cut to MAX_TEXT characters and MAX_TEXT_BYTES of JSON.
  Refusals of a non-root peer are rate-limited per uid (a bucket of REFUSAL_BURST, refilled at
  REFUSAL_RATE a second): past it a refusal is still answered, and counted; the counts are audited as
  one `(suppressed)` line per peer (args: count and reasons) at most every FLUSH_S. While the audit
  log holds as many unexported files as it may (AuditLog.full), the node's requests other than
  `audit.head` are refused `audit-full`, counted the same way, and its `audit.head`s are answered and
  counted the same way (no line each: the files the age rule keeps must not grow); every other refusal
  of a non-root peer (a bad shape or frame, refused before that check) is counted too, and the
  `(suppressed)` lines wait until the log has room (round 11); root is always served and audited.
- Each request is decoded into its op's frozen type (protocol.structure), run under the op's
  locks and deadline, answered, and recorded in the audit log, accepted or refused, before the
  answer is sent. A request's optional `trace` (the W3C trace context of the command the node is
  handling) is decoded strictly (protocol.decode_trace) and its ids go on each of its lines. A
  file.write's `accepted` line goes ahead of its effect (call.ahead, `_Ahead`): the connection's worker
  thread writes and fsyncs it while the file is fsynced; the answer waits for
  both, and an effect that fails after it is a second line (docs/helper.md "Audit log").
- After an answer, a connection polls its socket for the next request for NEXT_REQUEST_SPIN_NS before
  the read that sleeps (a node's requests come back to back while it converges); one connection at a
  time (Guards.spinner), none before its first request (docs/helper.md "Round 11").
- One thread per connection (the standard library's socketserver threading mix-in), so a
  30-minute host.unit never blocks a file.write on another connection. Per-connection state lives
  in a `Connection` object; process-wide state in the HelperContext and the server's `Guards`.
"""

from __future__ import annotations

import array
import contextlib
import errno
import grp
import hashlib
import json
import os
import re
import select
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from bcd_helper.audit import MAX_PENDING, canonical
from bcd_helper.ops.base import BoundedSystem, Call, Deadline, Failed, HelperContext, Peer, Refused
from bcd_helper.ops.table import LOCK_ORDER, OPS, OpSpec
from bcd_helper.protocol import (
    MAX_FRAME,
    MAX_VALUES,
    DecodeError,
    ProtocolError,
    decode_body,
    decode_trace,
    encode_frame,
    structure,
)

IDLE_TIMEOUT_S = 15 * 60.0
FRAME_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
MAX_SHOWN = 1024
MAX_TEXT = 2000
MAX_TEXT_BYTES = 4096
BUDGET = 24 * 1024 * 1024
VALUE_COST = 200  # bytes a decoded value may take (an empty list is 56, a one-key dict ~230 with its key)
REFUSAL_BURST = 100
REFUSAL_RATE = 10.0
FLUSH_S = 1.0
CLOSE_WAIT_S = 5.0  # how long closing the guards waits for a flusher stuck in an audit write
READ_AHEAD = 1 << 16
# How long a connection polls for its next request after an answer, before it sleeps (_await_next).
NEXT_REQUEST_SPIN_NS = 300_000
_LEN = struct.Struct(">I")
_FD_SPACE = socket.CMSG_SPACE(16 * 4)


SHAPE = 'a request is exactly {"op": <string>, "args": <object>}, and optionally "trace": <traceparent>'
EOF = object()  # read_request's answer at a clean end of stream (a JSON null is a request)


class Busy(ProtocolError):
    """The frame could not get its share of the in-flight budget in time."""


_UCRED = struct.Struct("iII")  # struct ucred: pid_t (signed), uid_t and gid_t (unsigned 32-bit)


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid, uid, gid)


# getsockopt(SOL_SOCKET, SO_PEERPIDFD): a pidfd of the process that connected (Linux 6.5; Python 3.12's
# socket module has no name for it).
SO_PEERPIDFD = 77


def peer_pidfd(sock: socket.socket) -> int | None:
    """A new pidfd (close it) of the process that connected `sock`: the same process SO_PEERCRED's pid
    named at connect, whatever holds that pid now. A pidfd of a process that has exited polls readable
    (Linux 6.16 and later give one even once it is reaped). None where the kernel has no SO_PEERPIDFD
    (ENOPROTOOPT: before 6.5); any other OSError is raised (a kernel before 6.16 refuses it, ESRCH or
    EINVAL, for a peer already reaped)."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:
            return None
        raise


def frame_cost(n: int) -> int:
    return 3 * n + VALUE_COST * min(n, MAX_VALUES)


class Budget:
    """The process-wide bytes that frames being read, decoded and served may take."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, deadline: float) -> bool:
        n = min(n, self.total)
        with self._cond:
            while self.used + n > self.total:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self.used += n
            return True

    def release(self, n: int) -> None:
        n = min(n, self.total)
        with self._cond:
            self.used -= n
            self._cond.notify_all()


MAX_PENDING_UIDS = 64
MAX_PENDING_REASONS = 32
_OTHER_REASONS = "(other reasons)"


def encode_pending(pending: Mapping[int, Mapping[str, int]]) -> bytes:
    """audit.pending's bytes: canonical JSON `{"pending": {"<uid>": {"<reason>": n}}, "v": 1}`, at most
    MAX_PENDING_UIDS uids (those with the most counts) and MAX_PENDING_REASONS reasons each (the rest
    added up under "(other reasons)")."""
    out: dict[str, dict[str, int]] = {}
    for uid, reasons in sorted(pending.items(), key=lambda kv: -sum(kv[1].values()))[:MAX_PENDING_UIDS]:
        other = reasons.get(_OTHER_REASONS, 0)  # read back from an earlier file
        ranked = sorted(
            ((r, n) for r, n in reasons.items() if r != _OTHER_REASONS), key=lambda kv: (-kv[1], kv[0])
        )
        room = MAX_PENDING_REASONS - (1 if other or len(ranked) > MAX_PENDING_REASONS else 0)
        kept = dict(ranked[:room])
        rest = other + sum(n for _r, n in ranked[room:])
        if rest:
            kept[_OTHER_REASONS] = rest
        out[str(uid)] = {r[:128]: n for r, n in kept.items()}
    return canonical({"pending": out, "v": 1})


def decode_pending(data: bytes) -> dict[int, dict[str, int]]:
    """audit.pending read back strictly; ValueError naming what is wrong."""
    if len(data) > MAX_PENDING:
        raise ValueError(f"more than {MAX_PENDING} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"pending", "v"} or doc["v"] != 1:
        raise ValueError('not {"pending": ..., "v": 1}')
    pending = doc["pending"]
    if not isinstance(pending, dict) or len(pending) > MAX_PENDING_UIDS:
        raise ValueError(f"pending: an object of at most {MAX_PENDING_UIDS} uids")
    out: dict[int, dict[str, int]] = {}
    for key, reasons in pending.items():
        if not re.fullmatch(r"0|[1-9][0-9]{0,9}", key) or int(key) > 0xFFFFFFFE:
            raise ValueError(f"pending: {key[:20]!r} is not a uid")
        if not isinstance(reasons, dict) or not 1 <= len(reasons) <= MAX_PENDING_REASONS:
            raise ValueError(f"pending.{key}: an object of 1 to {MAX_PENDING_REASONS} reasons")
        for reason, n in reasons.items():
            if not 1 <= len(reason) <= 128 or type(n) is not int or not 1 <= n < 2**53:
                raise ValueError(
                    f"pending.{key}: {reason[:40]!r}: a reason of 1 to 128 characters, a count 1 to 2**53-1"
                )
        out[int(key)] = dict(reasons)
    return out


class Guards:
    """Process-wide limits shared by both sockets: the in-flight budget, the per-peer refusal rate and the
    counts of refusals not audited one by one, which the flusher thread writes as `(suppressed)` lines."""

    def __init__(self, ctx: HelperContext) -> None:
        self.ctx = ctx
        self.budget = Budget(BUDGET)
        self._lock = threading.Lock()
        self._tokens: dict[int, tuple[float, float]] = {}  # uid -> (tokens, when)
        self._pending: dict[int, dict[str, int]] = {}
        # While the log is full the counts are also kept in audit.pending, so that a helper killed
        # then does not lose them (round 11's "not closed"): counted, saved, whether the file is there.
        self._counted = self._saved = 0
        self._on_disk = False
        self._restore()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flusher, name="audit-flusher", daemon=True)
        self._thread.start()
        self.spinner = threading.Lock()  # held by the one connection polling for its next request

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CLOSE_WAIT_S)
        self.flush(force=True)

    def allow_refusal(self, uid: int) -> bool:
        """Take a token for one audited refusal of `uid` (root is never limited)."""
        if uid == 0:
            return True
        now = time.monotonic()
        with self._lock:
            tokens, when = self._tokens.get(uid, (float(REFUSAL_BURST), now))
            tokens = min(float(REFUSAL_BURST), tokens + (now - when) * REFUSAL_RATE)
            if tokens < 1.0:
                self._tokens[uid] = (tokens, now)
                return False
            self._tokens[uid] = (tokens - 1.0, now)
            return True

    def count(self, uid: int, reason: str) -> None:
        """A refusal answered but not audited on its own line (no I/O: safe on the accept thread)."""
        with self._lock:
            reasons = self._pending.setdefault(uid, {})
            reasons[reason] = reasons.get(reason, 0) + 1
            self._counted += 1

    def _restore(self) -> None:
        """The counts an earlier helper left in audit.pending (it stopped while the log was full), added
        to this one's; an unreadable file gets a line of its own saying so, and is removed."""
        try:
            data = self.ctx.audit.load_pending()
        except OSError as exc:
            data = f"(unreadable: {exc.strerror})".encode()
        if data is None:
            return
        try:
            restored = decode_pending(data)
        except ValueError as exc:
            self.ctx.audit.record(
                peer_pid=0,
                peer_uid=0,
                op="(suppressed)",
                args={},
                args_sha256=hashlib.sha256(data).hexdigest(),
                decision="refused",
                reason="pending-unreadable",
                message=f"audit.pending of an earlier run not read, its counts lost: {str(exc)[:200]}",
                duration_ms=0.0,
            )
            self.ctx.audit.save_pending(None)
            return
        for uid, reasons in restored.items():
            mine = self._pending.setdefault(uid, {})
            for reason, n in reasons.items():
                mine[reason] = mine.get(reason, 0) + n
        self._on_disk = True

    def _save(self) -> None:
        """While the log is full: the counts into audit.pending when they changed since the last save."""
        with self._lock:
            if self._counted == self._saved or not self._pending:
                return
            counted, data = self._counted, encode_pending(self._pending)
        self.ctx.audit.save_pending(data)
        self._saved, self._on_disk = counted, True

    def flush(self, force: bool = False) -> None:
        """The counts as `(suppressed)` lines. While the audit log is full they wait (kept, counting on,
        and saved in audit.pending) until it has room, or the helper stops (`force`): else a line a
        second would grow the files past their bound for as long as the node keeps it full (round 11).
        audit.pending goes once the lines are written (a crash between the two writes them twice)."""
        if not force and self.ctx.audit.full:
            self._save()
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        self._write(pending)
        if self._on_disk:
            self.ctx.audit.save_pending(None)
            self._on_disk = False

    def _write(self, pending: dict[int, dict[str, int]]) -> None:
        for uid, reasons in sorted(pending.items()):
            args = {"count": sum(reasons.values()), "reasons": dict(sorted(reasons.items())[:32])}
            self.ctx.audit.record(
                peer_pid=0,
                peer_uid=uid,
                op="(suppressed)",
                args=args,
                args_sha256=hashlib.sha256(canonical(args)).hexdigest(),
                decision="refused",
                reason="rate-limit",
                message=f"{args['count']} refusals of uid {uid} answered without a line of their own"
                if "audit.head (log full)" not in reasons
                else f"{args['count']} requests of uid {uid} answered without a line of their own",
                duration_ms=0.0,
            )

    def _flusher(self) -> None:
        while not self._stop.wait(FLUSH_S):
            with contextlib.suppress(Exception):  # an audit write error must not end the flusher
                self.flush()


class _Worker:
    """A connection's second thread, for the audit line written ahead of a file.write's effect: it encodes,
    seals, appends and fsyncs the line while the connection's thread writes and fsyncs the file and its
    directory (docs/helper.md "Audit log"). Started on the connection's first such request and ended with
    the connection: no thread per request. Two plain locks hand a job over and its end back."""

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._job: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="audit-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            job = self._job
            if job is None:
                return
            try:
                job()
            except BaseException as exc:  # handed to the connection's thread by `result`
                self._error = exc
            self._done.release()

    def submit(self, job: Callable[[], None]) -> None:
        self._job, self._error = job, None
        self._go.release()

    def result(self) -> None:
        """Wait for the job; raise what it raised."""
        self._done.acquire()
        error, self._job, self._error = self._error, None, None
        if error is not None:
            raise error

    def close(self) -> None:
        self._job = None
        self._go.release()
        self._thread.join(timeout=5)


class _Ahead:
    """call.ahead of one request (ops.base.AuditAhead): its `accepted` line, written by the connection's
    worker from `start` on; `wait` returns once the line is fsynced. `started`: the line was handed over
    (the request's outcome, when not accepted, is then a second line); `failed`: the line could not be
    made durable (no answer is sent: the connection is closed, as when any audit write fails)."""

    __slots__ = ("args", "conn", "failed", "op", "spec", "started", "t0", "trace")

    def __init__(
        self, conn: Connection, op: str, args: Any, spec: OpSpec, t0: float, trace: tuple[str, str] | None
    ) -> None:
        self.conn, self.op, self.args, self.spec, self.t0 = conn, op, args, spec, t0
        self.trace = trace
        self.started = False
        self.failed = False

    def start(self) -> None:
        conn, duration = self.conn, (time.monotonic() - self.t0) * 1000
        op, args, spec, t0, trace = self.op, self.args, self.spec, self.t0, self.trace

        def job() -> None:
            conn.audit(op, args, spec, "accepted", "", "", t0, duration, trace)

        conn.worker().submit(job)
        self.started = True

    def wait(self) -> None:
        try:
            self.conn.worker().result()
        except BaseException:
            self.failed = True
            raise


class Connection:
    """One client connection: its peer, its socket and what it has sent so far."""

    def __init__(
        self, ctx: HelperContext, sock: socket.socket, guards: Guards, uids: tuple[int, ...] | None = None
    ) -> None:
        self.ctx = ctx
        self.sock = sock
        self.guards = guards
        self.uids = (0, ctx.config.node_uid) if uids is None else uids
        self.peer = peer_credentials(sock)
        self.buffer = bytearray()  # read ahead of the next frame (at most READ_AHEAD bytes)
        self._chunk: memoryview | None = None  # what each read of the frame's head goes into
        self.requests = 0
        self.reserved = 0
        self.frame_deadline: float | None = None  # set while a frame is partly read
        self._worker: _Worker | None = None
        self._poll: select.poll | None = None  # the socket's poll object for _await_next, made on first use
        self._timeout: float | None = None  # the socket's timeout as last set here (settimeout is a syscall)
        # The body of the frame being served, as received, until its answer is sent: its audit lines'
        # args_sha256 is its SHA-256 (signed bytes are never re-encoded: what is hashed is what came),
        # worked out where the line is written. None when no body has been read whole.
        self.body: bytes | bytearray | None = None

    def peer_pidfd(self) -> int | None:
        return peer_pidfd(self.sock)

    def worker(self) -> _Worker:
        if self._worker is None:
            self._worker = _Worker()
        return self._worker

    # --- framing with ancillary-data refusal --------------------------------------------------

    def _recv_into(self, view: memoryview) -> int:
        n, ancdata, flags, _addr = self.sock.recvmsg_into([view], _FD_SPACE)
        passed = False
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                passed = True
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            else:
                passed = True
        if passed or flags & socket.MSG_CTRUNC:
            raise ProtocolError("file descriptors or other ancillary data were sent: the helper takes none")
        return n

    def _settimeout(self, seconds: float) -> None:
        if seconds != self._timeout:
            self.sock.settimeout(seconds)
            self._timeout = seconds

    def _wait_left(self) -> None:
        if self.frame_deadline is None:
            self._settimeout(IDLE_TIMEOUT_S)
            return
        left = self.frame_deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"frame not complete within {FRAME_TIMEOUT_S:.0f} s")
        self._settimeout(left)

    def _recv_some(self, view: memoryview) -> int:
        self._wait_left()
        try:
            k = self._recv_into(view)
        except TimeoutError:
            if self.frame_deadline is None:
                raise
            raise ProtocolError(f"frame not complete within {FRAME_TIMEOUT_S:.0f} s") from None
        if k and self.frame_deadline is None:
            self.frame_deadline = time.monotonic() + FRAME_TIMEOUT_S
        return k

    def _await_next(self) -> None:
        """Poll for the next request for up to NEXT_REQUEST_SPIN_NS before the read that sleeps. A node sends
        its requests back to back while it converges (holds, env files, slices), the next one arriving
        within ~0.2 ms of the last answer; a sleep and its wake-up cost tens of microseconds on a VM
        without halt polling and leave the caches cold (docs/helper.md "Round 11"). One connection polls at
        a time (Guards.spinner; the others sleep at once), so a flood of connections burns one thread's
        worth of polling at most, ~0.3 ms after each answer. Each poll(2) lets the interpreter lock go."""
        if self.buffer or not self.guards.spinner.acquire(blocking=False):
            return
        try:
            poll = self._poll
            if poll is None:
                poll = self._poll = select.poll()
                poll.register(self.sock.fileno(), select.POLLIN)
            end = time.monotonic_ns() + NEXT_REQUEST_SPIN_NS
            while not poll.poll(0) and time.monotonic_ns() < end:
                pass
        finally:
            self.guards.spinner.release()

    def _fill_head(self) -> bool:
        """At least the 4-byte length in self.buffer (read READ_AHEAD bytes at a time, so a small frame
        comes in one call); False on a clean end of stream before a frame's first byte."""
        while len(self.buffer) < 4:
            if self.buffer and self.frame_deadline is None:
                self.frame_deadline = time.monotonic() + FRAME_TIMEOUT_S
            if self._chunk is None:  # one per connection: not 64 KiB allocated, zeroed and freed a frame
                self._chunk = memoryview(bytearray(READ_AHEAD))
            k = self._recv_some(self._chunk)
            if k == 0:
                if self.buffer:
                    raise ProtocolError("connection closed mid-frame")
                return False
            self.buffer += self._chunk[:k]
        return True

    def read_request(self) -> Any:
        """The next decoded JSON document, or EOF at a clean end of stream. The frame's budget stays
        reserved (self.reserved) until `release`."""
        self.body = None
        if not self._fill_head():
            return EOF
        if self.frame_deadline is None:
            self.frame_deadline = time.monotonic() + FRAME_TIMEOUT_S
        (n,) = _LEN.unpack(self.buffer[:4])
        if n > MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        if self.peer.uid != 0:
            cost = frame_cost(n)
            if not self.guards.budget.acquire(cost, self.frame_deadline):
                raise Busy("the helper is busy with other large frames: try again later")
            self.reserved = cost
        # The body goes into one buffer of its announced size: what was read ahead, then the rest.
        ahead = min(n, len(self.buffer) - 4)
        body = bytearray(n)
        body[:ahead] = self.buffer[4 : 4 + ahead]
        del self.buffer[: 4 + ahead]
        view = memoryview(body)
        got = ahead
        while got < n:
            k = self._recv_some(view[got:])
            if k == 0:
                raise ProtocolError("connection closed mid-frame")
            got += k
        del view
        self.frame_deadline = None
        self.body = body
        return decode_body(body)

    def release(self) -> None:
        self.body = None
        if self.reserved:
            self.guards.budget.release(self.reserved)
            self.reserved = 0

    def send(self, doc: Any, fd: int | None = None) -> None:
        self.send_frame(encode_frame(doc), fd)

    def reserve_answer(self, n: int) -> bool:
        """Call.reserve: `n` more bytes of the in-flight budget for an answer being built, held until it is
        sent (a client that does not read keeps them up to FRAME_TIMEOUT_S); False when the budget has no
        room at once. Root's answers are not counted."""
        if self.peer.uid == 0:
            return True
        if not self.guards.budget.acquire(n, time.monotonic()):
            return False
        self.reserved += n
        return True

    def send_frame(self, frame: bytes, fd: int | None = None) -> None:
        if fd is None:
            sent = 0
            if self._timeout is not None:
                # The socket has a timeout (set here, always above 0), so its descriptor is non-blocking: one
                # write(2) takes a usual answer whole (sendall under a timeout costs a settimeout, a poll and
                # the send).
                with contextlib.suppress(BlockingIOError):
                    sent = os.write(self.sock.fileno(), frame)
            if sent < len(frame):  # the rest within FRAME_TIMEOUT_S, as a whole answer otherwise
                self._settimeout(FRAME_TIMEOUT_S)
                self.sock.sendall(frame[sent:])
            return
        self._settimeout(FRAME_TIMEOUT_S)
        # A descriptor the op hands back (libvirt.console) rides with the frame's first byte.
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        sent = self.sock.sendmsg([frame], rights)
        if sent < len(frame):
            self.sock.sendall(frame[sent:])

    # --- serving ----------------------------------------------------------------------------------

    def audit(
        self,
        op: str,
        args: Any,
        spec: OpSpec | None,
        decision: str,
        reason: str,
        message: str,
        t0: float,
        duration_ms: float | None = None,
        trace: tuple[str, str] | None = None,
    ) -> None:
        """One audit line for the request; `trace`: the (trace id, parent id) it carried, if any. A refusal
        of a non-root peer is counted instead, past its rate or while the log is full (round 11: else
        the refusals before the full check, a bad shape or frame, grew the files past their bound)."""
        if (
            decision == "refused"
            and self.peer.uid != 0
            and (self.ctx.audit.full or not self.guards.allow_refusal(self.peer.uid))
        ):
            self.guards.count(self.peer.uid, reason)
            return
        shown: dict[str, Any] = {}
        if isinstance(args, dict) and spec is not None:
            shown = {k: _bounded(args[k]) for k in spec.shown if k in args}
        if self.body is not None:
            digest = hashlib.sha256(self.body).hexdigest()
        else:  # no frame body (a refused connection, a frame refused before its body was read whole)
            try:
                digest = hashlib.sha256(canonical({"op": op, "args": args})).hexdigest()
            except ValueError:  # an integer past Python's 4300 digits cannot be printed
                digest = "0" * 64
        self.ctx.audit.record(
            peer_pid=self.peer.pid,
            peer_uid=self.peer.uid,
            op=_cut(op, 100),
            args=shown,
            args_sha256=digest,
            decision=decision,
            reason=reason,
            message=_cut(message, MAX_TEXT),
            duration_ms=(time.monotonic() - t0) * 1000 if duration_ms is None else duration_ms,
            trace=trace,
        )

    def answer(self, doc: Any) -> dict[str, Any]:
        """Serve one request document; returns the answer (already audited)."""
        t0 = time.monotonic()
        op, args = "?", None
        spec: OpSpec | None = None
        ahead: _Ahead | None = None
        trace: tuple[str, str] | None = None
        full = False
        try:
            if (
                not isinstance(doc, dict)
                or "op" not in doc
                or "args" not in doc
                or len(doc) != 2 + ("trace" in doc)
            ):
                raise Refused("bad-request", SHAPE)
            op, args = doc["op"], doc["args"]
            if not isinstance(op, str):
                op = "?"
                raise Refused("bad-request", "$.op: expected string")
            if len(doc) == 3:
                try:
                    trace = decode_trace(doc["trace"])
                except DecodeError as exc:
                    raise Refused("bad-request", f"{op[:100]}: {exc}") from None
            full = self.peer.uid != 0 and self.ctx.audit.full
            if full and op != "audit.head":
                self.guards.count(self.peer.uid, "audit-full")
                message = "the audit log holds all the unexported files it may: read audit.head first"
                return {"ok": False, "error": "refused", "reason": "audit-full", "message": message}
            spec = OPS.get(op)
            if spec is None:
                raise Refused("unknown-op", f"unknown operation {op[:100]!r}")
            try:
                req = structure(args, spec.request)
            except DecodeError as exc:
                raise Refused("bad-arguments", f"{op}: {exc}") from None
            deadline = Deadline(spec.timeout_s)
            ahead = _Ahead(self, op, args, spec, t0, trace)
            system = BoundedSystem(self.ctx.system, deadline)
            call = Call(self.ctx, self.peer, deadline, system, ahead, self.reserve_answer, self.peer_pidfd)
            held = self._acquire(spec, deadline)
            try:
                result = spec.handler(call, req)
            finally:
                for lock in reversed(held):
                    lock.release()
        except Refused as exc:
            self.audit(op, args, spec, "refused", exc.reason, _after(ahead, exc.message), t0, trace=trace)
            return {"ok": False, "error": "refused", "reason": exc.reason, "message": exc.message[:MAX_TEXT]}
        except Failed as exc:
            self.audit(op, args, spec, "failed", exc.reason, _after(ahead, exc.message), t0, trace=trace)
            return {"ok": False, "error": "failed", "reason": exc.reason, "message": exc.message[:MAX_TEXT]}
        except Exception as exc:  # a bug or an unexpected host error: failed, never silent
            if ahead is not None and ahead.failed:
                raise  # the audit line could not be written: no answer (as below when the audit fails)
            message = f"{op[:100]}: {type(exc).__name__}: {exc}"[:MAX_TEXT]
            self.audit(op, args, spec, "failed", "internal", _after(ahead, message), t0, trace=trace)
            return {"ok": False, "error": "failed", "reason": "internal", "message": message}
        if full:
            # The log is full: the node's way out (audit.head) is answered and counted, not a line each, or a
            # flood of heads would grow files the age rule keeps (docs/helper.md, round 5, row 1).
            self.guards.count(self.peer.uid, "audit.head (log full)")
        elif ahead is None or not ahead.started:
            self.audit(op, args, spec, "accepted", "", "", t0, trace=trace)
        return {"ok": True, "result": result}

    def _acquire(self, spec: OpSpec, deadline: Deadline) -> list[threading.Lock]:
        """The op's locks, taken in LOCK_ORDER; the caller releases them (in reverse). A lock not had in
        time refuses the request `busy`, releasing those already taken."""
        held: list[threading.Lock] = []
        try:
            for name in LOCK_ORDER:
                if name not in spec.locks:
                    continue
                lock = self.ctx.locks[name]
                if "nowait" in spec.flags:
                    ok = lock.acquire(blocking=False)
                else:
                    ok = lock.acquire(timeout=max(deadline.remaining(), 0.001))
                if not ok:
                    raise Refused("busy", f"another operation holds the helper's {name} lock")
                held.append(lock)
        except BaseException:
            for lock in reversed(held):
                lock.release()
            raise
        return held

    def serve(self) -> None:
        try:
            self._serve()
        finally:
            self.release()
            if self._worker is not None:
                self._worker.close()

    def _serve(self) -> None:
        if self.peer.uid not in self.uids:
            t0 = time.monotonic()
            who = " and ".join(f"uid {u}" if u else "root" for u in self.uids)
            message = f"uid {self.peer.uid} may not use this socket (only {who})"
            self.audit("(connect)", None, None, "refused", "peer", message, t0)
            with contextlib.suppress(OSError):
                self.send({"ok": False, "error": "refused", "reason": "peer", "message": message})
            return
        while True:
            if self.requests:
                self._await_next()
            t0 = time.monotonic()
            try:
                doc = self.read_request()
            except (ProtocolError, TimeoutError, ConnectionError) as exc:
                if not isinstance(exc, ConnectionError | TimeoutError):
                    reason = "busy" if isinstance(exc, Busy) else "protocol"
                    self.audit("(frame)", None, None, "refused", reason, str(exc), t0)
                    with contextlib.suppress(OSError):
                        self.send({"ok": False, "error": "refused", "reason": reason, "message": str(exc)})
                return
            if doc is EOF:
                return
            self.requests += 1
            reply = self.answer(doc)
            del doc
            result = reply.get("result")
            fd = result.pop("_fd", None) if isinstance(result, dict) else None
            try:
                # Encoded, then the answer's objects let go: a client that reads slowly holds the frame only.
                frame = encode_frame(reply)
                del reply, result
                self.send_frame(frame, fd)
            except OSError:
                return
            finally:
                self.release()
                if fd is not None:
                    os.close(fd)


def _after(ahead: _Ahead | None, message: str) -> str:
    """The message of a request's outcome line written after its `accepted` line went ahead."""
    if ahead is None or not ahead.started:
        return message
    return f"after its accepted line, the effect did not complete: {message}"


# audit.canonical's encoding, refusing what is not a JSON number: `1e309` is a JSON number that Python
# reads as inf, which canonical writes as `Infinity`, a line no strict JSON reader takes (round 11, row 2).
_FINITE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _bounded(value: Any) -> Any:
    """A shown argument as sent, or its size and digest when its JSON is longer than MAX_SHOWN bytes.
    Integers are shown only within 64 bits (a 4,299-digit one would make a 4 KiB line); a float past a
    double's range (inf, from `1e309`), alone or inside a list or object, as `bytes: -1` and a digest."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() <= 64:
            return value
        text = str(value).encode()
        return {"bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()}
    if isinstance(value, str) and len(value) <= MAX_SHOWN // 12:
        return value  # short enough whatever its escapes (at most 12 bytes a character)
    try:
        data = _FINITE.encode(value).encode()  # canonical's bytes, or ValueError
    except ValueError:  # holds an integer past Python's printable digits, or a number past a double
        data = repr(type(value)).encode() + b" too large"
        return {"bytes": -1, "sha256": hashlib.sha256(data).hexdigest()}
    if len(data) <= MAX_SHOWN:
        return value
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _cut(text: str, limit: int) -> str:
    """At most `limit` characters, whose JSON (escaped ASCII) is at most MAX_TEXT_BYTES bytes."""
    text = text[:limit]
    if len(text) * 12 + 2 <= MAX_TEXT_BYTES:  # JSON escapes a character to at most 12 bytes (a pair)
        return text
    while len(json.dumps(text)) > MAX_TEXT_BYTES:
        text = text[: len(text) * 3 // 4]
    return text


class _Handler(socketserver.BaseRequestHandler):
    server: HelperServer | RootServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        with contextlib.suppress(OSError):
            Connection(self.server.ctx, sock, self.server.guards, self.server.uids).serve()


def _bind(server: socketserver.UnixStreamServer, path: str, gid: int, mode: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old = os.umask(0o177)
    try:
        server.server_bind()
        server.server_activate()
    finally:
        os.umask(old)
    os.chown(path, 0, gid)
    os.chmod(path, mode)


class HelperServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The node's socket (root may use it too)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, ctx: HelperContext, real_socket_path: str, guards: Guards | None = None) -> None:
        self.ctx = ctx
        self.guards = guards or Guards(ctx)
        self.uids: tuple[int, ...] | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(real_socket_path, _Handler, bind_and_activate=False)
        try:
            _bind(self, real_socket_path, ctx.config.node_gid, 0o660)
        except BaseException:
            self.server_close()
            raise

    # A connection of a non-root peer holds one of MAX_CONNECTIONS slots while its thread runs.

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            peer = peer_credentials(request)
        except OSError:
            self.shutdown_request(request)
            return
        counted = peer.uid != 0
        if counted and not self._slots.acquire(blocking=False):
            self._refuse_busy(request, peer)
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self._run, args=(request, client_address, counted), daemon=self.daemon_threads
        )
        try:
            thread.start()
        except BaseException:
            if counted:
                self._slots.release()
            self.shutdown_request(request)
            raise

    def _run(self, request: Any, client_address: Any, counted: bool) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            if counted:
                self._slots.release()

    def _refuse_busy(self, request: socket.socket, peer: Peer) -> None:
        """On the accept thread: counted (audited later by the flusher), one non-blocking send."""
        self.guards.count(peer.uid, "busy")
        message = f"more than {MAX_CONNECTIONS} connections at once: try again later"
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(
                encode_frame({"ok": False, "error": "refused", "reason": "busy", "message": message})
            )


class RootServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Root's own socket: 0600 root, so the node can neither connect to it nor fill its backlog."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 64

    def __init__(self, ctx: HelperContext, real_socket_path: str, guards: Guards) -> None:
        self.ctx = ctx
        self.guards = guards
        self.uids: tuple[int, ...] | None = (0,)
        super().__init__(real_socket_path, _Handler, bind_and_activate=False)
        try:
            _bind(self, real_socket_path, 0, 0o600)
        except BaseException:
            self.server_close()
            raise


def node_group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
