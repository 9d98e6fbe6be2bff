"""Registry reconciliation keeps the state of engines that stay."""

from __future__ import annotations

from router.config import DecodeInstanceConfig, parse_config
from router.registry import Registry


def cfg(decode: list[dict[str, object]], mode: str = "aggregated") -> object:
    return parse_config({"models": [{"name": "m", "mode": mode, "decode": decode}]})


def test_apply_keeps_instances_that_stay_and_updates_slots() -> None:
    reg = Registry(cfg([{"url": "http://a:1", "slots": 2}, {"url": "http://b:1"}]))  # type: ignore[arg-type]
    pool = reg.get("m")
    assert pool is not None
    a = pool.decode[0]
    a.take_slot()
    a.breaker.record(False)
    changes = reg.apply(cfg([{"url": "http://a:1", "slots": 5}, {"url": "http://c:1"}]))  # type: ignore[arg-type]
    assert changes == ["model 'm': + http://c:1", "model 'm': - http://b:1"]
    assert pool.decode[0] is a and a.slots == 5 and a.slots_held == 1
    assert [i.url for i in pool.ledger.instances] == ["http://a:1", "http://c:1"]


def test_models_come_and_go() -> None:
    reg = Registry(cfg([{"url": "http://a:1"}]))  # type: ignore[arg-type]
    other = parse_config(
        {"models": [{"name": "n", "mode": "aggregated", "decode": [{"url": "http://z:1"}]}]}
    )
    assert reg.apply(other)[0] == "model 'm' removed"
    assert reg.get("m") is None and reg.get("n") is not None


def test_set_instances_from_discovery_keeps_learned_identities() -> None:
    reg = Registry(
        parse_config(
            {
                "models": [
                    {
                        "name": "m",
                        "mode": "push",
                        "prefill": [{"url": "http://p:1"}],
                        "decode": [{"url": "http://d:1"}],
                    }
                ]
            }
        )
    )
    pool = reg.get("m")
    assert pool is not None
    learned = pool.prefill[0].learn_nixl(
        {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1}
    )
    reg.set_instances("m", pool.config.prefill, [DecodeInstanceConfig(url="http://d2:1")])  # type: ignore[arg-type]
    assert learned is not None and pool.prefill[0].nixl == learned
    assert [d.url for d in pool.decode] == ["http://d2:1"]
