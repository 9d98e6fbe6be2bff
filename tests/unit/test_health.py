"""Active health checks: how many misses take an engine out of rotation, and what brings it back."""

from __future__ import annotations

import httpx
import pytest

from router.config import HealthConfig, TimeoutConfig
from router.engines.breaker import Breaker
from router.engines.health import HealthMonitor
from router.engines.instance import Instance, Role
from router.httpx_carrier import HttpxCarrier
from router.upstream import UpstreamClient

URL = "http://p:8000"


class Engine:
    """Answers ``/health`` with ``status``, or times out; records each probe's timeout."""

    def __init__(self) -> None:
        self.status = 200
        self.hangs = False
        self.timeouts: list[float] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        self.timeouts.append(request.extensions["timeout"]["read"])
        if self.hangs:
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(self.status)


def _monitor(config: HealthConfig) -> tuple[HealthMonitor, Instance, Engine]:
    engine = Engine()
    carrier = HttpxCarrier(httpx.MockTransport(engine.handle), 5.0, 30.0)
    upstream = UpstreamClient(TimeoutConfig(), carrier)
    inst = Instance(URL, Role.PREFILL, "tiny", Breaker(5, 10.0))
    return HealthMonitor(lambda: [inst], upstream, config), inst, engine


async def test_an_engine_leaves_rotation_only_after_unhealthy_after_misses_in_a_row() -> None:
    config = HealthConfig(unhealthy_after=3)
    monitor, inst, engine = _monitor(config)
    await monitor.check_all()
    assert inst.healthy is True
    engine.status = 503
    await monitor.check_all()
    engine.hangs = True  # a timeout is a miss too
    await monitor.check_all()
    assert inst.healthy is True and inst.routable, "two misses must not take it out"
    await monitor.check_all()
    assert inst.healthy is False and not inst.routable
    assert engine.timeouts == [config.timeout] * 4


async def test_one_answer_resets_the_count_and_brings_the_engine_back() -> None:
    monitor, inst, engine = _monitor(HealthConfig(unhealthy_after=2))
    await monitor.check_all()
    engine.status = 500
    await monitor.check_all()
    engine.status = 200
    await monitor.check_all()  # resets the count: the next miss is the first again
    engine.status = 500
    await monitor.check_all()
    assert inst.healthy is True
    await monitor.check_all()
    assert inst.healthy is False
    engine.status = 200
    await monitor.check_all()
    assert inst.healthy is True and inst.routable


@pytest.mark.parametrize("unhealthy_after", [1, 3])
async def test_an_engine_never_seen_healthy_is_unhealthy_at_its_first_miss(
    unhealthy_after: int,
) -> None:
    """At start-up nothing vouches for the engine: one miss is enough to keep it out."""
    monitor, inst, engine = _monitor(HealthConfig(unhealthy_after=unhealthy_after))
    engine.status = 503
    await monitor.check_all()
    assert inst.healthy is False
