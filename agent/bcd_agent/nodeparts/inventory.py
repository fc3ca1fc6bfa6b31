"""The node's inventory state: what the last read of the host said, and the hash heartbeats carry.

- `read_gpus()` is the converge observation's `inventory` part (a `GpuInventory`, as the devices section
  reads it); each read also computes the wire `Inventory` (bcd_agent.inventory.handlers.collect_inventory
  over the same GPU read, plus memory, huge pages, NUMA nodes) and its `inventory_hash`.
- `hashes()` is `SessionCore.inventory_hashes`: `{"inventory": <hash>}`, the same digest an
  `inventory.refresh` result carries (`InventoryRefreshResult.inventory_hash`), so the control plane can
  tell from a heartbeat that its copy is stale. Empty until the first read.
- `publish(result)` takes a fresh `InventoryRefreshResult` (the `inventory.refresh` collector's publish).
- When the hash changes, `on_change` runs (the node sends a heartbeat soon).

Thread-safe: reads happen in the runner's worker thread and in the dispatcher's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from bcd_shared import wire
from bcd_shared.system import System

from bcd_agent.inventory.gpus import GpuInventory, collect_gpus
from bcd_agent.inventory.handlers import collect_inventory, inventory_hash

log = logging.getLogger("bcd.node")

HASH_KEY = "inventory"


class InventoryState:
    def __init__(self, system: System, on_change: Callable[[], None] = lambda: None) -> None:
        self.system = system
        self.on_change = on_change
        self._lock = threading.Lock()
        self._hash = ""
        self._gpus: GpuInventory | None = None
        self.reads = 0

    @property
    def hash(self) -> str:
        return self._hash

    @property
    def gpus(self) -> GpuInventory | None:
        """The last GPU inventory read (None before the first)."""
        return self._gpus

    def hashes(self) -> Mapping[str, str]:
        h = self._hash
        return {HASH_KEY: h} if h else {}

    def read_gpus(self) -> GpuInventory:
        """Read the GPUs now, record the inventory and its hash, and return the GPU inventory."""
        gpus = collect_gpus(self.system)
        inventory = collect_inventory(self.system, gpus)
        self._record(gpus, inventory_hash(inventory))
        return gpus

    def refresh(self) -> str:
        """Read again (after a host unit changed the host); returns the new hash."""
        self.read_gpus()
        return self._hash

    def publish(self, result: wire.InventoryRefreshResult) -> None:
        """A fresh inventory.refresh result: its hash becomes the heartbeat's."""
        self._record(None, result.inventory_hash)

    def _record(self, gpus: GpuInventory | None, digest: str) -> None:
        with self._lock:
            self.reads += 1
            if gpus is not None:
                self._gpus = gpus
            changed = digest != self._hash
            self._hash = digest
        if changed:
            log.info("node: inventory hash %s", digest)
            self.on_change()
