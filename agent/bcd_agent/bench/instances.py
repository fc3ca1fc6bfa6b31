"""`bcd bench instances`: the instances section's no-op pass, the helper's define cost, the header check.

- noop_pass_ms: 200 running instances on a simulated host (libvirt-kvm over the simulated host's
  file-backed virsh, in process), already converged: one pass's observation (list, the cached
  definitions, each overlay's header, host facts, holds) and plan, median of 15 (target <= 50);
- helper_define_ratio: `virsh -c test:///default define --validate` of the same XML run directly, per
  second, over the same through a real helper process (`libvirt.define`: strict frame, root's
  default-deny check and host re-check of the disks, root's own `dumpxml` of the name, the staged
  XML, audit fsynced), with `[helper] libvirt_uri = "test:///default"`, in one run (target >= 0.5).
  Define only: libvirt's test driver keeps its domains in the connection, so a start or destroy in a
  second virsh process finds no domain (docs/instances.md);
- header_check_us: bcd_shared.images.check_image of a qcow2 header (target <= 100);
- ch_api_roundtrip_ms: one cloud-hypervisor API request (`vmm.ping`) over the Unix socket with the
  h11 client, against the simulated host's v51 API server, median of 200 (target <= 5);
- ch_launch_ms: the helper's `ch.launch` up to a started unit (root reads and checks vm.json, the
  overlay and its base, the running units, creates the VMM's account on the first run, grants the ACL
  entries and runs the simulated systemd-run), through a real helper process on the simulated host,
  median of 15 launch/stop pairs (target <= 100).
- nft_apply_ms_100/_1000, nft_ratio (>= 0.8), integrity_check_ms (<= 150), volume_create_ms (<= 100):
  bcd_agent.bench.instances_net (in a private network namespace).
Runs as root (the helper's config must be root's); needs virsh for the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bcd_agent.helperclient import HelperClient

TARGETS: dict[str, tuple[str, float]] = {
    "noop_pass_ms": ("<=", 50.0),
    "helper_define_ratio": (">=", 0.5),
    "header_check_us": ("<=", 100.0),
    # network policy and volumes (bcd_agent.bench.instances_net)
    "nft_ratio": (">=", 0.8),
    "integrity_check_ms": ("<=", 150.0),
    "volume_create_ms": ("<=", 100.0),
    "ch_api_roundtrip_ms": ("<=", 5.0),
    "ch_launch_ms": ("<=", 100.0),
}
INSTANCES = 200
GIB = 1 << 30


def _noop_pass(base: Path) -> float:
    from bcd_simhost import sim_system
    from bcd_simhost.libvirt import IMAGE_SHA256
    from bcd_simhost.seed import seed

    from bcd_agent.converge.section import Observation, PassContext
    from bcd_agent.converge.types import DesiredSpec
    from bcd_agent.sections.instances.model import Image, InstanceSpec, InstancesSpec, Nic
    from bcd_agent.sections.instances.plan import plan
    from bcd_agent.sections.instances.runtimes.libvirt import DirectVirsh, LibvirtRuntime
    from bcd_agent.sections.instances.section import InstancesSection

    root = base / "host"
    seed(root)
    system = sim_system(root)
    data = "/var/lib/bcd"
    rt = LibvirtRuntime(system, DirectVirsh(system), data)
    section = InstancesSection(system, [rt], data)
    image = Image("https://images.sim.bcd/bench.qcow2", IMAGE_SHA256, "qcow2")
    spec = InstancesSpec(
        1,
        tuple(
            InstanceSpec(
                id=f"vm-{i:04d}",
                allocation_id=f"alloc_{i}",
                vcpus=1,
                memory_bytes=GIB,
                disk_bytes=10 * GIB,
                image=image,
                nics=(Nic("br0", f"52:54:00:00:{i >> 8:02x}:{i & 255:02x}"),),
            )
            for i in range(INSTANCES)
        ),
    )
    ctx = PassContext(DesiredSpec(1, "bench"), 1, frozenset({"bench"}), 0.0)
    first = section.converge(spec, Observation(), ctx)
    if first.state.value != "CONVERGED":
        raise RuntimeError(f"the bench's spec did not converge: {first.message}")
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        p = plan(spec, section.observe(spec))
        times.append((time.perf_counter() - t0) * 1000)
        if p.steps:
            raise RuntimeError(f"a converged pass planned {len(p.steps)} steps")
    return statistics.median(times)


def _header_check_us(base: Path) -> float:
    from bcd_shared.images import check_image
    from bcd_simhost.libvirt import IMAGE_BYTES

    path = base / "image.qcow2"
    path.write_bytes(IMAGE_BYTES)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        check_image(str(path), 1 << 46)
    return (time.perf_counter() - t0) / n * 1e6


@contextmanager
def _helper(root: Path, config: str) -> Iterator[HelperClient]:
    """`bcd helper serve` on the simulated `root` with `config` as its config.toml, once it answers a
    ping; stopped (SIGTERM, reaped) when the block ends."""
    from bcd_agent.helperclient import HelperClient

    cfg = root / "etc/bcd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(cfg.parent, 0o750)  # noqa: S103 (the install's /etc/bcd mode)
    cfg.write_text(config)
    os.chmod(cfg, 0o640)
    sock = str(root / "run/bcd/helper.sock")
    proc = subprocess.Popen([sys.executable, "-m", "bcd_helper.cli", "serve", "--root", str(root)])
    client = HelperClient(sock)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the helper did not start") from None
                time.sleep(0.01)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(5)


def _define_ratio(base: Path) -> dict[str, float]:
    from bcd_shared.system import CommandResult
    from bcd_simhost import sim_system
    from bcd_simhost.libvirt import IMAGE_SHA256
    from bcd_simhost.seed import seed

    from bcd_agent.sections.instances.model import Image, InstanceSpec, Nic
    from bcd_agent.sections.instances.runtimes.base import Prepared
    from bcd_agent.sections.instances.runtimes.libvirt import LibvirtRuntime

    class Keep:
        xml = b""

        def read(self, *args: str) -> CommandResult:
            return CommandResult(args, 0, b"shut off\n")

        def define(self, name: str, xml: bytes, xml_path: str) -> None:
            self.xml = xml

        def act(self, verb: str, name: str, *args: str) -> CommandResult:
            return CommandResult((verb,), 0)

    virsh = shutil.which("virsh")
    if virsh is None:
        raise RuntimeError("virsh is not installed")
    root = base / "lvhost"
    seed(root)
    for p in (base, root):
        os.chmod(p, 0o755)  # noqa: S103 (the simulated root must be traversable, as / is)
    system = sim_system(root)
    keep = Keep()
    rt = LibvirtRuntime(system, keep, "/var/lib/bcd", under_helper=True)
    inst = InstanceSpec(
        id="bench-vm", allocation_id="a", vcpus=2, memory_bytes=GIB, disk_bytes=10 * GIB,
        image=Image("https://images.sim.bcd/bench.qcow2", IMAGE_SHA256, "qcow2"),
        nics=(Nic("br0", "52:54:00:00:00:01"),),
    )  # fmt: skip
    rt.create(inst, Prepared(user_data=b"#cloud-config\n"))
    xml_text = keep.xml.decode()
    xml_file = base / "bench-vm.xml"
    xml_file.write_bytes(keep.xml)
    config = (
        '[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = 65534\nnode_gid = 65534\n'
        'instance_bridges = "br0"\nlibvirt_uri = "test:///default"\n'
    )
    with _helper(root, config) as client:
        argv = [virsh, "-c", "test:///default", "define", "--validate", str(xml_file)]
        direct: list[float] = []
        helper: list[float] = []
        for _ in range(12):  # interleaved, so both see the same machine load
            t0 = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True)
            direct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.call("libvirt.define", {"name": "bench-vm", "xml": xml_text})
            helper.append(time.perf_counter() - t0)
    d, h = statistics.median(direct), statistics.median(helper)
    return {"direct_define_ms": d * 1000, "helper_define_ms": h * 1000, "helper_define_ratio": d / h}


def _ch_api_roundtrip_ms(base: Path) -> float:
    from bcd_simhost.chapi import FakeCHServer

    from bcd_agent.sections.instances.runtimes.chapi import CHApi

    sock = Path(tempfile.mkdtemp(prefix="bcdch", dir="/tmp")) / "api.sock"  # sun_path: 108 bytes
    try:
        with FakeCHServer(sock) as srv:
            api = CHApi(srv.path, timeout_s=5)
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                api.ping()
                times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)
    finally:
        shutil.rmtree(sock.parent, ignore_errors=True)


def _ch_launch_ms(base: Path) -> float:
    from bcd_shared.chunit import VMM_UID_BASE
    from bcd_simhost.chapi import lay_out_instance
    from bcd_simhost.seed import seed

    root = base / "chhost"
    seed(root)
    for p in (base, root):
        os.chmod(p, 0o755)  # noqa: S103 (the simulated root must be traversable, as / is)
    node = 65534
    lay_out_instance(root, "bench-ch", node, VMM_UID_BASE + 1)
    config = (
        f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {node}\nnode_gid = {node}\n'
        'instance_bridges = "br0"\n'
    )
    with _helper(root, config) as client:
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            client.call("ch.launch", {"name": "bench-ch"})
            times.append((time.perf_counter() - t0) * 1000)
            client.call("ch.stop", {"name": "bench-ch"})
    return statistics.median(times)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="bcd-bench-instances-", dir=args.data_dir))
    try:
        result: dict[str, Any] = {"instances": INSTANCES}
        result["noop_pass_ms"] = round(_noop_pass(base), 2)
        result["header_check_us"] = round(_header_check_us(base), 2)
        try:
            result.update({k: round(v, 3) for k, v in _define_ratio(base).items()})
        except RuntimeError as exc:
            result["error"] = str(exc)
        result["ch_api_roundtrip_ms"] = round(_ch_api_roundtrip_ms(base), 3)
        result["ch_launch_ms"] = round(_ch_launch_ms(base), 2)
        from bcd_agent.bench import instances_net

        result["volume_create_ms"] = round(instances_net.volume_create_ms(base), 2)
        try:
            result.update({k: round(v, 3) for k, v in instances_net.nft_figures().items()})
        except RuntimeError as exc:
            result["nft_error"] = str(exc)
        return result  # the shape (bench, targets, met, missed) is bcd_agent.bench.result's
    finally:
        shutil.rmtree(base, ignore_errors=True)
