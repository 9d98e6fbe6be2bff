"""One trace across the router and both real engines: the router exports its spans and the
vLLM engines, started with ``--otlp-traces-endpoint``, export theirs to the same OTLP/HTTP
receiver; the engines' spans of a request are children of the router's ``prefill`` and
``decode_first_byte`` spans, in the router's trace."""

from __future__ import annotations

import time

import pytest

from router.stack import Stack
from tests.e2e import helpers as h
from tests.e2e.conftest import MODEL, Reference
from tests.fakes.otlp import OtlpReceiver, ReceivedSpan, threaded_receiver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _wait_for(receiver: OtlpReceiver, trace_id: str, parents: set[str]) -> list[ReceivedSpan]:
    """The spans of ``trace_id`` whose parent is one of ``parents``, once one per parent
    has arrived (engines export in batches) or after 60 s."""
    deadline = time.monotonic() + 60
    while True:
        children = [s for s in receiver.spans if s.trace_id == trace_id and s.parent_id in parents]
        if {s.parent_id for s in children} == parents or time.monotonic() > deadline:
            return children
        time.sleep(0.2)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_router_and_engine_spans_share_one_trace(
    mode: str, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    with threaded_receiver() as (url, receiver):
        # Read by vLLM's OpenTelemetry setup in the engine processes (OTLP over HTTP, and
        # export every 200 ms instead of every 5 s).
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        otlp = ["--otlp-traces-endpoint", url]
        with Stack(
            variant=h.FAST,
            mode=mode,
            router_overrides={"tracing": {"endpoint": url}},
            engine_args={"prefill-0": otlp, "decode-0": otlp},
        ) as stack:
            client = h.client_for(stack.router_url)
            out = h.chat(client, MODEL, [{"role": "user", "content": "trace me"}], stream=True)
            assert len(out.token_ids) == h.MAX_TOKENS
            # The router exports in batches: the request's span, which ends after its
            # stream, may come in a later batch than its children.
            names = ("POST /v1/chat/completions", "prefill", "decode_first_byte")
            deadline = time.monotonic() + 60
            while not all(map(receiver.named, names)) and time.monotonic() < deadline:
                time.sleep(0.2)
            [server] = receiver.named(names[0])
            [prefill] = receiver.named("prefill")
            [decode] = receiver.named("decode_first_byte")
            assert prefill.trace_id == decode.trace_id == server.trace_id
            children = _wait_for(receiver, server.trace_id, {prefill.span_id, decode.span_id})
    engine_spans = {s.parent_id: s for s in children}
    assert set(engine_spans) == {prefill.span_id, decode.span_id}, receiver.spans
    assert all(span.service != "pd-router" for span in engine_spans.values()), engine_spans
