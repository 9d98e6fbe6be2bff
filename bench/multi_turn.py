"""Multi-turn benchmark on real engines: history reuse off, on, or read back from D. Not a test.

    .venv/bin/python bench/multi_turn.py --mode push --conversations 4 --turns 6 --repeats 2
    .venv/bin/python bench/multi_turn.py --mode pull --variants off,on,return --repeats 2
    .venv/bin/python bench/multi_turn.py --mode pipelined --variants off,on,return --repeats 2

N conversations of M turns go through the router one request at a time (the TTFT of a turn is
then its own, not a queue's). Each turn resends the whole history (an opening of
``--history`` words, about as many tokens, then per turn a scripted reply and a new question
of ``--new`` words) with the conversation in ``x-session-id``, streamed, 16 output tokens.
Variants, each on a fresh 1P1D stack (``router.stack``; P on core 0, D on core 1):

* ``off``: prefix caching off on both engines: every turn computes and moves the whole history;
* ``on``: prefix caching on both and the session header (affinity keeps a conversation on its
  P and D; on 1P1D there is one of each, so this measures what caching gives a session);
* ``return`` (pull and pipelined): prefix caching off, as on a P that lost the conversation,
  and kept turns on (the router's ``kept_turns``; in pull mode vLLM's
  ``bidirectional_kv_xfer``, in pipelined this project's connector): P reads the history D
  kept from the last turn instead of recomputing it.

vLLM 0.32 hands D's kept blocks back only in non-streaming answers, so a pull run with
``return`` sends every variant's turns non-streamed with ``--tokens`` (default 2 then, 16
otherwise) and prints their latency, which is TTFT plus ``--tokens - 1`` decode steps, in
place of TTFT. This project's connector keeps streamed turns too: pipelined runs stream.

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
from typing import Any

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


def _turn(client: httpx.Client, url: str, messages: list[dict], session: str, args: Any) -> float:
    """Seconds to the first token (streamed) or to the whole answer (not streamed)."""
    body = {
        "model": args.model,
        "messages": messages,
        "max_tokens": args.tokens,
        "stream": args.stream,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    if not args.stream:
        r = client.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session})
        r.raise_for_status()
        return time.perf_counter() - t0
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


# per turn index: seconds, KV bytes D received, KV bytes P read back from D
PerTurn = dict[int, tuple[list[float], list[float], list[float]]]


# KV bytes P read back from D: NixlConnector counts its READs; this project's connector the
# bytes P received.
BACK = {"pull": "vllm:nixl_bytes_transferred_sum", "pipelined": "vllm:pdr_bytes_received_total"}


def _moved(stack: Stack, node: str, metric: str) -> tuple[float, float]:
    """KV bytes so far: received by D, and read back by P."""
    if not stack.kept_turns:
        return stack.engine_metrics(node).total(metric), 0.0
    back = stack.engine_metrics("prefill-0").total(BACK[stack.mode.value])
    return stack.engine_metrics(node).total(metric), back


def run_variant(args: argparse.Namespace, variant: str) -> PerTurn:
    """Per turn index: TTFTs (s) and KV bytes moved, over every conversation."""
    flag = "--enable-prefix-caching" if variant == "on" else "--no-enable-prefix-caching"
    engine_args = {"prefill-0": [flag], "decode-0": [flag]}
    node, metric = BYTES[args.mode]
    per_turn: PerTurn = {}
    with (
        Stack(
            args.mode,
            variant=args.model,
            engine_args=engine_args,
            kept_turns=variant == "return",
            log=open(Path("/dev/null"), "w"),
        ) as stack,
        httpx.Client(timeout=120) as client,
    ):
        _turn(client, stack.router_url, [{"role": "user", "content": "warm up"}], "warm", args)
        for c, turns in enumerate(_script(args.conversations, args.turns, args.history, args.new)):
            for t, messages in enumerate(turns):
                before = _moved(stack, node, metric)
                ttft = _turn(client, stack.router_url, messages, f"c{c}", args)
                time.sleep(0.3)  # let the engine count the transfer
                moved = [a - b for a, b in zip(_moved(stack, node, metric), before, strict=True)]
                ttfts, moves, back = per_turn.setdefault(t, ([], [], []))
                ttfts.append(ttft)
                moves.append(moved[0])
                back.append(moved[1])
    return per_turn


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def _report(args: argparse.Namespace, runs: dict[str, list[PerTurn]]) -> None:
    label = "TTFT" if args.stream else f"latency ({args.tokens} tokens)"
    mean = {
        v: [
            statistics.median(statistics.fmean(r[t][0]) for r in runs[v]) for t in range(args.turns)
        ]
        for v in runs
    }
    others = [v for v in runs if v != "off"]
    print(
        f"mode {args.mode}, model {args.model}, {args.conversations} conversations x "
        f"{args.turns} turns, opening {args.history} words, {args.repeats} repeats, "
        f"{'streamed' if args.stream else 'not streamed'}, {args.tokens} output tokens"
    )
    head = [f"{label} {v} (ms)" for v in runs] + [f"{v}/off" for v in others]
    head += [f"KV KB {v}" for v in runs] + ["KV KB back to P" for v in runs if v == "return"]
    print("| turn | " + " | ".join(head) + " |")
    print("|---" * (len(head) + 1) + "|")
    for t in range(args.turns):
        cells = [f"{mean[v][t] * 1000:.0f}" for v in runs]
        cells += [f"{mean[v][t] / mean['off'][t]:.2f}" for v in others]
        cells += [
            f"{statistics.fmean(b for r in runs[v] for b in r[t][1]) / 1024:.0f}" for v in runs
        ]
        if "return" in runs:
            back = statistics.fmean(b for r in runs["return"] for b in r[t][2])
            cells.append(f"{back / 1024:.0f}")
        print(f"| {t} | " + " | ".join(cells) + " |")
    for v in runs:
        xs = [x for r in runs[v] for t in range(2, args.turns) for x in r[t][0]]
        late_mean, late_p99 = statistics.fmean(xs) * 1000, _p99(xs) * 1000
        print(f"{v}: turns >= 3 mean {late_mean:.0f} ms, p99 {late_p99:.0f} ms")
    for v in others:
        ratios = [
            statistics.fmean(r_v[t][0]) / statistics.fmean(r_off[t][0])
            for r_off, r_v in zip(runs["off"], runs[v], strict=True)
            for t in range(2, args.turns)
        ]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(f"{v}/off mean {label} at turns >= 3, per repeat and turn: {spread}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", choices=list(BYTES), default="push")
    ap.add_argument("--model", default="tiny", help="stack model variant (tiny, bench)")
    ap.add_argument("--variants", default="off,on", help="off, on, return (pull, pipelined)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--history", type=int, default=1500, help="opening words (~tokens)")
    ap.add_argument("--new", type=int, default=40, help="words of each new question")
    ap.add_argument("--tokens", type=int, help="output tokens per turn (16; 2 with return)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if "off" not in variants or not set(variants) <= {"off", "on", "return"}:
        ap.error("--variants: off and any of on, return")
    if "return" in variants and args.mode not in BACK:
        ap.error("the return variant needs --mode pull or pipelined")
    args.stream = "return" not in variants or args.mode == "pipelined"
    args.tokens = args.tokens or (16 if args.stream else 2)
    runs: dict[str, list[PerTurn]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            runs[variant].append(run_variant(args, variant))
    _report(args, runs)
    if args.json:
        args.json.write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
