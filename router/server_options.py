"""The uvicorn settings every way of serving the router shares (one process or workers)."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["uvicorn_options"]


def uvicorn_options(
    *,
    log_level: str,
    access_log: bool,
    grace: float,
    backlog: int,
    own_logging: bool = False,
    http_protocol: type[asyncio.Protocol] | str = "httptools",
) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config`` (app, host, port aside).
    ``own_logging``: leave logging to the router's root handler (its JSON format), instead
    of uvicorn's own text handlers. ``http_protocol``: the app's guarded httptools
    protocol (``RouterApp.http_protocol``: the bounds on slow and greedy clients)."""
    options: dict[str, Any] = {
        "log_level": log_level,
        "access_log": access_log,
        # uvloop, accepting pending connections in batches (router/accept.py).
        "loop": "router.accept:new_event_loop",
        "http": http_protocol,
        # Clients' X-Forwarded-* headers are not trusted, and the router never uses the
        # client address: skip the middleware that rewrites it on every request.
        "proxy_headers": False,
        "server_header": False,
        "timeout_graceful_shutdown": grace,
        "backlog": backlog,
    }
    if own_logging:
        options["log_config"] = None
    return options
