"""Watching for the client's disconnect during one exchange.

The guarded protocol (router/guard.py) offers the client's connection in the request's scope
(``scope[CONNECTION]``): the relay sets its ``on_lost`` hook for the time of its exchange, so
a request pays an attribute write, not a task. Another server (uvicorn's h11 protocol) offers
no connection: its ``receive()`` returns ``http.disconnect`` once the client is gone, which a
task per request waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from router.asgi_types import BodyWriter

__all__ = ["CONNECTION", "Connection", "watch"]

# The scope key under which the server's protocol (router/guard.py) offers its connection.
CONNECTION = "pdrouter.connection"

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class Connection(Protocol):
    """The client's connection as the server's protocol offers it (``scope[CONNECTION]``):
    ``lost`` once it is gone; ``on_lost``, if set, is called once when it goes. The relay
    sets it for the time of its exchange: a request pays an attribute write, not a task."""

    lost: bool
    on_lost: Callable[[], None] | None

    def hold_head(self) -> None:
        """Write the response head sent next together with the body message sent right
        after it (one write instead of two); the caller sends that body message at once."""

    def body_writer(self, send: Any) -> BodyWriter | None:
        """What writes the body of the response that ``send`` (the ASGI send of a request
        on this connection) sends, without the ASGI call; None: only ``send`` can."""

    def whole_body(self, receive: Any) -> bytes | None:
        """The body of the request whose ASGI receive is ``receive``, taken as that receive
        would have returned it, if all of it has arrived and none of it was received yet;
        None (nothing taken): read it through ``receive``."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def watch(
    conn: Connection | None, receive: Receive, on_lost: Callable[[], None]
) -> Callable[[], None]:
    """Call ``on_lost`` once the client is gone (at once if it already is); returns what
    stops watching (call it once, when the exchange is over)."""
    if conn is not None:
        conn.on_lost = on_lost
        if conn.lost:
            on_lost()

        def detach() -> None:
            if conn.on_lost is on_lost:  # not yet a pipelined next request's
                conn.on_lost = None

        return detach
    watcher = asyncio.create_task(_wait_disconnect(receive))
    watcher.add_done_callback(lambda w: None if w.cancelled() else on_lost())

    def stop() -> None:
        watcher.cancel()

    return stop
