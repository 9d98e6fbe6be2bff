"""What the client's response does for a migrating relay (router/pd/migration.py)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from router.asgi_types import BodyWriter
from router.errors import Outcome
from router.pd.decode_leg import DecodeLeg
from router.pd.opened import Dispatch

__all__ = ["RelayHooks"]


class RelayHooks(Protocol):
    """What the client's response (router/relay.py) does for a migrating relay: the relay
    alone writes the client's ASGI messages; this module hands it bytes."""

    def opened(self, dispatch: Dispatch) -> None:
        """The request's first dispatch is open (the access log names its engines)."""

    async def as_is(self, dispatch: Dispatch) -> Outcome:
        """Relay a dispatch whose answer cannot be migrated (a whole body) as usual."""

    async def start(self, leg: DecodeLeg, request_id: str) -> None:
        """Send the response head from D's status and content type."""

    def first_byte(self) -> None:
        """The first body bytes are about to be sent (TTFT)."""

    def stream_stats(self, dispatch: Dispatch) -> None:
        """Count a leg's chunks once it is read."""

    def writer(self) -> BodyWriter | None:
        """What writes body bytes to the client without a send (None: only sends do)."""

    def more(self, body: bytes) -> Awaitable[None]:
        """Send a body message, more to come (the awaitable of its send)."""

    async def end(self, body: bytes) -> None:
        """Send the last body message."""

    async def whole(self, body: bytes, request_id: str) -> None:
        """Answer a non-streamed request with its assembled JSON body (status 200)."""
