"""A clock a test moves by hand, for whatever takes a ``clock`` callable."""

from __future__ import annotations


class Clock:
    """``clock()`` reads ``now``; the test sets it, or moves it with :meth:`advance`."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
