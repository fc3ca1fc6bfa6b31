"""The journal: bcd's durable memory (one SQLite file, `data_dir/journal.db`).

Rules (docs/journal.md has the detail and the decisions):

* **Durable before it returns.** WAL with synchronous=FULL; every public write is one transaction,
  fsynced when the call returns. `accept_command` reaches disk before any side effect; self-terminating
  kinds call `mark_running` immediately before theirs (DLV-JRN-15..17). `accept_commands` and
  `complete_many` write several commands in one transaction, fsynced once, before they return.
* **Synchronous store.** No trio here: callers run it in a thread (`trio.to_thread.run_sync`) or call it
  directly. Calls are serialised by an internal lock. One process per data_dir (an flock on
  `journal.lock`); the data_dir is 0700 and ours alone, the files 0600.
* **Checked on open.** `PRAGMA quick_check`, the schema version and the meta rows; a journal that fails
  is moved aside (renamed `journal.db.failed-<UTC stamp>`, never deleted) and a new journal with a new
  `journal_id` starts: `Journal.report.moved_aside` is set and the session sends SpecRequest NO_SPEC.
* **Commands.** id -> accepted | running{boot_id} | done | cancelled | rejected, with kind, flags, the
  writing process's incarnation, host-clock timestamps and the exact body/signature bytes. `resolve`
  answers the Resolve table (NONE, DONE, REATTACH, REBOOTED, REEXECUTE, INTERRUPTED); `recover` settles
  REBOOTED (SUCCEEDED `rebooted`, previous_boot_id) and INTERRUPTED (FAILED `interrupted`) at start;
  retry-safe leftovers wait for redelivery and are taken over by `accept_command`. The first terminal
  outcome wins; a running command is never cancelled. Each incarnation is fresh per process.
* **Results** stay in `unacked_results()` until `ack_results(ids)`. `sweep` deletes acked results older
  than 7 days and earlier processes' accepted/running entries untouched for 7 days, never this process's.
* **Events.** seq increases from 1 per journal_id and is never reused; `ack_events(journal_id, seq)` is
  cumulative and ignored for another journal_id. Bounds: 10,000 unacked events and 64 MiB (lower only).
  Over them the oldest METRIC events are dropped; TRANSITION and RESULT events never are: when they alone
  fill the bounds, appends of them raise JournalFull, `is_full()` is true and accepts raise JournalFull
  (answer BUSY).
* **Storage faults.** A full file system (SQLITE_FULL, ENOSPC) raises DataDirFull: nothing is written,
  `space_ok` turns false and `on_space_change` is called once per change (the node logs it once, raises
  the `DataDirFull` condition, answers BUSY); the next write that succeeds turns it back. An I/O error
  (SQLITE_IOERR, e.g. EIO on fsync) raises JournalIOError naming the file and the error: the node ends.
* **A lost tail.** `restart_events(reason)` starts a new journal_id and renumbers the unacked events
  from 1, for when the gateway acked (or the node sent) seqs this journal no longer knows it issued.
* **Meta.** node id, last epoch, applied generation (that of the stored spec), the server time mark
  (forward only; `check_welcome` refuses a Welcome more than 5 minutes before it), the last full spec's
  exact bytes, hash and signature, and used exec-ticket jtis until expiry (at most 10,000).
"""

from __future__ import annotations

from bcd_agent.journal._resolve import resolve_entry
from bcd_agent.journal._store import Journal, new_incarnation
from bcd_agent.journal._types import (
    CODE_INTERRUPTED,
    CODE_REBOOTED,
    MAX_EVENT_BYTES,
    MAX_EXEC_TICKETS,
    MAX_REFUSED_ROWS,
    MAX_UNACKED_EVENTS,
    RETENTION_S,
    WELCOME_SLACK_S,
    Action,
    Attester,
    BoundError,
    CommandEntry,
    CommandFlags,
    CommandResult,
    CommandState,
    Completion,
    DataDirFull,
    Event,
    EventClass,
    EventsAppended,
    EventStats,
    JournalError,
    JournalFull,
    JournalIOError,
    JournalLocked,
    NewCommand,
    NewEvent,
    OpenReport,
    Outcome,
    RefusalsFull,
    Resolution,
    StateError,
    StoredSpec,
    TicketRefused,
    UnsafeDataDir,
    WelcomeRefused,
)

__all__ = [
    "CODE_INTERRUPTED",
    "CODE_REBOOTED",
    "MAX_EVENT_BYTES",
    "MAX_EXEC_TICKETS",
    "MAX_REFUSED_ROWS",
    "MAX_UNACKED_EVENTS",
    "RETENTION_S",
    "WELCOME_SLACK_S",
    "Action",
    "Attester",
    "BoundError",
    "CommandEntry",
    "CommandFlags",
    "CommandResult",
    "CommandState",
    "Completion",
    "DataDirFull",
    "Event",
    "EventClass",
    "EventStats",
    "EventsAppended",
    "Journal",
    "JournalError",
    "JournalFull",
    "JournalIOError",
    "JournalLocked",
    "NewCommand",
    "NewEvent",
    "OpenReport",
    "Outcome",
    "RefusalsFull",
    "Resolution",
    "StateError",
    "StoredSpec",
    "TicketRefused",
    "UnsafeDataDir",
    "WelcomeRefused",
    "new_incarnation",
    "resolve_entry",
]
