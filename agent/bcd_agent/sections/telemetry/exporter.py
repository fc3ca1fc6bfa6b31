"""The OTLP/HTTP exporter: a trio service that sends `NodeMetrics` to the configured endpoint.

- `configure(config)` (the section's applier; None stops) takes effect at once: the queue of the old
  endpoint is dropped (counted), a send in flight to it is cancelled, and the first export to the new one
  is built immediately, then one every `interval_s`. No restart.
- Each export is one snapshot of every metric (cumulative since start), encoded once and queued. The
  queue is bounded (MAX_QUEUE exports, MAX_QUEUE_BYTES in all): when full the OLDEST export is dropped and
  counted (`bcd.telemetry.exports.dropped`). Cumulative values make a dropped export cheap: the next one
  carries everything. So an unreachable endpoint costs a few queued payloads, never more memory.
- One sender posts the oldest queued export with a timeout: 2xx sends it; 429/502/503/504, a timeout or a
  connection error keeps it and waits (Retry-After, else 1 s doubling to 60 s); any other status drops it.
  Every attempt counts in `bcd.telemetry.exports` (`error.type` = the status or the transport error).
  A 401 or 403 calls `on_auth_failure`: the section fetches the headers secret again (rotated
  credentials), at most once per refused export.
- The converge pass never waits for any of this: collecting reads in-memory counters only, and sending
  runs in the exporter's own task.

OTLP/HTTP: `POST <url>` with `Content-Type: application/x-protobuf`, the body an
ExportMetricsServiceRequest (bcd_agent.sections.telemetry.otlp), the section's headers added. TLS for
https uses the system's trust store (`ssl.create_default_context`), imported only when needed.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import trio

from bcd_agent.sections.telemetry.metrics import NodeMetrics
from bcd_agent.sections.telemetry.otlp import encode_request
from bcd_agent.sections.telemetry.plan import ExportConfig

log = logging.getLogger("bcd.telemetry")

MAX_QUEUE = 4
MAX_QUEUE_BYTES = 1 << 20
TIMEOUT_S = 10.0
MAX_BACKOFF_S = 60.0
MIN_RETRY_S = 0.5  # a `Retry-After: 0` never makes a tight loop
MAX_RESPONSE_HEAD = 16 * 1024
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
# The endpoint refused the credentials: the headers secret may have been rotated (fetched again).
AUTH_STATUS = frozenset({"401", "403"})
SCOPE_NAME = "bcd"


class ExportFailed(Exception):
    def __init__(self, error_type: str, retryable: bool, retry_after_s: float | None = None) -> None:
        super().__init__(error_type)
        self.error_type = error_type
        self.retryable = retryable
        self.retry_after_s = retry_after_s


Post = Callable[[str, bytes, Sequence[tuple[str, str]], float], Awaitable[None]]


async def _read_head(stream: trio.abc.Stream) -> tuple[int, float | None]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_RESPONSE_HEAD:
            raise ExportFailed("response_too_large", True)
    lines = buf.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ExportFailed("bad_response", True)
    retry_after: float | None = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"retry-after" and value.strip().isdigit():
            retry_after = min(float(value.strip()), MAX_BACKOFF_S)
    return int(parts[1]), retry_after


async def post_otlp(url: str, body: bytes, headers: Sequence[tuple[str, str]], timeout_s: float) -> None:
    """One OTLP/HTTP POST; returns on 2xx, raises ExportFailed otherwise."""
    u = urllib.parse.urlsplit(url)
    host = u.hostname or ""
    https = u.scheme == "https"
    port = u.port or (443 if https else 80)
    authority = f"[{host}]" if ":" in host else host
    if u.port:
        authority += f":{u.port}"
    head = (
        f"POST {u.path or '/'} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/x-protobuf\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    )
    head += "".join(f"{name}: {value}\r\n" for name, value in headers) + "\r\n"
    try:
        with trio.fail_after(timeout_s):
            stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
            try:
                if https:
                    import ssl

                    stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=host)
                await stream.send_all(head.encode("ascii") + body)
                status, retry_after = await _read_head(stream)
            finally:
                await trio.aclose_forcefully(stream)
    except trio.TooSlowError:
        raise ExportFailed("timeout", True) from None
    except (OSError, trio.BrokenResourceError) as exc:
        raise ExportFailed(type(exc).__name__, True) from None
    if not 200 <= status < 300:
        raise ExportFailed(str(status), status in RETRYABLE_STATUS, retry_after)


class Exporter:
    """See the module docstring. Start with `await nursery.start(exporter.run)`."""

    def __init__(
        self,
        metrics: NodeMetrics,
        *,
        scope_version: str = "",
        post: Post = post_otlp,
        max_queue: int = MAX_QUEUE,
        max_queue_bytes: int = MAX_QUEUE_BYTES,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.metrics = metrics
        self.scope_version = scope_version
        self._post = post
        self._max_queue = max_queue
        self._max_bytes = max_queue_bytes
        self._timeout_s = timeout_s
        self.config: ExportConfig | None = None
        self._version = 0  # bumped by every configure(); queued exports carry the version they were built for
        self._queue: deque[tuple[int, bytes]] = deque()
        self._queued_bytes = 0
        self._changed = trio.Event()
        self._queued = trio.Event()
        self._send_scope: trio.CancelScope | None = None
        self.start_ns = time.time_ns()
        self.sent = 0
        # Called on a 401 or 403 answer (the telemetry section fetches the headers again).
        self.on_auth_failure: Callable[[], None] | None = None

    # --- the section's side -----------------------------------------------------------------------

    def configure(self, config: ExportConfig | None) -> None:
        """Run with `config` from now on (None: stop). Safe to call from the runner's task."""
        if config == self.config:
            return
        log.info(
            "telemetry: %s",
            f"exporting to {config.url} every {config.interval_s:g} s" if config else "export stopped",
        )
        self.config = config
        self._version += 1
        if self._queue:
            self.metrics.exports_dropped.add((), len(self._queue))
            self._queue.clear()
            self._queued_bytes = 0
        if self._send_scope is not None:
            self._send_scope.cancel()
        self._changed.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def encode(self) -> bytes:
        """One ExportMetricsServiceRequest of every metric now, with the running config's resource."""
        config = self.config
        resource = config.resource if config is not None else ()
        return encode_request(
            resource,
            SCOPE_NAME,
            self.scope_version,
            self.metrics.collect(),
            start_ns=self.start_ns,
            now_ns=time.time_ns(),
        )

    def enqueue(self, payload: bytes) -> None:
        """Queue one export; the oldest ones are dropped (counted) to stay within the bounds."""
        if len(payload) > self._max_bytes:
            self.metrics.exports_dropped.add(())
            log.warning(
                "telemetry: an export of %d bytes exceeds the queue's %d bytes; dropped",
                len(payload),
                self._max_bytes,
            )
            return
        while self._queue and (
            len(self._queue) >= self._max_queue or self._queued_bytes + len(payload) > self._max_bytes
        ):
            _, old = self._queue.popleft()
            self._queued_bytes -= len(old)
            self.metrics.exports_dropped.add(())
        self._queue.append((self._version, payload))
        self._queued_bytes += len(payload)
        self._queued.set()

    # --- the service ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._collect_loop)
            nursery.start_soon(self._send_loop)
            task_status.started()

    async def _collect_loop(self) -> None:
        while True:
            self._changed = trio.Event()
            config = self.config
            if config is None:
                await self._changed.wait()
                continue
            try:
                self.enqueue(self.encode())
            except Exception:  # a bug in a metric's source must not stop the node
                log.warning("telemetry: building an export failed", exc_info=True)
            with trio.move_on_after(config.interval_s):
                await self._changed.wait()

    async def _send_loop(self) -> None:
        failures = 0
        while True:
            if not self._queue:
                self._queued = trio.Event()
                await self._queued.wait()
                continue
            version, payload = self._queue[0]
            config = self.config
            if config is None or version != self._version:
                self._discard(payload)
                continue
            wait = 0.0
            with trio.CancelScope() as scope:
                self._send_scope = scope
                try:
                    headers = (("User-Agent", f"bcd/{self.scope_version}"), *config.headers)
                    await self._post(config.url, payload, headers, min(self._timeout_s, config.interval_s))
                except Exception as exc:
                    if not isinstance(exc, ExportFailed):  # a bug, not the endpoint: drop, never crash
                        log.warning("telemetry: export to %s failed", config.url, exc_info=True)
                        exc = ExportFailed(type(exc).__name__, False)
                    self.metrics.exports.add((exc.error_type,))
                    failures += 1
                    if exc.retryable:
                        backoff = min(2.0 ** (failures - 1), MAX_BACKOFF_S)
                        wait = max(
                            exc.retry_after_s if exc.retry_after_s is not None else backoff, MIN_RETRY_S
                        )
                        log.info(
                            "telemetry: export to %s failed (%s); retrying in %g s",
                            config.url,
                            exc.error_type,
                            wait,
                        )
                    else:
                        log.warning(
                            "telemetry: export to %s refused (%s); dropped", config.url, exc.error_type
                        )
                        self._discard(payload)
                        if exc.error_type in AUTH_STATUS and self.on_auth_failure is not None:
                            self.on_auth_failure()
                else:
                    failures = 0
                    self.sent += 1
                    self.metrics.exports.add(("",))
                    self._discard(payload)
                if wait:
                    await trio.sleep(wait)
            self._send_scope = None

    def _discard(self, payload: bytes) -> None:
        if self._queue and self._queue[0][1] is payload:
            self._queue.popleft()
            self._queued_bytes -= len(payload)
