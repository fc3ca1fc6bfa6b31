"""Events between the sections, the journal and the session (DLV-EVT-01..04).

`JournalEventSink` is the EventSink the sections are given: it journals each event durably before
returning (the journal assigns its seq, from 1 per journal_id) and wakes the session. The journal row's
payload is the serialized wire `Event` without its seq (class, type, the attested report or plain
payload, the boot id): the attested report's signed body travels inside as exact bytes, so re-encoding
the outer Event never touches what the node key signed. `wire_event` turns a journal row back into the
wire Event with its seq; the session sends them in EventBatches until acked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from bcd_shared import wire
from bcd_shared.wire.strict import decode

from bcd_agent.journal import Event, EventClass, Journal

_CLASSES = {
    EventClass.METRIC: wire.EventClass.METRIC,
    EventClass.TRANSITION: wire.EventClass.TRANSITION,
    EventClass.RESULT: wire.EventClass.RESULT,
}


class JournalEventSink:
    """sections' EventSink over the journal. `wake` is called after every append (thread-safe callers:
    the session's `events_changed`)."""

    def __init__(self, journal: Journal, boot_id: str, wake: Callable[[], None] = lambda: None) -> None:
        self._journal = journal
        self._boot_id = boot_id
        self.wake = wake

    def emit(self, event: object, key: str | None = None) -> None:
        # Duck-typed on the devices section's SignedReport (to_wire) and PlainEvent (payload).
        type_name = str(getattr(event, "type"))  # noqa: B009
        to_wire = getattr(event, "to_wire", None)
        if callable(to_wire):
            report = to_wire()
            assert isinstance(report, wire.AttestedReport)
            message = wire.Event(
                event_class=wire.EventClass.RESULT, type=type_name, attested=report, boot_id=self._boot_id
            )
        else:
            payload = bytes(getattr(event, "payload"))  # noqa: B009
            message = wire.Event(
                event_class=wire.EventClass.RESULT, type=type_name, payload=payload, boot_id=self._boot_id
            )
        self.append(EventClass.RESULT, type_name, message, key)

    def event_keys(self, prefix: str) -> frozenset[str]:
        """The journal's remembered event keys that start with `prefix`."""
        return frozenset(self._journal.event_keys(prefix))

    def forget_keys(self, keys: Collection[str]) -> None:
        """Forget idempotency keys (the journal's `forget_event_keys`)."""
        self._journal.forget_event_keys(keys)

    def append(self, cls: EventClass, type_name: str, message: wire.Event, key: str | None = None) -> int:
        """Journal one event (`key`: at most once per key; see Journal.append_event)."""
        seq = self._journal.append_event(cls, type_name, bytes(message), key)
        self.wake()
        return seq


def wire_event(event: Event) -> wire.Event:
    """The wire Event of a journal row (its stored Event, with the journal's seq)."""
    try:
        message = decode(wire.Event, event.payload)
    except ValueError:
        # A row not written by JournalEventSink: send it as a plain payload of its type.
        message = wire.Event(event_class=_CLASSES[event.cls], type=event.type, payload=event.payload)
    message.seq = event.seq
    return message
