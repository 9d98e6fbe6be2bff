"""The config's numeric bounds and cross-field rules: each bad value refused with a message
naming the field and the rule, and the value at the boundary accepted."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from router.config import ConfigError, parse_config

BASE: dict[str, Any] = {
    "models": [
        {
            "name": "tiny",
            "mode": "pull",
            "prefill": [{"url": "http://127.0.0.1:8100"}],
            "decode": [{"url": "http://127.0.0.1:8200"}],
        }
    ]
}
INF = float("inf")
NAN = float("nan")


def _with(**values: Any) -> dict[str, Any]:
    """``BASE`` with each dotted path (``__`` for ``.``, ``models__0__decode__0__slots``) set."""
    data = copy.deepcopy(BASE)
    for dotted, value in values.items():
        *parents, last = dotted.split("__")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[last] = value
    return data


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


GT0 = "Input should be greater than 0"
FINITE = "Input should be a finite number"


def _ge(n: float) -> str:
    return f"Input should be greater than or equal to {n}"


def _le(n: float) -> str:
    return f"Input should be less than or equal to {n}"


SECONDS = [
    "timeouts__connect",
    "timeouts__prefill",
    "timeouts__decode_first_byte",
    "timeouts__idle",
    "timeouts__total",
    "admission__max_wait",
    "breaker__open_seconds",
    "health__interval",
    "health__timeout",
    "health__load_interval",
    "connections__header_timeout",
    "connections__body_timeout",
    "connections__write_timeout",
    "models__0__sessions__ttl_seconds",
    "models__0__kept_turns__ttl_seconds",
]

# (field, a bad value, the message, the boundary value that is accepted)
BOUNDS: list[tuple[str, Any, str, Any]] = [
    *((f, 0, GT0, 0.001) for f in SECONDS),
    *((f, INF, FINITE, 1e9) for f in SECONDS),
    ("timeouts__total", NAN, FINITE, 1800),
    ("listen__port", 65536, _le(65535), 65535),
    ("listen__port", -1, _ge(0), 0),
    ("models__0__decode__0__slots", 0, _ge(1), 1),
    ("models__0__decode__0__kv_port", 0, _ge(1), 1),
    ("models__0__prefill__0__kv_port", 65536, _le(65535), 65535),
    ("models__0__prefill__0__tp_size", 0, _ge(1), 1),
    ("models__0__prefill__0__pp_size", 0, _ge(1), 1),
    ("models__0__sessions__load_factor", 0.99, _ge(1), 1.0),
    ("models__0__sessions__load_factor", INF, FINITE, 100.0),
    ("models__0__sessions__max_sessions", 0, _ge(1), 1),
    ("models__0__sessions__spill_at", 0, GT0, 0.01),
    ("models__0__sessions__spill_at", 1.01, _le(1), 1.0),
    ("models__0__sessions__spill_at", NAN, FINITE, 0.5),
    ("models__0__sessions__prefill_capacity", 0, _ge(1), 1),
    ("models__0__kept_turns__min_tokens", 0, _ge(1), 1),
    ("models__0__kept_turns__max_entries", 0, _ge(1), 1),
    ("models__0__disagg_min_prompt_tokens", -1, _ge(0), 0),
    ("models__0__disagg_max_prefill_queue", -1, _ge(0), 0),
    ("models__0__max_model_len", 0, _ge(1), 1),
    ("admission__queue_size", -1, _ge(0), 0),
    ("admission__max_body_bytes", 1023, _ge(1024), 1024),
    ("admission__replicas", 0, _ge(1), 1),
    ("retries__max_attempts", 0, _ge(1), 1),
    ("retries__backoff_initial", -0.01, _ge(0), 0),
    ("retries__backoff_max", -0.01, _ge(0), 0.05),
    ("retries__backoff_max", INF, FINITE, 1e6),
    ("breaker__failure_threshold", 0, _ge(1), 1),
    ("breaker__consecutive_5xx", 0, _ge(1), 1),
    ("health__unhealthy_after", 0, _ge(1), 1),
    ("health__leak_usage_epsilon", -0.01, _ge(0), 0),
    ("health__leak_usage_epsilon", 1, "Input should be less than 1", 0.999),
    ("limits__max_tokens", 0, _ge(1), 1),
    ("limits__max_n", 0, _ge(1), 1),
    ("limits__max_n", 16385, _le(16384), 16384),
    ("limits__max_prompts", 0, _ge(1), 1),
    ("limits__per_key__max_concurrent", 0, _ge(1), 1),
    ("limits__per_key__requests_per_second", 0, GT0, 0.001),
    ("limits__per_key__requests_per_second", 1_000_001, _le(1_000_000), 1_000_000),
    ("connections__max_open", 0, _ge(1), 1),
    ("connections__send_buffer_bytes", -1, _ge(0), 0),
    ("connections__send_buffer_bytes", 64 * 2**20 + 1, _le(64 * 2**20), 64 * 2**20),
    ("connections__max_header_bytes", 1023, _ge(1024), 1024),
    ("connections__max_headers", 7, _ge(8), 8),
    ("tracing__sample_ratio", -0.01, _ge(0), 0.0),
    ("tracing__sample_ratio", 1.01, _le(1), 1.0),
    ("models__0__adaptive__tpot_ms", 0, GT0, 0.001),
    ("models__0__adaptive__tpot_ms", NAN, FINITE, 40),
    ("models__0__adaptive__ttft_ms", 0, GT0, 40),
    ("models__0__adaptive__ttft_ms", 3_600_001, _le(3_600_000), 3_600_000),
    ("models__0__adaptive__stall_tokens", 0, _ge(1), 1),
]


@pytest.mark.parametrize(
    ("field", "bad", "message", "boundary"),
    BOUNDS,
    ids=[f"{f.replace('__', '.')}={bad}" for f, bad, _, _ in BOUNDS],
)
def test_a_value_out_of_bounds_is_refused_and_the_boundary_accepted(
    field: str, bad: Any, message: str, boundary: Any
) -> None:
    path = field.replace("__", ".")
    assert _problems(_with(**{field: bad})) == [f"  {path}: {message}"]
    cfg = parse_config(_with(**{field: boundary}))
    node: Any = cfg
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    assert node == boundary


# (the values breaking a rule, the one problem reported, the values at its boundary)
RULES: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    "backoff_max below backoff_initial": (
        {"retries__backoff_initial": 0.5, "retries__backoff_max": 0.1},
        "retries.backoff_max: must be at least backoff_initial (0.5), got 0.1",
        {"retries__backoff_initial": 0.5, "retries__backoff_max": 0.5},
    ),
    "a burst without a rate": (
        {"limits__per_key__burst": 4},
        "limits.per_key.burst: needs requests_per_second (it sizes that rate's bucket)",
        {"limits__per_key__burst": 4, "limits__per_key__requests_per_second": 0.5},
    ),
    "a key's burst without a rate": (
        {"auth__keys": [{"name": "a", "key": "k", "limits": {"burst": 4}}]},
        "auth.keys.0.limits.burst: needs requests_per_second (it sizes that rate's bucket)",
        {
            "auth__keys": [
                {"name": "a", "key": "k", "limits": {"burst": 4, "requests_per_second": 2}}
            ]
        },
    ),
    "limits.max_tokens over a model's context": (
        {"models__0__max_model_len": 4096, "limits__max_tokens": 4097},
        "limits: max_tokens (4097) must be at most models.0.max_model_len (4096): a request "
        "that names no output limit is given max_tokens, and would be refused",
        {"models__0__max_model_len": 4096, "limits__max_tokens": 4096},
    ),
    "disagg_min_prompt_tokens at the context": (
        {"models__0__max_model_len": 4096, "models__0__disagg_min_prompt_tokens": 4096},
        "models.0: disagg_min_prompt_tokens (4096) must be below max_model_len (4096): no "
        "prompt that long fits the context, so none would be disaggregated",
        {"models__0__max_model_len": 4096, "models__0__disagg_min_prompt_tokens": 4095},
    ),
    "adaptive.ttft_ms below tpot_ms": (
        {"models__0__adaptive__ttft_ms": 39.5, "models__0__adaptive__tpot_ms": 40},
        "models.0.adaptive: ttft_ms (39.5) must be at least tpot_ms (40): the first token "
        "takes at least one decode step",
        {"models__0__adaptive__ttft_ms": 40, "models__0__adaptive__tpot_ms": 40},
    ),
    "adaptive in aggregated mode": (
        {"models__0__mode": "aggregated", "models__0__adaptive__enabled": True},
        "models.0: adaptive needs a disaggregated mode: in 'aggregated' every request is "
        "served by D alone already",
        {"models__0__mode": "aggregated", "models__0__adaptive__enabled": False},
    ),
    "adaptive with kept turns": (
        {"models__0__adaptive__enabled": True, "models__0__kept_turns__enabled": True},
        "models.0: adaptive and kept_turns cannot both be on: a turn served by one engine "
        "keeps nothing on D for the next turn's P to read",
        {"models__0__adaptive__enabled": True, "models__0__kept_turns__enabled": False},
    ),
    "kept_turns.min_tokens at the context": (
        {
            "models__0__max_model_len": 256,
            "models__0__kept_turns__enabled": True,
            "models__0__kept_turns__min_tokens": 256,
        },
        "models.0: kept_turns.min_tokens (256) must be below max_model_len (256): no turn that "
        "long fits the context, so none would be reused",
        {
            "models__0__max_model_len": 256,
            "models__0__kept_turns__enabled": True,
            "models__0__kept_turns__min_tokens": 255,
        },
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_a_cross_field_rule_names_both_fields(rule: str) -> None:
    broken, message, boundary = RULES[rule]
    assert _problems(_with(**broken)) == [f"  {message}"]
    parse_config(_with(**boundary))


def test_kept_turns_min_tokens_is_free_while_kept_turns_is_off() -> None:
    """The rule is about reuse: a model without it may keep the default above its context."""
    cfg = parse_config(_with(models__0__max_model_len=32))
    assert cfg.models[0].kept_turns.min_tokens == 64 and not cfg.models[0].kept_turns.enabled


def test_every_problem_is_reported_at_once() -> None:
    data = _with(
        timeouts__total=0,
        retries__backoff_initial=2,
        retries__backoff_max=1,
        models__0__decode__0__slots=0,
    )
    assert sorted(_problems(data)) == [
        "  models.0.decode.0.slots: Input should be greater than or equal to 1",
        "  retries.backoff_max: must be at least backoff_initial (2), got 1",
        "  timeouts.total: Input should be greater than 0",
    ]


def test_the_old_kv_return_key_is_read_as_kept_turns_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Renamed in this release (CHANGELOG.md): a file written for the last one still loads,
    and says what to rename."""
    old = {"enabled": True, "ttl_seconds": 30, "min_tokens": 8, "max_entries": 5}
    with caplog.at_level("WARNING", logger="pd_router.config"):
        cfg = parse_config(_with(models__0__kv_return=old))
    kept = cfg.models[0].kept_turns
    assert (kept.enabled, kept.ttl_seconds, kept.min_tokens, kept.max_entries) == (
        True,
        30,
        8,
        5,
    )
    [record] = [r for r in caplog.records if r.name == "pd_router.config"]
    assert record.levelname == "WARNING"
    assert "old=kv_return new=kept_turns" in record.getMessage()
    assert "model=tiny" in record.getMessage()


def test_the_new_key_loads_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="pd_router.config"):
        cfg = parse_config(_with(models__0__kept_turns={"enabled": True}))
    assert cfg.models[0].kept_turns.enabled
    assert not [r for r in caplog.records if r.name == "pd_router.config"]


def test_an_old_key_is_checked_under_its_new_name() -> None:
    assert _problems(_with(models__0__kv_return={"ttl_seconds": 0})) == [
        f"  models.0.kept_turns.ttl_seconds: {GT0}"
    ]


def test_the_old_and_the_new_key_together_are_refused() -> None:
    problems = _problems(
        _with(models__0__kv_return={"enabled": True}, models__0__kept_turns={"enabled": False})
    )
    assert len(problems) == 1
    assert "kv_return is the old name of kept_turns: give only kept_turns" in problems[0]
