"""The alert rules under Prometheus's own rule engine (``promtool test rules``): each alert
fires in a scenario built for it, with the labels and annotations an operator gets, and none
fires in a healthy run. Every alert of alerts.yaml must have a scenario here."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.observability.promtool import ALERTS, alert_rules, binary

R = 'model="m", mode="push"'
GAP = "pdrouter_stream_max_chunk_gap_seconds_bucket"
G = 'model="m", decision="push"'
D = 'model="m", role="decode", engine="http://d1:8000"'
P = 'model="m", role="prefill", engine="http://p1:8000"'
D2 = 'model="m", role="decode", engine="http://d2:8000"'
P2 = 'model="m", role="prefill", engine="http://p2:8000"'


@dataclass
class Scenario:
    """Series sampled every 15 s; the alert fires at ``at`` with ``labels`` (besides the
    rule's own labels), and is not yet firing one evaluation before its ``for`` runs out."""

    series: dict[str, str]
    at: str
    labels: list[dict[str, str]]
    quiet_at: str | None = None


def _healthy_router(minutes: int = 20) -> dict[str, str]:
    n = minutes * 4
    return {
        'up{job="pd-router", instance="r1:8000"}': f"1x{n}",
        f"pdrouter_engine_healthy{{{D}}}": f"1x{n}",
        f"pdrouter_engine_healthy{{{P}}}": f"1x{n}",
        f"pdrouter_breaker_state{{{D}}}": f"0x{n}",
        f"pdrouter_breaker_state{{{P}}}": f"0x{n}",
        'pdrouter_engine_degraded{model="m", engine="http://d1:8000"}': f"0x{n}",
        'pdrouter_queue_depth{model="m"}': f"0x{n}",
        f'pdrouter_requests_total{{{R}, outcome="success"}}': f"0+30x{n}",
        f'pdrouter_requests_total{{{R}, outcome="client_error"}}': f"0+1x{n}",
        f'pdrouter_ttft_seconds_bucket{{{R}, le="0.5"}}': f"0+30x{n}",
        f'pdrouter_ttft_seconds_bucket{{{R}, le="+Inf"}}': f"0+30x{n}",
        'pdrouter_stream_max_chunk_gap_seconds_bucket{model="m", decision="push", le="0.1"}': (
            f"0+30x{n}"
        ),
        'pdrouter_stream_max_chunk_gap_seconds_bucket{model="m", decision="push", le="+Inf"}': (
            f"0+30x{n}"
        ),
        'pdrouter_decode_slots{model="m", engine="http://d1:8000"}': f"64x{n}",
        'pdrouter_decode_slots_in_use{model="m", engine="http://d1:8000"}': f"20x{n}",
        'pdrouter_retries_total{model="m"}': f"0+0x{n}",
        'pdrouter_kv_params_missing_total{model="m", engine="http://p1:8000"}': f"0+0x{n}",
        'pdrouter_push_sequential_dispatches_total{model="m"}': f"0+0x{n}",
        'vllm:nixl_num_failed_transfers_total{job="vllm", instance="p1:8000"}': f"0+0x{n}",
        'vllm:kv_cache_usage_perc{job="vllm", instance="d1:8000"}': f"0.4x{n}",
    }


def _with(**changes: str) -> dict[str, str]:
    """The healthy series with some replaced (keys are the series' metric names plus labels,
    given as ``name=labels`` pairs below)."""
    series = _healthy_router()
    series.update(changes)
    return series


SCENARIOS: dict[str, Scenario] = {
    "PdRouterDown": Scenario(
        _with(**{'up{job="pd-router", instance="r1:8000"}': "1 1 0x20"}),
        at="2m",
        quiet_at="1m15s",
        labels=[{"job": "pd-router", "instance": "r1:8000"}],
    ),
    "PdRouterNoRoutableEngine": Scenario(
        # D fails its health checks; then it passes them but stays ejected.
        _with(
            **{
                f"pdrouter_engine_healthy{{{D}}}": "0x8 1x20",
                f"pdrouter_breaker_state{{{D}}}": "1x30",
            }
        ),
        at="4m",
        quiet_at="15s",
        labels=[{"model": "m", "role": "decode"}],
    ),
    "PdRouterEngineUnhealthy": Scenario(
        # One of two decode engines: the other one still serves.
        _with(
            **{
                f"pdrouter_engine_healthy{{{D}}}": "0x20",
                f"pdrouter_engine_healthy{{{D2}}}": "1x20",
                f"pdrouter_breaker_state{{{D2}}}": "0x20",
            }
        ),
        at="3m",
        quiet_at="1m45s",
        labels=[{"model": "m", "role": "decode", "engine": "http://d1:8000"}],
    ),
    "PdRouterEngineEjected": Scenario(
        # Ejected, probed (half-open), ejected again: never back in for good.
        # One of two prefill engines: the other one still serves.
        _with(
            **{
                f"pdrouter_breaker_state{{{P}}}": " ".join(["1 1 2"] * 12),
                f"pdrouter_engine_healthy{{{P2}}}": "1x40",
                f"pdrouter_breaker_state{{{P2}}}": "0x40",
            }
        ),
        at="6m",
        quiet_at="4m30s",
        labels=[{"model": "m", "role": "prefill", "engine": "http://p1:8000"}],
    ),
    "PdRouterDecodeDegraded": Scenario(
        _with(**{'pdrouter_engine_degraded{model="m", engine="http://d1:8000"}': "1x60"}),
        at="11m",
        quiet_at="9m",
        labels=[{"model": "m", "engine": "http://d1:8000"}],
    ),
    "PdRouterQueueStuck": Scenario(
        _with(
            **{
                'pdrouter_queue_depth{model="m"}': "0 0 5x40",
                f'pdrouter_requests_total{{{R}, outcome="success"}}': "0 30 60x40",
            }
        ),
        at="6m",
        quiet_at="3m",
        labels=[{"model": "m"}],
    ),
    "PdRouterHighErrorRate": Scenario(
        _with(**{f'pdrouter_requests_total{{{R}, outcome="upstream_error"}}': "0+3x60"}),
        at="10m",
        quiet_at="4m",
        labels=[{"model": "m"}],
    ),
    "PdRouterSlowTTFT": Scenario(
        _with(
            **{
                f'pdrouter_ttft_seconds_bucket{{{R}, le="0.5"}}': "0+0x80",
                f'pdrouter_ttft_seconds_bucket{{{R}, le="10"}}': "0+30x80",
                f'pdrouter_ttft_seconds_bucket{{{R}, le="+Inf"}}': "0+30x80",
            }
        ),
        at="15m",
        quiet_at="9m",
        labels=[{"model": "m"}],
    ),
    "PdRouterSlowStreams": Scenario(
        _with(
            **{
                f'{GAP}{{{G}, le="0.1"}}': "0+0x80",
                f'{GAP}{{{G}, le="2.5"}}': "0+30x80",
                f'{GAP}{{{G}, le="+Inf"}}': "0+30x80",
            }
        ),
        at="15m",
        quiet_at="9m",
        labels=[{"model": "m"}],
    ),
    "PdRouterDecodeSlotsExhausted": Scenario(
        _with(**{'pdrouter_decode_slots_in_use{model="m", engine="http://d1:8000"}': "62x60"}),
        at="11m",
        quiet_at="9m",
        labels=[{"model": "m"}],
    ),
    "PdRouterRetriesHigh": Scenario(
        _with(**{'pdrouter_retries_total{model="m"}': "0+10x80"}),
        at="15m",
        quiet_at="9m",
        labels=[{"model": "m"}],
    ),
    "PdRouterKVParamsMissing": Scenario(
        _with(**{'pdrouter_kv_params_missing_total{model="m", engine="http://p1:8000"}': "0+2x60"}),
        at="7m",
        quiet_at="4m",
        labels=[{"model": "m", "engine": "http://p1:8000"}],
    ),
    "PdRouterPushWithoutPrefillIdentity": Scenario(
        _with(**{'pdrouter_push_sequential_dispatches_total{model="m"}': "0+5x80"}),
        at="17m",
        quiet_at="14m",
        labels=[{"model": "m"}],
    ),
    "VllmKVTransferFailures": Scenario(
        _with(
            **{'vllm:pdr_failures_total{job="vllm", instance="p1:8000", kind="write"}': "0+1x60"}
        ),
        at="7m",
        quiet_at="4m",
        labels=[{"job": "vllm", "instance": "p1:8000"}],
    ),
    "VllmKVCacheFull": Scenario(
        _with(**{'vllm:kv_cache_usage_perc{job="vllm", instance="d1:8000"}': "0.97x60"}),
        at="11m",
        quiet_at="9m",
        labels=[{"job": "vllm", "instance": "d1:8000"}],
    ),
}

_LABEL_REF = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def _render(template: str, labels: dict[str, str]) -> str:
    """The annotation as Prometheus renders it: only ``{{ $labels.x }}`` is used here."""
    assert "{{" not in _LABEL_REF.sub("", template), f"untested template in {template!r}"
    return _LABEL_REF.sub(lambda m: labels.get(m.group(1), ""), template)


def _expected(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    all_labels = {**labels, **rule.get("labels", {})}
    return {
        "exp_labels": all_labels,
        "exp_annotations": {
            k: _render(v, all_labels) for k, v in rule.get("annotations", {}).items()
        },
    }


def _unit_tests() -> dict[str, Any]:
    rules = alert_rules()
    tests = []
    for name, sc in SCENARIOS.items():
        checks = [
            {
                "eval_time": sc.at,
                "alertname": name,
                "exp_alerts": [_expected(rules[name], labels) for labels in sc.labels],
            },
        ]
        if sc.quiet_at is not None:
            checks.append({"eval_time": sc.quiet_at, "alertname": name, "exp_alerts": []})
        # The scenario of one alert raises no other alert.
        checks += [
            {"eval_time": sc.at, "alertname": other, "exp_alerts": []}
            for other in rules
            if other != name and other not in _ALSO_FIRES.get(name, ())
        ]
        tests.append(_test(sc.series, checks))
    healthy = [{"eval_time": "19m", "alertname": name, "exp_alerts": []} for name in rules]
    tests.append(_test(_healthy_router(), healthy))
    return {"rule_files": [str(ALERTS)], "evaluation_interval": "15s", "tests": tests}


# Alerts that rightly fire together with the one a scenario is built for.
_ALSO_FIRES: dict[str, tuple[str, ...]] = {
    "PdRouterNoRoutableEngine": ("PdRouterEngineUnhealthy", "PdRouterEngineEjected"),
    "PdRouterQueueStuck": (),
}


def _test(series: dict[str, str], checks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "interval": "15s",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": checks,
    }


def test_rules_pass_promtool_check() -> None:
    out = subprocess.run(
        [binary("promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_scenario() -> None:
    assert set(alert_rules()) == set(SCENARIOS)


def test_each_alert_fires_in_its_scenario_and_none_in_a_healthy_run(tmp_path: Path) -> None:
    spec = tmp_path / "alerts_test.yaml"
    spec.write_text(yaml.safe_dump(_unit_tests(), sort_keys=False))
    out = subprocess.run(
        [binary("promtool"), "test", "rules", str(spec)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


@pytest.mark.parametrize("name", ["PdRouterDown", "PdRouterQueueStuck"])
def test_a_wrong_expectation_fails(tmp_path: Path, name: str) -> None:
    """Positive control: promtool rejects a scenario whose alert is expected to stay quiet."""
    doc = _unit_tests()
    index = list(SCENARIOS).index(name)
    doc["tests"][index]["alert_rule_test"][0]["exp_alerts"] = []
    spec = tmp_path / "wrong.yaml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = subprocess.run(
        [binary("promtool"), "test", "rules", str(spec)], capture_output=True, text=True
    )
    assert out.returncode != 0
    assert f"alertname: {name}," in out.stderr
