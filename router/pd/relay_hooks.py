"""What the client's response does for a migrating relay (router/pd/migration.py)."""

from __future__ import annotations

from typing import Protocol

from router.errors import Outcome
from router.pd.decode_leg import DecodeLeg, Send
from router.pd.opened import Dispatch

__all__ = ["RelayHooks"]


class RelayHooks(Protocol):
    """What the client's response (router/relay.py) does for a migrating relay."""

    def opened(self, dispatch: Dispatch) -> None:
        """The request's first dispatch is open (the access log names its engines)."""

    async def as_is(self, dispatch: Dispatch, send: Send) -> Outcome:
        """Relay a dispatch whose answer cannot be migrated (a whole body) as usual."""

    async def start(self, send: Send, leg: DecodeLeg, request_id: str) -> None:
        """Send the response head from D's status and content type."""

    def first_byte(self) -> None:
        """The first body bytes are about to be sent (TTFT)."""

    def stream_stats(self, dispatch: Dispatch) -> None:
        """Count a leg's chunks once it is read."""

    async def end(self, send: Send, body: bytes) -> None:
        """Send the last body message."""

    async def whole(self, send: Send, body: bytes, request_id: str) -> None:
        """Answer a non-streamed request with its assembled JSON body (status 200)."""
