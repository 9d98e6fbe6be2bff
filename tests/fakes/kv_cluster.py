"""Fake engines with KV events behind routers: configs and the waits a test needs.

``with_events`` gives every engine of a :class:`~tests.conftest.Cluster` a prefix cache and a
publisher (tests/fakes/kv_events.py); ``events_config`` names each engine's endpoints in a
router config; ``synced`` waits until a router has applied every batch the engines published
(a test decides that the next request is routed with the last one's events known, instead of
hoping the events came first).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from router.app import AppContext
from tests.fakes.fake_vllm import FakeEngine
from tests.fakes.kv_events import Encoding


async def with_events(engines: list[FakeEngine], stack: Any, encoding: Encoding = "map") -> None:
    """Start each engine's publisher; ``stack`` (an AsyncExitStack) stops them."""
    for engine in engines:
        await engine.start_kv_events(encoding=encoding)
        stack.push_async_callback(engine.stop_kv_events)


def events_config(
    cfg: dict[str, Any],
    engines: dict[str, FakeEngine],
    **settings: Any,
) -> dict[str, Any]:
    """``cfg`` (one model) with ``kv_events`` on and each instance's endpoints (by URL in
    ``engines``; an engine without a publisher gets endpoints nobody serves)."""
    model = cfg["models"][0]
    model["kv_events"] = {"enabled": True, "verify_interval": 60, **settings}
    for inst in (*model.get("prefill", []), *model["decode"]):
        pub = engines[inst["url"]].publisher
        if pub is None:
            inst["kv_events_endpoint"] = "tcp://127.0.0.1:9"
            inst["kv_events_replay"] = "tcp://127.0.0.1:9"
        else:
            inst["kv_events_endpoint"] = pub.endpoint
            inst["kv_events_replay"] = pub.replay_endpoint
    return cfg


async def synced(ctxs: list[AppContext], engines: list[FakeEngine], timeout: float = 5.0) -> None:
    """Wait until every router has applied every batch of every publishing engine."""
    deadline = time.monotonic() + timeout
    while not all(_caught_up(ctx, engines) for ctx in ctxs):
        if time.monotonic() > deadline:
            raise AssertionError("routers did not catch up with the engines' KV events")
        await asyncio.sleep(0.001)


def _caught_up(ctx: AppContext, engines: list[FakeEngine]) -> bool:
    streams = {s.url: s for s in ctx.kv_index.streams()}
    for engine in engines:
        if engine.publisher is None:
            continue
        stream = next((s for s in streams.values() if s.source.endpoint ==
                       engine.publisher.endpoint), None)  # fmt: skip
        if stream is None or not stream.index.known:
            return False
        if stream.next_seq != engine.publisher.next_seq:
            return False
    return True
