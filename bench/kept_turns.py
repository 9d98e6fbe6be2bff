"""How often a conversation's next turn reads the turn D kept. Not a test.

    .venv/bin/python bench/kept_turns.py --mode pipelined --conversations 6 --turns 5

N conversations of M turns, one request at a time, through the router of one 1P1D stack
(``router.stack`` with ``kept_turns``, prefix caching off) with the ``openai`` SDK, as a chat
client sends them: the conversation in ``x-session-id``, each turn the whole history with the
model's own reply and a new question. Pipelined turns are streamed: the SDK stops reading at
the terminal ``[DONE]`` event and closes, as most clients do; pull turns are not (vLLM keeps
only those). After each turn the script waits for P to count it, then reads from P's
``vllm:prompt_tokens_by_source_total`` how many prompt tokens came from D. A turn *reads its
kept turn* when that is at least the previous turn's prompt (rounded down to the 16-token
spans P compares in pipelined mode). Printed: per turn index, the turns that read it, then
the total with the router's and the connector's counts of kept, offered and missed turns, and
the router's count of requests by outcome (a client that closes at ``[DONE]`` is a success).
"""

from __future__ import annotations

import argparse
from typing import Any

import openai

from router.stack import Stack
from router.stack.metrics import MetricsPage, scrape
from tests.e2e import helpers as h

BY_SOURCE = "vllm:prompt_tokens_by_source_total"
FINISHED = "vllm:request_success_total"
KEPT_TURNS = "pdrouter_kept_turns_total"
OUTCOMES = ("success", "client_disconnect", "upstream_error")
MAX_TOKENS = 16


def _ask(client: openai.OpenAI, model: str, messages: list[dict[str, str]], stream: bool) -> str:
    msgs: Any = list(messages)
    if not stream:
        r = client.chat.completions.create(
            model=model, messages=msgs, temperature=0.0, max_tokens=MAX_TOKENS
        )
        return r.choices[0].message.content or ""
    chunks = client.chat.completions.create(
        model=model, messages=msgs, temperature=0.0, max_tokens=MAX_TOKENS, stream=True
    )
    return "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)


def _settled(p_url: str, before: MetricsPage) -> MetricsPage:
    """P's metrics once it has counted one more finished request and its tokens stopped moving
    (in pipelined mode D's answer may end before P's request does)."""
    h.wait_until(lambda: (h.delta(scrape(p_url), before, FINISHED) >= 1, "P"), timeout_s=15)
    return h.settled(lambda: scrape(p_url), BY_SOURCE)


def _conversation(stack: Stack, c: int, turns: int, hits: list[list[bool]]) -> None:
    client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="-", max_retries=0)
    client = client.with_options(default_headers={"x-session-id": f"conversation-{c}"})
    p_url = stack.engine("prefill-0").url
    grain = 16 if stack.mode.value == "pipelined" else 1
    messages = [{"role": "user", "content": f"Conversation {c}. " + "context " * 600}]
    last_prompt = 0
    for t in range(turns):
        before = scrape(p_url)
        reply = _ask(client, stack.model_name, messages, stream=stack.mode.value == "pipelined")
        after = _settled(p_url, before)
        from_d = h.delta(after, before, BY_SOURCE, source="external_kv_transfer")
        computed = h.delta(after, before, BY_SOURCE, source="local_compute")
        if t > 0:
            hits[t].append(from_d >= last_prompt // grain * grain)
        last_prompt = int(from_d + computed)
        messages = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Question {t + 1}: " + "detail " * 30},
        ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("pipelined", "pull"), default="pipelined")
    ap.add_argument("--model", default="tiny", help="model variant (router.stack.models)")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    hits: list[list[bool]] = [[] for _ in range(args.turns)]
    with Stack(variant=args.model, mode=args.mode, kept_turns=True) as stack:
        for c in range(args.conversations):
            _conversation(stack, c, args.turns, hits)
        router = stack.router_metrics()
        p = stack.engine_metrics("prefill-0")
    print(f"mode {args.mode}, {args.conversations} conversations x {args.turns} turns")
    print("turn  read the kept turn")
    for t in range(1, args.turns):
        print(f"{t:>4}  {sum(hits[t])} of {len(hits[t])}")
    total = [h for row in hits for h in row]
    print(f"all   {sum(total)} of {len(total)} ({100 * sum(total) / max(1, len(total)):.0f}%)")
    counts = {r: int(router.total(KEPT_TURNS, result=r)) for r in ("kept", "offered", "reused")}
    print("router:", ", ".join(f"{k} {v}" for k, v in counts.items()))
    outcomes = {o: int(router.total("pdrouter_requests_total", outcome=o)) for o in OUTCOMES}
    print("router, requests by outcome:", ", ".join(f"{k} {v}" for k, v in outcomes.items()))
    if args.mode == "pipelined":
        print("P: kept turns missed", int(p.total("vllm:pdr_kept_missed_total")))


if __name__ == "__main__":
    main()
