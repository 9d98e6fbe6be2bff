"""Decode capacity shared by several router replicas, from the engines' own reports.

Replicas do not talk to each other. Each decode engine reports its load on its
own ``/metrics`` (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``);
every ``load_interval`` a replica reads it and sets its *cap* on that engine::

    others = reported - (our streams surely running there: first bytes in, end not seen)
    cap    = own + ceil(max(0, slots - own - others) / replicas)

(``own`` counts our reservations, including legs not yet at the engine), so the
capacity left free is split between the replicas, and the
replica may hold at most ``cap`` requests there until the next report (its own
finished requests free room under the cap again). Before the first report, or
after ``_STALE_AFTER`` failed reads, the cap falls back to a static share
``max(1, slots // replicas)``.

Consistency model (the margin): requests on one engine exceed ``slots`` by at
most ``replicas - 1`` (splitting free capacity rounded up) plus the reservations
other replicas hold whose decode leg has not reached the engine at their report
time (a few milliseconds in push and aggregated modes, which send the decode leg
at once; a whole prefill leg in pull mode, where D is called after P). With two
replicas the test ``tests/integration/test_replicas.py`` holds them to
``slots + 2`` under a sustained overload, where replicas unaware of each other
reach ``2 * slots``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable

from router.engines.health import parse_engine_load
from router.engines.instance import Instance
from router.errors import UpstreamError
from router.upstream import UpstreamClient

__all__ = ["LoadWatcher", "static_share"]

log = logging.getLogger("pd_router.load")

_STALE_AFTER = 3  # failed reads before falling back to the static share


def static_share(slots: int, replicas: int) -> int:
    return max(1, slots // replicas)


class LoadWatcher:
    def __init__(
        self,
        decode_instances: Callable[[], Iterable[Instance]],
        upstream: UpstreamClient,
        replicas: int,
        interval: float,
        timeout: float,
    ) -> None:
        """A changed ``cap`` reaches the ledger through the instance itself."""
        self._instances = decode_instances
        self._upstream = upstream
        self._replicas = replicas
        self._interval = interval
        self._timeout = timeout
        self._failures: dict[str, int] = {}

    def initial_caps(self) -> None:
        for inst in self._instances():
            if inst.cap is None:
                inst.cap = static_share(inst.slots, self._replicas)

    async def run(self) -> None:
        """Read every decode engine's load forever; cancel to stop."""
        while True:
            await self.read_all()
            await asyncio.sleep(self._interval)

    async def read_all(self) -> None:
        self.initial_caps()
        await asyncio.gather(*(self._read(i) for i in self._instances()))

    async def _read(self, inst: Instance) -> None:
        sent_before = inst.at_engine
        reported = await self._reported_load(inst)
        # The smaller sample counts the fewest of ours in the report: the estimate
        # of the other replicas' load errs on the high side.
        ours = min(sent_before, inst.at_engine)
        if reported is None:
            failures = self._failures.get(inst.key, 0) + 1
            self._failures[inst.key] = failures
            if failures >= _STALE_AFTER:
                inst.cap = static_share(inst.slots, self._replicas)
        else:
            self._failures[inst.key] = 0
            others = max(0, reported - ours)
            free = max(0, inst.slots - inst.slots_held - others)
            inst.cap = inst.slots_held + math.ceil(free / self._replicas)

    async def _reported_load(self, inst: Instance) -> int | None:
        try:
            status, body = await self._upstream.get(inst, "/metrics", self._timeout)
        except UpstreamError:
            return None
        load = (
            parse_engine_load(body.decode("utf-8", "replace"), inst.rank) if status == 200 else None
        )
        return None if load is None else round(load.running + load.waiting)
