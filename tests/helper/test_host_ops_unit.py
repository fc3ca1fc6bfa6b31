"""gpu.reset, node.reboot, helper.ping and host.unit's argument rules called in process over a temporary
root whose programs are scripted and recorded: each refusal word for word, the argv root runs, and the
signed command's GPUs (DLV-PRIV-09, issue 9 item 10; docs/mutation.md)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import types
from pathlib import Path
from typing import Any

import pytest
from bcd_helper.ops import host, hostunit
from bcd_helper.ops.base import Failed, HelperContext
from bcd_helper.ops.host import GpuReset, NodeReboot, Ping, SignedCommand, gpu_reset, node_reboot
from bcd_helper.ops.hostunit import HostUnit, check_request, host_unit
from bcd_helper.usedcommands import USED_PATH
from bcd_shared import wire
from bcd_shared.pki import Purpose
from bcd_shared.wire.strict import type_url
from intentkit import ControlPlane, Signer, b64
from opskit import call, context, make_root, programs, refused

GPU1 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU2 = "GPU-5f1c2a90-0000-4000-8000-000000000002"
GPU3 = "GPU-5f1c2a90-0000-4000-8000-000000000003"
NODE = "node-a"
APPS = ("nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader")
LIST = ("nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader")


def smi(apps: bytes = b"", gpus: bytes = b"", reset: dict[str, tuple[int, bytes]] | None = None) -> Any:
    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv == APPS:
            return 0, apps, b""
        if argv == LIST:
            return 0, gpus, b""
        if argv[:3] == ("nvidia-smi", "--gpu-reset", "-i"):
            rc, err = (reset or {}).get(argv[3], (0, b""))
            return rc, b"", err
        return 0, b"", b""

    return script


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


def ctx_of(root: Path, script: Any = None, config: str = "") -> HelperContext:
    return context(root, config, script)


# --- gpu.reset --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uuids", "message"),
    [
        ((), "gpu.reset: no GPU named"),
        (tuple(f"GPU-5f1c2a90-0000-4000-8000-{i:012d}" for i in range(65)), "gpu.reset: at most 64 GPUs"),
        ((GPU1, GPU1), "gpu.reset: a GPU is listed twice"),
        ((GPU1, "GPU-1"), "gpu_uuids[1]: 'GPU-1' is not a GPU UUID"),
        ((GPU1 + "\n",), f"gpu_uuids[0]: {GPU1 + chr(10)!r} is not a GPU UUID"),
        (
            ("MIG-5f1c2a90-0000-4000-8000-000000000001",),
            "gpu_uuids[0]: 'MIG-5f1c2a90-0000-4000-8000-000000000001' is not a GPU UUID",
        ),
    ],
)
def test_gpu_reset_arguments(root: Path, uuids: tuple[str, ...], message: str) -> None:
    ctx = ctx_of(root, smi())
    assert refused(gpu_reset, call(ctx), GpuReset(uuids)) == ("invalid-payload", message)
    assert programs(ctx).runs == []


def test_gpu_reset_takes_64_gpus_and_upper_case_hex(root: Path) -> None:
    ctx = ctx_of(root, smi())
    many = tuple(f"GPU-5F1C2A90-0000-4000-8000-{i:012d}" for i in range(64))
    assert len(gpu_reset(call(ctx), GpuReset(many))["gpus"]) == 64


def test_gpu_reset_resets_each_known_gpu(root: Path) -> None:
    ctx = ctx_of(
        root, smi(gpus=f"{GPU1}\n {GPU2} \n\n".encode(), reset={GPU2: (3, b"In use by another client\n")})
    )
    got = gpu_reset(call(ctx, bounded=False), GpuReset((GPU1, GPU2, GPU3)))
    assert got == {
        "gpus": [
            {"uuid": GPU1, "reset": True, "message": ""},
            {"uuid": GPU2, "reset": False, "message": "In use by another client"},
            {"uuid": GPU3, "reset": False, "message": "unknown GPU"},
        ]
    }
    runs = programs(ctx).runs
    assert ("nvidia-smi", "--gpu-reset", "-i", GPU1) in runs and (
        "nvidia-smi",
        "--gpu-reset",
        "-i",
        GPU3,
    ) not in runs
    i = runs.index(("nvidia-smi", "--gpu-reset", "-i", GPU1))
    assert programs(ctx).timeouts[i] == 300


def test_a_failed_reset_without_output_is_described(root: Path) -> None:
    ctx = ctx_of(root, smi(gpus=GPU1.encode(), reset={GPU1: (9, b"")}))
    assert gpu_reset(call(ctx), GpuReset((GPU1,)))["gpus"] == [
        {"uuid": GPU1, "reset": False, "message": "nvidia-smi exited 9"}
    ]


def test_without_nvidia_smi_every_gpu_is_tried(root: Path) -> None:
    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        return (127, b"", b"") if argv in (APPS, LIST) else (0, b"", b"")

    ctx = ctx_of(root, script)
    assert gpu_reset(call(ctx), GpuReset((GPU1,)))["gpus"] == [{"uuid": GPU1, "reset": True, "message": ""}]


def test_a_busy_gpu_refuses_the_whole_request(root: Path) -> None:
    ctx = ctx_of(root, smi(apps=f"{GPU2}, 4321\n".encode(), gpus=f"{GPU1}\n{GPU2}".encode()))
    assert refused(gpu_reset, call(ctx), GpuReset((GPU1, GPU2))) == (
        "gpu-busy",
        f"gpu.reset: {GPU2} runs compute process 4321",
    )
    assert not any(r[:2] == ("nvidia-smi", "--gpu-reset") for r in programs(ctx).runs)


def test_busy_gpus_that_cannot_be_read_fail(root: Path) -> None:
    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        return (2, b"", b"driver gone") if argv == APPS else (0, b"", b"")

    with pytest.raises(Failed) as info:
        gpu_reset(call(ctx_of(root, script)), GpuReset((GPU1,)))
    assert (info.value.reason, info.value.message) == (
        "busy-unknown",
        "gpu.reset: cannot list compute processes: nvidia-smi exited 2: driver gone",
    )


# --- signed commands ----------------------------------------------------------------------------------------


def signed(
    signer: Signer, kind: str, payload: Any, command_id: str = "01J00000000000000000000000"
) -> SignedCommand:
    body = bytes(
        wire.CommandBody(
            id=command_id,
            node_id=NODE,
            seq=1,
            kind=kind,
            payload=wire.ProtoAny(type_url=type_url(type(payload)), value=bytes(payload)),
            lane=wire.Lane.CONTROL,
            not_after=int((dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)).timestamp() * 1000),
        )
    )
    sig = signer.key.sign(Purpose.COMMAND, body)
    return SignedCommand(b64(body), b64(sig), tuple(b64(c) for c in signer.chain), None)


def signed_ctx(root: Path, cp: ControlPlane, script: Any = None) -> HelperContext:
    cp.write_record(root, NODE, cp.bundle(1))
    return ctx_of(root, script, cp.config_lines())


def test_with_roots_a_reset_needs_the_signed_command_naming_each_gpu(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    ctx = signed_ctx(root, cp, smi(gpus=f"{GPU1}\n{GPU2}".encode()))
    assert refused(gpu_reset, call(ctx), GpuReset((GPU1,))) == (
        "command-required",
        "gpu.reset: the signed command is required (command-signing roots from join record)",
    )
    command = signed(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1]))
    assert gpu_reset(call(ctx), GpuReset((GPU1,), command))["gpus"][0]["reset"] is True
    assert refused(gpu_reset, call(ctx), GpuReset((GPU1, GPU2, GPU3), command)) == (
        "command-mismatch",
        f"gpu.reset: the signed command does not name {GPU2}, {GPU3}",
    )
    wrong = signed(worker, "gpu.reset", wire.NodeRebootRequest())
    reason, message = refused(gpu_reset, call(ctx), GpuReset((GPU1,), wrong))
    assert reason == "command-mismatch" and message.startswith("gpu.reset: the signed command's payload: ")
    ctx.audit.close()


def test_a_presented_command_without_any_pin_is_still_checked(root: Path, worker: Signer) -> None:
    """A command the node presents turns the check on (no_roots_possible is False): with nothing to
    check against, it is not required, and the request goes on."""
    ctx = ctx_of(root, smi(gpus=GPU1.encode()))
    command = signed(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[]))
    assert gpu_reset(call(ctx), GpuReset((GPU1,), command))["gpus"][0]["reset"] is True


def test_node_reboot_runs_systemctl_reboot(root: Path) -> None:
    ctx = ctx_of(root)
    assert node_reboot(call(ctx, bounded=False), NodeReboot()) == {"rebooting": True}
    assert programs(ctx).runs == [("systemctl", "reboot")] and programs(ctx).timeouts == [60]
    bad = ctx_of(root, lambda argv: (1, b"", b"Failed to reboot\n"))
    with pytest.raises(Failed) as info:
        node_reboot(call(bad), NodeReboot())
    assert (info.value.reason, info.value.message) == ("systemctl", "systemctl exited 1: Failed to reboot")


def test_with_roots_a_reboot_needs_its_signed_command(root: Path, cp: ControlPlane, worker: Signer) -> None:
    ctx = signed_ctx(root, cp)
    assert refused(node_reboot, call(ctx), NodeReboot())[0] == "command-required"
    assert programs(ctx).runs == []
    assert node_reboot(call(ctx), NodeReboot(signed(worker, "node.reboot", wire.NodeRebootRequest()))) == {
        "rebooting": True
    }
    wrong = signed(worker, "node.reboot", wire.GpuResetRequest(gpu_uuids=[GPU1]))
    reason, message = refused(node_reboot, call(ctx), NodeReboot(wrong))
    assert reason == "command-mismatch" and message.startswith("node.reboot: the signed command's payload: ")


def _used(root: Path) -> list[dict[str, Any]]:
    doc = json.loads((root / USED_PATH.lstrip("/")).read_bytes())
    return list(doc["used"])


def _not_after(command: SignedCommand) -> int:
    return int(wire.CommandBody.parse(base64.b64decode(command.body)).not_after)


def test_a_signed_reset_is_remembered_per_gpu_before_nvidia_smi_and_a_replay_refused_first(
    root: Path, cp: ControlPlane, worker: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root's memory of used commands as gpu.reset keeps it: each GPU reset under the command is an entry
    (id, op `gpu.reset`, GPU, the command's not_after); the same command for a GPU already reset is refused
    `command-replayed` before any program runs (the check ahead of the busy query), another GPU of it is
    taken; an entry whose not_after passed by root's clock (milliseconds of time.time) is dropped."""
    ctx = signed_ctx(root, cp, smi(gpus=f"{GPU1}\n{GPU2}".encode()))
    command = signed(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1, GPU2]))
    not_after = _not_after(command)
    assert gpu_reset(call(ctx), GpuReset((GPU1,), command))["gpus"][0]["reset"] is True
    entry = {"id": "01J00000000000000000000000", "op": "gpu.reset", "not_after_ms": not_after}
    assert _used(root) == [{**entry, "target": GPU1}]
    ran = len(programs(ctx).runs)
    assert refused(gpu_reset, call(ctx), GpuReset((GPU1,), command)) == (
        "command-replayed",
        f"gpu.reset: root acted on the signed command '01J00000000000000000000000' for {GPU1} already: "
        "a command is acted on once (root remembers it until its not_after)",
    )
    assert len(programs(ctx).runs) == ran  # refused before nvidia-smi was asked anything
    assert gpu_reset(call(ctx), GpuReset((GPU2,), command))["gpus"][0]["reset"] is True
    assert _used(root) == [{**entry, "target": GPU1}, {**entry, "target": GPU2}]
    # Root's clock past the command's not_after (the verifier's own clock still takes it): both entries
    # expired, so a reset under it is taken again and only that one is kept.
    monkeypatch.setattr(host, "time", types.SimpleNamespace(time=lambda: not_after / 1000 + 1))
    assert gpu_reset(call(ctx), GpuReset((GPU1,), command))["gpus"][0]["reset"] is True
    assert _used(root) == [{**entry, "target": GPU1}]
    ctx.audit.close()


def test_a_signed_reboot_is_remembered_once_and_a_replay_refused(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    """node.reboot remembers its command (op `node.reboot`, target "", its not_after) before systemctl
    runs; the same command again is refused `command-replayed` and reboots nothing; another command is
    taken and remembered beside it."""
    ctx = signed_ctx(root, cp)
    first = signed(worker, "node.reboot", wire.NodeRebootRequest())
    assert node_reboot(call(ctx), NodeReboot(first)) == {"rebooting": True}
    one = {"id": "01J00000000000000000000000", "op": "node.reboot", "target": ""}
    assert _used(root) == [{**one, "not_after_ms": _not_after(first)}]
    assert refused(node_reboot, call(ctx), NodeReboot(first)) == (
        "command-replayed",
        "node.reboot: root acted on the signed command '01J00000000000000000000000' already: "
        "a command is acted on once (root remembers it until its not_after)",
    )
    assert programs(ctx).runs == [("systemctl", "reboot")]
    second = signed(worker, "node.reboot", wire.NodeRebootRequest(), "01J00000000000000000000001")
    assert node_reboot(call(ctx), NodeReboot(second)) == {"rebooting": True}
    assert _used(root) == [
        {**one, "not_after_ms": _not_after(first)},
        {**one, "id": "01J00000000000000000000001", "not_after_ms": _not_after(second)},
    ]
    ctx.audit.close()


def test_ping_answers_the_peer_and_the_config(root: Path) -> None:
    ctx = ctx_of(root, config="[host]\nunits = false\n")
    got = host.ping(call(ctx, uid=4242), Ping())
    assert got == {"peer_uid": 4242, "host_units": False, "version": host.helper_version()}
    assert host.helper_version() != ""


def test_ping_reads_the_version_once_per_helper(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The running code's version: read on the first ping, kept after (an upgrade under a running
    helper is not what it runs)."""
    ctx = ctx_of(root)
    reads: list[str] = []

    def version() -> str:
        reads.append("read")
        return f"1.{len(reads)}.0"

    monkeypatch.setattr(host, "helper_version", version)
    assert [host.ping(call(ctx), Ping())["version"] for _ in range(3)] == ["1.1.0"] * 3
    assert reads == ["read"]
    assert host.ping(call(ctx_of(root)), Ping())["version"] == "1.2.0"  # another helper reads its own


# --- host.unit's rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("req", "reason", "message"),
    [
        (HostUnit("Sysctl"), "bad-unit-name", "host.unit: 'Sysctl' is not a config unit name"),
        (HostUnit(""), "bad-unit-name", "host.unit: '' is not a config unit name"),
        (HostUnit("a" * 65), "bad-unit-name", f"host.unit: {'a' * 65!r} is not a config unit name"),
        (HostUnit("a\n"), "bad-unit-name", "host.unit: 'a\\n' is not a config unit name"),
        (
            HostUnit("sysctl", busy_gpus=("x",) * 1025),
            "too-many-busy-gpus",
            "host.unit: 1025 busy GPUs, at most 1024",
        ),
        (
            HostUnit("sysctl", busy_gpus=(GPU1, "")),
            "bad-busy-gpu",
            "host.unit: busy_gpus[1] is not a device id",
        ),
        (
            HostUnit("sysctl", busy_gpus=("a b",)),
            "bad-busy-gpu",
            "host.unit: busy_gpus[0] is not a device id",
        ),
        (
            HostUnit("sysctl", busy_gpus=("a\x1fb",)),
            "bad-busy-gpu",
            "host.unit: busy_gpus[0] is not a device id",
        ),
        (
            HostUnit("sysctl", busy_gpus=("x" * 129,)),
            "bad-busy-gpu",
            "host.unit: busy_gpus[0] is not a device id",
        ),
        (
            HostUnit("sysctl", settings="é" * (128 * 1024 + 1)),
            "too-large",
            "host.unit: settings larger than 262144 bytes",
        ),
    ],
)
def test_host_unit_arguments(root: Path, req: HostUnit, reason: str, message: str) -> None:
    assert refused(check_request, call(ctx_of(root)), req) == (reason, message)


def test_host_unit_limits_are_inclusive(root: Path) -> None:
    c = call(ctx_of(root))
    check_request(c, HostUnit("a" * 64, settings="x" * (256 * 1024), busy_gpus=("x" * 128,) * 1024))
    check_request(c, HostUnit("mig-layout-2", busy_gpus=(f"{GPU1}/gi1/ci0", "\x7f")))


def test_host_unit_when_root_manages_the_host(root: Path) -> None:
    ctx = ctx_of(root, config="[host]\nunits = false\n")
    assert refused(check_request, call(ctx), HostUnit("sysctl")) == (
        "host-managed-externally",
        hostunit.EXTERNAL_MESSAGE,
    )


def test_host_unit_refusals_before_any_effect(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = ctx_of(root)
    assert refused(host_unit, call(ctx), HostUnit("nope")) == (
        "not-supported",
        "host.unit: nope: not supported",
    )
    reason, message = refused(host_unit, call(ctx), HostUnit("sysctl", settings="{"))
    assert reason == "invalid-settings" and message.startswith("host.unit: sysctl: ")
    deep = "[" * 100_000 + "]" * 100_000
    assert refused(host_unit, call(ctx), HostUnit("sysctl", settings=deep)) == (
        "invalid-settings",
        "host.unit: sysctl: settings nested too deeply",
    )
    monkeypatch.setattr(hostunit, "unit_registry", lambda: None)
    assert refused(host_unit, call(ctx), HostUnit("sysctl")) == (
        "not-configured",
        "host.unit: not configured (this helper has no host units)",
    )
    assert programs(ctx).runs == []


def test_the_registry_is_bcd_shareds(monkeypatch: pytest.MonkeyPatch) -> None:
    import bcd_shared.units

    assert hostunit.unit_registry() is bcd_shared.units.REGISTRY
    monkeypatch.setattr(bcd_shared.units, "REGISTRY", ["not", "a", "mapping"])
    assert hostunit.unit_registry() is None


def test_sysctl_keys_outside_roots_allowlist_are_refused(root: Path) -> None:
    ctx = ctx_of(root, config='[host]\nsysctl_allow = "net.core"\n')
    s = '{"net.core.somaxconn":1024,"vm.swappiness":10}'
    assert refused(host_unit, call(ctx), HostUnit("sysctl", settings=s)) == (
        "invalid-settings",
        "host.unit: sysctl: vm.swappiness is refused: not under root's [host] sysctl_allow",
    )
    assert programs(ctx).runs == []


def test_mig_layout_reads_the_busy_gpus_itself(root: Path) -> None:
    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        return (2, b"", b"no driver") if argv == APPS else (0, b"", b"")

    with pytest.raises(Failed) as info:
        host_unit(call(ctx_of(root, script)), HostUnit("mig-layout", settings=None))
    assert (info.value.reason, info.value.message) == (
        "busy-unknown",
        "host.unit: cannot list compute processes: nvidia-smi exited 2: no driver",
    )


# --- host.unit to the end ---------------------------------------------------------------------------------


def kernel(root: Path) -> Any:
    """A host whose `sysctl -w key=value` sets the simulated /proc/sys file, as the real tool would."""
    (root / "proc/sys/vm").mkdir(parents=True)
    (root / "proc/sys/vm/swappiness").write_text("60\n")

    def script(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv[:2] == ("sysctl", "-w"):
            key, _, value = argv[2].partition("=")
            (root / "proc/sys" / key.replace(".", "/")).write_text(value + "\n")
        return 0, b"", b""

    return script


def test_host_unit_converges_the_unit_and_answers_what_it_did(root: Path) -> None:
    ctx = ctx_of(root, kernel(root), config='[host]\nsysctl_allow = "vm"\n')
    got = host_unit(call(ctx), HostUnit("sysctl", settings='{"vm.swappiness":10}'))
    assert got["unit"] == "sysctl" and got["changed"] is True
    assert got["steps"] == ["write /etc/sysctl.d/90-bcd.conf", "run sysctl -w vm.swappiness=10"]
    assert got["issues"] == [] and got["conditions"] == []
    assert (root / "etc/sysctl.d/90-bcd.conf").exists()
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "10"
    again = host_unit(call(ctx), HostUnit("sysctl", settings='{"vm.swappiness":10}'))
    assert again == {"unit": "sysctl", "changed": False, "steps": [], "issues": [], "conditions": []}
    clean = host_unit(call(ctx), HostUnit("sysctl", settings=None))
    assert clean["steps"] == ["remove /etc/sysctl.d/90-bcd.conf"] and clean["changed"] is True
    assert not (root / "etc/sysctl.d/90-bcd.conf").exists()


def test_host_unit_reports_issues_as_kind_and_message(root: Path) -> None:
    ctx = ctx_of(root)
    got = host_unit(call(ctx), HostUnit("sysctl", settings='{"vm.swappiness":10}'))
    assert got["issues"] == [
        {
            "kind": "retryable",
            "message": "sysctl: this kernel has no vm.swappiness (is the module that provides it loaded?)",
        }
    ]


def test_a_signed_host_unit_writes_roots_state_before_the_unit(
    root: Path, cp: ControlPlane, worker: Signer
) -> None:
    from bcd_helper.intent import STATE_PATH, IntentState
    from intentkit import host_body, intent

    ctx = signed_ctx(root, cp, kernel(root))
    settings = '{"vm.swappiness":10}'
    doc = intent(worker, host_body(NODE, 7, {"sysctl": settings}))
    signed_intent = hostunit.SignedIntent(doc["body"], doc["signature"], tuple(doc["chain"]), None)
    host_unit(call(ctx), HostUnit("sysctl", settings=settings, intent=signed_intent))
    state = IntentState.decode((root / STATE_PATH.lstrip("/")).read_bytes())
    assert state.generation == 7 and state.node_id == NODE
    refused_req = HostUnit("sysctl", settings='{"vm.swappiness":20}', intent=signed_intent)
    assert refused(host_unit, call(ctx), refused_req)[0] == "settings-mismatch"
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "10"


def test_a_presented_command_is_decoded_even_without_roots(root: Path, worker: Signer) -> None:
    import attrs

    bad = attrs.evolve(signed(worker, "gpu.reset", wire.GpuResetRequest(gpu_uuids=[GPU1])), chain=("A",))
    ctx = ctx_of(root, smi())
    assert refused(gpu_reset, call(ctx), GpuReset((GPU1,), bad)) == (
        "bad-intent",
        "gpu.reset: intent.command.chain[0] is not base64",
    )
    assert refused(node_reboot, call(ctx), NodeReboot(bad)) == (
        "bad-intent",
        "node.reboot: intent.command.chain[0] is not base64",
    )
    assert programs(ctx).runs == []


def test_every_busy_gpu_is_named(root: Path) -> None:
    ctx = ctx_of(root, smi(apps=f"{GPU1}, 11\n{GPU2}, 22\n".encode()))
    assert refused(gpu_reset, call(ctx), GpuReset((GPU1, GPU2))) == (
        "gpu-busy",
        f"gpu.reset: {GPU1} runs compute process 11; {GPU2} runs compute process 22",
    )


def test_a_reset_message_that_is_not_utf8_is_replaced(root: Path) -> None:
    ctx = ctx_of(root, smi(gpus=GPU1.encode(), reset={GPU1: (3, b"bad \xff byte")}))
    assert gpu_reset(call(ctx), GpuReset((GPU1,)))["gpus"][0]["message"] == "bad \ufffd byte"


def test_the_version_is_the_installed_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    assert host.helper_version() == md.version("bcd-helper")

    def missing(_name: str) -> str:
        raise md.PackageNotFoundError(_name)

    monkeypatch.setattr(md, "version", missing)
    assert host.helper_version() == "unknown"


# --- what host.unit hands a unit --------------------------------------------------------------------------


class Seen:
    """A stand-in unit and converge: what host.unit passes on, and a result with every field set."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def decode_settings(self, text: str) -> str:
        return f"decoded:{text}"

    def converge(self, unit: Any, settings: Any, system: Any, uctx: Any, actx: Any) -> Any:
        from types import SimpleNamespace as NS

        self.calls.append((unit, settings, system, uctx, actx))
        return NS(
            changed=True,
            steps_done=("one", "two"),
            issues=[NS(kind="retryable", message="m1")],
            conditions=[NS(type="RebootRequired", reason="Driver", message="m2")],
        )


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Seen:
    import bcd_shared.units

    s = Seen()
    monkeypatch.setattr(hostunit, "unit_registry", lambda: {"mig-layout": s, "kmod": s})
    monkeypatch.setattr(bcd_shared.units, "converge_unit", s.converge)
    return s


def test_host_unit_hands_the_unit_its_context_and_answers_its_result(root: Path, seen: Seen) -> None:
    """HST-HLP-06: a unit other than mig-layout gets the busy GPUs the node sent, as sent. HST-K8S-57: the
    unit's allowed clusters are root's config's (the request has no field for them)."""
    import bcd_shared.units as units

    pin = "b" * 64
    ctx = ctx_of(
        root,
        config=f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = 4242\n[kubernetes]\nallowed_clusters = "https://10.0.0.1:6443#sha256:{pin}"\n',
    )
    c = call(ctx)
    got = host_unit(c, HostUnit("kmod", settings="{}", busy_gpus=(GPU1, f"{GPU2}/gi1/ci0")))
    assert got == {
        "unit": "kmod",
        "changed": True,
        "steps": ["one", "two"],
        "issues": [{"kind": "retryable", "message": "m1"}],
        "conditions": [{"type": "RebootRequired", "reason": "Driver", "message": "m2"}],
    }
    ((unit, settings, system, uctx, actx),) = seen.calls
    assert unit is seen and settings == "decoded:{}" and system is c.system
    assert uctx == units.UnitContext(
        busy_gpus=frozenset({GPU1, f"{GPU2}/gi1/ci0"}),
        allowed_clusters=(units.ClusterPin("https://10.0.0.1:6443", pin),),
    )
    assert actx.guard == c.system.guard  # the bound method of the call's system
    assert isinstance(actx.tokens, units.StagedTokenSource) and actx.tokens.system is c.system
    host_unit(c, HostUnit("kmod", settings=None))
    assert seen.calls[-1][1] is None  # a clean: no settings decoded


def test_mig_layout_takes_roots_own_busy_gpus_and_all_known_when_any_mig_is_busy(
    root: Path, seen: Seen
) -> None:
    ctx = ctx_of(root, smi(apps=f"{GPU1}, 7\n".encode(), gpus=f"{GPU1}\n{GPU2}\n".encode()))
    host_unit(
        call(ctx), HostUnit("mig-layout", settings="{}", busy_gpus=(GPU3,))
    )  # the node's list is ignored
    assert seen.calls[-1][3].busy_gpus == frozenset({GPU1})
    mig = ctx_of(
        root, smi(apps=b"MIG-5f1c2a90-0000-4000-8000-000000000009, 8\n", gpus=f"{GPU1}\n{GPU2}\n".encode())
    )
    host_unit(call(mig), HostUnit("mig-layout", settings="{}"))
    assert seen.calls[-1][3].busy_gpus == frozenset({GPU1, GPU2})

    def no_smi(argv: tuple[str, ...]) -> tuple[int, bytes, bytes]:
        if argv == APPS:
            return 0, b"MIG-5f1c2a90-0000-4000-8000-000000000009, 8\n", b""
        return 127, b"", b""

    host_unit(call(ctx_of(root, no_smi)), HostUnit("mig-layout", settings="{}"))
    assert seen.calls[-1][3].busy_gpus == frozenset()
