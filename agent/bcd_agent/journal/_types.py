"""The journal's value types and errors (frozen attrs records; no I/O here)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path

from attrs import frozen

# Bounds from the delivery contract (DLV-JRN-10, DLV-JRN-18). Configuration may lower them, never raise them.
MAX_UNACKED_EVENTS = 10_000
MAX_EVENT_BYTES = 64 * 1024 * 1024
MAX_EXEC_TICKETS = 10_000
# Rows the journal keeps on the gateway's word alone (refusals and cancels of commands never accepted,
# journaled without a body): at most this many. Past it the oldest acked ones are deleted; when none is
# acked, new ones are refused (RefusalsFull: the command is answered BUSY). Not in the seeds: without it a
# gateway that never acks grows the journal by a row per message (docs/session.md, hostile gateway round 2).
MAX_REFUSED_ROWS = 10_000
# Done entries are kept this long (DLV-JRN-04, DLV-REC-13/14).
RETENTION_S = 7 * 24 * 3600.0
# A Welcome more than this far before the server time mark is refused (DLV-JRN-13).
WELCOME_SLACK_S = 300.0
# A result's message is kept up to this many characters (it is informational; the code is what counts).
MAX_MESSAGE_CHARS = 1024


class CommandState(enum.Enum):
    """Where a journaled command stands. DONE, CANCELLED and REJECTED are terminal and carry a result."""

    ACCEPTED = "accepted"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({CommandState.DONE, CommandState.CANCELLED, CommandState.REJECTED})


class Outcome(enum.Enum):
    """A command's terminal outcome, as reported in its terminal CommandUpdate (DLV-RES-03)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REJECTED = "rejected"
    CANCELLED = "cancelled"

    @property
    def state(self) -> CommandState:
        """The journal state a result with this outcome puts its command in."""
        if self is Outcome.REJECTED:
            return CommandState.REJECTED
        if self is Outcome.CANCELLED:
            return CommandState.CANCELLED
        return CommandState.DONE


# Result codes the journal itself produces.
CODE_REBOOTED = "rebooted"  # SUCCEEDED: a self-terminating command completed by the reboot it caused
CODE_INTERRUPTED = "interrupted"  # FAILED: a crash interrupted a command that is not retry-safe


class Action(enum.Enum):
    """What to do with a delivered command: one row of the Resolve table (DLV-REC-03..09)."""

    NONE = "none"  # no entry: run the acceptance checks, journal `accepted`, run it
    DONE = "done"  # terminal entry: resend the stored result
    REATTACH = "reattach"  # accepted/running in this process: the execution in flight reports
    REBOOTED = "rebooted"  # running, self-terminating, from an earlier boot: SUCCEEDED `rebooted`
    REEXECUTE = "reexecute"  # left by an earlier process, retry-safe: acceptance checks, then run again
    INTERRUPTED = "interrupted"  # left by an earlier process, not retry-safe: FAILED `interrupted`


class EventClass(enum.IntEnum):
    """An event's class (DLV-JRN-19). Under the bounds only METRIC events are ever dropped."""

    METRIC = 0
    TRANSITION = 1
    RESULT = 2


@frozen
class CommandFlags:
    retry_safe: bool = False
    self_terminating: bool = False
    attested: bool = False


@frozen
class NewCommand:
    """A delivered command as the journal records it: the id, kind, flags and the exact signed bytes."""

    id: str
    kind: str
    flags: CommandFlags
    body: bytes = b""
    signature: bytes = b""


@frozen
class Completion:
    """One real outcome for `Journal.complete_many` (the arguments of `Journal.complete`)."""

    command_id: str
    outcome: Outcome
    code: str = ""
    body: bytes = b""
    message: str = ""


@frozen
class CommandResult:
    """A terminal result, stored exactly as produced and replayed until acknowledged.

    `code` is the error code of a FAILED result (`interrupted`, `invalid-payload`, ...), the reason of a
    REJECTED or CANCELLED one, `rebooted` for a reboot-completed command, else empty. `body` is the
    kind's encoded result message. For attested kinds `attestation` is the serialized CommandAttestation
    and `node_sig` the node's signature over it, made once when the result was journaled (the journal's
    attester) and replayed exactly as stored (all exact bytes). `boot_id` is the boot the result was
    produced in; `previous_boot_id` is set on a `rebooted` result. `message` is the human-readable detail
    sent with it (a handler's failure text, the rule a rejection broke), kept so that a replay, perhaps the
    first send, carries it too (at most MAX_MESSAGE_CHARS).
    """

    outcome: Outcome
    code: str
    body: bytes
    boot_id: str
    finished_at: float
    node_sig: bytes = b""
    previous_boot_id: str = ""
    attestation: bytes = b""
    message: str = ""


@frozen
class CommandEntry:
    """One row of the commands part. `boot_id` is the boot of the last accepted/running write."""

    id: str
    kind: str
    flags: CommandFlags
    state: CommandState
    incarnation: str
    boot_id: str
    accepted_at: float
    updated_at: float
    body: bytes
    signature: bytes
    result: CommandResult | None
    acked: bool
    # Set on a refusal of a command whose signature did not verify against the command-signing roots:
    # SHA-256 of the refused envelope (`dispatch.command.envelope_sha256`). Such a refusal answers only
    # that envelope; another one under the id is judged afresh (Resolve NONE), and may take the row over.
    envelope_sha256: bytes = b""

    @property
    def binds(self) -> bool:
        """The entry answers every delivery of its id (all but a refusal on the gateway's word alone)."""
        return not self.envelope_sha256


# Signs the terminal result of an attested command as it is journaled: given the entry with its result,
# returns (attestation bytes, node signature). Set with `Journal.set_attester` (dispatch.results makes one).
Attester = Callable[[CommandEntry], tuple[bytes, bytes]]


@frozen
class Resolution:
    action: Action
    entry: CommandEntry | None


@frozen
class NewEvent:
    cls: EventClass
    type: str
    payload: bytes


@frozen
class Event:
    seq: int
    cls: EventClass
    type: str
    payload: bytes
    created_at: float


@frozen
class EventsAppended:
    """What `append_events` did: seqs `first_seq .. first_seq+count-1` were assigned (0 count: none);
    `dropped_metrics` metric events (oldest first, possibly some of this batch) were dropped for room."""

    first_seq: int
    count: int
    dropped_metrics: int

    @property
    def seqs(self) -> range:
        return range(self.first_seq, self.first_seq + self.count)


@frozen
class StoredSpec:
    """The last full spec: its exact body bytes, the server's spec_hash (echoed, never recomputed) and the
    signature bytes (empty when unsigned)."""

    generation: int
    body: bytes
    spec_hash: str
    signature: bytes


@frozen
class OpenReport:
    """How `Journal.open` found the journal. `moved_aside` lists the files of a journal that failed its
    integrity or schema check (renamed, never deleted); then `reason` says why and a new journal_id
    started, so the session must send SpecRequest NO_SPEC (DLV-RCV-08). `migrated_from` is the older schema
    version the journal was migrated from in place (0: none)."""

    created: bool
    moved_aside: tuple[Path, ...]
    reason: str
    migrated_from: int = 0


@frozen
class EventStats:
    count: int
    bytes: int
    metric_count: int
    metric_bytes: int


class JournalError(Exception):
    """Base of the journal's errors."""


class JournalFull(JournalError):
    """Dropping metric events does not make room: answer new commands BUSY until acks drain it."""


class RefusalsFull(JournalFull):
    """MAX_REFUSED_ROWS rows on the gateway's word alone are held and none is acked: nothing was written;
    answer the command BUSY (a Cancel of an unseen id is dropped: the gateway repeats it)."""


class DataDirFull(JournalError):
    """The data_dir's file system is full (ENOSPC / SQLITE_FULL): nothing was written. The node stays up,
    answers new commands BUSY and raises the `DataDirFull` condition until a write succeeds again."""


class JournalIOError(JournalError):
    """The journal's storage failed (EIO on write or fsync, SQLITE_IOERR): what is on disk is no longer
    known to be what was written, so the process ends (as PostgreSQL does on an fsync failure) with this
    one line, which names the file and the error."""


class JournalLocked(JournalError):
    """Another process holds this data_dir's journal."""


class UnsafeDataDir(JournalError):
    """The data_dir is not ours alone (another owner, or group/world-writable)."""


class BoundError(JournalError, ValueError):
    """A configured bound is above the contract's limit (config may lower bounds, never raise them)."""


class StateError(JournalError):
    """A command transition the rules do not allow (unknown id, wrong state, another process's entry)."""


class WelcomeRefused(JournalError):
    """A Welcome's server_time is more than 5 minutes before the server time mark (DLV-JRN-13)."""


class TicketRefused(JournalError):
    """An exec ticket is refused: `reason` is `replayed`, `full` or `expired`."""

    def __init__(self, jti: str, reason: str) -> None:
        super().__init__(f"exec ticket {jti!r} refused: {reason}")
        self.jti = jti
        self.reason = reason
