"""The router's metric families write their values without prometheus_client's lock (one
process, one event loop); a scrape must read exactly what prometheus_client's own
families read after the same writes, and the errors of a wrong write stay its errors."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.metrics import _Counter, _Gauge, _Histogram

BUCKETS = (0.005, 0.01, 0.1, 1.0, 10.0)
# Amounts on, between, below and above the bounds; NaN falls in no bucket.
AMOUNTS = (0.0, 0.005, 0.0051, 0.01, 0.5, 1.0, 9.99, 10.0, 11.0, 1e9, -1.0, math.nan)


def _families(r: CollectorRegistry, fast: bool) -> tuple[Counter, Gauge, Histogram]:
    counter, gauge, histogram = (
        (_Counter, _Gauge, _Histogram) if fast else (Counter, Gauge, Histogram)
    )
    return (
        counter("c", "a counter", ["model", "outcome"], registry=r),
        gauge("g", "a gauge", ["key"], registry=r),
        histogram("h", "a histogram", ["model"], buckets=BUCKETS, registry=r),
    )


def _write(c: Counter, g: Gauge, h: Histogram) -> None:
    for i, amount in enumerate(AMOUNTS):
        h.labels("m").observe(amount)
        h.labels("other").observe(amount / 3)
        c.labels("m", "success").inc()
        c.labels("m", "timeout").inc(0.1 * i)
        g.labels("k").inc()
        g.labels("k").dec(0.5)
    g.labels("k2").set(7.25)
    g.labels("k2").dec()


def _scrape(r: CollectorRegistry) -> list[bytes]:
    """The exposition text but the creation times (which differ by construction)."""
    return [line for line in generate_latest(r).splitlines() if b"_created" not in line]


def test_a_scrape_reads_what_prometheus_client_would() -> None:
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    _write(*_families(mine, fast=True))
    _write(*_families(theirs, fast=False))
    assert _scrape(mine) == _scrape(theirs)
    assert b'h_bucket{le="+Inf",model="m"} 11.0' in _scrape(mine)  # NaN: in no bucket


def test_the_values_are_the_routers_own_and_wrong_writes_keep_their_errors() -> None:
    c, g, h = _families(CollectorRegistry(), fast=True)
    assert c.labels("m", "x")._fast and g.labels("k")._fast and h.labels("m")._fast
    with pytest.raises(ValueError):
        c.labels("m", "x").inc(-1)  # counters only go up
    with pytest.raises(ValueError):
        c.inc()  # a family with labels, none given
    with pytest.raises(ValueError):
        h.observe(1.0)
    with pytest.raises(ValueError):
        g.inc()
