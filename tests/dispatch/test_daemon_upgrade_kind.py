"""`daemon.upgrade`'s handler (agent/bcd_agent/kinds/daemon.py) over a recording helper: the signed command
itself goes to the helper as the release's freshness, root's refusals become the command's FAILED code,
and the re-execution after the restart confirms and completes the command.

Covers DLV-PRIV-10 (daemon.upgrade's privileged half goes through the helper)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload
from bcd_agent.kinds.daemon import DaemonUpgradeHandler
from bcd_agent.sections.daemon.upgrade import Upgrader
from bcd_shared import wire
from bcd_shared.errors import HelperRefused
from bcd_shared.wire.strict import type_url
from dhelpers import EffectCtx, Pki, make_command

ARTIFACT = b"#!/usr/bin/python3\nrelease 2.0.0\n"
SHA = hashlib.sha256(ARTIFACT).hexdigest()


class Helper:
    def __init__(self, refuse: str = "") -> None:
        self.swaps: list[dict[str, Any]] = []
        self.confirms: list[str] = []
        self.refuse = refuse

    def daemon_swap(self, **kwargs: Any) -> dict[str, Any]:
        self.swaps.append(kwargs)
        if self.refuse:
            raise HelperRefused(self.refuse, f"helper: daemon.swap: {self.refuse}")
        return {"version": kwargs["version"], "restart": "restarted bcd-node.service"}

    def daemon_confirm(self, version: str, *, healthy: bool = True) -> dict[str, Any]:
        self.confirms.append(version)
        return {"version": version, "confirmed": True, "previous_version": "1.0.0"}


def _command(pki: Pki, **request: Any) -> Any:
    fields: dict[str, Any] = {
        "version": "2.0.0",
        "url": "https://releases.example.com/bcd/2.0.0/bcd",
        "sha256": SHA,
        "signature": bytes(64),
        "rollback": False,
    }
    fields.update(request)
    payload = (type_url(wire.DaemonUpgradeRequest), bytes(wire.DaemonUpgradeRequest(**fields)))
    return make_command(pki, kind="daemon.upgrade", payload=payload)


def _upgrader(tmp_path: Path, helper: Helper, running: str) -> Upgrader:
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    (staging / "bcd-2.0.0").write_bytes(ARTIFACT)  # already downloaded: no network here
    return Upgrader(helper, tmp_path, running)


async def test_DLV_PRIV_10_the_signed_command_goes_to_the_helper_with_the_release(tmp_path: Path) -> None:
    pki = Pki.build()
    helper = Helper()
    handler = DaemonUpgradeHandler(_upgrader(tmp_path, helper, "1.0.0"), wait_s=1)
    command = _command(pki, rollback=True)
    ctx = EffectCtx()
    with pytest.raises(CommandFailed) as info:  # the restart never came in this test
        await handler.run(command, ctx)
    assert info.value.code == "restart-timeout" and ctx.began == 1
    [swap] = helper.swaps
    assert swap["command"] == (command.body_bytes, command.signature) and swap["spec"] is None
    assert swap["chain"] == command.signer_chain and swap["artifact"] == "bcd-2.0.0"
    assert (swap["version"], swap["sha256"], swap["rollback"]) == ("2.0.0", SHA, True)
    assert handler.resources(command) == frozenset()


async def test_root_s_refusal_is_the_command_s_failure(tmp_path: Path) -> None:
    handler = DaemonUpgradeHandler(_upgrader(tmp_path, Helper(refuse="downgrade"), "3.0.0"), wait_s=1)
    with pytest.raises(CommandFailed) as info:
        await handler.run(_command(Pki.build()), EffectCtx())
    assert info.value.code == "downgrade"


async def test_the_re_execution_after_the_restart_confirms_and_completes(tmp_path: Path) -> None:
    helper = Helper()
    handler = DaemonUpgradeHandler(_upgrader(tmp_path, helper, "2.0.0"), wait_s=1)
    ctx = EffectCtx()
    with trio.fail_after(5):
        out = await handler.run(_command(Pki.build()), ctx)
    assert wire.DaemonUpgradeResult.parse(out) == wire.DaemonUpgradeResult(
        previous_version="1.0.0", version="2.0.0"
    )
    assert (helper.confirms, helper.swaps, ctx.began) == (["2.0.0"], [], 0)


@pytest.mark.parametrize("field", [{"version": "../x"}, {"url": "http://x/y"}, {"signature": b"x"}])
async def test_a_bad_payload_is_invalid(tmp_path: Path, field: dict[str, Any]) -> None:
    handler = DaemonUpgradeHandler(_upgrader(tmp_path, Helper(), "1.0.0"))
    with pytest.raises(InvalidPayload):
        handler.resources(_command(Pki.build(), **field))
