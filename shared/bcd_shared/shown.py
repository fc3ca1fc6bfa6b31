"""Text from outside made safe to print on an operator's terminal."""

from __future__ import annotations


def shown(text: object) -> str:
    """`text` with every unprintable character escaped as Python writes it (`\\x1b`, `\\n`, `\\u202e`).
    What a node, a tool or a peer chose can then neither start what looks like another line of a log or
    table nor send the terminal an escape sequence (a title, a clipboard write, a bidi override)."""
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in s)
