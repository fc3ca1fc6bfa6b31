"""End to end: the development control plane, `bcd node` and the root helper as real processes.

A simulated host (bcd_shared.simhost) stands for `/`; the helper serves it as root (`bcd helper serve
--root`), the node joins over TLS with `bcd join`, runs `bcd node --root` with `[helper] socket`, and the
devplane is driven through its admin socket. Then the devplane is SIGKILLed while a command's side effect
runs and restarted on the same directory and port: the node reconnects, the result and the events still
arrive, and the effect happened once.

Covers DLV-RCV-01, DLV-RCV-02, DLV-RES-01, DLV-RES-03, DLV-RES-08, DLV-RES-11, DLV-EVT-03, DLV-EVT-04,
DLV-RCV-20, DLV-GEN-03.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.devplane.admin import AdminClient
from bcd_shared.simhost import sim_system
from bcd_shared.simhost.seed import seed

pytestmark = pytest.mark.slow

HELPER_SOCKET = "/run/bcd/helper.sock"


def _bcd(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", *args], capture_output=True, text=True, **kw
    )


def _wait(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, ConnectionError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


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
        # The root helper over the simulated host.
        helper_cfg = root / "etc/bcd/config.toml"
        helper_cfg.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(helper_cfg.parent, 0o750)
        helper_cfg.write_text(f'[helper]\nsocket = "{HELPER_SOCKET}"\nnode_uid = 4242\nnode_gid = 4242\n')
        os.chmod(helper_cfg, 0o640)
        helper = Proc(
            [sys.executable, "-m", "bcd_helper.cli", "serve", "--root", str(root)], tmp_path / "helper.log"
        )
        procs.append(helper)
        _wait("the helper socket", lambda: (root / HELPER_SOCKET.lstrip("/")).exists())
        world = {
            "tmp": tmp_path,
            "root": root,
            "dir": tmp_path / "devplane",
            "port": _free_port(),
            "procs": procs,
        }
        yield world
    finally:
        for p in reversed(procs):
            p.kill()


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


def test_e2e_spec_command_and_devplane_killed_mid_session(world: dict[str, Any]) -> None:
    tmp: Path = world["tmp"]
    root: Path = world["root"]
    admin = AdminClient(world["dir"])
    devplane = _start_devplane(world)

    # Join over TLS with the devplane's CA, then run the node under the helper.
    data = tmp / "data"
    config = tmp / "node.toml"
    config.write_text(f'data_dir = "{data}"\n\n[helper]\nsocket = "{HELPER_SOCKET}"\n')
    token = admin.call("token")
    joined = _bcd(
        "join", "--config", str(config), "--token", token, "--address", f"127.0.0.1:{world['port']}",
        "--ca-file", str(world["dir"] / "ca.pem"),
    )  # fmt: skip
    assert joined.returncode == 0, joined.stderr
    node_id = joined.stdout.strip()
    assert json.loads((data / "identity.json").read_text())["node_id"] == node_id
    assert (data / "identity.json").stat().st_mode & 0o777 == 0o600
    node = Proc(
        [
            sys.executable, "-m", "bcd_agent.cli", "node", "--config", str(config), "--root", str(root),
            "--test-kinds", "--test-effect-delay", "3",
        ],
        tmp / "node.log",
    )  # fmt: skip
    world["procs"].append(node)
    _wait("the node's session", lambda: admin.call("node", node=node_id)["connected"])

    # A spec with a GPU hold: applied, observed, and the node-signed AllocationBound event stored.
    out = sim_system(root).run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"]).stdout
    gpu = (out.decode() if isinstance(out, bytes) else out).split()[0]
    hold = {
        "allocationId": "alloc_1",
        "reservationId": "res_1",
        "binding": "BINDING_HOLD",
        "devices": [{"id": gpu, "deviceClass": "gpu"}],
    }
    spec = {"devices": {"assignments": [hold]}}
    assert admin.call("apply", spec=spec, node=node_id) == 1
    record = _wait(
        "observed generation 1",
        lambda: (r := admin.call("node", node=node_id))["observed_generation"] == 1 and r,
    )
    status = record["status"]
    assert status["observedGeneration"] == "1"
    devices = next(s for s in status["sections"] if s["section"] == "SECTION_DEVICES")
    assert devices["state"] == "SECTION_STATE_CONVERGED", devices.get("message")
    _wait(
        "AllocationBound",
        lambda: [e for e in admin.call("node", node=node_id)["events"] if e["type"] == "AllocationBound"],
    )
    assert (root / "etc/cdi/bcd-alloc_1.json").exists()

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
    time.sleep(4)  # the effect completes while the control plane is away; the node keeps its result
    _start_devplane(world)
    final = _wait(
        "the second command's result after the restart",
        lambda: (c := admin.call("command", id=second))["state"] == "succeeded" and c,
        timeout=60,
    )
    assert bytes.fromhex(final["result"]) == b'{"token": "two"}'

    # Events after the restart: the spec emptied, the release reported (stored once each).
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
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)), "each event stored once, in order"
    assert admin.call("node", node=node_id)["hellos"] >= 2

    # Nothing ran twice: one effect line per command, although the second was redelivered.
    lines = (data / "test-effects.log").read_text().splitlines()
    assert sum(1 for line in lines if line.startswith(first)) == 1
    assert sum(1 for line in lines if line.startswith(second)) == 1
    assert node.kill(signal.SIGTERM) == 0
