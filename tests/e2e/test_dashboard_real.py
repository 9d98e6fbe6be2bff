"""The dashboard's engine panels on real engines: a real Prometheus scrapes the router and both
engines of each P/D stack (pull, push, pipelined), and every panel built on vLLM's own metrics
(KV usage, running/waiting, TTFT, ITL, NIXL bytes and failures) has data while requests flow.

Once per stack, not per router mode: push-sequential is a second router over the push engines,
and these panels read only the engines.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from router.stack import Stack
from tests.e2e import helpers as h
from tests.e2e.conftest import MODEL, Reference
from tests.engine_stacks import MAIN, Running
from tests.observability.prometheus import prometheus
from tests.observability.test_prometheus_live import dashboard_queries

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.parametrize("engine_stack", MAIN, indirect=True),
]


def test_dashboard_engine_panels_return_data(
    engine_stack: Running, reference: Reference, tmp_path: Path
) -> None:
    stack: Stack = engine_stack.stack
    asyncio.run(_engine_panels(stack, reference, tmp_path))


async def _engine_panels(stack: Stack, reference: Reference, tmp_path: Path) -> None:
    engines = [(s.url, {"role": s.role}) for s in stack.engines]
    jobs = {"pd-router": [(stack.router_url, {})], "vllm": engines}
    client = h.client_for(stack.router_url)
    queries = dashboard_queries(engines=True)
    async with prometheus(tmp_path, jobs) as prom:
        await prom.targets_up(3)
        empty = list(queries)
        deadline = time.monotonic() + 120
        while empty and time.monotonic() < deadline:
            for prompt in reference.prompts[:2]:
                await asyncio.to_thread(h.complete, client, MODEL, prompt, stream=True)
            await asyncio.sleep(2.5)  # two scrapes after the last request
            empty = [t for t in empty if not await prom.has_finite_value(queries[t])]
    assert empty == [], f"engine panels without data: {empty}"
