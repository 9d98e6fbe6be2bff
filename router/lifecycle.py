"""A request's lifecycle as events, and the seam its watchers subscribe through.

Intake, dispatch (``router/pd/``) and the relay announce what happened to one request
(decided, slot waited, placed, attempt failed, handed off, stream ended, request ended) by
calling a ``Lifecycle``; metrics, tracing, the routing timings and the access log are
``Observer``s of it, built once in ``router/context.py``. The request path imports neither
``router.metrics`` nor ``router.tracing`` (``tests/unit/test_observer_seam.py``).

Contracts:
- an event method returns nothing and never raises into the request path (an observer's
  failure is the observer's bug; nothing here catches it, so tests see it);
- events are synchronous and cheap: an observer that must do I/O queues it;
- ``phase`` brackets a part of the request (a tracing span): the context manager it returns
  is entered before the part and exited after it, whatever the part's outcome;
- label values (outcome, decision, cause, phase names) are the enums and constants of the
  module that owns them, never retyped literals.

``Observer`` is the base every observer extends: every event is a no-op there, so an
observer overrides only what it watches, and ``Lifecycle`` calls each subscribed observer in
subscription order. Event methods are grouped by who announces them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from router.errors import DisconnectPhase, KeyResult
from router.request_end import RequestEnd

__all__ = ["Lifecycle", "Observer"]

_NULL: AbstractContextManager[None] = contextlib.nullcontext()


class Observer:
    """Watches requests; every event a no-op until overridden."""

    # -- any stage ---------------------------------------------------------------------------

    def phase(
        self, name: str, attributes: Mapping[str, Any] | None = None
    ) -> AbstractContextManager[Any] | None:
        """A part of the request begins (``None``: this observer does not bracket it)."""
        return None

    def annotate(self, attributes: Mapping[str, Any]) -> None:
        """Facts about the request so far (the engine chosen, the handoff time, ...)."""

    # -- dispatch (router/pd) ----------------------------------------------------------------

    # -- relay and intake --------------------------------------------------------------------

    def request_span(
        self, name: str, headers: Iterable[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> AbstractContextManager[Any] | None:
        """The relay takes a request (``headers``: the client's, its ``traceparent``
        included); the context manager, if any, brackets it to its end (``None``: this
        observer does not)."""
        return None

    def disconnected(self, model: str, phase: DisconnectPhase) -> None:
        """The client left before its response ended."""

    def stream_read(self, model: str, decision: str, chunks: int, worst_gap: float) -> None:
        """A D leg's stream was read to its end or its cut: chunks read and the longest
        wait between two (seconds); before the client is sent the end."""

    def auth_failed(self, reason: str) -> None:
        """A request named no valid API key (``reason``: :class:`Unauthorized`'s)."""

    def bound_exceeded(self, model: str, bound: str) -> None:
        """A request exceeded one of its model's bounds (:class:`BoundExceeded`'s ``bound``)."""

    def adapter_requested(self, model: str, adapter: str, most_labels: int) -> None:
        """A request names a LoRA adapter of ``model`` (counted under at most
        ``most_labels`` adapter labels)."""

    def key_result(self, key: str, result: KeyResult) -> None:
        """What became of a request of the API key named ``key`` (admitted or refused)."""

    def key_released(self, key: str) -> None:
        """An admitted request of ``key`` is over (its place in the key's concurrency)."""

    def refused(self, end: RequestEnd) -> None:
        """The intake refused a request before its relay (never announced with
        :meth:`request_ended`: a request ends once, one way or the other)."""

    def request_ended(self, end: RequestEnd) -> None:
        """The relay's request is over (inside its :meth:`request_span`)."""


class Lifecycle(Observer):
    """The observers of every request, called in order; what the request path holds."""

    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self._observers = tuple(observers)
        self._bracketing = tuple(o for o in self._observers if type(o).phase is not Observer.phase)
        spanning = (o for o in self._observers if type(o).request_span is not Observer.request_span)
        self._spanning = tuple(spanning)
        # An observer brackets requests (else the relay skips building the span's facts).
        self.spans_requests = bool(self._spanning)

    @property
    def observers(self) -> tuple[Observer, ...]:
        return self._observers

    # -- any stage ---------------------------------------------------------------------------

    def phase(
        self, name: str, attributes: Mapping[str, Any] | None = None
    ) -> AbstractContextManager[Any]:
        if not self._bracketing:
            return _NULL
        if len(self._bracketing) == 1:
            return self._bracketing[0].phase(name, attributes) or _NULL
        return self._phases(name, attributes)

    @contextlib.contextmanager
    def _phases(self, name: str, attributes: Mapping[str, Any] | None) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for o in self._bracketing:
                cm = o.phase(name, attributes)
                if cm is not None:
                    stack.enter_context(cm)
            yield

    def annotate(self, attributes: Mapping[str, Any]) -> None:
        for o in self._observers:
            o.annotate(attributes)

    # -- dispatch (router/pd) ----------------------------------------------------------------

    # -- relay and intake --------------------------------------------------------------------

    def request_span(
        self, name: str, headers: Iterable[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> AbstractContextManager[Any]:
        if len(self._spanning) == 1:
            return self._spanning[0].request_span(name, headers, attributes) or _NULL
        return self._request_spans(name, list(headers), attributes)

    @contextlib.contextmanager
    def _request_spans(
        self, name: str, headers: list[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for o in self._spanning:
                cm = o.request_span(name, headers, attributes)
                if cm is not None:
                    stack.enter_context(cm)
            yield

    def disconnected(self, model: str, phase: DisconnectPhase) -> None:
        for o in self._observers:
            o.disconnected(model, phase)

    def stream_read(self, model: str, decision: str, chunks: int, worst_gap: float) -> None:
        for o in self._observers:
            o.stream_read(model, decision, chunks, worst_gap)

    def auth_failed(self, reason: str) -> None:
        for o in self._observers:
            o.auth_failed(reason)

    def bound_exceeded(self, model: str, bound: str) -> None:
        for o in self._observers:
            o.bound_exceeded(model, bound)

    def adapter_requested(self, model: str, adapter: str, most_labels: int) -> None:
        for o in self._observers:
            o.adapter_requested(model, adapter, most_labels)

    def key_result(self, key: str, result: KeyResult) -> None:
        for o in self._observers:
            o.key_result(key, result)

    def key_released(self, key: str) -> None:
        for o in self._observers:
            o.key_released(key)

    def refused(self, end: RequestEnd) -> None:
        for o in self._observers:
            o.refused(end)

    def request_ended(self, end: RequestEnd) -> None:
        for o in self._observers:
            o.request_ended(end)
