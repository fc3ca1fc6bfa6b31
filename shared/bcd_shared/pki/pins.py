"""Pins: the out-of-band trust anchors written at install.

- A root pin is the lowercase hex SHA-256 of a command-signing root certificate's DER (`root_pin`).
  `command_root_sha256` in root's config.toml is a comma-separated list of them (`parse_root_pins`): at most
  16, each exactly 64 lowercase hex digits, no duplicates; spaces around a comma are allowed.
- The JoinService key pin (`join_signing_key_pin`, Q-HST-SIGN-02) is `sha256/` followed by the standard,
  padded base64 of SHA-256 over the key's DER SubjectPublicKeyInfo (the HPKP / OkHttp pin form, 44
  characters), e.g. `sha256/47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=`.
A malformed value raises BadPin naming the rule; callers stop bcd from starting on it (HST-SIGN-13).
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Final

import attrs

from bcd_shared import configschema
from bcd_shared.pki.errors import BadPin
from bcd_shared.pki.signing import check_public_key

MAX_ROOT_PINS: Final = 16
JOIN_PIN_PREFIX: Final = "sha256/"
_HEX64: Final = re.compile(r"[0-9a-f]{64}")
# The DER SubjectPublicKeyInfo of an Ed25519 key is these 12 bytes and the raw key (RFC 8410 section 4;
# DER has one encoding): built here rather than through cryptography's `serialization` package, whose
# import (its SSH and cipher modules, ~0.4 MB) the node would otherwise carry for this alone.
ED25519_SPKI_PREFIX: Final = bytes.fromhex("302a300506032b6570032100")


def root_pin(der: bytes) -> str:
    """The pin of a root certificate: lowercase hex SHA-256 of its exact DER bytes."""
    return hashlib.sha256(der).hexdigest()


def check_root_pin(value: str, where: str = "pin") -> str:
    if not _HEX64.fullmatch(value):
        if re.fullmatch(r"[0-9a-fA-F]{64}", value):
            raise BadPin(f"{where}: {value!r} must be lowercase hex")
        raise BadPin(f"{where}: {value!r} is not 64 hex digits (a SHA-256 of the root's DER)")
    return value


def parse_root_pins(text: str, field: str = "command_root_sha256") -> tuple[str, ...]:
    """Parse `command_root_sha256`: comma-separated root pins, 1 to 16, in the order given. The rule is
    config.toml's (bcd_shared.configschema.parse_root_pins), so config and every other use agree."""
    if not isinstance(text, str):
        raise BadPin(f"{field}: must be a string, got {type(text).__name__}")
    try:
        return configschema.parse_root_pins(text)
    except configschema.RuleError as exc:
        raise BadPin(f"{field}: {exc}") from None


def spki_der(public_key: bytes) -> bytes:
    """The DER SubjectPublicKeyInfo of a raw Ed25519 public key."""
    check_public_key(public_key)
    return ED25519_SPKI_PREFIX + public_key


@attrs.frozen
class JoinKeyPin:
    """The JoinService signing key's pin: SHA-256 of its SPKI DER."""

    digest: bytes = attrs.field(repr=False)

    @digest.validator
    def _check(self, _attr: attrs.Attribute[bytes], value: bytes) -> None:
        if len(value) != 32:
            raise BadPin("join_signing_key_pin: digest must be 32 bytes")

    @classmethod
    def of_key(cls, public_key: bytes) -> JoinKeyPin:
        return cls(hashlib.sha256(spki_der(public_key)).digest())

    @classmethod
    def parse(cls, text: str, field: str = "join_signing_key_pin") -> JoinKeyPin:
        if not isinstance(text, str):
            raise BadPin(f"{field}: must be a string, got {type(text).__name__}")
        try:
            digest = configschema.parse_join_pin(text)  # config.toml's rule: one implementation
        except configschema.RuleError as exc:
            raise BadPin(f"{field}: {exc}") from None
        return cls(digest)

    def matches(self, public_key: bytes) -> bool:
        return hashlib.sha256(spki_der(public_key)).digest() == self.digest

    def __str__(self) -> str:
        return JOIN_PIN_PREFIX + base64.b64encode(self.digest).decode("ascii")
