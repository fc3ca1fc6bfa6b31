"""Real processes, SIGKILL at 200+ points: zero duplicate effects of non-retry-safe commands and zero
lost results (DLV-JRN-15/16/17, DLV-REC-01..11, DLV-REC-17, DLV-RES-08, DLV-EVT-02).

Each chain is one data_dir and one list of commands, two of each recovery class (retry-safe,
not retry-safe, self-terminating retry-safe like node.reboot, self-terminating like boot.kexec), in a
shuffled order. Each life of bcd_agent.journal.crashdriver recovers, redelivers every command and pauses
at a chosen (point, command), where the test SIGKILLs it with os.kill; half the kills are followed by a
reboot (a new boot id), and a self-terminating side effect always is. After the kills, a last life
runs to the end; then the effects file and the journal are checked. Three chains run at a time, in
threads (each life is mostly process start and fsync).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bcd_agent.journal.crashdriver import CLASSES, EXIT_REBOOTED, POINTS

KILLS_WANTED = 210
STREAMS = 3  # chains run in this many threads at once (each life is mostly fsync and process start)
CLASS_NAMES = sorted(CLASSES)


class Chain:
    def __init__(self, root: Path, n: int, rng: random.Random) -> None:
        self.data = root / f"chain{n}"
        self.effects = root / f"effects{n}"
        classes = CLASS_NAMES * 2
        rng.shuffle(classes)
        self.commands = [(f"n{n}-{i}-{cls}", cls) for i, cls in enumerate(classes)]
        self.boot = 1
        self.first_result: dict[str, tuple[str, str]] = {}
        self.seqs: list[int] = []
        self.kills = 0

    def life(self, pause: str = "") -> tuple[int, list[str]]:
        argv = [
            sys.executable, "-m", "bcd_agent.journal.crashdriver",
            "--data-dir", str(self.data), "--effects", str(self.effects), "--boot-id", f"boot-{self.boot}",
            "--commands", ",".join(f"{c}:{k}" for c, k in self.commands),
        ]  # fmt: skip
        if pause:
            argv += ["--pause-at", pause]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("PAUSED"):
                os.kill(proc.pid, signal.SIGKILL)
                self.kills += 1
                break
        rc = proc.wait()
        proc.stdout.close()
        proc.stdin.close()
        for line in lines:
            word, *rest = line.split()
            if word == "RESULT":
                cid, outcome, code = rest[0], rest[1], rest[2]
                # the first terminal outcome reported is the one that stays, whatever crashes follow
                self.first_result.setdefault(cid, (outcome, "" if code == "-" else code))
            elif word == "SEQ":
                self.seqs.append(int(rest[0]))
            elif word == "BROKEN":
                raise AssertionError(line)
        return rc, lines


# every (point, class, reboot-or-not) in turn; `done` is never reached by a self-terminating command
# (its side effect ends the process) and `recovered` is before any command
COMBOS = [("recovered", "*", b) for b in (False, True)] + [
    (p, c, b)
    for p in POINTS[1:]
    for c in CLASS_NAMES
    for b in (False, True)
    if not (p == "done" and CLASSES[c].self_terminating)
]


@dataclass
class Stream:
    """One thread's share: chains run one after another until it has made its kills."""

    root: Path
    seed: int
    kills_wanted: int
    kills_at: Counter[tuple[str, str, bool]] = field(default_factory=Counter)
    kills: int = 0
    lives: int = 0
    chains: int = 0

    def run(self) -> None:
        rng = random.Random(self.seed)
        turn = self.seed  # streams start at different places in the cycle
        while self.kills < self.kills_wanted:
            chain = Chain(self.root, self.chains, rng)
            self.chains += 1
            for _ in range(24):
                point, cls, reboot = COMBOS[turn % len(COMBOS)]
                if cls == "*":
                    cid = "*"
                else:
                    left = [c for c, k in chain.commands if k == cls and c not in chain.first_result]
                    if not left:
                        break  # every command of the class is settled here: go on in a new chain
                    cid = left[0]
                self.lives += 1
                before = chain.kills
                rc, lines = chain.life(f"{point}:{cid}")
                if chain.kills > before:
                    turn += 1
                    self.kills_at[(point, cls, reboot)] += 1
                    if reboot:
                        chain.boot += 1
                elif rc == EXIT_REBOOTED:
                    chain.boot += 1
                else:
                    assert rc == 0, lines
            final: dict[str, object] = {}
            for _ in range(len(chain.commands) + 1):
                self.lives += 1
                rc, lines = chain.life()
                if rc == EXIT_REBOOTED:
                    chain.boot += 1
                    continue
                assert rc == 0, lines
                final = json.loads(lines[-1].removeprefix("FINAL "))
                break
            self.kills += chain.kills
            _check_chain(chain, final)


def test_crash_points_no_duplicate_effects_no_lost_results(tmp_path: Path) -> None:
    streams = [Stream(tmp_path / f"s{i}", 1000 + 11 * i, -(-KILLS_WANTED // STREAMS)) for i in range(STREAMS)]
    for st in streams:
        st.root.mkdir()
    with ThreadPoolExecutor(STREAMS) as pool:
        for fut in [pool.submit(st.run) for st in streams]:
            fut.result()
    kills_at = sum((st.kills_at for st in streams), Counter())
    total = sum(st.kills for st in streams)
    # every point, class and reboot-or-not combination was killed several times
    assert set(kills_at) == set(COMBOS), f"never killed at: {sorted(set(COMBOS) - set(kills_at))}"
    assert min(kills_at.values()) >= 3
    assert total >= KILLS_WANTED
    lives = sum(st.lives for st in streams)
    print(f"{total} kills in {lives} lives over {sum(st.chains for st in streams)} chains")


def _check_chain(chain: Chain, final: dict[str, object]) -> None:
    commands = final["commands"]
    assert isinstance(commands, dict)
    effects = (
        Counter(line.split()[0] for line in chain.effects.read_text().splitlines())
        if chain.effects.exists()
        else Counter()
    )
    for cid, cls in chain.commands:
        flags = CLASSES[cls]
        result = commands[cid]
        assert result is not None, f"{cid} ({cls}): result lost"
        outcome, code = result
        assert (outcome, code) == chain.first_result[cid], f"{cid} ({cls}): result changed after a crash"
        if not flags.retry_safe:
            assert effects[cid] <= 1, f"{cid} ({cls}): side effect ran {effects[cid]} times"
            if (outcome, code) == ("succeeded", ""):
                assert effects[cid] == 1
        if code == "interrupted":
            assert not flags.retry_safe and outcome == "failed"
        if code == "rebooted":
            assert flags.self_terminating and outcome == "succeeded"
        if not flags.self_terminating and outcome == "succeeded":
            assert effects[cid] >= 1
    # every result is still there to replay: nothing was acked, nothing lost
    assert final["unacked"] == sorted(cid for cid, _ in chain.commands)
    # event seqs are never handed out twice in one journal, crashes or not
    assert len(chain.seqs) == len(set(chain.seqs))


def test_crashdriver_imports_only_the_journal() -> None:
    code = (
        "import sys, bcd_agent.journal.crashdriver\n"
        "print(','.join(m for m in sys.modules if m.split('.')[0] in ('trio', 'grpclib', 'trio_asyncio')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
