"""An opened request: what a dispatch holds once D's first bytes are in, and D's usage as
the client gets it (P's prefix-cache hits, where D counts the transfer as cached)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from router.engines.ledger import Reservation
from router.errors import Fault, UpstreamError
from router.pd.decision import Decision
from router.pd.decode_leg import DecodeLeg, PrefillResult
from router.pd.scrub import without_params
from router.pd.usage import MARKER, Patch, with_cached_tokens

__all__ = ["Dispatch"]

# The decisions whose D counts the transferred KV as cached (router/pd/usage.py).
_USAGE_FROM_PREFILL = frozenset({Decision.PUSH, Decision.PUSH_SEQUENTIAL, Decision.PIPELINED})


@dataclass(eq=False)
class Dispatch:
    """An opened request: D's first bytes are in; the caller forwards the rest of ``leg``
    (P's, for P alone: then ``reservation`` is None, no decode slot is held)."""

    reservation: Reservation | None
    leg: DecodeLeg
    decision: Decision
    request_id: str
    prefill_task: asyncio.Task[PrefillResult] | None = None  # P still running at open
    prefill_error: UpstreamError | None = None  # P failed after D's first bytes
    prefill_engine: str | None = None  # P's engine key (None: D alone)
    prefill_result: PrefillResult | None = None  # P's, when it finished before D opened
    on_clean_end: Callable[[], None] | None = None  # see ended_cleanly

    @functools.cached_property
    def usage_patch(self) -> Patch | None:
        """The rewrite of D's ``cached_tokens`` to P's, where D counts the transfer as
        cached (None: D's usage is right as it is); built once per dispatch."""
        if self.decision not in _USAGE_FROM_PREFILL:
            return None

        async def patch(chunk: bytes) -> bytes:
            cached = await self.prefill_cached_tokens()
            return chunk if cached is None else with_cached_tokens(chunk, cached)

        return patch

    async def first_bytes(self) -> bytes:
        """D's first bytes for the client (``leg.first``, its usage rewritten where needed);
        a whole body without its engine's coordinates (router/pd/scrub.py: a streamed leg's
        bytes are scrubbed as they are read)."""
        patch = self.usage_patch
        first = self.leg.first
        if self.leg.rest is None:
            first = without_params(first)
        return await patch(first) if patch is not None and MARKER in first else first

    async def prefill_cached_tokens(self) -> int | None:
        """P's prefix-cache hits; None where P failed or did not report them. Waits for a
        P leg still running (it is bounded by the prefill timeout)."""
        if self.prefill_result is None and self.prefill_task is not None:
            await asyncio.wait({self.prefill_task})
            task = self.prefill_task
            if not task.cancelled() and task.exception() is None:
                self.prefill_result = task.result()
        return None if self.prefill_result is None else self.prefill_result.cached_tokens

    def ended_cleanly(self) -> None:
        """Called by whoever relays D's answer once it has read D's end and before the
        client gets it: runs ``on_clean_end`` (at most once) if the end is clean. Before
        the client, so that its next request finds what that records (a kept turn)."""
        callback, self.on_clean_end = self.on_clean_end, None
        if callback is not None and self.verdict is None and self.leg.status == 200:
            callback()

    @property
    def decode_engine(self) -> str | None:
        """D's engine key (None: P served the request alone)."""
        return None if self.reservation is None else self.leg.instance.key

    @property
    def verdict(self) -> Fault | None:
        """What the request's end says about D: the leg's verdict, except that a D
        stream cut because its P failed says nothing about D."""
        if self.prefill_error is not None and self.leg.verdict not in (None, Fault.ANSWER):
            return Fault.BLAMELESS
        return self.leg.verdict
