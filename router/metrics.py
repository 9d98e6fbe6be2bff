"""Prometheus metrics: one registry per app, no prometheus calls elsewhere.

Counters and histograms are updated on the request path; instance state
(slots, queue depth, breaker, health) is read from its single owner at scrape
time by :class:`StateCollector`, so the hot path pays nothing for it.

With ``--workers N`` (``Metrics(multiprocess=True)``), every worker writes its
counters and histograms to prometheus_client's multiprocess files (the
supervisor sets ``PROMETHEUS_MULTIPROC_DIR``) and a scrape of any worker reads
all of them with ``MultiProcessCollector``. Decode slots in use come from the
shared slot table (router-wide). The state each worker keeps for itself (queue,
prefill legs, breakers, health: health checks and breakers are per worker) is
copied into multiprocess gauges every :data:`WORKER_STATE_INTERVAL` seconds and
on each scrape: queue depth and prefill legs are summed over live workers, the
breaker and degraded flags take the worst (max) and health the worst (min) view.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from router.config import split_engine_key
from router.demand import demands, desired_or_nan
from router.engines.adapters import AdapterLabels
from router.engines.affinity import Placement
from router.engines.instance import Instance, Role
from router.engines.kept_turns import KeptTurnResult
from router.errors import DisconnectPhase, KeyResult, MigrationCause, Outcome, RouteChoice
from router.kvindex.route import Result

if TYPE_CHECKING:
    from router.kvindex.stream import Stream
    from router.registry import ModelPool

__all__ = ["KEY_RESULTS", "MIGRATION_CAUSES", "ROUTE_CHOICES", "WORKER_STATE_INTERVAL", "Metrics"]

# What became of a key's requests: pdrouter_key_requests_total{result}.
KEY_RESULTS = tuple(r.value for r in KeyResult)
# The adaptive rule's choices: pdrouter_route_choice_total{choice}.
ROUTE_CHOICES = tuple(c.value for c in RouteChoice)
# Why a stream was cut and continued elsewhere: pdrouter_migrations_total{cause}.
MIGRATION_CAUSES = tuple(c.value for c in MigrationCause)

# Seconds between copies of a worker's own state into the multiprocess gauges.
WORKER_STATE_INTERVAL = 1.0

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    30.0,
    60.0,
)
_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)


class _CachedLabels:
    """``labels()`` served from a cache of the children by their label values.

    prometheus_client's own ``labels()`` converts every value with ``str()`` and takes a
    lock on every call; the request path makes about ten such calls per request. The
    children are the ones prometheus_client made (the cache only remembers them); label
    values are the router's strings and string enums, whose hash and equality are those of
    their text.
    """

    _children: dict[tuple[object, ...], Any]

    def labels(self, *values: Any, **by_name: Any) -> Any:
        if not by_name:
            try:
                return self._children[values]
            except AttributeError:
                self._children = {}
            except KeyError:
                pass
        child = super().labels(*values, **by_name)  # type: ignore[misc]
        if not by_name:
            self._children[values] = child
        return child


class _Counter(_CachedLabels, Counter):
    pass


class _Gauge(_CachedLabels, Gauge):
    pass


class _Histogram(_CachedLabels, Histogram):
    pass


_ENGINES_HELP = "Engines of a role in rotation now, as this router sees them"
_DESIRED_HELP = (
    "Engines of a role the load this router sends needs at the model's autoscaling targets "
    "(router/demand.py; NaN until measured): sum over router replicas and scale on it"
)


def _demand_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    return (
        GaugeMetricFamily("pdrouter_autoscale_engines", _ENGINES_HELP, labels=["model", "role"]),
        GaugeMetricFamily(
            "pdrouter_autoscale_desired_engines", _DESIRED_HELP, labels=["model", "role"]
        ),
    )


def _facts(inst: Instance) -> tuple[str, str]:
    """``pdrouter_engine_info``'s own labels: vLLM version and block size ('' unknown)."""
    facts = inst.facts
    return facts.version or "", "" if facts.block_size is None else str(facts.block_size)


class StateCollector(Collector):
    """Reads slots, queues, breakers and health from the model pools at scrape time."""

    def __init__(
        self,
        pools: Callable[[], Iterable[ModelPool]],
        per_worker: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``per_worker=False``: only the slot families (the rest comes from gauges).
        ``clock``: the dispatcher's, which the demand's rates are counted on."""
        self._pools = pools
        self._per_worker = per_worker
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        if not self._per_worker:
            yield from self._slots()
            return
        slots = GaugeMetricFamily(
            "pdrouter_decode_slots", "Decode slots offered", labels=["model", "engine", "rank"]
        )
        in_use = GaugeMetricFamily(
            "pdrouter_decode_slots_in_use",
            "Decode slots reserved",
            labels=["model", "engine", "rank"],
        )
        queue = GaugeMetricFamily(
            "pdrouter_queue_depth", "Requests waiting for a decode slot", labels=["model"]
        )
        inflight = GaugeMetricFamily(
            "pdrouter_prefill_in_flight",
            "Prefill legs in flight, and requests P serves alone (adaptive)",
            labels=["model", "engine", "rank"],
        )
        breaker = GaugeMetricFamily(
            "pdrouter_breaker_state",
            "Circuit breaker state (0 closed, 1 open, 2 half-open)",
            labels=["model", "role", "engine", "rank"],
        )
        healthy = GaugeMetricFamily(
            "pdrouter_engine_healthy",
            "Active health check result (1 healthy, 0 unhealthy, -1 unknown)",
            labels=["model", "role", "engine", "rank"],
        )
        degraded = GaugeMetricFamily(
            "pdrouter_engine_degraded",
            "1 while a decode engine holds leaked KV blocks and is out of rotation",
            labels=["model", "engine", "rank"],
        )
        sessions = GaugeMetricFamily(
            "pdrouter_sessions", "Sessions in the affinity table", labels=["model"]
        )
        info = GaugeMetricFamily(
            "pdrouter_engine_info",
            "What an engine runs, as read from it ('' until read); always 1",
            labels=["model", "role", "engine", "rank", "vllm_version", "block_size"],
        )
        unpaired = GaugeMetricFamily(
            "pdrouter_engine_unpaired",
            "1 while no engine of the other role can pair with this one (out of rotation)",
            labels=["model", "role", "engine", "rank"],
        )
        engines, desired = _demand_families()
        now = self._clock()
        for pool in self._pools():
            for demand in demands(pool, now):
                engines.add_metric([pool.name, demand.role.value], demand.engines)
                desired.add_metric([pool.name, demand.role.value], desired_or_nan(demand))
            queue.add_metric([pool.name], pool.ledger.queue_depth)
            sessions.add_metric([pool.name], len(pool.affinity))
            for d in pool.decode:
                slots.add_metric([pool.name, d.url, d.rank_label], d.slots)
                in_use.add_metric([pool.name, d.url, d.rank_label], d.in_use)
                degraded.add_metric([pool.name, d.url, d.rank_label], 1 if d.degraded else 0)
            for p in pool.prefill:
                inflight.add_metric([pool.name, p.url, p.rank_label], p.load)
            for inst in (*pool.prefill, *pool.decode):
                labels = [pool.name, inst.role.value, inst.url, inst.rank_label]
                breaker.add_metric(labels, int(inst.breaker.state))
                health = -1 if inst.healthy is None else int(inst.healthy)
                healthy.add_metric(labels, health)
                info.add_metric([*labels, *_facts(inst)], 1)
                unpaired.add_metric(labels, 0 if inst.unpaired is None else 1)
        yield from (slots, in_use, queue, inflight, breaker, healthy, degraded, sessions)
        yield from (info, unpaired, engines, desired)

    def _slots(self) -> Iterator[Metric]:
        slots = GaugeMetricFamily(
            "pdrouter_decode_slots", "Decode slots offered", labels=["model", "engine", "rank"]
        )
        in_use = GaugeMetricFamily(
            "pdrouter_decode_slots_in_use",
            "Decode slots reserved",
            labels=["model", "engine", "rank"],
        )
        for pool in self._pools():
            for d in pool.decode:
                slots.add_metric([pool.name, d.url, d.rank_label], d.slots)
                in_use.add_metric([pool.name, d.url, d.rank_label], d.in_use)
        yield from (slots, in_use)


class KvIndexCollector(Collector):
    """The KV index (router/kvindex) read at scrape time, per engine: whether its block set
    is known, its size and bound, and its stream's counters. With ``--workers N`` every
    worker follows every engine: a scrape shows the scraped worker's index."""

    _COUNTERS = (
        ("batches", "pdrouter_kv_index_batches", "Event batches applied"),
        ("replays", "pdrouter_kv_index_replays", "Replay requests sent to the engine"),
        ("restarts", "pdrouter_kv_index_restarts", "Engine restarts seen in its stream"),
        (
            "decode_errors",
            "pdrouter_kv_index_decode_errors",
            "Event batches that could not be decoded (the block set became unknown)",
        ),
        (
            "evicted",
            "pdrouter_kv_index_evicted_blocks",
            "Blocks dropped by max_blocks_per_engine (least recently stored first)",
        ),
        (
            "unkeyed",
            "pdrouter_kv_index_unkeyed_blocks",
            "Stored blocks not indexed (parent unknown, LoRA, multimodal, salt, partial)",
        ),
    )

    def __init__(self, streams: Callable[[], Iterable[Stream]]) -> None:
        self._streams = streams

    def collect(self) -> Iterator[Metric]:
        e = ["engine", "rank"]
        known = GaugeMetricFamily(
            "pdrouter_kv_index_known",
            "1 while the index holds the engine's whole cache; 0: unknown, routed as without "
            "events",
            labels=e,
        )
        engines = GaugeMetricFamily(
            "pdrouter_kv_index_engines", "Engines followed, by index state", labels=["state"]
        )
        blocks = GaugeMetricFamily("pdrouter_kv_index_blocks", "Blocks indexed", labels=e)
        bound = GaugeMetricFamily(
            "pdrouter_kv_index_max_blocks", "The bound on blocks indexed per engine", labels=e
        )
        seq = GaugeMetricFamily(
            "pdrouter_kv_index_next_seq", "The engine's next event sequence number", labels=e
        )
        events = CounterMetricFamily(
            "pdrouter_kv_index_events",
            "KV events applied, in blocks (stored, removed) or events (cleared, unknown kinds)",
            labels=["engine", "rank", "kind"],
        )
        gaps = CounterMetricFamily(
            "pdrouter_kv_index_gaps",
            "Missing event sequence numbers: found, filled by a replay, or not (unfilled)",
            labels=["engine", "rank", "result"],
        )
        counters = {
            attr: CounterMetricFamily(name, doc, labels=e) for attr, name, doc in self._COUNTERS
        }
        states = {"known": 0, "unknown": 0}
        for stream in self._streams():
            index, stats = stream.index, stream.index.stats
            url = list(split_engine_key(stream.url))
            states["known" if index.known else "unknown"] += 1
            known.add_metric(url, 1 if index.known else 0)
            blocks.add_metric(url, index.blocks)
            bound.add_metric(url, index.max_blocks)
            seq.add_metric(url, stream.next_seq)
            for kind, value in (
                ("stored", stats.stored),
                ("removed", stats.removed),
                ("cleared", stats.cleared),
                ("unknown", stats.unknown_events),
            ):
                events.add_metric([*url, kind], value)
            for result, value in (
                ("found", stats.gaps),
                ("filled", stats.gaps_filled),
                ("unfilled", stats.gaps_unfilled),
            ):
                gaps.add_metric([*url, result], value)
            for attr, family in counters.items():
                family.add_metric(url, getattr(stats, attr))
        for state, count in states.items():
            engines.add_metric([state], count)
        yield from (known, engines, blocks, bound, seq, events, gaps, *counters.values())


class WorkerStateGauges:
    """One worker's own state as multiprocess gauges, merged over live workers."""

    def __init__(self, r: CollectorRegistry) -> None:
        mi, mri = ["model", "engine", "rank"], ["model", "role", "engine", "rank"]
        self.queue = _Gauge(
            "pdrouter_queue_depth",
            "Requests waiting for a decode slot",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.prefill = _Gauge(
            "pdrouter_prefill_in_flight",
            "Prefill legs in flight, and requests P serves alone (adaptive)",
            mi,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.breaker = _Gauge(
            "pdrouter_breaker_state",
            "Circuit breaker state (0 closed, 1 open, 2 half-open), worst worker",
            mri,
            registry=r,
            multiprocess_mode="livemax",
        )
        self.healthy = _Gauge(
            "pdrouter_engine_healthy",
            "Active health check result (1 healthy, 0 unhealthy, -1 unknown), worst worker",
            mri,
            registry=r,
            multiprocess_mode="livemin",
        )
        self.degraded = _Gauge(
            "pdrouter_engine_degraded",
            "1 while a decode engine holds leaked KV blocks and is out of rotation",
            mi,
            registry=r,
            multiprocess_mode="livemax",
        )
        self.sessions = _Gauge(
            "pdrouter_sessions",
            "Sessions in the affinity tables (each worker has its own)",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.info = _Gauge(
            "pdrouter_engine_info",
            "What an engine runs, as read from it ('' until read); always 1",
            [*mri, "vllm_version", "block_size"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.unpaired = _Gauge(
            "pdrouter_engine_unpaired",
            "1 while no engine of the other role can pair with this one, worst worker",
            mri,
            registry=r,
            multiprocess_mode="livemax",
        )
        # Every worker sees the same engines; each its own share of the load: max, sum.
        self.engines = _Gauge(
            "pdrouter_autoscale_engines",
            _ENGINES_HELP,
            ["model", "role"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.desired = _Gauge(
            "pdrouter_autoscale_desired_engines",
            _DESIRED_HELP,
            ["model", "role"],
            registry=r,
            multiprocess_mode="livesum",
        )

    def refresh(self, pools: Iterable[ModelPool], now: float) -> None:
        """Copy the current state (``now``: the dispatcher's clock). Series of removed
        instances keep their last value until the worker restarts (multiprocess files
        cannot drop a series)."""
        for pool in pools:
            for demand in demands(pool, now):
                role = demand.role.value
                self.engines.labels(pool.name, role).set(demand.engines)
                self.desired.labels(pool.name, role).set(desired_or_nan(demand))
            self.queue.labels(pool.name).set(pool.ledger.queue_depth)
            self.sessions.labels(pool.name).set(len(pool.affinity))
            for d in pool.decode:
                self.degraded.labels(pool.name, d.url, d.rank_label).set(1 if d.degraded else 0)
            for p in pool.prefill:
                self.prefill.labels(pool.name, p.url, p.rank_label).set(p.load)
            for inst in (*pool.prefill, *pool.decode):
                labels = (pool.name, inst.role.value, inst.url, inst.rank_label)
                self.breaker.labels(*labels).set(int(inst.breaker.state))
                self.healthy.labels(*labels).set(-1 if inst.healthy is None else int(inst.healthy))
                self.info.labels(*labels, *_facts(inst)).set(1)
                self.unpaired.labels(*labels).set(0 if inst.unpaired is None else 1)


class Metrics:
    def __init__(self, multiprocess: bool = False) -> None:
        """``multiprocess``: one of ``--workers N`` (needs ``PROMETHEUS_MULTIPROC_DIR``)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._pools: Callable[[], Iterable[ModelPool]] | None = None
        self._clock: Callable[[], float] = time.monotonic  # the dispatcher's (attach_state)
        self._zeroed: set[tuple[str, str, tuple[str, ...], tuple[bool, ...]]] = set()
        self._worker_state = WorkerStateGauges(r) if multiprocess else None
        self._scrape = r
        if multiprocess:
            # A scrape reads every worker's files, never this process's registry.
            self._scrape = CollectorRegistry()
            MultiProcessCollector(self._scrape)  # type: ignore[no-untyped-call]
        self.requests = _Counter(
            "pdrouter_requests", "Client requests", ["model", "mode", "outcome"], registry=r
        )
        self.ttft = _Histogram(
            "pdrouter_ttft_seconds",
            "Client-observed time to first byte",
            ["model", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Per stream, not per chunk: a per-chunk histogram cost ~5% of the router's
        # CPU with --workers (each observation is a locked write to a shared file),
        # and the per-token distribution is the engine's own metric
        # (vllm:inter_token_latency_seconds). The router's share is the worst stall.
        self.max_chunk_gap = _Histogram(
            "pdrouter_stream_max_chunk_gap_seconds",
            "Longest client-observed time between two chunks of a stream",
            ["model", "decision"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.chunks = _Counter(
            "pdrouter_streamed_chunks", "Body chunks relayed to clients", ["model"], registry=r
        )
        self.prefill_duration = _Histogram(
            "pdrouter_prefill_duration_seconds",
            "Prefill leg duration",
            ["model", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.handoff = _Histogram(
            "pdrouter_handoff_seconds",
            "Prefill done to first decode byte",
            ["model", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = _Counter("pdrouter_retries", "Dispatch retries", ["model"], registry=r)
        self.kv_params_missing = _Counter(
            "pdrouter_kv_params_missing",
            "Prefill responses without kv_transfer_params",
            ["model", "engine", "rank"],
            registry=r,
        )
        self.disconnects = _Counter(
            "pdrouter_client_disconnects",
            "Clients gone before their response ended",
            ["model", "phase"],
            registry=r,
        )
        self.upstream_errors = _Counter(
            "pdrouter_upstream_errors", "Upstream failures", ["model", "role", "code"], registry=r
        )
        self.decisions = _Counter(
            "pdrouter_disagg_decisions",
            "How requests were dispatched",
            ["model", "decision"],
            registry=r,
        )
        self.route_choices = _Counter(
            "pdrouter_route_choice",
            "Choices of the adaptive rule (adaptive: docs/policy.md): pd (the model's mode), "
            "decode_alone or prefill_alone (one engine serves the whole request)",
            ["model", "choice"],
            registry=r,
        )
        self.session_routes = _Counter(
            "pdrouter_session_routes",
            "Requests with a session key by how affinity placed them (hit, placed, spilled)",
            ["model", "role", "result"],
            registry=r,
        )
        self.kept_turns = _Counter(
            "pdrouter_kept_turns",
            "Finished turns kept on D for the next P, and what became of them "
            "(kept, reused, partial, mismatch, expired, unavailable, offered, unequal_tp)",
            ["model", "result"],
            registry=r,
        )
        self.kept_turns_entries = _Gauge(
            "pdrouter_kept_turns_entries",
            "Finished turns kept on D and not yet taken by a next turn",
            ["model"],
            registry=r,
        )
        self.cache_routes = _Counter(
            "pdrouter_cache_routes",
            "Engine choices of cache-aware routing (kv_events): cached (the chosen engine holds "
            "part of the prompt), cold (none does: by load), unknown (an engine's index is "
            "unknown) or no_tokens (the prompt's token ids could not be had); the last two "
            "fall back to the usual rule",
            ["model", "role", "result"],
            registry=r,
        )
        self.cache_predicted = _Histogram(
            "pdrouter_cache_predicted_tokens",
            "Prompt tokens the chosen engine was predicted to hold, per cache-aware choice",
            ["model", "role"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.cache_prompt_tokens = _Counter(
            "pdrouter_cache_prompt_tokens",
            "Prompt tokens of the requests routed by cache (with pdrouter_cache_predicted_tokens"
            "_sum: the predicted hit ratio)",
            ["model", "role"],
            registry=r,
        )
        self.cache_tokenize = _Histogram(
            "pdrouter_cache_tokenize_seconds",
            "Time to get a request's token ids for cache-aware routing (an engine's /tokenize)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # LoRA adapter requests by adapter, a bounded label set (router/engines/adapters.py);
        # every other family counts them under their base model's name.
        self.lora_requests = _Counter(
            "pdrouter_lora_requests",
            "Requests naming a LoRA adapter, by base model and adapter (past the model's "
            "lora.max_adapter_labels: other)",
            ["model", "adapter"],
            registry=r,
        )
        self.adapter_labels = AdapterLabels()
        self.push_fallbacks = _Counter(
            "pdrouter_push_sequential_dispatches",
            "Push requests sent sequentially because P's identity was not yet known",
            ["model"],
            registry=r,
        )
        self._abuse(r)

    def _abuse(self, r: CollectorRegistry) -> None:
        """Families of the rules against abuse: keys, limits, bounds, slow clients. Keys
        appear by their configured name, never by the key."""
        self.auth_failures = _Counter(
            "pdrouter_auth_failures",
            "Requests refused for their credentials (missing, scheme, invalid)",
            ["reason"],
            registry=r,
        )
        self.key_requests = _Counter(
            "pdrouter_key_requests",
            "Requests by API key name: admitted, or refused by the key's limits "
            "(rate_limited, concurrency_limited) or its share of the queue "
            "(queue_share_exceeded)",
            ["key", "result"],
            registry=r,
        )
        self.key_in_flight = _Gauge(
            "pdrouter_key_in_flight",
            "Requests in flight by API key name",
            ["key"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.key_queue_wait = _Histogram(
            "pdrouter_key_queue_wait_seconds",
            "Time a dispatch waited for a decode slot, by API key name",
            ["key"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.class_queue_wait = _Histogram(
            "pdrouter_priority_queue_wait_seconds",
            "Time a dispatch waited for a decode slot, by model and priority class (- none)",
            ["model", "priority_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.deadline_misses = _Counter(
            "pdrouter_deadline_misses",
            "Requests refused because their TTFT deadline passed while they waited for a "
            "decode slot, by model and priority class (- none)",
            ["model", "priority_class"],
            registry=r,
        )
        self.class_refusals = _Counter(
            "pdrouter_admission_refusals",
            "Requests refused while asking for a decode slot, by model, priority class (- none) "
            "and reason (the error's code: deadline_unattainable, deadline_exceeded, queue_full, "
            "queue_share_exceeded, no_capacity)",
            ["model", "priority_class", "reason"],
            registry=r,
        )
        self.bounds_refused = _Counter(
            "pdrouter_bounds_refusals",
            "Requests refused before any work, by bound (prompts, n, max_tokens, context)",
            ["model", "bound"],
            registry=r,
        )
        self.client_connections = _Gauge(
            "pdrouter_client_connections",
            "Client connections open",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.connections_refused = _Counter(
            "pdrouter_client_connections_refused",
            "Client connections closed at once, over connections.max_open",
            registry=r,
        )
        self.client_timeouts = _Counter(
            "pdrouter_client_timeouts",
            "Client connections cut for slowness: request head, body, or a response not read",
            ["phase"],
            registry=r,
        )
        self.headers_refused = _Counter(
            "pdrouter_client_headers_refused",
            "Requests refused with 431 for their headers (size, count)",
            ["reason"],
            registry=r,
        )
        # Mid-stream migrations (router/pd/migration.py), by MIGRATION_CAUSES.
        self.migrations = _Counter(
            "pdrouter_migrations",
            "Streams continued on another engine after D's failure mid-stream, by cause",
            ["model", "mode", "cause"],
            registry=r,
        )

    def attach_keys(self, names: Iterable[str]) -> None:
        """Create every key's series at 0 (and the slow-client ones), so that a rate or a
        ratio has data before the first refusal."""
        for name in names:
            for result in KEY_RESULTS:
                self.key_requests.labels(name, result)
            self.key_in_flight.labels(name)
        for reason in ("missing", "scheme", "invalid"):
            self.auth_failures.labels(reason)
        for phase in ("headers", "body", "write"):
            self.client_timeouts.labels(phase)
        for reason in ("size", "count"):
            self.headers_refused.labels(reason)

    def observe_request(
        self, model: str, mode: str, outcome: Outcome, ttft: float | None = None
    ) -> None:
        """Count one client request by how it ended (and its TTFT, if it got a first
        byte). ``model``/``mode`` are empty for a request refused before its model
        was known (bad JSON, unknown model, no API key)."""
        self.requests.labels(model, mode, outcome).inc()
        if ttft is not None:
            self.ttft.labels(model, mode).observe(ttft)

    def attach_kv_index(self, streams: Callable[[], Iterable[Stream]]) -> None:
        """Read the KV index's streams at every scrape."""
        self._scrape.register(KvIndexCollector(streams))

    def attach_state(
        self, pools: Callable[[], Iterable[ModelPool]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Read the pools at every scrape (``clock``: the dispatcher's, for the demand)."""
        self._pools = pools
        self._clock = clock
        per_worker = self._worker_state is None
        self._scrape.register(StateCollector(pools, per_worker=per_worker, clock=clock))

    def refresh_worker_state(self) -> None:
        """Copy this worker's own state into the multiprocess gauges (no-op otherwise)."""
        if self._worker_state is not None and self._pools is not None:
            self._worker_state.refresh(self._pools(), self._clock())

    def _zero_series(self) -> None:
        """Create every model's request, retry and fallback series at 0 (and each prefill
        instance's missing-params series): a counter that never moved otherwise has no
        series, so ``rate()`` in a dashboard or an alert ratio gets no data instead of 0.
        At scrape time, so models added by a reload or discovery get theirs too."""
        for pool in self._pools() if self._pools is not None else ():
            cfg = pool.config
            flags = (
                cfg.sessions.enabled,
                cfg.kept_turns.enabled,
                cfg.kv_events.enabled,
                cfg.adaptive.enabled,
            )
            key = (pool.name, pool.mode.value, tuple(p.key for p in pool.prefill), flags)
            if key in self._zeroed:
                continue
            self._zeroed.add(key)
            self._zero_turns(pool)
            for outcome in Outcome:
                self.requests.labels(pool.name, pool.mode.value, outcome)
            self.retries.labels(pool.name)
            self.push_fallbacks.labels(pool.name)
            for phase in DisconnectPhase:
                self.disconnects.labels(pool.name, phase)
            for cause in MIGRATION_CAUSES:
                self.migrations.labels(pool.name, pool.mode.value, cause)
            for p in pool.prefill:
                self.kv_params_missing.labels(pool.name, p.url, p.rank_label)

    def _zero_turns(self, pool: ModelPool) -> None:
        """Session placements and kept turns, where the model has them on."""
        if pool.config.sessions.enabled:
            roles = (Role.PREFILL, Role.DECODE) if pool.mode.uses_prefill else (Role.DECODE,)
            for role in roles:
                for placement in Placement:
                    self.session_routes.labels(pool.name, role.value, placement.value)
        if pool.config.kv_events.enabled:
            roles = (Role.PREFILL, Role.DECODE) if pool.mode.uses_prefill else (Role.DECODE,)
            for role in roles:
                for cache_result in Result:
                    self.cache_routes.labels(pool.name, role.value, cache_result.value)
                self.cache_prompt_tokens.labels(pool.name, role.value)
                self.cache_predicted.labels(pool.name, role.value)
            self.cache_tokenize.labels(pool.name)
        if pool.config.adaptive.enabled:
            for choice in ROUTE_CHOICES:
                self.route_choices.labels(pool.name, choice)
        if pool.config.kept_turns.enabled:
            for result in KeptTurnResult:
                self.kept_turns.labels(pool.name, result.value)
            self.kept_turns_entries.labels(pool.name)

    def render(self) -> bytes:
        self._zero_series()
        self.refresh_worker_state()
        return generate_latest(self._scrape)
