"""Root's config.toml: what root does for the node, read only from a file only root can write.

Rules (host-config.md "Under bcd helper", "Signed specs", "Which clusters"; HST-HLP-20..31,
HST-SIGN-05/11/13, HST-K8S-54/55):
- the file must be a regular file (not a symlink), owned by root, writable by neither group nor
  others, in directories only root can write (the root-only rule, from `/` down); otherwise the
  helper stops with `<path> must be a regular file root owns that no one else can write`. The
  install's `root:bcd 0640` in `/etc/bcd 0750` passes;
- it is parsed with tomllib, strictly: within the helper's keys and tables an unknown key or a bad
  value stops the helper with a message naming the key and the rule.

The same file is the node's config (the node reads it through its group). The helper owns:
  join_signing_key_pin   "sha256/<padded base64 of SHA-256 of the JoinService key's SPKI DER>"
  command_root_sha256    "<64 lowercase hex>,..." 1 to 16, no repeats
(The pins are parsed here with the same rules as bcd_shared.pki.pins, which a test checks; importing
bcd_shared.pki would pull the wire types and cryptography into the helper's start-up, ~100 ms. The
signed-intent checks import it when a host.unit first needs it.)
  [host] units           bool, default true
  [helper] socket        the socket path, default /run/bcd/helper.sock
  [helper] node_user     the node's account, default "bcd" (resolved with the passwd database)
  [helper] node_uid      the node's uid (instead of node_user; tests and containers)
  [helper] node_gid      the group the socket is given to, default the node account's group
  [helper] instance_bridges  "br0,br1": bridges instance taps may join (interface names)
  [helper] audit_dir     the audit log's directory, default /var/log/bcd-helper
  [helper] unsigned_access  bool, default false: with no command-signing roots, access.apply renders the
                         sshd files from an unsigned spec. Development only: without it, access writes
                         need a signed spec (issue 9 item 1)
  [helper] root_principals  bool, default false: an account of uid 0 may get a principals file
  [helper] libvirt_uri   the libvirt connection of libvirt.*: qemu:///system (default) or test:///default
  data_dir               (the node's key, read by root too) where instance disks may live, default
                         /var/lib/bcd: libvirt.* allows disks only under it
  [helper] audit_max_bytes  rotate audit.log past this size, 16384 to 1 GiB, default 16 MiB
  [helper] audit_keep    rotated files kept once the node has read past them, 1 to 1000, default 8
  [helper] root_socket   root's own socket (0600 root; the node cannot reach or fill it),
                         default /run/bcd/helper-root.sock
  [host] sysctl_allow    "vm.swappiness,net.core.": when set, the sysctl unit takes only keys equal to
                         one of these names or under one of these prefixes (whole name components);
                         the denylist applies either way
  [kubernetes] allowed_clusters  "https://host[:port]#sha256:<64 hex>,..."
Other top-level tables are the node's and are checked by the node's own strict loader; they are not
read here. Other top-level scalar keys must be in NODE_SCALARS, else the helper stops: a misspelt
pin at the top level must never pass silently.
"""

from __future__ import annotations

import base64
import binascii
import os
import pwd
import re
import stat
import tomllib
from pathlib import Path
from typing import Any

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, open_regular_nofollow

DEFAULT_CONFIG = "/etc/bcd/config.toml"
DEFAULT_SOCKET = "/run/bcd/helper.sock"
DEFAULT_ROOT_SOCKET = "/run/bcd/helper-root.sock"
DEFAULT_AUDIT_DIR = "/var/log/bcd-helper"
DEFAULT_NODE_USER = "bcd"
MAX_CONFIG_BYTES = 1024 * 1024
MAX_ROOT_PINS = 16
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

# Top-level scalar keys the node's config owns; the helper ignores them.
NODE_SCALARS = frozenset({"data_dir", "log_level", "mode", "node_id"})

_HELPER_KEYS = frozenset(
    {
        "socket",
        "root_socket",
        "node_user",
        "node_uid",
        "node_gid",
        "instance_bridges",
        "audit_dir",
        "unsigned_access",
        "root_principals",
        "libvirt_uri",
        "audit_max_bytes",
        "audit_keep",
    }
)
DEFAULT_DATA_DIR = "/var/lib/bcd"
DEFAULT_LIBVIRT_URI = "qemu:///system"
# libvirt.*: the connection root drives; test:///default only for tests and `bcd bench instances`.
LIBVIRT_URIS = frozenset({"qemu:///system", "test:///default"})
_HOST_KEYS = frozenset({"units", "sysctl_allow"})
_SYSCTL_PREFIX_RE = re.compile(r"^[a-z0-9_]+(?:\.[a-z0-9_-]+)*\.?$")
_K8S_KEYS = frozenset({"allowed_clusters"})
_IFNAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\$?$")
_CLUSTER_RE = re.compile(
    r"^https://([A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])(?::([0-9]{1,5}))?#sha256:([0-9a-fA-F]{64})$"
)


class ConfigError(Exception):
    """Root's config cannot be used; the helper does not start. The message names the key or path."""


@frozen
class AllowedCluster:
    """One `allowed_clusters` entry: the API server (port made explicit) and its CA pin (lowercase)."""

    server: str
    ca_sha256: str

    def __str__(self) -> str:
        return f"{self.server}#sha256:{self.ca_sha256}"


def parse_root_pins(text: str, key: str = "command_root_sha256") -> tuple[str, ...]:
    """At most 16 lowercase-hex SHA-256 pins, comma-separated (spaces around commas allowed)."""
    if text.strip(" ") == "":
        raise ConfigError(f"{key}: is empty; leave the key out to pin no roots")
    entries = [e.strip(" ") for e in text.split(",")]
    if len(entries) > MAX_ROOT_PINS:
        raise ConfigError(f"{key}: {len(entries)} entries, at most {MAX_ROOT_PINS}")
    for i, entry in enumerate(entries, start=1):
        if not _HEX64.fullmatch(entry):
            raise ConfigError(
                f"{key} entry {i}: {entry!r} is not 64 lowercase hex digits (a SHA-256 of the root's DER)"
            )
        if entry in entries[: i - 1]:
            raise ConfigError(f"{key}: entry {i} repeats {entry}")
    return tuple(entries)


def parse_join_pin(text: str, key: str = "join_signing_key_pin") -> bytes:
    """`sha256/` + 44 characters of canonical padded base64 of a SHA-256: the digest."""
    if not text.startswith("sha256/"):
        raise ConfigError(f"{key}: must start with 'sha256/'")
    encoded = text[len("sha256/") :]
    if not re.fullmatch(r"[A-Za-z0-9+/]{43}=", encoded):
        raise ConfigError(f"{key}: after 'sha256/' expected 44 characters of padded base64 of a SHA-256")
    try:
        digest = base64.b64decode(encoded, validate=True)
    except binascii.Error:
        raise ConfigError(f"{key}: not valid base64") from None
    if len(digest) != 32 or base64.b64encode(digest).decode() != encoded:
        raise ConfigError(f"{key}: non-canonical base64")
    return digest


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
    data_dir: str = DEFAULT_DATA_DIR
    libvirt_uri: str = DEFAULT_LIBVIRT_URI
    root_socket: str = DEFAULT_ROOT_SOCKET
    audit_max_bytes: int = 16 * 1024 * 1024
    audit_keep: int = 8
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


def _table(doc: dict[str, Any], name: str, allowed: frozenset[str]) -> dict[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: must be a table ([{name}])")
    for key in value:
        if key not in allowed:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(sorted(allowed))})")
    return value


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: must be a string, got {type(value).__name__}")
    return value


def _int(value: Any, key: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{key}: must be an integer from {lo} to {hi}")
    return value


def _list_of(value: Any, key: str) -> list[str]:
    text = _str(value, key)
    return [] if text.strip() == "" else [e.strip() for e in text.split(",")]


def parse_allowed_clusters(text: Any, key: str = "kubernetes.allowed_clusters") -> tuple[AllowedCluster, ...]:
    out: list[AllowedCluster] = []
    for i, entry in enumerate(_list_of(text, key), start=1):
        m = _CLUSTER_RE.fullmatch(entry)
        if m is None:
            raise ConfigError(
                f"{key}: entry {i} {entry!r} is not https://<host>[:<port>]#sha256:<64 hex digits>"
            )
        port = int(m.group(2) or "443")
        if not 1 <= port <= 65535:
            raise ConfigError(f"{key}: entry {i}: port {port} out of range")
        out.append(AllowedCluster(f"https://{m.group(1).lower()}:{port}", m.group(3).lower()))
    return tuple(out)


def parse_config(data: bytes, path: str = DEFAULT_CONFIG) -> HelperConfig:
    """Decode root's config strictly. Raises ConfigError naming the key."""
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for key, value in doc.items():
        if key in ("join_signing_key_pin", "command_root_sha256", "host", "helper", "kubernetes"):
            continue
        if not isinstance(value, dict) and key not in NODE_SCALARS:
            raise ConfigError(f"{key}: unknown key")
    pin = (
        parse_join_pin(_str(doc["join_signing_key_pin"], "join_signing_key_pin"))
        if "join_signing_key_pin" in doc
        else None
    )
    roots = (
        parse_root_pins(_str(doc["command_root_sha256"], "command_root_sha256"))
        if "command_root_sha256" in doc
        else ()
    )
    host = _table(doc, "host", _HOST_KEYS)
    units = host.get("units", True)
    if not isinstance(units, bool):
        raise ConfigError("host.units: must be true or false")
    allow = _list_of(host.get("sysctl_allow", ""), "host.sysctl_allow")
    for i, prefix in enumerate(allow, start=1):
        if not _SYSCTL_PREFIX_RE.fullmatch(prefix):
            raise ConfigError(f"host.sysctl_allow: entry {i} {prefix!r} is not a sysctl name or prefix")
    if "sysctl_allow" in host and not allow:
        raise ConfigError("host.sysctl_allow: is empty; leave the key out to allow every key not denied")
    helper = _table(doc, "helper", _HELPER_KEYS)
    socket_path = _str(helper.get("socket", DEFAULT_SOCKET), "helper.socket")
    if not socket_path.startswith("/") or len(socket_path) > 100:
        raise ConfigError("helper.socket: must be an absolute path of at most 100 characters")
    root_socket = _str(helper.get("root_socket", DEFAULT_ROOT_SOCKET), "helper.root_socket")
    if not root_socket.startswith("/") or len(root_socket) > 100 or root_socket == socket_path:
        raise ConfigError(
            "helper.root_socket: must be an absolute path of at most 100 characters, not helper.socket"
        )
    max_bytes = _int(
        helper.get("audit_max_bytes", 16 * 1024 * 1024), "helper.audit_max_bytes", 16384, 1 << 30
    )
    keep = _int(helper.get("audit_keep", 8), "helper.audit_keep", 1, 1000)
    audit_dir = _str(helper.get("audit_dir", DEFAULT_AUDIT_DIR), "helper.audit_dir")
    if not audit_dir.startswith("/") or ".." in audit_dir.split("/"):
        raise ConfigError("helper.audit_dir: must be an absolute path without '..'")
    if "node_uid" in helper and "node_user" in helper:
        raise ConfigError("helper.node_uid: give node_user or node_uid, not both")
    if "node_uid" in helper:
        uid = _int(helper["node_uid"], "helper.node_uid", 1, 2**31 - 2)
        gid_default = uid
    else:
        user = _str(helper.get("node_user", DEFAULT_NODE_USER), "helper.node_user")
        if not _USER_RE.fullmatch(user):
            raise ConfigError(f"helper.node_user: {user!r} is not an account name")
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise ConfigError(f"helper.node_user: no account {user!r} on this host") from None
        uid, gid_default = entry.pw_uid, entry.pw_gid
        if uid == 0:
            raise ConfigError("helper.node_user: the node's account must not be root")
    gid = _int(helper.get("node_gid", gid_default), "helper.node_gid", 1, 2**31 - 2)
    bridges = _list_of(helper.get("instance_bridges", ""), "helper.instance_bridges")
    for i, name in enumerate(bridges, start=1):
        if not _IFNAME_RE.fullmatch(name):
            raise ConfigError(f"helper.instance_bridges: entry {i} {name!r} is not an interface name")
    flags = {}
    for key in ("unsigned_access", "root_principals"):
        flags[key] = helper.get(key, False)
        if not isinstance(flags[key], bool):
            raise ConfigError(f"helper.{key}: must be true or false")
    k8s = _table(doc, "kubernetes", _K8S_KEYS)
    clusters = parse_allowed_clusters(k8s.get("allowed_clusters", ""))
    data_dir = _str(doc.get("data_dir", DEFAULT_DATA_DIR), "data_dir")
    if not data_dir.startswith("/") or ".." in data_dir.split("/") or data_dir.rstrip("/") == "":
        raise ConfigError("data_dir: must be an absolute path without '..', not /")
    uri = _str(helper.get("libvirt_uri", DEFAULT_LIBVIRT_URI), "helper.libvirt_uri")
    if uri not in LIBVIRT_URIS:
        raise ConfigError(f"helper.libvirt_uri: must be one of {', '.join(sorted(LIBVIRT_URIS))}")
    return HelperConfig(
        path=path,
        join_signing_key_pin=pin,
        command_root_sha256=roots,
        host_units=units,
        socket=socket_path,
        node_uid=uid,
        node_gid=gid,
        instance_bridges=tuple(bridges),
        audit_dir=audit_dir,
        allowed_clusters=clusters,
        unsigned_access=flags["unsigned_access"],
        root_principals=flags["root_principals"],
        data_dir=data_dir.rstrip("/"),
        libvirt_uri=uri,
        root_socket=root_socket,
        audit_max_bytes=max_bytes,
        audit_keep=keep,
        sysctl_allow=tuple(allow),
    )


def load_config(root: Path, path: str = DEFAULT_CONFIG) -> HelperConfig:
    """Read and decode root's config at host path `path` under `root` ("/" on a real host)."""
    return parse_config(read_root_config(root, path), path)
