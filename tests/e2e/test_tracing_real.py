"""One trace across the router and both real engines: a router with tracing on exports its spans
and the vLLM engines, started with ``--otlp-traces-endpoint``, export theirs to the same
OTLP/HTTP receiver (the run's, ``otlp_receiver``: every engine of the main stacks exports to
it); the engines' spans of a request are children of the router's ``prefill`` and
``decode_first_byte`` spans, in the router's trace. The traced router is a second router
over the shared engines."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e import helpers as h
from tests.e2e.conftest import MODEL, AnyStack
from tests.engine_stacks import Running
from tests.fakes.otlp import OtlpReceiver, ReceivedSpan

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.parametrize("engine_stack", ["pull", "push"], indirect=True),
]
EXPORT_DEADLINE_S = 60.0  # engines and router export in batches (every 200 ms here)
NAMES = ("POST /v1/chat/completions", "prefill", "decode_first_byte")


def _spans_after(receiver: OtlpReceiver, start: int) -> list[ReceivedSpan]:
    return receiver.spans[start:]


def _wait_for(what: str, probe: Callable[[], object]) -> None:
    ok, last, waited = h.wait_until(lambda: (bool(probe()), what), EXPORT_DEADLINE_S)
    assert ok, f"{last} not exported after {waited:.0f} s"


def test_router_and_engine_spans_share_one_trace(
    engine_stack: Running, otlp_receiver: tuple[str, OtlpReceiver]
) -> None:
    url, receiver = otlp_receiver
    stack: AnyStack = engine_stack.routed("traced", router_overrides={"tracing": {"endpoint": url}})
    start = len(receiver.spans)  # spans of earlier requests (the engines trace every one)
    client = h.client_for(stack.router_url)
    out = h.chat(client, MODEL, [{"role": "user", "content": "trace me"}], stream=True)
    assert len(out.token_ids) == h.MAX_TOKENS

    def router_spans(name: str, trace_id: str | None = None) -> list[ReceivedSpan]:
        return [
            s
            for s in _spans_after(receiver, start)
            if s.service == "pd-router" and s.name == name and trace_id in (None, s.trace_id)
        ]

    # The request's own span ends after its stream: it may come in a later batch than its
    # children. Earlier requests' spans (the router's warm-up) may come after ``start``.
    _wait_for("the router's request span", lambda: router_spans(NAMES[0]))
    [server] = router_spans(NAMES[0])
    _wait_for(
        "the router's leg spans",
        lambda: all(router_spans(n, server.trace_id) for n in NAMES[1:]),
    )
    [prefill], [decode] = (router_spans(n, server.trace_id) for n in NAMES[1:])
    parents = {prefill.span_id, decode.span_id}

    def engine_children() -> dict[str, ReceivedSpan]:
        return {
            s.parent_id: s
            for s in _spans_after(receiver, start)
            if s.trace_id == server.trace_id and s.parent_id in parents
        }

    _wait_for(
        "an engine span under prefill and under decode_first_byte",
        lambda: set(engine_children()) == parents,
    )
    children = engine_children()
    assert all(span.service != "pd-router" for span in children.values()), children
