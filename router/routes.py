"""The routes other than the generate endpoints' hot path: models, the endpoints forwarded
to an engine, probes, metrics, and the error handlers that answer with the router's one
renderer (router/errors.py). They are FastAPI routes (the OpenAPI document lists them, and
the generate routes too, which router/asgi.py serves without FastAPI)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import chat_batch
from router.client_request import Endpoint, check_passthrough_body, request_json_schema
from router.context import AppContext
from router.errors import HttpError, InternalError, NoCapacity, RouterError, render
from router.intake import KEY, charge, client_request_id, handle, hold, pool_for, read_body
from router.passthrough import GET_PATHS, POST_PATHS
from router.pd import kv_params as kp

__all__ = ["register_errors", "register_routes"]

log = logging.getLogger("pd_router")


def _error_response(exc: RouterError) -> Response:
    status, headers, body = render(exc)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})


def _openapi_body(endpoint: Endpoint) -> dict[str, Any]:
    schema = request_json_schema(endpoint)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def register_routes(app: FastAPI, ctx: AppContext) -> None:
    @app.post("/v1/completions", openapi_extra=_openapi_body(Endpoint.COMPLETIONS))
    async def completions(request: Request) -> Any:
        return await handle(
            ctx, request, Endpoint.COMPLETIONS, client_request_id(request.scope["headers"])
        )

    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(Endpoint.CHAT))
    async def chat_completions(request: Request) -> Any:
        return await handle(
            ctx, request, Endpoint.CHAT, client_request_id(request.scope["headers"])
        )

    @app.post("/v1/responses", openapi_extra=_openapi_body(Endpoint.RESPONSES))
    async def responses(request: Request) -> Any:
        return await handle(
            ctx, request, Endpoint.RESPONSES, client_request_id(request.scope["headers"])
        )

    @app.post(
        "/v1/chat/completions/batch",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": chat_batch.request_schema()}},
            }
        },
    )
    async def chat_completions_batch(request: Request) -> Any:
        return await handle(
            ctx, request, Endpoint.CHAT_BATCH, client_request_id(request.scope["headers"])
        )

    @app.post("/v1/messages", openapi_extra=_openapi_body(Endpoint.MESSAGES))
    async def messages(request: Request) -> Any:
        """The Anthropic Messages API: both legs on the engines' own /v1/messages."""
        return await handle(
            ctx, request, Endpoint.MESSAGES, client_request_id(request.scope["headers"])
        )

    @app.post("/invocations")
    async def invocations(request: Request) -> Any:
        """SageMaker-style: a chat completion or a completion, by the body's shape."""
        return await handle(ctx, request, None, client_request_id(request.scope["headers"]))

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
        for card in list(data):  # then its LoRA adapters, as vLLM lists them after its model
            pool = ctx.registry.get(card["id"])
            data += pool.adapter_cards() if pool is not None else []
        return JSONResponse({"object": "list", "data": data})

    _register_passthrough(app, ctx)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        # An open probe; its detail (the engines' URLs and state) only for a valid key.
        return _readiness(ctx, detail=KEY in request.scope)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")


def _register_passthrough(app: FastAPI, ctx: AppContext) -> None:
    """vLLM's endpoints that need no P/D, forwarded to one engine (router/passthrough.py) once
    their body has what the engine needs: a malformed one is refused as vLLM refuses it, with
    no engine call."""

    async def forward(request: Request) -> Response:
        key: str = request.scope[KEY]
        charge(ctx, key)
        body = check_passthrough_body(await read_body(ctx, request), request.url.path)
        model = body.get("model")
        client_id = client_request_id(request.scope["headers"])
        request_id = client_id.decode() if client_id else kp.new_dispatch_ids().request_id
        pool = pool_for(ctx, model)
        done = hold(ctx, key)
        try:
            return await ctx.passthrough.forward(pool, request.url.path, body, request_id)
        finally:
            done()

    for path in POST_PATHS:
        app.add_api_route(path, forward, methods=["POST"], name=path.strip("/"))

    async def forward_get(request: Request) -> Response:
        """A GET that names no model (``/version``, ``/tokenizer_info``): the first model's
        engine answers, its 404 included (vLLM serves ``/tokenizer_info`` only with
        ``--enable-tokenizer-info-endpoint``)."""
        key: str = request.scope[KEY]
        charge(ctx, key)
        pools = list(ctx.registry.pools())
        if not pools:
            raise NoCapacity("no model is configured", retry_after=1.0)
        done = hold(ctx, key)
        try:
            return await ctx.passthrough.forward(pools[0], request.url.path, None, "-")
        finally:
            done()

    for path in GET_PATHS:
        app.add_api_route(path, forward_get, methods=["GET"], name=path.strip("/"))


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
                    "rank": i.rank,
                    "role": i.role.value,
                    "healthy": i.healthy,
                    "degraded": i.degraded,
                    "breaker": i.breaker.state.name.lower(),
                    "slots_in_use": i.in_use if i.slots else None,
                    "slots": i.slots or None,
                    "vllm_version": i.facts.version,
                    "block_size": i.facts.block_size,
                    "unpaired": i.unpaired,
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


def register_errors(app: FastAPI) -> None:
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
