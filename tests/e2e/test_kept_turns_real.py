"""Kept turns, on real engines: a conversation whose history holds the model's own
replies, one turn after the other with the session in ``x-session-id``. In pull mode (vLLM's
``bidirectional_kv_xfer`` on both engines) the turns are not streamed (vLLM keeps only
those); in pipelined mode (this project's connector) they are streamed. Prefix caching is
off, as on a P whose cache lost the conversation (or another P): from the second turn on, P
takes the history it would recompute from D over NIXL instead, at least the previous turn's
whole prompt, and computes only the rest. The answers equal the aggregated engine's (which
recomputes every history) up to near-ties: the reply's KV now comes from D's decode steps,
not from a prefill, and rounds differently, as it would in any prefix cache
(``helpers.first_disagreement``).
"""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from router.stack.metrics import MetricsPage
from tests.e2e import helpers as h
from tests.e2e.conftest import AnyStack, Reference, feed_back
from tests.engine_stacks import NEEDS_REFERENCE, Running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BY_SOURCE = "vllm:prompt_tokens_by_source_total"
FINISHED = "vllm:request_success_total"
KEPT_TURNS = "pdrouter_kept_turns_total"
RESULTS = ("kept", "reused", "partial", "offered", "mismatch", "expired", "unavailable")


# How each mode's turns are asked (see the module doc).
ASK: dict[str, Callable[[openai.OpenAI, str, list[dict[str, str]]], h.Reply]] = {
    "pull": h.chat_top2,
    "pipelined": h.chat_top2_streamed,
}


# Pull: the real model's pull engines, which keep finished turns (vLLM's bidirectional_kv_xfer
# keeps every finished request's blocks on D, which the tiny pull stack's tests must not see);
# the reference is that stack's D alone. Pipelined: the shared tiny engines (this project's
# connector keeps a turn only when asked) through a second router that asks; the reference is
# the run's aggregated one.
pytestmark.append(
    pytest.mark.parametrize(
        "engine_stack", ["smol-pull", "pipelined"], indirect=True, ids=list(ASK)
    )
)


@pytest.fixture
def stack(engine_stack: Running) -> AnyStack:
    if engine_stack.kind == "pipelined":
        routed: AnyStack = engine_stack.routed("kept-turns", kept_turns=True)
        return routed
    st: AnyStack = engine_stack.stack
    return st


@pytest.fixture
def replies(
    request: pytest.FixtureRequest, engine_stack: Running, stack: AnyStack
) -> list[h.Reply]:
    """The conversation as one engine alone answers it (``feed_back``): the run's aggregated
    reference on the tiny model; on the real model, its D asked directly (a request without
    ``kv_transfer_params`` is an ordinary local one, kept by no one), once per stack."""
    if engine_stack.kind in NEEDS_REFERENCE:
        reference: Reference = request.getfixturevalue("reference")
        return reference.replies
    client = h.client_for(stack.decode.url)
    ask = ASK[stack.mode.value]

    def make(_: object) -> list[h.Reply]:
        return feed_back(lambda m: ask(client, stack.model_name, m))

    made: list[h.Reply] = engine_stack.shared("kept-turn-replies", make)
    return made


def test_next_turn_reads_the_history_from_d(stack: AnyStack, replies: list[h.Reply]) -> None:
    client = h.client_for(stack.router_url).with_options(
        default_headers={"x-session-id": "long-talk"}
    )
    rows: list[tuple[int, float, float, int]] = []  # turn, P computed, P from D, prompt tokens
    ask = ASK[stack.mode.value]
    # Other tests on this stack (test_kv_events_real) pull kept turns too: counts are deltas.
    p0, router0 = stack.engine_metrics("prefill-0"), stack.router_metrics()

    def say(messages: list[dict[str, str]]) -> h.Reply:
        before = stack.engine_metrics("prefill-0")
        reply = ask(client, stack.model_name, messages)
        after = _p_counted(stack, before)
        computed = h.delta(after, before, BY_SOURCE, source="local_compute")
        from_d = h.delta(after, before, BY_SOURCE, source="external_kv_transfer")
        rows.append((len(rows), computed, from_d, int(computed + from_d)))
        router = stack.router_metrics()
        print("turn", len(rows) - 1, {r: router.total(KEPT_TURNS, result=r) for r in RESULTS})
        return reply

    got = feed_back(say)
    print("\nturn, P computed, P read from D, prompt tokens")
    for row in rows:
        print("  ", *row)
    # Turn by turn until the first answer that differs: the histories differ from there on.
    for turn, (mine, want) in enumerate(zip(got, replies, strict=True)):
        assert h.first_disagreement(mine, want) is None, (turn, h.first_disagreement(mine, want))
        if mine.token_ids != want.token_ids:
            print(f"turn {turn}: a near-tie went the other way; later turns not compared")
            break
    assert rows[0][2] == 0  # nothing kept yet
    # Pull: the router compares token ids; pipelined: P compares hashes of 16
    # (connector/kept_turns.py).
    grain = 16 if stack.mode.value == "pipelined" else 1
    # Every turn reads at least the last turn's prompt from D.
    assert all(from_d >= rows[t - 1][3] // grain * grain for t, _, from_d, _ in rows[1:]), rows
    if stack.mode.value == "pipelined":  # the connector's own counts of what P read
        p = stack.engine_metrics("prefill-0")
        pulled = h.delta(p, p0, "vllm:pdr_tokens_pulled_total")
        assert pulled == sum(row[2] for row in rows)
        assert h.delta(p, p0, "vllm:pdr_kept_missed_total") == 0
    router = stack.router_metrics()
    results = ("reused", "partial", "offered")  # pipelined: offered, P checks it
    assert sum(h.delta(router, router0, KEPT_TURNS, result=r) for r in results) == len(rows) - 1
    assert h.delta(router, router0, KEPT_TURNS, result="mismatch") == 0


def test_an_edited_history_is_recomputed(stack: AnyStack) -> None:
    """The same conversation's first turn, then a second turn whose first message was
    changed: P computes it all (nothing from D) and the answer is the fresh request's."""
    client = h.client_for(stack.router_url).with_options(
        default_headers={"x-session-id": "edited-talk"}
    )
    first = [{"role": "user", "content": "A long talk. " + "context " * 600}]
    h.chat(client, stack.model_name, first, stream=False)
    edited = [{"role": "user", "content": "A long talk. " + "other " * 600}]
    fresh = h.chat(h.client_for(stack.router_url), stack.model_name, edited, stream=False)
    before = stack.engine_metrics("prefill-0")
    again = h.chat(client, stack.model_name, edited, stream=False)
    after = _p_counted(stack, before)
    # P counted this request (it computed the prompt), and none of it came from D.
    assert h.delta(after, before, BY_SOURCE, source="local_compute") > 0
    assert h.delta(after, before, BY_SOURCE, source="external_kv_transfer") == 0
    assert again.token_ids == fresh.token_ids
    if stack.mode.value == "pull":  # the router compares token ids; in pipelined, P does
        assert stack.router_metrics().total(KEPT_TURNS, result="mismatch") >= 1


def _p_counted(stack: AnyStack, before: MetricsPage) -> MetricsPage:
    """P's metrics once it has counted one more finished request and its prompt tokens by
    source have settled: in pipelined mode D's answer may end before P's own is counted, and
    a check that nothing came from D proves nothing before then."""
    ok, what, _ = h.wait_until(
        lambda: (h.delta(stack.engine_metrics("prefill-0"), before, FINISHED) >= 1, "P"),
        timeout_s=10,
    )
    assert ok, f"P never counted the request ({what})"
    return h.settled(lambda: stack.engine_metrics("prefill-0"), BY_SOURCE)
