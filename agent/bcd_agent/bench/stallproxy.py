"""A Unix-socket proxy between the node and a gateway that can stall (benches and tests).

While `stalled`, it stops reading what the node sends, so the node's socket buffer and then its HTTP/2
window fill, as with a gateway that stopped reading while keeping its connection open; what the gateway
sends still reaches the node. `resume()` lets the bytes flow again. Each accepted connection opens its
own connection to the gateway.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import trio


class StallProxy:
    def __init__(self, listen: Path, target: Path, *, stall_after_bytes: int | None = None) -> None:
        self.listen = listen
        self.target = target
        # Set: every connection stalls on its own once it forwarded this many bytes from the node (the
        # Hello passes, the backlog behind it does not), until `resume()`.
        self.stall_after_bytes = stall_after_bytes
        self.stalled = False
        self._resumed = trio.Event()
        self.connections = 0

    def stall(self) -> None:
        self.stalled = True
        if self._resumed.is_set():
            self._resumed = trio.Event()

    def resume(self) -> None:
        self.stalled = False
        self._resumed.set()

    async def run(self, *, task_status: trio.TaskStatus[StallProxy] = trio.TASK_STATUS_IGNORED) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.listen)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(str(self.listen))
        sock.listen(16)
        listener = trio.SocketListener(sock)
        async with listener:
            task_status.started(self)
            await trio.serve_listeners(self._handle, [listener])

    async def _handle(self, node: trio.SocketStream) -> None:
        self.connections += 1
        try:
            await self._pipe(node)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # one side closed its connection: this connection is over, the proxy goes on

    async def _pipe(self, node: trio.SocketStream) -> None:
        try:
            gateway = await trio.open_unix_socket(str(self.target))
        except OSError:
            await node.aclose()
            return
        async with node, gateway, trio.open_nursery() as nursery:

            async def upstream() -> None:
                forwarded = 0
                while True:
                    while self.stalled or (
                        self.stall_after_bytes is not None
                        and forwarded >= self.stall_after_bytes
                        and not self._resumed.is_set()
                    ):
                        await self._resumed.wait()
                    data = await node.receive_some(65536)
                    forwarded += len(data)
                    if not data:
                        break
                    await gateway.send_all(data)
                nursery.cancel_scope.cancel()

            async def downstream() -> None:
                while True:
                    data = await gateway.receive_some(65536)
                    if not data:
                        break
                    await node.send_all(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(upstream)
            nursery.start_soon(downstream)
