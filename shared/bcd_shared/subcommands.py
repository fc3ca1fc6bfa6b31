"""The subcommand-table dispatcher that `bcd` (bcd_agent.cli) and `bcd helper` (bcd_helper.cli) share.

A table maps a name to (module, one-line help). Every name gets a subparser; only the module of the
subcommand being run is imported (to add its arguments, then to run it), so a command starts fast and
pulls in nothing another subcommand needs. A subcommand module provides:

    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int

Stdlib only: the helper imports it at start.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Mapping, Sequence


def dispatch(
    args_list: Sequence[str],
    table: Mapping[str, tuple[str, str]],
    *,
    prog: str,
    description: str,
    listed: Mapping[str, str] | None = None,
    version: str | None = None,
) -> int:
    """Parse `args_list` against `table` and run the chosen subcommand; 2 (with help) when none is named.

    `listed` (name -> help) are subcommands the caller handles before this is reached: they show in
    the help, first, and take no arguments here. `version`: what `--version` prints.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    if version is not None:
        parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in (listed or {}).items():
        sub.add_parser(name, help=help_text)
    wanted = args_list[0] if args_list and not args_list[0].startswith("-") else None
    for name, (module, help_text) in table.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(list(args_list))
    if args.command is None:
        parser.print_help()
        return 2
    rc: int = importlib.import_module(table[args.command][0]).run(args)
    return rc
