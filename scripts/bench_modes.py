#!/usr/bin/env python3
"""Client TTFT of aggregated vs pull vs push on real vLLM engines, as ratios to aggregated.

Starts one stack per mode (router + engines, the wider ``bench`` model so the KV is a visible
part of TTFT), keeps them all up, and interleaves the modes request by request so machine noise
hits every mode alike. Each prompt starts with a random nonce so no cache can serve it. The first
requests of each mode (NIXL handshake, allocator warm-up) are discarded.

    .venv/bin/python scripts/bench_modes.py                 # 128/512/2048 tokens, 15 reps
    .venv/bin/python scripts/bench_modes.py --reps 5 --lengths 128,512

Not a test: it asserts nothing, it prints a table (Markdown) to stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from router.stack import Stack, ensure_model

MODEL = "tiny"  # served model name (the stack's default), whatever the variant


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    modes: list[str] = args.modes.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = ensure_model(args.variant, args.cache_dir)
    text_ids, tok = _token_source(model_dir / "tokenizer.json")
    with contextlib.ExitStack() as stacks:
        urls = {}
        for mode in modes:
            stack = Stack(mode=mode, variant=args.variant, cache_dir=args.cache_dir)
            stacks.enter_context(stack)
            urls[mode] = stack.router_url
        ttfts = _measure(urls, lengths, args.reps, args.warmup, lambda n: _prompt(tok, text_ids, n))
    _print_table(ttfts, modes, lengths, args)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--modes", default="aggregated,pull,push", help="comma-separated; first = base")
    p.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=15, help="measured requests per mode and length")
    p.add_argument("--warmup", type=int, default=3, help="discarded requests per mode and length")
    p.add_argument("--variant", default="bench", help="model variant (bench or tiny)")
    p.add_argument("--cache-dir", default=None, help="default $PD_ROUTER_CACHE or ~/.cache")
    return p.parse_args(argv)


def _token_source(tokenizer_json: Path) -> tuple[list[int], Any]:
    """Token ids of a long, varied text (standard library sources) and the tokenizer."""
    import sysconfig

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / f).read_text() for f in ("argparse.py", "textwrap.py", "shlex.py"))
    return tok.encode(text).ids, tok


def _prompt(tok: Any, ids: list[int], n_tokens: int) -> str:
    """About ``n_tokens`` tokens: a random nonce first (defeats any prefix cache), then text."""
    nonce = f"{random.getrandbits(64):016x} "
    start = random.randrange(len(ids) - n_tokens)
    body: str = tok.decode(ids[start : start + n_tokens - 8])
    return nonce + body


def _measure(
    urls: dict[str, str],
    lengths: list[int],
    reps: int,
    warmup: int,
    make_prompt: Callable[[int], str],
) -> dict[tuple[str, int], list[float]]:
    """TTFT samples in seconds per (mode, length); modes interleaved in random order."""
    results: dict[tuple[str, int], list[float]] = {(m, n): [] for m in urls for n in lengths}
    clients = {m: httpx.Client(base_url=u, timeout=120) for m, u in urls.items()}
    try:
        for n in lengths:
            for i in range(warmup + reps):
                order = list(urls)
                random.shuffle(order)
                for mode in order:
                    ttft = _ttft(clients[mode], make_prompt(n))
                    if i >= warmup:
                        results[(mode, n)].append(ttft)
            summary = ", ".join(f"{m} {_ms(statistics.median(results[(m, n)]))}" for m in urls)
            print(f"[bench] {n} tokens: {summary}", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            client.close()
    return results


def _ttft(client: httpx.Client, prompt: str) -> float:
    """Seconds from sending a streamed completion to its first SSE data event with a choice."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            # Read the whole stream (the request must finish before the next one starts).
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"]:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("stream ended without a token")
    return first


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _print_table(
    ttfts: dict[tuple[str, int], list[float]],
    modes: list[str],
    lengths: list[int],
    args: argparse.Namespace,
) -> None:
    base = modes[0]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\nClient TTFT, median of {args.reps} (after {args.warmup} warm-up) per cell, "
        f"model variant {args.variant!r}, {os.cpu_count()} CPUs, load average at the end "
        f"{load}; ratio = mode / {base}\n"
    )
    print("| prompt tokens | " + " | ".join(modes) + " |")
    print("|---" * (len(modes) + 1) + "|")
    for n in lengths:
        ref = statistics.median(ttfts[(base, n)])
        cells = []
        for mode in modes:
            med = statistics.median(ttfts[(mode, n)])
            cells.append(_ms(med) if mode == base else f"{_ms(med)} ({med / ref:.2f}x)")
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the stacks are already down (context managers)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
