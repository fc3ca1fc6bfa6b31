"""`bcd status` tells a live node from a stopped, disconnected or stale one; `bcd status --check` probes it.

The end-to-end test runs the real processes (the development control plane on a Unix socket, `bcd join`,
`bcd node` on a simulated host), kills the control plane, then stops the node, and reads `bcd status` and
`bcd status --check` at each step. The others write status.json directly to reach the cases a live run
reaches only slowly (a stale file, a recycled pid, an hour of disconnection).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import evolve
from bcd_agent.converge.types import Condition, NodeStatus, SectionState, SectionStatus
from bcd_agent.devplane.admin import AdminClient
from bcd_agent.status import StatusSnapshot, check, render, snapshot
from bcd_agent.statusfile import process_start, read_status, status_path, write_status
from bcd_simhost.seed import seed
from clisupport import bcd
from testsupport import wait_until

NOW = 1_800_000_000.0


def _wait(what: str, check_: Callable[[], Any], timeout: float = 30.0) -> Any:
    return wait_until(
        what, check_, timeout, errors=(OSError, ValueError)
    )  # ValueError: status.json mid-write


def _proc(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "bcd_agent.cli", *args], stdout=fh, stderr=fh)


def _stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _session(data: Path) -> dict[str, Any]:
    view = read_status(data)
    node = view.extra.get("node") if view is not None else None
    return dict(node["session"]) if isinstance(node, dict) else {}


def test_status_follows_a_node_through_disconnection_and_stop(tmp_path: Path) -> None:
    root, plane_dir, data = tmp_path / "host", tmp_path / "devplane", tmp_path / "data"
    seed(root)
    sock = tmp_path / "gateway.sock"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        plane = _proc(["devplane", "serve", "--dir", str(plane_dir), "--listen", "", "--unix", str(sock)],
                      tmp_path / "devplane.log")  # fmt: skip
        procs.append(plane)
        admin = AdminClient(plane_dir)
        _wait("the devplane", lambda: sock.exists() and admin.call("nodes") is not None)
        config = tmp_path / "node.toml"
        config.write_text(f'data_dir = "{data}"\n[control_plane]\nunix_socket = "{sock}"\n')
        joined = bcd("join", "--config", str(config), f"--token={admin.call('token')}", "--address",
                     f"unix:{sock}")  # fmt: skip
        assert joined.returncode == 0, joined.stderr
        node = _proc(["node", "--config", str(config), "--root", str(root)], tmp_path / "node.log")
        procs.append(node)
        _wait("the session up", lambda: _session(data).get("state") == "connected")

        up = bcd("status", "--data-dir", str(data), "--check")
        assert up.returncode == 0
        assert re.fullmatch(rf"ok: pid {node.pid} up, connected, status \d+s old\n", up.stdout), up.stdout
        text = bcd("status", "--data-dir", str(data), "--no-holds").stdout.splitlines()
        assert text[1].startswith(f"node: up (pid {node.pid}, bcd ")
        assert text[2].startswith(f"session: connected to unix:{sock} for ")
        assert "; last heartbeat " in text[2]
        assert text[3] == "converge: last pass none yet"  # no spec yet

        _stop(plane, signal.SIGKILL)
        _wait("the session down", lambda: _session(data).get("state") == "disconnected")
        _wait("a failed attempt", lambda: _session(data).get("attempts", 0) >= 1)
        assert _session(data)["last_error"]
        time.sleep(1.1)
        late = bcd("status", "--data-dir", str(data), "--check", "--max-disconnected", "1")
        assert late.returncode == 1
        assert late.stdout.startswith("FAIL: disconnected for ") and "(over 1 s)" in late.stdout
        assert bcd("status", "--data-dir", str(data), "--check").returncode == 0  # within the default 300 s
        text = bcd("status", "--data-dir", str(data), "--no-holds").stdout.splitlines()
        assert (
            text[2].startswith(f"session: disconnected from unix:{sock} for ") and "last error: " in text[2]
        )
        # The error without "connection to ENDPOINT ended:" (the line names the endpoint once), as
        # docs/operations.md shows it.
        assert text[2].count(str(sock)) == 1, text[2]
        assert "; last error: connection failed: ConnectionRefusedError: " in text[2], text[2]

        _stop(node, signal.SIGTERM)
        assert node.returncode == 0
        down = bcd("status", "--data-dir", str(data), "--check")
        assert (down.returncode, down.stdout) == (1, f"FAIL: down: pid {node.pid} is not running\n")
        shown = bcd("status", "--data-dir", str(data), "--no-holds")
        assert shown.returncode == 1
        lines = shown.stdout.splitlines()
        assert lines[1].startswith(f"node: DOWN (pid {node.pid} is not running); last status ")
        assert lines[2].startswith("last known session: disconnected")
        generation = next(line for line in lines if line.startswith("generation:"))
        assert "(last known: " in generation
        assert (
            json.loads(bcd("status", "--data-dir", str(data), "--no-holds", "--json").stdout)["liveness"][
                "alive"
            ]
            is False
        )
    finally:
        for p in reversed(procs):
            _stop(p, signal.SIGTERM)


def _status(state: SectionState = SectionState.CONVERGED) -> NodeStatus:
    return NodeStatus(
        version=1,
        applied_generation=3,
        observed_generation=3 if state.settled else 2,
        spec_hash="h",
        sections=(SectionStatus("devices", state, 3, "" if state.settled else "HolderBusy", "GPU-1 busy"),),
        conditions=(Condition("RebootRequired", "hugepages", "reboot", "host", since_monotonic=10.0),),
        passes=1,
        last_pass_monotonic=0.0,
    )  # fmt: skip


def _node(since: float, state: str = "connected", next_pass: float | None = NOW + 20) -> dict[str, object]:
    return {
        "node": {
            "version": "0.1.0",
            "session": {"state": state, "since": since, "last_error": "" if state == "connected" else "no",
                        "retry_at": None, "attempts": 3, "last_heartbeat_at": NOW - 5,
                        "endpoint": "unix:/gw"},
            "converge": {"last_pass_at": NOW - 10, "next_pass_at": next_pass, "next_pass_reason": "retry"},
        }
    }  # fmt: skip


def _snap(tmp: Path, *, written: float = NOW, extra: dict[str, object] | None = None,
          state: SectionState = SectionState.CONVERGED) -> StatusSnapshot:  # fmt: skip
    write_status(tmp, _status(state), now_monotonic=11.0, now_wall=written, extra=extra or _node(NOW - 60))
    return snapshot(str(tmp), None, now_wall=NOW)


def test_check_stale_and_disconnected_bounds(tmp_path: Path) -> None:
    """The pid is this test's process (alive); the file's age and the link's decide."""
    fresh = _snap(tmp_path)
    assert check(fresh, max_disconnected_s=300, max_stale_s=60) == []
    stale = _snap(tmp_path, written=NOW - 61)
    assert check(stale, max_disconnected_s=300, max_stale_s=60) == [
        "stale: status.json written 1m01s ago (over 60 s)"
    ]
    assert check(stale, max_disconnected_s=300, max_stale_s=62) == []
    away = _snap(tmp_path, extra=_node(NOW - 400, "disconnected"))
    assert check(away, max_disconnected_s=300, max_stale_s=60) == ["disconnected for 6m40s (over 300 s): no"]
    assert check(away, max_disconnected_s=401, max_stale_s=60) == []
    assert check(_snap(tmp_path, extra=_node(NOW - 400)), max_disconnected_s=1, max_stale_s=60) == []


def test_a_recycled_pid_is_not_the_node(tmp_path: Path) -> None:
    """Same pid, another start time: another process got the node's pid after it stopped."""
    write_status(tmp_path, _status(), now_monotonic=11.0, now_wall=NOW, extra=_node(NOW - 60))
    path = status_path(tmp_path)
    doc = json.loads(path.read_text())
    assert doc["pid"] == os.getpid() and doc["pid_start"] == process_start(os.getpid())
    doc["pid_start"] += 1
    path.write_text(json.dumps(doc))
    snap = snapshot(str(tmp_path), None, now_wall=NOW)
    assert snap.live is not None and snap.live.process == "recycled" and snap.exit_code == 1
    assert check(snap, max_disconnected_s=300, max_stale_s=60) == [
        f"down: pid {os.getpid()} is another process now"
    ]
    assert (
        render(snap, now_wall=NOW)
        .splitlines()[1]
        .startswith(f"node: DOWN (pid {os.getpid()} is another process now)")
    )


def test_a_section_without_reason_ends_its_line_without_blanks(tmp_path: Path) -> None:
    """As docs/operations.md shows `host       CONVERGED       1`: before, two trailing spaces."""
    status = evolve(_status(), sections=(SectionStatus("host", SectionState.CONVERGED, 3, "", ""),))
    write_status(tmp_path, status, now_monotonic=11.0, now_wall=NOW, extra=_node(NOW - 60))
    lines = render(snapshot(str(tmp_path), None, now_wall=NOW), now_wall=NOW).splitlines()
    assert "host       CONVERGED       3" in lines
    assert all(line == line.rstrip() for line in lines)


def test_a_progressing_section_shows_its_next_retry_and_why(tmp_path: Path) -> None:
    snap = _snap(tmp_path, state=SectionState.PROGRESSING)
    text = render(snap, now_wall=NOW)
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("devices    PROGRESSING"))
    assert lines[i + 1].strip() == "next retry in 20s, because HolderBusy"
    assert lines[2] == "session: connected to unix:/gw for 1m00s; last heartbeat 5s ago"
    assert lines[3] == "converge: last pass 10s ago; next pass in 20s (retry)"


def test_no_status_file_is_down_for_check(tmp_path: Path) -> None:
    res = bcd("status", "--data-dir", str(tmp_path), "--check")
    assert res.returncode == 1
    assert res.stdout == "FAIL: down: no status.json (bcd node has not run with this data_dir)\n"


def test_a_missing_data_dir_is_named_not_taken_for_a_node_that_never_ran(tmp_path: Path) -> None:
    """A mistyped --data-dir: before, "no status published yet", as if the node had simply not run."""
    missing = tmp_path / "no-such-dir"
    snap = snapshot(str(missing), None, now_wall=NOW)
    problem = f"data_dir {missing} does not exist (check --data-dir, or the config's data_dir)"
    assert check(snap, max_disconnected_s=300, max_stale_s=60) == [f"down: {problem}"]
    assert render(snap).splitlines()[1] == f"node: no status: {problem}"
    assert f"! {problem}" not in render(snap)


def test_root_without_data_dir_reads_the_configs_data_dir_under_root(tmp_path: Path) -> None:
    """`bcd status --root DIR`: the config's data_dir (a host path) is DIR's, as for `bcd doctor --root`;
    before, the real host's /var/lib/bcd was read."""
    res = bcd("status", "--root", str(tmp_path), "--check")
    assert res.returncode == 1
    assert res.stdout.startswith(f"FAIL: down: data_dir {tmp_path}/var/lib/bcd does not exist"), res.stdout


def test_an_unreadable_status_file_is_not_called_missing(tmp_path: Path) -> None:
    """A status.json that does not parse: `--check` names it, never "no status.json"."""
    status_path(tmp_path).write_text("{bad")
    snap = snapshot(str(tmp_path), None, now_wall=NOW)
    (problem,) = check(snap, max_disconnected_s=300, max_stale_s=60)
    assert problem.startswith(f"down: {status_path(tmp_path)}: not JSON (")
    assert "no status.json" not in problem
    assert render(snap).splitlines()[1].startswith(f"node: no status: {status_path(tmp_path)}: not JSON")
    status_path(tmp_path).write_text("{}")
    snap = snapshot(str(tmp_path), None, now_wall=NOW)
    assert check(snap, max_disconnected_s=300, max_stale_s=60) == [
        f'down: {status_path(tmp_path)}: has no "format" key (not a status.json bcd node wrote)'
    ]


def test_a_node_in_another_pid_namespace_is_judged_by_the_files_age(tmp_path: Path) -> None:
    """A host reading a container's node: the pid means nothing here; three missed rewrites mean down."""
    for written, alive in ((NOW - 5, True), (NOW - 31, False)):
        write_status(tmp_path, _status(), now_monotonic=11.0, now_wall=written, extra=_node(NOW - 60))
        path = status_path(tmp_path)
        doc = json.loads(path.read_text())
        assert doc["pid_ns"] == os.readlink("/proc/self/ns/pid")
        doc["pid_ns"] = "pid:[1]"  # not ours
        path.write_text(json.dumps(doc))
        snap = snapshot(str(tmp_path), None, now_wall=NOW)
        assert snap.live is not None and snap.live.process == "foreign" and snap.live.alive is alive
        head = render(snap, now_wall=NOW).splitlines()[1]  # after the version line
        assert head.startswith(
            f"node: {'up' if alive else 'DOWN'} (pid {os.getpid()} in another pid namespace"
        )
        problems = check(snap, max_disconnected_s=300, max_stale_s=60)
        assert problems == ([] if alive else ["down: no status.json written for 31s (another pid namespace)"])


def test_watch_reprints_on_a_change_not_on_ages(tmp_path: Path) -> None:
    """`bcd status --watch` off a terminal: ages and liveness lines move every round without a new block;
    a section's message that changes (even one with " in " in it) prints one."""
    import io

    from bcd_agent.status import watch

    rounds = iter(
        [
            (NOW - 1, "waiting in line"),
            (NOW - 2, "waiting in line"),  # only the file's age differs
            (NOW - 3, "waiting in the queue"),
        ]
    )

    def take() -> StatusSnapshot:
        written, message = next(rounds)
        status = _status(SectionState.PROGRESSING)
        section = status.sections[0]
        status = NodeStatus(
            version=1, applied_generation=3, observed_generation=2, spec_hash="h",
            sections=(SectionStatus(section.section, section.state, 3, "HolderBusy", message),),
            conditions=(), passes=1, last_pass_monotonic=0.0,
        )  # fmt: skip
        write_status(tmp_path, status, now_monotonic=11.0, now_wall=written, extra=_node(written - 30))
        return snapshot(str(tmp_path), None, now_wall=NOW)

    out = io.StringIO()
    watch(take, out, interval=0, tty=False, count=3, sleep=lambda _: None)
    assert out.getvalue().count("SECTION") == 2
    assert "waiting in the queue" in out.getvalue().split("SECTION")[2]
