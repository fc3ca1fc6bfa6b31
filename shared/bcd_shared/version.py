"""bcd's version: one constant for `bcd --version`, `bcd-helper --version`, Hello, `bcd status`,
`bcd doctor` and the start-up log lines. The three pyproject.toml files carry the same string (a
test checks that they agree), and the Debian packages take theirs from here (`make deb`)."""

from __future__ import annotations

VERSION = "0.1.0"
