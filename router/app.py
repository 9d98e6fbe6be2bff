"""Composition root: ``create_app(config, ...)`` builds every piece and wires it.

Nothing here is module-level state: each app owns its registry, metrics
registry, HTTP client and health monitor, built from the config and the
injected ``transport`` (tests, benchmarks) and ``clock`` (router/context.py).
The request path starts at :class:`~router.asgi.RouterApp`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import FastAPI

from router import __version__
from router.asgi import RouterApp
from router.config import RouterConfig
from router.context import AppContext, build_context
from router.reload import ConfigReloader
from router.routes import register_errors, register_routes
from router.shared_slots import WorkerSlots

__all__ = ["AppContext", "RouterApp", "create_app"]


def create_app(
    config: RouterConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.monotonic,
    health_checks: bool = True,
    config_path: str | None = None,
    watch_interval: float | None = None,
    shared_slots: WorkerSlots | None = None,
    sidecar: bool = False,
) -> RouterApp:
    """Build the router app.

    ``health_checks=False`` skips the background monitor (instances then count as
    healthy until proven otherwise). With ``config_path``, SIGHUP reloads the
    models from that file, and so does any change to it when ``watch_interval``
    is set. ``shared_slots``: this worker's view of the slot table shared by the
    workers of ``pd-router serve --workers N`` (metrics then need the supervisor's
    ``PROMETHEUS_MULTIPROC_DIR``); health checks and breakers stay per worker.
    ``sidecar``: ``pd-router sidecar`` (router/picker), which runs the legs an endpoint
    picker chose (its ``x-pd-decision`` and ``x-pd-prefill-endpoint`` headers).
    """
    ctx = build_context(config, transport, clock, shared_slots, sidecar)
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
    register_routes(app, ctx)
    register_errors(app)
    return RouterApp(app, ctx)
