"""A real Prometheus scrapes a router (fake engines on real sockets) and evaluates the alert
rules: every router panel of the Grafana dashboard returns data under load, the alerts stay
silent while all is well, and each one built for it goes off when an engine stops answering
its health checks or the admission queue sticks; the autoscalers' queries (deploy/autoscaling)
read each role's demand. (The engine panels are checked against
real vLLM engines in tests/e2e/test_pd_modes.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from router.app import AppContext
from tests.conftest import Cluster
from tests.observability.prometheus import Prometheus, prometheus
from tests.observability.promtool import DASHBOARD, ROOT

# Generous: Prometheus scrapes and evaluates every second; this only bounds a broken run.
DEADLINE_S = 30.0


def dashboard_queries(*, engines: bool) -> dict[str, str]:
    """``panel title: expr`` for every target of the dashboard, with Grafana's variables set
    as Grafana would for "all models" at a 1 s scrape interval; ``engines`` picks the panels
    on vLLM's metrics, else the router's."""
    doc = json.loads(DASHBOARD.read_text())
    queries = {}
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "10s").replace("$model", ".*")
            if ('job="vllm"' in expr) == engines:
                queries[f"{panel['title']} [{target['refId']}]"] = expr
    return queries


async def _traffic(url: str, stop: asyncio.Event, statuses: list[int]) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(timeout=30) as c:
        while not stop.is_set():
            r = await c.post(f"{url}/v1/completions", json=body)
            statuses.append(r.status_code)


@contextlib.asynccontextmanager
async def load(url: str, clients: int = 3) -> AsyncIterator[list[int]]:
    """Steady streamed completions from ``clients`` loops until the block ends."""
    stop, statuses = asyncio.Event(), []
    tasks = [asyncio.create_task(_traffic(url, stop, statuses)) for _ in range(clients)]
    try:
        yield statuses
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def _router(cluster: Cluster, mode: str = "push", **overrides: Any) -> tuple[str, AppContext]:
    for e in cluster.decode:
        e.behaviour.tokens, e.behaviour.token_delay = 4, 0.01
    return await cluster.router(mode, health_checks=True, **overrides)


def _jobs(router_url: str, cluster: Cluster) -> dict[str, list[tuple[str, dict[str, str]]]]:
    engines = [(u, {"role": "prefill"}) for u in cluster.prefill_urls]
    engines += [(u, {"role": "decode"}) for u in cluster.decode_urls]
    return {"pd-router": [(router_url, {})], "vllm": engines}


async def until(check: Callable[[], Awaitable[bool]], what: Callable[[], str]) -> None:
    stop = time.monotonic() + DEADLINE_S
    while not await check():
        assert time.monotonic() < stop, what()
        await asyncio.sleep(0.25)


def _active(alerts: list[dict[str, Any]], name: str, **labels: str) -> bool:
    return any(
        a["labels"]["alertname"] == name and all(a["labels"].get(k) == v for k, v in labels.items())
        for a in alerts
    )


async def test_router_panels_return_data_and_no_alert_goes_off_while_healthy(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Pipelined with kept turns: the kept-turn panels have series too.
    url, _ = await _router(
        cluster,
        "pipelined",
        model={"kept_turns": {"enabled": True}},
        prefill_extra={"engine_id": "P", "kv_host": "127.0.0.1", "kv_port": 7001},
        decode_extra={"engine_id": "D", "kv_host": "127.0.0.1", "kv_port": 7002},
    )
    async with prometheus(tmp_path, _jobs(url, cluster)) as prom, load(url) as statuses:
        await prom.targets_up(3)
        queries = dashboard_queries(engines=False)
        assert len(queries) > 20

        async def all_have_data() -> bool:
            return all([await prom.has_finite_value(q) for q in queries.values()])

        # One prompt D rejects: the engine-failure panel has no series before a failure.
        cluster.decode[0].behaviour.poison = "POISON"
        async with httpx.AsyncClient(timeout=30) as c:
            bad = {"model": "tiny", "prompt": "POISON", "max_tokens": 4}
            r = await c.post(f"{url}/v1/completions", json=bad)
            assert r.status_code == 502 and r.json()["error"]["code"] == 500  # D's own 500
        empty: list[str] = []

        async def record_empty() -> bool:
            empty[:] = [t for t, q in queries.items() if not await prom.has_finite_value(q)]
            return not empty

        await until(record_empty, lambda: f"panels without data: {empty}")
        # Five seconds of evaluations of every rule over live series, none of them pending.
        started = time.time()
        await until(
            lambda: _evaluated_after(prom, started + 5), lambda: "rules not evaluated for 5 s"
        )
        assert await prom.alerts() == []
        assert await all_have_data()
    assert len(statuses) > 100 and set(statuses) == {200}


async def _evaluated_after(prom: Prometheus, t: float) -> bool:
    return min(await prom.last_evaluations()) > t


async def test_engine_failing_health_checks_raises_its_alerts(
    cluster: Cluster, tmp_path: Path
) -> None:
    url, _ = await _router(cluster)
    async with prometheus(tmp_path, _jobs(url, cluster)) as prom:
        await prom.targets_up(3)
        cluster.decode[0].behaviour.health_status = 503

        async def raised() -> bool:
            alerts = await prom.alerts()
            return _active(alerts, "PdRouterNoRoutableEngine", role="decode") and _active(
                alerts, "PdRouterEngineUnhealthy", role="decode", engine=cluster.decode_urls[0]
            )

        await until(raised, lambda: "no alert for the decode engine failing its health checks")
        assert not _active(await prom.alerts(), "PdRouterNoRoutableEngine", role="prefill")
        cluster.decode[0].behaviour.health_status = 200
        await until(
            lambda: _quiet(prom, "PdRouterNoRoutableEngine"),
            lambda: "alert still active after recovery",
        )


async def _quiet(prom: Prometheus, name: str) -> bool:
    return not _active(await prom.alerts(), name)


async def test_stuck_admission_queue_raises_its_alert(cluster: Cluster, tmp_path: Path) -> None:
    """D accepts requests and never answers: its slots fill, later requests queue, and
    nothing completes."""
    url, ctx = await _router(
        cluster,
        timeouts={"decode_first_byte": 120, "total": 120},
        admission={"max_wait": 120},
    )
    cluster.decode[0].behaviour.hang = True
    async with prometheus(tmp_path, _jobs(url, cluster)) as prom:
        await prom.targets_up(3)
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
            stuck = [
                asyncio.create_task(c.post(f"{url}/v1/completions", json=body)) for _ in range(6)
            ]
            try:
                await until(
                    lambda: _raised(prom, "PdRouterQueueStuck", model="tiny"),
                    lambda: "no alert for a queue that does not move",
                )
                assert ctx.registry.slots_in_use() == 4
            finally:
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)
        cluster.decode[0].behaviour.hang = False


async def _raised(prom: Prometheus, name: str, **labels: str) -> bool:
    return _active(await prom.alerts(), name, **labels)


def keda_queries(model: str) -> dict[str, str]:
    """The Prometheus query of each of deploy/autoscaling/keda.yaml's ScaledObjects (by the
    Deployment it scales), for ``model``."""
    path = ROOT / "deploy" / "autoscaling" / "keda.yaml"
    out = {}
    for doc in yaml.safe_load_all(path.read_text()):
        [trigger] = doc["spec"]["triggers"]
        query = trigger["metadata"]["query"].replace('model="pd-model"', f'model="{model}"')
        out[doc["spec"]["scaleTargetRef"]["name"]] = query
    return out


async def test_the_autoscalers_queries_read_each_roles_demand_under_load(
    cluster: Cluster, tmp_path: Path
) -> None:
    """deploy/autoscaling/keda.yaml's own queries against a real Prometheus scraping a router:
    0 while idle (one sample: KEDA holds minReplicaCount), then, under steady traffic, each
    role's demand in engines, above 0 once P's prompts and D's steps are timed (D's step of
    ~10 ms a token against a 5 ms target: more D)."""
    queries = keda_queries("tiny")
    assert set(queries) == {"vllm-prefill", "vllm-decode"}
    url, _ = await _router(cluster, model={"autoscaling": {"tpot_ms": 5}})
    async with prometheus(tmp_path, _jobs(url, cluster)) as prom:
        await prom.targets_up(3)
        for query in queries.values():
            assert [float(s["value"][1]) for s in await prom.query(query)] == [0.0]
        async with load(url) as statuses:

            async def demand_seen() -> bool:
                values = [await prom.query(q) for q in queries.values()]
                return all(float(v[0]["value"][1]) > 0 for v in values)

            await until(demand_seen, lambda: "no demand in the autoscalers' queries")
        assert set(statuses) == {200}
