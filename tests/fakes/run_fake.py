"""Serve fake engines in their own process (so a test can SIGKILL them, or so a load
driver does not share their CPU). Several ports share one KV bus, so a push-mode D
served here waits for the P served here; a D given ``kv_peer`` (a P's URL) waits for
that P, in another process, instead.

    python -m tests.fakes.run_fake PORT '{"delay": 1.0, "tokens": 50}'
    python -m tests.fakes.run_fake P_PORT,D_PORT '{"chaos": 0.02}'
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvicorn

from tests.fakes.fake_vllm import FakeEngine, KvBus


async def _serve(ports: list[int], behaviour: dict[str, object]) -> None:
    bus = KvBus()
    servers = []
    for i, port in enumerate(ports):
        engine = FakeEngine(f"fake-{i}", bus)
        for key, value in behaviour.items():
            setattr(engine.behaviour, key, value)
        config = uvicorn.Config(
            engine,
            host="127.0.0.1",
            port=port,
            log_level="critical",
            lifespan="off",
            http="httptools",
            backlog=4096,
            timeout_keep_alive=60,
        )
        servers.append(uvicorn.Server(config))
    await asyncio.gather(*(s.serve() for s in servers))


def main() -> None:
    ports = [int(p) for p in sys.argv[1].split(",")]
    asyncio.run(_serve(ports, json.loads(sys.argv[2])))


if __name__ == "__main__":
    main()
