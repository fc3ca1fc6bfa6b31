"""Red team round 10 (docs/helper.md, "Threat model, round 10"): the node's account, compromised, against
daemon.confirm and the ops that put the node's values on a program's argv, as a real unprivileged client
(a forked child dropped to the node's uid: SO_PEERCRED sees that uid and its pid) against a real
`bcd helper serve` over a simulated host. Each test of a fix failed on the code before it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.ops import daemon
from bcd_helper.ops.base import Call, Deadline, Peer
from helperproc import HelperProcess
from hostilekit import NODE_GID, NODE_UID, NodeProcess, as_node, refused_as_node
from intentkit import ControlPlane
from releasekit import RECORD, old_release_host, staged_swap


def test_round10_a_confirm_from_a_process_that_started_before_the_flip_is_refused(
    fresh_root: Path, cp: ControlPlane
) -> None:
    """DLV-PRIV-10. The node's old release asks for the swap, root flips /usr/lib/bcd/bcd and restarts
    the node with `--no-block`; the old process, still there, answers `daemon.confirm healthy` for the
    new version before the new one has run at all. Root took it (round 9, "Found and not closed", row 1):
    the release counted as installed and healthy, never rolled back. Now root dates the confirming
    process (SO_PEERCRED's pid, /proc/PID/stat's starttime) against the flip it recorded: a process
    that started before the flip is refused `peer-predates-swap`, the record stays pending and the timer
    armed, and a process started after it (the restarted node) confirms."""
    h = old_release_host(fresh_root, cp)
    try:
        old = NodeProcess(h)  # the old release's process: started before the swap
        new = b"#!/bin/sh\necho bcd 1.1.0\n" + os.urandom(16)
        assert as_node(h, staged_swap(cp.command.leaf(), fresh_root, new))["ok"] is True
        record = json.loads((fresh_root / RECORD).read_text())
        assert record["state"] == "pending" and isinstance(record["flip_tick"], int)
        answer = old.ask({"op": "daemon.confirm", "args": {"version": "1.1.0", "healthy": True}})
        assert answer is not None
        assert (answer["ok"], answer.get("reason")) == (False, "peer-predates-swap"), answer
        assert "started" in answer["message"] and "/usr/lib/bcd/bcd" in answer["message"]
        assert json.loads((fresh_root / RECORD).read_text())["state"] == "pending"
        assert h.last_audit()["reason"] == "peer-predates-swap"
        # The restarted node: a process forked after the swap's answer.
        confirmed = as_node(h, {"op": "daemon.confirm", "args": {"version": "1.1.0"}})
        assert confirmed["ok"] is True, confirmed
        assert json.loads((fresh_root / RECORD).read_text())["state"] == "confirmed"
    finally:
        h.stop()


def test_round10_an_old_process_may_still_report_the_new_release_unhealthy(
    fresh_root: Path, cp: ControlPlane
) -> None:
    """`healthy: false` rolls back, the safe direction: it is not dated (a rollback from any process of
    the node is what the deadline would do anyway)."""
    h = old_release_host(fresh_root, cp)
    try:
        old = NodeProcess(h)
        new = b"#!/bin/sh\necho bcd 1.1.0\n" + os.urandom(16)
        assert as_node(h, staged_swap(cp.command.leaf(), fresh_root, new))["ok"] is True
        answer = old.ask({"op": "daemon.confirm", "args": {"version": "1.1.0", "healthy": False}})
        assert answer is not None
        assert answer["ok"] is True and answer["result"]["rolled_back"] is True, answer
    finally:
        h.stop()


def test_round10_a_swap_whose_flip_time_was_never_recorded_is_not_confirmed_by_the_node(
    fresh_root: Path, cp: ControlPlane
) -> None:
    """A helper stopped between the flip and the record of its time (flip_tick null, as the first,
    durable-before-effect record says): root cannot date the flip, so no node process confirms the swap
    (`flip-unrecorded`), and the deadline rolls it back."""
    h = old_release_host(fresh_root, cp)
    try:
        new = b"#!/bin/sh\necho bcd 1.1.0\n" + os.urandom(16)
        assert h.raw(staged_swap(cp.command.leaf(), fresh_root, new))["ok"] is True
        h.stop()
        path = fresh_root / RECORD
        path.write_text(json.dumps({**json.loads(path.read_text()), "flip_tick": None}))
        h = HelperProcess(fresh_root)
        answer = as_node(h, {"op": "daemon.confirm", "args": {"version": "1.1.0"}})
        assert (answer["ok"], answer.get("reason")) == (False, "flip-unrecorded"), answer
        assert json.loads(path.read_text())["state"] == "pending"
    finally:
        h.stop()


def _pending(flip_tick: int | None, boot: str) -> dict[str, Any]:
    return {
        "state": "pending",
        "version": "1.1.0",
        "flip_tick": flip_tick,
        "flip_boot_id": boot,
    }


@pytest.mark.parametrize(
    ("started", "boot", "now_boot", "outcome"),
    [
        (101, "A", "A", None),  # the tick after the flip's: after it
        (100, "A", "A", "peer-predates-swap"),  # the flip's own tick may hold both
        (5, "A", "A", "peer-predates-swap"),
        (None, "A", "A", "peer-predates-swap"),  # no such process (gone, or pid 0)
        (5, "A", "B", None),  # another boot than the flip's started after it
        (5, "", "A", "flip-unrecorded"),  # a record from before round 10
        (5, "A", "", "flip-unrecorded"),  # no boot id to compare
    ],
)
def test_round10_the_confirming_process_is_dated_against_the_flip(
    monkeypatch: pytest.MonkeyPatch,
    started: int | None,
    boot: str,
    now_boot: str,
    outcome: str | None,
) -> None:
    """DLV-PRIV-10. The rule in process, each time controlled (no clock involved)."""
    monkeypatch.setattr(daemon, "start_tick", lambda _pid: started)
    monkeypatch.setattr(daemon, "boot_id", lambda: now_boot)
    doc = _pending(100 if boot else None, boot)
    c = Call(None, Peer(12345, NODE_UID, NODE_GID), Deadline(60), None)  # type: ignore[arg-type]
    if outcome is None:
        daemon._check_peer_started_after_flip(c, doc)
    else:
        with pytest.raises(daemon.Refused) as exc:
            daemon._check_peer_started_after_flip(c, doc)
        assert exc.value.reason == outcome


def test_round10_start_tick_reads_field_22_past_a_comm_with_parentheses() -> None:
    """/proc/PID/stat's comm may hold spaces and ")": field 22 is counted from the last ")"."""
    mine = daemon.start_tick(os.getpid())
    assert mine is not None and 0 <= mine <= daemon.boot_tick()
    assert daemon.start_tick(0) is None and daemon.start_tick(2**22 + 7) is None


@pytest.mark.parametrize(
    ("doc", "reason", "text"),
    [
        # Values that would read as options on root's argv (systemctl, ip, virsh, nvidia-smi), or carry
        # a newline, a NUL or 300 characters: each refused by its field's rule before any program runs.
        ({"op": "slice.apply", "args": {"name": "-bcd-alloc-a.slice"}}, "bad-slice-name", "hold slice"),
        ({"op": "slice.apply", "args": {"name": "bcd-alloc-a.slice\n"}}, "bad-slice-name", "hold slice"),
        ({"op": "slice.remove", "args": {"name": "--all"}}, "bad-slice-name", "hold slice"),
        (
            {"op": "slice.apply", "args": {"name": "bcd-alloc-a.slice", "cpus": "0\n"}},
            "bad-cpulist",
            "N or N-M",
        ),
        ({"op": "ch.taps", "args": {"name": "--help", "bridges": ["br0"]}}, "bad-name", "instance id"),
        ({"op": "ch.untaps", "args": {"name": "-x"}}, "bad-name", "instance id"),
        ({"op": "ch.stop", "args": {"name": "vm-a\x00"}}, "bad-name", "instance id"),
        ({"op": "ch.launch", "args": {"name": "a" * 300}}, "bad-name", "instance id"),
        ({"op": "libvirt.setmem", "args": {"name": "-c", "kib": 1}}, "bad-name", "instance id"),
        ({"op": "libvirt.destroy", "args": {"name": "vm-a\nvm-b"}}, "bad-name", "instance id"),
        ({"op": "libvirt.console", "args": {"name": "--devname"}}, "bad-name", "instance id"),
        ({"op": "gpu.reset", "args": {"gpu_uuids": ["-r"]}}, "invalid-payload", "not a GPU UUID"),
        ({"op": "audit.tail", "args": {"max_bytes": -1}}, "bad-arguments", "max_bytes"),
        ({"op": "daemon.confirm", "args": {"version": "1.0.0\n"}}, "no-pending-swap", ""),
    ],
)
def test_round10_option_like_and_control_values_never_reach_an_argv(
    helper: HelperProcess, doc: dict[str, Any], reason: str, text: str
) -> None:
    """Tried and already refused (docs/helper.md, round 10): each value is refused by its field's rule,
    audited, and nothing under the root changed."""
    refused_as_node(helper, doc, reason, text)
