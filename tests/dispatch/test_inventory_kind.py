"""`inventory.refresh` through the dispatcher, over an injected collector (DLV-KIND-02)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from bcd_agent.dispatch.command import UpdateState
from bcd_agent.dispatch.kinds import Role
from bcd_agent.kinds.inventory import KIND, InventoryRefreshHandler
from bcd_shared import wire
from bcd_shared.errors import RetryableError
from bcd_shared.wire.strict import decode, type_url
from dhelpers import Harness, Pki, make_command

REQUEST = (type_url(wire.InventoryRefreshRequest), b"")


class Collector:
    """Answers like the inventory package would: a fresh collection per call."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    async def refresh(self) -> wire.InventoryRefreshResult:
        self.calls += 1
        if self.fail:
            raise RetryableError("nvidia-smi-failed", "nvidia-smi exited 9: NVML not loaded")
        inv = wire.Inventory(
            gpus=[wire.GpuInfo(uuid="GPU-1", index=0, name="NVIDIA H100 80GB HBM3", numa_node=0)],
            cpu_count=64,
            hostname="gpu-host-1",
        )
        return wire.InventoryRefreshResult(inventory=inv, inventory_hash=f"sha256:{self.calls}")


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


@pytest.mark.parametrize("role", list(Role))
async def test_DLV_KIND_02_inventory_refresh_runs_on_every_role(tmp_path: Path, pki: Pki, role: Role) -> None:
    h = Harness(tmp_path / "data", pki, bundle=pki.bundle(), role=role)
    collector = Collector()
    async with trio.open_nursery() as n:
        d = await n.start(h.dispatcher({KIND: InventoryRefreshHandler(collector)}).run)
        cmd = make_command(pki, kind=KIND, payload=REQUEST)
        d.deliver(cmd)
        done = await h.sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    assert h.sink.states(cmd.id) == [UpdateState.ACKED, UpdateState.RUNNING, UpdateState.SUCCEEDED]
    result = decode(wire.InventoryRefreshResult, done.result)
    assert result.inventory is not None and result.inventory.gpus[0].uuid == "GPU-1"
    assert collector.calls == 1


async def test_inventory_refresh_failures(tmp_path: Path, pki: Pki) -> None:
    h = Harness(tmp_path / "data", pki)
    collector = Collector(fail=True)
    async with trio.open_nursery() as n:
        d = await n.start(h.dispatcher({KIND: InventoryRefreshHandler(collector)}).run)
        broken = make_command(pki, kind=KIND, payload=REQUEST)
        wrong = make_command(pki, kind=KIND, payload=(type_url(wire.GpuResetRequest), b""))
        extra = make_command(pki, kind=KIND, payload=(REQUEST[0], b"\x08\x01"))  # a field the request lacks
        for c in (broken, wrong, extra):
            d.deliver(c)
        results = [await h.sink.wait_terminal(c.id) for c in (broken, wrong, extra)]
        n.cancel_scope.cancel()
    assert [(r.state, r.error_code) for r in results] == [
        (UpdateState.FAILED, "nvidia-smi-failed"),
        (UpdateState.FAILED, "invalid-payload"),
        (UpdateState.FAILED, "invalid-payload"),
    ]
    assert collector.calls == 1
