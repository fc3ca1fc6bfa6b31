"""The XID watcher: NVIDIA XID errors of this boot as node conditions (docs/devices.md "XID errors").

A trio service in the node's tree (`await nursery.start(watcher.run)`). Every POLL_INTERVAL_S it asks
journald for the kernel's entries of this boot after the cursor it holds (`journal_argv`: matches
`_TRANSPORT=kernel SYSLOG_FACILITY=0 _BOOT_ID=<boot>`, at most `chunk` entries a call, again until a
call returns fewer), folds them into the pure `XidState` (bcd_agent.inventory.xid), writes the state
to data_dir/xid.json (atomic, fsynced) and hands the runner one `XidError` condition per GPU
(`ConvergeRunner.set_conditions`), so StatusReport and `bcd status` carry them.

- The state file carries the boot id: an agent restarted in the same boot keeps the XIDs (and the
  clears) and reads on after its cursor; on a new boot the file is forgotten and the log read from the
  boot's start. A file that fails its strict read is set aside the same way, with a warning.
- `gpus_reset(result)`: the gpu.reset handler's report. Each GPU that reset and reads healthy loses
  its XIDs at once (DLV-RST-14, DEV-BUSY-12): the log is read up to now first (lines the reset itself
  caused are cleared with the rest), then the state is cleared, written and published before the
  command's result goes out. A GPU that reset but reads unhealthy, or did not reset, keeps them.
- `xids(uuid)`, `by_gpu()`: the distinct codes this boot (`diag.nvml`'s `GpuHealth.xids`).
- Reading needs journald's system journal: the agent's account in group `systemd-journal` (the
  deploy unit grants it, SupplementaryGroups=; the DaemonSet mounts the host's journal and grants its
  gid through the pod's supplementalGroups) or root. journalctl without it prints only a hint on
  stderr; the watcher then says once that XIDs are not seen (`blind`), and `bcd doctor` fails the check.

No module-level state; the clock is trio's (MockClock in tests).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import trio
from bcd_shared import wire
from bcd_shared.system import CommandResult, System, atomic_write

from bcd_agent.converge.types import Condition
from bcd_agent.inventory.gpus import GpuInventory
from bcd_agent.inventory.xid import (
    XidState,
    XidStateError,
    address_of_bus_id,
    apply_entries,
    clear,
    cursor_of,
    from_json,
    parse_entry,
    to_json,
    uuid_map,
    xid_conditions,
)

log = logging.getLogger("bcd.xid")

JOURNALCTL = "journalctl"
JOURNAL_DIRS = ("/var/log/journal", "/run/log/journal")  # journald's persistent and volatile journal
STATE_FILE = "xid.json"
SOURCE = "xid"  # ConvergeRunner.set_conditions' source
POLL_INTERVAL_S = 10.0
CHUNK = 1000  # entries a journalctl call returns at most (memory per call: ~0.5 MB)
MAX_CHUNKS_PER_POLL = 50  # a backlog beyond this waits for the next poll
TOOL_TIMEOUT_S = 60.0
# gpu.reset reads the log up to now before it clears; a journalctl that hangs must not hold the
# command's result: after this long the clear goes ahead with what was read.
RESET_DRAIN_S = 20.0
# journalctl's hint when the caller may read only its own journal (not the kernel's entries).
NOT_SEEING = b"not seeing messages from other users and the system"
_CURSOR = re.compile(r"[0-9A-Za-z=;]{1,512}")


def journal_argv(boot_id: str, cursor: str, chunk: int = CHUNK, extra: tuple[str, ...] = ()) -> list[str]:
    """This boot's kernel entries after `cursor` (from the boot's start without one), oldest first, at
    most `chunk`. Matches on different fields are ANDed by journalctl. `extra`: `--file=…` in tests."""
    argv = [
        JOURNALCTL,
        *extra,
        "--no-pager",
        "--quiet",
        "--output=json",
        "--output-fields=MESSAGE,SYSLOG_FACILITY,_TRANSPORT",
        f"--lines={chunk}",
    ]
    # Without a cursor: --since (not the tail that --lines alone shows) so the boot is read from its start.
    argv.append(f"--after-cursor={cursor}" if cursor and _CURSOR.fullmatch(cursor) else "--since=@0")
    argv += ["_TRANSPORT=kernel", "SYSLOG_FACILITY=0", f"_BOOT_ID={boot_id.replace('-', '')}"]
    return argv


def inventory_uuids(gpus: GpuInventory | None) -> dict[str, str]:
    """NVRM's address (0000:3b:00) -> GPU UUID, from nvidia-smi's pci.bus_id (00000000:3B:00.0)."""
    out: dict[str, str] = {}
    for g in gpus.gpus if gpus is not None else ():
        address = address_of_bus_id(g.bus_id)
        if address is not None:
            out[address] = g.uuid
    return out


class XidWatcher:
    def __init__(
        self,
        system: System,
        data_dir: str,
        boot_id: str,
        publish: Callable[[tuple[Condition, ...]], None],
        inventory: Callable[[], GpuInventory | None] = lambda: None,
        *,
        poll_interval_s: float = POLL_INTERVAL_S,
        chunk: int = CHUNK,
        journal_extra: tuple[str, ...] = (),
    ) -> None:
        self.system = system
        self.path = Path(data_dir) / STATE_FILE
        self.boot_id = boot_id
        self.publish = publish
        self.inventory = inventory
        self.poll_interval_s = poll_interval_s
        self.chunk = chunk
        self.journal_extra = journal_extra
        self.state = XidState(boot_id)
        self.blind = ""  # why the kernel's entries cannot be read ("" while they can)
        self.polls = 0
        self._lock = trio.Lock()
        self._since: dict[str, float] = {}  # condition reason -> when this process first raised it
        self._known: dict[str, str] = {}  # the last inventory's address -> UUID (kept when a GPU drops off)
        self._stale = False  # the file holds another boot's (or a refused) state: rewrite it

    # --- state ------------------------------------------------------------------------------------

    def load(self) -> None:
        """This boot's state from data_dir/xid.json; another boot's, or a bad file, is forgotten."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning(
                "xid: %s unreadable, the kernel log is read from the boot's start: %s", self.path, exc
            )
            return
        try:
            state = from_json(data)
        except XidStateError as exc:
            log.warning("xid: %s refused, the kernel log is read from the boot's start: %s", self.path, exc)
            self._stale = True
            return
        if state.boot_id != self.boot_id:
            log.info("xid: %s is of boot %s: a new boot starts without XIDs", self.path, state.boot_id)
            self._stale = True
            return
        self.state = state

    def _commit(self, new: XidState) -> None:
        if new == self.state and not self._stale:
            return
        try:
            atomic_write(self.path, to_json(new), mode=0o640)
            self._stale = False
        except OSError as exc:  # the state is kept in memory: an agent restart may then see XIDs again
            log.warning("xid: %s not written: %s", self.path, exc)
        self.state = new
        self._publish()

    def uuids(self) -> dict[str, str]:
        self._known.update(inventory_uuids(self.inventory()))
        return uuid_map(self.state, self._known)

    def _publish(self) -> None:
        conditions = xid_conditions(self.state, self.uuids())
        now = trio.current_time()
        live = {c.reason for c in conditions}
        self._since = {r: t for r, t in self._since.items() if r in live}
        stamped = tuple(
            attrs.evolve(c, since_monotonic=self._since.setdefault(c.reason, now)) for c in conditions
        )
        self.publish(stamped)

    def xids(self, uuid: str) -> tuple[int, ...]:
        return self.by_gpu().get(uuid, ())

    def by_gpu(self) -> dict[str, tuple[int, ...]]:
        """Each GPU with XIDs this boot (its UUID, or `PCI:<address>` while none is known) -> its codes."""
        uuids = self.uuids()
        return {uuids.get(a, f"PCI:{a}"): self.state.codes(a) for a in self.state.gpus if self.state.codes(a)}

    # --- reading ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.load()
        self._publish()
        task_status.started()
        while True:
            try:
                await self.poll()
            except Exception:  # the node goes on without XIDs rather than stop; the next poll retries
                log.exception("xid: reading the kernel log failed")
            await trio.sleep(self.poll_interval_s)

    async def poll(self) -> None:
        async with self._lock:
            await self._drain()
            # Also after a fresh inventory alone: an address may now have its UUID (the reason).
            self._publish()

    async def _drain(self) -> None:
        for _ in range(MAX_CHUNKS_PER_POLL):
            argv = journal_argv(self.boot_id, self.state.cursor, self.chunk, self.journal_extra)
            # Abandoned on cancel (gpu.reset's bound): the orphan journalctl ends within its own timeout.
            result: CommandResult = await trio.to_thread.run_sync(self._run, argv, abandon_on_cancel=True)
            self.polls += 1
            if not result.ok:
                self._set_blind(result.describe())
                return
            lines = result.stdout.splitlines()
            if NOT_SEEING in result.stderr:
                self._set_blind(
                    "journalctl shows only this account's own entries: give it the journal's group "
                    "(systemd-journal; in the Kubernetes DaemonSet, the host journal's gid in the pod's "
                    "supplementalGroups)"
                )
            elif not lines and not self.state.cursor and not any(map(self.system.exists, JOURNAL_DIRS)):
                # journalctl --quiet finds no journal files and says nothing: a container without
                # the host's journal mounted (the DaemonSet before it mounted one).
                self._set_blind(
                    f"there is no journal at {' or '.join(JOURNAL_DIRS)}, so journalctl reads nothing (in a "
                    "container: mount the host's /var/log, /run/log and /etc/machine-id read-only, as "
                    "deploy/kubernetes/bcd-daemonset.yaml does)"
                )
            else:
                self._set_blind("")
            entries = []
            last = ""
            for line in lines:
                last = cursor_of(line) or last
                entry = parse_entry(line, self.boot_id)
                if entry is not None:
                    entries.append(entry)
            new = apply_entries(self.state, entries)
            if last and new.cursor != last:  # past entries refused, too
                new = attrs.evolve(new, cursor=last)
            self._commit(new)
            if len(lines) < self.chunk:
                return

    def _run(self, argv: list[str]) -> CommandResult:
        try:
            return self.system.run(argv, timeout=TOOL_TIMEOUT_S)
        except OSError as exc:  # not executable, no memory to fork: the log is not read this time
            return CommandResult(tuple(argv), 126, b"", str(exc).encode())

    def _set_blind(self, why: str) -> None:
        if why != self.blind:
            if why:
                log.warning(
                    "xid: the kernel log cannot be read, XID errors are not seen: %s"
                    " (`bcd doctor`, check kernel-log, names the fix)",
                    why,
                )
            else:
                log.info("xid: the kernel log is readable again")
        self.blind = why

    # --- gpu.reset ----------------------------------------------------------------------------------

    async def gpus_reset(self, result: wire.GpuResetResult) -> None:
        """Each GPU that reset and reads healthy loses its XIDs at once (DLV-RST-14, DEV-BUSY-12)."""
        healthy = [o.gpu_uuid for o in result.gpus if o.reset and o.healthy]
        if not healthy:
            return
        async with self._lock:
            with trio.move_on_after(RESET_DRAIN_S) as scope:
                await self._drain()
            if scope.cancelled_caught:
                log.warning("xid: the kernel log was not read up to the reset within %g s", RESET_DRAIN_S)
            by_uuid: Mapping[str, str] = {u: a for a, u in self.uuids().items()}
            cleared = [by_uuid[u] for u in healthy if u in by_uuid]
            if cleared:
                log.info("xid: reset and healthy, XIDs cleared: %s", ", ".join(healthy))
            self._commit(clear(self.state, cleared))
