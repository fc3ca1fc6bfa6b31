"""The signed host section the node keeps for the helper, and the `host.unit` sender that carries it.

seeds/host-config.md "Signed specs" (HST-SIGN-02/03/04, Q-HST-SIGN-01): every `host.unit` carries the
signed DesiredState body that last set the host section (a full spec, or a patch that sets `host`) with
its worker signature and chain. The node keeps it in `data_dir/host-intent.json` (0600): the exact body
bytes received, never re-encoded, base64, beside the signature and the signer chain (decided for
Q-HST-SIGN-01: the chain is kept too, since the helper verifies it). A later patch that does not set
`host` does not replace it (the session writes only when the accepted body sets `host`).

File format (JSON, sorted keys): {"generation": int, "body": b64, "signature": b64,
"signer_chain": [b64 DER, leaf first]}.

`HelperHostSend` is the HelperExecutor's `send`: it reads the kept body for every request (so the newest
one always goes), attaches the node's current trust bundle whenever the node holds one (the helper needs
the current bundle whenever it is newer than root's join record, which the node cannot read; a replay
of the bundle the helper already accepted costs it one digest), and appends the chain's root from that
bundle when the chain stops below it (a helper with `command_root_sha256` needs the request to name its
root). The answer (text) becomes a HelperAnswer; a refusal is retryable (`helper: ...`).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from attrs import frozen
from bcd_shared.errors import HelperRefused
from bcd_shared.system import atomic_write
from bcd_shared.units import UnitCondition

from bcd_agent.sections.host import HelperAnswer

HOST_INTENT_FILE: Final = "host-intent.json"
_KEYS: Final = frozenset({"generation", "body", "signature", "signer_chain"})


@frozen
class HostIntent:
    """The signed body that last set the host section, exactly as received."""

    generation: int
    body: bytes
    signature: bytes
    signer_chain: tuple[bytes, ...]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{HOST_INTENT_FILE}: {field}: expected base64 text")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"{HOST_INTENT_FILE}: {field}: not base64 ({exc})") from None


def write_host_intent(
    data_dir: str | Path, *, generation: int, body: bytes, signature: bytes, signer_chain: tuple[bytes, ...]
) -> Path:
    """Keep the signed body that set the host section (atomic, fsynced, 0600); returns the path."""
    doc = {
        "generation": generation,
        "body": _b64(body),
        "signature": _b64(signature),
        "signer_chain": [_b64(c) for c in signer_chain],
    }
    path = Path(data_dir) / HOST_INTENT_FILE
    atomic_write(path, json.dumps(doc, sort_keys=True).encode(), mode=0o600)
    return path


def read_host_intent(data_dir: str | Path) -> HostIntent | None:
    """The kept body, or None when no signed body has set the host section. Raises ValueError when the
    file is not one this module wrote (strict: exact keys and types)."""
    path = Path(data_dir) / HOST_INTENT_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(8 * 1024 * 1024)
    doc = json.loads(raw)
    if not isinstance(doc, dict) or set(doc) != _KEYS:
        raise ValueError(f"{HOST_INTENT_FILE}: keys must be {sorted(_KEYS)}")
    if type(doc["generation"]) is not int or not isinstance(doc["signer_chain"], list):
        raise ValueError(f"{HOST_INTENT_FILE}: generation must be an integer, signer_chain an array")
    return HostIntent(
        generation=doc["generation"],
        body=_unb64(doc["body"], "body"),
        signature=_unb64(doc["signature"], "signature"),
        signer_chain=tuple(_unb64(c, f"signer_chain[{i}]") for i, c in enumerate(doc["signer_chain"])),
    )


def signed_bundle_bytes(bundle: bytes, signature: bytes, signer_spki: bytes) -> bytes:
    """The serialized SignedTrustBundle the helper takes, from the exact parts the node keeps."""
    from bcd_shared import wire

    return bytes(wire.SignedTrustBundle(bundle=bundle, signature=signature, signer_spki=signer_spki))


def _with_root(chain: tuple[bytes, ...], signed_bundle: bytes | None) -> tuple[bytes, ...]:
    """The chain, ending with its root when the node's bundle holds the root that issued its last cert."""
    if not chain or signed_bundle is None:
        return chain
    from bcd_shared import wire
    from bcd_shared.pki import PkiError, TrustBundle, parse_certificate
    from cryptography.exceptions import InvalidSignature

    try:
        last = parse_certificate(chain[-1]).cert
        if last.subject == last.issuer:
            return chain  # already ends with a root
        outer = wire.SignedTrustBundle.parse(signed_bundle)
        for der in TrustBundle.decode(bytes(outer.bundle)).command_roots:
            root = parse_certificate(der).cert
            if root.subject == last.issuer:
                try:
                    last.verify_directly_issued_by(root)
                except (InvalidSignature, ValueError, TypeError):  # another key with the same name
                    continue
                return (*chain, der)
    except (PkiError, ValueError):
        return chain
    return chain


def intent_args(intent: HostIntent | None, signed_bundle: bytes | None) -> dict[str, Any] | None:
    """The `intent` argument of host.unit (docs/helper-rpc.md), or None when the node keeps no body."""
    if intent is None:
        return None
    return {
        "body": _b64(intent.body),
        "signature": _b64(intent.signature),
        "chain": [_b64(c) for c in _with_root(intent.signer_chain, signed_bundle)],
        "trust_bundle": None if signed_bundle is None else _b64(signed_bundle),
    }


def answer_of(result: dict[str, Any]) -> HelperAnswer:
    """A HelperAnswer from host.unit's result: issues make it a failure (terminal when all are)."""
    conditions = tuple(
        UnitCondition(str(c.get("type", "")), str(c.get("reason", "")), str(c.get("message", "")))
        for c in result.get("conditions", [])
        if isinstance(c, dict)
    )
    issues = [i for i in result.get("issues", []) if isinstance(i, dict)]
    changed = bool(result.get("changed", False))
    if not issues:
        return HelperAnswer(True, changed=changed, conditions=conditions)
    return HelperAnswer(
        False,
        "; ".join(str(i.get("message", "")) for i in issues),
        terminal=all(i.get("kind") == "terminal" for i in issues),
        changed=changed,
        conditions=conditions,
    )


@frozen
class HelperHostSend:
    """The HelperExecutor's `send`: one host.unit with the kept signed body and the current bundle."""

    client: Any  # HelperClient (sync): host_unit(unit, settings, busy_gpus, intent)
    data_dir: Path
    trust_bundle: Callable[[], bytes | None] = lambda: None  # the serialized SignedTrustBundle held

    def __call__(self, name: str, settings: str | None, busy: frozenset[str]) -> HelperAnswer:
        try:
            intent = read_host_intent(self.data_dir)
        except ValueError as exc:
            return HelperAnswer(False, f"{HOST_INTENT_FILE} cannot be read: {exc}")
        args = intent_args(intent, self.trust_bundle())
        try:
            result = self.client.host_unit(name, settings, sorted(busy), args)
        except HelperRefused as exc:
            return HelperAnswer(False, str(exc))
        return answer_of(result)
