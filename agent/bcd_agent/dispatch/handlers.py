"""Kind handlers: what runs a command of one kind on this agent.

The kind table (dispatch.kinds) says what a kind is; a handler registered with the dispatcher makes it
runnable here. A kind without a handler is `UNSUPPORTED` (DLV-KIND-01). A handler:

- declares the resources it acts on from its payload (`resources`: GPU UUIDs, disks, allocations), so
  the dispatcher's per-resource locks keep two lanes off the same device (DLV-LANE-08). A payload that
  does not decode raises `InvalidPayload` there already;
- runs in a lane worker (`run`): checks first, then `await ctx.begin_effect()` immediately before its
  first side effect, then the effect, and returns the kind's serialized result message.

`begin_effect` journals `running{boot_id}` (for self-terminating kinds this is the record that lets the
next boot tell the reboot it caused from a crash, DLV-JRN-17) and reports RUNNING. A cancel that arrives
before it wins (CANCELLED); after it, the command's real outcome is reported (DLV-CAN-05/06). A handler
that can stop between later actions may look at `ctx.cancel_requested`, but once the effect has begun
the outcome it returns is what is reported.

Failures: raise `CommandFailed(code, message)` for a kind-specific code (`gpu-busy`, ...),
`InvalidPayload` for `invalid-payload`; a bcd_shared.errors StepError fails with its reason; anything
else fails `internal`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from bcd_agent.dispatch.command import ERR_INVALID_PAYLOAD, CommandEnvelope


class CommandFailed(Exception):
    """The command failed with `code` (a FAILED error code) and a message for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidPayload(CommandFailed):
    """The payload is not the kind's request message, or breaks one of its rules."""

    def __init__(self, message: str) -> None:
        super().__init__(ERR_INVALID_PAYLOAD, message)


class CommandCancelled(Exception):
    """Raised by `begin_effect` when a cancel arrived before the side effect started."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RunContext(Protocol):
    """What a running handler may use (provided by the dispatcher)."""

    @property
    def boot_id(self) -> str: ...

    @property
    def cancel_requested(self) -> bool: ...

    async def begin_effect(self) -> None:
        """Journal `running{boot_id}` and report RUNNING; raises CommandCancelled if a cancel came first."""
        ...

    async def secret(self, ref: str) -> bytes:
        """The secret `ref` from the control plane's broker, bound to the command's workflow step
        (`workflow_id`, `step_id`, DLV-CMD-14): a command that names none gets `secret-unbound`."""
        ...


class Handler(Protocol):
    """Runs one kind on this agent."""

    def resources(self, command: CommandEnvelope) -> frozenset[str]:
        """Lock names (`gpu:<uuid>`, `disk:<path>`, `alloc:<id>`) the command acts on."""
        ...

    async def run(self, command: CommandEnvelope, ctx: RunContext) -> bytes:
        """Run the command; return the kind's serialized result message."""
        ...


Handlers = Mapping[str, Handler]


def gpu_resource(uuid: str) -> str:
    return f"gpu:{uuid}"


def disk_resource(path: str) -> str:
    return f"disk:{path}"


def allocation_resource(allocation_id: str) -> str:
    return f"alloc:{allocation_id}"
