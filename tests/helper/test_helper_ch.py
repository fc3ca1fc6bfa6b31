"""The helper's ch.* operations (cloud-hypervisor under the helper) against a real helper process on a
simulated host (fake systemd-run, systemctl, useradd; real files, real POSIX ACLs on ext4, real qcow2
headers), and `ch.taps`/`ch.untaps` with the real `ip` in a private network namespace.

The ACL test runs as the VMM's own uid for real (`setpriv --reuid`): it reads and writes exactly what
`vm.json` names and nothing else. Refusals are properties: any record or layout outside the rules is
refused, audited, and the tree under the simulated root is unchanged (1,000 examples under CI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.config import parse_config
from bcd_helper.ops.base import BoundedSystem, Call, Deadline, HelperContext, Peer
from bcd_helper.ops.ch import ChName, ChTaps, ch_taps, ch_untaps
from bcd_helper.ops.table import LOCK_ORDER
from bcd_shared import posixacl
from bcd_shared.chrecord import CHNic, CHRecord, CHVolume, encode_record
from bcd_shared.chunit import VMM_UID_BASE, VMM_UID_COUNT
from bcd_shared.instancenames import tap_name
from bcd_shared.system import LocalSystem
from bcd_simhost.libvirt import qcow2_bytes
from helperproc import HELPER_SETTINGS, HelperProcess, assert_refused, base_config, make_root
from hypothesis import given
from hypothesis import strategies as st
from testsupport import require_tool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from netns import in_netns

NODE = 4242
DATA = "/var/lib/bcd"
CH = f"{DATA}/cloud-hypervisor"
BASE_BYTES = qcow2_bytes(1 << 30)
SHA = "d" * 64  # the name only: root checks the header, the download checked the digest
BASE = f"{CH}/images/{SHA}.qcow2"
UID1 = VMM_UID_BASE + 1


def record(name: str = "vm1", **kw: Any) -> CHRecord:
    args: dict[str, Any] = {
        "name": name,
        "allocation_id": "alloc-1",
        "uid": UID1,
        "vcpus": 2,
        "memory_bytes": 1 << 30,
        "image_sha256": SHA,
        "image_format": "qcow2",
        "seed": True,
        "nics": (CHNic("52:54:00:00:00:01", "br0"),),
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


def _node_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chown(path, NODE, NODE)
    os.chmod(path, mode)


def _node_dir(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, NODE, NODE)
    os.chmod(path, mode)


def lay_out(root: Path, rec: CHRecord) -> Path:
    """The node's files for `rec` as its runtime leaves them (directories searchable, files 0600)."""
    data = root / DATA.lstrip("/")
    for d in (data, data / "cloud-hypervisor", data / "cloud-hypervisor/instances", data / "volumes"):
        _node_dir(d, 0o711)
    _node_dir(data / "cloud-hypervisor/images", 0o700)
    inst = data / "cloud-hypervisor/instances" / rec.name
    _node_dir(inst, 0o700)
    if not (root / BASE.lstrip("/")).exists():
        _node_file(root / BASE.lstrip("/"), BASE_BYTES, 0o644)
    _node_file(inst / "disk.qcow2", qcow2_bytes(1 << 30, BASE, "qcow2"))
    _node_file(inst / "seed.iso", b"\0" * 2048)
    _node_file(inst / "vm.json", encode_record(rec))
    for vol in ("rw.raw", "ro.raw", "other.raw"):
        if not (data / "volumes" / vol).exists():
            _node_file(data / "volumes" / vol, b"v" * 512)
    binary = root / "usr/bin/cloud-hypervisor"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text("#!/bin/sh\nexit 0\n")
        os.chmod(binary, 0o755)
    return inst


@pytest.fixture(scope="module")
def ch() -> Iterator[HelperProcess]:
    # Under /var/tmp, searchable: the VMM's uid must reach the files as it would through its binds.
    parent = Path(tempfile.mkdtemp(prefix="bcd-ch-", dir="/var/tmp"))
    os.chmod(parent, 0o755)
    root = make_root(parent)
    for d in (root / "var", root / "var/lib"):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o755)
    lay_out(root, record())
    proc = HelperProcess(root, base_config(node_uid=NODE, node_gid=NODE, extra='instance_bridges = "br0"\n'))
    yield proc
    proc.stop()
    shutil.rmtree(parent, ignore_errors=True)


def _units(h: HelperProcess) -> dict[str, Any]:
    path = h.root / "var/lib/bcd-sim/systemd/units.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def _as_uid(uid: int, code: str) -> str:
    """Run `code` as `uid` for real (no groups); its stdout."""
    setpriv = require_tool("setpriv")
    result = subprocess.run(
        [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3", "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _reach(uid: int, paths: dict[str, str]) -> dict[str, str]:
    code = (
        "import json,sys\nout={}\n"
        f"for key, (path, mode) in {json.dumps({k: list(v) for k, v in _modes(paths).items()})}.items():\n"
        "    try:\n        open(path, mode).close(); out[key] = 'ok'\n"
        "    except OSError as e:\n        out[key] = e.__class__.__name__\n"
        "print(json.dumps(out))"
    )
    return dict(json.loads(_as_uid(uid, code)))


def _modes(paths: dict[str, str]) -> dict[str, tuple[str, str]]:
    return {
        k: (p, "r+b" if k.startswith("write") else ("xb" if k.startswith("create") else "rb"))
        for k, p in paths.items()
    }


def test_launch_and_stop_dlv_chh_21_dlv_chh_02_dlv_chh_04(ch: HelperProcess) -> None:
    """DLV-CHH-21, DLV-CHH-02, DLV-CHH-03, DLV-CHH-04, DLV-CHH-14, DLV-CHH-23, DLV-VOL-42: root
    builds the unit from its own reading (its own binary, UMask 0007, the VMM's account created), the
    VMM's uid gets exactly the record's files for the run (checked as that uid for real: the
    read-write volume rw, the read-only one r), and ch.stop takes them back."""
    h = ch
    inst = h.root / CH.lstrip("/") / "instances/vm1"
    vols = h.root / DATA.lstrip("/") / "volumes"
    answer = h.raw({"op": "ch.launch", "args": {"name": "vm1"}})
    assert answer["ok"] is True, answer
    assert answer["result"]["binary"] == "/usr/bin/cloud-hypervisor"
    unit = _units(h)["bcd-ch-vm1.service"]
    assert unit["active"] is True
    props = unit["properties"]
    assert props["User"] == str(UID1) and props["UMask"] == "0007"
    assert props["ExecStart"] == f"/usr/bin/cloud-hypervisor --api-socket path={CH}/instances/vm1/api.sock"
    # the last of base image, ro volume: root's link of the inode it checked, bound where the VMM looks
    assert props["BindReadOnlyPaths"] == f"{DATA}-ch-binds/vm1/vol-ro.raw:{DATA}/volumes/ro.raw"
    assert f"bcd-vmm-1:x:{UID1}:{UID1}:" in (h.root / "etc/passwd").read_text()
    last = h.last_audit()
    assert (last["op"], last["decision"], last["args"]["name"]) == ("ch.launch", "accepted", "vm1")
    reach = {
        "read disk": str(inst / "disk.qcow2"),
        "write disk": str(inst / "disk.qcow2"),
        "write seed": str(inst / "seed.iso"),
        "read record": str(inst / "vm.json"),
        "create in dir": str(inst / "created-by-vmm"),
        "read rw volume": str(vols / "rw.raw"),
        "write rw volume": str(vols / "rw.raw"),
        "read ro volume": str(vols / "ro.raw"),
        "write ro volume": str(vols / "ro.raw"),
        "read other volume": str(vols / "other.raw"),
    }
    got = _reach(UID1, reach)
    assert got == {
        "read disk": "ok",
        "write disk": "ok",
        "write seed": "ok",
        "read record": "PermissionError",  # the record is never the VMM's
        "create in dir": "ok",
        "read rw volume": "ok",
        "write rw volume": "ok",
        "read ro volume": "ok",
        "write ro volume": "PermissionError",
        "read other volume": "PermissionError",
    }
    created = inst / "created-by-vmm"
    assert os.stat(created).st_uid == UID1
    os.unlink(created)
    # a second launch of a running unit is refused
    assert_refused(h, {"op": "ch.launch", "args": {"name": "vm1"}}, "running")
    answer = h.raw({"op": "ch.stop", "args": {"name": "vm1"}})
    assert answer["ok"] is True and answer["result"]["state"] == "inactive", answer
    after = _reach(UID1, {k: v for k, v in reach.items() if not k.startswith("create")})
    assert set(after.values()) == {"PermissionError"}
    for p in (inst, inst / "disk.qcow2", vols / "rw.raw", vols / "ro.raw"):
        fd = os.open(p, os.O_RDONLY)
        try:
            assert posixacl.user_perms(fd, UID1) is None
        finally:
            os.close(fd)


def test_a_uid_another_running_unit_has_is_refused_dlv_chh_19(ch: HelperProcess) -> None:
    """DLV-CHH-19: the VMM user must not be another running unit's."""
    h = ch
    lay_out(h.root, record("vm2"))
    assert h.raw({"op": "ch.launch", "args": {"name": "vm1"}})["ok"] is True
    try:
        assert_refused(h, {"op": "ch.launch", "args": {"name": "vm2"}}, "uid-in-use")
    finally:
        assert h.raw({"op": "ch.stop", "args": {"name": "vm1"}})["ok"] is True
        shutil.rmtree(h.root / CH.lstrip("/") / "instances/vm2")


# Each: (what it does to vm1's files, the reason root refuses with).
def _rewrite(**kw: Any) -> Callable[[Path], None]:
    def apply(inst: Path) -> None:
        _node_file(inst / "vm.json", encode_record(record(**kw)))

    return apply


def _raw_record(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(inst: Path) -> None:
        doc = json.loads(encode_record(record()))
        change(doc)
        _node_file(inst / "vm.json", json.dumps(doc).encode())

    return apply


def _symlink(name: str, target: str) -> Callable[[Path], None]:
    def apply(inst: Path) -> None:
        p = inst / name
        if p.exists() or p.is_symlink():
            p.unlink()
        os.symlink(target, p)

    return apply


def _root_owned(name: str) -> Callable[[Path], None]:
    def apply(inst: Path) -> None:
        os.chown(inst / name, 0, 0)

    return apply


def _overlay(backing: str) -> Callable[[Path], None]:
    def apply(inst: Path) -> None:
        _node_file(inst / "disk.qcow2", qcow2_bytes(1 << 30, backing, "qcow2"))

    return apply


MUTATIONS: list[tuple[str, Callable[[Path], None], str]] = [
    ("vm.json a symlink (DLV-CHH-16)", _symlink("vm.json", "/etc/shadow"), "symlink"),
    ("a symlink beside the files (DLV-CHH-16)", _symlink("evil", "/etc/shadow"), "symlink"),
    ("the disk a symlink (DLV-CHH-16)", _symlink("disk.qcow2", "/etc/shadow"), "symlink"),
    ("the disk root's (DLV-CHH-16)", _root_owned("disk.qcow2"), "bad-layout"),
    ("vm.json root's (DLV-CHH-16)", _root_owned("vm.json"), "bad-layout"),
    ("an unknown field", _raw_record(lambda d: d.update(tap="eth0")), "bad-record"),
    ("a field missing", _raw_record(lambda d: d.pop("uid")), "bad-record"),
    ("another instance's name", _rewrite(name="vm9"), "bad-record"),
    ("an iso image (DLV-CH-08)", _rewrite(image_format="iso"), "bad-record"),
    ("the overlay naming another file (DLV-CHH-17)", _overlay("/etc/shadow"), "image-backing-file"),
    (
        "a volume outside the store (DLV-CHH-18)",
        _raw_record(lambda d: d["volumes"][0].update(name="../x")),
        "bad-record",
    ),
    ("a missing volume (DLV-CHH-18)", _rewrite(volumes=(CHVolume("nope.raw", True, "x"),)), "bad-volume"),
    ("a GPU not of this host (DLV-CHH-18)", _rewrite(gpus=("0000:ff:00.0",)), "not-this-hosts-gpu"),
    ("a restored disk naming a backing file (DLV-CH-07)", _rewrite(restored=True), "image-backing-file"),
]


@HELPER_SETTINGS
@given(which=st.integers(0, len(MUTATIONS) - 1))
def test_records_outside_the_rules_are_refused_and_change_nothing_dlv_chh_16_17_18(
    ch: HelperProcess, which: int
) -> None:
    """DLV-CHH-16, DLV-CHH-17, DLV-CHH-18: root's own reading refuses, audited, tree unchanged."""
    h = ch
    inst = h.root / CH.lstrip("/") / "instances/vm1"
    _what, mutate, reason = MUTATIONS[which]
    mutate(inst)
    try:
        assert_refused(h, {"op": "ch.launch", "args": {"name": "vm1"}}, reason)
    finally:
        for name in ("vm.json", "disk.qcow2", "evil"):
            p = inst / name
            if p.is_symlink():
                p.unlink()
        if (inst / "disk.qcow2").exists():
            os.chown(inst / "disk.qcow2", NODE, NODE)
        lay_out(h.root, record())


@HELPER_SETTINGS
@given(
    uid=st.one_of(st.integers(-(2**31), VMM_UID_BASE - 1), st.integers(VMM_UID_BASE + VMM_UID_COUNT, 2**32)),
    vcpus=st.one_of(st.just(2), st.integers(-5, 0), st.integers(513, 10**6)),
    memory=st.one_of(st.just(1 << 30), st.integers(0, (64 << 20) - 1), st.integers((4 << 40) + 1, 1 << 50)),
    pick=st.integers(0, 2),
)
def test_uid_and_size_bounds_dlv_chh_19_dlv_chh_20(
    ch: HelperProcess, uid: int, vcpus: int, memory: int, pick: int
) -> None:
    """DLV-CHH-19, DLV-CHH-20: a uid outside bcd's range, vCPUs outside 1..512, memory outside
    64 MiB..4 TiB are refused before anything runs."""
    h = ch
    inst = h.root / CH.lstrip("/") / "instances/vm1"
    change = {
        0: {"uid": uid},
        1: {"vcpus": vcpus if vcpus != 2 else 0},
        2: {"memory_bytes": memory if memory != 1 << 30 else 1},
    }[pick]
    _raw_record(lambda d: d.update(change))(inst)
    try:
        assert_refused(h, {"op": "ch.launch", "args": {"name": "vm1"}}, "bad-record")
    finally:
        _node_file(inst / "vm.json", encode_record(record()))


@HELPER_SETTINGS
@given(
    name=st.text(max_size=70),
    bridges=st.lists(st.text(max_size=20), max_size=20),
)
def test_taps_outside_the_rules_are_refused_dlv_chh_05(
    ch: HelperProcess, name: str, bridges: list[str]
) -> None:
    """DLV-CHH-05, DLV-CHH-23: a name that is not an instance id, no or too many NICs, a bridge not in
    [helper] instance_bridges: refused before any interface is touched."""
    from bcd_shared.instancenames import valid_instance_id

    h = ch
    if valid_instance_id(name) and 1 <= len(bridges) <= 16 and all(b == "br0" for b in bridges):
        return
    answer = assert_refused(h, {"op": "ch.taps", "args": {"name": name, "bridges": bridges}})
    if not valid_instance_id(name):
        assert answer["reason"] == "bad-name"
    else:
        assert answer["reason"] in ("bad-arguments", "bridge-not-allowed")


@HELPER_SETTINGS
@given(name=st.text(max_size=70), op=st.sampled_from(["ch.launch", "ch.stop", "ch.untaps"]))
def test_names_that_are_not_instance_ids_are_refused_dlv_chh_23(
    ch: HelperProcess, name: str, op: str
) -> None:
    """DLV-CHH-23: every ch.* call names the instance by the domain-name pattern."""
    from bcd_shared.instancenames import valid_instance_id

    if valid_instance_id(name):
        return
    assert_refused(ch, {"op": op, "args": {"name": name}}, "bad-name")


# -- taps, for real in a private network namespace --------------------------------------------------


def _call(root: Path, extra: str = 'instance_bridges = "br0"\n') -> Call:
    """Root's programs run for real (`ip`, on the calling thread's network namespace); root's files (the
    taps' claims, /var/lib/bcd-hostconfig/taps) go under `root`, never the machine's."""
    cfg = parse_config(base_config(node_uid=NODE, node_gid=NODE, extra=extra).encode())
    system = LocalSystem(root)
    ctx = HelperContext(root=root, config=cfg, system=system, audit=None, lock_names=LOCK_ORDER)  # type: ignore[arg-type]
    deadline = Deadline(60)
    return Call(ctx, Peer(os.getpid(), NODE, NODE), deadline, BoundedSystem(system, deadline))


def _ip(*args: str) -> Any:
    out = subprocess.run(["ip", "-j", "-d", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout) if out.stdout.strip() else None


@pytest.mark.realhost
def test_taps_are_created_on_the_bridge_and_deleted_for_real_dlv_chh_05_06_07(tmp_path: Path) -> None:
    """DLV-CHH-05, DLV-CHH-06, DLV-CHH-07, DLV-CHH-08: real taps owned by the node on the bridge (the
    node's uid opens one with TUNSETIFF); an existing interface that is not a tap is refused and kept;
    ch.untaps deletes only taps of the instance's names."""
    require_tool("ip")
    require_tool("setpriv")
    from bcd_helper.ops.base import Refused

    def body() -> None:
        subprocess.run(["ip", "link", "add", "br0", "type", "bridge"], check=True)
        subprocess.run(["ip", "link", "add", "br1", "type", "bridge"], check=True)
        call = _call(tmp_path)
        out = ch_taps(call, ChTaps("vm1", ("br0", "br0")))
        taps = [tap_name("vm1", 0), tap_name("vm1", 1)]
        assert out["taps"] == taps and out["created"] == taps
        for tap in taps:
            (link,) = _ip("link", "show", "dev", tap)
            assert link["linkinfo"]["info_kind"] == "tun"
            assert link["linkinfo"]["info_data"]["type"] == "tap"
            assert link["linkinfo"]["info_data"]["user"] == NODE
            assert link["master"] == "br0" and "UP" in link["flags"]

        # The node's uid attaches to its tap (what it then hands the VMM by SCM_RIGHTS); another uid
        # cannot. /dev/net/tun is 0666 under udev and root's 0600 here, so root opens the device and
        # the uid under test does the TUNSETIFF, where the kernel checks the tap's owner.
        def attach(uid: int) -> subprocess.CompletedProcess[str]:
            fd = os.open("/dev/net/tun", os.O_RDWR)
            try:
                code = (
                    "import fcntl,struct\n"
                    f"fcntl.ioctl({fd},0x400454CA,struct.pack('16sH',b'{taps[0]}',0x1002))\nprint('attached')"
                )
                argv = [
                    "setpriv",
                    f"--reuid={uid}",
                    f"--regid={uid}",
                    "--clear-groups",
                    "/usr/bin/python3",
                    "-c",
                    code,
                ]
                return subprocess.run(argv, capture_output=True, text=True, pass_fds=(fd,))
            finally:
                os.close(fd)

        assert attach(NODE).stdout.strip() == "attached"
        assert "PermissionError" in attach(NODE + 1).stderr
        # Again: kept, nothing created.
        assert ch_taps(call, ChTaps("vm1", ("br0", "br0")))["created"] == []
        # A bridge not configured is refused.
        with pytest.raises(Refused) as exc:
            ch_taps(call, ChTaps("vm1", ("br1",)))
        assert exc.value.reason == "bridge-not-allowed"
        # An interface of vm2's tap name that is not a tap: refused, and never deleted.
        squatter = tap_name("vm2", 0)
        subprocess.run(["ip", "link", "add", squatter, "type", "bridge"], check=True)
        with pytest.raises(Refused) as exc:
            ch_taps(call, ChTaps("vm2", ("br0",)))
        assert exc.value.reason == "not-a-tap"
        assert ch_untaps(call, ChName("vm2"))["deleted"] == []
        assert _ip("link", "show", "dev", squatter)[0]["linkinfo"]["info_kind"] == "bridge"
        assert ch_untaps(call, ChName("vm1"))["deleted"] == taps
        names = {link["ifname"] for link in _ip("link", "show")}
        assert not names & set(taps) and squatter in names

    in_netns(body)


@pytest.mark.realhost
def test_without_instance_bridges_every_tap_is_refused(tmp_path: Path) -> None:
    from bcd_helper.ops.base import Refused

    with pytest.raises(Refused) as exc:
        ch_taps(_call(tmp_path, extra=""), ChTaps("vm1", ("br0",)))
    assert exc.value.reason == "bridge-not-allowed" and "none configured" in exc.value.message


def test_only_roots_own_binary_is_run_dlv_chh_21(ch: HelperProcess) -> None:
    """DLV-CHH-21: a cloud-hypervisor others can write is never run: the launch fails before anything
    is granted or started."""
    h = ch
    binary = h.root / "usr/bin/cloud-hypervisor"
    inst = h.root / CH.lstrip("/") / "instances/vm1"
    os.chmod(binary, 0o775)
    try:
        answer = h.raw({"op": "ch.launch", "args": {"name": "vm1"}})
        assert answer["ok"] is False and answer["reason"] == "no-vmm", answer
        assert not _units(h).get("bcd-ch-vm1.service", {}).get("active")
        fd = os.open(inst, os.O_RDONLY)
        try:
            assert posixacl.user_perms(fd, UID1) is None
        finally:
            os.close(fd)
    finally:
        os.chmod(binary, 0o755)


def test_a_uid_held_by_another_account_is_refused(ch: HelperProcess) -> None:
    """A VMM never runs as an account that is not bcd's, even in bcd's uid range."""
    h = ch
    inst = h.root / CH.lstrip("/") / "instances/vm1"
    passwd = h.root / "etc/passwd"
    before = passwd.read_text() if passwd.exists() else None
    uid = VMM_UID_BASE + 50
    passwd.write_text((before or "") + f"mallory:x:{uid}:{uid}::/home/m:/bin/sh\n")
    _node_file(inst / "vm.json", encode_record(record(uid=uid)))
    try:
        answer = assert_refused(h, {"op": "ch.launch", "args": {"name": "vm1"}}, "foreign-account")
        assert "mallory" in answer["message"]
    finally:
        if before is None:
            passwd.unlink()
        else:
            passwd.write_text(before)
        _node_file(inst / "vm.json", encode_record(record()))


def test_what_the_node_and_the_vmm_add_during_a_run_reaches_the_other_dlv_chh_22(ch: HelperProcess) -> None:
    """DLV-CHH-22, DLV-REB-08 (under the helper): during a run, a disk the node writes into the
    instance's directory for `vm.add-disk` (the rebind disk, 0660) is readable and writable by the
    VMM's uid through the inherited ACL entry, and what the VMM's uid creates there (its sockets) is
    reachable by the node's; both checked as those uids for real. After ch.stop the VMM's uid
    reaches nothing."""
    h = ch
    inst = h.root / CH.lstrip("/") / "instances/vm1"
    answer = h.raw({"op": "ch.launch", "args": {"name": "vm1"}})
    assert answer["ok"] is True, answer
    rebind, made = inst / "rebind.img", inst / "made-by-vmm"
    try:
        _as_uid(
            NODE,
            f"import os\nfd = os.open({str(rebind)!r}, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)\n"
            "os.write(fd, b'bundle')\nos.close(fd)",
        )
        assert _reach(UID1, {"read rebind": str(rebind), "write rebind": str(rebind)}) == {
            "read rebind": "ok",
            "write rebind": "ok",
        }
        assert _reach(UID1, {"create made": str(made)}) == {"create made": "ok"}
        assert _reach(NODE, {"read made": str(made), "write made": str(made)}) == {
            "read made": "ok",
            "write made": "ok",
        }
    finally:
        answer = h.raw({"op": "ch.stop", "args": {"name": "vm1"}})
        assert answer["ok"] is True, answer
    assert _reach(UID1, {"read rebind": str(rebind), "write rebind": str(rebind)}) == {
        "read rebind": "PermissionError",
        "write rebind": "PermissionError",
    }
    for p in (rebind, made):
        p.unlink()
