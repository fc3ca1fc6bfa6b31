"""Release versions are ordered so that self-update only moves forward, and a rollback intent is part of the
signed manifest bytes (shared/bcd_shared/release.py; issue 9 item 4)."""

from __future__ import annotations

import pytest
from bcd_shared.pki import KeyPair, PkiError, Purpose
from bcd_shared.release import ReleaseManifest, compare_versions, version_key

ORDERED = [
    "0.9",
    "1.0.dev1",
    "1.0a1",
    "1.0a2.dev1",
    "1.0a2",
    "1.0b1",
    "1.0rc1",
    "1.0",
    "1.0.post1",
    "1.0.1",
    "1.2",
    "1.10",
    "2.0.0",
    "10.0",
]


def test_versions_sort_in_release_order() -> None:
    for i, a in enumerate(ORDERED):
        for j, b in enumerate(ORDERED):
            assert compare_versions(a, b) == (i > j) - (i < j), (a, b)
    assert compare_versions("1.2", "1.2.0") == 0


@pytest.mark.parametrize("version", ["nightly", "1.0-beta", "v1.0", "1..0", "1.0rc", "01x", ""])
def test_a_version_outside_the_grammar_has_no_order(version: str) -> None:
    with pytest.raises(PkiError) as info:
        version_key(version)
    assert info.value.rule == "unordered-version"


def test_the_rollback_flag_is_inside_the_signed_bytes_and_absent_otherwise() -> None:
    digest = "ab" * 32
    forward = ReleaseManifest("1.5.0", "https://r.example/bcd", digest)
    back = ReleaseManifest("1.5.0", "https://r.example/bcd", digest, rollback=True)
    assert forward.encode() == (
        b'{"sha256":"' + digest.encode() + b'","url":"https://r.example/bcd","version":"1.5.0"}'
    )
    assert back.encode() == (
        b'{"rollback":true,"sha256":"'
        + digest.encode()
        + b'","url":"https://r.example/bcd","version":"1.5.0"}'
    )
    key = KeyPair.generate()
    assert key.sign(Purpose.DAEMON_RELEASE, forward.encode()) != key.sign(
        Purpose.DAEMON_RELEASE, back.encode()
    )
