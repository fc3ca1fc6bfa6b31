"""The verification calls the agent and the helper make on signed intent.

Each takes the exact bytes received (never a decoded message), the detached signature, the signer's chain
(DER, leaf first), the trusted roots and the time, and returns the VerifiedSigner or raises a PkiError.
Whether a signature is required is the caller's decision from its trust state (DLV-SIG-03..05), never from
a flag in the body: these functions always verify.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from bcd_shared.pki.chain import ChainCache, Roots, VerifiedSigner, verify_signed
from bcd_shared.pki.signing import Purpose


def verify_command(
    body_bytes: bytes,
    signature: bytes,
    signer_chain: Sequence[bytes],
    roots: Roots,
    now: datetime.datetime,
    cache: ChainCache | None = None,
) -> VerifiedSigner:
    """A Command's signature: a worker-role key under purpose `command`, chained to `roots` (DLV-SIG-01)."""
    return verify_signed(Purpose.COMMAND, body_bytes, signature, signer_chain, roots, now, cache)


def verify_desired_state(
    body_bytes: bytes,
    signature: bytes,
    signer_chain: Sequence[bytes],
    roots: Roots,
    now: datetime.datetime,
    cache: ChainCache | None = None,
) -> VerifiedSigner:
    """A DesiredStateBody's signature: worker role, purpose `desired-state` (DLV-SIG-13, HST-SIGN-18)."""
    return verify_signed(Purpose.DESIRED_STATE, body_bytes, signature, signer_chain, roots, now, cache)
