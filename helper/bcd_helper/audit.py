"""The audit log: every request, accepted or refused, as one hash-chained JSON line.

Rules (issue 4, item 6):
- one line per request: `seq`, `time` (UTC, RFC 3339 with microseconds), `peer_pid`, `peer_uid`,
  `op`, `args` (the security-relevant arguments, as sent), `args_sha256` (SHA-256 of the whole
  request's canonical JSON, so what is not shown is still pinned), `decision`
  (`accepted` | `refused` | `failed`), `reason`, `message`, `duration_ms`, and `prev`: the SHA-256
  (hex) of the previous line's bytes without its newline; the first line ever has 64 zeros;
- appended with O_APPEND, fsynced before the answer goes out, files 0600 in a directory 0700
  that the root-only rule accepts;
- rotated when `audit.log` passes `max_bytes`: it becomes `audit.log.1` (older ones shift up to
  `keep`), and the first line of the new file chains to the last line of the old one;
- `audit.head` (0600) holds the seq and hash of the newest line, rewritten after each append (not
  fsynced: it may lag after a crash), so that an edited or removed *last* line is found too;
- each line also goes to the system log (best effort: `/dev/log` of the real host, when present).

`verify_chain(dir)` reads the files oldest first and names the first line that does not chain
(edited, removed, inserted or reordered), by file and line number.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from attrs import frozen
from bcd_shared.rootpath import split_host_path, verified_dir

LOG_NAME = "audit.log"
HEAD_NAME = "audit.head"
GENESIS = "0" * 64
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_KEEP = 8


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _syslog(line: bytes) -> None:
    """Best effort: one datagram to the real host's /dev/log (RFC 3164, facility authpriv)."""
    if not os.path.exists("/dev/log"):
        return
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        s.connect("/dev/log")
        s.send(b"<86>bcd-helper[%d]: " % os.getpid() + line[:8000])


class AuditLog:
    """Appends chained lines to `<root>/<dir>/audit.log`. Thread-safe; one per helper process."""

    def __init__(
        self,
        root: Path,
        directory: str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        syslog: bool = True,
    ) -> None:
        self._root = root
        self._dir = directory.rstrip("/") or "/"
        self._parts = split_host_path(self._dir + "/" + LOG_NAME)[:-1]
        self._max = max_bytes
        self._keep = keep
        self._syslog = syslog
        self._lock = threading.Lock()
        with verified_dir(root, self._parts, create=True) as dfd:
            os.fchmod(dfd, 0o700)
            self._prev, self._seq = self._tail(dfd)
            # The directory was checked from / down once; its fd is kept (only root could move it),
            # and so are the log's and the head's fds, reopened after a rotation: a record is then a
            # write, an fsync and a rewrite of the head, without walking the path again.
            self._dfd = os.dup(dfd)
        self._fd = -1
        self._hfd = -1

    def _open(self, name: str, flags: int) -> int:
        return os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dfd)

    def _log_fd(self) -> int:
        if self._fd < 0:
            self._fd = self._open(LOG_NAME, os.O_WRONLY | os.O_APPEND)
            os.fchmod(self._fd, 0o600)
        return self._fd

    def close(self) -> None:
        with self._lock:
            for fd in (self._fd, self._hfd, self._dfd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._hfd = self._dfd = -1

    def _tail(self, dfd: int) -> tuple[str, int]:
        """The hash and seq of the newest line (in audit.log, else audit.log.1)."""
        for name in (LOG_NAME, f"{LOG_NAME}.1"):
            last = _last_line(dfd, name)
            if last is not None:
                try:
                    seq = int(json.loads(last)["seq"])
                except (ValueError, KeyError, TypeError):
                    seq = 0
                return line_hash(last), seq
        return GENESIS, 0

    def _rotate(self, dfd: int) -> None:
        for i in range(self._keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{LOG_NAME}.{i}", f"{LOG_NAME}.{i + 1}", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.rename(LOG_NAME, f"{LOG_NAME}.1", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)

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
    ) -> str:
        """Append one line, fsynced; returns its hash."""
        with self._lock:
            dfd = self._dfd
            size = os.fstat(self._log_fd()).st_size
            if size >= self._max:
                self._rotate(dfd)
                os.close(self._fd)
                self._fd = -1
                size = 0
            entry = {
                "seq": self._seq + 1,
                "time": _now(),
                "peer_pid": peer_pid,
                "peer_uid": peer_uid,
                "op": op,
                "args": dict(args),
                "args_sha256": args_sha256,
                "decision": decision,
                "reason": reason,
                "message": message,
                "duration_ms": round(duration_ms, 3),
                "prev": self._prev,
            }
            line = canonical(entry)
            fd = self._log_fd()
            os.write(fd, line + b"\n")
            os.fsync(fd)
            if size == 0:
                os.fsync(dfd)
            digest = line_hash(line)
            self._prev, self._seq = digest, self._seq + 1
            # The head is rewritten in place without an fsync of its own: it guards the newest lines
            # against an edit or a removal; after a crash it may lag, which verify accepts as long as
            # the line it names is still there, unchanged.
            head = canonical({"seq": self._seq, "sha256": digest}) + b"\n"
            if self._hfd < 0:
                self._hfd = self._open(HEAD_NAME, os.O_WRONLY)
            os.ftruncate(self._hfd, 0)
            os.pwrite(self._hfd, head, 0)
        if self._syslog:
            _syslog(line)
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


def verify_chain(directory: Path) -> VerifyResult:
    """Check the chain over every kept file and against audit.head. Names the first bad line."""
    prev: str | None = None
    seq: int | None = None
    count = 0
    hashes: dict[int, str] = {}
    for path, n, line in iter_lines(directory):
        where = f"{path.name} line {n}"
        try:
            entry = json.loads(line)
            this_prev, this_seq = entry["prev"], int(entry["seq"])
        except (ValueError, KeyError, TypeError):
            return VerifyResult(False, count, f"{where}: not an audit entry")
        if prev is None:
            if this_prev != GENESIS and this_seq == 1:
                return VerifyResult(False, count, f"{where}: the first entry does not start the chain")
        elif this_prev != prev:
            return VerifyResult(
                False,
                count,
                f"{where} (seq {this_seq}): does not chain to the line before it "
                "(that line was edited, or lines were removed or reordered)",
            )
        if seq is not None and this_seq != seq + 1:
            return VerifyResult(
                False, count, f"{where}: seq {this_seq} follows seq {seq} (lines removed or reordered)"
            )
        prev, seq = line_hash(line), this_seq
        hashes[this_seq] = prev
        count += 1
    head_path = directory / HEAD_NAME
    if head_path.exists():
        try:
            head = json.loads(head_path.read_bytes())
            head_seq, head_sha = int(head["seq"]), head["sha256"]
        except (ValueError, KeyError, TypeError):
            return VerifyResult(False, count, f"{HEAD_NAME}: unreadable")
        if hashes.get(head_seq) != head_sha:
            return VerifyResult(
                False,
                count,
                f"the line {HEAD_NAME} records (seq {head_seq}) is missing or changed (newest: seq {seq}): "
                "the last line was edited or removed",
            )
    return VerifyResult(True, count, "")


# --- `bcd helper audit show|verify` ------------------------------------------------------------------


def _common_arguments(parser: argparse.ArgumentParser, default: Any) -> None:
    # On `audit` and again on `show`/`verify` (there with SUPPRESS, so that a flag given before the
    # subcommand is not reset): `bcd helper audit verify --root DIR` and `audit --root DIR verify` agree.
    def d(value: object) -> object:
        return value if default is None else default

    parser.add_argument("--root", default=d("/"), help="the directory standing for / (a simulated host)")
    parser.add_argument("--dir", default=d(None), help="the audit directory (host path; default from config)")
    parser.add_argument("--config", default=d("/etc/bcd/config.toml"), help="root's config.toml (host path)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _common_arguments(parser, None)
    sub = parser.add_subparsers(dest="audit_command", metavar="show|verify", required=True)
    show = sub.add_parser("show", help="print audit entries, filtered")
    show.add_argument("--op", default=None, help="only this operation")
    show.add_argument("--decision", choices=("accepted", "refused", "failed"), default=None)
    show.add_argument(
        "--since", type=_time_arg, default=None, help="only entries at or after this time (RFC 3339)"
    )
    show.add_argument(
        "--until", type=_time_arg, default=None, help="only entries before this time (RFC 3339)"
    )
    show.add_argument("--json", action="store_true", help="print the raw JSON lines")
    _common_arguments(show, argparse.SUPPRESS)
    verify = sub.add_parser("verify", help="check the hash chain; names the first bad line")
    _common_arguments(verify, argparse.SUPPRESS)


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


def _audit_dir(args: argparse.Namespace) -> Path:
    from bcd_shared.subcommands import EX_CONFIG, CliError

    root = Path(args.root)
    directory: str = args.dir
    if directory is None:
        from bcd_helper.config import ConfigError, load_config

        try:
            directory = load_config(root, args.config).audit_dir
        except ConfigError as exc:
            raise CliError(f"{exc} (or name the audit directory with --dir)", EX_CONFIG) from None
    return root.joinpath(*split_host_path(directory + "/x")[:-1])


def run(args: argparse.Namespace) -> int:
    from bcd_shared.subcommands import EX_NOINPUT, EX_NOPERM, CliError

    if Path(args.root) == Path("/") and os.geteuid() != 0:
        raise CliError("must run as root: the audit log and root's config.toml are root's alone", EX_NOPERM)
    directory = _audit_dir(args)
    if not directory.is_dir():
        raise CliError(f"{directory}: no audit log here (is this the helper's audit_dir?)", EX_NOINPUT)
    if args.audit_command == "verify":
        result = verify_chain(directory)
        if result.ok:
            print(f"audit log intact: {result.lines} entries")
            return 0
        print(f"audit log broken after {result.lines} good entries: {result.problem}", file=sys.stderr)
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
                f"{_shown(entry['op'])} {entry['decision']} {entry['reason']} "
                f"{json.dumps(entry['args'], sort_keys=True)} {_shown(entry['message'])}".rstrip()
            )
    return 0


def _shown(text: Any) -> str:
    """Text a client chose (an op name, a message quoting it) with every unprintable character escaped,
    so a newline in it cannot start what looks like another entry in `show`'s output."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))
