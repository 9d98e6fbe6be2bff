"""Pod → instance rules (pure functions) and the ``discovery`` config section."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from router.config import ConfigError, KubernetesDiscoveryConfig, parse_config
from router.discovery.pods import decode_configs, endpoint, endpoints, is_serving, prefill_configs

CFG = KubernetesDiscoveryConfig(decode_selector="role=decode", port=8000, slots_default=8)


def pod(name: str = "d-0", ip: str = "10.0.0.5", **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "annotations": {f"pd-router.io/{k}": v for k, v in annotations.items()},
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_defaults_and_annotations() -> None:
    ep = endpoint(pod(), CFG)
    assert ep is not None
    assert (ep.url, ep.kv_host, ep.kv_port, ep.engine_id, ep.slots) == (
        "http://10.0.0.5:8000",
        "10.0.0.5",
        5600,
        "d-0",
        8,
    )
    ep = endpoint(
        pod(**{"engine-id": "e1", "kv-port": "7000", "slots": "3", "port": "9000", "tp-size": "2"}),
        CFG,
    )
    assert ep is not None
    assert (ep.url, ep.kv_port, ep.engine_id, ep.slots, ep.tp_size) == (
        "http://10.0.0.5:9000",
        7000,
        "e1",
        3,
        2,
    )
    [p] = prefill_configs([ep])
    [d] = decode_configs([ep])
    assert (p.engine_id, p.kv_host, p.kv_port, p.tp_size) == ("e1", "10.0.0.5", 7000, 2)
    assert (d.base_url, d.slots, d.tp_size) == ("http://10.0.0.5:9000", 3, 2)


def test_ipv6_pod_ip_is_bracketed() -> None:
    ep = endpoint(pod(ip="fd00::5"), CFG)
    assert ep is not None and ep.url == "http://[fd00::5]:8000" and ep.kv_host == "fd00::5"


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p["status"].update(phase="Pending"),
        lambda p: p["status"].pop("podIP"),
        lambda p: p["status"].update(conditions=[{"type": "Ready", "status": "False"}]),
        lambda p: p["status"].update(conditions=[]),
        lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"),
    ],
)
def test_only_ready_running_pods_with_an_ip_serve(change: Any) -> None:
    p = pod()
    assert is_serving(p)
    change(p)
    assert not is_serving(p) and endpoint(p, CFG) is None


def test_a_data_parallel_pod_declares_its_size() -> None:
    ep = endpoint(pod(**{"data-parallel-size": "4", "kv-port": "7000"}), CFG)
    assert ep is not None and ep.data_parallel_size == 4
    [p] = prefill_configs([ep])
    [d] = decode_configs([ep])
    assert p.data_parallel_size == d.data_parallel_size == 4
    assert d.keys == [f"http://10.0.0.5:8000#dp{r}" for r in range(4)]
    ep = endpoint(pod(), CFG)
    assert ep is not None and ep.data_parallel_size == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"slots": "many"},
        {"kv-port": "0"},
        {"port": "70000"},
        {"data-parallel-size": "0"},
        {"data-parallel-size": "65"},
        {"data-parallel-size": "4", "kv-port": "65533"},  # rank 3's side channel: 65536
    ],
)
def test_mis_annotated_pods_are_skipped(bad: dict[str, str]) -> None:
    assert endpoint(pod(**bad), CFG) is None


def test_endpoints_sorted_and_one_per_url() -> None:
    eps = endpoints([pod("b", "10.0.0.2"), pod("a", "10.0.0.1"), pod("c", "10.0.0.1")], CFG)
    assert [e.name for e in eps] == ["a", "b"]


MODEL = {"name": "tiny", "mode": "push"}
DISC = {"kubernetes": {"prefill_selector": "role=prefill", "decode_selector": "role=decode"}}


def test_discovery_allows_empty_static_lists() -> None:
    cfg = parse_config({"models": [{**MODEL, "discovery": DISC}]})
    model = cfg.models[0]
    assert model.decode == [] and model.discovery is not None
    assert model.discovery.kubernetes.kv_port_default == 5600


def test_discovery_needs_a_prefill_selector_when_the_mode_uses_prefill() -> None:
    disc = copy.deepcopy(DISC)
    del disc["kubernetes"]["prefill_selector"]
    with pytest.raises(ConfigError, match=r"needs discovery\.kubernetes\.prefill_selector"):
        parse_config({"models": [{**MODEL, "discovery": disc}]})
    parse_config({"models": [{**MODEL, "mode": "aggregated", "discovery": disc}]})


def test_without_discovery_decode_is_still_required() -> None:
    with pytest.raises(ConfigError, match=r"models\.0\.decode: List should have at least 1 item"):
        parse_config({"models": [{**MODEL, "mode": "aggregated"}]})
