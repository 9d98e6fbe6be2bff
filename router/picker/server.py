"""Serve the picker: the router app's context and background work (health checks, bounds,
KV events, discovery: its lifespan), the ``ext_proc`` service and gRPC health checks on one
port, and optionally the router's HTTP routes (``/metrics``, probes) on another."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from router.app import create_app
from router.asgi import RouterApp
from router.config import RouterConfig
from router.context import AppContext
from router.pd.dispatch import Pick
from router.picker.destinations import Destinations
from router.picker.extproc import ExtProc

__all__ = ["HEALTH_SERVICES", "SERVICE", "RunningPicker", "run_picker", "running_picker"]

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # its health-check service name
# The health services the extension's protocol names (docs/proposals/004 upstream): the
# process alive, ready for requests, the ext_proc service ready; "" the server as a whole.
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE)


@dataclass(frozen=True, slots=True)
class RunningPicker:
    ctx: AppContext  # the router's context the picker places with
    service: ExtProc
    port: int  # the gRPC port bound (given 0: the one the system chose)
    app: RouterApp  # the router's HTTP routes (metrics, probes), not served by itself


@contextlib.asynccontextmanager
async def running_picker(
    config: RouterConfig,
    grpc_port: int,
    destinations: Destinations,
    host: str = "0.0.0.0",
    *,
    health_checks: bool = True,
    grace: float = 5.0,
    on_pick: Callable[[Pick], None] | None = None,
) -> AsyncIterator[RunningPicker]:
    """A picker serving on ``host:grpc_port`` until the block exits; then its health turns
    NOT_SERVING, and streams still open get ``grace`` seconds before they are cut (each
    one's slot given back as it ends). ``on_pick``: see :class:`ExtProc`."""
    app = create_app(config, health_checks=health_checks)
    ctx: AppContext = app.state.ctx
    async with app.api.router.lifespan_context(app.api):
        server = grpc.aio.server()
        service = ExtProc(ctx, destinations, on_pick)
        ep_grpc.add_ExternalProcessorServicer_to_server(service, server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port(f"{host}:{grpc_port}")
        await server.start()
        for name in HEALTH_SERVICES:
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        try:
            yield RunningPicker(ctx, service, port, app)
        finally:
            await health.enter_graceful_shutdown()
            await server.stop(grace)


async def run_picker(
    config: RouterConfig,
    grpc_port: int,
    destinations: Destinations,
    host: str,
    http_port: int | None,
) -> None:
    """Serve until SIGTERM or SIGINT (``pd-router picker``)."""
    import uvicorn

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with running_picker(config, grpc_port, destinations, host) as picker:
        http = None
        if http_port is not None:
            # The lifespan is the picker's (above): the HTTP server only serves routes. Its
            # startup and shutdown are called here, not serve(), which takes the signals.
            cfg = uvicorn.Config(
                picker.app, host=host, port=http_port, lifespan="off", log_level="warning"
            )
            cfg.load()
            http = uvicorn.Server(cfg)
            http.lifespan = cfg.lifespan_class(cfg)
            await http.startup()
        await stop.wait()
        if http is not None:
            await http.shutdown()
