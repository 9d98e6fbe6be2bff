"""The Prometheus series the request's lifecycle events count (router/lifecycle.py)."""

from __future__ import annotations

from router.errors import DisconnectPhase, KeyResult
from router.lifecycle import Observer
from router.metrics import Metrics
from router.request_end import RequestEnd

__all__ = ["MetricsObserver"]


class MetricsObserver(Observer):
    """Each event to its series of :class:`~router.metrics.Metrics`; label values as the
    announcer passed them (the owners' enums)."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    # -- dispatch (router/pd) ----------------------------------------------------------------

    def decided(self, model: str, decision: str) -> None:
        self._m.decisions.labels(model, decision).inc()

    def adapted(self, model: str, choice: str) -> None:
        self._m.route_choices.labels(model, choice).inc()

    def cache_scored(self, model: str, seconds: float) -> None:
        self._m.cache_tokenize.labels(model).observe(seconds)

    def routed(self, model: str, role: str, placement: str) -> None:
        self._m.session_routes.labels(model, role, placement).inc()

    def cache_routed(self, model: str, role: str, result: str) -> None:
        self._m.cache_routes.labels(model, role, result).inc()

    def cache_predicted(self, model: str, role: str, cached: int, prompt_tokens: int) -> None:
        self._m.cache_predicted.labels(model, role).observe(cached)
        self._m.cache_prompt_tokens.labels(model, role).inc(prompt_tokens)

    def slot_waited(
        self, model: str, api_key_name: str, priority_class: str, seconds: float
    ) -> None:
        self._m.key_queue_wait.labels(api_key_name).observe(seconds)
        self._m.class_queue_wait.labels(model, priority_class).observe(seconds)

    def refused(self, model: str, priority_class: str, code: str, deadline_missed: bool) -> None:
        self._m.class_refusals.labels(model, priority_class, code).inc()
        if deadline_missed:
            self._m.deadline_misses.labels(model, priority_class).inc()

    def attempt_failed(self, model: str, role: str, code: str) -> None:
        self._m.upstream_errors.labels(model, role, code).inc()

    def retried(self, model: str, attempt: int) -> None:
        self._m.retries.labels(model).inc()

    def prefill_done(self, model: str, mode: str, seconds: float) -> None:
        self._m.prefill_duration.labels(model, mode).observe(seconds)

    def handed_off(self, model: str, mode: str, seconds: float) -> None:
        self._m.handoff.labels(model, mode).observe(seconds)

    def push_fallback(self, model: str) -> None:
        self._m.push_fallbacks.labels(model).inc()

    def kv_params_missing(self, model: str, url: str, rank: str) -> None:
        self._m.kv_params_missing.labels(model, url, rank).inc()

    def kept_turn(self, model: str, result: str, entries: int) -> None:
        self._m.kept_turns.labels(model, result).inc()
        self._m.kept_turns_entries.labels(model).set(entries)

    def migrated(self, model: str, mode: str, cause: str) -> None:
        self._m.migrations.labels(model, mode, cause).inc()

    # -- relay and intake --------------------------------------------------------------------

    def disconnected(self, model: str, phase: DisconnectPhase) -> None:
        self._m.disconnects.labels(model, phase).inc()

    def stream_read(self, model: str, decision: str, chunks: int, worst_gap: float) -> None:
        self._m.chunks.labels(model).inc(chunks)
        if chunks > 1:
            self._m.max_chunk_gap.labels(model, decision).observe(worst_gap)

    def auth_failed(self, reason: str) -> None:
        self._m.auth_failures.labels(reason).inc()

    def bound_exceeded(self, model: str, bound: str) -> None:
        self._m.bounds_refused.labels(model, bound).inc()

    def adapter_requested(self, model: str, adapter: str, most_labels: int) -> None:
        label = self._m.adapter_labels.label(model, adapter, most_labels)
        self._m.lora_requests.labels(model, label).inc()

    def key_result(self, key: str, result: KeyResult) -> None:
        self._m.key_requests.labels(key, result).inc()
        if result is KeyResult.ADMITTED:
            self._m.key_in_flight.labels(key).inc()

    def key_released(self, key: str) -> None:
        self._m.key_in_flight.labels(key).dec()

    def intake_refused(self, end: RequestEnd) -> None:
        self._m.observe_request(end.model, end.mode, end.outcome)

    def request_ended(self, end: RequestEnd) -> None:
        self._m.observe_request(end.model, end.mode, end.outcome, end.ttft)
