"""Multi-turn conversations on real engines with prefix caching on both P and D (issue: only
the missing KV moves). Per mode (pull: ``NixlConnector``, push: ``NixlPushConnector``,
pipelined: this project's connector), two conversations of five turns, each turn resending
the whole history with the session in ``x-session-id``:

* every answer equals the aggregated engine's (prefix caching off there), turn by turn, and an
  edited history gets the fresh request's answer; where the aggregated engine's two best
  tokens were a near-tie, the first difference may be there (KV computed in another order,
  as a prefix cache reuses it, rounds differently: ``helpers.first_disagreement``; seen at
  one turn of all three modes in a clean-clone run, 2026-12-06);
* from the second turn on, P finds the history in its prefix cache and computes only the
  rest, and D receives over NIXL only the blocks its own cache lacks: its KV bytes are those
  of the tokens it did not hold, not the whole history's.
"""

from __future__ import annotations

import time

import pytest

from router.stack import Stack
from router.stack.metrics import MetricsPage
from tests.e2e import helpers as h
from tests.e2e.conftest import (
    MODEL,
    MULTI_TURN_CONVERSATIONS,
    MULTI_TURN_TURNS,
    Reference,
    multi_turn,
)
from tests.engine_stacks import Running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BY_SOURCE = "vllm:prompt_tokens_by_source_total"
# KV bytes D received: NixlConnector/NixlPushConnector count them as transfers on the side
# that posts them (D pulls, P pushes); this project's connector counts them on D.
KV_BYTES = {
    "pull": ("decode-0", "vllm:nixl_bytes_transferred_sum"),
    "push": ("prefill-0", "vllm:nixl_bytes_transferred_sum"),
    "pipelined": ("decode-0", "vllm:pdr_bytes_received_total"),
}
BLOCK_TOKENS = 128  # vLLM's KV block on CPU: transfers move whole blocks
SETTLE_S = 10.0
# Engines with prefix caching on (tests/engine_stacks.py), one stack per mode.
pytestmark.append(
    pytest.mark.parametrize(
        "engine_stack", [f"{m}-cached" for m in KV_BYTES], indirect=True, ids=list(KV_BYTES)
    )
)


@pytest.fixture
def cached_stack(engine_stack: Running) -> Stack:
    st: Stack = engine_stack.stack
    return st


def _kv_bytes_per_token() -> int:
    from router.stack.model import ensure_model, kv_bytes_per_token

    return kv_bytes_per_token(ensure_model(h.FAST))


def _snapshot(stack: Stack) -> dict[str, MetricsPage]:
    """Both engines' metrics once they have counted everything (two scrapes 0.2 s apart
    agree: engines count a request's tokens and transfers after its answer); fails the test
    if they still move after ``SETTLE_S``."""
    last = _scrape(stack)
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _scrape(stack)
        if all(_key(now[n]) == _key(last[n]) for n in now):
            return now
        last = now
    raise AssertionError(f"engine counters still moving after {SETTLE_S} s")


def _scrape(stack: Stack) -> dict[str, MetricsPage]:
    return {name: stack.engine_metrics(name) for name in ("prefill-0", "decode-0")}


def _key(m: MetricsPage) -> tuple[float, ...]:
    names = (BY_SOURCE, *{b for _, b in KV_BYTES.values()})
    return tuple(m.total(n) for n in names)


def test_turns_equal_the_aggregated_engine_and_move_only_missing_kv(
    cached_stack: Stack, reference: Reference
) -> None:
    stack = cached_stack
    node, kv_bytes = KV_BYTES[stack.mode.value]
    per_token = _kv_bytes_per_token()
    script = multi_turn()
    mismatches, rows = [], []
    previous: dict[str, float] = {}  # each conversation's last prompt length, in tokens
    # Settled after the last turn, nothing runs between two turns: one turn's "after" is the
    # next one's "before" (a settle costs a few scrapes of both engines).
    after = _snapshot(stack)
    for name, messages in script.items():
        conversation = "c0" if name == "edited" else name.split("t")[0]
        client = h.client_for(stack.router_url).with_options(
            default_headers={"x-session-id": conversation}
        )
        before = after
        got = h.chat(client, MODEL, messages, stream=name.endswith("t1"))
        after = _snapshot(stack)
        want = reference.turns[name]
        differs = h.first_disagreement(got, want)
        if differs is not None:
            mismatches.append(f"{name}: {differs}: {got.text!r} != {want.text!r}")
        p_hit = h.delta(
            after["prefill-0"], before["prefill-0"], BY_SOURCE, source="local_cache_hit"
        )
        p_computed = h.delta(
            after["prefill-0"], before["prefill-0"], BY_SOURCE, source="local_compute"
        )
        d_hit = h.delta(after["decode-0"], before["decode-0"], BY_SOURCE, source="local_cache_hit")
        d_moved = h.delta(
            after["decode-0"], before["decode-0"], BY_SOURCE, source="external_kv_transfer"
        )
        moved_bytes = h.delta(after[node], before[node], kv_bytes)
        rows.append((name, p_hit, p_computed, d_hit, d_moved, moved_bytes))
        prompt = p_hit + p_computed
        assert d_hit + d_moved == prompt, (name, rows[-1])
        # Whole blocks of the tokens D lacked, never the history's.
        assert moved_bytes <= (d_moved + BLOCK_TOKENS) * per_token, (name, rows[-1])
        if name.endswith("t0"):
            assert p_hit == 0 and d_hit == 0, (name, rows[-1])
        elif name != "edited":
            # The last turn's whole prompt (its full blocks) came from both caches.
            cached = previous[conversation] // BLOCK_TOKENS * BLOCK_TOKENS
            assert p_hit >= cached and d_hit >= cached, (name, cached, rows[-1])
            assert moved_bytes < prompt * per_token / 2, (name, rows[-1])
        if name != "edited":
            previous[conversation] = prompt
    print(f"\n{stack.mode.value}: name, P cache hit, P computed, D cache hit, D received, bytes")
    for row in rows:
        print("  ", *row)
    assert mismatches == []
    last_turns = [r for r in rows if r[0].endswith(f"t{MULTI_TURN_TURNS - 1}")]
    assert len(last_turns) == MULTI_TURN_CONVERSATIONS
