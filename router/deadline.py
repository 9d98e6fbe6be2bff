"""A deadline for a block of the current task: ``asyncio.timeout``'s contract, cheaper.

Every request enters four (its body, its whole exchange, each engine leg). As a plain
class with a synchronous ``with``, one costs the loop's timer and three Python calls
(construct, enter, exit); ``asyncio.timeout`` adds a factory, two coroutines and its
``reschedule`` on entry to every use.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["Deadline"]

_NEW, _RUNNING, _EXPIRING, _OVER = range(4)


class Deadline:
    """``with Deadline(seconds):`` bounds the block as ``async with asyncio.timeout(seconds):``
    does. At the deadline the task running the block is cancelled; that cancellation leaves
    the block as ``TimeoutError`` (from the ``CancelledError``), while a cancellation from
    elsewhere (the task's own, a shutdown) leaves it as it came. Enter it once, in a task.
    :meth:`reschedule` moves the deadline of a running block."""

    __slots__ = ("_cancelling", "_handle", "_loop", "_seconds", "_state", "_task")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._state = _NEW
        self._handle: asyncio.TimerHandle | None = None

    def __enter__(self) -> Deadline:
        if self._state != _NEW:
            raise RuntimeError("a Deadline is entered once")
        loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a Deadline bounds a block of a task")
        self._task = task
        self._cancelling = task.cancelling()  # the cancellations that are not this deadline's
        self._state = _RUNNING
        self._handle = loop.call_at(loop.time() + self._seconds, self._expire)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        expired = self._state == _EXPIRING
        self._state = _OVER
        # Only this deadline's cancellation becomes the timeout: if the task was also
        # cancelled otherwise meanwhile, uncancel() leaves it above the count at entry.
        if expired and self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from exc

    def reschedule(self, when: float) -> None:
        """Expire at loop time ``when`` instead (at the next loop turn if past).
        ``RuntimeError`` unless the block is running and the deadline not yet expired."""
        if self._state != _RUNNING:
            raise RuntimeError("the deadline is not running")
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._handle = None
        self._state = _EXPIRING
        self._task.cancel()
