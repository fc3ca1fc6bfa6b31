"""The access section's files against a real OpenSSH sshd and ssh client (issue 9 item 1).

A real node account asks a real helper for `access.apply` with a signed spec; root renders the files under
a simulated host. A real `sshd` then runs on loopback (a free high port, its own host key and config) in a
private mount namespace where the simulated host's `/etc/ssh` is bind-mounted over `/etc/ssh`, so sshd
reads exactly the files the helper wrote, at the paths the drop-in names, and the machine's own
/etc/ssh is never touched. A unique login account is created and removed by the test. Logins use the
real `ssh` client with certificates from `ssh-keygen -s`:
- a certificate for `<account>@node-a` from the spec's CA logs in;
- one for a principal the spec does not list, and one for the same account on another node, do not;
- after a newer spec revokes the first certificate's serial, the KRL refuses it (no sshd reload: the
  drop-in did not change, and sshd reads the KRL at every login).
The rendered drop-in also passes `sshd -t` with Debian's include layout.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_shared import access as acc
from intentkit import ControlPlane, access_body, access_doc, intent
from realnode import RealNode
from testsupport import require_tool

NODE = "node-a"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sshd_config(port: int) -> str:
    return (
        "Include /etc/ssh/sshd_config.d/*.conf\n"
        f"Port {port}\n"
        "ListenAddress 127.0.0.1\n"
        "HostKey /etc/ssh/test_host_ed25519_key\n"
        "PidFile none\n"
        "UsePAM no\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\n"
        "AuthorizedKeysFile none\n"
        "LogLevel VERBOSE\n"
    )


class Keys:
    """A user CA, one user key and certificates for it (ssh-keygen -s)."""

    def __init__(self, where: Path) -> None:
        self.where = where
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bcd test CA", "-f", str(where / "ca")],
            check=True,
        )
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(where / "user")], check=True)
        self.ca_line = (where / "ca.pub").read_text().strip()

    def cert(self, name: str, principal: str, serial: int) -> Path:
        subprocess.run(
            [
                "ssh-keygen",
                "-q",
                "-s",
                str(self.where / "ca"),
                "-I",
                name,
                "-n",
                principal,
                "-z",
                str(serial),
                "-V",
                "-5m:+1h",
                str(self.where / "user.pub"),
            ],
            check=True,
        )
        out = self.where / f"{name}-cert.pub"
        (self.where / "user-cert.pub").rename(out)
        return out


@pytest.fixture
def login() -> Iterator[str]:
    require_tool("useradd")
    name = f"bcdl{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", name],
        check=True,
        capture_output=True,
    )
    subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True)  # not locked, no password
    yield name
    subprocess.run(["userdel", name], capture_output=True)


def _in_namespace(root: Path, argv: list[str]) -> list[str]:
    """argv run with the simulated host's /etc/ssh over /etc/ssh, in a private mount namespace."""
    script = 'mount --bind "$1" /etc/ssh && shift && exec "$@"'
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(root / "etc/ssh"),
        *argv,
    ]


def _ssh(keys: Keys, cert: Path, user: str, port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "ssh",
            "-F",
            "/dev/null",
            "-p",
            str(port),
            "-i",
            str(keys.where / "user"),
            "-o",
            f"CertificateFile={cert}",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "ConnectTimeout=10",
            f"{user}@127.0.0.1",
            "id",
            "-un",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_DLV_ACC_01_02_03_04_real_sshd_accepts_revokes_and_refuses(login: str) -> None:
    for tool in ("sshd", "ssh", "ssh-keygen", "unshare", "mount"):
        require_tool(tool)
    sshd = shutil.which("sshd")
    assert sshd is not None
    cp = ControlPlane.build()
    worker = cp.command.leaf()
    node = RealNode(cp.config_lines(), setup=lambda root: cp.write_record(root, NODE, cp.bundle(1)))
    keydir = Path(tempfile.mkdtemp(prefix="bcd-ssh-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        keys = Keys(keydir)
        good = keys.cert("good", f"{login}@{NODE}", 7)
        unlisted = keys.cert("unlisted", f"other@{NODE}", 8)
        elsewhere = keys.cert("elsewhere", f"{login}@node-b", 9)
        spec = access_body(
            NODE, 2, ca_keys=(keys.ca_line,), principals=(f"{login}@{NODE}", f"{login}@node-b")
        )
        result = node.ok(access_doc(intent(worker, spec)))
        assert result["accounts"] == [login] and acc.SSHD_DROPIN in result["written"]
        # The test's own sshd: its config and host key beside the helper's files, in the simulated /etc/ssh.
        etc_ssh = node.root / "etc/ssh"
        port = _free_port()
        (etc_ssh / "sshd_config").write_text(_sshd_config(port))
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(etc_ssh / "test_host_ed25519_key")],
            check=True,
        )
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        checked = subprocess.run(
            _in_namespace(node.root, [sshd, "-t", "-f", "/etc/ssh/sshd_config"]),
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0, checked.stderr
        dumped = subprocess.run(
            _in_namespace(node.root, [sshd, "-T", "-f", "/etc/ssh/sshd_config"]),
            capture_output=True,
            text=True,
        )
        assert dumped.returncode == 0, dumped.stderr
        assert f"trustedusercakeys {acc.SSHD_CA}" in dumped.stdout
        assert f"revokedkeys {acc.SSHD_KRL}" in dumped.stdout
        proc = subprocess.Popen(
            _in_namespace(node.root, [sshd, "-D", "-e", "-f", "/etc/ssh/sshd_config"]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                assert time.monotonic() < deadline, "sshd did not listen"
                time.sleep(0.1)
        ok = _ssh(keys, good, login, port)
        assert ok.returncode == 0 and ok.stdout.strip() == login, ok.stderr
        for cert in (unlisted, elsewhere):
            refused = _ssh(keys, cert, login, port)
            assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused
        # A newer spec revokes serial 7: the KRL changes, the drop-in does not (no reload), login refused.
        spec = access_body(NODE, 3, ca_keys=(keys.ca_line,), principals=(f"{login}@{NODE}",), serials=(7,))
        result = node.ok(access_doc(intent(worker, spec)))
        assert result["written"] == [acc.SSHD_KRL] and result["reloaded"] == ""
        revoked = _ssh(keys, good, login, port)
        assert revoked.returncode == 255 and "Permission denied" in revoked.stderr, revoked
        again = keys.cert("again", f"{login}@{NODE}", 10)  # another serial from the same CA still logs in
        ok = _ssh(keys, again, login, port)
        assert ok.returncode == 0 and ok.stdout.strip() == login, ok.stderr
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        node.close()
        shutil.rmtree(keydir, ignore_errors=True)
