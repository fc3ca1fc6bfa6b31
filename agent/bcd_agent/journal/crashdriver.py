"""A small process that runs commands through the journal and can be SIGKILLed at chosen points.

Used by the crash test (tests/journal/test_journal_crash.py) and by dispatch's own crash tests. It imports
only the journal (no trio, no grpclib), so a run starts in well under 100 ms.

    python -m bcd_agent.journal.crashdriver --data-dir D --effects F --boot-id B \
        --commands c1:safe,c2:unsafe,c3:reboot,c4:kexec [--pause-at POINT:ID]

One life of the daemon: open the journal, `recover` (settled results are printed), then deliver every
command in order, as the server's redelivery would: resolve it; DONE is skipped (the stored result would
be resent); NONE and REEXECUTE are accepted, marked running, and perform their side effect: one line
`<id> <incarnation>` appended to the effects file with O_APPEND and fsync. A self-terminating command's side
effect ends the process (exit 42: "the host rebooted"; the next life must use a new boot id); the others
complete SUCCEEDED and append a transition event. Classes: `safe` (retry-safe), `unsafe` (not retry-safe),
`reboot` (retry-safe, self-terminating, like node.reboot), `kexec` (self-terminating only, like boot.kexec).

Points, in order for a command: `accepted` (accept is durable), `running`, `effect` (after the side effect,
before the result), `done` (after the result and its event). `recovered:*` is after Recover. At the point
named by --pause-at the driver prints `PAUSED <point> <id>` and blocks on stdin: the test kills it there.
Lines on stdout: `OPEN <incarnation>`, `RESULT <id> <outcome> <code> <previous_boot_id>`, `SEQ <n>`,
`PAUSED ...`, and at the end `FINAL <json>` with every command's journal state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from bcd_agent.journal import Action, CommandEntry, CommandFlags, EventClass, Journal, NewCommand, Outcome

CLASSES: dict[str, CommandFlags] = {
    "safe": CommandFlags(retry_safe=True),
    "unsafe": CommandFlags(),
    "reboot": CommandFlags(retry_safe=True, self_terminating=True),
    "kexec": CommandFlags(self_terminating=True),
}
POINTS = ("recovered", "accepted", "running", "effect", "done")
EXIT_REBOOTED = 42
EXIT_BROKEN_RULE = 3


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _result_line(e: CommandEntry) -> str:
    r = e.result
    assert r is not None
    return f"RESULT {e.id} {r.outcome.value} {r.code or '-'} {r.previous_boot_id or '-'}"


class _Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.pause = tuple(args.pause_at.split(":", 1)) if args.pause_at else None
        self.effects = args.effects
        self.commands = [tuple(c.split(":", 1)) for c in args.commands.split(",") if c]

    def point(self, name: str, cid: str) -> None:
        if self.pause == (name, cid):
            _say(f"PAUSED {name} {cid}")
            sys.stdin.readline()  # the test kills us here

    def effect(self, cid: str, incarnation: str) -> None:
        fd = os.open(self.effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, f"{cid} {incarnation}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def run(self, j: Journal) -> int:
        _say(f"OPEN {j.incarnation}")
        for settled in j.recover():
            _say(_result_line(settled))
        self.point("recovered", "*")
        for cid, cls in self.commands:
            flags = CLASSES[cls]
            res = j.resolve(cid)
            if res.action is Action.DONE:
                continue
            if res.action not in (Action.NONE, Action.REEXECUTE):
                _say(f"BROKEN {cid} resolved {res.action.value} after recover")
                return EXIT_BROKEN_RULE
            j.accept_command(NewCommand(cid, cls, flags, body=f"body-{cid}".encode()))
            self.point("accepted", cid)
            j.mark_running(cid)
            self.point("running", cid)
            self.effect(cid, j.incarnation)
            self.point("effect", cid)
            if flags.self_terminating:
                _say(f"REBOOTING {cid}")
                return EXIT_REBOOTED
            done = j.complete(cid, Outcome.SUCCEEDED, body=f"ok-{cid}".encode())
            _say(_result_line(done))
            _say(f"SEQ {j.append_event(EventClass.TRANSITION, 'command.done', cid.encode())}")
            self.point("done", cid)
        final = {}
        for cid, _ in self.commands:
            e = j.get_command(cid)
            final[cid] = None if e is None or e.result is None else [e.result.outcome.value, e.result.code]
        unacked = sorted(e.id for e in j.unacked_results())
        _say("FINAL " + json.dumps({"commands": final, "unacked": unacked}, sort_keys=True))
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crashdriver", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--effects", required=True)
    p.add_argument("--boot-id", required=True)
    p.add_argument("--commands", required=True, help="id:class,... (classes: safe, unsafe, reboot, kexec)")
    p.add_argument(
        "--pause-at", default="", help="POINT:ID (POINT in recovered, accepted, running, effect, done)"
    )
    args = p.parse_args(argv)
    driver = _Driver(args)
    with Journal.open(args.data_dir, boot_id=args.boot_id) as j:
        return driver.run(j)


if __name__ == "__main__":
    sys.exit(main())
