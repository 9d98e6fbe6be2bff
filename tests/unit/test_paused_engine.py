"""A paused engine's 503 (vLLM 0.33+: paused, asleep, checkpointed) is load: retried on
another engine, nothing counted against it; every other 5xx stays a fault."""

from __future__ import annotations

import json

import pytest

from router.engines.breaker import Breaker, BreakerState
from router.errors import Fault, Outcome, UpstreamStatus, engine_paused

MESSAGE = "Generation is paused. Please retry after it resumes."
PAUSED = json.dumps(
    {"error": {"message": MESSAGE, "type": "ServiceUnavailableError", "param": None, "code": 503}}
).encode()
# vLLM's other 503s (a full queue, a faulted engine) are typed so.
BUSY = json.dumps(
    {"error": {"message": "busy", "type": "Service Unavailable", "param": None, "code": 503}}
).encode()


def test_a_paused_engine_s_503_is_load() -> None:
    exc = UpstreamStatus(503, PAUSED, role="prefill", engine="http://p:8000")
    assert exc.paused and exc.fault is Fault.BLAMELESS and exc.retryable
    assert (exc.status, exc.outcome, exc.body()) == (503, Outcome.NO_CAPACITY, PAUSED)
    breaker = Breaker(1, 10.0, answer_threshold=1)
    for _ in range(5):
        breaker.record(exc.fault)
    assert breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize(
    ("status", "body", "fault"),
    [
        (503, BUSY, Fault.ENGINE),
        (503, b"upstream connect error", Fault.ENGINE),
        (502, PAUSED, Fault.ENGINE),
        (500, PAUSED, Fault.ANSWER),
    ],
)
def test_every_other_5xx_is_a_fault(status: int, body: bytes, fault: Fault) -> None:
    exc = UpstreamStatus(status, body, role="decode", engine="http://d:8000")
    assert not exc.paused and exc.fault is fault and exc.retryable
    assert exc.status == 502 and exc.outcome is Outcome.UPSTREAM_ERROR
    breaker = Breaker(1, 10.0, answer_threshold=1)
    breaker.record(exc.fault)
    assert breaker.state is BreakerState.OPEN


def test_a_stream_s_error_event_of_code_503_is_the_paused_engine_s() -> None:
    # A streamed request finds the engine paused after its 200: vLLM types it so.
    event = json.dumps({"error": {"message": MESSAGE, "type": "InternalServerError", "code": 503}})
    assert engine_paused(event.encode(), streamed=True)
    assert not engine_paused(event.encode())  # as a whole body, a 503 so typed is not
    internal = event.replace("503", "500").encode()
    assert not engine_paused(internal, streamed=True)
