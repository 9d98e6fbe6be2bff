"""Config reload without restart: instances come and go, requests in flight finish."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from router.app import create_app
from router.config import load_config
from tests.conftest import Cluster, eventually
from tests.fakes.servers import serve

PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 8}


def write(path: Path, cfg: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(cfg))


def with_decode(cluster: Cluster, urls: list[str]) -> dict[str, Any]:
    cfg = cluster.config("aggregated")
    cfg["models"][0]["decode"] = [{"url": u, "slots": 2} for u in urls]
    return cfg


async def start(cluster: Cluster, path: Path, **kw: Any) -> tuple[str, Any]:
    app = create_app(load_config(path), health_checks=False, config_path=str(path), **kw)
    url = await cluster.stack.enter_async_context(serve(app))
    cluster.routers.append(app.state.ctx)
    return url, app


async def test_reload_swaps_instances_without_dropping_streams(
    cluster2: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    d0, d1 = cluster2.decode_urls
    path = tmp_path / "router.yaml"
    write(path, with_decode(cluster2, [d0]))
    url, app = await start(cluster2, path)
    slow = cluster2.decode[0].behaviour
    slow.tokens, slow.token_delay = 30, 0.02
    in_flight = asyncio.create_task(
        client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    )
    await eventually(lambda: cluster2.decode[0].active == 1)

    write(path, with_decode(cluster2, [d1]))
    changes = app.state.reloader.reload()
    assert changes == [f"model 'tiny': + {d1}", f"model 'tiny': - {d0}"]

    r = await in_flight
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    r2 = await client.post(url + "/v1/completions", json=PROMPT)
    assert r2.status_code == 200
    assert len(cluster2.decode[0].received) == 1 and len(cluster2.decode[1].received) == 1


async def test_invalid_reload_keeps_running_config(
    cluster: Cluster, client: httpx.AsyncClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An invalid file on SIGHUP is refused with a log line naming the problem, and the
    pool keeps its instances (the same objects, state and all) and serves on."""
    path = tmp_path / "router.yaml"
    write(path, with_decode(cluster, cluster.decode_urls))
    url, app = await start(cluster, path)
    registry = app.state.ctx.registry
    pool = registry.get("tiny")
    before = list(pool.decode)
    path.write_text("models: [{name: tiny, decode: []}]")
    caplog.set_level(logging.ERROR, logger="pd_router.reload")
    os.kill(os.getpid(), signal.SIGHUP)
    await eventually(lambda: bool(_rejections(caplog)))
    (rejected,) = _rejections(caplog)
    assert "models.0.decode" in rejected, rejected  # the problem, by its path
    assert registry.get("tiny") is pool and pool.decode == before
    assert [d.url for d in pool.decode] == cluster.decode_urls
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200
    assert len(cluster.decode[0].received) == 1


def _rejections(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "pd_router.reload" and r.getMessage().startswith("reload rejected")
    ]


async def test_sighup_and_file_watch_reload(
    cluster2: Cluster, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    d0, d1 = cluster2.decode_urls
    path = tmp_path / "router.yaml"
    write(path, with_decode(cluster2, [d0]))
    _, app = await start(cluster2, path, watch_interval=0.05)
    pool = app.state.ctx.registry.get("tiny")
    write(path, with_decode(cluster2, [d0, d1]))
    os.utime(path, (1, 1))  # a different mtime, whatever the clock's resolution
    await eventually(lambda: len(pool.decode) == 2)
    write(path, with_decode(cluster2, [d1]))
    os.kill(os.getpid(), signal.SIGHUP)
    await eventually(lambda: [d.url for d in pool.decode] == [d1])
