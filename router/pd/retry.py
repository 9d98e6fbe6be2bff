"""Attempts of one dispatch: which failures are retried, where, and after how long.

:class:`Retrier` runs an attempt until one succeeds or a failure cannot be helped by
another: the error is retryable, attempts are left, and another engine of the failing role
is in rotation (a timeout or refusal is never retried on the same, only engine). Each retry
avoids the engines that failed, after an exponential backoff with jitter. The engines'
breakers are judged by the legs (``pool.record``), not here.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from router.config import RetryConfig, split_engine_key
from router.engines.instance import Instance
from router.errors import Fault, UpstreamError
from router.lifecycle import Lifecycle
from router.registry import ModelPool

__all__ = ["ATTEMPT", "Retrier"]

ATTEMPT = "attempt"  # the phase of one attempt

log = logging.getLogger("pd_router.dispatch")

T = TypeVar("T")


class Retrier:
    def __init__(self, retries: RetryConfig, lifecycle: Lifecycle) -> None:
        self._retries = retries
        self._events = lifecycle

    async def run(
        self,
        pool: ModelPool,
        attempt: Callable[[frozenset[Instance]], Awaitable[T]],
        client_id: str,
        avoid: frozenset[Instance] = frozenset(),
    ) -> T:
        """``attempt(avoid)``'s result, retried as the module doc says; raises the last
        attempt's error. ``client_id`` appears in log lines only."""
        attempts = self._retries.max_attempts
        for n in range(1, attempts + 1):
            try:
                with self._events.phase(ATTEMPT, {"pdrouter.attempt": n}):
                    return await attempt(avoid)
            except UpstreamError as exc:
                self._events.attempt_failed(pool.name, exc.role, str(exc.code))
                avoid = avoid | _failed(pool, exc)
                retry = exc.retryable and n < attempts and pool.has_alternative(exc.role, avoid)
                _log_failed_attempt(exc, client_id, n, retry)
                if not retry:
                    raise
                self._events.retried(pool.name, n)
                await asyncio.sleep(self._backoff(n))
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, attempt: int) -> float:
        r = self._retries
        base = min(r.backoff_max, r.backoff_initial * (2.0 ** (attempt - 1)))
        jitter: float = random.uniform(0.8, 1.2)
        return base * jitter


def _log_failed_attempt(exc: UpstreamError, client_id: str, attempt: int, retry: bool) -> None:
    log.warning(
        "event=attempt_failed request_id=%s client_id=%s attempt=%d role=%s "
        "engine=%s reason=%r cause=%r retry=%s",
        exc.request_id,
        client_id,
        attempt,
        exc.role,
        exc.engine,
        exc.message,
        str(exc.__cause__ or exc.code),
        "yes" if retry else "no",
    )


def _failed(pool: ModelPool, exc: UpstreamError) -> set[Instance]:
    """The engines a retry avoids after ``exc``: the one that failed; where nothing listened
    at its URL, every data-parallel rank behind that URL too (one API server serves them all)."""
    url = split_engine_key(exc.engine)[0] if exc.fault is Fault.REFUSED else None
    return {i for i in (*pool.prefill, *pool.decode) if i.key == exc.engine or i.url == url}
