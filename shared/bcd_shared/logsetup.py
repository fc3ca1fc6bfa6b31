"""Logging for the two daemons (`bcd node`, `bcd helper serve`): stdlib only, the helper imports it.

Three formats (`--log-format`):
- `auto` (the default): `journal` when stderr is journald's stream, else `text`;
- `journal`: `<N>logger: message` per line, N the syslog priority (journald reads the prefix, see
  sd-daemon(3), and adds its own timestamp, so none is written);
- `text`: `2026-12-01T13:35:18.123Z LEVEL logger: message`, readable on a terminal or in a file;
- `json`: one JSON object per line, `{"ts", "level", "priority", "logger", "msg"}` (and `exc` with a
  traceback); under journald without `ts` and with the `<N>` prefix, so journald keeps the priority.

A line written while a command's handler runs names the command's W3C trace (bcd_shared.tracecontext):
` trace=<trace-id>` after the message in `text` and `journal`; `trace_id` and `parent_id` (the span that
sent the command) in `json`.

"stderr is journald's stream": $JOURNAL_STREAM is `DEVICE:INODE` of the stream systemd connected, and
fd 2 is that stream (systemd.exec(5)); a child whose stderr was redirected elsewhere inherits the
variable but not the stream, so both are compared.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import TextIO

from bcd_shared import tracecontext

FORMATS = ("auto", "text", "json", "journal")
# logging level -> syslog priority (sd-daemon(3): <0> emerg ... <7> debug)
PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def priority(levelno: int) -> int:
    for level in sorted(PRIORITIES, reverse=True):
        if levelno >= level:
            return PRIORITIES[level]
    return 7


def under_journald(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    env = os.environ if environ is None else environ
    value = env.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def _utc(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def _message(record: logging.LogRecord) -> str:
    """The message, with the current command's trace after it (module docstring)."""
    trace = tracecontext.CURRENT.get()
    return record.getMessage() if trace is None else f"{record.getMessage()} trace={trace.trace_id}"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_utc(record.created)} {record.levelname} {record.name}: {_message(record)}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        text = f"{record.name}: {_message(record)}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        # Every line carries the prefix: journald reads each line as its own entry.
        return "\n".join(prefix + line for line in text.splitlines())


class JsonFormatter(logging.Formatter):
    def __init__(self, *, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {}
        if not self.journal:
            doc["ts"] = _utc(record.created)
        doc.update(
            level=record.levelname,
            priority=priority(record.levelno),
            logger=record.name,
            msg=record.getMessage(),
        )
        trace = tracecontext.CURRENT.get()
        if trace is not None:
            doc.update(trace_id=trace.trace_id, parent_id=trace.parent_id)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        line = json.dumps(doc, sort_keys=False, ensure_ascii=False)
        return f"<{priority(record.levelno)}>{line}" if self.journal else line


def resolve(fmt: str, environ: Mapping[str, str] | None = None) -> str:
    """The format `auto` stands for here: `journal` under journald, else `text`."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "auto":
        return "journal" if under_journald(environ) else "text"
    return fmt


def formatter(fmt: str, environ: Mapping[str, str] | None = None) -> logging.Formatter:
    kind = resolve(fmt, environ)
    if kind == "journal":
        return JournalFormatter()
    if kind == "json":
        return JsonFormatter(journal=under_journald(environ))
    return TextFormatter()


def configure(level: str | int, fmt: str = "auto", stream: TextIO | None = None) -> logging.Handler:
    """Send the root logger to stderr (or `stream`) in `fmt`, replacing any handler it had."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


def add_argument(parser: argparse.ArgumentParser) -> None:
    """`--log-format` on a daemon's subcommand parser."""
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="auto",
        help="auto (journal under journald, else text), text, json, or journal (<N> priority prefixes)",
    )
