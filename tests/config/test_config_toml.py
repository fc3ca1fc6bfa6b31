"""config.toml: every key parsed strictly; every rule refused with a message naming key and rule."""

from __future__ import annotations

import base64
import ipaddress
from pathlib import Path

import pytest
from bcd_agent.config import (
    DEFAULT_DATA_DIR,
    JOURNAL_MAX_BYTES,
    JOURNAL_MAX_EVENTS,
    AllowedCluster,
    Config,
    ConfigError,
    load_config,
    parse_config,
)

HEX_A = "a" * 64
HEX_B = "0123456789abcdef" * 4
PIN = "sha256/" + base64.b64encode(bytes(range(32))).decode()

FULL = f"""
data_dir = "/srv/bcd"
join_signing_key_pin = "{PIN}"
command_root_sha256 = "{HEX_A},{HEX_B}"

[control_plane]
address = "gw.example.com:7443"
unix_socket = "/run/bcd/devplane.sock"
ca_file = "/etc/bcd/ca.pem"
server_name = "gateway.example.com"

[helper]
socket = "/run/bcd/helper.sock"
instance_bridges = "br0, br-vps"
node_user = "bcd"
audit_dir = "/var/log/bcd-helper"

[host]
units = false

[journal]
max_bytes = 33554432
max_events = 5000

[kubernetes]
allowed_clusters = "https://10.0.0.1:6443#sha256:{HEX_A},https://k8s.example.com#sha256:{HEX_B}"

[devices]
pod_resources_socket = "/run/kubelet/pod-resources.sock"

[instances]
balloon_floor_percent = 30

[site]
bmc_networks = "10.20.0.0/16,fd00:bc::/64"

[log]
level = "debug"
"""


def test_every_key_parses_into_frozen_values() -> None:
    c = parse_config(FULL, "/etc/bcd/config.toml")
    assert c.data_dir == "/srv/bcd"
    assert c.journal_path == Path("/srv/bcd/journal.db")
    assert c.identity_path == Path("/srv/bcd/identity.json")
    assert str(c.join_signing_key_pin) == PIN
    assert c.command_root_sha256 == (HEX_A, HEX_B)
    assert c.control_plane.address == "gw.example.com:7443"
    assert c.control_plane.unix_socket == "/run/bcd/devplane.sock"
    assert c.control_plane.ca_file == "/etc/bcd/ca.pem"
    assert c.control_plane.server_name == "gateway.example.com"
    assert c.helper.socket == "/run/bcd/helper.sock" and c.under_helper
    assert (c.helper.node_user, c.helper.audit_dir) == ("bcd", "/var/log/bcd-helper")
    assert c.devices.pod_resources_socket == "/run/kubelet/pod-resources.sock"
    assert c.helper.instance_bridges == ("br0", "br-vps")
    assert c.host.units is False
    assert (c.journal.max_bytes, c.journal.max_events) == (32 * 1024 * 1024, 5000)
    assert c.kubernetes.allowed_clusters == (
        AllowedCluster("https://10.0.0.1:6443", HEX_A),
        AllowedCluster("https://k8s.example.com", HEX_B),
    )
    assert str(c.kubernetes.allowed_clusters[0]) == f"https://10.0.0.1:6443#sha256:{HEX_A}"
    assert c.instances.balloon_floor_percent == 30
    assert c.site.bmc_networks == (ipaddress.ip_network("10.20.0.0/16"), ipaddress.ip_network("fd00:bc::/64"))
    assert c.log.level == "debug"
    with pytest.raises(AttributeError):
        c.data_dir = "/tmp"  # type: ignore[misc]


def test_an_empty_file_gives_the_documented_defaults() -> None:
    c = parse_config("")
    assert c == Config(source="config.toml")
    assert c.data_dir == DEFAULT_DATA_DIR
    assert c.host.units is True
    assert (c.journal.max_bytes, c.journal.max_events) == (JOURNAL_MAX_BYTES, JOURNAL_MAX_EVENTS)
    assert c.helper.socket is None and not c.under_helper
    assert c.instances.balloon_floor_percent == 50
    assert c.kubernetes.allowed_clusters == ()
    assert c.log.level == "info"


# (toml text, key named in the message, a fragment of the rule)
REFUSED = [
    ("datadir = '/x'", "datadir", "unknown key at the top level"),
    ("[hots]\nunits = true", "[hots]", "unknown table"),
    (
        "[helper]\nsockets = '/x'",
        "[helper] sockets",
        "unknown key in [helper] (known: audit_dir, audit_keep, audit_max_bytes, audit_min_age_s,"
        " guest_network_rules,"
        " instance_bridges, libvirt_uri, node_gid",
    ),
    ("host = true", "[host]", "must be a table"),
    ("[[journal]]\nmax_bytes = 1", "[journal]", "must be a table ([journal] on its own line), got an array"),
    ("data_dir = 'var/lib/bcd'", "data_dir", "absolute path"),
    ("data_dir = '/var/../etc'", "data_dir", "absolute path without '..'"),
    ("data_dir = '/'", "data_dir", "not /"),
    # systemd unit settings take it (BindPaths=SOURCE:DEST): before, `:` was an internal error at ch.launch
    ("data_dir = '/srv/a:b'", "data_dir", "letters, digits and . _ + @ - / only"),
    ("data_dir = '/srv/a b'", "data_dir", "letters, digits and . _ + @ - / only"),
    ("data_dir = '/srv/%h'", "data_dir", "letters, digits and . _ + @ - / only"),
    ("data_dir = '/srv/a\\\\b'", "data_dir", "letters, digits and . _ + @ - / only"),
    ("data_dir = 7", "data_dir", "must be a string"),
    ("join_signing_key_pin = 'abc'", "join_signing_key_pin", "must start with 'sha256/'"),
    ("join_signing_key_pin = 'sha256/" + "!" * 44 + "'", "join_signing_key_pin", "base64"),
    ("join_signing_key_pin = 'sha256/AAAA'", "join_signing_key_pin", "44 characters"),
    ("join_signing_key_pin = 7", "join_signing_key_pin", "must be a string"),
    ("command_root_sha256 = 'ABC'", "command_root_sha256", "64 hex digits"),
    (f"command_root_sha256 = '{HEX_A.upper()}'", "command_root_sha256", "lowercase hex"),
    (f"command_root_sha256 = '{HEX_A},,{HEX_B}'", "command_root_sha256", "is empty"),
    (f"command_root_sha256 = '{HEX_A},{HEX_A}'", "command_root_sha256", "repeats"),
    ("command_root_sha256 = ''", "command_root_sha256", "leave the key out"),
    (
        "command_root_sha256 = '" + ",".join(f"{i:064x}" for i in range(17)) + "'",
        "command_root_sha256",
        "at most 16",
    ),
    ("[control_plane]\naddress = 'gw.example.com'", "[control_plane] address", "must name a port"),
    ("[control_plane]\naddress = 'gw.example.com:70000'", "[control_plane] address", "outside 1-65535"),
    ("[control_plane]\naddress = 'bad host!:443'", "[control_plane] address", "bad host name"),
    ("[control_plane]\naddress = '[::zz]:443'", "[control_plane] address", "bad IPv6 address"),
    ("[control_plane]\nunix_socket = 'rel.sock'", "[control_plane] unix_socket", "absolute path"),
    ("[control_plane]\nserver_name = '-x-'", "[control_plane] server_name", "DNS name or IP address"),
    ("[helper]\nsocket = 'helper.sock'", "[helper] socket", "absolute path"),
    ("[helper]\ninstance_bridges = 'br0,br/1'", "[helper] instance_bridges", "network interface name"),
    ("[helper]\ninstance_bridges = 'a-very-long-bridge-name'", "[helper] instance_bridges", "1 to 15"),
    ("[helper]\nnode_user = 'Root'", "[helper] node_user", "account name"),
    ("[helper]\nnode_uid = 0", "[helper] node_uid", "from 1 to"),
    ("[helper]\nnode_user = 'bcd'\nnode_uid = 999", "[helper] node_uid", "not both"),
    ("[helper]\naudit_dir = 'log'", "[helper] audit_dir", "absolute path"),
    ("[host]\nunits = 'false'", "[host] units", "must be a boolean"),
    ("[host]\nunits = 0", "[host] units", "must be a boolean"),
    ("[journal]\nmax_bytes = 67108865", "[journal] max_bytes", "never raise it"),
    ("[journal]\nmax_bytes = 1000", "[journal] max_bytes", "from 1048576 to 67108864"),
    ("[journal]\nmax_bytes = '64MiB'", "[journal] max_bytes", "must be an integer"),
    ("[journal]\nmax_events = 10001", "[journal] max_events", "10,000 at most"),
    ("[journal]\nmax_events = true", "[journal] max_events", "must be an integer"),
    (
        "[kubernetes]\nallowed_clusters = 'http://k8s#sha256:" + HEX_A + "'",
        "[kubernetes] allowed_clusters",
        "https://",
    ),
    ("[kubernetes]\nallowed_clusters = 'https://k8s:6443'", "[kubernetes] allowed_clusters", "#sha256:"),
    (
        "[kubernetes]\nallowed_clusters = 'https://k8s#sha256:abc'",
        "[kubernetes] allowed_clusters",
        "64 lowercase",
    ),
    (
        "[kubernetes]\nallowed_clusters = 'https://k8s:0#sha256:" + HEX_A + "'",
        "[kubernetes] allowed_clusters",
        "port",
    ),
    ("[devices]\npod_resources_socket = 'kubelet.sock'", "[devices] pod_resources_socket", "absolute"),
    ("[kubernetes]\npod_resources_socket = '/x'", "[kubernetes] pod_resources_socket", "unknown key"),
    ("[instances]\nballoon_floor_percent = 9", "[instances] balloon_floor_percent", "from 10 to 100"),
    ("[instances]\nballoon_floor_percent = 101", "[instances] balloon_floor_percent", "from 10 to 100"),
    ("[site]\nbmc_networks = '10.0.0.1/16'", "[site] bmc_networks", "CIDR"),
    ("[site]\nbmc_networks = 'bmc'", "[site] bmc_networks", "CIDR"),
    ("[log]\nlevel = 'verbose'", "[log] level", "one of debug, info, warning, error"),
    ("[log]\nlevel = 'info'\nformat = 'json'", "[log] format", "unknown key in [log]"),
    ("data_dir = ", "", "not valid TOML"),
]


@pytest.mark.parametrize(
    ("text", "key", "rule"), REFUSED, ids=[f"{i:02d}-{r[1] or 'toml'}" for i, r in enumerate(REFUSED)]
)
def test_every_rule_is_refused_naming_the_key_and_the_rule(text: str, key: str, rule: str) -> None:
    """Covers HST-SIGN-13 (a malformed pin stops bcd), HST-K8S-54/55 (allowed_clusters form; a
    malformed entry stops bcd), DLV-JRN-18 (the journal bounds may be lowered, never raised)."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, "/etc/bcd/config.toml")
    err = info.value
    assert err.key == key
    assert rule in err.rule
    assert str(err).startswith(f"/etc/bcd/config.toml: {key}: " if key else "/etc/bcd/config.toml: ")


def test_load_config_reads_the_file_and_refuses_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[host]\nunits = false\n")
    assert load_config(path).host.units is False
    assert load_config(path).source == str(path)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    assert load_config(tmp_path / "nope.toml", missing_ok=True).host.units is True
    (tmp_path / "latin1.toml").write_bytes(b"data_dir = '/caf\xe9'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "latin1.toml")


# One valid value per schema key, as TOML (a key added to SCHEMA must be added here too).
EVERY_KEY = {
    "data_dir": '"/srv/bcd"',
    "join_signing_key_pin": f'"{PIN}"',
    "command_root_sha256": f'"{HEX_A}"',
    "[control_plane] address": '"gw.example.com:7443"',
    "[control_plane] unix_socket": '"/run/bcd/devplane.sock"',
    "[control_plane] ca_file": '"/etc/bcd/ca.pem"',
    "[control_plane] server_name": '"gateway.example.com"',
    "[control_plane] max_message_bytes": "1048576",
    "[control_plane] frame_deadline_s": "20",
    "[control_plane] stall_timeout_s": "30",
    "[helper] socket": '"/run/bcd/helper.sock"',
    "[helper] instance_bridges": '"br0"',
    "[helper] node_uid": "990",
    "[helper] node_gid": "990",
    "[helper] audit_dir": '"/var/log/bcd-helper"',
    "[helper] unsigned_access": "true",
    "[helper] root_principals": "true",
    "[helper] guest_network_rules": "false",
    "[helper] libvirt_uri": '"test:///default"',
    "[helper] audit_max_bytes": "65536",
    "[helper] audit_min_age_s": "3600",
    "[helper] audit_keep": "3",
    "[helper] root_socket": '"/run/bcd/root.sock"',
    "[host] units": "false",
    "[host] sysctl_allow": '"vm.swappiness"',
    "[devices] pod_resources_socket": '"/run/kubelet/pod-resources.sock"',
    "[journal] max_bytes": "2097152",
    "[journal] max_events": "500",
    "[journal] group_commit": "true",
    "[kubernetes] allowed_clusters": f'"https://10.0.0.1:6443#sha256:{HEX_A}"',
    "[instances] balloon_floor_percent": "30",
    "[site] bmc_networks": '"10.20.0.0/16"',
    "[log] level": '"debug"',
}


def test_the_node_takes_every_key_of_the_schema() -> None:
    """Each key the schema accepts reaches the node's frozen values: a key the schema knows but the
    node's table type lacks (`[helper] guest_network_rules`, which `bcd sim` writes) once crashed
    `bcd node` and `bcd doctor` with a TypeError instead of starting."""
    from bcd_agent.config import SCHEMA

    assert set(EVERY_KEY) | {"[helper] node_user"} == {
        f"[{t}] {k}" if t else k for t, keys in SCHEMA.items() for k in keys
    }
    tables: dict[str, list[str]] = {}
    for name, value in EVERY_KEY.items():
        table, _, key = name.rpartition(" ")
        tables.setdefault(table.strip("[]"), []).append(f"{key} = {value}")
    text = "\n".join(tables.pop(""))
    text += "".join(f"\n[{t}]\n" + "\n".join(lines) for t, lines in tables.items())
    c = parse_config(text + "\n")
    assert c.helper.guest_network_rules is False
    assert c.helper.root_socket == "/run/bcd/root.sock" and c.host.sysctl_allow == ("vm.swappiness",)
    assert parse_config('[helper]\nnode_user = "bcd"\n').helper.node_user == "bcd"


def test_the_documented_key_table_matches_the_schema() -> None:
    """docs/config.md documents every key the parser accepts, and nothing else."""
    import re

    from bcd_agent.config import SCHEMA
    from testsupport import REPO

    doc = (REPO / "docs" / "config.md").read_text()
    documented = set(re.findall(r"^\| `((?:\[\w+\] )?\w+)` \|", doc, re.M))
    accepted = {f"[{t}] {k}" if t else k for t, keys in SCHEMA.items() for k in keys}
    assert documented == accepted


def test_the_root_helper_reads_the_same_file() -> None:
    """One file, two strict readers: whatever the node accepts, the helper's reader accepts too
    (tables the helper does not own are the node's), and they agree on root's keys (HST-HLP-31)."""
    helper_config = pytest.importorskip("bcd_helper.config")
    text = FULL.replace('node_user = "bcd"', "node_uid = 990")
    node = parse_config(text)
    root = helper_config.parse_config(text.encode(), "/etc/bcd/config.toml")
    assert root.host_units is node.host.units is False
    assert root.command_root_sha256 == node.command_root_sha256
    assert node.join_signing_key_pin is not None
    assert root.join_signing_key_pin == node.join_signing_key_pin.digest
    assert root.instance_bridges == node.helper.instance_bridges
    assert root.socket == node.helper.socket
    assert [c.ca_sha256 for c in root.allowed_clusters] == [
        c.ca_sha256 for c in node.kubernetes.allowed_clusters
    ]


@pytest.mark.parametrize(
    ("text", "key", "rule"), REFUSED, ids=[f"{i:02d}-{r[1] or 'toml'}" for i, r in enumerate(REFUSED)]
)
def test_one_schema_the_helper_refuses_what_the_node_refuses(text: str, key: str, rule: str) -> None:
    """Issue 15, item 7: the root helper validates with the same schema (bcd_shared.configschema), so
    it refuses every value and key the node refuses, with the node's message, which names the file."""
    helper_config = pytest.importorskip("bcd_helper.config")
    with pytest.raises(ConfigError) as node:
        parse_config(text, "/etc/bcd/config.toml")
    with pytest.raises(helper_config.ConfigError) as root:
        helper_config.parse_config(text.encode(), "/etc/bcd/config.toml")
    assert str(root.value) == str(node.value)


def test_one_schema_keys_the_helper_used_to_pass() -> None:
    """What the helper accepted and the node refused: a top-level log_level, keys in the node's tables
    (it skipped them), an uppercase cluster pin. Both refuse them now; both accept the full file."""
    helper_config = pytest.importorskip("bcd_helper.config")
    for text in (
        "log_level = 'debug'\n",
        "node_id = 'n1'\n",
        "[control_plane]\nanything = 1\n",
        f"[kubernetes]\nallowed_clusters = 'https://k8s:6443#sha256:{HEX_A.upper()}'\n",
    ):
        with pytest.raises(ConfigError):
            parse_config(text)
        with pytest.raises(helper_config.ConfigError, match=r"^/etc/bcd/config\.toml: "):
            helper_config.parse_config(f"{text}[helper]\nnode_uid = 900\n".encode(), "/etc/bcd/config.toml")
    full = FULL.replace('node_user = "bcd"', "node_uid = 990")
    assert parse_config(full).helper.node_uid == 990
    assert helper_config.parse_config(full.encode(), "/etc/bcd/config.toml").node_uid == 990


def test_the_schema_lives_in_shared() -> None:
    """One table: the agent's SCHEMA is bcd_shared.configschema's, and the helper imports no agent code."""
    from bcd_agent import config as agent_config
    from bcd_shared import configschema

    assert agent_config.SCHEMA is configschema.SCHEMA


def test_every_config_snippet_in_the_docs_parses() -> None:
    """Each `[table] key = value` the docs quote (README.md, docs/*.md) is TOML the node's strict reader
    accepts, placeholders (PATH, PORT) filled in; an operator pastes them. Before: docs/instances.md
    quoted `[helper] libvirt_uri = qemu:///system`, which is not TOML (the value is a string)."""
    import re

    from testsupport import REPO

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = 0
    for page in pages:
        if page.name == "compliance.md":  # generated from test names and notes
            continue
        for table, key, value in re.findall(r"`\[(\w+)\] (\w+) = ([^`]+)`", page.read_text()):
            value = value.replace('"PATH"', '"/run/bcd/x.sock"').replace(":PORT", ":443")
            try:
                parse_config(f"[{table}]\n{key} = {value}\n", f"{page.name}: [{table}] {key}")
            except ConfigError as exc:
                pytest.fail(f"{page.relative_to(REPO)}: `[{table}] {key} = {value}`: {exc}")
            found += 1
    assert found >= 5  # the pattern still finds what it is for
