"""A command's W3C trace context in root's audit log (DLV-CMD-15): the node's helper client sends the
context of the command being handled with each request (`"trace"`, a version-00 traceparent), and root
records its ids in the request's audit lines (docs/helper.md "Audit log"). A real Dispatcher runs the
commands; its handlers call the agent's own HelperClient, whose connection a process of the node's uid
made, against a real `bcd helper serve`; root's audit log is then read and verified."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.command import CommandEnvelope, UpdateState
from bcd_agent.helperclient import HelperClient
from bcd_agent.kinds.testing import EffectHandler, effect_handlers, effect_payload
from bcd_helper.audit import AuditLog, verify_chain
from bcd_shared.errors import HelperRefused
from dispatch.dhelpers import Harness, Pki, make_command, start
from helperproc import AUDIT_DIR, HelperProcess
from hostilekit import NODE_GID, NODE_UID, as_node, connect_as, refused_as_node
from intentkit import hold_text

TRACE_A = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACE_B = "0af7651916cd43dd8448eb211c80319c"
PARENT = "00f067aa0ba902b7"
GPU = "GPU-5f1c2a90-0000-4000-8000-000000000001"


class NodeClient(HelperClient):
    """The agent's HelperClient, its connection made by a process of the node's uid (the helper sees the
    node through SO_PEERCRED, as it sees `bcd node`). Connected before the dispatcher runs, so no fork
    happens while its threads do."""

    def __init__(self, h: HelperProcess) -> None:
        super().__init__(h.socket_path)
        self._sock, _ = connect_as(h, NODE_UID, NODE_GID)

    def _connect(self) -> Any:
        assert self._sock is not None, "the node's connection was dropped"
        return self._sock


def _ops(client: HelperClient, ident: str) -> None:
    """What each command's handler asks root (in a thread trio starts for it): a hold written (its
    `accepted` line goes ahead of the effect), a file removed, and one refused (a bad id)."""
    client.file_write("cdi", ident, hold_text(ident, [(GPU, None)], [f"BCD_ALLOCATION_ID={ident}"]))
    client.file_remove("allocation-env", ident)
    with pytest.raises(HelperRefused):
        client.file_remove("cdi", ident + "-bad")


async def _handle(tmp_path: Path, client: HelperClient, cmds: list[CommandEnvelope]) -> None:
    pki = Pki.build()
    h = Harness(tmp_path / "data", pki)

    async def hook(cmd: CommandEnvelope) -> None:
        token = json.loads(cmd.payload.value)["token"]
        await trio.to_thread.run_sync(_ops, client, f"trace_{token}")

    async with trio.open_nursery() as n:
        d = await start(n, h.dispatcher(effect_handlers(EffectHandler(tmp_path / "fx", before_effect=hook))))
        for cmd in cmds:
            d.deliver(cmd)
        with trio.fail_after(60):
            for cmd in cmds:
                done = await h.sink.wait_terminal(cmd.id)
                assert done.state is UpdateState.SUCCEEDED, done
        n.cancel_scope.cancel()


def _lines_of(helper: HelperProcess, ident: str, after: int) -> list[dict[str, Any]]:
    return [
        e for e in helper.audit_lines() if e["seq"] > after and str(e["args"].get("id", "")).startswith(ident)
    ]


async def test_DLV_CMD_15_roots_audit_lines_of_a_commands_helper_ops_carry_its_trace(
    helper: HelperProcess, tmp_path: Path
) -> None:
    """DLV-CMD-15: the helper ops a command's handler makes are audited by root with the command's trace
    id and parent id, on the `accepted` line written ahead of a file.write, on a remove's line and on a
    refusal's. A later version's traceparent goes on as version 00 (its ids unchanged); a command with an
    invalid one (upper-case hex) gets lines with neither field, and is not refused for it. The log, with
    and without the fields, verifies with its key, and `audit show` names the trace."""
    seq = helper.last_audit()["seq"]
    client = NodeClient(helper)
    pki = Pki.build()
    a = make_command(pki, payload=effect_payload("a", ("r-a",)), traceparent=f"00-{TRACE_A}-{PARENT}-01")
    b = make_command(pki, payload=effect_payload("b", ("r-b",)), traceparent=f"cc-{TRACE_B}-{PARENT}-00-x")
    c = make_command(
        pki, payload=effect_payload("c", ("r-c",)), traceparent=f"00-{TRACE_A.upper()}-{PARENT}-01"
    )
    try:
        await _handle(tmp_path, client, [a, b, c])
    finally:
        client.close()

    for token, trace in (("a", TRACE_A), ("b", TRACE_B)):
        mine = _lines_of(helper, f"trace_{token}", seq)
        got = [(e["op"], e["decision"], e["peer_uid"]) for e in mine]
        assert got == [
            ("file.write", "accepted", NODE_UID),
            ("file.remove", "accepted", NODE_UID),
            ("file.remove", "refused", NODE_UID),
        ], mine
        assert all((e["trace_id"], e["parent_id"]) == (trace, PARENT) for e in mine), mine
    untraced = _lines_of(helper, "trace_c", seq)
    assert len(untraced) == 3 and all("trace_id" not in e and "parent_id" not in e for e in untraced)

    directory = helper.root / AUDIT_DIR.lstrip("/")
    result = verify_chain(directory, helper.audit_key)
    assert result.ok, result.problem
    base = [sys.executable, "-m", "bcd_helper.cli", "audit", "--root", str(helper.root), "--dir", AUDIT_DIR]
    out = await trio.run_process(
        [*base, "verify", "--key", str(helper.audit_key)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    shown = (
        await trio.run_process([*base, "show", "--op", "file.write"], capture_stdout=True)
    ).stdout.decode()
    traced = [line for line in shown.splitlines() if '"trace_a"' in line]
    assert len(traced) == 1 and traced[0].endswith(f" trace={TRACE_A}"), shown


BAD_TRACES: list[Any] = [
    f"00-{TRACE_A.upper()}-{PARENT}-01",  # upper-case hex
    f"01-{TRACE_A}-{PARENT}-01",  # a later version: the node sends version 00 only
    f"00-{TRACE_A}-{PARENT}-01-extra",  # version 00 is exactly four fields
    f"00-{'0' * 32}-{PARENT}-01",  # an all-zero trace id
    f"00-{TRACE_A}-{'0' * 16}-01",  # an all-zero parent id
    f"00-{TRACE_A}-{PARENT}-1",  # 54 characters
    f"00-{TRACE_A}-{PARENT}-01\n",
    "",
    55,
    None,
    [f"00-{TRACE_A}-{PARENT}-01"],
    {"trace_id": TRACE_A},
    "x" * 1_000_000,  # bounded: the line records the rule, never the value
]


@pytest.mark.parametrize("value", BAD_TRACES, ids=range(len(BAD_TRACES)))
def test_DLV_CMD_15_a_malformed_trace_is_refused_naming_the_field_and_its_rule(
    helper: HelperProcess, value: Any
) -> None:
    """DLV-CMD-15: the helper decodes `trace` strictly (docs/helper.md "Audit log"): anything but a valid
    version-00 traceparent is refused `bad-request`, the message naming `$.trace` and the rule, as one
    short refused line that names the op and holds no trace fields; nothing changes."""
    answer = refused_as_node(
        helper, {"op": "helper.ping", "args": {}, "trace": value}, "bad-request", "$.trace"
    )
    assert "version 00" in answer["message"] and "55 characters" in answer["message"], answer
    raw = (helper.root / AUDIT_DIR.lstrip("/") / "audit.log").read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    line = json.loads(raw)
    assert line["op"] == "helper.ping" and "trace_id" not in line and "parent_id" not in line, line
    assert len(raw) < 1024, len(raw)


def test_a_request_with_a_trace_and_another_field_is_still_refused_for_its_shape(
    helper: HelperProcess,
) -> None:
    """Only `trace` is added to the request's shape: `{"op", "args", "trace", "x"}` and `{"op", "trace"}`
    are refused `bad-request` as before."""
    good = f"00-{TRACE_A}-{PARENT}-01"
    for doc in (
        {"op": "helper.ping", "args": {}, "trace": good, "x": 1},
        {"op": "helper.ping", "trace": good},
    ):
        refused_as_node(helper, doc, "bad-request", "exactly")
    answer = as_node(helper, {"op": "helper.ping", "args": {}, "trace": good})
    assert answer["ok"] is True, answer
    assert (helper.last_audit()["trace_id"], helper.last_audit()["parent_id"]) == (TRACE_A, PARENT)


def test_DLV_CMD_15_a_traced_line_is_sealed_like_any_other(tmp_path: Path) -> None:
    """DLV-CMD-15: lines with and without the trace fields chain and verify with the key; an edit of a
    line's trace id (a forged correlation) breaks its seal."""
    root = tmp_path / "host"
    root.mkdir(mode=0o755)
    log = AuditLog(root, AUDIT_DIR, syslog=False)
    key = log.created_key
    try:
        for i in range(4):
            log.record(
                peer_pid=1,
                peer_uid=4242,
                op="helper.ping",
                args={},
                args_sha256="0" * 64,
                decision="accepted",
                reason="",
                message="",
                duration_ms=0.0,
                trace=(TRACE_A, PARENT) if i % 2 else None,
            )
    finally:
        log.close()
    directory = root / AUDIT_DIR.lstrip("/")
    assert verify_chain(directory, key).ok
    text = (directory / "audit.log").read_bytes()
    lines = [json.loads(x) for x in text.splitlines()]
    assert ["trace_id" in e for e in lines] == [False, True, False, True]
    assert all(e["trace_id"] == TRACE_A and e["parent_id"] == PARENT for e in lines if "trace_id" in e)
    (directory / "audit.log").write_bytes(text.replace(TRACE_A.encode(), TRACE_B.encode(), 1))
    broken = verify_chain(directory, key)
    assert not broken.ok and "line 2" in broken.problem, broken


def test_DLV_CMD_15_audit_show_ends_a_traced_line_with_its_trace_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bcd helper audit show` (in process): a line with a trace ends ` trace=<trace id>`, one without has
    no trace part (the real helper's lines are shown by the test above, in a subprocess)."""
    import argparse

    from bcd_helper import audit

    root = tmp_path / "host"
    root.mkdir(mode=0o755)
    log = AuditLog(root, AUDIT_DIR, syslog=False)
    try:
        for i in range(2):
            log.record(
                peer_pid=7,
                peer_uid=4242,
                op="helper.ping",
                args={},
                args_sha256="0" * 64,
                decision="accepted",
                reason="",
                message="",
                duration_ms=0.0,
                trace=(TRACE_A, PARENT) if i else None,
            )
    finally:
        log.close()
    capsys.readouterr()
    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    assert audit.run(parser.parse_args(["--root", str(root), "--dir", AUDIT_DIR, "show"])) == 0
    shown = capsys.readouterr().out.splitlines()
    assert [line.split(" ", 1)[1] for line in shown] == [
        "#1 uid=4242 pid=7 helper.ping accepted  {}",
        f"#2 uid=4242 pid=7 helper.ping accepted  {{}} trace={TRACE_A}",
    ]
