"""The subcommand-table dispatcher that `bcd` (bcd_agent.cli) and `bcd helper` (bcd_helper.cli) share.

A table maps a name to (module, one-line help). Every name gets a subparser; only the module of the
subcommand being run is imported (to add its arguments, then to run it), so a command starts fast and
pulls in nothing another subcommand needs. A subcommand module provides:

    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int

Errors (docs/operations.md "Exit codes"): every refusal is one line on stderr, `<prog> <command>:
<what>`, and a documented exit code; never a traceback. A subcommand raises `CliError(message, code)`
for what it refuses; an OSError that escapes a subcommand (a file it cannot read or write) is printed
the same way (77 for EACCES/EPERM, 74 otherwise); a closed stdout (`bcd doctor --json | head`) ends
the command quietly with 141 (128 + SIGPIPE, what a shell reports for a process SIGPIPE killed); a bad
command line is one line and 64. `BCD_TRACEBACK=1` re-raises instead, for debugging.

Stdlib only: the helper imports it at start.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

# Exit codes (sysexits.h where one fits; docs/operations.md lists them per command).
EX_OK = 0
EX_NO = 1  # the command ran and its answer is "no": a check failed, not converged, a broken chain
EX_CHANGES = 2  # `bcd plan`: it plans changes or failures (terraform plan -detailed-exitcode)
EX_USAGE = 64  # a bad command line: unknown flag, a value out of range
EX_DATAERR = 65  # an input file refused: a spec, a journal or status file that does not parse
EX_NOINPUT = 66  # an input that is not there: no journal, no audit log
EX_UNAVAILABLE = 69  # a service the command needs does not answer
EX_IOERR = 74  # reading or writing a file failed
EX_TEMPFAIL = 75  # try again later: another process holds the node's journal
EX_NOPERM = 77  # permission denied, or a command that must run as root did not
EX_CONFIG = 78  # config.toml missing or refused, the node not joined, data_dir unusable
EX_INTERRUPTED = 130  # SIGINT
EX_PIPE = 141  # stdout was closed by its reader


class CliError(Exception):
    """A refusal the CLI prints as one line (`<prog> <command>: <message>`) and exits with `code`."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit 64 (EX_USAGE), not usage + 2."""

    def error(self, message: str) -> NoReturn:
        missing = re.fullmatch(r"argument (--[\w-]+)(?:/\S+)?: expected one argument", message)
        if missing:  # most often a value that begins with '-' (a join token, a path), read as an option
            message += f"; a value that begins with '-' is given as {missing.group(1)}=VALUE"
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        raise SystemExit(EX_USAGE)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, got {text}")
    return value


def existing_dir(text: str, hint: str = "") -> str:
    """argparse type of a directory a command reads (`--data-dir`): it must be there. A mistyped one is a
    usage error (64), not an empty directory read as "nothing here yet", nor one made on the spot."""
    if not os.path.isdir(text):
        why = "is not a directory" if os.path.exists(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {why}{hint}")
    return text


def root_dir(text: str) -> str:
    """argparse type of `--root DIR`: a directory that exists. A mistyped DIR is a usage error (64),
    not a host read as empty (no config, no data_dir, nvidia-smi failing) further on."""
    return existing_dir(text, " (--root names the directory standing for /)")


def os_error_code(exc: OSError) -> int:
    return EX_NOPERM if exc.errno in (errno.EACCES, errno.EPERM) else EX_IOERR


def describe_os_error(exc: OSError) -> str:
    """`<file>: <strerror>` (both files for a rename), or the exception's text when it names none."""
    what = exc.strerror or str(exc)
    if exc.filename is not None and exc.filename2 is not None:
        return f"{exc.filename} -> {exc.filename2}: {what}"
    if exc.filename is not None:
        return f"{exc.filename}: {what}"
    return what


def _single_leaf(exc: BaseException) -> BaseException:
    """The one exception inside nested exception groups (a trio nursery's), else `exc` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _quiet_stdout() -> None:
    # Python flushes stdout at exit and would report the broken pipe again: point it at /dev/null.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def run_guarded(prefix: str, call: Callable[[], int]) -> int:
    """Run `call()` and turn the failures an operator can cause into one line and an exit code."""
    if os.environ.get("BCD_TRACEBACK") == "1":
        rc: int = call()
        return rc
    try:
        rc = call()
        return rc
    except BaseException as raised:
        exc = _single_leaf(raised)
        if isinstance(exc, BrokenPipeError):
            _quiet_stdout()
            return EX_PIPE
        if isinstance(exc, CliError):
            sys.stderr.write(f"{prefix}: {exc.message}\n")
            return exc.code
        if isinstance(exc, KeyboardInterrupt):
            return EX_INTERRUPTED
        if isinstance(exc, OSError):
            sys.stderr.write(f"{prefix}: {describe_os_error(exc)}\n")
            return os_error_code(exc)
        raise


def dispatch(
    args_list: Sequence[str],
    table: Mapping[str, tuple[str, str]],
    *,
    prog: str,
    description: str,
    listed: Mapping[str, str] | None = None,
    version: str | None = None,
) -> int:
    """Parse `args_list` against `table` and run the chosen subcommand; 64 (after the help) when none is
    named.

    `listed` (name -> help) are subcommands the caller handles before this is reached: they show in
    the help, first, and take no arguments here. `version`: what `--version` prints.
    """
    parser = OneLineParser(prog=prog, description=description)
    if version is not None:
        parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in (listed or {}).items():
        sub.add_parser(name, help=help_text)
    wanted = args_list[0] if args_list and not args_list[0].startswith("-") else None
    for name, (module_name, help_text) in table.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(list(args_list))
    if args.command is None:
        parser.print_help()
        return EX_USAGE
    chosen = importlib.import_module(table[args.command][0])
    return run_guarded(f"{prog} {args.command}", lambda: int(chosen.run(args)))
