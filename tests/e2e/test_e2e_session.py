"""End to end: the development control plane, `bcd node` and the root helper as real processes.

A simulated host (bcd_simhost) stands for `/`; the helper serves it as root (`bcd helper serve
--root`), the node joins over TLS with `bcd join`, runs `bcd node --root` with `[helper] socket`, and the
devplane is driven through its admin socket. A spec with host units (sysctl, kernel-modules, k8s-join
with its token from the secret broker) and a GPU hold converges through the helper (host.unit, the
staged k8s token, the hold's file.write). Then the devplane is SIGKILLed while a command's side effect
runs and restarted on the same directory and port: the node reconnects, the result and the events still
arrive, and the effect happened once.

A second test runs `bcd node` without a helper, acting directly on the simulated host: host units and a
hold converge, and `node.reboot` is completed by the next boot (the fake systemctl records the reboot;
the node restarts with a new boot id and reports SUCCEEDED `rebooted`).

`bcd join` runs with a config without `[helper]`, so no join record is written to the real
/var/lib/bcd-hostconfig of the machine running the tests.

Covers DLV-RCV-01, DLV-RCV-02, DLV-RES-01, DLV-RES-03, DLV-RES-08, DLV-RES-11, DLV-EVT-03, DLV-EVT-04,
DLV-RCV-20, DLV-GEN-03, HST-HLP-01, HST-HLP-02, HST-K8S-50, HST-K8S-52, HST-K8S-53, DLV-PRIV-09,
DLV-JRN-17, DLV-REC-07.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.devplane.admin import AdminClient
from bcd_shared import wire
from bcd_simhost import sim_system
from bcd_simhost.seed import seed
from testsupport import wait_until as _wait

pytestmark = pytest.mark.slow

HELPER_SOCKET = "/run/bcd/helper.sock"
PIN = "ab" * 32
CLUSTERS = f"https://10.0.0.1:6443#sha256:{PIN}"
TOKEN_REF = "secret://pool/k8s-token"
TOKEN = "abcdef.0123456789abcdef"


def _bcd(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", *args], capture_output=True, text=True, **kw
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._fh = log.open("ab")
        self.proc = subprocess.Popen(args, stdout=self._fh, stderr=subprocess.STDOUT)

    def kill(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()
        return int(self.proc.returncode)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    os.chmod(tmp_path, 0o755)
    root = tmp_path / "host"
    seed(root)
    os.chmod(root, 0o755)
    procs: list[Proc] = []
    try:
        yield {
            "tmp": tmp_path,
            "root": root,
            "dir": tmp_path / "devplane",
            "port": _free_port(),
            "procs": procs,
        }
    finally:
        for p in reversed(procs):
            p.kill()


def _start_helper(world: dict[str, Any], join_pin: str) -> Proc:
    """The root helper over the simulated host. Root's config pins the JoinService key, so the helper
    verifies the trust bundle the node presents and, with its command roots, the signed spec every
    host.unit carries (bcd_helper.intent)."""
    root: Path = world["root"]
    helper_cfg = root / "etc/bcd/config.toml"
    helper_cfg.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(helper_cfg.parent, 0o750)
    helper_cfg.write_text(
        f'join_signing_key_pin = "{join_pin}"\n\n'
        f'[helper]\nsocket = "{HELPER_SOCKET}"\nnode_uid = 4242\nnode_gid = 4242\n\n'
        f'[kubernetes]\nallowed_clusters = "{CLUSTERS}"\n'
    )
    os.chmod(helper_cfg, 0o640)
    helper = Proc(
        [sys.executable, "-m", "bcd_helper.cli", "serve", "--root", str(root)], world["tmp"] / "helper.log"
    )
    world["procs"].append(helper)
    _wait("the helper socket", lambda: (root / HELPER_SOCKET.lstrip("/")).exists())
    return helper


def _start_devplane(world: dict[str, Any]) -> Proc:
    proc = Proc(
        [
            sys.executable, "-m", "bcd_agent.cli", "devplane", "serve",
            "--dir", str(world["dir"]), "--listen", f"127.0.0.1:{world['port']}",
        ],
        world["tmp"] / "devplane.log",
    )  # fmt: skip
    world["procs"].append(proc)
    _wait("the devplane admin socket", lambda: AdminClient(world["dir"]).call("nodes") is not None)
    return proc


def _unit(name: str, settings: dict[str, Any]) -> dict[str, str]:
    return {"name": name, "settings": json.dumps(settings, sort_keys=True, separators=(",", ":"))}


def _join(world: dict[str, Any], admin: AdminClient, data: Path) -> str:
    """`bcd join` over TLS with the devplane's CA; its config has no [helper] (no root join record)."""
    join_config = world["tmp"] / "join.toml"
    join_config.write_text(f'data_dir = "{data}"\n')
    joined = _bcd(
        "join", "--config", str(join_config), f"--token={admin.call('token')}",
        "--address", f"127.0.0.1:{world['port']}", "--ca-file", str(world["dir"] / "ca.pem"),
    )  # fmt: skip
    assert joined.returncode == 0, joined.stderr
    node_id = joined.stdout.strip()
    # stdout is the node id alone (scripts read it); the operator's next step is on stderr.
    assert joined.stdout == node_id + "\n"
    assert f"joined as {node_id}; next: systemctl enable --now bcd-node" in joined.stderr
    assert json.loads((data / "identity.json").read_text())["node_id"] == node_id
    assert (data / "identity.json").stat().st_mode & 0o777 == 0o600
    return node_id


def _start_node(world: dict[str, Any], config: Path, *extra: str) -> Proc:
    node = Proc(
        [sys.executable, "-m", "bcd_agent.cli", "node", "--config", str(config), "--root", str(world["root"]),
         *extra],
        world["tmp"] / "node.log",
    )  # fmt: skip
    world["procs"].append(node)
    return node


def _first_gpu(root: Path) -> str:
    out = sim_system(root).run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"]).stdout
    return (out.decode() if isinstance(out, bytes) else out).split()[0]


def _hold(gpu: str) -> dict[str, Any]:
    return {
        "allocationId": "alloc_1",
        "reservationId": "res_1",
        "binding": "BINDING_HOLD",
        "devices": [{"id": gpu, "deviceClass": "gpu"}],
    }


def _section(record: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in record["status"]["sections"] if s["section"] == f"SECTION_{name.upper()}")


def test_e2e_spec_command_and_devplane_killed_mid_session(world: dict[str, Any]) -> None:
    """Covers DLV-DS-01 (a spec and commands over one session) and DLV-DS-02 (a redelivered command
    has its effect once)."""
    tmp: Path = world["tmp"]
    root: Path = world["root"]
    admin = AdminClient(world["dir"])
    devplane = _start_devplane(world)
    _start_helper(world, admin.call("endpoint")["join_pin"])

    # Join, then run the node under the helper.
    data = tmp / "data"
    node_id = _join(world, admin, data)
    config = tmp / "node.toml"
    config.write_text(
        f'data_dir = "{data}"\n\n[helper]\nsocket = "{HELPER_SOCKET}"\n\n'
        f'[kubernetes]\nallowed_clusters = "{CLUSTERS}"\n'
    )
    node = _start_node(world, config, "--test-kinds", "--test-effect-delay", "3")
    _wait("the node's session", lambda: admin.call("node", node=node_id)["connected"])

    # A spec with host units and a GPU hold: the units go through the helper's host.unit (the node plans,
    # root applies), k8s-join with the token the node fetched by SecretRequest and staged for the helper;
    # the spec is observed and the node-signed AllocationBound event stored.
    gpu = _first_gpu(root)
    admin.call("secret", ref=TOKEN_REF, value=TOKEN)
    k8s = {"server": "https://10.0.0.1:6443", "caCertSha256": PIN, "tokenRef": TOKEN_REF,
           "kubernetesVersion": "1.34.1"}  # fmt: skip
    units = [_unit("sysctl", {"vm.swappiness": 10}), _unit("kernel-modules", {"load": ["vfio_pci"]})]
    spec = {"host": {"units": [*units, _unit("k8s-join", k8s)]}, "devices": {"assignments": [_hold(gpu)]}}
    assert admin.call("apply", spec=spec, node=node_id) == 1
    record = _wait(
        "observed generation 1",
        lambda: (r := admin.call("node", node=node_id))["observed_generation"] == 1 and r,
    )
    status = record["status"]
    assert status["observedGeneration"] == "1"
    devices = _section(record, "devices")
    assert devices["state"] == "SECTION_STATE_CONVERGED", devices.get("message")
    host = _section(record, "host")
    assert host["state"] == "SECTION_STATE_CONVERGED", host.get("message")
    _wait(
        "AllocationBound",
        lambda: [e for e in admin.call("node", node=node_id)["events"] if e["type"] == "AllocationBound"],
    )
    assert (root / "etc/cdi/bcd-alloc_1.json").exists()
    # The files root wrote on the simulated host, and what the helper audited.
    assert "vm.swappiness = 10" in (root / "etc/sysctl.d/90-bcd.conf").read_text()
    assert "vfio_pci" in (root / "etc/modules-load.d/bcd.conf").read_text()
    assert (root / "var/lib/bcd-hostconfig/k8s-join.json").exists()
    assert (root / "etc/kubernetes/kubelet.conf").exists()
    assert not (root / "var/lib/bcd-hostconfig/k8s/bootstrap-token").exists()  # consumed by the join
    audit = (root / "var/log/bcd-helper/audit.log").read_text()
    assert '"host.unit"' in audit and '"k8s-token"' in audit, audit[-2000:]

    # A command runs and its result is acked.
    first = admin.call("enqueue", kind="test.effect", payload={"token": "one"}, node=node_id)
    done = _wait(
        "the first command", lambda: (c := admin.call("command", id=first))["state"] == "succeeded" and c
    )
    assert [u["state"] for u in done["updates"]][-1] == "succeeded"

    # A second command: kill the devplane while its side effect runs (3 s), restart it on the same port.
    second = admin.call("enqueue", kind="test.effect", payload={"token": "two"}, node=node_id)
    _wait("the second command running", lambda: admin.call("command", id=second)["state"] == "running")
    assert devplane.kill(signal.SIGKILL) == -signal.SIGKILL
    # The effect completes while the control plane is away (its line in the effect log, written after
    # the 3 s delay): the node keeps its result. Waited for, not slept: a slow machine's effect may
    # take longer than a fixed sleep, and the restart would come before it.
    _wait(
        "the second command's effect",
        lambda: any(line.startswith(second) for line in (data / "test-effects.log").read_text().splitlines()),
    )
    _start_devplane(world)
    final = _wait(
        "the second command's result after the restart",
        lambda: (c := admin.call("command", id=second))["state"] == "succeeded" and c,
        timeout=60,
    )
    assert bytes.fromhex(final["result"]) == b'{"token": "two"}'

    # Events after the restart: the spec emptied, the release reported (stored once each).
    # The host section unset: a full spec decides it, so the helper cleans the units (signed intent).
    assert admin.call("apply", spec={}, node=node_id) == 2
    _wait("observed generation 2", lambda: admin.call("node", node=node_id)["observed_generation"] == 2)
    events = _wait(
        "AllocationReleased",
        lambda: (
            (ev := admin.call("node", node=node_id)["events"])
            and any(e["type"] == "AllocationReleased" for e in ev)
            and ev
        ),
    )
    assert not (root / "etc/sysctl.d/90-bcd.conf").exists()  # sysctl cleaned through the helper
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)), "each event stored once, in order"
    assert admin.call("node", node=node_id)["hellos"] >= 2

    # Nothing ran twice: one effect line per command, although the second was redelivered.
    lines = (data / "test-effects.log").read_text().splitlines()
    assert sum(1 for line in lines if line.startswith(first)) == 1
    assert sum(1 for line in lines if line.startswith(second)) == 1
    assert node.kill(signal.SIGTERM) == 0


def test_e2e_node_acts_directly_and_node_reboot_completes_at_the_next_boot(world: dict[str, Any]) -> None:
    """Covers DLV-REC-18: node.reboot completes SUCCEEDED from the next boot, end to end."""
    tmp: Path = world["tmp"]
    root: Path = world["root"]
    admin = AdminClient(world["dir"])
    _start_devplane(world)
    data = tmp / "data"
    node_id = _join(world, admin, data)
    config = tmp / "node.toml"
    config.write_text(f'data_dir = "{data}"\n')  # no helper: the node writes the simulated host itself
    node = _start_node(world, config)
    _wait("the node's session", lambda: admin.call("node", node=node_id)["connected"])

    units = [_unit("sysctl", {"vm.swappiness": 20}), _unit("kernel-modules", {"load": ["vfio_pci"]})]
    spec = {"host": {"units": units}, "devices": {"assignments": [_hold(_first_gpu(root))]}}
    assert admin.call("apply", spec=spec, node=node_id) == 1
    record = _wait(
        "observed generation 1",
        lambda: (r := admin.call("node", node=node_id))["observed_generation"] == 1 and r,
    )
    for name in ("host", "devices"):
        assert _section(record, name)["state"] == "SECTION_STATE_CONVERGED", _section(record, name)
    assert "vm.swappiness = 20" in (root / "etc/sysctl.d/90-bcd.conf").read_text()
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "20"
    assert "vfio_pci" in (root / "etc/modules-load.d/bcd.conf").read_text()
    assert (root / "etc/cdi/bcd-alloc_1.json").exists()
    assert (
        not (root / "var/log/bcd-helper/audit.log").exists()
        or "host.unit" not in (root / "var/log/bcd-helper/audit.log").read_text()
    )

    # node.reboot: running{boot_id} journaled, then the (fake) systemctl records the reboot.
    boot_file = root / "proc/sys/kernel/random/boot_id"
    first_boot = boot_file.read_text().strip()
    cid = admin.call("enqueue", kind="node.reboot", payload={"reason": "e2e"}, node=node_id)
    _wait("the reboot requested", lambda: (root / "var/lib/bcd-sim/reboot-requested").exists())
    _wait("node.reboot running", lambda: admin.call("command", id=cid)["state"] == "running")
    assert node.kill(signal.SIGTERM) == 0
    # The next boot: a new boot id; the restarted node completes the command from its journal.
    boot_file.write_text("0f0e0d0c-0b0a-4909-8807-060504030201\n")
    _start_node(world, config)
    done = _wait(
        "node.reboot completed by the next boot",
        lambda: (c := admin.call("command", id=cid))["state"] == "succeeded" and c,
    )
    assert done["reason"] == "rebooted", done
    assert bytes.fromhex(done["result"]) == bytes(wire.NodeRebootResult(previous_boot_id=first_boot))
