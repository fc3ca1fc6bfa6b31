"""What the hostile tests (test_hostile_*.py) share: raw frames, clients of another uid, and the check that
a hostile request changed nothing but one refused audit line, and left the helper serving.

A client of the node's uid is made by forking: the child changes into the socket's directory as root,
drops to the uid and group, connects by the relative name (pytest's tmp directories are 0700 root, so
no absolute path would reach the socket) and hands the connected socket back over a socketpair.
SO_PEERCRED keeps the credentials of the process that connected, so the helper sees that uid.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

from bcd_helper.audit import verify_chain
from bcd_shared import wire
from bcd_simhost import sim_system
from bcd_simhost.chapi import CH_BASE_SHA256
from helperproc import AUDIT_DIR, HelperProcess, base_config, make_root, tree
from intentkit import ControlPlane, instances_body, intent

NODE_UID = 4242  # helperproc.base_config's node uid and gid
NODE_GID = 4242
SIGNED_NODE = "node-hostile"  # SignedHost's node id
INJECTED = '\n{"decision":"accepted","op":"file.write","prev":"' + "0" * 64 + '","seq":1}\n'


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def connect(h: HelperProcess, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(h.socket_path)
    return s


def read_answer(s: socket.socket) -> dict[str, Any] | None:
    """The next answer on `s`, or None when the helper closed the connection first."""
    head = _exact(s, 4)
    if head is None:
        return None
    body = _exact(s, struct.unpack(">I", head)[0])
    return None if body is None else dict(json.loads(body))


def _exact(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def send_raw(h: HelperProcess, body: bytes) -> dict[str, Any] | None:
    """One framed body on a fresh connection; the answer (None: closed without one)."""
    with connect(h) as s:
        s.sendall(frame(body))
        return read_answer(s)


def audit_size(h: HelperProcess) -> int:
    return (h.root / AUDIT_DIR.lstrip("/") / "audit.log").stat().st_size


def assert_still_serving(h: HelperProcess) -> None:
    with connect(h) as s:
        s.sendall(frame(b'{"op":"helper.ping","args":{}}'))
        answer = read_answer(s)
    assert answer is not None and answer["ok"] is True, answer


def assert_refused_raw(
    h: HelperProcess, body: bytes, reason: str, text: str = "", op: str | None = None
) -> dict[str, Any]:
    """`body` (raw bytes, framed here) is refused for `reason`, audited as exactly one refused line with
    that reason, the tree under the root is byte-for-byte unchanged, the audit chain verifies, and the
    helper still serves another connection. With `op`, the audit line names that op. The answer."""
    before = tree(h.root)
    seq = h.last_audit()["seq"]
    answer = send_raw(h, body)
    assert answer is not None, "the helper closed the connection without an answer"
    assert (answer["ok"], answer["error"], answer["reason"]) == (False, "refused", reason), answer
    assert text in answer["message"], answer
    last = h.last_audit()
    assert (last["seq"], last["decision"], last["reason"]) == (seq + 1, "refused", reason), last
    assert op is None or last["op"] == op, last
    assert tree(h.root) == before
    assert_still_serving(h)
    assert verify_audit(h)
    return answer


def verify_audit(h: HelperProcess) -> bool:
    result = verify_chain(h.root / AUDIT_DIR.lstrip("/"))
    assert result.ok, result.problem
    return True


def connect_as(
    h: HelperProcess, uid: int, gid: int, creds: tuple[int, int, int] | None = None, payload: bytes = b""
) -> tuple[socket.socket, int]:
    """A socket connected to the helper by a process of `uid`/`gid` (see the module). With `creds`, the
    child sends `payload` with an SCM_CREDENTIALS message claiming (pid, uid, gid) (pid 0: its own) before
    handing the socket over. Returns the socket and the kernel's answer to that sendmsg (0, or its errno)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    directory, name = os.path.split(h.socket_path)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            parent.close()
            os.chdir(directory)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(name)
            status = 0
            if creds is not None:
                claimed = (creds[0] or os.getpid(), *creds[1:])  # pid 0: the child's own
                try:
                    s.sendmsg(
                        [payload],
                        [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("3i", *claimed))],
                    )
                except OSError as exc:
                    status = exc.errno or errno.EIO
            socket.send_fds(child, [bytes([status])], [s.fileno()])
            code = 0
        finally:
            os._exit(code)
    child.close()
    try:
        parent.settimeout(10)
        msg, fds, _flags, _addr = socket.recv_fds(parent, 1, 1)
    finally:
        parent.close()
        _pid, status = os.waitpid(pid, 0)
    assert status == 0 and len(fds) == 1, "the child could not connect"
    sock = socket.socket(fileno=fds[0])
    sock.settimeout(10)
    return sock, msg[0]


class NodeProcess:
    """A process of the node's uid, forked now, that connects and sends one request when `ask` is
    called, and reads the answer itself: the connecting process is alive while the helper serves it
    (root dates it by its pid for daemon.confirm, round 10), as the node's own process is. Forked
    before a swap, it is the old release's process (test_hostile_round10.py)."""

    def __init__(self, h: HelperProcess, uid: int = NODE_UID, gid: int = NODE_GID) -> None:
        self.parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        directory, name = os.path.split(h.socket_path)
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                self.parent.close()
                os.chdir(directory)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                doc = _until_eof(child)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(name)
                s.sendall(frame(doc))
                child.sendall(json.dumps(read_answer(s)).encode())
                code = 0
            finally:
                os._exit(code)
        child.close()
        self.parent.settimeout(60)

    def ask(self, doc: dict[str, Any]) -> dict[str, Any] | None:
        try:
            self.parent.sendall(json.dumps(doc).encode())
            self.parent.shutdown(socket.SHUT_WR)
            raw = _until_eof(self.parent)
        finally:
            self.parent.close()
            _pid, status = os.waitpid(self.pid, 0)
        assert status == 0, "the node's process could not connect or read the answer"
        answer = json.loads(raw)
        assert answer is None or isinstance(answer, dict)
        return answer


def _until_eof(s: socket.socket) -> bytes:
    chunks = []
    while chunk := s.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def as_node(h: HelperProcess, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` sent on a fresh connection by a process of the node's uid and group, which stays alive
    until it has read the answer; the answer."""
    answer = NodeProcess(h).ask(doc)
    assert answer is not None, "the helper closed the connection without an answer"
    return answer


def refused_as_node(h: HelperProcess, doc: dict[str, Any], reason: str, text: str = "") -> dict[str, Any]:
    """Sent as the node, `doc` is refused for `reason` (its message holding `text`), audited as the next
    line with the node's uid, and nothing under the root changed."""
    before = tree(h.root)
    seq = h.last_audit()["seq"]
    answer = as_node(h, doc)
    assert (answer["ok"], answer.get("reason")) == (False, reason), answer
    assert text in answer["message"], answer
    last = h.last_audit()
    assert (last["seq"], last["decision"], last["reason"], last["peer_uid"]) == (
        seq + 1,
        "refused",
        reason,
        NODE_UID,
    )
    assert tree(h.root) == before
    return answer


def gpus_by_bus(root: Path) -> dict[str, str]:
    """The simulated nvidia-smi's GPUs: sysfs address -> UUID."""
    out = sim_system(root).run(["nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"])
    return {
        b.strip()[-12:].lower(): u.strip()
        for u, b in (x.split(",") for x in out.stdout.decode().splitlines())
    }


def ch_instance(name: str, **fields: Any) -> wire.InstanceSpec:
    """A RUNNING cloud-hypervisor instance of the signed spec as bcd_simhost.chapi's `lay_out_instance`
    lays it out (2 vCPUs, 1 GiB, 10 GiB, its base image), one NIC on br0 unless `fields` say otherwise."""
    spec: dict[str, Any] = {
        "id": name,
        "allocation_id": f"alloc-{name}",
        "runtime": "cloud-hypervisor",
        "desired_state": wire.InstanceDesiredState(1),
        "size": wire.InstanceSize(vcpus=2, memory_bytes=1 << 30, disk_bytes=10 << 30),
        "image": wire.ImageRef(url="https://x.invalid/x.qcow2", sha256=CH_BASE_SHA256, format="qcow2"),
        "nics": [wire.Nic(bridge="br0", mac="52:54:00:00:00:01")],
    }
    return wire.InstanceSpec(**{**spec, **fields})


class SignedHost:
    """A simulated host under `parent` whose helper trusts `cp`'s command-signing roots (the join record
    of SIGNED_NODE written); `start` runs the real `bcd helper serve` over it (conftest's `signed_host`:
    one under /var/tmp, short for the VMM's socket paths, its helpers stopped at the test's end)."""

    def __init__(self, parent: Path) -> None:
        self.cp = ControlPlane.build()
        self.root = make_root(parent)
        self.cp.write_record(self.root, SIGNED_NODE, self.cp.bundle(1))
        self.helpers: list[HelperProcess] = []

    def start(self, *, netns: bool = False) -> HelperProcess:
        """The helper, bridge br0 allowed (`netns`: in a network namespace of its own)."""
        config = self.cp.config_lines() + base_config(extra='instance_bridges = "br0"\n')
        self.helpers.append(HelperProcess(self.root, config, netns=netns))
        return self.helpers[-1]

    def signed(self, generation: int, *instances: wire.InstanceSpec) -> dict[str, Any]:
        """An `intent` argument: the full spec of `instances` at `generation`, signed by a command leaf."""
        return intent(self.cp.command.leaf(), instances_body(SIGNED_NODE, generation, *instances))


class LibvirtVm:
    """An instance the node's libvirt runtime laid out on a signed host's simulated root (its overlay, its
    seed, the definition it would define: `xml`; nothing run), and that instance as a signed spec gives it:
    where the libvirt red-team rounds start."""

    GIB = 1 << 30
    MAC, URL = "52:54:00:00:00:01", "https://images.sim.bcd/debian.qcow2"

    def __init__(self, host: SignedHost, ident: str, allocation: str, placement: Any = None) -> None:
        """`placement`: the agent model's Placement the node's runtime builds the definition with."""
        from bcd_agent.sections.instances.model import Image, InstanceSpec, Nic
        from bcd_agent.sections.instances.runtimes.base import Prepared
        from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime
        from bcd_shared.system import CommandResult
        from bcd_simhost.libvirt import IMAGE_SHA256

        self.host, self.ident, self.allocation, self.sha256 = host, ident, allocation, IMAGE_SHA256
        kept: list[bytes] = []

        class Keep:  # the runtime's virsh: keeps the definition, runs nothing
            def read(self, *args: str) -> CommandResult:
                return CommandResult(args, 0, b"shut off\n")

            def define(self, name: str, xml: bytes, xml_path: str) -> None:
                kept.append(xml)

            def act(self, verb: str, name: str, *args: str) -> CommandResult:
                return CommandResult((verb,), 0)

        inst = InstanceSpec(
            id=ident, allocation_id=allocation, vcpus=2, memory_bytes=self.GIB, disk_bytes=10 * self.GIB,
            image=Image(self.URL, IMAGE_SHA256, "qcow2"), nics=(Nic("br0", self.MAC),), placement=placement,
        )  # fmt: skip
        LibvirtRuntime(sim_system(host.root), Keep(), "/var/lib/bcd", under_helper=True).create(
            inst, Prepared()
        )
        self.xml = kept[-1].decode()

    def spec(self, state: int = 1, runtime: str = "libvirt-kvm") -> wire.InstanceSpec:
        """The instance in a spec: `state` an InstanceDesiredState number (1 RUNNING, 2 PAUSED, 3 STOPPED)."""
        return wire.InstanceSpec(
            id=self.ident, allocation_id=self.allocation, runtime=runtime,
            desired_state=wire.InstanceDesiredState(state),
            size=wire.InstanceSize(vcpus=2, memory_bytes=self.GIB, disk_bytes=10 * self.GIB),
            image=wire.ImageRef(url=self.URL, sha256=self.sha256, format="qcow2"),
            nics=[wire.Nic(bridge="br0", mac=self.MAC)],
        )  # fmt: skip

    def signed(self, generation: int, state: int = 1) -> dict[str, Any]:
        """An `intent`: the spec of this instance alone at `generation`."""
        return self.host.signed(generation, self.spec(state))


def vm_hwm_kib(pid: int) -> int:
    """A process's peak resident memory (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")
