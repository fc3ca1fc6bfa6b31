"""The real Dispatcher in real child processes, killed at every durable step (DLV-JRN-15..17, DLV-REC-01..11,
DLV-QRM-04/05, DLV-RES-03/08): zero duplicate side effects of non-retry-safe commands, zero lost results.

Each life is a forked child process that opens the journal and the quorum ledger in one data_dir, runs
`journal.recover()`, starts the Dispatcher and delivers the whole scenario in order (the gateway redelivers
every unsettled command after a reconnect, and resends a Cancel until the command is settled), waiting for
each outcome. Kill points surround every journal write, every quorum-ledger write, every update sent and
the side effect itself; at the chosen point the child SIGKILLs itself (no cleanup, no finally blocks).
`test.reboot`'s side effect ends the child too, as a reboot: the next life gets a new boot id.

For every first-life kill point k (all of them, found by bisection), the chain is: life 1 killed at k; life 2
killed at a point chosen from k, for a third of the chains life 3 too; then lives without kills until one
completes. At least KILLS_WANTED kills must hit (the journal's own crash test adds 210 more).
Checked afterwards: every command is settled in the journal and was reported settled by the last life
(no lost result); the effects file shows each non-retry-safe command's side effect at most once, once
exactly when it SUCCEEDED and never when it was REJECTED or CANCELLED; the unbatched destructive allowance
(1 per hour) was never exceeded across lives; the batch leaf ran at most once; the command cancelled
before its delivery is CANCELLED whatever the kill (never FAILED `interrupted`: one journal write).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.dispatch.clock import OffsetClock
from bcd_agent.dispatch.command import CommandEnvelope, CommandUpdate
from bcd_agent.dispatch.dispatcher import Dispatcher
from bcd_agent.dispatch.kinds import Role
from bcd_agent.dispatch.quorum import QuorumLedger
from bcd_agent.dispatch.trust import BundleTrust, NodeResultSigner
from bcd_agent.journal import CommandState, Journal, Outcome
from bcd_agent.kinds.testing import TEST_KINDS, EffectHandler, effect_handlers, effect_payload
from dhelpers import ALL_KINDS, JOURNAL_WRITES, NODE, T0, Pki, approved_batch, leaf_for, make_command, ulid

KILLS_WANTED = 200
EXIT_KILLED = -signal.SIGKILL  # os.waitstatus_to_exitcode of a SIGKILLed child
EXIT_REBOOTED = 99
EXIT_DONE = 0
NOT_AFTER = T0 + dt.timedelta(days=1)
CANCEL_FIRST: set[str] = set()  # ids the gateway cancels before delivering them (filled by build_scenario)


class Killed(BaseException):
    pass


class Switch:
    """Counts kill points; at point number `at` the process ends on the spot."""

    def __init__(self, at: int | None, record: Path | None = None) -> None:
        self.at = at
        self.n = 0
        self.record = record
        self.names: list[str] = []

    def point(self, name: str) -> None:
        self.n += 1
        self.names.append(name)
        if self.n == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


class KillingJournal:
    WRITES = JOURNAL_WRITES

    def __init__(self, journal: Journal, switch: Switch) -> None:
        self._j = journal
        self._s = switch

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._j, name)
        if name not in self.WRITES:
            return attr

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._s.point(f"before {name}")
            out = attr(*args, **kwargs)
            self._s.point(f"after {name}")
            return out

        return wrapped

    @property
    def boot_id(self) -> str:
        return self._j.boot_id


class KillingLedger:
    def __init__(self, ledger: QuorumLedger, switch: Switch) -> None:
        self._l = ledger
        self._s = switch

    def unbatched_admits(self, command_id: str, host_now: float, allowance: int) -> bool:
        return self._l.unbatched_admits(command_id, host_now, allowance)

    def leaf_owner(self, leaf: str) -> str | None:
        return self._l.leaf_owner(leaf)

    def record_unbatched(self, command_id: str, host_now: float) -> None:
        self._s.point("before ledger")
        self._l.record_unbatched(command_id, host_now)
        self._s.point("after ledger")

    def record_leaf(self, *args: Any) -> None:
        self._s.point("before ledger")
        self._l.record_leaf(*args)
        self._s.point("after ledger")


class KillingSink:
    def __init__(self, switch: Switch) -> None:
        self._s = switch
        self.updates: list[CommandUpdate] = []
        self.changed = trio.Event()

    def send(self, update: CommandUpdate) -> None:
        self._s.point(f"before send {update.state.value}")
        self.updates.append(update)
        self.changed.set()
        self.changed = trio.Event()
        self._s.point(f"after send {update.state.value}")

    async def wait_terminal(self, command_id: str) -> CommandUpdate:
        with trio.fail_after(20):
            while True:
                done = [u for u in self.updates if u.command_id == command_id and u.terminal]
                if done:
                    return done[-1]
                await self.changed.wait()


class NoSpecs:
    def request_spec_for_min_generation(self, have_generation: int) -> None:
        raise AssertionError("the scenario has no min_generation")


def build_scenario(pki: Pki) -> list[CommandEnvelope]:
    batched_id = ulid()
    batch = approved_batch(pki, "crash-batch", [leaf_for(batched_id, "test.destructive")], 0)

    def cmd(kind: str, attempt_cancel: bool = False, **kw: Any) -> CommandEnvelope:
        c = make_command(pki, kind=kind, not_after=NOT_AFTER, payload=effect_payload(kind), **kw)
        if attempt_cancel:
            CANCEL_FIRST.add(c.id)
        return c

    return [
        cmd("test.effect"),
        cmd("test.retry"),
        cmd("test.attested"),
        cmd("test.effect", sign="other"),  # BAD_SIGNATURE, journaled
        cmd("test.destructive"),  # unbatched: the hour's one allowance
        cmd("test.destructive"),  # unbatched: UNBATCHED_LIMIT
        cmd("test.destructive", id=batched_id, batch_id="crash-batch", batch=batch),
        cmd("test.provision"),
        cmd("test.effect", attempt_cancel=True),  # cancelled before its delivery
        cmd("test.bulk"),
        cmd("test.reboot"),  # last: its side effect ends the life
    ]


def life(data: Path, effects: Path, pki: Pki, scenario: list[CommandEnvelope], boot: int, kill_at: int | None,
         out: Path | None, clock_offset: float) -> int:  # fmt: skip
    """Fork one life of bcd; return its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            switch = Switch(kill_at)
            code, report = trio.run(_life_main, data, effects, pki, scenario, boot, switch, clock_offset)
            if out is not None:
                out.write_text(json.dumps(report))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


async def _life_main(data: Path, effects: Path, pki: Pki, scenario: list[CommandEnvelope], boot: int,
                     switch: Switch, clock_offset: float) -> tuple[int, dict[str, Any]]:  # fmt: skip
    journal = Journal.open(data, boot_id=f"boot-{boot}")
    journal.recover()
    trust = BundleTrust(pki.bundle(approvers=3, required=2, allowance=1))
    sink = KillingSink(switch)
    handler = EffectHandler(effects, terminate=lambda: os._exit(EXIT_REBOOTED))
    d = Dispatcher(
        node_id=NODE,
        role=Role.NODE,
        journal=KillingJournal(journal, switch),  # type: ignore[arg-type]
        sink=sink,
        spec_requester=NoSpecs(),
        trust=trust,
        batches=trust,
        ledger=KillingLedger(QuorumLedger.open(data), switch),
        clock=OffsetClock(time.time, clock_offset),
        handlers=effect_handlers(handler),
        signer=NodeResultSigner(pki.node_key, NODE),
        kinds=ALL_KINDS,
    )
    async with trio.open_nursery() as n:
        await n.start(d.run)
        for cmd in scenario:
            if cmd.id in CANCEL_FIRST:
                d.cancel(cmd.id, "operator")
            d.deliver(cmd)
            await sink.wait_terminal(cmd.id)
        n.cancel_scope.cancel()
    final = {
        c.id: _update_json(next(u for u in reversed(sink.updates) if u.command_id == c.id)) for c in scenario
    }
    return EXIT_DONE, {"points": switch.names, "final": final}


def _update_json(u: CommandUpdate) -> dict[str, str]:
    return {"state": u.state.value, "reason": u.reason, "error_code": u.error_code}


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki.build()


def _run_chain(root: Path, pki: Pki, scenario: list[CommandEnvelope], kills: list[int | None],
               offset: float) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """Lives with these kill points, then lives without until one completes. Returns (kills that hit,
    the completing life's report)."""
    data, effects, out = root / "data", root / "effects", root / "out.json"
    boot, hits = 1, 0
    for k in kills:
        code = life(data, effects, pki, scenario, boot, k, None, offset)
        assert code in (EXIT_KILLED, EXIT_REBOOTED, EXIT_DONE), code
        hits += code == EXIT_KILLED
        boot += code == EXIT_REBOOTED
    for _ in range(4):
        code = life(data, effects, pki, scenario, boot, None, out, offset)
        if code == EXIT_DONE:
            return hits, json.loads(out.read_text())
        assert code == EXIT_REBOOTED, code
        boot += 1
    raise AssertionError("no life completed the scenario")


def _check(root: Path, scenario: list[CommandEnvelope], report: dict[str, Any]) -> None:
    effects = Counter(line.split()[0] for line in (root / "effects").read_text().splitlines()) if (
        root / "effects").exists() else Counter()  # fmt: skip
    with Journal.open(root / "data", boot_id="inspect") as j:
        for cmd in scenario:
            entry = j.get_command(cmd.id)
            assert entry is not None and entry.state.terminal and entry.result is not None, (cmd.kind, entry)
            final = report["final"][cmd.id]
            assert final["state"] == entry.result.outcome.name, (cmd.kind, final, entry.result)
            spec = TEST_KINDS[cmd.kind]
            n = effects[cmd.id]
            if not spec.retry_safe:
                assert n <= 1, f"{cmd.kind} {cmd.id} ran {n} times"
            if entry.result.outcome is Outcome.SUCCEEDED:
                assert n >= 1 if spec.retry_safe else n == 1, (cmd.kind, n)
            if entry.state in (CommandState.REJECTED, CommandState.CANCELLED):
                assert n == 0, (cmd.kind, entry.state, n)
    unbatched = [c.id for c in scenario if c.kind == "test.destructive" and not c.batch_id]
    assert sum(effects[i] for i in unbatched) <= 1, "the unbatched allowance was exceeded across restarts"
    assert report["final"][scenario[3].id]["reason"] == "BAD_SIGNATURE"
    for cid in CANCEL_FIRST & {c.id for c in scenario}:
        assert report["final"][cid] == {"state": "CANCELLED", "reason": "operator", "error_code": ""}


def test_DLV_REC_dispatch_survives_a_kill_at_every_durable_step(tmp_path: Path, pki: Pki) -> None:
    scenario = build_scenario(pki)
    offset = T0.timestamp() - time.time()
    # The probe: one clean chain, which also lists the first life's kill points.
    probe = tmp_path / "probe"
    code = life(probe / "data", probe / "effects", pki, scenario, 1, None, probe / "out.json", offset)
    assert code == EXIT_REBOOTED  # test.reboot ended the first life
    hits, report = _run_chain(tmp_path / "probe2", pki, scenario, [], offset)
    _check(tmp_path / "probe2", scenario, report)
    points = len(report["points"])
    # Life 1's points: count them on a fresh chain without the reboot's early exit.
    first_life_points = _count_first_life_points(tmp_path / "count", pki, scenario, offset)
    assert first_life_points > 80, first_life_points
    total = 0
    for k in range(1, first_life_points + 1):
        second = 1 + (k * 7919) % points
        third = 1 + (k * 104729) % points if k % 3 == 0 else None
        hits, report = _run_chain(tmp_path / f"k{k}", pki, scenario, [k, second, third], offset)
        _check(tmp_path / f"k{k}", scenario, report)
        total += hits
    print(f"first-life kill points: {first_life_points}; kills that hit: {total}")
    assert total >= KILLS_WANTED, total


def _count_first_life_points(root: Path, pki: Pki, scenario: list[CommandEnvelope], offset: float) -> int:
    """Kill at ever later points until a life is not killed: that many points the first life has."""
    lo, hi = 1, 400
    while lo < hi:  # the smallest k the first life does not reach
        mid = (lo + hi) // 2
        r = root / f"c{mid}"
        if life(r / "data", r / "effects", pki, scenario, 1, mid, None, offset) == EXIT_KILLED:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1
