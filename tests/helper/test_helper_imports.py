"""The helper stays lean: no grpclib, trio, trio-asyncio or agent code in its process; root's pins are
parsed exactly as bcd_shared.pki parses them (both use config.toml's one schema, bcd_shared.configschema)."""

from __future__ import annotations

import base64
import subprocess
import sys
from typing import Any

import pytest
from bcd_helper.config import ConfigError, parse_config
from bcd_shared.pki.errors import BadPin
from bcd_shared.pki.pins import JoinKeyPin
from bcd_shared.pki.pins import parse_root_pins as pki_root_pins


def test_helper_server_process_loads_no_grpclib_trio_or_agent() -> None:
    code = (
        "import sys, bcd_helper.serve, bcd_helper.server, bcd_helper.ops.table, bcd_helper.audit\n"
        "banned = ('grpclib', 'trio_asyncio', 'trio', 'bcd_agent', 'betterproto2')\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in banned)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _root(line: str) -> Any:
    return parse_config(f"{line}\n[helper]\nnode_uid = 900\n".encode(), "/etc/bcd/config.toml")


PINS = [
    "a" * 64,
    f"{'a' * 64},{'b' * 64}",
    f"{'a' * 64} , {'b' * 64}",
    "A" * 64,
    "a" * 63,
    f"{'a' * 64},{'a' * 64}",
    ",".join(f"{i:064x}" for i in range(16)),
    ",".join(f"{i:064x}" for i in range(17)),
    "",
    f"{'a' * 64},",
]


@pytest.mark.parametrize("text", PINS)
def test_root_pins_agree_with_pki(text: str) -> None:
    try:
        expected: tuple[str, ...] | None = pki_root_pins(text)
    except BadPin:
        expected = None
    try:
        got: tuple[str, ...] | None = _root(f'command_root_sha256 = "{text}"').command_root_sha256
    except ConfigError:
        got = None
    assert got == expected


@pytest.mark.parametrize(
    "text",
    [
        "sha256/" + base64.b64encode(b"\x01" * 32).decode(),
        "sha256/" + base64.b64encode(b"\x01" * 31).decode(),
        "sha1/" + base64.b64encode(b"\x01" * 32).decode(),
        "sha256/" + base64.b64encode(b"\x01" * 32).decode()[:-1] + "A",
        "sha256/xyz",
    ],
)
def test_join_pin_agrees_with_pki(text: str) -> None:
    try:
        expected: bytes | None = JoinKeyPin.parse(text).digest
    except BadPin:
        expected = None
    try:
        got: bytes | None = _root(f'join_signing_key_pin = "{text}"').join_signing_key_pin
    except ConfigError:
        got = None
    assert got == expected
