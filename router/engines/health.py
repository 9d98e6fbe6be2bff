"""Active health checks, and the watch on decode engines suspected of leaking KV.

Health is ``GET /health`` on every engine: a decode engine is never sent a
generate request to probe it. A decode engine marked *suspect* (a leg was closed
while it waited for KV, which leaks blocks in vLLM 0.32's push connector) has its
own ``/metrics`` read: with nothing running or waiting and KV usage above its
idle value it is *degraded* and out of rotation until usage returns to idle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from router.config import HealthConfig
from router.engines.facts import FactsReader
from router.engines.instance import Instance, Role
from router.errors import UpstreamError
from router.upstream import UpstreamClient

__all__ = ["EngineLoad", "HealthMonitor", "parse_engine_load"]

log = logging.getLogger("pd_router.health")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float


_WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def parse_engine_load(text: str, rank: int | None = None) -> EngineLoad | None:
    """Running/waiting requests and KV usage from a vLLM ``/metrics`` page; None if the
    page lacks one of them or is not Prometheus text. ``rank``: only that data-parallel
    rank's samples (vLLM labels each engine core's series ``engine="<rank>"``); None: the
    page's sum."""
    found: dict[str, float] = {}
    engine = None if rank is None else str(rank)
    try:
        for family in text_string_to_metric_families(text):
            field = _WANTED.get(family.name)
            if field is None:
                continue
            # Added up: a page may list a family in several runs (one per rank).
            found[field] = found.get(field, 0.0) + sum(
                s.value
                for s in family.samples
                if s.name == family.name and (engine is None or s.labels.get("engine") == engine)
            )
    except ValueError:
        return None
    if len(found) != len(_WANTED):
        return None
    return EngineLoad(**found)


def _nothing() -> None:
    pass


class HealthMonitor:
    """Probes every engine; what it learns reaches the ledger through the instances
    themselves (see :class:`~router.engines.instance.Instance`), not through hooks here.
    With ``facts``, an engine that answers has what it runs read (router/engines/facts.py)
    before it counts as healthy, and ``on_facts`` is called when that changed (the
    registry's pairing check)."""

    def __init__(
        self,
        instances: Callable[[], Iterable[Instance]],
        upstream: UpstreamClient,
        config: HealthConfig,
        facts: FactsReader | None = None,
        on_facts: Callable[[], None] = _nothing,
    ) -> None:
        self._instances = instances
        self._upstream = upstream
        self._config = config
        self._facts = facts
        self._on_facts = on_facts

    async def run(self) -> None:
        """Check forever, every ``interval`` seconds; cancel to stop."""
        while True:
            await self.check_all()
            await asyncio.sleep(self._config.interval)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(i) for i in self._instances()))

    async def _check(self, inst: Instance) -> None:
        ok = await self._probe(inst)
        failures = inst.probed(ok)
        facts = self._facts
        if ok and facts is not None and facts.due(inst, inst.healthy) and await facts.read(inst):
            self._on_facts()
        if ok:
            if inst.healthy is False:
                log.warning("event=healthy role=%s engine=%s", inst.role, inst.key)
            inst.healthy = True
        elif failures >= self._config.unhealthy_after or inst.healthy is None:
            if inst.healthy is not False:
                log.warning(
                    "event=unhealthy role=%s engine=%s failed_checks=%d",
                    inst.role,
                    inst.key,
                    failures,
                )
            inst.healthy = False
        inst.breaker.probe(ok)
        if ok and inst.role is Role.DECODE and (inst.suspect or inst.degraded):
            await self._check_leak(inst)

    async def _probe(self, inst: Instance) -> bool:
        try:
            status, _ = await self._upstream.get(inst, "/health", self._config.timeout)
        except UpstreamError:
            return False
        return status == 200

    async def _check_leak(self, inst: Instance) -> None:
        try:
            status, body = await self._upstream.get(inst, "/metrics", self._config.timeout)
        except UpstreamError:
            return
        load = (
            parse_engine_load(body.decode("utf-8", "replace"), inst.rank) if status == 200 else None
        )
        if load is None:
            return
        if load.running or load.waiting:
            return  # busy: a leak cannot be told apart from real use
        # An idle engine holds no KV: anything above the tolerance is leaked blocks.
        leaked = load.kv_usage > self._config.leak_usage_epsilon
        if leaked and not inst.degraded:
            log.error(
                "event=degraded role=decode engine=%s kv_usage=%.4f reason=%r",
                inst.key,
                load.kv_usage,
                "holds KV blocks with no request running or waiting",
            )
        if not leaked and inst.degraded:
            log.warning("event=degraded_cleared role=decode engine=%s", inst.key)
        inst.leak_checked(leaked)
