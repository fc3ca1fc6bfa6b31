"""The telemetry section as bcd converges it: `TelemetrySpec`, read strictly from the wire's TelemetrySection.

TelemetrySection (proto/bcd/v1/nodespec.proto; DLV-SPEC-07) holds the OTLP endpoint, the export interval
in milliseconds, resource attributes and a secret reference for the export headers. Rules (a break is a
TerminalError `InvalidTelemetry` naming the field: only a new spec helps):

- `otlp_endpoint`: an `https://` URL (the proto says https); `http://` only to a loopback host
  (127.0.0.0/8, ::1, localhost: a collector on the node itself). ASCII only (an IDNA host, a
  percent-encoded path), no user or password (credentials belong in the headers secret), no query or
  fragment, at most 2048 characters. The OTLP base endpoint: metrics go to `<endpoint>/v1/metrics`,
  unless its path already ends with `/v1/metrics`. Empty: no export.
- `export_interval_ms`: 0 means OpenTelemetry's default of 60 s; otherwise 1 s to 1 h.
- `resource_attributes`: at most 64; keys 1-255 characters, values at most 4096, no control characters.
- `headers_secret_ref`: empty, or a `secret://` reference of at most 512 characters.
"""

from __future__ import annotations

import ipaddress
import urllib.parse

from attrs import frozen
from bcd_shared.errors import TerminalError

REASON_INVALID = "InvalidTelemetry"
DEFAULT_INTERVAL_MS = 60_000
MIN_INTERVAL_MS = 1_000
MAX_INTERVAL_MS = 3_600_000
MAX_ATTRIBUTES = 64
MAX_KEY = 255
MAX_VALUE = 4096
MAX_ENDPOINT = 2048
MAX_REF = 512
METRICS_PATH = "/v1/metrics"


@frozen
class TelemetrySpec:
    endpoint: str  # the OTLP base endpoint as given ("" = no export)
    interval_ms: int
    resource_attributes: tuple[tuple[str, str], ...] = ()  # sorted by key
    headers_secret_ref: str = ""

    @property
    def metrics_url(self) -> str:
        if not self.endpoint:
            return ""
        base = self.endpoint.rstrip("/")
        return base if base.endswith(METRICS_PATH) else base + METRICS_PATH

    @property
    def exports(self) -> bool:
        return bool(self.endpoint)


def _bad(field_name: str, rule: str) -> TerminalError:
    return TerminalError(REASON_INVALID, f"telemetry.{field_name}: {rule}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _printable(text: str) -> bool:
    return all(ch >= " " and ch != "\x7f" for ch in text)


def check_endpoint(endpoint: str) -> None:
    if len(endpoint) > MAX_ENDPOINT:
        raise _bad("otlp_endpoint", f"longer than {MAX_ENDPOINT} characters")
    if not _printable(endpoint) or " " in endpoint:
        raise _bad("otlp_endpoint", "contains a space or a control character")
    if not endpoint.isascii():
        raise _bad("otlp_endpoint", "not ASCII: give the host's IDNA (xn--) form and percent-encode the path")
    try:
        url = urllib.parse.urlsplit(endpoint)
        port = url.port
    except ValueError as exc:
        raise _bad("otlp_endpoint", f"not a URL: {exc}") from None
    host = url.hostname or ""
    if url.scheme not in ("https", "http"):
        raise _bad("otlp_endpoint", f"scheme {url.scheme!r}: must be https (or http to a loopback host)")
    if not host:
        raise _bad("otlp_endpoint", "has no host")
    if url.scheme == "http" and not _is_loopback(host):
        raise _bad("otlp_endpoint", f"http to {host}: plain http is allowed only to a loopback host")
    if url.username is not None or url.password is not None:
        raise _bad("otlp_endpoint", "carries credentials: put them in the headers secret")
    if url.query or url.fragment:
        raise _bad("otlp_endpoint", "has a query or a fragment")
    if port == 0:
        raise _bad("otlp_endpoint", "port 0")


def from_wire(section: object | None) -> TelemetrySpec | None:
    """The spec of a wire TelemetrySection (or an already-typed TelemetrySpec); None when it is empty."""
    if section is None or isinstance(section, TelemetrySpec):
        return section
    endpoint = str(getattr(section, "otlp_endpoint", ""))
    interval = int(getattr(section, "export_interval_ms", 0))
    attributes = dict(getattr(section, "resource_attributes", {}) or {})
    ref = str(getattr(section, "headers_secret_ref", ""))
    if not endpoint and not interval and not attributes and not ref:
        return None
    if endpoint:
        check_endpoint(endpoint)
    if interval == 0:
        interval = DEFAULT_INTERVAL_MS
    elif not MIN_INTERVAL_MS <= interval <= MAX_INTERVAL_MS:
        raise _bad(
            "export_interval_ms", f"{interval}: must be 0 (60 s) or {MIN_INTERVAL_MS} to {MAX_INTERVAL_MS}"
        )
    if len(attributes) > MAX_ATTRIBUTES:
        raise _bad("resource_attributes", f"{len(attributes)} attributes: at most {MAX_ATTRIBUTES}")
    for key, value in attributes.items():
        if not 1 <= len(key) <= MAX_KEY or not _printable(key):
            raise _bad("resource_attributes", f"key {key[:64]!r}: 1 to {MAX_KEY} printable characters")
        if len(value) > MAX_VALUE or not _printable(value):
            raise _bad("resource_attributes", f"{key}: value of at most {MAX_VALUE} printable characters")
    if ref and (not ref.startswith("secret://") or len(ref) > MAX_REF or not _printable(ref)):
        raise _bad("headers_secret_ref", f"must be a secret:// reference of at most {MAX_REF} characters")
    return TelemetrySpec(endpoint, interval, tuple(sorted(attributes.items())), ref)
