"""Priority classes and TTFT deadlines under overload: the router (its own process) over
fake decode engines, open-loop traffic at a multiple of what the engines serve. Not a test:
it prints figures.

    .venv/bin/python bench/priority_overload.py
    .venv/bin/python bench/priority_overload.py --load 3 --seconds 30

``--engines`` fake D engines (tests/fakes, this process) of ``--slots`` slots each, in
aggregated mode; every stream holds its slot for ``--tokens`` tokens ``--token-ms`` apart,
so the engines serve ``engines x slots / stream time`` requests a second; requests arrive
evenly at ``--load`` times that for ``--seconds``, every fifth one interactive. Three
routers over the same traffic:

- ``classes``: ``interactive`` (a ``--deadline-ms`` TTFT deadline) and ``batch`` (the
  default, no deadline), the interactive requests naming their class by ``x-priority``;
- ``deadlines``: one class; the interactive requests send ``x-slo-ttft-ms``
  (earliest deadline first within the one class, refused when unattainable);
- ``fifo``: one class, no deadlines (the router before priorities): one
  queue, fair between keys, in arrival order.

Batch requests wait at most ``admission.max_wait`` (``--max-wait``). Printed per router and
class: offered, served %, refusals by error code, and the TTFT (to the first streamed
token, at the client) p50 and p99 of the served, and how many served interactive requests
saw their first token after the deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from router.config import parse_config
from tests.fakes.fake_vllm import FakeEngine, KvBus
from tests.fakes.router_proc import router_process
from tests.fakes.servers import serve

_CLIENTS = 64


@dataclass
class _Class:
    offered: int = 0
    ttft: list[float] = field(default_factory=list)  # seconds, of the served
    refused: Counter[str] = field(default_factory=Counter)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _admission(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    admission: dict[str, Any] = {"max_wait": args.max_wait, "queue_size": 4096}
    if variant == "classes":
        admission["priority_classes"] = {
            "interactive": {"priority": -1, "ttft_deadline_ms": args.deadline_ms},
            "batch": {"priority": 1},
        }
        admission["default_priority_class"] = "batch"
    return admission


@contextlib.asynccontextmanager
async def _router(args: argparse.Namespace, variant: str) -> AsyncIterator[str]:
    async with contextlib.AsyncExitStack() as stack:
        engines = [FakeEngine(f"d{i}", KvBus()) for i in range(args.engines)]
        urls = [await stack.enter_async_context(serve(e)) for e in engines]
        for e in engines:
            e.behaviour.tokens, e.behaviour.token_delay = args.tokens, args.token_ms / 1000
        cfg: dict[str, Any] = {
            "models": [
                {
                    "name": "tiny",
                    "mode": "aggregated",
                    "decode": [{"url": u, "slots": args.slots} for u in urls],
                }
            ],
            "admission": _admission(args, variant),
            "health": {"interval": 60},
        }
        parse_config(cfg)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        router = router_process(cfg, tmp / "router.yaml", log=tmp / "router.log")
        url, _ = await stack.enter_async_context(router)
        yield url


def _headers(args: argparse.Namespace, variant: str, interactive: bool) -> dict[str, str]:
    if not interactive or variant == "fifo":
        return {}
    if variant == "classes":
        return {"x-priority": "interactive"}
    return {"x-slo-ttft-ms": f"{args.deadline_ms:g}"}


async def _one(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], stats: _Class, i: int
) -> None:
    stats.offered += 1
    try:
        await _stream(client, url, headers, stats, i)
    except httpx.HTTPError as exc:  # the client's own timeout, or a broken connection
        stats.refused[type(exc).__name__] += 1


async def _stream(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], stats: _Class, i: int
) -> None:
    body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 16, "stream": True}
    started = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            code = (await r.aread()).decode(errors="replace")
            stats.refused[_code(code, r.status_code)] += 1
            return
        first = True
        async for line in r.aiter_lines():
            if first and line.startswith("data: {"):
                stats.ttft.append(time.monotonic() - started)
                first = False


def _code(body: str, status: int) -> str:
    try:
        return f"{status} {httpx.Response(status, content=body).json()['error']['code']}"
    except (ValueError, KeyError, TypeError):
        return str(status)


async def run(args: argparse.Namespace, variant: str) -> dict[str, _Class]:
    stats = {"interactive": _Class(), "batch": _Class()}
    capacity = args.engines * args.slots / (args.tokens * args.token_ms / 1000)
    gap = 1 / (capacity * args.load)
    async with _router(args, variant) as url, contextlib.AsyncExitStack() as clients:
        # Many clients, few connections each: httpx's pool walks all of its connections on
        # every request and release, so one client with hundreds of streams open would be
        # what this measures (docs/bench-router.md, "the engine-call client").
        pool = [
            await clients.enter_async_context(httpx.AsyncClient(timeout=args.max_wait + 60))
            for _ in range(_CLIENTS)
        ]
        tasks = []
        start = time.monotonic()
        for i in range(int(args.seconds / gap)):
            await asyncio.sleep(max(0.0, start + i * gap - time.monotonic()))
            interactive = i % 5 == 0
            name = "interactive" if interactive else "batch"
            headers = _headers(args, variant, interactive)
            client = pool[i % _CLIENTS]
            tasks.append(asyncio.create_task(_one(client, url, headers, stats[name], i)))
        await asyncio.gather(*tasks)
    return stats


def report(args: argparse.Namespace, variant: str, stats: dict[str, _Class]) -> None:
    for name, st in stats.items():
        served = len(st.ttft)
        late = sum(t * 1000 > args.deadline_ms for t in st.ttft) if name == "interactive" else 0
        refused = ", ".join(f"{k}: {v}" for k, v in sorted(st.refused.items())) or "-"
        print(
            f"| {variant} | {name} | {st.offered} | {100 * served / max(1, st.offered):.1f}% "
            f"| {_pct(st.ttft, 0.5) * 1000:.0f} | {_pct(st.ttft, 0.99) * 1000:.0f} "
            f"| {late if name == 'interactive' else '-'} | {refused} |",
            flush=True,
        )


async def main(args: argparse.Namespace) -> None:
    capacity = args.engines * args.slots / (args.tokens * args.token_ms / 1000)
    print(
        f"capacity {capacity:g} req/s, offered {capacity * args.load:g} req/s for "
        f"{args.seconds:g} s, interactive deadline {args.deadline_ms:g} ms"
    )
    print("| router | class | offered | served | TTFT p50 ms | TTFT p99 ms | late | refused |")
    print("|---|---|---|---|---|---|---|---|")
    for variant in args.variants.split(","):
        report(args, variant, await run(args, variant))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="classes,deadlines,fifo")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--token-ms", type=float, default=50.0)
    ap.add_argument("--load", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--deadline-ms", type=float, default=1000.0)
    ap.add_argument("--max-wait", type=float, default=10.0)
    asyncio.run(main(ap.parse_args()))
