"""The audit log in process: the line format, the sealing key's evolution, rotation and pruning, every
problem `verify_chain` names (word for word) and the `bcd helper audit` CLI called as a function.

test_audit_and_config.py and the real-helper tests check the same log end to end; these are fast and
each rule's edge is here, so mutation testing sees them (docs/mutation.md)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import errno
import hashlib
import hmac
import json
import os
import re
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
from bcd_helper import audit
from bcd_helper.audit import (
    ANCHOR_OP,
    GENESIS,
    HEAD_NAME,
    KEY_NAME,
    LOG_NAME,
    AuditError,
    AuditLog,
    VerifyResult,
    canonical,
    evolve,
    format_key,
    parse_key,
    seal,
    verify_chain,
)
from bcd_shared.rootpath import RootPathRefused

DIR = "/var/log/bcd-helper"
SEAL = "its seal does not verify with this key (edited or forged, or another key)"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "host"
    r.mkdir(mode=0o755)
    return r


def adir(root: Path) -> Path:
    return root / DIR.lstrip("/")


def write(log: AuditLog, n: int, start: int = 0, **kw: Any) -> None:
    for i in range(start, start + n):
        fields: dict[str, Any] = {
            "peer_pid": 100 + i,
            "peer_uid": 4242,
            "op": "file.write",
            "args": {"i": i},
            "args_sha256": "0" * 64,
            "decision": "accepted",
            "reason": "",
            "message": f"m{i}",
            "duration_ms": 1.23456,
        }
        fields.update(kw)
        log.record(**fields)


def new_log(root: Path, **kw: Any) -> AuditLog:
    return AuditLog(root, DIR, syslog=False, **kw)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_bytes().splitlines()]


# --- primitives -----------------------------------------------------------------------------------------


def test_canonical_json_is_sorted_compact_ascii() -> None:
    assert canonical({"b": 1, "a": ["é", None]}) == b'{"a":["\\u00e9",null],"b":1}'


def test_the_key_evolves_by_a_tagged_sha256_and_seals_by_hmac() -> None:
    key = bytes(range(32))
    assert evolve(key) == hashlib.sha256(b"bcd-audit-evolve\0" + key).digest()
    assert seal(key, b"body") == hmac.new(key, b"body", hashlib.sha256).hexdigest()
    assert audit.line_hash(b"x") == hashlib.sha256(b"x").hexdigest()


def test_a_verification_key_reads_bcdk1_seq_hex() -> None:
    key = bytes(range(32))
    text = format_key(12, key)
    assert text == f"bcdk1-12-{key.hex()}"
    assert parse_key(text) == (12, key)
    assert parse_key(f"  {text}\n") == (12, key)
    assert parse_key(f"bcdk1-{'9' * 19}-{key.hex()}") == (int("9" * 19), key)


@pytest.mark.parametrize(
    "text",
    [
        f"bcdk1-0-{'a' * 64}",
        f"bcdk1-01-{'a' * 64}",
        f"bcdk1-{'9' * 20}-{'a' * 64}",
        f"bcdk1-1-{'A' * 64}",
        f"bcdk1-1-{'a' * 63}",
        f"bcdk1-1-{'a' * 65}",
        f"bcdk2-1-{'a' * 64}",
        f"xbcdk1-1-{'a' * 64}",
        f"bcdk1-1-{'a' * 64}x",
    ],
)
def test_a_bad_verification_key_is_refused(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_key(text)
    assert str(info.value) == "a verification key reads bcdk1-<seq>-<64 hex digits>"


def test_times_are_utc_rfc3339_with_microseconds() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", audit._now())


def test_rotated_files_are_numbered_without_leading_zeros(root: Path) -> None:
    d = adir(root)
    d.mkdir(parents=True)
    for name in ["audit.log", "audit.log.1", "audit.log.10", "audit.log.2", "audit.log.01", "audit.log.x"]:
        (d / name).write_bytes(b"")
    (d / "audit.logs.3").write_bytes(b"")
    (d / "audit.log.").write_bytes(b"")
    fd = os.open(d, os.O_RDONLY)
    try:
        assert audit._rotated(fd) == [1, 2, 10]
    finally:
        os.close(fd)
    assert [p.name for p in audit.log_files(d)] == [
        "audit.log.10",
        "audit.log.2",
        "audit.log.1",
        "audit.log.01",
        "audit.log",
    ]


def test_seq_of_a_line() -> None:
    assert audit._seq_of(None) is None
    assert audit._seq_of(b'{"seq": 7}') == 7
    assert audit._seq_of(b"{") is None
    assert audit._seq_of(b'{"q": 1}') is None
    assert audit._seq_of(b"[1]") is None
    assert audit._seq_of(b'{"seq": "x"}') is None


def test_first_and_last_lines_of_a_file(root: Path) -> None:
    d = root / "d"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY)
    try:
        assert audit._first_line(fd, "none") is None and audit._last_line(fd, "none") is None
        (d / "empty").write_bytes(b"")
        assert audit._first_line(fd, "empty") is None and audit._last_line(fd, "empty") is None
        (d / "one").write_bytes(b"only\n")
        assert audit._first_line(fd, "one") == b"only" and audit._last_line(fd, "one") == b"only"
        (d / "nonl").write_bytes(b"a\nb")
        assert audit._last_line(fd, "nonl") == b"b"
        big = b"".join(b"%06d" % i + b"x" * 993 + b"\n" for i in range(200))  # 200 KB, lines of 1000
        (d / "big").write_bytes(big)
        assert audit._first_line(fd, "big") == b"000000" + b"x" * 993
        assert audit._last_line(fd, "big") == b"000199" + b"x" * 993
        long = b"first\n" + b"y" * 150_000 + b"\n"  # a last line longer than one read
        (d / "long").write_bytes(long)
        assert audit._last_line(fd, "long") == b"y" * 150_000
        (d / "blank").write_bytes(b"a\n\n\n")
        assert audit._last_line(fd, "blank") == b"a"
    finally:
        os.close(fd)


# --- the key state --------------------------------------------------------------------------------------


def test_a_new_log_makes_its_sealing_key_once(root: Path) -> None:
    log = new_log(root)
    d = adir(root)
    assert log.created_key is not None
    seq, key = parse_key(log.created_key)
    assert seq == 1
    assert (d / KEY_NAME).read_bytes() == b"bcd-audit-key-state v1 %020d %s\n" % (1, key.hex().encode())
    assert os.stat(d / KEY_NAME).st_mode & 0o777 == 0o600
    assert os.stat(d).st_mode & 0o777 == 0o700
    log.close()
    again = new_log(root)
    assert again.created_key is None
    again.close()


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"bcd-audit-key-state v1 %020d %s\n" % (0, b"a" * 64),
        b"bcd-audit-key-state v1 %020d %s" % (1, b"a" * 64),
        b"bcd-audit-key-state v2 %020d %s\n" % (1, b"a" * 64),
        b"bcd-audit-key-state v1 %019d %s\n" % (1, b"a" * 64),
        b"bcd-audit-key-state v1 %020d %s\n" % (1, b"A" * 64),
    ],
)
def test_a_key_state_that_is_not_one_stops_the_log(root: Path, content: bytes) -> None:
    d = adir(root)
    d.mkdir(parents=True, mode=0o700)
    (d / KEY_NAME).write_bytes(content)
    with pytest.raises(AuditError) as info:
        new_log(root)
    assert str(info.value) == f"{KEY_NAME}: not a sealing key state; the sealing cannot go on"


def test_a_key_state_ahead_of_the_log_means_lines_were_removed(root: Path) -> None:
    log = new_log(root)
    write(log, 3)
    log.close()
    path = adir(root) / LOG_NAME
    path.write_bytes(b"\n".join(path.read_bytes().splitlines()[:2]) + b"\n")
    with pytest.raises(AuditError) as info:
        new_log(root)
    assert str(info.value) == f"{KEY_NAME} is at seq 4 but the log ends at seq 2: lines were removed"


def test_a_lagging_key_state_is_evolved_to_the_next_line(root: Path) -> None:
    log = new_log(root)
    assert log.created_key is not None
    write(log, 2)
    lagging = (adir(root) / KEY_NAME).read_bytes()
    write(log, 3, start=2)
    log.close()
    (adir(root) / KEY_NAME).write_bytes(lagging)  # a crash before the key file's rewrite reached disk
    again = new_log(root)
    write(again, 2, start=5)
    again.close()
    result = verify_chain(adir(root), log.created_key)
    assert result == VerifyResult(True, 7, "", 1, 7)


def test_init_key_starts_at_the_line_after_the_newest(root: Path) -> None:
    assert audit.init_key(root, DIR) is not None
    assert audit.init_key(root, DIR) is None
    d = adir(root)
    (d / KEY_NAME).unlink()
    log = new_log(root)  # makes one nobody holds
    write(log, 4)
    log.close()
    (d / KEY_NAME).unlink()
    key = audit.init_key(root, DIR)
    assert key is not None and parse_key(key)[0] == 5
    (d / KEY_NAME).unlink()
    os.rename(d / LOG_NAME, d / f"{LOG_NAME}.1")
    key = audit.init_key(root, DIR)
    assert key is not None and parse_key(key)[0] == 5


# --- appending ------------------------------------------------------------------------------------------


def test_a_line_holds_the_fields_chained_and_sealed(root: Path) -> None:
    log = new_log(root)
    assert log.created_key is not None
    _, key = parse_key(log.created_key)
    assert log.head() == (0, GENESIS)
    digest = log.record(
        peer_pid=7,
        peer_uid=4242,
        op="file.write",
        args={"kind": "cdi"},
        args_sha256="ab" * 32,
        decision="refused",
        reason="bad-kind",
        message="no",
        duration_ms=1.23456,
    )
    raw = (adir(root) / LOG_NAME).read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    line = raw.rstrip(b"\n")
    assert digest == hashlib.sha256(line).hexdigest()
    entry = json.loads(line)
    assert canonical(entry) == line
    mac = entry.pop("mac")
    assert mac == seal(key, canonical(entry))
    time = entry.pop("time")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", time)
    assert entry == {
        "seq": 1,
        "peer_pid": 7,
        "peer_uid": 4242,
        "op": "file.write",
        "args": {"kind": "cdi"},
        "args_sha256": "ab" * 32,
        "decision": "refused",
        "reason": "bad-kind",
        "message": "no",
        "duration_ms": 1.235,
        "prev": GENESIS,
    }
    assert log.head() == (1, digest)
    assert (adir(root) / HEAD_NAME).read_bytes() == canonical({"seq": 1, "sha256": digest}) + b"\n"
    assert (adir(root) / KEY_NAME).read_bytes() == b"bcd-audit-key-state v1 %020d %s\n" % (
        2,
        evolve(key).hex().encode(),
    )
    assert os.stat(adir(root) / LOG_NAME).st_mode & 0o777 == 0o600
    write(log, 1)
    second = lines(adir(root) / LOG_NAME)[1]
    assert second["seq"] == 2 and second["prev"] == digest
    mac2 = second.pop("mac")
    assert mac2 == seal(evolve(key), canonical(second))
    log.close()


def test_a_restart_continues_the_chain_from_the_newest_line(root: Path) -> None:
    log = new_log(root)
    write(log, 3)
    head = log.head()
    log.close()
    again = new_log(root)
    assert again.head() == head
    write(again, 1)
    assert lines(adir(root) / LOG_NAME)[3]["prev"] == head[1]
    again.close()


@pytest.mark.parametrize("left", [None, b""], ids=["audit.log-missing", "audit.log-empty"])
def test_a_restart_after_a_rotation_reads_the_rotated_file_and_writes_the_missing_anchor(
    root: Path, left: bytes | None
) -> None:
    """A crash between the rotation's rename and its anchor (audit.log not there yet, or created and
    empty): the next start reads the rotated file's last line and writes the anchor then, so the new
    audit.log starts with one and verify holds."""
    log = new_log(root)
    key = log.created_key
    write(log, 3)
    _seq, digest = log.head()
    log.close()
    os.rename(adir(root) / LOG_NAME, adir(root) / f"{LOG_NAME}.1")
    if left is not None:
        (adir(root) / LOG_NAME).write_bytes(left)
        os.chmod(adir(root) / LOG_NAME, 0o600)
    again = new_log(root)
    assert again.head()[0] == 4
    (anchor,) = lines(adir(root) / LOG_NAME)
    assert (anchor["seq"], anchor["op"], anchor["decision"], anchor["prev"]) == (
        4,
        "(anchor)",
        "anchor",
        digest,
    )
    assert anchor["args"] == {"previous_last_seq": 3, "oldest_seq": 1, "files": 1}
    write(again, 1)
    again.close()
    assert verify_chain(adir(root), key) == VerifyResult(True, 5, "", 1, 5)


def test_the_head_file_shrinks_with_its_content(root: Path) -> None:
    log = new_log(root)
    write(log, 10)
    head = (adir(root) / HEAD_NAME).read_bytes()
    assert json.loads(head) == {"seq": 10, "sha256": log.head()[1]} and head.count(b"\n") == 1
    log.close()


# --- rotation -------------------------------------------------------------------------------------------


def test_rotation_starts_a_file_with_an_anchor_that_chains_on(root: Path) -> None:
    log = new_log(root, max_bytes=1000)
    assert log.created_key is not None
    write(log, 4)  # each line is ~400 bytes: the third line starts audit.log.1's successor
    d = adir(root)
    assert audit.log_files(d) == [d / f"{LOG_NAME}.1", d / LOG_NAME]
    old, new = lines(d / f"{LOG_NAME}.1"), lines(d / LOG_NAME)
    assert [e["seq"] for e in old] == [1, 2, 3]
    anchor = new[0]
    assert anchor["op"] == ANCHOR_OP and anchor["decision"] == "anchor" and anchor["reason"] == "rotated"
    assert anchor["args"] == {"previous_last_seq": 3, "oldest_seq": 1, "files": 1}
    assert anchor["args_sha256"] == hashlib.sha256(canonical(anchor["args"])).hexdigest()
    assert (anchor["peer_pid"], anchor["peer_uid"], anchor["message"], anchor["duration_ms"]) == (
        os.getpid(),
        0,
        "",
        0.0,
    )
    assert anchor["prev"] == hashlib.sha256(raw_lines(d, f"{LOG_NAME}.1")[-1]).hexdigest()
    assert [e["seq"] for e in new] == [4, 5]
    assert verify_chain(d, log.created_key) == VerifyResult(True, 5, "", 1, 5)
    log.close()


def test_rotated_files_are_kept_until_the_node_read_past_them(root: Path) -> None:
    log = new_log(root, max_bytes=600, keep=2)
    write(log, 12)
    d = adir(root)
    held = len(audit.log_files(d)) - 1
    assert held > 2  # nothing exported: nothing removed
    assert log.full is (held >= 2 * audit.HOLD_FACTOR)
    seq, sha = log.head()
    assert log.export() == {"seq": seq, "sha256": sha}
    assert log.head()[0] == seq + 1  # the anchor
    rotated = audit.log_files(d)[:-1]
    assert len(rotated) == 2  # pruned down to keep, behind a new anchor
    newest = lines(d / LOG_NAME)
    assert newest[0]["op"] == ANCHOR_OP
    oldest_first = lines(rotated[0])[0]
    assert newest[0]["args"]["oldest_seq"] == oldest_first["seq"]
    assert newest[0]["args"]["files"] == 2
    assert verify_chain(d, log.created_key).ok
    log.close()


def test_export_rotates_only_when_more_than_keep_are_held(root: Path) -> None:
    log = new_log(root, max_bytes=600, keep=3)
    write(log, 4)
    d = adir(root)
    before = len(audit.log_files(d))
    assert 1 < before - 1 <= 3
    seq, sha = log.head()
    assert log.export() == {"seq": seq, "sha256": sha}
    assert len(audit.log_files(d)) == before and log.head() == (seq, sha)  # no anchor written
    log.close()


def test_the_log_is_full_at_keep_times_the_hold_factor(root: Path) -> None:
    log = new_log(root, max_bytes=400, keep=1)
    d = adir(root)
    n = 0
    while len(audit.log_files(d)) - 1 < audit.HOLD_FACTOR - 1:
        write(log, 1, start=n)
        n += 1
    assert not log.full
    while len(audit.log_files(d)) - 1 < audit.HOLD_FACTOR:
        write(log, 1, start=n)
        n += 1
    assert log.full
    log.export()
    assert not log.full and len(audit.log_files(d)) - 1 == 1
    log.close()
    reopened = new_log(root, max_bytes=400, keep=1)
    assert not reopened.full
    reopened.close()


def test_a_rotated_file_is_pruned_only_when_its_last_line_was_exported(root: Path) -> None:
    log = new_log(root, max_bytes=600, keep=1)
    write(log, 3)
    d = adir(root)
    log.export()
    exported = log.head()[0]
    write(log, 8, start=3)
    assert len(audit.log_files(d)) - 1 > 1
    kept = audit.log_files(d)[0]
    assert lines(kept)[-1]["seq"] > exported
    log.close()


# --- verify_chain ---------------------------------------------------------------------------------------


@pytest.fixture
def sealed(root: Path) -> tuple[Path, str]:
    log = new_log(root)
    assert log.created_key is not None
    write(log, 5)
    log.close()
    return adir(root), log.created_key


def raw_lines(d: Path, name: str = LOG_NAME) -> list[bytes]:
    return (d / name).read_bytes().splitlines()


def put(d: Path, rows: list[bytes], name: str = LOG_NAME) -> None:
    (d / name).write_bytes(b"".join(r + b"\n" for r in rows))


def reseal(entry: dict[str, Any]) -> bytes:
    return canonical(entry)


def test_an_intact_log_verifies(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    assert verify_chain(d, key) == VerifyResult(True, 5, "", 1, 5)
    assert verify_chain(d) == VerifyResult(True, 5, "", 1, 5)


def test_verify_names_a_bad_key_and_missing_files(root: Path, sealed: tuple[Path, str]) -> None:
    d, _ = sealed
    assert verify_chain(d, "nope") == VerifyResult(
        False, 0, "--key: a verification key reads bcdk1-<seq>-<64 hex digits>"
    )
    assert verify_chain(root / "nowhere") == VerifyResult(
        False, 0, f"{root / 'nowhere'}: no such audit directory"
    )
    (d / HEAD_NAME).unlink()
    assert verify_chain(d) == VerifyResult(False, 5, f"{HEAD_NAME} is missing", 1, 5)
    (d / LOG_NAME).unlink()
    assert verify_chain(d) == VerifyResult(
        False, 0, f"{LOG_NAME} is missing (nothing written since `audit init`, or deleted)"
    )


def test_verify_names_an_empty_log(root: Path) -> None:
    new_log(root).close()
    (adir(root) / LOG_NAME).write_bytes(b"")
    assert verify_chain(adir(root)) == VerifyResult(False, 0, f"{LOG_NAME} holds no entries")


def test_verify_names_a_gap_between_rotated_files(sealed: tuple[Path, str]) -> None:
    d, _ = sealed
    (d / f"{LOG_NAME}.2").write_bytes(b"")
    assert verify_chain(d) == VerifyResult(False, 0, f"{LOG_NAME}.1 is missing (a gap between rotated files)")
    (d / f"{LOG_NAME}.1").write_bytes(b"")
    (d / f"{LOG_NAME}.4").write_bytes(b"")
    assert verify_chain(d) == VerifyResult(False, 0, f"{LOG_NAME}.3 is missing (a gap between rotated files)")


@pytest.mark.parametrize(
    "bad",
    [
        b"not json",
        b"[]",
        b'{"seq": 1}',
        b'{"prev": "x"}',
        b'{"seq": "1", "prev": "x"}',
        b'{"seq": 1, "prev": 2}',
    ],
)
def test_verify_names_a_line_that_is_not_an_entry(sealed: tuple[Path, str], bad: bytes) -> None:
    d, _ = sealed
    rows = raw_lines(d)
    rows[2] = bad
    put(d, rows)
    assert verify_chain(d) == VerifyResult(False, 2, f"{LOG_NAME} line 3: not an audit entry", 1, 2)


def test_verify_names_a_line_not_in_canonical_form(sealed: tuple[Path, str]) -> None:
    d, _ = sealed
    rows = raw_lines(d)
    rows[1] = json.dumps(json.loads(rows[1])).encode()
    put(d, rows)
    assert verify_chain(d) == VerifyResult(
        False, 1, f"{LOG_NAME} line 2: not in canonical form (edited)", 1, 1
    )


def test_verify_names_an_edited_line_by_the_next_ones_chain(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    rows = raw_lines(d)
    entry = json.loads(rows[1])
    entry["message"] = "forged"
    rows[1] = reseal(entry)
    put(d, rows)
    assert verify_chain(d) == VerifyResult(
        False,
        2,
        f"{LOG_NAME} line 3 (seq 3): does not chain to the line before it "
        "(that line was edited, or lines were removed or reordered)",
        1,
        2,
    )
    assert verify_chain(d, key) == VerifyResult(
        False,
        1,
        f"{LOG_NAME} line 2 (seq 2): {SEAL}",
        1,
        1,
    )


def test_verify_names_a_missing_or_wrong_mac(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    rows = raw_lines(d)
    entry = json.loads(rows[4])
    del entry["mac"]
    rows[4] = reseal(entry)
    put(d, rows)
    result = verify_chain(d, key)
    assert result.problem == (f"{LOG_NAME} line 5 (seq 5): {SEAL}")
    assert (result.lines, result.first_seq, result.last_seq) == (4, 1, 4)
    entry["mac"] = 7
    rows[4] = reseal(entry)
    put(d, rows)
    assert verify_chain(d, key).problem.startswith(f"{LOG_NAME} line 5 (seq 5): its seal does not verify")


def test_verify_with_another_key_names_the_first_line(sealed: tuple[Path, str]) -> None:
    d, _ = sealed
    other = format_key(1, bytes(32))
    assert verify_chain(d, other).problem.startswith(f"{LOG_NAME} line 1 (seq 1): its seal does not verify")


def test_verify_with_a_later_key_checks_only_from_its_seq(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    seq, k = parse_key(key)
    for _ in range(3):
        k = evolve(k)
    later = format_key(seq + 3, k)
    assert verify_chain(d, later) == VerifyResult(True, 5, "", 1, 5)
    rows = raw_lines(d)
    entry = json.loads(rows[1])
    entry["message"] = "edited before the key's seq"
    rows[1] = reseal(entry)
    put(d, rows)
    assert verify_chain(d, later).problem.startswith(f"{LOG_NAME} line 3 (seq 3): does not chain")


def test_verify_names_a_key_beyond_the_log(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    _, k = parse_key(key)
    assert verify_chain(d, format_key(9, k)) == VerifyResult(
        False, 5, "sealing starts at seq 9 but the log ends at seq 5", 1, 5
    )


def test_verify_names_removed_and_reordered_lines(sealed: tuple[Path, str]) -> None:
    d, _ = sealed
    rows = raw_lines(d)
    put(d, rows[:2] + rows[3:])
    assert verify_chain(d) == VerifyResult(
        False, 2, f"{LOG_NAME} line 3: seq 4 follows seq 2 (lines removed or reordered)"
    )
    put(d, rows[1:])
    assert verify_chain(d) == VerifyResult(
        False,
        0,
        f"{LOG_NAME} line 1 (seq 2): a file that does not start with an anchor "
        "(lines dropped, or files spliced)",
        0,
        0,
    )


def test_verify_names_a_first_line_that_does_not_start_the_chain(sealed: tuple[Path, str]) -> None:
    d, _ = sealed
    rows = raw_lines(d)
    entry = json.loads(rows[0])
    entry["prev"] = "1" * 64
    rows[0] = reseal(entry)
    put(d, rows)
    assert verify_chain(d) == VerifyResult(
        False, 0, f"{LOG_NAME} line 1: the first entry does not start the chain"
    )


def test_verify_names_the_last_line_removed_or_edited(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    rows = raw_lines(d)
    put(d, rows[:-1])
    assert verify_chain(d) == VerifyResult(
        False,
        4,
        f"the line {HEAD_NAME} records (seq 5) is missing or changed (newest: seq 4): "
        "the last line was edited or removed",
        1,
        4,
    )
    put(d, rows)
    (d / HEAD_NAME).write_bytes(b"{")
    assert verify_chain(d) == VerifyResult(False, 5, f"{HEAD_NAME}: unreadable", 1, 5)
    (d / HEAD_NAME).write_bytes(b'{"seq": 5}')
    assert verify_chain(d).problem == f"{HEAD_NAME}: unreadable"
    (d / HEAD_NAME).write_bytes(b'{"seq": [5], "sha256": "x"}')
    assert verify_chain(d).problem == f"{HEAD_NAME}: unreadable"
    lagging = {"seq": 4, "sha256": hashlib.sha256(rows[3]).hexdigest()}
    (d / HEAD_NAME).write_bytes(canonical(lagging))
    assert verify_chain(d, key).ok  # a head that lags after a crash is accepted while its line is there


def test_verify_checks_the_key_state_file(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    state = (d / KEY_NAME).read_bytes()
    (d / KEY_NAME).unlink()
    assert verify_chain(d) == VerifyResult(
        False,
        5,
        f"{KEY_NAME} is missing (the sealing key state; a new one would seal with a key no one holds)",
        1,
        5,
    )
    (d / KEY_NAME).write_bytes(b"junk")
    assert verify_chain(d) == VerifyResult(False, 5, f"{KEY_NAME}: not a sealing key state", 1, 5)
    (d / KEY_NAME).write_bytes(state.replace(b"%020d" % 6, b"%020d" % 7))
    assert verify_chain(d).problem == (
        f"{KEY_NAME} is at seq 7 but the log ends at seq 5: lines were cut from the end"
    )
    (d / KEY_NAME).write_bytes(state.replace(b"%020d" % 6, b"%020d" % 5))
    assert verify_chain(d).ok  # may lag; without the key its content is not checked
    assert verify_chain(d, key).problem == f"{KEY_NAME}: the key state at seq 5 is not this key's (replaced)"
    _, k = parse_key(key)
    for _ in range(4):
        k = evolve(k)
    (d / KEY_NAME).write_bytes(b"bcd-audit-key-state v1 %020d %s\n" % (5, k.hex().encode()))
    assert verify_chain(d, key).ok  # the lagging state holds exactly seq 5's key
    (d / KEY_NAME).write_bytes(state)
    seq6 = format_key(6, evolve(k))
    assert verify_chain(d, seq6) == VerifyResult(
        False, 5, "sealing starts at seq 6 but the log ends at seq 5", 1, 5
    )


def test_verify_checks_the_expected_head(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    rows = raw_lines(d)
    h3 = hashlib.sha256(rows[2]).hexdigest()
    assert verify_chain(d, key, (3, h3)) == VerifyResult(True, 5, "", 1, 5)
    assert verify_chain(d, key, (5, hashlib.sha256(rows[4]).hexdigest())).ok
    assert verify_chain(d, key, (3, "0" * 64)) == VerifyResult(
        False, 5, "the line at the expected head seq 3 was changed"
    )
    assert verify_chain(d, key, (6, h3)) == VerifyResult(
        False, 5, "the log ends at seq 5, before the expected head seq 6: lines removed"
    )


def test_verify_across_rotations_checks_anchors(root: Path) -> None:
    log = new_log(root, max_bytes=1000)
    assert log.created_key is not None
    write(log, 7)
    log.close()
    d = adir(root)
    key = log.created_key
    files = audit.log_files(d)
    assert len(files) >= 3
    ok = verify_chain(d, key)
    assert ok.ok and ok.first_seq == 1
    # an anchor inside a file
    newest = raw_lines(d)
    first_anchor = newest[0]
    total = sum(len(lines(f)) for f in files)
    last = lines(files[-1])[-1]["seq"]
    put(d, [*newest, first_anchor])
    assert verify_chain(d) == VerifyResult(
        False,
        total,
        f"{LOG_NAME} line {len(newest) + 1} (seq {json.loads(first_anchor)['seq']}): an anchor inside a file "
        "(lines dropped, or files spliced)",
        1,
        last,
    )
    put(d, newest)
    # the oldest file removed: audit.log.N missing is a gap only when in the middle; drop the oldest
    oldest = files[0]
    oldest_seq = lines(oldest)[0]["seq"]
    next_first = lines(files[1])[0]["seq"]
    kept = total - len(lines(oldest))
    oldest.unlink()
    assert verify_chain(d) == VerifyResult(
        False,
        kept,
        f"the oldest kept line is seq {next_first} but the last rotation kept seq {oldest_seq} on: "
        "older files were removed",
        next_first,
        last,
    )


def test_verify_names_an_anchor_that_names_the_wrong_previous_line(root: Path) -> None:
    log = new_log(root, max_bytes=1000)
    write(log, 4)
    log.close()
    d2 = adir(root)
    rows = raw_lines(d2)
    entry = json.loads(rows[0])
    assert entry["op"] == ANCHOR_OP
    entry["args"]["previous_last_seq"] = 1
    rows[0] = canonical(entry)
    put(d2, rows)
    before = len(raw_lines(d2, f"{LOG_NAME}.1"))
    assert verify_chain(d2) == VerifyResult(
        False, before, f"{LOG_NAME} line 1: the anchor names the wrong previous line"
    )


def test_verify_names_an_oldest_anchor_that_does_not_explain_its_seq(root: Path) -> None:
    log = new_log(root, max_bytes=1000)
    write(log, 4)
    log.close()
    d = adir(root)
    (d / f"{LOG_NAME}.1").unlink()
    rows = raw_lines(d)
    entry = json.loads(rows[0])
    seq = entry["seq"]
    entry["args"]["previous_last_seq"] = seq - 2
    rows[0] = canonical(entry)
    put(d, rows)
    assert verify_chain(d) == VerifyResult(
        False, 0, f"{LOG_NAME} line 1: the anchor does not explain seq {seq}"
    )


def test_a_chain_that_starts_with_a_kept_anchor_verifies(root: Path) -> None:
    log = new_log(root, max_bytes=600, keep=1)
    assert log.created_key is not None
    write(log, 10)
    log.export()
    write(log, 1, start=10)
    log.close()
    d = adir(root)
    result = verify_chain(d, log.created_key)
    assert result.ok and result.first_seq > 1
    assert verify_chain(d, log.created_key, (result.first_seq - 1, "0" * 64)) == VerifyResult(
        False,
        result.lines,
        f"the expected head seq {result.first_seq - 1} is older than the oldest kept line "
        f"(seq {result.first_seq})",
    )


# --- the CLI --------------------------------------------------------------------------------------------


def cli(root: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    args = parser.parse_args(["--root", str(root), "--dir", DIR, *argv])
    return audit.run(args)


def test_cli_init_prints_the_key_once(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(root, "init") == 0
    out = capsys.readouterr()
    m = re.fullmatch(
        r"audit verification key \(keep it off this host; it is not shown again\): (bcdk1-1-[0-9a-f]{64})\n",
        out.out,
    )
    assert m is not None
    assert cli(root, "init") == 1
    assert capsys.readouterr().err == (
        f"bcd helper audit: {DIR}/{KEY_NAME} exists: this log is sealed already "
        "(its verification key was printed when it was made)\n"
    )


def test_cli_verify(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(root, "init") == 0
    key = capsys.readouterr().out.rsplit(" ", 1)[-1].strip()
    log = new_log(root)
    write(log, 3)
    seq, sha = log.head()
    log.close()
    assert cli(root, "verify", "--key", key) == 0
    assert capsys.readouterr().out == "audit log intact: 3 entries, seq 1 to 3, sealed\n"
    assert cli(root, "verify", "--key", key, "--expect-head", f"{seq}:{sha}") == 0
    assert (
        capsys.readouterr().out
        == "audit log intact: 3 entries, seq 1 to 3, sealed and at the expected head\n"
    )
    assert cli(root, "verify") == 1
    assert capsys.readouterr().err == (
        "bcd helper audit: --key is required (the verification key printed at set-up); "
        "without it the chain cannot show what root changed\n"
    )
    for bad in ["3", f"x:{sha}", f"3:{sha[:-1]}", f"3:{sha.upper()}", f"{'1' * 20}:{sha}"]:
        assert cli(root, "verify", "--key", key, "--expect-head", bad) == 1
        assert (
            capsys.readouterr().err == "bcd helper audit: --expect-head: expected SEQ:HASH (64 hex digits)\n"
        )
    assert cli(root, "verify", "--key", key, "--expect-head", f"4:{sha}") == 1
    assert capsys.readouterr().err == (
        "bcd helper audit: audit log broken after 3 good entries: the log ends at seq 3, "
        "before the expected head seq 4: lines removed\n"
    )


def test_cli_names_a_directory_without_a_log(root: Path) -> None:
    from bcd_shared.subcommands import CliError

    with pytest.raises(CliError) as info:
        cli(root, "show")
    assert str(info.value) == f"{adir(root)}: no audit log here (is this the helper's audit_dir?)"


def test_cli_needs_no_node_account_but_refuses_a_bad_config(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`audit init` runs at set-up, maybe before the node's account exists (or under --root, where
    install.sh made it in DIR's passwd): before, a node_user unknown to this host's passwd stopped
    every audit command ("no account 'bcd' on this host"). The file is still validated whole."""
    from bcd_shared.subcommands import CliError

    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    cfg = root / "etc/bcd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('[helper]\nnode_user = "no-such-bcd-account"\naudit_dir = "/var/log/elsewhere"\n')
    os.chmod(cfg, 0o640)
    assert audit.run(parser.parse_args(["--root", str(root), "init"])) == 0
    assert capsys.readouterr().out.startswith("audit verification key")
    assert (root / "var/log/elsewhere/audit.key").is_file()
    cfg.write_text('[helper]\nnode_user = "no-such-bcd-account"\naudit_dirr = "/var/log/elsewhere"\n')
    with pytest.raises(CliError) as info:
        audit.run(parser.parse_args(["--root", str(root), "show"]))
    assert "[helper] audit_dirr: unknown key" in info.value.message


def test_cli_reads_the_directory_from_roots_config(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bcd_shared.subcommands import CliError

    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    args = parser.parse_args(["--root", str(root), "show"])
    with pytest.raises(CliError) as info:
        audit.run(args)
    assert str(info.value).endswith("(or name the audit directory with --dir)")
    cfg = root / "etc/bcd/config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('[helper]\nnode_uid = 4242\naudit_dir = "/var/log/elsewhere"\n')
    os.chmod(cfg, 0o640)
    log = AuditLog(root, "/var/log/elsewhere", syslog=False)
    write(log, 1)
    log.close()
    assert audit.run(parser.parse_args(["--root", str(root), "show", "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["seq"] == 1
    args = parser.parse_args(["--root", str(root), "show", "--config", "/etc/bcd/other.toml"])
    with pytest.raises(CliError):
        audit.run(args)


def test_cli_flags_before_the_subcommand_are_kept(root: Path) -> None:
    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    r, r2 = str(root), str(root.parent)  # --root must exist (bcd_shared.subcommands.root_dir)
    args = parser.parse_args(["--root", r, "--dir", "/d", "--config", "/c", "show"])
    assert (args.root, args.dir, args.config) == (r, "/d", "/c")
    args = parser.parse_args(["show", "--root", r2])
    assert (args.root, args.dir, args.config) == (r2, None, "/etc/bcd/config.toml")
    args = parser.parse_args(["verify"])
    assert (args.root, args.key, args.expect_head) == ("/", None, None)


def test_cli_show_filters_and_escapes(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = new_log(root)
    write(log, 2, op="file.write", decision="accepted")
    write(log, 1, start=2, op="slice.apply", decision="refused", reason="bad", message="line\nforged #9")
    write(log, 1, start=3, op="evil\u2028op", decision="failed")
    log.close()
    d = adir(root)
    written = lines(d / LOG_NAME)
    # a line that is not JSON and one whose time does not parse are skipped by show
    with (d / LOG_NAME).open("ab") as f:
        f.write(b"garbage\n")
        f.write(canonical({"seq": 99, "time": "not a time", "op": "x"}) + b"\n")
    assert cli(root, "show") == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4
    first = written[0]
    assert out[0] == (f"{first['time']} #1 uid=4242 pid=100 file.write accepted  {json.dumps({'i': 0})} m0")
    assert out[2].endswith('slice.apply refused bad {"i": 2} line\\nforged #9')
    assert " evil\\u2028op failed " in out[3]
    assert cli(root, "show", "--op", "slice.apply") == 0
    assert capsys.readouterr().out.count("\n") == 1
    assert cli(root, "show", "--decision", "accepted", "--json") == 0
    shown = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [e["seq"] for e in shown] == [1, 2]
    when = dt.datetime.fromisoformat(written[2]["time"].replace("Z", "+00:00"))
    assert cli(root, "show", "--since", written[2]["time"]) == 0
    assert [x.split(" ")[1] for x in capsys.readouterr().out.splitlines()] == ["#3", "#4"]
    assert cli(root, "show", "--until", written[2]["time"]) == 0
    assert [x.split(" ")[1] for x in capsys.readouterr().out.splitlines()] == ["#1", "#2"]
    naive = when.replace(tzinfo=None).isoformat()
    assert cli(root, "show", "--since", naive) == 0  # no zone: UTC
    assert [x.split(" ")[1] for x in capsys.readouterr().out.splitlines()] == ["#3", "#4"]


def test_cli_refuses_a_time_that_is_not_rfc3339(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli(root, "show", "--since", "yesterday")
    assert (
        "'yesterday' is not an RFC 3339 time (like 2026-01-31T12:00:00Z or 2026-01-31)"
        in capsys.readouterr().err
    )
    assert audit._parse_time("2026-01-31") == dt.datetime(2026, 1, 31, tzinfo=dt.UTC)
    assert audit._parse_time("2026-01-31T12:00:00Z") == dt.datetime(2026, 1, 31, 12, tzinfo=dt.UTC)
    assert audit._parse_time("2026-01-31T12:00:00+02:00").utcoffset() == dt.timedelta(hours=2)


def test_shown_text_escapes_what_is_not_printable() -> None:
    from bcd_shared.shown import shown

    assert shown("a\nb\tc\x00d\u2028é\x1b[2J\u202e") == "a\\nb\\tc\\x00d\\u2028é\\x1b[2J\\u202e"
    assert shown(7) == "7"
    assert shown("plain é") == "plain é"


def test_the_cli_surface_operators_read(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option of `bcd helper audit` and its subcommands: the help an operator reads, the default,
    the choices (a flag given before the subcommand is not reset by the subcommand's own copy)."""
    parser = argparse.ArgumentParser(prog="bcd helper audit")
    audit.add_arguments(parser)
    common = {
        "--root": ("the directory standing for / (a simulated host)", None),
        "--dir": ("the audit directory (host path; default from config)", None),
        "--config": ("root's config.toml (host path)", None),
    }

    def options(p: argparse.ArgumentParser) -> dict[str, tuple[Any, ...]]:
        return {
            a.option_strings[-1]: (a.help, a.choices)
            for a in p._actions
            if a.option_strings and a.option_strings[-1] != "--help"
        }

    assert options(parser) == common
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.required and sub.metavar == "init|show|verify"
    assert {a.dest: a.help for a in sub._choices_actions} == {
        "init": "create the sealing key and print its verification key, once",
        "show": "print audit entries, filtered",
        "verify": "check the seals and the chain; names the first problem",
    }
    assert options(sub.choices["init"]) == common
    assert options(sub.choices["show"]) == {
        "--op": ("only this operation", None),
        "--decision": (None, ("accepted", "refused", "failed", "anchor", "repaired")),
        "--since": ("only entries at or after this time (RFC 3339)", None),
        "--until": ("only entries before this time (RFC 3339)", None),
        "--json": ("print the raw JSON lines", None),
        **common,
    }
    assert options(sub.choices["verify"]) == {
        "--key": ("the verification key printed at set-up (required)", None),
        "--expect-head": ("a head held off the host (the node's reports)", None),
        **common,
    }
    verify_help = sub.choices["verify"].format_help()
    assert "--expect-head SEQ:HASH" in verify_help
    args = parser.parse_args(["show", "--json", "--op", "x", "--decision", "failed"])
    assert (args.json, args.op, args.decision, args.since, args.until) == (True, "x", "failed", None, None)
    assert parser.parse_args(["show"]).json is False
    with pytest.raises(SystemExit):
        parser.parse_args(["show", "--decision", "maybe"])
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a subcommand is required
    capsys.readouterr()


def _receiver(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    return sock


def test_each_line_goes_to_the_system_log_over_one_kept_socket(tmp_path: Path) -> None:
    """A real datagram receiver stands for /dev/log: each line arrives as one datagram with the RFC 3164
    header, cut at SYSLOG_MAX bytes, and the socket is connected once for every line (a second receiver
    bound after the first line never sees the next one)."""
    path = tmp_path / "log"
    rx = _receiver(path)
    system = audit.SystemLog(str(path), pid=4242)
    system.send(b"x" * 9000)
    assert rx.recv(65536) == b"<86>bcd-helper[4242]: " + b"x" * audit.SYSLOG_MAX
    sock = system._sock
    assert sock is not None
    system.send(b"second")
    assert rx.recv(65536) == b"<86>bcd-helper[4242]: second"
    assert system._sock is sock  # kept: no socket, connect and close a line
    system.close()
    assert system._sock is None
    rx.close()


def test_a_restarted_system_log_gets_the_next_line_and_a_missing_one_is_left_alone_a_while(
    tmp_path: Path,
) -> None:
    """The receiver restarts (its socket removed and bound again, as journald's is): the send on the old
    connection fails, and the line goes over a new one at once. With no receiver, nothing is raised and
    no connect is tried again before SYSLOG_RETRY_S."""
    now = [100.0]
    path = tmp_path / "log"
    rx = _receiver(path)
    system = audit.SystemLog(str(path), clock=lambda: now[0], pid=7)
    system.send(b"one")
    assert rx.recv(100) == b"<86>bcd-helper[7]: one"
    rx.close()
    path.unlink()
    rx = _receiver(path)
    system.send(b"two")
    assert rx.recv(100) == b"<86>bcd-helper[7]: two"
    rx.close()
    path.unlink()
    system.send(b"lost")  # refused, then no socket to connect to: dropped, nothing raised
    assert system._sock is None
    rx = _receiver(path)
    now[0] += audit.SYSLOG_RETRY_S - 0.5
    system.send(b"still left alone")
    assert system._sock is None
    now[0] += 1.0
    system.send(b"three")
    assert rx.recv(100) == b"<86>bcd-helper[7]: three"
    rx.settimeout(0.05)
    with pytest.raises(TimeoutError):
        rx.recv(100)  # neither "lost" nor "still left alone" came
    system.close()
    rx.close()


def test_a_full_system_log_drops_the_line_and_keeps_the_socket(tmp_path: Path) -> None:
    path = tmp_path / "log"
    rx = _receiver(path)
    system = audit.SystemLog(str(path), pid=1)
    sent = 0
    while sent < 10_000:  # far past any datagram queue's length: the later sends find it full
        system.send(b"y" * 100)
        sent += 1
    assert system._sock is not None  # EAGAIN is not a restart
    got = 0
    rx.settimeout(0.05)
    with contextlib.suppress(TimeoutError):
        while True:
            rx.recv(1000)
            got += 1
    assert 0 < got < sent
    system.close()
    rx.close()


def test_record_sends_to_the_system_log_unless_told_not_to(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines_sent: list[bytes] = []
    monkeypatch.setattr(audit.SystemLog, "send", lambda self, line: lines_sent.append(line))
    log = AuditLog(root, DIR)
    write(log, 1)
    log.close()
    assert lines_sent == [(adir(root) / LOG_NAME).read_bytes().rstrip(b"\n")]
    quiet = new_log(root)
    write(quiet, 1, start=1)
    quiet.close()
    assert len(lines_sent) == 1


# --- edges found by mutation testing ----------------------------------------------------------------------


def test_first_line_never_follows_a_symlink_and_reads_at_most_a_mebibyte(root: Path) -> None:
    d = root / "d"
    d.mkdir()
    (d / "real").write_bytes(b"abX \n")
    (d / "link").symlink_to("real")
    (d / "huge").write_bytes(b"z" * ((1 << 20) + 10) + b"\n")
    fd = os.open(d, os.O_RDONLY)
    try:
        assert audit._first_line(fd, "real") == b"abX "  # only the newline is taken off
        with pytest.raises(OSError):
            audit._first_line(fd, "link")
        assert audit._first_line(fd, "huge") == b"z" * (1 << 20)
    finally:
        os.close(fd)


def test_export_with_exactly_keep_files_held_rotates_nothing(root: Path) -> None:
    log = new_log(root, max_bytes=600, keep=2)
    d = adir(root)
    n = 0
    while len(audit.log_files(d)) - 1 < 2:
        write(log, 1, start=n)
        n += 1
    assert len(audit.log_files(d)) - 1 == 2
    seq, _ = log.head()
    log.export()
    assert log.head()[0] == seq and len(audit.log_files(d)) - 1 == 2  # no anchor, nothing pruned
    log.close()


def test_pruning_stops_at_the_first_file_the_node_has_not_read(root: Path) -> None:
    log = new_log(root, max_bytes=600, keep=1)
    d = adir(root)
    write(log, 4)
    log.export()  # the node read up to here
    exported = log.head()[0]
    write(log, 12, start=4)  # more rotations: files past `keep` the node has not read stay
    rotated = audit.log_files(d)[:-1]
    assert len(rotated) > 2
    unread = [p for p in rotated if lines(p)[-1]["seq"] > exported]
    assert unread == rotated  # every kept file has lines the node has not read...
    assert lines(rotated[0])[0]["seq"] <= exported + 1  # ...and the oldest follows what it read
    assert verify_chain(d, log.created_key).ok
    log.close()


def test_rotated_files_shift_up_in_order(root: Path) -> None:
    log = new_log(root, max_bytes=600)
    write(log, 9)
    d = adir(root)
    names = [p.name for p in audit.log_files(d)]
    assert names == [f"{LOG_NAME}.{i}" for i in range(len(names) - 1, 0, -1)] + [LOG_NAME]
    assert len(names) >= 4
    seqs = [lines(p)[0]["seq"] for p in audit.log_files(d)]
    assert seqs == sorted(seqs)
    log.close()


def test_an_export_after_the_current_file_went_missing_still_rotates(root: Path) -> None:
    log = new_log(root, max_bytes=600, keep=1)
    write(log, 8)
    log.close()
    d = adir(root)
    (d / LOG_NAME).unlink()
    (d / KEY_NAME).unlink()  # (it was past the rotated file's last line: a new one is made)
    again = new_log(root, max_bytes=600, keep=1)
    held = len(audit.log_files(d))
    assert held > 1
    head = again.export()
    assert head["seq"] == lines(audit.log_files(d)[-2])[-1]["seq"]
    assert lines(d / LOG_NAME)[0]["op"] == ANCHOR_OP
    again.close()


def test_an_empty_file_rotated_names_the_next_seq_as_the_oldest(root: Path) -> None:
    log = new_log(root, max_bytes=0)
    write(log, 1)
    anchor = lines(adir(root) / LOG_NAME)[0]
    assert anchor["op"] == ANCHOR_OP
    assert anchor["args"] == {"previous_last_seq": 0, "oldest_seq": 1, "files": 1}
    log.close()


def test_an_entry_that_only_claims_to_be_an_anchor_is_not_one(sealed: tuple[Path, str]) -> None:
    d, _ = sealed
    rows = raw_lines(d)
    for change in ({"decision": "anchor"}, {"op": ANCHOR_OP}):
        entry = {**json.loads(rows[-1]), **change}
        put(d, [*rows[:-1], canonical(entry)])
        assert verify_chain(d).problem == (
            f"the line {HEAD_NAME} records (seq 5) is missing or changed (newest: seq 5): "
            "the last line was edited or removed"
        )


def test_a_replaced_key_state_is_found_with_a_key_of_its_seq(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    _, k = parse_key(key)
    for _ in range(4):
        k = evolve(k)
    at5 = format_key(5, k)
    (d / KEY_NAME).write_bytes(b"bcd-audit-key-state v1 %020d %s\n" % (5, bytes(32).hex().encode()))
    assert verify_chain(d, at5) == VerifyResult(
        False, 5, f"{KEY_NAME}: the key state at seq 5 is not this key's (replaced)", 1, 5
    )
    (d / KEY_NAME).write_bytes(b"bcd-audit-key-state v1 %020d %s\n" % (5, k.hex().encode()))
    assert verify_chain(d, at5).ok


def test_cli_must_run_as_root_on_the_real_host(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bcd_shared.subcommands import EX_NOPERM, CliError

    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    monkeypatch.setattr(audit.os, "geteuid", lambda: 1000)
    with pytest.raises(CliError) as info:
        audit.run(parser.parse_args(["--root", "/", "show"]))
    assert (info.value.message, info.value.code) == (
        "must run as root: the audit log and root's config.toml are root's alone",
        EX_NOPERM,
    )
    new_log(root).close()
    assert audit.run(parser.parse_args(["--root", str(root), "--dir", DIR, "show"])) == 0  # a simulated host
    monkeypatch.setattr(audit.os, "geteuid", lambda: 0)
    with pytest.raises(CliError) as info:
        audit.run(parser.parse_args(["--root", "/", "--dir", "/nonexistent-bcd-audit-dir", "show"]))
    assert info.value.code != EX_NOPERM


def test_cli_exit_codes(root: Path, tmp_path: Path) -> None:
    from bcd_shared.subcommands import EX_CONFIG, EX_NOINPUT, CliError

    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    with pytest.raises(CliError) as info:
        audit.run(parser.parse_args(["--root", str(root), "--dir", DIR, "show"]))
    assert info.value.code == EX_NOINPUT
    with pytest.raises(CliError) as info:
        audit.run(parser.parse_args(["--root", str(root), "show"]))
    assert info.value.code == EX_CONFIG
    afile = tmp_path / "a-file"
    afile.write_text("")
    # A --root that is a file is a bad command line now (64 under bcd's parser), refused before init.
    with pytest.raises(SystemExit):
        parser.parse_args(["--root", str(afile), "--dir", DIR, "init"])


def test_cli_verify_with_another_key_fails(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = new_log(root)
    write(log, 2)
    log.close()
    other = format_key(1, bytes(32))
    assert cli(root, "verify", "--key", other) == 1
    assert capsys.readouterr().err == (
        f"bcd helper audit: audit log broken after 0 good entries: {LOG_NAME} line 1 (seq 1): {SEAL}\n"
    )


def test_cli_verify_with_a_malformed_key_blames_the_key_not_the_log(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, a mistyped --key read "audit log broken after 0 good entries: --key: ..."."""
    log = new_log(root)
    write(log, 2)
    log.close()
    assert cli(root, "verify", "--key", "bcdk1-1-nothex") == 1
    err = capsys.readouterr().err
    assert err == "bcd helper audit: --key: a verification key reads bcdk1-<seq>-<64 hex digits>\n"


def test_init_key_makes_the_directory_root_only(root: Path) -> None:
    d = adir(root)
    d.mkdir(parents=True, mode=0o755)
    os.chmod(d, 0o755)
    assert audit.init_key(root, DIR) is not None
    assert os.stat(d).st_mode & 0o777 == 0o700


def test_cli_show_skips_unreadable_lines_anywhere(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = new_log(root)
    write(log, 1)
    write(log, 1, start=1, op="slice.apply")
    write(log, 1, start=2)
    log.close()
    d = adir(root)
    rows = raw_lines(d)
    junk = [
        b"garbage",
        canonical({"seq": 99, "time": "not a time", "op": "file.write", "decision": "accepted"}),
        canonical({"seq": 98, "op": "file.write", "decision": "accepted"}),
    ]
    put(d, [rows[0], *junk, rows[1], *junk, rows[2]])
    assert cli(root, "show") == 0
    assert [x.split(" ")[1] for x in capsys.readouterr().out.splitlines()] == ["#1", "#2", "#3"]
    assert cli(root, "show", "--op", "file.write") == 0
    assert [x.split(" ")[1] for x in capsys.readouterr().out.splitlines()] == ["#1", "#3"]
    assert cli(root, "show", "--decision", "accepted", "--op", "slice.apply") == 0
    assert [x.split(" ")[1] for x in capsys.readouterr().out.splitlines()] == ["#2"]


def test_only_the_newline_is_taken_off_a_line(root: Path, sealed: tuple[Path, str]) -> None:
    d, _ = sealed
    (root / "x").mkdir()
    (root / "x/f").write_bytes(b"abX\n")
    fd = os.open(root / "x", os.O_RDONLY)
    try:
        assert audit._first_line(fd, "f") == b"abX"
    finally:
        os.close(fd)
    rows = raw_lines(d)
    put(d, [rows[0], rows[1] + b" ", *rows[2:]])  # a trailing space: not what the helper wrote
    assert verify_chain(d) == VerifyResult(
        False, 1, f"{LOG_NAME} line 2: not in canonical form (edited)", 1, 1
    )


def test_the_expected_head_may_be_the_oldest_kept_line(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    first = hashlib.sha256(raw_lines(d)[0]).hexdigest()
    assert verify_chain(d, key, (1, first)) == VerifyResult(True, 5, "", 1, 5)


# --- symbolic links: audit.key and the log files are never opened through one -----------------------------
# The directory is checked root-only from / down, so only root can plant one; these check that the helper
# refuses such a link (ELOOP, naming the file) instead of reading or writing the file it points to.


def plausible_key_state() -> bytes:
    return b"bcd-audit-key-state v1 %020d %s\n" % (1, bytes(32).hex().encode())


def refused_link(info: pytest.ExceptionInfo[OSError], name: str) -> bool:
    return (info.value.errno, info.value.filename) == (errno.ELOOP, name)


def test_a_symlink_in_place_of_the_key_state_is_refused_not_read(root: Path) -> None:
    d = adir(root)
    d.mkdir(parents=True, mode=0o700)
    elsewhere = root / "elsewhere.key"
    elsewhere.write_bytes(plausible_key_state())
    (d / KEY_NAME).symlink_to(elsewhere)
    with pytest.raises(OSError) as info:
        new_log(root)
    assert refused_link(info, KEY_NAME)
    with pytest.raises(OSError) as info:
        audit.init_key(root, DIR)
    assert refused_link(info, KEY_NAME)
    assert elsewhere.read_bytes() == plausible_key_state() and not (d / LOG_NAME).exists()


@pytest.mark.parametrize("name", [LOG_NAME, f"{LOG_NAME}.1"])
def test_a_symlink_in_place_of_the_newest_log_file_is_refused_not_read(root: Path, name: str) -> None:
    log = new_log(root)
    write(log, 2)
    log.close()
    d = adir(root)
    elsewhere = root / "elsewhere.log"  # the log's own lines: what a follower would accept
    os.rename(d / LOG_NAME, elsewhere)
    (d / name).symlink_to(elsewhere)
    with pytest.raises(OSError) as info:
        new_log(root)
    assert refused_link(info, name)
    (d / KEY_NAME).unlink()  # `init` then reads the newest line to start the key after it
    with pytest.raises(OSError) as info:
        audit.init_key(root, DIR)
    assert refused_link(info, name) and not (d / KEY_NAME).exists()


@pytest.mark.parametrize("name", [LOG_NAME, KEY_NAME, HEAD_NAME])
def test_a_symlink_planted_while_the_log_is_open_is_refused_not_written_through(
    root: Path, name: str
) -> None:
    log = new_log(root)  # audit.log, audit.head and audit.key's writer are opened at the first line
    d = adir(root)
    elsewhere = root / "elsewhere"
    elsewhere.write_bytes(b"not the helper's\n")
    (d / name).unlink(missing_ok=True)
    (d / name).symlink_to(elsewhere)
    with pytest.raises(OSError) as info:
        write(log, 1)
    assert refused_link(info, name)
    assert elsewhere.read_bytes() == b"not the helper's\n" and (d / name).is_symlink()
    log.close()


# --- edges: the directory, the export mark, close, the newest line, rotation to the byte -------------------


@pytest.mark.parametrize("directory", ["/", "//"])
def test_an_audit_directory_of_slash_is_refused(root: Path, directory: str) -> None:
    """The log's directory is made 0700: `/` itself must never be, so it is refused before anything is
    opened (the path the refusal names is `/` joined to audit.log)."""
    with pytest.raises(RootPathRefused) as info:
        AuditLog(root, directory, syslog=False)
    assert (info.value.path, str(info.value)) == (
        "//audit.log",
        "'//audit.log' is not a plain absolute host path",
    )
    assert os.stat(root).st_mode & 0o777 == 0o755 and list(root.iterdir()) == []


def test_an_audit_directory_named_with_a_trailing_slash_is_the_same_directory(root: Path) -> None:
    log = AuditLog(root, "/var/log/bcdX/", syslog=False)  # only the slash is taken off
    write(log, 1)
    log.close()
    assert [e["seq"] for e in lines(root / "var/log/bcdX" / LOG_NAME)] == [1]


def test_a_file_holding_only_seq_1_is_kept_while_nothing_was_exported(root: Path) -> None:
    log = new_log(root, max_bytes=1, keep=1)  # every line after the first starts a new file
    write(log, 3)
    d = adir(root)
    oldest = audit.log_files(d)[0]
    assert [e["seq"] for e in lines(oldest)] == [1]  # held past keep: the node has read nothing
    assert len(audit.log_files(d)) - 1 == 2
    log.close()


def test_a_second_close_closes_nothing(root: Path) -> None:
    log = new_log(root)
    write(log, 1)
    log.close()
    saved = os.dup(1)  # were a second close to close fd 1, the test's output would go with it
    try:
        log.close()
        os.fstat(1)
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def test_a_log_whose_last_line_does_not_parse_ends_at_seq_0(root: Path) -> None:
    log = new_log(root)
    write(log, 3)
    log.close()
    d = adir(root)
    garbage = b'{"seq":4,"time":"2026-'  # a whole line (it ends with a newline) that is not an entry
    with (d / LOG_NAME).open("ab") as f:
        f.write(garbage + b"\n")
    with pytest.raises(AuditError) as info:
        new_log(root)
    assert str(info.value) == f"{KEY_NAME} is at seq 4 but the log ends at seq 0: lines were removed"
    (d / KEY_NAME).unlink()
    again = new_log(root)  # with no key state: the next line is seq 1, chained to that line
    assert again.head() == (0, hashlib.sha256(garbage).hexdigest())
    assert again.created_key is not None and parse_key(again.created_key)[0] == 1
    again.close()


@pytest.mark.parametrize(
    "torn",
    [b'{"seq":4,"time":"2026-', b"\0" * 300, b"x" * 70000, b"x" * 65535, b'{"seq":4}'],
    ids=["cut-short", "zeros", "long", "a-page-less-one", "no-newline"],
)
def test_a_line_a_crash_cut_short_is_cut_off_at_start_and_the_cut_recorded(root: Path, torn: bytes) -> None:
    """A crash in the middle of an append leaves audit.log ending in part of a line (never fsynced, so
    never answered): the next start cuts it at the last newline and seals a line saying what it cut,
    instead of refusing to start; the chain continues from the last whole line and verify holds."""
    log = new_log(root)
    key = log.created_key
    write(log, 3)
    _seq, digest = log.head()
    log.close()
    d = adir(root)
    whole = (d / LOG_NAME).read_bytes()
    with (d / LOG_NAME).open("ab") as f:
        f.write(torn)
    again = new_log(root)
    assert (d / LOG_NAME).read_bytes().startswith(whole)
    rows = lines(d / LOG_NAME)
    assert len(rows) == 4
    repair = rows[3]
    assert (repair["seq"], repair["op"], repair["decision"], repair["reason"]) == (
        4,
        "(repair)",
        "repaired",
        "torn-tail",
    )
    assert repair["prev"] == digest and repair["peer_uid"] == 0
    assert repair["args"] == {
        "file": LOG_NAME,
        "bytes": len(torn),
        "sha256": hashlib.sha256(torn).hexdigest(),
    }
    assert repair["message"] == (
        f"the last {len(torn)} bytes of {LOG_NAME}, part of a line a crash interrupted (never answered), "
        "were cut at start"
    )
    assert again.head() == (4, hashlib.sha256(raw_lines(d)[3]).hexdigest())
    write(again, 1, start=3)
    again.close()
    assert verify_chain(d, key) == VerifyResult(True, 5, "", 1, 5)


def test_a_torn_anchor_is_cut_and_written_again(root: Path) -> None:
    """The crash cut the rotation's anchor short: the start cuts it, writes the anchor again, then the
    repair line; the new file starts with an anchor, as verify requires."""
    log = new_log(root)
    key = log.created_key
    write(log, 3)
    log.close()
    d = adir(root)
    os.rename(d / LOG_NAME, d / f"{LOG_NAME}.1")
    (d / LOG_NAME).write_bytes(b'{"args":{"files":1')
    os.chmod(d / LOG_NAME, 0o600)
    again = new_log(root)
    rows = lines(d / LOG_NAME)
    assert [(r["seq"], r["op"]) for r in rows] == [(4, "(anchor)"), (5, "(repair)")]
    again.close()
    assert verify_chain(d, key).ok


def test_the_newest_line_is_read_whole_from_its_first_byte(root: Path) -> None:
    d = root / "d"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY)
    try:
        (d / "byte").write_bytes(b"7")
        assert audit._last_line(fd, "byte") == b"7"
        (d / "wide").write_bytes(b"y" * 65536 + b"\n")  # one read leaves its first byte
        assert audit._last_line(fd, "wide") == b"y" * 65536
        (d / "spaced").write_bytes(b"a b\nc d \n")
        assert audit._last_line(fd, "spaced") == b"c d "
        (d / "xs").write_bytes(b"a\nbXX\n")  # only the newline is taken off, whatever ends the line
        assert audit._last_line(fd, "xs") == b"bXX"
    finally:
        os.close(fd)


def test_verify_names_a_line_with_bytes_after_its_closing_brace(sealed: tuple[Path, str]) -> None:
    d, key = sealed
    rows = raw_lines(d)
    put(d, [rows[0], rows[1] + b"XX", *rows[2:]])  # the chain and seals hold for the line without them
    assert verify_chain(d, key) == VerifyResult(False, 1, f"{LOG_NAME} line 2: not an audit entry", 1, 1)


def test_a_restart_continues_after_a_line_whose_message_holds_spaces(root: Path) -> None:
    log = new_log(root)
    write(log, 2, message="no such file or directory")
    head = log.head()
    log.close()
    again = new_log(root)
    assert again.head() == head
    again.close()


def first_line_size(tmp_path: Path) -> int:
    """The bytes one `write` line takes (all its fields have fixed widths here)."""
    other = tmp_path / "measure"
    other.mkdir(mode=0o755)
    log = new_log(other)
    write(log, 1)
    log.close()
    return (adir(other) / LOG_NAME).stat().st_size


def test_rotation_comes_when_the_log_reaches_max_bytes_to_the_byte(root: Path, tmp_path: Path) -> None:
    size = first_line_size(tmp_path)
    log = new_log(root, max_bytes=size)  # one line reaches it: the second starts a new file
    write(log, 2)
    d = adir(root)
    assert [[e["seq"] for e in lines(p)] for p in audit.log_files(d)] == [[1], [2, 3]]
    log.close()
    under = tmp_path / "under"
    under.mkdir(mode=0o755)
    log = new_log(under, max_bytes=size + 1)  # one byte under it: the second line goes on
    write(log, 2)
    assert [[e["seq"] for e in lines(p)] for p in audit.log_files(adir(under))] == [[1, 2]]
    log.close()


def test_a_longer_stale_head_file_is_cut_to_the_new_head(root: Path) -> None:
    log = new_log(root)
    write(log, 3)
    log.close()
    d = adir(root)
    with (d / HEAD_NAME).open("ab") as f:  # longer than any head the next start writes
        f.write(b'{"seq":99999,"sha256":"' + b"0" * 64 + b'"}\n')
    again = new_log(root)
    write(again, 1, start=3)
    seq, sha = again.head()
    assert (d / HEAD_NAME).read_bytes() == canonical({"seq": seq, "sha256": sha}) + b"\n"
    again.close()


def test_cli_show_filters_every_entry_and_an_empty_message_ends_the_line(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = new_log(root)
    write(log, 1, message="")
    write(log, 1, start=1, decision="failed", reason="internal", message="boom")
    write(log, 1, start=2)
    log.close()
    first = lines(adir(root) / LOG_NAME)[0]
    assert cli(root, "show", "--decision", "failed") == 0  # past an entry it filters out
    assert [x.split(" ")[1] for x in capsys.readouterr().out.splitlines()] == ["#2"]
    assert cli(root, "show", "--op", "file.write", "--decision", "accepted") == 0
    out = capsys.readouterr().out.splitlines()
    assert [x.split(" ")[1] for x in out] == ["#1", "#3"]
    assert out[0] == f"{first['time']} #1 uid=4242 pid=100 file.write accepted  {json.dumps({'i': 0})}"


def record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each fsync from here on, as "dir" or "file", in order (the fsync still happens)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(audit.os, "fsync", fsync)
    return synced


def test_a_log_that_is_only_a_torn_line_is_cut_to_empty_and_its_directory_fsynced(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torn line was the log's first: the cut leaves audit.log empty, and the repair line starts it
    again, with the directory fsynced as for any new file (the file may be new since the last sync)."""
    d = adir(root)
    log = new_log(root)
    key = log.created_key
    log.close()
    (d / LOG_NAME).write_bytes(b'{"seq":1,"ti')
    os.chmod(d / LOG_NAME, 0o600)
    synced = record_fsyncs(monkeypatch)
    again = new_log(root)
    monkeypatch.undo()
    assert synced == ["file", "file", "dir"]  # the cut, the repair line, then its directory
    ((repair),) = lines(d / LOG_NAME)
    assert (repair["seq"], repair["op"], repair["prev"]) == (1, "(repair)", audit.GENESIS)
    again.close()
    assert verify_chain(d, key).ok


def test_a_missing_anchor_written_at_start_fsyncs_its_directory(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = adir(root)
    log = new_log(root)
    write(log, 2)
    log.close()
    os.rename(d / LOG_NAME, d / f"{LOG_NAME}.1")
    synced = record_fsyncs(monkeypatch)
    new_log(root).close()
    assert synced == ["file", "dir"]


def test_a_symlink_in_place_of_a_torn_log_is_refused_and_its_target_left_whole(root: Path) -> None:
    """The start's cut opens audit.log without following a link: root never truncates through one."""
    d = adir(root)
    log = new_log(root)
    write(log, 1)
    log.close()
    target = root / "elsewhere"
    target.write_bytes(b"line\nno newline at the end")
    (d / LOG_NAME).unlink()
    (d / LOG_NAME).symlink_to(target)
    with pytest.raises(OSError) as info:
        new_log(root)
    assert info.value.errno == errno.ELOOP
    assert target.read_bytes() == b"line\nno newline at the end"


def test_cli_init_refusals_are_one_line_with_their_exit_code(root: Path) -> None:
    """`audit init` under a directory others can write is the root-only rule's one line and 77 (never a
    traceback, never written as root); an error of the system (a name over 255 bytes) is its own line
    and 74."""
    from bcd_shared.subcommands import EX_IOERR, EX_NOPERM, CliError

    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    (root / "var/log").mkdir(parents=True)
    os.chmod(root / "var/log", 0o777)
    with pytest.raises(CliError) as info:
        audit.run(parser.parse_args(["--root", str(root), "--dir", DIR, "init"]))
    assert (info.value.message, info.value.code) == (
        "/var/log is not a directory only root can write: bcd will not write as root under it",
        EX_NOPERM,
    )
    assert not (root / DIR.lstrip("/")).exists()
    os.chmod(root / "var/log", 0o755)
    long = "/var/log/" + "a" * 300
    with pytest.raises(CliError) as info:
        audit.run(parser.parse_args(["--root", str(root), "--dir", long, "init"]))
    assert info.value.code == EX_IOERR
    assert info.value.message.startswith("[Errno 36] ") and "a" * 255 in info.value.message


@pytest.mark.parametrize("given", ["relative/dir", "/var/log/../tmp"])
def test_cli_a_dir_that_is_no_plain_absolute_path_is_a_usage_error(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--dir` is read as a host path when parsed: a relative or `..` path is argparse's usage error (2),
    naming the rule, before anything is opened."""
    parser = argparse.ArgumentParser(prog="bcd helper audit")
    audit.add_arguments(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--dir", given, "show"])
    assert info.value.code == 2
    assert "host path" in capsys.readouterr().err


def test_show_prints_an_op_as_one_token_a_space_in_it_escaped(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown op is audited as the node sent it: `show` prints it as one field, each space `\\x20`
    and each unprintable character escaped, so `file.write accepted  {...}` cannot read as an accepted
    write (red team round 8, in process: mutation testing sees no subprocess)."""
    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    log = AuditLog(root, DIR, syslog=False)
    write(log, 1, op="file.write accepted  {}", decision="refused", reason="unknown-op")
    write(log, 1, start=1, op="a\nb c")
    write(log, 1, start=2)
    log.close()
    capsys.readouterr()
    assert audit.run(parser.parse_args(["--root", str(root), "--dir", DIR, "show"])) == 0
    lines = [line.split(" ", 4)[4] for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        'file.write\\x20accepted\\x20\\x20{} refused unknown-op {"i": 0} m0',
        'a\\nb\\x20c accepted  {"i": 1} m1',
        'file.write accepted  {"i": 2} m2',
    ]
