"""Kubernetes releases against a fake kubelet pod-resources server on a real Unix socket, and the
busy checks / gpu.reset core on the simulated host."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload
from bcd_agent.inventory.gpus import collect_gpus
from bcd_agent.nodeparts.kinds import GpuResetHandler
from bcd_agent.sections.devices.busy import GpuBusy, dcgm_busy_check, gpu_reset, read_busy
from bcd_agent.sections.devices.kube import PodResourcesClient, PodResourcesError, gpus_with_pod_processes
from bcd_agent.sections.devices.model import DeviceAssignment, DeviceRef, DevicesSpec
from bcd_shared import wire
from bcd_shared.system import CommandResult, LocalSystem
from bcd_shared.wire.strict import type_url
from bcd_simhost.gpus import gpu_uuid, update_state
from devices.devhost import DATA_DIR, Host
from dispatch.dhelpers import EffectCtx, make_command

G0, G1, G7 = gpu_uuid(0), gpu_uuid(1), gpu_uuid(7)


def _ld(num: int, data: bytes) -> bytes:
    key, n, out = (num << 3) | 2, len(data), b""
    for v in (key, n):
        while v >= 0x80:
            out += bytes([(v & 0x7F) | 0x80])
            v >>= 7
        out += bytes([v])
    return out + data


def list_response(pods: list[tuple[str, str, list[str]]]) -> bytes:
    """ListPodResourcesResponse: pods of (name, resource, device ids), hand-encoded protobuf."""
    body = b""
    for name, resource, ids in pods:
        dev = (
            _ld(1, resource.encode()) + b"".join(_ld(2, i.encode()) for i in ids) + b"\x18\x07"
        )  # + an int field
        container = _ld(1, b"main") + _ld(2, dev)
        body += _ld(1, _ld(1, name.encode()) + _ld(2, b"default") + _ld(3, container))
    return body


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class FakeKubelet:
    """A pod-resources `List` server (HTTP/2 gRPC) on a Unix socket; `pods` is what it answers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pods: list[tuple[str, str, list[str]]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.calls = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):  # the client went away
                self._one(conn)

    def _one(self, conn: socket.socket) -> None:
        h2c = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False))
        h2c.initiate_connection()
        conn.sendall(h2c.data_to_send())
        path = ""
        while True:
            data = conn.recv(65536)
            if not data:
                return
            for ev in h2c.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    hdrs = {_text(k): _text(v) for k, v in ev.headers or ()}
                    path = hdrs.get(":path", "")
                elif isinstance(ev, h2.events.StreamEnded):
                    self.calls += 1
                    sid = ev.stream_id
                    h2c.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
                    if path == "/v1.PodResourcesLister/List":
                        msg = list_response(self.pods)
                        h2c.send_data(sid, b"\x00" + len(msg).to_bytes(4, "big") + msg)
                        h2c.send_headers(sid, [("grpc-status", "0")], end_stream=True)
                    else:
                        h2c.send_headers(
                            sid, [("grpc-status", "12"), ("grpc-message", "unimplemented")], end_stream=True
                        )
            conn.sendall(h2c.data_to_send())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    k = FakeKubelet(tmp_path / "kubelet.sock")
    yield k
    k.close()


def kube_hold(alloc: str, *ids: str) -> DeviceAssignment:
    return DeviceAssignment(
        alloc,
        f"rsv_{alloc}",
        "BINDING_KUBERNETES",
        tuple(DeviceRef(i, "gpu.slot" if "/s" in i else "gpu") for i in ids),
    )


def test_pod_resources_client_on_a_real_socket(kubelet: FakeKubelet, tmp_path: Path) -> None:
    kubelet.pods = [("trainer", "bcd.dev/gpu", [f"{G0}_s1"]), ("other", "nvidia.com/gpu", ["x"])]
    pods = PodResourcesClient(str(kubelet.path)).list()
    assert [(p.pod, p.namespace, p.container, p.resource_name, p.device_ids) for p in pods] == [
        ("trainer", "default", "main", "bcd.dev/gpu", (f"{G0}_s1",)),
        ("other", "default", "main", "nvidia.com/gpu", ("x",)),
    ]
    with pytest.raises(PodResourcesError):
        PodResourcesClient(str(tmp_path / "missing.sock")).list()


def test_DEV_K8S_02_release_waits_for_pods_then_reports(make_host, kubelet: FakeKubelet) -> None:  # type: ignore[no-untyped-def]
    """Covers DEV-K8S-01..03, DEV-K8S-06, DEV-K8S-08, DEV-K8S-09, DEV-K8S-11, DEV-EVT-08, DEV-BND-06,
    DEV-PASS-06 (a pending release reported once no pod holds it), DEV-PASS-08."""
    host: Host = make_host(pod_resources=PodResourcesClient(str(kubelet.path)))
    kubelet.pods = [("trainer", "bcd.dev/gpu", [f"{G0}_s1"])]
    host.run(DevicesSpec(1, (kube_hold("k1", f"{G0}/s1"),)))
    assert host.path("/run/bcd/allocations/k1.env").exists()
    out = host.run(DevicesSpec(2, (DeviceAssignment("h1", "r", "BINDING_HOLD", (DeviceRef(G0),)),)))
    assert out.state is SectionState.FAILED and out.message == f"h1: {G0} has {G0}/s1 assigned to k1"
    assert not host.path("/etc/cdi/bcd-k1.json").exists()  # withdrawn at once
    assert not host.path("/run/bcd/allocations/k1.env").exists()
    record = json.loads(host.path(f"{DATA_DIR}/releasing.json").read_text())
    assert record["releases"][0]["device_ids"] == [f"{G0}/s1"]
    assert abs(record["releases"][0]["since"] - time.time()) < 600
    assert record["releases"][0]["allocation_id"] == "k1" and record["releases"][0]["generation"] == 2
    assert (host.path(f"{DATA_DIR}/releasing.json").stat().st_mode & 0o777) == 0o600
    assert host.events("ReleasedEvent") == []
    kubelet.pods = []
    host.run(DevicesSpec(3, ()))
    [rel] = host.events("ReleasedEvent")
    assert rel.allocation_id == "k1" and rel.generation == 2  # type: ignore[attr-defined]
    assert json.loads(host.path(f"{DATA_DIR}/releasing.json").read_text())["releases"] == []
    # A plain hold, by contrast, is released in the pass that sees it gone, whatever the kube side says.
    kubelet.pods = [("trainer", "bcd.dev/gpu", [f"{G0}_s1"])]
    plain = DeviceAssignment("h1", "r", "BINDING_HOLD", (DeviceRef(G0),))
    assert host.run(DevicesSpec(4, (plain,))).state is SectionState.CONVERGED
    assert host.run(DevicesSpec(5, ())).state is SectionState.CONVERGED
    assert [e.allocation_id for e in host.events("ReleasedEvent")] == ["k1", "h1"]  # type: ignore[attr-defined]
    assert not host.path("/etc/cdi/bcd-h1.json").exists()


def test_DEV_K8S_11_a_pending_releases_gpu_is_refused_to_reset_dcgm_and_mig_layout(
    make_host, kubelet: FakeKubelet
) -> None:  # type: ignore[no-untyped-def]
    """While a pod holds a withdrawn Kubernetes hold's slot, gpu.reset and diag.dcgm (level 2) refuse its
    GPU naming the release, the host units are told its device id is busy (mig-layout leaves it), and
    the other GPUs stay free; once reported, the claim ends."""
    from bcd_agent.nodeparts.host import busy_devices

    host: Host = make_host(pod_resources=PodResourcesClient(str(kubelet.path)))
    kubelet.pods = [("trainer", "bcd.dev/gpu", [f"{G0}_s1"])]
    host.run(DevicesSpec(1, (kube_hold("k1", f"{G0}/s1"),)))
    host.run(DevicesSpec(2, ()))
    assert host.events("ReleasedEvent") == []  # pending
    gpus = collect_gpus(host.system)
    state = read_busy(host.system, DATA_DIR, {})
    why = f"{G0} is claimed by the pending Kubernetes release of k1"
    with pytest.raises(GpuBusy) as exc:
        gpu_reset(host.system, [G0], state)
    assert str(exc.value) == why
    with pytest.raises(GpuBusy) as exc:
        dcgm_busy_check(2, [], gpus, state)
    assert str(exc.value) == why
    dcgm_busy_check(2, [G1], gpus, state)
    assert busy_devices(host.system, DATA_DIR, gpus) == frozenset({f"{G0}/s1"})
    kubelet.pods = []
    host.run(DevicesSpec(3, ()))
    state = read_busy(host.system, DATA_DIR, {})
    dcgm_busy_check(2, [], gpus, state)
    assert busy_devices(host.system, DATA_DIR, gpus) == frozenset()


def test_DEV_K8S_06_a_whole_gpu_stays_held_while_a_pod_process_runs_on_it(
    make_host, kubelet: FakeKubelet
) -> None:  # type: ignore[no-untyped-def]
    """The kubelet lists no pod, but a compute process in a `kubepods` cgroup runs on the whole GPU: the
    release waits; once that process is in another cgroup, it is reported."""
    host: Host = make_host(pod_resources=PodResourcesClient(str(kubelet.path)))
    host.run(DevicesSpec(1, (kube_hold("k1", G0),)))
    kubelet.pods = []
    update_state(
        host.root, lambda s: s["gpus"][0].update(processes=[{"pid": 4343, "name": "py", "used_mib": 9}])
    )
    cgroup = host.path("/proc/4343/cgroup")
    cgroup.parent.mkdir(parents=True, exist_ok=True)
    cgroup.write_text("0::/kubepods.slice/kubepods-besteffort.slice/cri-containerd-ab12.scope\n")
    host.run(DevicesSpec(2, ()))
    assert host.events("ReleasedEvent") == []
    cgroup.write_text("0::/user.slice/user-1000.slice/session-4.scope\n")
    host.run(DevicesSpec(3, ()))
    assert [e.allocation_id for e in host.events("ReleasedEvent")] == ["k1"]  # type: ignore[attr-defined]


def test_DEV_K8S_07_unreachable_kubelet_counts_as_held(make_host, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Covers DEV-K8S-07: the release stays pending, the section PROGRESSING (which the runner retries)."""
    host: Host = make_host(pod_resources=PodResourcesClient(str(tmp_path / "nothing.sock")))
    host.run(DevicesSpec(1, (kube_hold("k1", G1),)))
    out = host.run(DevicesSpec(2, ()))
    assert out.state is SectionState.PROGRESSING and host.events("ReleasedEvent") == []


def test_DEV_K8S_07_a_pod_process_source_that_fails_counts_as_held(tmp_path: Path) -> None:
    """nvidia-smi's compute-apps list failing or unparseable is "unknown" (None), never "no pod process";
    nvidia-smi not installed is no process at all; a process counts when its cgroup is under kubepods."""
    answer: dict[str, tuple[int, bytes]] = {}

    def smi(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
        assert list(argv[1:]) == ["--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"]
        rc, out = answer["smi"]
        return CommandResult(tuple(argv), rc, out, b"")

    system = LocalSystem(tmp_path, tools={"nvidia-smi": smi})
    for rc, out in ((9, b""), (0, b"not,a,row,of,two\n"), (0, b"GPU-x, notapid\n")):
        answer["smi"] = (rc, out)
        assert gpus_with_pod_processes(system) is None, (rc, out)
    (tmp_path / "proc/41").mkdir(parents=True)
    (tmp_path / "proc/41/cgroup").write_text(
        "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope\n"
    )
    (tmp_path / "proc/42").mkdir(parents=True)
    (tmp_path / "proc/42/cgroup").write_text("0::/system.slice/ollama.service\n")
    answer["smi"] = (0, f"{G0}, 41\n{G1}, 42\n{G7}, 43\n".encode())
    assert gpus_with_pod_processes(system) == {G0}
    assert gpus_with_pod_processes(LocalSystem(tmp_path, tools={"true": smi})) == set()


def test_DEV_K8S_07_a_failing_pod_process_source_keeps_the_release_pending(
    make_host, kubelet: FakeKubelet, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The kubelet lists no pod, but the pod-process source cannot answer: the release stays pending."""
    from bcd_agent.sections.devices import section

    host: Host = make_host(pod_resources=PodResourcesClient(str(kubelet.path)))
    host.run(DevicesSpec(1, (kube_hold("k1", G0),)))
    kubelet.pods = []
    monkeypatch.setattr(section, "gpus_with_pod_processes", lambda system: None)
    out = host.run(DevicesSpec(2, ()))
    assert out.state is SectionState.PROGRESSING and host.events("ReleasedEvent") == []
    monkeypatch.undo()
    host.run(DevicesSpec(3, ()))
    assert [e.allocation_id for e in host.events("ReleasedEvent")] == ["k1"]  # type: ignore[attr-defined]


def test_DEV_K8S_16_unreadable_file_procedure_and_marker_removal(make_host, kubelet: FakeKubelet) -> None:  # type: ignore[no-untyped-def]
    """Covers DEV-K8S-14..16, DEV-K8S-18, DEV-CONF-09, DEV-BUSY-06."""
    host: Host = make_host(pod_resources=PodResourcesClient(str(kubelet.path)))
    host.path(DATA_DIR).mkdir(parents=True, exist_ok=True)
    host.path(f"{DATA_DIR}/releasing.json").write_text("{not json")
    kubelet.pods = [("ghost", "bcd.dev/gpu", ["GPU-unknown-to-this-node"])]
    out = host.run(DevicesSpec(1, (DeviceAssignment("h1", "r", "BINDING_HOLD", (DeviceRef(G1),)),)))
    assert out.message.startswith(
        f"h1: {G1} is assigned to (pending Kubernetes releases that could not be read)"
    )
    assert [c.type for c in out.conditions] == ["KubernetesReleasesUnreadable"]
    aside = list(host.path(DATA_DIR).glob("releasing.json.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_text() == "{not json"
    assert host.path(f"{DATA_DIR}/releasing.unreadable").exists()
    with pytest.raises(GpuBusy, match="pending Kubernetes releases could not be read"):
        gpu_reset(host.system, [G0], read_busy(host.system, DATA_DIR, {}))
    # a pod still holds a bcd GPU of an allocation this node does not know: the marker stays
    out = host.run(DevicesSpec(2, (DeviceAssignment("h1", "r", "BINDING_HOLD", (DeviceRef(G1),)),)))
    assert host.path(f"{DATA_DIR}/releasing.unreadable").exists()
    assert [c.type for c in out.conditions] == ["KubernetesReleasesUnreadable"]
    kubelet.pods = []  # the kube side: no pod holds a bcd GPU of an unknown allocation
    out = host.run(DevicesSpec(2, (DeviceAssignment("h1", "r", "BINDING_HOLD", (DeviceRef(G1),)),)))
    assert out.state is SectionState.CONVERGED and out.conditions == ()
    assert not host.path(f"{DATA_DIR}/releasing.unreadable").exists() and aside[0].exists()


def test_DEV_K8S_19_removing_the_marker_by_hand_ends_the_claim(make_host, kubelet: FakeKubelet) -> None:  # type: ignore[no-untyped-def]
    """A pod still holds a bcd GPU of an allocation this node does not know, so bcd keeps the marker and
    every GPU stays claimed; the operator deletes it by hand, and the next pass binds."""
    host: Host = make_host(pod_resources=PodResourcesClient(str(kubelet.path)))
    host.path(DATA_DIR).mkdir(parents=True, exist_ok=True)
    host.path(f"{DATA_DIR}/releasing.json").write_text("{not json")
    kubelet.pods = [("ghost", "bcd.dev/gpu", [f"{G1}_s9"])]
    spec = DevicesSpec(1, (DeviceAssignment("h1", "r", "BINDING_HOLD", (DeviceRef(G1),)),))
    marker = host.path(f"{DATA_DIR}/releasing.unreadable")
    for _ in range(2):
        out = host.run(spec)
        assert out.state is not SectionState.CONVERGED and marker.exists()
    marker.unlink()
    out = host.run(spec)
    assert out.state is SectionState.CONVERGED and out.conditions == ()
    assert host.path("/etc/cdi/bcd-h1.json").exists()


def test_DEV_BUSY_gpu_reset_checks_then_resets_and_reads_health(host: Host) -> None:
    """Covers DEV-BUSY-02..05, DEV-BUSY-07..10, DEV-CONF-14, DLV-DEV-21 (the busy side), and their
    delivery.md twins DLV-RST-02..07, DLV-RST-09, DLV-RST-11 (a failed remap stays unhealthy)."""
    host.run(
        DevicesSpec(
            1, (DeviceAssignment("a1", "r", "BINDING_HOLD", (DeviceRef(f"{G7}/gi2/ci0", "gpu.mig"),)),)
        )
    )
    state = read_busy(host.system, DATA_DIR, {G1: "vm-9"})
    with pytest.raises(ValueError):
        gpu_reset(host.system, [], state)
    with pytest.raises(GpuBusy) as busy:
        gpu_reset(host.system, [G0, G7, G1], state)
    assert busy.value.message == f"{G7} is held by allocation a1; {G1} is passed through to instance vm-9"
    assert json.loads(host.path("/var/lib/bcd-sim/gpus.json").read_text())["gpus"][0]["reset_count"] == 0
    with pytest.raises(GpuBusy):
        dcgm_busy_check(2, [], collect_gpus(host.system), state)
    dcgm_busy_check(1, [G7], collect_gpus(host.system), state)

    def change(s: dict) -> None:  # type: ignore[type-arg]
        s["gpus"][2]["remap_pending"] = True
        s["gpus"][3]["remap_failure"] = True
        s["gpus"][4]["processes"] = [{"pid": 4242, "name": "python", "used_mib": 100}]

    update_state(host.root, change)
    result = gpu_reset(host.system, [G0, gpu_uuid(2), gpu_uuid(3), gpu_uuid(4), "GPU-nope"], state)
    got = [
        (o.gpu_uuid, o.reset, o.healthy, o.message.splitlines()[0] if o.message else "") for o in result.gpus
    ]
    assert got == [
        (G0, True, True, ""),
        (gpu_uuid(2), True, True, ""),  # a reset applies the pending remap
        (gpu_uuid(3), True, False, ""),  # a failed remap stays
        (gpu_uuid(4), False, False, "The following GPUs could not be reset:"),
        ("GPU-nope", False, False, "unknown GPU"),
    ]


def _reset_command(*uuids: str) -> Any:
    request = wire.GpuResetRequest(gpu_uuids=list(uuids))
    return make_command(kind="gpu.reset", payload=(type_url(wire.GpuResetRequest), bytes(request)))


async def test_DEV_BUSY_03_04_every_hold_kind_is_busy_and_an_empty_list_is_invalid(host: Host) -> None:
    """Covers DEV-BUSY-03 and DEV-BUSY-04 through the gpu.reset handler: an empty `gpu_uuids` fails
    `invalid-payload`; a GPU held whole, by a MIG instance or by a slot each fails the whole command
    `gpu-busy` naming its hold, before the effect begins and before any GPU is reset."""
    host.run(
        DevicesSpec(
            1,
            (
                DeviceAssignment("whole", "r", "BINDING_HOLD", (DeviceRef(gpu_uuid(2), "gpu"),)),
                DeviceAssignment("mig", "r", "BINDING_HOLD", (DeviceRef(f"{G7}/gi2/ci0", "gpu.mig"),)),
                DeviceAssignment("slot", "r", "BINDING_HOLD", (DeviceRef(f"{gpu_uuid(3)}/s1", "gpu.slot"),)),
            ),
        )
    )
    handler = GpuResetHandler(host.system, DATA_DIR)
    with pytest.raises(InvalidPayload) as invalid:
        handler.resources(_reset_command())
    assert invalid.value.code == "invalid-payload"
    for gpu, holder in ((gpu_uuid(2), "whole"), (G7, "mig"), (gpu_uuid(3), "slot")):
        ctx = EffectCtx()
        with pytest.raises(CommandFailed) as busy:
            await handler.run(_reset_command(G0, gpu), ctx)
        assert (busy.value.code, busy.value.message, ctx.began) == (
            "gpu-busy",
            f"{gpu} is held by allocation {holder}",
            0,
        )
    gpus = json.loads(host.path("/var/lib/bcd-sim/gpus.json").read_text())["gpus"]
    assert [g["reset_count"] for g in gpus] == [0] * len(gpus)
