"""`diag.dcgm` (provision lane; ramdisk, node; retry-safe, attested; 1 hour; DLV-KIND-18).

Payload `DiagDcgmRequest{level, gpu_uuids}`: `level` 1 to 4 (`dcgmi diag -r`), `gpu_uuids` the GPUs to
run on (empty: every GPU); anything else, or a GPU named twice, is `invalid-payload`. Locks `gpu:<uuid>` of
each named GPU (an empty list names none: the run is read-mostly below level 2, and from level 2 the busy
check below refuses GPUs with holders).

1. The GPUs from a fresh inventory (`nvidia-smi`): a named GPU it does not list fails `unknown-gpu`.
2. From level 2 the gpu.reset busy check (DLV-RST-06, DEV-BUSY-07; sections.devices.busy.dcgm_busy_check):
   a GPU a live hold, a pending Kubernetes release, a VM or the unknown-release marker claims fails the
   whole command `gpu-busy`, before anything runs.
3. RUNNING, then `dcgmi diag -r <level> -j [-i <indexes>]` (the node runs it: dcgmi only asks DCGM's host
   engine, which does the work as root). No dcgmi is `dcgmi-missing`; output without a JSON document
   fails `dcgmi` with what it printed. dcgmi's own exit status is not the verdict (it exits non-zero when
   a test fails): the document is.
4. `parse_diag` turns the document into `DiagDcgmResult{passed, tests: DcgmTest{name, gpu_uuid, outcome,
   message}}`: one DcgmTest per test and GPU (a result for all GPUs, DCGM 3's software tests, has
   `gpu_uuid` empty), `outcome` pass | fail | warn | skip, `message` the warnings then the info lines.
   `passed` is true when no test failed and at least one passed. A status word bcd does not know is
   `fail` (an unknown word is not evidence of health). Both DCGM 4 (`DCGM Diagnostic`, `entity_id`) and
   DCGM 3 (`DCGM GPU Diagnostic`, `gpu_ids`) documents are read. Bounded: at most 512 entries, each
   message at most 1000 characters, dcgmi's output at most 8 MiB.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final

import trio
from bcd_shared import wire
from bcd_shared.system import System

from bcd_agent.dispatch.command import CommandEnvelope
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload, RunContext, gpu_resource
from bcd_agent.dispatch.payload import decode_request

KIND: Final = "diag.dcgm"
LEVEL_TIMEOUT_S: Final = {1: 600.0, 2: 1800.0, 3: 3000.0, 4: 3300.0}  # inside the kind's hour
MAX_TESTS: Final = 512
MAX_MESSAGE: Final = 1000
MAX_OUTPUT: Final = 8 * 1024 * 1024
_OUTCOMES: Final = {
    "pass": "pass",
    "fail": "fail",
    "warn": "warn",
    "warning": "warn",
    "skip": "skip",
    "skipped": "skip",
    "not run": "skip",
}


class DcgmOutputError(ValueError):
    """dcgmi printed no diagnostic document bcd can read."""


def _request(command: CommandEnvelope) -> tuple[int, tuple[str, ...]]:
    request = decode_request(command, wire.DiagDcgmRequest)
    if not 1 <= request.level <= 4:
        raise InvalidPayload(f"payload.level: {request.level} is not a dcgmi diag run level (1 to 4)")
    uuids = tuple(request.gpu_uuids)
    twice = sorted({u for u in uuids if uuids.count(u) > 1})
    if twice:
        raise InvalidPayload(f"payload.gpu_uuids: names {', '.join(twice)} more than once")
    return request.level, uuids


def _document(output: str) -> dict[str, Any]:
    """The JSON object in dcgmi's output (dcgmi may print a banner line before it)."""
    start = output.find("{")
    if start < 0:
        raise DcgmOutputError("no JSON document")
    try:
        doc, _end = json.JSONDecoder().raw_decode(output, start)
    except json.JSONDecodeError as exc:
        raise DcgmOutputError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise DcgmOutputError("the document is not a JSON object")
    return doc


def _text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("warning", value.get("message", ""))
    return str(value)


def _message(result: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    lines = [_text(w) for w in result.get("warnings") or [] if w]
    lines += [_text(i) for i in result.get("info") or [] if i]
    if not lines:
        lines = [_text(i) for i in summary.get("info") or [] if i]
    return "; ".join(lines)[:MAX_MESSAGE]


def parse_diag(output: str, uuid_of: Mapping[int, str]) -> wire.DiagDcgmResult:
    """The diagnostic document in dcgmi's output as DiagDcgmResult (see the module); DcgmOutputError when
    there is none. `uuid_of` maps DCGM's GPU ids (the nvidia-smi indexes) to UUIDs."""
    doc = _document(output)
    body = doc.get("DCGM Diagnostic", doc.get("DCGM GPU Diagnostic"))
    if not isinstance(body, dict) or not isinstance(body.get("test_categories"), list):
        raise DcgmOutputError("no `DCGM Diagnostic` object with `test_categories`")
    tests: list[wire.DcgmTest] = []
    for category in body["test_categories"]:
        for test in category.get("tests") or [] if isinstance(category, dict) else []:
            if not isinstance(test, dict):
                continue
            name = str(test.get("name", ""))[:200]
            raw_summary = test.get("test_summary")
            summary: Mapping[str, Any] = raw_summary if isinstance(raw_summary, dict) else {}
            for result in test.get("results") or []:
                if not isinstance(result, dict):
                    continue
                if len(tests) >= MAX_TESTS:
                    raise DcgmOutputError(f"more than {MAX_TESTS} results")
                word = str(result.get("status", "")).strip().lower()
                gpu = result.get("entity_id", result.get("gpu_ids", result.get("gpu_id")))
                try:
                    uuid = uuid_of.get(int(gpu), f"gpu-index-{int(gpu)}") if gpu is not None else ""
                except (TypeError, ValueError):  # a CSV of GPU ids: a result for all of them
                    uuid = ""
                tests.append(
                    wire.DcgmTest(
                        name=name,
                        gpu_uuid=uuid,
                        outcome=_OUTCOMES.get(word, "fail"),
                        message=_message(result, summary)
                        if word in _OUTCOMES
                        else f"unknown status {word[:40]!r}",
                    )
                )
    passed = any(t.outcome == "pass" for t in tests) and not any(t.outcome == "fail" for t in tests)
    return wire.DiagDcgmResult(passed=passed, tests=tests)


class DiagDcgmHandler:
    def __init__(self, system: System, data_dir: str, vfio: Callable[[], Mapping[str, str]] = dict) -> None:
        self.system = system
        self.data_dir = data_dir
        self.vfio = vfio  # GPU uuid -> the instance it is passed through to (busy, DEV-BUSY-05/07)

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        return frozenset(gpu_resource(u) for u in _request(command)[1])

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        from bcd_agent.inventory.gpus import collect_gpus
        from bcd_agent.sections.devices import busy

        level, uuids = _request(command)
        inventory = await trio.to_thread.run_sync(collect_gpus, self.system)
        index_of = {g.uuid: g.index for g in inventory.gpus}
        # Busy before unknown: a GPU passed through to a VM is bound to vfio-pci, which nvidia-smi does not
        # list, and the operator must hear which instance has it (DEV-BUSY-05/07), not "unknown".
        state = await trio.to_thread.run_sync(busy.read_busy, self.system, self.data_dir, dict(self.vfio()))
        try:
            busy.dcgm_busy_check(level, uuids, inventory, state)
        except busy.GpuBusy as exc:
            raise CommandFailed(busy.GPU_BUSY, exc.message) from None
        unknown = [u for u in uuids if u not in index_of]
        if unknown:
            raise CommandFailed("unknown-gpu", f"nvidia-smi does not list {', '.join(unknown)}")
        argv = ["dcgmi", "diag", "-r", str(level), "-j"]
        if uuids:
            argv += ["-i", ",".join(str(index_of[u]) for u in uuids)]
        await ctx.begin_effect()
        result = await trio.to_thread.run_sync(lambda: self.system.run(argv, timeout=LEVEL_TIMEOUT_S[level]))
        if result.returncode == 127:
            raise CommandFailed("dcgmi-missing", "dcgmi is not installed (DCGM's datacenter-gpu-manager)")
        output = result.stdout[:MAX_OUTPUT].decode(errors="replace")
        try:
            parsed = parse_diag(output, {g.index: g.uuid for g in inventory.gpus})
        except DcgmOutputError as exc:
            said = (result.stderr or result.stdout).decode(errors="replace").strip()[:MAX_MESSAGE]
            raise CommandFailed(
                "dcgmi", f"dcgmi diag -r {level}: {exc}: exit {result.returncode}: {said}"
            ) from None
        return bytes(parsed)
