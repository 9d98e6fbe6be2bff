"""Legs the client abandoned that must still finish to leave no KV behind.

vLLM 0.32's ``NixlPushConnector`` leaks the blocks of a decode request closed
while it waits for its KV. So when a push-mode client leaves while P is still
prefilling, the router does not close D at once: it lets P finish (P then writes
D's KV), waits until D shows it has the KV (its first streamed bytes, or a short
grace for a non-streaming leg), and only then closes D, which frees its blocks
normally. The decode slot stays reserved until then. If P fails instead, D is
closed anyway and reported as possibly leaking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from router.config import TimeoutConfig
from router.pd.decode_leg import DecodeLeg, PrefillResult

__all__ = ["Settler", "cancel_task", "discard_decode"]

log = logging.getLogger("pd_router.settle")

# A non-streaming decode leg shows nothing until it completes; after P's response
# the WRITE lands within milliseconds, so this much is ample for D to own its KV.
_NON_STREAM_GRACE = 1.0


async def cancel_task(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def discard_decode(task: asyncio.Task[DecodeLeg]) -> None:
    """Cancel a decode leg, or close its stream if it already opened."""
    await cancel_task(task)
    if not task.cancelled() and task.exception() is None:
        await task.result().close()


class Settler:
    """Owns background clean-up tasks; :meth:`aclose` ends them at shutdown."""

    def __init__(self, timeouts: TimeoutConfig) -> None:
        self._timeouts = timeouts
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def settle_push(
        self,
        p_task: asyncio.Task[PrefillResult],
        d_task: asyncio.Task[DecodeLeg],
        streaming: bool,
        release: Callable[[], None],
        on_leak: Callable[[], None],
    ) -> None:
        """Take over both legs of an abandoned push dispatch (see module doc)."""
        self.spawn(self._settle(p_task, d_task, streaming, release, on_leak))

    async def _settle(
        self,
        p_task: asyncio.Task[PrefillResult],
        d_task: asyncio.Task[DecodeLeg],
        streaming: bool,
        release: Callable[[], None],
        on_leak: Callable[[], None],
    ) -> None:
        try:
            await asyncio.wait({p_task}, timeout=self._timeouts.prefill)
            if p_task.done() and not p_task.cancelled() and p_task.exception() is None:
                grace = self._timeouts.decode_first_byte if streaming else _NON_STREAM_GRACE
                await asyncio.wait({d_task}, timeout=grace)
            else:
                on_leak()
        finally:
            with contextlib.suppress(Exception):
                await discard_decode(d_task)
            await cancel_task(p_task)
            release()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
