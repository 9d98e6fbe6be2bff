"""Run ASGI apps on real loopback sockets (port 0) inside the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn


@contextlib.asynccontextmanager
async def serve(app: Any, *, lifespan: str = "on", http: Any = None) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 with a free port; yields its base URL. ``http``: uvicorn's
    protocol; by default the app's own (the router's guarded httptools protocol,
    ``RouterApp.http_protocol``, which is what users get: its disconnect hook and held head
    are what the integration suite exercises), else h11 (fake engines)."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on accepted sockets whose protocol
    # says TCP, and without it a response written in two parts waits 40 ms for the
    # client's delayed ACK (Nagle), every request.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="critical",
        lifespan=lifespan,
        loop="asyncio",
        http=http if http is not None else getattr(app, "http_protocol", "h11"),
        timeout_graceful_shutdown=1,
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if task.done():
                task.result()
            assert time.monotonic() < deadline, "server did not start"
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        sock.close()
