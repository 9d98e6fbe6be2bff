"""Engine load as the engines report it, so that router replicas judge load alike.

Each engine reports its own load on ``/metrics`` (``vllm:num_requests_running`` +
``vllm:num_requests_waiting``). With several router replicas, one replica's own counts miss
the others' requests, so two replicas would spill a session (session affinity's load bound,
``router/engines/affinity.py``) or weigh an engine (cache-aware routing,
``router/kvindex/route.py``) differently. :class:`EngineLoads` reads every engine every
``interval`` seconds and answers, for an instance::

    load = others + own_now,   others = max(0, reported - own_at_engine_when_read)

where ``own`` is this replica's count (decode: reserved slots; prefill: legs in flight and
requests it serves alone) and ``own_at_engine`` what of it the engine could see (decode:
streams with first bytes in and no end yet; prefill: all of it). Replicas reading the same
report see the same total, give or take requests started since the read; with no report
yet, or after three failed reads in a row, the load is this replica's own count, as with one
router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from router.engines.health import parse_engine_load
from router.engines.instance import Instance, Role
from router.upstream import UpstreamClient

__all__ = ["EngineLoads", "own_load"]

_STALE_AFTER = 3  # failed reads in a row before a report is dropped


@dataclass(slots=True)
class _Report:
    others: int
    failures: int = 0


def own_load(inst: Instance) -> int:
    """This router's own count on ``inst``: reserved slots (decode), legs in flight and
    requests served alone (prefill)."""
    return inst.load


def _own_at_engine(inst: Instance) -> int:
    return inst.at_engine if inst.role is Role.DECODE else inst.load


class EngineLoads:
    """Reported load of every engine (see module doc); the only owner of the reports."""

    def __init__(self, upstream: UpstreamClient, interval: float, timeout: float) -> None:
        """The engines are read every ``interval`` seconds, each within ``timeout``."""
        self._upstream = upstream
        self._interval = interval
        self._timeout = timeout
        self._reports: dict[str, _Report] = {}

    def load(self, inst: Instance) -> int:
        """Requests on ``inst`` from every replica, as of the last report plus this
        replica's changes since."""
        report = self._reports.get(inst.key)
        others = report.others if report is not None and report.failures < _STALE_AFTER else 0
        return own_load(inst) + others

    async def run(self, instances: Callable[[], Iterable[Instance]]) -> None:
        """Read every engine of ``instances()`` forever; cancel to stop."""
        while True:
            await self.read_all(instances())
            await asyncio.sleep(self._interval)

    async def read_all(self, engines: Iterable[Instance]) -> None:
        """Read every engine of ``engines`` once (and forget the others' reports)."""
        instances = list(engines)
        wanted = {i.key for i in instances}
        for url in set(self._reports) - wanted:
            del self._reports[url]
        await asyncio.gather(*(self._read(i) for i in instances))

    async def _read(self, inst: Instance) -> None:
        before = _own_at_engine(inst)
        reported = await self._reported(inst)
        if reported is None:
            report = self._reports.get(inst.key)
            if report is not None:
                report.failures += 1
            return
        # The smaller sample counts the fewest of ours in the report: others err high.
        ours = min(before, _own_at_engine(inst))
        self._reports[inst.key] = _Report(max(0, reported - ours))

    async def _reported(self, inst: Instance) -> int | None:
        try:
            status, body = await self._upstream.get(inst, "/metrics", self._timeout)
        except Exception:
            return None
        load = (
            parse_engine_load(body.decode("utf-8", "replace"), inst.rank) if status == 200 else None
        )
        return None if load is None else round(load.running + load.waiting)
