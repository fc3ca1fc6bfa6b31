"""The helper's socket server: peer check, framing, strict decoding, dispatch through OPS, audit.

- A Unix stream socket, mode 0660, owned root:<node group>; its directory is made root-only.
- Every connection: SO_PEERCRED is read once; only root and the configured node uid are served,
  anyone else is refused (audited) and the connection closed.
- Reads go through recvmsg with room for ancillary data: any SCM_RIGHTS descriptor that arrives is
  closed at once, the request refused and the connection closed (the helper hands descriptors
  out, never takes them in). Truncated ancillary data is treated the same way.
- Frames: 4-byte big-endian length, at most MAX_FRAME; a larger one closes the connection. Once a
  frame's first byte has arrived, the whole frame must arrive within FRAME_TIMEOUT_S (however slowly
  it trickles), and an answer must be taken within FRAME_TIMEOUT_S; else the connection is closed
  (a slow-loris client holds one thread for seconds, not for the 15-minute idle timeout).
- At most MAX_CONNECTIONS connections of non-root peers at once (each is a thread): one more is
  answered `busy`, audited and closed at once. Root's own connections are never counted, so a
  flood from the node's uid cannot lock root out.
- Audit lines are bounded: a shown argument whose JSON is longer than MAX_SHOWN bytes is recorded as
  its size and SHA-256 (args_sha256 pins the whole request anyway), and messages are cut to MAX_TEXT
  characters, in the audit log and in the answer alike.
- Each request is decoded into its op's frozen type (protocol.structure), run under the op's
  locks and deadline, answered, and recorded in the audit log, accepted or refused, before the
  answer is sent.
- One thread per connection (the standard library's socketserver threading mix-in), so a
  30-minute host.unit never blocks a file.write on another connection. Per-connection state lives
  in a `Connection` object; process-wide state in the HelperContext.
"""

from __future__ import annotations

import array
import contextlib
import grp
import hashlib
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

from bcd_helper.audit import canonical
from bcd_helper.ops.base import BoundedSystem, Call, Deadline, Failed, HelperContext, Peer, Refused
from bcd_helper.ops.table import LOCK_ORDER, OPS, OpSpec
from bcd_helper.protocol import MAX_FRAME, DecodeError, ProtocolError, decode_body, encode_frame, structure

IDLE_TIMEOUT_S = 15 * 60.0
FRAME_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
MAX_SHOWN = 1024
MAX_TEXT = 2000
_LEN = struct.Struct(">I")
_FD_SPACE = socket.CMSG_SPACE(16 * 4)


EOF = object()  # read_request's answer at a clean end of stream (a JSON null is a request)


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


class Connection:
    """One client connection: its peer, its socket and what it has sent so far."""

    def __init__(self, ctx: HelperContext, sock: socket.socket) -> None:
        self.ctx = ctx
        self.sock = sock
        self.peer = peer_credentials(sock)
        self.buffer = bytearray()
        self.requests = 0
        self.frame_deadline: float | None = None  # set while a frame is partly read

    # --- framing with ancillary-data refusal --------------------------------------------------

    def _recv(self) -> bytes:
        data, ancdata, flags, _addr = self.sock.recvmsg(1 << 16, _FD_SPACE)
        passed = False
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                passed = True
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            else:
                passed = True
        if passed or flags & socket.MSG_CTRUNC:
            raise ProtocolError("file descriptors or other ancillary data were sent: the helper takes none")
        return data

    def _fill(self, n: int) -> bool:
        while len(self.buffer) < n:
            if self.buffer and self.frame_deadline is None:
                self.frame_deadline = time.monotonic() + FRAME_TIMEOUT_S
            if self.frame_deadline is None:
                self.sock.settimeout(IDLE_TIMEOUT_S)
            else:
                left = self.frame_deadline - time.monotonic()
                if left <= 0:
                    raise ProtocolError(f"frame not complete within {FRAME_TIMEOUT_S:.0f} s")
                self.sock.settimeout(left)
            try:
                chunk = self._recv()
            except TimeoutError:
                if self.frame_deadline is None:
                    raise
                raise ProtocolError(f"frame not complete within {FRAME_TIMEOUT_S:.0f} s") from None
            if not chunk:
                if self.buffer:
                    raise ProtocolError("connection closed mid-frame")
                return False
            self.buffer += chunk
        return True

    def read_request(self) -> Any:
        """The next decoded JSON document, or EOF at a clean end of stream."""
        if not self._fill(4):
            return EOF
        (n,) = _LEN.unpack(self.buffer[:4])
        if n > MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        if not self._fill(4 + n):
            raise ProtocolError("connection closed mid-frame")
        body = bytes(self.buffer[4 : 4 + n])
        del self.buffer[: 4 + n]
        self.frame_deadline = None
        return decode_body(body)

    def send(self, doc: Any, fd: int | None = None) -> None:
        self.sock.settimeout(FRAME_TIMEOUT_S)
        frame = encode_frame(doc)
        if fd is None:
            self.sock.sendall(frame)
            return
        # A descriptor the op hands back (libvirt.console) rides with the frame's first byte.
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        sent = self.sock.sendmsg([frame], rights)
        if sent < len(frame):
            self.sock.sendall(frame[sent:])

    # --- serving ----------------------------------------------------------------------------------

    def audit(
        self, op: str, args: Any, spec: OpSpec | None, decision: str, reason: str, message: str, t0: float
    ) -> None:
        shown: dict[str, Any] = {}
        if isinstance(args, dict) and spec is not None:
            shown = {k: _bounded(args[k]) for k in spec.shown if k in args}
        digest = hashlib.sha256(canonical({"op": op, "args": args})).hexdigest()
        self.ctx.audit.record(
            peer_pid=self.peer.pid,
            peer_uid=self.peer.uid,
            op=op[:100],
            args=shown,
            args_sha256=digest,
            decision=decision,
            reason=reason,
            message=message[:MAX_TEXT],
            duration_ms=(time.monotonic() - t0) * 1000,
        )

    def answer(self, doc: Any) -> dict[str, Any]:
        """Serve one request document; returns the answer (already audited)."""
        t0 = time.monotonic()
        op, args = "?", None
        spec: OpSpec | None = None
        try:
            if not isinstance(doc, dict) or set(doc) != {"op", "args"}:
                raise Refused("bad-request", 'a request is exactly {"op": <string>, "args": <object>}')
            op, args = doc["op"], doc["args"]
            if not isinstance(op, str):
                op = "?"
                raise Refused("bad-request", "$.op: expected string")
            spec = OPS.get(op)
            if spec is None:
                raise Refused("unknown-op", f"unknown operation {op[:100]!r}")
            try:
                req = structure(args, spec.request)
            except DecodeError as exc:
                raise Refused("bad-arguments", f"{op}: {exc}") from None
            deadline = Deadline(spec.timeout_s)
            call = Call(self.ctx, self.peer, deadline, BoundedSystem(self.ctx.system, deadline))
            with self._locks(spec, deadline):
                result = spec.handler(call, req)
        except Refused as exc:
            self.audit(op, args, spec, "refused", exc.reason, exc.message, t0)
            return {"ok": False, "error": "refused", "reason": exc.reason, "message": exc.message[:MAX_TEXT]}
        except Failed as exc:
            self.audit(op, args, spec, "failed", exc.reason, exc.message, t0)
            return {"ok": False, "error": "failed", "reason": exc.reason, "message": exc.message[:MAX_TEXT]}
        except Exception as exc:  # a bug or an unexpected host error: failed, never silent
            message = f"{op[:100]}: {type(exc).__name__}: {exc}"[:MAX_TEXT]
            self.audit(op, args, spec, "failed", "internal", message, t0)
            return {"ok": False, "error": "failed", "reason": "internal", "message": message}
        self.audit(op, args, spec, "accepted", "", "", t0)
        return {"ok": True, "result": result}

    @contextlib.contextmanager
    def _locks(self, spec: OpSpec, deadline: Deadline) -> Iterator[None]:
        held: list[threading.Lock] = []
        try:
            for name in LOCK_ORDER:
                if name not in spec.locks:
                    continue
                lock = self.ctx.locks[name]
                if "nowait" in spec.flags:
                    ok = lock.acquire(blocking=False)
                else:
                    ok = lock.acquire(timeout=max(deadline.remaining(), 0.001))
                if not ok:
                    raise Refused("busy", f"another operation holds the helper's {name} lock")
                held.append(lock)
            yield
        finally:
            for lock in reversed(held):
                lock.release()

    def serve(self) -> None:
        ctx = self.ctx
        if self.peer.uid not in (0, ctx.config.node_uid):
            t0 = time.monotonic()
            message = f"uid {self.peer.uid} may not use the helper (only root and uid {ctx.config.node_uid})"
            self.audit("(connect)", None, None, "refused", "peer", message, t0)
            with contextlib.suppress(OSError):
                self.send({"ok": False, "error": "refused", "reason": "peer", "message": message})
            return
        while True:
            t0 = time.monotonic()
            try:
                doc = self.read_request()
            except (ProtocolError, TimeoutError, ConnectionError) as exc:
                if not isinstance(exc, ConnectionError | TimeoutError):
                    self.audit("(frame)", None, None, "refused", "protocol", str(exc), t0)
                    with contextlib.suppress(OSError):
                        self.send(
                            {"ok": False, "error": "refused", "reason": "protocol", "message": str(exc)}
                        )
                return
            if doc is EOF:
                return
            self.requests += 1
            reply = self.answer(doc)
            result = reply.get("result")
            fd = result.pop("_fd", None) if isinstance(result, dict) else None
            try:
                self.send(reply, fd)
            except OSError:
                return
            finally:
                if fd is not None:
                    os.close(fd)


def _bounded(value: Any) -> Any:
    """A shown argument as sent, or its size and digest when its JSON is longer than MAX_SHOWN bytes."""
    if isinstance(value, str | int | None) and (not isinstance(value, str) or len(value) <= MAX_SHOWN // 12):
        return value  # short enough whatever its escapes (at most 12 bytes a character)
    data = canonical(value)
    if len(data) <= MAX_SHOWN:
        return value
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class _Handler(socketserver.BaseRequestHandler):
    server: HelperServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        with contextlib.suppress(OSError):
            Connection(self.server.ctx, sock).serve()


class HelperServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 64

    def __init__(self, ctx: HelperContext, real_socket_path: str) -> None:
        self.ctx = ctx
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(real_socket_path)
        old = os.umask(0o177)
        try:
            super().__init__(real_socket_path, _Handler)
        finally:
            os.umask(old)
        os.chown(real_socket_path, 0, ctx.config.node_gid)
        os.chmod(real_socket_path, 0o660)

    # A connection of a non-root peer holds one of MAX_CONNECTIONS slots while its thread runs.

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            peer = peer_credentials(request)
        except OSError:
            self.shutdown_request(request)
            return
        counted = peer.uid != 0
        if counted and not self._slots.acquire(blocking=False):
            self._refuse_busy(request, peer)
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self._run, args=(request, client_address, counted), daemon=self.daemon_threads
        )
        try:
            thread.start()
        except BaseException:
            if counted:
                self._slots.release()
            self.shutdown_request(request)
            raise

    def _run(self, request: Any, client_address: Any, counted: bool) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            if counted:
                self._slots.release()

    def _refuse_busy(self, request: socket.socket, peer: Peer) -> None:
        message = f"more than {MAX_CONNECTIONS} connections at once: try again later"
        self.ctx.audit.record(
            peer_pid=peer.pid,
            peer_uid=peer.uid,
            op="(connect)",
            args={},
            args_sha256=hashlib.sha256(canonical({"op": "(connect)", "args": None})).hexdigest(),
            decision="refused",
            reason="busy",
            message=message,
            duration_ms=0.0,
        )
        with contextlib.suppress(OSError):
            request.settimeout(0)
            request.send(
                encode_frame({"ok": False, "error": "refused", "reason": "busy", "message": message})
            )


def node_group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
