"""The access log: one line per inference request with what an operator greps for, in text
or JSON; nothing when it is off (the default)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import pytest

from router.access_log import ACCESS_LOGGER
from tests.conftest import Cluster
from tests.fakes.router_proc import router_process

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    """The access records as ``key=value`` dicts."""
    return [
        dict(pair.split("=", 1) for pair in r.getMessage().split(" "))
        for r in caplog.records
        if r.name == ACCESS_LOGGER
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_served_request_logs_one_line_with_engines_and_times(
    cluster: Cluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    url, _ = await cluster.router("push", logging={"access": True})
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    r = await client.post(
        f"{url}/v1/completions", json={**BODY, "stream": stream}, headers={"x-request-id": "c-1"}
    )
    assert r.status_code == 200
    [line] = _lines(caplog)
    assert {k: line[k] for k in ("method", "path", "status", "model", "mode", "outcome")} == {
        "method": "POST",
        "path": "/v1/completions",
        "status": "200",
        "model": "tiny",
        "mode": "push",
        "outcome": "success",
    }
    assert (line["decision"], line["client_id"]) == ("push", "c-1")
    assert (line["prefill"], line["decode"]) == (cluster.prefill_urls[0], cluster.decode_urls[0])
    assert re.fullmatch(r"pdr-[0-9a-f]+", line["request_id"])
    assert 0 <= float(line["ttft_ms"]) <= float(line["duration_ms"])


async def test_refused_and_failed_requests_are_logged_with_their_status(
    cluster: Cluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = await cluster.router("pull", logging={"access": True})
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    cluster.decode[0].behaviour.poison = "POISON"
    unknown = await client.post(f"{url}/v1/completions", json={**BODY, "model": "nope"})
    failed = await client.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "POISON"}],
            "max_tokens": 4,
        },
    )
    assert (unknown.status_code, failed.status_code) == (404, 502)
    refused, upstream = _lines(caplog)
    assert (refused["status"], refused["model"], refused["outcome"]) == ("404", "-", "client_error")
    assert refused["decision"] == refused["decode"] == "-"
    assert (upstream["status"], upstream["path"], upstream["outcome"]) == (
        "502",
        "/v1/chat/completions",
        "upstream_error",
    )
    assert upstream["ttft_ms"] == "-"


async def test_off_by_default(
    cluster: Cluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = await cluster.router("pull")
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200
    assert _lines(caplog) == []


async def test_json_format_writes_every_record_as_one_object(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``pd-router serve`` itself: its access lines and warnings are JSON objects."""
    cfg = cluster.config("pull", logging={"access": True, "format": "json"})
    cluster.decode[0].behaviour.poison = "POISON"
    async with router_process(cfg, tmp_path / "r.yaml") as (url, proc):
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.post(f"{url}/v1/completions", json=BODY)).status_code == 200
            bad = {**BODY, "prompt": "POISON"}
            assert (await c.post(f"{url}/v1/completions", json=bad)).status_code == 502
        proc.terminate()
        stderr = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
    lines = [line for line in stderr.splitlines() if line.strip()]
    # The start-up summary is plain text by design (printed before logging starts).
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) >= len(lines) - _summary_lines(stderr), stderr[-2000:]
    access = [r for r in records if r["logger"] == ACCESS_LOGGER]
    assert [(r["status"], r["outcome"]) for r in access] == [
        (200, "success"),
        (502, "upstream_error"),
    ]
    assert access[0]["decode"] == cluster.decode_urls[0] and access[0]["ttft_ms"] > 0
    warnings = [r for r in records if r["level"] == "WARNING"]
    assert any("attempt_failed" in r["message"] for r in warnings), warnings
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["logger"].startswith("uvicorn") for r in records), "uvicorn's lines not JSON"


def _summary_lines(stderr: str) -> int:
    """Lines before the first JSON record (the summary the CLI prints at start)."""
    head = stderr.split("\n{", 1)[0]
    return len([line for line in head.splitlines() if line.strip()])
