"""Who holds GPUs on the Kubernetes side: the kubelet's pod-resources API and the host's pod processes.

The kubelet serves `v1.PodResourcesLister/List` (gRPC, k8s.io/kubelet/pkg/apis/podresources/v1) on a
Unix socket (`[devices] pod_resources_socket`, default /var/lib/kubelet/pod-resources/kubelet.sock).
This client speaks just that unary call over HTTP/2 (h2, already a dependency of grpclib) with a
blocking socket and a timeout, and decodes the response by hand:

    ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
    PodResources { string name = 1; string namespace = 2; repeated ContainerResources containers = 3; }
    ContainerResources { string name = 1; repeated ContainerDevices devices = 2; ... }
    ContainerDevices { string resource_name = 1; repeated string device_ids = 2; ... }

Fields it does not read (cpu_ids, memory, topology, dynamic_resources) are skipped by wire type.
Whole GPUs are also checked against the host's compute processes (`nvidia-smi
--query-compute-apps=gpu_uuid,pid`) whose cgroup lies under `kubepods` (Q-DEV-K8S-04). Anything
unreachable counts as "a pod holds the device" (DEV-K8S-07).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence

import h2.config
import h2.connection
import h2.events
from attrs import frozen
from bcd_shared import nvsmi
from bcd_shared.system import System

LIST_PATH = "/v1.PodResourcesLister/List"
BCD_RESOURCE_PREFIX = "bcd.dev/"


class PodResourcesError(Exception):
    """The kubelet's pod-resources API could not be asked (or answered nonsense)."""


@frozen
class PodDevices:
    pod: str
    namespace: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise PodResourcesError("truncated varint in the pod-resources answer")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int, bytes | int]]:
    """(field number, wire type, value) of a protobuf message: bytes for LEN, int for VARINT."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = _varint(data, pos)
            yield num, wt, v
        elif wt == 2:
            n, pos = _varint(data, pos)
            if pos + n > len(data):
                raise PodResourcesError("truncated field in the pod-resources answer")
            yield num, wt, data[pos : pos + n]
            pos += n
        elif wt == 1:
            pos += 8
        elif wt == 5:
            pos += 4
        else:
            raise PodResourcesError(f"wire type {wt} in the pod-resources answer")


def _s(v: bytes | int) -> str:
    if not isinstance(v, bytes):
        raise PodResourcesError("a string field is not length-delimited")
    return v.decode()


def decode_list_response(data: bytes) -> tuple[PodDevices, ...]:
    out: list[PodDevices] = []
    for num, _, pod in fields(data):
        if num != 1 or not isinstance(pod, bytes):
            continue
        name = ns = ""
        containers: list[bytes] = []
        for n, _, v in fields(pod):
            if n == 1:
                name = _s(v)
            elif n == 2:
                ns = _s(v)
            elif n == 3 and isinstance(v, bytes):
                containers.append(v)
        for c in containers:
            cname = ""
            devs: list[tuple[str, tuple[str, ...]]] = []
            for n, _, v in fields(c):
                if n == 1:
                    cname = _s(v)
                elif n == 2 and isinstance(v, bytes):
                    resource = ""
                    ids: list[str] = []
                    for dn, _, dv in fields(v):
                        if dn == 1:
                            resource = _s(dv)
                        elif dn == 2:
                            ids.append(_s(dv))
                    devs.append((resource, tuple(ids)))
            out.extend(PodDevices(name, ns, cname, r, ids) for r, ids in devs)
    return tuple(out)


class PodResourcesClient:
    """A blocking client for the kubelet's `List` call on its Unix socket."""

    def __init__(self, socket_path: str, timeout: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def list(self) -> tuple[PodDevices, ...]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(self.socket_path)
                return self._call(sock)
        except OSError as exc:
            raise PodResourcesError(f"pod-resources at {self.socket_path}: {exc}") from None

    def _call(self, sock: socket.socket) -> tuple[PodDevices, ...]:
        conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", LIST_PATH),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        conn.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)
        sock.sendall(conn.data_to_send())
        body = b""
        status: str | None = None
        message = ""
        ended = False
        while not ended:
            chunk = sock.recv(65536)
            if not chunk:
                raise PodResourcesError("the kubelet closed the connection")
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                    body += ev.data or b""
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif (
                    isinstance(ev, h2.events.ResponseReceived | h2.events.TrailersReceived)
                    and ev.stream_id == sid
                ):
                    for k, v in ev.headers or ():
                        key = k.decode() if isinstance(k, bytes) else k
                        val = v.decode() if isinstance(v, bytes) else v
                        if key == "grpc-status":
                            status = val
                        elif key == "grpc-message":
                            message = val
                elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                    ended = True
                elif isinstance(ev, h2.events.StreamReset | h2.events.ConnectionTerminated):
                    raise PodResourcesError("the kubelet reset the call")
            pending = conn.data_to_send()
            if pending:
                sock.sendall(pending)
        if status != "0":
            raise PodResourcesError(f"List answered grpc-status {status}: {message}")
        if len(body) < 5 or body[0] != 0:
            raise PodResourcesError("List answered no (uncompressed) message")
        length = int.from_bytes(body[1:5], "big")
        if len(body) != 5 + length:
            raise PodResourcesError("List's message length does not match its frame")
        return decode_list_response(body[5:])


def bcd_devices(pods: Sequence[PodDevices]) -> set[str]:
    """Device ids of bcd's resources that pods hold (as the device plugin advertised them)."""
    return {d for p in pods if p.resource_name.startswith(BCD_RESOURCE_PREFIX) for d in p.device_ids}


def gpus_with_pod_processes(system: System) -> set[str] | None:
    """GPU UUIDs running a compute process inside a Kubernetes pod's cgroup; None when unknown."""
    result = system.run(
        ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"], timeout=30
    )
    if result.returncode == 127:
        return set()
    if not result.ok:
        return None
    try:
        apps = nvsmi.compute_apps(nvsmi.parse_csv(result.stdout.decode(), ("gpu_uuid", "pid")))
    except nvsmi.NvsmiParseError:
        return None
    out: set[str] = set()
    for app in apps:
        cg = system.read_text(f"/proc/{app.pid}/cgroup") or ""
        if "kubepods" in cg:
            out.add(app.gpu_uuid)
    return out
