"""bcd's config.toml, parsed strictly into frozen values, once, at start.

Every key the seeds give the node is here (docs/config.md lists each with its default and rule).
An unknown table or key, a value of the wrong type or one that breaks its rule raises ConfigError,
whose message names the file, the key and the rule; `bcd node` prints it and stops.

The file is shared with the root helper: the install script writes it `root:bcd` 0640 in
`/etc/bcd` 0750, so the node reads it through its group and root reads the same bytes. The helper
parses it with its own reader (it never imports the agent) and honours only root's copy of
`[host] units`, `command_root_sha256`, `join_signing_key_pin`, `[kubernetes] allowed_clusters` and
`[helper] instance_bridges`; the key table in docs/config.md is the contract both follow.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from attrs import field, frozen
from bcd_shared.pki.errors import BadPin
from bcd_shared.pki.pins import JoinKeyPin, parse_root_pins

DEFAULT_CONFIG_PATH = "/etc/bcd/config.toml"
CONFIG_ENV = "BCD_CONFIG"
DEFAULT_DATA_DIR = "/var/lib/bcd"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

# The journal's hard bounds (seeds/delivery.md "The journal"): config may lower, never raise.
JOURNAL_MAX_BYTES = 64 * 1024 * 1024
JOURNAL_MAX_EVENTS = 10_000
JOURNAL_MIN_BYTES = 1024 * 1024
JOURNAL_MIN_EVENTS = 100
MAX_COMMAND_ROOTS = 16
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A config.toml that bcd refuses: names the key and the rule it breaks."""

    def __init__(self, source: str, key: str, rule: str) -> None:
        self.source = source
        self.key = key
        self.rule = rule
        super().__init__(f"{source}: {key}: {rule}" if key else f"{source}: {rule}")


# --- value types ---------------------------------------------------------------------------------


@frozen
class AllowedCluster:
    """One `[kubernetes] allowed_clusters` entry: an API server and the SHA-256 of its CA."""

    server: str  # https://host[:port]
    ca_sha256: str  # 64 lowercase hex digits

    def __str__(self) -> str:
        return f"{self.server}#sha256:{self.ca_sha256}"


@frozen
class ControlPlaneConfig:
    address: str | None = None  # host:port of the gateway (TCP, mutual TLS)
    unix_socket: str | None = None  # a local gateway (development control plane, `bcd sim`)
    ca_file: str | None = None  # PEM of the CA the gateway's certificate chains to
    server_name: str | None = None  # TLS server name, when not the address's host
    # A received message over this is refused before its body is read (gRPC's usual 4 MiB).
    max_message_bytes: int = 4 * 1024 * 1024
    frame_deadline_s: int = 10  # a message's body must arrive within this once its prefix did
    stall_timeout_s: int = 60  # a message the gateway has not taken for this long: reconnect


@frozen
class HelperConfig:
    socket: str | None = None  # set: privileged steps go through `bcd helper` on this socket
    instance_bridges: tuple[str, ...] = ()
    # Read by the helper only (root's copy); checked here so that the node refuses what root would.
    node_user: str | None = None
    node_uid: int | None = None
    node_gid: int | None = None
    audit_dir: str | None = None
    unsigned_access: bool = False  # root: render sshd files from an unsigned spec (development only)
    root_principals: bool = False  # an account of uid 0 may get a principals file (root and the node)
    libvirt_uri: str | None = None
    audit_max_bytes: int | None = None
    audit_keep: int | None = None
    root_socket: str | None = None


@frozen
class DevicesConfig:
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET


@frozen
class HostConfig:
    units: bool = True
    sysctl_allow: tuple[str, ...] = ()  # read by the helper only (root's copy)


@frozen
class JournalConfig:
    max_bytes: int = JOURNAL_MAX_BYTES
    max_events: int = JOURNAL_MAX_EVENTS


@frozen
class KubernetesConfig:
    allowed_clusters: tuple[AllowedCluster, ...] = ()


@frozen
class InstancesConfig:
    balloon_floor_percent: int = 50


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@frozen
class SiteConfig:
    bmc_networks: tuple[Network, ...] = ()


@frozen
class LogConfig:
    level: str = "info"


@frozen
class Config:
    """The whole file. Paths under data_dir are derived, never configured apart (they must sit
    beside the journal with its modes)."""

    source: str = "<defaults>"
    data_dir: str = DEFAULT_DATA_DIR
    join_signing_key_pin: JoinKeyPin | None = None
    command_root_sha256: tuple[str, ...] = ()
    control_plane: ControlPlaneConfig = field(factory=ControlPlaneConfig)
    helper: HelperConfig = field(factory=HelperConfig)
    host: HostConfig = field(factory=HostConfig)
    devices: DevicesConfig = field(factory=DevicesConfig)
    journal: JournalConfig = field(factory=JournalConfig)
    kubernetes: KubernetesConfig = field(factory=KubernetesConfig)
    instances: InstancesConfig = field(factory=InstancesConfig)
    site: SiteConfig = field(factory=SiteConfig)
    log: LogConfig = field(factory=LogConfig)

    @property
    def journal_path(self) -> Path:
        return Path(self.data_dir) / "journal.db"

    @property
    def identity_path(self) -> Path:
        return Path(self.data_dir) / "identity.json"

    @property
    def under_helper(self) -> bool:
        return self.helper.socket is not None


# --- rules ---------------------------------------------------------------------------------------

T = TypeVar("T")
Rule = Callable[[object], Any]


class _Bad(Exception):
    """A rule's refusal; the caller adds the source and the key."""


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise _Bad(f"must be a string, got {_describe(value)}")
    return value


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"must be a boolean (true or false, unquoted), got {_describe(value)}")
    return value


def _int_range(low: int, high: int, note: str = "") -> Rule:
    def rule(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _Bad(f"must be an integer from {low} to {high}{note}, got {_describe(value)}")
        return value

    return rule


def _abs_path(value: object) -> str:
    text = _string(value)
    p = PurePosixPath(text)
    if not text or not p.is_absolute() or ".." in p.parts or "\x00" in text:
        raise _Bad(f"must be an absolute path without '..', got {_describe(value)}")
    return str(p)


def _data_dir(value: object) -> str:
    text = _abs_path(value)
    if text == "/":
        raise _Bad("must be a directory of its own, not /")
    return text


def _comma_list(value: object, item: Callable[[str], T], *, max_items: int | None = None) -> tuple[T, ...]:
    text = _string(value)
    if text.strip() == "":
        return ()
    parts = [p.strip() for p in text.split(",")]
    if any(p == "" for p in parts):
        raise _Bad(f"is a comma-separated list without empty entries, got {_describe(value)}")
    if max_items is not None and len(parts) > max_items:
        raise _Bad(f"has at most {max_items} entries, got {len(parts)}")
    if len(set(parts)) != len(parts):
        raise _Bad(f"lists an entry twice: {_describe(value)}")
    out = []
    for p in parts:
        try:
            out.append(item(p))
        except _Bad as e:
            raise _Bad(f"entry {p!r} {e}") from None
    return tuple(out)


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _sha256_hex(text: str) -> str:
    if not _HEX64.fullmatch(text):
        raise _Bad("must be a SHA-256: 64 lowercase hex digits")
    return text


def _pin_rule(parse: Callable[[str], T], field_name: str) -> Callable[[object], T]:
    # The pins are parsed by bcd_shared.pki.pins, the same code the root helper uses.
    def rule(value: object) -> T:
        text = _string(value)
        try:
            return parse(text)
        except BadPin as e:
            raise _Bad(str(e).removeprefix(f"{field_name}: ")) from None

    return rule


_command_roots = _pin_rule(parse_root_pins, "command_root_sha256")
_key_pin = _pin_rule(JoinKeyPin.parse, "join_signing_key_pin")


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _host(text: str) -> str:
    if text.startswith("[") and text.endswith("]"):
        try:
            ipaddress.IPv6Address(text[1:-1])
        except ValueError:
            raise _Bad(f"has a bad IPv6 address {text!r}") from None
        return text
    try:
        ipaddress.IPv4Address(text)
        return text
    except ValueError:
        pass
    if len(text) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in text.split(".")):
        raise _Bad(f"has a bad host name {text!r}")
    return text


def _host_port(text: str, *, port_required: bool) -> tuple[str, int | None]:
    m = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]+)(?::(\d{1,5}))?", text)
    if m is None:
        raise _Bad("must be host:port (an IPv6 address in brackets)")
    host, port_text = m.group(1), m.group(2)
    _host(host)
    if port_text is None:
        if port_required:
            raise _Bad("must name a port (host:port)")
        return host, None
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise _Bad(f"has port {port} outside 1-65535")
    return host, port


def _address(value: object) -> str:
    text = _string(value)
    try:
        _host_port(text, port_required=True)
    except _Bad as e:
        raise _Bad(f"{e}, got {_describe(value)}") from None
    return text


def _server_name(value: object) -> str:
    text = _string(value)
    try:
        return _host(text)
    except _Bad as e:
        raise _Bad(f"must be a DNS name or IP address: {e}") from None


def _cluster(text: str) -> AllowedCluster:
    rule = "must be https://<host>[:<port>]#sha256:<64 hex digits>"
    server, sep, pin = text.partition("#sha256:")
    if not sep or not server.startswith("https://"):
        raise _Bad(rule)
    try:
        _host_port(server[len("https://") :], port_required=False)
        _sha256_hex(pin)
    except _Bad as e:
        raise _Bad(f"{rule} ({e})") from None
    return AllowedCluster(server=server, ca_sha256=pin)


def _clusters(value: object) -> tuple[AllowedCluster, ...]:
    return _comma_list(value, _cluster)


_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")


def _ifname(text: str) -> str:
    if not _IFNAME.fullmatch(text) or text in (".", ".."):
        raise _Bad("must be a network interface name: 1 to 15 of letters, digits, '_', '.', '-'")
    return text


def _bridges(value: object) -> tuple[str, ...]:
    return _comma_list(value, _ifname)


def _network(text: str) -> Network:
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        raise _Bad(f"must be a network in CIDR form (10.0.0.0/24): {e}") from None


def _networks(value: object) -> tuple[Network, ...]:
    return _comma_list(value, _network)


_SYSCTL_PREFIX = re.compile(r"[a-z0-9_]+(?:\.[a-z0-9_-]+)*\.?")


def _sysctl_prefix(text: str) -> str:
    if not _SYSCTL_PREFIX.fullmatch(text):
        raise _Bad(f"must list sysctl names or prefixes (vm.swappiness, net.core.), got {text!r}")
    return text


def _sysctl_prefixes(value: object) -> tuple[str, ...]:
    out = _comma_list(value, _sysctl_prefix)
    if not out:
        raise _Bad("is empty; leave the key out to allow every key not denied")
    return out


_ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def _account(value: object) -> str:
    text = _string(value)
    if not _ACCOUNT.fullmatch(text):
        raise _Bad(
            f"must be an account name (a lowercase letter or '_', then up to 31 of a-z0-9_-), "
            f"got {_describe(value)}"
        )
    return text


def _libvirt_uri(value: object) -> str:
    text = _string(value)
    if text not in ("qemu:///system", "test:///default"):
        raise _Bad(f"must be qemu:///system or test:///default, got {_describe(value)}")
    return text


def _log_level(value: object) -> str:
    text = _string(value)
    if text not in LOG_LEVELS:
        raise _Bad(f"must be one of {', '.join(LOG_LEVELS)}, got {_describe(value)}")
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
        "socket": _abs_path,
        "instance_bridges": _bridges,
        "node_user": _account,
        "node_uid": _int_range(1, 2**31 - 2),
        "node_gid": _int_range(1, 2**31 - 2),
        "audit_dir": _abs_path,
        "unsigned_access": _boolean,
        "root_principals": _boolean,
        "libvirt_uri": _libvirt_uri,
        "audit_max_bytes": _int_range(16384, 1 << 30),
        "audit_keep": _int_range(1, 1000),
        "root_socket": _abs_path,
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
    },
    "kubernetes": {"allowed_clusters": _clusters},
    "instances": {"balloon_floor_percent": _int_range(10, 100)},
    "site": {"bmc_networks": _networks},
    "log": {"level": _log_level},
}

_TABLE_TYPES: dict[str, type] = {
    "control_plane": ControlPlaneConfig,
    "helper": HelperConfig,
    "host": HostConfig,
    "devices": DevicesConfig,
    "journal": JournalConfig,
    "kubernetes": KubernetesConfig,
    "instances": InstancesConfig,
    "site": SiteConfig,
    "log": LogConfig,
}


def _key_name(table: str, key: str) -> str:
    return f"[{table}] {key}" if table else key


def _parse_table(source: str, table: str, data: Mapping[str, object]) -> dict[str, Any]:
    rules = SCHEMA[table]
    values: dict[str, Any] = {}
    for key, raw in data.items():
        if table == "" and key in SCHEMA:
            continue
        if key not in rules:
            where = f"[{table}]" if table else "the top level"
            raise ConfigError(
                source, _key_name(table, key), f"unknown key in {where} (known: {', '.join(sorted(rules))})"
            )
        try:
            values[key] = rules[key](raw)
        except _Bad as e:
            raise ConfigError(source, _key_name(table, key), str(e)) from None
    return values


def parse_config(text: str, source: str = "config.toml") -> Config:
    """Parse config.toml text; raise ConfigError naming the key and the rule."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(source, "", f"not valid TOML: {e}") from None
    for name, value in data.items():
        if name in SCHEMA and name != "":
            if not isinstance(value, dict):
                raise ConfigError(
                    source, f"[{name}]", f"must be a table ([{name}] on its own line), got a value"
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
    top = _parse_table(source, "", data)
    tables: dict[str, Any] = {
        name: _TABLE_TYPES[name](**_parse_table(source, name, data[name]))
        for name in _TABLE_TYPES
        if name in data
    }
    return Config(source=source, **top, **tables)


def load_config(path: str | os.PathLike[str], *, missing_ok: bool = False) -> Config:
    """Read and parse the file; a missing file is an error unless `missing_ok` (defaults then)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return Config(source=f"{p} (missing: defaults)")
        raise ConfigError(str(p), "", "no such file (write one, or pass --config)") from None
    except OSError as e:
        raise ConfigError(str(p), "", f"cannot be read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(str(p), "", "is not UTF-8") from None
    return parse_config(text, str(p))


def default_config_path() -> str:
    return os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help=f"config.toml to read (default: ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})",
    )
