"""The relay's and the intake's events as Prometheus counts (router/metrics.py's families)."""

from __future__ import annotations

from router.errors import DisconnectPhase, KeyResult
from router.lifecycle import Observer
from router.metrics import Metrics
from router.request_end import RequestEnd

__all__ = ["RequestMetrics"]


class RequestMetrics(Observer):
    """Requests by outcome and their TTFT, disconnects, streams' chunks, keys' results,
    refusals at the intake (authentication, bounds), LoRA adapters' requests."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def disconnected(self, model: str, phase: DisconnectPhase) -> None:
        self._metrics.disconnects.labels(model, phase).inc()

    def stream_read(self, model: str, decision: str, chunks: int, worst_gap: float) -> None:
        self._metrics.chunks.labels(model).inc(chunks)
        if chunks > 1:
            self._metrics.max_chunk_gap.labels(model, decision).observe(worst_gap)

    def auth_failed(self, reason: str) -> None:
        self._metrics.auth_failures.labels(reason).inc()

    def bound_exceeded(self, model: str, bound: str) -> None:
        self._metrics.bounds_refused.labels(model, bound).inc()

    def adapter_requested(self, model: str, adapter: str, most_labels: int) -> None:
        label = self._metrics.adapter_labels.label(model, adapter, most_labels)
        self._metrics.lora_requests.labels(model, label).inc()

    def key_result(self, key: str, result: KeyResult) -> None:
        self._metrics.key_requests.labels(key, result).inc()
        if result is KeyResult.ADMITTED:
            self._metrics.key_in_flight.labels(key).inc()

    def key_released(self, key: str) -> None:
        self._metrics.key_in_flight.labels(key).dec()

    def refused(self, end: RequestEnd) -> None:
        self._metrics.observe_request(end.model, end.mode, end.outcome)

    def request_ended(self, end: RequestEnd) -> None:
        self._metrics.observe_request(end.model, end.mode, end.outcome, end.ttft)
