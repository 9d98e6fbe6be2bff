"""ASGI's callables as the router types them, a response's body writer outside them (the
server's, router/guard.py), and an error written as a whole response."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from router.errors import RouterError, render

__all__ = ["BodyWriter", "Message", "Receive", "Scope", "Send", "send_error"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyWriter(Protocol):
    """Body writes of one response, made synchronously (a spliced stream's chunks, written
    in the engine connection's callback). :meth:`write` is allowed only while :meth:`ready`
    (its head sent, its end not, the client reading, chunked coding): a write is then what
    an ``http.response.body`` message with ``more_body`` would have written."""

    def ready(self) -> bool: ...

    def write(self, body: bytes) -> None: ...

    def offer(self, body: bytes) -> bool:
        """:meth:`write` if :meth:`ready` (True), else nothing written (False): one call for
        a caller with nothing to undo when the client cannot take it."""
        ...


async def send_error(send: Send, exc: RouterError, request_id: bytes | None = None) -> None:
    """The error as a whole response; ``request_id`` is the client's, echoed."""
    status, headers, body = render(exc, request_id)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
