"""A hostile client against a real helper process: framing, strict JSON, slow clients, connection floods,
half-closes, spoofed credentials, and audit-line injection.

Every refused request must be answered, audited as exactly one refused line, leave the tree under the
simulated root byte-for-byte unchanged, keep the audit chain intact, and leave the helper serving other
connections (hostilekit.assert_refused_raw). Covers DLV-PRIV-01 (the helper trusts nothing the agent sends)
and the audit log's rules (docs/helper.md "Audit log").
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.ops.host import helper_version
from bcd_helper.protocol import MAX_DEPTH, MAX_FRAME
from bcd_helper.server import FRAME_TIMEOUT_S, MAX_CONNECTIONS, MAX_SHOWN, MAX_TEXT
from helperproc import AUDIT_DIR, HelperProcess, base_config, tree
from hostilekit import (
    INJECTED,
    NODE_GID,
    NODE_UID,
    assert_refused_raw,
    assert_still_serving,
    audit_size,
    connect,
    connect_as,
    frame,
    read_answer,
    send_raw,
    verify_audit,
)

VERSION = helper_version()
PING = b'{"op":"helper.ping","args":{}}'


# --- framing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0xFFFFFFFF, MAX_FRAME + 1, 1 << 31])
def test_length_prefix_above_the_cap_is_refused_audited_and_closed(
    helper: HelperProcess, length: int
) -> None:
    before = tree(helper.root)
    seq = helper.last_audit()["seq"]
    with connect(helper) as s:
        s.sendall(struct.pack(">I", length))
        answer = read_answer(s)
        assert answer is not None and answer["reason"] == "protocol" and "exceeds" in answer["message"]
        assert s.recv(1) == b""  # closed: the helper never reads the announced body
    last = helper.last_audit()
    assert (last["seq"], last["op"], last["decision"]) == (seq + 1, "(frame)", "refused")
    assert tree(helper.root) == before
    assert_still_serving(helper)


def test_length_prefix_zero_is_refused(helper: HelperProcess) -> None:
    assert_refused_raw(helper, b"", "protocol", "not one JSON document", op="(frame)")


@pytest.mark.parametrize(
    "body",
    [
        bytes(range(256)),  # garbage
        b"\xff\xfe" + PING,  # not UTF-8
        b'{"op":"helper.ping\xc0\xae","args":{}}',  # an overlong UTF-8 encoding of "."
        b'{"op":"helper.ping\xed\xa0\x80","args":{}}',  # a UTF-8-encoded surrogate
        b"\xef\xbb\xbf" + PING,  # a byte order mark
        PING + PING,  # trailing data: two documents in one frame
        PING[:-1],  # cut short
    ],
    ids=["garbage", "not-utf8", "overlong-utf8", "encoded-surrogate", "bom", "two-documents", "truncated"],
)
def test_bytes_that_are_not_one_json_document_are_refused(helper: HelperProcess, body: bytes) -> None:
    assert_refused_raw(helper, body, "protocol", op="(frame)")


# --- strict JSON ---------------------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b'{"op":"helper.ping","args":{},"x":' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (b'{"op":"helper.ping","args":{},"args":{}}', "twice"),
        (b'{"op":"file.remove","args":{"kind":"x","kind":"cdi","id":"a1"}}', "twice"),
        (b'{"op":"file.remove","op":"helper.ping","args":{}}', "twice"),
        (
            b'{"op":"host.unit","args":{"unit":"sysctl","settings":null,'
            b'"intent":{"body":"","body":"","signature":"","chain":[]}}}',
            "twice",
        ),
        (b'{"op":"slice.apply","args":{"name":"bcd-alloc-a.slice","cpu_millis":NaN}}', "NaN"),
        (b'{"op":"slice.apply","args":{"name":"bcd-alloc-a.slice","memory_bytes":Infinity}}', "Infinity"),
        (b'{"op":"slice.apply","args":{"name":"bcd-alloc-a.slice","memory_bytes":-Infinity}}', "Infinity"),
        (b'{"op":"\\ud800","args":{}}', "surrogate"),
        (b'{"op":"file.remove","args":{"kind":"cdi","id":"a\\udfff"}}', "surrogate"),
        (b'{"op":"file.remove","args":{"\\udc80":"cdi","id":"a"}}', "surrogate"),
        (_nested(10_000), "nested"),
        (_nested(MAX_DEPTH), "nested"),
        (b'{"op":"slice.apply","args":{"name":"bcd-alloc-a.slice","cpu_millis":' + b"9" * 5000 + b"}}", ""),
    ],
    ids=[
        "dup-top",
        "dup-args",
        "dup-op",
        "dup-nested",
        "nan",
        "infinity",
        "minus-infinity",
        "surrogate-op",
        "surrogate-value",
        "surrogate-key",
        "nested-10000",
        "nested-past-cap",
        "int-5000-digits",
    ],
)
def test_json_outside_strict_json_is_refused_at_the_frame(
    helper: HelperProcess, body: bytes, text: str
) -> None:
    """Duplicate keys are never last-wins, NaN/Infinity and lone surrogates are not JSON text, and nesting
    is capped (a request needs four levels; 10,000 would overflow a recursive decoder or encoder)."""
    assert_refused_raw(helper, body, "protocol", text, op="(frame)")


def test_nesting_within_the_cap_is_decoded(helper: HelperProcess) -> None:
    """The cap refuses no real request: a shown argument nested just under it is refused by its own rule."""
    kind = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    body = ('{"op":"file.remove","args":{"kind":' + kind + ',"id":"a"}}').encode()
    assert_refused_raw(helper, body, "bad-arguments", "$.args.kind: expected string")


@pytest.mark.parametrize(
    ("args", "reason", "text"),
    [
        ({"name": "bcd-alloc-a.slice", "cpu_millis": 2**64 + 1}, "bad-limit", "cpu_millis"),
        ({"name": "bcd-alloc-a.slice", "memory_bytes": 2**200}, "bad-limit", "memory_bytes"),
        ({"name": "bcd-alloc-a.slice", "hugepages_1gi": -(2**63) - 1}, "bad-limit", "hugepages_1gi"),
        ({"name": "bcd-alloc-a.slice", "cpu_millis": 100.0}, "bad-arguments", "expected integer, got float"),
        ({"name": "bcd-alloc-a.slice", "memory_bytes": 1e3}, "bad-arguments", "expected integer, got float"),
        ({"name": "bcd-alloc-a.slice", "cpu_millis": True}, "bad-arguments", "expected integer, got bool"),
        ({"name": "bcd-alloc-a.slice", "cpus": 3}, "bad-arguments", "expected string, got int"),
        ({"name": "bcd-alloc-a.slice", "reset": "cpus"}, "bad-arguments", "expected array"),
    ],
)
def test_numbers_of_the_wrong_kind_or_size_are_refused(
    helper: HelperProcess, args: dict[str, Any], reason: str, text: str
) -> None:
    """Integers beyond 64 bits are range-checked like any other (no wrap-around), floats and booleans never
    stand for integers."""
    body = json.dumps({"op": "slice.apply", "args": args}).encode()
    assert_refused_raw(helper, body, reason, text)


def test_daemon_swap_timeout_float_and_bool_refused(helper: HelperProcess) -> None:
    for value in ("600.0", "true", "1e2"):
        body = (
            '{"op":"daemon.swap","args":{"version":"1","url":"https://x/y","sha256":"' + "0" * 64 + '",'
            '"signature":"","chain":[],"artifact":"/a","trust_bundle":null,"confirm_timeout_s":'
            + value
            + "}}"
        ).encode()
        assert_refused_raw(helper, body, "bad-arguments", "confirm_timeout_s")


# --- huge strings ------------------------------------------------------------------------------------------


def test_huge_shown_argument_is_answered_and_its_audit_line_stays_small(helper: HelperProcess) -> None:
    """A 3.5 MiB string in an argument the audit log shows: refused and answered, and the audit line is
    bounded (the value is pinned by its digest), so a few requests cannot rotate the log's history away."""
    size = audit_size(helper)
    kind = "\x01" * (600 * 1024)  # escaped as \\u0001 by every JSON encoder: 6 bytes each
    body = json.dumps({"op": "file.remove", "args": {"kind": kind, "id": "a1"}}).encode()
    assert len(body) > 3 * 1024 * 1024
    seq = helper.last_audit()["seq"]
    answer = assert_refused_raw(helper, body, "bad-kind")
    assert len(answer["message"]) <= MAX_TEXT
    (line,) = [e for e in helper.audit_lines() if e["seq"] == seq + 1]
    assert line["args"]["id"] == "a1" and set(line["args"]["kind"]) == {"bytes", "sha256"}
    assert audit_size(helper) - size < 4 * MAX_SHOWN + 64 * 1024


def test_message_past_the_frame_cap_is_still_answered(helper: HelperProcess) -> None:
    """An id of 1M unprintable astral characters (4 MiB - a bit as UTF-8) makes a refusal message whose
    repr would be 10 MiB, past the frame cap: the answer is still sent, its message cut."""
    ident = "\U000e0001" * (MAX_FRAME // 4 - 100)
    body = json.dumps(
        {"op": "file.remove", "args": {"kind": "cdi", "id": ident}}, ensure_ascii=False
    ).encode()
    assert len(body) <= MAX_FRAME
    answer = assert_refused_raw(helper, body, "bad-id")
    assert len(answer["message"]) <= MAX_TEXT


# --- slow clients and floods -------------------------------------------------------------------------------


@pytest.fixture
def own_helper(fresh_root: Path) -> Any:
    h = HelperProcess(fresh_root, base_config())
    yield h
    h.stop()


def _fill_without_reading(h: HelperProcess) -> tuple[socket.socket, int]:
    """A client that sends requests and never reads an answer, until the helper's answers fill the socket
    buffers and the helper's thread waits to write. The socket and how many requests went out."""
    s = connect(h, timeout=1)
    bad = json.dumps({"op": "file.remove", "args": {"kind": "k" * 1500, "id": ""}}).encode()
    sent, started = 0, time.monotonic()
    while time.monotonic() - started < FRAME_TIMEOUT_S:
        try:
            s.sendall(frame(bad))
            sent += 1
        except TimeoutError:
            break
    return s, sent


def _closed_by_helper(s: socket.socket) -> bool:
    """True when what the helper wrote can be read to its end (or a reset): the helper closed `s`."""
    s.settimeout(5)
    try:
        while s.recv(1 << 20):
            pass
        return True
    except ConnectionResetError:  # closed with our unread requests still queued: a reset
        return True
    except TimeoutError:  # still being served: the helper waits on this client for good
        return False


def test_slow_clients_time_out_without_blocking_others(own_helper: HelperProcess) -> None:
    """A frame cut short and then held open (slow-loris), and a client that never reads its answers: other
    clients are served meanwhile, and the helper gives up on both after FRAME_TIMEOUT_S (a per-connection
    deadline for the whole frame however slowly it trickles, and for each answer), the cut frame audited
    as a protocol refusal."""
    h = own_helper
    seq = h.last_audit()["seq"]
    reader, sent = _fill_without_reading(h)
    assert sent > 10
    loris = connect(h, timeout=FRAME_TIMEOUT_S * 4)
    loris.sendall(frame(PING)[:7])  # the prefix and three bytes of the body
    started = time.monotonic()
    # It trickles one more byte now and then: the deadline is for the whole frame, not per byte.
    for _ in range(3):
        time.sleep(FRAME_TIMEOUT_S / 6)
        with connect(h) as other:
            other.sendall(frame(PING))
            assert read_answer(other) == {
                "ok": True,
                "result": {"peer_uid": 0, "host_units": True, "version": VERSION},
            }
        loris.send(b"{")
    answer = read_answer(loris)
    waited = time.monotonic() - started
    assert answer is not None and answer["reason"] == "protocol" and "within" in answer["message"]
    assert FRAME_TIMEOUT_S * 0.9 <= waited <= FRAME_TIMEOUT_S * 3
    assert loris.recv(1) == b""
    loris.close()
    frames = [e for e in h.audit_lines() if e["seq"] > seq and e["op"] == "(frame)"]
    assert [(e["decision"], e["reason"]) for e in frames] == [("refused", "protocol")]
    time.sleep(1)  # the reader's answer deadline started before the loris's frame
    assert _closed_by_helper(reader)
    reader.close()
    answered = [e for e in h.audit_lines() if e["seq"] > seq and e["op"] == "file.remove"]
    assert answered and all(e["decision"] == "refused" for e in answered)
    assert_still_serving(h)
    verify_audit(h)


def test_connection_cap_for_the_node_uid_and_root_is_never_locked_out(own_helper: HelperProcess) -> None:
    """At most MAX_CONNECTIONS connections of non-root peers at once: one more is answered `busy`, counted
    (audited in a `(suppressed)` line), and closed; root is always served; a freed slot is reused."""
    h = own_helper
    held = [connect_as(h, NODE_UID, NODE_GID)[0] for _ in range(MAX_CONNECTIONS)]
    try:
        held[0].sendall(frame(PING))
        assert read_answer(held[0]) == {
            "ok": True,
            "result": {"peer_uid": NODE_UID, "host_units": True, "version": VERSION},
        }
        seq = h.last_audit()["seq"]
        extra, _ = connect_as(h, NODE_UID, NODE_GID)
        with extra:
            answer = read_answer(extra)
            assert answer is not None and answer["reason"] == "busy", answer
            assert extra.recv(1) == b""
        # Counted on the accept thread (no audit write there) and audited by the flusher thread within a
        # second or so as one `(suppressed)` line of that uid.
        for _ in range(50):
            last = h.last_audit()
            if last["seq"] > seq:
                break
            time.sleep(0.1)
        assert (last["seq"], last["op"], last["args"]["reasons"], last["peer_uid"]) == (
            seq + 1,
            "(suppressed)",
            {"busy": 1},
            NODE_UID,
        )
        assert_still_serving(h)  # root
        held.pop().close()
        time.sleep(0.3)  # the freed thread ends
        again, _ = connect_as(h, NODE_UID, NODE_GID)
        with again:
            again.sendall(frame(PING))
            assert read_answer(again) == {
                "ok": True,
                "result": {"peer_uid": NODE_UID, "host_units": True, "version": VERSION},
            }
    finally:
        for s in held:
            s.close()
    verify_audit(h)


def test_many_connections_at_once_all_answered_or_refused_busy(own_helper: HelperProcess) -> None:
    """A burst of concurrent clients: each gets a well-formed answer (served, or `busy` past the cap)."""
    h = own_helper
    socks = [connect_as(h, NODE_UID, NODE_GID)[0] for _ in range(MAX_CONNECTIONS + 16)]
    results: list[dict[str, Any] | None] = [None] * len(socks)

    def one(i: int) -> None:
        with contextlib.suppress(OSError):  # refused busy and closed before the request went out
            socks[i].sendall(frame(PING))
        results[i] = read_answer(socks[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(socks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in socks:
        s.close()
    ok = [r for r in results if r and r["ok"]]
    busy = [r for r in results if r and not r["ok"] and r["reason"] == "busy"]
    assert len(ok) + len(busy) == len(socks) and len(ok) >= MAX_CONNECTIONS, results
    assert_still_serving(h)
    verify_audit(h)


# --- half-close and ancillary data -------------------------------------------------------------------------


def test_request_then_half_close_is_answered(helper: HelperProcess) -> None:
    with connect(helper) as s:
        s.sendall(frame(PING) + frame(b'{"op":"nope","args":{}}'))
        s.shutdown(socket.SHUT_WR)
        assert read_answer(s) == {
            "ok": True,
            "result": {"peer_uid": 0, "host_units": True, "version": VERSION},
        }
        second = read_answer(s)
        assert second is not None and second["reason"] == "unknown-op"
        assert s.recv(1) == b""
    with connect(helper) as s:  # half-closed in the middle of a frame: refused, audited
        seq = helper.last_audit()["seq"]
        s.sendall(frame(PING)[:10])
        s.shutdown(socket.SHUT_WR)
        answer = read_answer(s)
        assert answer is not None and answer["reason"] == "protocol" and "mid-frame" in answer["message"]
    assert helper.last_audit()["seq"] == seq + 1
    assert_still_serving(helper)


def test_scm_credentials_cannot_spoof_the_peer(helper: HelperProcess) -> None:
    """The helper trusts SO_PEERCRED (the credentials of the process that connected) and never asks for
    SCM_CREDENTIALS: the node uid claiming root is stopped by the kernel, a stranger in the node's group
    claiming the node uid too, and credentials that do arrive change nothing."""
    # The node's uid claims root: the kernel refuses the message (EPERM); the peer is still the node.
    s, status = connect_as(helper, NODE_UID, NODE_GID, creds=(0, 0, 0), payload=frame(PING))
    with s:
        assert status == 1  # EPERM
        s.sendall(frame(PING))
        assert read_answer(s) == {
            "ok": True,
            "result": {"peer_uid": NODE_UID, "host_units": True, "version": VERSION},
        }
    assert helper.last_audit()["peer_uid"] == NODE_UID
    # The node sends its own, true credentials with a request: accepted by the kernel, ignored by the helper.
    s, status = connect_as(helper, NODE_UID, NODE_GID, creds=(0, NODE_UID, NODE_GID), payload=frame(PING))
    with s:
        assert status == 0
        assert read_answer(s) == {
            "ok": True,
            "result": {"peer_uid": NODE_UID, "host_units": True, "version": VERSION},
        }
    # A stranger in the node's group claims the node's uid: EPERM, and the stranger is refused as a peer.
    seq = helper.last_audit()["seq"]
    s, status = connect_as(helper, 5555, NODE_GID, creds=(0, NODE_UID, NODE_GID), payload=frame(PING))
    with s:
        assert status == 1
        answer = read_answer(s)
        assert answer is not None and answer["reason"] == "peer"
    last = helper.last_audit()
    assert (last["seq"], last["op"], last["peer_uid"], last["reason"]) == (seq + 1, "(connect)", 5555, "peer")
    # Root (allowed to claim anything) claims the node: the helper still sees root.
    with connect(helper) as c:
        creds = struct.pack("3i", 1, NODE_UID, NODE_GID)
        c.sendmsg([frame(PING)], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
        answer = read_answer(c)
        assert answer is not None and answer.get("result", {}).get("peer_uid", 0) == 0
    assert helper.last_audit()["peer_uid"] == 0
    assert_still_serving(helper)
    verify_audit(helper)


# --- audit-line injection ---------------------------------------------------------------------------------

GOOD_HASH = "0" * 64


def _every_string_argument() -> list[tuple[str, dict[str, Any], str]]:
    """(op, request args with INJECTED in one string argument, the path of that argument)."""
    base: dict[str, dict[str, Any]] = {
        "file.write": {
            "kind": "allocation-env",
            "id": "a1",
            "content": "BCD_ALLOCATION_ID=a1\n",
            "encoding": "utf-8",
        },
        "file.remove": {"kind": "cdi", "id": "a1"},
        "slice.apply": {"name": "bcd-alloc-a1.slice", "cpus": "0", "mems": "0", "reset": ["cpu_millis"]},
        "slice.remove": {"name": "bcd-alloc-a1.slice"},
        "host.unit": {
            "unit": "sysctl",
            "settings": '{"vm.swappiness":10}',
            "busy_gpus": ["GPU-1"],
            "intent": {"body": "", "signature": "", "chain": ["AA=="], "trust_bundle": "AA=="},
        },
        "gpu.reset": {"gpu_uuids": ["GPU-5f1c2a90-0000-4000-8000-000000000001"]},
        "daemon.swap": {
            "version": "1.2.3",
            "url": "https://example.invalid/bcd",
            "sha256": "0" * 64,
            "signature": "AA==",
            "chain": ["AA=="],
            "artifact": "/var/lib/bcd/bcd.new",
            "trust_bundle": None,
            "confirm_timeout_s": 600,
        },
        "daemon.confirm": {"version": "1.2.3", "healthy": True},
    }
    out: list[tuple[str, dict[str, Any], str]] = []
    for op, args in base.items():
        for key, value in args.items():
            if isinstance(value, str):
                out.append((op, {**args, key: value + INJECTED}, key))
            elif isinstance(value, list) and value and isinstance(value[0], str):
                out.append((op, {**args, key: [value[0] + INJECTED]}, key))
            elif isinstance(value, dict):
                for inner, v in value.items():
                    if isinstance(v, str):
                        out.append((op, {**args, key: {**value, inner: v + INJECTED}}, f"{key}.{inner}"))
                    elif isinstance(v, list):
                        out.append((op, {**args, key: {**value, inner: [v[0] + INJECTED]}}, f"{key}.{inner}"))
    out.append(("file.remove", {"kind": "cdi", "id": "a1", "x" + INJECTED: 1}, "an unknown key"))
    out.append(("file.nuke" + INJECTED, {}, "op"))
    return out


def test_injected_newlines_never_forge_an_audit_entry(helper: HelperProcess) -> None:
    """`\\n{"decision":"accepted",...}` in every string argument of every op (and in an op name and a key):
    each request is refused and adds exactly one line, ASCII, naming the real decision; the chain verifies
    and `bcd helper audit verify` and `show` read it."""
    log = helper.root / AUDIT_DIR.lstrip("/") / "audit.log"
    for op, args, where in _every_string_argument():
        before = tree(helper.root)
        raw_before = log.read_bytes()
        doc = {"op": op, "args": args}
        answer = send_raw(helper, json.dumps(doc).encode())
        assert answer is not None and answer["ok"] is False and answer["error"] == "refused", (
            op,
            where,
            answer,
        )
        added = log.read_bytes()[len(raw_before) :]
        assert added.count(b"\n") == 1 and added.endswith(b"\n") and added.isascii(), (op, where)
        entry = json.loads(added)
        assert (entry["decision"], entry["reason"]) == ("refused", answer["reason"]), (op, where)
        assert tree(helper.root) == before, (op, where)
    verify_audit(helper)
    root = str(helper.root)
    verified = subprocess.run(
        [
            *(sys.executable, "-m", "bcd_helper.cli", "audit", "--root", root, "--dir", AUDIT_DIR, "verify"),
            *("--key", str(helper.audit_key)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verified.returncode == 0 and "audit log intact" in verified.stdout, verified.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "bcd_helper.cli", "audit", "--root", root, "--dir", AUDIT_DIR, "show"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == len(helper.audit_lines())  # one printed line per entry: none forged
    assert all(re.match(r"\d{4}-\d\d-\d\dT[0-9:.]+Z #\d+ uid=", line) for line in lines)
    assert_still_serving(helper)
