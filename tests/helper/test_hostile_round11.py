"""Red team round 11 (docs/helper.md, "Threat model, round 11"): the node's account, compromised, as a real
unprivileged client (a forked child dropped to the node's uid: SO_PEERCRED sees that uid and its pid)
against a real `bcd helper serve` over a simulated host. Each test of a fix failed on the code before it."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper import server
from bcd_helper.audit import verify_chain
from bcd_helper.ops import daemon
from bcd_helper.ops.base import Call, Deadline, Peer
from bcd_shared import wire
from helperproc import AUDIT_DIR, HelperProcess, base_config, make_root, require_netns
from hostilekit import (
    NODE_GID,
    NODE_UID,
    SIGNED_NODE,
    SignedHost,
    as_node,
    assert_refused_raw,
    connect_as,
    frame,
    read_answer,
    refused_as_node,
)
from intentkit import ControlPlane, host_body, intent
from releasekit import RECORD, old_release_host, staged_swap

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"
CONFIRM = {"op": "daemon.confirm", "args": {"version": "1.1.0", "healthy": True}}
NEW = b"#!/bin/sh\necho bcd 1.1.0\n"


def _connected_by_a_node_process(h: HelperProcess, *, reap: bool = True) -> tuple[socket.socket, int]:
    """A socket connected to the helper by a child of the node's uid that exits at once after its
    connect: the socket stays here (the connecting process handed it on). The socket and that child's
    pid (reaped with `reap`, else left a zombie until the caller reaps it)."""
    directory, name = os.path.split(h.socket_path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.chdir(directory)
            os.setgroups([])
            os.setgid(NODE_GID)
            os.setuid(NODE_UID)
            s.connect(name)
            code = 0
        finally:
            os._exit(code)
    if reap:
        _pid, status = os.waitpid(pid, 0)
        assert status == 0, "the node's process could not connect"
    s.settimeout(10)
    return s, pid


@contextlib.contextmanager
def _a_process_with_pid(pid: int) -> Iterator[int | None]:
    """A live child (it waits until the block ends) forked now with `pid`, which is free: the kernel's
    next pid is set through ns_last_pid (root) right before each fork. None when another process of the
    machine took the pid first in every try."""
    for _ in range(200):
        with open(NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        os.close(r)
        if child == pid:
            try:
                yield child
            finally:
                os.close(w)
                os.waitpid(child, 0)
            return
        os.close(w)
        os.waitpid(child, 0)
    yield None


def _ask(s: socket.socket, doc: dict[str, Any]) -> dict[str, Any]:
    s.sendall(frame(json.dumps(doc).encode()))
    answer = read_answer(s)
    assert answer is not None, "the helper closed the connection without an answer"
    return answer


def test_round11_a_confirm_on_a_socket_whose_connecting_process_exited_and_whose_pid_was_reused_is_refused(
    fresh_root: Path, cp: ControlPlane
) -> None:
    """DLV-PRIV-10. Round 10's open SO_PEERCRED row: a process of the old release (started before the
    flip) connects, hands its socket on and exits; after the swap a new process takes its pid. Root dated
    the confirmation by /proc/PID/stat of that pid, the new process's start, after the flip: the old
    release's confirmation was taken (`ok`). Now root pins the connecting process with SO_PEERPIDFD and,
    after reading its start, checks on the pidfd that it has not exited: `peer-gone`, the record still
    pending; the restarted node (a live process on its own connection) still confirms."""
    h = old_release_host(fresh_root, cp)
    try:
        s, old = _connected_by_a_node_process(h)  # before the swap: the old release's process
        assert as_node(h, staged_swap(cp.command.leaf(), fresh_root, NEW + os.urandom(16)))["ok"] is True
        with s, _a_process_with_pid(old) as taker:
            if taker is None:
                pytest.skip(f"pid {old} was taken by another process each time")
            answer = _ask(s, CONFIRM)
        assert (answer["ok"], answer.get("reason")) == (False, "peer-gone"), answer
        assert f"pid {old}" in answer["message"] and "exited" in answer["message"], answer
        assert json.loads((fresh_root / RECORD).read_text())["state"] == "pending"
        last = h.last_audit()
        assert (last["decision"], last["reason"], last["peer_pid"]) == ("refused", "peer-gone", old)
        assert as_node(h, CONFIRM)["ok"] is True
        assert json.loads((fresh_root / RECORD).read_text())["state"] == "confirmed"
    finally:
        h.stop()


def test_round11_a_confirm_from_a_connecting_process_that_is_a_zombie_is_refused(
    fresh_root: Path, cp: ControlPlane
) -> None:
    """The connecting process exited but is not reaped (its pid still its own): `peer-gone` too, not a
    date read from a zombie's stat."""
    h = old_release_host(fresh_root, cp)
    try:
        assert as_node(h, staged_swap(cp.command.leaf(), fresh_root, NEW + os.urandom(16)))["ok"] is True
        s, child = _connected_by_a_node_process(h, reap=False)  # after the flip: its start would pass
        try:
            # Until the child has exited (a zombie: its pid still held). By time, not by a count of
            # yields: on a loaded machine 500 yields ended before the child's exit, and the confirm of a
            # live peer is rightly taken.
            deadline = time.monotonic() + 30
            while True:
                with open(f"/proc/{child}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                        break
                assert time.monotonic() < deadline, "the node's process did not exit"
                time.sleep(0.001)
            with s:
                answer = _ask(s, CONFIRM)
        finally:
            os.waitpid(child, 0)
        assert (answer["ok"], answer.get("reason")) == (False, "peer-gone"), answer
        assert json.loads((fresh_root / RECORD).read_text())["state"] == "pending"
    finally:
        h.stop()


class _Sock:
    def __init__(self, err: int | None, value: int = 0) -> None:
        self.err, self.value = err, value

    def getsockopt(self, level: int, option: int) -> int:
        assert (level, option) == (socket.SOL_SOCKET, server.SO_PEERPIDFD)
        if self.err is not None:
            raise OSError(self.err, os.strerror(self.err))
        return self.value


def test_round11_without_so_peerpidfd_the_peer_is_dated_by_its_pid_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fallback on a kernel without SO_PEERPIDFD (before Linux 6.5: ENOPROTOOPT): no pidfd, and the
    confirmation is dated by SO_PEERCRED's pid as in round 10. Any other error of the kernel (a kernel
    before 6.16 gives no pidfd for a peer already reaped) is `peer-gone`."""
    assert server.peer_pidfd(_Sock(errno.ENOPROTOOPT)) is None  # type: ignore[arg-type]
    with pytest.raises(OSError):
        server.peer_pidfd(_Sock(errno.ESRCH))  # type: ignore[arg-type]
    monkeypatch.setattr(daemon, "boot_id", lambda: "A")
    doc = {"state": "pending", "version": "1.1.0", "flip_tick": 100, "flip_boot_id": "A"}

    def call(pidfd: Any) -> Call:
        return Call(None, Peer(12345, NODE_UID, NODE_GID), Deadline(60), None, peer_pidfd=pidfd)  # type: ignore[arg-type]

    monkeypatch.setattr(daemon, "start_tick", lambda _pid: 101)
    daemon._check_peer_started_after_flip(call(lambda: server.peer_pidfd(_Sock(errno.ENOPROTOOPT))), doc)
    daemon._check_peer_started_after_flip(call(None), doc)  # in process: no socket
    monkeypatch.setattr(daemon, "start_tick", lambda _pid: 100)
    with pytest.raises(daemon.Refused) as exc:
        daemon._check_peer_started_after_flip(call(lambda: None), doc)
    assert exc.value.reason == "peer-predates-swap"
    monkeypatch.setattr(daemon, "start_tick", lambda _pid: 101)
    with pytest.raises(daemon.Refused) as exc:
        daemon._check_peer_started_after_flip(call(lambda: server.peer_pidfd(_Sock(errno.ESRCH))), doc)
    assert exc.value.reason == "peer-gone"


def test_round11_a_live_peers_pidfd_passes_and_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process, a live process's pidfd (this one's): the start read stands, and the pidfd is closed."""
    monkeypatch.setattr(daemon, "boot_id", lambda: "A")
    monkeypatch.setattr(daemon, "start_tick", lambda _pid: 101)
    doc = {"state": "pending", "version": "1.1.0", "flip_tick": 100, "flip_boot_id": "A"}
    fds: list[int] = []

    def pidfd() -> int:
        fds.append(os.pidfd_open(os.getpid()))
        return fds[-1]

    c = Call(None, Peer(os.getpid(), NODE_UID, NODE_GID), Deadline(60), None, peer_pidfd=pidfd)  # type: ignore[arg-type]
    daemon._check_peer_started_after_flip(c, doc)
    with pytest.raises(OSError):
        os.fstat(fds[0])


def _lines_after(h: HelperProcess, seq: int) -> list[bytes]:
    path = h.root / AUDIT_DIR.lstrip("/") / "audit.log"
    lines = path.read_bytes().rstrip(b"\n").split(b"\n")
    return [line for line in lines if json.loads(line)["seq"] > seq]


def _rfc8259(line: bytes) -> Any:
    """The line as a strict JSON parser reads it (Go's encoding/json, serde_json, jq 1.7's --seq, a SIEM):
    `Infinity` and `NaN` are not JSON numbers."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize(
    "body",
    [
        b'{"op":"libvirt.setmem","args":{"name":"vm1","kib":1e309}}',
        b'{"op":"libvirt.setmem","args":{"name":"vm1","kib":-1e400}}',
        b'{"op":"file.write","args":{"kind":"cdi","id":[1e309],"content":""}}',
        b'{"op":"daemon.confirm","args":{"version":{"a":[1E999]}}}',
    ],
)
def test_round11_a_number_past_a_double_never_makes_an_audit_line_invalid_json(
    helper: HelperProcess, body: bytes
) -> None:
    """NaN and Infinity are refused as JSON literals, but `1e309` is a JSON number Python reads as inf:
    in a shown argument of a refused request it went into the audit line as `Infinity` (Python's encoder
    writes it), which no strict JSON reader takes (RFC 8259 has no Infinity): the node made its own line
    unreadable to a log shipper or SIEM that parses JSON, while root's `audit verify` (Python) passed it.
    Now a non-finite number is shown as its size and digest (`bytes: -1`), like an unprintable integer."""
    seq = helper.last_audit()["seq"]
    assert_refused_raw(helper, body, "bad-arguments")
    refused = _lines_after(helper, seq)[0]
    assert b"Infinity" not in refused, refused
    entry = _rfc8259(refused)
    assert (entry["decision"], entry["reason"]) == ("refused", "bad-arguments")


@pytest.fixture
def netns() -> None:
    """Before `signed_host`: skip (or fail under CI) without root, nft and nsenter."""
    require_netns("nft")


def test_round11_nft_apply_under_a_patch_that_sets_no_instances_is_refused(
    netns: None, signed_host: SignedHost
) -> None:
    """With command-signing roots, root derives every kept instance's NIC policies from the signed spec's
    instances section (round 4, row 19). A signed *patch* replaces only the sections it sets: one that
    sets only the host section says nothing about the instances, yet nft.apply read it as "no
    instances" and took any policy as sent: vm1, PRIVATE under the full spec of generation 2, was loaded
    EGRESS (or with no guard at all) under a generation-3 host-only patch. host.unit, the holds and
    access.apply already refuse a patch that does not set their section (`bad-intent`); nft.apply now
    does too. A full spec without instances still means none are kept (taken as before)."""
    h = signed_host.start(netns=True)
    h.in_netns("ip", "link", "add", "br0", "type", "bridge")
    mac, addr = "52:54:00:00:00:01", "10.0.0.5/24"
    vm1 = wire.InstanceSpec(
        id="vm1", allocation_id="a1", runtime="libvirt-kvm", desired_state=wire.InstanceDesiredState(1),
        nics=[wire.Nic(bridge="br0", mac=mac, addresses=[addr])],
        network_policy=wire.NetworkPolicy(2), ssh_from_host_only=True,
    )  # fmt: skip
    nic = {
        "instance": "vm1", "index": 0, "bridge": "br0", "mac": mac, "addresses": [addr],
        "policy": "PRIVATE", "ssh_from_host_only": True,
    }  # fmt: skip
    egress = {**nic, "policy": "EGRESS", "ssh_from_host_only": False}
    leaf = signed_host.cp.command.leaf()
    assert as_node(h, {"op": "nft.apply", "args": {"nics": [nic], "intent": signed_host.signed(2, vm1)}})[
        "ok"
    ]
    patch = intent(leaf, host_body(SIGNED_NODE, 3, {}, patch=True))  # sets the host section only
    for nics in ([egress], []):
        refused_as_node(
            h, {"op": "nft.apply", "args": {"nics": nics, "intent": patch}}, "bad-intent", "instances"
        )
    # A full spec of generation 3 that keeps no instance: vm1's entry is a deleted one's guard, as sent.
    full = intent(leaf, host_body(SIGNED_NODE, 3, {}))
    assert as_node(h, {"op": "nft.apply", "args": {"nics": [egress], "intent": full}})["ok"] is True


def _flood(h: HelperProcess, bodies: list[bytes], seconds: float = 0.0) -> dict[str, int]:
    """Each of `bodies` (raw frames' bodies) sent on one connection of the node's uid, the whole list again
    until `seconds` have passed (once at least); the answers counted by outcome."""
    sock, _ = connect_as(h, NODE_UID, NODE_GID)
    out: dict[str, int] = {}
    end = time.monotonic() + seconds
    with sock:
        while True:
            for body in bodies:
                sock.sendall(frame(body))
                answer = read_answer(sock)
                assert answer is not None
                key = "ok" if answer["ok"] else answer["reason"]
                out[key] = out.get(key, 0) + 1
            if time.monotonic() >= end:
                return out


def test_round11_a_full_audit_log_takes_no_more_lines_from_the_nodes_refusals(tmp_path: Path) -> None:
    """While the log holds all the unexported files it may (`audit-full`: keep x 4), the node's requests
    are refused `audit-full` and counted, so that its disk stays bounded (round 2 item 5, round 5 row 1:
    "the disk root fills for the node is bounded by audit_max_bytes x 4 x audit_keep"). But a request
    refused before that check (its shape, a malformed `trace`, a broken frame) was still audited one line
    each up to the refusal rate (a burst of 100, then 10 a second, plus a `(suppressed)` line a second):
    the files kept growing past the bound, ~6 KiB a second for as long as the node liked, until the disk
    was full and root's own requests (each needs its line) were no longer answered. Now, while the log is
    full, every refusal of a non-root peer is counted, not a line each, and the `(suppressed)` counts wait
    until the log has room (or the helper stops). Root is still served and audited."""
    root = make_root(tmp_path)
    h = HelperProcess(root, base_config(extra="audit_max_bytes = 16384\naudit_keep = 2\n"))
    audit = root / AUDIT_DIR.lstrip("/")
    try:
        counts = _flood(h, [b'{"op":"helper.ping","args":{}}'] * 700)
        assert counts.get("audit-full", 0) > 0, counts  # the log holds all it may
        before = sorted((p.name, p.stat().st_size) for p in audit.glob("audit.log*"))
        # Refused before the full check: a malformed trace (a 100-character op in the line), a bad shape.
        op = "x" * 100
        bad = [
            json.dumps({"op": op, "args": {}, "trace": "00-bad"}).encode(),
            json.dumps({"op": op}).encode(),
            b"[]",
        ]
        counts = _flood(h, bad * 50, seconds=2.5)
        assert set(counts) == {"bad-request"}, counts
        after = sorted((p.name, p.stat().st_size) for p in audit.glob("audit.log*"))
        assert len(after) == len(before), (before, after)
        assert sum(size for _, size in after) - sum(size for _, size in before) < 4096, (before, after)
        assert h.raw({"op": "helper.ping", "args": {}})["ok"] is True  # root: served and audited
        assert h.last_audit()["peer_uid"] == 0
        result = verify_chain(audit)
        assert result.ok, result.problem
    finally:
        h.stop()


def test_round11_the_counts_kept_while_the_log_is_full_survive_a_killed_helper(tmp_path: Path) -> None:
    """Row 4's "not closed": while the log is full the node's refusals are counted, not written, and the
    counts lived in memory only, so a helper killed then (SIGKILL, a power loss) lost them: the node could
    fill the log, send what it liked, and have the helper killed. Now the counts are also kept in
    `audit.pending` (replaced whole, fsynced) while the log is full; the next helper reads them back and
    writes them in its `(suppressed)` line once the node has read the head (room again), then removes
    the file; the chain verifies."""
    root = make_root(tmp_path)
    # audit_min_age_s = 0: the files the node has read may go at once (room again when it reads the head).
    h = HelperProcess(
        root, base_config(extra="audit_max_bytes = 16384\naudit_keep = 2\naudit_min_age_s = 0\n")
    )
    audit = root / AUDIT_DIR.lstrip("/")
    pending = audit / "audit.pending"
    try:
        assert _flood(h, [b'{"op":"helper.ping","args":{}}'] * 700).get("audit-full", 0) > 0
        counts = _flood(h, [b"[]"] * 40 + [b'{"op":"helper.ping","args":{}}'] * 10)
        assert counts == {"bad-request": 40, "audit-full": 10}, counts
        deadline = time.monotonic() + 10
        while not pending.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        saved = json.loads(pending.read_bytes())
        assert saved["v"] == 1 and saved["pending"][str(NODE_UID)]["bad-request"] == 40, saved
        assert (pending.stat().st_mode & 0o777) == 0o600
    finally:
        h.proc.kill()  # no clean stop: nothing written at close
        h.proc.wait()
    lines_before = sum(1 for p in audit.glob("audit.log*") for _ in p.read_bytes().splitlines())
    h = HelperProcess(root)
    try:
        head = as_node(h, {"op": "audit.head", "args": {}})  # the node reads the head: room again
        assert head["ok"] is True, head
        deadline = time.monotonic() + 10
        while pending.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pending.exists()
        lines = [json.loads(x) for p in sorted(audit.glob("audit.log*")) for x in p.read_bytes().splitlines()]
        assert len(lines) > 0 and lines_before > 0
        suppressed = [x for x in lines if x["op"] == "(suppressed)" and x["peer_uid"] == NODE_UID]
        assert suppressed, lines[-5:]
        reasons = suppressed[-1]["args"]["reasons"]
        assert reasons["bad-request"] >= 40 and reasons["audit-full"] >= 10, suppressed[-1]
        result = verify_chain(audit)
        assert result.ok, result.problem
    finally:
        h.stop()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("net.ipv4.ip_unprivileged_port_start", "01024"),  # the kernel reads octal 532
        ("net.ipv4.ip_unprivileged_port_start", "0001777"),  # octal 1023
        ("net.ipv4.ip_unprivileged_port_start", "+1024"),
        ("net.ipv4.ip_unprivileged_port_start", "1_024"),
        ("net.ipv4.ip_unprivileged_port_start", "\u0661\u0660\u0662\u0664"),  # Arabic-Indic 1024
        ("kernel.io_uring_disabled", "01"),
        ("kernel.oops_limit", "010000"),  # octal 4096
    ],
)
def test_round11_a_hardened_sysctl_value_is_read_as_the_kernel_reads_it(
    helper: HelperProcess, key: str, value: str
) -> None:
    """A hardened sysctl takes only its safe values (`net.ipv4.ip_unprivileged_port_start` 1024 or
    above), compared as integers. Root read the node's string with Python's int(), which takes leading
    zeros, `+`, `_` and any script's digits: "01024" passed as 1024, and the kernel, which reads a sysctl
    integer in base 0 (proc_get_long: a leading 0 is octal), set 532, so an unprivileged process could
    bind ports 532 to 1023 (the drop-in written, and applied at every boot). Now a hardened key takes
    only a plain decimal integer in ASCII (`-?(0|[1-9][0-9]*)`), which the kernel reads as root does;
    anything else is refused as lowering the defense, before anything is written."""
    settings = json.dumps({key: value})
    refused_as_node(
        helper,
        {"op": "host.unit", "args": {"unit": "sysctl", "settings": settings}},
        "invalid-settings",
        "would lower the host's defenses",
    )


@pytest.mark.parametrize(
    ("module", "options", "rule"),
    [
        ("nvidia", "NVreg_RestrictProfilingToAdminUsers=0", "only NVreg_RestrictProfilingToAdminUsers=1"),
        ("nvidia", "NVreg_RestrictProfilingToAdminUsers=0x0", "only NVreg_RestrictProfilingToAdminUsers=1"),
        ("nvidia", "NVreg_RestrictProfilingToAdminUsers=00", "only NVreg_RestrictProfilingToAdminUsers=1"),
        # an alias of the module: modprobe applies its line when the module is loaded through it
        (
            "nvidia-current",
            "NVreg_RestrictProfilingToAdminUsers=0",
            "only NVreg_RestrictProfilingToAdminUsers=1",
        ),
        ("nvidia", "NVreg_RegistryDwords=RmProfilingAdminOnly=0", "registry entries"),
        ("nvidia", "NVreg_RegistryDwordsPerDevice=RmProfilingAdminOnly=0", "registry entries"),
    ],
)
def test_round11_nvidia_profiling_opened_to_every_user_is_refused(
    helper: HelperProcess, module: str, options: str, rule: str
) -> None:
    """Round 11's "not closed": `kernel-modules` wrote `options nvidia NVreg_RestrictProfilingToAdminUsers=0`
    as the node asked (the GPUs' performance counters to every user of the host, a side channel between
    tenants), and the driver's registry keys can set the same switch (`RmProfilingAdminOnly`). Now the
    restriction is taken only as exactly 1 and the registry keys not at all, under any module name
    (`invalid-settings` naming the key), nothing written; the default itself is still written."""
    settings = json.dumps({"options": {module: options}})
    args = {"unit": "kernel-modules", "settings": settings, "busy_gpus": []}
    answer = refused_as_node(helper, {"op": "host.unit", "args": args}, "invalid-settings", rule)
    assert options.split("=")[0] in answer["message"], answer
    assert not (helper.root / "etc/modprobe.d/bcd.conf").exists()


def test_round11_nvidias_profiling_restriction_at_its_default_is_written(helper: HelperProcess) -> None:
    settings = json.dumps({"options": {"nvidia": "NVreg_RestrictProfilingToAdminUsers=1"}})
    answer = as_node(
        helper, {"op": "host.unit", "args": {"unit": "kernel-modules", "settings": settings, "busy_gpus": []}}
    )
    assert answer["ok"] is True, answer
    conf = helper.root / "etc/modprobe.d/bcd.conf"
    assert "options nvidia NVreg_RestrictProfilingToAdminUsers=1\n" in conf.read_text()
    conf.unlink()


@pytest.mark.parametrize(
    "body", [b"," * 16385 + b'\\"' * 2_000_000, b'["' + b'\\"' * 2_000_000 + b"," * 16385]
)
def test_round11_a_frame_of_escaped_quotes_never_stalls_the_helper(
    helper: HelperProcess, body: bytes
) -> None:
    """A frame holding more than MAX_VALUES `,` has its strings taken out before the values are counted
    again (protocol.count_values), by a regular expression tried at every `"`. With the quotes all escaped
    (`\\"` x 2 M) the estimate of strings is 0, and each try ran to the end of the frame: quadratic in the
    frame (19 s for an 80 KB frame on this machine, hours for 4 MiB), in C code that never lets the
    interpreter lock go, so every thread of the helper stood still: root's own socket, the audit, the
    swap's confirmation timer. Now escapes are taken out first (`\\.`, left to right) and then strings
    without escapes (`"[^"]*"`), two linear passes; the frame is refused `protocol` (values) at once and
    root's ping is answered meanwhile."""
    sock, _ = connect_as(helper, NODE_UID, NODE_GID)
    with sock:
        sock.settimeout(30)
        sock.sendall(frame(body))
        t0 = time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # root, while the frame is counted
            s.settimeout(5)
            s.connect(helper.socket_path)
            s.sendall(frame(b'{"op":"helper.ping","args":{}}'))
            pong = read_answer(s)
        assert pong is not None and pong["ok"] is True
        assert time.monotonic() - t0 < 5
        answer = read_answer(sock)
    assert answer is not None and (answer["ok"], answer["reason"]) == (False, "protocol"), answer
    assert "values" in answer["message"], answer
