"""Reconnect delays: capped exponential backoff with jitter (pure; the random draw is a parameter).

Attempt n (0 for the first retry after a failure) waits `min(max_s, initial_s * factor**n)` scaled into
`[1 - jitter, 1]` by the draw, so a fleet that lost its gateway at the same moment does not come back in
lockstep, and no delay ever exceeds `max_s`. A session that reached Welcome resets the attempt count.
"""

from __future__ import annotations

from attrs import frozen


@frozen
class Backoff:
    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.5

    def __attrs_post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s and self.factor >= 1 and 0 <= self.jitter <= 1):
            raise ValueError(f"backoff: bad parameters {self}")

    def ceiling(self, attempt: int) -> float:
        """The delay before jitter for attempt `attempt` (0-based), capped at max_s."""
        if attempt < 0:
            raise ValueError("attempt must not be negative")
        # Past ~64 doublings the float overflows; the cap is reached long before.
        return min(self.max_s, self.initial_s * self.factor ** min(attempt, 64))

    def delay(self, attempt: int, draw: float) -> float:
        """The delay for `attempt` with the uniform draw `draw` in [0, 1)."""
        if not 0 <= draw <= 1:
            raise ValueError("draw must be in [0, 1]")
        top = self.ceiling(attempt)
        return top * (1 - self.jitter * draw)
