"""A fake `journalctl` for the simulated host: `-u UNIT` reads `/var/lib/bcd-sim/journal/<UNIT>.log`.

The files hold what `journalctl -o short-iso` prints (journalctl(1), "short-iso": the ISO 8601 wall clock
time with its UTC offset, the host name, the identifier with its pid, the message), one entry a line, a
line without a timestamp continuing the entry before it (a multi-line message);
tests and `bcd sim` append to them. Supported: `-u UNIT` (repeated: the entries of every unit, ordered by
time), `--since @EPOCH` (entries at or after it), `-b` (this boot: every entry here), `-o short-iso`,
`--no-pager`, `-q`. No entry: `-- No entries --` (as journalctl prints it), exit 0.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from bcd_shared.system import CommandResult, LocalSystem

JOURNAL_DIR = "/var/lib/bcd-sim/journal"


def _when(line: str) -> float:
    try:
        return dt.datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return 0.0


def journalctl(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    units: list[str] = []
    since = 0.0
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-u", "--unit") and i + 1 < len(args):
            units.append(args[i + 1])
            i += 2
            continue
        if a == "--since" and i + 1 < len(args) and args[i + 1].startswith("@"):
            since = float(args[i + 1][1:])
            i += 2
            continue
        if a == "-o" and i + 1 < len(args):
            if args[i + 1] != "short-iso":
                return CommandResult(tuple(argv), 1, b"", b"simulated journalctl prints short-iso only\n")
            i += 2
            continue
        if a in ("-b", "--no-pager", "-q", "--quiet"):
            i += 1
            continue
        return CommandResult(tuple(argv), 1, b"", f"journalctl: unrecognized option '{a}'\n".encode())
    entries: list[tuple[float, str]] = []
    for unit in units:
        text = system.read_text(f"{JOURNAL_DIR}/{unit}.log") or ""
        for line in text.splitlines():
            when = _when(line)
            if when or not entries:
                entries.append((when, line))
            else:  # a multi-line message: its continuation lines stay with their entry
                entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + line)
    lines = [line for when, line in sorted(entries, key=lambda e: e[0]) if when >= since]
    out = "".join(line + "\n" for line in lines) if lines else "-- No entries --\n"
    return CommandResult(tuple(argv), 0, out.encode(), b"")
