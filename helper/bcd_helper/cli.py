"""`bcd helper` (also installed as `bcd-helper`): the root helper's command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, help). Each module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("bcd_helper.serve", "serve the node on the helper's Unix socket (as root)"),
    "audit": ("bcd_helper.audit", "show or verify the hash-chained audit log"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="bcd helper", description="bcd's root helper")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = args_list[0] if args_list and not args_list[0].startswith("-") else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    rc: int = importlib.import_module(SUBCOMMANDS[args.command][0]).run(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
