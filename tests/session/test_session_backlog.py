"""Events under faults (issue 16, items 1 and 2).

- A gateway that stops reading with a backlog of events: the node reads from the journal only what its
  send queue admits (bytes counted, a ceiling), declares the peer dead after `stall_timeout_s` and makes a
  new connection; once the gateway reads again, every event arrives. (The 120 s RSS measurement is
  `bcd bench converge`'s `stalled_gateway_rss_growth_mb`; here boundedness is asserted by queue bytes.)
- A journal that lost its tail (its SQLite WAL cut mid-transaction, or emptied, as a disk that lost its
  last writes): the node never reuses an event seq the gateway already holds; it starts a new journal_id,
  says why, raises `JournalTailLost`, and every event journaled after the restart reaches the gateway.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.bench.stallproxy import StallProxy
from bcd_agent.config import load_config
from bcd_agent.devplane.plane import DevPlane
from bcd_agent.dispatch.clock import OffsetClock
from bcd_agent.dispatch.trust import BundleTrust
from bcd_agent.join import join
from bcd_agent.journal import EventClass, Journal, NewEvent
from bcd_agent.node import Node, NodeOptions
from bcd_agent.session.conditions import JOURNAL_TAIL_LOST
from bcd_agent.session.core import EventsRestarted, SessionCore
from bcd_agent.session.outbox import EVENT_RESERVE_BYTES, MAX_OUTBOX_BYTES
from bcd_shared import wire
from bcd_simhost.seed import seed
from test_session_core import Pki, Recorder, make, welcome

pytestmark = pytest.mark.slow

KiB = 1024


async def _until(what: str, check: Callable[[], Any], within: float) -> Any:
    with trio.fail_after(within):
        while not (got := check()):  # noqa: ASYNC110 - polls state other tasks change
            await trio.sleep(0.05)
    assert got, what
    return got


# --- item 1: a gateway that stops reading ------------------------------------------------------------------


async def test_a_stalled_gateway_bounds_the_send_queue_and_is_replaced(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    root = tmp_path / "host"
    seed(root)
    plane_sock, proxy_sock = tmp_path / "gw.sock", tmp_path / "px.sock"
    plane = DevPlane(tmp_path / "dp", listen=None, unix_socket=plane_sock)
    proxy = StallProxy(proxy_sock, plane_sock)
    toml = tmp_path / "node.toml"
    toml.write_text(
        f'data_dir = "{tmp_path / "data"}"\n'
        f'[control_plane]\nunix_socket = "{proxy_sock}"\nstall_timeout_s = 5\n'
    )
    config = load_config(str(toml))
    events, size = 2500, 10 * KiB  # 25 MB of unacked events
    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        await nursery.start(proxy.run)
        identity = await join(config, token=plane.issue_token(), address=f"unix:{plane_sock}")
        node = Node(
            config, NodeOptions(root=str(root), sections=False, backoff_initial_s=0.1, backoff_max_s=0.5)
        )
        await nursery.start(node.run)
        await _until("the session", lambda: node.core.state.welcomed, 20)
        first_journal = node.journal.journal_id
        proxy.stall()
        for _ in range(0, events, 100):
            node.journal.append_events(
                [NewEvent(EventClass.TRANSITION, "test.backlog", os.urandom(size)) for _i in range(100)]
            )
        node.session.events_changed()
        t0 = time.monotonic()
        await _until(
            "the stalled peer declared dead",
            lambda: any("peer not reading" in f for f in node.session.failures),
            30,
        )
        assert time.monotonic() - t0 < 25
        # Read from the journal only what the queue admits: at most the events' share of the ceiling.
        peak = max(
            node.session.outbox_peak_bytes, node.session.outbox.peak_bytes if node.session.outbox else 0
        )
        assert 0 < peak <= MAX_OUTBOX_BYTES - EVENT_RESERVE_BYTES + 2 * size, peak
        proxy.resume()

        def delivered() -> bool:
            row = plane.store.one(
                "SELECT count(*) FROM events WHERE node_id = ? AND journal_id = ?",
                identity.node_id,
                first_journal,
            )
            return row is not None and int(row[0]) >= events

        await _until("every event at the gateway", delivered, 90)
        nursery.cancel_scope.cancel()


# --- item 2: a lost journal tail ------------------------------------------------------------------------


class Gateway:
    """The gateway's event rules (seeds: "Events"; DLV-EVT-05/07/08): stores the events above its
    cumulative ack for the node's current journal, a new journal_id (at Hello) counts from 0."""

    def __init__(self) -> None:
        self.journal_id = ""
        self.acked = 0
        self.stored: dict[tuple[str, int], bytes] = {}

    def hello(self, hello: wire.Hello) -> None:
        if hello.journal_id != self.journal_id:
            self.journal_id, self.acked = hello.journal_id, 0

    def batches(self, out: list[wire.NodeMessage]) -> list[wire.Ack]:
        acks = []
        for m in out:
            batch = m.event_batch
            if batch is None or batch.journal_id != self.journal_id:
                continue
            top = self.acked
            for e in batch.events:
                if e.seq > self.acked:
                    self.stored[(batch.journal_id, e.seq)] = bytes(e.payload)
                    top = max(top, e.seq)
            self.acked = top
            acks.append(wire.Ack(journal_id=batch.journal_id, event_seq=top))
        out.clear()
        return acks


def _session(core: SessionCore, gateway: Gateway, out: list[wire.NodeMessage]) -> None:
    """Hello, Welcome, then batches and acks until nothing is left to send."""
    hello = core.attach(out.append).hello
    assert hello is not None
    gateway.hello(hello)
    core.handle(welcome())
    while True:
        acks = gateway.batches(out)
        if not acks:
            return
        for ack in acks:
            core.handle(wire.GatewayMessage(ack=ack))
        core.pump_events()


def _append(journal: Journal, n: int, tag: str) -> None:
    for i in range(0, n, 50):
        journal.append_events(
            [NewEvent(EventClass.TRANSITION, "t", f"{tag}-{j}".encode()) for j in range(i, min(i + 50, n))]
        )


def _crash_copy(src: Path, dst: Path, wal_size: int | None) -> None:
    """What a crash leaves when the disk lost the WAL's tail: the db file as it is, the WAL cut to
    `wal_size` bytes (0: emptied), and the files beside the journal."""
    dst.mkdir(mode=0o700)
    for f in src.iterdir():
        if f.name.startswith("journal.db"):
            continue
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    shutil.copy2(src / "journal.db", dst / "journal.db")
    wal = (src / "journal.db-wal").read_bytes()
    (dst / "journal.db-wal").write_bytes(wal[: len(wal) if wal_size is None else wal_size])


@pytest.mark.parametrize("cut", ["mid-transaction", "emptied", "emptied-without-mark"])
def test_a_lost_journal_tail_never_reuses_an_acked_event_seq(tmp_path: Path, cut: str) -> None:
    """700 events sent and acked, then the WAL loses its tail (cut inside a later transaction, or emptied):
    the journal restarts below 700. The node detects it (the event mark beside the journal says seq 700
    was sent; without the mark, the gateway's Ack of 700, above anything the journal issued, says so),
    starts a new journal_id, raises JournalTailLost, and all 200 events journaled after the restart reach
    the gateway (today: 0 of 200, or some of 200, the rest dropped as duplicates)."""
    pki = Pki()
    data = tmp_path / "data"
    journal = Journal.open(data, boot_id="boot-1")
    _append(journal, 100, "old")
    journal.close()  # checkpointed: the db file holds the first 100
    journal = Journal.open(data, boot_id="boot-1")
    journal._conn.execute("PRAGMA wal_autocheckpoint=0")  # every later commit stays in the WAL
    core, out, _rec, _mono = make(tmp_path, pki, journal=journal)
    gateway = Gateway()
    _append(journal, 300, "old")
    wal_400 = (data / "journal.db-wal").stat().st_size
    _append(journal, 300, "old")
    wal_700 = (data / "journal.db-wal").stat().st_size
    _session(core, gateway, out)
    assert gateway.acked == 700 and len(gateway.stored) == 700
    old_id = journal.journal_id
    crashed = tmp_path / "crashed"
    _crash_copy(data, crashed, 0 if cut.startswith("emptied") else (wal_400 + wal_700) // 2)
    if cut == "emptied-without-mark":
        (crashed / "event-mark.json").unlink()
    core.detach()
    journal.close()

    lost = Journal.open(crashed, boot_id="boot-1")
    assert lost.journal_id == old_id and lost.next_event_seq <= 700  # the tail is gone: seqs would repeat
    rec = Recorder()
    core2 = SessionCore(
        journal=lost,
        dispatcher=rec,
        runner=rec,
        trust=BundleTrust(),
        clock=OffsetClock(),
        identity=pki.identity(),
        data_dir=crashed,
        persist_identity=False,
    )
    out2: list[wire.NodeMessage] = []
    if cut != "emptied-without-mark":
        # Detected at start from the event mark: a new journal_id before the first Hello.
        assert lost.journal_id != old_id
        assert core2.conditions.has(JOURNAL_TAIL_LOST)
    _append(lost, 200, "new")
    if cut == "emptied-without-mark":
        # The first batch reuses seqs; the gateway's Ack above anything issued reveals it.
        with pytest.raises(EventsRestarted):
            _session(core2, gateway, out2)
        assert lost.journal_id != old_id and core2.conditions.has(JOURNAL_TAIL_LOST)
        core2.detach()
    _session(core2, gateway, out2)
    new = [v for (jid, _seq), v in gateway.stored.items() if jid == lost.journal_id and v.startswith(b"new")]
    assert len(new) == 200, f"{len(new)} of 200 new events reached the gateway"
    assert lost.journal_id != old_id
    message = next(c.message for c in core2.conditions.active() if c.type == JOURNAL_TAIL_LOST)
    assert "lost its tail" in message
    lost.close()
