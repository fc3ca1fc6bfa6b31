"""`bcd bench NAME --json`: benchmarks that check the speed and memory targets.

Each bench is a module of this package with `measure(args) -> dict[str, float | int | str]`; the
result is printed as one JSON object. Targets are checked here and in docs/benchmarks.md, never by
timed assertions in tests.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# bench name -> module under bcd_agent.bench. One literal table.
BENCHES: dict[str, str] = {
    "journal": "journal",
    "pki": "pki",
    "helper": "helper",
    "host": "host",
    "converge": "converge",
    "devices": "devices",
    "session": "session",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHES) or None, help="which bench to run")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    parser.add_argument("--data-dir", default=None, help="directory to measure on (default: a temporary one)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"bcd_agent.bench.{BENCHES[args.name]}")
    result = module.measure(args)
    json.dump(result, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return 0
