"""`bcd doctor` as root on a node with `[helper]`: which node root's helper binds host units to, and whether
it checks signatures at all (host-config.md "Signed specs", the doctor table).

Each test lays out a scratch root (doctor's `--root`) with root's join record where the helper reads it,
`/var/lib/bcd-hostconfig/join-response.pb`, root-only; the data directory and config are real paths.
Running as root is needed: the record is read under the root-only rule (root-owned directories).

Covers HST-SIGN-38 (ok "host units bind to <node-id> (root's signed join record)"), HST-SIGN-39 (warn on
trust on first use, fixed by `bcd join --reset --yes`), HST-SIGN-40 (fail: the record names another node),
HST-SIGN-41 (fail: the pinned key did not sign it), HST-SIGN-42 (the second fail when neither
command_root_sha256 nor the record names command-signing roots).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bcd_agent.doctor import UNSIGNED, Finding, HostView, check_all
from bcd_agent.session import identity as ident
from bcd_shared import wire
from bcd_shared.joinrecord import JOIN_RECORD
from bcd_shared.pki import KeyPair, TrustBundle, issue_node_certificate, issue_root, sign_trust_bundle
from bcd_shared.pki.join import sign_join_response
from bcd_shared.pki.pins import JoinKeyPin

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="doctor reads root's join record as root")

NODE = "node-doctor-1"
NOW = dt.datetime.now(dt.UTC)


class Site:
    """A control plane's keys: the JoinService key (pinned) and a command-signing root."""

    def __init__(self) -> None:
        self.join = KeyPair.generate()
        self.pin = str(JoinKeyPin.of_key(self.join.public_key))
        self.root_key = KeyPair.generate()
        self.command_root = issue_root(
            self.root_key, "cmd root", NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=30), path_length=0
        )
        self.ca_key = KeyPair.generate()
        self.ca = issue_root(
            self.ca_key, "node ca", NOW - dt.timedelta(days=1), NOW + dt.timedelta(days=30), path_length=0
        )

    def record(
        self, node_id: str, *, roots: bool = True, bundle: bool = True, key: KeyPair | None = None
    ) -> bytes:
        node_key = KeyPair.generate()
        cert = issue_node_certificate(
            self.ca, self.ca_key, node_key.public_key, node_id, NOW, NOW + dt.timedelta(days=30)
        )
        signed = sign_trust_bundle(
            self.join, TrustBundle(version=4, command_roots=(self.command_root,) if roots else ())
        )
        body = wire.JoinResponseBody(
            node_id=node_id,
            certificate_chain=[cert],
            trust_bundle=signed if bundle else None,
            issued_at=int(NOW.timestamp() * 1000),
        )
        return sign_join_response(key or self.join, body)


def view(root: Path, euid: int) -> HostView:
    return HostView(root=root, euid=euid, which=lambda _n: None, wall_clock=lambda: 1_800_000_000.0)


class Host:
    def __init__(self, tmp: Path, site: Site) -> None:
        os.chmod(tmp, 0o755)
        self.tmp = tmp
        self.site = site
        self.root = tmp  # stands for /: config, data_dir and sockets are host paths under it
        (self.root / "etc").mkdir(parents=True)
        self.data = tmp / "data"
        self.data.mkdir(mode=0o700)
        self.view = HostView(
            root=self.root, euid=0, which=lambda _n: None, wall_clock=lambda: 1_800_000_000.0
        )

    def joined(self, node_id: str = NODE) -> None:
        node_key = KeyPair.generate()
        cert = issue_node_certificate(
            self.site.ca, self.site.ca_key, node_key.public_key, node_id, NOW, NOW + dt.timedelta(days=30)
        )
        ident.save(self.data, ident.Identity(node_id, node_key, (cert,), self.site.pin))

    def put_record(self, data: bytes) -> Path:
        path = self.root / JOIN_RECORD.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        path.write_bytes(data)
        os.chmod(path, 0o600)
        return path

    def put_helper_state(self, node_id: str, source: str) -> None:
        path = self.root / "var/lib/bcd-hostconfig/helper-intent.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"node_id": node_id, "node_source": source}))
        os.chmod(path, 0o600)

    def config(self, *, pin: bool = True, command_roots: bool = False, helper: bool = True) -> str:
        text = 'data_dir = "/data"\n'
        if pin:
            text += f'join_signing_key_pin = "{self.site.pin}"\n'
        if command_roots:
            text += f'command_root_sha256 = "{hashlib.sha256(self.site.command_root).hexdigest()}"\n'
        if helper:
            text += '[helper]\nsocket = "/helper.sock"\n'
        (self.tmp / "config.toml").write_text(text)
        return "/config.toml"

    def check(self, **kw: bool) -> dict[str, list[Finding]]:
        out: dict[str, list[Finding]] = {}
        for f in check_all(self.config(**kw), self.view):
            out.setdefault(f.check, []).append(f)
        return out


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path, Site())


def test_HST_SIGN_38_ok_when_the_record_names_this_node_and_the_pinned_key_signed_it(host: Host) -> None:
    host.joined()
    host.put_record(host.site.record(NODE))
    found = host.check()
    [binding] = found["join-binding"]
    assert (binding.level, binding.message) == (
        "ok",
        f"host units bind to {NODE} (root's signed join record)",
    )
    [intent] = found["signed-intent"]
    assert intent.level == "ok" and "root's join record names 1 command-signing root" in intent.message


def test_HST_SIGN_39_warn_when_the_node_joined_before_the_record(host: Host) -> None:
    host.joined()
    host.put_helper_state(NODE, "first-signed-spec")
    found = host.check(command_roots=True)
    [binding] = found["join-binding"]
    assert binding.level == "warn"
    assert "trust on first use" in binding.message and f"bound to {NODE}" in binding.message
    assert "bcd join --reset --yes" in binding.fix
    # With command_root_sha256 the helper still checks signatures: no second finding fails.
    assert [f.level for f in found["signed-intent"]] == ["ok"]


def test_HST_SIGN_40_fail_when_the_record_names_another_node(host: Host) -> None:
    host.joined()
    host.put_record(host.site.record("node-someone-else"))
    [binding] = host.check()["join-binding"]
    assert binding.level == "fail"
    assert "names node node-someone-else" in binding.message and NODE in binding.message
    assert "bcd join --reset --yes" in binding.fix


def test_HST_SIGN_41_fail_when_the_pinned_key_did_not_sign_the_record(host: Host) -> None:
    host.joined()
    host.put_record(host.site.record(NODE, key=KeyPair.generate()))
    found = host.check()
    [binding] = found["join-binding"]
    assert binding.level == "fail"
    assert "not signed by the pinned JoinService key" in binding.message
    assert "refuses every host unit" in binding.message
    # The helper refuses everything then: it does not apply units unsigned, so no second finding.
    assert "signed-intent" not in found


def test_HST_SIGN_41_a_record_changed_on_disk_fails(host: Host) -> None:
    host.joined()
    data = bytearray(host.site.record(NODE))
    data[-1] ^= 1
    host.put_record(bytes(data))
    [binding] = host.check()["join-binding"]
    assert binding.level == "fail" and "not signed by the pinned JoinService key" in binding.message


@pytest.mark.parametrize(
    ("record", "where"),
    [(None, "is missing"), ("rootless", "has no trust bundle with command-signing roots"), ("no-bundle", "")],
)
def test_HST_SIGN_42_second_fail_when_nothing_names_command_signing_roots(
    host: Host, record: str | None, where: str
) -> None:
    host.joined()
    if record is not None:
        host.put_record(host.site.record(NODE, roots=False, bundle=record == "rootless"))
    found = host.check()
    [intent] = found["signed-intent"]
    assert intent.level == "fail" and UNSIGNED in intent.message and where in intent.message
    assert UNSIGNED == "bcd helper applies host units unsigned unless the node itself presents a trust bundle"
    assert "command_root_sha256" in intent.fix and "bcd join --reset --yes" in intent.fix
    # Beside the binding's own finding (ok with a record, warn without one).
    assert [f.level for f in found["join-binding"]] == (["ok"] if record else ["warn"])
    # command_root_sha256 alone closes it.
    assert [f.level for f in host.check(command_roots=True)["signed-intent"]] == ["ok"]


def test_a_helper_bound_to_a_record_that_is_gone_fails(host: Host) -> None:
    host.joined()
    host.put_helper_state(NODE, "record")
    [binding] = host.check(command_roots=True)["join-binding"]
    assert binding.level == "fail" and "is gone" in binding.message


def test_a_helper_bound_on_first_use_to_another_node_fails(host: Host) -> None:
    host.joined()
    host.put_helper_state("node-first-spec", "first-signed-spec")
    [binding] = host.check(command_roots=True)["join-binding"]
    assert binding.level == "fail" and "node-first-spec" in binding.message


def test_a_record_without_a_pin_in_roots_config_fails(host: Host) -> None:
    host.joined()
    host.put_record(host.site.record(NODE))
    [binding] = host.check(pin=False)["join-binding"]
    assert binding.level == "fail" and "no join_signing_key_pin" in binding.message


def test_a_record_under_a_directory_the_node_could_write_fails(host: Host) -> None:
    host.joined()
    path = host.put_record(host.site.record(NODE))
    os.chmod(path.parent, 0o777)
    [binding] = host.check()["join-binding"]
    assert binding.level == "fail" and "root-only rule" in binding.message


def test_not_reported_without_helper_or_root(host: Host) -> None:
    host.joined()
    assert "join-binding" not in host.check(helper=False) and "signed-intent" not in host.check(helper=False)
    host.view = view(host.root, euid=990)
    assert "join-binding" not in host.check() and "signed-intent" not in host.check()


def test_bcd_doctor_root_json_reports_the_binding(host: Host) -> None:
    """The command: `bcd doctor --root DIR --json` exits 1 on the failures (the helper socket is not
    served here either) and carries both findings."""
    host.joined()
    host.put_record(host.site.record("node-other"))
    res = subprocess.run(
        [sys.executable, "-m", "bcd_agent.cli", "doctor", "--config", host.config(), "--root", str(host.root),
         "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    checks = {f["check"]: f for f in doc["findings"]}
    assert checks["join-binding"]["level"] == "fail" and "node-other" in checks["join-binding"]["message"]
    assert checks["signed-intent"]["level"] == "ok"
