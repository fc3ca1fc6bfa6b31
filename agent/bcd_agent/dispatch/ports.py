"""The small interfaces the dispatcher depends on (its imperative shell's edges).

The dispatcher never reaches into the session, the journal's storage, the pki package or the inventory
directly; it talks to these Protocols, and the agent's composition root passes the real objects (or thin
adapters around them, see dispatch.adapters). Tests pass the real journal and real pki where they can.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Protocol

from attrs import frozen

from bcd_agent.dispatch.command import CommandEnvelope, CommandUpdate, UpdateState
from bcd_agent.journal import (
    Attester,
    CommandEntry,
    Completion,
    JournalError,
    NewCommand,
    Outcome,
    Resolution,
    StateError,
)


@frozen
class BatchAdmission:
    """A batch leaf that admits a command: its stable printable id and the approval's expiry (server
    time, seconds since the epoch; None when the approval has none)."""

    leaf: str
    expires_at: float | None = None


class CommandJournal(Protocol):
    """The commands half of `bcd_agent.journal.Journal`, as the dispatcher uses it (the real Journal
    satisfies this structurally). Every write is durable when it returns (`accept_commands` and
    `complete_many` are one write each: one transaction for several commands), except, with
    [journal] group_commit, those made with `durable=False`, which `sync()` makes durable."""

    @property
    def boot_id(self) -> str: ...

    def resolve(self, command_id: str, envelope_sha256: bytes | None = None) -> Resolution: ...

    def accept_command(self, command: NewCommand, *, durable: bool = True) -> CommandEntry: ...

    def accept_commands(
        self, commands: Sequence[NewCommand], *, durable: bool = True
    ) -> list[CommandEntry | JournalError]: ...

    def sync(self) -> None: ...

    def mark_running(self, command_id: str, *, durable: bool = True) -> CommandEntry: ...

    def complete(
        self,
        command_id: str,
        outcome: Outcome,
        *,
        code: str = "",
        body: bytes = b"",
        node_sig: bytes = b"",
        attestation: bytes = b"",
        message: str = "",
        durable: bool = True,
    ) -> CommandEntry: ...

    def complete_many(
        self, completions: Sequence[Completion], *, durable: bool = True
    ) -> list[CommandEntry | StateError]: ...

    def reject(
        self,
        command: NewCommand,
        reason: str,
        message: str = "",
        *,
        signed: bool = False,
        envelope_sha256: bytes = b"",
    ) -> CommandEntry: ...

    def cancel(self, command_id: str, reason: str = "") -> CommandEntry | None: ...

    def cancel_new(self, command: NewCommand, reason: str = "") -> CommandEntry: ...

    def set_attester(self, attester: Attester | None) -> None: ...

    def settle(self, command_id: str) -> CommandEntry: ...

    def is_full(self) -> bool: ...


class TrustView(Protocol):
    """The command-signing half of the trust state (pure: no I/O)."""

    def has_command_roots(self) -> bool:
        """The trust bundle holds command-signing roots: every command must be signed (DLV-SIG-04/05)."""
        ...

    def verify_command(self, command: CommandEnvelope, now: dt.datetime) -> None:
        """Raise (any exception; its text is the rejection message) unless the signature over the exact
        body bytes verifies and chains to the command-signing roots."""
        ...


class BatchVerifier(Protocol):
    """The quorum half of the trust state (pure: no I/O)."""

    def has_approvers(self) -> bool:
        """The trust bundle holds approver keys: the quorum governs destructive kinds (DLV-QRM-01)."""
        ...

    def unbatched_allowance(self) -> int:
        """`unbatched_destructive_per_hour` of the trust bundle (default 0)."""
        ...

    def admit(self, command: CommandEnvelope, now: dt.datetime) -> BatchAdmission:
        """Check `batch_approval` (enough signatures by distinct approver keys over the scope, the scope
        for `command.batch_id` and not past its `not_after`) and `batch_proof` (the leaf is in the scope's
        tree and names `command.subject`, `command.kind`, the payload's SHA-256 and `command.id`); return
        the admitted leaf, or raise (any exception; its text is the BATCH_UNAPPROVED message)."""
        ...


class LedgerView(Protocol):
    """The quorum ledger's reads (dispatch.quorum.QuorumLedger)."""

    def unbatched_admits(self, command_id: str, host_now: float, allowance: int) -> bool: ...

    def leaf_owner(self, leaf: str) -> str | None: ...


class LedgerStore(LedgerView, Protocol):
    """The quorum ledger with its durable writes (dispatch.quorum.QuorumLedger)."""

    def record_unbatched(self, command_id: str, host_now: float) -> None: ...

    def record_leaf(
        self, leaf: str, command_id: str, host_now: float, server_now: float, expires_at: float | None
    ) -> None: ...


class ResultSigner(Protocol):
    """The node key, for attested kinds (DLV-SIG-17): returns the serialized CommandAttestation (command
    id, state, SHA-256 of the result bytes, node id, boot id) and the node key's signature over it under
    purpose `command-result`."""

    def attest(
        self, command_id: str, state: UpdateState, result: bytes, boot_id: str
    ) -> tuple[bytes, bytes]: ...


class UpdateSink(Protocol):
    """Where updates go: the session sends them, and replays terminal ones from the journal until acked."""

    def send(self, update: CommandUpdate) -> None: ...


class SecretFetcher(Protocol):
    """The session's secret broker (`session.secrets.SecretRequests`): a `SecretRequest` out, the value
    back; raises TerminalError (refused) or RetryableError (unavailable), both StepErrors."""

    async def fetch(self, ref: str, *, workflow_id: str, step_id: str) -> bytes: ...


class SpecRequester(Protocol):
    """Asks the control plane for the spec: `SpecRequest{have_generation, reason=MIN_GENERATION}`."""

    def request_spec_for_min_generation(self, have_generation: int) -> None: ...


class Clock(Protocol):
    """Time as the dispatcher judges it."""

    def server_now(self) -> dt.datetime:
        """Server time: the host clock through the Welcome offset (aware UTC). `not_after` is judged on it."""
        ...

    def host_time(self) -> float:
        """The host's own clock (seconds since the epoch); the unbatched allowance's rolling hour."""
        ...
