"""What `bcd node` registers for issue 13: `diag.dcgm` and `logs.collect` everywhere the node runs;
`daemon.upgrade` and the `daemon` section only under the helper on a real host (a simulated host, `bcd sim`,
reports a non-empty daemon section UNSUPPORTED, as the seeds say); `driver.invoke` nowhere. (The daemon
half of the seeds' list of convergers; the rest is other sections'.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from bcd_agent.config import load_config
from bcd_agent.node import Node, NodeOptions
from bcd_simhost import sim_system
from bcd_simhost.seed import seed


def _node(tmp_path: Path, *, helper: bool, root: str) -> Node:
    toml = tmp_path / "node.toml"
    text = f'data_dir = "{tmp_path / "data"}"\n[host]\nunits = false\n'
    if helper:
        text += '[helper]\nsocket = "/run/bcd/helper.sock"\n'
    toml.write_text(text)
    return Node(load_config(str(toml)), NodeOptions(root=root))


def test_the_daemon_converger_and_upgrade_kind_only_under_the_helper_on_a_real_host(
    tmp_path: Path,
) -> None:
    host = tmp_path / "host"
    seed(host)
    system = sim_system(host)
    real = _node(tmp_path, helper=True, root="/")
    handlers = real._handlers(system)
    assert {"diag.dcgm", "logs.collect", "daemon.upgrade"} <= set(handlers)
    assert "driver.invoke" not in handlers
    real.secrets = SimpleNamespace(fetch=print)  # built by `run`; the telemetry section keeps a reference
    sections = real._sections(system, None, None, SimpleNamespace(node_id="node-a"), None)
    assert [s.name for s in sections if s.name == "daemon"] == ["daemon"]
    for node in (_node(tmp_path, helper=True, root=str(host)), _node(tmp_path, helper=False, root="/")):
        handlers = node._handlers(system)
        assert {"diag.dcgm", "logs.collect"} <= set(handlers) and "daemon.upgrade" not in handlers
        assert node._upgrader() is None
