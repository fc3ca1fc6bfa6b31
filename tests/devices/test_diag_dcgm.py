"""`diag.dcgm` on the simulated host: the payload's rules, the busy check from level 2, `dcgmi diag -j` run
(the simulated dcgmi prints DCGM 4.x's document; see devhost/bcd_simhost/dcgmi.py for where the
format comes from) and its JSON parsed into DiagDcgmResult, for DCGM 4 and DCGM 3 documents.

Covers DLV-RST-06 and DEV-BUSY-07 (diag.dcgm from level 2 applies gpu.reset's busy check) and
DLV-KIND-18 (diag.dcgm runs on the node role: a handler bcd node registers)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload
from bcd_agent.kinds.dcgm import DcgmOutputError, DiagDcgmHandler, parse_diag
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec
from bcd_shared import wire
from bcd_shared.wire.strict import type_url
from bcd_simhost.gpus import gpu_uuid, update_state
from devices.devhost import DATA_DIR, Host
from dispatch.dhelpers import EffectCtx, make_command

G0, G1, G2 = gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)


def _command(level: int, *uuids: str) -> Any:
    request = wire.DiagDcgmRequest(level=level, gpu_uuids=list(uuids))
    return make_command(kind="diag.dcgm", payload=(type_url(wire.DiagDcgmRequest), bytes(request)))


async def _run(host: Host, command: Any) -> tuple[wire.DiagDcgmResult, EffectCtx]:
    ctx = EffectCtx()
    with trio.fail_after(30):
        out = await DiagDcgmHandler(host.system, DATA_DIR).run(command, ctx)
    return wire.DiagDcgmResult.parse(out), ctx


async def test_DLV_KIND_18_a_level_2_run_on_two_gpus_parses_every_test(host: Host) -> None:
    def bad_memory(s: dict[str, Any]) -> None:
        s["gpus"][1]["ecc_uncorrected_volatile"] = 3

    update_state(host.root, bad_memory)
    result, ctx = await _run(host, _command(2, G0, G1))
    assert ctx.began == 1
    got = [(t.name, t.gpu_uuid, t.outcome) for t in result.tests]
    assert got == [
        ("software", G0, "pass"),
        ("software", G1, "pass"),
        ("pcie", G0, "pass"),
        ("pcie", G1, "pass"),
        ("memory", G0, "pass"),
        ("memory", G1, "fail"),
    ]
    assert result.passed is False
    assert "3 uncorrectable volatile ECC errors" in result.tests[-1].message
    healthy, _ = await _run(host, _command(1))
    assert healthy.passed is True and {t.gpu_uuid for t in healthy.tests} == {gpu_uuid(i) for i in range(8)}


async def test_DLV_RST_06_DEV_BUSY_07_from_level_2_a_held_gpu_fails_gpu_busy_before_dcgmi_runs(
    host: Host,
) -> None:
    host.run(DevicesSpec(1, (DeviceAssignment("a1", "r", "BINDING_HOLD", (DeviceRef(G2, "gpu"),)),)))
    for command in (_command(2, G0, G2), _command(3)):
        ctx = EffectCtx()
        with pytest.raises(CommandFailed) as info:
            await DiagDcgmHandler(host.system, DATA_DIR).run(command, ctx)
        assert (info.value.code, ctx.began) == ("gpu-busy", 0)
        assert f"{G2} is held by allocation a1" in info.value.message
    result, _ = await _run(host, _command(1, G2))  # level 1 is not checked
    assert result.passed is True


@pytest.mark.parametrize(
    ("level", "uuids", "why"),
    [(0, (), "payload.level"), (5, (), "payload.level"), (1, (G0, G0), "more than once")],
)
async def test_a_bad_payload_is_invalid(host: Host, level: int, uuids: tuple[str, ...], why: str) -> None:
    with pytest.raises(InvalidPayload) as info:
        DiagDcgmHandler(host.system, DATA_DIR).resources(_command(level, *uuids))
    assert why in info.value.message


async def test_unknown_gpu_and_no_driver(host: Host) -> None:
    with pytest.raises(CommandFailed) as info:
        await _run(host, _command(1, "GPU-nope"))
    assert info.value.code == "unknown-gpu"
    (host.root / "sys/module/nvidia").rename(host.root / "sys/module/nvidia.off")
    with pytest.raises(CommandFailed) as info:
        await _run(host, _command(1))
    assert info.value.code == "dcgmi" and "Unable to connect to host engine" in info.value.message


DCGM3 = """Successfully ran diagnostic for group.
{
  "DCGM GPU Diagnostic" : {
    "test_categories" : [
      {"category" : "Deployment", "tests" : [
        {"name" : "Denylist", "results" : [{"gpu_ids" : "0,1", "status" : "PASS"}]}]},
      {"category" : "Hardware", "tests" : [
        {"name" : "GPU Memory", "results" : [
          {"gpu_ids" : "0", "status" : "PASS"},
          {"gpu_ids" : "1", "status" : "FAIL",
           "warnings" : [{"warning" : "GPU 1 Memory test found 2 errors", "error_id" : 27}],
           "info" : ["Allocated 95% of memory"]}]}]}
    ],
    "version" : "3.3.9"
  }
}"""


def test_a_dcgm_3_document_and_unknown_words() -> None:
    result = parse_diag(DCGM3, {0: G0, 1: G1})
    got = [(t.name, t.gpu_uuid, t.outcome, t.message) for t in result.tests]
    assert got == [
        ("Denylist", "", "pass", ""),
        ("GPU Memory", G0, "pass", ""),
        ("GPU Memory", G1, "fail", "GPU 1 Memory test found 2 errors; Allocated 95% of memory"),
    ]
    assert result.passed is False
    odd = json.dumps(
        {
            "DCGM Diagnostic": {
                "test_categories": [
                    {"tests": [{"name": "x", "results": [{"entity_id": 0, "status": "Inconclusive"}]}]}
                ]
            }
        }
    )
    [test] = parse_diag(odd, {0: G0}).tests
    assert (test.outcome, test.message) == ("fail", "unknown status 'inconclusive'")
    skipped = json.dumps(
        {
            "DCGM Diagnostic": {
                "test_categories": [
                    {"tests": [{"name": "x", "results": [{"entity_id": 0, "status": "Skip"}]}]}
                ]
            }
        }
    )
    assert parse_diag(skipped, {0: G0}).passed is False  # nothing ran: not a pass
    for bad in ("", "Error: Unable to connect to host engine.", "{not json", '{"other": 1}'):
        with pytest.raises(DcgmOutputError):
            parse_diag(bad, {})
