"""The agent's side of the root helper: a client for the helper's Unix-socket operations.

The protocol is docs/helper-rpc.md: 4-byte big-endian length + one JSON document per frame;
request `{"op", "args"}`, answer `{"ok": true, "result"}` or `{"ok": false, "error", "reason",
"message"}`. A refusal or failure, and any transport error, is raised as
`bcd_shared.errors.HelperRefused` ("helper: ..."), which is retryable: the section that asked stays
PROGRESSING and the next pass tries again (DLV-PRIV-05/06, DEV-BIND-07).

`HelperClient` is synchronous (one connection, reopened after an error; a lock serialises calls on
it). `TrioHelperClient` runs the same calls in a worker thread with `trio.to_thread.run_sync`, so
a 30-minute host.unit never blocks the agent's event loop. The wait for an answer is the op's
timeout plus a minute on the connection (HST-HLP-08).

While a command is handled (bcd_shared.tracecontext.CURRENT is set, in the handler's task and in the
threads trio starts for it), each request carries its W3C trace context as `"trace"` (a version-00
`traceparent`), and root records the ids in the request's audit lines (DLV-CMD-15; docs/helper.md
"Audit log"). A request made outside any command's handling carries none.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import trio
from bcd_shared import tracecontext
from bcd_shared.errors import HelperRefused

from bcd_agent.counters import CounterSet

MAX_FRAME = 4 * 1024 * 1024
CONNECTION_SLACK_S = 60.0
# Each op's own timeout in the helper's OPS table; the client waits that plus CONNECTION_SLACK_S.
OP_TIMEOUT_S: Mapping[str, float] = {
    "helper.ping": 5,
    "file.write": 60,
    "file.remove": 60,
    "slice.apply": 120,
    "slice.remove": 120,
    "host.unit": 30 * 60,
    "gpu.reset": 10 * 60,
    "node.reboot": 120,
    "access.apply": 120,
    "daemon.swap": 10 * 60,
    "daemon.confirm": 120,
    "audit.tail": 30,
    "libvirt.define": 120,
    "libvirt.start": 300,
    "libvirt.shutdown": 120,
    "libvirt.destroy": 120,
    "libvirt.suspend": 120,
    "libvirt.resume": 120,
    "libvirt.undefine": 120,
    "libvirt.blockresize": 120,
    "libvirt.setmem": 120,
    "libvirt.restore": 600,
    "libvirt.console": 60,
}
_LEN = struct.Struct(">I")
READ_AHEAD = 4096  # a first read takes a usual answer whole; a larger one is read on


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # built once (json.dumps with options builds one a call)


def _request(op: str, args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The request document; with the current command's trace context when there is one."""
    trace = tracecontext.CURRENT.get()
    if trace is None:
        return {"op": op, "args": dict(args or {})}
    return {"op": op, "args": dict(args or {}), "trace": tracecontext.header(trace)}


def _send(sock: socket.socket, frame: bytes) -> None:
    """The socket has a timeout, so its descriptor is non-blocking: one write(2) takes a usual request whole
    (sendall under a timeout polls first); the rest, if any, goes through sendall and its timeout."""
    try:
        sent = os.write(sock.fileno(), frame)
    except BlockingIOError:
        sent = 0
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts: list[bytes] = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the helper closed the connection")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _read_answer(sock: socket.socket) -> bytes:
    """One answer frame's body. A small answer comes whole in the first read (one wait, not two); the
    helper sends one frame per request, so bytes past it are a broken stream."""
    data = b""
    while len(data) < 4:
        more = sock.recv(READ_AHEAD)
        if not more:
            raise ConnectionError("the helper closed the connection")
        data += more
    (n,) = _LEN.unpack_from(data)
    if n > MAX_FRAME:
        raise ConnectionError(f"answer of {n} bytes is too large")
    if len(data) - 4 > n:
        raise ConnectionError("the helper sent more than one answer")
    if len(data) - 4 == n:
        return data[4:]
    return data[4:] + _recv_exact(sock, n - (len(data) - 4))


class HelperCallStats:
    """Calls per op and refusals per (op, reason), shared by a node's helper clients (bcd's own metrics,
    docs/telemetry.md). An op outside the client's table counts as "other"."""

    def __init__(self) -> None:
        self.calls = CounterSet()
        self.refusals = CounterSet()

    def called(self, op: str) -> None:
        self.calls.add((_op_label(op),))

    def refused(self, op: str, reason: str) -> None:
        self.refusals.add((_op_label(op), reason))


def _op_label(op: str) -> str:
    return op if op in OP_TIMEOUT_S else "other"


class HelperClient:
    """A synchronous client over one connection to the helper's socket."""

    def __init__(
        self, socket_path: str, *, connect_timeout: float = 5.0, stats: HelperCallStats | None = None
    ) -> None:
        self.socket_path = socket_path
        self.connect_timeout = connect_timeout
        self.stats = stats
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout)
            try:
                sock.connect(self.socket_path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def call(
        self, op: str, args: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Send one request; the result on success, else HelperRefused. `timeout` replaces the op's."""
        if self.stats is None:
            return self._call(op, args, timeout)
        self.stats.called(op)
        try:
            return self._call(op, args, timeout)
        except HelperRefused as exc:
            self.stats.refused(op, exc.reason)
            raise

    def _call(self, op: str, args: Mapping[str, Any] | None, timeout: float | None) -> dict[str, Any]:
        body = _ENCODER.encode(_request(op, args)).encode()
        if len(body) > MAX_FRAME:
            raise HelperRefused("too-large", f"helper: {op}: request of {len(body)} bytes is too large")
        wait = timeout if timeout is not None else OP_TIMEOUT_S.get(op, 60.0) + CONNECTION_SLACK_S
        with self._lock:
            try:
                sock = self._connect()
                if sock.gettimeout() != wait:
                    sock.settimeout(wait)
                _send(sock, _LEN.pack(len(body)) + body)
                reply = json.loads(_read_answer(sock))
            except (OSError, ValueError) as exc:
                self._drop()
                raise HelperRefused("unreachable", f"helper: {op}: {type(exc).__name__}: {exc}") from None
        if not isinstance(reply, dict) or "ok" not in reply:
            self.close()
            raise HelperRefused("protocol", f"helper: {op}: malformed answer")
        if reply["ok"] is not True:
            reason = str(reply.get("reason", "refused"))
            message = str(reply.get("message", ""))
            if reason in ("peer", "protocol"):
                self.close()
            raise HelperRefused(reason, f"helper: {message or reason}")
        result = reply.get("result", {})
        return result if isinstance(result, dict) else {}

    def call_fd(self, op: str, args: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], int]:
        """An op that hands back a file descriptor (libvirt.console): (result, fd) on a fresh connection."""
        import array

        body = _ENCODER.encode(_request(op, args)).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(OP_TIMEOUT_S.get(op, 60.0) + CONNECTION_SLACK_S)
            try:
                sock.connect(self.socket_path)
                sock.sendall(_LEN.pack(len(body)) + body)
                data, anc, _flags, _addr = sock.recvmsg(4, socket.CMSG_SPACE(4))
                fds = array.array("i")
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                data += _recv_exact(sock, 4 - len(data))
                (n,) = _LEN.unpack(data)
                reply = json.loads(_recv_exact(sock, n))
            except (OSError, ValueError) as exc:
                raise HelperRefused("unreachable", f"helper: {op}: {type(exc).__name__}: {exc}") from None
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            for fd in fds:
                os.close(fd)
            message = str(reply.get("message", "")) if isinstance(reply, dict) else "malformed answer"
            raise HelperRefused(
                str(reply.get("reason", "refused")) if isinstance(reply, dict) else "protocol",
                f"helper: {message}",
            )
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise HelperRefused("protocol", f"helper: {op}: expected one file descriptor, got {len(fds)}")
        result = reply.get("result", {})
        return (result if isinstance(result, dict) else {}), fds[0]

    # --- the operations -----------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        return self.call("helper.ping")

    def file_write(
        self, kind: str, ident: str, content: bytes | str, intent: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """`intent`: the signed spec the node keeps (as for host.unit); root binds holds to it."""
        text = content.decode("utf-8") if isinstance(content, bytes) else content
        args: dict[str, Any] = {"kind": kind, "id": ident, "content": text, "encoding": "utf-8"}
        if intent is not None:
            args["intent"] = dict(intent)
        return self.call("file.write", args)

    def file_remove(self, kind: str, ident: str, intent: Mapping[str, Any] | None = None) -> bool:
        args: dict[str, Any] = {"kind": kind, "id": ident}
        if intent is not None:
            args["intent"] = dict(intent)
        return bool(self.call("file.remove", args).get("removed"))

    def slice_apply(
        self,
        name: str,
        *,
        cpus: str | None = None,
        mems: str | None = None,
        cpu_millis: int | None = None,
        memory_bytes: int | None = None,
        hugepages_2mi: int | None = None,
        hugepages_1gi: int | None = None,
        reset: Sequence[str] = (),
        intent: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Start the slice, set the limits given and reset the limits named in `reset` (by the same
        field names) to the kernel's default; `reset` is sent only when not empty. `intent`: the signed
        spec the node keeps; with roots, root takes only the signed assignment's limits."""
        args: dict[str, Any] = {"name": name}
        for key, value in (
            ("cpus", cpus),
            ("mems", mems),
            ("cpu_millis", cpu_millis),
            ("memory_bytes", memory_bytes),
            ("hugepages_2mi", hugepages_2mi),
            ("hugepages_1gi", hugepages_1gi),
        ):
            if value is not None:
                args[key] = value
        if reset:
            args["reset"] = list(reset)
        if intent is not None:
            args["intent"] = dict(intent)
        return self.call("slice.apply", args)

    def slice_remove(self, name: str) -> dict[str, Any]:
        return self.call("slice.remove", {"name": name})

    def host_unit(
        self,
        unit: str,
        settings: str | None,
        busy_gpus: Sequence[str] = (),
        intent: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"unit": unit, "settings": settings, "busy_gpus": list(busy_gpus)}
        if intent is not None:
            args["intent"] = dict(intent)
        return self.call("host.unit", args)

    def gpu_reset(
        self, gpu_uuids: Sequence[str], command: Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """`command`: the signed Command the node received (command_arg), which root re-validates."""
        args: dict[str, Any] = {"gpu_uuids": list(gpu_uuids)}
        if command is not None:
            args["command"] = dict(command)
        gpus = self.call("gpu.reset", args).get("gpus", [])
        return list(gpus) if isinstance(gpus, list) else []

    def node_reboot(self, command: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self.call("node.reboot", {} if command is None else {"command": dict(command)})

    def access_apply(self, intent: Mapping[str, Any] | None) -> dict[str, Any]:
        """Root renders the access section's sshd files from the signed spec (`intent`, as for host.unit)."""
        return self.call("access.apply", {} if intent is None else {"intent": dict(intent)})

    def daemon_swap(
        self,
        *,
        version: str,
        url: str,
        sha256: str,
        signature: bytes,
        chain: Sequence[bytes],
        artifact: str,
        trust_bundle: bytes | None = None,
        confirm_timeout_s: int = 600,
        rollback: bool = False,
        spec: tuple[bytes, bytes] | None = None,
        command: tuple[bytes, bytes] | None = None,
    ) -> dict[str, Any]:
        """Ask root to verify the downloaded release (`artifact`, a file name in the node's staging
        directory) and swap it in. `spec` or `command`: the signed (body, signature) that names the
        release, binding it to freshness (helper/bcd_helper/ops/daemon.py)."""

        def carrier(pair: tuple[bytes, bytes] | None) -> dict[str, str] | None:
            if pair is None:
                return None
            return {
                "body": base64.b64encode(pair[0]).decode(),
                "signature": base64.b64encode(pair[1]).decode(),
            }

        return self.call(
            "daemon.swap",
            {
                "version": version,
                "url": url,
                "sha256": sha256,
                "signature": base64.b64encode(signature).decode(),
                "chain": [base64.b64encode(c).decode() for c in chain],
                "artifact": artifact,
                "trust_bundle": None if trust_bundle is None else base64.b64encode(trust_bundle).decode(),
                "confirm_timeout_s": confirm_timeout_s,
                "rollback": rollback,
                "spec": carrier(spec),
                "command": carrier(command),
            },
        )

    def daemon_confirm(self, version: str, *, healthy: bool = True) -> dict[str, Any]:
        """The running release confirms itself (or, unhealthy, asks root to roll back)."""
        return self.call("daemon.confirm", {"version": version, "healthy": healthy})

    def audit_tail(self, max_bytes: int = 256 * 1024) -> str:
        """The newest whole lines of root's audit log (at most `max_bytes`), for logs.collect."""
        return str(self.call("audit.tail", {"max_bytes": max_bytes}).get("text", ""))


class TrioHelperClient:
    """The same operations for trio code: each call runs the sync client in a worker thread."""

    def __init__(self, socket_path: str) -> None:
        self.sync = HelperClient(socket_path)

    async def call(self, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self.sync.call, op, args)

    async def ping(self) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self.sync.ping)

    async def file_write(self, kind: str, ident: str, content: bytes | str) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self.sync.file_write, kind, ident, content)

    async def file_remove(self, kind: str, ident: str) -> bool:
        return await trio.to_thread.run_sync(self.sync.file_remove, kind, ident)

    async def slice_apply(self, name: str, **limits: Any) -> dict[str, Any]:
        return await trio.to_thread.run_sync(lambda: self.sync.slice_apply(name, **limits))

    async def slice_remove(self, name: str) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self.sync.slice_remove, name)

    async def host_unit(
        self,
        unit: str,
        settings: str | None,
        busy_gpus: Sequence[str] = (),
        intent: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        return await trio.to_thread.run_sync(lambda: self.sync.host_unit(unit, settings, busy_gpus, intent))

    async def gpu_reset(self, gpu_uuids: Sequence[str]) -> list[dict[str, Any]]:
        return await trio.to_thread.run_sync(self.sync.gpu_reset, gpu_uuids)

    async def node_reboot(self) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self.sync.node_reboot)

    async def daemon_swap(self, **kwargs: Any) -> dict[str, Any]:
        return await trio.to_thread.run_sync(lambda: self.sync.daemon_swap(**kwargs))

    async def daemon_confirm(self, version: str, *, healthy: bool = True) -> dict[str, Any]:
        return await trio.to_thread.run_sync(lambda: self.sync.daemon_confirm(version, healthy=healthy))

    def close(self) -> None:
        self.sync.close()
