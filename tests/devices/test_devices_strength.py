"""Devices checks that a wrong implementation fails (issue 14's weak checks)."""

from __future__ import annotations

import pytest
from bcd_agent.inventory.gpus import GpuHealth, build_inventory
from bcd_shared import nvsmi

# `nvidia-smi -L` as a driver prints it (the form of ../shared/reference/nvidia-smi/list/*.txt).
LISTING = (
    "GPU 0: NVIDIA H200 (UUID: GPU-2f9b6c1e-6d2a-4c1b-9a57-0c1d2e3f4a5b)\n"
    "GPU 1: NVIDIA H200 (UUID: GPU-8a7b6c5d-4e3f-2a1b-0c9d-8e7f6a5b4c3d)\n"
)


def test_DEV_BUSY_11_without_ecc_or_remap_data_every_gpu_reads_healthy() -> None:
    """DEV-BUSY-11: an inventory built without `-q -x` (and without the CSV's health columns) carries
    neither ECC counters nor row remapping, and every GPU reads healthy."""
    assert GpuHealth().healthy is True
    inv = build_inventory(nvsmi.parse_list(LISTING), (), None, {})
    assert len(inv.gpus) == 2
    for gpu in inv.gpus:
        assert gpu.health == GpuHealth(None, None, None)
        assert gpu.health.healthy is True


@pytest.mark.parametrize(
    ("health", "healthy"),
    [
        (GpuHealth(0, False, False), True),
        (GpuHealth(1, None, None), False),
        (GpuHealth(None, True, None), False),
        (GpuHealth(None, None, True), False),
        (GpuHealth(0, None, None), True),
        (GpuHealth(None, False, None), True),
    ],
)
def test_DEV_BUSY_10_11_health_from_what_the_gpu_said(health: GpuHealth, healthy: bool) -> None:
    """Only what the GPU reported counts against it; an absent reading is never a fault."""
    assert health.healthy is healthy
