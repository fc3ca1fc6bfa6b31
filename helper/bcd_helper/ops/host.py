"""gpu.reset, node.reboot and helper.ping: whole-host actions with root's own checks.

gpu.reset (delivery.md "gpu.reset and live holds"; DLV-PRIV-09): 1 to 64 distinct GPU UUIDs. Root
reads the busy GPUs itself (bcd_helper.busy, with `passthrough`): a GPU a live hold or env file names,
one with compute processes, or one a VM has through VFIO (bound to vfio-pci, in an IOMMU group with a
device bound to it, or named by a libvirt definition root staged) refuses the whole request
(`gpu-busy`, naming the hold, process or instance), so a reset never pulls a GPU from under a workload.
A GPU nvidia-smi does not list (one already on vfio-pci among them) comes back `reset: false,
message: unknown GPU`: no reset runs for it. Each other GPU is reset with
`nvidia-smi --gpu-reset -i <uuid>`; a failure is that GPU's message.

Signed commands (issue 9 item 10): with command-signing roots (bcd_helper.intent: pins, root's join record,
a presented bundle), both ops need the signed Command the node received (`command`: body, signature,
chain, trust_bundle, base64) and re-validate it: its signature, kind, node and `not_after`
(IntentVerifier.check_command), and for gpu.reset every GPU asked for must be named in the command's
GpuResetRequest. Where nothing names roots, root acts on the request alone (HST-SIGN-33).
Root acts on a signed command once (bcd_helper.usedcommands): gpu.reset once per GPU it names,
node.reboot once; a replay before its `not_after` is refused (`command-replayed`).

node.reboot: root's own busy check is the helper's locks: a reboot never starts while a host.unit
(a driver install, a MIG change) or a daemon.swap is running (`busy`); then `systemctl reboot`.
"""

from __future__ import annotations

import re
import time
from typing import Any

from attrs import frozen

from bcd_helper.busy import BusyUnknown, busy_gpus, known_gpus
from bcd_helper.ops.base import Call, Failed, Refused, no_roots_possible

GPU_UUID_RE = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
MAX_RESET = 64


@frozen
class SignedCommand:
    """The Command the node received, as the node forwards it (base64)."""

    body: str
    signature: str
    chain: tuple[str, ...] = ()
    trust_bundle: str | None = None


@frozen
class GpuReset:
    gpu_uuids: tuple[str, ...]
    command: SignedCommand | None = None


@frozen
class NodeReboot:
    command: SignedCommand | None = None


def _payload(op: str, body: Any, cls: type[Any]) -> Any:
    from bcd_shared.wire.strict import WireError, unpack_any

    try:
        return unpack_any(body.payload, cls)
    except WireError as exc:
        raise Refused("command-mismatch", f"{op}: the signed command's payload: {exc}") from None


@frozen
class Ping:
    pass


def _now_ms() -> int:
    return int(time.time() * 1000)


def gpu_reset(call: Call, req: GpuReset) -> dict[str, Any]:
    if not req.gpu_uuids:
        raise Refused("invalid-payload", "gpu.reset: no GPU named")
    if len(req.gpu_uuids) > MAX_RESET:
        raise Refused("invalid-payload", f"gpu.reset: at most {MAX_RESET} GPUs")
    if len(set(req.gpu_uuids)) != len(req.gpu_uuids):
        raise Refused("invalid-payload", "gpu.reset: a GPU is listed twice")
    for i, uuid in enumerate(req.gpu_uuids):
        if not GPU_UUID_RE.fullmatch(uuid):
            raise Refused("invalid-payload", f"gpu_uuids[{i}]: {uuid!r} is not a GPU UUID")
    signed = None
    if not no_roots_possible(call.ctx, req.command):
        signed = call.ctx.intent_verifier().check_command("gpu.reset", req.command)
    if signed is not None:
        from bcd_shared.wire import GpuResetRequest

        named = set(_payload("gpu.reset", signed, GpuResetRequest).gpu_uuids)
        outside = [u for u in req.gpu_uuids if u not in named]
        if outside:
            raise Refused(
                "command-mismatch",
                f"gpu.reset: the signed command does not name {', '.join(outside)}",
            )
        call.ctx.intent_verifier().used.check("gpu.reset", signed.id, req.gpu_uuids, _now_ms())
    try:
        busy = busy_gpus(call.system, passthrough=True)
        known = known_gpus(call.system)
    except BusyUnknown as exc:
        raise Failed("busy-unknown", f"gpu.reset: {exc}") from None
    reasons = [r for r in (busy.reason(u) for u in req.gpu_uuids) if r]
    if reasons:
        raise Refused("gpu-busy", "gpu.reset: " + "; ".join(reasons))
    if signed is not None:  # durable before effect: each GPU is reset once under a command
        call.ctx.intent_verifier().used.remember(
            "gpu.reset", signed.id, req.gpu_uuids, signed.not_after, _now_ms()
        )
    out = []
    for uuid in req.gpu_uuids:
        if known is not None and uuid not in known:
            out.append({"uuid": uuid, "reset": False, "message": "unknown GPU"})
            continue
        result = call.system.run(["nvidia-smi", "--gpu-reset", "-i", uuid], timeout=300)
        text = (result.stdout + result.stderr).decode(errors="replace").strip()
        out.append(
            {"uuid": uuid, "reset": result.ok, "message": "" if result.ok else (text or result.describe())}
        )
    return {"gpus": out}


def node_reboot(call: Call, req: NodeReboot) -> dict[str, Any]:
    signed = None
    if not no_roots_possible(call.ctx, req.command):
        signed = call.ctx.intent_verifier().check_command("node.reboot", req.command)
    if signed is not None:
        from bcd_shared.wire import NodeRebootRequest

        _payload("node.reboot", signed, NodeRebootRequest)
        # Durable before effect: a command reboots the machine once, never again on a replay.
        call.ctx.intent_verifier().used.remember("node.reboot", signed.id, ("",), signed.not_after, _now_ms())
    result = call.system.run(["systemctl", "reboot"], timeout=60)
    if not result.ok:
        raise Failed("systemctl", result.describe())
    return {"rebooting": True}


def helper_version() -> str:
    """The installed bcd-helper's version (package metadata); "unknown" outside an install."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bcd-helper")
    except PackageNotFoundError:
        return "unknown"


def ping(call: Call, _req: Ping) -> dict[str, Any]:
    # The version lets `bcd doctor` tell a helper left at another release from the node's.
    if call.ctx.version is None:  # two first pings at once both read it: the same value
        call.ctx.version = helper_version()
    return {"peer_uid": call.peer.uid, "host_units": call.ctx.config.host_units, "version": call.ctx.version}
