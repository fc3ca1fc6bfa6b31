"""Issue 15 items 3 and 4: `--version`, the version in Hello, `bcd status` and `bcd doctor`; the daemons'
start and stop lines, journald priority prefixes, `--log-format json`, and the helper's READY=1 once
its socket is bound."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.devplane.plane import DevPlane
from bcd_agent.join import join
from bcd_agent.node import Node, NodeOptions, start_line
from bcd_shared import logsetup, wire
from bcd_shared.version import VERSION
from bcd_simhost.seed import seed
from testsupport import REPO

PYPROJECTS = ("shared", "helper", "agent", "devhost")


def _bcd(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", *argv],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip


# --- version -----------------------------------------------------------------------------------------


def test_one_version_everywhere() -> None:
    """The three distributions (and bcd-simhost) carry bcd_shared.version.VERSION."""
    for d in PYPROJECTS:
        doc = tomllib.loads((REPO / d / "pyproject.toml").read_text())
        assert doc["project"]["version"] == VERSION, d
        pins = [r for r in doc["project"].get("dependencies", []) if r.startswith("bcd-shared")]
        assert pins in ([], [f"bcd-shared=={VERSION}"]), d


def test_version_flags() -> None:
    res = _bcd("--version")
    assert (res.returncode, res.stdout) == (0, f"bcd {VERSION}\n")
    helper = subprocess.run(
        [sys.executable, "-m", "bcd_helper.cli", "--version"], capture_output=True, text=True, check=False
    )
    assert (helper.returncode, helper.stdout) == (0, f"bcd-helper {VERSION}\n")
    res = _bcd("helper", "--version")
    assert res.stdout == f"bcd-helper {VERSION}\n"


def test_status_and_doctor_show_the_version(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    empty = tmp_path / "empty.toml"  # a --config must exist (status refuses a missing one)
    empty.write_text("")
    res = _bcd("status", "--data-dir", str(data), "--no-holds", "--config", str(empty))
    assert res.stdout.splitlines()[0] == f"bcd {VERSION}; node version unknown", res.stdout + res.stderr
    res = _bcd("status", "--data-dir", str(data), "--no-holds", "--json", "--config", str(empty))
    doc = json.loads(res.stdout)
    assert doc["version"] == VERSION and doc["node_version"] is None
    res = _bcd("doctor", "--json", "--config", str(tmp_path / "none.toml"), "--root", str(tmp_path))
    assert json.loads(res.stdout)["version"] == VERSION
    res = _bcd("doctor", "--config", str(tmp_path / "none.toml"), "--root", str(tmp_path))
    assert res.stdout.splitlines()[0] == f"bcd doctor {VERSION}"


async def test_hello_and_status_file_carry_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's Hello names its version, and so does data_dir/status.json, which `bcd status` shows."""
    hellos: list[wire.Hello] = []
    opened = DevPlane.open_session

    def spy(self: DevPlane, hello: wire.Hello, send: Any) -> Any:
        hellos.append(hello)
        return opened(self, hello, send)

    monkeypatch.setattr(DevPlane, "open_session", spy)
    os.chmod(tmp_path, 0o755)
    root = tmp_path / "host"
    seed(root)
    gw = tmp_path / "gw.sock"
    data = tmp_path / "data"
    toml = tmp_path / "node.toml"
    toml.write_text(f'data_dir = "{data}"\n[control_plane]\nunix_socket = "{gw}"\n')
    from bcd_agent.config import load_config

    config = load_config(str(toml))
    plane = DevPlane(tmp_path / "dp", listen=None, unix_socket=gw)
    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        await join(config, token=plane.issue_token(), address=f"unix:{gw}")
        node = Node(config, NodeOptions(root=str(root), sections=False, status_interval_s=0.05))
        await nursery.start(node.run)
        with trio.fail_after(20):
            while not hellos or not (data / "status.json").exists():  # noqa: ASYNC110 - another task writes
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert hellos[0].version == VERSION
    assert json.loads((data / "status.json").read_text())["version"] == VERSION
    res = _bcd("status", "--data-dir", str(data), "--no-holds", "--config", str(toml))
    assert res.stdout.splitlines()[0] == f"bcd {VERSION}; node {VERSION}"


# --- log formats -------------------------------------------------------------------------------------


def _record(level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord("bcd.node", level, __file__, 1, msg, None, None)


def _journal_env() -> tuple[dict[str, str], int]:
    """JOURNAL_STREAM naming a file that is open on a descriptor (fd), as systemd sets it for fd 2."""
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    st = os.fstat(fd)
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, fd


def test_journald_is_the_stream_on_fd_2_not_the_variable_alone() -> None:
    env, fd = _journal_env()
    try:
        assert logsetup.under_journald(env, fd)
        assert not logsetup.under_journald(env, 1 if fd != 1 else 0)  # inherited variable, other stream
        assert not logsetup.under_journald({"JOURNAL_STREAM": "x:y"}, fd)
        assert not logsetup.under_journald({}, fd)
    finally:
        os.close(fd)


def test_journal_lines_carry_syslog_priorities_and_no_timestamp() -> None:
    fmt = logsetup.JournalFormatter()
    assert fmt.format(_record(logging.ERROR, "boom")) == "<3>bcd.node: boom"
    assert fmt.format(_record(logging.WARNING, "careful")) == "<4>bcd.node: careful"
    assert fmt.format(_record(logging.INFO, "a\nb")) == "<6>bcd.node: a\n<6>b"
    assert fmt.format(_record(logging.DEBUG, "x")) == "<7>bcd.node: x"
    assert fmt.format(_record(logging.CRITICAL, "x")).startswith("<2>")


def test_text_lines_are_readable_with_a_utc_timestamp() -> None:
    line = logsetup.TextFormatter().format(_record(logging.WARNING, "careful"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING bcd\.node: careful", line), line


def test_json_lines() -> None:
    doc = json.loads(logsetup.JsonFormatter().format(_record(logging.ERROR, "boom")))
    assert doc["level"] == "ERROR" and doc["priority"] == 3 and doc["logger"] == "bcd.node"
    assert doc["msg"] == "boom" and doc["ts"].endswith("Z")
    line = logsetup.JsonFormatter(journal=True).format(_record(logging.ERROR, "boom"))
    assert line.startswith("<3>{") and "ts" not in json.loads(line[3:])


def test_a_traceback_follows_the_message_in_every_format() -> None:
    """An exception's traceback comes after the line, never instead of it; in JSON as `exc`, with the
    keys in the order written (ts, level, priority, logger, msg, exc)."""
    try:
        raise RuntimeError("inner")
    except RuntimeError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("bcd.node", logging.ERROR, __file__, 1, "failed", None, exc_info)
    text = logsetup.TextFormatter().format(record).splitlines()
    assert text[0].endswith(" ERROR bcd.node: failed") and text[1] == "Traceback (most recent call last):"
    assert text[-1] == "RuntimeError: inner"
    journal = logsetup.JournalFormatter().format(record).splitlines()
    assert journal[0] == "<3>bcd.node: failed" and journal[-1] == "<3>RuntimeError: inner"
    line = logsetup.JsonFormatter().format(record)
    doc = json.loads(line)
    assert list(doc) == ["ts", "level", "priority", "logger", "msg", "exc"]
    assert doc["msg"] == "failed" and doc["exc"].endswith("RuntimeError: inner")
    assert "\n" not in line and "\\n" in line  # one line: the traceback escaped
    assert "é" in logsetup.JsonFormatter().format(_record(logging.INFO, "café"))  # not as \\u00e9


def test_auto_picks_journal_only_under_journald() -> None:
    assert logsetup.resolve("auto", {}) == "text"
    assert logsetup.resolve("json", {}) == "json"
    with pytest.raises(ValueError, match="--log-format"):
        logsetup.resolve("xml", {})
    stream = io.StringIO()
    logsetup.configure("info", "json", stream)
    logging.getLogger("bcd.test").info("hello")
    assert json.loads(stream.getvalue())["msg"] == "hello"


def test_node_start_line_names_version_config_data_dir_and_helper_mode(tmp_path: Path) -> None:
    from bcd_agent.config import parse_config

    with_helper = parse_config('data_dir = "/var/lib/bcd"\n[helper]\nsocket = "/run/bcd/helper.sock"\n', "c")
    line = start_line("/etc/bcd/config.toml", with_helper, "/", 990)
    assert line == (
        f"bcd node {VERSION} started: config /etc/bcd/config.toml, data_dir /var/lib/bcd,"
        " host changes through bcd helper at /run/bcd/helper.sock"
    )
    alone = parse_config('data_dir = "/var/lib/bcd"\n', "c")
    assert "host changes none (unprivileged" in start_line("/c.toml", alone, "/", 990)
    assert "acting as root" in start_line("/c.toml", alone, "/", 0)


def test_node_writes_start_and_stop_lines_in_json(tmp_path: Path) -> None:
    """`bcd node --log-format json`: the start line (version, config, data_dir, helper mode) and, on
    SIGTERM, the stop line, each one JSON object."""
    os.chmod(tmp_path, 0o755)
    root = tmp_path / "host"
    seed(root)
    data = tmp_path / "data"
    gw = tmp_path / "gw.sock"
    toml = tmp_path / "node.toml"
    toml.write_text(f'data_dir = "{data}"\n[control_plane]\nunix_socket = "{gw}"\n')
    plane = DevPlane(tmp_path / "dp", listen=None, unix_socket=gw)

    async def joined() -> None:
        from bcd_agent.config import load_config

        async with trio.open_nursery() as nursery:
            await nursery.start(plane.run)
            await join(load_config(str(toml)), token=plane.issue_token(), address=f"unix:{gw}")
            nursery.cancel_scope.cancel()

    trio.run(joined)
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bcd_agent.cli", "node", "--config", str(toml), "--root", str(root),
         "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        while True:  # the start line comes once the node has started (its signal handling set up)
            line = proc.stderr.readline()
            assert line, "the node ended before its start line"
            first = json.loads(line)
            if "started" in first["msg"]:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    mode = (
        "itself (no [helper] socket; acting as root)" if os.geteuid() == 0 else "itself on the simulated host"
    )
    assert first["msg"] == (
        f"bcd node {VERSION} started: config {toml}, data_dir {data}, root {root}, host changes {mode}"
    ), first
    assert first["level"] == "INFO" and "ts" in first
    lines = [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
    msgs = [d["msg"] for d in lines]
    assert "bcd node: SIGTERM received, stopping" in msgs, rest
    assert msgs[-1] == f"bcd node {VERSION} stopped"
    assert proc.returncode == 0


# --- the helper: start, READY=1, stop ---------------------------------------------------------------


def test_helper_logs_start_and_stop_and_notifies_ready_after_binding(tmp_path: Path) -> None:
    """`bcd helper serve` under a notify socket: READY=1 arrives when its socket exists; the start line
    names version, socket and config; on SIGTERM, STOPPING=1 and the stop line. Under journald
    (JOURNAL_STREAM naming its stderr) the lines carry <6> and no timestamp."""
    from helper.helperproc import base_config, make_root, write_config

    root = make_root(tmp_path)
    write_config(root, base_config())
    # Set up as an operator does (docs/helper.md): the audit log's sealing key before the first start.
    subprocess.run(
        [sys.executable, "-m", "bcd_helper.cli", "audit", "--root", str(root), "init"],
        check=True,
        capture_output=True,
    )
    notify_path = tmp_path / "notify.sock"
    log_path = tmp_path / "helper.log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify, log_path.open("wb") as log:
        notify.bind(str(notify_path))
        notify.settimeout(20)
        st = os.fstat(log.fileno())
        env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "bcd_helper.cli", "serve", "--root", str(root)],
            stdout=subprocess.DEVNULL, stderr=log, env=env,
        )  # fmt: skip
        try:
            ready = notify.recv(4096).decode()
            assert ready.splitlines()[0] == "READY=1", ready
            assert (root / "run/bcd/helper.sock").exists()
            proc.send_signal(signal.SIGTERM)
            assert notify.recv(4096).decode() == "STOPPING=1"
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = log_path.read_text().splitlines()
    sock = root / "run/bcd/helper.sock"
    assert lines[0] == (
        f"<6>bcd.helper: bcd-helper {VERSION} serving on {sock} (root {root}, config /etc/bcd/config.toml,"
        " node uid 4242)"
    ), lines
    assert lines[-1] == f"<6>bcd.helper: bcd-helper {VERSION} stopped (SIGTERM received)"
