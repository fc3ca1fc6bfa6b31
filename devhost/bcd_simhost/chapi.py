"""A stand-in for cloud-hypervisor's REST API server (v51, the runtime's minimum), on a Unix socket.

No cloud-hypervisor can be installed on the development hosts (docs/instances.md), so the runtime's
client and the bench talk to this one. It follows the VMM where bcd depends on it:

- HTTP/1.1 on `/api/v1/<endpoint>`; `vmm.ping`, `vm.create`, `vm.boot`, `vm.pause`, `vm.resume`,
  `vm.power-button`, `vm.shutdown`, `vmm.shutdown`, `vm.info`, `vm.resize`, `vm.add-disk`,
  `vm.remove-device`, `vm.add-net`, `vm.snapshot`, `vm.restore` and `vm.resize-disk` (the shapes of
  vmm/src/api/openapi/cloud-hypervisor.yaml at v51.0); 204 for an action, 200 with JSON for an answer,
  500 with a message for a refused one, 404 for an unknown endpoint;
- file descriptors only through SCM_RIGHTS on the request's connection: a `fds` or `tap` field in a
  body is ignored (recorded in `ignored_fields`), as the VMM ignores it. Every received fd is checked
  by fstat (a character device, /dev/net/tun's 10:200) and TUNGETIFF (a tap, not a tun); its
  interface name is recorded in `nets` (`net_fds` of a restore likewise);
- the states Created, Running, Paused, Shutdown; a snapshot only while Paused, writing `config.json`,
  `state.json` and `memory-ranges` into the destination directory; a restore only before a create.

`guest_acpi` says whether the simulated guest honours the ACPI power button (it then shuts down);
`guest_rebind` whether it answers an identity-rebind disk (serial `bc-rebind`) hot-added by
`vm.add-disk`: it reads the disk's tar and writes `BCREBOUND <nonce>` into its answer area, as the
published guest script does (False: a silent guest).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import socket
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import h11

VERSION = "v51.1"
TUNGETIFF = 0x800454D2
IFF_TAP = 0x0002
TUN_MAJOR, TUN_MINOR = 10, 200
ACTIONS = {
    "vm.create",
    "vm.boot",
    "vm.pause",
    "vm.resume",
    "vm.power-button",
    "vm.shutdown",
    "vmm.shutdown",
    "vm.resize",
    "vm.add-disk",
    "vm.remove-device",
    "vm.add-net",
    "vm.snapshot",
    "vm.restore",
    "vm.resize-disk",
}


class Refuse(Exception):
    pass


def tap_name_of(fd: int) -> str:
    """The interface name of a tap fd, or Refuse: what the server checks of each received fd."""
    st = os.fstat(fd)
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (TUN_MAJOR, TUN_MINOR):
        raise Refuse(f"fd is not /dev/net/tun (mode {st.st_mode:o}, rdev {st.st_rdev:#x})")
    buf = bytearray(40)
    try:
        fcntl.ioctl(fd, TUNGETIFF, buf)
    except OSError as exc:
        raise Refuse(f"fd is not an attached tap: {exc.strerror}") from None
    name, flags = struct.unpack("16sH", bytes(buf[:18]))
    if not flags & IFF_TAP:
        raise Refuse("fd is a tun, not a tap")
    tap: str = name.rstrip(b"\0").decode()
    return tap


class FakeCHServer:
    def __init__(
        self,
        socket_path: str | Path,
        *,
        guest_acpi: bool = True,
        mode: int | None = None,
        boot_error: str = "",
        root: Path | None = None,
    ) -> None:
        self.path = str(socket_path)
        self.root = root  # the simulated host the VMM's paths are under (None: this machine's /)
        self.guest_acpi = guest_acpi
        self.guest_rebind = True
        self.boot_error = boot_error  # vm.boot answers 500 with it (e.g. the KVM's "Cannot allocate memory")
        self.state = ""  # "" before vm.create
        self.config: dict[str, Any] = {}
        self.balloon = 0
        self.nets: list[dict[str, Any]] = []  # each with "tap": the name read from the received fd
        self.disks: list[dict[str, Any]] = []
        self.requests: list[tuple[str, Any, int]] = []  # (endpoint, body, number of fds received)
        self.ignored_fields: list[str] = []
        self.vmm_up = True
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind(self.path)
        if mode is not None:  # as the VMM's unit leaves it (UMask 0007: 0770)
            os.chmod(self.path, mode)
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fake-ch")
        self._thread.start()

    def close(self) -> None:
        self.vmm_up = False
        # accept() is not woken by closing the socket: a connection wakes it, and the loop ends.
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as poke:
            poke.settimeout(1)
            poke.connect(self.path)
        self._thread.join(5)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> FakeCHServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ----------------------------------------------------------------------------

    def _serve(self) -> None:
        while self.vmm_up:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                if not self.vmm_up:  # the poke of close()
                    return
                self._one(conn)

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        h = h11.Connection(our_role=h11.SERVER)
        fds: list[int] = []
        body = bytearray()
        request: h11.Request | None = None
        try:
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    data, anc, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
                    for level, kind, raw in anc:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            arr = array.array("i")
                            arr.frombytes(raw[: len(raw) - len(raw) % arr.itemsize])
                            fds.extend(arr)
                    h.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            if request is None:
                return
            status, answer = self._dispatch(request, bytes(body), fds)
        finally:
            for fd in fds:
                os.close(fd)
        payload = (
            b"" if answer is None else (answer if isinstance(answer, bytes) else json.dumps(answer).encode())
        )
        headers = [("Content-Length", str(len(payload)))]
        if payload and not isinstance(answer, bytes):
            headers.append(("Content-Type", "application/json"))
        out = h.send(h11.Response(status_code=status, headers=headers))
        out += h.send(h11.Data(data=payload)) if payload else b""
        out += h.send(h11.EndOfMessage())
        conn.sendall(out)
        if request.target == b"/api/v1/vmm.shutdown" and status == 204:
            self.vmm_up = False
            self._sock.close()

    def _dispatch(self, req: h11.Request, body: bytes, fds: list[int]) -> tuple[int, Any]:
        target = req.target.decode()
        if not target.startswith("/api/v1/"):
            return 404, b"not found"
        endpoint = target[len("/api/v1/") :]
        try:
            doc = json.loads(body) if body.strip() else None
        except ValueError:
            return 400, b"body is not JSON"
        with self._lock:
            self.requests.append((endpoint, doc, len(fds)))
            method = req.method.decode()
            if endpoint in ("vmm.ping", "vm.info"):
                if method != "GET":
                    return 405, b"method not allowed"
            elif endpoint in ACTIONS:
                if method != "PUT":
                    return 405, b"method not allowed"
            else:
                return 404, b"no such endpoint"
            try:
                return self._handle(endpoint, doc, fds)
            except Refuse as exc:
                return 500, str(exc).encode()

    # -- the VMM ------------------------------------------------------------------------------

    def _host(self, path: str) -> str:
        return str(self.root / path.lstrip("/")) if self.root is not None and path.startswith("/") else path

    def _need(self, *states: str) -> None:
        if self.state not in states:
            raise Refuse(f"VM is in state {self.state or 'not created'}, needs {' or '.join(states)}")

    def _ignore_fds(self, doc: Any, where: str) -> None:
        if isinstance(doc, dict):
            for key in ("fds", "tap"):
                if key in doc:
                    self.ignored_fields.append(f"{where}.{key}")

    def _handle(self, endpoint: str, doc: Any, fds: list[int]) -> tuple[int, Any]:
        if endpoint == "vmm.ping":
            return 200, {
                "build_version": VERSION,
                "version": VERSION,
                "pid": os.getpid(),
                "features": ["kvm"],
            }
        if endpoint == "vm.info":
            self._need("Created", "Running", "Paused", "Shutdown")
            config = dict(self.config, net=[dict(n) for n in self.nets], disks=list(self.disks))
            if "balloon" in config:
                config["balloon"] = dict(config["balloon"], size=self.balloon)
            mem = int(self.config.get("memory", {}).get("size", 0))
            return 200, {"config": config, "state": self.state, "memory_actual_size": mem - self.balloon}
        if fds and endpoint not in ("vm.add-net", "vm.restore"):
            raise Refuse(f"{endpoint} takes no file descriptors")
        if endpoint == "vm.create":
            self._need("")
            if not isinstance(doc, dict) or "payload" not in doc or "cpus" not in doc or "memory" not in doc:
                raise Refuse("vm.create needs payload, cpus and memory")
            for net in doc.get("net") or []:
                self._ignore_fds(net, "vm.create.net")
                raise Refuse("a NIC in vm.create names a tap the VMM would open itself")
            self.config = dict(doc)
            self.disks = list(doc.get("disks") or [])
            self.balloon = int((doc.get("balloon") or {}).get("size", 0))
            self.state = "Created"
        elif endpoint == "vm.boot":
            self._need("Created")
            if self.boot_error:
                raise Refuse(self.boot_error)
            self.state = "Running"
        elif endpoint == "vm.pause":
            self._need("Running")
            self.state = "Paused"
        elif endpoint == "vm.resume":
            self._need("Paused")
            self.state = "Running"
        elif endpoint == "vm.power-button":
            self._need("Running")
            if self.guest_acpi:
                self.state = "Shutdown"
        elif endpoint == "vm.shutdown":
            self._need("Running", "Paused", "Created", "Shutdown")
            self.state = "Shutdown"
        elif endpoint == "vmm.shutdown":
            pass
        elif endpoint == "vm.resize":
            self._need("Running", "Paused")
            size = (doc or {}).get("desired_balloon")
            if "balloon" not in self.config:
                raise Refuse("no balloon device")
            if not isinstance(size, int) or not 0 <= size <= int(self.config["memory"]["size"]):
                raise Refuse("desired_balloon outside the memory")
            self.balloon = size
        elif endpoint == "vm.add-disk":
            self._need("Running", "Paused")
            if not isinstance(doc, dict) or not os.path.exists(self._host(str(doc.get("path", "")))):
                raise Refuse(f"cannot open disk {doc.get('path') if isinstance(doc, dict) else None!r}")
            disk = dict(doc)
            disk.setdefault("id", f"_disk{len(self.disks)}")
            if any(d.get("id") == disk["id"] for d in self.disks):
                raise Refuse(f"device id {disk['id']} in use")
            self.disks.append(disk)
            if disk.get("serial") == "bc-rebind" and self.guest_rebind:
                from .libvirt import _rebind_guest

                _rebind_guest(Path(self._host(str(disk["path"]))))
            return 200, {"id": disk["id"], "bdf": f"0000:00:{5 + len(self.disks):02x}.0"}
        elif endpoint == "vm.remove-device":
            self._need("Running", "Paused")
            did = (doc or {}).get("id")
            kept = [d for d in self.disks if d.get("id") != did]
            if len(kept) == len(self.disks):
                raise Refuse(f"no device {did!r}")
            self.disks = kept
        elif endpoint == "vm.resize-disk":
            self._need("Running", "Paused")
            did, size = (doc or {}).get("id"), (doc or {}).get("desired_size")
            target: dict[str, Any] | None = next((d for d in self.disks if d.get("id") == did), None)
            if target is None or not isinstance(size, int) or size <= 0:
                raise Refuse(f"cannot resize {did!r}")
            target["size"] = size
        elif endpoint == "vm.add-net":
            self._need("Created", "Running", "Paused")
            self._ignore_fds(doc, "vm.add-net")
            if len(fds) != 1:
                raise Refuse(f"vm.add-net needs exactly one tap fd by SCM_RIGHTS, got {len(fds)}")
            net = {k: v for k, v in (doc or {}).items() if k not in ("fds", "tap")}
            net.setdefault("id", f"_net{len(self.nets)}")
            net["tap"] = tap_name_of(fds[0])
            self.nets.append(net)
            return 200, {"id": net["id"], "bdf": f"0000:00:{0x10 + len(self.nets):02x}.0"}
        elif endpoint == "vm.snapshot":
            self._need("Paused")
            dest = str((doc or {}).get("destination_url", ""))
            if not dest.startswith("file://") or not os.path.isdir(self._host(dest[7:])):
                raise Refuse(f"bad destination {dest!r}")
            d = Path(self._host(dest[7:]))
            config = dict(self.config, net=[{k: v for k, v in n.items() if k != "tap"} for n in self.nets])
            config["disks"] = list(self.disks)
            if "balloon" in config:
                config["balloon"] = dict(config["balloon"], size=self.balloon)
            (d / "config.json").write_text(json.dumps(config))
            (d / "state.json").write_text(json.dumps({"vm": "state"}))
            (d / "memory-ranges").write_bytes(b"\0" * 64)
        elif endpoint == "vm.restore":
            self._need("")
            src = str((doc or {}).get("source_url", ""))
            if not src.startswith("file://") or not os.path.isfile(
                os.path.join(self._host(src[7:]), "config.json")
            ):
                raise Refuse(f"bad source {src!r}")
            config = json.loads(Path(self._host(src[7:]), "config.json").read_text())
            wanted = (doc or {}).get("net_fds") or []
            if sum(int(n.get("num_fds", 0)) for n in wanted) != len(fds):
                raise Refuse(f"net_fds name {len(wanted)} NICs but {len(fds)} fds came by SCM_RIGHTS")
            ids = [n.get("id") for n in config.get("net") or []]
            if sorted(str(n.get("id")) for n in wanted) != sorted(str(i) for i in ids):
                raise Refuse("net_fds must name every NIC of the snapshot")
            by_id = {n.get("id"): fd for n, fd in zip(wanted, fds, strict=True)}
            self.nets = [dict(n, tap=tap_name_of(by_id[n.get("id")])) for n in config.get("net") or []]
            self.config = {k: v for k, v in config.items() if k != "net"}
            self.disks = list(config.get("disks") or [])
            self.balloon = int((config.get("balloon") or {}).get("size", 0))
            self.state = "Paused"
        return 204, None


CH_DATA = "/var/lib/bcd"
CH_BASE_SHA256 = "d" * 64  # a name only: the download checked the digest, root checks the header


def lay_out_instance(
    root: Path,
    name: str,
    node_uid: int,
    vmm_uid: int,
    *,
    volumes: tuple[tuple[str, bool], ...] = (),
    gpus: tuple[str, ...] = (),
) -> Path:
    """A cloud-hypervisor instance's files on the simulated host as the node's runtime leaves them
    under the helper: directories the node's (searchable), a qcow2 base in `images/`, the overlay
    naming it, the seed, `vm.json` (bcd_shared.chrecord) naming `volumes` ((file, read_only) in the
    volume store, created when missing), and root's own /usr/bin/cloud-hypervisor stand-in."""
    from bcd_shared.chrecord import CHNic, CHRecord, CHVolume, encode_record
    from bcd_shared.chunit import ch_dir

    from .libvirt import qcow2_bytes

    def node_dir(p: Path, mode: int) -> None:
        p.mkdir(parents=True, exist_ok=True)
        os.chown(p, node_uid, node_uid)
        os.chmod(p, mode)

    def node_file(p: Path, data: bytes, mode: int = 0o600) -> None:
        p.write_bytes(data)
        os.chown(p, node_uid, node_uid)
        os.chmod(p, mode)

    data = root / CH_DATA.lstrip("/")
    chd = root / ch_dir(CH_DATA).lstrip("/")
    for d in (root / "var", root / "var/lib"):
        d.mkdir(parents=True, exist_ok=True)
    for d in (data, chd, chd / "instances", data / "volumes"):
        node_dir(d, 0o711)
    node_dir(chd / "images", 0o700)
    base = f"{ch_dir(CH_DATA)}/images/{CH_BASE_SHA256}.qcow2"
    if not (root / base.lstrip("/")).exists():
        node_file(root / base.lstrip("/"), qcow2_bytes(1 << 30), 0o644)
    inst = chd / "instances" / name
    node_dir(inst, 0o700)
    node_file(inst / "disk.qcow2", qcow2_bytes(1 << 30, base, "qcow2"))
    node_file(inst / "seed.iso", b"\0" * 2048)
    for vol, _ro in volumes:
        if not (data / "volumes" / vol).exists():
            node_file(data / "volumes" / vol, b"v" * 512)
    rec = CHRecord(
        name=name,
        allocation_id=f"alloc-{name}",
        uid=vmm_uid,
        vcpus=2,
        memory_bytes=1 << 30,
        image_sha256=CH_BASE_SHA256,
        image_format="qcow2",
        seed=True,
        nics=(CHNic("52:54:00:00:00:01", "br0"),),
        gpus=gpus,
        volumes=tuple(CHVolume(v, ro, f"vol{i}") for i, (v, ro) in enumerate(volumes)),
        hugepages=False,
        cpus="",
        mems="",
        restored=False,
        config={"cpus": {"boot_vcpus": 2, "max_vcpus": 2}},
    )
    node_file(inst / "vm.json", encode_record(rec))
    binary = root / "usr/bin/cloud-hypervisor"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text("#!/bin/sh\nexit 0\n")
        os.chmod(binary, 0o755)  # noqa: S103 (a program root runs)
    return inst
