"""The journal's SQLite schema (version 3). One file, `journal.db`, WAL mode, synchronous=FULL.

Version 2 added `commands.attestation` (the exact CommandAttestation bytes of an attested result, stored
with its node signature) and `commands.message` (the result's human-readable message). Version 3 added
`commands.envelope_sha256`: set on a refusal of a command whose signature did not verify against the
command-signing roots (the gateway's word only), it makes the refusal answer that envelope alone, not
every body a gateway sends under the id (docs/session.md "Hostile gateway, round 2"). An older version is
migrated in place on open (`MIGRATIONS`), in one transaction; a newer one is treated like corruption
(moved aside)."""

from __future__ import annotations

SCHEMA_VERSION = 3
DB_NAME = "journal.db"
LOCK_NAME = "journal.lock"

DDL = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE commands (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    retry_safe INTEGER NOT NULL,
    self_terminating INTEGER NOT NULL,
    attested INTEGER NOT NULL,
    state TEXT NOT NULL,
    incarnation TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    accepted_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    body BLOB NOT NULL,
    signature BLOB NOT NULL,
    outcome TEXT,
    code TEXT,
    result BLOB,
    result_boot_id TEXT,
    node_sig BLOB,
    previous_boot_id TEXT,
    attestation BLOB,
    message TEXT,
    finished_at REAL,
    acked INTEGER NOT NULL DEFAULT 0,
    envelope_sha256 BLOB
) WITHOUT ROWID;
CREATE TABLE events (
    seq INTEGER PRIMARY KEY,
    class INTEGER NOT NULL,
    type TEXT NOT NULL,
    payload BLOB NOT NULL,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX events_metric ON events (seq) WHERE class = 0;
CREATE TABLE spec (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    generation INTEGER NOT NULL,
    body BLOB NOT NULL,
    spec_hash TEXT NOT NULL,
    signature BLOB NOT NULL
);
CREATE TABLE exec_tickets (jti TEXT PRIMARY KEY, expires_at REAL NOT NULL) WITHOUT ROWID;
"""

# Statements that take a journal of version N to N + 1 (run in one transaction with the version bump).
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("ALTER TABLE commands ADD COLUMN attestation BLOB", "ALTER TABLE commands ADD COLUMN message TEXT"),
    2: ("ALTER TABLE commands ADD COLUMN envelope_sha256 BLOB",),
}

# The tables a journal of this version must have (checked on open, with the version row).
TABLES = frozenset({"schema_version", "meta", "commands", "events", "spec", "exec_tickets"})

# meta keys
K_JOURNAL_ID = "journal_id"
K_NODE_ID = "node_id"
K_NEXT_SEQ = "next_event_seq"
K_ACKED_SEQ = "acked_event_seq"
K_LAST_EPOCH = "last_epoch"
K_APPLIED_GEN = "applied_generation"
K_SERVER_MARK = "server_time_mark"
K_CREATED_AT = "created_at"
# An idempotent event's key (Journal.append_event `key`): "event-key:<key>" -> the seq it was appended at.
K_EVENT_KEY = "event-key:"
