"""Multi-turn benchmark on real engines: history reuse off vs on. Not a test: it prints figures.

    .venv/bin/python bench/multi_turn.py --mode push --conversations 4 --turns 6 --repeats 2

N conversations of M turns go through the router one request at a time (the TTFT of a turn is
then its own, not a queue's). Each turn resends the whole history (an opening of
``--history`` words, about as many tokens, then per turn a scripted reply and a new question
of ``--new`` words) with the conversation in ``x-session-id``, streamed, 16 output tokens.
Variants, each on a fresh 1P1D stack (``router.stack``; P on core 0, D on core 1):

* ``off``: prefix caching off on both engines: every turn computes and moves the whole history;
* ``on``: prefix caching on both and the session header (affinity keeps a conversation on its
  P and D; on 1P1D there is one of each, so this measures what caching gives a session).

Runs alternate ``off``, ``on``, ``off``, ... ``--repeats`` times; printed per turn index: the
median over repeats of the mean TTFT, the ratio on/off, and the KV bytes D received (NIXL
metrics of the engines), then the mean and p99 TTFT over turns >= 3. The ratios move by a few
hundredths between runs on a quiet machine; more on a shared one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from router.stack import Stack

BYTES = {
    "pull": ("decode-0", "vllm:nixl_bytes_transferred_sum"),
    "push": ("prefill-0", "vllm:nixl_bytes_transferred_sum"),
    "pipelined": ("decode-0", "vllm:pdr_bytes_received_total"),
}


def _script(conversations: int, turns: int, history: int, new: int) -> list[list[list[dict]]]:
    out = []
    for c in range(conversations):
        msgs = [{"role": "user", "content": f"Conversation {c}. " + "context " * history}]
        per_turn = []
        for t in range(turns):
            per_turn.append(list(msgs))
            reply = {"role": "assistant", "content": f"Reply {t} in conversation {c}."}
            question = {"role": "user", "content": f"Question {t + 1}: " + "detail " * new}
            msgs = [*msgs, reply, question]
        out.append(per_turn)
    return out


def _ttft(client: httpx.Client, url: str, messages: list[dict], session: str) -> float:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 16,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session}
    ) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - t0
        assert first is not None, "no content in the stream"
        return first


def run_variant(
    args: argparse.Namespace, variant: str
) -> dict[int, tuple[list[float], list[float]]]:
    """Per turn index: TTFTs (s) and KV bytes moved, over every conversation."""
    flag = "--enable-prefix-caching" if variant == "on" else "--no-enable-prefix-caching"
    engine_args = {"prefill-0": [flag], "decode-0": [flag]}
    node, metric = BYTES[args.mode]
    per_turn: dict[int, tuple[list[float], list[float]]] = {}
    with (
        Stack(
            args.mode, variant=args.model, engine_args=engine_args, log=open(Path("/dev/null"), "w")
        ) as stack,
        httpx.Client(timeout=120) as client,
    ):
        _ttft(client, stack.router_url, [{"role": "user", "content": "warm up"}], "warm")
        for c, turns in enumerate(_script(args.conversations, args.turns, args.history, args.new)):
            for t, messages in enumerate(turns):
                before = stack.engine_metrics(node).total(metric)
                ttft = _ttft(client, stack.router_url, messages, f"c{c}")
                time.sleep(0.3)  # let the engine count the transfer
                moved = stack.engine_metrics(node).total(metric) - before
                ttfts, moves = per_turn.setdefault(t, ([], []))
                ttfts.append(ttft)
                moves.append(moved)
    return per_turn


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", choices=list(BYTES), default="push")
    ap.add_argument("--model", default="tiny", help="stack model variant (tiny, bench)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--history", type=int, default=1500, help="opening words (~tokens)")
    ap.add_argument("--new", type=int, default=40, help="words of each new question")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    args = ap.parse_args()
    runs: dict[str, list[dict[int, tuple[list[float], list[float]]]]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for variant in ("off", "on"):
            runs[variant].append(run_variant(args, variant))
    mean_ttft = {
        v: {
            t: statistics.median(statistics.fmean(r[t][0]) for r in runs[v])
            for t in range(args.turns)
        }
        for v in runs
    }
    print(
        f"mode {args.mode}, model {args.model}, {args.conversations} conversations x "
        f"{args.turns} turns, opening {args.history} words, {args.repeats} repeats"
    )
    print("| turn | TTFT off (ms) | TTFT on (ms) | on/off | KV KB off | KV KB on |")
    print("|---|---|---|---|---|---|")
    for t in range(args.turns):
        kb = {v: statistics.fmean(b for r in runs[v] for b in r[t][1]) / 1024 for v in runs}
        off, on = mean_ttft["off"][t] * 1000, mean_ttft["on"][t] * 1000
        print(f"| {t} | {off:.0f} | {on:.0f} | {on / off:.2f} | {kb['off']:.0f} | {kb['on']:.0f} |")
    late = {v: [x for r in runs[v] for t in range(2, args.turns) for x in r[t][0]] for v in runs}
    for v in runs:
        xs = sorted(late[v])
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        print(f"{v}: turns >= 3 mean {statistics.fmean(xs) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    ratios = [
        statistics.fmean(r_on[t][0]) / statistics.fmean(r_off[t][0])
        for r_off, r_on in zip(runs["off"], runs["on"], strict=True)
        for t in range(2, args.turns)
    ]
    print(
        f"on/off mean TTFT at turns >= 3, per repeat and turn: {min(ratios):.2f}-{max(ratios):.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
