"""The request's spans and their attributes from its lifecycle events (router/lifecycle.py).

Subscribed only when tracing is on (``router/context.py``): with it off, no event reaches
this observer and the request path builds no attributes for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from router.errors import Outcome
from router.lifecycle import Observer
from router.request_end import RequestEnd
from router.tracing import Tracing

__all__ = ["TracingObserver"]


class TracingObserver(Observer):
    """``phase`` a child span of the current one; ``annotate`` and the events with a fact
    worth a span attribute set it on the current span (``pdrouter.*``)."""

    def __init__(self, tracing: Tracing) -> None:
        self._t = tracing

    def phase(
        self, name: str, attributes: Mapping[str, Any] | None = None
    ) -> AbstractContextManager[Any]:
        if attributes is not None and not isinstance(attributes, dict):
            attributes = dict(attributes)
        return self._t.span(name, attributes)

    def annotate(self, attributes: Mapping[str, Any]) -> None:
        self._t.set(**{k.replace(".", "__"): v for k, v in attributes.items()})

    # -- dispatch (router/pd) ----------------------------------------------------------------

    def decided(self, model: str, decision: str) -> None:
        self._t.set(pdrouter__decision=str(decision))

    def cache_predicted(self, model: str, role: str, cached: int, prompt_tokens: int) -> None:
        self._t.set(**{f"pdrouter__cached_{role}": cached})

    def retried(self, model: str, attempt: int) -> None:
        self._t.set(pdrouter__retries=attempt)

    def handed_off(self, model: str, mode: str, seconds: float) -> None:
        self._t.set(pdrouter__handoff_s=seconds)

    # -- relay and intake --------------------------------------------------------------------

    def request_span(
        self, name: str, headers: Iterable[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> AbstractContextManager[Any] | None:
        return self._t.request(name, headers, attributes)

    def request_ended(self, end: RequestEnd) -> None:
        self._t.set(pdrouter__outcome=end.outcome.value)
        if end.ttft is not None:
            self._t.set(pdrouter__ttft_s=end.ttft)
        if end.outcome is not Outcome.SUCCESS:
            self._t.failed(end.outcome.value)
