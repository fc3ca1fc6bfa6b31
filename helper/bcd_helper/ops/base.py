"""What every operation shares: refusals, the per-call context, deadlines and the bounded System.

A handler is `handler(call, request) -> dict` (the answer's `result`). It raises `Refused` when the
request is outside the rules (nothing was done) and `Failed` when a tool or the host failed. Every
fact a handler decides on it reads itself, as root: nothing the node says about the host is trusted.

Timeouts are cooperative (threads cannot be killed): each call has a `Deadline`; the `BoundedSystem`
it gets caps every program at min(20 minutes, what is left of the deadline) and refuses to start a
program once the deadline has passed, so an operation ends within its timeout plus one program's
cleanup. Writes through the BoundedSystem go through the root-only rule: it is bcd_shared.rootsystem's
RootOnlySystem with the deadline added.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, read_root_only
from bcd_shared.rootsystem import RootOnlySystem
from bcd_shared.system import DEFAULT_TOOL_TIMEOUT_S, CommandResult, LocalSystem

if TYPE_CHECKING:
    from bcd_helper.audit import AuditLog
    from bcd_helper.config import HelperConfig
    from bcd_helper.intent import IntentVerifier

# daemon.swap's record of a swap waiting for its confirmation (bcd_helper.ops.daemon); here, so that a
# start checks for it without importing the daemon module.
RELEASE_STATE = "/var/lib/bcd-hostconfig/daemon-release.json"


class Refused(Exception):
    """The request is outside the rules; nothing was done."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Failed(Exception):
    """The request was allowed but the host or a tool failed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def refused_path(exc: RootPathRefused) -> Refused:
    return Refused("root-only", str(exc))


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self._end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0


class BoundedSystem(RootOnlySystem):
    """A System for one call: programs bounded by the deadline, writes under the root-only rule."""

    inner: LocalSystem

    def __init__(
        self, inner: LocalSystem, deadline: Deadline, tool_cap: float = DEFAULT_TOOL_TIMEOUT_S
    ) -> None:
        super().__init__(inner)
        self._deadline = deadline
        self._cap = tool_cap

    def read_root_only(self, path: str) -> bytes | None:
        return read_root_only(self.inner.root, path)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TOOL_TIMEOUT_S,
        input: bytes | None = None,
        pass_fds: Sequence[int] = (),
    ) -> CommandResult:
        left = self._deadline.remaining()
        if left <= 0:
            raise Failed("timeout", f"the operation's {self._deadline.seconds:.0f}s ran out before {argv[0]}")
        if pass_fds:  # only then: in-process fakes of the host take the two-argument form
            return self.inner.run(argv, timeout=min(timeout, self._cap, left), input=input, pass_fds=pass_fds)
        return self.inner.run(argv, timeout=min(timeout, self._cap, left), input=input)


@frozen
class Peer:
    pid: int
    uid: int
    gid: int


class HelperContext:
    """Process-wide state of one helper: root's config, the host, the audit log, the op locks."""

    def __init__(
        self,
        *,
        root: Path,
        config: HelperConfig,
        system: LocalSystem,
        audit: AuditLog,
        lock_names: Sequence[str],
    ) -> None:
        self.root = root
        self.config = config
        self.system = system
        self.audit = audit
        self.locks: dict[str, threading.Lock] = {name: threading.Lock() for name in lock_names}
        self._intent: IntentVerifier | None = None
        # daemon.swap's confirmation timer (bcd_helper.ops.daemon), one per helper.
        self.daemon_timer: threading.Timer | None = None
        self.timer_lock = threading.Lock()
        # nft.apply's reference (bcd_helper.ops.nft): the tables' digest, the bridges and the host's
        # addresses on them the rules were built with; None: none loaded.
        self.nft_reference: tuple[str, tuple[str, ...], Any] | None = None
        self.nft_memo: Any = None  # bcd_shared.netpolicy.NicMemo, made by the first nft.apply
        # The NIC policies of the last nft.apply that loaded (empty before one, and while one loads):
        # with roots, a guarded instance starts only with its signed rules in it (nft.require_loaded).
        self.nft_loaded: frozenset[Any] = frozenset()
        self._intent_lock = threading.Lock()
        # helper.ping's version, read from the package metadata on the first ping: the code this process
        # runs is what was installed when it started (a package upgraded under it shows after the restart
        # that runs it), and reading the metadata scans sys.path at every call (~0.3 ms a ping).
        self.version: str | None = None

    def intent_verifier(self) -> IntentVerifier:
        """The signed-intent checks, created (and bcd_shared.pki imported) on the first signed op."""
        with self._intent_lock:
            if self._intent is None:
                from bcd_helper.intent import IntentVerifier

                self._intent = IntentVerifier(self.root, self.config)
            return self._intent


# Root's files that can name command-signing roots (bcd_shared.joinrecord.JOIN_RECORD and
# bcd_helper.intent.STATE_PATH; repeated here so the check below imports neither, nor pki with them).
JOIN_RECORD_PATH = "/var/lib/bcd-hostconfig/join-response.pb"
INTENT_STATE_PATH = "/var/lib/bcd-hostconfig/helper-intent.json"


def no_roots_possible(ctx: HelperContext, presented: object | None) -> bool:
    """True when nothing could name command-signing roots for this request: no pin of either kind in root's
    config, no join record, no intent state (so no bundle ever accepted) and nothing presented. Ops that
    bind to signed intent skip the signed-intent module then (it imports pki: memory and start time)."""
    cfg = ctx.config
    if cfg.join_signing_key_pin is not None or cfg.command_root_sha256 or presented is not None:
        return False
    root = str(ctx.root)  # string joins: this runs on every hold write (pathlib's parsing is not free)
    # os.access(F_OK, not following) is lexists without raising and catching an exception for a file that
    # is not there (the usual answer): ~1 us against ~4 a path.
    return not any(
        os.access(root + p, os.F_OK, follow_symlinks=False) for p in (JOIN_RECORD_PATH, INTENT_STATE_PATH)
    )


class AuditAhead(Protocol):
    """The request's `accepted` audit line written ahead of its effect (server.Connection; docs/helper.md
    "Audit log"): `start` once every check has passed and nothing is written yet, `wait` before the
    handler returns, whatever happened in between (it raises when the line could not be made durable)."""

    def start(self) -> None: ...

    def wait(self) -> None: ...


@frozen
class Call:
    """One request being served. `ahead`: set by the server for the ops that write their audit line
    ahead of their effect (file.write), None elsewhere (in-process calls of the tests: no audit)."""

    ctx: HelperContext
    peer: Peer
    deadline: Deadline
    system: BoundedSystem
    ahead: AuditAhead | None = None
    # Bytes of the server's in-flight budget for a large answer, held until it is sent; False: no room now
    # (None in process: nothing is counted).
    reserve: Callable[[int], bool] | None = None
    # A new pidfd of the process that connected (SO_PEERPIDFD; the caller closes it), None where the
    # kernel has none; raises OSError where the kernel cannot give one for that process (server.peer_pidfd).
    # None in process: no socket, the peer is dated by its pid alone (daemon.confirm, round 11).
    peer_pidfd: Callable[[], int | None] | None = None


Handler = Callable[[Call, Any], dict[str, Any]]
