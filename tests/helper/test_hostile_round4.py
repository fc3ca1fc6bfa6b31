"""The gaps round 3 left open (docs/helper.md, "Threat model, round 3", "Found and not closed"), closed and
tried as the hostile node: a real unprivileged account (SO_PEERCRED sees the node's uid) against a real
`bcd helper serve` over a simulated host. Each test failed on the code before its fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from bcd_agent.helperclient import HelperClient
from bcd_agent.sections.instances.model import InstanceSpec
from bcd_agent.sections.instances.runtimes.base import Prepared
from bcd_agent.sections.instances.runtimes.libvirt import SYSTEM_URI, HelperVirsh, LibvirtRuntime
from bcd_shared import wire
from bcd_shared.chunit import VMM_UID_BASE as VMM_UID
from bcd_shared.system import LocalSystem
from helperproc import require_netns
from hostilekit import NODE_UID, SignedHost, as_node, ch_instance, gpus_by_bus, refused_as_node


@pytest.fixture
def netns() -> None:
    """Before `signed_host`: skip (or fail under CI) without root, nft and nsenter."""
    require_netns("nft")


def test_round4_ch_vfio_hands_over_only_the_signed_specs_gpus(signed_host: SignedHost) -> None:
    """With command-signing roots, `ch.vfio` took only the instance's name: root bound whatever GPUs the
    node's vm.json named to vfio-pci and handed their /dev/vfio groups to its VMM uid, whatever the
    signed spec said. It now takes the signed spec as ch.launch does: without one `intent-required`; a
    spec that gives the instance another GPU `spec-mismatch`, one that does not name it `not-in-spec`,
    an older generation `stale-generation`; each before any driver or group is touched. The spec's own
    GPU is bound and handed over."""
    from bcd_simhost.chapi import lay_out_instance
    from bcd_simhost.pcisim import lay_out_pci

    gpu0, gpu1 = "0000:18:00.0", "0000:2a:00.0"
    root = signed_host.root
    lay_out_pci(root, [(gpu0, "0x030200", 10, "nvidia"), (gpu1, "0x030200", 11, "nvidia")])
    uid = VMM_UID + 5
    lay_out_instance(root, "vm5", NODE_UID, uid, gpus=(gpu1,))
    h = signed_host.start()
    by_bus = gpus_by_bus(root)

    def vfio(generation: int, gpu: str, name: str = "vm5") -> dict[str, Any]:
        signed = signed_host.signed(generation, ch_instance(name, gpu_uuids=[gpu]))
        return {"op": "ch.vfio", "args": {"name": "vm5", "intent": signed}}

    def untouched() -> None:
        drivers = [
            os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{g}/driver")) for g in (gpu0, gpu1)
        ]
        assert drivers == ["nvidia", "nvidia"]
        for g in ("10", "11"):  # the simulated kernel makes the node at the bind; root's until handed over
            assert not (root / f"dev/vfio/{g}").exists() or os.stat(root / f"dev/vfio/{g}").st_uid == 0

    refused_as_node(h, {"op": "ch.vfio", "args": {"name": "vm5"}}, "intent-required")
    untouched()
    refused_as_node(h, vfio(2, by_bus[gpu0]), "spec-mismatch", "GPUs")
    untouched()
    refused_as_node(h, vfio(2, by_bus[gpu1], name="vm6"), "not-in-spec")
    answer = as_node(h, vfio(2, by_bus[gpu1]))
    assert answer["ok"] is True and answer["result"]["groups"] == ["11"], answer
    assert os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{gpu1}/driver")) == "vfio-pci"
    assert os.stat(root / "dev/vfio/11").st_uid == uid
    assert os.path.basename(os.readlink(root / f"sys/bus/pci/devices/{gpu0}/driver")) == "nvidia"
    assert as_node(h, {"op": "ch.unvfio", "args": {"name": "vm5"}})["ok"] is True
    untouched()
    refused_as_node(h, vfio(1, by_bus[gpu1]), "stale-generation")  # generation 2 was accepted
    untouched()


def test_round4_nft_apply_grants_no_guest_more_than_the_signed_spec(
    netns: None, signed_host: SignedHost
) -> None:
    """With command-signing roots, `nft.apply` took the node's NIC policies as they came: a spec that makes
    vm1 PRIVATE with SSH from the host only could be loaded as EGRESS, without vm1 at all, or with a
    wider subnet, so the guest reached what the signed spec denies. Root now derives each kept
    instance's policies from the signed spec itself: without the spec `intent-required`; a weaker
    policy, a missing instance, an extra address, a NIC more or less `spec-mismatch`; an older
    generation `stale-generation`. The spec's own policies load (with a deleted instance's guard kept as
    the node sends it), real nft in the helper's own network namespace."""
    import json

    from bcd_shared.netpolicy import NicPolicy

    h = signed_host.start(netns=True)
    h.in_netns("ip", "link", "add", "br0", "type", "bridge")
    h.in_netns("ip", "addr", "add", "10.0.0.1/24", "dev", "br0")
    mac, addr = "52:54:00:00:00:01", "10.0.0.5/24"

    def signed(generation: int) -> dict[str, Any]:
        vm1 = wire.InstanceSpec(
            id="vm1", allocation_id="a1", runtime="libvirt-kvm", desired_state=wire.InstanceDesiredState(1),
            nics=[wire.Nic(bridge="br0", mac=mac, addresses=[addr])],
            network_policy=wire.NetworkPolicy(2), ssh_from_host_only=True,
        )  # fmt: skip
        gone = wire.InstanceSpec(id="old", desired_state=wire.InstanceDesiredState(4))
        return signed_host.signed(generation, vm1, gone)

    nic = {
        "instance": "vm1", "index": 0, "bridge": "br0", "mac": mac, "addresses": [addr],
        "policy": "PRIVATE", "ssh_from_host_only": True,
    }  # fmt: skip
    egress = {**nic, "policy": "EGRESS", "ssh_from_host_only": False}
    leftover = {"instance": "old", "index": 0, "bridge": "br0", "policy": "EGRESS"}  # a deleted one's

    def apply(nics: list[dict[str, Any]], generation: int | None = 2) -> dict[str, Any]:
        args: dict[str, Any] = {"nics": nics}
        if generation is not None:
            args["intent"] = signed(generation)
        return {"op": "nft.apply", "args": args}

    refused_as_node(h, apply([egress], None), "intent-required")
    for nics in (
        [egress],  # PRIVATE and SSH from the host only, loaded as EGRESS
        [{**nic, "ssh_from_host_only": False}],
        [],  # vm1's guard left out
        [leftover],
        [{**nic, "addresses": [addr, "192.168.0.5/16"]}],  # a wider subnet for the PRIVATE guest
        [nic, {**nic, "index": 1, "mac": "52:54:00:00:00:02", "addresses": ["10.0.0.6/24"]}],
    ):
        refused_as_node(h, apply(nics), "spec-mismatch", "vm1")
    answer = as_node(h, apply([nic, leftover]))
    assert answer["ok"] is True and answer["result"]["nics"] == 2, answer
    tap = NicPolicy("vm1", 0, "br0").tap
    listed = json.loads(h.in_netns("nft", "-j", "list", "set", "bridge", "bcd_instances", "bind4"))
    assert listed["nftables"][1]["set"]["elem"] == [{"concat": [tap, "10.0.0.5"]}]
    refused_as_node(h, apply([nic, leftover], 1), "stale-generation")


def test_round4_roots_derivation_of_the_nic_policies_is_the_nodes() -> None:
    """nft.apply with roots loads only what root derives from the signed spec (`spec_policies`), and the
    node sends what its `nic_policies` derives: the two must agree, or a signed node could load no rules.
    Cases: each policy, SSH from the host only, an unset policy, a PRIVATE NIC without addresses, an
    address an earlier instance claims, a DELETED instance, a `bc*` bridge, two NICs."""
    from bcd_agent.sections.instances.model import spec_from_wire
    from bcd_agent.sections.instances.network import nic_policies
    from bcd_helper.ops.nft import spec_policies
    from bcd_shared import wire

    def inst(id_: str, policy: int, nics: list[tuple[str, str, list[str]]], **kw: Any) -> Any:
        return wire.InstanceSpec(
            id=id_, desired_state=wire.InstanceDesiredState(kw.pop("state", 1)),
            nics=[wire.Nic(bridge=b, mac=m, addresses=a) for b, m, a in nics],
            network_policy=wire.NetworkPolicy(policy), **kw,
        )  # fmt: skip

    m = "52:54:00:00:00:0{}".format
    instances = [
        inst("a", 2, [("br0", m(1), ["10.0.0.5/24"])], ssh_from_host_only=True),
        inst("b", 1, [("br0", "", [])]),
        inst("c", 3, [("br0", m(3), ["10.0.0.7/24"]), ("br1", m(4), ["fd00::7/64"])]),
        inst("d", 0, [("br0", m(5), ["10.0.0.8/24"])]),  # unset policy
        inst("e", 2, [("br0", m(6), [])]),  # PRIVATE without addresses
        inst("f", 3, [("br0", m(7), ["10.0.0.5/24"])]),  # a's address
        inst("g", 2, [("br0", m(8), ["10.0.0.9/24"])], state=4),  # DELETED
        inst("h", 1, [("bcx", "", [])]),  # a bc* bridge
    ]
    section = wire.InstancesSection(instances=instances)
    mine, errors = nic_policies(spec_from_wire(1, section), (), {})
    roots = spec_policies(instances)
    assert {k: v for k, v in roots.items() if v is not None} == mine
    assert {k for k, v in roots.items() if v is None} == set(errors) == {"d", "e", "f", "h"}
    assert "g" not in roots


def test_round4_a_guarded_guest_never_starts_without_its_signed_rules(
    netns: None, signed_host: SignedHost
) -> None:
    """With command-signing roots `nft.apply` loads only the signed policies (row 19), but nothing made the
    node load them: it could launch a PRIVATE guest and never call nft.apply (or load nothing after a
    reboot), and the guest ran with no rules at all. `ch.launch` (as `libvirt.start` and
    `libvirt.restore`) now starts a guest the signed spec guards only when root's last successful load
    holds every NIC policy root derives for it: refused `network-policy` before, launched after the
    signed load. Real nft in the helper's own network namespace, the simulated VMM."""
    from bcd_simhost.chapi import lay_out_instance

    lay_out_instance(signed_host.root, "vm5", NODE_UID, VMM_UID + 5)
    h = signed_host.start(netns=True)
    h.in_netns("ip", "link", "add", "br0", "type", "bridge")
    mac, addr = "52:54:00:00:00:01", "10.0.0.5/24"
    vm5 = ch_instance(
        "vm5", nics=[wire.Nic(bridge="br0", mac=mac, addresses=[addr])], network_policy=wire.NetworkPolicy(2)
    )
    signed = signed_host.signed(1, vm5)
    launch = {"op": "ch.launch", "args": {"name": "vm5", "intent": signed}}
    nic = {
        "instance": "vm5",
        "index": 0,
        "bridge": "br0",
        "mac": mac,
        "addresses": [addr],
        "policy": "PRIVATE",
    }
    refused_as_node(h, launch, "network-policy", "nft.apply")
    egress = {**nic, "policy": "EGRESS", "addresses": [], "mac": ""}
    refused_as_node(h, {"op": "nft.apply", "args": {"nics": [egress], "intent": signed}}, "spec-mismatch")
    refused_as_node(h, launch, "network-policy")
    answer = as_node(h, {"op": "nft.apply", "args": {"nics": [nic], "intent": signed}})
    assert answer["ok"] is True, answer
    answer = as_node(h, launch)
    assert answer["ok"] is True, answer
    assert as_node(h, {"op": "ch.stop", "args": {"name": "vm5"}})["ok"] is True


# The real helper on the real libvirt (qemu:///system, TCG), as tests/instances/test_guest_boot_real.py
# drives it: its fixtures are used here (a bridge, a work directory QEMU can reach, the helper's socket).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "instances"))
from test_guest_boot_real import bridge, helper_socket, workdir  # noqa: E402, F401  (fixtures)


@pytest.fixture
def real_libvirt() -> None:
    """Before the real-host fixtures: skip (or fail under CI) without libvirtd and root."""
    from test_guest_boot_real import _require_libvirtd

    _require_libvirtd()


@pytest.fixture
def node_wins_the_race(real_libvirt: None, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:  # noqa: F811
    """A `virsh` first on the PATH the helper inherits: when the test has written `<trigger>` ("VERB PATH
    TARGET"; VERB a shell pattern), its next VERB first renames PATH away and puts a symlink to
    TARGET in its place, then runs the real virsh: the node winning the window between root's checks
    and libvirt's open, made deterministic."""
    real = shutil.which("virsh")
    assert real is not None
    bindir = workdir / "bin"
    bindir.mkdir()
    trigger = workdir / "swap-trigger"
    wrapper = bindir / "virsh"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ -f {trigger} ] && case "$3" in $(cut -d" " -f1 {trigger})) true;; *) false;; esac; then\n'
        f"  read verb src dst < {trigger}; rm -f {trigger}\n"
        '  mv "$src" "$src.moved" && ln -s "$dst" "$src"\n'
        "fi\n"
        f'exec {real} "$@"\n'
    )
    os.chmod(wrapper, 0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return trigger


@attrs.frozen
class Guest:
    """An instance of the node's LibvirtRuntime under the real helper (not created yet): `data` its data
    directory, `dir` its domain's; destroyed and undefined at the test's end."""

    inst: InstanceSpec
    data: str
    client: HelperClient
    rt: LibvirtRuntime

    @property
    def name(self) -> str:
        return self.inst.id

    @property
    def dir(self) -> Path:
        return Path(self.data) / "libvirt/instances" / self.name


@pytest.fixture
def guest(
    node_wins_the_race: Path,  # first: the helper below inherits its PATH
    workdir: Path,  # noqa: F811
    bridge: str,  # noqa: F811
    helper_socket: tuple[str, Path],  # noqa: F811
) -> Iterator[Guest]:
    from test_guest_boot_real import _instance

    sock, _home = helper_socket
    inst, data, _marker = _instance(workdir, bridge)
    system = LocalSystem(Path("/"))
    client = HelperClient(sock)
    rt = LibvirtRuntime(
        system, HelperVirsh(system, client, SYSTEM_URI), data, under_helper=True,
        domain_type="qemu", cpu_mode="maximum", stop_timeout_s=0.0,
    )  # fmt: skip
    try:
        yield Guest(inst, data, client, rt)
    finally:
        subprocess.run(["virsh", "-c", SYSTEM_URI, "destroy", inst.id], capture_output=True, check=False)
        subprocess.run(["virsh", "-c", SYSTEM_URI, "undefine", inst.id], capture_output=True, check=False)
        client.close()


def test_round4_a_saved_state_swapped_after_roots_check_is_never_read(
    guest: Guest,
    node_wins_the_race: Path,
    workdir: Path,  # noqa: F811
) -> None:
    """`libvirt.restore` checked the node's `save.state` (no symlink, one link, the header), then gave
    libvirtd its path: libvirtd, as root, opened whatever the path named by then, so a node that swapped
    in a symlink inside the window had root read a root-only file (another domain's saved memory) into
    its guest. Root now opens the state itself (the directory without following a link, the file
    O_NOFOLLOW, checked on the descriptor) and libvirtd reads `/proc/<helper>/fd/<n>`: the swap made
    right before libvirtd's open changes nothing, the checked state is restored. Real libvirt 9.0 (TCG)."""
    from test_guest_boot_real import _virsh

    client, name, d = guest.client, guest.name, guest.dir
    _node_owns(guest.data)
    host_file = workdir / "host-secret"
    host_file.write_text("root's, not a save image\n")
    os.chmod(host_file, 0o600)
    guest.rt.create(guest.inst, Prepared())
    _node_owns(guest.data)
    assert client.call("libvirt.start", {"name": name, "paused": True})["name"] == name
    client.call("libvirt.save", {"name": name})
    xml = (d / "domain.xml").read_text()
    node_wins_the_race.write_text(f"*restore* {d / 'save.state'} {host_file}\n")
    answer = client.call("libvirt.restore", {"name": name, "xml": xml, "paused": True})
    assert answer == {"name": name, "paused": True}, answer
    assert not node_wins_the_race.exists() and (d / "save.state").is_symlink()  # the swap was made
    assert _virsh("domstate", name).strip() == "paused"


def _node_owns(data: str) -> None:
    """What the node (uid 4242, group kvm here: QEMU's user is in it) would own had it made the files."""
    import grp

    kvm = grp.getgrnam("kvm").gr_gid
    for dirpath, _dirs, files in os.walk(data):
        os.chown(dirpath, 4242, kvm)
        for f in files:
            os.chown(os.path.join(dirpath, f), 4242, kvm, follow_symlinks=False)


def test_round4_a_disk_swapped_after_roots_check_is_never_opened(
    guest: Guest,
    node_wins_the_race: Path,
    workdir: Path,  # noqa: F811
) -> None:
    """Root checked a domain's files at `libvirt.start`, then libvirt opened them by path: a node that
    swapped `disk.qcow2` for a symlink to a host file inside that window (milliseconds, the virsh process
    start) got libvirt, with `dynamic_ownership` (Debian's default), to chown the host file to QEMU's
    user (`libvirt-qemu`) and the guest to run on it (a root-only qcow2 here: another guest's disk).
    Root's definition now carries `fdgroup`s and `relabel='no'` on every disk source, and the start
    associates each group with a descriptor root opened and checked (`virsh dom-fd-associate`, then
    `start`, in one virsh process): the swap, made right before the real virsh runs, changes nothing
    QEMU opens; the host file is neither opened nor chowned. Real libvirt 9.0 and QEMU (TCG)."""
    from test_guest_boot_real import _virsh

    client, name = guest.client, guest.name
    host_file = workdir / "host-secret.qcow2"  # root's own image (another guest's disk, say), 0600
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(host_file), "16M"], check=True)
    os.chmod(host_file, 0o600)
    disk = guest.dir / "disk.qcow2"
    guest.rt.create(guest.inst, Prepared())
    _node_owns(guest.data)
    xml = _virsh("dumpxml", "--inactive", name)
    sources = xml.count("<source file=")
    assert sources >= 2 and xml.count("fdgroup='bcd") == sources, xml
    assert xml.count("<seclabel model='dac' relabel='no'/>") == sources, xml
    real = os.stat(disk)
    node_wins_the_race.write_text(f"*start* {disk} {host_file}\n")
    assert client.call("libvirt.start", {"name": name, "paused": True})["name"] == name
    assert not node_wins_the_race.exists() and disk.is_symlink()  # the swap was made
    st = os.stat(host_file)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)
    pid = Path(f"/run/libvirt/qemu/{name}.pid").read_text().strip()
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fst = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        held.add((fst.st_dev, fst.st_ino))
    assert (real.st_dev, real.st_ino) in held  # QEMU runs on the disk root checked
    assert (st.st_dev, st.st_ino) not in held  # and never opened the host file


def test_round4_a_rebind_disk_swapped_after_roots_check_is_never_chowned_by_libvirt(
    guest: Guest,
    node_wins_the_race: Path,
    workdir: Path,  # noqa: F811
) -> None:
    """`libvirt.rebind` checked `rebind.img` (no symlink, one link, 1 MiB), then `virsh attach-disk` gave
    libvirt its path: a node that swapped in a symlink inside the window had libvirt (dynamic_ownership)
    chown a root-only file to QEMU's user and hot-add it to the guest. Root now hot-adds the disk with
    `attach-device` and `<seclabel model='dac' relabel='no'/>` on its source: nothing is chowned, QEMU
    opens the path with its own user's rights (Permission denied), the file stays root's 0600. The
    window itself stays (libvirt 9.0 cannot hot-add from a descriptor). Real libvirt 9.0 (TCG)."""
    from bcd_shared.errors import HelperRefused
    from bcd_shared.rebinddisk import REBIND_SIZE

    client, name, d = guest.client, guest.name, guest.dir
    host_file = workdir / "host-secret.img"
    host_file.write_bytes(b"root's\n".ljust(REBIND_SIZE, b"\0"))
    os.chmod(host_file, 0o600)
    guest.rt.create(guest.inst, Prepared())
    _node_owns(guest.data)
    assert client.call("libvirt.start", {"name": name, "paused": True})["name"] == name
    rebind = d / "rebind.img"
    rebind.write_bytes(bytes(REBIND_SIZE))
    os.chmod(rebind, 0o660)
    _node_owns(guest.data)
    node_wins_the_race.write_text(f"attach-* {rebind} {host_file}\n")  # attach-disk before the fix
    with pytest.raises(HelperRefused) as refused:
        client.call("libvirt.rebind", {"name": name})
    assert "Permission denied" in str(refused.value), refused.value
    assert not node_wins_the_race.exists() and rebind.is_symlink()  # the swap was made
    st = os.stat(host_file)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)
    rebind.unlink()
    os.rename(d / "rebind.img.moved", rebind)
    assert client.call("libvirt.rebind", {"name": name}) == {"name": name}  # the node's own disk
    assert (
        "vdz"
        in subprocess.run(
            ["virsh", "-c", SYSTEM_URI, "domblklist", name], capture_output=True, text=True, check=True
        ).stdout
    )


def test_round4_roots_rebind_disk_is_attach_disks_with_relabelling_off() -> None:
    """The XML root hot-adds (row 22) is the disk `attach-disk PATH vdz --targetbus virtio --driver qemu
    --subdriver raw --serial bc-rebind` makes, plus `relabel='no'` on its source, the path escaped."""
    import xml.etree.ElementTree as ET

    from bcd_helper.ops.libvirt import rebind_device_xml

    disk = ET.fromstring(rebind_device_xml("/d/a'b&c/rebind.img"))
    assert (disk.tag, disk.get("type"), disk.get("device")) == ("disk", "file", "disk")
    assert [(c.tag, dict(c.attrib), (c.text or "")) for c in disk] == [
        ("driver", {"name": "qemu", "type": "raw"}, ""),
        ("source", {"file": "/d/a'b&c/rebind.img"}, ""),
        ("target", {"dev": "vdz", "bus": "virtio"}, ""),
        ("serial", {}, "bc-rebind"),
    ]
    src = disk.find("source")
    assert src is not None and [dict(c.attrib) for c in src] == [{"model": "dac", "relabel": "no"}]
