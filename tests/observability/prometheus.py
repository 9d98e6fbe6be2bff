"""A real Prometheus server (Debian's ``prometheus``) scraping given targets every second and
evaluating deploy/observability/alerts.yaml, with a small client for its HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import subprocess
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from tests.fakes.router_proc import free_port
from tests.observability.promtool import ALERTS, binary

SCRAPE_S = 1


class Prometheus:
    """The HTTP API of a running Prometheus."""

    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self.url = url
        self._client = client

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (``resultType`` vector or scalar as one sample)."""
        r = await self._client.get(f"{self.url}/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    async def has_finite_value(self, expr: str) -> bool:
        return any(math.isfinite(float(s["value"][1])) for s in await self.query(expr))

    async def alerts(self) -> list[dict[str, Any]]:
        """Every pending or firing alert."""
        r = await self._client.get(f"{self.url}/api/v1/alerts")
        alerts: list[dict[str, Any]] = r.json()["data"]["alerts"]
        return alerts

    async def last_evaluations(self) -> list[float]:
        """When each rule group was last evaluated (Unix time)."""
        r = await self._client.get(f"{self.url}/api/v1/rules")
        groups = r.json()["data"]["groups"]
        return [_unix(g["lastEvaluation"]) for g in groups]

    async def targets_up(self, count: int, deadline_s: float = 20.0) -> None:
        """Wait until ``count`` targets have been scraped successfully."""
        stop = time.monotonic() + deadline_s
        while True:
            up = await self.query("up == 1")
            if len(up) >= count:
                return
            assert time.monotonic() < stop, f"targets up: {up}"
            await asyncio.sleep(0.2)


def _unix(rfc3339: str) -> float:
    """Prometheus's nanosecond RFC 3339 times, to the microsecond."""
    head, _, rest = rfc3339.partition(".")
    fraction = rest.rstrip("Z")[:6] if rest else "0"
    stamp = datetime.datetime.fromisoformat(head + "+00:00")
    return stamp.timestamp() + float(f"0.{fraction}")


def _config(jobs: Mapping[str, Sequence[tuple[str, Mapping[str, str]]]]) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": job,
                "static_configs": [
                    {"targets": [urlsplit(url).netloc], "labels": dict(labels)}
                    for url, labels in targets
                ],
            }
            for job, targets in jobs.items()
        ],
    }


@contextlib.asynccontextmanager
async def prometheus(
    tmp_path: Path, jobs: Mapping[str, Sequence[tuple[str, Mapping[str, str]]]]
) -> AsyncIterator[Prometheus]:
    """Run Prometheus over ``jobs`` (job name → (base URL, extra labels) per target)."""
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(_config(jobs), sort_keys=False))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            stop = time.monotonic() + 30
            while True:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/-/ready")).status_code == 200:
                        break
                assert time.monotonic() < stop, "Prometheus not ready in 30 s"
                await asyncio.sleep(0.1)
            yield Prometheus(url, client)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
