"""The router's event loop: uvloop, accepting pending connections in batches.

libuv (1.45 and later, under uvloop) accepts one connection per turn of the event loop, so
that a busy listener cannot starve the loop's other work. Under load one turn of the router's
loop is long (a decode step's burst of chunks for thousands of streams): connections then wait
in the backlog and are accepted at one per turn, and clients that connected last time out
while those already accepted are served (2,000 keep-alive streams: 1,520 connections never
accepted in two minutes, bench/results/2026-12-06-router-cost-vs-peers.md). asyncio's own
loop accepts up to its backlog per readiness; this loop does the same for the router's
listening sockets, at most ``ACCEPT_BATCH`` per turn (with ``--workers N`` the workers share
one socket, and a bounded batch leaves the rest to the others).

Contract: ``new_event_loop()`` is uvloop's loop (every other call unchanged) whose
``create_server`` serves a given socket, or binds ``host:port`` itself, through
:class:`BatchAcceptServer`; TLS servers and anything else keep uvloop's own server.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Iterable
from typing import Any

import uvloop

__all__ = ["ACCEPT_BATCH", "BatchAcceptServer", "bind", "new_event_loop"]

log = logging.getLogger("router.accept")

ACCEPT_BATCH = 128
# Out of descriptors or buffers: stop accepting for a moment (as asyncio does), instead of
# spinning on a listener that stays readable.
_RETRY_S = 1.0
_PAUSING = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 where the host has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY on an accepted connection only
    # when the socket says TCP, and a response written in two parts otherwise waits ~40 ms
    # for Nagle's algorithm.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


class BatchAcceptServer(asyncio.AbstractServer):
    """Serves one listening socket: up to ``batch`` connections accepted per readiness, each
    handed to ``factory``'s protocol on the loop's own transport. :meth:`close` stops
    accepting; it closes the socket only where the server bound it (``owned``): a socket
    given to uvicorn is uvicorn's to close."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        factory: Callable[[], asyncio.BaseProtocol],
        batch: int = ACCEPT_BATCH,
        *,
        owned: bool = False,
    ) -> None:
        self._loop, self._sock, self._factory, self._batch = loop, sock, factory, batch
        self._owned = owned
        self._tasks: set[asyncio.Task[Any]] = set()
        self._serving = False
        sock.setblocking(False)
        self._start()

    def _start(self) -> None:
        self._serving = True
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(self._batch):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._accept_failed(exc)
                return
            self._connect(conn)

    def _connect(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = self._loop.create_task(self._made(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _made(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except Exception:  # one connection lost; the listener goes on
            log.exception("event=accept_failed: connection closed")
            conn.close()

    def _accept_failed(self, exc: OSError) -> None:
        if exc.errno not in _PAUSING:
            log.warning("event=accept_error errno=%s: %s", exc.errno, exc)
            return
        log.error("event=accept_paused errno=%s: %s; retrying in %gs", exc.errno, exc, _RETRY_S)
        self._loop.remove_reader(self._sock.fileno())
        self._loop.call_later(_RETRY_S, self._resume)

    def _resume(self) -> None:
        if self._serving:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    # -- asyncio.AbstractServer ---------------------------------------------------------------

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return (self._sock,)

    def close(self) -> None:
        if self._serving:
            self._serving = False
            self._loop.remove_reader(self._sock.fileno())
            if self._owned:
                self._sock.close()

    async def wait_closed(self) -> None:
        """Connections are the protocol's (uvicorn drains them); nothing else to wait for."""

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        """Serving starts with the server."""

    async def serve_forever(self) -> None:
        raise NotImplementedError("the router's servers are driven by uvicorn")


class BatchAcceptLoop(uvloop.Loop):  # type: ignore[misc]
    """uvloop, with :class:`BatchAcceptServer` for plain TCP servers."""

    async def create_server(
        self,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        host: str | Iterable[str] | None = None,
        port: int | None = None,
        *,
        sock: socket.socket | None = None,
        backlog: int = 100,
        ssl: Any = None,
        **kwargs: Any,
    ) -> asyncio.AbstractServer:
        plain = ssl is None and not kwargs
        if plain and sock is None and isinstance(host, str) and port is not None:
            return BatchAcceptServer(self, bind(host, port, backlog), protocol_factory, owned=True)
        if not plain or sock is None or sock.type != socket.SOCK_STREAM:
            return await super().create_server(  # type: ignore[no-any-return]
                protocol_factory, host, port, sock=sock, backlog=backlog, ssl=ssl, **kwargs
            )
        return BatchAcceptServer(self, sock, protocol_factory)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The router's loop (uvicorn's ``loop`` option names this function)."""
    return BatchAcceptLoop()
