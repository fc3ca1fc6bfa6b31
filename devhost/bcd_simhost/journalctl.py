"""A fake `journalctl` for the simulated host: `-u UNIT` reads `/var/lib/bcd-sim/journal/<UNIT>.log`.

The files hold what `journalctl -o short-iso` prints (journalctl(1), "short-iso": the ISO 8601 wall clock
time with its UTC offset, the host name, the identifier with its pid, the message), one entry a line, a
line without a timestamp continuing the entry before it (a multi-line message);
tests and `bcd sim` append to them. Supported: `-u UNIT` (repeated: the entries of every unit, ordered by
time), `--since @EPOCH` (entries at or after it), `-b` (this boot: every entry here), `-o short-iso`,
`--no-pager`, `-q`. No entry: `-- No entries --` (as journalctl prints it), exit 0.

`-o json` / `--output=json` reads the kernel log instead (kernellog.py, the XID watcher's query):
`FIELD=VALUE` matches (ANDed), `--after-cursor=C` or `--since=@0`, `--lines=N` (the first N from there),
`--output-fields=F,…` (plus `__CURSOR`, `__REALTIME_TIMESTAMP`, `__MONOTONIC_TIMESTAMP`, `_BOOT_ID`, which
journalctl always prints); one JSON object a line, nothing at all when no entry matches.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence

from bcd_shared.system import CommandResult, LocalSystem

JOURNAL_DIR = "/var/lib/bcd-sim/journal"


def _when(line: str) -> float:
    try:
        return dt.datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return 0.0


_ALWAYS = ("__CURSOR", "__REALTIME_TIMESTAMP", "__MONOTONIC_TIMESTAMP", "_BOOT_ID")


def _json(system: LocalSystem, argv: Sequence[str]) -> CommandResult:
    from bcd_simhost.kernellog import entries

    matches: dict[str, str] = {}
    after, lines, fields = "", -1, None
    for a in argv[1:]:
        if a in ("-o", "json", "--output=json", "--no-pager", "-q", "--quiet", "--since=@0"):
            continue
        if a.startswith("--after-cursor="):
            after = a.split("=", 1)[1]
        elif a.startswith("--lines="):
            lines = int(a.split("=", 1)[1])
        elif a.startswith("--output-fields="):
            fields = a.split("=", 1)[1].split(",")
        elif "=" in a and not a.startswith("-"):
            key, _, value = a.partition("=")
            matches[key] = value
        else:
            return CommandResult(tuple(argv), 1, b"", f"journalctl: unrecognized option '{a}'\n".encode())
    found = [e for e in entries(system.root) if all(e.get(k) == v for k, v in matches.items())]
    if after:
        cursors = [e.get("__CURSOR") for e in found]
        found = found[cursors.index(after) + 1 :] if after in cursors else found
    if lines >= 0:
        found = found[:lines]
    if fields is not None:
        keep = set(fields) | set(_ALWAYS)
        found = [{k: v for k, v in e.items() if k in keep} for e in found]
    out = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in found)
    return CommandResult(tuple(argv), 0, out.encode(), b"")


def journalctl(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    if "--output=json" in argv or ("-o" in argv and "json" in argv):
        return _json(system, argv)
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
