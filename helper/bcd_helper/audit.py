"""The audit log: every request, accepted or refused, as one hash-chained, forward-secure sealed JSON line.

Rules (issue 4 item 6, issue 9 items 5 and 6; docs/helper.md "Audit log"):
- one line per request: `seq`, `time` (UTC, RFC 3339 with microseconds), `peer_pid`, `peer_uid`,
  `op`, `args` (the security-relevant arguments, as sent, each bounded by the server), `args_sha256`
  (SHA-256 of the request frame's body exactly as received, so what is not shown is still pinned; of the
  canonical JSON of {"op", "args"} for a line with no body read whole, and of the canonical `args` for
  the helper's own lines), `decision`
  (`accepted` | `refused` | `failed` | `anchor` | `repaired`), `reason`, `message`, `duration_ms`, `prev`: the
  SHA-256 (hex) of the previous line's bytes without its newline (the first line ever has 64 zeros),
  and `mac`: HMAC-SHA256 of the line without `mac` under the sealing key of its seq; a request that
  carried a W3C trace context also has `trace_id` and `parent_id` (the node's claim, a correlation aid:
  root cannot check it);
- the sealing key evolves at every line, k[s+1] = SHA-256("bcd-audit-evolve\\0" || k[s]), and only the
  next one is kept (`audit.key`, 0600, rewritten after each line; the one before is gone). Whoever
  takes root later cannot recompute the MAC of a line already written. The verification key
  `bcdk1-<seq>-<hex k[seq]>` is printed once, by `bcd helper audit init` at set-up, for the operator to
  keep off the host (like journald's Forward Secure Sealing). It derives every later sealing key, so it
  is never written to a log: a helper that starts without `audit.key` makes one no one holds (a
  warning says so) and the chain alone is then checkable;
- appended with O_APPEND, fsynced before the answer goes out, files 0600 in a directory 0700
  that the root-only rule accepts;
- rotated when `audit.log` passes `max_bytes`: audit.log.N shift up, audit.log becomes audit.log.1,
  and the new audit.log starts with an anchor line (op `(anchor)`) that chains to the old file's last
  line and records the previous file's last seq and the oldest seq still kept. A rotated file is
  deleted only when more than `keep` are kept AND the node has read a head at or past its last line
  (`audit.head`, the op; docs/helper.md) AND that line is at least `min_age_s` old (the file's mtime:
  only root writes the directory), so a node that reads heads and never reports them cannot flood
  pings to rotate away what it did before the control plane misses its head (round 5). Past keep x
  HOLD_FACTOR files held for these reasons, `full` is true and the server refuses the node's requests
  (`audit-full`) except `audit.head`;
- `audit.head` (the file, 0600) holds the seq and hash of the newest line, rewritten after each
  append (not fsynced: it may lag after a crash, which verify accepts while the line it names is
  there, unchanged);
- a crash in the middle of an append can leave `audit.log` ending in part of a line (never fsynced, so
  its request was never answered). The next start cuts those bytes off at the last newline and records
  the cut as a line of its own (op `(repair)`, decision `repaired`, reason `torn-tail`, the count and
  SHA-256 of the bytes cut), so every line still parses and the cut is sealed, not silent. A start that
  finds `audit.log` missing or empty beside rotated files (a crash between the rotation's rename and its
  anchor) writes the anchor then;
- each line also goes to the system log (best effort: `/dev/log` of the real host, when present).

`verify(dir, key, expect_head)` reads the files oldest first and names the first problem.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import hmac
import json
import mmap
import os
import re
import secrets
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, split_host_path, verified_dir
from bcd_shared.shown import shown

LOG_NAME = "audit.log"
HEAD_NAME = "audit.head"
PENDING_NAME = "audit.pending"
MAX_PENDING = 64 * 1024
KEY_NAME = "audit.key"
GENESIS = "0" * 64
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_KEEP = 8
HOLD_FACTOR = 4
ANCHOR_OP = "(anchor)"
REPAIR_OP = "(repair)"
KEY_PREFIX = "bcdk1"
_KEY_RE = re.compile(r"^bcdk1-([1-9][0-9]{0,18})-([0-9a-f]{64})$")


class AuditError(Exception):
    """The audit log cannot be used as it is (the helper does not start); the message says why."""


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)  # built once


def canonical(value: Any) -> bytes:
    return _CANONICAL.encode(value).encode()


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def evolve(key: bytes) -> bytes:
    return hashlib.sha256(b"bcd-audit-evolve\0" + key).digest()


def seal(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def _sealed_line(key: bytes, entry: dict[str, Any]) -> bytes:
    """canonical(entry with `mac`), where mac seals canonical(entry): the entry is encoded once, and `mac`
    is spliced in at its sorted place (canonical sorts the top-level keys; each value's encoding does not
    depend on its neighbours)."""
    body = canonical(entry)
    # `mac` sorts just before `message`, which every entry has. The top-level `,"message":` is the last
    # one: after it come only op, parent_id, peer_pid, peer_uid, prev, reason, seq, time and trace_id,
    # strings (whose quotes are escaped) and integers; one inside `args` (a shown object's key) comes
    # before it.
    at = body.rfind(b',"message":')
    if at < 0 or "message" not in entry or any("mac" < k < "message" for k in entry):
        # not the fields record() writes: the general way
        before = {k: v for k, v in entry.items() if k < "mac"}
        after = {k: v for k, v in entry.items() if k > "mac"}
        head, tail = canonical(before), canonical(after)
        return head[:-1] + b',"mac":"' + seal(key, body).encode() + b'",' + tail[1:]
    return body[:at] + b',"mac":"' + seal(key, body).encode() + b'"' + body[at:]


def _head_bytes(seq: int, digest: str) -> bytes:
    """canonical({"seq": seq, "sha256": digest}) and a newline, formatted directly (the keys sorted)."""
    return b'{"seq":%d,"sha256":"%s"}\n' % (seq, digest.encode())


def format_key(seq: int, key: bytes) -> str:
    return f"{KEY_PREFIX}-{seq}-{key.hex()}"


def parse_key(text: str) -> tuple[int, bytes]:
    m = _KEY_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError("a verification key reads bcdk1-<seq>-<64 hex digits>")
    return int(m.group(1)), bytes.fromhex(m.group(2))


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


SYSLOG_PATH = "/dev/log"
SYSLOG_MAX = 8000  # bytes of a line sent (a datagram past the receiver's limit would be dropped whole)
SYSLOG_RETRY_S = 5.0  # how long a missing or refusing /dev/log is left alone before the next try


class SystemLog:
    """Best effort: each line as one datagram to the host's system log (RFC 3164, facility authpriv).

    One non-blocking datagram socket is kept connected across lines (a socket, a connect and a close a
    line cost three syscalls more, and a path lookup). A send that fails with anything but a full buffer
    (the receiver restarted: ECONNREFUSED) closes it, and one new connect is tried at once; a host
    without `path`, or one that refuses the connect, is left alone for SYSLOG_RETRY_S. A full buffer drops
    the line: the audit log, not the system log, is the record."""

    def __init__(
        self, path: str = SYSLOG_PATH, clock: Callable[[], float] = time.monotonic, pid: int | None = None
    ) -> None:
        self._path = path
        self._clock = clock
        self._prefix = b"<86>bcd-helper[%d]: " % (os.getpid() if pid is None else pid)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_try = float("-inf")

    def send(self, line: bytes) -> None:
        message = self._prefix + line[:SYSLOG_MAX]
        with self._lock:
            for _ in range(2):
                sock = self._sock if self._sock is not None else self._connect()
                if sock is None:
                    return
                try:
                    sock.send(message)
                    return
                except BlockingIOError:
                    return
                except OSError:
                    self._drop()

    def _connect(self) -> socket.socket | None:
        now = self._clock()
        if now < self._next_try:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            sock.connect(self._path)
        except OSError:
            sock.close()
            self._next_try = now + SYSLOG_RETRY_S
            return None
        self._sock = sock
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def _open(dfd: int, name: str, flags: int) -> int:
    return os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)


def _cut_torn_tail(dfd: int) -> tuple[int, str] | None:
    """Cut what follows audit.log's last newline (part of a line a crash interrupted), fsynced; the
    count and SHA-256 of the bytes cut, or None when the log ends with a whole line."""
    try:
        fd = os.open(LOG_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
            keep = mm.rfind(b"\n") + 1
            if keep == size:
                return None
            with memoryview(mm)[keep:] as torn:
                digest = hashlib.sha256(torn).hexdigest()
        os.ftruncate(fd, keep)
        os.fsync(fd)
        return size - keep, digest
    finally:
        os.close(fd)


def _rotated(dfd: int) -> list[int]:
    """The numbers N of the audit.log.N files in the directory, ascending (1 is the newest)."""
    out = []
    for name in os.listdir(dfd):
        suffix = name[len(LOG_NAME) + 1 :]
        if name.startswith(LOG_NAME + ".") and suffix.isdigit() and not suffix.startswith("0"):
            out.append(int(suffix))
    return sorted(out)


def _seq_of(line: bytes | None) -> int | None:
    if line is None:
        return None
    try:
        return int(json.loads(line)["seq"])
    except (ValueError, KeyError, TypeError):
        return None


def _first_line(dfd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.readline(1 << 20).rstrip(b"\n") or None


_KEY_STATE_RE = re.compile(rb"^bcd-audit-key-state v1 ([0-9]{20}) ([0-9a-f]{64})\n$")


def _read_key_state(dfd: int) -> tuple[int, bytes] | None:
    """audit.key: the seq of the next line and its sealing key; None when there is none."""
    try:
        fd = os.open(KEY_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(4096)
    m = _KEY_STATE_RE.fullmatch(data)
    if m is None or int(m.group(1)) < 1:
        raise AuditError(f"{KEY_NAME}: not a sealing key state; the sealing cannot go on")
    return int(m.group(1)), bytes.fromhex(m.group(2).decode())


def _key_state_bytes(seq: int, key: bytes) -> bytes:
    """Fixed length, so each rewrite is one pwrite of the same bytes' span (no truncation to tear)."""
    return b"bcd-audit-key-state v1 %020d %s\n" % (seq, key.hex().encode())


def create_key(dfd: int, next_seq: int) -> str:
    """A new sealing key starting at `next_seq`, written to audit.key (fsynced); the verification key."""
    key = secrets.token_bytes(32)
    fd = _open(dfd, KEY_NAME, os.O_WRONLY | os.O_EXCL)
    try:
        os.write(fd, _key_state_bytes(next_seq, key))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.fsync(dfd)
    return format_key(next_seq, key)


class AuditLog:
    """Appends chained, sealed lines to `<root>/<dir>/audit.log`. Thread-safe; one per helper process."""

    def __init__(
        self,
        root: Path,
        directory: str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        syslog: bool = True,
        min_age_s: float = 0.0,
    ) -> None:
        self._dir = directory.rstrip("/") or "/"
        self._parts = split_host_path(self._dir + "/" + LOG_NAME)[:-1]
        self._max = max_bytes
        self._keep = keep
        self._min_age = min_age_s
        self._system_log = SystemLog() if syslog else None
        self._lock = threading.Lock()
        self.created_key: str | None = None  # the verification key, when this start created it
        self._exported = 0
        with verified_dir(root, self._parts, create=True) as dfd:
            os.fchmod(dfd, 0o700)
            cut = _cut_torn_tail(dfd)
            self._prev, self._seq = self._tail(dfd)
            # The directory was checked from / down once; its fd is kept (only root could move it),
            # and so are the log's, the head's and the key's fds, reopened after a rotation.
            self._dfd = os.dup(dfd)
        state = _read_key_state(self._dfd)
        if state is None:
            self.created_key = create_key(self._dfd, self._seq + 1)
            state = _read_key_state(self._dfd)
            assert state is not None
        kseq, key = state
        if kseq > self._seq + 1:
            raise AuditError(
                f"{KEY_NAME} is at seq {kseq} but the log ends at seq {self._seq}: lines were removed"
            )
        while kseq < self._seq + 1:  # the key file lags after a crash: evolve to the next line
            kseq, key = kseq + 1, evolve(key)
        self._key = key
        self._fd = -1
        self._size = 0  # audit.log's size, read when it is opened
        self._hfd = -1
        self._head_len = -1  # the length audit.head was last truncated to
        self._kfd = -1
        self._held = len(_rotated(self._dfd))
        if self._held and os.fstat(self._log_fd()).st_size == 0:
            self._anchor()  # a crash came between the rotation's rename and its anchor
        if cut is not None:
            count, digest = cut
            args = {"file": LOG_NAME, "bytes": count, "sha256": digest}
            self._append(
                self._own_fields(
                    REPAIR_OP,
                    args,
                    "repaired",
                    "torn-tail",
                    f"the last {count} bytes of {LOG_NAME}, part of a line a crash interrupted (never "
                    "answered), were cut at start",
                ),
                new_file=self._size == 0,
            )

    def _open(self, name: str, flags: int) -> int:
        return _open(self._dfd, name, flags)

    def _log_fd(self) -> int:
        if self._fd < 0:
            self._fd = self._open(LOG_NAME, os.O_WRONLY | os.O_APPEND)
            os.fchmod(self._fd, 0o600)
            self._size = os.fstat(self._fd).st_size  # then counted here: one writer, under the lock
        return self._fd

    def close(self) -> None:
        with self._lock:
            for fd in (self._fd, self._hfd, self._kfd, self._dfd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._hfd = self._kfd = self._dfd = -1
        if self._system_log is not None:
            self._system_log.close()

    def _tail(self, dfd: int) -> tuple[str, int]:
        """The hash and seq of the newest line (in audit.log, else audit.log.1)."""
        for name in (LOG_NAME, f"{LOG_NAME}.1"):
            last = _last_line(dfd, name)
            if last is not None:
                return line_hash(last), _seq_of(last) or 0
        return GENESIS, 0

    # --- export and rotation ------------------------------------------------------------------

    @property
    def full(self) -> bool:
        """True while more than keep x HOLD_FACTOR rotated files are held unexported."""
        return self._held >= self._keep * HOLD_FACTOR

    def head(self) -> tuple[int, str]:
        with self._lock:
            return self._seq, self._prev

    def save_pending(self, data: bytes | None) -> None:
        """`audit.pending` (the counts of requests answered without a line while the log is full, kept
        across a crash, docs/helper.md "Audit log"): replaced whole (a temporary file fsynced, renamed,
        the directory fsynced), or removed when `data` is None. Relative to the log's own directory."""
        with self._lock:
            if self._dfd < 0:
                return
            if data is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(PENDING_NAME, dir_fd=self._dfd)
                    os.fsync(self._dfd)
                return
            tmp = f".{PENDING_NAME}.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self._dfd)
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=self._dfd,
            )
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, PENDING_NAME, src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
            os.fsync(self._dfd)

    def load_pending(self) -> bytes | None:
        """`audit.pending` as left by a helper that stopped while the log was full; None when absent.
        At most MAX_PENDING bytes (a longer file is refused by the caller's parse)."""
        with self._lock:
            try:
                fd = os.open(
                    PENDING_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._dfd
                )
            except FileNotFoundError:
                return None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return b"(not a regular file)"
                return os.read(fd, MAX_PENDING + 1)
            finally:
                os.close(fd)

    def export(self) -> dict[str, Any]:
        """The head, now read by the node: every line up to it may be rotated away (and files past
        `keep` are, at once, behind a new anchor)."""
        with self._lock:
            self._exported = max(self._exported, self._seq)
            head = {"seq": self._seq, "sha256": self._prev}
            numbers = _rotated(self._dfd) if self._held > self._keep else []
            if numbers and self._deletable(numbers[-1]):  # a rotation now deletes at least one file
                self._rotate_and_anchor()
            return head

    def _deletable(self, number: int) -> bool:
        """audit.log.<number> may go: every line of it exported, the newest at least min_age_s old."""
        name = f"{LOG_NAME}.{number}"
        last = _seq_of(_last_line(self._dfd, name))
        if last is None or last > self._exported:
            return False
        if self._min_age <= 0:
            return True
        age = time.time() - os.stat(name, dir_fd=self._dfd, follow_symlinks=False).st_mtime
        return age >= self._min_age

    def _prune(self) -> None:
        numbers = _rotated(self._dfd)
        while len(numbers) > self._keep:
            oldest = numbers[-1]
            if not self._deletable(oldest):
                break
            os.unlink(f"{LOG_NAME}.{oldest}", dir_fd=self._dfd)
            numbers.pop()
        self._held = len(numbers)

    def _rotate_and_anchor(self) -> None:
        dfd = self._dfd
        for i in reversed(_rotated(dfd)):
            os.rename(f"{LOG_NAME}.{i}", f"{LOG_NAME}.{i + 1}", src_dir_fd=dfd, dst_dir_fd=dfd)
        with contextlib.suppress(FileNotFoundError):
            os.rename(LOG_NAME, f"{LOG_NAME}.1", src_dir_fd=dfd, dst_dir_fd=dfd)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._prune()
        os.fsync(dfd)
        self._anchor()

    def _anchor(self) -> None:
        """The first line of a new audit.log, chained to the last line of audit.log.1 (there is one:
        `keep` is at least 1)."""
        numbers = _rotated(self._dfd)
        oldest = _seq_of(_first_line(self._dfd, f"{LOG_NAME}.{numbers[-1]}"))
        args = {"previous_last_seq": self._seq, "oldest_seq": oldest or self._seq + 1, "files": len(numbers)}
        self._append(self._own_fields(ANCHOR_OP, args, "anchor", "rotated", ""), new_file=True)

    @staticmethod
    def _own_fields(
        op: str, args: dict[str, Any], decision: str, reason: str, message: str
    ) -> dict[str, Any]:
        """A line the helper writes of its own accord (an anchor, a repair)."""
        return {
            "peer_pid": os.getpid(),
            "peer_uid": 0,
            "op": op,
            "args": args,
            "args_sha256": hashlib.sha256(canonical(args)).hexdigest(),
            "decision": decision,
            "reason": reason,
            "message": message,
            "duration_ms": 0.0,
        }

    # --- appending ----------------------------------------------------------------------------

    def _append(self, fields: dict[str, Any], new_file: bool = False) -> bytes:
        seq = self._seq + 1
        entry = {"seq": seq, "time": _now(), **fields, "prev": self._prev}
        line = _sealed_line(self._key, entry)
        fd = self._log_fd()
        os.write(fd, line + b"\n")
        os.fsync(fd)
        self._size += len(line) + 1
        if new_file:
            os.fsync(self._dfd)
        digest = line_hash(line)
        self._prev, self._seq = digest, seq
        # The old key is overwritten by the next one (not fsynced: after a crash it may lag, and the
        # next start evolves it forward from the log's last seq).
        self._key = evolve(self._key)
        if self._kfd < 0:
            self._kfd = self._open(KEY_NAME, os.O_WRONLY)
        state = _key_state_bytes(seq + 1, self._key)
        os.pwrite(self._kfd, state, 0)
        # The head guards the newest lines against an edit or a removal; it may lag after a crash.
        head = _head_bytes(seq, digest)
        if self._hfd < 0:
            self._hfd = self._open(HEAD_NAME, os.O_WRONLY)
            self._head_len = -1
        os.pwrite(self._hfd, head, 0)
        if len(head) != self._head_len:  # seqs only grow: the same length overwrites it all
            os.ftruncate(self._hfd, len(head))
            self._head_len = len(head)
        return line

    def record(
        self,
        *,
        peer_pid: int,
        peer_uid: int,
        op: str,
        args: Mapping[str, Any],
        args_sha256: str,
        decision: str,
        reason: str,
        message: str,
        duration_ms: float,
        trace: tuple[str, str] | None = None,
    ) -> str:
        """Append one line, fsynced; returns its hash. `trace`: the (trace id, parent id) the request
        carried (the node's claim, validated as a version-00 traceparent), as `trace_id` and `parent_id`;
        a line without one has neither field."""
        fields: dict[str, Any] = {
            "peer_pid": peer_pid,
            "peer_uid": peer_uid,
            "op": op,
            "args": dict(args),
            "args_sha256": args_sha256,
            "decision": decision,
            "reason": reason,
            "message": message,
            "duration_ms": round(duration_ms, 3),
        }
        if trace is not None:
            fields["trace_id"], fields["parent_id"] = trace
        with self._lock:
            self._log_fd()
            if self._size >= self._max:
                self._rotate_and_anchor()
            line = self._append(fields, new_file=self._size == 0)
            digest = self._prev
        if self._system_log is not None:
            self._system_log.send(line)
        return digest


def _last_line(dfd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        pos, chunk = end, b""
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step) + chunk
            lines = chunk.rstrip(b"\n").split(b"\n")
            if len(lines) > 1 or pos == 0:
                return lines[-1] or None
    return None


def log_files(directory: Path) -> list[Path]:
    """The audit files oldest first: audit.log.N ... audit.log.1, audit.log."""
    rotated = []
    for p in directory.glob(f"{LOG_NAME}.*"):
        suffix = p.name[len(LOG_NAME) + 1 :]
        if suffix.isdigit():
            rotated.append((int(suffix), p))
    files = [p for _, p in sorted(rotated, reverse=True)]
    current = directory / LOG_NAME
    if current.exists():
        files.append(current)
    return files


def iter_lines(directory: Path) -> Iterator[tuple[Path, int, bytes]]:
    for path in log_files(directory):
        with path.open("rb") as f:
            for n, raw in enumerate(f, start=1):
                yield path, n, raw.rstrip(b"\n")


@frozen
class VerifyResult:
    ok: bool
    lines: int
    problem: str
    first_seq: int = 0
    last_seq: int = 0


def verify_chain(
    directory: Path, key: str | None = None, expect_head: tuple[int, str] | None = None
) -> VerifyResult:
    """Check every kept file: canonical lines, consecutive seqs, the hash chain, an anchor at the start
    of every file after the oldest (and at the oldest unless it starts the chain), the newest anchor's
    oldest seq, audit.head, and with `key` every sealed line's MAC, with `expect_head` that line.
    Names the first problem; a missing directory, audit.log or audit.head is one."""
    sealing: tuple[int, bytes] | None = None
    if key is not None:
        try:
            sealing = parse_key(key)
        except ValueError as exc:
            return VerifyResult(False, 0, f"--key: {exc}")
    if not directory.is_dir():
        return VerifyResult(False, 0, f"{directory}: no such audit directory")
    if not (directory / LOG_NAME).is_file():
        # Right after `audit init` too: an empty log proves nothing, and a deleted one looks the same.
        return VerifyResult(
            False, 0, f"{LOG_NAME} is missing (nothing written since `audit init`, or deleted)"
        )
    files = log_files(directory)
    numbers = sorted(int(p.name[len(LOG_NAME) + 1 :]) for p in files[:-1])
    if numbers != list(range(1, len(numbers) + 1)):
        missing = sorted(set(range(1, (numbers[-1] if numbers else 0) + 1)) - set(numbers))
        return VerifyResult(False, 0, f"{LOG_NAME}.{missing[0]} is missing (a gap between rotated files)")
    prev: str | None = None
    seq = 0
    first_seq = 0
    count = 0
    anchor_oldest: int | None = None
    hashes: dict[int, str] = {}
    kseq, kval = sealing if sealing is not None else (0, b"")
    for path, n, line in iter_lines(directory):
        where = f"{path.name} line {n}"
        try:
            entry = json.loads(line)
            this_prev, this_seq = entry["prev"], entry["seq"]
            if type(this_seq) is not int or type(this_prev) is not str:
                raise TypeError("seq or prev of the wrong type")
        except (ValueError, KeyError, TypeError):
            return VerifyResult(False, count, f"{where}: not an audit entry", first_seq, seq)
        if canonical(entry) != line:
            return VerifyResult(False, count, f"{where}: not in canonical form (edited)", first_seq, seq)
        is_anchor = entry.get("op") == ANCHOR_OP and entry.get("decision") == "anchor"
        if is_anchor != (n == 1 and (prev is not None or this_seq != 1)):
            what = "an anchor inside a file" if is_anchor else "a file that does not start with an anchor"
            return VerifyResult(
                False,
                count,
                f"{where} (seq {this_seq}): {what} (lines dropped, or files spliced)",
                first_seq,
                seq,
            )
        if prev is None:
            first_seq = this_seq
            if not is_anchor and this_prev != GENESIS:
                return VerifyResult(False, count, f"{where}: the first entry does not start the chain")
            if is_anchor and entry["args"].get("previous_last_seq") != this_seq - 1:
                return VerifyResult(False, count, f"{where}: the anchor does not explain seq {this_seq}")
        else:
            if this_seq != seq + 1:
                return VerifyResult(
                    False, count, f"{where}: seq {this_seq} follows seq {seq} (lines removed or reordered)"
                )
            if this_prev != prev:
                return VerifyResult(
                    False,
                    count,
                    f"{where} (seq {this_seq}): does not chain to the line before it "
                    "(that line was edited, or lines were removed or reordered)",
                    first_seq,
                    seq,
                )
            if is_anchor and entry["args"].get("previous_last_seq") != seq:
                return VerifyResult(False, count, f"{where}: the anchor names the wrong previous line")
        if is_anchor:
            anchor_oldest = entry["args"].get("oldest_seq")
        if sealing is not None and this_seq >= sealing[0]:
            if this_seq < kseq:  # cannot happen with consecutive seqs; kept for clarity
                return VerifyResult(False, count, f"{where}: seq goes back")
            while kseq < this_seq:
                kseq, kval = kseq + 1, evolve(kval)
            mac = entry.pop("mac", None)
            if not isinstance(mac, str) or not hmac.compare_digest(mac, seal(kval, canonical(entry))):
                return VerifyResult(
                    False,
                    count,
                    f"{where} (seq {this_seq}): its seal does not verify with this key "
                    "(edited or forged, or another key)",
                    first_seq,
                    seq,
                )
        prev, seq = line_hash(line), this_seq
        hashes[this_seq] = prev
        count += 1
    if count == 0:
        return VerifyResult(False, 0, f"{LOG_NAME} holds no entries")
    if anchor_oldest is not None and anchor_oldest != first_seq:
        return VerifyResult(
            False,
            count,
            f"the oldest kept line is seq {first_seq} but the last rotation kept seq {anchor_oldest} on: "
            "older files were removed",
            first_seq,
            seq,
        )
    if sealing is not None and seq < sealing[0]:
        return VerifyResult(
            False, count, f"sealing starts at seq {sealing[0]} but the log ends at seq {seq}", first_seq, seq
        )
    head_path = directory / HEAD_NAME
    if not head_path.is_file():
        return VerifyResult(False, count, f"{HEAD_NAME} is missing", first_seq, seq)
    try:
        head = json.loads(head_path.read_bytes())
        head_seq, head_sha = int(head["seq"]), head["sha256"]
    except (ValueError, KeyError, TypeError):
        return VerifyResult(False, count, f"{HEAD_NAME}: unreadable", first_seq, seq)
    if hashes.get(head_seq) != head_sha:
        return VerifyResult(
            False,
            count,
            f"the line {HEAD_NAME} records (seq {head_seq}) is missing or changed (newest: seq {seq}): "
            "the last line was edited or removed",
            first_seq,
            seq,
        )
    problem = _check_key_state(directory, sealing, seq)
    if problem:
        return VerifyResult(False, count, problem, first_seq, seq)
    if expect_head is not None:
        want_seq, want_sha = expect_head
        if want_seq > seq:
            return VerifyResult(
                False,
                count,
                f"the log ends at seq {seq}, before the expected head seq {want_seq}: lines removed",
            )
        if want_seq < first_seq:
            return VerifyResult(
                False,
                count,
                f"the expected head seq {want_seq} is older than the oldest kept line (seq {first_seq})",
            )
        if hashes.get(want_seq) != want_sha:
            return VerifyResult(False, count, f"the line at the expected head seq {want_seq} was changed")
    return VerifyResult(True, count, "", first_seq, seq)


def _check_key_state(directory: Path, sealing: tuple[int, bytes] | None, last_seq: int) -> str:
    """audit.key must be there, name the line after the newest (or an earlier one: it is rewritten
    without an fsync and may lag after a crash), and, with the verification key, hold exactly the
    sealing key of its seq: after lines are cut from the end the helper's next key cannot be made again
    (the ones before it are erased), so a cut tail shows here even when audit.head was rewritten."""
    path = directory / KEY_NAME
    if not path.is_file():
        return f"{KEY_NAME} is missing (the sealing key state; a new one would seal with a key no one holds)"
    m = _KEY_STATE_RE.fullmatch(path.read_bytes()[:4096])
    if m is None:
        return f"{KEY_NAME}: not a sealing key state"
    kseq, kval = int(m.group(1)), bytes.fromhex(m.group(2).decode())
    if kseq > last_seq + 1:
        return f"{KEY_NAME} is at seq {kseq} but the log ends at seq {last_seq}: lines were cut from the end"
    if sealing is not None and kseq >= sealing[0]:
        s, k = sealing
        while s < kseq:
            s, k = s + 1, evolve(k)
        if not hmac.compare_digest(k, kval):
            return f"{KEY_NAME}: the key state at seq {kseq} is not this key's (replaced)"
    return ""


# --- `bcd helper audit init|show|verify` -------------------------------------------------------------


def _common_arguments(parser: argparse.ArgumentParser, default: Any) -> None:
    # On `audit` and again on `show`/`verify` (there with SUPPRESS, so that a flag given before the
    # subcommand is not reset): `bcd helper audit verify --root DIR` and `audit --root DIR verify` agree.
    def d(value: object) -> object:
        return value if default is None else default

    from bcd_shared.subcommands import root_dir

    parser.add_argument(
        "--root", default=d("/"), type=root_dir, help="the directory standing for / (a simulated host)"
    )
    parser.add_argument(
        "--dir", default=d(None), type=_dir_arg, help="the audit directory (host path; default from config)"
    )
    parser.add_argument("--config", default=d("/etc/bcd/config.toml"), help="root's config.toml (host path)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _common_arguments(parser, None)
    sub = parser.add_subparsers(dest="audit_command", metavar="init|show|verify", required=True)
    init = sub.add_parser("init", help="create the sealing key and print its verification key, once")
    _common_arguments(init, argparse.SUPPRESS)
    show = sub.add_parser("show", help="print audit entries, filtered")
    show.add_argument("--op", default=None, help="only this operation")
    show.add_argument(
        "--decision", choices=("accepted", "refused", "failed", "anchor", "repaired"), default=None
    )
    show.add_argument(
        "--since", type=_time_arg, default=None, help="only entries at or after this time (RFC 3339)"
    )
    show.add_argument(
        "--until", type=_time_arg, default=None, help="only entries before this time (RFC 3339)"
    )
    show.add_argument("--json", action="store_true", help="print the raw JSON lines")
    _common_arguments(show, argparse.SUPPRESS)
    verify = sub.add_parser("verify", help="check the seals and the chain; names the first problem")
    verify.add_argument("--key", default=None, help="the verification key printed at set-up (required)")
    verify.add_argument(
        "--expect-head",
        default=None,
        metavar="SEQ:HASH",
        help="a head held off the host (the node's reports)",
    )
    _common_arguments(verify, argparse.SUPPRESS)


def _dir_arg(text: str) -> str:
    # A usage error (64), not the root-only rule's refusal further on.
    try:
        split_host_path(text + "/x")
    except RootPathRefused as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def _parse_time(text: str) -> dt.datetime:
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def _time_arg(text: str) -> dt.datetime:
    try:
        return _parse_time(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an RFC 3339 time (like 2026-01-31T12:00:00Z or 2026-01-31)"
        ) from None


def _host_dir(args: argparse.Namespace) -> tuple[Path, str]:
    from bcd_shared.subcommands import EX_CONFIG, CliError

    root = Path(args.root)
    directory: str = args.dir
    if directory is None:
        from bcd_helper.config import ConfigError, load_audit_dir

        try:
            directory = load_audit_dir(root, args.config)
        except ConfigError as exc:
            raise CliError(f"{exc} (or name the audit directory with --dir)", EX_CONFIG) from None
    return root, directory


def _audit_dir(args: argparse.Namespace) -> Path:
    root, directory = _host_dir(args)
    return root.joinpath(*split_host_path(directory + "/x")[:-1])


def init_key(root: Path, directory: str) -> str | None:
    """Make the sealing key of the audit log in `directory` (a host path under `root`), starting at the
    line after the newest; its verification key, or None when the log is sealed already."""
    with verified_dir(root, split_host_path(directory + "/x")[:-1], create=True) as dfd:
        os.fchmod(dfd, 0o700)
        if _read_key_state(dfd) is not None:
            return None
        tail = _seq_of(_last_line(dfd, LOG_NAME) or _last_line(dfd, f"{LOG_NAME}.1")) or 0
        return create_key(dfd, tail + 1)


def _init(args: argparse.Namespace) -> int:
    root, directory = _host_dir(args)
    key = init_key(root, directory)
    if key is None:
        print(
            f"bcd helper audit: {directory}/{KEY_NAME} exists: this log is sealed already "
            "(its verification key was printed when it was made)",
            file=sys.stderr,
        )
        return 1
    print(f"audit verification key (keep it off this host; it is not shown again): {key}")
    return 0


def _token(text: object) -> str:
    """One field of `show`'s line: escaped as `shown` does, and a space too (`\\x20`). An unknown op is
    audited as the node sent it, and `file.write accepted  {...}` printed as is read as an accepted write
    before the real decision (red team round 8); bcd's own op names hold no space."""
    return shown(text).replace(" ", "\\x20")


def run(args: argparse.Namespace) -> int:
    from bcd_shared.subcommands import EX_IOERR, EX_NOINPUT, EX_NOPERM, CliError

    if Path(args.root) == Path("/") and os.geteuid() != 0:
        raise CliError("must run as root: the audit log and root's config.toml are root's alone", EX_NOPERM)
    try:
        if args.audit_command == "init":
            return _init(args)
        directory = _audit_dir(args)
    except OSError as exc:
        raise CliError(str(exc), EX_IOERR) from None
    except RootPathRefused as exc:  # `init` under a directory others can write (/tmp): never as root
        raise CliError(str(exc), EX_NOPERM) from None
    if not directory.is_dir():
        raise CliError(f"{directory}: no audit log here (is this the helper's audit_dir?)", EX_NOINPUT)
    if args.audit_command == "verify":
        if args.key is None:
            print(
                "bcd helper audit: --key is required (the verification key printed at set-up); "
                "without it the chain cannot show what root changed",
                file=sys.stderr,
            )
            return 1
        try:
            parse_key(args.key)
        except ValueError as exc:  # the key given is wrong, not the log: never "audit log broken"
            print(f"bcd helper audit: --key: {exc}", file=sys.stderr)
            return 1
        expect: tuple[int, str] | None = None
        if args.expect_head is not None:
            m = re.fullmatch(r"([0-9]{1,19}):([0-9a-f]{64})", args.expect_head)
            if m is None:
                print("bcd helper audit: --expect-head: expected SEQ:HASH (64 hex digits)", file=sys.stderr)
                return 1
            expect = (int(m.group(1)), m.group(2))
        result = verify_chain(directory, args.key, expect)
        if result.ok:
            print(
                f"audit log intact: {result.lines} entries, seq {result.first_seq} to {result.last_seq}, "
                "sealed" + (" and at the expected head" if expect else "")
            )
            return 0
        print(
            f"bcd helper audit: audit log broken after {result.lines} good entries: {result.problem}",
            file=sys.stderr,
        )
        return 1
    since: dt.datetime | None = args.since
    until: dt.datetime | None = args.until
    for _path, _n, line in iter_lines(directory):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if args.op and entry.get("op") != args.op:
            continue
        if args.decision and entry.get("decision") != args.decision:
            continue
        try:
            when = _parse_time(str(entry.get("time", "")))
        except ValueError:
            continue  # `verify` names a line that does not parse; `show` filters by time
        if (since and when < since) or (until and when >= until):
            continue
        if args.json:
            print(line.decode())
        else:
            print(
                f"{entry['time']} #{entry['seq']} uid={entry['peer_uid']} pid={entry['peer_pid']} "
                f"{_token(entry['op'])} {entry['decision']} {entry['reason']} "
                f"{json.dumps(entry['args'], sort_keys=True)} {shown(entry['message'])}".rstrip()
                + (f" trace={shown(str(entry['trace_id']))}" if "trace_id" in entry else "")
            )
    return 0
