"""vLLM-facing stats classes: ``KVConnectorStats`` and Prometheus metrics for this connector.

Exported series (label ``engine`` etc. as vLLM sets them):

* ``vllm:pdr_bytes_written_total``, ``vllm:pdr_writes_total`` (P)
* ``vllm:pdr_bytes_received_total``, ``vllm:pdr_requests_received_total`` (D; P for kept turns)
* ``vllm:pdr_turns_kept_total``, ``vllm:pdr_kept_expired_total`` (D),
  ``vllm:pdr_tokens_pulled_total``, ``vllm:pdr_kept_missed_total`` (P): kept turns
  (``connector.kept_turns_worker``)
* ``vllm:pdr_notices_repeated_total`` (both): notices sent again to a peer still waiting on them
  (``nudge_interval_s``); steady growth means a transport holding notices back
* ``vllm:pdr_writes_per_request`` (histogram, P), ``vllm:pdr_request_write_seconds`` (histogram,
  first WRITE posted to last completed, P: it spans every prefill chunk after the first),
  ``vllm:pdr_request_write_tail_seconds`` (histogram, P: the prompt's last step ended to the
  last WRITE completed, the transfer D waits for), ``vllm:pdr_handshake_seconds`` (histogram,
  both)
* ``vllm:pdr_failures_total{kind=...}`` (both; kinds in ``stats.FAILURE_KINDS``)
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from connector.stats import FAILURE_KINDS, empty_data, merge_data, reduce_data

__all__ = ["PipelinedPromMetrics", "PipelinedStats"]


class PipelinedStats(KVConnectorStats):  # type: ignore[misc]
    """Plain-dict stats; merged across workers and intervals by vLLM."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=data if data else empty_data())

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge_data(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_data(self.data)

    def is_empty(self) -> bool:
        return bool(self.data == empty_data())


class PipelinedPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Registers the series above once per API-server process; ``observe`` per stats batch."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter(name, doc)
            for key, name, doc in (
                ("bytes_written", "vllm:pdr_bytes_written", "KV bytes written to decode engines"),
                ("num_writes", "vllm:pdr_writes", "NIXL WRITEs posted (one per layer and chunk)"),
                ("bytes_received", "vllm:pdr_bytes_received", "KV bytes received from prefill"),
                ("requests_received", "vllm:pdr_requests_received", "Completed KV receives"),
                ("turns_kept", "vllm:pdr_turns_kept", "Finished turns kept for a next prefill"),
                ("kept_expired", "vllm:pdr_kept_expired", "Kept turns no prefill asked for"),
                (
                    "tokens_pulled",
                    "vllm:pdr_tokens_pulled",
                    "Prompt tokens read from a kept turn instead of computed",
                ),
                (
                    "kept_missed",
                    "vllm:pdr_kept_missed",
                    "Kept turns asked for that D refused or did not answer",
                ),
                (
                    "notices_repeated",
                    "vllm:pdr_notices_repeated",
                    "REG, DONE, ACK or HELLO sent again to a peer still waiting on it",
                ),
            )
        }
        self._hists = {
            key: self._histogram(name, doc, buckets)
            for key, name, doc, buckets in (
                (
                    "writes_per_request",
                    "vllm:pdr_writes_per_request",
                    "WRITEs per pushed request",
                    [1.0, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                ),
                (
                    "write_seconds",
                    "vllm:pdr_request_write_seconds",
                    "First WRITE posted to last WRITE completed, per request",
                    [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5],
                ),
                (
                    "write_tail_seconds",
                    "vllm:pdr_request_write_tail_seconds",
                    "Prompt's last step ended to last WRITE completed, per request: the "
                    "transfer left after P's compute",
                    [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5],
                ),
                (
                    "handshake_seconds",
                    "vllm:pdr_handshake_seconds",
                    "Peer handshake duration",
                    [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5],
                ),
            )
        }
        failures = self._counter_cls(
            name="vllm:pdr_failures",
            documentation="Failed transfers by kind",
            labelnames=[*labelnames, "kind"],
        )
        self._failures = {
            idx: {kind: failures.labels(*values, kind) for kind in FAILURE_KINDS}
            for idx, values in per_engine_labelvalues.items()
        }

    def _counter(self, name: str, doc: str) -> dict[int, Any]:
        metric = self._counter_cls(name=name, documentation=doc, labelnames=self._labelnames)
        return dict(create_metric_per_engine(metric, self.per_engine_labelvalues))

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
        metric = self._histogram_cls(
            name=name, documentation=doc, buckets=buckets, labelnames=self._labelnames
        )
        return dict(create_metric_per_engine(metric, self.per_engine_labelvalues))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)
        for key, per_engine in self._hists.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)
        for kind, count in transfer_stats_data.get("failures", {}).items():
            counter = self._failures.get(engine_idx, {}).get(kind)
            if counter is not None:
                counter.inc(count)
