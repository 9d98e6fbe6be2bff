"""Per-key limits: requests per second (a token bucket) and requests in flight.

One :class:`Limiter` per router process owns every key's counters; a key's limits are its
own (``auth.keys[].limits``) or ``limits.per_key``. Refusals are :class:`RateLimited`
(429 with ``Retry-After``): ``rate_limit_exceeded`` when the bucket is empty, with the
time until its next token, and ``concurrency_limit_exceeded`` when the key already has
``max_concurrent`` requests in flight. With ``--workers N`` each worker counts for itself,
so a key may use up to N times its limits (set them per worker).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from router.config import KeyLimits
from router.errors import RateLimited

__all__ = ["Lease", "Limiter", "TokenBucket"]

# Retry-After of a concurrency refusal: nothing says when a stream ends; one second is
# what a client's backoff would start with.
_CONCURRENCY_RETRY_S = 1.0


class TokenBucket:
    """``rate`` tokens per second, at most ``size`` kept; starts full."""

    def __init__(self, rate: float, size: int, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._size = float(size)
        self._clock = clock
        self._tokens = float(size)
        self._at = clock()

    def take(self) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there will be."""
        now = self._clock()
        self._tokens = min(self._size, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self._rate


@dataclass(eq=False, slots=True)
class _KeyState:
    limits: KeyLimits
    bucket: TokenBucket | None
    in_flight: int = 0


class Lease:
    """One request in flight for a key; :meth:`release` (idempotent) gives it back."""

    __slots__ = ("_state", "released")

    def __init__(self, state: _KeyState) -> None:
        self._state = state
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._state.in_flight -= 1


class Limiter:
    def __init__(
        self,
        default: KeyLimits,
        own: Mapping[str, KeyLimits | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``own``: the limits each named key has of its own (None: ``default``)."""
        self._default = default
        self._own = dict(own)
        self._clock = clock
        self._states: dict[str, _KeyState] = {}

    def _state(self, key: str) -> _KeyState:
        state = self._states.get(key)
        if state is None:
            limits = self._own.get(key) or self._default
            rate = limits.requests_per_second
            bucket = TokenBucket(rate, limits.bucket_size, self._clock) if rate else None
            state = self._states[key] = _KeyState(limits, bucket)
        return state

    def in_flight(self, key: str) -> int:
        return self._state(key).in_flight

    def charge(self, key: str) -> None:
        """Count one request against ``key``'s rate; raises :class:`RateLimited`."""
        bucket = self._state(key).bucket
        if bucket is None:
            return
        wait = bucket.take()
        if wait > 0:
            rate = self._state(key).limits.requests_per_second
            raise RateLimited(
                f"API key {key!r} is over its limit of {rate:g} requests per second",
                "rate_limit_exceeded",
                retry_after=math.ceil(wait),
            )

    def acquire(self, key: str) -> Lease:
        """A request in flight for ``key`` until the lease is released; raises
        :class:`RateLimited` when the key already has ``max_concurrent``."""
        state = self._state(key)
        cap = state.limits.max_concurrent
        if cap is not None and state.in_flight >= cap:
            raise RateLimited(
                f"API key {key!r} already has {cap} requests in flight, its limit",
                "concurrency_limit_exceeded",
                retry_after=_CONCURRENCY_RETRY_S,
            )
        state.in_flight += 1
        return Lease(state)
