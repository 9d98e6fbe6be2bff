"""The routing timings each model learns from its legs' events (router/lifecycle.py).

A model's :class:`~router.engines.timings.Timings` (prefill seconds per token, decode step
time, P's demand) are what its adaptive rule and its slot wait read; they are taught here, not
by the request path, from what the legs announce.
"""

from __future__ import annotations

from router.engines.instance import Role
from router.engines.timings import Timings
from router.lifecycle import Observer
from router.registry import Registry

__all__ = ["TimingsObserver"]


class TimingsObserver(Observer):
    """Each leg's time to its model's timings (a model gone by a reload learns nothing)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def _timings(self, model: str) -> Timings | None:
        pool = self._registry.get(model)
        return pool.timings if pool is not None else None

    def prompt_sent(self, model: str, at: float, tokens: int) -> None:
        if (timings := self._timings(model)) is not None:
            timings.prefill_tokens.add(at, tokens)  # P's demand (router/demand.py)

    def prompt_computed(self, model: str, seconds: float, tokens: int) -> None:
        if (timings := self._timings(model)) is not None:
            timings.observe_prefill(seconds, tokens)

    def stream_timed(self, model: str, role: str, seconds: float, steps: int) -> None:
        if (timings := self._timings(model)) is not None:
            timings.observe_stream(seconds, steps, on_prefill=role == Role.PREFILL)
