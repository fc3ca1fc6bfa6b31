"""cloud-hypervisor's REST API on `instances/<id>/api.sock` (DLV-CH-02): h11 over a Unix socket.

One connection per request, closed after the answer: the VMM's API server is single-threaded, and a
fresh connection ties each request's file descriptors to that request. Tap fds travel with the request
that needs them (`vm.add-net`, `vm.restore`'s `net_fds`) as SCM_RIGHTS ancillary data on the first
`sendmsg` of that request, which is how the VMM receives them: fd numbers in a body are ignored
(DLV-CHU-04). httpx cannot send ancillary data, hence h11 (docs/instances.md).

The minimum VMM version is MIN_VERSION (v51: `image_type` and `backing_files` on disks; `vm.resize-disk`
since v50, `net_fds` on restore since v40). Every answer is bounded (MAX_BODY) and every call has a
deadline (`timeout_s`): a hung VMM is a RetryableError, never a hung pass.
"""

from __future__ import annotations

import array
import json
import socket
import time
from collections.abc import Sequence
from typing import Any

import h11

MIN_VERSION = (51, 0)
MAX_BODY = 4 << 20  # vm.info of a large VM is a few KiB; a snapshot config never comes back here
MAX_FDS = 16  # MAX_NICS taps at most on one request


class CHApiError(Exception):
    """The VMM answered with an error status, or the exchange itself failed (status 0)."""

    def __init__(self, endpoint: str, status: int, detail: str) -> None:
        super().__init__(f"cloud-hypervisor {endpoint}: {status or 'no answer'}: {detail[:300]}")
        self.endpoint = endpoint
        self.status = status
        self.detail = detail


def parse_version(text: str) -> tuple[int, int] | None:
    """`v51.1`, `v51.1-dirty`, `cloud-hypervisor v51.0` or `51.0` -> (51, 0); None when unreadable."""
    word = text.strip().split()[-1] if text.strip() else ""
    word = word.removeprefix("v").split("-", 1)[0]
    parts = word.split(".")
    if len(parts) < 2 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[0]), int(parts[1])


class CHApi:
    """A client of one VMM's API socket. Synchronous: the runtime runs in a worker thread."""

    def __init__(self, socket_path: str, timeout_s: float = 30.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    # -- the exchange ---------------------------------------------------------------------------

    def request(
        self, method: str, endpoint: str, body: Any = None, fds: Sequence[int] = ()
    ) -> tuple[int, Any]:
        """One request to `/api/v1/<endpoint>`; the status and the decoded JSON body (None if empty)."""
        if len(fds) > MAX_FDS:
            raise ValueError(f"at most {MAX_FDS} file descriptors on one request")
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        conn = h11.Connection(our_role=h11.CLIENT)
        headers = [("Host", "localhost"), ("Accept", "application/json")]
        if body is not None:
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
        elif method != "GET":
            headers.append(("Content-Length", "0"))
        data = conn.send(h11.Request(method=method, target=f"/api/v1/{endpoint}", headers=headers))
        data += conn.send(h11.Data(data=payload)) if payload else b""
        data += conn.send(h11.EndOfMessage())
        deadline = time.monotonic() + self.timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(self.socket_path)
            self._send(sock, data, fds)
            return self._answer(sock, conn, endpoint, deadline)
        except (OSError, h11.ProtocolError) as exc:
            raise CHApiError(endpoint, 0, str(exc)) from None
        finally:
            sock.close()

    @staticmethod
    def _send(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
        view = memoryview(data)
        if fds:
            # The fds ride on the first bytes of the request, which the VMM reads with recvmsg.
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            sent = sock.sendmsg([view], anc)
            view = view[sent:]
        while view:
            sent = sock.send(view)
            view = view[sent:]

    @staticmethod
    def _answer(sock: socket.socket, conn: h11.Connection, endpoint: str, deadline: float) -> tuple[int, Any]:
        status = 0
        reason = ""
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CHApiError(endpoint, 0, "timed out")
                sock.settimeout(left)
                conn.receive_data(sock.recv(65536))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                reason = event.reason.decode(errors="replace")
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    raise CHApiError(endpoint, status, f"answer larger than {MAX_BODY} bytes")
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise CHApiError(endpoint, status, "connection closed before the answer ended")
        text = bytes(body)
        if not 200 <= status < 300:
            raise CHApiError(endpoint, status, text.decode(errors="replace").strip() or reason)
        if not text.strip():
            return status, None
        try:
            return status, json.loads(text)
        except ValueError:
            raise CHApiError(endpoint, status, "the answer is not JSON") from None

    def _put(self, endpoint: str, body: Any = None, fds: Sequence[int] = ()) -> Any:
        return self.request("PUT", endpoint, body, fds)[1]

    # -- the endpoints bcd uses -----------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        out = self.request("GET", "vmm.ping")[1]
        if not isinstance(out, dict) or not isinstance(out.get("version"), str):
            raise CHApiError("vmm.ping", 200, "the answer names no version")
        return out

    def version(self) -> tuple[int, int] | None:
        return parse_version(str(self.ping()["version"]))

    def info(self) -> dict[str, Any]:
        out = self.request("GET", "vm.info")[1]
        if not isinstance(out, dict) or not isinstance(out.get("state"), str):
            raise CHApiError("vm.info", 200, "the answer names no state")
        return out

    def create(self, config: dict[str, Any]) -> None:
        self._put("vm.create", config)

    def boot(self) -> None:
        self._put("vm.boot")

    def pause(self) -> None:
        self._put("vm.pause")

    def resume(self) -> None:
        self._put("vm.resume")

    def power_button(self) -> None:
        self._put("vm.power-button")

    def shutdown(self) -> None:
        self._put("vm.shutdown")

    def vmm_shutdown(self) -> None:
        self._put("vmm.shutdown")

    def resize_balloon(self, desired_balloon: int) -> None:
        self._put("vm.resize", {"desired_balloon": desired_balloon})

    def resize_disk(self, disk_id: str, size: int) -> None:
        self._put("vm.resize-disk", {"id": disk_id, "desired_size": size})

    def add_disk(self, disk: dict[str, Any]) -> dict[str, Any]:
        out = self._put("vm.add-disk", disk)
        return out if isinstance(out, dict) else {}

    def remove_device(self, device_id: str) -> None:
        self._put("vm.remove-device", {"id": device_id})

    def add_net(self, net: dict[str, Any], tap_fd: int) -> dict[str, Any]:
        """Add a NIC whose tap is `tap_fd` (DLV-CHU-06): the body names no tap and no fd number."""
        body = {k: v for k, v in net.items() if k not in ("tap", "fds")}
        out = self._put("vm.add-net", body, fds=[tap_fd])
        return out if isinstance(out, dict) else {}

    def snapshot(self, destination_dir: str) -> None:
        self._put("vm.snapshot", {"destination_url": f"file://{destination_dir}"})

    def restore(self, source_dir: str, net_fds: Sequence[tuple[str, int]]) -> None:
        """Restore from `source_dir` with each NIC's new tap fd (DLV-CHU-07), in the order listed."""
        body: dict[str, Any] = {"source_url": f"file://{source_dir}", "prefault": False}
        if net_fds:
            body["net_fds"] = [{"id": nid, "num_fds": 1} for nid, _fd in net_fds]
        self._put("vm.restore", body, fds=[fd for _nid, fd in net_fds])
