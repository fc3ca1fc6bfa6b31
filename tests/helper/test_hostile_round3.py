"""Round 3 of the hostile node (red team, 2026-12-01): the instances' ops as a compromised node would use
them, from a real unprivileged account (tests/helper/realnode.py: `useradd` + `setpriv`, SO_PEERCRED
sees the account) against a real `bcd helper serve` over a simulated host.

The node owns its instance directories (it writes the overlay, the seed and the rebind disk), so what
root checked at `libvirt.define` can be changed before the next op: each op that makes libvirt open the
instance's files must check them again itself. docs/helper.md "Threat model, round 3" has a row for
each test here."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.sections.instances.model import Desired
from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime
from bcd_agent.sections.instances.section import InstancesSection
from bcd_shared.chunit import VMM_UID_BASE as VMM_UID
from bcd_simhost import sim_system
from helperproc import HelperProcess, base_config, make_root, require_netns, tree
from hostilekit import (
    NODE_UID,
    SignedHost,
    as_node,
    ch_instance,
    gpus_by_bus,
    refused_as_node,
)
from realnode import RealNode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from instkit import converge, helper_section, spec, vm

DATA = "/var/lib/bcd"


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[RealNode, InstancesSection]]:
    n = RealNode('[helper]\ninstance_bridges = "br0"\n')
    try:
        sec, _rt = helper_section(sim_system(n.root), n.h.client)
        out = converge(sec, spec(vm("sw", desired=Desired.STOPPED)))
        assert out.state is SectionState.CONVERGED, out.message
        yield n, sec
    finally:
        n.close()


# A libvirt save image header root accepts (magic, version 2, a 4 KiB data area; was-running), then the data.
_SAVE_IMAGE = struct.pack("<16s5I56x", b"LibvirtQemudSave", 2, 4096, 1, 0, 0) + b"\0" * 4096


def _inst(n: RealNode, name: str) -> Path:
    return n.root / DATA.lstrip("/") / "libvirt/instances" / name


def _start(name: str) -> dict[str, Any]:
    return {"op": "libvirt.start", "args": {"name": name}}


def test_round3_a_disk_swapped_after_the_define_is_refused_at_start(
    node: tuple[RealNode, InstancesSection],
) -> None:
    """The node defines a checked domain, then replaces its overlay with a symlink to a host file (or a
    hard link) before `libvirt.start`: libvirt would open (and with dynamic ownership chown) the host
    file. Root re-checks the defined domain's files at every start: refused `domain-disk`, nothing
    started; the untouched domain starts."""
    n, _sec = node
    disk = _inst(n, "sw") / "disk.qcow2"
    real = disk.with_name("real.qcow2")
    os.rename(disk, real)
    try:
        os.symlink("/etc/shadow", disk)
        answer = n.refused(_start("sw"), "domain-disk", "symlink")
        assert "disk.qcow2" in answer["message"]
        disk.unlink()
        os.link(real, disk)  # the overlay with a second name the node keeps
        n.refused(_start("sw"), "domain-disk", "hard links")
    finally:
        if disk.exists() or disk.is_symlink():
            disk.unlink()
        os.rename(real, disk)
    assert n.call(_start("sw"))["ok"] is True
    assert n.call({"op": "libvirt.destroy", "args": {"name": "sw"}})["ok"] is True


def test_round3_a_restore_never_takes_a_gpu_a_hold_has_dlv_dev_21(
    node: tuple[RealNode, InstancesSection],
) -> None:
    """DLV-DEV-21 as root holds for every way a domain gets its GPUs: `libvirt.start` refuses a GPU a
    live hold has, so the node tried `libvirt.restore` of the same checked definition instead (a saved
    state of its own). Refused `gpu-busy` before anything is staged; restored once the hold is gone."""
    from bcd_shared import cdi
    from bcd_simhost.gpus import gpu_uuid

    n, sec = node
    g5 = gpu_uuid(5)
    both = (vm("sw", desired=Desired.STOPPED), vm("gv", gpu_uuids=(g5,), desired=Desired.STOPPED))
    out = converge(sec, spec(*both, generation=2))
    assert out.state is SectionState.CONVERGED, out.message
    xml = (_inst(n, "gv") / "domain.xml").read_text()
    (_inst(n, "gv") / "save.state").write_bytes(_SAVE_IMAGE)
    hold = cdi.build_hold_spec(
        allocation_id="alloc_r3",
        reservation_id="r",
        generation=1,
        kubernetes=False,
        cgroup_parent=None,
        devices=[cdi.HoldDevice(g5)],
        env=["BCD_ALLOCATION_ID=alloc_r3"],
        vendor=None,
    )
    path = n.root / "etc/cdi/bcd-alloc_r3.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cdi.encode_spec(hold))
    restore = {"op": "libvirt.restore", "args": {"name": "gv", "xml": xml}}
    try:
        answer = n.refused(restore, "gpu-busy")
        assert "is held by alloc_r3" in answer["message"]
    finally:
        path.unlink()
    assert n.call(restore)["ok"] is True
    assert n.call({"op": "libvirt.destroy", "args": {"name": "gv"}})["ok"] is True


def test_round3_the_saved_state_is_reached_as_the_disks_are(node: tuple[RealNode, InstancesSection]) -> None:
    """libvirt.restore hands root's libvirtd the instance's `save.state`: it must be reached with no
    symlink from data_dir and have one link, as the disks (a hard link brings a file the node did not
    write; a symlinked instance directory a state file of anywhere). Refused `no-state`."""
    n, _sec = node
    inst = _inst(n, "sw")
    xml = (inst / "domain.xml").read_text()
    state = inst / "save.state"
    state.write_bytes(_SAVE_IMAGE)
    other = n.root / "var/other.state"
    os.link(state, other)
    restore = {"op": "libvirt.restore", "args": {"name": "sw", "xml": xml}}
    try:
        n.refused(restore, "no-state", "one link")
    finally:
        other.unlink()
    assert n.call(restore)["ok"] is True
    assert n.call({"op": "libvirt.destroy", "args": {"name": "sw"}})["ok"] is True


def test_round3_a_console_whose_pty_changed_while_opened_is_never_handed_out(
    node: tuple[RealNode, InstancesSection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """libvirt.console opens the `/dev/pts/N` root's dumpxml named. The node destroys the domain on
    another connection in between, and the kernel gives N to the next login: root would hand that
    terminal to the node. The race is made deterministic here, in process: the domain is destroyed at
    the moment root opens the pty. Root's second look must name the same pty on the same run, else
    `failed` (`no-console`) and the descriptor closed."""
    from bcd_helper.config import load_config
    from bcd_helper.ops import libvirt as ops
    from bcd_helper.ops.base import BoundedSystem, Call, Deadline, Failed, HelperContext, Peer
    from bcd_helper.ops.table import LOCK_ORDER

    n, _sec = node
    assert n.call(_start("sw"))["ok"] is True
    system = sim_system(n.root)
    ctx = HelperContext(
        root=n.root, config=load_config(n.root), system=system, audit=None, lock_names=LOCK_ORDER
    )  # type: ignore[arg-type]
    deadline = Deadline(60)
    call = Call(ctx, Peer(1, n.uid, n.gid), deadline, BoundedSystem(system, deadline))
    first = ops.libvirt_console(call, ops.LibvirtName("sw"))  # no race: the pty, open
    os.close(first["_fd"])
    real_open = os.open
    opened: list[int] = []

    def racing_open(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if "/dev/pts/" in str(path):
            system.run(["virsh", "destroy", "sw"])  # the domain goes; its pty number is free
            fd = real_open(path, flags, *a, **kw)
            opened.append(fd)
            return fd
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(ops.os, "open", racing_open)
    with pytest.raises(Failed) as exc:
        ops.libvirt_console(call, ops.LibvirtName("sw"))
    monkeypatch.undo()
    assert exc.value.reason == "no-console" and "changed" in exc.value.message
    assert len(opened) == 1
    with pytest.raises(OSError):
        os.fstat(opened[0])  # closed, never handed out


def test_round3_roots_staged_definitions_are_bounded(node: tuple[RealNode, InstancesSection]) -> None:
    """Each `libvirt.define` (and restore) of a new name leaves root's staged copy of up to 256 KiB in
    /var/lib/bcd-hostconfig/libvirt/ (and a libvirt definition) until its undefine: without signing
    roots nothing bounds the names, so the node could fill root's file system. Past MAX_STAGED a new
    name is refused `too-many-files` before anything is checked or written; a staged name may be
    defined again."""
    from bcd_helper.ops.libvirt import MAX_STAGED
    from bcd_simhost.gpus import gpu_uuid

    n, sec = node
    # nw's files as the node's runtime lays them out; its definition and staged copy gone again
    three = (
        vm("sw", desired=Desired.STOPPED),
        vm("gv", gpu_uuids=(gpu_uuid(5),), desired=Desired.STOPPED),
        vm("nw", desired=Desired.STOPPED),
    )
    assert converge(sec, spec(*three, generation=5)).state is SectionState.CONVERGED
    assert n.call({"op": "libvirt.undefine", "args": {"name": "nw"}})["ok"] is True
    stage = n.root / "var/lib/bcd-hostconfig/libvirt"
    have = len(os.listdir(stage))
    filler = [stage / f"filler{i}.xml" for i in range(MAX_STAGED - have)]
    for p in filler:
        p.write_bytes(b"")
    try:
        new = {
            "op": "libvirt.define",
            "args": {"name": "nw", "xml": (_inst(n, "nw") / "domain.xml").read_text()},
        }
        n.refused(new, "too-many-files", str(MAX_STAGED))
        xml = (_inst(n, "sw") / "domain.xml").read_text()
        assert n.call({"op": "libvirt.define", "args": {"name": "sw", "xml": xml}})["ok"] is True
    finally:
        for p in filler:
            p.unlink()


# --- cloud-hypervisor: the node's uid (hostilekit.connect_as forks and drops to it) -------------------


@pytest.fixture(scope="module")
def ch() -> Iterator[HelperProcess]:
    from test_helper_ch import NODE, lay_out, record

    parent = Path(tempfile.mkdtemp(prefix="bcd-r3-", dir="/var/tmp"))
    os.chmod(parent, 0o755)
    root = make_root(parent)
    for d in (root / "var", root / "var/lib"):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o755)
    lay_out(root, record("ca"))
    lay_out(root, record("cb"))  # the same VMM uid as ca's: never launched while ca runs
    proc = HelperProcess(root, base_config(node_uid=NODE, node_gid=NODE, extra='instance_bridges = "br0"\n'))
    yield proc
    proc.stop()
    shutil.rmtree(parent, ignore_errors=True)


def test_round3_ch_stop_never_takes_a_running_vmms_vfio_groups(ch: HelperProcess) -> None:
    """ch.stop of an instance whose unit is gone reads the VMM uid from the node's own vm.json. The node
    names there the uid of another instance's running VMM: root must not give that VMM's /dev/vfio
    groups back to root (it would take a live passthrough away on the node's word, DLV-CHH-14)."""
    from test_helper_ch import UID1

    h = ch
    group = h.root / "dev/vfio/77"
    group.parent.mkdir(parents=True, exist_ok=True)
    group.touch()
    assert as_node(h, {"op": "ch.launch", "args": {"name": "ca"}})["ok"] is True
    # the running VMM's group (given after the launch: ch.launch refuses a uid holding a group none of
    # its record's GPUs is in, and ca's record names none)
    os.chown(group, UID1, UID1)
    try:
        answer = as_node(h, {"op": "ch.stop", "args": {"name": "cb"}})
        assert answer["ok"] is True and answer["result"]["groups"] == [], answer
        assert os.stat(group).st_uid == UID1  # still the running VMM's
    finally:
        assert as_node(h, {"op": "ch.stop", "args": {"name": "ca"}})["ok"] is True
    assert os.stat(group).st_uid == 0  # its own unit stopped: given back
    group.unlink()


def test_round3_ch_instance_directory_entries_are_bounded(ch: HelperProcess) -> None:
    """Root scans the node's instance directory (symlinks) and grants an ACL entry per file, under the
    `gpus` and `ch` locks, with no program to bound it by the op's deadline: a directory of thousands of
    files held both locks as long as the node liked. More than MAX_ENTRIES entries is `bad-layout`
    before anything is granted."""
    from bcd_helper.ops.ch import MAX_ENTRIES
    from test_helper_ch import NODE

    h = ch
    inst = h.root / "var/lib/bcd/cloud-hypervisor/instances/ca"
    extra = []
    for i in range(MAX_ENTRIES):
        p = inst / f"junk{i}"
        p.touch()
        os.chown(p, NODE, NODE)
        extra.append(p)
    try:
        refused_as_node(h, {"op": "ch.launch", "args": {"name": "ca"}}, "bad-layout", "entries")
    finally:
        for p in extra:
            p.unlink()
    assert as_node(h, {"op": "ch.launch", "args": {"name": "ca"}})["ok"] is True
    assert as_node(h, {"op": "ch.stop", "args": {"name": "ca"}})["ok"] is True


def test_round3_a_failed_ch_taps_leaves_no_tap(tmp_path: Path) -> None:
    """ch.taps creates a tap and then enslaves it: when a later step fails (here `instance_bridges`
    names br0 but the host has none), the taps this call created are deleted again, so a failure is
    not half-applied. Real `ip` in the helper's own network namespace."""
    from bcd_shared.instancenames import tap_name

    require_netns("ip")
    h = HelperProcess(make_root(tmp_path), base_config(extra='instance_bridges = "br0"\n'), netns=True)
    try:
        answer = as_node(h, {"op": "ch.taps", "args": {"name": "vm1", "bridges": ["br0", "br0"]}})
        assert (answer["ok"], answer["error"], answer["reason"]) == (False, "failed", "ip"), answer
        names = {link["ifname"] for link in json.loads(h.in_netns("ip", "-j", "link", "show"))}
        assert tap_name("vm1", 0) not in names, names
        assert as_node(h, {"op": "ch.untaps", "args": {"name": "vm1"}})["result"]["deleted"] == []
    finally:
        h.stop()


# --- the lazily imported OPS table ------------------------------------------------------------------


def test_round3_op_names_never_reach_an_import_and_a_failed_import_denies(tmp_path: Path) -> None:
    """The table imports an op's module on its first call, by the row's own name. Names that look like
    modules, attributes or rows with a twist are `unknown-op` (nothing imported: the row is looked up in
    a dict); an op whose module fails to import (here made to, in the helper process) is denied: failed
    `internal`, audited, nothing run, and the helper keeps serving every other op."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["bcd_helper.ops.nft"] = None\n')
    h = HelperProcess(
        make_root(tmp_path), base_config(extra='instance_bridges = "br0"\n'), env={"PYTHONPATH": str(site)}
    )
    try:
        for op in (
            "bcd_helper.ops.nft",
            "nft",
            "nft.apply ",
            "NFT.APPLY",
            "nft.apply\u0000",
            "__class__",
            "__init__",
            "ops.table",
            "os.system",
            "OPS",
            "x" * 5000,
        ):
            answer = as_node(h, {"op": op, "args": {}})
            assert answer["reason"] == "unknown-op", (op[:40], answer)
            last = h.last_audit()
            assert (last["decision"], last["reason"]) == ("refused", "unknown-op")
            assert len(last["op"]) <= 100
        before = tree(h.root)
        answer = as_node(h, {"op": "nft.apply", "args": {"nics": []}})
        assert (answer["ok"], answer["error"], answer["reason"]) == (False, "failed", "internal"), answer
        assert "ImportError" in answer["message"] or "ModuleNotFoundError" in answer["message"], answer
        last = h.last_audit()
        assert (last["op"], last["decision"], last["peer_uid"]) == ("nft.apply", "failed", NODE_UID)
        assert tree(h.root) == before
        assert as_node(h, {"op": "nft.check", "args": {}})["reason"] == "internal"
        assert as_node(h, {"op": "helper.ping", "args": {}})["ok"] is True
    finally:
        h.stop()


# --- nft.apply: typed policies only ----------------------------------------------------------------

NIC: dict[str, Any] = {
    "instance": "vm-1",
    "index": 0,
    "bridge": "br0",
    "mac": "52:54:00:00:00:01",
    "addresses": ["10.0.0.5/24"],
    "policy": "PRIVATE",
    "ssh_from_host_only": True,
}
NFT_ATTACKS: list[tuple[str, Any]] = [
    ("addresses", ['10.0.0.5/24"; flush ruleset']),
    ("addresses", ["10.0.0.5/24 } ; flush ruleset ; {"]),
    ("addresses", ["10.0.0.5/\uff12\uff14"]),  # fullwidth digits
    ("addresses", ["10.0.0.5/24\n"]),
    ("addresses", ["fe80::1%br0/64"]),
    ("addresses", ["10.0.0.5/24"] * 65),
    ("instance", 'vm"; flush ruleset;"'),
    ("instance", "vm\u0661"),  # an Arabic-Indic digit
    ("instance", "\uff56\uff4d"),
    ("bridge", 'br0" ; flush'),
    ("bridge", "bc0"),
    ("bridge", "lo"),
    ("index", 16),
    ("index", 2**70),
    ("index", True),
    ("mac", "52:54:00:00:00:01\n"),
    ("policy", "PRIVATE\n"),
    ("ssh_from_host_only", 1),
]


def test_round3_nft_syntax_never_reaches_root_through_a_typed_field(tmp_path: Path) -> None:
    """nft.apply takes typed NIC policies: nft syntax, non-ASCII look-alikes, a `bc*` or foreign bridge,
    an index past the taps, 65 addresses or a wrong JSON type in any field is refused before anything
    runs (bad-policy or bad-arguments), audited with the node's uid, nothing changed."""
    h = HelperProcess(make_root(tmp_path), base_config(extra='instance_bridges = "br0"\n'))
    try:
        for field, value in NFT_ATTACKS:
            doc = {"op": "nft.apply", "args": {"nics": [{**NIC, field: value}]}}
            answer = as_node(h, doc)
            assert answer["ok"] is False, (field, answer)
            assert answer["reason"] in ("bad-policy", "bad-arguments"), (field, answer)
            last = h.last_audit()
            assert (last["op"], last["decision"], last["peer_uid"]) == ("nft.apply", "refused", NODE_UID)
        many = [{**NIC, "instance": f"v{i}", "mac": "", "addresses": []} for i in range(3000)]
        answer = as_node(h, {"op": "nft.apply", "args": {"nics": many}})
        assert (answer["ok"], answer["reason"]) == (False, "protocol"), answer  # values counted, not decoded
    finally:
        h.stop()


def test_round3_a_deeply_nested_vm_json_is_a_bad_record(ch: HelperProcess) -> None:
    """Root parses the node's vm.json (at most 1 MiB): 200,000 `[` made json.loads raise RecursionError,
    answered as an internal failure with the interpreter's message. It is the node's bad record:
    refused `bad-record`, audited, nothing changed. (Since round 6 more than 16,384 values are refused before
    decoding: 10,000 `[` still reach the decoder's recursion limit.)"""
    from test_helper_ch import NODE, lay_out, record

    h = ch
    inst = lay_out(h.root, record("cd", uid=VMM_UID + 4))
    path = inst / "vm.json"
    for brackets, text in ((10_000, "nested"), (200_000, "values")):
        path.write_bytes(b"[" * brackets)
        os.chown(path, NODE, NODE)
        refused_as_node(h, {"op": "ch.launch", "args": {"name": "cd"}}, "bad-record", text)
        refused_as_node(h, {"op": "ch.vfio", "args": {"name": "cd"}}, "bad-record", text)


def test_round3_vmm_accounts_root_creates_are_bounded(ch: HelperProcess) -> None:
    """Root creates the VMM's account (`bcd-vmm-<n>`) for the uid vm.json names and, under the helper,
    never removes it: launching and stopping with a new uid each time, the node could add 65,536
    accounts and groups to the host's /etc/passwd and /etc/group. Past MAX_VMM_ACCOUNTS accounts a new
    one is refused (`too-many-accounts`) before anything is granted; a uid that has its account still
    launches."""
    from bcd_helper.ops.ch import MAX_VMM_ACCOUNTS
    from bcd_shared.chunit import vmm_user_name
    from test_helper_ch import UID1, lay_out, record

    h = ch
    passwd = h.root / "etc/passwd"
    before = passwd.read_bytes() if passwd.exists() else b""
    have = sum(1 for line in before.decode().splitlines() if line.startswith("bcd-vmm-"))
    uids = [VMM_UID + 1000 + i for i in range(MAX_VMM_ACCOUNTS - have)]
    lines = [f"{vmm_user_name(u)}:x:{u}:{u}::/:/usr/sbin/nologin" for u in uids]
    passwd.write_bytes(before + ("\n".join(lines) + "\n").encode())
    try:
        lay_out(h.root, record("ce", uid=VMM_UID + 900))
        answer = refused_as_node(h, {"op": "ch.launch", "args": {"name": "ce"}}, "too-many-accounts")
        assert str(MAX_VMM_ACCOUNTS) in answer["message"]
        if not any(line.startswith(vmm_user_name(UID1) + ":") for line in before.decode().splitlines()):
            with passwd.open("a") as f:  # ca's uid, as its launch left it
                f.write(f"{vmm_user_name(UID1)}:x:{UID1}:{UID1}::/:/usr/sbin/nologin\n")
        lay_out(h.root, record("ce", uid=UID1))  # ca's uid: its account exists (ca is stopped)
        assert as_node(h, {"op": "ch.launch", "args": {"name": "ce"}})["ok"] is True
        assert as_node(h, {"op": "ch.stop", "args": {"name": "ce"}})["ok"] is True
    finally:
        passwd.write_bytes(before)


def test_round3_vfio_never_hands_a_group_to_an_account_not_bcds(tmp_path: Path) -> None:
    """ch.launch refuses a VMM uid that is another account's (`foreign-account`: a VMM never runs as
    someone else), but ch.vfio chowned the GPU's /dev/vfio group to whatever uid of bcd's range vm.json
    named: an account of that range that is not `bcd-vmm-<n>` got the GPU's VFIO group. Refused the
    same way, before any driver is touched."""
    from bcd_simhost.chapi import lay_out_instance
    from bcd_simhost.pcisim import lay_out_pci

    gpu = "0000:2a:00.0"  # the simulated nvidia-smi's GPU 1, alone in IOMMU group 11
    uid = VMM_UID + 7
    root = make_root(tmp_path)
    lay_out_pci(root, [(gpu, "0x030200", 11, "nvidia")])
    lay_out_instance(root, "vm4", NODE_UID, uid, gpus=(gpu,))
    passwd = root / "etc/passwd"
    with passwd.open("a") as f:
        f.write(f"intruder:x:{uid}:{uid}::/home/intruder:/bin/sh\n")
    h = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    try:
        answer = refused_as_node(h, {"op": "ch.vfio", "args": {"name": "vm4"}}, "foreign-account")
        assert "intruder" in answer["message"]
        assert os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{gpu}/driver")) == "nvidia"
    finally:
        h.stop()


def test_round3_the_instances_ops_shown_fields_never_forge_or_bloat_an_audit_line(tmp_path: Path) -> None:
    """Every shown field of the instances' ops (`name`, `target`, `size_bytes`, `kib`, `bridges`,
    `paused`) carrying a forged entry after a newline, or a 4,001-digit integer, as the node: each
    request adds exactly one ASCII line of at most 8 KiB naming the real decision, and the chain
    verifies."""
    from hostilekit import INJECTED, verify_audit

    h = HelperProcess(make_root(tmp_path), base_config(extra='instance_bridges = "br0"\n'))
    big = 10**4000
    forged = "vm1" + INJECTED
    docs: list[dict[str, Any]] = [
        {"op": "libvirt.blockresize", "args": {"name": forged, "target": "vda", "size_bytes": 1}},
        {"op": "libvirt.blockresize", "args": {"name": "vm1", "target": "vda" + INJECTED, "size_bytes": big}},
        {"op": "libvirt.setmem", "args": {"name": forged, "kib": big}},
        {"op": "libvirt.start", "args": {"name": forged, "paused": True}},
        {"op": "libvirt.rebind", "args": {"name": forged}},
        {"op": "libvirt.unrebind", "args": {"name": forged * 50}},
        {"op": "libvirt.restore", "args": {"name": forged, "xml": INJECTED * 1000}},
        {"op": "ch.taps", "args": {"name": forged, "bridges": ["br0" + INJECTED] * 16}},
        {"op": "ch.taps", "args": {"name": "vm1", "bridges": ["br0" + INJECTED * 20] * 16}},
        {"op": "ch.launch", "args": {"name": forged}},
        {"op": "ch.stop", "args": {"name": forged}},
        {"op": "nft.apply", "args": {"nics": [{"instance": forged, "index": big, "bridge": "br0"}]}},
    ]
    log = h.root / "var/log/bcd-helper/audit.log"
    try:
        for doc in docs:
            raw_before = log.read_bytes()
            answer = as_node(h, doc)
            assert answer["ok"] is False, (doc["op"], answer)
            added = log.read_bytes()[len(raw_before) :]
            assert added.count(b"\n") == 1 and added.isascii() and len(added) <= 8192, (doc["op"], len(added))
            entry = json.loads(added)
            assert (entry["op"], entry["decision"], entry["peer_uid"]) == (
                doc["op"],
                answer["error"],
                NODE_UID,
            )
        verify_audit(h)
    finally:
        h.stop()


def test_round3_a_signed_define_passes_through_only_the_spec_gpus(signed_host: SignedHost) -> None:
    """With command-signing roots root compared the definition with the signed spec's instance on the
    GPU *count* only: the spec gives vm1 GPU 3, the node's definition passes through GPU 5 (one GPU,
    as many). Root maps each hostdev's address to its UUID (nvidia-smi, as root) and refuses any GPU
    the spec does not name: `spec-mismatch` (GPUs)."""
    from bcd_agent.sections.instances.model import Image, InstanceSpec, Nic
    from bcd_agent.sections.instances.runtimes.base import Prepared
    from bcd_shared import wire
    from bcd_shared.system import CommandResult
    from bcd_simhost.gpus import gpu_uuid
    from bcd_simhost.libvirt import IMAGE_SHA256

    class Keep:
        xml = b""

        def read(self, *args: str) -> CommandResult:
            return CommandResult(args, 0, b"shut off\n")

        def define(self, name: str, xml: bytes, xml_path: str) -> None:
            Keep.xml = xml

        def act(self, verb: str, name: str, *args: str) -> CommandResult:
            return CommandResult((verb,), 0)

    gib, mac, url = 1 << 30, "52:54:00:00:00:01", "https://images.sim.bcd/debian.qcow2"
    root = signed_host.root
    h = signed_host.start()
    inst = InstanceSpec(
        id="vm1", allocation_id="a1", vcpus=2, memory_bytes=gib, disk_bytes=10 * gib,
        image=Image(url, IMAGE_SHA256, "qcow2"), nics=(Nic("br0", mac),), gpu_uuids=(gpu_uuid(5),),
    )  # fmt: skip
    system = sim_system(root)
    out = system.run(["nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"]).stdout
    bus = {u.strip(): b.strip() for u, b in (line.split(",") for line in out.decode().splitlines())}
    domain, _, rest = bus[gpu_uuid(5)].partition(":")
    address = f"{domain[-4:]}:{rest}".lower()
    LibvirtRuntime(system, Keep(), DATA, under_helper=True).create(inst, Prepared((address,)))
    assert b"<hostdev" in Keep.xml

    def signed(generation: int, gpu: str) -> dict[str, Any]:
        vm1 = wire.InstanceSpec(
            id="vm1", allocation_id="a1", runtime="libvirt-kvm",
            desired_state=wire.InstanceDesiredState(1),
            size=wire.InstanceSize(vcpus=2, memory_bytes=gib, disk_bytes=10 * gib),
            image=wire.ImageRef(url=url, sha256=IMAGE_SHA256, format="qcow2"),
            nics=[wire.Nic(bridge="br0", mac=mac)], gpu_uuids=[gpu],
        )  # fmt: skip
        args = {"name": "vm1", "xml": Keep.xml.decode(), "intent": signed_host.signed(generation, vm1)}
        return {"op": "libvirt.define", "args": args}

    refused_as_node(h, signed(1, gpu_uuid(3)), "spec-mismatch", "GPUs")
    answer = as_node(h, signed(1, gpu_uuid(5)))
    assert answer["ok"] is True, answer


def test_round3_a_signed_launch_passes_through_only_the_spec_gpus(signed_host: SignedHost) -> None:
    """As for libvirt: with roots ch.launch compared vm.json's GPUs with the signed spec's by count. The
    spec gives vm5 GPU 0; vm.json names GPU 1's address. Refused `spec-mismatch` (GPUs); the spec's own
    GPU launches."""
    from bcd_simhost.chapi import lay_out_instance

    lay_out_instance(signed_host.root, "vm5", NODE_UID, VMM_UID + 5, gpus=("0000:2a:00.0",))
    h = signed_host.start()
    by_bus = gpus_by_bus(signed_host.root)

    def launch(generation: int, gpu: str) -> dict[str, Any]:
        signed = signed_host.signed(generation, ch_instance("vm5", gpu_uuids=[gpu]))
        return {"op": "ch.launch", "args": {"name": "vm5", "intent": signed}}

    refused_as_node(h, launch(1, by_bus["0000:18:00.0"]), "spec-mismatch", "GPUs")
    answer = as_node(h, launch(1, by_bus["0000:2a:00.0"]))
    assert answer["ok"] is True, answer
    assert as_node(h, {"op": "ch.stop", "args": {"name": "vm5"}})["ok"] is True
