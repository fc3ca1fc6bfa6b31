"""gpu.reset and the live holds (delivery.md DLV-RST, devices.md DEV-BUSY) on the simulated HGX host.

The busy refusals and per-GPU outcomes themselves are in test_devices_kube_busy.py; this file adds the
kind's table row, the exact reset argv, the fresh inventory after the resets and where health comes
from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bcd_agent.dispatch.kinds import KINDS, Lane, Role
from bcd_agent.inventory.gpus import collect_gpus
from bcd_agent.sections.devices.busy import gpu_reset, read_busy
from bcd_shared import nvsmi
from bcd_shared.system import CommandResult, System
from bcd_simhost.gpus import gpu_uuid, update_state
from devices.devhost import DATA_DIR, Host


class RecordingSystem:
    """The simulated host's System, recording every argv it runs."""

    def __init__(self, inner: System) -> None:
        self.inner = inner
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        self.calls.append(list(argv))
        return self.inner.run(argv, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_DLV_RST_01_and_DEV_BUSY_01_kind_row() -> None:
    """Covers DLV-RST-01, DEV-BUSY-01: control lane, destructive, attested, not retry-safe, node only."""
    k = KINDS["gpu.reset"]
    assert k.lane is Lane.CONTROL
    assert k.roles == frozenset({Role("node")})
    assert k.destructive and k.attested and not k.retry_safe


def test_DLV_RST_08_10_reset_argv_then_a_fresh_inventory(host: Host) -> None:
    """Covers DLV-RST-08, DLV-RST-10, DEV-BUSY-09, DEV-BUSY-10: each known GPU is reset with
    `nvidia-smi --gpu-reset -i <uuid>`, in list order, an unknown one never; the inventory is read again
    after the last reset (a pending remap the reset applied reads healthy)."""
    g2, g5 = gpu_uuid(2), gpu_uuid(5)
    update_state(host.root, lambda s: s["gpus"][2].__setitem__("remap_pending", True))
    before = collect_gpus(host.system).gpu(g2)
    assert before is not None and not before.health.healthy
    rec = RecordingSystem(host.system)
    state = read_busy(host.system, DATA_DIR, {})
    result = gpu_reset(rec, [g5, "GPU-unknown", g2], state)  # type: ignore[arg-type]
    resets = [c for c in rec.calls if "--gpu-reset" in c]
    assert resets == [["nvidia-smi", "--gpu-reset", "-i", g5], ["nvidia-smi", "--gpu-reset", "-i", g2]]
    last_reset = max(i for i, c in enumerate(rec.calls) if "--gpu-reset" in c)
    assert any(c == ["nvidia-smi", "-L"] for c in rec.calls[last_reset:])  # collected after the resets
    assert [(o.gpu_uuid, o.reset, o.healthy) for o in result.gpus] == [
        (g5, True, True),
        ("GPU-unknown", False, False),
        (g2, True, True),
    ]


def test_DLV_RST_11_uncorrectable_ecc_reads_unhealthy(host: Host) -> None:
    """Covers DLV-RST-11, DEV-BUSY-10 (the ECC half): a GPU whose fresh inventory shows uncorrectable
    volatile ECC errors is not healthy; the simulated reset clears volatile counters, so the check runs
    on a reset that fails to clear them (the resetter leaves the state as it is)."""
    g6 = gpu_uuid(6)
    update_state(host.root, lambda s: s["gpus"][6].__setitem__("ecc_uncorrected_volatile", 2))
    state = read_busy(host.system, DATA_DIR, {})
    ok = CommandResult(argv=("nvidia-smi",), returncode=0, stdout=b"", stderr=b"")
    result = gpu_reset(host.system, [g6], state, reset=lambda _uuid: ok)
    assert [(o.gpu_uuid, o.reset, o.healthy) for o in result.gpus] == [(g6, True, False)]


def test_DLV_RST_12_15_ecc_and_remap_from_q_x(host: Host) -> None:
    """Covers DLV-RST-12, DLV-RST-15, DEV-BUSY-11 (first half), DEV-BUSY-13: the simulated HGX node's
    `nvidia-smi -q -x` carries ECC counters and row remapping for every GPU, and the inventory reads
    them from there (the real captures: test_devices_inventory.py)."""
    update_state(host.root, lambda s: s["gpus"][1].__setitem__("ecc_uncorrected_volatile", 3))
    qx_run = host.system.run(["nvidia-smi", "-q", "-x"], timeout=60)
    assert qx_run.ok
    qx = nvsmi.parse_qx(qx_run.stdout)
    assert len(qx.gpus) == 8
    for g in qx.gpus:
        assert g.ecc_uncorrected_volatile is not None
        if not g.mig_enabled:  # a real driver prints <remapped_rows>N/A</remapped_rows> under MIG
            assert g.remap_pending is not None and g.remap_failure is not None
    assert sum(not g.mig_enabled for g in qx.gpus) >= 7
    inv = collect_gpus(host.system)
    g1 = inv.gpu(gpu_uuid(1))
    assert g1 is not None and g1.health.ecc_uncorrected_volatile == 3 and not g1.health.healthy
    assert all(g.health.remap_pending is False for g in inv.gpus if not g.mig_enabled)
