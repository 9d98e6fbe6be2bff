"""The dashboard's engine panels on real engines: a real Prometheus scrapes the router and both
engines of each P/D stack (pull, push, pipelined), and every panel built on vLLM's own metrics
(KV usage, running/waiting, TTFT, ITL, NIXL bytes and failures) has data while requests flow.

Once per stack, not per router mode: push-sequential is a second router over the push engines,
and these panels read only the engines.
"""

from __future__ import annotations

import asyncio
import threading
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
    engines = [(s.url, {"role": str(s.role)}) for s in stack.engines]
    jobs: dict[str, list[tuple[str, dict[str, str]]]] = {
        "pd-router": [(stack.router_url, {})],
        "vllm": engines,
    }
    client = h.client_for(stack.router_url)
    queries = dashboard_queries(engines=True)
    stop = threading.Event()

    def traffic() -> int:
        """Requests one after the other until told to stop; how many were sent."""
        sent = 0
        while not stop.is_set():
            h.complete(client, MODEL, reference.prompts[sent % 2], stream=True)
            sent += 1
        return sent

    async with prometheus(tmp_path, jobs) as prom:
        await prom.targets_up(3)
        flowing = asyncio.ensure_future(asyncio.to_thread(traffic))
        try:
            empty = list(queries)
            deadline = time.monotonic() + 120
            while empty and time.monotonic() < deadline:
                await asyncio.sleep(0.5)  # Prometheus scrapes every second
                empty = [t for t in empty if not await prom.has_finite_value(queries[t])]
        finally:
            stop.set()
            sent = await flowing
    assert sent > 0
    assert empty == [], f"engine panels without data after {sent} requests: {empty}"
