"""`bcd node` and its journal: the result attester before `recover()`, and the daily sweep.

Covers DLV-SIG-17 (an attested kind's result that recover settles at start is stored signed, in the same
transaction, so its replay sends the bytes first signed), DLV-REC-13 and Q-DLV-REC-01 (the journal is
swept at start and then every `sweep_interval_s`, daily by default, while the process runs).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import trio
import trio.testing
from bcd_agent.config import load_config
from bcd_agent.journal import CODE_INTERRUPTED, CommandFlags, Journal, NewCommand, Outcome
from bcd_agent.node import SWEEP_INTERVAL_S, Node, NodeOptions, sweep_periodically
from bcd_agent.session import identity as ident
from bcd_shared import wire
from bcd_shared.pki.attest import verify_command_result
from bcd_simhost.seed import seed
from testsupport import node_identity

NODE = "node-journal-1"
DAY = 24 * 3600.0


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def _until(check: Callable[[], bool], *, within: float, step: float) -> None:
    with trio.fail_after(within):
        while True:
            if check():
                return
            await trio.sleep(step)


def _identity() -> ident.Identity:
    now = dt.datetime.now(dt.UTC)
    return node_identity(NODE, now - dt.timedelta(days=1), now + dt.timedelta(days=30))


def _setup(tmp_path: Path) -> tuple[Path, Path, ident.Identity]:
    """A simulated host, a data_dir with an identity, and a config whose gateway socket nobody serves
    (the session keeps reconnecting; these tests need no control plane)."""
    root = tmp_path / "host"
    seed(root)
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    identity = _identity()
    ident.save(data, identity)
    toml = tmp_path / "node.toml"
    toml.write_text(f'data_dir = "{data}"\n[control_plane]\nunix_socket = "{tmp_path / "nobody.sock"}"\n')
    return root, toml, identity


async def test_DLV_SIG_17_results_recover_settles_at_start_are_stored_signed(tmp_path: Path) -> None:
    """An attested command (gpu.reset: attested, not retry-safe) left running by an earlier process is
    settled FAILED `interrupted` by recover at start; the node set the attester before recover, so the
    journal row holds the CommandAttestation and the node's signature, which verify with the node key."""
    root, toml, identity = _setup(tmp_path)
    config = load_config(str(toml))
    boot_id = (root / "proc/sys/kernel/random/boot_id").read_text().strip()
    cid = "01J0000000000000000000GPU1"
    with Journal.open(config.data_dir, boot_id=boot_id) as earlier:
        earlier.accept_command(NewCommand(cid, "gpu.reset", CommandFlags(attested=True), b"body", b"sig"))
        earlier.mark_running(cid)
    async with trio.open_nursery() as nursery:
        node = Node(config, NodeOptions(root=str(root), sections=False, backoff_max_s=1.0))
        await nursery.start(node.run)
        entry = node.journal.get_command(cid)
        assert entry is not None and entry.result is not None
        assert (entry.result.outcome, entry.result.code) == (Outcome.FAILED, CODE_INTERRUPTED)
        assert entry.result.attestation and entry.result.node_sig  # stored signed, not signed at send
        signed = verify_command_result(
            entry.result.attestation,
            entry.result.node_sig,
            identity.node_key.public_key,
            command_id=cid,
            state=wire.CommandState.FAILED,
            result=entry.result.body,
            node_id=NODE,
        )
        assert signed.boot_id == boot_id
        # What Hello replays is exactly the stored pair (never re-signed).
        [replayed] = [e for e in node.journal.unacked_results() if e.id == cid]
        assert replayed.result is not None
        assert (replayed.result.attestation, replayed.result.node_sig) == (
            entry.result.attestation,
            entry.result.node_sig,
        )
        nursery.cancel_scope.cancel()


async def test_DLV_REC_13_the_node_sweeps_again_while_it_runs(tmp_path: Path) -> None:
    """Q-DLV-REC-01: the sweep at start, then one every `sweep_interval_s` (a short one here) in the
    node's nursery, for as long as the node runs."""
    root, toml, _ = _setup(tmp_path)
    assert NodeOptions().sweep_interval_s == SWEEP_INTERVAL_S == DAY
    async with trio.open_nursery() as nursery:
        node = Node(
            load_config(str(toml)),
            NodeOptions(root=str(root), sections=False, backoff_max_s=1.0, sweep_interval_s=0.05),
        )
        await nursery.start(node.run)
        assert node.sweeps >= 1  # the one at start, before the node reported itself started
        await _until(lambda: node.sweeps >= 4, within=10, step=0.02)
        nursery.cancel_scope.cancel()


def _done_and_acked(journal: Journal, cid: str) -> None:
    journal.accept_command(NewCommand(cid, "inventory.refresh", CommandFlags(retry_safe=True)))
    journal.complete(cid, Outcome.SUCCEEDED, body=b"ok")
    journal.ack_results([cid])


async def test_DLV_REC_13_daily_sweep_deletes_acked_results_once_past_seven_days(tmp_path: Path) -> None:
    """`sweep_periodically` (the node's task) sweeps once per interval, never at once: a result acked
    and finished 8 days before the first daily sweep is deleted by it; a fresh one is kept."""
    clock = Clock()
    with Journal.open(tmp_path / "data", boot_id="b1", clock=clock) as journal:
        _done_and_acked(journal, "old")
        clock.t += 8 * DAY  # the journal's wall clock: `old` finished 8 days ago
        _done_and_acked(journal, "fresh")
        swept: list[tuple[float, int]] = []
        mock = trio.testing.MockClock(autojump_threshold=0)

        async def main() -> None:
            three = trio.Event()

            def on_swept(n: int) -> None:
                swept.append((trio.current_time(), n))
                if len(swept) == 3:
                    three.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sweep_periodically, journal, DAY, on_swept)
                await trio.sleep(DAY - 1)
                assert swept == [] and journal.get_command("old") is not None  # not at once
                # The sweep runs in a worker thread. Waited for by an event, not by polling: a poll's
                # sleeps let the mock clock jump on while the thread works (by as much as the machine is
                # slow); with no task sleeping, virtual time stands still until the sweep is done.
                await three.wait()
                nursery.cancel_scope.cancel()
            assert [n for _, n in swept] == [1, 0, 0]  # daily, for as long as it runs
            # Each a day after the last one ended.
            assert [at for at, _ in swept] == [DAY, 2 * DAY, 3 * DAY]
            assert journal.get_command("old") is None and journal.get_command("fresh") is not None

        # A trio run of its own: the mock clock drives the days (no virtual deadline in it: the clock
        # would jump to it while a sweep runs; this real-time one fails a hang instead).
        with trio.fail_after(120):
            await trio.to_thread.run_sync(lambda: trio.run(main, clock=mock), abandon_on_cancel=True)


async def test_a_failed_sweep_is_logged_and_tried_again(tmp_path: Path) -> None:
    class Flaky:
        def __init__(self) -> None:
            self.calls = 0

        def sweep(self) -> int:
            self.calls += 1
            if self.calls == 1:
                raise OSError("disk I/O error")
            return 2

    flaky, swept = Flaky(), list[int]()

    async def main() -> None:
        done = trio.Event()

        def on_swept(n: int) -> None:
            swept.append(n)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sweep_periodically, flaky, DAY, on_swept)
            await done.wait()  # an event, not a poll: see the daily sweep test above
            nursery.cancel_scope.cancel()

    clock = trio.testing.MockClock(autojump_threshold=0)
    with trio.fail_after(120):
        await trio.to_thread.run_sync(lambda: trio.run(main, clock=clock), abandon_on_cancel=True)
    assert (flaky.calls, swept) == (2, [2])  # the failure at day 1 logged, the sweep at day 2 done
