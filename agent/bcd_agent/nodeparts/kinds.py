"""The handlers of `gpu.reset`, `diag.nvml` and `node.reboot` (delivery.md "Kinds by lane").

- `gpu.reset` (control; attested, destructive): `GpuResetRequest`; an empty list, or a GPU named twice, is
  `invalid-payload`. Locks `gpu:<uuid>` of each GPU. Checks first: a GPU a live hold, a pending Kubernetes
  release or the unknown-release marker claims fails the whole command `gpu-busy` naming them, before any
  effect (DEV-BUSY-02..09; bcd_agent.sections.devices.busy). Then RUNNING, and the reset core
  (`busy.gpu_reset`): each known GPU reset with `nvidia-smi --gpu-reset -i <uuid>` through the System as
  root / on the simulated host, or one by one through the helper's `gpu.reset` op beside `bcd helper`
  (root checks busy again: its `gpu-busy` fails the command the same way); a GPU nvidia-smi does not list
  is `reset: false, "unknown GPU"`; health read again after the reset. Result `GpuResetResult`, told to
  `on_reset` (the XID watcher) before it goes out: a GPU that reset and reads healthy loses its XID
  conditions at once (DLV-RST-14, DEV-BUSY-12; nodeparts.xid).
- `diag.nvml` (control; retry-safe, attested): `DiagNvmlRequest`; no locks; RUNNING, then each GPU's
  health from a fresh inventory (bcd_agent.inventory.handlers.diag_nvml), with the XID codes the watcher
  saw for it this boot (`xids`), and a GPU with XIDs nvidia-smi no longer lists. Result `DiagNvmlResult`.
- `node.reboot` (control; retry-safe, self-terminating, destructive): `NodeRebootRequest`; the reason is
  logged. `begin_effect` journals `running{boot_id}` right before the effect (DLV-JRN-17), then the reboot:
  the helper's `node.reboot` op beside `bcd helper` (DLV-PRIV-09), else `systemctl reboot` through the
  System (root, or the simulated host's systemctl, which records it). The command is completed by the next
  boot: `journal.recover` finds it running from another boot and reports SUCCEEDED `rebooted` with the
  previous boot id (DLV-REC-07/17). Until the host goes down the handler waits; if it is still up after
  `wait_s` the command fails `reboot-timeout` (the host did not reboot). A refused or failed reboot
  request fails the command with the helper's reason or `systemctl`.

Under the helper both forward the signed Command (body bytes exactly as received, signature, signer chain
with its root appended from the node's trust bundle when the chain stops below it, and that bundle):
with command-signing roots root re-validates it (issue 9 item 10; docs/helper-rpc.md).

The dispatcher signs the results of attested kinds (NodeResultSigner) and journals every outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio
from bcd_shared import wire
from bcd_shared.errors import HelperRefused
from bcd_shared.system import CommandResult, System

from bcd_agent.dispatch.command import CommandEnvelope
from bcd_agent.dispatch.handlers import CommandFailed, InvalidPayload, RunContext, gpu_resource
from bcd_agent.dispatch.payload import decode_request

log = logging.getLogger("bcd.kinds")


def no_bundle() -> bytes | None:
    return None


def command_arg(command: CommandEnvelope, signed_bundle: bytes | None) -> dict[str, Any]:
    """The helper's `command` argument: the signed Command as received (docs/helper-rpc.md)."""
    import base64

    from bcd_agent.sections.host.intent import _with_root

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    return {
        "body": b64(command.body_bytes),
        "signature": b64(command.signature),
        "chain": [b64(c) for c in _with_root(tuple(command.signer_chain), signed_bundle)],
        "trust_bundle": None if signed_bundle is None else b64(signed_bundle),
    }


GPU_RESET = "gpu.reset"
DIAG_NVML = "diag.nvml"
NODE_REBOOT = "node.reboot"
REBOOT_WAIT_S = 600.0


def _gpu_uuids(command: CommandEnvelope) -> tuple[str, ...]:
    request = decode_request(command, wire.GpuResetRequest)
    uuids = tuple(request.gpu_uuids)
    if not uuids:
        raise InvalidPayload("payload.gpu_uuids: must name at least one GPU")
    twice = sorted({u for u in uuids if uuids.count(u) > 1})
    if twice:
        raise InvalidPayload(f"payload.gpu_uuids: names {', '.join(twice)} more than once")
    return uuids


class GpuResetHandler:
    def __init__(
        self,
        system: System,
        data_dir: str,
        helper: Any | None = None,
        trust_bundle: Callable[[], bytes | None] = no_bundle,
        on_reset: Callable[[wire.GpuResetResult], Awaitable[None]] | None = None,
        vfio: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.system = system
        self.data_dir = data_dir
        self.helper = helper  # a HelperClient beside bcd helper, else None
        self.trust_bundle = trust_bundle  # the serialized SignedTrustBundle the node holds
        self.on_reset = on_reset  # the XID watcher's gpus_reset
        # GPU uuid -> the instance it is passed through to (the instances section's map): such a GPU is
        # busy (DEV-BUSY-05); nvidia-smi no longer lists it, so no file bcd reads would say so.
        self.vfio = vfio

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        return frozenset(gpu_resource(u) for u in _gpu_uuids(command))

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        from bcd_agent.sections.devices import busy

        uuids = _gpu_uuids(command)
        state = await trio.to_thread.run_sync(busy.read_busy, self.system, self.data_dir, dict(self.vfio()))
        try:
            busy.check_not_busy(uuids, state)
        except busy.GpuBusy as exc:
            raise CommandFailed(busy.GPU_BUSY, exc.message) from None
        await ctx.begin_effect()
        reset: Callable[[str], CommandResult] | None = None
        if self.helper is not None:
            signed = command_arg(command, self.trust_bundle())

            def reset(uuid: str) -> CommandResult:
                return self._helper_reset(uuid, signed)

        try:
            result = await trio.to_thread.run_sync(busy.gpu_reset, self.system, uuids, state, reset)
        except busy.GpuBusy as exc:
            raise CommandFailed(busy.GPU_BUSY, exc.message) from None
        if self.on_reset is not None:
            await self.on_reset(result)
        return bytes(result)

    def _helper_reset(self, uuid: str, signed: dict[str, Any] | None = None) -> CommandResult:
        from bcd_agent.sections.devices import busy

        argv = ("helper", "gpu.reset", uuid)
        try:
            gpus = self.helper.gpu_reset([uuid], signed)  # type: ignore[union-attr]
        except HelperRefused as exc:
            if exc.reason == busy.GPU_BUSY:
                raise busy.GpuBusy(exc.message) from None
            return CommandResult(argv, 1, b"", exc.message.encode())
        answer = next((g for g in gpus if isinstance(g, dict) and g.get("uuid") == uuid), None)
        if answer is not None and answer.get("reset") is True:
            return CommandResult(argv, 0, b"", b"")
        message = str(answer.get("message", "")) if answer is not None else "the helper did not answer for it"
        return CommandResult(argv, 1, b"", message.encode())


class DiagNvmlHandler:
    def __init__(
        self, system: System, xids: Callable[[], Mapping[str, tuple[int, ...]]] | None = None
    ) -> None:
        self.system = system
        self.xids = xids  # the XID watcher's by_gpu: each GPU's codes this boot

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        decode_request(command, wire.DiagNvmlRequest)
        return frozenset()

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        from bcd_agent.inventory.handlers import diag_nvml

        decode_request(command, wire.DiagNvmlRequest)
        await ctx.begin_effect()
        result = await trio.to_thread.run_sync(diag_nvml, self.system)
        if self.xids is not None:
            result = with_xids(result, self.xids())
        return bytes(result)


def with_xids(result: wire.DiagNvmlResult, xids: Mapping[str, tuple[int, ...]]) -> wire.DiagNvmlResult:
    """Each GPU's XID codes this boot (`xids`: UUID -> codes, the watcher's `by_gpu`) in `xids`, named in
    its message. Health itself stays gpu.reset's ECC and row-remap judgment (DEV-BUSY-10). A GPU with
    XIDs that nvidia-smi no longer lists (XID 79: it fell off the bus) is added, not healthy."""
    from bcd_agent.inventory.xid import describe

    def seen(codes: tuple[int, ...]) -> str:
        return "XIDs this boot: " + ", ".join(describe(c) for c in codes)

    listed = set()
    for g in result.gpus:
        listed.add(g.uuid)
        codes = xids.get(g.uuid, ())
        g.xids = list(codes)
        if codes:
            g.message = f"{g.message}; {seen(codes)}" if g.message else seen(codes)
    for uuid, codes in sorted(xids.items()):
        if uuid not in listed and uuid.startswith("GPU-") and codes:
            result.gpus.append(
                wire.GpuHealth(
                    uuid=uuid,
                    healthy=False,
                    xids=list(codes),
                    message=f"not listed by nvidia-smi; {seen(codes)}",
                )
            )
    return result


class NodeRebootHandler:
    def __init__(
        self,
        system: System,
        helper: Any | None = None,
        wait_s: float = REBOOT_WAIT_S,
        trust_bundle: Callable[[], bytes | None] = no_bundle,
    ) -> None:
        self.system = system
        self.helper = helper
        self.trust_bundle = trust_bundle
        self.wait_s = wait_s
        self.requested = 0

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        decode_request(command, wire.NodeRebootRequest)
        return frozenset()

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        request = decode_request(command, wire.NodeRebootRequest)
        why = request.reason or "(no reason given)"
        log.warning("node.reboot %s: rebooting the host: %s", command.id, why)
        await ctx.begin_effect()  # running{boot_id}, durable, right before the effect (DLV-JRN-17)
        if self.helper is not None:
            try:
                signed = command_arg(command, self.trust_bundle())
                await trio.to_thread.run_sync(self.helper.node_reboot, signed)
            except HelperRefused as exc:
                raise CommandFailed(exc.reason, exc.message) from None
        else:
            result = await trio.to_thread.run_sync(
                lambda: self.system.run(["systemctl", "reboot"], timeout=60)
            )
            if not result.ok:
                raise CommandFailed("systemctl", result.describe())
        self.requested += 1
        # The next boot completes the command (SUCCEEDED `rebooted`); wait for the host to go down.
        await trio.sleep(self.wait_s)
        raise CommandFailed(
            "reboot-timeout", f"the host was still up {self.wait_s:g} s after the reboot request"
        )
