"""Issue 9 item 6: under bcd helper the node reads the helper's audit head (op `audit.head`) from a real
helper process and its StatusReport carries it (`helper_audit_head`), so the control plane holds a copy
off the host; reading it is what lets the helper rotate lines away (docs/helper.md "Audit log")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from bcd_agent.converge.runner import ConvergeRunner
from bcd_agent.node import Node
from bcd_agent.session.status import status_report
from bcd_shared import wire
from helperproc import AUDIT_DIR, HelperProcess, base_config, make_root


async def _observe() -> Any:
    return None


async def test_node_reports_the_helpers_audit_head_in_its_status_report(tmp_path: Path) -> None:
    helper = HelperProcess(make_root(tmp_path), base_config())
    try:
        runner = ConvergeRunner([], _observe)
        runner._publish()  # the runner's first status (a pass would do this)
        before = runner.status.latest()
        assert before is not None and before.audit_head is None
        assert status_report(before, 0.0).helper_audit_head is None

        class Shell:
            def _helper_client(self) -> Any:
                from bcd_agent.helperclient import HelperClient

                return HelperClient(helper.socket_path)

        shell: Any = Shell()
        shell.runner = runner
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(Node._read_audit_head, shell)  # reads, then sleeps AUDIT_HEAD_INTERVAL_S
                await runner.status.wait_newer(before.version)
                nursery.cancel_scope.cancel()
        status = runner.status.latest()
        assert status is not None and status.version == before.version + 1 and status.audit_head is not None
        seq, sha = status.audit_head
        # The head names a line the helper wrote, unchanged: the one before the audit.head request's own line.
        lines = (helper.root / AUDIT_DIR.lstrip("/") / "audit.log").read_bytes().splitlines()
        import hashlib

        (line,) = [x for x in lines if json.loads(x)["seq"] == seq]
        assert hashlib.sha256(line).hexdigest() == sha
        assert json.loads(lines[-1])["op"] == "audit.head" and json.loads(lines[-1])["seq"] == seq + 1
        report = status_report(status, 0.0)
        assert report.helper_audit_head == wire.HelperAuditHead(seq=seq, sha256=sha)
        assert wire.StatusReport.parse(bytes(report)).helper_audit_head == report.helper_audit_head
    finally:
        helper.stop()
