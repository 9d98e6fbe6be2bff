"""ASGI's callables as the router types them, and an error written as a whole response."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from router.errors import RouterError, render

__all__ = ["Message", "Receive", "Scope", "Send", "send_error"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def send_error(send: Send, exc: RouterError, request_id: bytes | None = None) -> None:
    """The error as a whole response; ``request_id`` is the client's, echoed."""
    status, headers, body = render(exc, request_id)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
