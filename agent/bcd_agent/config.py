"""bcd's config.toml, parsed strictly into frozen values, once, at start.

The tables, keys and rules are bcd_shared.configschema's SCHEMA, which the root helper validates the
file with too: one schema, so both refuse the same keys and values with the same message, which names
the file, the key and the rule (ConfigError); `bcd node` prints it and stops. docs/config.md lists each
key with its default and rule.

The file is shared with the root helper: the install script writes it `root:bcd` 0640 in
`/etc/bcd` 0750, so the node reads it through its group and root reads the same bytes. The helper
honours only root's copy of `[host] units`, `command_root_sha256`, `join_signing_key_pin`,
`[kubernetes] allowed_clusters` and `[helper] instance_bridges`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from attrs import field, frozen
from bcd_shared.configschema import (
    JOURNAL_MAX_BYTES,
    JOURNAL_MAX_EVENTS,
    JOURNAL_MIN_BYTES,
    JOURNAL_MIN_EVENTS,
    LOG_LEVELS,
    MAX_COMMAND_ROOTS,
    SCHEMA,
    AllowedCluster,
    ConfigError,
    Network,
    decode,
    parse_document,
)
from bcd_shared.pki.pins import JoinKeyPin

DEFAULT_CONFIG_PATH = "/etc/bcd/config.toml"
CONFIG_ENV = "BCD_CONFIG"
DEFAULT_DATA_DIR = "/var/lib/bcd"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_DATA_DIR",
    "JOURNAL_MAX_BYTES",
    "JOURNAL_MAX_EVENTS",
    "JOURNAL_MIN_BYTES",
    "JOURNAL_MIN_EVENTS",
    "LOG_LEVELS",
    "MAX_COMMAND_ROOTS",
    "SCHEMA",
    "AllowedCluster",
    "Config",
    "ConfigError",
    "load_config",
    "parse_config",
]


# --- value types ---------------------------------------------------------------------------------


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
    guest_network_rules: bool = True  # root: a guarded guest starts only under its loaded nft rules
    libvirt_uri: str | None = None
    audit_max_bytes: int | None = None
    audit_keep: int | None = None
    audit_min_age_s: int | None = None
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
    # Off (the seeds' rule, DLV-JRN-15): every journal write is fsynced before it returns. On: accepts
    # and outcomes share one fsync before each effect and before anything is told (docs/journal.md).
    group_commit: bool = False


@frozen
class KubernetesConfig:
    allowed_clusters: tuple[AllowedCluster, ...] = ()


@frozen
class InstancesConfig:
    balloon_floor_percent: int = 50


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


def parse_config(text: str, source: str = "config.toml") -> Config:
    """Parse config.toml text; raise ConfigError naming the file, the key and the rule."""
    doc = parse_document(text, source)
    top = dict(doc[""])
    if "join_signing_key_pin" in top:
        top["join_signing_key_pin"] = JoinKeyPin(top["join_signing_key_pin"])
    tables = {name: _TABLE_TYPES[name](**doc[name]) for name in _TABLE_TYPES}
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
    return parse_config(decode(raw, str(p)), str(p))


def default_config_path() -> str:
    return os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help=f"config.toml to read (default: ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH})",
    )


def config_of(args: argparse.Namespace) -> Config:
    """The config a read-only command (status, plan, journal) takes from `--config`: a missing default
    file (or $BCD_CONFIG's) means the defaults; a `--config` naming no file is refused like any bad
    config, exit 78 (a typo never silently reads the defaults)."""
    from bcd_shared.subcommands import EX_CONFIG, CliError

    try:
        return load_config(args.config or default_config_path(), missing_ok=args.config is None)
    except ConfigError as e:
        raise CliError(str(e), EX_CONFIG) from None
