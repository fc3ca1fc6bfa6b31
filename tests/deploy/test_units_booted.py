"""The installed units under a real systemd as PID 1: an operator's first install, step by step.

`make deb`, both packages unpacked (`dpkg-deb -x`) and laid over a booted systemd's view of this
machine: `systemd-nspawn -D / --volatile=yes -b` (a tmpfs root over the host's /usr: nothing the test
writes reaches the machine) with `--private-network` (its nftables.service and the control plane's
listener stay inside), `/usr` overlaid with the packages' `/usr/bin/bcd`, `/usr/bin/bcd-helper`,
units and `/usr/share/bcd/install.sh`, and their `/opt/bcd` bound read-only. A preset keeps the
first boot from enabling the units (dpkg applies no presets). Then docs/deploy.md's sequence, as
written: install.sh (enables and starts neither yet), `bcd-helper audit init`, `systemctl enable --now
bcd-helper`, `bcd join`, `systemctl enable --now bcd-node`, a signed host spec converged through the helper,
`bcd doctor`, and the helper refusing a group-writable config without a restart loop.

Runs as root with systemd-nspawn (fails under CI=true without it); about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from instances.test_ch_confinement_real import Container
from testsupport import REPO, require_tool

pytestmark = [
    pytest.mark.realhost,
    pytest.mark.skipif(os.geteuid() != 0, reason="systemd-nspawn and make deb's ownership need root"),
]

UNITS = ("bcd-helper.service", "bcd-node.service")
PLANE = "/srv/plane"
ADDRESS = "127.0.0.1:7443"


def _packages(tmp: Path) -> tuple[Path, Path]:
    """The two packages unpacked: (the /usr to lay over the host's, the /opt/bcd to bind)."""
    require_tool("dpkg-deb")
    done = subprocess.run(["make", "deb"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    unpacked = tmp / "unpacked"
    for deb in sorted((REPO / "dist").glob("bcd-*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True, timeout=120)
    usr = tmp / "usr"
    (usr / "lib/systemd/system-preset").mkdir(parents=True)
    # Debian's /lib is /usr/lib: the packages' /lib/systemd/system lands in the overlay's lib.
    shutil.copytree(unpacked / "lib/systemd/system", usr / "lib/systemd/system")
    shutil.copytree(unpacked / "usr", usr, symlinks=True, dirs_exist_ok=True)
    (usr / "lib/systemd/system-preset/00-bcd-test.preset").write_text("disable bcd-*.service\n")
    return usr, unpacked / "opt/bcd"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    usr, opt = _packages(tmp_path_factory.mktemp("booted"))
    c = Container(
        "--private-network",
        f"--overlay-ro=/usr:{usr}:/usr",
        f"--bind-ro={opt}:/opt/bcd",
        # Debian's awk, python3... are alternatives' links into /etc, which the volatile root lacks.
        "--bind-ro=/etc/alternatives",
    )
    try:
        yield c
    finally:
        c.stop()


def _wait(c: Container, argv: list[str], what: str, seconds: float = 60) -> subprocess.CompletedProcess[str]:
    end = time.monotonic() + seconds
    while True:
        done = c.run(argv, check=False)
        if done.returncode == 0:
            return done
        if time.monotonic() > end:
            raise AssertionError(f"{what}: {done.stdout}{done.stderr}")
        time.sleep(0.5)


def _show(c: Container, unit: str, *props: str) -> dict[str, str]:
    out = c.run(["systemctl", "show", unit, "-p", ",".join(props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_first_install_as_docs_deploy_md_gives_it(host: Container) -> None:
    c = host
    # The node's unit waits for network-online.target; in the container's private network
    # systemd-networkd-wait-online would hold it for two minutes, then fail.
    c.run(["systemctl", "mask", "--runtime", "--now", "systemd-networkd-wait-online.service"])
    for unit in UNITS:
        assert c.run(["systemctl", "is-enabled", unit], check=False).stdout.strip() == "disabled"
    c.run(["mkdir", "-p", PLANE])
    c.run(["systemd-run", "--unit", "bcd-test-plane", "/usr/bin/bcd", "devplane", "serve", "--dir", PLANE,
           "--listen", ADDRESS])  # fmt: skip
    _wait(c, ["test", "-s", f"{PLANE}/endpoint.json"], "the control plane did not come up")
    pin = json.loads(c.path(f"{PLANE}/endpoint.json").read_text())["join_pin"]

    # install.sh: the account, the layout, root's config; neither unit enabled nor started yet (a boot
    # before `audit init` would start the helper unsealed).
    done = c.run(["/usr/share/bcd/install.sh", "--join-signing-key-pin", pin, "--control-plane", ADDRESS])
    assert "bcd-helper.service comes from the package" in done.stdout
    assert "Next, as root: bcd-helper audit init" in done.stdout
    assert "Next, as root: bcd join --token=TOKEN --address HOST:PORT" in done.stdout
    for unit in UNITS:
        assert c.run(["systemctl", "is-enabled", unit], check=False).stdout.strip() == "disabled"
        assert c.run(["systemctl", "is-active", unit], check=False).stdout.strip() == "inactive"

    # The helper, once its audit log has a key the operator holds.
    key = c.run(["bcd-helper", "audit", "init"]).stdout.rsplit(" ", 1)[-1].strip()
    assert key.startswith("bcdk1-")
    c.run(["systemctl", "enable", "--now", "bcd-helper.service"])  # Type=notify: returns on READY=1
    assert c.run(["stat", "-c", "%U:%G %a", "/run/bcd/helper.sock"]).stdout.strip() == "root:bcd 660"

    # The join, then the node: up, connected, with the unit's credentials and sandbox.
    token = c.run(["bcd", "devplane", "token", "--dir", PLANE]).stdout.strip()
    c.run(["bcd", "join", f"--token={token}", "--address", ADDRESS, "--ca-file", f"{PLANE}/ca.pem"])
    c.run(["systemctl", "enable", "--now", "bcd-node.service"])
    _wait(c, ["bcd", "status", "--check"], "the node did not come up connected")
    pid = _show(c, "bcd-node.service", "MainPID")["MainPID"]
    status = dict(
        line.split(":", 1) for line in c.path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    journal_gid = c.run(["getent", "group", "systemd-journal"]).stdout.split(":")[2]
    bcd_uid = c.run(["id", "-u", "bcd"]).stdout.strip()
    assert status["Uid"].split()[0] == bcd_uid and journal_gid in status["Groups"].split()
    assert status["CapEff"].strip() == "0000000000000000" and status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"

    # A signed host spec: planned by the unprivileged node, applied by root (net.* is the container's own).
    c.path("/srv/spec.json").write_text(
        json.dumps({"host": {"units": [{"name": "sysctl", "settings": '{"net.ipv4.ip_forward":1}'}]}})
    )
    c.run(["bcd", "devplane", "apply", "/srv/spec.json", "--dir", PLANE])
    _wait(
        c,
        ["sh", "-c", "bcd status --json | grep -q '\"observed_generation\": 1'"],
        "the spec did not converge",
    )
    assert c.path("/etc/sysctl.d/90-bcd.conf").exists()

    doctor = json.loads(c.run(["bcd", "doctor", "--json"], check=False).stdout)
    findings = {f["id"]: f["level"] for f in doctor["findings"]}
    for ok in ("config-owner", "data-dir", "helper", "helper-version", "control-plane", "certificate",
               "units/bcd-helper.service", "units/bcd-node.service", "join-binding"):  # fmt: skip
        assert findings[ok] == "ok", (ok, findings)
    c.run(["bcd-helper", "audit", "verify", "--key", key])

    # The node's sandbox reads the journal through its supplementary group (PrivateUsers= shows the
    # group as nogroup inside, but the kernel checks the real gid).
    sandbox = ("User=bcd", "PrivateUsers=yes", "SupplementaryGroups=systemd-journal")
    argv = ["systemd-run", "--wait", "--pipe", "--quiet", *(a for p in sandbox for a in ("-p", p))]
    read = c.run([*argv, "journalctl", "-u", "bcd-helper", "-n", "1"])
    assert "bcd-helper" in read.stdout

    # A config others can write: the helper refuses it (78) and is not restarted every 2 s.
    c.run(["chmod", "0660", "/etc/bcd/config.toml"])
    assert c.run(["systemctl", "restart", "bcd-helper.service"], check=False).returncode != 0
    time.sleep(5)
    shown = _show(c, "bcd-helper.service", "ActiveState", "ExecMainStatus", "NRestarts")
    assert shown == {"ActiveState": "failed", "ExecMainStatus": "78", "NRestarts": "0"}, shown
    # A bare re-run of install.sh puts the mode right and starts the helper again.
    c.run(["/usr/share/bcd/install.sh"])
    for unit in UNITS:
        assert c.run(["systemctl", "is-enabled", unit]).stdout.strip() == "enabled"
    assert c.run(["stat", "-c", "%a", "/etc/bcd/config.toml"]).stdout.strip() == "640"
    assert c.run(["systemctl", "is-active", "bcd-helper.service"]).stdout.strip() == "active"
