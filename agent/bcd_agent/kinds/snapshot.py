"""`instance.snapshot` (bulk lane; node; not retry-safe; 6 hours; DLV-KIND-21, DLV-SNAP-13..18).

Payload `InstanceSnapshotRequest{instance_id, include_memory, upload_url}` (Q-DLV-SNAP-01, decided in
docs/instances.md): `instance_id` an instance of the current spec (not DELETED) on a runtime that takes
snapshots; `upload_url` a presigned https URL. A bad field is `invalid-payload`, naming it.

Before any effect: an unknown instance fails `unknown-instance`; a runtime without snapshots (a plugin,
DLV-RT-09) `snapshot-unsupported`; a memory snapshot of an instance with passthrough GPUs or a read-write
volume `snapshot-refused`, with the seeds' messages (DLV-RT-13/14). Then RUNNING, and:
1. the converger is kept off the instance (`hold`), and the runtime captures it into the staging file
   `data_dir/snapshots/staging/<command id>.tar` (the data disk, never a tmpfs; DLV-SNAP-13);
2. bcd hashes the tar and PUTs it to `upload_url` (bcd_agent.sections.instances.transfers: https
   only, redirects only to https, ended by a 2-minute window under 1 MiB or 6 hours in all;
   DLV-SNAP-14, -16..18), failing `transfer-stalled`, `transfer-timeout`, `transfer-refused` or
   `transfer-failed`;
3. the staging file is removed whatever the outcome.
Result `InstanceSnapshotResult{sha256, size_bytes, runtime, cpu_model, includes_memory}`.

A crash leaves the journal entry `running`: the kind is not retry-safe, so the next process reports it
FAILED `interrupted` (the journal's recovery table, DLV-REC-12) and never runs it again; the staging
files it left are deleted when the handler is built at start (DLV-SNAP-15), and before every run (one
bulk worker: no other snapshot is under way).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final

import trio
from bcd_shared import wire
from bcd_shared.errors import StepError
from bcd_shared.instancenames import valid_instance_id
from bcd_shared.system import System

from bcd_agent.dispatch.command import CommandEnvelope
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload, RunContext
from bcd_agent.dispatch.payload import decode_request
from bcd_agent.sections.instances.model import InstanceSpec
from bcd_agent.sections.instances.runtimes.base import SnapshotMeta, SnapshotRefused
from bcd_agent.sections.instances.snapshots import refuse_memory_snapshot
from bcd_agent.sections.instances.transfers import TransferFailed, TransferRules, upload

KIND: Final = "instance.snapshot"
STAGING: Final = "snapshots/staging"


def _request(command: CommandEnvelope) -> wire.InstanceSnapshotRequest:
    request = decode_request(command, wire.InstanceSnapshotRequest)
    if not valid_instance_id(request.instance_id):
        raise InvalidPayload(f"payload.instance_id: {request.instance_id[:80]!r} is not an instance id")
    url = request.upload_url
    if not url.startswith("https://") or any(c.isspace() or ord(c) < 32 for c in url):
        raise InvalidPayload("payload.upload_url: must be a presigned https URL")
    if len(url) > 8192:
        raise InvalidPayload("payload.upload_url: longer than 8192 characters")
    return request


def _sha256(path: str) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


class InstanceSnapshotHandler:
    def __init__(
        self,
        system: System,
        data_dir: str | Path,
        *,
        instance: Callable[[str], InstanceSpec | None],
        runtimes: Callable[[], Mapping[str, Any]],
        hold: Callable[[str], AbstractContextManager[None]] = lambda _n: contextlib.nullcontext(),
        rules: TransferRules | None = None,
    ) -> None:
        self.system = system
        self.staging = Path(system.host_path(f"{str(data_dir).rstrip('/')}/{STAGING}"))
        self.instance = instance
        self.runtimes = runtimes
        self.hold = hold
        self.rules = rules or TransferRules()
        self.clean()

    def clean(self) -> tuple[str, ...]:
        """Delete the staging files an earlier run left (a crash's, DLV-SNAP-15)."""
        removed = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for leftover in self.staging.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
                    removed.append(leftover.name)
        return tuple(removed)

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        return frozenset({f"instance:{_request(command).instance_id}"})

    def _capture(self, command_id: str, inst: InstanceSpec, include_memory: bool, rt: Any) -> Any:
        self.staging.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.staging.parent, 0o700)
        self.clean()
        tar = str(self.staging / f"{command_id}.tar")
        try:
            with self.hold(inst.id):
                meta: SnapshotMeta = rt.snapshot(inst, include_memory, tar)
            sha, size = _sha256(tar)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tar)
            raise
        return tar, meta, sha, size

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        request = _request(command)
        inst = self.instance(request.instance_id)
        if inst is None:
            raise CommandFailed(
                "unknown-instance", f"payload.instance_id: the spec has no instance {request.instance_id}"
            )
        rt = self.runtimes().get(inst.runtime)
        if rt is None or not hasattr(rt, "snapshot"):
            raise CommandFailed(
                "snapshot-unsupported", f"payload.instance_id: the {inst.runtime} runtime takes no snapshots"
            )
        try:
            refuse_memory_snapshot(inst, request.include_memory)
        except SnapshotRefused as exc:
            raise CommandFailed("snapshot-refused", exc.message) from None
        await ctx.begin_effect()
        try:
            tar, meta, sha, size = await trio.to_thread.run_sync(
                self._capture, command.id, inst, request.include_memory, rt
            )
        except SnapshotRefused as exc:
            raise CommandFailed("snapshot-refused", exc.message) from None
        except StepError as exc:
            raise CommandFailed("snapshot-failed", exc.message) from None
        try:
            await trio.to_thread.run_sync(upload, self.system, request.upload_url, tar, self.rules)
        except TransferFailed as exc:
            raise CommandFailed(exc.code, exc.message) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tar)
        return bytes(
            wire.InstanceSnapshotResult(
                sha256=sha,
                size_bytes=size,
                runtime=meta.runtime,
                cpu_model=meta.cpu_model,
                includes_memory=meta.include_memory,
            )
        )
