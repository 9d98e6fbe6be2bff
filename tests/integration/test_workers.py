"""``pd-router serve --workers 2`` as a real subprocess: the decode slot bound holds
across workers, /metrics reports the whole router, a killed worker's slots come
back, and SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Cluster, eventually
from tests.fakes.router_proc import free_port, router_process

SLOTS = 4
STREAMS = 4 * SLOTS
BODY = {"model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True}


def workers_of(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()]


async def scrape(c: httpx.AsyncClient, url: str, name: str) -> float:
    text = (await c.get(url + "/metrics")).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    )


async def stream_all(c: httpx.AsyncClient, url: str) -> tuple[int, str]:
    r = await c.post(url + "/v1/completions", json=BODY)
    return r.status_code, r.text


async def test_two_workers_share_the_slot_bound(cluster: Cluster, tmp_path: Path) -> None:
    d = cluster.decode[0]
    d.behaviour.tokens, d.behaviour.token_delay = 6, 0.03
    cfg = cluster.config("pull", decode_extra={"slots": SLOTS}, admission={"max_wait": 20})
    args = ("--workers", "2")
    async with router_process(cfg, tmp_path / "r.yaml", args=args) as (url, proc):
        assert len(workers_of(proc.pid)) == 2
        limits = httpx.Limits(max_connections=STREAMS)
        async with httpx.AsyncClient(timeout=30, limits=limits) as c:
            for round_ in range(3):
                # The first round is held at D until the bound is reached: SLOTS streams
                # on D, the others queued in either worker.
                gate = d.behaviour.gate = asyncio.Event() if round_ == 0 else None
                sent = [asyncio.create_task(stream_all(c, url)) for _ in range(STREAMS)]
                if gate is not None:
                    await eventually(lambda: d.active == SLOTS, timeout=10)
                    gate.set()
                results = await asyncio.gather(*sent)
                assert {s for s, _ in results} == {200}
                assert all(t.rstrip().endswith("[DONE]") for _, t in results)
            # Every request has ended, so the peak is final: the bound, never more.
            assert d.peak == SLOTS, d.peak
            # Every worker's counters, whichever worker answers the scrape.
            for _ in range(6):
                total = await scrape(c, url, "pdrouter_requests_total")
                assert total == 3 * STREAMS
            assert await scrape(c, url, "pdrouter_decode_slots_in_use") == 0
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0


async def test_a_killed_worker_gives_its_slots_back(cluster: Cluster, tmp_path: Path) -> None:
    d = cluster.decode[0]
    d.behaviour.tokens, d.behaviour.token_delay = 400, 0.025  # 10 s streams
    cfg = cluster.config("aggregated", decode_extra={"slots": SLOTS}, admission={"max_wait": 1})
    args = ("--workers", "2")
    async with router_process(cfg, tmp_path / "r.yaml", args=args) as (url, proc):
        before = workers_of(proc.pid)
        async with httpx.AsyncClient(timeout=30) as c:
            streams = [asyncio.create_task(stream_all(c, url)) for _ in range(SLOTS)]
            await eventually(lambda: d.active == SLOTS, timeout=10)
            assert await scrape(c, url, "pdrouter_decode_slots_in_use") == SLOTS
            for pid in before:
                os.kill(pid, signal.SIGKILL)
            await asyncio.gather(*streams, return_exceptions=True)
            deadline = time.monotonic() + 20
            while True:  # restarted workers, every slot free again
                try:
                    in_use = await scrape(c, url, "pdrouter_decode_slots_in_use")
                    if in_use == 0 and len(workers_of(proc.pid)) == 2:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "slots not freed"
                await asyncio.sleep(0.2)
            after = workers_of(proc.pid)
            assert len(after) == 2 and not set(after) & set(before)
            d.behaviour.tokens = 4
            results = await asyncio.gather(*(stream_all(c, url) for _ in range(SLOTS)))
            assert {s for s, _ in results} == {200}
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    await eventually(lambda: d.active == 0, timeout=10)


# Runs the real CLI with one change: the supervisor gets SIGTERM right after forking
# worker 1, before start() returns (the window where the stop used to miss worker 1).
_STOP_DURING_FORK = """
import multiprocessing.context, os, signal, sys
real_start = multiprocessing.context.ForkProcess.start
def start(self):
    real_start(self)
    if self.name.endswith("-w1"):
        os.kill(os.getpid(), signal.SIGTERM)
multiprocessing.context.ForkProcess.start = start
from router.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


async def _serve_and_stop(argv: tuple[str, ...], stop_when_two: bool) -> int:
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv)
    try:
        if stop_when_two:
            await eventually(lambda: len(workers_of(proc.pid)) == 2, timeout=20)
            proc.send_signal(signal.SIGTERM)  # workers are still importing and building the app
        return await asyncio.wait_for(proc.wait(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_while_workers_start_still_exits_0(cluster: Cluster, tmp_path: Path) -> None:
    """A SIGTERM that reaches the supervisor or its workers before uvicorn took their
    signals (start-up, or a worker restarted just before a shutdown) must not be lost:
    every worker stops and the router exits 0."""
    path = tmp_path / "r.yaml"
    cfg = {**cluster.config("pull"), "listen": {"host": "127.0.0.1", "port": free_port()}}
    path.write_text(yaml.safe_dump(cfg))
    serve = ("serve", "--config", str(path), "--workers", "2", "--grace", "1")
    assert await _serve_and_stop(("-m", "router", *serve), stop_when_two=True) == 0
    assert await _serve_and_stop(("-c", _STOP_DURING_FORK, *serve), stop_when_two=False) == 0
