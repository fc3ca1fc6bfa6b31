"""The cloud-hypervisor VMM's confined unit run for real: a probe process in the VMM's place.

systemd cannot run as PID 1 on these hosts, so the test boots a real systemd with
`systemd-nspawn -D / --volatile=yes --register=no --keep-unit -b` (a tmpfs root over the host's /usr:
nothing the test writes reaches the machine), stops `systemd-firstboot` (it would wait at its prompt),
creates the VMM's account there with bcd's own `account_add_argv` (systemd 252 refuses `User=` without
a passwd entry), lays out bcd's files, and starts the probe with `systemd-run --wait --pipe` and
exactly the properties `bcd_shared.chunit.properties` gives the VMM. The probe reports what it can
reach; the test asserts what the confinement promises."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bcd_shared.chunit import VMM_UID_BASE, CHLaunch, account_add_argv, ch_dir, properties
from testsupport import require_tool

DATA = "/var/lib/bcd"
SHA = "b" * 64
OTHER = "c" * 64
UID = VMM_UID_BASE + 11

PROBE = r"""
import ctypes, json, os, socket
r = {}
def try_open(p, mode="r"):
    try:
        with open(p, mode):
            return "ok"
    except OSError as e:
        return e.__class__.__name__
for p in ("/etc/bcd/node.toml", "/etc/shadow", "/etc/gshadow", IMAGES + "/" + OTHER + ".qcow2",
          INSTANCES + "/vm-2/disk.qcow2", BASE, OWN + "/disk.qcow2"):
    r["read " + p] = try_open(p)
r["write own"] = try_open(OWN + "/created-by-vmm", "w")
r["write base"] = try_open(BASE, "r+")
def ls(p):
    try:
        return sorted(os.listdir(p))
    except OSError as e:
        return e.__class__.__name__
r["ls instances"] = ls(INSTANCES)
r["ls images"] = ls(IMAGES)
r["ls run"] = ls("/run")
r["ls run/systemd"] = ls("/run/systemd")
r["sockets"] = [p for p in ("/run/systemd/private", "/run/dbus/system_bus_socket", "/run/systemd/notify",
                            "/run/systemd/journal/stdout") if os.path.exists(p)]
libc = ctypes.CDLL(None, use_errno=True)
for name, flag in (("user", 0x10000000), ("mount", 0x00020000), ("net", 0x40000000)):
    rc = libc.unshare(flag)
    r["unshare " + name] = "ok" if rc == 0 else os.strerror(ctypes.get_errno())
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    r["inet"] = "ok"
except OSError as e:
    r["inet"] = e.__class__.__name__
r["uid"] = os.getuid()
r["umask"] = os.umask(0)
print(json.dumps(r))
"""


class Container:
    """A booted systemd on a volatile copy of /, driven through nsenter into its PID 1."""

    def __init__(self, *extra: str) -> None:
        """`extra`: more systemd-nspawn options (tests/deploy/test_units_booted.py overlays the packages)."""
        nspawn = require_tool("systemd-nspawn")
        require_tool("nsenter")
        self.proc = subprocess.Popen(
            [nspawn, "-D", "/", "--volatile=yes", "--register=no", "--keep-unit", "-b", "--quiet", *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.leader = self._leader()
        end = time.monotonic() + 30
        while self.run(["systemctl", "stop", "systemd-firstboot.service"], check=False).returncode != 0:
            if time.monotonic() > end:  # PID 1 takes a moment to open its bus
                self.run(["systemctl", "stop", "systemd-firstboot.service"])
            time.sleep(0.1)
        self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=60)

    def _leader(self) -> int:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                kids = (task / "children").read_text().split()
                if kids and Path(f"/proc/{kids[0]}/comm").read_text().strip() == "systemd":
                    return int(kids[0])
            time.sleep(0.05)
        raise AssertionError("systemd-nspawn booted no systemd")

    def run(
        self, argv: list[str], *, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-a", *argv], capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{argv}: {result.returncode}: {result.stderr}")
        return result

    def path(self, p: str) -> Path:
        return Path(f"/proc/{self.leader}/root") / p.lstrip("/")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def container() -> Iterator[Container]:
    c = Container()
    yield c
    c.stop()


@pytest.mark.realhost
def test_the_vmm_unit_confines_a_probe_dlv_chu_30(container: Container) -> None:
    """DLV-CHU-30, DLV-CHU-19/21/22, DLV-CHU-23, DLV-CHU-25, DLV-CHU-11: as the VMM's own user, the
    probe cannot open /etc/bcd, /etc/shadow, another image or instance, sees only its own instance
    directory and its base image, writes only there, has no Internet socket and is refused unshare.
    (The unit's other protections, CHU-17, 18 and 20's full list, are asserted on its text by
    test_ch_unit.py; this probe tries only the paths above.)"""
    c = container
    for argv in account_add_argv(UID):
        c.run(argv)
    base = f"{ch_dir(DATA)}/images/{SHA}.qcow2"
    own = f"{ch_dir(DATA)}/instances/vm-1"
    images, instances = f"{ch_dir(DATA)}/images", f"{ch_dir(DATA)}/instances"
    # Everything world-readable: only the unit's confinement, not a file mode, can keep the probe out.
    c.run(["mkdir", "-p", "-m", "0755", "/etc/bcd", images, f"{instances}/vm-2", own])
    setup = (
        f"echo secret > /etc/bcd/node.toml && chmod 0644 /etc/bcd/node.toml"
        f" && echo base > {base} && chmod 0644 {base}"
        f" && echo other > {images}/{OTHER}.qcow2 && chmod 0644 {images}/{OTHER}.qcow2"
        f" && echo theirs > {instances}/vm-2/disk.qcow2 && echo mine > {own}/disk.qcow2"
        f" && chown -R {UID}:{UID} {own} && chmod 0644 {instances}/vm-2/disk.qcow2 && chmod 0755 {instances}"
        f" && (test -e /etc/shadow || echo x > /etc/shadow) && chmod 0644 /etc/shadow"
        " && (test -e /etc/gshadow || echo x > /etc/gshadow) && chmod 0644 /etc/gshadow"
    )
    c.run(["sh", "-c", setup])
    spec = CHLaunch(
        instance_id="vm-1",
        uid=UID,
        data_dir=DATA,
        binary="/usr/bin/python3",
        vcpus=1,
        memory_bytes=256 << 20,
        base_image=base,
    )
    code = (
        f"IMAGES={images!r}\nINSTANCES={instances!r}\nBASE={base!r}\nOWN={own!r}\nOTHER={OTHER!r}\n" + PROBE
    )
    # systemd expands % and $ in a command line: the probe travels base64-encoded.
    encoded = base64.b64encode(code.encode()).decode()
    argv = [
        "systemd-run",
        "--wait",
        "--pipe",
        "--quiet",
        f"--unit={spec.unit}",
        "--slice=bcd-instances.slice",
    ]
    argv += [f"--property={k}={v}" for k, v in properties(spec)]
    argv += ["--", "/usr/bin/python3", "-c", f"import base64;exec(base64.b64decode('{encoded}'))"]
    result = c.run(argv, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    r = json.loads(result.stdout.strip().splitlines()[-1])
    assert r["uid"] == UID
    assert r["umask"] == 0o077
    assert r["read /etc/bcd/node.toml"] != "ok"
    assert r["read /etc/shadow"] != "ok" and r["read /etc/gshadow"] != "ok"
    assert r[f"read {images}/{OTHER}.qcow2"] != "ok"
    assert r[f"read {instances}/vm-2/disk.qcow2"] != "ok"
    assert r[f"read {base}"] == "ok" and r["write base"] != "ok"
    assert r[f"read {own}/disk.qcow2"] == "ok" and r["write own"] == "ok"
    assert r["ls instances"] == ["vm-1"]
    assert r["ls images"] == [f"{SHA}.qcow2"]
    assert "dbus" not in r["ls run"] and r["sockets"] == [], (r["ls run"], r["ls run/systemd"])
    assert r["unshare user"] != "ok" and r["unshare mount"] != "ok" and r["unshare net"] != "ok"
    assert r["inet"] != "ok"
    # What the VMM created stayed in its own directory (the bind is the host's directory).
    assert c.path(f"{own}/created-by-vmm").exists()


READ_PROBE = """
import json
r = {}
for p in PATHS:
    try:
        with open(p) as f:
            r[p] = f.read().strip()
    except OSError as e:
        r[p] = e.__class__.__name__
print(json.dumps(r))
"""


@pytest.mark.realhost
@pytest.mark.parametrize("data", ["/var/lib/bcd", "/srv/bcd/data"])
def test_a_store_swapped_for_a_symlink_never_changes_what_systemd_binds_round11(
    container: Container, data: str
) -> None:
    """docs/helper.md, "Threat model, round 11": the helper checks the base image and a volume, links
    those inodes into `<data_dir>-ch-binds/<id>/` (root 0700) and binds `LINK:PATH`; the node then swaps
    `images` for a symlink to a directory only root enters (holding a world-readable secret of that
    name) and `volumes` for one to an empty root directory, before systemd sets the namespace up (the
    race, won). Real systemd 252: the VMM reads the node's own base image and volume at their paths,
    and systemd created nothing in either root directory, with data_dir under /var (its tmpfs) and
    outside it (the unit's tmpfs over data_dir). Before, with the node's paths as sources, the VMM
    read the secret (data_dir under /var); and outside /var systemd, resolving the destination through
    the node's `volumes`, created an empty `v1.raw` as root in the link's target on the host."""
    c = container
    uid = UID + 1 if data.startswith("/var") else UID + 2
    name = f"vm-r11-{uid - UID}"
    for argv in account_add_argv(uid):
        c.run(argv, check=False)  # the module's container: the account may be there
    parent = data.rsplit("/", 1)[0]
    chd = ch_dir(data)
    base, vol = f"{chd}/images/{SHA}.qcow2", f"{data}/volumes/v1.raw"
    links = f"{data}-ch-binds/{name}"
    secret, empty = f"{parent}/root-only-{name}", f"{parent}/empty-{name}"
    node = 4242
    setup = (
        f"mkdir -p -m 0755 {parent} && mkdir -p {data}/volumes {chd}/images {chd}/instances/{name}"
        f" && chown -R {node}:{node} {data} && chmod 0711 {data} {data}/volumes {chd} {chd}/images"
        f" && chown {uid}:{uid} {chd}/instances/{name}"
        f" && echo base > {base} && echo mine > {vol} && chown {node}:{node} {base} {vol}"
        f" && chmod 0644 {base} {vol}"
        f" && mkdir -m 0700 {secret} && echo secret > {secret}/{SHA}.qcow2 && chmod 0644 {secret}/{SHA}.qcow2"
        f" && mkdir -m 0755 {empty}"
        # root's links of the inodes it checked (bcd_helper.chbinds), then the node's swap
        f" && mkdir -p -m 0700 {data}-ch-binds {links}"
        f" && ln {base} {links}/image && ln {vol} {links}/vol-v1.raw"
        f" && mv {chd}/images {chd}/images.real && ln -s {secret} {chd}/images"
        f" && mv {data}/volumes {data}/volumes.real && ln -s {empty} {data}/volumes"
    )
    c.run(["sh", "-c", setup])
    spec = CHLaunch(
        instance_id=name,
        uid=uid,
        data_dir=data,
        binary="/usr/bin/python3",
        vcpus=1,
        memory_bytes=256 << 20,
        base_image=base,
        volumes_rw=(vol,),
        bind_sources=((base, f"{links}/image"), (vol, f"{links}/vol-v1.raw")),
    )
    encoded = base64.b64encode((f"PATHS={[base, vol]!r}\n" + READ_PROBE).encode()).decode()
    argv = [
        "systemd-run",
        "--wait",
        "--pipe",
        "--quiet",
        f"--unit={spec.unit}",
        "--slice=bcd-instances.slice",
    ]
    argv += [f"--property={k}={v}" for k, v in properties(spec)]
    argv += ["--", "/usr/bin/python3", "-c", f"import base64;exec(base64.b64decode('{encoded}'))"]
    result = c.run(argv, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    r = json.loads(result.stdout.strip().splitlines()[-1])
    assert r == {base: "base", vol: "mine"}
    listing = {d: c.run(["ls", "-A", d]).stdout.split() for d in (secret, empty)}
    assert listing == {secret: [f"{SHA}.qcow2"], empty: []}  # nothing created as root
