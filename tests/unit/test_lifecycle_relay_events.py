"""The relay's and the intake's events through the lifecycle: every observer called in
order with the same facts; the request's span only where an observer brackets requests;
the access line a request's end makes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from router.errors import DisconnectPhase, KeyResult, Outcome
from router.lifecycle import Lifecycle, Observer
from router.observers.access_log import record
from router.request_end import RequestEnd


class _Recorder(Observer):
    def __init__(self, name: str, seen: list[tuple[str, str, Any]]) -> None:
        self._name, self._seen = name, seen

    def disconnected(self, model: str, phase: DisconnectPhase) -> None:
        self._seen.append((self._name, "disconnected", (model, phase)))

    def stream_read(self, model: str, decision: str, chunks: int, worst_gap: float) -> None:
        self._seen.append((self._name, "stream_read", (model, decision, chunks, worst_gap)))

    def auth_failed(self, reason: str) -> None:
        self._seen.append((self._name, "auth_failed", reason))

    def bound_exceeded(self, model: str, bound: str) -> None:
        self._seen.append((self._name, "bound_exceeded", (model, bound)))

    def adapter_requested(self, model: str, adapter: str, most_labels: int) -> None:
        self._seen.append((self._name, "adapter_requested", (model, adapter, most_labels)))

    def key_result(self, key: str, result: KeyResult) -> None:
        self._seen.append((self._name, "key_result", (key, result)))

    def key_released(self, key: str) -> None:
        self._seen.append((self._name, "key_released", key))

    def intake_refused(self, end: RequestEnd) -> None:
        self._seen.append((self._name, "intake_refused", end))

    def request_ended(self, end: RequestEnd) -> None:
        self._seen.append((self._name, "request_ended", end))


class _Spans(Observer):
    def __init__(self, name: str, seen: list[tuple[str, str, Any]]) -> None:
        self._name, self._seen = name, seen

    def request_span(
        self, name: str, headers: Iterable[tuple[bytes, bytes]], attributes: dict[str, Any]
    ) -> AbstractContextManager[Any] | None:
        return self._span(name, list(headers))

    @contextlib.contextmanager
    def _span(self, name: str, headers: list[tuple[bytes, bytes]]) -> Iterator[None]:
        self._seen.append((self._name, "enter", (name, headers)))
        yield
        self._seen.append((self._name, "exit", name))


def _end(**facts: Any) -> RequestEnd:
    return RequestEnd("POST", "/v1/completions", "m", "pull", 0.0, **facts)


def test_every_event_reaches_every_observer_in_order() -> None:
    seen: list[tuple[str, str, Any]] = []
    life = Lifecycle([_Recorder("a", seen), Observer(), _Recorder("b", seen)])
    end = _end(outcome=Outcome.TIMEOUT)
    life.disconnected("m", DisconnectPhase.STREAMING)
    life.stream_read("m", "pd", 7, 0.5)
    life.auth_failed("missing")
    life.bound_exceeded("m", "max_tokens")
    life.adapter_requested("m", "sql", 8)
    life.key_result("k", KeyResult.ADMITTED)
    life.key_released("k")
    life.intake_refused(end)
    life.request_ended(end)
    facts = [
        ("disconnected", ("m", DisconnectPhase.STREAMING)),
        ("stream_read", ("m", "pd", 7, 0.5)),
        ("auth_failed", "missing"),
        ("bound_exceeded", ("m", "max_tokens")),
        ("adapter_requested", ("m", "sql", 8)),
        ("key_result", ("k", KeyResult.ADMITTED)),
        ("key_released", "k"),
        ("intake_refused", end),
        ("request_ended", end),
    ]
    assert seen == [(who, event, f) for event, f in facts for who in ("a", "b")]


def test_the_request_span_only_where_an_observer_brackets_it() -> None:
    seen: list[tuple[str, str, Any]] = []
    assert not Lifecycle([_Recorder("a", seen)]).spans_requests
    life = Lifecycle([_Spans("outer", seen), _Recorder("a", seen), _Spans("inner", seen)])
    assert life.spans_requests
    headers = iter([(b"traceparent", b"00-1-2-01")])  # read by both observers
    with life.request_span("POST /v1/completions", headers, {}):
        seen.append(("-", "request", None))
    assert [(who, event) for who, event, _ in seen] == [
        ("outer", "enter"),
        ("inner", "enter"),
        ("-", "request"),
        ("inner", "exit"),
        ("outer", "exit"),
    ]
    assert seen[1][2] == ("POST /v1/completions", [(b"traceparent", b"00-1-2-01")])


def test_the_access_line_of_a_request_end() -> None:
    gone = record(_end(outcome=Outcome.DISCONNECT), 0.25)
    assert (gone.status, gone.outcome, gone.duration_ms) == (499, "client_disconnect", 250.0)
    answered = record(_end(status=200, ttft=0.1, request_id="r1", decision="pd", migrations=1), 1)
    assert (answered.status, answered.ttft_ms, answered.request_id) == (200, 100.0, "r1")
    assert (answered.decision, answered.migrations, answered.prefill) == ("pd", 1, "-")
    refused = record(RequestEnd("POST", "/invocations", "", "", 0.0, status=401), 0.0)
    assert (refused.model, refused.mode, refused.status) == ("-", "-", 401)
