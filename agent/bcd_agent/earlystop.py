"""SIGTERM or SIGINT before `bcd node` has its trio signal receiver: remembered, then honoured.

`bcd` installs an EarlyStop for `bcd node` before it imports the node (about 0.3 s of imports, then the
journal and identity); until trio's signal receiver takes over, a signal would otherwise kill the process
with the default action (exit -15, not 0). `bcd_agent.node.run` finds the EarlyStop still installed and,
once its receiver is in place, stops at once (exit 0) if a signal came in meanwhile.
"""

from __future__ import annotations

import signal
from types import FrameType


class EarlyStop:
    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)

    def install(self) -> EarlyStop:
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)
        return self


def installed() -> EarlyStop | None:
    """The EarlyStop handling SIGTERM now, if any."""
    handler = signal.getsignal(signal.SIGTERM)
    return handler if isinstance(handler, EarlyStop) else None
