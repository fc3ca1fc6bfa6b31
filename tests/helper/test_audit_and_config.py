"""The audit log's chain, rotation and CLI; root's config decoding. Covers HST-SIGN-05, HST-SIGN-13,
HST-K8S-54, HST-K8S-55, HST-HLP-20, HST-HLP-31."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bcd_helper.audit import AuditLog, _sealed_line, canonical, seal, verify_chain
from bcd_helper.config import ConfigError, parse_config
from hypothesis import given, settings
from hypothesis import strategies as st

KEYS: dict[Path, str] = {}


def _log(root: Path, n: int, **kw: int) -> Path:
    log = AuditLog(root, "/var/log/bcd-helper", syslog=False, **kw)
    if log.created_key:
        KEYS[root] = log.created_key
    for i in range(n):
        log.record(
            peer_pid=100 + i,
            peer_uid=0,
            op="file.write" if i % 2 else "slice.apply",
            args={"i": i},
            args_sha256="0" * 64,
            decision="accepted" if i % 3 else "refused",
            reason="",
            message="",
            duration_ms=1.0,
        )
    return root / "var/log/bcd-helper"


def test_chain_verifies_and_survives_a_restart(fresh_root: Path) -> None:
    d = _log(fresh_root, 5)
    _log(fresh_root, 3)  # a new process continues the chain
    assert verify_chain(d).ok and verify_chain(d).lines == 8
    assert oct((d / "audit.log").stat().st_mode & 0o777) == "0o600"
    assert oct(d.stat().st_mode & 0o777) == "0o700"


def test_edited_removed_and_reordered_lines_are_found(fresh_root: Path) -> None:
    d = _log(fresh_root, 6)
    path = d / "audit.log"
    original = path.read_bytes()
    lines = original.split(b"\n")[:-1]
    edited = list(lines)
    edited[2] = edited[2].replace(b'"peer_pid":102', b'"peer_pid":999')
    path.write_bytes(b"\n".join(edited) + b"\n")
    result = verify_chain(d)
    assert not result.ok and "audit.log line 4" in result.problem
    path.write_bytes(b"\n".join(lines[:3] + lines[4:]) + b"\n")
    assert "audit.log line 4" in verify_chain(d).problem
    path.write_bytes(b"\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + b"\n")
    assert "audit.log line 2" in verify_chain(d).problem
    path.write_bytes(b"\n".join(lines[:-1]) + b"\n")  # the last line removed
    assert "last line" in verify_chain(d).problem
    path.write_bytes(original)
    assert verify_chain(d).ok


def test_rotation_keeps_the_chain(fresh_root: Path) -> None:
    d = _log(fresh_root, 30, max_bytes=2000)
    assert (d / "audit.log.1").exists() and (d / "audit.log.2").exists()
    anchors = [json.loads(x) for p in d.glob("audit.log*") for x in p.read_bytes().splitlines()]
    anchors = [e for e in anchors if e["op"] == "(anchor)"]
    assert anchors and verify_chain(d).ok and verify_chain(d).lines == 30 + len(anchors)
    first_new = json.loads((d / "audit.log").read_bytes().split(b"\n")[0])
    assert first_new["prev"] != "0" * 64 and first_new["op"] == "(anchor)"


def test_audit_cli_show_and_verify(fresh_root: Path) -> None:
    _log(fresh_root, 6)
    base = [
        sys.executable,
        "-m",
        "bcd_helper.cli",
        "audit",
        "--root",
        str(fresh_root),
        "--dir",
        "/var/log/bcd-helper",
    ]
    out = subprocess.run([*base, "verify", "--key", KEYS[fresh_root]], capture_output=True, text=True)
    assert out.returncode == 0 and "6 entries" in out.stdout
    shown = subprocess.run(
        [*base, "show", "--op", "file.write", "--decision", "refused", "--json"],
        capture_output=True,
        text=True,
    )
    entries = [json.loads(x) for x in shown.stdout.splitlines()]
    assert entries and all(e["op"] == "file.write" and e["decision"] == "refused" for e in entries)
    later = subprocess.run([*base, "show", "--since", "2999-01-01T00:00:00Z"], capture_output=True, text=True)
    assert later.stdout == ""
    log = fresh_root / "var/log/bcd-helper/audit.log"
    log.write_bytes(log.read_bytes().replace(b'"peer_pid":101', b'"peer_pid":7'))
    bad = subprocess.run([*base, "verify", "--key", KEYS[fresh_root]], capture_output=True, text=True)
    assert bad.returncode == 1 and "audit.log line 2" in bad.stderr  # the edited line: its seal


PIN = "a" * 64
CLUSTER = f"https://10.0.0.1:6443#sha256:{'b' * 64},https://K8s.Example.com#sha256:{'c' * 64}"


def test_config_decodes_the_helpers_keys() -> None:
    cfg = parse_config(
        f'command_root_sha256 = "{PIN},{"c" * 64}"\ndata_dir = "/var/lib/bcd"\n[host]\nunits = false\n'
        f'[helper]\nnode_uid = 900\ninstance_bridges = "br0, virbr1"\n'
        f'[kubernetes]\nallowed_clusters = "{CLUSTER}"\n'
        '[control_plane]\naddress = "gw.example.com:7443"\n'.encode()
    )
    assert cfg.command_root_sha256 == (PIN, "c" * 64) and cfg.host_units is False
    assert cfg.node_uid == 900 and cfg.node_gid == 900 and cfg.instance_bridges == ("br0", "virbr1")
    assert [str(c) for c in cfg.allowed_clusters] == [
        f"https://10.0.0.1:6443#sha256:{'b' * 64}",
        f"https://k8s.example.com:443#sha256:{'c' * 64}",
    ]


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('command_root_sha256 = "ABC"', "command_root_sha256"),
        (f'command_root_sha256 = "{",".join([PIN] * 2)}"', "command_root_sha256"),
        ("command_root_sha256 = " + '"' + ",".join(f"{i:064x}" for i in range(17)) + '"', "at most 16"),
        ('join_signing_key_pin = "sha256/xyz"', "join_signing_key_pin"),
        ("command_root_sha265 = 1", "command_root_sha265: unknown key"),
        ("[host]\nunits = 1", "[host] units"),
        ("[host]\nunit = true", "[host] unit: unknown key"),
        ('[helper]\nnode_uid = "900"', "[helper] node_uid"),
        ("[helper]\nnode_uid = 900\nsockets = 1", "[helper] sockets: unknown key"),
        ('[helper]\nnode_uid = 900\ninstance_bridges = "br 0"', "[helper] instance_bridges"),
        (
            '[helper]\nnode_uid = 900\n[kubernetes]\nallowed_clusters = "http://x#sha256:00"',
            "[kubernetes] allowed_clusters",
        ),
        ('[helper]\nnode_user = "no-such-user-here"', "[helper] node_user"),
        ("log_level = 'debug'", "log_level: unknown key at the top level"),
        ("[control_plane]\nanything = 1", r"\[control_plane\] anything: unknown key"),
        ('[host]\nsysctl_allow = ""', r"\[host\] sysctl_allow: is empty"),
        ('[host]\nsysctl_allow = "vm.swappiness, Kernel.x"', r"\[host\] sysctl_allow: entry 'Kernel.x'"),
        ("[helper]\nnode_uid = 900\naudit_keep = 0", r"\[helper\] audit_keep"),
        ("[helper]\nnode_uid = 900\naudit_max_bytes = 100", r"\[helper\] audit_max_bytes"),
        ('[helper]\nnode_uid = 900\nroot_socket = "/run/bcd/helper.sock"', r"\[helper\] root_socket"),
        ("x = [", "not valid TOML"),
    ],
)
def test_HST_SIGN_13_a_malformed_value_stops_the_helper_naming_the_key(text: str, names: str) -> None:
    if "[helper]" not in text:
        text += "\n[helper]\nnode_uid = 900\n"
    with pytest.raises(ConfigError, match=names if "\\[" in names else names.replace("[", r"\[")) as info:
        parse_config(text.encode())
    assert str(info.value).startswith("/etc/bcd/config.toml: ")  # names the file


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(args=st.dictionaries(st.text(max_size=6), _JSONISH, max_size=4), text=st.text(max_size=12))
def test_a_sealed_line_is_the_canonical_entry_with_its_mac(args: dict[str, object], text: str) -> None:
    """The writer encodes an entry once and splices `mac` in; `verify` re-encodes the whole entry: both must
    give the same bytes whatever the values hold (keys sorting around "mac", quotes, `"mac":` in text)."""
    key = bytes(range(32))
    entry = {
        "seq": 7,
        "time": text,
        "peer_pid": 1,
        "peer_uid": 0,
        "op": text + '","mac":"',
        "args": args,
        "args_sha256": "0" * 64,
        "decision": "accepted",
        "reason": text,
        "message": text,
        "duration_ms": 1.5,
        "prev": "0" * 64,
    }
    assert _sealed_line(key, entry) == canonical({**entry, "mac": seal(key, canonical(entry))})


@pytest.mark.parametrize(
    "args",
    [
        {"message": "x"},
        {"a": {"message": ',"message":"'}, "z": [{"message": 1}]},
        {"kind": ',"message":', "id": '"message"'},
        {"a": 1, "message": "x"},  # a `,"message":` of the shown arguments' own, before the entry's
    ],
)
@pytest.mark.parametrize("extra", [{}, {"mad": 1}, {"mab": "m"}, {"zz": {"message": 2}}])
def test_a_sealed_line_puts_mac_at_its_sorted_place_whatever_message_keys_args_hold(
    args: dict[str, object], extra: dict[str, object]
) -> None:
    """`mac` is spliced in before the top-level `message`: a `message` key or text inside the shown arguments
    (before it) or another entry's keys sorting between `mac` and `message` must not move it."""
    key = bytes(range(32))
    entry: dict[str, object] = {
        "seq": 7,
        "time": "t",
        "peer_pid": 1,
        "peer_uid": 0,
        "op": ',"message":"',
        "args": args,
        "args_sha256": "0" * 64,
        "decision": "accepted",
        "reason": ',"message":',
        "message": ',"message":"x',
        "duration_ms": 1.5,
        "prev": "0" * 64,
        **extra,
    }
    assert _sealed_line(key, entry) == canonical({**entry, "mac": seal(key, canonical(entry))})
    without = {k: v for k, v in entry.items() if k != "message"}
    assert _sealed_line(key, without) == canonical({**without, "mac": seal(key, canonical(without))})
