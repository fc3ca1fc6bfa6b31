"""The admin channel of a running development control plane: `DIR/admin.sock` (0600), JSON lines.

Each request is one JSON object on one line, `{"op": NAME, ...}`; each answer one line, `{"ok": true,
"result": ...}` or `{"ok": false, "error": "..."}`. Ops:

| op | arguments | result |
| --- | --- | --- |
| `token` | | a one-time join token |
| `apply` | `spec` (NodeSpec, protobuf JSON), `node` (optional when one node joined) | the generation |
| `enqueue` | `kind`, `payload` (JSON; optional), `node`, `not_after_s`, `min_generation` | the command id |
| `command` | `id` | the command's record (state, result hex, updates received) or null |
| `cancel` | `id`, `reason` | the state the command was in |
| `node` | `node` (optional) | the node's record (generations, status, events, connected) |
| `nodes` | | node ids |
| `secret` | `ref`, `value` (text) | null |
| `endpoint` | | address, unix socket, CA file, join pin |
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from bcd_agent.devplane.plane import DevPlane

MAX_LINE = 16 * 1024 * 1024


def handle(plane: DevPlane, request: dict[str, Any]) -> Any:
    from bcd_agent.devplane.plane import payload_for

    op = request.get("op")

    def node() -> str:
        value = request.get("node")
        return str(value) if value else plane.default_node()

    if op == "token":
        return plane.issue_token()
    if op == "apply":
        return plane.apply_spec(node(), request["spec"])
    if op == "enqueue":
        kind = str(request["kind"])
        return plane.enqueue(
            node(),
            kind,
            payload_for(kind, request.get("payload")),
            not_after_s=float(request.get("not_after_s", 300.0)),
            min_generation=int(request.get("min_generation", 0)),
        )
    if op == "command":
        return plane.command(str(request["id"]))
    if op == "cancel":
        return plane.cancel(str(request["id"]), str(request.get("reason", "cancelled by the operator")))
    if op == "node":
        return plane.node(node())
    if op == "nodes":
        return plane.nodes()
    if op == "secret":
        plane.put_secret(str(request["ref"]), str(request["value"]).encode())
        return None
    if op == "endpoint":
        return json.loads((plane.directory / "endpoint.json").read_text())
    raise ValueError(f"unknown op {op!r}")


async def serve(plane: DevPlane, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    path = plane.admin_path
    # Bound and listening under another name, then renamed: once admin.sock exists it answers (a script
    # that waits for the file, as docs/devplane.md's does, met a refused connection in between).
    # The staging name is no longer than the final one: a path that fits sun_path (108 bytes) as
    # admin.sock fits while bound too (a deep `bcd sim --root` stays within it).
    staging = path.with_name("admin.new")
    for stale in (path, staging):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(str(staging))
    os.chmod(staging, 0o600)
    sock.listen(16)
    os.rename(staging, path)
    listener = trio.SocketListener(sock)

    async def connection(stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buffer += data
                if len(buffer) > MAX_LINE:
                    return
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    try:
                        answer = {"ok": True, "result": handle(plane, json.loads(line))}
                    except Exception as exc:
                        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                    await stream.send_all(json.dumps(answer).encode() + b"\n")

    async with trio.open_nursery() as nursery:
        task_status.started()
        await trio.serve_listeners(connection, [listener], handler_nursery=nursery)


class AdminError(Exception):
    pass


class AdminClient:
    """A synchronous client of the admin socket (the CLI, tests)."""

    def __init__(self, directory: str | os.PathLike[str], timeout: float = 30.0) -> None:
        self.path = Path(directory) / "admin.sock"
        self.timeout = timeout

    def call(self, op: str, **args: Any) -> Any:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            sock.connect(str(self.path))
            sock.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    raise AdminError("the devplane closed the admin connection")
                data += chunk
        answer = json.loads(data)
        if not answer.get("ok"):
            raise AdminError(answer.get("error", "error"))
        return answer.get("result")
