"""Data-parallel engine entries: one entry, one instance per rank (router/registry.py), each
with vLLM's per-rank identity: its NIXL engine id and side-channel port, its KV-events
endpoints (router/kvindex/index.py) and its own series of the engine's ``/metrics``."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import RouterConfig, engine_key, parse_config, split_engine_key
from router.engines.breaker import Breaker
from router.engines.facts import parse_engine_ranks, rank_mismatch
from router.engines.health import parse_engine_load
from router.engines.instance import Instance, Role
from router.kvindex.index import rank_endpoint, sources
from router.registry import Registry


def _cfg(mode: str, prefill: dict[str, Any], decode: dict[str, Any], **model: Any) -> RouterConfig:
    return parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "mode": mode,
                    "prefill": [{"url": "http://p:8000", **prefill}],
                    "decode": [{"url": "http://d:8000", **decode}],
                    **model,
                }
            ]
        }
    )


NIXL = {"engine_id": "e", "kv_host": "10.0.0.9", "kv_port": 5600}


@pytest.mark.parametrize(("mode", "step"), [("push", 1), ("pull", 1), ("pipelined", 4)])
def test_each_rank_is_an_instance_with_vllm_s_identity_for_that_rank(mode: str, step: int) -> None:
    """vLLM's NIXL connectors offset a rank's side channel by the rank; this project's
    connector (pipelined) by the rank's TP x PP workers (here 2 x 2)."""
    layout = {"tp_size": 2, "pp_size": 2}
    cfg = _cfg(
        mode,
        {"data_parallel_size": 3, **NIXL, **layout},
        {"data_parallel_size": 2, "slots": 5, **NIXL, **layout},
    )
    pool = Registry(cfg).get("m")
    assert pool is not None
    assert [(i.url, i.rank) for i in pool.prefill] == [("http://p:8000", r) for r in (0, 1, 2)]
    assert [i.key for i in pool.decode] == ["http://d:8000#dp0", "http://d:8000#dp1"]
    for rank, inst in enumerate(pool.prefill):
        assert inst.nixl is not None
        assert (inst.nixl.engine_id, inst.nixl.port) == (f"e_dp{rank}", 5600 + rank * step)
        assert (inst.nixl.host, inst.nixl.tp_size) == ("10.0.0.9", 2)
    # Slots are per rank: the ledger sees two engines of five each.
    assert [(d.slots, d.rank) for d in pool.ledger.instances] == [(5, 0), (5, 1)]


def test_an_engine_without_data_parallelism_is_one_unpinned_instance() -> None:
    pool = Registry(_cfg("push", NIXL, {})).get("m")
    assert pool is not None
    (p,) = pool.prefill
    assert (p.rank, p.key, p.rank_label) == (None, "http://p:8000", "")
    assert p.nixl is not None and (p.nixl.engine_id, p.nixl.port) == ("e", 5600)


def test_a_reload_keeps_the_ranks_that_stay_and_drops_the_others() -> None:
    reg = Registry(_cfg("pull", {"data_parallel_size": 3}, {"data_parallel_size": 2}))
    pool = reg.get("m")
    assert pool is not None
    d1 = pool.decode[1]
    d1.take_slot()
    changes = reg.apply(_cfg("pull", {"data_parallel_size": 2}, {"data_parallel_size": 2}))
    assert changes == ["model 'm': - http://p:8000#dp2"]
    assert pool.decode[1] is d1 and d1.slots_held == 1
    d1.give_slot()


def test_engine_keys_split_back_into_url_and_rank_label() -> None:
    assert split_engine_key(engine_key("http://h:1", 3)) == ("http://h:1", "3")
    assert split_engine_key(engine_key("http://h:1", None)) == ("http://h:1", "")


def test_each_rank_follows_its_own_kv_events_ports() -> None:
    """vLLM's publisher binds the endpoint's port plus the rank (``offset_endpoint_port``)."""
    cfg = _cfg(
        "pull",
        {"data_parallel_size": 2},
        {"data_parallel_size": 2, "kv_events_endpoint": "tcp://d:6000"},
        kv_events={"enabled": True, "port": 5557, "replay_port": 5567},
    )
    got = {k: (s.endpoint, s.replay) for k, s in sources(cfg.models[0]).items()}
    assert got == {
        "http://p:8000#dp0": ("tcp://p:5557", "tcp://p:5567"),
        "http://p:8000#dp1": ("tcp://p:5558", "tcp://p:5568"),
        "http://d:8000#dp0": ("tcp://d:6000", "tcp://d:5567"),
        "http://d:8000#dp1": ("tcp://d:6001", "tcp://d:5568"),
    }
    assert rank_endpoint("tcp://*:0", 3) == "tcp://*:0"
    assert rank_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    assert rank_endpoint("tcp://[::1]:7000", 2) == "tcp://[::1]:7002"


def test_a_rank_s_load_is_its_own_series_of_the_engine_s_metrics() -> None:
    page = "".join(
        f'vllm:num_requests_running{{model_name="m",engine="{r}"}} {2 * r + 1}\n'
        f'vllm:num_requests_waiting{{model_name="m",engine="{r}"}} {r}\n'
        f'vllm:kv_cache_usage_perc{{model_name="m",engine="{r}"}} 0.{r + 1}\n'
        for r in (0, 1)
    )
    rank1 = parse_engine_load(page, 1)
    assert rank1 is not None and (rank1.running, rank1.waiting, rank1.kv_usage) == (3, 1, 0.2)
    whole = parse_engine_load(page)
    assert whole is not None and (whole.running, whole.waiting) == (4, 1)
    missing = parse_engine_load(page, 2)
    assert missing is not None and missing.running == 0


def test_a_declared_size_the_engine_contradicts_is_named() -> None:
    """The size is declared; the engine's own ``engine`` labels only tell the operator."""
    page = "".join(f'vllm:num_requests_running{{engine="{r}"}} 0\n' for r in (0, 1))
    ranks = parse_engine_ranks(page)
    assert ranks == {"0", "1"}

    def inst(rank: int | None) -> Instance:
        return Instance("http://h:1", Role.DECODE, "m", Breaker(5, 10.0), rank=rank)

    assert rank_mismatch(inst(1), ranks) is None
    assert rank_mismatch(inst(2), ranks) == "it reports no rank 2 (ranks 0,1)"
    assert "declare data_parallel_size" in str(rank_mismatch(inst(None), ranks))
    assert rank_mismatch(inst(None), {"0"}) is None
    assert rank_mismatch(inst(None), parse_engine_ranks("vllm:num_requests_running 0\n")) is None


def test_a_sidecar_reads_the_rank_the_picker_pinned() -> None:
    """``X-data-parallel-rank`` beside the picker's decision narrows the sidecar's D to that
    rank; without a decision it is not the picker's (the router chooses); a rank that is
    not a whole number is a 400, not a silent choice of the sidecar's own."""
    from router.client_request import Endpoint, parse_client_request
    from router.errors import InvalidRequest
    from router.intake import with_pick

    creq = parse_client_request(b'{"model": "m", "prompt": "hi"}', Endpoint.COMPLETIONS)
    picked = [(b"x-pd-decision", b"decode_alone"), (b"x-data-parallel-rank", b"1")]
    assert with_pick(creq, picked).picked_rank == 1
    assert with_pick(creq, picked[1:]).picked_rank is None
    with pytest.raises(InvalidRequest, match="x-data-parallel-rank"):
        with_pick(creq, [picked[0], (b"x-data-parallel-rank", b"-1")])
