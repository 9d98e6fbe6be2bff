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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

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


class Lifecycle(Observer):
    """The observers of every request, called in order; what the request path holds."""

    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self._observers = tuple(observers)
        self._bracketing = tuple(o for o in self._observers if type(o).phase is not Observer.phase)

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
