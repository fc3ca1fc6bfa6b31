"""The node's host-section parts (bcd_agent.nodeparts.host) on the simulated host: the unit context and
the k8s token staging in front of the helper's host.unit. The real helper path is in tests/e2e.

Covers the identity labels (HST-K8S-44 but bcd.dev/site, which no config carries), HST-K8S-52/53 (the
token staged for the helper, removed when the join did not use it), HST-HLP-02 (busy devices sent).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.inventory.gpus import collect_gpus
from bcd_agent.nodeparts.host import TokenStagingSend, busy_devices, identity_labels
from bcd_agent.sections.host import HelperAnswer, HostSection
from bcd_agent.sections.host.wire import from_wire
from bcd_shared import wire
from bcd_shared.errors import TerminalError
from bcd_shared.system import atomic_write
from bcd_simhost import sim_system

K8S = json.dumps({"caCertSha256": "ab" * 32, "server": "https://10.0.0.1:6443", "tokenRef": "secret://t"})
TOKEN = "abcdef.0123456789abcdef"


class Client:
    """Records the helper calls TokenStagingSend makes (file kinds only; host.unit is `inner`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def file_write(self, kind: str, ident: str, content: str) -> dict[str, Any]:
        self.calls.append(("write", kind, ident, content))
        return {}

    def file_remove(self, kind: str, ident: str) -> bool:
        self.calls.append(("remove", kind, ident))
        return True


class Tokens:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.fetched: list[str] = []

    def fetch(self, token_ref: str) -> str:
        self.fetched.append(token_ref)
        if self.error is not None:
            raise self.error
        return TOKEN

    def consumed(self) -> None:
        pass


def test_HST_K8S_52_53_token_staged_before_host_unit_and_removed_when_unused(sim_root: Path) -> None:
    system = sim_system(sim_root)
    client, tokens = Client(), Tokens()
    sent: list[tuple[str, list[tuple[str, ...]]]] = []

    def inner(name: str, settings: str | None, busy: frozenset[str]) -> HelperAnswer:
        sent.append((name, list(client.calls)))
        return HelperAnswer(False, "k8s-join: kubeadm join failed")

    send = TokenStagingSend(inner, client, system, tokens)
    answer = send("k8s-join", K8S, frozenset())
    assert not answer.ok and tokens.fetched == ["secret://t"]
    # Staged before host.unit went out, removed after since the join did not happen.
    assert sent == [("k8s-join", [("write", "k8s-token", "", TOKEN + "\n")])]
    assert client.calls[-1] == ("remove", "k8s-token", "")

    # Joined already (kubelet.conf exists): no token is fetched or staged.
    atomic_write(sim_root / "etc/kubernetes/kubelet.conf", b"apiVersion: v1\n")
    client.calls.clear()
    send("k8s-join", K8S, frozenset())
    assert client.calls == [] and tokens.fetched == ["secret://t"]
    # Other units and cleans never stage.
    send("sysctl", '{"vm.swappiness":10}', frozenset())
    send("k8s-join", None, frozenset())
    assert client.calls == []


def test_a_refused_token_fails_the_unit_terminally_without_host_unit(sim_root: Path) -> None:
    sent: list[str] = []
    send = TokenStagingSend(
        lambda name, _s, _b: sent.append(name) or HelperAnswer(True),  # type: ignore[func-returns-value]
        Client(),
        sim_system(sim_root),
        Tokens(TerminalError("SecretRefused", "secret://t: the control plane refused to release it")),
    )
    answer = send("k8s-join", K8S, frozenset())
    assert not answer.ok and answer.terminal and "refused" in answer.message
    assert sent == []


@pytest.mark.planted_cdi  # an unreadable hold file claims every GPU
def test_identity_labels_and_busy_devices(sim_root: Path) -> None:
    system = sim_system(sim_root)
    gpus = collect_gpus(system)
    labels = dict(identity_labels("node-1a2b", gpus))
    assert labels["bcd.dev/node-id"] == "node-1a2b"
    assert labels["bcd.dev/gpu.count"] == str(len(gpus.gpus)) == "8"
    assert labels["bcd.dev/gpu.product"] == gpus.gpus[0].name.replace(" ", "-")
    assert labels["bcd.dev/gpu.driver"] == gpus.driver_version
    assert "bcd.dev/site" not in labels  # no site is known to the node
    assert dict(identity_labels("n", None)) == {"bcd.dev/node-id": "n"}
    # No holds: nothing busy; an unparseable hold spec: every GPU.
    assert busy_devices(system, str(sim_root / "data"), gpus) == frozenset()
    atomic_write(sim_root / "etc/cdi/bcd-alloc_x.json", b"{not json")
    assert busy_devices(system, str(sim_root / "data"), gpus) == frozenset(g.uuid for g in gpus.gpus)


def test_from_wire_keeps_names_settings_and_order() -> None:
    section = wire.HostSection(
        units=[wire.HostUnit(name="sysctl", settings='{"a":1}'), wire.HostUnit(name="nope", settings="{}")]
    )
    assert from_wire(section) == HostSection((("sysctl", '{"a":1}'), ("nope", "{}")))
    assert from_wire(None) == HostSection()


def test_DEV_CONF_13_units_leave_alone_what_holds_and_releases_name(sim_root: Path) -> None:
    """Covers DEV-CONF-13: the GPUs the host units (mig-layout) must not repartition are exactly what a
    live hold or a pending release names, and every GPU while the pending-releases file cannot be read."""
    from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec
    from bcd_agent.sections.devices.observe import RELEASES_FILE, encode_releases
    from bcd_agent.sections.devices.plan import PendingRelease
    from bcd_simhost.gpus import gpu_uuid
    from devices.devhost import DATA_DIR, Host

    host = Host(sim_root)
    gpus = collect_gpus(host.system)
    held = DeviceAssignment("a1", "rsv_a1", "BINDING_HOLD", (DeviceRef(gpu_uuid(1), "gpu"),), None)
    assert host.run(DevicesSpec(1, (held,))).state.value == "CONVERGED"
    assert busy_devices(host.system, DATA_DIR, gpus) == frozenset({gpu_uuid(1)})
    # A pending Kubernetes release names its devices until it is reported.
    pending = PendingRelease("k1", "rsv_k1", 1, (f"{gpu_uuid(2)}/s0",), 0.0)
    host.system.write_atomic(f"{DATA_DIR}/{RELEASES_FILE}", encode_releases((pending,)))
    assert busy_devices(host.system, DATA_DIR, gpus) == frozenset({gpu_uuid(1), f"{gpu_uuid(2)}/s0"})
    host.system.write_atomic(f"{DATA_DIR}/{RELEASES_FILE}", b"{torn")
    assert busy_devices(host.system, DATA_DIR, gpus) == frozenset(g.uuid for g in gpus.gpus)
