"""The request's trace (router/tracing.py): its SERVER span, child of the client's
``traceparent``; the spans of its phases and their facts; how it ended. Subscribed only
when tracing is on: off, the relay builds no span at all."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from router.errors import Outcome
from router.lifecycle import Observer
from router.request_end import RequestEnd
from router.tracing import Tracing

__all__ = ["RequestTracing"]


class RequestTracing(Observer):
    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing

    def phase(
        self, name: str, attributes: Mapping[str, Any] | None = None
    ) -> AbstractContextManager[Any] | None:
        return self._tracing.span(name, None if attributes is None else dict(attributes))

    def annotate(self, attributes: Mapping[str, Any]) -> None:
        self._tracing.set(**{k.replace(".", "__"): v for k, v in attributes.items()})

    def request_span(
        self, name: str, headers: Iterable[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> AbstractContextManager[Any] | None:
        return self._tracing.request(name, headers, attributes)

    def request_ended(self, end: RequestEnd) -> None:
        self._tracing.set(pdrouter__outcome=end.outcome.value)
        if end.ttft is not None:
            self._tracing.set(pdrouter__ttft_s=end.ttft)
        if end.outcome is not Outcome.SUCCESS:
            self._tracing.failed(end.outcome.value)
