"""Engine-reported load (router/engines/reported.py): others' requests from the engine's own
count, this replica's own from its counters; stale reports fall back to the own count."""

from __future__ import annotations

from typing import Any

from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from router.engines.reported import EngineLoads, own_load


class Pages:
    """Answers ``/metrics`` with the running/waiting counts set per URL (None: a failure)."""

    def __init__(self) -> None:
        self.load: dict[str, tuple[int, int] | None] = {}

    async def get(self, engine: Instance, path: str, timeout: float) -> tuple[int, bytes]:
        assert path == "/metrics"
        counts = self.load[engine.url]
        if counts is None:
            raise OSError("refused")
        running, waiting = counts
        text = (
            f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\n"
            "vllm:kv_cache_usage_perc 0.0\n"
        )
        return 200, text.encode()


def _inst(url: str, role: Role) -> Instance:
    return Instance(url, role, "m", Breaker(3, 1.0, lambda: 0.0), slots=8)


async def test_others_come_from_the_report_and_own_from_the_counters() -> None:
    pages = Pages()
    d, p = _inst("http://d", Role.DECODE), _inst("http://p", Role.PREFILL)
    upstream: Any = pages
    loads = EngineLoads(upstream, interval=1.0, timeout=1.0)
    assert loads.load(d) == own_load(d) == 0  # no report yet: the own count
    for _ in range(2):  # two of ours streaming there
        d.take_slot()
        d.stream_started()
    pages.load = {"http://d": (4, 1), "http://p": (3, 0)}
    await loads.read_all([d, p])
    assert loads.load(d) == 2 + 3  # 5 reported, 2 of them ours
    d.take_slot()  # one more of ours since the report
    assert loads.load(d) == 3 + 3
    assert loads.load(p) == 3


async def test_a_report_three_reads_old_is_dropped() -> None:
    pages = Pages()
    d = _inst("http://d", Role.DECODE)
    upstream: Any = pages
    loads = EngineLoads(upstream, interval=1.0, timeout=1.0)
    pages.load = {"http://d": (5, 0)}
    await loads.read_all([d])
    pages.load["http://d"] = None
    for expected in (5, 5, 0):
        await loads.read_all([d])
        assert loads.load(d) == expected
