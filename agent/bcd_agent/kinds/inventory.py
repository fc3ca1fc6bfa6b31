"""`inventory.refresh` (control lane; node, site, ramdisk; retry-safe; 2 minutes; DLV-KIND-02).

Collects a fresh inventory now through the injected `InventoryCollector` (which also publishes it to the
status report and the heartbeat's inventory hash) and returns `InventoryRefreshResult`. Reading the host
is the command's only effect, so RUNNING is reported as collection starts. Acts on no device: no locks.
"""

from __future__ import annotations

from typing import Protocol

from bcd_shared.errors import RetryableError
from bcd_shared.wire import InventoryRefreshRequest, InventoryRefreshResult

from bcd_agent.dispatch.command import CommandEnvelope
from bcd_agent.dispatch.handlers import RunContext
from bcd_agent.dispatch.payload import decode_request

KIND = "inventory.refresh"


class InventoryCollector(Protocol):
    async def refresh(self) -> InventoryRefreshResult:
        """Collect the inventory now (not from a cache), publish it, and return it. Raises a StepError
        (its reason becomes the FAILED code) when the host cannot be read."""
        ...


class InventoryRefreshHandler:
    def __init__(self, collector: InventoryCollector) -> None:
        self._collector = collector

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        decode_request(command, InventoryRefreshRequest)
        return frozenset()

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        decode_request(command, InventoryRefreshRequest)
        await ctx.begin_effect()
        result = await self._collector.refresh()
        if result.inventory is None:
            raise RetryableError("inventory-unavailable", "the collector returned no inventory")
        return bytes(result)
