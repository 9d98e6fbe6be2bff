"""KV that flows back, on real engines (pull mode, vLLM's ``bidirectional_kv_xfer`` on both):
a conversation whose history holds the model's own replies, one non-streaming turn after the
other with the session in ``x-session-id``. Prefix caching is off, as on a P whose cache lost
the conversation (or another P): every answer equals the aggregated engine's, and from the
second turn on P takes the history it would recompute from D over NIXL instead, at least the
previous turn's whole prompt, and computes only the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from router.stack import Stack
from tests.e2e import helpers as h
from tests.e2e.conftest import MODEL, Reference, feed_back

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BY_SOURCE = "vllm:prompt_tokens_by_source_total"
KV_RETURN = "pdrouter_kv_return_total"


@pytest.fixture(scope="module")
def stack(reference: Reference) -> Iterator[Stack]:
    with Stack(variant=h.FAST, mode="pull", kv_return=True) as st:
        h.complete(h.client_for(st.router_url), MODEL, "warm-up", stream=False, max_tokens=2)
        yield st


def test_next_turn_reads_the_history_from_d(stack: Stack, reference: Reference) -> None:
    client = h.client_for(stack.router_url).with_options(
        default_headers={"x-session-id": "long-talk"}
    )
    rows: list[tuple[int, float, float, int]] = []  # turn, P computed, P from D, prompt tokens

    def say(messages: list[dict[str, str]]) -> h.Output:
        before = stack.engine_metrics("prefill-0")
        msgs: Any = messages
        r = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=h.MAX_TOKENS, **h.GREEDY
        )
        after = h.settled(lambda: stack.engine_metrics("prefill-0"), BY_SOURCE)
        computed = h.delta(after, before, BY_SOURCE, source="local_compute")
        from_d = h.delta(after, before, BY_SOURCE, source="external_kv_transfer")
        assert r.usage is not None
        rows.append((len(rows), computed, from_d, r.usage.prompt_tokens))
        choice = r.choices[0]
        return h.Output(choice.message.content or "", h.token_ids(choice), choice.finish_reason)

    got = feed_back(say)
    print("\nturn, P computed, P read from D, prompt tokens")
    for row in rows:
        print("  ", *row)
    assert [(o.token_ids, o.text) for o in got] == [
        (o.token_ids, o.text) for o in reference.replies
    ]
    assert rows[0][2] == 0  # nothing kept yet
    for turn, computed, from_d, prompt in rows[1:]:
        previous_prompt = rows[turn - 1][3]
        assert from_d >= previous_prompt, rows  # at least the last turn's prompt, from D
        assert computed + from_d == prompt, rows
    router = stack.router_metrics()
    reused = router.total(KV_RETURN, result="reused") + router.total(KV_RETURN, result="partial")
    assert reused == len(rows) - 1
    assert router.total(KV_RETURN, result="mismatch") == 0


def test_an_edited_history_is_recomputed(stack: Stack, reference: Reference) -> None:
    """The same conversation's first turn, then a second turn whose first message was
    changed: P computes it all (nothing from D) and the answer is the fresh request's."""
    client = h.client_for(stack.router_url).with_options(
        default_headers={"x-session-id": "edited-talk"}
    )
    first = [{"role": "user", "content": "A long talk. " + "context " * 600}]
    h.chat(client, MODEL, first, stream=False)
    edited = [{"role": "user", "content": "A long talk. " + "other " * 600}]
    before = stack.engine_metrics("prefill-0")
    h.chat(client, MODEL, edited, stream=False)
    after = h.settled(lambda: stack.engine_metrics("prefill-0"), BY_SOURCE)
    assert h.delta(after, before, BY_SOURCE, source="external_kv_transfer") == 0
    assert stack.router_metrics().total(KV_RETURN, result="mismatch") >= 1
