"""A request's priority class, and the ``priority`` its engine legs carry.

The class comes from, first to last: the ``x-priority`` header (a class name), the body's
``priority`` (vLLM's integer: one of the configured classes' values), the API key's
``priority_class``, the configured default class. A name or value that is not a
configured class is a 400 naming it. With no classes configured every request is in one
class.

The class's *level* (0 most urgent) is its value's rank among the configured values and
vLLM's default 0 (what a request without a class runs as): the admission queue serves
lower levels first (:mod:`router.engines.fair_queue`).

What the engines see: with ``engine_priority_scheduling`` the legs carry the class's value
as ``priority`` (vLLM then schedules by it); without it, ``priority`` is removed from the
legs: vLLM's API documents a non-zero priority as an error on an engine that does not
schedule by it (0.32 accepts and ignores it; removing it keeps either behaviour harmless).

A request's TTFT deadline: the ``x-slo-ttft-ms`` header (a positive number of milliseconds,
else a 400), else its class's ``ttft_deadline_ms``, else none. It runs from the request's
arrival; the decode-slot queue refuses a request still waiting when it passes
(:class:`router.errors.DeadlineExceeded`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from router.client_request import ClientRequest
from router.config import AdmissionConfig
from router.errors import InvalidRequest

__all__ = ["DEADLINE_HEADER", "HEADER", "Priority", "deadline_ms", "resolve", "with_priority"]

HEADER = b"x-priority"
DEADLINE_HEADER = b"x-slo-ttft-ms"
_DEFAULT = 0  # vLLM's priority for a request that gives none


@dataclass(frozen=True, slots=True)
class Priority:
    name: str  # the class's name; "" without one
    value: int  # vLLM's priority (lower first)
    level: int  # the queue's order: 0 most urgent


_NONE = Priority("", _DEFAULT, 0)  # the class of every request when none is configured


def _header(headers: Iterable[tuple[bytes, bytes]], wanted: bytes = HEADER) -> str | None:
    for name, value in headers:
        if name == wanted:
            return value.decode("latin-1").strip()
    return None


def _level(config: AdmissionConfig, value: int) -> int:
    values = sorted({c.priority for c in config.priority_classes.values()} | {_DEFAULT})
    return values.index(value)


def _by_value(config: AdmissionConfig, given: Any) -> str:
    # bool is an int in Python, not in vLLM's schema.
    if not isinstance(given, int) or isinstance(given, bool):
        raise InvalidRequest("priority must be an integer", param="priority")
    for name, cls in config.priority_classes.items():
        if cls.priority == given:
            return name
    known = ", ".join(f"{n}={c.priority}" for n, c in config.priority_classes.items())
    raise InvalidRequest(
        f"priority {given} is not a configured priority class ({known})", param="priority"
    )


def resolve(
    config: AdmissionConfig,
    headers: Iterable[tuple[bytes, bytes]],
    body: dict[str, Any],
    key_class: str | None = None,
) -> Priority:
    """The request's class (module doc; ``key_class``: its API key's default, a configured
    class); raises :class:`InvalidRequest` for an unknown one."""
    classes = config.priority_classes
    if not classes:
        return _NONE
    name = _header(headers)
    if name is not None and name not in classes:
        raise InvalidRequest(
            f"x-priority {name!r} is not a priority class ({', '.join(sorted(classes))})",
            param="x-priority",
        )
    if name is None and "priority" in body:
        name = _by_value(config, body["priority"])
    if name is None:
        name = key_class or config.default_priority_class
    if name is None:
        return Priority("", _DEFAULT, _level(config, _DEFAULT))
    value = classes[name].priority
    return Priority(name, value, _level(config, value))


def deadline_ms(
    config: AdmissionConfig, headers: Iterable[tuple[bytes, bytes]], prio: Priority
) -> float | None:
    """The request's TTFT deadline in ms (module doc); a 400 for a malformed header."""
    given = _header(headers, DEADLINE_HEADER)
    if given is None:
        cls = config.priority_classes.get(prio.name)
        return None if cls is None else cls.ttft_deadline_ms
    try:
        value = float(given)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequest(
            f"x-slo-ttft-ms must be a positive number of milliseconds, got {given!r}",
            param="x-slo-ttft-ms",
        )
    return value


def with_priority(
    creq: ClientRequest,
    headers: Iterable[tuple[bytes, bytes]],
    config: AdmissionConfig,
    engine_priority: bool,
    now: float = 0.0,
    key_class: str | None = None,
) -> ClientRequest:
    """``creq`` with its class and deadline (``now``: its arrival on the router's clock),
    its body's ``priority`` what the engines must see."""
    prio = resolve(config, headers, creq.body, key_class)
    deadline = deadline_ms(config, headers, prio)
    deadline_at = None if deadline is None else now + deadline / 1000
    body = _engine_body(creq.body, prio, config, engine_priority)
    if body is creq.body and deadline is None and prio == _NONE:
        return creq  # no class, no deadline, nothing to change: no copy
    return replace(
        creq,
        body=body,
        priority_class=prio.name,
        priority_level=prio.level,
        ttft_deadline_ms=deadline,
        deadline_at=deadline_at,
    )


def _engine_body(
    body: dict[str, Any], prio: Priority, config: AdmissionConfig, engine_priority: bool
) -> dict[str, Any]:
    """The body the legs get: the class's value as ``priority`` for engines that schedule by
    it, no ``priority`` for the others; ``body`` itself when that is what it already is (no
    copy on the way of every request)."""
    if engine_priority and config.priority_classes:
        if body.get("priority") == prio.value:  # an int: never None
            return body
        return {**body, "priority": prio.value}
    if not engine_priority and "priority" in body:
        return {k: v for k, v in body.items() if k != "priority"}
    return body
