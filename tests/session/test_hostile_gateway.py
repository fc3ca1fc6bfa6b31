"""Hostile gateway, round 1 (docs/session.md): a compromised gateway holds the TLS session but no signing
key. Each test drives the real SessionCore over a real journal (and identity.json where it matters) with
what such a gateway can send, and checks that nothing it says outlives the compromise."""

from __future__ import annotations

import time
from pathlib import Path

from bcd_agent.session import identity as ident
from bcd_shared import wire
from session.test_session_core import Pki, _persisting, connect, welcome

YEAR_MS = 365 * 86400 * 1000
LEAD_S = 300.0  # session.core.MAX_SERVER_LEAD_S


def test_a_far_future_server_time_does_not_lock_out_the_next_honest_gateway(tmp_path: Path) -> None:
    """A compromised gateway's Welcome and heartbeats say the year is ten years on. The mark (journal and
    identity.json) moves no further than the host clock + 5 minutes, so once an honest gateway
    is back, its Welcome with the true server time is admitted, in this process and after a restart;
    before the fix the mark kept the gateway's time and every later Welcome was refused forever."""
    pki = Pki()
    data = tmp_path / "data"
    core = _persisting(data, pki)
    now_ms = int(time.time() * 1000)
    connect(core, [], server_ms=now_ms + 10 * YEAR_MS)
    core.handle(wire.GatewayMessage(heartbeat=wire.GatewayHeartbeat(server_time=now_ms + 20 * YEAR_MS)))
    ceiling = time.time() + LEAD_S
    assert core.journal.server_time_mark <= ceiling
    assert ident.load(data).server_time_mark_ms / 1000 <= ceiling
    core.detach()
    core.attach([].append)
    core.handle(welcome(int(time.time() * 1000)))  # the honest gateway, same process
    assert core.state.welcomed
    core.journal.close()
    again = _persisting(data, pki, identity=ident.load(data))
    again.attach([].append)
    again.handle(welcome(int(time.time() * 1000)))  # and after a restart
    assert again.state.welcomed
    again.journal.close()
