"""Kubernetes discovery against a fake API server on a real socket (the real client).

The router's pool follows pods being added, made ready, deleted; a stream in
flight on a removed pod completes; an expired watch (410) is healed by a fresh
list; an API outage keeps the last known pods.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from router.app import AppContext, create_app
from router.config import parse_config
from router.registry import ModelPool
from tests.conftest import Cluster, eventually
from tests.deploy.fake_kube import FakeKube
from tests.fakes.servers import serve
from tests.needs import need_module

need_module("kubernetes_asyncio", "test extra")

PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 8}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def discovery_config(kube_url: str, mode: str = "pull") -> dict[str, Any]:
    return {
        "models": [
            {
                "name": "tiny",
                "mode": mode,
                "discovery": {
                    "kubernetes": {
                        "namespace": "llm",
                        "prefill_selector": "app=vllm,pd-router.io/role=prefill",
                        "decode_selector": "app=vllm,pd-router.io/role=decode",
                        "slots_default": 4,
                        "api_url": kube_url,
                        "watch_seconds": 30,
                    }
                },
            }
        ],
        "timeouts": {"prefill": 5, "decode_first_byte": 5, "idle": 5, "total": 30},
        "retries": {"max_attempts": 1},
    }


async def start_router(cluster: Cluster, kube: FakeKube) -> tuple[str, AppContext]:
    kube_url = await cluster.stack.enter_async_context(serve(kube))
    app = create_app(parse_config(discovery_config(kube_url)), health_checks=False)
    url = await cluster.stack.enter_async_context(serve(app))
    ctx: AppContext = app.state.ctx
    cluster.routers.append(ctx)
    return url, ctx


def urls(pool: ModelPool) -> tuple[list[str], list[str]]:
    return [p.url for p in pool.prefill], [d.url for d in pool.decode]


async def test_pool_follows_pods_and_streams_survive_removal(
    cluster2: Cluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    (p0, p1), (d0, d1) = cluster2.prefill_urls, cluster2.decode_urls
    kube = FakeKube()
    await kube.add_pod("p-0", "prefill", port_of(p0), annotations={"pd-router.io/kv-port": "7001"})
    await kube.add_pod("d-0", "decode", port_of(d0), ready=False)
    url, ctx = await start_router(cluster2, kube)
    pool = ctx.registry.get("tiny")
    assert pool is not None

    await eventually(lambda: urls(pool) == ([p0], []))  # d-0 not Ready: not routed to
    nixl = pool.prefill[0].nixl
    assert nixl is not None and nixl.engine_id == "p-0" and nixl.port == 7001

    await kube.set_ready("d-0", True)
    await eventually(lambda: urls(pool) == ([p0], [d0]))
    assert pool.decode[0].slots == 4
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200

    held = cluster2.decode[0].behaviour.end_gate = asyncio.Event()  # d-0 streams, holds its end
    in_flight = asyncio.create_task(
        client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    )
    await asyncio.wait_for(cluster2.decode[0].holding_end.wait(), 10)
    await kube.add_pod("d-1", "decode", port_of(d1), annotations={"pd-router.io/slots": "2"})
    await kube.add_pod("p-1", "prefill", port_of(p1))
    await kube.delete_pod("d-0")
    await kube.delete_pod("p-0")
    await eventually(lambda: urls(pool) == ([p1], [d1]))
    assert pool.decode[0].slots == 2
    assert not in_flight.done() and cluster2.decode[0].active == 1  # in flight on d-0 still
    held.set()

    r = await in_flight  # started on d-0 before it went away: completes normally
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200
    assert len(cluster2.decode[1].received) == 1 and len(cluster2.prefill[1].received) == 1
    # Followed by the watch alone: one list per role, no error, no relist.
    assert kube.lists() == 2
    assert not [
        r
        for r in caplog.records
        if r.name.startswith("pd_router.discovery") and r.levelno >= logging.WARNING
    ]


async def discovered(cluster: Cluster, p0: str, d0: str) -> tuple[FakeKube, ModelPool]:
    """A fake API server with pods p-0 (at ``p0``) and d-0 (at ``d0``), and a router's pool
    that has discovered both."""
    kube = FakeKube()
    await kube.add_pod("p-0", "prefill", port_of(p0))
    await kube.add_pod("d-0", "decode", port_of(d0))
    _, ctx = await start_router(cluster, kube)
    pool = ctx.registry.get("tiny")
    assert pool is not None
    await eventually(lambda: urls(pool) == ([p0], [d0]))
    return kube, pool


async def test_expired_watch_lists_again_and_sees_missed_changes(cluster2: Cluster) -> None:
    (p0, p1), (d0, _) = cluster2.prefill_urls, cluster2.decode_urls
    kube, pool = await discovered(cluster2, p0, d0)
    lists = kube.lists()

    watches = sum(r.watch for r in kube.requests)
    kube.hold_watches.clear()  # the connection drops and stays down a while...
    await kube.end_watches()
    # Both roles have asked to watch again (held by the server) before anything changes: each
    # resumes from a version the compaction below forgets, whatever the scheduler does.
    await eventually(lambda: sum(r.watch for r in kube.requests) == watches + 2)
    await kube.add_pod("p-1", "prefill", port_of(p1))  # ...while pods change
    await kube.delete_pod("p-0")
    kube.compact()  # and the history those changes were in is gone
    kube.hold_watches.set()

    # Both roles list again after the 410, each on its own time: wait for both, not for the
    # pool alone (the prefill role's list is enough for it).
    await eventually(lambda: urls(pool) == ([p1], [d0]) and kube.lists() == lists + 2)
    assert any(r.watch and r.resource_version for r in kube.requests)


async def test_a_watch_refused_at_every_version_backs_off(
    cluster2: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that answers 410 even to the version it has just listed: the router lists
    again after a doubling wait (not in a loop) and keeps the pods it knew."""
    (p0, _), (d0, _) = cluster2.prefill_urls, cluster2.decode_urls
    kube, pool = await discovered(cluster2, p0, d0)

    caplog.set_level(logging.WARNING, logger="pd_router.discovery")
    kube.compacted = 10**9  # every watch from any version is gone
    await kube.end_watches()

    def waits() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("pd_router.discovery")]
        return [
            line.rsplit(" ", 1)[-1]
            for line in lines
            if "tiny/prefill:" in line and "expired at once" in line
        ]

    await eventually(lambda: len(waits()) >= 3)
    assert waits()[:3] == ["0.5s", "1.0s", "2.0s"]
    assert kube.lists() < 20  # a loop without the wait lists thousands of times a second
    assert urls(pool) == ([p0], [d0])


def _outage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("pd_router.discovery")
        and "keeping the last known pods" in r.getMessage()
    ]


async def test_api_outage_keeps_last_pods_then_recovers(
    cluster2: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    (p0, _), (d0, d1) = cluster2.prefill_urls, cluster2.decode_urls
    kube, pool = await discovered(cluster2, p0, d0)

    caplog.set_level(logging.WARNING, logger="pd_router.discovery")
    kube.fail_status = 503
    await kube.end_watches()
    # Both roles' watches ended, were retried and refused (503), and the router said so.
    await eventually(
        lambda: all(
            any(f"tiny/{role}:" in line and "503" in line for line in _outage_lines(caplog))
            for role in ("prefill", "decode")
        ),
        timeout=45,
    )
    assert urls(pool) == ([p0], [d0])  # an API outage takes nothing out of rotation
    await kube.add_pod("d-1", "decode", port_of(d1))
    kube.fail_status = None
    # The next retry comes after the backoff the outage reached (doubling from 0.5 s, at most
    # 30 s): a slow machine spends longer in the outage and so waits longer here.
    await eventually(lambda: urls(pool) == ([p0], [d0, d1]), timeout=45)


async def test_reload_keeps_discovered_instances(cluster: Cluster, tmp_path: Any) -> None:
    import yaml

    (p0,), (d0,) = cluster.prefill_urls, cluster.decode_urls
    kube = FakeKube()
    await kube.add_pod("p-0", "prefill", port_of(p0))
    await kube.add_pod("d-0", "decode", port_of(d0))
    kube_url = await cluster.stack.enter_async_context(serve(kube))
    path = tmp_path / "router.yaml"
    cfg = discovery_config(kube_url)
    path.write_text(yaml.safe_dump(cfg))
    app = create_app(parse_config(cfg), health_checks=False, config_path=str(path))
    await cluster.stack.enter_async_context(serve(app))
    ctx: AppContext = app.state.ctx
    cluster.routers.append(ctx)
    pool = ctx.registry.get("tiny")
    assert pool is not None
    await eventually(lambda: urls(pool) == ([p0], [d0]))

    cfg["models"][0]["policy"] = {"decode": "round_robin"}
    path.write_text(yaml.safe_dump(cfg))
    assert app.state.reloader.reload() == []
    assert urls(pool) == ([p0], [d0]) and pool.config.policy.decode == "round_robin"
