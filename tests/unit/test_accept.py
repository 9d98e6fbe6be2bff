"""The router's loop accepts pending connections in batches, where uvloop takes one a turn."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import uvloop

from router.accept import ACCEPT_BATCH, BatchAcceptServer, bind, new_event_loop

PENDING = 300


class _Counted(asyncio.Protocol):
    def __init__(self, made: list[asyncio.BaseTransport]) -> None:
        self._made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._made.append(transport)


@contextmanager
def _clients(port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` connections completed by the kernel (blocking connect: the handshake is done
    and the connection waits in the listener's backlog) before the loop runs a turn."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def _accepted_after(loop: asyncio.AbstractEventLoop, turns: int, via_host: bool) -> int:
    made: list[asyncio.BaseTransport] = []

    async def main() -> int:
        factory: Callable[[], asyncio.Protocol] = lambda: _Counted(made)  # noqa: E731
        given = None if via_host else bind("127.0.0.1", 0, 1024)
        if given is None:
            server = await loop.create_server(factory, "127.0.0.1", 0, backlog=1024)
        else:
            server = await loop.create_server(factory, sock=given)
        port = server.sockets[0].getsockname()[1]
        with _clients(port, PENDING):
            for _ in range(turns):
                await asyncio.sleep(0)
            n = len(made)
            server.close()
            for t in made:
                t.close()
            await asyncio.sleep(0)
        if given is not None:
            given.close()
        return n

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("via_host", [False, True], ids=["given-socket", "host-port"])
def test_every_pending_connection_is_accepted_within_a_few_turns(via_host: bool) -> None:
    turns = PENDING // ACCEPT_BATCH + 4  # a batch per turn, and turns to make the protocols
    assert _accepted_after(new_event_loop(), turns, via_host) == PENDING


def test_uvloops_own_server_takes_one_a_turn() -> None:
    """Why the router's loop exists: the same backlog on uvloop's server (the check above
    would fail on it)."""
    turns = PENDING // ACCEPT_BATCH + 4
    assert _accepted_after(uvloop.new_event_loop(), turns, via_host=True) <= turns


def test_closing_stops_accepting_and_closes_only_a_socket_it_bound() -> None:
    loop = new_event_loop()

    async def main() -> None:
        given = bind("127.0.0.1", 0, 16)
        server = await loop.create_server(asyncio.Protocol, sock=given)
        assert isinstance(server, BatchAcceptServer) and server.is_serving()
        server.close()
        assert not server.is_serving() and given.fileno() != -1  # uvicorn's to close
        given.close()
        own = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        sock = own.sockets[0]
        own.close()
        await own.wait_closed()
        assert sock.fileno() == -1

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
