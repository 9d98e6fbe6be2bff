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
    # ``model`` is the pool's name; role, decision, mode, placement and result are the owners'
    # enums (``Role``, ``Decision``, ``Mode``, ``Placement``, ``kvindex.route.Result``, ...).

    def decided(self, model: str, decision: str) -> None:
        """How the request is served (``Decision``), once per request."""

    def adapted(self, model: str, choice: str) -> None:
        """The adaptive rule chose (``RouteChoice``) for a request the mode would split."""

    def cache_scored(self, model: str, seconds: float) -> None:
        """The cache-aware route was computed (its ``/tokenize`` included) in ``seconds``."""

    def routed(self, model: str, role: str, placement: str) -> None:
        """``role``'s engine was placed by session affinity (``Placement``)."""

    def cache_routed(self, model: str, role: str, result: str) -> None:
        """How cache-aware routing chose ``role``'s engine (``kvindex.route.Result``)."""

    def cache_predicted(self, model: str, role: str, cached: int, prompt_tokens: int) -> None:
        """Cache-aware routing predicted ``cached`` of ``prompt_tokens`` cached on ``role``'s
        engine."""

    def slot_waited(
        self, model: str, api_key_name: str, priority_class: str, seconds: float
    ) -> None:
        """A decode slot was granted after ``seconds`` in the queue."""

    def refused(self, model: str, priority_class: str, code: str, deadline_missed: bool) -> None:
        """No decode slot: refused with the error ``code`` (``deadline_missed``: its TTFT
        deadline could not be met)."""

    def attempt_failed(self, model: str, role: str, code: str) -> None:
        """An attempt failed on ``role``'s engine with the error ``code``."""

    def retried(self, model: str, attempt: int) -> None:
        """Attempt ``attempt`` failed and the request is tried again."""

    def prefill_done(self, model: str, mode: str, seconds: float) -> None:
        """P's leg ended (well or not) after ``seconds``."""

    def handed_off(self, model: str, mode: str, seconds: float) -> None:
        """D's stream opened ``seconds`` after P finished."""

    def prompt_sent(self, model: str, at: float, tokens: int) -> None:
        """A prompt of about ``tokens`` went to P at ``at`` (the clock's seconds): P's demand."""

    def prompt_computed(self, model: str, seconds: float, tokens: int) -> None:
        """An engine that computed no other prompt for this router computed one of about
        ``tokens`` in ``seconds``: the computation's own time, no wait behind others."""

    def stream_timed(self, model: str, role: str, seconds: float, steps: int) -> None:
        """A stream read cleanly to its end took ``seconds`` for ``steps`` steps after its
        first bytes, on an engine of ``role`` (``Role``)."""

    def push_fallback(self, model: str) -> None:
        """A push dispatch fell back to pulling (router/pd/plans.py)."""

    def kv_params_missing(self, model: str, url: str, rank: str) -> None:
        """P answered without ``kv_transfer_params`` where they were required."""

    def kept_turn(self, model: str, result: str, entries: int) -> None:
        """A kept turn's fate (``KeptTurnResult``); ``entries``: the model's table size."""

    def migrated(self, model: str, mode: str, cause: str) -> None:
        """A cut stream is continued elsewhere (``cause``: a ``MigrationCause``)."""

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

    def intake_refused(self, end: RequestEnd) -> None:
        """The intake refused a request before its relay (never announced with
        :meth:`request_ended`: a request ends once, one way or the other)."""

    def request_ended(self, end: RequestEnd) -> None:
        """The relay's request is over (inside its :meth:`request_span`)."""


def _ignore(*_args: object) -> None:
    """An event no observer watches."""


# Observer's events (its methods that return nothing and bracket nothing), by name.
_EVENTS = {
    name: member
    for name, member in vars(Observer).items()
    if callable(member) and not name.startswith("_")
    if name not in ("phase", "annotate", "request_span")
}


class Lifecycle(Observer):
    """The observers of every request, called in order; what the request path holds."""

    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self._observers = tuple(observers)
        self._bracketing = tuple(o for o in self._observers if type(o).phase is not Observer.phase)
        # Whether any observer reads ``annotate``: a caller builds the attributes only then.
        self.annotates = any(type(o).annotate is not Observer.annotate for o in self._observers)
        spanning = (o for o in self._observers if type(o).request_span is not Observer.request_span)
        self._spanning = tuple(spanning)
        # An observer brackets requests (else the relay skips building the span's facts).
        self.spans_requests = bool(self._spanning)
        self._direct()

    def _direct(self) -> None:
        """Each event calls only the observers that watch it (override it): an event one
        observer watches is that observer's method itself (one call, not a fan-out's two),
        an event none watches a no-op. The fan-out methods below serve the rest. Events
        are announced a dozen times a request: this keeps the seam's cost to the watchers'."""
        for name in _EVENTS:
            watchers = [o for o in self._observers if getattr(type(o), name) is not _EVENTS[name]]
            if len(watchers) == 1:
                setattr(self, name, getattr(watchers[0], name))
            elif not watchers:
                setattr(self, name, _ignore)

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

    def decided(self, model: str, decision: str) -> None:
        for o in self._observers:
            o.decided(model, decision)

    def adapted(self, model: str, choice: str) -> None:
        for o in self._observers:
            o.adapted(model, choice)

    def cache_scored(self, model: str, seconds: float) -> None:
        for o in self._observers:
            o.cache_scored(model, seconds)

    def routed(self, model: str, role: str, placement: str) -> None:
        for o in self._observers:
            o.routed(model, role, placement)

    def cache_routed(self, model: str, role: str, result: str) -> None:
        for o in self._observers:
            o.cache_routed(model, role, result)

    def cache_predicted(self, model: str, role: str, cached: int, prompt_tokens: int) -> None:
        for o in self._observers:
            o.cache_predicted(model, role, cached, prompt_tokens)

    def slot_waited(
        self, model: str, api_key_name: str, priority_class: str, seconds: float
    ) -> None:
        for o in self._observers:
            o.slot_waited(model, api_key_name, priority_class, seconds)

    def refused(self, model: str, priority_class: str, code: str, deadline_missed: bool) -> None:
        for o in self._observers:
            o.refused(model, priority_class, code, deadline_missed)

    def attempt_failed(self, model: str, role: str, code: str) -> None:
        for o in self._observers:
            o.attempt_failed(model, role, code)

    def retried(self, model: str, attempt: int) -> None:
        for o in self._observers:
            o.retried(model, attempt)

    def prefill_done(self, model: str, mode: str, seconds: float) -> None:
        for o in self._observers:
            o.prefill_done(model, mode, seconds)

    def handed_off(self, model: str, mode: str, seconds: float) -> None:
        for o in self._observers:
            o.handed_off(model, mode, seconds)

    def prompt_sent(self, model: str, at: float, tokens: int) -> None:
        for o in self._observers:
            o.prompt_sent(model, at, tokens)

    def prompt_computed(self, model: str, seconds: float, tokens: int) -> None:
        for o in self._observers:
            o.prompt_computed(model, seconds, tokens)

    def stream_timed(self, model: str, role: str, seconds: float, steps: int) -> None:
        for o in self._observers:
            o.stream_timed(model, role, seconds, steps)

    def push_fallback(self, model: str) -> None:
        for o in self._observers:
            o.push_fallback(model)

    def kv_params_missing(self, model: str, url: str, rank: str) -> None:
        for o in self._observers:
            o.kv_params_missing(model, url, rank)

    def kept_turn(self, model: str, result: str, entries: int) -> None:
        for o in self._observers:
            o.kept_turn(model, result, entries)

    def migrated(self, model: str, mode: str, cause: str) -> None:
        for o in self._observers:
            o.migrated(model, mode, cause)

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

    def intake_refused(self, end: RequestEnd) -> None:
        for o in self._observers:
            o.intake_refused(end)

    def request_ended(self, end: RequestEnd) -> None:
        for o in self._observers:
            o.request_ended(end)
