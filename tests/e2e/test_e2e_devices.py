"""End to end: a 2-GPU reservation bound and released through the development control plane.

`bcd devplane serve` and `bcd node --root` (acting directly on the simulated host, no helper) run as real
processes, joined over TLS with `bcd join`, as in test_e2e_session.py (whose helpers this reuses). The
devplane is driven through its admin socket: a spec whose devices section holds two whole GPUs for one
allocation, then a spec without it.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import test_e2e_session as session
from bcd_agent.devplane.admin import AdminClient
from bcd_agent.devplane.store import DB_FILE
from bcd_shared import cdi, wire
from bcd_simhost import sim_system
from testsupport import wait_until as _wait

pytestmark = pytest.mark.slow

world = session.world  # the fixture: a seeded simulated host, the devplane's directory and port
_join, _section, _start_devplane, _start_node = (
    session._join,
    session._section,
    session._start_devplane,
    session._start_node,
)


def _gpus(root: Path) -> list[str]:
    out = sim_system(root).run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"]).stdout
    return (out.decode() if isinstance(out, bytes) else out).split()


def _reports(world: dict[str, Any], node_id: str, kind: str) -> list[Any]:
    """The node-signed reports of type `kind` the devplane stored, parsed from its database."""
    db = sqlite3.connect(f"file:{world['dir'] / DB_FILE}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT event FROM events WHERE node_id = ? AND type = ? ORDER BY seq", (node_id, kind)
        ).fetchall()
    finally:
        db.close()
    out = []
    for (raw,) in rows:
        event = wire.Event.parse(raw)
        assert event.attested is not None, event
        out.append(wire.AttestedReportBody.parse(event.attested.body))
    return out


def test_DLV_DEV_12_a_2_gpu_reservation_binds_and_releases_end_to_end(world: dict[str, Any]) -> None:
    """DLV-DEV-12: through the development control plane, a spec holding two whole GPUs for one
    allocation reaches a real `bcd node`, which binds it: the devices section converges, the CDI spec
    and env file name both GPUs, and the devplane stores one node-signed AllocationBound with both.
    A spec without it releases it: the files go, and one AllocationReleased names both GPUs."""
    tmp: Path = world["tmp"]
    root: Path = world["root"]
    admin = AdminClient(world["dir"])
    _start_devplane(world)
    data = tmp / "data"
    node_id = _join(world, admin, data)
    config = tmp / "node.toml"
    config.write_text(f'data_dir = "{data}"\n')  # no helper: the node writes the simulated host itself
    _start_node(world, config)
    _wait("the node's session", lambda: admin.call("node", node=node_id)["connected"])
    g0, g1 = _gpus(root)[:2]
    hold = {
        "allocationId": "alloc_2gpu",
        "reservationId": "res_2gpu",
        "binding": "BINDING_HOLD",
        "devices": [{"id": g0, "deviceClass": "gpu"}, {"id": g1, "deviceClass": "gpu"}],
    }
    assert admin.call("apply", spec={"devices": {"assignments": [hold]}}, node=node_id) == 1
    record = _wait(
        "observed generation 1",
        lambda: (r := admin.call("node", node=node_id))["observed_generation"] == 1 and r,
    )
    devices = _section(record, "devices")
    assert devices["state"] == "SECTION_STATE_CONVERGED", devices.get("message")
    _wait("AllocationBound", lambda: _reports(world, node_id, "AllocationBound"))
    [bound] = _reports(world, node_id, "AllocationBound")
    assert bound.node_id == node_id
    b = bound.allocation_bound
    assert (b.allocation_id, b.reservation_id, b.generation) == ("alloc_2gpu", "res_2gpu", 1)
    assert sorted(b.device_ids) == sorted([g0, g1])
    cdi_spec = json.loads((root / "etc/cdi/bcd-alloc_2gpu.json").read_text())
    assert sorted(d["name"] for d in cdi_spec["devices"]) == sorted(cdi.device_name(g) for g in (g0, g1))
    env = (root / "run/bcd/allocations/alloc_2gpu.env").read_text()
    assert g0 in env and g1 in env, env

    assert admin.call("apply", spec={}, node=node_id) == 2
    _wait("observed generation 2", lambda: admin.call("node", node=node_id)["observed_generation"] == 2)
    _wait("AllocationReleased", lambda: _reports(world, node_id, "AllocationReleased"))
    [released] = _reports(world, node_id, "AllocationReleased")
    r = released.allocation_released
    assert (r.allocation_id, r.generation) == ("alloc_2gpu", 2)
    assert sorted(r.device_ids) == sorted([g0, g1])
    assert not (root / "etc/cdi/bcd-alloc_2gpu.json").exists()
    assert not (root / "run/bcd/allocations/alloc_2gpu.env").exists()
    assert len(_reports(world, node_id, "AllocationBound")) == 1  # stored once
