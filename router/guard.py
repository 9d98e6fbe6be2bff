"""Slow and greedy clients at the connection: uvicorn's httptools protocol, guarded.

uvicorn bounds what it bounds (``timeout_keep_alive`` for idle kept-alive connections,
``limit_concurrency`` answering 503 once a request's head is in) but nothing else with
httptools: a client may take forever to send a request's head, send any number or size
of headers, or stop reading a streamed answer and so hold the router's send buffer, its
decode slot and its engine leg for as long as ``timeouts.total``. This subclass of
uvicorn's own protocol adds, per connection (``connections`` in the config):

* ``max_open``: a connection beyond it is closed at once (before any byte is read);
* ``header_timeout``: the request line and headers must arrive within it, from the
  connection (or from the first byte of a later request on a kept-alive one): else 408;
* ``max_header_bytes`` / ``max_headers``: a head larger or with more headers is
  answered 431, as Envoy does past its 60 KiB and 100 headers;
* ``write_timeout``: the transport asked the response to pause (its buffer above the
  high-water mark: the client is not reading) and did not resume within it: the
  connection is aborted, which the relay sees as a client disconnect (slot, legs and
  all released). The socket's send buffer is set to ``send_buffer_bytes``: left to the
  kernel it grows to megabytes, which a token stream takes minutes to fill before the
  transport ever pauses.

The protocol also offers itself to the relay as the request's connection
(:class:`~router.relay.Connection`): its loss calls the relay's hook at once, so that a
streamed request needs no task of its own waiting for the disconnect; and the relay, which
has D's first bytes in hand when it sends the response head, has both written at once.

The body's deadline (``body_timeout``) is the app's where it reads the body
(``router/intake.py``: a 408 before any slot is reserved); here it ends a connection whose
answer is already sent while its body still trickles in (a 401, a 404: nobody reads it, and
every byte would otherwise keep the connection alive). Each event is a metric
(:class:`ClientEvents`) and a log line, at most one per second per kind with the count of
those left out.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from router.config import ConnectionsConfig
from router.disconnect import CONNECTION
from router.errors import error_body
from router.metrics import Metrics

__all__ = ["ClientEvents", "guarded_protocol"]

log = logging.getLogger("pd_router.clients")

_LOG_INTERVAL_S = 1.0


class _Throttle:
    """At most one log line per kind per interval; counts the ones left out."""

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def allow(self, kind: str) -> int | None:
        """None: skip this line; else how many were skipped since the last one."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._skipped.pop(kind, 0)


def _peer(client: Any) -> str:
    if isinstance(client, (tuple, list)) and len(client) == 2:
        return f"{client[0]}:{client[1]}"
    return "-"


class ClientEvents:
    """What the guard (and the app's body deadline) report: a metric and a log line."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._throttle = _Throttle(_LOG_INTERVAL_S, clock)

    def opened(self) -> None:
        self._metrics.client_connections.inc()

    def closed(self) -> None:
        self._metrics.client_connections.dec()

    def refused(self, open_now: int, limit: int, client: Any) -> None:
        self._metrics.connections_refused.inc()
        self._log("connection_refused", f"open={open_now} limit={limit} client={_peer(client)}")

    def timed_out(self, phase: str, seconds: float, client: Any) -> None:
        self._metrics.client_timeouts.labels(phase).inc()
        fields = f"phase={phase} after_s={seconds:g} client={_peer(client)}"
        self._log("client_timeout", fields, kind=f"client_timeout:{phase}")

    def headers_refused(self, reason: str, limit: int, client: Any) -> None:
        self._metrics.headers_refused.labels(reason).inc()
        self._log("headers_refused", f"reason={reason} limit={limit} client={_peer(client)}")

    def _log(self, event: str, fields: str, kind: str | None = None) -> None:
        skipped = self._throttle.allow(kind or event)
        if skipped is not None:
            log.warning("event=%s %s suppressed=%d", event, fields, skipped)


def _raw_response(status: int, phrase: str, message: str, code: str) -> bytes:
    """A whole error response written on the socket itself (no ASGI cycle exists yet)."""
    body = error_body(message, "invalid_request_error", code)
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class _HeldHead:
    """A response's transport between its head and its first body write, which carries
    both: one write (one send, one segment to the client) instead of two. The first body
    write, or a close, hands the cycle its transport back."""

    __slots__ = ("_cycle", "_head", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport: asyncio.Transport = cycle.transport
        self._head = b""
        cycle.transport = self

    def write(self, data: bytes) -> None:
        if not self._head:
            self._head = data  # uvicorn writes the whole head at once
            return
        self._cycle.transport = self._transport
        self._transport.write(self._head + data)

    def close(self) -> None:
        self._cycle.transport = self._transport
        if self._head:
            self._transport.write(self._head)
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


class _BodyWriter:
    """:class:`~router.asgi_types.BodyWriter` of one response (uvicorn's cycle): its body
    writes as uvicorn's ``send`` makes them (chunked coding), made without the ASGI call."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def ready(self) -> bool:
        cycle = self._cycle
        return bool(
            cycle.response_started
            and not cycle.response_complete
            and cycle.chunked_encoding
            and not cycle.flow.write_paused
            and not cycle.disconnected
        )

    def write(self, body: bytes) -> None:
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    def offer(self, body: bytes) -> bool:
        cycle = self._cycle  # ready() and write() inlined: a spliced token's two calls
        if (
            not cycle.response_started
            or cycle.response_complete
            or not cycle.chunked_encoding
            or cycle.flow.write_paused
            or cycle.disconnected
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


def guarded_protocol(config: ConnectionsConfig, events: ClientEvents) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the bounds of ``config`` (``http=`` of uvicorn)."""

    class GuardedProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None
            self._in_head = True  # bytes now received belong to a request's head
            # A request's head begun / its body still to come: the head or body timer is
            # armed once the bytes at hand are parsed, and only if the head or body is
            # still incomplete then (most requests arrive whole in one read: no timer).
            self._head_begun = False
            self._body_due = False
            self._head_bytes = 0
            self._heads = 0  # heads read whole on this connection
            self._header_count = 0
            self._shut = False  # refused or cut: the parser's callbacks do nothing more
            self._counted = False
            # router.relay.Connection: set by the relay of the request being answered.
            self.lost = False
            self.on_lost: Callable[[], None] | None = None

        # -- connection --------------------------------------------------------------

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > config.max_open:
                self._shut = True
                events.refused(len(self.connections) - 1, config.max_open, self.client)
                transport.abort()
                return
            self._counted = True
            events.opened()
            self._arm_head()
            sock = transport.get_extra_info("socket")
            if config.send_buffer_bytes and sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.send_buffer_bytes)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel(head=True, body=True, write=True)
            if self._counted:
                self._counted = False
                events.closed()
            super().connection_lost(exc)
            self.lost = True
            on_lost, self.on_lost = self.on_lost, None
            if on_lost is not None:
                on_lost()

        def data_received(self, data: bytes) -> None:
            if self._shut:
                return
            if self._in_head:
                room = config.max_header_bytes - self._head_bytes
                if len(data) > room:
                    rest = self._head_within(data, room)
                    if rest:  # a body, or the next request: its head counted from 0
                        self.data_received(rest)
                    return
                self._head_bytes += len(data)
            super().data_received(data)
            if self._shut:
                return
            if self._head_begun and self._head_timer is None:
                self._arm_head()  # a later request on a kept-alive connection, head in parts
            if self._body_due and self._body_timer is None:
                self._body_timer = self.loop.call_later(config.body_timeout, self._body_late)

        def _head_within(self, data: bytes, room: int) -> bytes:
            """``data`` goes past the head's bound (``room`` bytes left): the head must end
            within it; the bytes after ``room`` (a body, a long prompt's) are returned to
            be read as usual. Empty: refused (431), or the connection is closing."""
            heads = self._heads
            super().data_received(data[:room])
            if self._shut or self.transport.is_closing():
                return b""
            if self._heads == heads:  # the head goes on past its bound
                self._refuse_head("size", config.max_header_bytes)
                return b""
            return data[room:]

        # -- the parser's callbacks ----------------------------------------------------

        def hold_head(self) -> None:
            """router.relay.Connection.hold_head: the next head goes with the body after it."""
            if self.cycle is not None and not self.cycle.response_started:
                _HeldHead(self.cycle)

        def body_writer(self, send: Any) -> _BodyWriter | None:
            """router.disconnect.Connection.body_writer: the writer of ``send``'s response."""
            cycle = getattr(send, "__self__", None)
            return _BodyWriter(cycle) if isinstance(cycle, RequestResponseCycle) else None

        def whole_body(self, receive: Any) -> bytes | None:
            """router.disconnect.Connection.whole_body: what uvicorn's ``receive`` does for
            a body it holds whole, without the awaits (most bodies come with their head)."""
            cycle = getattr(receive, "__self__", None)
            if (
                not isinstance(cycle, RequestResponseCycle)
                or cycle.more_body
                or cycle.disconnected
                or cycle.response_complete
                or cycle.waiting_for_100_continue
            ):
                return None
            cycle.flow.resume_reading()
            cycle.message_event.clear()
            body = bytes(cycle.body)
            cycle.body = bytearray()
            return body

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope[CONNECTION] = self  # type: ignore[literal-required]
            self._header_count = 0
            self._head_begun = True

        def on_url(self, url: bytes) -> None:
            if not self._shut:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._shut:
                return
            self._header_count += 1
            if self._header_count > config.max_headers:
                self._refuse_head("count", config.max_headers)
                return
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._shut:
                return
            self._in_head = self._head_begun = False
            self._heads += 1
            self._cancel(head=True)
            self._body_due = True
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._shut:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._shut:
                return
            self._body_due = False
            self._cancel(body=True)
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0

        # -- flow control: a client that does not read ----------------------------------

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None and not self._shut:
                self._write_timer = self.loop.call_later(config.write_timeout, self._write_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel(write=True)

        # -- internals -------------------------------------------------------------------

        def _arm_head(self) -> None:
            self._head_timer = self.loop.call_later(config.header_timeout, self._head_late)

        def _cancel(self, *, head: bool = False, body: bool = False, write: bool = False) -> None:
            if head and self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if body and self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            if write and self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _responding(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _close_with(self, response: bytes) -> None:
            """End the connection: ``response`` first, unless an answer is under way."""
            self._shut = True
            self._cancel(head=True, body=True, write=True)
            if self.transport.is_closing():
                return
            if self._responding():
                self.transport.abort()
                return
            self.transport.write(response)
            self.transport.close()

        def _head_late(self) -> None:
            self._head_timer = None
            if self._shut or self.transport.is_closing():
                return
            events.timed_out("headers", config.header_timeout, self.client)
            message = f"the request head did not arrive within {config.header_timeout:g}s"
            self._close_with(_raw_response(408, "Request Timeout", message, "request_timeout"))

        def _body_late(self) -> None:
            self._body_timer = None
            if self._shut or self.transport.is_closing() or self._responding():
                return  # the app is reading it (its own 408) or still answering
            events.timed_out("body", config.body_timeout, self.client)
            self._shut = True
            self._cancel(head=True, write=True)
            self.transport.close()  # the answer is out: nothing more to say

        def _refuse_head(self, reason: str, limit: int) -> None:
            events.headers_refused(reason, limit, self.client)
            what = "bytes of headers" if reason == "size" else "headers"
            message = f"the request has more than {limit} {what}"
            self._close_with(
                _raw_response(431, "Request Header Fields Too Large", message, "headers_too_large")
            )

        def _write_stalled(self) -> None:
            self._write_timer = None
            if self.transport.is_closing():
                return
            events.timed_out("write", config.write_timeout, self.client)
            self._shut = True
            self._cancel(head=True, body=True)
            # Not close(): that would wait for a buffer the client never drains.
            self.transport.abort()

    return GuardedProtocol
