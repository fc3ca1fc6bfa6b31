"""Node conditions the session itself raises (not a section's): `DataDirFull`, `JournalTailLost`.

The session adds them to every StatusReport beside the runner's conditions, and a change makes it send
a report at once. At most one per type; `version` moves on every change.
"""

from __future__ import annotations

from bcd_agent.converge.types import Condition

DATA_DIR_FULL = "DataDirFull"
JOURNAL_TAIL_LOST = "JournalTailLost"


class NodeConditions:
    def __init__(self) -> None:
        self._by_type: dict[str, Condition] = {}
        self.version = 0

    def raise_(self, type: str, reason: str, message: str, now_monotonic: float) -> None:
        held = self._by_type.get(type)
        since = held.since_monotonic if held is not None else now_monotonic
        new = Condition(type=type, reason=reason, message=message, since_monotonic=since)
        if held != new:
            self._by_type[type] = new
            self.version += 1

    def clear(self, type: str) -> None:
        if self._by_type.pop(type, None) is not None:
            self.version += 1

    def active(self) -> tuple[Condition, ...]:
        return tuple(self._by_type.values())

    def has(self, type: str) -> bool:
        return type in self._by_type
