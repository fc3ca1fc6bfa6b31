"""`bcd bench journal`: durable accepts and event appends against the disk's raw fsync rate.

Measured in one run on the data_dir's disk: `--data-dir`, else the `data_dir` of config.toml (`$BCD_CONFIG`
or /etc/bcd/config.toml) when that directory exists and is writable, else a temporary directory; the
output's `data_dir` and `data_dir_from` (`argument`, `config`, `temporary`) say which. A fresh
subdirectory is used and removed afterwards.
- `raw_fsync_per_s`: append 100 bytes to a file and fsync it (the disk's limit for durable writes);
- `accepts_per_s`: `Journal.accept_command`, each one durable on return (one WAL commit + fsync);
- `accept_ratio`: accepts_per_s / raw_fsync_per_s (target >= 0.9). Raw and accept rounds alternate
  (twelve short rounds each) so that a drifting, shared disk affects both alike;
- `events_per_s`: `Journal.append_events` in batches of `event_batch` 100-byte events, with a cumulative
  `ack_events` whenever 8,000 are unacked (the ack is part of the timing; target >= 50,000).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

from bcd_agent.journal import CommandFlags, EventClass, Journal, NewCommand, NewEvent

ROUNDS = 12
ROUND_S = 0.15
EVENT_BATCH = 256
EVENTS_S = 1.0
TARGETS: dict[str, tuple[str, float]] = {"accept_ratio": (">=", 0.9), "events_per_s": (">=", 50_000.0)}


def _raw_fsync(path: Path, seconds: float) -> tuple[int, float]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    rec = b"r" * 99 + b"\n"
    n = 0
    try:
        start = time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline:
            os.write(fd, rec)
            os.fsync(fd)
            n += 1
        return n, time.perf_counter() - start
    finally:
        os.close(fd)


def _accepts(j: Journal, seconds: float, first: int) -> tuple[int, float]:
    flags = CommandFlags(retry_safe=True)
    body = b"b" * 300
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        j.accept_command(NewCommand(f"01BENCH{first + n:019d}", "inventory.refresh", flags, body, b"s" * 64))
        n += 1
    return n, time.perf_counter() - start


def _events(j: Journal, seconds: float) -> tuple[int, float]:
    batch = [NewEvent(EventClass.TRANSITION, "allocation.bound", b"e" * 100) for _ in range(EVENT_BATCH)]
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        out = j.append_events(batch)
        n += out.count
        if j.event_stats().count >= 8000:
            j.ack_events(j.journal_id, out.first_seq + out.count - 1)
    return n, time.perf_counter() - start


def _base_dir(args: argparse.Namespace) -> tuple[Path, str]:
    if getattr(args, "data_dir", None):
        return Path(args.data_dir), "argument"
    from bcd_agent.config import ConfigError, default_config_path, load_config

    try:
        configured = Path(load_config(default_config_path(), missing_ok=True).data_dir)
    except ConfigError:
        configured = None
    if configured is not None and configured.is_dir() and os.access(configured, os.W_OK | os.X_OK):
        return configured, "config"
    return Path(tempfile.gettempdir()), "temporary"


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    base, source = _base_dir(args)
    # Never made here: a mistyped --data-dir once created the whole path, as root, on the real host
    # (the bench's parser refuses a directory that is not there).
    work = Path(tempfile.mkdtemp(prefix="bcd-bench-journal-", dir=base))
    try:
        raw_n = raw_t = acc_n = acc_t = 0.0
        with Journal.open(work / "data", boot_id="bench") as j:
            for _ in range(ROUNDS):
                n, t = _raw_fsync(work / "raw", ROUND_S)
                raw_n, raw_t = raw_n + n, raw_t + t
                n, t = _accepts(j, ROUND_S, int(acc_n))
                acc_n, acc_t = acc_n + n, acc_t + t
            ev_n, ev_t = _events(j, EVENTS_S)
        raw = raw_n / raw_t
        accepts = acc_n / acc_t
        return {
            "raw_fsync_per_s": round(raw, 1),
            "accepts_per_s": round(accepts, 1),
            "accept_ratio": round(accepts / raw, 3),
            "events_per_s": round(ev_n / ev_t, 1),
            "event_batch": EVENT_BATCH,
            "sqlite_version": sqlite3.sqlite_version,
            "data_dir": str(base),
            "data_dir_from": source,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
