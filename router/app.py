"""Composition root: ``create_app(config, ...)`` builds every piece and wires it.

Nothing here is module-level state: each app owns its registry, metrics
registry, HTTP client and health monitor, built from the config and the
injected ``transport`` (tests, benchmarks) and ``clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from router import __version__
from router.access_log import AccessLog, AccessRecord
from router.auth import OPEN_PATHS, Authenticator
from router.bounds import Bounds
from router.client_request import (
    ClientRequest,
    Endpoint,
    check_passthrough_body,
    parse_client_request,
    request_json_schema,
    with_session,
)
from router.config import CorsConfig, RouterConfig
from router.engines.health import HealthMonitor
from router.engines.load import LoadWatcher
from router.engines.reported import EngineLoads, own_load
from router.errors import (
    BodyTooLarge,
    BoundExceeded,
    HttpError,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    Outcome,
    RateLimited,
    RequestTimeout,
    RouterError,
    Unauthorized,
    render,
)
from router.guard import ClientEvents, guarded_protocol
from router.kvindex.index import KvIndex
from router.kvindex.route import CacheScorer
from router.limits import Limiter
from router.metrics import Metrics
from router.multi_prompt import MultiPromptResponse
from router.passthrough import POST_PATHS, PassThrough
from router.pd import kv_params as kp
from router.pd.dispatch import Dispatcher
from router.pd.legs import LegRunner
from router.registry import ModelPool, Registry
from router.relay import Receive, RelayResponse, Scope, Send, send_error
from router.reload import ConfigReloader
from router.shared_slots import WorkerSlots
from router.tracing import Tracing
from router.upstream import UpstreamClient

__all__ = ["AppContext", "RouterApp", "create_app"]

log = logging.getLogger("pd_router")

_MAX_CLIENT_ID = 128


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


def _build_context(
    config: RouterConfig,
    transport: httpx.AsyncBaseTransport | None,
    clock: Callable[[], float],
    shared_slots: WorkerSlots | None = None,
) -> AppContext:
    key = config.auth.upstream_api_key
    upstream = UpstreamClient(
        config.timeouts, key.get_secret_value() if key else None, transport=transport
    )
    # Several replicas judge load from the engines' reports, so that they place alike.
    engine_loads = None
    if config.admission.replicas > 1:
        engine_loads = EngineLoads(upstream, config.health.load_interval, config.health.timeout)
    engine_load = engine_loads.load if engine_loads is not None else own_load
    registry = Registry(config, clock, shared_slots, load=engine_load)
    metrics = Metrics(multiprocess=shared_slots is not None)
    metrics.attach_state(registry.pools)
    kv_index = KvIndex()
    metrics.attach_kv_index(kv_index.streams)
    legs = LegRunner(upstream, config.timeouts, metrics, clock)
    tracing = Tracing(config.tracing)
    scorer = CacheScorer(kv_index, engine_load, legs.tokenize)
    dispatcher = Dispatcher(
        legs, metrics, config.retries, clock, config.health.interval, tracing, scorer
    )

    health = HealthMonitor(registry.instances, upstream, config.health)
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
    access = AccessLog(config.logging)
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
    )


def _error_response(exc: RouterError) -> Response:
    status, headers, body = render(exc)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})


def _identify(ctx: AppContext, scope: Scope) -> str:
    """The name of the request's API key; raises (and counts) :class:`Unauthorized`."""
    try:
        return ctx.auth.identify(scope["headers"])
    except Unauthorized as exc:
        ctx.metrics.auth_failures.labels(exc.reason).inc()
        raise


def _charge(ctx: AppContext, key: str) -> None:
    """Count one request against ``key``'s rate (refusals counted by key name)."""
    try:
        ctx.limiter.charge(key)
    except RateLimited:
        ctx.metrics.key_requests.labels(key, "rate_limited").inc()
        raise


def _hold(ctx: AppContext, key: str) -> Callable[[], None]:
    """One request in flight for ``key``; returns what gives it back (idempotent)."""
    try:
        lease = ctx.limiter.acquire(key)
    except RateLimited:
        ctx.metrics.key_requests.labels(key, "concurrency_limited").inc()
        raise
    ctx.metrics.key_requests.labels(key, "admitted").inc()
    gauge = ctx.metrics.key_in_flight.labels(key)
    gauge.inc()

    def give_back() -> None:
        if not lease.released:
            lease.release()
            gauge.dec()

    return give_back


async def _read_body(ctx: AppContext, request: Request) -> bytes:
    """The whole body within ``connections.body_timeout`` (else 408, the connection
    closed), at most ``admission.max_body_bytes`` (else 413)."""
    limit = ctx.config.admission.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    deadline = ctx.config.connections.body_timeout
    try:
        async with asyncio.timeout(deadline):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"request body exceeds {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        ctx.clients.timed_out("body", deadline, request.scope.get("client"))
        raise RequestTimeout(deadline) from None
    return b"".join(chunks)


async def _bounded(ctx: AppContext, pool: ModelPool, creq: ClientRequest) -> ClientRequest:
    try:
        return await ctx.bounds.check(pool, creq)
    except BoundExceeded as exc:
        ctx.metrics.bounds_refused.labels(pool.name, exc.bound).inc()
        raise


def _client_request_id(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The client's X-Request-Id, echoed back as vLLM does; only a short token of
    visible ASCII (it goes into log lines and a response header), else None."""
    for name, value in headers:
        if name == b"x-request-id":
            if 0 < len(value) <= _MAX_CLIENT_ID and all(0x21 <= c <= 0x7E for c in value):
                return value
            return None
    return None


async def _handle(
    ctx: AppContext, request: Request, endpoint: Endpoint, client_id: bytes | None
) -> Response:
    """The relay for one generate request, or the :class:`RouterError` that refuses
    it (counted here: every request is counted once, here or by the relay)."""
    started = ctx.clock()
    pool: ModelPool | None = None
    try:
        key = _identify(ctx, request.scope)
        _charge(ctx, key)  # before the body: a flood is refused for the price of its head
        raw = await _read_body(ctx, request)
        creq = parse_client_request(raw, endpoint)
        pool = _pool_for(ctx, creq.model)
        creq = with_session(creq, request.headers.raw, pool.config.sessions)
        creq = await _bounded(ctx, pool, creq)  # before any slot or generate call
        done = _hold(ctx, key)
    except RouterError as exc:
        model, mode = (pool.name, pool.mode.value) if pool is not None else ("", "")
        ctx.metrics.observe_request(model, mode, exc.outcome)
        if ctx.access.enabled:
            ctx.access.write(_refused_record(ctx, request, endpoint, exc, model, mode, started))
        raise
    creq = replace(creq, client_key=key)
    # Several prompts in a disaggregated mode: one dispatch each (router/multi_prompt.py).
    several = creq.num_prompts > 1 and pool.mode.uses_prefill
    return (MultiPromptResponse if several else RelayResponse)(
        ctx.dispatcher,
        ctx.metrics,
        pool,
        creq,
        started,
        ctx.clock,
        ctx.config.timeouts.total,
        client_id,
        ctx.tracing,
        ctx.access,
        on_end=done,
    )


def _refused_record(
    ctx: AppContext,
    request: Request,
    endpoint: Endpoint,
    exc: RouterError,
    model: str,
    mode: str,
    started: float,
) -> AccessRecord:
    client_id = request.headers.get("x-request-id", "-")
    return AccessRecord(
        method=request.method,
        path=endpoint.value,
        status=exc.status,
        model=model or "-",
        mode=mode or "-",
        outcome=exc.outcome.value,
        duration_ms=(ctx.clock() - started) * 1000,
        client_id=client_id if _client_request_id(request.headers.raw) else "-",
    )


def _pool_for(ctx: AppContext, model: str | None) -> ModelPool:
    """The pool serving ``model``; without a model, the only one (as vLLM serves its
    one model to requests that name none)."""
    if model is not None:
        pool = ctx.registry.get(model)
        if pool is None:
            raise ModelNotFound(model, sorted(p.name for p in ctx.registry.pools()))
        return pool
    pools = list(ctx.registry.pools())
    if len(pools) != 1:
        names = ", ".join(sorted(p.name for p in pools))
        raise InvalidRequest(f"model: Field required (this router serves {names})", "model")
    return pools[0]


def _openapi_body(endpoint: Endpoint) -> dict[str, Any]:
    schema = request_json_schema(endpoint)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _register_routes(app: FastAPI, ctx: AppContext) -> None:
    @app.post("/v1/completions", openapi_extra=_openapi_body(Endpoint.COMPLETIONS))
    async def completions(request: Request) -> Any:
        return await _handle(
            ctx, request, Endpoint.COMPLETIONS, _client_request_id(request.scope["headers"])
        )

    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(Endpoint.CHAT))
    async def chat_completions(request: Request) -> Any:
        return await _handle(
            ctx, request, Endpoint.CHAT, _client_request_id(request.scope["headers"])
        )

    @app.post("/v1/responses", openapi_extra=_openapi_body(Endpoint.RESPONSES))
    async def responses(request: Request) -> Any:
        return await _handle(
            ctx, request, Endpoint.RESPONSES, _client_request_id(request.scope["headers"])
        )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        data: list[dict[str, Any]] = [
            {"id": p.name, "object": "model", "created": 0, "owned_by": "pd-router"}
            for p in ctx.registry.pools()
            if any(d.healthy is not False and not d.degraded for d in p.decode)
        ]
        for card in data:  # as vLLM's cards, once the router knows it
            pool = ctx.registry.get(card["id"])
            context = ctx.bounds.known_context(pool) if pool is not None else None
            if context is not None:
                card["max_model_len"] = context
        return JSONResponse({"object": "list", "data": data})

    _register_passthrough(app, ctx)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        # An open probe; its detail (the engines' URLs and state) only for a valid key.
        return _readiness(ctx, detail=_KEY in request.scope)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")


def _register_passthrough(app: FastAPI, ctx: AppContext) -> None:
    """vLLM's endpoints that need no P/D, forwarded to one engine (router/passthrough.py) once
    their body has what the engine needs: a malformed one is refused as vLLM refuses it, with
    no engine call."""

    async def forward(request: Request) -> Response:
        key: str = request.scope[_KEY]
        _charge(ctx, key)
        body = check_passthrough_body(await _read_body(ctx, request), request.url.path)
        model = body.get("model")
        client_id = _client_request_id(request.scope["headers"])
        request_id = client_id.decode() if client_id else kp.new_dispatch_ids().request_id
        pool = _pool_for(ctx, model)
        done = _hold(ctx, key)
        try:
            return await ctx.passthrough.forward(pool, request.url.path, body, request_id)
        finally:
            done()

    for path in POST_PATHS:
        app.add_api_route(path, forward, methods=["POST"], name=path.strip("/"))

    @app.get("/version")
    async def version(request: Request) -> Response:
        key: str = request.scope[_KEY]
        _charge(ctx, key)
        pools = list(ctx.registry.pools())
        if not pools:
            raise NoCapacity("no model is configured", retry_after=1.0)
        done = _hold(ctx, key)
        try:
            return await ctx.passthrough.forward(pools[0], "/version", None, "-")
        finally:
            done()


def _readiness(ctx: AppContext, detail: bool) -> Response:
    if not detail:
        ok = all(p.has_healthy_pair() for p in ctx.registry.pools())
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)
    models = {}
    for pool in ctx.registry.pools():
        models[pool.name] = {
            "ready": pool.has_healthy_pair(),
            "mode": pool.mode.value,
            "instances": [
                {
                    "url": i.url,
                    "role": i.role.value,
                    "healthy": i.healthy,
                    "degraded": i.degraded,
                    "breaker": i.breaker.state.name.lower(),
                    "slots_in_use": i.in_use if i.slots else None,
                    "slots": i.slots or None,
                }
                for i in (*pool.prefill, *pool.decode)
            ],
        }
    ok = all(m["ready"] for m in models.values())
    return JSONResponse({"ready": ok, "models": models}, status_code=200 if ok else 503)


def _served(app: FastAPI) -> list[str]:
    """``METHOD /path`` of every route, for the 404 that tells a client what exists."""
    served = []
    for route in app.routes:
        methods = sorted(getattr(route, "methods", None) or ()) or ["GET"]
        served += [f"{m} {getattr(route, 'path', '')}" for m in methods if m != "HEAD"]
    return sorted(set(served))


def _register_errors(app: FastAPI) -> None:
    @app.exception_handler(RouterError)
    async def router_error(request: Request, exc: RouterError) -> Response:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = (
                f"{request.method} {request.url.path}: {message}; "
                f"this router serves {', '.join(_served(app))}"
            )
        return _error_response(HttpError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(InternalError())


def create_app(
    config: RouterConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.monotonic,
    health_checks: bool = True,
    config_path: str | None = None,
    watch_interval: float | None = None,
    shared_slots: WorkerSlots | None = None,
) -> RouterApp:
    """Build the router app.

    ``health_checks=False`` skips the background monitor (instances then count as
    healthy until proven otherwise). With ``config_path``, SIGHUP reloads the
    models from that file, and so does any change to it when ``watch_interval``
    is set. ``shared_slots``: this worker's view of the slot table shared by the
    workers of ``pd-router serve --workers N`` (metrics then need the supervisor's
    ``PROMETHEUS_MULTIPROC_DIR``); health checks and breakers stay per worker.
    """
    ctx = _build_context(config, transport, clock, shared_slots)
    reloader = ConfigReloader(config_path, ctx.registry, config) if config_path else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = []
        if health_checks:
            await ctx.health.check_all()
            tasks.append(asyncio.create_task(ctx.health.run()))
        # Context lengths before the first request, so that its bounds are checked.
        await ctx.bounds.refresh_all(ctx.registry.pools())
        tasks.append(asyncio.create_task(ctx.bounds.run(ctx.registry.pools)))
        if ctx.load is not None:
            ctx.load.initial_caps()
            tasks.append(asyncio.create_task(ctx.load.run()))
        if ctx.engine_loads is not None:  # reads at once, then every load_interval
            tasks.append(asyncio.create_task(ctx.engine_loads.run(ctx.registry.instances)))
        ctx.kv_index.follow(ctx.registry)
        if any(m.discovery for m in config.models):
            # Lazy: the k8s extra is needed only by configs that use discovery.
            from router.discovery import start_discovery

            tasks += start_discovery(config, ctx.registry)
        if reloader is not None:
            reloader.install_sighup()
            if watch_interval:
                tasks.append(asyncio.create_task(reloader.watch(watch_interval)))
        try:
            yield
        finally:
            if reloader is not None:
                reloader.remove_sighup()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await ctx.kv_index.aclose()
            await ctx.dispatcher.settler.aclose()
            await ctx.upstream.aclose()
            await asyncio.to_thread(ctx.tracing.shutdown)

    app = FastAPI(title="pd-router", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.reloader = reloader
    _register_routes(app, ctx)
    _register_errors(app)
    return RouterApp(app, ctx)


_HOT_ROUTES = {e.value: e for e in Endpoint}
_ASGI = Callable[[Scope, Receive, Send], Awaitable[None]]
_KEY = "pdrouter.key"  # scope key: the name of the request's API key, once identified


def _cors(app: _ASGI, cors: CorsConfig) -> _ASGI:
    """``app`` behind Starlette's CORS middleware, configured as ``vllm serve`` 0.32
    configures it: with no allowed origin (the default) a preflight is answered 400 and
    no answer carries ``access-control-allow-origin``."""
    return CORSMiddleware(
        app,
        allow_origins=cors.allowed_origins,
        allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers,
        allow_credentials=cors.allow_credentials,
    )


def _has_origin(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    return any(name == b"origin" for name, _ in headers)


class RouterApp:
    """The ASGI entry point.

    The generate routes go straight to :func:`_handle` and the relay: on the
    hot path, FastAPI's routing and its middleware stack (which wraps ``send``
    for every streamed chunk) cost about a sixth of the router's CPU. Everything
    else — lifespan, the other routes, the OpenAPI document, which still lists
    the generate routes — is the FastAPI app.

    The one rule of authentication is applied here, before any route: with keys
    configured, every HTTP request but a CORS preflight (which browsers send without
    credentials, as ``vllm serve`` lets it through) and the probes of
    :data:`~router.auth.OPEN_PATHS` needs a valid key, unknown paths included.
    """

    def __init__(self, api: FastAPI, ctx: AppContext) -> None:
        self.api = api
        self._ctx = ctx
        # Only browsers send Origin: other requests skip the middleware (it cost ~5% of the
        # router's throughput in the router benchmark when every request went through it).
        self._cors = _cors(self._route, ctx.config.cors)
        self._protocol: type[asyncio.Protocol] | None = None

    @property
    def state(self) -> Any:
        return self.api.state

    @property
    def http_protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's ``http=``: its httptools protocol with this router's connection
        bounds (``connections`` in the config, :mod:`router.guard`)."""
        if self._protocol is None:
            self._protocol = guarded_protocol(self._ctx.config.connections, self._ctx.clients)
        return self._protocol

    def openapi(self) -> dict[str, Any]:
        return self.api.openapi()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _has_origin(scope["headers"]):
            await self._cors(scope, receive, send)
            return
        await self._route(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = _HOT_ROUTES.get(path)
        if endpoint is not None and scope["method"] == "POST":
            await self._generate(endpoint, scope, receive, send)
            return
        if path in OPEN_PATHS:
            # A probe is served anyway; a valid key only adds /ready's detail.
            with contextlib.suppress(Unauthorized):
                scope[_KEY] = self._ctx.auth.identify(scope["headers"])
        else:
            try:
                scope[_KEY] = _identify(self._ctx, scope)
            except Unauthorized as exc:
                await send_error(send, exc)
                return
        await self.api(scope, receive, send)

    async def _generate(
        self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
    ) -> None:
        request = Request(scope, receive)
        client_id = _client_request_id(scope["headers"])
        try:
            response = await _handle(self._ctx, request, endpoint, client_id)
        except RouterError as exc:
            await send_error(send, exc, client_id)
            return
        except ClientDisconnect:
            return  # gone while sending its body: nothing was reserved or sent upstream
        except Exception:
            log.exception("unhandled error on %s", endpoint.value)
            self._ctx.metrics.observe_request("", "", Outcome.INTERNAL_ERROR)
            await send_error(send, InternalError(), client_id)
            return
        await response(scope, receive, send)
