"""Small pure pieces of the instances section: capabilities, runtimes on PATH, the status report on
the wire, admission's charge of configured memory, tap names."""

from __future__ import annotations

import json
import math

import trio
from bcd_agent.converge.runner import ConvergeRunner
from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import (
    DesiredSpec,
    InstanceReport,
    InstancesReport,
    SectionOutcome,
    SectionState,
)
from bcd_agent.sections.instances.runtimes.libvirt import _parse_domain, parse_list
from bcd_agent.sections.instances.section import capabilities, runtimes_on_path
from bcd_agent.session.status import status_report
from bcd_shared import wire
from bcd_shared.instancenames import tap_name


def test_capabilities_only_what_is_enforced_dlv_cap_03_05() -> None:
    """DLV-CAP-03, DLV-CAP-05: placement is enforced (libvirt-kvm maps it); network policy, SSH from the
    host only and volumes are not built yet, so they are not advertised; none without a runtime."""
    assert capabilities(["libvirt-kvm"]) == ("instance.placement",)
    assert capabilities([]) == ()


def test_virsh_on_path_turns_on_libvirt_kvm_dlv_rt_01_02() -> None:
    """DLV-RT-01, DLV-RT-02: no configuration key; `virsh` on PATH is libvirt-kvm."""
    assert runtimes_on_path(lambda name: "/usr/bin/virsh" if name == "virsh" else None) == ("libvirt-kvm",)
    assert runtimes_on_path(lambda name: None) == ()
    assert runtimes_on_path(lambda name: "/usr/bin/cloud-hypervisor" if name != "virsh" else None) == ()


def test_status_report_carries_instances_dlv_conv_21() -> None:
    """DLV-CONV-21, DLV-INST-15: StatusReport.instances and instances_complete on the wire."""
    from bcd_agent.converge.types import NodeStatus

    rep = InstancesReport(
        (
            InstanceReport("a", "libvirt-kvm", "RUNNING", True, "", "alloc_a", "a"),
            InstanceReport("leak", "libvirt-kvm", "STOPPED", False, "", "", "leak"),
            InstanceReport("b", "libvirt-kvm", "PENDING", True, "ResourcesExhausted: 1 MiB", "alloc_b"),
        ),
        True,
    )
    status = NodeStatus(1, 1, 1, "h", (), (), 1, 0.0, instances=rep)
    msg = status_report(status, 0.0)
    assert msg.instances_complete is True
    got = [(i.instance_id, i.state, i.managed, i.message) for i in msg.instances]
    assert got == [
        ("a", wire.InstanceState.RUNNING, True, ""),
        ("leak", wire.InstanceState.STOPPED, False, ""),
        ("b", wire.InstanceState.PENDING, True, "ResourcesExhausted: 1 MiB"),
    ]
    assert status_report(NodeStatus(1, 1, 1, "h", (), (), 1, 0.0), 0.0).instances_complete is False


class _Raises:
    name = "instances"

    def __init__(self) -> None:
        self.calls = 0

    def is_empty(self, desired: object | None) -> bool:
        return False

    def converge(self, desired: object | None, observation: Observation, ctx: PassContext) -> SectionOutcome:
        self.calls += 1
        if self.calls == 1:
            rep = InstancesReport((InstanceReport("a", "libvirt-kvm", "RUNNING", True),), True)
            return SectionOutcome("instances", SectionState.CONVERGED, instances=rep)
        raise RuntimeError("virsh vanished")


def test_a_section_that_raised_reports_its_last_listing_incomplete() -> None:
    """Q-DLV-INST-02: instances_complete is true only after a pass that listed every runtime."""

    async def main() -> None:
        async def observe() -> Observation:
            return Observation()

        runner = ConvergeRunner(
            [_Raises()], observe, initial_spec=DesiredSpec(1, "h"), sync_sections_in_thread=False
        )
        first = await runner.converge_once()
        assert first.instances is not None and first.instances.complete
        second = await runner.converge_once()
        assert second.instances is not None and not second.instances.complete
        assert [i.instance_id for i in second.instances.instances] == ["a"]
        assert not math.isinf(second.last_pass_monotonic)

    trio.run(main)


def test_admission_charges_configured_memory_not_the_balloon_dlv_adm_03_16() -> None:
    """DLV-ADM-03, DLV-ADM-16: a domain is charged its <memory>, never its ballooned currentMemory."""
    xml = b"""<domain type='kvm'><name>a</name><memory unit='KiB'>4194304</memory>
      <currentMemory unit='KiB'>1048576</currentMemory><vcpu>2</vcpu></domain>"""
    assert _parse_domain(xml).memory_bytes == 4 << 30


def test_virsh_list_table_is_parsed() -> None:
    """`virsh list --all` (virsh 9.0's table), names with states of one or two words."""
    text = (
        " Id   Name        State\n-----------------------------\n"
        " 1    web-1       running\n -    db 2        shut off\n 3    p           paused\n\n"
    )
    assert parse_list(text) == [("web-1", "running"), ("db 2", "shut off"), ("p", "paused")]


def test_tap_names_fit_and_start_with_bc() -> None:
    names = {tap_name(f"inst-{i}", n) for i in range(200) for n in range(16)}
    assert len(names) == 200 * 16
    assert all(len(t) <= 15 and t.startswith("bc") for t in names)


class _Recording:
    """A simulated host that records every program bcd runs (argv), then runs the simulated tool."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.argv: list[tuple[str, ...]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def run(self, argv: object, **kw: object) -> object:
        self.argv.append(tuple(argv))  # type: ignore[arg-type]
        return self.inner.run(argv, **kw)  # type: ignore[attr-defined]


def test_a_disk_grows_with_blockresize_while_running_and_qemu_img_while_stopped_dlv_libvirt_07(
    tmp_path: object,
) -> None:
    """DLV-LIBVIRT-07, both halves: a running domain's disk grows by `virsh blockresize <id> vda
    <bytes>B` and never by qemu-img under QEMU's feet; a stopped one by `qemu-img resize` of the
    overlay as qcow2 (a json: target that opens no backing file) and never by virsh."""
    from pathlib import Path

    from bcd_agent.sections.instances.model import Desired
    from bcd_agent.sections.instances.runtimes.libvirt import DirectVirsh, LibvirtRuntime
    from bcd_agent.sections.instances.section import InstancesSection
    from instkit import GIB, converge, sim_host, spec, vm

    rec = _Recording(sim_host(Path(str(tmp_path))))
    rt = LibvirtRuntime(rec, DirectVirsh(rec), "/var/lib/bcd")  # type: ignore[arg-type]
    sec = InstancesSection(rec, [rt], "/var/lib/bcd")  # type: ignore[arg-type]
    converge(sec, spec(vm("r"), vm("s", desired=Desired.STOPPED)))
    rec.argv.clear()
    grown = spec(
        vm("r", disk_bytes=20 * GIB), vm("s", desired=Desired.STOPPED, disk_bytes=20 * GIB), generation=2
    )
    converge(sec, grown)
    resizes = [a for a in rec.argv if "blockresize" in a or (a[0] == "qemu-img" and "resize" in a)]
    assert [a[3:] for a in resizes if a[0] == "virsh"] == [("blockresize", "r", "vda", f"{20 * GIB}B")]
    imgs = [a for a in resizes if a[0] == "qemu-img"]
    assert len(imgs) == 1 and imgs[0][1] == "resize" and imgs[0][-1] == str(20 * GIB), imgs
    target = json.loads(imgs[0][2].removeprefix("json:"))
    assert target["driver"] == "qcow2" and target["backing"] is None, target
    assert target["file"]["filename"].endswith("/var/lib/bcd/libvirt/instances/s/disk.qcow2"), target


def test_virsh_connections_dlv_libvirt_01_18_dlv_hlp_12(tmp_path: object) -> None:
    """DLV-LIBVIRT-01: as root, `virsh -c qemu:///system` for every call; DLV-LIBVIRT-18: a paused start
    is `start --paused`; DLV-HLP-12: under the helper, the node's own calls are reads over the read-only
    socket (`virsh -r`), and only reads."""
    from pathlib import Path

    from bcd_agent.sections.instances.runtimes.libvirt import DirectVirsh, HelperVirsh, LibvirtRuntime
    from instkit import converge, sim_host, spec, vm

    rec = _Recording(sim_host(Path(str(tmp_path)) / "a"))
    from bcd_agent.sections.instances.section import InstancesSection

    rt = LibvirtRuntime(rec, DirectVirsh(rec), "/var/lib/bcd")  # type: ignore[arg-type]
    from bcd_agent.sections.instances.model import Desired

    converge(
        InstancesSection(rec, [rt], "/var/lib/bcd"),  # type: ignore[arg-type]
        spec(vm("a"), vm("p", desired=Desired.PAUSED)),
    )
    virsh = [a for a in rec.argv if a[0] == "virsh"]
    assert virsh and all(a[1:3] == ("-c", "qemu:///system") for a in virsh)
    assert {a[3] for a in virsh} >= {"list", "define", "start"}
    starts = [a[3:] for a in virsh if a[3] == "start"]
    assert sorted(starts) == [("start", "a"), ("start", "p", "--paused")]

    class Client:
        calls: list[str] = []

        def call(self, op: str, args: dict[str, object]) -> dict[str, object]:
            self.calls.append(op)
            return {}

    rec2 = _Recording(sim_host(Path(str(tmp_path)) / "b"))
    client = Client()
    rt2 = LibvirtRuntime(rec2, HelperVirsh(rec2, client), "/var/lib/bcd", under_helper=True)  # type: ignore[arg-type]
    converge(InstancesSection(rec2, [rt2], "/var/lib/bcd"), spec(vm("a")))  # type: ignore[arg-type]
    virsh = [a for a in rec2.argv if a[0] == "virsh"]
    assert virsh and all(a[1:4] == ("-r", "-c", "qemu:///system") for a in virsh)
    assert {a[4] for a in virsh} <= {"list", "dumpxml", "domstate", "domstats"}
    assert client.calls == ["libvirt.define", "libvirt.start"]
