"""Shared fixtures: fake engines on real sockets and a router in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from router.app import AppContext, create_app
from router.config import parse_config
from tests import engine_stacks
from tests.fakes.fake_vllm import FakeEngine, KvBus
from tests.fakes.otlp import OtlpReceiver, threaded_receiver
from tests.fakes.servers import serve
from tests.needs import missing
from tests.suites import SuiteClock


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteClock(), "pd-router-suite-clock")
    config.addinivalue_line(
        "markers",
        "destructive(order): kills or restarts engines; runs after the other tests of its "
        "engine stack (tests/engine_stacks.py), lower order first",
    )
    config.addinivalue_line(
        "markers",
        "serial: runs in scripts/test.sh's one-process run, with the engine tests, not on xdist "
        "workers (tests whose node ids are not unique)",
    )


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[tuple[str, OtlpReceiver]]:
    """The run's OTLP/HTTP trace receiver; the main stacks' engines export to it (OTLP over
    HTTP, every 200 ms instead of every 5 s: read by vLLM's OpenTelemetry setup, and by a
    router whose config names a tracing endpoint)."""
    with pytest.MonkeyPatch.context() as env, threaded_receiver() as (url, receiver):
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        yield url, receiver


@pytest.fixture(scope="session")
def engine_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[engine_stacks.Running]:
    """The real-engine stack named by the test's indirect parameter (one of
    ``engine_stacks.KINDS``). Session scope: every test of a kind shares one stack, and pytest
    stops it before it starts another kind's, so no two stacks ever run at once. A kind whose
    tests compare with the aggregated reference gets it: from a main stack's D once it runs,
    otherwise from an engine of its own stopped before this stack starts (tests/e2e)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        missing("needs vLLM and NIXL: run scripts/setup.sh (engine-cpu extra)")
    kind: str = request.param
    references = None
    if kind in engine_stacks.NEEDS_REFERENCE:
        references = request.getfixturevalue("references")
        if kind not in engine_stacks.MAIN:
            references.standalone()
    otlp_url = None
    if kind in engine_stacks.MAIN:
        otlp_url, _ = request.getfixturevalue("otlp_receiver")
    with engine_stacks.start(kind, tmp_path_factory.mktemp(kind), otlp_url) as running:
        if references is not None:
            references.from_engines(running.stack.decode.url, running.stack.prefill.url)
        yield running


@dataclass
class Cluster:
    """Fake P and D engines on loopback; ``router()`` starts a router in front of them."""

    prefill: list[FakeEngine]
    decode: list[FakeEngine]
    prefill_urls: list[str]
    decode_urls: list[str]
    stack: contextlib.AsyncExitStack
    routers: list[AppContext] = field(default_factory=list)

    def config(self, mode: str = "pull", **overrides: Any) -> dict[str, Any]:
        prefill_extra = overrides.pop("prefill_extra", {})
        decode_extra = overrides.pop("decode_extra", {})
        model = {
            "name": "tiny",
            "mode": mode,
            "prefill": [{"url": u, **prefill_extra} for u in self.prefill_urls],
            "decode": [{"url": u, "slots": 4, **decode_extra} for u in self.decode_urls],
        }
        model.update(overrides.pop("model", {}))
        cfg: dict[str, Any] = {
            "models": [model],
            "timeouts": {"prefill": 5, "decode_first_byte": 5, "idle": 5, "total": 30},
            "retries": {"max_attempts": 1},
            "health": {"interval": 0.1, "timeout": 1},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        return cfg

    async def router(self, mode: str = "pull", **overrides: Any) -> tuple[str, AppContext]:
        health_checks = overrides.pop("health_checks", False)
        app = create_app(parse_config(self.config(mode, **overrides)), health_checks=health_checks)
        url = await self.stack.enter_async_context(serve(app))
        ctx: AppContext = app.state.ctx
        self.routers.append(ctx)
        return url, ctx

    @property
    def engines(self) -> list[FakeEngine]:
        return [*self.prefill, *self.decode]


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until ``check()`` holds (cleanup happens asynchronously after a close). Returns as
    soon as it holds: the deadline only ends a test that would wait forever, far above what a
    run takes even on a busy machine."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def stream_error(text: str) -> dict[str, Any]:
    """The error of a failed SSE stream, which must end as vLLM ends one: the error
    event, then ``data: [DONE]`` (once)."""
    *_, error, done = [e for e in text.split("\n\n") if e]
    assert done == "data: [DONE]" and text.count("data: [DONE]") == 1, text[-300:]
    doc: dict[str, Any] = json.loads(error.removeprefix("data: "))["error"]
    return doc


async def assert_nothing_leaked(cluster: Cluster) -> None:
    """Every slot free, every upstream connection closed by the end of a test."""
    await eventually(lambda: all(e.active == 0 for e in cluster.engines))
    for ctx in cluster.routers:
        await eventually(lambda ctx=ctx: ctx.registry.slots_in_use() == 0)
        for inst in ctx.registry.instances():
            assert inst.slots_held == inst.legs_running == 0, inst.url


async def _start_cluster(n_prefill: int, n_decode: int) -> AsyncIterator[Cluster]:
    bus = KvBus()
    async with contextlib.AsyncExitStack() as stack:
        prefill = [FakeEngine(f"p{i}", bus) for i in range(n_prefill)]
        decode = [FakeEngine(f"d{i}", bus) for i in range(n_decode)]
        p_urls = [await stack.enter_async_context(serve(e)) for e in prefill]
        d_urls = [await stack.enter_async_context(serve(e)) for e in decode]
        cluster = Cluster(prefill, decode, p_urls, d_urls, stack)
        yield cluster
        await assert_nothing_leaked(cluster)


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async for c in _start_cluster(1, 1):
        yield c


@pytest.fixture
async def cluster2() -> AsyncIterator[Cluster]:
    async for c in _start_cluster(2, 2):
        yield c


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


def metric(ctx: AppContext, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(ctx.metrics.render().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def client_leaves(
    url: str, body: dict[str, Any], when: Callable[[], bool] | None = None
) -> None:
    """POST ``body`` as a streaming client, then close the connection at the moment the test
    chose: once ``when()`` holds, or (without it) once the first bytes of the answer came.
    Fails if the answer ended before that moment."""
    first_bytes = asyncio.Event()

    async def read() -> None:
        async with httpx.AsyncClient(timeout=30) as c, c.stream("POST", url, json=body) as r:
            async for _ in r.aiter_bytes():
                first_bytes.set()

    ready = first_bytes.is_set if when is None else when
    task = asyncio.create_task(read())
    try:
        await eventually(lambda: ready() or task.done(), timeout=10)
        assert not task.done(), f"the answer ended before the client left: {task}"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
