"""vLLM's KV cache events on real engines (``--kv-events-config``, the stacks of
tests/engine_stacks.py):

* prefix caching and events on P and D (the ``pull-cached`` stack), requests without a session
  that repeat a few long system prompts: for every request the router's predicted cached
  tokens for P (``pdrouter_cache_predicted_tokens``) equal the prefix-cache hits P counts for
  it (``vllm:prefix_cache_hits``), and from the second request of a prompt on they are the
  whole blocks of that prompt;
* two router replicas over the same pipelined engines with kept turns, the turns of one
  conversation going to one replica then the other: every turn from the second reads the kept
  turn from D (this project's connector counts what P pulled), although the replica that
  serves it did not serve the turn before.
"""

from __future__ import annotations

import pytest

from router.stack import Stack
from router.stack.metrics import MetricsPage
from tests.e2e import helpers as h
from tests.e2e.conftest import MODEL, AnyStack
from tests.engine_stacks import Running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HITS = "vllm:prefix_cache_hits_total"
FINISHED = "vllm:request_success_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PREDICTED = "pdrouter_cache_predicted_tokens_sum"
BLOCK = 128  # vLLM's KV block on CPU
SYSTEMS = [f"System prompt {k}. " + " ".join(f"rule{k}-{i}" for i in range(300)) for k in range(2)]


def _index_settled(stack: Stack) -> MetricsPage:
    """The router's metrics once its index follows both engines and has applied every event
    they published (its position in their streams holds still for two scrapes)."""
    ok, what, _ = h.wait_until(
        lambda: (
            stack.router_metrics().total("pdrouter_kv_index_engines", state="known") == 2,
            "both engines known",
        ),
        timeout_s=30,
    )
    assert ok, what
    return h.settled(stack.router_metrics, "pdrouter_kv_index_next_seq")


def _p_counted(stack: AnyStack, before: MetricsPage, name: str) -> MetricsPage:
    """P's metrics once it has counted one more finished request and ``name`` has settled."""
    ok, what, _ = h.wait_until(
        lambda: (h.delta(stack.engine_metrics("prefill-0"), before, FINISHED) >= 1, "P"),
        timeout_s=10,
    )
    assert ok, f"P never counted the request ({what})"
    return h.settled(lambda: stack.engine_metrics("prefill-0"), name)


@pytest.mark.parametrize("engine_stack", ["pull-cached"], indirect=True)
def test_the_routers_prediction_is_what_p_finds_in_its_cache(engine_stack: Running) -> None:
    stack: Stack = engine_stack.stack
    client = h.client_for(stack.router_url)
    rows = []  # system prompt, predicted for P, P's hits
    for i in range(6):
        router_before = _index_settled(stack)
        p_before = stack.engine_metrics("prefill-0")
        messages = [
            {"role": "system", "content": SYSTEMS[i % 2]},
            {"role": "user", "content": f"Question {i}: what does rule {i} say?"},
        ]
        h.chat(client, MODEL, messages, stream=False, max_tokens=2)
        p_after = _p_counted(stack, p_before, HITS)
        predicted = h.delta(stack.router_metrics(), router_before, PREDICTED, role="prefill")
        rows.append((i % 2, predicted, h.delta(p_after, p_before, HITS)))
    print("\nsystem prompt, predicted cached tokens on P, P's prefix-cache hits")
    for row in rows:
        print("  ", *row)
    assert all(predicted == hits for _, predicted, hits in rows), rows
    assert all(hits >= 2 * BLOCK and hits % BLOCK == 0 for _, _, hits in rows[2:]), rows
    router = stack.router_metrics()
    assert router.total("pdrouter_cache_routes_total", role="prefill", result="unknown") == 0
    assert router.total("pdrouter_kv_index_gaps_total", result="unfilled") == 0


@pytest.mark.parametrize("engine_stack", ["pipelined"], indirect=True)
def test_any_replica_hands_p_the_turn_kept_by_another(engine_stack: Running) -> None:
    replicas: list[AnyStack] = [
        engine_stack.routed("kept-turns", kept_turns=True),
        engine_stack.routed("kept-turns-b", kept_turns=True),
    ]
    clients = [
        h.client_for(r.router_url).with_options(default_headers={"x-session-id": "two-routers"})
        for r in replicas
    ]
    stack = replicas[0]
    messages = [{"role": "user", "content": "A long talk. " + "context " * 600}]
    rows = []  # turn, replica, prompt tokens P computed, read from D, kept turns D refused
    for turn in range(4):
        before = stack.engine_metrics("prefill-0")
        reply = h.chat(clients[turn % 2], MODEL, messages, stream=True)
        after = _p_counted(stack, before, BY_SOURCE)
        computed = h.delta(after, before, BY_SOURCE, source="local_compute")
        from_d = h.delta(after, before, BY_SOURCE, source="external_kv_transfer")
        missed = h.delta(after, before, "vllm:pdr_kept_missed_total")
        rows.append((turn, turn % 2, computed, from_d, missed))
        messages = [
            *messages,
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": f"Question {turn + 1}: " + "detail " * 30},
        ]
    print("\nturn, replica, prompt tokens P computed, read from D, kept turns D refused")
    for row in rows:
        print("  ", *row)
    assert rows[0][3] == 0  # nothing kept yet
    # Every turn reads at least the previous turn's prompt (in spans of 16, connector/kept_turns.py)
    # from the turn the other replica served.
    for t, _, _, from_d, missed in rows[1:]:
        previous_prompt = rows[t - 1][2] + rows[t - 1][3]
        assert from_d >= previous_prompt // 16 * 16 and missed == 0, rows
