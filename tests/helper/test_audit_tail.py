"""audit.tail through a real helper, asked by a process of the node's uid: the newest whole lines of root's
audit log within max_bytes, and nothing else (no path, no other file). For logs.collect (issue 13 item 3)."""

from __future__ import annotations

import json

from helperproc import HelperProcess
from hostilekit import as_node, assert_refused_raw


def test_the_node_reads_the_newest_whole_lines_of_the_audit_log(helper: HelperProcess) -> None:
    for _ in range(30):
        assert as_node(helper, {"op": "helper.ping", "args": {}})["ok"] is True
    answer = as_node(helper, {"op": "audit.tail", "args": {"max_bytes": 1024}})
    assert answer["ok"] is True, answer
    result = answer["result"]
    lines = [json.loads(line) for line in result["text"].splitlines()]
    assert result["truncated"] is True and 0 < len(result["text"].encode()) <= 1024
    newest = helper.audit_lines()
    assert lines == newest[-len(lines) - 1 : -1] or lines == newest[-len(lines) :]
    assert result["size_bytes"] >= 1024


def test_audit_tail_takes_no_path_and_bounds_its_size(helper: HelperProcess) -> None:
    for body, reason in [
        (b'{"op":"audit.tail","args":{"max_bytes":100}}', "bad-arguments"),
        (b'{"op":"audit.tail","args":{"max_bytes":2000000}}', "bad-arguments"),
        (b'{"op":"audit.tail","args":{"path":"/etc/shadow"}}', "bad-arguments"),
    ]:
        assert_refused_raw(helper, body, reason, op="audit.tail")
