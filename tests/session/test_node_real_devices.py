"""Devices on a real node (issue 15, item 9): what `bcd node` gives the devices section and Hello.

- `[devices] pod_resources_socket` reaches the devices section (under `--root`, the simulated host's
  path), so a released Kubernetes hold is reported once the kubelet says no pod holds it;
- Hello advertises `nvml` when nvidia-smi answers, and not when it fails (devices-and-holds.md
  "Hello claims nothing");
- an unreadable /proc/meminfo (a read error, not a missing file) binds without host-side admission, with
  the warning, instead of stopping the section (delivery.md "Host-side admission").
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.config import load_config
from bcd_agent.node import Node, NodeOptions, device_capabilities
from bcd_agent.sections.devices.model import DevicesSpec, Limits
from bcd_agent.sections.devices.plan import ADMISSION_UNREADABLE_WARNING
from bcd_agent.session import identity as ident
from bcd_simhost.gpus import gpu_uuid
from bcd_simhost.seed import seed
from devices.devhost import Host
from testsupport import node_identity

NODE = "node-devices-1"


def _identity() -> ident.Identity:
    now = dt.datetime.now(dt.UTC)
    return node_identity(NODE, now - dt.timedelta(days=1), now + dt.timedelta(days=30))


def _config(tmp_path: Path, extra: str = "") -> tuple[Path, Any]:
    root = tmp_path / "host"
    seed(root)
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    ident.save(data, _identity())
    toml = tmp_path / "node.toml"
    toml.write_text(
        f'data_dir = "{data}"\n[control_plane]\nunix_socket = "{tmp_path / "nobody.sock"}"\n{extra}'
    )
    return root, load_config(str(toml))


@pytest.mark.parametrize("configured", [None, "/run/kubelet/pod-resources.sock"])
async def test_pod_resources_socket_reaches_the_devices_section(
    tmp_path: Path, configured: str | None
) -> None:
    extra = f'[devices]\npod_resources_socket = "{configured}"\n' if configured else ""
    root, config = _config(tmp_path, extra)
    async with trio.open_nursery() as nursery:
        node = Node(config, NodeOptions(root=str(root), backoff_max_s=1.0))
        await nursery.start(node.run)
        [devices] = [s for s in node.runner._sections.values() if s.name == "devices"]
        expected = configured or "/var/lib/kubelet/pod-resources/kubelet.sock"
        assert devices.pod_resources is not None
        assert devices.pod_resources.socket_path == str(root / expected.lstrip("/"))
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("driver", [True, False])
async def test_hello_advertises_nvml_when_nvidia_smi_answers(tmp_path: Path, driver: bool) -> None:
    """Covers DEV-CAP-02: a real `bcd node`'s Hello carries `nvml` when nvidia-smi answered, and only then."""
    root, config = _config(tmp_path)
    if not driver:
        (root / "var/lib/bcd-sim/gpus.json").unlink()  # the fake nvidia-smi: "couldn't communicate"
    async with trio.open_nursery() as nursery:
        node = Node(config, NodeOptions(root=str(root), backoff_max_s=1.0))
        await nursery.start(node.run)
        hello = node.core.attach(lambda _m: None).hello
        assert ("nvml" in hello.capabilities) is driver
        assert {"cdi", "devices.limits", "binding.kubernetes"} <= set(hello.capabilities)
        node.core.detach()
        nursery.cancel_scope.cancel()


def test_nvml_is_advertised_without_the_hold_capabilities() -> None:
    """An unprivileged node takes no holds (DEV-UNPRIV-02) but still says nvidia-smi answered."""
    assert device_capabilities(True, False, nvml=True) == ("nvml",)
    assert device_capabilities(True, True, nvml=False) == ("cdi", "devices.limits", "binding.kubernetes")


def test_unreadable_meminfo_binds_without_admission(sim_root: Path) -> None:
    """A read error (here EISDIR; EIO or EACCES on a real host), not a missing file: the hold binds, its
    limits applied, with the warning; the section is CONVERGED, not stopped."""
    from bcd_agent.converge.types import SectionState
    from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef

    host = Host(sim_root)
    meminfo = host.path("/proc/meminfo")
    meminfo.unlink()
    meminfo.mkdir()
    wanted = DeviceAssignment(
        allocation_id="a",
        reservation_id="r",
        devices=(DeviceRef(gpu_uuid(0), "gpu"),),
        limits=Limits(memory_bytes=900 << 30, cpus="0-3"),
    )
    spec = DevicesSpec(1, (wanted,))
    plan = host.section.plan(spec, 1)
    assert ADMISSION_UNREADABLE_WARNING in plan.warnings and plan.failures == ()
    assert host.run(spec).state is SectionState.CONVERGED
    assert host.path("/etc/cdi/bcd-a.json").exists()
