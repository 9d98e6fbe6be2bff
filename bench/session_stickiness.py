"""How many conversations change P or D across turns at low load, on fake engines. Not a test.

    .venv/bin/python bench/session_stickiness.py
    .venv/bin/python bench/session_stickiness.py --modes push --replicas-config 3

The setup of issue 41's report: three router replicas (processes of their own, ``pd-router
serve``, one config) over four P and four D fake engines (tests/fakes, this process; D has
``--slots`` slots), ``--conversations`` conversations with an ``x-session-id``, turn ``t`` of
conversation ``i`` sent to replica ``(i + t) % 3``, ``--clients`` conversations at a time (far
below the D slots). Each engine streams ``--tokens`` tokens ``--token-ms`` apart, so turns of
different conversations overlap on the engines. Printed per mode and ``admission.replicas``:
how many conversations had more than one P, and more than one D, over their turns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from router.config import parse_config
from tests.fakes.fake_vllm import FakeEngine, KvBus
from tests.fakes.router_proc import router_process
from tests.fakes.servers import serve

_ROUTERS = 3


@contextlib.asynccontextmanager
async def cluster(
    args: argparse.Namespace, mode: str, replicas: int
) -> AsyncIterator[tuple[list[str], list[FakeEngine]]]:
    """Fresh 4P4D engines and three routers of one config; yields their URLs and the engines."""
    bus = KvBus()
    async with contextlib.AsyncExitStack() as stack:
        engines = [FakeEngine(f"{r}{i}", bus) for r in "pd" for i in range(4)]
        urls = [await stack.enter_async_context(serve(e)) for e in engines]
        for e in engines:
            e.behaviour.tokens, e.behaviour.token_delay = args.tokens, args.token_ms / 1000
        model = {
            "name": "tiny",
            "mode": mode,
            "prefill": [{"url": u} for u in urls[:4]],
            "decode": [{"url": u, "slots": args.slots} for u in urls[4:]],
        }
        cfg: dict[str, Any] = {
            "models": [model],
            "admission": {"replicas": replicas},
            "health": {"interval": 60},
        }
        parse_config(cfg)  # a mistake here, not in a subprocess's log
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        routers = []
        for i in range(_ROUTERS):
            url, _ = await stack.enter_async_context(router_process(cfg, tmp / f"r{i}.yaml"))
            routers.append(url)
        yield routers, engines


def _tag(conv: int) -> str:
    return f"<conv-{conv}>"


async def conversations(args: argparse.Namespace, routers: list[str]) -> None:
    """Every conversation's turns, ``--clients`` conversations at a time."""
    pending = list(range(args.conversations))

    async def conversation(client: httpx.AsyncClient, conv: int) -> None:
        messages = [{"role": "user", "content": f"{_tag(conv)} tell me a story"}]
        for turn in range(args.turns):
            body = {"model": "tiny", "messages": messages, "max_tokens": args.tokens}
            url = routers[(conv + turn) % len(routers)]
            headers = {"x-session-id": f"conv-{conv}"}
            r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]["message"]["content"]
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


def changed(engines: list[FakeEngine], role: str, conversations: int) -> int:
    """Conversations that reached more than one engine of ``role`` ("p" or "d")."""
    count = 0
    for conv in range(conversations):
        names = {
            e.name
            for e in engines
            if e.name.startswith(role)
            for r in e.received
            if r.path.startswith("/v1/") and _tag(conv) in str(r.body)
        }
        count += len(names) > 1
    return count


async def main(args: argparse.Namespace) -> None:
    print("| mode | admission.replicas | changed P | changed D |")
    print("|---|---|---|---|")
    for mode in args.modes.split(","):
        for replicas in map(int, args.replicas_config.split(",")):
            async with cluster(args, mode, replicas) as (routers, engines):
                await conversations(args, routers)
                p = changed(engines, "p", args.conversations)
                d = changed(engines, "d", args.conversations)
            n = args.conversations
            print(f"| {mode} | {replicas} | {p} of {n} | {d} of {n} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="pull,push")
    ap.add_argument("--replicas-config", default="1,3", help="admission.replicas values")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-ms", type=float, default=5.0)
    asyncio.run(main(ap.parse_args()))
