"""host.unit, gpu.reset and node.reboot through a real helper over the simulated host.

Covers HST-HLP-03, HST-HLP-06, HST-HLP-09, HST-HLP-10, HST-HLP-12, HST-HLP-20..23, HST-HLP-33..36,
DLV-PRIV-09.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.helperclient import HelperClient
from bcd_helper.busy import busy_gpus
from bcd_shared import cdi
from bcd_shared.errors import HelperRefused
from bcd_shared.system import CommandResult, LocalSystem
from bcd_simhost.gpus import gpu_uuid, mig_uuid, update_state
from helperproc import HelperProcess, assert_refused, base_config, tree

DROPIN = "etc/sysctl.d/90-bcd.conf"


def test_HST_HLP_03_09_10_12_sysctl_replanned_applied_refused_and_cleaned(helper: HelperProcess) -> None:
    """Covers HST-SYS-13 (helper side): root refuses a denylisted sysctl whoever sends it."""
    result = helper.client.host_unit("sysctl", '{"vm.swappiness":10}')
    assert result["changed"] is True and result["issues"] == []
    assert "vm.swappiness = 10" in (helper.root / DROPIN).read_text()
    assert helper.client.host_unit("sysctl", '{"vm.swappiness":10}')["changed"] is False
    before = tree(helper.root)
    with pytest.raises(HelperRefused, match=r"kernel\.core_pattern is refused"):
        helper.client.host_unit("sysctl", '{"kernel.core_pattern":"|/bin/sh"}')
    with pytest.raises(HelperRefused, match="not supported"):
        helper.client.host_unit("no-such-unit", "{}")
    with pytest.raises(HelperRefused, match="not a config unit name"):
        helper.client.host_unit("../etc", "{}")
    assert tree(helper.root) == before
    cleaned = helper.client.host_unit("sysctl", None)
    assert cleaned["changed"] is True and not (helper.root / DROPIN).exists()


def test_HST_HLP_21_22_23_units_false_in_roots_config_refuses_everything(fresh_root: Path) -> None:
    h = HelperProcess(fresh_root, base_config(extra="[host]\nunits = false\n"))
    try:
        before = tree(fresh_root)
        for settings in ('{"vm.swappiness":10}', None):
            with pytest.raises(HelperRefused) as exc:
                h.client.host_unit("sysctl", settings)
            assert str(exc.value) == (
                "helper: host.unit: this host's configuration is managed outside bcd "
                "([host] units = false in root's config.toml)"
            )
        assert tree(fresh_root) == before
        assert h.last_audit()["reason"] == "host-managed-externally"
    finally:
        h.stop()


def _hold(client: HelperClient, alloc: str, device: str) -> None:
    doc = cdi.build_hold_spec(
        allocation_id=alloc,
        reservation_id="rsv",
        generation=1,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(device)],
        env=[f"BCD_ALLOCATION_ID={alloc}"],
        vendor=None,
    )
    client.file_write("cdi", alloc, cdi.encode_spec(doc))


def test_DLV_PRIV_09_gpu_reset_with_roots_own_busy_check(fresh_root: Path) -> None:
    h = HelperProcess(fresh_root, base_config())
    try:
        _hold(h.client, "held_1", f"{gpu_uuid(1)}/s0")
        with pytest.raises(HelperRefused, match=f"{gpu_uuid(1)} is held by held_1"):
            h.client.gpu_reset([gpu_uuid(0), gpu_uuid(1)])
        update_state(
            fresh_root, lambda s: s["gpus"][2]["processes"].append({"pid": 4242, "name": "x", "used_mib": 10})
        )
        with pytest.raises(HelperRefused, match="runs compute process 4242"):
            h.client.gpu_reset([gpu_uuid(2)])
        unknown = "GPU-00000000-0000-4000-8000-00000000abcd"
        out = h.client.gpu_reset([gpu_uuid(0), unknown])
        assert out[0]["uuid"] == gpu_uuid(0) and out[0]["reset"] is True
        assert out[1] == {"uuid": unknown, "reset": False, "message": "unknown GPU"}
        with pytest.raises(HelperRefused, match=r"not a GPU UUID"):
            h.client.gpu_reset(["GPU-nope"])
    finally:
        h.stop()


def test_HST_HLP_34_35_36_roots_busy_view(fresh_root: Path) -> None:
    """Compute processes (nvidia-smi's CSV, as in the reference captures) and live holds make GPUs
    busy; a MIG device's UUID among the processes makes every GPU busy; an unreadable hold too."""
    rows = {"out": ""}

    def fake_smi(_system: LocalSystem, argv: Sequence[str], _stdin: bytes | None) -> CommandResult:
        return CommandResult(tuple(argv), 0, rows["out"].encode(), b"")

    system = LocalSystem(fresh_root, tools={"nvidia-smi": fake_smi})
    assert busy_gpus(system).by_gpu == ()
    rows["out"] = f"{gpu_uuid(3)}, 11327\n"
    assert busy_gpus(system).reason(gpu_uuid(3)) == f"{gpu_uuid(3)} runs compute process 11327"
    assert busy_gpus(system).reason(gpu_uuid(4)) is None
    rows["out"] = f"{mig_uuid(7, 1, 0)}, 21180\n"
    assert busy_gpus(system).reason(gpu_uuid(4)) is not None
    rows["out"] = ""
    (fresh_root / "etc/cdi/bcd-broken.json").write_text("{not json")
    assert "cannot be read" in (busy_gpus(system).reason(gpu_uuid(0)) or "")
    (fresh_root / "etc/cdi/bcd-broken.json").unlink()
    doc = cdi.build_hold_spec(
        allocation_id="a_1",
        reservation_id="r",
        generation=1,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(f"{gpu_uuid(5)}/gi1/ci0")],
        env=["BCD_ALLOCATION_ID=a_1"],
        vendor=None,
    )
    (fresh_root / "etc/cdi/bcd-a_1.json").write_bytes(cdi.encode_spec(doc))
    assert busy_gpus(system).reason(gpu_uuid(5)) == f"{gpu_uuid(5)} is held by a_1"


def test_node_reboot_runs_systemctl_reboot(fresh_root: Path) -> None:
    h = HelperProcess(fresh_root, base_config())
    try:
        assert h.client.node_reboot() == {"rebooting": True}
        assert (fresh_root / "var/lib/bcd-sim/reboot-requested").exists()
    finally:
        h.stop()


def _gpus(root: Path) -> list[dict[str, Any]]:
    gpus: list[dict[str, Any]] = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())["gpus"]
    return gpus


def test_HST_HLP_33_mig_layout_takes_roots_busy_gpus_not_the_nodes(fresh_root: Path) -> None:
    """A live hold on GPU 1 that the node leaves out of busy_gpus still keeps its GPU from being
    repartitioned, and GPU 0, which the node claims is busy though nothing uses it, is repartitioned."""
    h = HelperProcess(fresh_root, base_config())
    try:
        _hold(h.client, "held_1", f"{gpu_uuid(1)}/s0")
        before = _gpus(fresh_root)[1]
        out = h.client.host_unit("mig-layout", '{"layout":"all-1g.18gb"}', busy_gpus=[gpu_uuid(0)])
        assert [i["kind"] for i in out["issues"]] == ["retryable"]
        assert "hold allocations; they are repartitioned once those end" in out["issues"][0]["message"]
        after = _gpus(fresh_root)
        assert after[1] == before  # the held GPU is left alone
        assert after[0]["mig_enabled"] and [m["profile"] for m in after[0]["migs"]] == ["1g.18gb"] * 7
    finally:
        h.stop()


def test_HST_HLP_20_host_units_is_roots_config_never_the_nodes(fresh_root: Path) -> None:
    """The same request, from the same node, applies or is refused as root's own config.toml says: a
    request that claims host units are on is refused for the unknown field, and root's `units = false`
    decides until root's file changes."""
    request = {"unit": "sysctl", "settings": '{"vm.swappiness":10}', "busy_gpus": []}
    h = HelperProcess(fresh_root, base_config(extra="[host]\nunits = false\n"))
    try:
        assert h.client.ping()["host_units"] is False
        assert_refused(h, {"op": "host.unit", "args": {**request, "host_units": True}})
        assert_refused(h, {"op": "host.unit", "args": request}, "host-managed-externally")
    finally:
        h.stop()
    h = HelperProcess(fresh_root, base_config())  # root's file now leaves units at their default, on
    try:
        assert h.client.ping()["host_units"] is True
        answer = h.raw({"op": "host.unit", "args": request})
        assert answer["ok"] is True and answer["result"]["changed"] is True
        assert "vm.swappiness = 10" in (fresh_root / DROPIN).read_text()
    finally:
        h.stop()
