"""The ASGI entry point: the generate routes straight to the intake and the relay, the one
rule of authentication, CORS only for requests from browsers, everything else to FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from router.auth import OPEN_PATHS
from router.client_request import Endpoint
from router.config import CorsConfig
from router.context import AppContext
from router.errors import InternalError, Outcome, RouterError, Unauthorized
from router.guard import guarded_protocol
from router.intake import INVOCATIONS, KEY, client_request_id, handle, identify
from router.relay import Receive, Scope, Send, send_error

__all__ = ["RouterApp"]

log = logging.getLogger("pd_router")

# The generate routes; /invocations is one of them, its endpoint read from its body (None).
_HOT_ROUTES: dict[str, Endpoint | None] = {e.value: e for e in Endpoint} | {INVOCATIONS: None}
_ASGI = Callable[[Scope, Receive, Send], Awaitable[None]]


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
    for name, _ in headers:  # noqa: SIM110 (a loop, not any(): no generator per request)
        if name == b"origin":
            return True
    return False


class RouterApp:
    """The ASGI entry point.

    The generate routes go straight to :func:`~router.intake.handle` and the relay: on the
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
        if scope["type"] == "http":
            if _has_origin(scope["headers"]):
                await self._cors(scope, receive, send)
                return
            path = scope.get("path", "")
            if path in _HOT_ROUTES and scope["method"] == "POST":
                endpoint = _HOT_ROUTES[path]
                # The response is awaited here, not in a helper: every relayed chunk resumes
                # each coroutine frame between the server and the relay loop.
                response = await self._open(endpoint, scope, receive, send)
                if response is not None:
                    await response(scope, receive, send)
                return
        await self._route(scope, receive, send)

    async def _generate(
        self, endpoint: Endpoint | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A generate request that came through the CORS middleware (as :meth:`__call__`)."""
        response = await self._open(endpoint, scope, receive, send)
        if response is not None:
            await response(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in _HOT_ROUTES and scope["method"] == "POST":
            await self._generate(_HOT_ROUTES[path], scope, receive, send)
            return
        if path in OPEN_PATHS:
            # A probe is served anyway; a valid key only adds /ready's detail.
            with contextlib.suppress(Unauthorized):
                scope[KEY] = self._ctx.auth.identify(scope["headers"])
        else:
            try:
                scope[KEY] = identify(self._ctx, scope)
            except Unauthorized as exc:
                await send_error(send, exc)
                return
        await self.api(scope, receive, send)

    async def _open(
        self, endpoint: Endpoint | None, scope: Scope, receive: Receive, send: Send
    ) -> Response | None:
        """The response that runs a generate request, or None once its refusal is sent."""
        request = Request(scope, receive)
        client_id = client_request_id(scope["headers"])
        try:
            return await handle(self._ctx, request, endpoint, client_id)
        except RouterError as exc:
            await send_error(send, exc, client_id)
        except ClientDisconnect:
            pass  # gone while sending its body: nothing was reserved or sent upstream
        except Exception:
            log.exception("unhandled error on %s", scope.get("path", ""))
            self._ctx.metrics.observe_request("", "", Outcome.INTERNAL_ERROR)
            await send_error(send, InternalError(), client_id)
        return None
