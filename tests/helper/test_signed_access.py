"""Issue 9 items 1, 2 and 9: root renders the sshd files from a signed spec; a real node cannot write them.

Every request goes as a real unprivileged account (realnode.RealNode: useradd + setpriv) to a real
`bcd helper serve` over a simulated host. The real sshd and ssh client half (a login accepted, revoked by
the KRL, refused for a principal not in the spec) is test_access_sshd_real.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_shared import access as acc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from intentkit import (
    ControlPlane,
    access_body,
    access_doc,
    host_body,
    host_unit_doc,
    intent,
    settings,
    unsigned,
)
from realnode import RealNode

NODE = "node-a"
S10 = settings(**{"vm.swappiness": 10})


def ca_key(comment: str = "") -> str:
    line = (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
        .decode()
    )
    return f"{line} {comment}" if comment else line


@pytest.fixture
def signed_node(cp: ControlPlane) -> Iterator[RealNode]:
    """Roots from root's join record (node-a, a bundle with command-signing roots)."""
    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    yield node
    node.close()


def _file(node: RealNode, path: str) -> bytes | None:
    p = node.root / path.lstrip("/")
    return p.read_bytes() if p.exists() else None


def test_issue9_item1_the_node_cannot_write_sshd_files_by_kind() -> None:
    """The three unsigned writes that gave a node a root shell (a CA key of its own, a principals file for
    root, a drop-in naming them) are refused: there is no sshd file kind any more."""
    node = RealNode()
    try:
        mine = ca_key()
        dropin = "".join(f"{k} {v}\n" for k, v in acc_directives().items())
        for kind, ident, content in (
            ("sshd-ca", "", mine + "\n"),
            ("sshd-principals", "root", "root\n"),
            ("sshd-config", "", dropin),
        ):
            doc = {"op": "file.write", "args": {"kind": kind, "id": ident, "content": content}}
            node.refused(doc, "bad-kind")
        assert _file(node, acc.SSHD_CA) is None and _file(node, acc.principals_path("root")) is None
    finally:
        node.close()


def acc_directives() -> dict[str, str]:
    return {
        "TrustedUserCAKeys": acc.SSHD_CA,
        "AuthorizedPrincipalsFile": f"{acc.SSHD_PRINCIPALS}/%u",
        "RevokedKeys": acc.SSHD_KRL,
    }


def test_issue9_item1_no_roots_refuses_access_unless_root_opts_in() -> None:
    """No command-signing roots: access.apply is refused; `[helper] unsigned_access = true` (development
    only) lets root render from the unsigned body; the node still sends no sshd text."""
    key = ca_key()
    body = access_body(NODE, 1, ca_keys=(key,), principals=(f"alice@{NODE}",))
    node = RealNode()
    try:
        node.refused(access_doc(unsigned(body)), "access-unsigned", "unsigned_access")
        node.start("[helper]\nunsigned_access = true\n")
        result = node.ok(access_doc(unsigned(body)))
        assert result["signed"] is False and result["accounts"] == ["alice"]
        assert _file(node, acc.principals_path("alice")) == f"alice@{NODE}\n".encode()
        assert _file(node, acc.SSHD_CA) == (key + "\n").encode()
    finally:
        node.close()


def test_DLV_ACC_01_02_03_04_signed_spec_renders_own_principals_only(
    signed_node: RealNode, cp: ControlPlane
) -> None:
    """Root writes the CA keys, this node's own principals (`<account>@node-a` only: another node's and
    malformed ones are skipped) and a KRL, then the drop-in pointing at them, byte for byte what
    bcd_shared.access renders."""
    worker = cp.command.leaf()
    key = ca_key("ops CA")
    principals = (f"alice@{NODE}", "alice@node-b", "bob@node-b", f"carol@{NODE}", "nobody", f"Bad@{NODE}")
    body = access_body(NODE, 3, ca_keys=(key,), principals=principals, serials=(9, 7))
    result = signed_node.ok(access_doc(intent(worker, body)))
    assert result["accounts"] == ["alice", "carol"] and result["skipped_principals"] == 4
    want = acc.render([key], list(principals), [9, 7], NODE)
    for path, data in want.files.items():
        assert _file(signed_node, path) == data, path
    assert _file(signed_node, acc.principals_path("alice")) == f"alice@{NODE}\n".encode()
    assert _file(signed_node, acc.SSHD_CA) == (" ".join(key.split(" ")[:2]) + "\n").encode()
    assert _file(signed_node, acc.principals_path("bob")) is None
    assert _file(signed_node, acc.SSHD_DROPIN) == acc.DROPIN_TEXT.encode()
    krl = _file(signed_node, acc.SSHD_KRL)
    assert krl is not None and krl.startswith(acc.KRL_MAGIC)
    assert (9).to_bytes(8, "big") in krl and (7).to_bytes(8, "big") in krl


def test_issue9_item1_signed_access_is_bound_like_host_unit(signed_node: RealNode, cp: ControlPlane) -> None:
    """With roots: unsigned, another node's, a stranger root's, an older generation's and a tampered spec
    are all refused, and nothing is written."""
    worker = cp.command.leaf()
    key = ca_key()
    good = access_body(NODE, 5, ca_keys=(key,), principals=(f"alice@{NODE}",))
    signed_node.refused(access_doc(unsigned(good)), "bad-intent")
    signed_node.refused(access_doc(None), "intent-required")
    other = access_body("node-b", 6, ca_keys=(key,), principals=("alice@node-b",))
    signed_node.refused(access_doc(intent(worker, other)), "wrong-node")
    signed_node.refused(access_doc(intent(cp.other.leaf(), good)), "bad-intent")
    signed_node.refused(access_doc(intent(worker, good, flip=3)), "bad-intent")
    signed_node.ok(access_doc(intent(worker, good)))
    old = access_body(NODE, 4, ca_keys=(key,), principals=(f"root@{NODE}",))
    signed_node.refused(access_doc(intent(worker, old)), "stale-generation")
    # A host.unit spec moves the same generation: access cannot go back below it either.
    signed_node.ok(host_unit_doc("sysctl", S10, intent(worker, host_body(NODE, 8, {"sysctl": S10}))))
    signed_node.refused(access_doc(intent(worker, access_body(NODE, 7, ca_keys=(key,)))), "stale-generation")


def test_issue9_item1_uid0_account_gets_no_principals_file_unless_root_says_so(cp: ControlPlane) -> None:
    def setup(root: Path) -> None:
        cp.write_record(root, NODE, cp.bundle(1))
        passwd = root / "etc/passwd"
        passwd.write_text(
            "root:x:0:0:root:/root:/bin/sh\ntoor:x:0:0::/root:/bin/sh\nalice:x:1001:1001::/:/bin/sh\n"
        )

    worker = cp.command.leaf()
    node = RealNode(cp.config_lines(), setup=setup)
    try:
        for account in ("root", "toor"):
            body = access_body(
                NODE, 2, ca_keys=(ca_key(),), principals=(f"alice@{NODE}", f"{account}@{NODE}")
            )
            node.refused(access_doc(intent(worker, body)), "root-principal", account)
        node.start(cp.config_lines() + "[helper]\nroot_principals = true\n")
        body = access_body(NODE, 2, ca_keys=(ca_key(),), principals=(f"toor@{NODE}",))
        node.ok(access_doc(intent(worker, body)))
        assert _file(node, acc.principals_path("toor")) == f"toor@{NODE}\n".encode()
    finally:
        node.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("principal", f"alice\u00a0x@{NODE}"),
        ("principal", f"alice\u2003x@{NODE}"),
        ("principal", f"alice@{NODE}\u0085"),
        ("principal", f"alice@{NODE}\nroot@{NODE}"),
        ("principal", f"alice x@{NODE}"),
        ("ca", "\u00a0"),
        ("ca", "\u2003"),
        ("ca", "\u2028"),
        ("ca", "\nssh-ed25519 AAAA"),
    ],
)
def test_DLV_ACC_09_10_11_issue9_item2_no_non_ascii_or_control_byte_reaches_sshd(
    signed_node: RealNode, cp: ControlPlane, field: str, value: str
) -> None:
    """U+00A0 / U+2003 (whitespace to Python's str.split, not to sshd), C1 controls, line separators,
    newlines and plain whitespace in a principal or a CA key make the whole section invalid: refused,
    nothing written, nothing stripped."""
    worker = cp.command.leaf()
    if field == "principal":
        body = access_body(NODE, 2, ca_keys=(ca_key(),), principals=(value,))
    else:
        key = ca_key()
        kind, data = key.split(" ")[:2]
        body = access_body(
            NODE, 2, ca_keys=(f"{kind}{value}{data}" if value.strip() else f"{kind} {data} x{value}y",)
        )
    signed_node.refused(access_doc(intent(worker, body)), "invalid-access")


def test_DLV_ACC_10_ca_key_must_be_exactly_one_openssh_key(signed_node: RealNode, cp: ControlPlane) -> None:
    worker = cp.command.leaf()
    ed = ca_key().split(" ")[1]
    for bad in (
        f"ssh-rsa {ed}",
        "ssh-ed25519 notbase64!",
        "ssh-dss AAAAB3NzaC1kc3M=",
        "ssh-ed25519",
        ed,
    ):
        body = access_body(NODE, 2, ca_keys=(bad,))
        signed_node.refused(access_doc(intent(worker, body)), "invalid-access")


def test_DLV_ACC_05_06_reload_only_on_dropin_change_and_empty_section_removes_all(cp: ControlPlane) -> None:
    def setup(root: Path) -> None:
        cp.write_record(root, NODE, cp.bundle(1))
        unit = root / "lib/systemd/system/ssh.service"
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text("[Service]\nExecStart=/usr/sbin/sshd -D\n")
        state = root / "var/lib/bcd-sim/systemd/units.json"
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps({"ssh.service": {"active": True, "enabled": True, "properties": {}}}))

    worker = cp.command.leaf()
    node = RealNode(cp.config_lines(), setup=setup)
    log = node.root / "var/lib/bcd-sim/systemd/log"
    try:
        first = access_body(NODE, 2, ca_keys=(ca_key(),), principals=(f"alice@{NODE}",))
        assert node.ok(access_doc(intent(worker, first)))["reloaded"] == "ssh.service"
        assert log.read_text().count("reload ssh.service") == 1
        # New CA key, principals and serials: the drop-in is the same, so no reload (sshd reads the
        # files at every login).
        second = access_body(NODE, 3, ca_keys=(ca_key(),), principals=(f"bob@{NODE}",), serials=(4,))
        result = node.ok(access_doc(intent(worker, second)))
        assert result["reloaded"] == "" and acc.principals_path("alice") in result["removed"]
        assert log.read_text().count("reload ssh.service") == 1
        assert _file(node, acc.principals_path("bob")) == f"bob@{NODE}\n".encode()
        # An empty section removes everything and reloads (the drop-in went away).
        result = node.ok(access_doc(intent(worker, access_body(NODE, 4, empty=True))))
        assert result["reloaded"] == "ssh.service"
        for path in (acc.SSHD_DROPIN, acc.SSHD_CA, acc.SSHD_KRL, acc.principals_path("bob")):
            assert _file(node, path) is None, path
        # Same again: nothing to do.
        result = node.ok(access_doc(intent(worker, access_body(NODE, 4, empty=True))))
        assert (result["written"], result["removed"], result["reloaded"]) == ([], [], "")
    finally:
        node.close()


def test_issue9_item9_pin_without_join_record_fails_closed(cp: ControlPlane) -> None:
    """`join_signing_key_pin` set, no join record yet: an unsigned host.unit and an unsigned access.apply
    (even with unsigned_access on) are refused; signing is expected."""
    node = RealNode(cp.config_lines())
    try:
        node.refused(host_unit_doc("sysctl", S10, None), "join-record-required")
        node.start(cp.config_lines() + "[helper]\nunsigned_access = true\n")
        body = access_body(NODE, 1, ca_keys=(ca_key(),), principals=(f"alice@{NODE}",))
        node.refused(access_doc(unsigned(body)), "join-record-required")
        # Once the record exists, signed specs apply.
        cp.write_record(node.root, NODE, cp.bundle(1))
        worker = cp.command.leaf()
        node.ok(host_unit_doc("sysctl", S10, intent(worker, host_body(NODE, 1, {"sysctl": S10}))))
    finally:
        node.close()
