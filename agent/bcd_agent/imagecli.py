"""`bcd image check FILE [--json]`: the tenant-image header check the runtime runs (DLV-IMG), for an operator.

It runs bcd_shared.images (the same code the libvirt-kvm runtime runs before every start, snapshot
and grow), opens nothing but FILE (O_NOFOLLOW, one cluster read) and never runs qemu-img. It prints
the verdict, the format, the virtual size and, for a refused image, the reason and why.

Exit codes, as issue 10 asks for this command (unlike the sysexits codes of the other commands,
docs/operations.md "Exit codes"): 0 accepted, 1 refused, 2 a usage error (a bad command line, or a
FILE that cannot be opened at all: not there, or not readable).

`bcd image` is dispatched by bcd_agent.cli before the shared table, like `bcd helper`, because the
shared dispatcher answers usage errors with 64.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from bcd_shared.images import ImageRefused, verdict
from bcd_shared.subcommands import CliError, non_negative_int, run_guarded

EX_ACCEPTED = 0
EX_REFUSED = 1
EX_USAGE_IMAGE = 2
# The runtime's default cap (bcd_agent.sections.instances.runtimes.libvirt.MAX_VIRTUAL_SIZE), kept
# here so that this command imports nothing of the runtime.
DEFAULT_MAX_VIRTUAL_SIZE = 64 << 40


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit 2 (the issue's code for this command)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        raise SystemExit(EX_USAGE_IMAGE)


def _parser() -> _Parser:
    parser = _Parser(prog="bcd image", description="tenant images: check a qcow2 header as bcd does")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    check = sub.add_parser(
        "check",
        help="check FILE as the runtime checks a tenant image; exit 0 accepted, 1 refused, 2 usage",
        description="Check FILE as bcd checks a tenant image before every start, snapshot and grow.",
    )
    check.add_argument("file", metavar="FILE")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.add_argument(
        "--max-virtual-size",
        type=non_negative_int,
        default=DEFAULT_MAX_VIRTUAL_SIZE,
        metavar="BYTES",
        help=f"the virtual size cap in bytes (default {DEFAULT_MAX_VIRTUAL_SIZE}, the runtime's)",
    )
    return parser


def _check(args: argparse.Namespace) -> int:
    try:
        answer = verdict(args.file, args.max_virtual_size)
    except ImageRefused as exc:  # "unreadable": nothing to judge
        raise CliError(exc.message, EX_USAGE_IMAGE) from None
    if args.json:
        out = {
            "file": args.file,
            "verdict": "accepted" if answer.accepted else "refused",
            "format": answer.format,
            "version": answer.version,
            "virtual_size": answer.virtual_size,
            "max_virtual_size": args.max_virtual_size,
            "reason": answer.reason,
            "message": answer.message,
        }
        sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
    else:
        size = "unknown" if answer.virtual_size is None else f"{answer.virtual_size} bytes"
        fmt = answer.format or "unknown"
        if answer.version is not None:
            fmt += f" v{answer.version}"
        sys.stdout.write(f"{args.file}: {'accepted' if answer.accepted else 'REFUSED'}\n")
        sys.stdout.write(f"  format:       {fmt}\n  virtual size: {size}\n")
        if not answer.accepted:
            sys.stdout.write(f"  reason:       {answer.reason}: {answer.message}\n")
    return EX_ACCEPTED if answer.accepted else EX_REFUSED


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    if args.action is None:
        _parser().print_usage(sys.stderr)
        return EX_USAGE_IMAGE
    return run_guarded(f"bcd image {args.action}", lambda: _check(args))
