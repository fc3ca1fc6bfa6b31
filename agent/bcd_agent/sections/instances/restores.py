"""`restore_from` downloads, in the background (docs/instances.md "Snapshots and restores").

The converger asks `states(wanted)` once per pass for the snapshots its new instances restore from
(SHA-256 -> URL) and never waits on a transfer (DLV-SNAP-08/09): a snapshot not yet on disk starts
downloading and its instance waits "for the user data or snapshot"; the pass goes on with its deletes,
firewall rules and other instances. A download's end calls `on_done` (the node triggers a pass,
DLV-SNAP-10). A failed download is reported for `retry_s` (a minute) before it is tried again
(DLV-SNAP-11); a digest mismatch fails the instance for that minute (DLV-SNAP-05).

Files, all in `data_dir/snapshots/` (0700, the data disk): `<sha256>.tar`, a verified snapshot, made
0600 and renamed into place only after its digest matched (DLV-SNAP-02); `.<sha256>.part`, a download
under way, removed whatever its outcome and, when no download runs, by `prune` (a crash's). `prune`
deletes every `<sha256>.tar` no spec instance restores from any more, on every pass (DLV-SNAP-12).
`staging/` belongs to `instance.snapshot` (kinds/snapshot.py) and is never touched here.

Downloads run one per snapshot, through `start` (the node's: a task in its nursery running the
blocking transfer in a worker thread, see `serve`; tests: a thread).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from attrs import frozen
from bcd_shared.system import System

from bcd_agent.sections.instances.transfers import TransferFailed, TransferRules, download

log = logging.getLogger("bcd.instances")

SNAPSHOTS_DIR: Final = "snapshots"
RETRY_S: Final = 60.0
_TAR = re.compile(r"^([0-9a-f]{64})\.tar$")
_PART = re.compile(r"^\.([0-9a-f]{64})\.part$")


@frozen
class SnapshotState:
    """One snapshot's download, as a pass sees it."""

    path: str | None = None  # the verified tar (a real path), ready to restore
    running: bool = False
    failed: str | None = None  # the last failure, reported until it is tried again
    mismatch: bool = False  # that failure was a digest mismatch: the instance fails (DLV-SNAP-05)


def _thread_start(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="bcd-snapshot-download", daemon=True).start()


class SnapshotDownloads:
    def __init__(
        self,
        system: System,
        data_dir: str,
        *,
        rules: TransferRules | None = None,
        on_done: Callable[[], None] = lambda: None,
        start: Callable[[Callable[[], None]], None] = _thread_start,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = RETRY_S,
    ) -> None:
        self.system = system
        self.dir = f"{data_dir.rstrip('/')}/{SNAPSHOTS_DIR}"
        self.rules = rules or TransferRules()
        self.on_done = on_done
        self.start = start
        self.clock = clock
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._failed: dict[str, tuple[float, str, bool]] = {}  # sha -> (when, message, mismatch)

    def _real(self, path: str) -> str:
        return str(self.system.host_path(path))

    def tar_path(self, sha256: str) -> str:
        return self._real(f"{self.dir}/{sha256}.tar")

    def _ensure_dir(self) -> None:
        real = self.system.host_path(self.dir)
        real.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(real, 0o700)

    def states(
        self, wanted: Mapping[str, str], limits: Mapping[str, int] | None = None
    ) -> dict[str, SnapshotState]:
        """Each wanted snapshot's state (SHA-256 -> URL); starts the downloads that are due, each
        capped at `limits[sha]` bytes when given (plan.restore_limits)."""
        limits = limits or {}
        out: dict[str, SnapshotState] = {}
        due: list[tuple[str, str]] = []
        if wanted:
            try:
                self._ensure_dir()
            except OSError as exc:  # the instances wait, saying why; the next pass tries again
                why = f"restore_from: {self.dir} cannot be made: {exc.strerror}"
                return {sha: SnapshotState(failed=why) for sha in wanted}
        now = self.clock()
        with self._lock:
            for sha, url in wanted.items():
                if os.path.isfile(self.tar_path(sha)):
                    out[sha] = SnapshotState(path=self.tar_path(sha))
                elif sha in self._running:
                    out[sha] = SnapshotState(running=True)
                elif sha in self._failed and now - self._failed[sha][0] < self.retry_s:
                    _when, message, mismatch = self._failed[sha]
                    out[sha] = SnapshotState(failed=message, mismatch=mismatch)
                else:
                    self._failed.pop(sha, None)
                    self._running.add(sha)
                    due.append((sha, url))
                    out[sha] = SnapshotState(running=True)
        for sha, url in due:
            cap = limits.get(sha)
            self.start(lambda sha=sha, url=url, cap=cap: self._download(sha, url, cap))  # type: ignore[misc]
        return out

    def _download(self, sha: str, url: str, max_bytes: int | None = None) -> None:
        part = self._real(f"{self.dir}/.{sha}.part")
        failure: tuple[str, bool] | None = None
        try:
            digest = download(self.system, url, part, self.rules, self.clock, max_bytes)
            if digest != sha:
                failure = (f"restore_from.sha256: the snapshot's SHA-256 is {digest}, not {sha}", True)
            else:
                os.chmod(part, 0o600)
                os.replace(part, self.tar_path(sha))
        except TransferFailed as exc:
            failure = (f"restore_from: {exc.code}: {exc.message}", False)
        except OSError as exc:
            failure = (f"restore_from: the download could not be stored: {exc}", False)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            with self._lock:
                self._running.discard(sha)
                if failure is not None:
                    self._failed[sha] = (self.clock(), failure[0], failure[1])
            if failure is not None:
                log.warning("instances: snapshot %s: %s", sha[:12], failure[0])
            self.on_done()

    def prune(self, keep: Iterable[str]) -> tuple[str, ...]:
        """Delete the snapshots no spec restores from and the partial files no download writes
        (DLV-SNAP-12); the names removed."""
        keep = set(keep)
        removed = []
        with self._lock:
            running = set(self._running)
        for name in self.system.listdir(self.dir):
            tar, part = _TAR.match(name), _PART.match(name)
            if (tar and tar.group(1) not in keep) or (part and part.group(1) not in running):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._real(f"{self.dir}/{name}"))
                removed.append(name)
        return tuple(removed)

    async def serve(self) -> None:
        """The node's starter: each download a task of this nursery, its blocking transfer in a worker
        thread (abandoned on cancel: curl's own limits end it)."""
        import math

        import trio

        send, recv = trio.open_memory_channel[Callable[[], None]](math.inf)
        token = trio.lowlevel.current_trio_token()

        def start(fn: Callable[[], None]) -> None:
            trio.from_thread.run_sync(send.send_nowait, fn, trio_token=token)

        self.start = start
        async with trio.open_nursery() as nursery:
            async for fn in recv:
                nursery.start_soon(_in_thread, fn)


async def _in_thread(fn: Callable[[], None]) -> None:
    import trio

    await trio.to_thread.run_sync(fn, abandon_on_cancel=True)
