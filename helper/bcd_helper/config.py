"""Root's config.toml: what root does for the node, read only from a file only root can write.

Rules (host-config.md "Under bcd helper", "Signed specs", "Which clusters"; HST-HLP-20..31,
HST-SIGN-05/11/13, HST-K8S-54/55):
- the file must be a regular file (not a symlink), owned by root, writable by neither group nor
  others, in directories only root can write (the root-only rule, from `/` down); otherwise the
  helper stops with `<path> must be a regular file root owns that no one else can write`. The
  install's `root:bcd 0640` in `/etc/bcd 0750` passes;
- it is validated with config.toml's one schema (bcd_shared.configschema), the node's too: an unknown
  table or key, or a value that breaks its rule, stops the helper with `<file>: <key>: <rule>`, exactly
  as the node would refuse it (docs/config.md).

The same file is the node's config (the node reads it through its group). Of it the helper uses:
  join_signing_key_pin   the JoinService key's pin (its digest)
  command_root_sha256    1 to 16 root pins
  [host] units           bool, default true
  [helper] socket        the socket path, default /run/bcd/helper.sock
  [helper] node_user     the node's account, default "bcd" (resolved with the passwd database)
  [helper] node_uid      the node's uid (instead of node_user; tests and containers)
  [helper] node_gid      the group the socket is given to, default the node account's group
  [helper] instance_bridges  bridges instance taps may join
  [helper] audit_dir     the audit log's directory, default /var/log/bcd-helper
  [helper] unsigned_access  bool, default false: with no command-signing roots, access.apply renders the
                         sshd files from an unsigned spec. Development only: without it, access writes
                         need a signed spec (issue 9 item 1)
  [helper] root_principals  bool, default false: an account of uid 0 may get a principals file
  [helper] guest_network_rules  bool, default true: with roots, a guest the signed spec guards starts only
                         behind its signed nft rules. `bcd sim` turns it off: the simulated host has no
                         nftables (bcd_simhost.netns), so its node loads no rules
  [helper] libvirt_uri   the libvirt connection of libvirt.*: qemu:///system (default) or test:///default
  data_dir               (the node's key, read by root too) where instance disks may live, default
                         /var/lib/bcd: libvirt.* allows disks only under it
  [helper] audit_max_bytes  rotate audit.log past this size, 16384 to 1 GiB, default 16 MiB
  [helper] audit_keep    rotated files kept once the node has read past them, 1 to 1000, default 8
  [helper] audit_min_age_s  a rotated file is deleted only once its newest line is this old, 0 to 30
                         days, default 86400 (one day)
  [helper] root_socket   root's own socket (0600 root; the node cannot reach or fill it),
                         default /run/bcd/helper-root.sock; never the same path as [helper] socket
  [host] sysctl_allow    "vm.swappiness,net.core.": when set, the sysctl unit takes only keys equal to
                         one of these names or under one of these prefixes (whole name components);
                         the denylist applies either way
  [kubernetes] allowed_clusters  API servers and their CA pins (ports made explicit, hosts lowercase)
The other keys are the node's: validated the same way, not used here.
"""

from __future__ import annotations

import os
import pwd
import re
import stat
from pathlib import Path

from attrs import frozen
from bcd_shared import configschema as schema
from bcd_shared.rootpath import RootPathRefused, open_regular_nofollow

DEFAULT_CONFIG = "/etc/bcd/config.toml"
DEFAULT_SOCKET = "/run/bcd/helper.sock"
DEFAULT_AUDIT_DIR = "/var/log/bcd-helper"
DEFAULT_ROOT_SOCKET = "/run/bcd/helper-root.sock"
DEFAULT_DATA_DIR = "/var/lib/bcd"
DEFAULT_LIBVIRT_URI = "qemu:///system"
# libvirt.*: the connection root drives; test:///default only for tests and `bcd bench instances`.
LIBVIRT_URIS = frozenset({"qemu:///system", "test:///default"})
DEFAULT_NODE_USER = "bcd"
MAX_CONFIG_BYTES = 1024 * 1024
_SERVER_RE = re.compile(r"https://(\[[^\]]+\]|[^:\[\]]+)(?::(\d{1,5}))?")


class ConfigError(Exception):
    """Root's config cannot be used; the helper does not start. The message names the file and the key."""


@frozen
class AllowedCluster:
    """One `allowed_clusters` entry: the API server (port made explicit) and its CA pin (lowercase)."""

    server: str
    ca_sha256: str

    def __str__(self) -> str:
        return f"{self.server}#sha256:{self.ca_sha256}"


@frozen
class HelperConfig:
    path: str
    join_signing_key_pin: bytes | None
    command_root_sha256: tuple[str, ...]
    host_units: bool
    socket: str
    node_uid: int
    node_gid: int
    instance_bridges: tuple[str, ...]
    audit_dir: str
    allowed_clusters: tuple[AllowedCluster, ...]
    unsigned_access: bool = False
    root_principals: bool = False
    guest_network_rules: bool = True
    data_dir: str = DEFAULT_DATA_DIR
    libvirt_uri: str = DEFAULT_LIBVIRT_URI
    root_socket: str = DEFAULT_ROOT_SOCKET
    audit_max_bytes: int = 16 * 1024 * 1024
    audit_keep: int = 8
    audit_min_age_s: int = 86400
    sysctl_allow: tuple[str, ...] = ()


def ownership_message(path: str) -> str:
    """The seeds' start refusal (HST-HLP-28)."""
    return f"{path} must be a regular file root owns that no one else can write"


def read_root_config(root: Path, path: str) -> bytes:
    """The config's bytes, after the ownership rules (HST-HLP-24..27). Raises ConfigError."""
    try:
        fd, st = open_regular_nofollow(root, path)
    except RootPathRefused as exc:
        raise ConfigError(f"{ownership_message(path)} ({exc})") from None
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (root's config.toml is required)") from None
    try:
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise ConfigError(ownership_message(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    return data


def _explicit(cluster: schema.AllowedCluster) -> AllowedCluster:
    """The server with its port made explicit and its host lowercase, as a Kubernetes join compares it."""
    m = _SERVER_RE.fullmatch(cluster.server)
    assert m is not None  # the schema's rule accepted it
    return AllowedCluster(f"https://{m.group(1).lower()}:{m.group(2) or '443'}", cluster.ca_sha256)


def parse_config(data: bytes, path: str = DEFAULT_CONFIG) -> HelperConfig:
    """Validate root's config with the one schema, then take root's keys. Raises ConfigError naming the
    file and the key."""
    try:
        doc = schema.parse_document(schema.decode(data, path), path)
    except schema.ConfigError as exc:
        raise ConfigError(str(exc)) from None

    def refuse(key: str, rule: str) -> ConfigError:
        return ConfigError(str(schema.ConfigError(path, key, rule)))

    top, helper = doc[""], doc["helper"]
    uid: int
    gid_default: int
    if "node_uid" in helper:
        uid = helper["node_uid"]
        gid_default = uid
    else:
        user = helper.get("node_user", DEFAULT_NODE_USER)
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise refuse("[helper] node_user", f"no account {user!r} on this host") from None
        uid, gid_default = entry.pw_uid, entry.pw_gid
        if uid == 0:
            raise refuse("[helper] node_user", "the node's account must not be root")
    socket_path = helper.get("socket", DEFAULT_SOCKET)
    root_socket = helper.get("root_socket", DEFAULT_ROOT_SOCKET)
    if root_socket == socket_path:
        raise refuse("[helper] root_socket", "must not be [helper] socket (root's socket is its own)")
    return HelperConfig(
        path=path,
        join_signing_key_pin=top.get("join_signing_key_pin"),
        command_root_sha256=top.get("command_root_sha256", ()),
        host_units=doc["host"].get("units", True),
        socket=socket_path,
        node_uid=uid,
        node_gid=int(helper.get("node_gid", gid_default)),
        instance_bridges=helper.get("instance_bridges", ()),
        audit_dir=helper.get("audit_dir", DEFAULT_AUDIT_DIR),
        allowed_clusters=tuple(_explicit(c) for c in doc["kubernetes"].get("allowed_clusters", ())),
        unsigned_access=helper.get("unsigned_access", False),
        root_principals=helper.get("root_principals", False),
        guest_network_rules=helper.get("guest_network_rules", True),
        data_dir=top.get("data_dir", DEFAULT_DATA_DIR).rstrip("/") or "/",
        libvirt_uri=helper.get("libvirt_uri", DEFAULT_LIBVIRT_URI),
        root_socket=root_socket,
        audit_max_bytes=helper.get("audit_max_bytes", 16 * 1024 * 1024),
        audit_keep=helper.get("audit_keep", 8),
        audit_min_age_s=helper.get("audit_min_age_s", 86400),
        sysctl_allow=tuple(doc["host"].get("sysctl_allow", ())),
    )


def load_audit_dir(root: Path, path: str = DEFAULT_CONFIG) -> str:
    """`[helper] audit_dir` of root's config, for `bcd helper audit`: the same ownership rules and the
    whole file validated, but no account looked up. The audit commands never use the node's account,
    and `audit init` runs at set-up, possibly before the account exists (or under --root, where it is
    in DIR's passwd, not this host's)."""
    data = read_root_config(root, path)
    try:
        doc = schema.parse_document(schema.decode(data, path), path)
    except schema.ConfigError as exc:
        raise ConfigError(str(exc)) from None
    audit_dir: str = doc["helper"].get("audit_dir", DEFAULT_AUDIT_DIR)
    return audit_dir


def load_config(root: Path, path: str = DEFAULT_CONFIG) -> HelperConfig:
    """Read and decode root's config at host path `path` under `root` ("/" on a real host)."""
    return parse_config(read_root_config(root, path), path)
