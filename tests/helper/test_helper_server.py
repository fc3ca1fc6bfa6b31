"""The helper as a process on a real socket: framing, strict decoding, the OPS table, the audit log."""

from __future__ import annotations

import array
import json
import os
import re
import socket
import struct
import subprocess
import sys
from pathlib import Path

import attrs
from bcd_helper.ops.table import OPS
from bcd_simhost import sim_system
from helperproc import REPO, HelperProcess, tree


def test_ping_answers_and_audits(helper: HelperProcess) -> None:
    assert helper.client.ping()["peer_uid"] == 0
    last = helper.last_audit()
    assert last["op"] == "helper.ping" and last["decision"] == "accepted" and last["peer_uid"] == 0
    assert last["peer_pid"] == os.getpid()


def test_HST_SIGN_32_unknown_op_field_and_types_refused_with_reason(helper: HelperProcess) -> None:
    """Covers HST-SIGN-32: an unknown field is refused, so mismatched versions fail closed."""
    cases = [
        ({"op": "file.nuke", "args": {}}, "unknown-op", "unknown operation"),
        ({"op": "helper.ping", "args": {"x": 1}}, "bad-arguments", "unknown field 'x'"),
        (
            {"op": "file.remove", "args": {"kind": "cdi", "id": 5}},
            "bad-arguments",
            "$.args.id: expected string",
        ),
        (
            {"op": "file.remove", "args": {"kind": "cdi"}},
            "bad-arguments",
            "$.args.id: required field missing",
        ),
        (
            {"op": "slice.apply", "args": {"name": "bcd-alloc-a.slice", "cpu_millis": "100"}},
            "bad-arguments",
            "$.args.cpu_millis: expected integer",
        ),
        ({"op": "gpu.reset", "args": {"gpu_uuids": "GPU-x"}}, "bad-arguments", "expected array"),
        ({"op": "helper.ping"}, "bad-request", "exactly"),
        ({"op": "helper.ping", "args": {}, "extra": 1}, "bad-request", "exactly"),
        (["helper.ping"], "bad-request", "exactly"),
    ]
    for doc, reason, text in cases:
        answer = helper.raw(doc)
        assert answer["ok"] is False and answer["error"] == "refused", doc
        assert answer["reason"] == reason and text in answer["message"], (doc, answer)
        assert helper.last_audit()["decision"] == "refused"


def _connect(helper: HelperProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(helper.socket_path)
    return s


def test_inbound_file_descriptors_are_refused(helper: HelperProcess) -> None:
    body = json.dumps({"op": "helper.ping", "args": {}}).encode()
    with _connect(helper) as s, open("/dev/null", "rb") as f:
        fds = array.array("i", [f.fileno()])
        s.sendmsg(
            [struct.pack(">I", len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())]
        )
        n = struct.unpack(">I", s.recv(4))[0]
        answer = json.loads(s.recv(n))
        assert answer["reason"] == "protocol" and "descriptors" in answer["message"]
        assert s.recv(10) == b""  # closed
    assert helper.last_audit()["op"] == "(frame)"


def test_oversized_and_malformed_frames_close_the_connection(helper: HelperProcess) -> None:
    with _connect(helper) as s:
        s.sendall(struct.pack(">I", 4 * 1024 * 1024 + 1))
        n = struct.unpack(">I", s.recv(4))[0]
        assert "exceeds" in json.loads(s.recv(n))["message"]
        assert s.recv(10) == b""
    with _connect(helper) as s:
        s.sendall(struct.pack(">I", 3) + b"{x}")
        n = struct.unpack(">I", s.recv(4))[0]
        assert "not one JSON document" in json.loads(s.recv(n))["message"]


def test_a_stalled_connection_does_not_block_others(helper: HelperProcess) -> None:
    with _connect(helper) as stalled:
        stalled.sendall(b"\x00\x00")  # half a length prefix, then nothing
        with _connect(helper) as _other:
            assert helper.client.ping()["peer_uid"] == 0


def test_file_write_builds_the_path_and_remove_removes(
    helper: HelperProcess,
) -> None:
    """Covers DLV-PRIV-02, DEV-BIND-06."""
    from bcd_shared import cdi

    doc = cdi.build_hold_spec(
        allocation_id="alloc_1",
        reservation_id="rsv_1",
        generation=3,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice("GPU-5f1c2a90-0000-4000-8000-000000000001")],
        env=["BCD_ALLOCATION_ID=alloc_1"],
        vendor=None,
    )
    data = cdi.encode_spec(doc)
    result = helper.client.file_write("cdi", "alloc_1", data)
    assert result["path"] == "/etc/cdi/bcd-alloc_1.json"
    target = helper.root / "etc/cdi/bcd-alloc_1.json"
    assert target.read_bytes() == data and oct(target.stat().st_mode & 0o777) == "0o644"
    env = b"BCD_ALLOCATION_ID=alloc_1\nBCD_RESERVATION_ID=rsv_1\n"
    assert (
        helper.client.file_write("allocation-env", "alloc_1", env)["path"]
        == "/run/bcd/allocations/alloc_1.env"
    )
    assert helper.client.file_remove("cdi", "alloc_1") is True
    assert helper.client.file_remove("cdi", "alloc_1") is False
    assert helper.client.file_remove("allocation-env", "alloc_1") is True
    assert not target.exists()


def test_slice_apply_sets_exactly_the_properties_and_remove_waits_for_empty(helper: HelperProcess) -> None:
    """Covers DEV-SLICE-09..16, DEV-SLICE-18/19/24, DLV-PRIV-03/04."""
    name = "bcd-alloc-alloc_s1.slice"
    helper.client.slice_apply(
        name, cpus="0-3,8", mems="0", cpu_millis=1500, memory_bytes=1 << 30, hugepages_1gi=2
    )
    shown = sim_system(helper.root).run(["systemctl", "show", name]).stdout.decode()
    props = dict(line.split("=", 1) for line in shown.splitlines())
    assert props["ActiveState"] == "active"
    expected = {
        "AllowedCPUs": "0-3,8",
        "AllowedMemoryNodes": "0",
        "CPUQuota": "150%",
        "MemoryMax": str(1 << 30),
        "MemoryHigh": str((1 << 30) * 9 // 10),
    }
    assert {k: v for k, v in props.items() if k not in ("ActiveState", "UnitFileState")} == expected
    cg = helper.root / "sys/fs/cgroup/bcd.slice/bcd-alloc.slice" / name
    assert (cg / "hugetlb.1GB.max").read_text() == str(2 << 30)
    assert (cg / "hugetlb.2MB.max").read_text() == "0"
    for parent in ("sys/fs/cgroup", "sys/fs/cgroup/bcd.slice", "sys/fs/cgroup/bcd.slice/bcd-alloc.slice"):
        assert (helper.root / parent / "cgroup.subtree_control").read_text() == "+hugetlb"
    (cg / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    assert helper.client.slice_remove(name) == {
        "name": name,
        "stopped": False,
        "populated": True,
        "absent": False,
    }
    assert cg.exists()
    (cg / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    assert helper.client.slice_remove(name)["stopped"] is True
    assert not cg.exists()


def test_every_row_resolves_to_a_request_type_and_handler_in_the_helpers_ops() -> None:
    """The table names each op's module, type and handler; a start imports none of them (the op's first
    call does). Each name must resolve, to an attrs type and a callable of a module under bcd_helper.ops."""
    for name, spec in OPS.items():
        assert spec.module.startswith("bcd_helper.ops."), name
        assert attrs.has(spec.request), name
        assert callable(spec.handler), name


def test_a_start_imports_no_op_family() -> None:
    """`bcd helper serve`'s imports leave every op module (libvirt, nft, ch, ...) for its first call."""
    code = (
        "import sys, bcd_helper.serve\n"
        "print(sorted(m for m in sys.modules if m.startswith('bcd_helper.ops.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "['bcd_helper.ops.base', 'bcd_helper.ops.table']"


def test_docs_document_every_op_and_no_other() -> None:
    text = (REPO / "docs/helper-rpc.md").read_text()
    documented = set(re.findall(r"^### `([a-z0-9.-]+)`", text, flags=re.M))
    assert documented == set(OPS)
    for name, spec in OPS.items():
        section = text.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        for field in spec.request.__attrs_attrs__:
            assert f"`{field.name}`" in section, (name, field.name)


def test_refusals_change_nothing(helper: HelperProcess) -> None:
    before = tree(helper.root)
    helper.raw({"op": "file.write", "args": {"kind": "cdi", "id": "../../etc/passwd", "content": "x"}})
    helper.raw({"op": "slice.apply", "args": {"name": "ssh.service"}})
    assert tree(helper.root) == before
    _ = Path
