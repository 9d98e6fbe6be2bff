"""Per-instance circuit breaker: an explicit state machine with an injected clock."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

__all__ = ["Breaker", "BreakerState"]


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Breaker:
    """Opens after ``threshold`` consecutive failures; after ``open_seconds`` lets
    one trial request through (half-open); that trial's outcome closes or reopens it.

    Decode outcomes are recorded when the stream ends, not when headers arrive, so a
    decode engine that answers 200 and then breaks still counts as failing.
    """

    def __init__(
        self, threshold: int, open_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._threshold = threshold
        self._open_seconds = open_seconds
        self._clock = clock
        self._failures = 0
        self._opened_at = 0.0
        self._state = BreakerState.CLOSED
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self._clock() - self._opened_at >= self._open_seconds
        ):
            self._state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    def allows(self) -> bool:
        """Whether a request may be sent now (does not consume the half-open trial)."""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._trial_in_flight
        )

    def on_dispatch(self) -> None:
        """Called when a request is sent: in half-open state it is the one trial."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record(self, success: bool) -> None:
        if success:
            self._failures = 0
            self._state = BreakerState.CLOSED
            self._trial_in_flight = False
            return
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self._threshold:
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._trial_in_flight = False
