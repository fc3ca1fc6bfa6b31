"""Root's join record: the JoinResponse exactly as signed, kept at /var/lib/bcd-hostconfig/join-response.pb.

`bcd join`, run as root on a node with `[helper]`, writes it before the identity (HST-SIGN-34): verified
against root's `join_signing_key_pin` first, then written under the root-only rule (0600, atomic, fsynced
file and directory). Any failure raises, so the join fails and no identity is written (HST-SIGN-35).
The helper reads it back with `read_join_record` and re-verifies it against the pin (HST-SIGN-20/21).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from bcd_shared.pki.join import VerifiedJoin, verify_join_response
from bcd_shared.pki.pins import JoinKeyPin
from bcd_shared.rootpath import read_root_only, write_root_only

JOIN_RECORD: Final = "/var/lib/bcd-hostconfig/join-response.pb"
MAX_RECORD: Final = 1024 * 1024


def write_join_record(root: Path, data: bytes, pin: JoinKeyPin, path: str = JOIN_RECORD) -> VerifiedJoin:
    """Verify `data` (a serialized JoinResponse, as received) against `pin`, then write it root-only 0600.

    Raises PkiError (not signed by the pinned key, malformed), RootPathRefused (a directory on the way is
    not root-only) or OSError; the caller fails the join on any of them.
    """
    verified = verify_join_response(data, pin)
    write_root_only(root, path, data, 0o600)
    return verified


def read_join_record(
    root: Path, pin: JoinKeyPin, path: str = JOIN_RECORD
) -> tuple[bytes, VerifiedJoin] | None:
    """The record's exact bytes and their verification, or None when there is no record.

    Raises PkiError when the pinned key did not sign it, RootPathRefused when it cannot be read under the
    root-only rule.
    """
    data = read_root_only(root, path, MAX_RECORD)
    if data is None:
        return None
    return data, verify_join_response(data, pin)
