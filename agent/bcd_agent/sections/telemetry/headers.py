"""The export headers: the value of the section's `headers_secret_ref`, parsed strictly.

Format (decided, docs/telemetry.md): OpenTelemetry's `OTEL_EXPORTER_OTLP_HEADERS` form, which collectors'
and vendors' docs give for exactly this use: `name=value` pairs separated by commas, each value
percent-decoded (`api-key=abc%2Cdef,x-tenant=ml`); spaces around names and values and one trailing
newline are ignored. Refused (the secret's value is never echoed in the message):

- a pair without `=`, an empty name or value, a name that is not an HTTP token (RFC 9110), a name twice;
- a value with a control or non-ASCII character once decoded (no header injection);
- a header bcd sets itself (Host, Content-Type, Content-Length, Content-Encoding, Connection,
  Transfer-Encoding, User-Agent);
- more than 32 headers or 8 KiB in all.
"""

from __future__ import annotations

import re
import urllib.parse

from bcd_shared.errors import TerminalError

REASON_INVALID_HEADERS = "InvalidHeaders"
MAX_HEADERS = 32
MAX_BYTES = 8192
RESERVED = frozenset(
    {
        "host",
        "content-type",
        "content-length",
        "content-encoding",
        "connection",
        "transfer-encoding",
        "user-agent",
    }
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def parse_headers(value: bytes, ref: str) -> tuple[tuple[str, str], ...]:
    def bad(rule: str) -> TerminalError:
        return TerminalError(REASON_INVALID_HEADERS, f"telemetry.headers_secret_ref {ref}: {rule}")

    if len(value) > MAX_BYTES:
        raise bad(f"the value is longer than {MAX_BYTES} bytes")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the value is not UTF-8") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        return ()
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for n, pair in enumerate(text.split(","), 1):
        name, eq, raw = pair.partition("=")
        name = name.strip()
        if not eq:
            raise bad(f"pair {n} has no '='")
        if not _TOKEN.fullmatch(name):
            raise bad(f"pair {n}: the name is empty or not an HTTP token")
        try:
            decoded = urllib.parse.unquote(raw.strip(), errors="strict")
        except UnicodeDecodeError:
            raise bad(f"{name}: the percent-encoded value is not UTF-8") from None
        if not decoded:
            raise bad(f"{name}: empty value")
        if any(not " " <= ch <= "~" for ch in decoded):
            raise bad(f"{name}: the value holds a control or non-ASCII character")
        lower = name.lower()
        if lower in RESERVED:
            raise bad(f"{name}: bcd sets this header itself")
        if lower in seen:
            raise bad(f"{name}: given twice")
        seen.add(lower)
        out.append((name, decoded))
    if len(out) > MAX_HEADERS:
        raise bad(f"{len(out)} headers: at most {MAX_HEADERS}")
    return tuple(out)
