"""A minimal OTLP/HTTP receiver on loopback, for tests and `bcd bench converge` (not for production).

`OtlpReceiver` accepts `POST /v1/metrics`, keeps each request's headers and body (bounded: the last
`keep` requests, bodies up to 4 MiB) and answers 200 with an empty ExportMetricsServiceResponse, or the
status set in `status` (to test retries). Decoding is the caller's business: the tests decode bodies
with the official opentelemetry-proto definitions.
"""

from __future__ import annotations

from collections import deque

import trio
from attrs import frozen

MAX_BODY = 4 << 20
MAX_HEAD = 64 * 1024


@frozen
class Received:
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes


class OtlpReceiver:
    def __init__(self, keep: int = 64) -> None:
        self.requests: deque[Received] = deque(maxlen=keep)
        self.count = 0
        self.status = 200
        self.port = 0
        self.arrived = trio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._serve, listeners)
            task_status.started(self.port)

    async def _serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = await stream.receive_some(65536)
                if not chunk or len(buf) > MAX_HEAD:
                    return
                buf += chunk
            head, _, body = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _version = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if length > MAX_BODY:
                return
            while len(body) < length:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                body += chunk
            status = self.status if method == "POST" else 405
            if status == 200:
                self.requests.append(Received(path, headers, body[:length]))
                self.count += 1
                self.arrived.set()
                self.arrived = trio.Event()
            reason = "OK" if status == 200 else "Error"
            await stream.send_all(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/x-protobuf\r\n"
                f"Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
            )
