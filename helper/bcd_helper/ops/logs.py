"""audit.tail: the newest part of root's audit log, for `logs.collect` (issue 13 item 3).

The node cannot read `<audit_dir>/audit.log` (root-only); `logs.collect` puts its tail into the bundle it
uploads for the operator. Root reads at most `max_bytes` (1 KiB to 1 MiB, default 256 KiB) from the end of
the current file only, opened through verified root-only directories without following a symlink
(bcd_shared.rootpath), and answers whole lines (the partial first line dropped) as UTF-8 text. Nothing
else is readable through it: no path, no older file, no other directory. The lines are what every
request already shows in its own audit line (bounded shown arguments, digests for the rest).
"""

from __future__ import annotations

import os
from typing import Any, Final

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, open_regular_nofollow

from bcd_helper.ops.base import Call, Failed, Refused

DEFAULT_TAIL: Final = 256 * 1024
MAX_TAIL: Final = 1024 * 1024


@frozen
class AuditTail:
    max_bytes: int = DEFAULT_TAIL


def audit_tail(call: Call, req: AuditTail) -> dict[str, Any]:
    if not 1024 <= req.max_bytes <= MAX_TAIL:
        raise Refused("bad-arguments", f"audit.tail: max_bytes must be 1024 to {MAX_TAIL}")
    # The bytes read, their text and the encoded answer: from the in-flight budget, held until the answer
    # is sent, so a node that asks on many connections and reads nothing holds no more (round 5).
    if call.reserve is not None and not call.reserve(4 * req.max_bytes):
        raise Refused("busy", "audit.tail: the helper holds as many large answers as it may: try again later")
    path = call.ctx.config.audit_dir.rstrip("/") + "/audit.log"
    try:
        fd, st = open_regular_nofollow(call.ctx.root, path)
    except FileNotFoundError:
        return {"text": "", "size_bytes": 0, "truncated": False}
    except (RootPathRefused, OSError) as exc:
        raise Failed("audit-tail", f"audit.tail: {path}: {exc}") from None
    try:
        start = max(0, st.st_size - req.max_bytes)
        data = os.pread(fd, req.max_bytes, start)
    finally:
        os.close(fd)
    if start > 0:
        cut = data.find(b"\n")
        data = data[cut + 1 :] if cut >= 0 else b""
    return {"text": data.decode("utf-8", errors="replace"), "size_bytes": st.st_size, "truncated": start > 0}
