"""What cache-aware routing costs per request: the prompt's token ids, and the router's lookup.
Not a test.

    flock /tmp/pd-engines.lock .venv/bin/python bench/tokenize_cost.py --variant smollm2

Starts one real vLLM engine (the stack's model, ``router.stack``), then for chat prompts of
several sizes measures, ``--repeats`` times each, side by side:

* ``engine /tokenize``: the engine's ``POST /tokenize`` over a kept-alive HTTP connection, what
  the router does per request (router/kvindex/tokens.py);
* ``local tokenizer``: the same ids from the model's own files in this process
  (``transformers``: the chat template, then the tokenizer), the alternative; the ids are
  checked equal to the engine's;
* ``router lookup``: the router's own work once it has the ids: the prompt's block keys
  (router/kvindex/blocks.py) and the longest match against 16 engines' indexes that each hold
  the prompt's first half (router/kvindex/route.py), with 16-token blocks (vLLM's default on
  GPUs; 128 on CPU means 8 times fewer keys).

Prints the median and p99 in milliseconds, then what following the engines costs the router:
microseconds of its event loop per block stored (decoding a vLLM 0.32 payload and indexing its
blocks). The engine shares the machine's cores with this
process: on a loaded machine the HTTP call pays for the engine's API server being descheduled.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx

from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from router.kvindex.blocks import pack
from router.kvindex.engine import EngineIndex
from router.kvindex.route import CacheRoute
from router.kvindex.wire import Batch, Stored, decode_batch
from router.stack import Stack

WORDS = ("route", "engine", "prompt", "cache", "token", "block", "reply", "turn")
BLOCK = 16  # vLLM's default KV block on GPUs
ENGINES = 16


def _messages(words: int) -> list[dict[str, str]]:
    text = " ".join(WORDS[i % len(WORDS)] + str(i % 97) for i in range(words))
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": text},
    ]


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    fn()  # warm
    samples, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return statistics.median(samples), p99, out


def _indexes(tokens: list[int]) -> dict[str, EngineIndex]:
    """16 known engines, each holding the prompt's first half (one BlockStored)."""
    half = tokens[: len(tokens) // 2 // BLOCK * BLOCK]
    out = {}
    for i in range(ENGINES):
        index = EngineIndex(1_000_000)
        index.known = True
        hashes = tuple(range(len(half) // BLOCK))
        index.apply(Batch(0.0, (Stored(hashes, None, pack(half), BLOCK, "GPU", True),), 0))
        out[f"http://e{i}"] = index
    return out


def _lookup(tokens: list[int], views: dict[str, EngineIndex]) -> Callable[[], Any]:
    engines = [Instance(u, Role.DECODE, "m", Breaker(3, 1.0)) for u in views]

    def run() -> Instance | None:
        route = CacheRoute(tokens, "tie", views.get, lambda i: 0, 1.25, 256)
        return route(Role.DECODE, engines)

    return run


def _apply_cost(batches: int = 2000, blocks: int = 8) -> float:
    """Microseconds per block to decode and index vLLM payloads of ``blocks`` blocks each."""
    import msgspec

    index = EngineIndex(10_000_000)
    payloads = []
    for b in range(batches):
        tokens = list(range(b * blocks * BLOCK, (b + 1) * blocks * BLOCK))
        event = {
            "type": "BlockStored",
            "block_hashes": list(range(b * blocks, (b + 1) * blocks)),
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        payloads.append(msgspec.msgpack.encode([time.time(), [event], 0]))
    t0 = time.perf_counter()
    for payload in payloads:
        index.apply(decode_batch(payload))
    return (time.perf_counter() - t0) / (batches * blocks) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="smollm2")
    ap.add_argument("--words", default="250,1000,3000", help="prompt sizes, in words")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    rows = []
    with Stack(mode="aggregated", variant=args.variant, with_router=False) as stack:
        assert stack.model_path is not None
        local = AutoTokenizer.from_pretrained(str(stack.model_path))
        url = stack.decode.url + "/tokenize"
        with httpx.Client(timeout=30) as client:
            for words in (int(w) for w in args.words.split(",")):
                messages = _messages(words)
                body = {"model": stack.model_name, "messages": messages}

                def remote(body: dict[str, Any] = body) -> list[int]:
                    tokens: list[int] = client.post(url, json=body).json()["tokens"]
                    return tokens

                def in_process(messages: list[dict[str, str]] = messages) -> list[int]:
                    ids = local.apply_chat_template(
                        messages, tokenize=True, add_generation_prompt=True
                    )
                    # transformers 5 answers a BatchEncoding (a mapping), older ones a list.
                    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

                r_med, r_p99, ids = _timed(remote, args.repeats)
                l_med, l_p99, local_ids = _timed(in_process, args.repeats)
                k_med, k_p99, _ = _timed(_lookup(ids, _indexes(ids)), args.repeats)
                rows.append((len(ids), r_med, r_p99, l_med, l_p99, k_med, k_p99, local_ids == ids))
    print(f"\nmodel {args.variant}, {args.repeats} requests per size, milliseconds (median / p99)")
    print(
        "| prompt tokens | engine /tokenize | local tokenizer | router lookup (16 engines) "
        "| local ids = engine ids |"
    )
    print("|---|---|---|---|---|")
    for n, rm, rp, lm, lp, km, kp, same in rows:
        print(f"| {n} | {rm:.2f} / {rp:.2f} | {lm:.2f} / {lp:.2f} | {km:.3f} / {kp:.3f} | {same} |")
    print(f"\nindexing vLLM events: {_apply_cost():.1f} us per {BLOCK}-token block stored")


if __name__ == "__main__":
    main()
