"""config.toml's one schema: every table, key and rule, for the node and the root helper alike.

`bcd node` (bcd_agent.config) and `bcd helper` (bcd_helper.config) both validate the file with
`parse_document`, so a key or value one of them refuses the other refuses too, with the same message:
`<file>: <key>: <rule>` (ConfigError), the key written as in the file (`data_dir`, `[helper] socket`).
Each then builds its own view: the node everything, the helper root's keys with its defaults and the
account lookup (docs/config.md "Who reads it"). docs/config.md's key table lists exactly SCHEMA's keys
(a test checks it).

Stdlib only: the helper imports it at start (no cryptography, no wire types).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import Any, TypeVar

from attrs import frozen

JOURNAL_MAX_BYTES = 64 * 1024 * 1024
JOURNAL_MAX_EVENTS = 10_000
JOURNAL_MIN_BYTES = 1024 * 1024
JOURNAL_MIN_EVENTS = 100
MAX_COMMAND_ROOTS = 16
MAX_ROOT_PINS = MAX_COMMAND_ROOTS
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes with its NUL; a margin for the simulated root
LOG_LEVELS = ("debug", "info", "warning", "error")
JOIN_PIN_PREFIX = "sha256/"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ConfigError(ValueError):
    """A config.toml that bcd refuses: names the file, the key and the rule it breaks."""

    def __init__(self, source: str, key: str, rule: str) -> None:
        self.source = source
        self.key = key
        self.rule = rule
        super().__init__(f"{source}: {key}: {rule}" if key else f"{source}: {rule}")


@frozen
class AllowedCluster:
    """One `[kubernetes] allowed_clusters` entry: an API server and the SHA-256 of its CA."""

    server: str  # https://host[:port], as written
    ca_sha256: str  # 64 lowercase hex digits

    def __str__(self) -> str:
        return f"{self.server}#sha256:{self.ca_sha256}"


Network = ipaddress.IPv4Network | ipaddress.IPv6Network

T = TypeVar("T")
Rule = Callable[[object], Any]


class RuleError(ValueError):
    """A rule's refusal; the caller adds the source and the key."""


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise RuleError(f"must be a string, got {_describe(value)}")
    return value


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise RuleError(f"must be a boolean (true or false, unquoted), got {_describe(value)}")
    return value


def _int_range(low: int, high: int, note: str = "") -> Rule:
    def rule(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise RuleError(f"must be an integer from {low} to {high}{note}, got {_describe(value)}")
        return value

    return rule


def _abs_path(value: object) -> str:
    text = _string(value)
    p = PurePosixPath(text)
    if not text or not p.is_absolute() or ".." in p.parts or "\x00" in text:
        raise RuleError(f"must be an absolute path without '..', got {_describe(value)}")
    return str(p)


def _socket_path(value: object) -> str:
    text = _abs_path(value)
    if len(text) > MAX_SOCKET_PATH:
        raise RuleError(
            f"must be at most {MAX_SOCKET_PATH} characters (a Unix socket's path), got {len(text)}"
        )
    return text


# data_dir (and what root derives from it, `<data_dir>-ch-binds`) goes into systemd unit settings
# (BindPaths=SOURCE:DEST, ReadWritePaths=, TemporaryFileSystem=), where `:` separates, whitespace
# splits, `%` is a specifier and `\` an escape: before, a `:` in it was an internal error at ch.launch.
_DATA_DIR_RE = re.compile(r"/[A-Za-z0-9._+@/-]*")


def _data_dir(value: object) -> str:
    text = _abs_path(value)
    if text == "/":
        raise RuleError("must be a directory of its own, not /")
    if not _DATA_DIR_RE.fullmatch(text):
        raise RuleError(
            "must be a path of letters, digits and . _ + @ - / only (systemd unit settings take it, where "
            f": % \\ and spaces are special), got {_describe(value)}"
        )
    return text


def _comma_list(value: object, item: Callable[[str], T], *, max_items: int | None = None) -> tuple[T, ...]:
    text = _string(value)
    if text.strip() == "":
        return ()
    parts = [p.strip() for p in text.split(",")]
    if any(p == "" for p in parts):
        raise RuleError(f"is a comma-separated list without empty entries, got {_describe(value)}")
    if max_items is not None and len(parts) > max_items:
        raise RuleError(f"has at most {max_items} entries, got {len(parts)}")
    if len(set(parts)) != len(parts):
        raise RuleError(f"lists an entry twice: {_describe(value)}")
    out = []
    for p in parts:
        try:
            out.append(item(p))
        except RuleError as e:
            raise RuleError(f"entry {p!r} {e}") from None
    return tuple(out)


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _sha256_hex(text: str) -> str:
    if not _HEX64.fullmatch(text):
        raise RuleError("must be a SHA-256: 64 lowercase hex digits")
    return text


def parse_join_pin(text: str) -> bytes:
    """`join_signing_key_pin`: "sha256/" + 44 characters of canonical padded base64 of a 32-byte
    SHA-256; the digest. (bcd_shared.pki.pins.JoinKeyPin.parse uses this: one rule.)"""
    if not text.startswith(JOIN_PIN_PREFIX):
        raise RuleError(f"must start with {JOIN_PIN_PREFIX!r}")
    encoded = text[len(JOIN_PIN_PREFIX) :]
    if len(encoded) != 44 or not re.fullmatch(r"[A-Za-z0-9+/]{43}=", encoded):
        raise RuleError("after 'sha256/' expected 44 characters of padded base64 of a SHA-256")
    try:
        digest = base64.b64decode(encoded, validate=True)
    except binascii.Error:
        raise RuleError("not valid base64") from None
    if base64.b64encode(digest).decode("ascii") != encoded or len(digest) != 32:
        raise RuleError("non-canonical base64")
    return digest


def parse_root_pins(text: str) -> tuple[str, ...]:
    """`command_root_sha256`: 1 to 16 comma-separated lowercase-hex SHA-256s, no repeats, in order.
    (bcd_shared.pki.pins.parse_root_pins uses this: one rule.)"""
    if text.strip(" ") == "":
        raise RuleError("is empty; leave the key out to pin no roots")
    entries = [entry.strip(" ") for entry in text.split(",")]
    if len(entries) > MAX_ROOT_PINS:
        raise RuleError(f"{len(entries)} entries, at most {MAX_ROOT_PINS}")
    seen: set[str] = set()
    for index, entry in enumerate(entries, start=1):
        if entry == "":
            raise RuleError(f"entry {index} is empty")
        if not _HEX64.fullmatch(entry):
            if re.fullmatch(r"[0-9a-fA-F]{64}", entry):
                raise RuleError(f"entry {index} {entry!r} must be lowercase hex")
            raise RuleError(f"entry {index} {entry!r} is not 64 hex digits (a SHA-256 of the root's DER)")
        if entry in seen:
            raise RuleError(f"entry {index} repeats {entry}")
        seen.add(entry)
    return tuple(entries)


def _key_pin(value: object) -> bytes:
    return parse_join_pin(_string(value))


def _command_roots(value: object) -> tuple[str, ...]:
    return parse_root_pins(_string(value))


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _host(text: str) -> str:
    if text.startswith("[") and text.endswith("]"):
        try:
            ipaddress.IPv6Address(text[1:-1])
        except ValueError:
            raise RuleError(f"has a bad IPv6 address {text!r}") from None
        return text
    try:
        ipaddress.IPv4Address(text)
        return text
    except ValueError:
        pass
    if len(text) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in text.split(".")):
        raise RuleError(f"has a bad host name {text!r}")
    return text


def _host_port(text: str, *, port_required: bool) -> tuple[str, int | None]:
    m = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]+)(?::(\d{1,5}))?", text)
    if m is None:
        raise RuleError("must be host:port (an IPv6 address in brackets)")
    host, port_text = m.group(1), m.group(2)
    _host(host)
    if port_text is None:
        if port_required:
            raise RuleError("must name a port (host:port)")
        return host, None
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise RuleError(f"has port {port} outside 1-65535")
    return host, port


def _address(value: object) -> str:
    text = _string(value)
    try:
        _host_port(text, port_required=True)
    except RuleError as e:
        raise RuleError(f"{e}, got {_describe(value)}") from None
    return text


def _server_name(value: object) -> str:
    text = _string(value)
    try:
        return _host(text)
    except RuleError as e:
        raise RuleError(f"must be a DNS name or IP address: {e}") from None


def _cluster(text: str) -> AllowedCluster:
    rule = "must be https://<host>[:<port>]#sha256:<64 hex digits>"
    server, sep, pin = text.partition("#sha256:")
    if not sep or not server.startswith("https://"):
        raise RuleError(rule)
    try:
        _host_port(server[len("https://") :], port_required=False)
        _sha256_hex(pin)
    except RuleError as e:
        raise RuleError(f"{rule} ({e})") from None
    return AllowedCluster(server=server, ca_sha256=pin)


def _clusters(value: object) -> tuple[AllowedCluster, ...]:
    return _comma_list(value, _cluster)


_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")


def _ifname(text: str) -> str:
    if not _IFNAME.fullmatch(text) or text in (".", ".."):
        raise RuleError("must be a network interface name: 1 to 15 of letters, digits, '_', '.', '-'")
    return text


def _bridges(value: object) -> tuple[str, ...]:
    return _comma_list(value, _ifname)


def _network(text: str) -> Network:
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        raise RuleError(f"must be a network in CIDR form (10.0.0.0/24): {e}") from None


def _networks(value: object) -> tuple[Network, ...]:
    return _comma_list(value, _network)


_ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def _account(value: object) -> str:
    text = _string(value)
    if not _ACCOUNT.fullmatch(text):
        raise RuleError(
            f"must be an account name (a lowercase letter or '_', then up to 31 of a-z0-9_-), "
            f"got {_describe(value)}"
        )
    return text


def _libvirt_uri(value: object) -> str:
    text = _string(value)
    if text not in ("qemu:///system", "test:///default"):
        raise RuleError(f"must be qemu:///system or test:///default, got {_describe(value)}")
    return text


_SYSCTL_PREFIX = re.compile(r"[a-z0-9_]+(?:\.[a-z0-9_-]+)*\.?")


def _sysctl_prefix(text: str) -> str:
    if not _SYSCTL_PREFIX.fullmatch(text):
        raise RuleError(f"must list sysctl names or prefixes (vm.swappiness, net.core.), got {text!r}")
    return text


def _sysctl_prefixes(value: object) -> tuple[str, ...]:
    out = _comma_list(value, _sysctl_prefix)
    if not out:
        raise RuleError("is empty; leave the key out to allow every key not denied")
    return out


def _log_level(value: object) -> str:
    text = _string(value)
    if text not in LOG_LEVELS:
        raise RuleError(f"must be one of {', '.join(LOG_LEVELS)}, got {_describe(value)}")
    return text


# table name ("" for the top level) -> key -> rule. One literal table; docs/config.md follows it.
SCHEMA: dict[str, dict[str, Rule]] = {
    "": {
        "data_dir": _data_dir,
        "join_signing_key_pin": _key_pin,
        "command_root_sha256": _command_roots,
    },
    "control_plane": {
        "address": _address,
        "unix_socket": _abs_path,
        "ca_file": _abs_path,
        "server_name": _server_name,
        "max_message_bytes": _int_range(64 * 1024, 64 * 1024 * 1024),
        "frame_deadline_s": _int_range(1, 600),
        "stall_timeout_s": _int_range(5, 3600),
    },
    "helper": {
        "socket": _socket_path,
        "instance_bridges": _bridges,
        "node_user": _account,
        "node_uid": _int_range(1, 2**31 - 2),
        "node_gid": _int_range(1, 2**31 - 2),
        "audit_dir": _abs_path,
        "unsigned_access": _boolean,
        "root_principals": _boolean,
        "guest_network_rules": _boolean,
        "libvirt_uri": _libvirt_uri,
        "audit_max_bytes": _int_range(16384, 1 << 30),
        "audit_keep": _int_range(1, 1000),
        "audit_min_age_s": _int_range(0, 30 * 86400),
        "root_socket": _socket_path,
    },
    "host": {"units": _boolean, "sysctl_allow": _sysctl_prefixes},
    "devices": {"pod_resources_socket": _abs_path},
    "journal": {
        "max_bytes": _int_range(
            JOURNAL_MIN_BYTES,
            JOURNAL_MAX_BYTES,
            " (64 MiB at most: config may lower the bound, never raise it)",
        ),
        "max_events": _int_range(
            JOURNAL_MIN_EVENTS,
            JOURNAL_MAX_EVENTS,
            " (10,000 at most: config may lower the bound, never raise it)",
        ),
        "group_commit": _boolean,
    },
    "kubernetes": {"allowed_clusters": _clusters},
    "instances": {"balloon_floor_percent": _int_range(10, 100)},
    "site": {"bmc_networks": _networks},
    "log": {"level": _log_level},
}


def key_name(table: str, key: str) -> str:
    return f"[{table}] {key}" if table else key


Document = dict[str, dict[str, Any]]


def _parse_table(source: str, table: str, data: Mapping[str, object]) -> dict[str, Any]:
    rules = SCHEMA[table]
    values: dict[str, Any] = {}
    for key, raw in data.items():
        if table == "" and key in SCHEMA:
            continue
        if key not in rules:
            where = f"[{table}]" if table else "the top level"
            raise ConfigError(
                source, key_name(table, key), f"unknown key in {where} (known: {', '.join(sorted(rules))})"
            )
        try:
            values[key] = rules[key](raw)
        except RuleError as e:
            raise ConfigError(source, key_name(table, key), str(e)) from None
    return values


def parse_document(text: str, source: str = "config.toml") -> Document:
    """Validate config.toml text against SCHEMA: {table ("" for the top level): {key: value}}, only the
    keys present, each value checked and converted by its rule. Raises ConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(source, "", f"not valid TOML: {e}") from None
    for name, value in data.items():
        if name in SCHEMA and name != "":
            if not isinstance(value, dict):
                got = "an array of tables ([[...]])" if isinstance(value, list) else "a value"
                raise ConfigError(
                    source, f"[{name}]", f"must be a table ([{name}] on its own line), got {got}"
                )
        elif name not in SCHEMA[""]:
            known_tables = ", ".join(f"[{t}]" for t in SCHEMA if t)
            if isinstance(value, dict):
                raise ConfigError(source, f"[{name}]", f"unknown table (known: {known_tables})")
            raise ConfigError(
                source,
                name,
                f"unknown key at the top level (known: {', '.join(sorted(SCHEMA['']))}; "
                f"tables: {known_tables})",
            )
    helper = data.get("helper", {})
    if "node_user" in helper and "node_uid" in helper:
        raise ConfigError(source, "[helper] node_uid", "give node_user or node_uid, not both")
    doc: Document = {"": _parse_table(source, "", data)}
    for name in SCHEMA:
        if name:
            doc[name] = _parse_table(source, name, data.get(name, {}))
    return doc


def decode(data: bytes, source: str) -> str:
    """The file's bytes as text; ConfigError when not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(source, "", "is not UTF-8") from None
