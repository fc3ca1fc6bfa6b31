"""audit.head: the audit log's head (seq and SHA-256 of its newest line), for the node to report.

The node reads it and carries it in its StatusReport (bcd_agent), so that the control plane holds a copy
of the head outside this host (`bcd helper audit verify --expect-head SEQ:HASH`). Reading it also marks
every line up to it as exported: only exported lines are ever rotated away (bcd_helper.audit). No
arguments; served even while the log is full, since it is the way out.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from bcd_helper.ops.base import Call


@frozen
class AuditHead:
    pass


def audit_head(call: Call, _req: AuditHead) -> dict[str, Any]:
    return call.ctx.audit.export()
