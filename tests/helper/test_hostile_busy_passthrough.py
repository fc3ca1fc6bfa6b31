"""Round 8 (docs/helper.md, "Threat model, round 8: root's busy check"): root's own busy check for
gpu.reset and the `mig-layout` unit did not see GPUs a VM has through VFIO. The node's account,
compromised, asks root to reset (or repartition) such a GPU: a real unprivileged client (a forked child
dropped to the node's uid, hostilekit.as_node: SO_PEERCRED sees that uid) against a real
`bcd helper serve` over a simulated host whose sysfs (bcd_simhost.pcisim) binds devices as the kernel
does. The simulated nvidia-smi lists a GPU whatever its driver (a real one does not list a GPU on
vfio-pci), so before the fix each of these resets ran. Each test failed on the code before it."""

from __future__ import annotations

import json
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.busy import ALL as ALL_GPUS
from bcd_helper.ops.hostunit import HostUnit, host_unit
from bcd_shared.system import CommandResult
from bcd_simhost import sim_system
from bcd_simhost.gpus import gpu_uuid
from bcd_simhost.pcisim import lay_out_pci
from helperproc import HelperProcess, base_config, make_root
from hostilekit import NODE_UID, as_node, refused_as_node, verify_audit

DATA = "/var/lib/bcd"
# The simulated nvidia-smi's GPUs 0 to 3 (gpus.bus_id), laid out in sysfs with their audio functions.
VFIO_GPU = "0000:18:00.0"  # GPU 0: on vfio-pci, as a runtime leaves it for a running VM
GROUPED_GPU, GROUPED_AUDIO = "0000:2a:00.0", "0000:2a:00.1"  # GPU 1 on nvidia, its audio on vfio-pci
FREE_GPU = "0000:3a:00.0"  # GPU 2: nvidia, nothing of its group on vfio-pci
DEFINED_GPU = "0000:5d:00.0"  # GPU 3: a libvirt domain root defined passes it through


def _reset(*uuids: str) -> dict[str, Any]:
    return {"op": "gpu.reset", "args": {"gpu_uuids": list(uuids)}}


def _gpus(root: Path) -> list[dict[str, Any]]:
    gpus: list[dict[str, Any]] = json.loads((root / "var/lib/bcd-sim/gpus.json").read_text())["gpus"]
    return gpus


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelperProcess]:
    root = make_root(tmp_path_factory.mktemp("busy8"))
    lay_out_pci(
        root,
        [
            (VFIO_GPU, "0x030200", 10, "vfio-pci"),
            ("0000:18:00.1", "0x040300", 10, "vfio-pci"),
            (GROUPED_GPU, "0x030200", 11, "nvidia"),
            (GROUPED_AUDIO, "0x040300", 11, "vfio-pci"),
            (FREE_GPU, "0x030200", 12, "nvidia"),
            ("0000:3a:00.1", "0x040300", 12, "snd_hda_intel"),
            (DEFINED_GPU, "0x030200", 13, "nvidia"),
        ],
    )
    proc = HelperProcess(root, base_config(extra='instance_bridges = "br0"\n'))
    yield proc
    proc.stop()


def test_round8_a_gpu_bound_to_vfio_pci_is_never_reset(host: HelperProcess) -> None:
    """GPU 0 is bound to vfio-pci (a VM has it). Root's busy check read holds, env files and compute
    processes only: the node's gpu.reset of it ran. Now it is `gpu-busy`, naming the GPU and its binding,
    audited with the node's uid, nothing changed (the simulated GPU's state included); the whole command
    is refused, the free GPU beside it too."""
    answer = refused_as_node(host, _reset(gpu_uuid(2), gpu_uuid(0)), "gpu-busy", "bound to vfio-pci")
    assert f"{gpu_uuid(0)} ({VFIO_GPU}) is bound to vfio-pci" in answer["message"]
    assert gpu_uuid(2) not in answer["message"]
    verify_audit(host)


def test_round8_a_gpu_whose_iommu_group_has_a_device_on_vfio_pci_is_never_reset(host: HelperProcess) -> None:
    """GPU 1 is on nvidia, but its audio function, in the same IOMMU group, is on vfio-pci: the runtimes
    hand a GPU's whole group to the VMM (delivery.md, "the GPU's audio function too"). Refused, naming
    the group and the device; nothing changed."""
    answer = refused_as_node(host, _reset(gpu_uuid(1)), "gpu-busy", "vfio-pci")
    assert f"shares IOMMU group 11 with {GROUPED_AUDIO}" in answer["message"]


def test_round8_a_gpu_nothing_passes_through_still_resets(host: HelperProcess) -> None:
    """GPU 2 (nvidia, its group on host drivers) resets, as the node's account asks: the new check
    refuses only what a VM has."""
    answer = as_node(host, _reset(gpu_uuid(2)))
    assert answer["ok"] is True, answer
    assert answer["result"]["gpus"] == [{"uuid": gpu_uuid(2), "reset": True, "message": ""}]
    last = host.last_audit()
    assert (last["op"], last["decision"], last["peer_uid"]) == ("gpu.reset", "accepted", NODE_UID)


def _define_with_gpu(h: HelperProcess, ident: str, address: str) -> dict[str, Any]:
    """The node's libvirt runtime lays out `ident` with the GPU at `address` and defines it through root."""
    from bcd_agent.sections.instances.model import Image, InstanceSpec, Nic
    from bcd_agent.sections.instances.runtimes.base import Prepared
    from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime
    from bcd_simhost.libvirt import IMAGE_SHA256

    kept: list[bytes] = []

    class Keep:  # the runtime's virsh: keeps the definition, runs nothing
        def read(self, *args: str) -> CommandResult:
            return CommandResult(args, 0, b"shut off\n")

        def define(self, name: str, xml: bytes, xml_path: str) -> None:
            kept.append(xml)

        def act(self, verb: str, name: str, *args: str) -> CommandResult:
            return CommandResult((verb,), 0)

    gib = 1 << 30
    inst = InstanceSpec(
        id=ident, allocation_id=f"a-{ident}", vcpus=2, memory_bytes=gib, disk_bytes=10 * gib,
        image=Image("https://images.sim.bcd/debian.qcow2", IMAGE_SHA256, "qcow2"),
        nics=(Nic("br0", "52:54:00:00:00:08"),), gpu_uuids=(gpu_uuid(3),),
    )  # fmt: skip
    LibvirtRuntime(sim_system(h.root), Keep(), DATA, under_helper=True).create(inst, Prepared((address,)))
    assert b"<hostdev" in kept[-1]
    return as_node(h, {"op": "libvirt.define", "args": {"name": ident, "xml": kept[-1].decode()}})


def test_round8_a_gpu_a_domain_root_defined_passes_through_is_never_reset_dev_busy_05(
    host: HelperProcess,
) -> None:
    """DEV-BUSY-05 under the helper: GPU 3 is on nvidia, but root defined libvirt domain vm8 with it as a
    hostdev (libvirt moves it to vfio-pci at the start). The node's reset was taken; now `gpu-busy`
    names instance vm8, from root's own staged definition, not from anything the node keeps. Once root
    undefines the domain the GPU resets."""
    defined = _define_with_gpu(host, "vm8", DEFINED_GPU)
    assert defined["ok"] is True, defined
    refused_as_node(host, _reset(gpu_uuid(3)), "gpu-busy", f"{gpu_uuid(3)} is passed through to instance vm8")
    assert as_node(host, {"op": "libvirt.undefine", "args": {"name": "vm8"}})["ok"] is True
    answer = as_node(host, _reset(gpu_uuid(3)))
    assert answer["ok"] is True and answer["result"]["gpus"][0]["reset"] is True, answer


def test_round8_mig_layout_leaves_a_gpu_on_vfio_pci_alone_hst_hlp_33(host: HelperProcess) -> None:
    """HST-HLP-33: the node's account asks `mig-layout` with no busy GPU at all. Before, root's view had
    nothing on GPUs 0 and 1 and repartitioned them under their VM. Now both are left alone exactly as they
    were (the unit's retryable issue naming root's reasons, as for a held GPU), GPU 2 is repartitioned,
    and the request is audited with the node's uid."""
    before = _gpus(host.root)
    args = {"unit": "mig-layout", "settings": '{"layout":"all-1g.18gb"}', "busy_gpus": []}
    answer = as_node(host, {"op": "host.unit", "args": args})
    assert answer["ok"] is True, answer
    issues = answer["result"]["issues"]
    assert [i["kind"] for i in issues] == ["retryable"], issues
    message = issues[0]["message"]
    assert f"{gpu_uuid(0)} ({VFIO_GPU}) is bound to vfio-pci" in message
    assert f"shares IOMMU group 11 with {GROUPED_AUDIO}" in message
    after = _gpus(host.root)
    assert after[0] == before[0] and after[1] == before[1]  # the VMs' GPUs untouched
    assert after[2]["mig_enabled"] and [m["profile"] for m in after[2]["migs"]] == ["1g.18gb"] * 7
    last = host.last_audit()
    assert (last["op"], last["decision"], last["peer_uid"]) == ("host.unit", "accepted", NODE_UID)
    verify_audit(host)


def test_round8_passthrough_view_in_process(tmp_path: Path) -> None:
    """The edges, in process: a staged definition root cannot parse makes every GPU busy; a memory
    snapshot's `.state` file and a hostdev without a PCI address name nothing; a GPU with no IOMMU group
    and a host driver is free; without `passthrough` (the VM starts' view) none of it counts."""
    from bcd_helper.busy import ALL, STAGE_DIR, busy_gpus, passthrough_gpus

    root = make_root(tmp_path)
    lay_out_pci(root, [(FREE_GPU, "0x030200", 12, "nvidia"), (VFIO_GPU, "0x030200", 10, "vfio-pci")])
    os.unlink(root / f"sys/bus/pci/devices/{FREE_GPU}/iommu_group")
    system = sim_system(root)
    assert passthrough_gpus(system) == [
        (gpu_uuid(0), f"{gpu_uuid(0)} ({VFIO_GPU}) is bound to vfio-pci: it is passed through to a VM")
    ]
    assert busy_gpus(system).reason(gpu_uuid(0)) is None
    stage = root / STAGE_DIR.lstrip("/")
    stage.mkdir(parents=True)
    (stage / "vm1.state").write_bytes(b"<not xml")
    (stage / "vm2.xml").write_text(
        "<domain><devices><hostdev><source><address bus='0x3a'/></source></hostdev></devices></domain>"
    )
    assert [g for g, _ in passthrough_gpus(system)] == [gpu_uuid(0)]
    (stage / "vm3.xml").write_bytes(b"<domain")
    assert (ALL, f"root's libvirt definition {STAGE_DIR}/vm3.xml cannot be read: it may name any GPU") in (
        passthrough_gpus(system)
    )
    assert busy_gpus(system, passthrough=True).reason(gpu_uuid(2)) is not None


def test_round8_mig_layout_holds_the_gpus_lock_from_its_busy_read_to_its_end(tmp_path: Path) -> None:
    """`host.unit` took only the `units` lock: a `libvirt.start` or `ch.vfio` (which take `gpus`) could pass
    a GPU through between mig-layout's busy read and its `nvidia-smi mig` calls. Now mig-layout takes
    `gpus` too: while another op holds it, the request waits and, past its deadline, is refused `busy`
    with nothing run; another unit does not wait for it."""
    from opskit import call, context, make_root, programs, refused

    root = make_root(tmp_path)
    ctx = context(root)
    ctx.locks["gpus"].acquire()  # a VM start, a reset or a hold write in progress
    try:
        assert refused(
            host_unit, call(ctx, timeout_s=0.05), HostUnit("mig-layout", settings='{"layout":"all-disabled"}')
        ) == ("busy", "host.unit: mig-layout: another operation holds the helper's gpus lock")
        assert programs(ctx).runs == []
        (root / "proc/sys/vm").mkdir(parents=True)
        assert host_unit(call(ctx), HostUnit("sysctl", settings=None))["unit"] == "sysctl"
    finally:
        ctx.locks["gpus"].release()
    assert host_unit(call(ctx), HostUnit("mig-layout", settings=None))["issues"] == []
    assert not ctx.locks["gpus"].locked()  # released at the unit's end


def test_round8_an_unreadable_driver_binding_fails_the_check(tmp_path: Path) -> None:
    """A `driver` entry root cannot read as a link (here a plain file: EINVAL) is no proof the GPU is off
    vfio-pci: the check fails (`BusyUnknown`, the ops' `busy-unknown`) instead of taking the GPU for
    free. A missing link (an unbound device) is free."""
    from bcd_helper.busy import BusyUnknown, passthrough_gpus

    root = make_root(tmp_path)
    lay_out_pci(root, [(FREE_GPU, "0x030200", 12, "nvidia")])
    link = root / f"sys/bus/pci/devices/{FREE_GPU}/driver"
    link.unlink()
    assert passthrough_gpus(sim_system(root)) == []
    link.write_text("vfio-pci\n")
    with pytest.raises(BusyUnknown, match=f"cannot read /sys/bus/pci/devices/{FREE_GPU}/driver"):
        passthrough_gpus(sim_system(root))


def test_round8_the_mig_units_issue_names_roots_reasons_for_the_gpus_it_left_alone() -> None:
    """In process (the unit as root runs it): the reasons root passes (`UnitContext.busy_reasons`) end
    the retryable issue, once each, only for the busy GPUs the unit left alone (a reason for a GPU already
    at the layout, or for another GPU, is not repeated); without reasons (the node's own run) the message
    is the seeds' word for word."""
    from bcd_shared.units import REGISTRY
    from bcd_shared.units.mig import MigGpu, MigObserved

    unit = REGISTRY["mig-layout"]
    settings = unit.decode_settings(json.dumps({"layout": "all-disabled"}))
    gpus = tuple(MigGpu(str(i), f"GPU-{i}", "Enabled", "Enabled", (), ()) for i in range(2))
    gpus += (MigGpu("2", "GPU-2", "Disabled", "Disabled", (), ()),)
    busy = frozenset({"GPU-0", "GPU-1", "GPU-2"})
    vfio = ("GPU-1", "GPU-1 is on vfio-pci")
    why = (vfio, ("GPU-2", "GPU-2 at the layout"), vfio)
    why += (("GPU-9", "another GPU"), ("GPU-0", "GPU-0 is held by a1"))
    issue = unit.plan(settings, MigObserved(gpus, busy, why)).issues[0]
    assert (issue.kind, issue.message) == (
        "retryable",
        "mig-layout: GPU-0, GPU-1 hold allocations; they are repartitioned once those end "
        "(GPU-1 is on vfio-pci; GPU-0 is held by a1)",
    )
    plain = unit.plan(settings, MigObserved(gpus, busy)).issues[0].message
    assert plain == "mig-layout: GPU-0, GPU-1 hold allocations; they are repartitioned once those end"


def test_round8_the_mig_unit_observes_the_reasons_root_hands_it(tmp_path: Path) -> None:
    """In process, over the simulated host's nvidia-smi: `observe` carries `UnitContext.busy_reasons` to
    the plan unchanged, beside the busy GPUs."""
    from bcd_shared.units import REGISTRY, UnitContext

    unit = REGISTRY["mig-layout"]
    why = ((gpu_uuid(0), "on vfio-pci"),)
    ctx = UnitContext(busy_gpus=frozenset({f"{gpu_uuid(0)}/s1"}), busy_reasons=why)
    observed = unit.observe(
        sim_system(make_root(tmp_path)), unit.decode_settings('{"layout":"all-disabled"}'), ctx
    )
    assert (observed.busy, observed.why) == (frozenset({gpu_uuid(0)}), why)


def test_round8_passthrough_reads_every_gpu_group_and_staged_definition_in_process(tmp_path: Path) -> None:
    """In process, word for word: root's nvidia-smi rows (a blank or UUID-less row skipped, not the end;
    asked with the 60 s bound), every listed GPU's group (a peer on a host driver frees nothing, a peer on
    vfio-pci names the first such), every staged definition in order (a state file, a dangling entry and
    one root cannot parse do not end the walk), every hostdev of each (one without a PCI address skipped),
    matched by sysfs's lowercase address."""
    from bcd_helper.busy import ALL, STAGE_DIR, BusyUnknown, passthrough_gpus
    from opskit import Programs

    rows = [
        f"{gpu_uuid(5)}, 00000000:AB:00.0",
        "\udcff, 00000000:99:00.0",  # a byte that is no UTF-8: replaced, its row read on
        "",
        f"{gpu_uuid(0)}, 00000000:18:00.0",
        ", 00000000:9A:00.0",
        f"{gpu_uuid(1)}, 00000000:2A:00.0",
        f"{gpu_uuid(2)}, 00000000:3A:00.0",
        f"{gpu_uuid(4)}, 00000000:9A:00.0",
    ]
    answer = {"rc": 0}

    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv == ("nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"):
            return answer["rc"], "\n".join(rows).encode(errors="surrogateescape"), b"no driver"
        return 0, b"", b""

    root = tmp_path / "host"
    root.mkdir()
    lay_out_pci(
        root,
        [
            (VFIO_GPU, "0x030200", 10, "vfio-pci"),
            (GROUPED_GPU, "0x030200", 11, "nvidia"),
            (GROUPED_AUDIO, "0x040300", 11, "vfio-pci"),
            (FREE_GPU, "0x030200", 12, "nvidia"),
            ("0000:3a:00.1", "0x040300", 12, "snd_hda_intel"),
            ("0000:9a:00.0", "0x030200", 14, "nvidia"),
            ("0000:9a:00.1", "0x040300", 14, "vfio-pci"),
            ("0000:ab:00.0", "0x030200", 15, "nvidia"),
        ],
    )
    stage = root / STAGE_DIR.lstrip("/")
    stage.mkdir(parents=True)

    def definition(*buses: str) -> str:
        """One hostdev without a whole PCI address (bus only), then hostdevs of these buses."""
        address = "<address domain='0x0000' bus='{}' slot='0x00' function='0x0'/>"
        hostdevs = [f"<hostdev><source>{address.format(b)}</source></hostdev>" for b in ("", *buses)]
        hostdevs[0] = "<hostdev><source><address bus='0x2a'/></source></hostdev>"
        return f"<domain><devices>{''.join(hostdevs)}</devices></domain>"

    (stage / "a1.xml").write_text(definition("0x77", "0xab"))  # 0x77: no GPU of this host
    (stage / "b1.state").write_bytes(b"<not a definition")
    (stage / "c1.xml").symlink_to(stage / "gone.xml")
    (stage / "c2.xml").write_bytes(b"<domain")
    (stage / "d1.xml").write_text(definition("0x3a"))
    system = Programs(root, script)
    grouped = "shares IOMMU group {g} with {d}, which is bound to vfio-pci: it is passed through to a VM"
    assert passthrough_gpus(system) == [
        (gpu_uuid(0), f"{gpu_uuid(0)} ({VFIO_GPU}) is bound to vfio-pci: it is passed through to a VM"),
        (gpu_uuid(1), f"{gpu_uuid(1)} ({GROUPED_GPU}) " + grouped.format(g=11, d=GROUPED_AUDIO)),
        (gpu_uuid(4), f"{gpu_uuid(4)} (0000:9a:00.0) " + grouped.format(g=14, d="0000:9a:00.1")),
        (gpu_uuid(5), f"{gpu_uuid(5)} is passed through to instance a1 (0000:ab:00.0, root's definition)"),
        (ALL, f"root's libvirt definition {STAGE_DIR}/c2.xml cannot be read: it may name any GPU"),
        (gpu_uuid(2), f"{gpu_uuid(2)} is passed through to instance d1 (0000:3a:00.0, root's definition)"),
    ]
    assert system.timeouts == [60]
    answer["rc"] = 9
    with pytest.raises(BusyUnknown, match=r"^cannot list GPUs: nvidia-smi exited 9: no driver$"):
        passthrough_gpus(system)
    answer["rc"] = 127
    assert passthrough_gpus(system) == [
        (ALL, f"root's libvirt definition {STAGE_DIR}/c2.xml cannot be read: it may name any GPU")
    ]


def test_round8_mig_layout_hands_the_unit_roots_passthrough_view_and_its_reasons(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, with a stand-in unit: mig-layout's busy GPUs are root's view with `passthrough` (the GPU
    on vfio-pci), and its reasons reach the unit (`busy_reasons`): root's own, then, when something makes
    every GPU busy (a MIG process), that reason for each GPU root's nvidia-smi lists."""
    import bcd_shared.units
    from bcd_helper.ops import hostunit
    from opskit import call, context

    handed: list[Any] = []

    class StandIn:
        def decode_settings(self, text: str) -> str:
            return text

    def converge(unit: Any, settings: Any, system: Any, uctx: Any, actx: Any) -> Any:
        handed.append(uctx)
        return types.SimpleNamespace(changed=False, steps_done=(), issues=[], conditions=[])

    monkeypatch.setattr(hostunit, "unit_registry", lambda: {"mig-layout": StandIn()})
    monkeypatch.setattr(bcd_shared.units, "converge_unit", converge)
    mig = "MIG-5f1c2a90-0000-4000-8000-000000000009"
    apps = {"out": b""}

    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[1] == "--query-gpu=uuid,pci.bus_id":
            return 0, f"{gpu_uuid(0)}, 00000000:18:00.0\n{gpu_uuid(2)}, 00000000:3A:00.0\n".encode(), b""
        if argv[1] == "--query-gpu=uuid":
            return 0, f"{gpu_uuid(0)}\n{gpu_uuid(2)}\n".encode(), b""
        return 0, apps["out"], b""

    root = tmp_path / "host"
    root.mkdir()
    lay_out_pci(root, [(VFIO_GPU, "0x030200", 10, "vfio-pci"), (FREE_GPU, "0x030200", 12, "nvidia")])
    ctx = context(root, script=script)
    bound = (gpu_uuid(0), f"{gpu_uuid(0)} ({VFIO_GPU}) is bound to vfio-pci: it is passed through to a VM")
    host_unit(call(ctx), HostUnit("mig-layout", settings="{}", busy_gpus=(gpu_uuid(2),)))
    assert (handed[-1].busy_gpus, handed[-1].busy_reasons) == (frozenset({gpu_uuid(0)}), (bound,))
    apps["out"] = f"{mig}, 8\n".encode()
    host_unit(call(ctx), HostUnit("mig-layout", settings="{}"))
    every = f"a MIG device ({mig}) runs compute process 8"
    assert (handed[-1].busy_gpus, handed[-1].busy_reasons) == (
        frozenset({gpu_uuid(0), gpu_uuid(2)}),
        ((ALL_GPUS, every), bound, (gpu_uuid(0), every), (gpu_uuid(2), every)),
    )
