"""The allocation events: domain values, and their wire form (attested reports signed with the node key).

AllocationBound and AllocationReleased travel as `AttestedReport{body, signature}`: `body` is the
serialized `AttestedReportBody` (node id, boot id, the report), signed under purpose
`attested-report`; the exact body bytes are what the sink journals and sends (never re-encoded).
AllocationFailed is a plain event. `EventSink.emit` must journal the event durably before it returns
(DEV-EVT-03); the journal replays it until acknowledged.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from attrs import frozen
from bcd_shared import wire
from bcd_shared.pki import KeyPair, Purpose


@frozen
class BoundEvent:
    allocation_id: str
    reservation_id: str
    generation: int
    device_ids: tuple[str, ...]
    cdi_devices: tuple[str, ...]
    cdi_spec_path: str
    env_file: str
    cgroup_parent: str  # "" unless sliced
    kubernetes: bool = False


@frozen
class ReleasedEvent:
    allocation_id: str
    reservation_id: str
    generation: int
    device_ids: tuple[str, ...]
    kubernetes: bool = False


@frozen
class FailedEvent:
    allocation_id: str
    reservation_id: str
    generation: int
    reason: str
    message: str
    device_ids: tuple[str, ...] = ()


AllocationEvent = BoundEvent | ReleasedEvent | FailedEvent


@frozen
class SignedReport:
    """An attested report as it is journaled and sent: the exact body bytes and the node's signature."""

    type: str  # "AllocationBound" or "AllocationReleased"
    body: bytes
    signature: bytes
    event: BoundEvent | ReleasedEvent

    def to_wire(self) -> wire.AttestedReport:
        return wire.AttestedReport(body=self.body, signature=self.signature)


@frozen
class PlainEvent:
    type: str  # "AllocationFailed"
    payload: bytes
    event: FailedEvent


class ReportSigner(Protocol):
    """The node key and identity (the node's KeyPair and ids; tests pass a fresh KeyPair)."""

    @property
    def node_id(self) -> str: ...

    @property
    def boot_id(self) -> str: ...

    def sign(self, purpose: Purpose, data: bytes) -> bytes: ...


@frozen
class KeyReportSigner:
    """A ReportSigner over a KeyPair: bcd node's key, or a fresh one (`fresh`) in benches and tests."""

    key: KeyPair
    node_id: str
    boot_id: str

    @classmethod
    def fresh(cls, node_id: str, boot_id: str) -> KeyReportSigner:
        return cls(KeyPair.generate(), node_id, boot_id)

    def sign(self, purpose: Purpose, data: bytes) -> bytes:
        return self.key.sign(purpose, data)


class EventSink(Protocol):
    """Journals an event durably before returning (then the session sends it until acknowledged).

    `key`: the event is journaled at most once per key (a second emit with a remembered key journals
    nothing), until `forget_keys` drops the key. The devices section keys each AllocationReleased and
    AllocationBound, so that a release or bind a crash interrupted after its event was journaled sends
    nothing more on the next pass (docs/devices.md, "Releases across a crash", "Binds across a crash")."""

    def emit(self, event: SignedReport | PlainEvent, key: str | None = None) -> None: ...

    def event_keys(self, prefix: str) -> frozenset[str]:
        """The remembered keys that start with `prefix`."""
        ...

    def forget_keys(self, keys: Collection[str]) -> None: ...


def _binding(kubernetes: bool) -> wire.Binding:
    return wire.Binding.KUBERNETES if kubernetes else wire.Binding.HOLD


def bound_to_wire(e: BoundEvent) -> wire.AllocationBound:
    return wire.AllocationBound(
        allocation_id=e.allocation_id,
        reservation_id=e.reservation_id,
        generation=e.generation,
        device_ids=list(e.device_ids),
        cdi_devices=list(e.cdi_devices),
        cdi_spec_path=e.cdi_spec_path,
        env_file=e.env_file,
        cgroup_parent=e.cgroup_parent,
        binding=_binding(e.kubernetes),
    )


def released_to_wire(e: ReleasedEvent) -> wire.AllocationReleased:
    return wire.AllocationReleased(
        allocation_id=e.allocation_id,
        reservation_id=e.reservation_id,
        generation=e.generation,
        device_ids=list(e.device_ids),
        binding=_binding(e.kubernetes),
    )


def sign_report(signer: ReportSigner, event: BoundEvent | ReleasedEvent) -> SignedReport:
    if isinstance(event, BoundEvent):
        body = wire.AttestedReportBody(
            node_id=signer.node_id, boot_id=signer.boot_id, allocation_bound=bound_to_wire(event)
        )
        kind = "AllocationBound"
    else:
        body = wire.AttestedReportBody(
            node_id=signer.node_id, boot_id=signer.boot_id, allocation_released=released_to_wire(event)
        )
        kind = "AllocationReleased"
    data = bytes(body)
    return SignedReport(kind, data, signer.sign(Purpose.ATTESTED_REPORT, data), event)


def failed_event(event: FailedEvent) -> PlainEvent:
    msg = wire.AllocationFailed(
        allocation_id=event.allocation_id,
        reservation_id=event.reservation_id,
        generation=event.generation,
        reason=event.reason,
        message=event.message,
        device_ids=list(event.device_ids),
    )
    return PlainEvent("AllocationFailed", bytes(msg), event)


class MemorySink:
    """An EventSink that keeps events in a list (tests, `bcd plan`); nothing is durable."""

    def __init__(self) -> None:
        self.events: list[SignedReport | PlainEvent] = []
        self.remembered: set[str] = set()

    def emit(self, event: SignedReport | PlainEvent, key: str | None = None) -> None:
        if key is not None:
            if key in self.remembered:
                return
            self.remembered.add(key)
        self.events.append(event)

    def event_keys(self, prefix: str) -> frozenset[str]:
        return frozenset(k for k in self.remembered if k.startswith(prefix))

    def forget_keys(self, keys: Collection[str]) -> None:
        self.remembered -= set(keys)
