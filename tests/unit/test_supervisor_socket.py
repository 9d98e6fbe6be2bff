"""The workers' shared listening socket."""

from __future__ import annotations

import asyncio
import socket

from router.supervisor import _bind


async def test_accepted_connections_get_tcp_nodelay() -> None:
    """asyncio sets TCP_NODELAY on an accepted connection only when the listening socket says
    TCP; without it a response written in two parts waits for Nagle's algorithm (~40 ms)."""
    sock = _bind("127.0.0.1", 0, 8)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_client(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_client, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 10) != 0
        writer.close()
