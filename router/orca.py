"""ORCA load reports, as ``vllm serve`` 0.32 sends them: a non-streamed chat completion or
completion whose request carries ``endpoint-load-metrics-format: TEXT`` (or ``JSON``) is
answered with an ``endpoint-load-metrics`` header. vLLM fills it from its own Prometheus
gauges when it answers; the router fills it from D's (the engine that made the answer),
read from D's ``/metrics`` once D has answered::

    endpoint-load-metrics: TEXT named_metrics.num_requests_waiting=0.0,
        named_metrics.kv_cache_usage_perc=0.25           (one line)
    endpoint-load-metrics: JSON {"named_metrics": {"num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.25}}                     (one line)

Another format, or a ``/metrics`` read that fails, is no header (vLLM: another format is
none either). A load balancer in front of several routers reads it as it reads vLLM's."""

from __future__ import annotations

import json
from collections.abc import Iterable

from router.engines.health import parse_engine_load
from router.engines.instance import Instance
from router.pd.side_calls import SideCalls

__all__ = ["FORMAT_HEADER", "LoadReports", "report_header", "requested_format"]

FORMAT_HEADER = b"endpoint-load-metrics-format"
REPORT_HEADER = b"endpoint-load-metrics"
_FORMATS = ("text", "json")


def requested_format(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The format the request asks its load report in (``text``, ``json``); None if none
    or one vLLM does not write."""
    for name, value in headers:
        if name == FORMAT_HEADER:
            fmt = value.decode("latin-1").strip().lower()
            return fmt if fmt in _FORMATS else None
    return None


def report_header(fmt: str, waiting: float, kv_usage: float) -> tuple[bytes, bytes]:
    """vLLM's ``endpoint-load-metrics`` header in ``fmt`` (its gauges' order: waiting
    requests, then KV cache usage)."""
    named = {"num_requests_waiting": float(waiting), "kv_cache_usage_perc": float(kv_usage)}
    if fmt == "text":
        value = "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())
    else:
        value = "JSON " + json.dumps({"named_metrics": named})
    return REPORT_HEADER, value.encode("latin-1")


class LoadReports:
    """An engine's load report, read from its ``/metrics`` when asked (a side call: its
    failure costs the header, never the answer)."""

    def __init__(self, side_calls: SideCalls) -> None:
        self._side_calls = side_calls

    async def header(self, inst: Instance, fmt: str) -> list[tuple[bytes, bytes]]:
        """``inst``'s report as the response header, or nothing if it cannot be read."""
        text = await self._side_calls.metrics_text(inst)
        load = parse_engine_load(text) if text is not None else None
        if load is None:
            return []
        return [report_header(fmt, load.waiting, load.kv_usage)]
