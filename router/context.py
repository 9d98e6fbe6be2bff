"""What one app is made of: every piece the composition root builds, and how it builds them.

:func:`build_context` builds them from the config and the injected ``transport``
(tests, benchmarks), ``clock`` and ``shared_slots``; nothing here is module-level state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from router.access_log import AccessLog
from router.auth import Authenticator
from router.bounds import Bounds
from router.carrier import Carrier, Http1Carrier
from router.composer import Relaying
from router.config import LoraConfig, RouterConfig
from router.engines.adapter_loads import AdapterLoader
from router.engines.facts import FactsReader
from router.engines.health import HealthMonitor
from router.engines.instance import Instance
from router.engines.load import LoadWatcher
from router.engines.reported import EngineLoads, own_load
from router.guard import ClientEvents
from router.httpx_carrier import HttpxCarrier
from router.kvindex.index import KvIndex
from router.kvindex.route import CacheScorer
from router.lifecycle import Lifecycle, Observer
from router.limits import Limiter
from router.metrics import Metrics
from router.observers.access_log import AccessLines
from router.observers.metrics import MetricsObserver
from router.observers.timings import TimingsObserver
from router.observers.tracing import TracingObserver
from router.orca import LoadReports
from router.passthrough import PassThrough
from router.pd.dispatch import Dispatcher
from router.pd.kept_turns import KeptTurns
from router.pd.legs import LegRunner
from router.pd.side_calls import SideCalls
from router.registry import Registry
from router.shared_slots import WorkerSlots
from router.tracing import Tracing
from router.upstream import UpstreamClient

__all__ = ["AppContext", "build_context"]


@dataclass(frozen=True, slots=True)
class AppContext:
    config: RouterConfig
    registry: Registry
    metrics: Metrics
    upstream: UpstreamClient
    dispatcher: Dispatcher
    health: HealthMonitor
    clock: Callable[[], float]
    load: LoadWatcher | None  # several router replicas: engine-reported decode load
    passthrough: PassThrough
    tracing: Tracing
    access: AccessLog
    auth: Authenticator
    limiter: Limiter
    bounds: Bounds
    clients: ClientEvents  # slow clients: the connection guard's and the body deadline's
    kv_index: KvIndex  # the engines' KV events (router/kvindex), for cache-aware routing
    engine_loads: EngineLoads | None  # several router replicas: engine-reported load
    load_reports: LoadReports  # ORCA headers from D's /metrics (router/orca.py)
    lifecycle: Lifecycle  # the request's events and their observers (router/lifecycle.py)
    relaying: Relaying  # what every relay shares (router/relay.py)
    # ``pd-router sidecar`` (router/picker): requests carry an endpoint picker's choice
    sidecar: bool = False


def _carrier(config: RouterConfig, transport: httpx.AsyncBaseTransport | None) -> Carrier:
    """The engine calls' carrier: the router's own HTTP/1.1 client, or httpx over a
    transport a test or benchmark injected."""
    key = config.auth.upstream_api_key
    secret = key.get_secret_value() if key else None
    timeouts = config.timeouts
    if transport is not None:
        return HttpxCarrier(transport, timeouts.connect, timeouts.idle, secret)
    return Http1Carrier(timeouts.connect, secret)


def build_context(
    config: RouterConfig,
    transport: httpx.AsyncBaseTransport | None,
    clock: Callable[[], float],
    shared_slots: WorkerSlots | None = None,
    sidecar: bool = False,
) -> AppContext:
    upstream = UpstreamClient(config.timeouts, _carrier(config, transport))
    # Several replicas judge load from the engines' reports, so that they place alike.
    engine_loads = None
    if config.admission.replicas > 1:
        engine_loads = EngineLoads(upstream, config.health.load_interval, config.health.timeout)
    engine_load = engine_loads.load if engine_loads is not None else own_load
    registry = Registry(config, clock, shared_slots, load=engine_load)
    metrics = Metrics(multiprocess=shared_slots is not None)
    metrics.attach_state(registry.pools, clock)
    kv_index = KvIndex()
    metrics.attach_kv_index(kv_index.streams)
    tracing = Tracing(config.tracing)
    access = AccessLog(config.logging)
    lifecycle = _lifecycle(registry, metrics, tracing, access, clock)
    legs = LegRunner(upstream, config.timeouts, lifecycle, clock)
    side_calls = SideCalls(upstream, config.timeouts.connect)
    turns = KeptTurns(side_calls, lifecycle)
    scorer = CacheScorer(kv_index, engine_load, side_calls.tokenize)
    dispatcher = Dispatcher(
        legs,
        turns,
        lifecycle,
        config.retries,
        clock,
        config.health.interval,
        tracing.traceparent,
        scorer,
        AdapterLoader(upstream),
    )

    facts = FactsReader(upstream, config.health.timeout, clock, functools.partial(_lora, registry))
    health = HealthMonitor(registry.instances, upstream, config.health, facts, registry.check_pairs)
    load = None
    if config.admission.replicas > 1:
        load = LoadWatcher(
            lambda: (d for p in registry.pools() for d in p.decode),
            upstream,
            config.admission.replicas,
            config.health.load_interval,
            config.health.timeout,
        )
    passthrough = PassThrough(upstream, config.timeouts.total, config.health.interval, clock)
    auth = Authenticator(config.auth)
    metrics.attach_keys(auth.names)
    own = {k.name: k.limits for k in config.auth.named_keys()}
    limiter = Limiter(config.limits.per_key, own, clock)
    bounds = Bounds(
        config.limits, passthrough, config.health.timeout, config.health.interval, clock
    )
    return AppContext(
        config,
        registry,
        metrics,
        upstream,
        dispatcher,
        health,
        clock,
        load,
        passthrough,
        tracing,
        access,
        auth,
        limiter,
        bounds,
        ClientEvents(metrics, clock),
        kv_index,
        engine_loads,
        LoadReports(side_calls),
        lifecycle,
        Relaying(dispatcher, lifecycle, clock, config.timeouts.total),
        sidecar,
    )


def _lifecycle(
    registry: Registry,
    metrics: Metrics,
    tracing: Tracing,
    access: AccessLog,
    clock: Callable[[], float],
) -> Lifecycle:
    """The observers of every request: the routing timings and metrics always; tracing and
    the access log only when they are on, so that with them off the request path builds
    nothing for them (``Lifecycle.annotates``, ``Lifecycle.spans_requests`` false)."""
    observers: list[Observer] = [TimingsObserver(registry), MetricsObserver(metrics)]
    if tracing.enabled:
        observers.append(TracingObserver(tracing))
    if access.enabled:
        observers.append(AccessLines(access, clock))
    return Lifecycle(observers)


def _lora(registry: Registry, inst: Instance) -> LoraConfig | None:
    """The LoRA settings of ``inst``'s model (read at each check: a reload may change them)."""
    pool = registry.get(inst.model)
    return pool.config.lora if pool is not None else None
