"""Composition root: ``create_app(config, ...)`` builds every piece and wires it.

Nothing here is module-level state: each app owns its registry, metrics
registry, HTTP client and health monitor, built from the config and the
injected ``transport`` (tests, benchmarks) and ``clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from router import __version__
from router.access_log import AccessLog, AccessRecord
from router.client_request import (
    Endpoint,
    parse_client_request,
    parse_json_object,
    request_json_schema,
    with_session,
)
from router.config import CorsConfig, RouterConfig
from router.engines.health import HealthMonitor
from router.engines.load import LoadWatcher
from router.errors import (
    BodyTooLarge,
    HttpError,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    Outcome,
    RouterError,
    Unauthorized,
    render,
)
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


def _build_context(
    config: RouterConfig,
    transport: httpx.AsyncBaseTransport | None,
    clock: Callable[[], float],
    shared_slots: WorkerSlots | None = None,
) -> AppContext:
    registry = Registry(config, clock, shared_slots)
    metrics = Metrics(multiprocess=shared_slots is not None)
    metrics.attach_state(registry.pools)
    key = config.auth.upstream_api_key
    upstream = UpstreamClient(
        config.timeouts, key.get_secret_value() if key else None, transport=transport
    )
    legs = LegRunner(upstream, config.timeouts, metrics, clock)
    tracing = Tracing(config.tracing)
    dispatcher = Dispatcher(
        legs, metrics, config.retries, clock, config.health.interval, tracing=tracing
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
    )


def _error_response(exc: RouterError) -> Response:
    status, headers, body = render(exc)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})


def _authorize(ctx: AppContext, request: Request) -> None:
    keys = ctx.config.auth.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    # Compare against every key so timing does not reveal which (if any) matched.
    matched = False
    for k in keys:
        matched |= hmac.compare_digest(given, k.get_secret_value().encode())
    if not matched:
        raise Unauthorized("missing or invalid API key (send Authorization: Bearer <key>)")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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
        _authorize(ctx, request)
        raw = await _read_body(request, ctx.config.admission.max_body_bytes)
        creq = parse_client_request(raw, endpoint)
        pool = _pool_for(ctx, creq.model)
        creq = with_session(creq, request.headers.raw, pool.config.sessions)
    except RouterError as exc:
        model, mode = (pool.name, pool.mode.value) if pool is not None else ("", "")
        ctx.metrics.observe_request(model, mode, exc.outcome)
        if ctx.access.enabled:
            ctx.access.write(_refused_record(ctx, request, endpoint, exc, model, mode, started))
        raise
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
        _authorize(ctx, request)
        data = [
            {"id": p.name, "object": "model", "created": 0, "owned_by": "pd-router"}
            for p in ctx.registry.pools()
            if any(d.healthy is not False and not d.degraded for d in p.decode)
        ]
        return JSONResponse({"object": "list", "data": data})

    _register_passthrough(app, ctx)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        return _readiness(ctx)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")


def _register_passthrough(app: FastAPI, ctx: AppContext) -> None:
    """vLLM's endpoints that need no P/D, forwarded to one engine (router/passthrough.py)."""

    async def forward(request: Request) -> Response:
        _authorize(ctx, request)
        body = parse_json_object(await _read_body(request, ctx.config.admission.max_body_bytes))
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("model: Input should be a valid string", "model")
        client_id = _client_request_id(request.scope["headers"])
        request_id = client_id.decode() if client_id else kp.new_dispatch_ids().request_id
        pool = _pool_for(ctx, model)
        return await ctx.passthrough.forward(pool, request.url.path, body, request_id)

    for path in POST_PATHS:
        app.add_api_route(path, forward, methods=["POST"], name=path.strip("/"))

    @app.get("/version")
    async def version() -> Response:
        pools = list(ctx.registry.pools())
        if not pools:
            raise NoCapacity("no model is configured", retry_after=1.0)
        return await ctx.passthrough.forward(pools[0], "/version", None, "-")


def _readiness(ctx: AppContext) -> Response:
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
        if ctx.load is not None:
            ctx.load.initial_caps()
            tasks.append(asyncio.create_task(ctx.load.run()))
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


def _cors(app: _ASGI, cors: CorsConfig) -> _ASGI | None:
    """``app`` behind Starlette's CORS middleware, or None when CORS is off."""
    if not cors.allowed_origins:
        return None
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

    The two generate routes go straight to :func:`_handle` and the relay: on the
    hot path, FastAPI's routing and its middleware stack (which wraps ``send``
    for every streamed chunk) cost about a sixth of the router's CPU. Everything
    else — lifespan, the other routes, the OpenAPI document, which still lists
    the generate routes — is the FastAPI app.
    """

    def __init__(self, api: FastAPI, ctx: AppContext) -> None:
        self.api = api
        self._ctx = ctx
        # Only browsers send Origin: other requests skip the middleware (it cost ~5% of the
        # router's throughput in the router benchmark when every request went through it).
        self._cors = _cors(self._route, ctx.config.cors)

    @property
    def state(self) -> Any:
        return self.api.state

    def openapi(self) -> dict[str, Any]:
        return self.api.openapi()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._cors is not None and scope["type"] == "http" and _has_origin(scope["headers"]):
            await self._cors(scope, receive, send)
            return
        await self._route(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = _HOT_ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.api(scope, receive, send)
            return
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
