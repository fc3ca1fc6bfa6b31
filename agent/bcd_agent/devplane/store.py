"""The development control plane's state: one SQLite file `DIR/devplane.db` (WAL, synchronous=NORMAL).

synchronous=NORMAL: in WAL mode a commit is written to the WAL before it returns (a killed devplane
process loses nothing) but fsynced only at checkpoints, so a power loss may lose the last commits. This
is the development plane: its speed is the bench's ceiling on the node's command rate, and what the
tests do to it is kill it, never the machine's power.

Everything a restart must keep lives here: join tokens, nodes (spec body and signature of the current
generation, observed generation, the node's journal id and acknowledged event seq, the last status
report, the next command seq), commands (body and signature as enqueued, state, result and node
signature exactly as received, cancel requests), events (stored above the cumulative ack) and every
command update received (`updates`, an audit trail the e2e test reads), and secrets.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

DB_FILE = "devplane.db"

DDL = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value INTEGER NOT NULL) STRICT;
CREATE TABLE IF NOT EXISTS tokens (token TEXT PRIMARY KEY, node_id TEXT NOT NULL DEFAULT '',
  created_at REAL NOT NULL, used_at REAL) STRICT;
CREATE TABLE IF NOT EXISTS nodes (
  node_id TEXT PRIMARY KEY, public_key BLOB NOT NULL, certificate BLOB NOT NULL, hostname TEXT NOT NULL,
  generation INTEGER NOT NULL DEFAULT 0, spec_json TEXT NOT NULL DEFAULT '', spec_body BLOB,
  spec_signature BLOB,
  spec_hash TEXT NOT NULL DEFAULT '', applied_generation INTEGER NOT NULL DEFAULT 0,
  observed_generation INTEGER NOT NULL DEFAULT 0, journal_id TEXT NOT NULL DEFAULT '',
  acked_event_seq INTEGER NOT NULL DEFAULT 0, next_cmd_seq INTEGER NOT NULL DEFAULT 1,
  status BLOB, status_at REAL, boot_id TEXT NOT NULL DEFAULT '', hellos INTEGER NOT NULL DEFAULT 0,
  epoch INTEGER NOT NULL DEFAULT 0, joined_at REAL NOT NULL) STRICT;
CREATE TABLE IF NOT EXISTS commands (
  id TEXT PRIMARY KEY, node_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, lane TEXT NOT NULL,
  body BLOB NOT NULL, signature BLOB NOT NULL, signer_chain BLOB NOT NULL, approval BLOB, proof BLOB,
  state TEXT NOT NULL, not_after_ms INTEGER NOT NULL, timeout_s REAL NOT NULL, retry_safe INTEGER NOT NULL,
  not_before REAL NOT NULL DEFAULT 0, created_at REAL NOT NULL, dispatched_at REAL, dispatched_epoch INTEGER,
  updated_at REAL NOT NULL, error_code TEXT NOT NULL DEFAULT '', reason TEXT NOT NULL DEFAULT '',
  message TEXT NOT NULL DEFAULT '', result BLOB, node_sig BLOB, attestation BLOB,
  boot_id TEXT NOT NULL DEFAULT '',
  cancel_requested INTEGER NOT NULL DEFAULT 0, cancel_reason TEXT NOT NULL DEFAULT '',
  deliveries INTEGER NOT NULL DEFAULT 0) STRICT;
CREATE INDEX IF NOT EXISTS commands_node ON commands (node_id, state, seq);
CREATE TABLE IF NOT EXISTS events (
  node_id TEXT NOT NULL, journal_id TEXT NOT NULL, seq INTEGER NOT NULL, type TEXT NOT NULL,
  event BLOB NOT NULL,
  received_at REAL NOT NULL, PRIMARY KEY (node_id, journal_id, seq)) STRICT;
CREATE TABLE IF NOT EXISTS updates (
  n INTEGER PRIMARY KEY AUTOINCREMENT, command_id TEXT NOT NULL, node_id TEXT NOT NULL, state TEXT NOT NULL,
  known INTEGER NOT NULL, applied INTEGER NOT NULL, at REAL NOT NULL) STRICT;
CREATE TABLE IF NOT EXISTS secrets (ref TEXT PRIMARY KEY, value BLOB NOT NULL) STRICT;
"""

TERMINAL = frozenset({"succeeded", "failed", "rejected", "cancelled", "expired"})
IN_FLIGHT = frozenset({"dispatched", "acked", "running"})


class Store:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / DB_FILE
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.lock = threading.RLock()
        self.depth = 0  # open transactions and savepoints (the lock's owner's)
        with self.tx() as c:
            for stmt in DDL.split(";"):
                if stmt.strip():
                    c.execute(stmt)

    def close(self) -> None:
        self.conn.close()

    class _Tx:
        """One transaction; inside `batch()` (or another tx of this thread) a savepoint of it, so a
        failing one still rolls back only its own writes."""

        def __init__(self, store: Store, always_commit: bool = False) -> None:
            self.store = store
            self.always_commit = always_commit

        def __enter__(self) -> sqlite3.Connection:
            store = self.store
            store.lock.acquire()
            try:
                store.conn.execute("SAVEPOINT tx" if store.depth else "BEGIN IMMEDIATE")
            except BaseException:
                store.lock.release()
                raise
            store.depth += 1
            return store.conn

        def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
            store = self.store
            store.depth -= 1
            failed = exc_type is not None and not self.always_commit
            try:
                if store.depth:
                    if failed:
                        store.conn.execute("ROLLBACK TO tx")
                    store.conn.execute("RELEASE tx")
                else:
                    store.conn.execute("ROLLBACK" if failed else "COMMIT")
            finally:
                store.lock.release()

    def tx(self) -> Store._Tx:
        return Store._Tx(self)

    def batch(self) -> Store._Tx:
        """One transaction around several `tx()` blocks (the messages of one received batch): each is a
        savepoint, rolled back alone if it fails, and what the others wrote is committed once at the end,
        even when one raised."""
        return Store._Tx(self, always_commit=True)

    def one(self, sql: str, *args: Any) -> sqlite3.Row | None:
        with self.lock:
            row: sqlite3.Row | None = self.conn.execute(sql, args).fetchone()
            return row

    def all(self, sql: str, *args: Any) -> list[sqlite3.Row]:
        with self.lock:
            return list(self.conn.execute(sql, args).fetchall())

    def next_counter(self, key: str) -> int:
        with self.tx() as c:
            row = c.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
            value = (int(row[0]) if row else 0) + 1
            c.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))
        return value

    def log_update(self, command_id: str, node_id: str, state: str, known: bool, applied: bool) -> None:
        with self.tx() as c:
            log_update_in(c, command_id, node_id, state, known, applied)


def log_update_in(
    c: sqlite3.Connection, command_id: str, node_id: str, state: str, known: bool, applied: bool
) -> None:
    """`Store.log_update` inside a transaction the caller holds."""
    c.execute(
        "INSERT INTO updates (command_id, node_id, state, known, applied, at) VALUES (?, ?, ?, ?, ?, ?)",
        (command_id, node_id, state, int(known), int(applied), time.time()),
    )
