"""Stats merging, the vLLM stats/prom classes, package exports, and loading through vLLM."""

from __future__ import annotations

import importlib

import pytest

import connector
from connector.stats import WorkerStats, empty_data, merge_data, reduce_data
from tests.needs import need_module

# Importing vLLM emits torch deprecation warnings that are not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def test_worker_stats_snapshot_and_reset() -> None:
    s = WorkerStats()
    assert s.take() is None
    s.wrote(100)
    s.wrote(50)
    s.sent(2, 0.01, 0.002)
    s.failure("reg_timeout")
    data = s.take()
    assert data is not None
    assert (data["bytes_written"], data["num_writes"], data["writes_per_request"]) == (150, 2, [2])
    assert (data["write_seconds"], data["write_tail_seconds"]) == ([0.01], [0.002])
    assert data["failures"] == {"reg_timeout": 1}
    assert s.take() is None


def test_merge_and_reduce() -> None:
    a, b = empty_data(), empty_data()
    a.update(bytes_written=10, num_writes=2, writes_per_request=[2], failures={"refused": 1})
    b.update(bytes_written=5, num_writes=1, writes_per_request=[1], failures={"refused": 2})
    m = merge_data(a, b)
    assert m["bytes_written"] == 15 and m["writes_per_request"] == [2, 1]
    assert m["failures"] == {"refused": 3}
    assert reduce_data(m)["avg_writes_per_request"] == 1.5


def test_exports_resolve() -> None:
    for name in connector.__all__:
        assert getattr(connector, name) is not None


def test_vllm_factory_loads_the_connector() -> None:
    need_module("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from connector.prom import PipelinedStats

    module = importlib.import_module("connector")
    cls = module.PipelinedPushConnector
    assert supports_hma(cls)
    stats = cls.build_kv_connector_stats({**empty_data(), "bytes_written": 3})
    assert isinstance(stats, PipelinedStats) and not stats.is_empty()
    merged = stats.aggregate(cls.build_kv_connector_stats({**empty_data(), "bytes_written": 4}))
    assert merged.data["bytes_written"] == 7
