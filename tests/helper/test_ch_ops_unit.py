"""ch.* called in process over a temporary root whose programs are scripted and recorded (opskit's
Programs): the exact argv root runs (`ip`, `systemctl`, `systemd-run`, `groupadd`/`useradd`, `tee` into
sysfs, `nvidia-smi`), the node's files it checks, the POSIX ACL entries it grants and takes back (real
ACLs on this machine's ext4), the /dev/vfio nodes it hands over, each refusal word for word, with and
without command-signing roots (docs/mutation.md, "helper ops: libvirt, ch").

What root reads is realistic: `ip -j -d link show` answers are iproute2 6.1.0's own JSON for a tap and
a bridge (tests/fixtures/ip/README.md) and its messages for a missing device; `systemctl list-units
--plain --no-legend` prints systemd's `UNIT LOAD ACTIVE SUB DESCRIPTION` columns; `nvidia-smi` answers
are columns of the simulated HGX H200's `--query-gpu` capture (tests/fixtures/nvidia-smi/README.md);
sysfs is laid out as the kernel's by bcd_simhost.pcisim, whose `pci_write` acts as the kernel on
driver_override, unbind and drivers_probe (the scripted `tee` hands it the value root wrote); disks
are qcow2 v3 headers (bcd_simhost.libvirt.qcow2_bytes). The real-process tests (test_helper_ch*.py)
drive the same handlers through `bcd helper serve`; mutmut sees only these."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.audit import AuditLog
from bcd_helper.config import parse_config
from bcd_helper.ops import ch
from bcd_helper.ops.base import HelperContext
from bcd_helper.ops.hostunit import SignedIntent
from bcd_helper.ops.table import LOCK_ORDER
from bcd_shared import posixacl, wire
from bcd_shared.chrecord import CHNic, CHRecord, CHVolume, encode_record
from bcd_shared.chunit import VMM_UID_BASE, CHLaunch, account_add_argv, run_argv
from bcd_shared.instancenames import tap_name
from bcd_shared.system import DEFAULT_TOOL_TIMEOUT_S, CommandResult, LocalSystem
from bcd_simhost.libvirt import qcow2_bytes
from bcd_simhost.pcisim import lay_out_pci, pci_write
from intentkit import ControlPlane, Signer, intent
from opskit import NODE_UID, Programs, call, failed, make_root, refused, req

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TAP_JSON = json.loads((FIXTURES / "ip/tap_ip-j-d-link-show_iproute2-6.1.0.json").read_text())
BRIDGE_JSON = json.loads((FIXTURES / "ip/bridge_ip-j-d-link-show_iproute2-6.1.0.json").read_text())
SMI_CSV = (FIXTURES / "nvidia-smi/hgx-h200-8gpu_mig-on-gpu7_590.48.01_query-gpu_noheader.csv").read_text()
GPUS = [[f.strip() for f in line.split(",")] for line in SMI_CSV.splitlines()]  # index, uuid, name, bus, ...
GPU0_UUID, GPU1_UUID = GPUS[0][1], GPUS[1][1]
GPU, AUDIO, BRIDGE, GPU1, NIC = "0000:18:00.0", "0000:18:00.1", "0000:17:00.0", "0000:2a:00.0", "0000:2b:00.0"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the driver"
NODE_GID = 4343
DATA = "/var/lib/bcd"
CHD = f"{DATA}/cloud-hypervisor"
INST = f"{CHD}/instances/vm1"
SHA = "d" * 64
BASE = f"{CHD}/images/{SHA}.qcow2"
UID1, UID2 = VMM_UID_BASE + 1, VMM_UID_BASE + 2
UNIT = "bcd-ch-vm1.service"
NODE = "node-ch"
GIB = 1 << 30
MAC = "52:54:00:00:00:01"
CONFIG = (
    f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE_UID}\nnode_gid = {NODE_GID}\n'
    'instance_bridges = "br0,br1"\n'
)
PASSWD = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"


def record(name: str = "vm1", **kw: Any) -> CHRecord:
    args: dict[str, Any] = {
        "name": name,
        "allocation_id": "alloc-1",
        "uid": UID1,
        "vcpus": 2,
        "memory_bytes": GIB,
        "image_sha256": SHA,
        "image_format": "qcow2",
        "seed": True,
        "nics": (CHNic(MAC, "br0"),),
        "gpus": (),
        "volumes": (CHVolume("rw.raw", False, "data"), CHVolume("ro.raw", True, "ref")),
        "hugepages": False,
        "cpus": "",
        "mems": "",
        "restored": False,
        "config": {"cpus": {"boot_vcpus": 2, "max_vcpus": 2}},
    }
    args.update(kw)
    return CHRecord(**args)


def node_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chown(path, NODE_UID, NODE_UID)
    os.chmod(path, mode)


def node_dir(path: Path, mode: int = 0o711) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, NODE_UID, NODE_UID)
    os.chmod(path, mode)


def lay_out(root: Path, rec: CHRecord) -> Path:
    """The node's files for `rec` as its runtime leaves them under the helper (as test_helper_ch.py)."""
    data = root / DATA.lstrip("/")
    for d in (data, data / "cloud-hypervisor", data / "cloud-hypervisor/instances", data / "volumes"):
        node_dir(d)
    node_dir(data / "cloud-hypervisor/images", 0o700)
    inst = data / "cloud-hypervisor/instances" / rec.name
    node_dir(inst, 0o700)
    if not (root / BASE.lstrip("/")).exists():
        node_file(root / BASE.lstrip("/"), qcow2_bytes(GIB), 0o644)
    node_file(inst / "disk.qcow2", qcow2_bytes(GIB, BASE, "qcow2"))  # as the VMM sees the base
    node_file(inst / "seed.iso", b"\0" * 2048)
    node_file(inst / "vm.json", encode_record(rec))
    for vol in ("rw.raw", "ro.raw", "other.raw"):
        if not (data / "volumes" / vol).exists():
            node_file(data / "volumes" / vol, b"v" * 512)
    binary = root / "usr/bin/cloud-hypervisor"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text("#!/bin/sh\nexit 0\n")
        os.chmod(binary, 0o755)
    return inst


def rewrite(root: Path, rec: CHRecord) -> None:
    node_file(root / f"{CHD}/instances/{rec.name}/vm.json".lstrip("/"), encode_record(rec))


class Host:
    """Root's programs on the simulated host: links by name (iproute2's JSON), units by name (active
    state and User=), /etc/passwd, sysfs through the kernel's binding rules, the GPUs and their compute
    processes; `fail[key]` answers the program (key: its argv's first two words, or `tee <path>`) with
    an error. `inputs` is what root wrote to each program's stdin."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.links: dict[str, Any] = {}
        self.units: dict[str, tuple[str, str]] = {}  # unit -> (ActiveState, User)
        self.fail: dict[str, tuple[int, bytes, bytes]] = {}
        self.apps = b""
        self.smi_rc = 0
        self.writes: list[tuple[str, str]] = []
        self.input: bytes | None = None
        (root / "etc").mkdir(exist_ok=True)
        (root / "etc/passwd").write_text(PASSWD)

    def __call__(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        key = " ".join(argv[:2])
        if argv[0] == "tee":
            key = f"tee {self.sim(argv[1])}"
        if key in self.fail:
            return self.fail[key]
        handler = {
            "ip": self.ip,
            "systemctl": self.systemctl,
            "systemd-run": self.systemd_run,
            "groupadd": self.account,
            "useradd": self.account,
            "tee": self.tee,
            "nvidia-smi": self.smi,
        }[argv[0]]
        return handler(argv)

    def sim(self, host: str) -> str:
        return "/" + os.path.relpath(host, self.root)

    def link_json(self, name: str, kind: Any) -> bytes:
        doc = json.loads(json.dumps(kind))
        doc[0]["ifname"] = name
        return json.dumps(doc).encode()

    def ip(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[1:5] == ("-j", "-d", "link", "show"):
            dev = argv[6]
            if dev not in self.links:
                return 1, b"", f'Device "{dev}" does not exist.\n'.encode()
            return 0, self.link_json(dev, self.links[dev]), b""
        if argv[1:3] == ("tuntap", "add"):
            self.links[argv[4]] = TAP_JSON
            return 0, b"", b""
        if argv[1:3] == ("link", "delete"):
            if self.links.pop(argv[4], None) is None:
                return 1, b"", f'Cannot find device "{argv[4]}"\n'.encode()
            return 0, b"", b""
        if argv[1:3] == ("link", "set"):
            return 0, b"", b""
        raise AssertionError(argv)

    def systemctl(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[1] == "list-units":
            lines = [
                f"{u} loaded {state} {'running' if state == 'active' else 'dead'} cloud-hypervisor VMM\n"
                for u, (state, _user) in sorted(self.units.items())
            ]
            return 0, "".join(lines).encode(), b""
        if argv[1:3] == ("show", "-p"):
            state, user = self.units.get(argv[5], ("inactive", ""))
            return 0, ((user if argv[3] == "User" else state) + "\n").encode(), b""
        if argv[1] == "stop":
            if argv[2] not in self.units:
                return 5, b"", f"Failed to stop {argv[2]}: Unit {argv[2]} not loaded.\n".encode()
            self.units[argv[2]] = ("inactive", self.units[argv[2]][1])
            return 0, b"", b""
        raise AssertionError(argv)

    def systemd_run(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        unit = argv[1].removeprefix("--unit=")
        user = next(a for a in argv if a.startswith("--property=User=")).removeprefix("--property=User=")
        self.units[unit] = ("active", user)
        return 0, b"", b""

    def account(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[0] == "useradd":
            uid = argv[argv.index("--uid") + 1]
            with (self.root / "etc/passwd").open("a") as f:
                f.write(f"{argv[-1]}:x:{uid}:{uid}:bcd cloud-hypervisor VMM:/nonexistent:/usr/sbin/nologin\n")
        return 0, b"", b""

    def tee(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        path, value = self.sim(argv[1]), (self.input or b"").decode()
        self.writes.append((path, value))
        assert pci_write(LocalSystem(self.root), path, value), path
        return 0, value.encode(), b""

    def smi(self, argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if self.smi_rc:
            return self.smi_rc, b"", f"{NO_DRIVER}\n".encode()
        cols = {"pci.bus_id": 3, "uuid": 1}
        query = argv[1].removeprefix("--query-gpu=")
        if query.startswith("--query-compute-apps"):
            return 0, self.apps, b""
        names = query.split(",")
        return 0, "".join(", ".join(g[cols[n]] for n in names) + "\n" for g in GPUS).encode(), b""


class StdinPrograms(Programs):
    """opskit's recorded host, handing the script what root writes on stdin (tee's value)."""

    def __init__(self, root: Path, host: Host) -> None:
        super().__init__(root, host)
        self.host = host

    def run(
        self, argv: Sequence[str], *, timeout: float = DEFAULT_TOOL_TIMEOUT_S, input: bytes | None = None
    ) -> CommandResult:
        self.host.input = input
        return super().run(argv, timeout=timeout, input=input)


def context(root: Path, host: Host, config: str = CONFIG) -> HelperContext:
    cfg = parse_config(config.encode())
    audit = AuditLog(root, cfg.audit_dir, syslog=False)
    return HelperContext(
        root=root, config=cfg, system=StdinPrograms(root, host), audit=audit, lock_names=LOCK_ORDER
    )


def runs(ctx: HelperContext) -> list[tuple[str, ...]]:
    assert isinstance(ctx.system, Programs)
    return ctx.system.runs


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = make_root(tmp_path)
    lay_out(r, record())
    return r


@pytest.fixture
def host(root: Path) -> Host:
    return Host(root)


@pytest.fixture
def ctx(root: Path, host: Host) -> Iterator[HelperContext]:
    c = context(root, host)
    yield c
    c.audit.close()


def acl(path: Path) -> tuple[dict[int, int], dict[int, int]]:
    """The named-user entries of the access and the default ACL: uid -> rwx bits."""
    out: list[dict[int, int]] = []
    for name in ("system.posix_acl_access", "system.posix_acl_default"):
        try:
            entries = posixacl.parse(os.getxattr(path, name, follow_symlinks=False))
        except OSError as exc:
            assert exc.errno == errno.ENODATA
            entries = []
        out.append({i: p for t, p, i in entries if t == posixacl.USER})
    return out[0], out[1]


# --- names ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("handler", "op", "cls"),
    [
        (ch.ch_launch, "ch.launch", ch.ChLaunch),
        (ch.ch_stop, "ch.stop", ch.ChName),
        (ch.ch_untaps, "ch.untaps", ch.ChName),
        (ch.ch_vfio, "ch.vfio", ch.ChLaunch),
        (ch.ch_unvfio, "ch.unvfio", ch.ChName),
    ],
)
def test_a_name_that_is_no_instance_id_is_refused_dlv_chh_23(
    ctx: HelperContext, handler: Any, op: str, cls: Any
) -> None:
    """DLV-CHH-23: before any program runs."""
    long = "a" * 70 + "/" + "b" * 40
    assert refused(handler, call(ctx), cls(long)) == (
        "bad-name",
        f"{op}: {long[:80]!r} is not an instance id",
    )
    assert refused(handler, call(ctx), cls("a..b"))[0] == "bad-name"
    assert refused(ch.ch_taps, call(ctx), ch.ChTaps("a/b", ("br0",))) == (
        "bad-name",
        "ch.taps: 'a/b' is not an instance id",
    )
    assert runs(ctx) == []


# --- taps ----------------------------------------------------------------------------------------------

T0, T1 = tap_name("vm1", 0), tap_name("vm1", 1)


def show(dev: str) -> tuple[str, ...]:
    return ("ip", "-j", "-d", "link", "show", "dev", dev)


def tuntap(dev: str) -> tuple[str, ...]:
    return ("ip", "tuntap", "add", "dev", dev, "mode", "tap", "user", str(NODE_UID), "group", str(NODE_GID))


def master(dev: str, br: str) -> tuple[str, ...]:
    return ("ip", "link", "set", "dev", dev, "master", br, "up")


def test_taps_are_made_for_the_node_on_their_bridges_dlv_chh_05_06(ctx: HelperContext, host: Host) -> None:
    """DLV-CHH-05, DLV-CHH-06: exactly tap_name(id, i), the node's uid and gid, on the NIC's bridge;
    an existing tap is kept and only joined to its bridge again."""
    got = ch.ch_taps(call(ctx, bounded=False), req(ch.ChTaps, name="vm1", bridges=["br0", "br1"]))
    assert got == {"name": "vm1", "taps": [T0, T1], "created": [T0, T1]}
    assert runs(ctx) == [show(T0), show(T1), tuntap(T0), master(T0, "br0"), tuntap(T1), master(T1, "br1")]
    assert set(ctx.system.timeouts) == {30}  # type: ignore[attr-defined]
    del host.links[T1]
    n = len(runs(ctx))
    got = ch.ch_taps(call(ctx), ch.ChTaps("vm1", ("br0", "br1")))
    assert got == {"name": "vm1", "taps": [T0, T1], "created": [T1]}
    assert runs(ctx)[n:] == [show(T0), show(T1), master(T0, "br0"), tuntap(T1), master(T1, "br1")]


def test_taps_count_and_bridges_are_checked_before_any_interface(ctx: HelperContext) -> None:
    for bridges in ((), ("br0",) * 17):
        assert refused(ch.ch_taps, call(ctx), ch.ChTaps("vm1", bridges)) == (
            "bad-arguments",
            "ch.taps: 1 to 16 NICs",
        )
    for i, bad in ((0, "br9"), (1, "br0 "), (2, "x" * 30), (1, "")):
        bridges = ("br0",) * i + (bad,)
        assert refused(ch.ch_taps, call(ctx), ch.ChTaps("vm1", bridges)) == (
            "bridge-not-allowed",
            f"ch.taps: NIC {i}: bridge {bad[:20]!r} is not in [helper] instance_bridges (br0, br1)",
        )
    assert runs(ctx) == []
    got = ch.ch_taps(call(ctx), ch.ChTaps("vm1", ("br1",) * 16))
    assert got["taps"] == [tap_name("vm1", i) for i in range(16)]


def test_without_instance_bridges_every_tap_is_refused(root: Path, host: Host) -> None:
    c = context(root, host, CONFIG.replace('instance_bridges = "br0,br1"\n', ""))
    try:
        assert refused(ch.ch_taps, call(c), ch.ChTaps("vm1", ("br0",))) == (
            "bridge-not-allowed",
            "ch.taps: NIC 0: bridge 'br0' is not in [helper] instance_bridges "
            "(none configured: every instance tap is refused)",
        )
    finally:
        c.audit.close()


def test_an_interface_that_is_not_a_tap_is_never_touched_dlv_chh_06(ctx: HelperContext, host: Host) -> None:
    """DLV-CHH-06: refused before anything is created."""
    host.links[T1] = BRIDGE_JSON
    assert refused(ch.ch_taps, call(ctx), ch.ChTaps("vm1", ("br0", "br0"))) == (
        "not-a-tap",
        f"ch.taps: {T1} exists and is not a tap: it is never touched",
    )
    assert runs(ctx) == [show(T0), show(T1)]
    tun = json.loads(json.dumps(TAP_JSON))
    tun[0]["linkinfo"]["info_data"]["type"] = "tun"
    no_info = [{k: v for k, v in TAP_JSON[0].items() if k != "linkinfo"}]
    no_data = json.loads(json.dumps(TAP_JSON))
    del no_data[0]["linkinfo"]["info_data"]
    for other in (tun, no_info, no_data):
        host.links[T1] = other
        assert refused(ch.ch_taps, call(ctx), ch.ChTaps("vm1", ("br0", "br0")))[0] == "not-a-tap"
    assert T0 not in host.links


def test_a_failed_tap_leaves_none_of_the_calls_taps(ctx: HelperContext, host: Host) -> None:
    """Nothing half-applied: the taps this call created are deleted again; one it found is kept."""
    host.links[T0] = TAP_JSON
    host.fail["ip tuntap"] = (1, b"", b"ioctl(TUNSETIFF): Device or resource busy\n")
    assert failed(ch.ch_taps, call(ctx), ch.ChTaps("vm1", ("br0", "br0"))) == (
        "ip",
        f"ip tuntap add {T1}: ioctl(TUNSETIFF): Device or resource busy",
    )
    assert T0 in host.links and ("ip", "link", "delete", "dev", T0) not in runs(ctx)
    del host.fail["ip tuntap"]
    del host.links[T0]
    n = len(runs(ctx))
    host.fail["ip link"] = (2, b"", b'Error: argument "br0" is wrong: Device does not exist\n')
    assert failed(ch.ch_taps, call(ctx), ch.ChTaps("vm1", ("br0",))) == (
        "ip",
        f'ip link set {T0} master br0: Error: argument "br0" is wrong: Device does not exist',
    )
    assert runs(ctx)[n:] == [show(T0), tuntap(T0), master(T0, "br0"), ("ip", "link", "delete", "dev", T0)]
    assert ctx.system.timeouts[-1] == 30  # type: ignore[attr-defined]


TWIN_A, TWIN_B = "vm-1762438", "vm-3742940"  # their taps collide (instancenames.tap_collision)
CLAIMS = "var/lib/bcd-hostconfig/taps"
STAGED = "var/lib/bcd-hostconfig/libvirt"


def test_a_second_instance_of_a_tap_stem_is_refused_and_its_untaps_deletes_nothing(
    ctx: HelperContext, host: Host, root: Path
) -> None:
    """ch.taps claims the instance's tap stem for it (`taps/<stem>` = its id, 0600) before the first
    tap; the twin's ch.taps is then refused `tap-collision` naming both ids and the rule, before any
    interface is looked at, and the twin's ch.untaps deletes nothing (the taps are the first one's).
    The first one's ch.untaps deletes its taps and drops the claim: the twin may then have them."""
    from bcd_shared.instancenames import tap_name, tap_stem

    tap = tap_name(TWIN_A, 0)
    claim = root / CLAIMS / tap_stem(TWIN_A)
    assert ch.ch_taps(call(ctx), ch.ChTaps(TWIN_A, ("br0",)))["created"] == [tap]
    assert claim.read_bytes() == f"{TWIN_A}\n".encode() and stat.S_IMODE(claim.stat().st_mode) == 0o600
    n = len(runs(ctx))
    reason, message = refused(ch.ch_taps, call(ctx), ch.ChTaps(TWIN_B, ("br1",)))
    assert (reason, message) == (
        "tap-collision",
        f"ch.taps: instance {TWIN_B}'s taps ({tap_stem(TWIN_B)}<NIC>) are instance {TWIN_A}'s too: tap "
        "names hash the instance id into 15 characters (IFNAMSIZ), and no two live instances may share "
        "one (rename one of them)",
    )
    assert runs(ctx)[n:] == [] and claim.read_bytes() == f"{TWIN_A}\n".encode()
    assert ch.ch_untaps(call(ctx), ch.ChName(TWIN_B)) == {"name": TWIN_B, "deleted": []}
    assert runs(ctx)[n:] == [] and tap in host.links and claim.exists()
    # Its own again: kept, claimed still.
    assert ch.ch_taps(call(ctx), ch.ChTaps(TWIN_A, ("br0",)))["created"] == []
    assert ch.ch_untaps(call(ctx), ch.ChName(TWIN_A))["deleted"] == [tap]
    assert not claim.exists() and tap not in host.links
    assert ch.ch_taps(call(ctx), ch.ChTaps(TWIN_B, ("br1",)))["created"] == [tap]
    assert claim.read_bytes() == f"{TWIN_B}\n".encode()
    assert refused(ch.ch_taps, call(ctx), ch.ChTaps(TWIN_A, ("br0",)))[0] == "tap-collision"
    # ch.untaps of an instance that never claimed leaves another's claim alone.
    assert ch.ch_untaps(call(ctx), ch.ChName("vm1"))["deleted"] == []
    assert claim.read_bytes() == f"{TWIN_B}\n".encode()


def test_a_claim_root_cannot_read_or_write_is_never_taken_for_free(ctx: HelperContext, root: Path) -> None:
    """A claim whose bytes are not UTF-8 still names another instance (replacement characters), so
    the tap names stay refused; a claims directory that is a symlink is refused `root-only` (root
    writes its claims under the root-only rule) before any tap is made."""
    from bcd_shared.instancenames import tap_stem

    claims = root / CLAIMS
    claims.mkdir(parents=True)
    (claims / tap_stem("vm1")).write_bytes(b"\xffvm1\n")
    reason, message = refused(ch.ch_taps, call(ctx), ch.ChTaps("vm1", ("br0",)))
    assert reason == "tap-collision" and "are instance \ufffdvm1's too" in message, message
    (claims / tap_stem("vm1")).unlink()
    claims.rmdir()
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    claims.symlink_to(elsewhere)
    reason, message = refused(ch.ch_taps, call(ctx), ch.ChTaps("vm1", ("br0",)))
    assert reason == "root-only" and "taps" in message, message
    assert os.listdir(elsewhere) == [] and runs(ctx)[-1] != tuntap(T0)


def test_a_defined_libvirt_domain_owns_its_tap_names_for_ch_taps(ctx: HelperContext, root: Path) -> None:
    """A definition root staged (`libvirt/<id>.xml`) owns its tap names: the twin's ch.taps is refused;
    a staged file of the instance itself, one not ending `.xml`, or one that is no instance id does
    not count."""
    staged = root / STAGED
    staged.mkdir(parents=True)
    for name in (f"{TWIN_B}.xml", TWIN_A, f"{TWIN_A}.xml.tmp", "..xml", "vm1.xml"):
        (staged / name).write_bytes(b"<domain/>")
    assert ch.ch_taps(call(ctx), ch.ChTaps(TWIN_B, ("br0",)))["name"] == TWIN_B
    ch.ch_untaps(call(ctx), ch.ChName(TWIN_B))
    (staged / f"{TWIN_A}.xml").write_bytes(b"<domain/>")
    reason, message = refused(ch.ch_taps, call(ctx), ch.ChTaps(TWIN_B, ("br0",)))
    assert reason == "tap-collision" and f"are instance {TWIN_A}'s too" in message
    assert ch.ch_untaps(call(ctx), ch.ChName(TWIN_B))["deleted"] == []


def test_a_failed_first_tap_drops_the_claim_a_kept_tap_keeps_it(
    ctx: HelperContext, host: Host, root: Path
) -> None:
    """Nothing half-applied: a call that created every tap and failed drops its claim with them; one
    that found a tap of the instance keeps the claim (that tap stays)."""
    from bcd_shared.instancenames import tap_stem

    claim = root / CLAIMS / tap_stem("vm1")
    host.fail["ip tuntap"] = (1, b"", b"ioctl(TUNSETIFF): Device or resource busy\n")
    assert failed(ch.ch_taps, call(ctx), ch.ChTaps("vm1", ("br0", "br0")))[0] == "ip"
    assert not claim.exists() and host.links == {}
    host.links[T0] = TAP_JSON
    assert failed(ch.ch_taps, call(ctx), ch.ChTaps("vm1", ("br0", "br0")))[0] == "ip"
    assert claim.read_bytes() == b"vm1\n" and T0 in host.links


def test_a_failed_tap_is_answered_even_when_the_rollback_runs_out_of_time(
    ctx: HelperContext, host: Host
) -> None:
    """The call's deadline passes while the bridge step fails: the rollback's delete is refused by the
    bounded system (`timeout`), and the answer is still the step's own failure."""
    c = call(ctx)
    real = host.ip

    def ip(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[1:3] == ("link", "set"):
            c.deadline._end = 0.0  # the deadline passes while `ip link set` runs
            return 2, b"", b"Error: Device does not exist\n"
        return real(argv)

    host.ip = ip  # type: ignore[method-assign]
    assert failed(ch.ch_taps, c, ch.ChTaps("vm1", ("br0",))) == (
        "ip",
        f"ip link set {T0} master br0: Error: Device does not exist",
    )
    assert ("ip", "link", "delete", "dev", T0) not in runs(ctx)  # refused before it ran


def test_the_rollback_tries_every_created_tap_when_the_deadline_passes_midway(
    ctx: HelperContext, host: Host
) -> None:
    """Both taps created, the second's bridge step fails; the deadline passes while the rollback's first
    delete runs: that tap is gone, the second's delete is still tried (the bounded system refuses it:
    `timeout`) and the answer is the bridge step's own failure, not the rollback's."""
    c = call(ctx)
    tried: list[tuple[str, ...]] = []
    bounded = c.system.run

    def run(argv: Sequence[str], **kw: Any) -> CommandResult:
        tried.append(tuple(argv))  # before the bounded system's deadline check
        return bounded(argv, **kw)

    c.system.run = run  # type: ignore[method-assign]
    real = host.ip

    def ip(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[1:3] == ("link", "set") and argv[4] == T1:
            return 2, b"", b"Error: Device does not exist\n"
        if argv[1:3] == ("link", "delete"):
            c.deadline._end = 0.0  # the deadline passes while the first delete runs
        return real(argv)

    host.ip = ip  # type: ignore[method-assign]
    assert failed(ch.ch_taps, c, ch.ChTaps("vm1", ("br0", "br0"))) == (
        "ip",
        f"ip link set {T1} master br0: Error: Device does not exist",
    )
    delete = [("ip", "link", "delete", "dev", t) for t in (T0, T1)]
    assert tried[-2:] == delete  # every tap this call created, in order
    assert runs(ctx)[-3:] == [tuntap(T1), master(T1, "br0"), delete[0]]  # T1's delete never ran
    assert T0 not in host.links and T1 in host.links  # what the deadline left, ch.untaps deletes


def test_roots_view_of_a_link_and_its_failures(ctx: HelperContext, host: Host) -> None:
    host.fail["ip -j"] = (2, b"", b"\xff" + b"e" * 600 + b"\n")
    assert failed(ch._link, call(ctx), "x") == ("ip", "ip link show x: \ufffd" + "e" * 499)
    host.fail["ip -j"] = (2, b"\xffout\n", b"")
    assert failed(ch._link, call(ctx), "x") == ("ip", "ip link show x: \ufffdout")
    host.fail["ip -j"] = (1, b"", b'Cannot find device "x"\n')
    assert ch._link(call(ctx), "x") is None
    host.fail["ip -j"] = (255, b"", b"RTNETLINK answers: Operation not permitted\n")
    assert failed(ch._link, call(ctx), "x") == (
        "ip",
        "ip link show x: RTNETLINK answers: Operation not permitted",
    )
    host.fail["ip -j"] = (0, b"Device x\n", b"")
    assert failed(ch._link, call(ctx), "x") == ("ip", "ip -j link show x: not JSON")
    for out in (b"[]", b"{}", b"[1]", b"null"):
        host.fail["ip -j"] = (0, out, b"")
        assert ch._link(call(ctx), "x") is None
    host.fail["ip -j"] = (0, json.dumps(TAP_JSON + BRIDGE_JSON).encode(), b"")
    assert ch._link(call(ctx), "x") == TAP_JSON[0]


def test_untaps_deletes_only_the_instances_taps_dlv_chh_07(ctx: HelperContext, host: Host) -> None:
    """DLV-CHH-07: every NIC index's name is looked at; only taps are deleted."""
    host.links.update(
        {T0: TAP_JSON, T1: BRIDGE_JSON, tap_name("vm1", 15): TAP_JSON, tap_name("vm2", 0): TAP_JSON}
    )
    got = ch.ch_untaps(call(ctx), req(ch.ChName, name="vm1"))
    assert got == {"name": "vm1", "deleted": [T0, tap_name("vm1", 15)]}
    shows = [show(tap_name("vm1", i)) for i in range(16)]
    assert [r for r in runs(ctx) if r[1] == "-j"] == shows
    deletes = [(r, t) for r, t in zip(runs(ctx), ctx.system.timeouts, strict=True) if r[2] == "delete"]  # type: ignore[attr-defined]
    assert deletes == [(("ip", "link", "delete", "dev", t), 30) for t in (T0, tap_name("vm1", 15))]
    assert sorted(host.links) == sorted([T1, tap_name("vm2", 0)])
    host.links[T0] = TAP_JSON
    host.fail["ip link"] = (2, b"", b"RTNETLINK answers: Operation not permitted\n")
    assert failed(ch.ch_untaps, call(ctx), ch.ChName("vm1")) == (
        "ip",
        f"ip link delete {T0}: RTNETLINK answers: Operation not permitted",
    )


# --- the record, read as root ------------------------------------------------------------------------

SYSTEMD_RUN_KEY = "systemd-run --unit=bcd-ch-vm1.service"
LIST = (
    "systemctl",
    "list-units",
    "--type=service",
    "--plain",
    "--no-legend",
    "--no-pager",
    "bcd-ch-*",
)


def expected_launch(root: Path, **kw: Any) -> tuple[str, ...]:
    """The unit root must start for vm1's default record, built independently of ch.launch."""
    args: dict[str, Any] = {
        "instance_id": "vm1",
        "uid": UID1,
        "data_dir": DATA,
        "binary": "/usr/bin/cloud-hypervisor",
        "vcpus": 2,
        "memory_bytes": GIB,
        "base_image": BASE,
        "volumes_rw": (f"{DATA}/volumes/rw.raw",),
        "volumes_ro": (f"{DATA}/volumes/ro.raw",),
        "under_helper": True,
    }
    args.update(kw)
    # root binds its hard links of the inodes it checked (bcd_helper.chbinds; round 11)
    links = f"{DATA}-ch-binds/{args['instance_id']}"
    sources = [(args["base_image"], f"{links}/image")] if args["base_image"] else []
    sources += [(v, f"{links}/vol-{v.rsplit('/', 1)[1]}") for v in (*args["volumes_rw"], *args["volumes_ro"])]
    args.setdefault("bind_sources", tuple(sources))
    return tuple(run_argv(CHLaunch(**args)))


def launch_refused(ctx: HelperContext, op: str = "ch.launch") -> tuple[str, str]:
    fn = {"ch.launch": ch.ch_launch, "ch.vfio": ch.ch_vfio, "ch.unvfio": ch.ch_unvfio}[op]
    return refused(fn, call(ctx), (ch.ChName if op == "ch.unvfio" else ch.ChLaunch)("vm1"))


def test_launch_starts_roots_unit_with_the_vmms_acl_entries_dlv_chh_21_dlv_chh_02(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """DLV-CHH-21, DLV-CHH-02: root's own reading builds the unit (its own binary, the
    VMM's account created first); the VMM's uid gets exactly the record's files (the instance
    directory rwx with a default entry, its files rw, the rw volume rw, the ro volume r; never vm.json),
    the node a default entry on the directory (what the VMM creates stays the node's to reach)."""
    got = ch.ch_launch(call(ctx, bounded=False), req(ch.ChLaunch, name="vm1"))
    assert got == {"name": "vm1", "unit": UNIT, "uid": UID1, "binary": "/usr/bin/cloud-hypervisor"}
    name = "bcd-vmm-1"
    assert runs(ctx) == [
        LIST,
        *[tuple(a) for a in account_add_argv(UID1)],
        expected_launch(root),
    ]
    assert ctx.system.timeouts == [30, 60, 60, 120]  # type: ignore[attr-defined]
    assert f"{name}:x:{UID1}:{UID1}:" in (root / "etc/passwd").read_text()
    inst = root / INST.lstrip("/")
    vols = root / f"{DATA}/volumes".lstrip("/")
    assert acl(inst) == ({UID1: 7}, {UID1: 7, NODE_UID: 7})
    assert acl(inst / "disk.qcow2") == ({UID1: 6}, {}) and acl(inst / "seed.iso") == ({UID1: 6}, {})
    assert acl(inst / "vm.json") == ({}, {})
    assert acl(vols / "rw.raw") == ({UID1: 6}, {}) and acl(vols / "ro.raw") == ({UID1: 4}, {})
    assert acl(vols / "other.raw") == ({}, {})
    # a second launch of the running unit is refused
    assert launch_refused(ctx) == ("running", f"ch.launch: {UNIT} is already running")


def test_launch_passes_the_records_placement_gpus_and_hugepages_to_the_unit(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    lay_out_pci(root, [(GPU, "0x030200", 10, "nvidia")])
    rewrite(root, record(gpus=(GPU,), hugepages=True, cpus="2-3", mems="0", vcpus=3, memory_bytes=2 * GIB,
                         volumes=()))  # fmt: skip
    ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))
    want = expected_launch(
        root, vfio=True, hugepages=True, cpus="2-3", mems="0", vcpus=3, memory_bytes=2 * GIB, volumes_rw=(),
        volumes_ro=(),
    )  # fmt: skip
    assert runs(ctx)[-1] == want


def test_launch_of_a_restored_disk_binds_no_base(ctx: HelperContext, root: Path, host: Host) -> None:
    """A restored disk is flat and names no base; the unit binds none (restored memory)."""
    inst = root / INST.lstrip("/")
    rewrite(root, record(restored=True, image_sha256=None, image_format=None, volumes=()))
    node_file(inst / "disk.qcow2", qcow2_bytes(GIB))
    ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))
    assert runs(ctx)[-1] == expected_launch(
        root, base_image=None, restored_memory=True, volumes_rw=(), volumes_ro=()
    )
    # restored memory with huge pages: the unit charges the memory again (DLV-CHU-29's unit)
    rewrite(root, record(restored=True, image_sha256=None, image_format=None, volumes=(), hugepages=True))
    host.units.clear()
    ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))
    want = expected_launch(
        root, base_image=None, restored_memory=True, hugepages=True, volumes_rw=(), volumes_ro=()
    )
    assert runs(ctx)[-1] == want
    assert want != expected_launch(root, base_image=None, hugepages=True, volumes_rw=(), volumes_ro=())
    host.units.clear()
    rewrite(root, record(restored=True, volumes=()))  # a restored record naming its image: still no base
    host.units.clear()
    ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))
    assert runs(ctx)[-1] == expected_launch(
        root, base_image=None, restored_memory=True, volumes_rw=(), volumes_ro=()
    )
    node_file(inst / "disk.qcow2", qcow2_bytes(GIB, BASE, "qcow2"))
    host.units.clear()
    reason, message = launch_refused(ctx)
    assert reason == "image-backing-file" and message.startswith(
        f"ch.launch: {root}{INST}/disk.qcow2: names a"
    )


def test_a_record_without_a_base_must_be_restored(ctx: HelperContext, root: Path) -> None:
    rewrite(root, record(image_sha256=None, image_format=None))
    assert launch_refused(ctx) == (
        "bad-record",
        "ch.launch: a disk without a base image must be a restored one",
    )


@pytest.mark.parametrize(
    ("change", "reason", "message"),
    [
        (lambda i: os.chown(i, 0, 0), "bad-layout", f"ch.launch: {INST} must be the node's directory"),
        (lambda i: os.symlink("/etc/shadow", i / "evil"), "symlink",
         f"ch.launch: {INST}/evil is a symlink: none may be in the directory"),
        (lambda i: os.unlink(i / "vm.json"), "bad-layout",
         f"ch.launch: {INST}/vm.json: No such file or directory (a regular file, no symlink)"),
        (lambda i: os.chown(i / "vm.json", 0, 0), "bad-layout",
         f"ch.launch: {INST}/vm.json must be a regular file the node owns"),
        (lambda i: (os.unlink(i / "vm.json"), node_dir(i / "vm.json")), "bad-layout",
         f"ch.launch: {INST}/vm.json must be a regular file the node owns"),
        (lambda i: (os.unlink(i / "vm.json"), os.mkfifo(i / "vm.json"), os.chown(i / "vm.json", NODE_UID, 0)),
         "bad-layout", f"ch.launch: {INST}/vm.json must be a regular file the node owns"),
        (lambda i: os.chown(i / "disk.qcow2", 0, 0), "bad-layout",
         f"ch.launch: {INST}/disk.qcow2 must be a regular file the node owns"),
        (lambda i: os.unlink(i / "disk.qcow2"), "bad-layout",
         f"ch.launch: {INST}/disk.qcow2: No such file or directory (a regular file, no symlink)"),
        (lambda i: os.chown(i / "seed.iso", NODE_UID + 1, 0), "bad-layout",
         f"ch.launch: {INST}/seed.iso must be a regular file the node owns"),
        (lambda i: node_file(i / "vm.json", b"{}"), "bad-record",
         "ch.launch: vm.json.v: required field missing"),
        (lambda i: node_file(i / "vm.json", b" " * (1 << 20) + b"{}"), "bad-record",
         "ch.launch: vm.json: larger than 1048576 bytes"),
        (lambda i: node_file(i / "vm.json", encode_record(record("vm9"))), "bad-record",
         "ch.launch: vm.json names 'vm9', not 'vm1'"),
    ],
)  # fmt: skip
def test_the_node_files_are_checked_as_root_dlv_chh_16(
    ctx: HelperContext, root: Path, change: Any, reason: str, message: str
) -> None:
    """DLV-CHH-16: the directory, vm.json, the disk and the seed are the node's and regular; nothing in
    the directory is a symlink; the record is the instance's. Refused before any program runs."""
    change(root / INST.lstrip("/"))
    assert launch_refused(ctx) == (reason, message)
    assert runs(ctx) == []


def test_the_record_is_read_bounded(ctx: HelperContext, root: Path) -> None:
    """A record of exactly 1 MiB is read whole; one byte more is refused (never read unbounded)."""
    data = encode_record(record())
    node_file(root / INST.lstrip("/") / "vm.json", data + b" " * ((1 << 20) - len(data)))
    assert ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))["name"] == "vm1"


def test_no_seed_is_needed_when_the_record_has_none(ctx: HelperContext, root: Path) -> None:
    rewrite(root, record(seed=False))
    os.unlink(root / INST.lstrip("/") / "seed.iso")
    assert ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))["name"] == "vm1"


def test_the_instance_directory_is_reached_without_a_symlink(
    ctx: HelperContext, root: Path, tmp_path: Path
) -> None:
    inst = root / INST.lstrip("/")
    os.rename(inst, tmp_path / "vm1")
    os.symlink(tmp_path / "vm1", inst)
    for op in ("ch.launch", "ch.vfio"):
        assert launch_refused(ctx, op) == (
            "bad-layout",
            f"{op}: cloud-hypervisor/instances/vm1: Not a directory (a directory, no symlink)",
        )
    os.unlink(inst)
    assert launch_refused(ctx) == (
        "bad-layout",
        "ch.launch: cloud-hypervisor/instances/vm1: No such file or directory (a directory, no symlink)",
    )
    os.rename(tmp_path / "vm1", inst)  # a real directory again, but a link earlier on the way
    chd = root / CHD.lstrip("/")
    os.rename(chd, tmp_path / "chd")
    os.symlink(tmp_path / "chd", chd)
    assert launch_refused(ctx) == (
        "bad-layout",
        "ch.launch: cloud-hypervisor/instances/vm1: Not a directory (a directory, no symlink)",
    )
    before = len(os.listdir("/proc/self/fd"))
    launch_refused(ctx)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_directory_holding_too_many_entries_is_refused(ctx: HelperContext, root: Path) -> None:
    inst = root / INST.lstrip("/")
    for i in range(ch.MAX_ENTRIES - 3):  # with vm.json, the disk and the seed: exactly the limit
        (inst / f"f{i}").write_bytes(b"")
    assert ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))["name"] == "vm1"
    (inst / "one-more").write_bytes(b"")
    assert launch_refused(ctx) == ("bad-layout", f"ch.launch: {INST} holds more than 256 entries")


def test_the_base_image_and_the_overlay_are_checked_dlv_chh_17(ctx: HelperContext, root: Path) -> None:
    """DLV-CHH-17: `images/<sha256>.<format>`, regular, a flat qcow2, and the overlay naming exactly it."""
    base = root / BASE.lstrip("/")
    inst = root / INST.lstrip("/")
    base.write_bytes(qcow2_bytes(GIB, "/etc/shadow", "raw"))
    reason, message = launch_refused(ctx)
    assert reason == "image-backing-file" and message.startswith(f"ch.launch: {base}: ")
    os.unlink(base)
    assert launch_refused(ctx) == ("bad-image", f"ch.launch: base image {BASE} is missing")
    base.mkdir()
    assert launch_refused(ctx) == ("bad-image", f"ch.launch: base image {BASE} must be a regular file")
    base.rmdir()
    os.symlink("/etc/passwd", base)
    assert launch_refused(ctx)[1] == f"ch.launch: base image {BASE} must be a regular file"
    os.unlink(base)
    node_file(base, qcow2_bytes(GIB), 0o644)
    node_file(inst / "disk.qcow2", qcow2_bytes(GIB, "/etc/shadow", "qcow2"))
    reason, message = launch_refused(ctx)
    assert reason == "image-backing-file" and "names backing file '/etc/shadow' (qcow2)" in message
    # a raw base: its header is not read, and the overlay names it as raw
    raw = f"{CHD}/images/{SHA}.raw"
    node_file(root / raw.lstrip("/"), b"\0" * 4096, 0o644)
    rewrite(root, record(image_format="raw"))
    node_file(inst / "disk.qcow2", qcow2_bytes(GIB, raw, "raw"))
    assert ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))["name"] == "vm1"
    assert runs(ctx)[-1] == expected_launch(root, base_image=raw)


def test_volumes_must_be_the_node_files_of_the_store_dlv_chh_18(ctx: HelperContext, root: Path) -> None:
    """DLV-CHH-18."""
    vols = root / f"{DATA}/volumes".lstrip("/")
    rewrite(root, record(volumes=(CHVolume("nope.raw", True, "x"),)))
    assert launch_refused(ctx) == ("bad-volume", f"ch.launch: volume {DATA}/volumes/nope.raw is missing")
    rule = f"ch.launch: volume {DATA}/volumes/other.raw must be a regular file of the node's volume store"
    rewrite(root, record(volumes=(CHVolume("other.raw", False, "x"),)))
    os.chown(vols / "other.raw", 0, 0)
    assert launch_refused(ctx) == ("bad-volume", rule)
    os.unlink(vols / "other.raw")
    node_dir(vols / "other.raw")
    assert launch_refused(ctx) == ("bad-volume", rule)
    os.rmdir(vols / "other.raw")
    os.symlink(vols / "rw.raw", vols / "other.raw")
    assert launch_refused(ctx) == ("bad-volume", rule)


def test_gpus_must_be_this_hosts_dlv_chh_18(ctx: HelperContext, root: Path, host: Host) -> None:
    """DLV-CHH-18: root's nvidia-smi lists them (sysfs form, lower case)."""
    rewrite(root, record(gpus=(GPU, "0000:ff:00.0", "0000:fe:00.0")))
    assert launch_refused(ctx) == (
        "not-this-hosts-gpu",
        "ch.launch: 0000:ff:00.0, 0000:fe:00.0 is not a GPU of this host",
    )
    host.smi_rc = 127
    rewrite(root, record(gpus=(GPU,)))
    assert launch_refused(ctx) == ("not-this-hosts-gpu", f"ch.launch: {GPU} is not a GPU of this host")


# --- units, uids, the binary, the account ----------------------------------------------------------------


def test_running_units_as_root_reads_them(ctx: HelperContext, host: Host) -> None:
    host.units = {
        "bcd-ch-a.service": ("active", str(UID1)),
        "bcd-ch-b.service": ("activating", ""),
        "bcd-ch-c.service": ("failed", str(UID2)),
        "bcd-ch-d.service": ("active", "bcd-vmm-4"),
    }
    got = ch._running_units(call(ctx, bounded=False))
    assert got == {"bcd-ch-a.service": UID1, "bcd-ch-b.service": -1, "bcd-ch-d.service": -1}
    assert runs(ctx) == [
        LIST,
        ("systemctl", "show", "-p", "User", "--value", "bcd-ch-a.service"),
        ("systemctl", "show", "-p", "User", "--value", "bcd-ch-b.service"),
        ("systemctl", "show", "-p", "User", "--value", "bcd-ch-d.service"),
    ]
    assert ctx.system.timeouts == [30] * 4  # type: ignore[attr-defined]
    assert ch._running_uids(call(ctx)) == {UID1}
    c = context(
        ctx.root,
        lambda a: (
            0,
            b"bcd-ch-a.service loaded\nother.service loaded active running x\n"
            b"\nbcd-ch-e.service loaded active running x\n",
            b"",
        ),
    )  # type: ignore[arg-type]
    try:
        assert ch._running_units(call(c)) == {"bcd-ch-e.service": -1}
    finally:
        c.audit.close()
    host.fail["systemctl list-units"] = (1, b"", b"Failed to connect to bus: No such file or directory\n")
    assert failed(ch._running_units, call(ctx)) == (
        "systemctl",
        "systemctl list-units: Failed to connect to bus: No such file or directory",
    )
    host.fail["systemctl show"] = (1, b"", b"Failed to get properties\n")
    del host.fail["systemctl list-units"]
    assert ch._running_units(call(ctx))["bcd-ch-a.service"] == -1
    del host.fail["systemctl show"]
    host.fail["systemctl list-units"] = (
        0,
        b"\xff loaded active running x\nbcd-ch-a.service loaded active running x\n",
        b"",
    )
    host.fail["systemctl show"] = (0, b"\xff\n", b"")
    assert ch._running_units(call(ctx)) == {"bcd-ch-a.service": -1}


def test_a_uid_another_running_unit_has_is_refused_dlv_chh_19(ctx: HelperContext, host: Host) -> None:
    """DLV-CHH-19: one VMM user per instance; nothing is granted or started."""
    host.units = {"bcd-ch-a.service": ("failed", str(UID1)), "bcd-ch-b.service": ("active", str(UID1))}
    assert launch_refused(ctx) == (
        "uid-in-use",
        f"ch.launch: uid {UID1} is bcd-ch-b.service's: one VMM user per instance",
    )
    assert acl(ctx.root / INST.lstrip("/")) == ({}, {})
    host.units = {"bcd-ch-b.service": ("active", str(UID2))}
    assert ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))["uid"] == UID1


@pytest.mark.parametrize(
    ("where", "mode", "owner", "chosen"),
    [
        ("usr/local/bin", 0o755, 0, "/usr/local/bin/cloud-hypervisor"),
        ("usr/local/bin", 0o700, 0, "/usr/local/bin/cloud-hypervisor"),
        ("usr/local/bin", 0o601, 0, "/usr/local/bin/cloud-hypervisor"),
        ("usr/local/bin", 0o775, 0, "/usr/bin/cloud-hypervisor"),
        ("usr/local/bin", 0o757, 0, "/usr/bin/cloud-hypervisor"),
        ("usr/local/bin", 0o644, 0, "/usr/bin/cloud-hypervisor"),
        ("usr/local/bin", 0o755, NODE_UID, "/usr/bin/cloud-hypervisor"),
        ("usr/local/bin", None, 0, "/usr/bin/cloud-hypervisor"),
    ],
)
def test_only_roots_own_binary_is_run_dlv_chh_21(
    ctx: HelperContext, root: Path, where: str, mode: int | None, owner: int, chosen: str
) -> None:
    """DLV-CHH-21: the first of /usr/local/bin, /usr/bin that is a regular file root owns, executable and
    writable by no one else."""
    path = root / where / "cloud-hypervisor"
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        path.mkdir()
    else:
        path.write_text("#!/bin/sh\n")
        os.chmod(path, mode)
        os.chown(path, owner, 0)
    assert ch.root_binary(call(ctx)) == chosen


def test_no_binary_root_owns_fails_before_anything_is_granted(ctx: HelperContext, root: Path) -> None:
    os.chmod(root / "usr/bin/cloud-hypervisor", 0o775)
    assert failed(ch.ch_launch, call(ctx), ch.ChLaunch("vm1")) == (
        "no-vmm",
        "no cloud-hypervisor binary root owns in /usr/local/bin/cloud-hypervisor or "
        "/usr/bin/cloud-hypervisor",
    )
    assert runs(ctx) == [LIST] and acl(root / INST.lstrip("/")) == ({}, {})


def test_the_vmm_account_is_bcds_or_refused(ctx: HelperContext, root: Path, host: Host) -> None:
    """A VMM never runs as an account that is not bcd's, even in bcd's uid range; an existing bcd
    account is reused (no groupadd, no useradd)."""
    passwd = root / "etc/passwd"
    passwd.write_text(PASSWD + f"mallory:x:{UID1}:{UID1}::/home/m:/bin/sh\n")
    assert launch_refused(ctx) == (
        "foreign-account",
        f"ch.launch: uid {UID1} is the account 'mallory', not bcd's",
    )
    passwd.write_text(PASSWD + f"{'m' * 40}:x:{UID1}:1::/:/bin/sh\n")
    assert launch_refused(ctx)[1] == f"ch.launch: uid {UID1} is the account {'m' * 32!r}, not bcd's"
    passwd.write_text(PASSWD + f"bcd-vmm-1:x:{UID1}:{UID1}::/nonexistent:/usr/sbin/nologin\n")
    n = len(runs(ctx))
    ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))
    assert [r[0] for r in runs(ctx)[n:]] == ["systemctl", "systemd-run"]
    # another uid's line naming this uid elsewhere (its gid) is no account of it
    host.units.clear()
    passwd.write_text(PASSWD + f"bcd-vmm-2:x:{UID2}:{UID1}::/nonexistent:/usr/sbin/nologin\n")
    n = len(runs(ctx))
    ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))
    assert [r[0] for r in runs(ctx)[n:]] == ["systemctl", "groupadd", "useradd", "systemd-run"]


def test_at_most_max_vmm_accounts_are_created(ctx: HelperContext, root: Path) -> None:
    lines = "".join(
        f"bcd-vmm-{i + 100}:x:{VMM_UID_BASE + i + 100}:1::/:/x\n" for i in range(ch.MAX_VMM_ACCOUNTS - 1)
    )
    (root / "etc/passwd").write_text(PASSWD + lines)
    assert ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))["name"] == "vm1"  # the 1024th
    rewrite(root, record(uid=UID2))
    (root / "etc/passwd").write_text(PASSWD + lines + "bcd-vmm-99:x:1:1::/:/x\n")
    ctx_host = ctx.system.host  # type: ignore[attr-defined]
    ctx_host.units.clear()
    assert launch_refused(ctx) == (
        "too-many-accounts",
        "ch.launch: 1024 VMM accounts exist, at most 1024: reuse a uid",
    )


def test_account_creation_failures(ctx: HelperContext, host: Host) -> None:
    host.fail["groupadd --gid"] = (9, b"", b"groupadd: group 'bcd-vmm-1' already exists\n")
    host.fail["useradd --uid"] = (9, b"", b"useradd: user 'bcd-vmm-1' already exists\n")
    assert ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))["name"] == "vm1"  # a race with another creator
    host.units.clear()
    (ctx.root / "etc/passwd").write_text(PASSWD)
    n = len(runs(ctx))
    host.fail["useradd --uid"] = (10, b"", b"useradd: cannot lock /etc/passwd; try again later.\n")
    assert failed(ch.ch_launch, call(ctx), ch.ChLaunch("vm1")) == (
        "account",
        "useradd bcd-vmm-1: useradd: cannot lock /etc/passwd; try again later.",
    )
    assert [r[0] for r in runs(ctx)[n:]] == ["systemctl", "groupadd", "useradd"]


def test_a_failed_start_takes_the_grants_back(ctx: HelperContext, root: Path, host: Host) -> None:
    """No VMM runs: the VMM user's entries go again, so a failed launch leaves nothing granted."""
    host.fail[SYSTEMD_RUN_KEY] = (1, b"", b"Job for bcd-ch-vm1.service failed.\n")
    assert failed(ch.ch_launch, call(ctx), ch.ChLaunch("vm1")) == (
        "systemd-run",
        f"ch.launch: systemd-run {UNIT}: Job for bcd-ch-vm1.service failed.",
    )
    inst = root / INST.lstrip("/")
    vols = root / f"{DATA}/volumes".lstrip("/")
    assert acl(inst)[0] == {} and UID1 not in acl(inst)[1] and acl(inst / "disk.qcow2")[0] == {}
    assert acl(vols / "rw.raw")[0] == {} and acl(vols / "ro.raw")[0] == {}


def test_a_failed_start_answers_its_failure_whatever_the_rollback_meets(
    ctx: HelperContext, root: Path, host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    host.fail[SYSTEMD_RUN_KEY] = (1, b"", b"Job for bcd-ch-vm1.service failed.\n")
    want = ("systemd-run", f"ch.launch: systemd-run {UNIT}: Job for bcd-ch-vm1.service failed.")

    def refuse(*a: Any, **kw: Any) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    with monkeypatch.context() as m:
        m.setattr(posixacl, "remove_user", refuse)
        assert failed(ch.ch_launch, call(ctx), ch.ChLaunch("vm1")) == want
    # a volume the node gave away meanwhile: the rollback's refusal is not the answer either
    real = posixacl.remove_user

    def chown_then_remove(fd: int, uid: int) -> None:
        os.chown(root / f"{DATA}/volumes/rw.raw".lstrip("/"), 0, 0)
        real(fd, uid)

    with monkeypatch.context() as m:
        m.setattr(posixacl, "remove_user", chown_then_remove)
        assert failed(ch.ch_launch, call(ctx), ch.ChLaunch("vm1")) == want


def test_a_grant_the_filesystem_refuses_fails_the_launch(
    ctx: HelperContext, root: Path, host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*a: Any, **kw: Any) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(posixacl, "set_user", refuse)
    assert failed(ch.ch_launch, call(ctx), ch.ChLaunch("vm1")) == (
        "acl",
        "ch.launch: granting the VMM user's ACL entries: Operation not supported",
    )
    assert [r[0] for r in runs(ctx)] == ["systemctl", "groupadd", "useradd"]


def test_a_volume_gone_before_the_grant_fails_it(ctx: HelperContext, root: Path) -> None:
    checked = ch._read_record(call(ctx), "ch.launch", "vm1")
    os.unlink(root / f"{DATA}/volumes/rw.raw".lstrip("/"))
    assert failed(ch._acl_instance, call(ctx), checked, UID1, True) == (
        "acl",
        f"{DATA}/volumes/rw.raw: No such file or directory",
    )
    ch._acl_instance(call(ctx), checked, UID1, False)  # taking back skips it
    node_file(root / f"{DATA}/volumes/rw.raw".lstrip("/"), b"")
    os.chown(root / f"{DATA}/volumes/rw.raw".lstrip("/"), 0, 0)
    assert refused(ch._acl_instance, call(ctx), checked, UID1, True) == (
        "bad-volume",
        f"volume {DATA}/volumes/rw.raw must be a regular file of the node's",
    )
    os.chown(root / INST.lstrip("/"), 0, 0)
    assert refused(ch._acl_instance, call(ctx), checked, UID1, True) == (
        "bad-layout",
        f"{INST} must be the node's directory",
    )


def test_grants_reach_the_directory_without_a_symlink(ctx: HelperContext, root: Path, tmp_path: Path) -> None:
    """The directory is opened again for the grants, one component at a time: gone or reached through
    a symlink since the record was read, it is refused, naming the step."""
    checked = ch._read_record(call(ctx), "ch.launch", "vm1")
    chd = root / CHD.lstrip("/")
    os.rename(chd, tmp_path / "ch")
    os.symlink(tmp_path / "ch", chd)
    assert refused(ch._acl_instance, call(ctx), checked, UID1, True) == (
        "bad-layout",
        "acl: cloud-hypervisor/instances/vm1: Not a directory (a directory, no symlink)",
    )
    assert acl(tmp_path / "ch/instances/vm1") == ({}, {})
    os.unlink(chd)
    assert refused(ch._acl_instance, call(ctx), checked, UID1, True)[1] == (
        "acl: cloud-hypervisor/instances/vm1: No such file or directory (a directory, no symlink)"
    )


def test_grants_on_what_changed_since_the_record_was_read(ctx: HelperContext, root: Path) -> None:
    """Between root's reading and its grants the node can change its files: a volume swapped for a
    link is never followed; a directory grown past the bound is refused; taking entries back goes on
    past a volume that is gone."""
    checked = ch._read_record(call(ctx), "ch.launch", "vm1")
    vols = root / f"{DATA}/volumes".lstrip("/")
    os.unlink(vols / "rw.raw")
    os.symlink(vols / "other.raw", vols / "rw.raw")
    assert failed(ch._acl_instance, call(ctx), checked, UID1, True) == (
        "acl",
        f"{DATA}/volumes/rw.raw: Too many levels of symbolic links",
    )
    assert acl(vols / "other.raw") == ({}, {})
    os.unlink(vols / "rw.raw")
    node_file(vols / "rw.raw", b"")
    ch._acl_instance(call(ctx), checked, UID1, True)
    os.unlink(vols / "rw.raw")
    ch._acl_instance(call(ctx), checked, UID1, False)
    assert acl(vols / "ro.raw") == ({}, {})  # the volume after the missing one
    inst = root / INST.lstrip("/")
    for i in range(ch.MAX_ENTRIES):
        (inst / f"f{i}").write_bytes(b"")
    assert refused(ch._acl_instance, call(ctx), checked, UID1, True) == (
        "bad-layout",
        f"acl: {INST} holds more than 256 entries",
    )


def test_grants_skip_what_is_not_the_nodes_or_not_a_file(ctx: HelperContext, root: Path) -> None:
    import socket

    inst = root / INST.lstrip("/")
    (inst / "roots").write_bytes(b"")  # root's own file: never granted
    node_dir(inst / "sub", 0o700)
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(inst)  # a socket's path is short
    try:
        sock.bind("api.sock")  # a socket: cannot be opened, skipped
    finally:
        os.chdir(cwd)
    os.chown(inst / "api.sock", NODE_UID, NODE_UID)
    os.mkfifo(inst / "fifo")
    os.chown(inst / "fifo", NODE_UID, NODE_UID)
    try:
        ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))
        assert acl(inst / "roots") == ({}, {}) and acl(inst / "sub") == ({UID1: 7}, {UID1: 7})
        assert acl(inst / "fifo") == ({}, {})
        assert ch.ch_stop(call(ctx), ch.ChName("vm1"))["state"] == "inactive"
        assert acl(inst / "sub") == ({}, {}) and acl(inst / "disk.qcow2") == ({}, {})
    finally:
        sock.close()


# --- stop ----------------------------------------------------------------------------------------------


def show_user(unit: str = UNIT) -> tuple[str, ...]:
    return ("systemctl", "show", "-p", "User", "--value", unit)


def vfio_node(root: Path, group: str, uid: int) -> Path:
    node = root / f"dev/vfio/{group}"
    node.parent.mkdir(parents=True, exist_ok=True)
    node.write_bytes(b"")
    os.chown(node, uid, uid)
    os.chmod(node, 0o660)
    return node


def test_stop_takes_back_the_grants_and_the_users_groups_dlv_chh_14(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """DLV-CHH-14, DLV-CHH-04: the unit stopped, its user's ACL entries removed, exactly the /dev/vfio
    groups that user owned given back to root (0600)."""
    ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))
    mine, other = vfio_node(root, "10", UID1), vfio_node(root, "11", UID2)
    (root / "dev/vfio/vfio").write_bytes(b"")
    os.chown(root / "dev/vfio/vfio", UID1, 0)
    n = len(runs(ctx))
    got = ch.ch_stop(call(ctx, bounded=False), req(ch.ChName, name="vm1"))
    assert got == {"name": "vm1", "unit": UNIT, "state": "inactive", "groups": ["10"]}
    assert runs(ctx)[n:] == [
        show_user(),
        ("systemctl", "stop", UNIT),
        ("systemctl", "show", "-p", "ActiveState", "--value", UNIT),
        LIST,
    ]
    assert ctx.system.timeouts[n:] == [30, 120, 30, 30]  # type: ignore[attr-defined]
    st, st2 = os.stat(mine), os.stat(other)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)
    assert (st2.st_uid, stat.S_IMODE(st2.st_mode)) == (UID2, 0o660)
    assert os.stat(root / "dev/vfio/vfio").st_uid == UID1  # not a group
    inst = root / INST.lstrip("/")
    assert acl(inst) == ({}, {NODE_UID: 7}) and acl(inst / "disk.qcow2") == ({}, {})
    assert acl(root / f"{DATA}/volumes/ro.raw".lstrip("/")) == ({}, {})


def test_stop_of_a_unit_gone_uses_the_records_uid(ctx: HelperContext, root: Path, host: Host) -> None:
    """A unit not loaded (or with no VMM user of bcd's) is stopped all the same; the record names the uid
    whose groups go back, unless a running unit has that uid."""
    node = vfio_node(root, "10", UID1)
    got = ch.ch_stop(call(ctx), ch.ChName("vm1"))
    assert got == {"name": "vm1", "unit": UNIT, "state": "inactive", "groups": ["10"]}
    node = vfio_node(root, "10", UID1)
    host.units["bcd-ch-other.service"] = ("active", str(UID1))
    assert ch.ch_stop(call(ctx), ch.ChName("vm1"))["groups"] == []
    assert os.stat(node).st_uid == UID1
    del host.units["bcd-ch-other.service"]
    for user in ("root", "0", str(VMM_UID_BASE - 1), ""):
        host.units[UNIT] = ("active", user)
        node = vfio_node(root, "10", UID1)
        assert ch.ch_stop(call(ctx), ch.ChName("vm1"))["groups"] == ["10"], user
    # no record either: nothing is given back
    os.unlink(root / INST.lstrip("/") / "vm.json")
    node = vfio_node(root, "10", UID1)
    assert ch.ch_stop(call(ctx), ch.ChName("vm1"))["groups"] == [] and os.stat(node).st_uid == UID1


def test_stop_reads_a_user_that_is_not_text_as_none(ctx: HelperContext, root: Path, host: Host) -> None:
    host.units[UNIT] = ("active", "\udcff")  # systemctl's answer is bytes: one that is not UTF-8
    orig = host.systemctl

    def systemctl(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[1:4] == ("show", "-p", "User"):
            return 0, b"\xff\n", b""
        return orig(argv)

    host.systemctl = systemctl  # type: ignore[method-assign]
    vfio_node(root, "10", UID1)
    assert ch.ch_stop(call(ctx), ch.ChName("vm1"))["groups"] == ["10"]  # the record's uid


def test_stop_answers_even_when_taking_the_entries_back_fails(
    ctx: HelperContext, root: Path, host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*a: Any, **kw: Any) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(posixacl, "remove_user", refuse)
    vfio_node(root, "10", UID1)
    assert ch.ch_stop(call(ctx), ch.ChName("vm1"))["groups"] == ["10"]


def test_stop_reads_a_state_that_is_not_text_as_not_stopped(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    orig = host.systemctl

    def systemctl(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[1:4] == ("show", "-p", "ActiveState"):
            return 0, b"\xff\n", b""
        return orig(argv)

    host.systemctl = systemctl  # type: ignore[method-assign]
    node = vfio_node(root, "10", UID1)
    got = ch.ch_stop(call(ctx), ch.ChName("vm1"))
    assert (got["state"], got["groups"]) == ("\ufffd", []) and os.stat(node).st_uid == UID1


def test_stop_gives_back_the_units_own_user_not_the_records(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    host.units[UNIT] = ("active", str(UID2))
    vfio_node(root, "10", UID1)
    vfio_node(root, "12", UID2)
    assert ch.ch_stop(call(ctx), ch.ChName("vm1"))["groups"] == ["12"]


def test_stop_that_did_not_stop_gives_nothing_back(ctx: HelperContext, root: Path, host: Host) -> None:
    node = vfio_node(root, "10", UID1)
    host.units[UNIT] = ("active", str(UID1))
    host.fail["systemctl stop"] = (0, b"", b"")  # stop answered, the unit is still deactivating
    c = ctx
    ch._acl_instance(call(c), ch._read_record(call(c), "ch.launch", "vm1"), UID1, True)
    got = ch.ch_stop(call(c), ch.ChName("vm1"))
    assert (got["state"], got["groups"]) == ("active", []) and os.stat(node).st_uid == UID1
    assert acl(root / INST.lstrip("/"))[0] == {UID1: 7}  # a VMM still running keeps its entries
    host.units[UNIT] = ("failed", str(UID1))
    assert ch.ch_stop(call(c), ch.ChName("vm1"))["groups"] == ["10"]
    host.fail["systemctl show"] = (1, b"", b"Failed to connect to bus\n")
    got = ch.ch_stop(call(c), ch.ChName("vm1"))
    assert got["state"] == "unknown" and got["groups"] == []
    host.fail["systemctl stop"] = (1, b"", b"Failed to stop bcd-ch-vm1.service: Access denied\n")
    assert failed(ch.ch_stop, call(c), ch.ChName("vm1")) == (
        "systemctl",
        f"ch.stop: systemctl stop {UNIT}: Failed to stop bcd-ch-vm1.service: Access denied",
    )


def test_stop_of_an_instance_whose_directory_is_gone(ctx: HelperContext, root: Path, host: Host) -> None:
    import shutil

    shutil.rmtree(root / INST.lstrip("/"))
    host.units[UNIT] = ("active", str(UID1))
    node = vfio_node(root, "10", UID1)
    assert ch.ch_stop(call(ctx), ch.ChName("vm1")) == {
        "name": "vm1",
        "unit": UNIT,
        "state": "inactive",
        "groups": ["10"],
    }
    assert os.stat(node).st_uid == 0


# --- VFIO ----------------------------------------------------------------------------------------------

PCI = [
    (GPU, "0x030200", 10, "nvidia"),
    (AUDIO, "0x040300", 10, "snd_hda_intel"),
    (BRIDGE, "0x060400", 10, "pcieport"),
    (GPU1, "0x030200", 11, "nvidia"),
    (NIC, "0x020000", 11, "ixgbe"),
]


def driver(root: Path, addr: str) -> str:
    link = root / f"sys/bus/pci/devices/{addr}/driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else ""


@pytest.fixture
def pci(root: Path) -> Path:
    lay_out_pci(root, PCI)
    rewrite(root, record(gpus=(GPU,)))
    return root


def test_vfio_binds_the_group_and_hands_it_to_the_vmm_dlv_chh_12_dlv_ch_19(
    ctx: HelperContext, pci: Path, host: Host
) -> None:
    """DLV-CHH-12, DLV-CH-19: every endpoint of the GPU's group (its audio function too) moves to
    vfio-pci through driver_override, unbind and drivers_probe, one value per write; the bridge stays on
    pcieport; /dev/vfio/10 becomes the VMM user's, 0600."""
    root = pci
    got = ch.ch_vfio(call(ctx, bounded=False), req(ch.ChLaunch, name="vm1"))
    assert got == {"name": "vm1", "groups": ["10"]}
    dev = "/sys/bus/pci/devices"
    assert host.writes == [
        (f"{dev}/{GPU}/driver_override", "vfio-pci"),
        (f"{dev}/{GPU}/driver/unbind", GPU),
        ("/sys/bus/pci/drivers_probe", GPU),
        (f"{dev}/{AUDIO}/driver_override", "vfio-pci"),
        (f"{dev}/{AUDIO}/driver/unbind", AUDIO),
        ("/sys/bus/pci/drivers_probe", AUDIO),
    ]
    assert next(r for r in runs(ctx) if r[0] == "tee") == (
        "tee",
        str(root / f"sys/bus/pci/devices/{GPU}/driver_override"),
    )
    assert all(t == 60 for r, t in zip(runs(ctx), ctx.system.timeouts, strict=True) if r[0] == "tee")  # type: ignore[attr-defined]
    assert (driver(root, GPU), driver(root, AUDIO), driver(root, BRIDGE)) == (
        "vfio-pci",
        "vfio-pci",
        "pcieport",
    )
    st = os.lstat(root / "dev/vfio/10")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID1, UID1, 0o600)
    # again: devices already on vfio-pci are left as they are
    host.writes.clear()
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"] and host.writes == []
    # and given back: the node to root, the devices to their host drivers
    got = ch.ch_unvfio(call(ctx), req(ch.ChName, name="vm1"))
    assert got == {"name": "vm1", "groups": ["10"]}
    assert host.writes == [
        (f"{dev}/{GPU}/driver/unbind", GPU),
        (f"{dev}/{GPU}/driver_override", "\n"),
        ("/sys/bus/pci/drivers_probe", GPU),
        (f"{dev}/{AUDIO}/driver/unbind", AUDIO),
        (f"{dev}/{AUDIO}/driver_override", "\n"),
        ("/sys/bus/pci/drivers_probe", AUDIO),
    ]
    assert (driver(root, GPU), driver(root, AUDIO), driver(root, BRIDGE)) == (
        "nvidia",
        "snd_hda_intel",
        "pcieport",
    )
    st = os.lstat(root / "dev/vfio/10")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)


def test_a_device_with_no_driver_is_probed_without_an_unbind(
    ctx: HelperContext, pci: Path, host: Host
) -> None:
    os.unlink(pci / f"sys/bus/pci/devices/{AUDIO}/driver")
    ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))
    assert (f"/sys/bus/pci/devices/{AUDIO}/driver/unbind", AUDIO) not in host.writes
    assert driver(pci, AUDIO) == "vfio-pci"


def test_a_device_already_on_vfio_pci_is_skipped_and_the_next_bound(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    lay_out_pci(root, [(GPU, "0x030200", 10, "vfio-pci"), (AUDIO, "0x040300", 10, "snd_hda_intel")])
    rewrite(root, record(gpus=(GPU,)))
    vfio_node(root, "10", 0)
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"]
    assert [w[0] for w in host.writes] == [
        f"/sys/bus/pci/devices/{AUDIO}/driver_override",
        f"/sys/bus/pci/devices/{AUDIO}/driver/unbind",
        "/sys/bus/pci/drivers_probe",
    ]
    assert driver(root, AUDIO) == "vfio-pci"


def test_vfio_names_itself_in_its_sysfs_failures(ctx: HelperContext, pci: Path, host: Host) -> None:
    dev = f"/sys/bus/pci/devices/{GPU}"
    for path, value in ((f"{dev}/driver/unbind", GPU), ("/sys/bus/pci/drivers_probe", GPU)):
        host.fail[f"tee {path}"] = (1, b"", b"tee: write error: No such device\n")
        assert failed(ch.ch_vfio, call(ctx), ch.ChLaunch("vm1")) == (
            "sysfs",
            f"ch.vfio: writing {value!r} to {path}: tee: write error: No such device",
        )
        del host.fail[f"tee {path}"]


def test_busy_gpus_reads_nvidia_smis_forms(root: Path) -> None:
    """GPU 1's bus has hex letters (2A, lower-cased); older drivers print a 4-digit PCI domain; a byte
    that is not UTF-8 names no GPU."""

    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[1] == "--query-gpu=pci.bus_id,uuid":
            return 0, f"\xff, x\n0000:2A:00.0, {GPU1_UUID}\n".encode("latin-1"), b""
        return 0, f"{GPU1_UUID}, 31\n".encode(), b""

    c = context(root, Host(root))
    c.system.script = script  # type: ignore[attr-defined]
    try:
        assert refused(ch._busy_gpus, call(c, bounded=False), "ch.vfio", (GPU1,)) == (
            "gpu-busy",
            f"ch.vfio: {GPU1}: {GPU1_UUID} runs compute process 31",
        )
        assert c.system.timeouts == [60, 60]  # type: ignore[attr-defined]
    finally:
        c.audit.close()


def test_vfio_of_a_record_without_gpus_touches_nothing(ctx: HelperContext, root: Path) -> None:
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1")) == {"name": "vm1", "groups": []}
    assert ch.ch_unvfio(call(ctx), ch.ChName("vm1")) == {"name": "vm1", "groups": []}
    assert runs(ctx) == [LIST]


def test_a_group_with_a_foreign_device_is_refused_dlv_chh_11(
    ctx: HelperContext, pci: Path, host: Host
) -> None:
    """DLV-CHH-11: GPU 1 shares its IOMMU group with a NIC: refused, nothing bound."""
    rewrite(pci, record(gpus=(GPU1,)))
    assert launch_refused(ctx, "ch.vfio") == (
        "foreign-device",
        f"ch.vfio: IOMMU group 11 of {GPU1} holds {NIC}, which is not a GPU of this host, a function of one "
        "or a PCI bridge",
    )
    assert host.writes == [] and driver(pci, NIC) == "ixgbe"
    assert launch_refused(ctx, "ch.unvfio") == (
        "foreign-device",
        f"ch.unvfio: IOMMU group 11 of {GPU1} holds {NIC}, which is not a GPU of this host, a function of "
        "one or a PCI bridge",
    )


def test_an_iommu_group_root_cannot_read_fails(ctx: HelperContext, pci: Path) -> None:
    link = pci / f"sys/bus/pci/devices/{GPU}/iommu_group"
    os.unlink(link)
    assert failed(ch.ch_vfio, call(ctx), ch.ChLaunch("vm1")) == (
        "no-iommu",
        f"ch.vfio: {GPU} has no IOMMU group (is the IOMMU on?)",
    )
    os.symlink("../../../../kernel/iommu_groups/" + "x" * 30, link)
    assert failed(ch.ch_vfio, call(ctx), ch.ChLaunch("vm1")) == (
        "no-iommu",
        f"ch.vfio: {GPU}: unreadable IOMMU group {'x' * 20!r}",
    )


def test_a_gpu_root_sees_busy_is_refused_dlv_chh_09(ctx: HelperContext, pci: Path, host: Host) -> None:
    """DLV-CHH-09: root's own busy view (compute processes, live holds) refuses the GPU."""
    host.apps = f"{GPU1_UUID}, 12\n{GPU0_UUID}, 777\n".encode()
    assert launch_refused(ctx, "ch.vfio") == (
        "gpu-busy",
        f"ch.vfio: {GPU}: {GPU0_UUID} runs compute process 777",
    )
    assert host.writes == []
    assert ("nvidia-smi", "--query-gpu=pci.bus_id,uuid", "--format=csv,noheader") in runs(ctx)
    host.apps = f"{GPU1_UUID}, 12\n".encode()
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"]


def test_busy_gpus_when_nvidia_smi_cannot_name_them(ctx: HelperContext, host: Host) -> None:
    host.apps = b"MIG-5f1c2a90-0000-4000-8000-00000000000a, 99\n"
    reason, message = refused(ch._busy_gpus, call(ctx), "ch.vfio", (GPU,))
    assert (reason, message.startswith(f"ch.vfio: {GPU}: a MIG device")) == ("gpu-busy", True)
    host.apps = f"{GPU0_UUID}, 1\n".encode()
    host.fail["nvidia-smi --query-gpu=pci.bus_id,uuid"] = (6, b"", b"x\n")
    ch._busy_gpus(call(ctx), "ch.vfio", (GPU,))  # unnamed: only "every GPU" would refuse it
    host.fail["nvidia-smi --query-compute-apps=gpu_uuid,pid"] = (6, b"", f"{NO_DRIVER}\n".encode())
    assert failed(ch._busy_gpus, call(ctx), "ch.vfio", (GPU,)) == (
        "gpu-busy-unknown",
        f"ch.vfio: cannot list compute processes: nvidia-smi exited 6: {NO_DRIVER}",
    )


def test_a_group_a_running_vmm_holds_is_never_taken_or_given_back_dlv_chh_10_13(
    ctx: HelperContext, pci: Path, host: Host
) -> None:
    """DLV-CHH-10, DLV-CHH-13, DLV-CHH-15: root reads /dev/vfio's owner itself; a group a running
    unit's user holds is refused to another instance and never given back; a leftover of a stopped
    VMM's user, or root's, is free."""
    node = vfio_node(pci, "10", UID2)
    host.units = {"bcd-ch-vm2.service": ("active", str(UID2))}
    message = f"/dev/vfio/10 is held by a running VMM's user ({UID2})"
    assert launch_refused(ctx, "ch.vfio") == ("group-in-use", f"ch.vfio: {message}")
    assert launch_refused(ctx, "ch.unvfio") == ("group-in-use", f"ch.unvfio: {message}")
    assert host.writes == [] and os.stat(node).st_uid == UID2
    host.units = {"bcd-ch-vm2.service": ("failed", str(UID2))}
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"] and os.stat(node).st_uid == UID1
    # its own user (the record's uid) while its unit runs: taken again, not given back
    host.units = {UNIT: ("active", str(UID1))}
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"]
    assert launch_refused(ctx, "ch.unvfio")[0] == "group-in-use"
    os.chown(node, 0, 0)
    host.units = {"bcd-ch-vm2.service": ("active", "0")}
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"]


def test_a_unit_running_as_root_holds_no_group_root_owns_dlv_chh_10_13(
    ctx: HelperContext, pci: Path, host: Host
) -> None:
    """DLV-CHH-10, DLV-CHH-13, DLV-CHH-15: a group /dev/vfio shows as root's was given back: no VMM
    unit's user owns it, even while a `bcd-ch-*` unit runs as root (never one of bcd's: ch.launch's
    User= is a VMM uid), so ch.unvfio unbinds it and ch.vfio takes it; any other user of a running unit,
    the lowest included, keeps its group."""
    node = vfio_node(pci, "10", 0)
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"]
    os.chown(node, 0, 0)  # given back (ch.stop), the devices still on vfio-pci
    for user in ("0", "root"):
        host.units = {"bcd-ch-vm2.service": ("active", user)}
        host.writes.clear()
        assert ch.ch_unvfio(call(ctx), ch.ChName("vm1")) == {"name": "vm1", "groups": ["10"]}
        assert (driver(pci, GPU), driver(pci, AUDIO)) == ("nvidia", "snd_hda_intel")
        assert (f"/sys/bus/pci/devices/{GPU}/driver/unbind", GPU) in host.writes
        assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"]
        os.chown(node, 0, 0)
    os.chown(node, 1, 1)  # the lowest user but root's, a running unit's: kept
    host.units = {"bcd-ch-vm2.service": ("active", "1")}
    for op in ("ch.unvfio", "ch.vfio"):
        assert launch_refused(ctx, op) == (
            "group-in-use",
            f"{op}: /dev/vfio/10 is held by a running VMM's user (1)",
        )
    assert os.stat(node).st_uid == 1 and driver(pci, GPU) == "vfio-pci"


def test_vfio_refuses_a_uid_of_another_account(ctx: HelperContext, pci: Path) -> None:
    (pci / "etc/passwd").write_text(PASSWD + f"mallory:x:{UID1}:{UID1}::/:/bin/sh\n")
    assert launch_refused(ctx, "ch.vfio") == (
        "foreign-account",
        f"ch.vfio: uid {UID1} is the account 'mallory', not bcd's",
    )


def test_no_vfio_pci_module_fails_the_bind_and_restores_the_driver_dlv_ch_20(root: Path, host: Host) -> None:
    """DLV-CH-20: without vfio-pci loaded the device does not move: the op fails naming the module, the
    override cleared and the device probed back to its host driver."""
    lay_out_pci(root, [(GPU, "0x030200", 10, "nvidia")], vfio=False)
    rewrite(root, record(gpus=(GPU,)))
    c = context(root, host)
    try:
        assert failed(ch.ch_vfio, call(c), ch.ChLaunch("vm1")) == (
            "vfio",
            f"ch.vfio: {GPU} did not move to vfio-pci (is the vfio-pci module loaded?)",
        )
        dev = f"/sys/bus/pci/devices/{GPU}"
        assert host.writes[-2:] == [(f"{dev}/driver_override", "\n"), ("/sys/bus/pci/drivers_probe", GPU)]
        assert driver(root, GPU) == "nvidia"
        assert (root / f"sys/bus/pci/devices/{GPU}/driver_override").read_text() == "\n"
        # the restoring writes failing too: the answer is still the bind's failure
        host.fail[f"tee {dev}/driver_override"] = (1, b"", b"tee: write error\n")
        os.unlink(root / f"sys/bus/pci/devices/{GPU}/driver")
        host.writes.clear()
        host.fail[f"tee {dev}/driver_override"] = (1, b"", b"tee: write error: Permission denied\n")
        assert failed(ch.ch_vfio, call(c), ch.ChLaunch("vm1")) == (
            "sysfs",
            f"ch.vfio: writing 'vfio-pci' to {dev}/driver_override: tee: write error: Permission denied",
        )
    finally:
        c.audit.close()


def test_a_failed_restore_write_after_a_failed_bind_is_not_the_answer(root: Path, host: Host) -> None:
    lay_out_pci(root, [(GPU, "0x030200", 10, "nvidia")], vfio=False)
    rewrite(root, record(gpus=(GPU,)))
    c = context(root, host)
    try:
        real = host.tee
        count = {"n": 0}

        def tee(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
            count["n"] += 1
            if count["n"] == 4:  # the first write of the restore
                return 1, b"", b"tee: write error\n"
            return real(argv)

        host.tee = tee  # type: ignore[method-assign]
        assert failed(ch.ch_vfio, call(c), ch.ChLaunch("vm1"))[0] == "vfio"
        assert count["n"] == 4  # the probe after the failed override is not tried
    finally:
        c.audit.close()


def test_a_group_node_root_cannot_hand_over_fails(ctx: HelperContext, root: Path) -> None:
    lay_out_pci(root, [(GPU, "0x030200", 10, "vfio-pci")])  # already bound: no node made
    rewrite(root, record(gpus=(GPU,)))
    assert failed(ch.ch_vfio, call(ctx), ch.ChLaunch("vm1")) == (
        "vfio",
        "ch.vfio: /dev/vfio/10: No such file or directory",
    )


def test_unvfio_gives_back_only_devices_on_vfio_pci(ctx: HelperContext, pci: Path, host: Host) -> None:
    ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))
    os.unlink(pci / f"sys/bus/pci/devices/{AUDIO}/driver")  # gone from vfio-pci meanwhile
    host.writes.clear()
    ch.ch_unvfio(call(ctx), ch.ChName("vm1"))
    assert [w for w in host.writes if AUDIO in w[0] or w[1] == AUDIO] == []
    os.unlink(pci / "dev/vfio/10")  # a node gone: nothing to give back, no failure
    assert ch.ch_unvfio(call(ctx), ch.ChName("vm1"))["groups"] == ["10"]


def test_unvfio_names_itself_in_what_it_refuses_or_fails(ctx: HelperContext, pci: Path, host: Host) -> None:
    ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))
    dev = f"/sys/bus/pci/devices/{GPU}"
    for path, value in ((f"{dev}/driver/unbind", GPU), (f"{dev}/driver_override", "\n"),
                        ("/sys/bus/pci/drivers_probe", GPU)):  # fmt: skip
        host.fail[f"tee {path}"] = (1, b"", b"tee: write error: No such device\n")
        assert failed(ch.ch_unvfio, call(ctx), ch.ChName("vm1")) == (
            "sysfs",
            f"ch.unvfio: writing {value!r} to {path}: tee: write error: No such device",
        )
        del host.fail[f"tee {path}"]
        ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))
    os.unlink(pci / INST.lstrip("/") / "vm.json")
    assert launch_refused(ctx, "ch.unvfio") == (
        "bad-layout",
        f"ch.unvfio: {INST}/vm.json: No such file or directory (a regular file, no symlink)",
    )


def test_the_group_devices_are_this_hosts_gpus_functions_and_bridges(ctx: HelperContext, root: Path) -> None:
    lay_out_pci(
        root,
        [(GPU, "0x030200", 12, "nvidia"), (GPU1, "0x030200", 12, "nvidia"),
         ("0000:18:00.3", "0x0c0330", 12, "x"), ("0000:16:00.0", "0x060400", 12, "pcieport")],
    )  # fmt: skip
    assert ch._groups_for(call(ctx), "ch.vfio", (GPU,)) == {
        "12": sorted([GPU, GPU1, "0000:18:00.3", "0000:16:00.0"])
    }
    assert refused(ch._groups_for, call(ctx), "ch.vfio", ("0000:99:00.0",)) == (
        "not-this-hosts-gpu",
        "ch.vfio: 0000:99:00.0 is not a GPU of this host",
    )


# --- with command-signing roots ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def signer(cp: ControlPlane) -> Signer:
    return cp.command.leaf()


def signed_ctx(root: Path, host: Host, cp: ControlPlane) -> HelperContext:
    cp.write_record(root, NODE, cp.bundle(1))
    return context(root, host, cp.config_lines() + CONFIG)


def wire_vm(
    *,
    vcpus: int = 2,
    memory: int = GIB,
    nics: tuple[tuple[str, str], ...] = (("br0", MAC),),
    gpus: tuple[str, ...] = (),
    sha: str = SHA,
    state: int = 1,
    sized: bool = True,
    policy: int = 0,
    addresses: tuple[str, ...] = (),
    runtime: str = "cloud-hypervisor",
) -> wire.InstanceSpec:
    return wire.InstanceSpec(
        id="vm1",
        allocation_id="alloc-1",
        runtime=runtime,
        desired_state=wire.InstanceDesiredState(state),
        size=wire.InstanceSize(vcpus=vcpus, memory_bytes=memory, disk_bytes=10 * GIB) if sized else None,
        image=wire.ImageRef(url="https://images.example/x.qcow2", sha256=sha, format="qcow2")
        if sha
        else None,
        nics=[wire.Nic(bridge=b, mac=m, addresses=list(addresses)) for b, m in nics],
        gpu_uuids=list(gpus),
        network_policy=wire.NetworkPolicy(policy),
    )


def signed(signer: Signer, generation: int, *instances: wire.InstanceSpec) -> SignedIntent:
    spec = wire.NodeSpec(instances=wire.InstancesSection(instances=list(instances)))
    body = bytes(
        wire.DesiredStateBody(node_id=NODE, generation=generation, spec_hash=f"h{generation}", full=spec)
    )
    doc = intent(signer, body)
    return SignedIntent(doc["body"], doc["signature"], tuple(doc["chain"]), None)


def state_generation(root: Path) -> int | None:
    path = root / "var/lib/bcd-hostconfig/helper-intent.json"
    return int(json.loads(path.read_text())["generation"]) if path.exists() else None


def test_a_signed_launch_compares_the_record_with_the_spec(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """Root re-validates the node's vm.json against the signed spec's instance (vCPUs, memory, NICs by
    bridge and MAC, GPUs by UUID as root's nvidia-smi names them, image) before anything runs; a
    refusal writes no state."""
    lay_out_pci(root, PCI)
    rewrite(root, record(gpus=(GPU,)))
    c = signed_ctx(root, host, cp)
    try:
        launch = lambda i: ch.ch_launch(call(c), ch.ChLaunch("vm1", i))  # noqa: E731
        assert refused(launch, None) == (
            "intent-required",
            "ch.launch: a signed spec is required (command-signing roots from join record)",
        )
        mismatch = "ch.launch: vm1: vm.json differs from the signed spec in "
        cases = [
            (wire_vm(vcpus=3, gpus=(GPU0_UUID,)), "vCPUs"),
            (wire_vm(memory=2 * GIB, gpus=(GPU0_UUID,)), "memory"),
            (wire_vm(nics=(("br0", "52:54:00:00:00:02"),), gpus=(GPU0_UUID,)), "NICs"),
            (wire_vm(nics=(("br1", MAC),), gpus=(GPU0_UUID,)), "NICs"),
            (wire_vm(gpus=(GPU1_UUID,)), "GPUs"),
            (wire_vm(gpus=()), "GPUs"),
            (wire_vm(gpus=(GPU0_UUID, GPU1_UUID)), "GPUs"),
            (wire_vm(sha="e" * 64, gpus=(GPU0_UUID,)), "image"),
            (wire_vm(sha="", gpus=(GPU0_UUID,)), "image"),
            (wire_vm(sized=False, gpus=(GPU0_UUID,)), "vCPUs, memory"),
            (wire_vm(vcpus=1, memory=1, nics=(), gpus=(), sha="e" * 64), "vCPUs, memory, NICs, GPUs, image"),
        ]
        for inst, fields in cases:
            assert refused(launch, signed(signer, 5, inst)) == ("spec-mismatch", mismatch + fields)
        assert state_generation(root) is None and "systemd-run" not in [r[0] for r in runs(c)]
        assert refused(launch, signed(signer, 5, wire_vm(gpus=(GPU0_UUID,), state=4)))[0] == "not-in-spec"
        # round 6b: only an instance the spec wants RUNNING or PAUSED is launched
        assert refused(launch, signed(signer, 5, wire_vm(gpus=(GPU0_UUID,), state=3))) == (
            "instance-stopped",
            "ch.launch: vm1: the signed spec (generation 5) wants it STOPPED: root starts only an "
            "instance it wants RUNNING or PAUSED",
        )
        assert state_generation(root) is None and "systemd-run" not in [r[0] for r in runs(c)]
        assert launch(signed(signer, 5, wire_vm(gpus=(GPU0_UUID,))))["name"] == "vm1"
        assert state_generation(root) == 5 and runs(c)[-1][0] == "systemd-run"
        # a restored record is compared without its image (its disk names none)
        host.units.clear()
        node_file(root / INST.lstrip("/") / "disk.qcow2", qcow2_bytes(GIB))
        rewrite(root, record(restored=True, image_sha256=None, image_format=None))
        assert launch(signed(signer, 6, wire_vm(sha="e" * 64)))["name"] == "vm1"
        assert state_generation(root) == 6
    finally:
        c.audit.close()


def test_signed_taps_must_be_the_specs_nics_bridges(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    c = signed_ctx(root, host, cp)
    try:
        taps = lambda b, i: ch.ch_taps(call(c), ch.ChTaps("vm1", b, i))  # noqa: E731
        assert refused(taps, ("br0",), None)[0] == "intent-required"
        two = wire_vm(nics=(("br0", MAC), ("br1", "52:54:00:00:00:02")))
        for bridges in (("br0",), ("br1", "br0"), ("br0", "br1", "br1")):
            assert refused(taps, bridges, signed(signer, 3, two)) == (
                "spec-mismatch",
                "ch.taps: vm1: the bridges differ from the signed spec's NICs",
            )
        assert runs(c) == [] and state_generation(root) is None
        assert taps(("br0", "br1"), signed(signer, 3, two))["taps"] == [T0, T1]
        assert state_generation(root) == 3
        # taps run no guest: an instance the spec wants STOPPED may have them (round 6b binds only starts)
        stopped = wire_vm(nics=(("br0", MAC), ("br1", "52:54:00:00:00:02")), state=3)
        assert taps(("br0", "br1"), signed(signer, 4, stopped))["taps"] == [T0, T1]
    finally:
        c.audit.close()


def test_round7_a_ch_op_takes_only_an_instance_the_spec_runs_under_cloud_hypervisor(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """Round 7 (docs/helper.md): `ch.*` with roots takes only an instance the signed spec runs under
    `cloud-hypervisor` (`spec-mismatch`, naming the spec's runtime): a libvirt-kvm instance is never also
    given taps here, a second guest of one instance. Nothing runs and no state is written."""
    c = signed_ctx(root, host, cp)
    try:
        kvm = wire_vm(runtime="libvirt-kvm")
        assert refused(ch.ch_taps, call(c), ch.ChTaps("vm1", ("br0",), signed(signer, 3, kvm))) == (
            "spec-mismatch",
            "ch.taps: vm1: the signed spec (generation 3) runs it under 'libvirt-kvm', not cloud-hypervisor",
        )
        assert runs(c) == [] and state_generation(root) is None
        assert ch.ch_taps(call(c), ch.ChTaps("vm1", ("br0",), signed(signer, 3, wire_vm())))["taps"] == [T0]
        assert state_generation(root) == 3
    finally:
        c.audit.close()


def test_an_unsigned_host_with_a_presented_intent_checks_it(root: Path, host: Host, signer: Signer) -> None:
    """No roots anywhere, but an intent presented: its decoding is checked (a bad one refused)."""
    c = context(root, host)
    try:
        bad = SignedIntent("", "", ("!!",), None)
        assert refused(ch.ch_taps, call(c), ch.ChTaps("vm1", ("br0",), bad))[0] == "bad-intent"
        assert refused(ch.ch_launch, call(c), ch.ChLaunch("vm1", bad)) == (
            "bad-intent",
            "ch.launch: intent.chain[0] is not base64",
        )
        assert refused(ch.ch_vfio, call(c), ch.ChLaunch("vm1", bad)) == (
            "bad-intent",
            "ch.vfio: intent.chain[0] is not base64",
        )
        assert runs(c) == []
        assert ch.ch_taps(call(c), ch.ChTaps("vm1", ("br0",)))["created"] == [T0]
    finally:
        c.audit.close()


def test_a_symlink_in_place_of_the_group_node_is_refused_by_name_and_never_followed(
    ctx: HelperContext, pci: Path, host: Host
) -> None:
    """A link at /dev/vfio/<group> (only root can make one) fails `vfio` naming it, for ch.vfio and
    ch.unvfio alike, rather than chowning what it points at or failing as `internal` (Linux has no
    lchmod); its target keeps its owner and mode."""
    target = pci / "etc/not-a-group"
    target.write_text("x")
    os.chmod(target, 0o644)
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"]  # the simulated driver made the node
    node = pci / "dev/vfio/10"
    node.unlink()
    node.symlink_to(target)
    want = ("vfio", "ch.vfio: /dev/vfio/10 is a symlink, not the group's device node")
    assert failed(ch.ch_vfio, call(ctx), ch.ChLaunch("vm1")) == want
    assert failed(ch.ch_unvfio, call(ctx), ch.ChName("vm1")) == (
        "vfio",
        want[1].replace("ch.vfio", "ch.unvfio"),
    )
    st = os.stat(target)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644) and node.is_symlink()


def test_the_group_node_missing_fails_vfio_and_is_skipped_when_given_back(
    ctx: HelperContext, pci: Path, host: Host
) -> None:
    """ch.vfio cannot hand over a group whose node is missing (`vfio`, named); giving back skips it."""
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"]  # the simulated driver made the node
    (pci / "dev/vfio/10").unlink()
    assert failed(ch.ch_vfio, call(ctx), ch.ChLaunch("vm1")) == (
        "vfio",
        "ch.vfio: /dev/vfio/10: No such file or directory",
    )
    assert ch.ch_unvfio(call(ctx), ch.ChName("vm1")) == {"name": "vm1", "groups": ["10"]}


# --- a VMM user never reaches another instance's GPUs ---------------------------------------------------


def test_vfio_refuses_a_uid_another_running_unit_has(ctx: HelperContext, pci: Path, host: Host) -> None:
    """The groups go to the record's uid: a uid another running VMM unit runs as is refused (as
    ch.launch refuses it), or a node could hand this instance's GPUs to that VMM and attach them to
    its guest over its API socket. The instance's own unit running as that uid is no other's."""
    node = vfio_node(pci, "10", 0)
    host.units = {"bcd-ch-vm2.service": ("active", str(UID1)), "bcd-ch-vm3.service": ("failed", str(UID2))}
    assert launch_refused(ctx, "ch.vfio") == (
        "uid-in-use",
        f"ch.vfio: uid {UID1} is bcd-ch-vm2.service's: one VMM user per instance",
    )
    assert host.writes == [] and os.stat(node).st_uid == 0 and driver(pci, GPU) == "nvidia"
    host.units = {UNIT: ("active", str(UID1)), "bcd-ch-vm3.service": ("active", str(UID2))}
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["10"] and os.stat(node).st_uid == UID1


def test_launch_refuses_a_uid_holding_a_group_of_gpus_not_its_records(
    ctx: HelperContext, pci: Path, host: Host
) -> None:
    """The VMM's user may hold only the /dev/vfio groups of its record's GPUs: a uid that ch.vfio of
    another record gave a group to is refused before anything is granted or started (else the node
    attaches that group's GPU to this guest over the VMM's API socket)."""
    vfio_node(pci, "10", UID1)
    other = vfio_node(pci, "11", UID1)
    vfio_node(pci, "12", UID2)
    (pci / "dev/vfio/vfio").write_bytes(b"")
    os.chown(pci / "dev/vfio/vfio", UID1, 0)  # the container node is no group
    message = (
        f"ch.launch: uid {UID1} holds /dev/vfio/11, the group of no GPU of vm.json "
        "(ch.stop or ch.unvfio of the instance it was given to gives it back)"
    )
    assert launch_refused(ctx) == ("uid-in-use", message)
    assert acl(pci / INST.lstrip("/")) == ({}, {}) and "systemd-run" not in [r[0] for r in runs(ctx)]
    rewrite(pci, record())  # no GPU at all: group 10 is no longer its either
    os.chown(other, UID2, UID2)
    assert launch_refused(ctx) == ("uid-in-use", message.replace("/11", "/10"))
    rewrite(pci, record(gpus=(GPU,)))
    link = pci / f"sys/bus/pci/devices/{GPU}/iommu_group"
    target = os.readlink(link)
    os.unlink(link)  # the record's GPU's group cannot be read: nothing to compare the held one with
    assert failed(ch.ch_launch, call(ctx), ch.ChLaunch("vm1")) == (
        "no-iommu",
        f"ch.launch: {GPU} has no IOMMU group (is the IOMMU on?)",
    )
    os.symlink(target, link)
    assert ch.ch_launch(call(ctx), ch.ChLaunch("vm1"))["uid"] == UID1


def test_a_signed_vfio_hands_over_only_the_specs_gpus(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """With roots, ch.vfio takes the signed spec: the record's GPUs must be exactly its instance's by
    UUID (root's nvidia-smi) before any driver or group is touched; a refusal writes no state."""
    lay_out_pci(root, PCI)
    rewrite(root, record(gpus=(GPU,)))
    c = signed_ctx(root, host, cp)
    try:
        vfio = lambda i: ch.ch_vfio(call(c), ch.ChLaunch("vm1", i))  # noqa: E731
        assert refused(vfio, None) == (
            "intent-required",
            "ch.vfio: a signed spec is required (command-signing roots from join record)",
        )
        mismatch = (
            "spec-mismatch",
            "ch.vfio: vm1: vm.json's GPUs differ from the signed spec's: only the GPUs the spec's instance "
            "holds go to its VMM",
        )
        for gpus in ((GPU1_UUID,), (), (GPU0_UUID, GPU1_UUID), (GPU0_UUID, GPU0_UUID)):
            assert refused(vfio, signed(signer, 5, wire_vm(gpus=gpus))) == mismatch, gpus
        assert refused(vfio, signed(signer, 5, wire_vm(gpus=(GPU0_UUID,), state=4)))[0] == "not-in-spec"
        # round 6b: a VMM's GPUs only for an instance the spec wants running (RUNNING or PAUSED)
        assert refused(vfio, signed(signer, 5, wire_vm(gpus=(GPU0_UUID,), state=3)))[0] == "instance-stopped"
        assert host.writes == [] and state_generation(root) is None and not (root / "dev/vfio/10").exists()
        assert ("nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader") in runs(c)
        assert vfio(signed(signer, 5, wire_vm(gpus=(GPU0_UUID,)))) == {"name": "vm1", "groups": ["10"]}
        assert state_generation(root) == 5 and driver(root, GPU) == "vfio-pci"
        assert os.stat(root / "dev/vfio/10").st_uid == UID1
        # a record without GPUs: the spec's instance must hold none either, and nothing is bound
        rewrite(root, record())
        assert refused(vfio, signed(signer, 6, wire_vm(gpus=(GPU0_UUID,)))) == mismatch
        assert vfio(signed(signer, 6, wire_vm())) == {"name": "vm1", "groups": []}
        assert state_generation(root) == 6
    finally:
        c.audit.close()


def test_vfio_refuses_a_group_holding_a_gpu_the_record_does_not_name(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """The whole IOMMU group goes to the VMM: another GPU of this host in it (GPUs sharing a group behind
    a switch without ACS) must be one the record names, or a GPU the record (with roots: the signed
    spec) never gave the instance, and whose work root never checked, would be taken from its driver."""
    lay_out_pci(root, [(GPU, "0x030200", 12, "nvidia"), (GPU1, "0x030200", 12, "nvidia"),
                       (BRIDGE, "0x060400", 12, "pcieport")])  # fmt: skip
    rewrite(root, record(gpus=(GPU,)))
    host.apps = f"{GPU1_UUID}, 31\n".encode()  # GPU 1 runs work
    assert launch_refused(ctx, "ch.vfio") == (
        "gpu-not-in-record",
        f"ch.vfio: IOMMU group 12 of {GPU} holds the GPU {GPU1}, which vm.json does not name: the whole "
        "group goes to the VMM",
    )
    assert host.writes == [] and (driver(root, GPU), driver(root, GPU1)) == ("nvidia", "nvidia")
    rewrite(root, record(gpus=(GPU, GPU1)))  # both named: GPU 1's work is seen
    assert launch_refused(ctx, "ch.vfio")[0] == "gpu-busy"
    host.apps = b""
    assert ch.ch_vfio(call(ctx), ch.ChLaunch("vm1"))["groups"] == ["12"]
    assert (driver(root, GPU), driver(root, GPU1), driver(root, BRIDGE)) == (
        "vfio-pci",
        "vfio-pci",
        "pcieport",
    )
    # given back, the group's GPUs need not all be named
    rewrite(root, record(gpus=(GPU,)))
    assert ch.ch_unvfio(call(ctx), ch.ChName("vm1"))["groups"] == ["12"]
    assert (driver(root, GPU), driver(root, GPU1)) == ("nvidia", "nvidia")


def test_a_guarded_guest_launches_only_with_its_signed_rules_loaded(
    root: Path, host: Host, cp: ControlPlane, signer: Signer
) -> None:
    """With roots, ch.launch of an instance the signed spec guards (PRIVATE here) is refused
    `network-policy`, naming ch.launch, until root's last nft.apply holds its NIC's policy; nothing is
    granted or started and no state written before. ch.vfio runs no guest: it asks for no rules."""
    from bcd_shared.netpolicy import NicPolicy

    c = signed_ctx(root, host, cp)
    try:
        private = wire_vm(policy=2, addresses=("10.0.0.5/24",))
        launch = lambda g: ch.ch_launch(call(c), ch.ChLaunch("vm1", signed(signer, g, private)))  # noqa: E731
        assert refused(launch, 2) == (
            "network-policy",
            "ch.launch: vm1: the signed spec's network rules for it are not loaded: nft.apply first",
        )
        assert runs(c) == [] and state_generation(root) is None and acl(root / INST.lstrip("/")) == ({}, {})
        assert ch.ch_vfio(call(c), ch.ChLaunch("vm1", signed(signer, 2, private)))["groups"] == []
        c.nft_loaded = frozenset([NicPolicy("vm1", 0, "br0", MAC, ("10.0.0.5/24",), "PRIVATE")])
        assert launch(3)["unit"] == UNIT and state_generation(root) == 3
    finally:
        c.audit.close()


def test_a_group_node_root_cannot_open_or_change_fails_naming_it(
    ctx: HelperContext, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/dev/vfio/<group> that root cannot open (here /dev/vfio is no directory) or whose owner it cannot
    change fails `vfio` with the system's reason, for ch.vfio and ch.unvfio alike."""
    lay_out_pci(root, [(GPU, "0x030200", 10, "vfio-pci")])  # already bound: no node made
    rewrite(root, record(gpus=(GPU,)))
    (root / "dev").mkdir(exist_ok=True)
    (root / "dev/vfio").write_bytes(b"")
    assert failed(ch.ch_vfio, call(ctx), ch.ChLaunch("vm1")) == (
        "vfio",
        "ch.vfio: /dev/vfio/10: Not a directory",
    )
    assert failed(ch.ch_unvfio, call(ctx), ch.ChName("vm1")) == (
        "vfio",
        "ch.unvfio: /dev/vfio/10: Not a directory",
    )
    (root / "dev/vfio").unlink()
    node = vfio_node(root, "10", 0)

    def chown(*a: Any, **kw: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(ch.os, "chown", chown)
    assert failed(ch.ch_vfio, call(ctx), ch.ChLaunch("vm1")) == (
        "vfio",
        "ch.vfio: /dev/vfio/10: Operation not permitted",
    )
    assert (os.stat(node).st_uid, stat.S_IMODE(os.stat(node).st_mode)) == (0, 0o660)


def test_stop_names_itself_when_a_group_node_cannot_be_given_back(
    ctx: HelperContext, root: Path, host: Host
) -> None:
    """A symlink at /dev/vfio/<group> whose target the stopped user owns fails ch.stop `vfio`, naming
    ch.stop and the node; the target is never changed."""
    target = root / "etc/not-a-group"
    target.write_text("x")
    os.chown(target, UID1, UID1)
    node = root / "dev/vfio/10"
    node.parent.mkdir(parents=True, exist_ok=True)
    node.symlink_to(target)
    assert failed(ch.ch_stop, call(ctx), ch.ChName("vm1")) == (
        "vfio",
        "ch.stop: /dev/vfio/10 is a symlink, not the group's device node",
    )
    assert os.stat(target).st_uid == UID1
