"""Cache-aware routing (KV events) against today's policies, on fake engines. Not a test.

    .venv/bin/python bench/cache_routing.py
    .venv/bin/python bench/cache_routing.py --workloads shared-prefix --replicas 1

Fake engines (tests/fakes: 4 P and 4 D, pull mode) with a prefix cache and KV events in vLLM
0.32's wire format, whose prefill takes ``--prefill-us`` per prompt token not in P's cache, one
prompt after the other per engine (so an engine that takes more than its share queues), and
whose D takes ``--receive-us`` per prompt token not in D's cache before its first token (each
engine's cache holds ``--cache-blocks`` blocks of 16 tokens, least recently used evicted): time
proportional to uncached tokens stands in for a real engine's prefill and transfer, so the
comparison is of routing, not of engines. ``--replicas`` routers serve the same engines,
requests spread over them in turn; every policy runs on fresh engines with the same requests.
The routers run as processes of their own (``pd-router serve``); the engines and the clients
share this one.

Workloads:

* ``shared-prefix``: requests without a session id, each one of a few long system prompts
  (``--systems``, ``--system-tokens``) and a question of its own; ``--clients`` closed-loop
  clients;
* ``multi-turn``: conversations (``--conversations`` x ``--turns``) with a session id, each an
  opening of its own, replies of 16 tokens and a new question per turn; consecutive turns go to
  different replicas; ``--clients`` conversations at a time.

Policies: ``least_loaded`` (the default policy), ``prefix_hash`` (rendezvous on the prompt's
first 256 characters), ``prefix_fallback`` (sessions keyed by the prompt's start),
``sessions`` (affinity by session id, the default for multi-turn) and ``kv_events`` (this
change). Printed per workload and policy: prompt tokens found in P's and in D's cache (of all
prompt tokens sent), and the client's TTFT (mean, p50, p99).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from router.config import parse_config
from tests.fakes.fake_vllm import FakeEngine, KvBus
from tests.fakes.kv_cluster import events_config
from tests.fakes.router_proc import router_process
from tests.fakes.servers import serve

POLICIES = {
    "shared-prefix": ["least_loaded", "prefix_hash", "prefix_fallback", "kv_events"],
    "multi-turn": ["least_loaded", "sessions", "kv_events"],
}


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    prompt: int = 0
    p_cached: int = 0
    d_cached: int = 0


@contextlib.asynccontextmanager
async def cluster(
    args: argparse.Namespace, policy: str
) -> AsyncIterator[tuple[list[str], list[FakeEngine]]]:
    """Fresh engines and ``--replicas`` routers configured for ``policy``; yields the routers'
    URLs and the engines."""
    bus = KvBus()
    async with contextlib.AsyncExitStack() as stack:
        engines = [FakeEngine(f"{r}{i}", bus) for r in "pd" for i in range(args.engines)]
        urls = [await stack.enter_async_context(serve(e)) for e in engines]
        for e in engines:
            await e.start_kv_events(capacity=args.cache_blocks)
            stack.push_async_callback(e.stop_kv_events)
        for e in engines:
            b = e.behaviour
            b.tokens, b.compute_token_delay = 16, args.prefill_us / 1e6
            b.receive_token_delay = args.receive_us / 1e6
            b.compute_one_at_a_time = True  # an engine's prefill capacity is finite
        n = args.engines
        model: dict[str, Any] = {
            "name": "tiny",
            "mode": "pull",
            "prefill": [{"url": u} for u in urls[:n]],
            "decode": [{"url": u, "slots": 256} for u in urls[n:]],
            "sessions": {
                "enabled": policy in ("sessions", "prefix_fallback", "kv_events"),
                "load_factor": args.load_factor,
            },
        }
        if policy == "prefix_hash":
            model["policy"] = {"prefill": "prefix_hash", "decode": "prefix_hash"}
        if policy == "prefix_fallback":
            model["sessions"]["prefix_fallback"] = True
        cfg: dict[str, Any] = {
            "models": [model],
            "admission": {"replicas": args.replicas},
            "health": {"interval": 60},
        }
        if policy == "kv_events":
            cfg = events_config(cfg, dict(zip(urls, engines, strict=True)))
        parse_config(cfg)  # a mistake here, not in a subprocess's log
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        routers = []
        for i in range(args.replicas):
            url, _ = await stack.enter_async_context(router_process(cfg, tmp / f"r{i}.yaml"))
            routers.append(url)
        yield routers, engines


def _count(run: Run, engines: list[FakeEngine]) -> None:
    """Prompt tokens each engine found in its cache, by role."""
    for e in engines:
        for rec in e.received:
            if rec.cached is None or not rec.path.startswith("/v1/"):
                continue
            if e.name.startswith("p"):
                run.p_cached += rec.cached
            else:
                run.d_cached += rec.cached


async def _ttft(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], session: str | None
) -> tuple[float, str]:
    headers = {"x-session-id": session} if session else {}
    t0 = time.perf_counter()
    first = None
    reply = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - t0
            if '"content": "' in line:
                reply.append(line.split('"content": "', 1)[1].split('"', 1)[0])
    assert first is not None
    return first, "".join(reply)


def _tokens(body: dict[str, Any]) -> int:
    from tests.fakes.fake_vllm import _token_ids

    return len(_token_ids(body))


async def shared_prefix(args: argparse.Namespace, routers: list[str], run: Run) -> None:
    rng = random.Random(args.seed)
    systems = [
        f"{k} " + "".join(rng.choice("abcdefgh ") for _ in range(args.system_tokens))
        for k in range(args.systems)
    ]
    queue = [(rng.randrange(args.systems), i) for i in range(args.requests)]

    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        while queue:
            system, i = queue.pop(0)
            messages = [
                {"role": "system", "content": systems[system]},
                {"role": "user", "content": f"question {i}: what now?"},
            ]
            body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": True}
            ttft, _ = await _ttft(client, routers[i % len(routers)], body, None)
            run.ttft.append(ttft)
            run.prompt += _tokens(body)

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(client_loop(client, c) for c in range(args.clients)))


async def multi_turn(args: argparse.Namespace, routers: list[str], run: Run) -> None:
    rng = random.Random(args.seed)
    system = "You are a helpful assistant. " * 4
    pending = list(range(args.conversations))

    async def conversation(client: httpx.AsyncClient, conv: int) -> None:
        opening = f"{conv} " + "".join(rng.choice("abcdefgh ") for _ in range(args.opening))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
        for turn in range(args.turns):
            body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": True}
            url = routers[(conv + turn) % len(routers)]
            ttft, reply = await _ttft(client, url, body, f"conv-{conv}")
            run.ttft.append(ttft)
            run.prompt += _tokens(body)
            messages = [
                *messages,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"and then, {turn}?"},
            ]

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            await conversation(client, pending.pop(0))

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))


async def _once(args: argparse.Namespace, workload: str, policy: str) -> Run:
    run = Run()
    async with cluster(args, policy) as (routers, engines):
        await asyncio.sleep(0.3)  # the routers' first event and load reads
        drive = shared_prefix if workload == "shared-prefix" else multi_turn
        await drive(args, routers, run)
        _count(run, engines)
    return run


async def main(args: argparse.Namespace) -> None:
    print(
        f"{args.engines} P + {args.engines} D, {args.replicas} router replicas, pull mode; "
        f"prefill {args.prefill_us} us and transfer {args.receive_us} us per uncached token; "
        f"{args.cache_blocks} blocks of cache per engine; median of {args.repeats} runs"
    )
    print("| workload | policy | P cache hits | D cache hits | TTFT mean | p50 | p99 |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        wanted = set(args.policies.split(",")) if args.policies else set(POLICIES[workload])
        policies = [p for p in POLICIES[workload] if p in wanted]
        runs: dict[str, list[Run]] = {p: [] for p in policies}
        for _ in range(args.repeats):  # policies alternate: drift on the machine hits all alike
            for policy in policies:
                runs[policy].append(await _once(args, workload, policy))
        for policy in policies:
            figures = [_figures(r) for r in runs[policy]]
            p_hits, d_hits, mean, p50, p99 = (
                statistics.median(f[i] for f in figures) for i in range(5)
            )
            print(
                f"| {workload} | {policy} | {p_hits:.1%} | {d_hits:.1%} | {mean:.0f} ms | "
                f"{p50:.0f} ms | {p99:.0f} ms |",
                flush=True,
            )


def _figures(run: Run) -> tuple[float, float, float, float, float]:
    """P hits, D hits (of prompt tokens), TTFT mean, p50, p99 (ms)."""
    t = sorted(run.ttft)
    p99 = t[min(len(t) - 1, int(0.99 * len(t)))]
    return (
        run.p_cached / run.prompt,
        run.d_cached / run.prompt,
        statistics.mean(t) * 1000,
        statistics.median(t) * 1000,
        p99 * 1000,
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="shared-prefix,multi-turn")
    ap.add_argument("--engines", type=int, default=4, help="P engines, and as many D")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--opening", type=int, default=1500)
    ap.add_argument("--cache-blocks", type=int, default=1000, help="per engine, 16 tokens each")
    ap.add_argument("--prefill-us", type=float, default=150.0)
    ap.add_argument("--receive-us", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--load-factor", type=float, default=1.25, help="sessions.load_factor")
    ap.add_argument("--policies", default="", help="a subset of the policies, comma-separated")
    asyncio.run(main(ap.parse_args()))
