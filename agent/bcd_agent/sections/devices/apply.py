"""Applying a devices plan: the executors that write holds, and the applier that runs the actions.

Two executors do root's part (the hold files under /etc/cdi and /run, and the slices):
- `DirectExecutor(system)`: bcd node as root (or the simulated host): atomic 0644 writes through
  the System, `systemctl start` + `systemctl set-property --runtime`, `+hugetlb` into the ancestors'
  `cgroup.subtree_control` then `hugetlb.<size>.max`, `systemctl stop` only when `cgroup.events`
  says `populated 0` (read again just before the stop). A running slice whose limits changed gets
  the new ones, and the properties no longer set are reset (`AllowedCPUs=`, `MemoryMax=infinity`,
  ..., huge page limits back to `max`). Acting as root (effective uid 0; `root_only` overrides),
  every write and removal follows the root-only rule: the System is a `units.RootOnlySystem`, and
  cgroup files are written through a verified directory fd without following symlinks;
- `HelperExecutor(client)`: an unprivileged node beside `bcd helper`: `file.write`/`file.remove` of
  kind `cdi` / `allocation-env` with the allocation id (the helper builds the path), `slice.apply` /
  `slice.remove` with the name and limits, and the limits to reset named in `reset` (the helper
  assigns their defaults as the direct executor does). A refusal is HelperRefused (retryable).
The agent's own records (releasing.json 0600, the marker, the event ledger) are in data_dir, which the
agent owns: the applier writes them through the System directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from attrs import frozen
from bcd_shared import cdi
from bcd_shared.errors import RetryableError, StepError
from bcd_shared.rootpath import RootPathRefused, split_host_path, verified_dir
from bcd_shared.system import System
from bcd_shared.units.rootonly import RootOnlySystem, acting_as_root

from bcd_agent.sections.devices import observe
from bcd_agent.sections.devices.events import (
    EventSink,
    FailedEvent,
    ReportSigner,
    failed_event,
    sign_report,
)
from bcd_agent.sections.devices.plan import (
    Action,
    ApplySlice,
    Emit,
    ForgetEventKeys,
    Ledger,
    Plan,
    RemoveEnv,
    RemoveMarker,
    RemoveSpec,
    SetAsideReleases,
    Step,
    StopSlice,
    WriteEnv,
    WriteLedger,
    WriteReleases,
    WriteSpec,
)
from bcd_agent.sections.devices.slices import (
    CGROUP_ROOT,
    HUGETLB_FILES,
    PARENT_CGROUP,
    RESET_VALUES,
    SliceSpec,
    reset_fields,
    slice_cgroup,
)


def _write_kernel_file(root: Path, path: str, data: bytes) -> None:
    """Write an existing kernel (cgroupfs) file in place, through directories checked root-only from
    `/` down and without following a symlink at any component (as the helper does)."""
    parts = split_host_path(path)
    with verified_dir(root, parts[:-1], create=False) as dfd:
        fd = os.open(
            parts[-1], os.O_WRONLY | os.O_TRUNC | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd
        )
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


class HoldExecutor(Protocol):
    """Root's part of a hold. Every method raises a StepError (RetryableError / HelperRefused) on failure."""

    def write_cdi(self, allocation_id: str, data: bytes) -> None: ...

    def remove_cdi(self, allocation_id: str) -> None: ...

    def write_env(self, allocation_id: str, data: bytes) -> None: ...

    def remove_env(self, allocation_id: str) -> None: ...

    def apply_slice(self, spec: SliceSpec, reset: tuple[str, ...] = ()) -> None: ...

    def stop_slice(self, name: str) -> None: ...


class DirectExecutor:
    """Writes holds directly (bcd node as root, or the simulated host)."""

    def __init__(self, system: System, *, slice_records: bool = False, root_only: bool | None = None) -> None:
        self.root_only = acting_as_root() if root_only is None else root_only
        self.system: System = RootOnlySystem(system) if self.root_only else system
        # A fakehw host keeps slices as JSON records under /run/bcd/slices (DEV-SLICE-25).
        self.slice_records = slice_records

    def _write(self, path: str, data: bytes) -> None:
        try:
            self.system.write_atomic(path, data, 0o644)
        except OSError as exc:
            raise RetryableError("WriteFailed", f"writing {path}: {exc}") from None

    def _remove(self, path: str) -> None:
        try:
            self.system.remove(path)
        except OSError as exc:
            raise RetryableError("RemoveFailed", f"removing {path}: {exc}") from None

    def write_cdi(self, allocation_id: str, data: bytes) -> None:
        cdi.parse_hold_spec(data, allocation_id)  # never write what bcd itself could not read back
        self._write(cdi.cdi_spec_path(allocation_id), data)

    def remove_cdi(self, allocation_id: str) -> None:
        self._remove(cdi.cdi_spec_path(allocation_id))

    def write_env(self, allocation_id: str, data: bytes) -> None:
        self._write(cdi.env_file_path(allocation_id), data)

    def remove_env(self, allocation_id: str) -> None:
        self._remove(cdi.env_file_path(allocation_id))

    def _systemctl(self, *args: str) -> None:
        result = self.system.run(["systemctl", *args], timeout=120)
        if not result.ok:
            raise RetryableError("SliceFailed", f"systemctl {args[0]} {args[1]}: {result.describe()}")

    def _cgwrite(self, path: str, text: str) -> None:
        # cgroupfs files are written in place (no temporary file, no rename).
        try:
            if self.root_only:
                _write_kernel_file(self.system.root, path, text.encode())
            else:
                with open(self.system.host_path(path), "w") as f:
                    f.write(text)
        except RootPathRefused as exc:
            raise RetryableError("RootOnly", str(exc)) from None
        except OSError as exc:
            raise RetryableError("SliceFailed", f"writing {text.strip()!r} to {path}: {exc}") from None

    def _record(self, name: str) -> str:
        return f"{observe.SLICE_RECORDS_DIR}/{name}.json"

    def apply_slice(self, spec: SliceSpec, reset: tuple[str, ...] = ()) -> None:
        if self.slice_records:
            old = self.system.read_bytes(self._record(spec.name))
            rec = json.loads(old) if old else {"populated": False, "hugetlb_current": {}}
            rec["properties"] = dict(spec.properties)  # the record is rewritten whole: resets included
            rec["hugetlb_max"] = {str(k): v for k, v in spec.hugetlb_max}
            self._write(self._record(spec.name), (json.dumps(rec, sort_keys=True) + "\n").encode())
            return
        self._systemctl("start", spec.name)
        assignments = [f"{k}={RESET_VALUES[k]}" for k in reset if k in RESET_VALUES]
        assignments += [f"{k}={v}" for k, v in spec.properties]
        if assignments:
            self._systemctl("set-property", "--runtime", spec.name, *assignments)
        if spec.hugetlb_max:
            for parent in (CGROUP_ROOT, f"{CGROUP_ROOT}/bcd.slice", PARENT_CGROUP):
                self._cgwrite(f"{parent}/cgroup.subtree_control", "+hugetlb\n")
            for size, limit in spec.hugetlb_max:
                self._cgwrite(f"{spec.cgroup}/{HUGETLB_FILES[size]}.max", f"{limit}\n")
        for stem in HUGETLB_FILES.values():
            if stem in reset:
                self._cgwrite(f"{spec.cgroup}/{stem}.max", "max\n")

    def stop_slice(self, name: str) -> None:
        if self.slice_records:
            state = observe.read_slice_records(self.system).get(name)
            if state is not None and not state.populated:
                self._remove(self._record(name))
            return
        events = self.system.read_text(f"{slice_cgroup(name)}/cgroup.events") or ""
        if any(line.split() == ["populated", "1"] for line in events.splitlines()):
            return  # a workload still runs there: a release never kills it; a later pass retries
        self._systemctl("stop", name)


class HelperClientLike(Protocol):
    def file_write(
        self, kind: str, ident: str, content: bytes | str, intent: Mapping[str, Any] | None = ...
    ) -> object: ...

    def file_remove(self, kind: str, ident: str, intent: Mapping[str, Any] | None = ...) -> bool: ...

    def slice_apply(
        self,
        name: str,
        *,
        cpus: str | None = ...,
        mems: str | None = ...,
        cpu_millis: int | None = ...,
        memory_bytes: int | None = ...,
        hugepages_2mi: int | None = ...,
        hugepages_1gi: int | None = ...,
        reset: Sequence[str] = ...,
        intent: Mapping[str, Any] | None = ...,
    ) -> object: ...

    def slice_remove(self, name: str) -> object: ...


def _no_intent() -> Mapping[str, Any] | None:
    return None


class HelperExecutor:
    """Asks the root helper for each write (bcd_agent.helperclient.HelperClient). `intent` gives the
    signed spec the node keeps (sections.host.intent.intent_args), sent with every hold write, removal and
    slice.apply: with command-signing roots, root binds holds and their slices' limits to the spec's
    devices section (issue 9 item 8; helper round 5)."""

    def __init__(
        self, client: HelperClientLike, intent: Callable[[], Mapping[str, Any] | None] = _no_intent
    ) -> None:
        self.client = client
        self.intent = intent

    def write_cdi(self, allocation_id: str, data: bytes) -> None:
        self.client.file_write("cdi", allocation_id, data, self.intent())

    def remove_cdi(self, allocation_id: str) -> None:
        self.client.file_remove("cdi", allocation_id, self.intent())

    def write_env(self, allocation_id: str, data: bytes) -> None:
        self.client.file_write("allocation-env", allocation_id, data, self.intent())

    def remove_env(self, allocation_id: str) -> None:
        self.client.file_remove("allocation-env", allocation_id, self.intent())

    def apply_slice(self, spec: SliceSpec, reset: tuple[str, ...] = ()) -> None:
        # The same properties as the direct executor: a 0 CPU quota or memory limit is no limit
        # (slices.slice_spec), and the properties the spec dropped are reset in the same call,
        # named by their limit (slice.apply's `reset`).
        lim = spec.limits
        self.client.slice_apply(
            spec.name,
            cpus=lim.cpus or None,
            mems=lim.mems or None,
            cpu_millis=lim.cpu_millis or None,
            memory_bytes=lim.memory_bytes or None,
            hugepages_2mi=lim.hugepages_2mi,
            hugepages_1gi=lim.hugepages_1gi,
            reset=reset_fields(reset),
            intent=self.intent(),  # with roots, root takes only the signed assignment's limits
        )

    def stop_slice(self, name: str) -> None:
        self.client.slice_remove(name)


@frozen
class ApplyResult:
    errors: tuple[tuple[str, str], ...]  # (action key, message)
    changed: bool
    done: frozenset[str]


class Applier:
    """Runs a plan's actions in order. Emits go to the sink (journaled before they are sent)."""

    def __init__(
        self,
        executor: HoldExecutor,
        system: System,
        data_dir: str,
        sink: EventSink,
        signer: ReportSigner,
        log: Callable[[str], None] | None = None,
        workers: int = 16,
    ) -> None:
        self.workers = workers
        self.executor = executor
        self.system = system
        self.data_dir = data_dir
        self.sink = sink
        self.signer = signer
        self.log = log or (lambda _msg: None)

    def run(self, plan: Plan) -> ApplyResult:
        """Run the actions in plan order. A run of consecutive bind/keep actions (distinct allocations,
        distinct files) has its file steps run on a small thread pool, since each durable write waits
        on fsync; each action's steps still run in their order, and its events are emitted in plan
        order once its own files are in place."""
        errors: list[tuple[str, str]] = []
        failed: set[str] = set()
        done: set[str] = set()
        # The keys of the events journaled by actions that completed: only those are forgotten.
        self._journaled: set[str] = set()
        changed = False
        actions = list(plan.actions)
        i = 0
        while i < len(actions):
            j = i
            while j < len(actions) and actions[j].kind in ("bind", "keep") and self.workers > 1:
                j += 1
            batch = actions[i:j] if j > i + 1 else [actions[i]]
            i += len(batch)
            if len(batch) > 1:
                with ThreadPoolExecutor(max_workers=self.workers) as pool:
                    outcomes = list(pool.map(lambda a: self._files(a, failed), batch))
            else:
                outcomes = [self._files(batch[0], failed)]
            for action, (ok, action_changed, message) in zip(batch, outcomes, strict=True):
                changed |= action_changed
                if ok and action.kind in ("bind", "keep"):
                    try:
                        for step in action.steps:
                            if isinstance(step, Emit):
                                self._step(step)
                    except StepError as exc:
                        ok, message = False, exc.message
                if not ok:
                    errors.append((action.key, message))
                    failed.add(action.key)
                    self.log(f"devices: {action.key}: {message}")
                else:
                    done.add(action.key)
                    self._journaled |= {s.key for s in action.steps if isinstance(s, Emit) and s.key}
        return ApplyResult(tuple(errors), changed, frozenset(done))

    def _files(self, action: Action, failed: set[str]) -> tuple[bool, bool, str]:
        """Run an action's steps other than its events: (ok, changed, message)."""
        if action.after & failed:
            return False, False, "waits for a release that failed in this pass"
        if action.kind == "ledger":
            action = self._ledger_without(action, failed)  # only record events that were sent
        changed = False
        try:
            for step in action.steps:
                if isinstance(step, Emit):
                    if action.kind not in ("bind", "keep"):
                        self._step(step)  # releases: the event goes out between its steps, in order
                    continue
                changed |= self._step(step)
        except StepError as exc:
            return False, changed, exc.message
        return True, changed, ""

    def _ledger_without(self, action: Action, failed: set[str]) -> Action:
        """The ledger action as the pass went: the events of failed actions are not recorded as
        sent, the releases under way that did not journal their event stay recorded (the ledger on
        disk holds those the pass recorded), and only the keys of journaled events are forgotten."""
        step = action.steps[0]
        assert isinstance(step, WriteLedger)
        forget = tuple(
            k
            for s in action.steps[1:]
            if isinstance(s, ForgetEventKeys)
            for k in s.keys
            if k in self._journaled
        )
        ledger = step.ledger
        if failed:
            allocs = {k.split(":", 1)[1] for k in failed if ":" in k}
            fail = {} if "failures" in failed else dict(ledger.failed)
            on_disk = observe.read_ledger(self.system, self.data_dir)
            # A failed action's allocation keeps what the ledger recorded before the pass: its new
            # event was not sent, and the hold it failed to release or write over may still be the
            # one whose AllocationBound was (dropping it would make that hold owe it again).
            ledger = Ledger(
                bound={
                    **{k: v for k, v in ledger.bound.items() if k not in allocs},
                    **{k: v for k, v in on_disk.bound.items() if k in allocs},
                },
                failed=fail,
                releasing={
                    **{k: e for k, e in on_disk.releasing.items() if k not in self._journaled},
                    **ledger.releasing,
                },
            )
        forgets = (ForgetEventKeys(forget),) if forget else ()
        return Action(action.key, action.kind, (WriteLedger(ledger), *forgets))

    def _data(self, name: str) -> str:
        return f"{self.data_dir}/{name}"

    def _step(self, step: Step) -> bool:
        ex = self.executor
        if isinstance(step, WriteSpec):
            ex.write_cdi(step.allocation_id, cdi.encode_spec(step.doc))
        elif isinstance(step, RemoveSpec):
            ex.remove_cdi(step.allocation_id)
        elif isinstance(step, WriteEnv):
            ex.write_env(step.allocation_id, cdi.encode_env_file(step.lines))
        elif isinstance(step, RemoveEnv):
            ex.remove_env(step.allocation_id)
        elif isinstance(step, ApplySlice):
            if step.reset:
                ex.apply_slice(step.slice, step.reset)
            else:
                ex.apply_slice(step.slice)
        elif isinstance(step, StopSlice):
            ex.stop_slice(step.name)
        elif isinstance(step, WriteReleases):
            self._own_write(observe.RELEASES_FILE, observe.encode_releases(step.releases), 0o600)
        elif isinstance(step, SetAsideReleases):
            src = self.system.host_path(self._data(observe.RELEASES_FILE))
            dst = self.system.host_path(self._data(f"{observe.RELEASES_FILE}.unreadable-{step.suffix}"))
            self._own_write(
                observe.MARKER_FILE,
                b"releasing.json could not be read; see releasing.json.unreadable-*\n",
                0o600,
            )
            try:
                os.replace(src, dst)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise RetryableError("ReleasesFile", f"setting {src} aside: {exc}") from None
        elif isinstance(step, RemoveMarker):
            self.system.remove(self._data(observe.MARKER_FILE))
        elif isinstance(step, Emit):
            event = step.event
            if isinstance(event, FailedEvent):
                self.sink.emit(failed_event(event))
            elif step.key is None:
                self.sink.emit(sign_report(self.signer, event))
            else:
                self.sink.emit(sign_report(self.signer, event), step.key)
            return False
        elif isinstance(step, ForgetEventKeys):
            self.sink.forget_keys(step.keys)
            return False
        elif isinstance(step, WriteLedger):
            self._own_write(observe.LEDGER_FILE, observe.encode_ledger(step.ledger), 0o600)
            return False
        return True

    def _own_write(self, name: str, data: bytes, mode: int) -> None:
        try:
            self.system.write_atomic(self._data(name), data, mode)
        except OSError as exc:
            raise RetryableError("DataDirWrite", f"writing {self._data(name)}: {exc}") from None
