"""The dispatcher's clock: the host clock, and server time through the Welcome offset.

The session sets the offset on every `Welcome` (server_time - host time at receipt); `not_after` is judged
on `server_now()` (DLV-ACK-10). The quorum's unbatched allowance counts on `host_time()`, the host's own
clock, which no gateway can move (DLV-QRM-03).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable


class OffsetClock:
    def __init__(self, host_time: Callable[[], float] = time.time, offset_s: float = 0.0) -> None:
        self._host_time = host_time
        self.offset_s = offset_s

    def set_offset(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def host_time(self) -> float:
        return self._host_time()

    def server_now(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self._host_time() + self.offset_s, tz=dt.UTC)
