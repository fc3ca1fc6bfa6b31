"""The request and result messages of each command kind (CommandBody.payload, CommandUpdate.result).

Only the wire types live here; a kind's lane, roles and flags are the dispatch table's (agent side).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs
import betterproto2

from bcd_shared.wire._gen.bcd.v1 import (
    DaemonUpgradeRequest,
    DaemonUpgradeResult,
    DiagDcgmRequest,
    DiagDcgmResult,
    DiagNvmlRequest,
    DiagNvmlResult,
    GpuResetRequest,
    GpuResetResult,
    InstanceSnapshotRequest,
    InstanceSnapshotResult,
    InventoryRefreshRequest,
    InventoryRefreshResult,
    LogsCollectRequest,
    LogsCollectResult,
    NodeRebootRequest,
    NodeRebootResult,
)


@attrs.frozen
class KindMessages:
    request: type[betterproto2.Message]
    result: type[betterproto2.Message]


KIND_MESSAGES: Mapping[str, KindMessages] = MappingProxyType(
    {
        "inventory.refresh": KindMessages(InventoryRefreshRequest, InventoryRefreshResult),
        "diag.nvml": KindMessages(DiagNvmlRequest, DiagNvmlResult),
        "gpu.reset": KindMessages(GpuResetRequest, GpuResetResult),
        "node.reboot": KindMessages(NodeRebootRequest, NodeRebootResult),
        "logs.collect": KindMessages(LogsCollectRequest, LogsCollectResult),
        "instance.snapshot": KindMessages(InstanceSnapshotRequest, InstanceSnapshotResult),
        "diag.dcgm": KindMessages(DiagDcgmRequest, DiagDcgmResult),
        "daemon.upgrade": KindMessages(DaemonUpgradeRequest, DaemonUpgradeResult),
    }
)
