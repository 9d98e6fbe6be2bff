"""Per-instance outlier detection: an explicit state machine with an injected clock.

In the style of Envoy's outlier detection, each outcome is judged by what it says
about the *engine* (:class:`~router.errors.Fault`), not merely failed or not:

======================  ========================================================
``REFUSED``             nothing listens there: ejected at once
``ENGINE``              timeout, reset, dropped stream, 502/503/504: ejected after
                        ``threshold`` in a row (consecutive gateway failures)
``ANSWER``              a 5xx answer to one request's content: ejected after
                        ``answer_threshold`` in a row, and only when the caller
                        says another instance of the role stays in rotation
                        (panic threshold: bad prompts never eject the last one)
``NONE``                4xx, 408/429, client gone: says nothing, counts nothing
======================  ========================================================

Any success resets both streaks: a 5xx that other requests on the same engine do
not get is the request's fault. An ejected instance (``OPEN``) lets one trial
request through after ``open_seconds`` (``HALF_OPEN``); the trial's outcome closes
or reopens it. A health probe that answers after the instance was refused, or after
a probe failed during the ejection (the engine was down and is back), ends the
ejection at once.

Every state change calls ``on_change`` (the owner's re-evaluation hook) and is
logged once as a ``key=value`` line (``event=ejected role=... engine=... reason=...``).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from router.errors import Fault

__all__ = ["Breaker", "BreakerState"]

log = logging.getLogger("pd_router.outliers")


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


def _nothing() -> None:
    pass


class Breaker:
    def __init__(
        self,
        threshold: int,
        open_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        answer_threshold: int | None = None,
    ) -> None:
        self._threshold = threshold
        self._answer_threshold = threshold if answer_threshold is None else answer_threshold
        self._open_seconds = open_seconds
        self._clock = clock
        self.name = "engine=?"  # for log lines; the owning Instance names it
        self.on_change: Callable[[], None] = _nothing
        self._engine_faults = 0
        self._answer_faults = 0
        self._opened_at = 0.0
        self._state = BreakerState.CLOSED
        self._trial_in_flight = False
        self._refused = False  # the ejection began with a refused connection
        self._probe_failed = False  # a health probe failed during the ejection

    # -- reading -------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self.reopens_at:
            self._half_open("ejection time over")
        return self._state

    @property
    def reopens_at(self) -> float:
        """When an ejection ends by itself (meaningful while ``OPEN``)."""
        return self._opened_at + self._open_seconds

    def allows(self) -> bool:
        """Whether a request may be sent now (does not consume the half-open trial)."""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._trial_in_flight
        )

    # -- events --------------------------------------------------------------

    def on_dispatch(self) -> None:
        """Called when a request is sent: in half-open state it is the one trial."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record(self, fault: Fault | None, *, may_eject: bool = True) -> None:
        """One outcome: ``None`` is a success. ``may_eject`` is False when ejecting
        this instance would leave its role with none in rotation (answers only)."""
        if fault is None:
            self._success()
        elif fault is Fault.REFUSED:
            self._eject("connection refused", refused=True)
        elif fault is Fault.ENGINE:
            self._engine_faults += 1
            if self._state is BreakerState.HALF_OPEN:
                self._eject("half-open trial failed")
            elif self._engine_faults >= self._threshold:
                self._eject(f"{self._engine_faults} engine faults in a row")
        elif fault is Fault.ANSWER:
            self._answer_faults += 1
            if self._answer_faults >= self._answer_threshold or (
                self._state is BreakerState.HALF_OPEN
            ):
                if may_eject:
                    self._eject(f"{self._answer_faults} error answers in a row")
                    return
                # The engine answered, so it is up: let the next trial through.
                self._trial_in_flight = False
                if self._answer_faults == self._answer_threshold:
                    log.warning(
                        "event=ejection_refused %s answers_5xx=%d reason=%r",
                        self.name,
                        self._answer_faults,
                        "last of its role in rotation (panic threshold)",
                    )
        else:
            # No verdict (a 4xx, the client left): a trial it was frees the next one.
            self._trial_in_flight = False

    def probe(self, ok: bool) -> None:
        """An active health probe's result; may end an ejection early."""
        if self._state is not BreakerState.OPEN:
            return
        if not ok:
            self._probe_failed = True
        elif self._refused or self._probe_failed:
            self._half_open("health probe answers again")

    # -- transitions ---------------------------------------------------------

    def _success(self) -> None:
        self._engine_faults = self._answer_faults = 0
        self._trial_in_flight = False
        if self._state is not BreakerState.CLOSED:
            self._state = BreakerState.CLOSED
            log.warning("event=breaker_closed %s reason=%r", self.name, "request succeeded")
            self.on_change()

    def _eject(self, reason: str, *, refused: bool = False) -> None:
        was = self._state
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._trial_in_flight = False
        self._refused = refused
        self._probe_failed = False
        if was is not BreakerState.OPEN:
            log.warning(
                "event=ejected %s seconds=%g reason=%r", self.name, self._open_seconds, reason
            )
            self.on_change()

    def _half_open(self, reason: str) -> None:
        self._state = BreakerState.HALF_OPEN
        self._trial_in_flight = False
        self._engine_faults = self._answer_faults = 0
        log.warning("event=breaker_half_open %s reason=%r", self.name, reason)
        self.on_change()
