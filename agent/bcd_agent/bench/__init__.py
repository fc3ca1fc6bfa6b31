"""`bcd bench NAME [--json] [--check]` and `bcd bench all`: the speed and memory targets, measured.

Each bench is a module of this package with `measure(args) -> dict` (the measured numbers and facts) and a
module-level `TARGETS: dict[str, tuple[str, float]]` = {key: (op, value)}, op one of "<=", ">=", "<", ">".
Every bench prints the same shape, one JSON object (docs/benchmarks.md):

    {"bench": NAME, "targets": {key: [op, value]}, "met": bool, "missed": [key, ...], ...measured}

`met` is true when every target's key was measured as a number that meets it; a target whose key is
missing or not a number counts as missed (a bench that failed to measure cannot pass). `--check` exits 1
when a target is missed. `bcd bench all` runs every bench in turn and prints one table (`--json`: one
JSON object per line instead); with `--check` it exits 1 when any bench missed a target. A bench that
raises is reported as missed with its `error`. Targets are checked here and in docs/benchmarks.md, never
by timed assertions in tests.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import operator
import sys
from collections.abc import Callable, Mapping
from typing import Any

# bench name -> module under bcd_agent.bench. One literal table.
BENCHES: dict[str, str] = {
    "journal": "journal",
    "pki": "pki",
    "helper": "helper",
    "host": "host",
    "converge": "converge",
    "devices": "devices",
    "instances": "instances",
    "session": "session",
}
ALL = "all"

OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}

Targets = Mapping[str, tuple[str, float]]


def check_targets(targets: Targets) -> None:
    """Refuse a malformed TARGETS table (a bench module's bug, caught by the tests of the shape)."""
    for key, target in targets.items():
        if not (isinstance(target, tuple) and len(target) == 2 and target[0] in OPS):
            raise ValueError(
                f"TARGETS[{key!r}] = {target!r}: must be (op, value) with op one of {sorted(OPS)}"
            )
        if isinstance(target[1], bool) or not isinstance(target[1], int | float):
            raise ValueError(f"TARGETS[{key!r}]: the value {target[1]!r} is not a number")


def missed(targets: Targets, measured: Mapping[str, Any]) -> list[str]:
    """The keys whose measured value does not meet its target (or was not measured as a number)."""
    out = []
    for key, (op, value) in targets.items():
        got: Any = measured.get(key)
        number = isinstance(got, int | float) and not isinstance(got, bool) and not math.isnan(got)
        if not number or not OPS[op](float(got), value):
            out.append(key)
    return out


def result(name: str, targets: Targets, measured: Mapping[str, Any]) -> dict[str, Any]:
    """The one shape every bench prints."""
    check_targets(targets)
    if measured.get("bench") == name:  # a bench that names itself (the old shape) says nothing new
        measured = {k: v for k, v in measured.items() if k != "bench"}
    reserved = {"bench", "targets", "met", "missed"} & set(measured)
    if reserved:
        raise ValueError(f"bench {name}: measured keys {sorted(reserved)} are reserved for the shape")
    miss = missed(targets, measured)
    return {
        "bench": name,
        "targets": {key: [op, value] for key, (op, value) in targets.items()},
        "met": not miss,
        "missed": miss,
        **measured,
    }


def run_bench(name: str, args: argparse.Namespace, module_name: str | None = None) -> dict[str, Any]:
    """Import and run one bench; an exception is reported in the shape as `error` (all targets missed)."""
    module = importlib.import_module(module_name or f"bcd_agent.bench.{BENCHES[name]}")
    targets: Targets = getattr(module, "TARGETS", {})
    try:
        measured = dict(module.measure(args))
    except Exception as exc:  # reported, not raised: `bench all` goes on with the next bench
        measured = {"error": f"{type(exc).__name__}: {exc}"}
    return result(name, targets, measured)


def table(results: list[dict[str, Any]]) -> str:
    """One table over every bench: a row per target, then the bench's other numbers on one line."""
    rows = [("bench", "key", "target", "measured", "")]
    for r in results:
        for key, (op, value) in r["targets"].items():
            got = r.get(key, "-")
            rows.append(
                (r["bench"], key, f"{op} {value:g}", _fmt(got), "ok" if key not in r["missed"] else "MISSED")
            )
        if "error" in r:
            rows.append((r["bench"], "error", "", str(r["error"])[:60], "MISSED"))
        if not r["targets"] and "error" not in r:
            rows.append((r["bench"], "(no targets)", "", "", "ok"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in rows
    ]
    met = sum(1 for r in results if r["met"])
    lines.append(f"{met} of {len(results)} benches met every target")
    return "\n".join(line.rstrip() for line in lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_shared.subcommands import existing_dir

    parser.add_argument(
        "name", choices=[*sorted(BENCHES), ALL], help="which bench to run (all: every one, a table)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (the default for one bench)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--data-dir",
        default=None,
        type=existing_dir,  # a mistyped one was once made, whole path, as root, on the real host
        help="directory to measure on (default: a temporary one)",
    )


def run(args: argparse.Namespace) -> int:
    if args.name == ALL:
        results = []
        for name in BENCHES:
            out = run_bench(name, args)
            results.append(out)
            if args.json:
                _dump(out)
            else:
                print(
                    f"bench {name}: {'met' if out['met'] else 'MISSED ' + ', '.join(out['missed'])}",
                    file=sys.stderr,
                )
        if not args.json:
            print(table(results))
        return 1 if args.check and not all(r["met"] for r in results) else 0
    out = run_bench(args.name, args)
    _dump(out)
    return 1 if args.check and not out["met"] else 0


def _dump(out: Mapping[str, Any]) -> None:
    json.dump(out, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
